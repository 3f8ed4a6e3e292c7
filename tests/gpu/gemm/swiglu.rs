use super::*;
use crate::gemm::grouped::{offsets_of, random_offsets, random_weights};
use nvfp4_moe::gemm::{ExpertShape, GemmTile, GroupedGemm, Interleaved, Nvfp4Weights, SwigluBf16};
use nvfp4_moe::quantize::GroupedDesc;
use nvfp4_moe::{host::ExpertWeightsHost, reference::swiglu_element};

/// `quantize_nvfp4_grouped` of a compact SwiGLU output and `swiglu_quantize` of an interleaved
/// one (poisoned outputs first), on the host: `[(codes, scales) compact, (codes, scales)
/// interleaved]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn quantize_compact_and_interleaved(
    s: &Arc<CudaStream>,
    compact: &CudaSlice<bf16>,
    interleaved: &CudaSlice<bf16>,
    rows: usize,
    inter: usize,
    experts: usize,
    offsets: &CudaSlice<i32>,
    act_scales: &CudaSlice<f32>,
) -> [(Vec<u8>, Vec<u8>); 2] {
    use nvfp4_moe::layout::grouped_scale_len;
    use nvfp4_moe::quantize::{quantize_nvfp4_grouped_into, GroupedSource};
    let sl = grouped_scale_len(rows, experts, inter);
    [(GroupedSource::Contiguous, compact), (GroupedSource::InterleavedSwiglu, interleaved)].map(|(source, x)| {
        let (mut c, mut sc) = (poisoned_u8(s, rows * inter / 2), poisoned_u8(s, sl));
        quantize_nvfp4_grouped_into(
            s,
            source,
            x,
            &GroupedDesc { rows, cols: inter, expert_offsets: offsets, decode_scales: act_scales },
            &mut c,
            &mut sc,
        )
        .unwrap();
        (s.clone_dtoh(&c).unwrap(), s.clone_dtoh(&sc).unwrap())
    })
}

/// Random gate/up weights `[e, n, k]` with gate decode scales in [1e-3, 2e-3) and up's 10x
/// larger, prepared for the SwiGLU epilogues: (host weights, gate scales, up scales, prepared).
pub fn gate_up_weights(
    s: &Arc<CudaStream>,
    rng: &mut Rng,
    e: usize,
    n: usize,
    k: usize,
) -> (ExpertWeightsHost, Vec<f32>, Vec<f32>, Nvfp4Weights) {
    let w = random_weights(rng, e, n, k);
    let gate_g: Vec<f32> = (0..e).map(|_| rng.uniform(1e-3, 2e-3)).collect();
    let up_g: Vec<f32> = gate_g.iter().map(|g| g * 10.0).collect();
    let (codes, scales) = (s.clone_htod(&w.codes).unwrap(), s.clone_htod(&w.scales).unwrap());
    let wd = Nvfp4Weights::prepare_gate_up(s, &codes, &scales, &gate_g, &up_g, ExpertShape::new(e, n, k)).unwrap();
    (w, gate_g, up_g, wd)
}

/// For each I, random fused weights (gate and up decode scales 10x apart), uneven rows with
/// empty experts: SwigluBf16 within 1e-2 of the f64 reference per expert; Interleaved's swiglu
/// columns bit-identical to SwigluBf16 and its gate columns within 1e-2 of the reference;
/// every expert row written, rows past offsets[E] untouched.
#[test]
#[ignore = "needs a CUDA GPU"]
fn swiglu_epilogues_match_reference_and_each_other() {
    let s = stream();
    let mut rng = test_rng();
    // One unit per shape; NVFP4MOE_TEST_PART runs a share of them (TestPart).
    let part = TestPart::from_env();
    let rp = replay_with(&part.env());
    let (mut warp_cases, mut shapes) = (0, 0);
    // The five shapes after (768, 256, 3, 513) have so few tiles that the N16 tile splits K (2, 3
    // or 4 CTAs per tile, one with an uneven split: 9 K stages over 2 CTAs; (2048, 1024, 2, 1): 64
    // tiles in clusters of 3 on the H200, 8 stages over 3 CTAs).
    let cases = [
        (768usize, 2048usize, 16usize, 150usize),
        (1536, 256, 8, 150),
        (2048, 512, 32, 150),
        (2880, 2880, 4, 150),
        (14336, 256, 2, 150),
        (768, 256, 3, 513),
        (512, 2048, 4, 3),
        (768, 768, 8, 2),
        (2880, 2880, 2, 5),
        (256, 576, 3, 4),
        (2048, 1024, 2, 1),
        // At most 8 rows in all (the warp kernel too): I = 96 (n % 128 == 64), K at its minimum.
        (96, 64, 5, 1),
        (1536, 4096, 4, 1),
        (2880, 2880, 3, 2),
    ];
    // Each shape draws from a generator of its own, seeded from the test's in shape order, so that
    // a part sees the inputs the whole test gives its shapes.
    let seeds: Vec<u64> = cases.iter().map(|_| rng.next_u64()).collect();
    for (unit, (inter, k, e, max_rows)) in cases.into_iter().enumerate() {
        if !part.has(unit) {
            continue;
        }
        shapes += 1;
        let mut rng = Rng::new(seeds[unit]);
        let n = 2 * inter;
        let (w, gate_g, up_g, wd) = gate_up_weights(&s, &mut rng, e, n, k);
        let mut off = random_offsets(&mut rng, e, max_rows);
        if max_rows > 256 {
            // The last expert past one 256-row tile, its last tile partial (whichever tile runs).
            let last = off.len() - 1;
            off[last] = off[last - 1] + max_rows as i32;
        }
        let rows = *off.last().unwrap() as usize;
        let total = rows + 2;
        let x = rng.normal_bf16(total * k, 1.0);
        let xd = s.clone_htod(&x).unwrap();
        let off_dev = s.clone_htod(&off).unwrap();
        // The warp kernel where the launch has at most 8 rows (the last three shapes always).
        assert!(unit + 3 < cases.len() || total <= 8, "shape {unit} has {total} rows: the warp kernel is not run");
        let warp = (total <= 8).then_some(GemmTile::WarpM16N8);
        warp_cases += usize::from(total <= 8);
        for tile in WGMMA_TILES.into_iter().chain(warp) {
            let ctx = format!("I={inter} k={k} E={e} rows={rows} {tile:?}: {rp}");
            let mut compact = poisoned_bf16(&s, total * inter);
            let mut inter_out = poisoned_bf16(&s, total * n);
            GroupedGemm::<SwigluBf16>::new(&wd, tile).unwrap().launch(&s, &xd, total, &off_dev, &mut compact).unwrap();
            GroupedGemm::<Interleaved>::new(&wd, tile)
                .unwrap()
                .launch(&s, &xd, total, &off_dev, &mut inter_out)
                .unwrap();
            let compact = s.clone_dtoh(&compact).unwrap();
            let inter_out = s.clone_dtoh(&inter_out).unwrap();
            for (i, v) in compact.iter().enumerate() {
                assert_eq!(v.to_bits() != POISON_BF16, i / inter < rows, "compact element {i}: {ctx}");
            }
            for r in 0..total {
                for b in 0..inter / 8 {
                    for i in 0..8 {
                        let (gate_col, sw_col) = (r * n + 16 * b + i, r * n + 16 * b + 8 + i);
                        if r >= rows {
                            assert_eq!(inter_out[gate_col].to_bits(), POISON_BF16, "{ctx}");
                            assert_eq!(inter_out[sw_col].to_bits(), POISON_BF16, "{ctx}");
                            continue;
                        }
                        // The swiglu columns of Interleaved are SwigluBf16, bit for bit.
                        assert_eq!(
                            inter_out[sw_col].to_bits(),
                            compact[r * inter + 8 * b + i].to_bits(),
                            "row {r} feature {}: {ctx}",
                            8 * b + i
                        );
                    }
                }
            }
            let names = ["swiglu", "interleaved gate"];
            let [case_sw, case_gate] =
                sampled_expert_errors(&mut rng, &off, inter, 200, 1e-2, names, &ctx, |ex, row, f| {
                    let (gate, want) = swiglu_element(&x, &w, ex, row, f, gate_g[ex], up_g[ex]);
                    [
                        (f64::from(compact[row * inter + f].to_f32()), want),
                        (f64::from(inter_out[row * n + 16 * (f / 8) + f % 8].to_f32()), gate),
                    ]
                });
            case_sw.report(&format!("swiglu {ctx}"));
            case_gate.report(&format!("interleaved gate {ctx}"));
        }
    }
    assert!(shapes > 0, "no shape in {part:?}");
    if part.is_whole() {
        assert!(warp_cases >= 3, "{warp_cases} launches of at most 8 rows (the warp kernel)");
    }
}

/// The grouped quantizer against the CPU oracle, every byte (codes, scales, padding), with
/// per-expert and shared decode scales, empty experts and rows past offsets[E].
#[test]
#[ignore = "needs a CUDA GPU"]
fn grouped_quantize_matches_reference() {
    use nvfp4_moe::layout::grouped_scale_len;
    use nvfp4_moe::quantize::{quantize_nvfp4_grouped_into, GroupedSource};
    let s = stream();
    let mut rng = test_rng();
    let rp = replay();
    for &(e, cols) in &[(1usize, 16usize), (4, 768), (16, 2048), (128, 1536), (8, 2880)] {
        let off = random_offsets(&mut rng, e, 200);
        let rows = *off.last().unwrap() as usize;
        let total = rows + 5;
        let x = rng.varied_bf16(total * cols);
        for shared in [false, true] {
            let g: Vec<f32> = (0..if shared { 1 } else { e }).map(|_| rng.uniform(1e-3, 1.0)).collect();
            let (want_codes, want_scales) = reference::quantize_grouped(&x[..rows * cols], &off, cols, &g).unwrap();
            let xd = s.clone_htod(&x).unwrap();
            let offd = s.clone_htod(&off).unwrap();
            let gd = s.clone_htod(&g).unwrap();
            let mut codes = poisoned_u8(&s, total * cols / 2);
            let mut scales = poisoned_u8(&s, grouped_scale_len(total, e, cols));
            quantize_nvfp4_grouped_into(
                &s,
                GroupedSource::Contiguous,
                &xd,
                &GroupedDesc { rows: total, cols, expert_offsets: &offd, decode_scales: &gd },
                &mut codes,
                &mut scales,
            )
            .unwrap();
            let (codes, scales) = (s.clone_dtoh(&codes).unwrap(), s.clone_dtoh(&scales).unwrap());
            let ctx = format!("E={e} cols={cols} rows={rows} shared={shared}: {rp}");
            assert!(codes[..rows * cols / 2] == want_codes[..], "codes {:?}: {ctx}", first_diff(&codes, &want_codes));
            assert!(codes[rows * cols / 2..].iter().all(|&b| b == POISON), "rows past offsets[E] written: {ctx}");
            assert!(
                scales[..want_scales.len()] == want_scales[..],
                "scales {:?}: {ctx}",
                first_diff(&scales, &want_scales)
            );
            assert!(scales[want_scales.len()..].iter().all(|&b| b == 0), "padding: {ctx}");
            report_exact(&format!("grouped quantize {ctx}"), codes.len() + scales.len());
        }
    }
}

/// The old flow's swiglu_quantize(Interleaved) equals quantize_grouped(SwigluBf16) in the same
/// per-expert layout, every byte; and the separate SwiGLU kernel is close to the reference.
#[test]
#[ignore = "needs a CUDA GPU"]
fn swiglu_quantize_equals_quantize_of_compact() {
    use nvfp4_moe::gemm::PlainBf16;
    use nvfp4_moe::quantize::swiglu_bf16_into;
    let s = stream();
    let mut rng = test_rng();
    let rp = replay();
    let (inter, k, e) = (1536usize, 512usize, 16usize);
    let n = 2 * inter;
    let (w, gate_g, up_g, wd) = gate_up_weights(&s, &mut rng, e, n, k);
    let off = random_offsets(&mut rng, e, 100);
    let rows = *off.last().unwrap() as usize;
    let x = rng.normal_bf16(rows * k, 1.0);
    let (xd, offd) = (s.clone_htod(&x).unwrap(), s.clone_htod(&off).unwrap());
    let act_g: Vec<f32> = (0..e).map(|_| rng.uniform(1e-3, 1e-1)).collect();
    let gd = s.clone_htod(&act_g).unwrap();
    let mut compact = s.alloc_zeros::<bf16>(rows * inter).unwrap();
    let mut interleaved = s.alloc_zeros::<bf16>(rows * n).unwrap();
    let mut plain = s.alloc_zeros::<bf16>(rows * n).unwrap();
    GroupedGemm::<SwigluBf16>::new(&wd, GemmTile::Auto).unwrap().launch(&s, &xd, rows, &offd, &mut compact).unwrap();
    GroupedGemm::<Interleaved>::new(&wd, GemmTile::Auto)
        .unwrap()
        .launch(&s, &xd, rows, &offd, &mut interleaved)
        .unwrap();
    GroupedGemm::<PlainBf16>::new(&wd, GemmTile::Auto).unwrap().launch(&s, &xd, rows, &offd, &mut plain).unwrap();
    let [(c1, s1), (c2, s2)] = quantize_compact_and_interleaved(&s, &compact, &interleaved, rows, inter, e, &offd, &gd);
    for (name, h1, h2) in [("codes", &c1, &c2), ("scales", &s1, &s2)] {
        assert!(h1 == h2, "{name} differ at {:?}: {rp}", first_diff(h1, h2));
    }
    // The separate kernel (from BF16-rounded gate/up) against the f64 reference.
    let mut sep = s.alloc_zeros::<bf16>(rows * inter).unwrap();
    swiglu_bf16_into(&s, &plain, rows, inter, &mut sep).unwrap();
    let sep = s.clone_dtoh(&sep).unwrap();
    let mut err = RelErr::default();
    for _ in 0..2000 {
        let row = rng.range(0, rows.max(1));
        if rows == 0 {
            break;
        }
        let ex = off.partition_point(|&o| o as usize <= row) - 1;
        let f = rng.range(0, inter);
        let (_, want) = swiglu_element(&x, &w, ex, row, f, gate_g[ex], up_g[ex]);
        err.add(f64::from(sep[row * inter + f].to_f32()), want);
    }
    let rel = err.rel();
    assert!(rel <= 1e-2, "separate swiglu relative error {rel:.3e}: {rp}");
    err.report("separate swiglu kernel");
}

/// NVFP4 packed in the epilogue: `SwigluNvfp4` equals `quantize_nvfp4_grouped(SwigluBf16)` and
/// `swiglu_quantize(Interleaved)` in every byte (codes, scales, padding), for I in {768, 1536,
/// 2048, 2880, 14336} and 96 (n % 128 == 64: a half-empty last feature tile), every tile, rows
/// per expert 0, 1 and not a multiple of the tile, gate and
/// up decode scales 10x apart, one or per-expert activation scales, and all-zero blocks (an
/// expert whose rows of x are zero).
#[test]
#[ignore = "needs a CUDA GPU"]
fn swiglu_nvfp4_equals_quantized_compact() {
    use nvfp4_moe::gemm::{SwigluNvfp4, SwigluNvfp4Out};
    use nvfp4_moe::layout::grouped_scale_len;
    let s = stream();
    let mut rng = test_rng();
    // One unit per shape; NVFP4MOE_TEST_PART runs a share of them (TestPart).
    let part = TestPart::from_env();
    let rp = replay_with(&part.env());
    let mut shapes = 0;
    let cases = [
        (768usize, 256usize, 8usize, 70usize),
        (1536, 128, 4, 300),
        (2048, 512, 16, 40),
        (2880, 192, 3, 150),
        (14336, 64, 2, 20),
        (96, 64, 5, 33),
        (512, 2048, 4, 3), // split-K: few tiles
        (768, 768, 8, 2),
        (2048, 1024, 2, 1), // split-K over clusters of 3 on the H200 (64 tiles)
    ];
    // Each shape draws from a generator of its own, seeded from the test's in shape order, so that
    // a part sees the inputs the whole test gives its shapes.
    let seeds: Vec<u64> = cases.iter().map(|_| rng.next_u64()).collect();
    for (ci, &(inter, k, e, max_rows)) in cases.iter().enumerate() {
        if !part.has(ci) {
            continue;
        }
        shapes += 1;
        let mut rng = Rng::new(seeds[ci]);
        let n = 2 * inter;
        let (_, _, _, wd) = gate_up_weights(&s, &mut rng, e, n, k);
        let mut off = random_offsets(&mut rng, e, max_rows);
        if max_rows > 256 {
            // The last expert past one 256-row tile, its last tile partial (whichever tile runs).
            let last = off.len() - 1;
            off[last] = off[last - 1] + max_rows as i32;
        }
        if off[1] == 0 {
            // Expert 0 must have rows: they are the all-zero blocks below.
            off.iter_mut().skip(1).for_each(|o| *o += 1);
        }
        let rows = *off.last().unwrap() as usize + 3; // 3 rows past off[E]: never written
        let mut x = rng.normal_bf16(rows * k, 1.0);
        // Expert 0's rows are zero: all-zero SwiGLU blocks.
        for v in &mut x[..off[1] as usize * k] {
            *v = bf16::ZERO;
        }
        let (xd, offd) = (s.clone_htod(&x).unwrap(), s.clone_htod(&off).unwrap());
        let act_g: Vec<f32> =
            if ci % 2 == 0 { (0..e).map(|_| rng.uniform(1e-3, 1e-1)).collect() } else { vec![rng.uniform(1e-3, 1e-1)] };
        let gd = s.clone_htod(&act_g).unwrap();
        let sl = grouped_scale_len(rows, e, inter);
        for tile in WGMMA_TILES {
            let mut compact = s.alloc_zeros::<bf16>(rows * inter).unwrap();
            let mut interleaved = s.alloc_zeros::<bf16>(rows * n).unwrap();
            GroupedGemm::<SwigluBf16>::new(&wd, tile).unwrap().launch(&s, &xd, rows, &offd, &mut compact).unwrap();
            GroupedGemm::<Interleaved>::new(&wd, tile).unwrap().launch(&s, &xd, rows, &offd, &mut interleaved).unwrap();
            let [(c1, s1), (c2, s2)] =
                quantize_compact_and_interleaved(&s, &compact, &interleaved, rows, inter, e, &offd, &gd);
            let (mut c3, mut s3) = (poisoned_u8(&s, rows * inter / 2), poisoned_u8(&s, sl));
            // Which launch a sanitizer's fault follows (the tool's report names no case).
            eprintln!("SwigluNvfp4 I={inter} k={k} E={e} rows={rows} {tile:?}");
            GroupedGemm::<SwigluNvfp4>::new(&wd, tile)
                .unwrap()
                .launch_nvfp4(
                    &s,
                    &xd,
                    rows,
                    &offd,
                    SwigluNvfp4Out { act_decode_scales: &gd, codes: &mut c3, scales: &mut s3 },
                )
                .unwrap();
            let (h1, h2, h3) = (c1, c2, s.clone_dtoh(&c3).unwrap());
            assert!(h3 == h1, "I={inter} {tile:?}: codes differ at {:?}: {rp}", first_diff(&h3, &h1));
            assert!(h3 == h2, "I={inter} {tile:?}: codes vs swiglu_quantize at {:?}: {rp}", first_diff(&h3, &h2));
            let (h1, h2, h3) = (s1, s2, s.clone_dtoh(&s3).unwrap());
            assert!(h3 == h1, "I={inter} {tile:?}: scales differ at {:?}: {rp}", first_diff(&h3, &h1));
            assert!(h3 == h2, "I={inter} {tile:?}: scales vs swiglu_quantize at {:?}: {rp}", first_diff(&h3, &h2));
            // The codes of the zero expert are zero (and were written: the buffer was poisoned).
            let zc = s.clone_dtoh(&c3).unwrap();
            assert!(zc[..off[1] as usize * inter / 2].iter().all(|&b| b == 0), "zero expert: {rp}");
        }
    }
    assert!(shapes > 0, "no shape in {part:?}");
    if !part.has(0) {
        return; // the argument checks below run in one part
    }
    // Bad input: wrong scale-buffer length and wrong activation-scale count are typed errors.
    let w = random_weights(&mut rng, 2, 128, 64);
    let g = [1e-3f32, 1e-3];
    let (codes, scales) = (s.clone_htod(&w.codes).unwrap(), s.clone_htod(&w.scales).unwrap());
    let wd = Nvfp4Weights::prepare_gate_up(&s, &codes, &scales, &g, &g, ExpertShape::new(2, 128, 64)).unwrap();
    let plan = GroupedGemm::<SwigluNvfp4>::new(&wd, GemmTile::Auto).unwrap();
    let (xd, offd) = (s.clone_htod(&rng.normal_bf16(8 * 64, 1.0)).unwrap(), s.clone_htod(&[0i32, 3, 8]).unwrap());
    let mut c = s.alloc_zeros::<u8>(8 * 32).unwrap();
    let mut sc = s.alloc_zeros::<u8>(grouped_scale_len(8, 2, 64) - 1).unwrap();
    let gd = s.clone_htod(&[0.01f32; 2]).unwrap();
    assert!(
        plan.launch_nvfp4(&s, &xd, 8, &offd, SwigluNvfp4Out { act_decode_scales: &gd, codes: &mut c, scales: &mut sc })
            .is_err(),
        "short scale buffer: {rp}"
    );
    let mut sc = s.alloc_zeros::<u8>(grouped_scale_len(8, 2, 64)).unwrap();
    assert!(plan
        .launch_nvfp4(&s, &xd, 8, &offd, SwigluNvfp4Out { act_decode_scales: &gd, codes: &mut c, scales: &mut sc })
        .is_ok());
    let gd = s.clone_htod(&[0.01f32; 3]).unwrap();
    assert!(
        plan.launch_nvfp4(&s, &xd, 8, &offd, SwigluNvfp4Out { act_decode_scales: &gd, codes: &mut c, scales: &mut sc })
            .is_err(),
        "3 scales for 2 experts: {rp}"
    );
    // No rows: the scale buffer is still zeroed (its padding), as the grouped quantizer does.
    let gd = s.clone_htod(&[0.01f32; 2]).unwrap();
    let off0 = s.clone_htod(&[0i32, 0, 0]).unwrap();
    let mut sc0 = poisoned_u8(&s, grouped_scale_len(0, 2, 64));
    plan.launch_nvfp4(&s, &xd, 0, &off0, SwigluNvfp4Out { act_decode_scales: &gd, codes: &mut c, scales: &mut sc0 })
        .unwrap();
    assert!(s.clone_dtoh(&sc0).unwrap().iter().all(|&b| b == 0), "scales not zeroed with no rows: {rp}");
}

/// The 128x256 tile's tail split (an expert's rows past its last whole 256-row tile, when at most
/// 32, run on the 128x32 tile, when 33-64 on the 128x64 tile, when 65-128 on the 128x128 tile, in
/// launches of their own; one tail tile for the first two under `NVFP4MOE_TAIL_TILES=32` or `64`):
/// the `PlainBf16`, `SwigluBf16` and `SwigluNvfp4` outputs under `M128N256`, and under `Auto`, which
/// picks that tile here, equal the 128x128 tile's bit for bit (every tile gives the same bits; the
/// batch-invariance test), with tails of 0, 1, 32, 33, 63, 64, 65, 72, 96 and 128 rows, head tiles
/// of 129-200 rows (issued 192 and 256 wide), experts of only a tail, an empty expert, and
/// the rows past offsets[E] untouched: a tail left unwritten or
/// written over a neighbour's rows fails it. (It tests the split that the environment selects: run
/// it also under `NVFP4MOE_TAIL_TILES=32`, `=64` and `=32,64`, the last of which leaves the tails
/// of 65-128 rows with the head, as scripts/gpu-run.sh does.)
#[test]
#[ignore = "needs a CUDA GPU"]
fn tail_split_gives_the_unsplit_bits() {
    use nvfp4_moe::gemm::{PlainBf16, SwigluNvfp4, SwigluNvfp4Out};
    use nvfp4_moe::layout::grouped_scale_len;
    let s = stream();
    let mut rng = test_rng();
    let rp = replay();
    let (inter, k) = (320usize, 192usize); // n = 640: five 128-feature tiles; three K stages
    let n = 2 * inter;
    // Tails: 1 (257), 32 (288), 33 (289), 63 (319), 64 (320), 65 (321), 72 (328), 96 (352), 128
    // (384), 200 (456: stays with the head, issued 256 wide), 144, 160 and 192 (400, 416, 448: with
    // the head, issued 192 wide), 0 (512, 256); only a tail (5, 64, 100); only a head tile of 129
    // rows (issued 192 wide); none (0). Tails of 65-128 rows stay with the head under
    // NVFP4MOE_TAIL_TILES=32,64, 32 or 64.
    let counts = [257usize, 0, 288, 289, 319, 320, 321, 5, 512, 64, 456, 256, 352, 384, 100, 400, 448, 129, 328, 416];
    let e = counts.len();
    let off = offsets_of(&counts);
    let rows = off[e] as usize;
    let total = rows + 3; // 3 rows past offsets[E]: never written
    assert!(total > 128 * e, "Auto must pick the 128x256 tile: {total} rows, {e} experts");
    let (_, _, _, wd) = gate_up_weights(&s, &mut rng, e, n, k);
    let x = rng.normal_bf16(total * k, 1.0);
    let (xd, offd) = (s.clone_htod(&x).unwrap(), s.clone_htod(&off).unwrap());
    let act_g: Vec<f32> = (0..e).map(|_| rng.uniform(1e-3, 1e-1)).collect();
    let gd = s.clone_htod(&act_g).unwrap();
    let sl = grouped_scale_len(total, e, inter);
    let tiles = [GemmTile::M128N128, GemmTile::M128N256, GemmTile::Auto];
    // (tile, plain, compact, codes, scales)
    let mut outs = Vec::new();
    for tile in tiles {
        let mut plain = poisoned_bf16(&s, total * n);
        let mut compact = poisoned_bf16(&s, total * inter);
        GroupedGemm::<PlainBf16>::new(&wd, tile).unwrap().launch(&s, &xd, total, &offd, &mut plain).unwrap();
        GroupedGemm::<SwigluBf16>::new(&wd, tile).unwrap().launch(&s, &xd, total, &offd, &mut compact).unwrap();
        let (mut codes, mut scales) = (poisoned_u8(&s, total * inter / 2), poisoned_u8(&s, sl));
        eprintln!("tail split: SwigluNvfp4 {tile:?}");
        GroupedGemm::<SwigluNvfp4>::new(&wd, tile)
            .unwrap()
            .launch_nvfp4(
                &s,
                &xd,
                total,
                &offd,
                SwigluNvfp4Out { act_decode_scales: &gd, codes: &mut codes, scales: &mut scales },
            )
            .unwrap();
        let plain = s.clone_dtoh(&plain).unwrap();
        let compact = s.clone_dtoh(&compact).unwrap();
        for (name, v, cols) in [("plain", &plain, n), ("compact", &compact, inter)] {
            for (i, b) in v.iter().enumerate() {
                assert_eq!(
                    b.to_bits() != POISON_BF16,
                    i / cols < rows,
                    "{name} element {i} (row {}), {tile:?}: {rp}",
                    i / cols
                );
            }
        }
        let codes = s.clone_dtoh(&codes).unwrap();
        assert!(
            codes[rows * inter / 2..].iter().all(|&b| b == POISON),
            "codes past offsets[E] written, {tile:?}: {rp}"
        );
        outs.push((tile, plain, compact, codes, s.clone_dtoh(&scales).unwrap()));
    }
    let (_, p0, c0, q0, s0) = &outs[0];
    for (tile, p, c, q, sc) in &outs[1..] {
        let bits = |v: &[bf16]| v.iter().map(|b| b.to_bits()).collect::<Vec<u16>>();
        let row_of = |i: usize, cols: usize| i / cols;
        let diff = bits(p).iter().zip(bits(p0)).position(|(a, b)| *a != b);
        assert!(diff.is_none(), "plain {tile:?} differs from 128x128 at row {:?}: {rp}", diff.map(|i| row_of(i, n)));
        let diff = bits(c).iter().zip(bits(c0)).position(|(a, b)| *a != b);
        assert!(diff.is_none(), "compact {tile:?} differs at row {:?}: {rp}", diff.map(|i| row_of(i, inter)));
        assert!(q == q0, "codes {tile:?} differ at {:?}: {rp}", first_diff(q, q0));
        assert!(sc == s0, "scales {tile:?} differ at {:?}: {rp}", first_diff(sc, s0));
    }
    eprintln!("tail split: {} rows over {e} experts, three epilogues, bit-identical to the 128x128 tile", rows);
}

/// The tail split and the launch after it: a second GEMM on the first one's output, launched right
/// after it on the same stream, gives the 128x128 chain's bits, three rounds. The tail launches
/// start beside the head and wait for it only before they exit (scripts/gpu-run.sh also runs it
/// under `NVFP4MOE_TAIL_OVERLAP=0`, where they follow it): a tail that let its successor start
/// before the head finished would feed the second GEMM poisoned rows.
#[test]
#[ignore = "needs a CUDA GPU"]
fn tail_split_then_a_launch_sees_every_row() {
    use nvfp4_moe::gemm::PlainBf16;
    let s = stream();
    let mut rng = test_rng();
    let rp = replay();
    let (n1, k1, n2) = (1024usize, 4096usize, 256usize);
    // Tails of 44, 8, 1, 128, 34, 74 rows; 188 and 194 stay with the head; only a tail (40, 100, 64);
    // none (768).
    let counts = [300usize, 520, 257, 40, 384, 700, 290, 100, 768, 330, 64, 450];
    let e = counts.len();
    let off = offsets_of(&counts);
    let rows = off[e] as usize;
    let w1 = Nvfp4Weights::from_host(&s, &random_weights(&mut rng, e, n1, k1)).unwrap();
    let w2 = Nvfp4Weights::from_host(&s, &random_weights(&mut rng, e, n2, n1)).unwrap();
    let x = rng.normal_bf16(rows * k1, 1.0);
    let (xd, offd) = (s.clone_htod(&x).unwrap(), s.clone_htod(&off).unwrap());
    let chain = |tile: GemmTile| {
        let mut mid = poisoned_bf16(&s, rows * n1);
        let mut out = poisoned_bf16(&s, rows * n2);
        let (g1, g2) =
            (GroupedGemm::<PlainBf16>::new(&w1, tile).unwrap(), GroupedGemm::<PlainBf16>::new(&w2, tile).unwrap());
        g1.launch(&s, &xd, rows, &offd, &mut mid).unwrap();
        g2.launch(&s, &mid, rows, &offd, &mut out).unwrap();
        s.clone_dtoh(&out).unwrap().iter().map(|b| b.to_bits()).collect::<Vec<u16>>()
    };
    let want = chain(GemmTile::M128N128);
    assert!(want.iter().all(|&b| b != POISON_BF16), "the 128x128 chain left poison: {rp}");
    for round in 0..3 {
        let got = chain(GemmTile::M128N256);
        let diff = got.iter().zip(&want).position(|(a, b)| a != b);
        assert!(diff.is_none(), "round {round}: the 128x256 chain differs at row {:?}: {rp}", diff.map(|i| i / n2));
    }
    eprintln!("tail split then a launch: {rows} rows over {e} experts, three rounds, the 128x128 chain's bits");
}

/// The grouped dequantizer against the CPU decode of every element (per-expert and shared
/// decode scales; rows past `expert_offsets[E]` stay untouched).
#[test]
#[ignore = "needs a CUDA GPU"]
fn grouped_dequantize_matches_reference() {
    use nvfp4_moe::layout::{grouped_scale_len, grouped_swizzled_offset};
    use nvfp4_moe::quantize::{dequantize_nvfp4_grouped_into, quantize_nvfp4_grouped_into, GroupedSource};
    use nvfp4_moe::reference::dequantize_element;
    let s = stream();
    let mut rng = test_rng();
    let rp = replay();
    for &(cols, e, max_rows, shared) in &[(64usize, 3usize, 40usize, true), (2880, 5, 70, false), (768, 16, 9, false)] {
        let off = random_offsets(&mut rng, e, max_rows);
        let total = *off.last().unwrap() as usize;
        let rows = total + 2;
        let x = rng.normal_bf16(rows * cols, 1.0);
        let g: Vec<f32> = (0..if shared { 1 } else { e }).map(|_| rng.uniform(1e-3, 1e-1)).collect();
        let (xd, offd, gd) = (s.clone_htod(&x).unwrap(), s.clone_htod(&off).unwrap(), s.clone_htod(&g).unwrap());
        let sl = grouped_scale_len(rows, e, cols);
        let (mut c, mut sc) = (poisoned_u8(&s, rows * cols / 2), poisoned_u8(&s, sl));
        let desc = GroupedDesc { rows, cols, expert_offsets: &offd, decode_scales: &gd };
        quantize_nvfp4_grouped_into(&s, GroupedSource::Contiguous, &xd, &desc, &mut c, &mut sc).unwrap();
        let mut out = poisoned_bf16(&s, rows * cols);
        dequantize_nvfp4_grouped_into(&s, &c, &sc, &desc, &mut out).unwrap();
        let (ch, sh, got) = (s.clone_dtoh(&c).unwrap(), s.clone_dtoh(&sc).unwrap(), s.clone_dtoh(&out).unwrap());
        for row in 0..rows {
            for col in 0..cols {
                let v = got[row * cols + col];
                if row >= total {
                    assert_eq!(v.to_bits(), POISON_BF16, "row {row} past the experts was written: {rp}");
                    continue;
                }
                let ex = off.partition_point(|&o| o as usize <= row) - 1;
                let byte = ch[row * cols / 2 + col / 2];
                let code = if col % 2 == 0 { byte & 0xF } else { byte >> 4 };
                let scale = sh[grouped_swizzled_offset(&off, row, col / 16, cols)];
                let want = dequantize_element(code, scale, g[if shared { 0 } else { ex }]);
                assert_eq!(v.to_bits(), want.to_bits(), "[{row}, {col}] cols={cols}: {rp}");
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn swiglu_needs_gate_up_weights() {
    let s = stream();
    let mut rng = test_rng();
    let rp = replay();
    let w = random_weights(&mut rng, 2, 128, 64);
    let wd = Nvfp4Weights::from_host(&s, &w).unwrap();
    assert!(GroupedGemm::<SwigluBf16>::new(&wd, GemmTile::Auto).is_err(), "SwigluBf16: {rp}");
    assert!(GroupedGemm::<Interleaved>::new(&wd, GemmTile::Auto).is_err(), "Interleaved: {rp}");
}
