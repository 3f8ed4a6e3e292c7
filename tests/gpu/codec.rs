//! The dense quantizer and dequantizer against the oracle (bit-exact), and both quantizers against
//! ModelOpt's own bytes.

use super::*;

/// Quantizes on the GPU into poisoned buffers and compares every byte (padding included) with
/// the CPU reference; then dequantizes on the GPU and compares every bf16 with the reference.
/// `replay` (how to replay the case) ends every failure's context.
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_case(
    s: &Arc<CudaStream>,
    rng: &mut Rng,
    rows: usize,
    cols: usize,
    kind: Data,
    layout: ScaleLayout,
    g_choice: Option<f32>,
    replay: &str,
) {
    let g0 = g_choice.unwrap_or(1.0);
    let x = make_data(rng, kind, rows, cols, g0);
    let g = match g_choice {
        Some(g) => g,
        None => host::weight_decode_scale(&x).unwrap_or(1.0),
    };
    let ctx = format!("rows={rows} cols={cols} {kind:?} {layout:?} g={g}: {replay}");
    let want = reference::quantize(&x, rows, cols, g, layout).unwrap();

    let x_dev = s.clone_htod(&x).unwrap();
    let mut codes = poisoned_u8(s, rows * cols / 2);
    let mut scales = poisoned_u8(s, scale_len(layout, rows, cols));
    quantize_nvfp4_into(s, &x_dev, Nvfp4Desc { rows, cols, layout, decode_scale: g }, &mut codes, &mut scales).unwrap();
    let got_codes = s.clone_dtoh(&codes).unwrap();
    let got_scales = s.clone_dtoh(&scales).unwrap();
    assert!(
        first_diff(&got_scales, &want.scales).is_none(),
        "scales differ at {:?}: {ctx}",
        first_diff(&got_scales, &want.scales)
    );
    assert!(
        first_diff(&got_codes, &want.codes).is_none(),
        "codes differ at {:?}: {ctx}",
        first_diff(&got_codes, &want.codes)
    );

    let want_deq = reference::dequantize(&want);
    let mut out = poisoned_bf16(s, rows * cols);
    dequantize_nvfp4_into(s, &codes, &scales, Nvfp4Desc { rows, cols, layout, decode_scale: g }, &mut out).unwrap();
    let got_deq = s.clone_dtoh(&out).unwrap();
    let bits = |v: &[bf16]| v.iter().map(|b| b.to_bits()).collect::<Vec<u16>>();
    let (gb, wb) = (bits(&got_deq), bits(&want_deq));
    if let Some(i) = gb.iter().zip(&wb).position(|(a, b)| a != b) {
        panic!("dequantize differs at {i}: gpu {:#06x} cpu {:#06x}: {ctx}", gb[i], wb[i]);
    }
    report_exact(&ctx, got_codes.len() + got_scales.len() + 2 * gb.len());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn quantize_matches_reference_on_many_shapes() {
    let s = stream();
    let mut rng = test_rng();
    // (rows, cols): 1 row, K = 16, K not a multiple of 64, K = 7168, rows not a multiple of 128,
    // thousands of rows.
    let shapes: [(usize, usize); 24] = [
        (1, 16),
        (1, 7168),
        (2, 16),
        (3, 48),
        (5, 80),
        (7, 2880),
        (17, 112),
        (31, 208),
        (64, 64),
        (127, 7168),
        (128, 128),
        (129, 2880),
        (200, 1040),
        (255, 336),
        (256, 2048),
        (300, 4096),
        (511, 16),
        (640, 1536),
        (1000, 768),
        (1024, 2880),
        (2048, 7168),
        (3000, 2048),
        (4099, 272),
        (8192, 256),
    ];
    let kinds = [Data::Normal, Data::Varied, Data::Tiny, Data::Huge, Data::NonFinite, Data::Ties];
    let mut n = 0;
    for (i, &(rows, cols)) in shapes.iter().enumerate() {
        for (j, &kind) in kinds.iter().enumerate() {
            let layout = if (i + j) % 2 == 0 { ScaleLayout::Linear } else { ScaleLayout::Swizzled128x4 };
            // Ties need a power-of-two g; others use the weight convention or a few fixed values.
            let g = match (kind, (i + j) % 3) {
                (Data::Ties, k) => Some([1.0f32, 0.0078125, 64.0][k]),
                (_, 0) => None,
                (_, 1) => Some(1.0),
                (_, _) => Some(0.37),
            };
            check_case(&s, &mut rng, rows, cols, kind, layout, g, &replay());
            n += 1;
        }
    }
    eprintln!("{n} quantize/dequantize cases bit-exact");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn quantize_edge_blocks() {
    let s = stream();
    let cols = 64;
    // Row 0: all zero. Row 1: -0.0 only. Row 2: scale rounds to zero. Row 3: NaN with Inf.
    // Row 4: Inf block. Row 5: a tiny subnormal-scale block. Row 6: max bf16.
    let mut x = vec![bf16::ZERO; 8 * cols];
    for v in &mut x[cols..2 * cols] {
        *v = bf16::from_f32(-0.0);
    }
    for (i, v) in x[2 * cols..3 * cols].iter_mut().enumerate() {
        *v = bf16::from_f32(1e-6 * (i as f32 + 1.0));
    }
    x[3 * cols] = bf16::NAN;
    x[3 * cols + 1] = bf16::INFINITY;
    x[4 * cols + 3] = bf16::INFINITY;
    x[4 * cols + 4] = bf16::NEG_INFINITY;
    x[4 * cols + 5] = bf16::from_f32(3.0);
    for (i, v) in x[5 * cols..6 * cols].iter_mut().enumerate() {
        *v = bf16::from_f32(0.004 * (i as f32 - 30.0));
    }
    for v in &mut x[6 * cols..7 * cols] {
        *v = bf16::MAX;
    }
    let mut rng = test_rng();
    let rp = replay();
    for v in &mut x[7 * cols..] {
        *v = bf16::from_f32(rng.normal());
    }
    for layout in [ScaleLayout::Linear, ScaleLayout::Swizzled128x4] {
        for g in [1.0f32, 1e-3, 1e-30, 3e30, 1e37] {
            let want = reference::quantize(&x, 8, cols, g, layout).unwrap();
            let xd = s.clone_htod(&x).unwrap();
            let t = quantize_nvfp4(&s, &xd, 8, cols, g, layout).unwrap();
            let got = t.to_host(&s).unwrap();
            assert_eq!(got.scales, want.scales, "{layout:?} g={g}: {rp}");
            assert_eq!(got.codes, want.codes, "{layout:?} g={g}: {rp}");
            let deq = s.clone_dtoh(&dequantize_nvfp4(&s, &t).unwrap()).unwrap();
            let wdeq = reference::dequantize(&want);
            let b = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(b(&deq[..8 * cols]), b(&wdeq), "{layout:?} g={g}: {rp}");
        }
    }
}

/// Millions of blocks whose quotients land on or within a few ulps of the E2M1 decision points,
/// at scales across the E4M3 range: the kernel's fast paths (reciprocal, Markstein) must agree
/// with true division.
#[test]
#[ignore = "needs a CUDA GPU"]
fn quantize_division_fast_path_is_exact() {
    let s = stream();
    let mut rng = test_rng();
    let rp = replay();
    let (rows, cols) = (4096usize, 1024usize);
    const POINTS: [f32; 7] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0];
    // Round g (the exact paths), fixed and fresh random g (the reciprocal fast path).
    let random_g = [rng.uniform(-30.0, 10.0).exp2(), rng.uniform(-30.0, 10.0).exp2()];
    for &g in [1.0f32, 0.3, 1.7e-5, 2.2e4].iter().chain(&random_g) {
        let mut x = Vec::with_capacity(rows * cols);
        for _ in 0..rows * cols / 16 {
            let amax = 6.0 * nvfp4_moe::format::e4m3_decode(rng.range(1, 0x7E) as u8) * g * rng.uniform(0.9, 1.1);
            x.push(bf16::from_f32(amax));
            let d_est = amax / 6.0;
            for _ in 1..16 {
                let t = POINTS[rng.below(7) as usize];
                let v = bf16::from_f32(t * d_est);
                // Nudge a few bf16 ulps either way.
                let bits = (v.to_bits() as i32 + rng.range(0, 7) as i32 - 3) as u16;
                x.push(bf16::from_bits(bits));
            }
        }
        let want = reference::quantize(&x, rows, cols, g, ScaleLayout::Linear).unwrap();
        let xd = s.clone_htod(&x).unwrap();
        let got = quantize_nvfp4(&s, &xd, rows, cols, g, ScaleLayout::Linear).unwrap().to_host(&s).unwrap();
        assert!(got.scales == want.scales, "scales differ at {:?} g={g}: {rp}", first_diff(&got.scales, &want.scales));
        assert!(got.codes == want.codes, "codes differ at {:?} g={g}: {rp}", first_diff(&got.codes, &want.codes));
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_input_is_rejected_before_launch() {
    let s = stream();
    let mut rng = test_rng();
    let rp = replay();
    let (rows, cols) = (4usize, 64usize);
    let x = s.clone_htod(&rng.normal_bf16(rows * cols + 8, 1.0)).unwrap();
    let mut codes = poisoned_u8(&s, rows * cols / 2 + 8);
    let mut scales = poisoned_u8(&s, 512);
    let lin = |rows, cols, decode_scale| Nvfp4Desc { rows, cols, layout: ScaleLayout::Linear, decode_scale };
    // x shifted by one bf16: 2-byte aligned only.
    let e = quantize_nvfp4_into(&s, &x.slice(1..), lin(rows, cols, 1.0), &mut codes, &mut scales).unwrap_err();
    assert!(matches!(e, Error::Misaligned { name: "x", .. }), "{e}: {rp}");
    let e = quantize_nvfp4_into(&s, &x, lin(rows, cols, 1.0), &mut codes.slice_mut(4..), &mut scales).unwrap_err();
    assert!(matches!(e, Error::Misaligned { name: "codes", .. }), "{e}: {rp}");
    let e = quantize_nvfp4_into(&s, &x, lin(rows, 40, 1.0), &mut codes, &mut scales).unwrap_err();
    assert!(matches!(e, Error::InvalidShape(_)), "{e}: {rp}");
    let e = quantize_nvfp4_into(&s, &x, lin(rows, cols, f32::NAN), &mut codes, &mut scales).unwrap_err();
    assert!(matches!(e, Error::InvalidDecodeScale(_)), "{e}: {rp}");
    let e = quantize_nvfp4_into(
        &s,
        &x,
        Nvfp4Desc { rows, cols, layout: ScaleLayout::Swizzled128x4, decode_scale: 1.0 },
        &mut codes,
        &mut scales.slice_mut(..100),
    )
    .unwrap_err();
    assert!(matches!(e, Error::BufferTooSmall { name: "scales", .. }), "{e}: {rp}");
    s.synchronize().unwrap();
    // Nothing was launched: the outputs still hold the poison.
    assert!(s.clone_dtoh(&codes).unwrap().iter().all(|&b| b == POISON), "codes written: {rp}");
    assert!(s.clone_dtoh(&scales).unwrap().iter().all(|&b| b == POISON), "scales written: {rp}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn host_round_trip_through_device() {
    let s = stream();
    let mut rng = test_rng();
    let (rows, cols) = (37usize, 96usize);
    let x = rng.varied_bf16(rows * cols);
    let h: Nvfp4Host = reference::quantize(&x, rows, cols, 0.5, ScaleLayout::Swizzled128x4).unwrap();
    let t = Nvfp4Tensor::from_host(&s, &h).unwrap();
    let back = t.to_host(&s).unwrap();
    assert_eq!(back.codes, h.codes, "codes: {}", replay());
    assert_eq!(back.scales, h.scales, "scales: {}", replay());
}

/// Recipe v2 against ModelOpt itself on the CUDA paths: the committed fixtures through every GPU
/// quantizer, and ModelOpt run live (tests/modelopt/oracle.py) on fresh random data beside them.
mod modelopt {
    use super::*;
    use crate::modelopt_fixture::{
        cases_from, describe_diff, fixture, linear_from_grouped, linear_scales, three_way_offsets, Case,
    };
    use nvfp4_moe::gemm::{GemmTile, GroupedGemm, SwigluBf16, SwigluNvfp4, SwigluNvfp4Out};
    use nvfp4_moe::layout::grouped_scale_len;
    use nvfp4_moe::moe::{quantize_bf16_experts, MoeWeightsBf16};
    use nvfp4_moe::quantize::{quantize_nvfp4_grouped_into, GroupedDesc, GroupedSource};

    /// Compares every CUDA quantizer with ModelOpt's bytes for one case; returns the bytes compared.
    fn cuda_paths_equal(s: &Arc<CudaStream>, rng: &mut Rng, c: &Case) -> usize {
        let mut compared = 0;
        let mut check = |what: &str, codes: &[u8], scales: &[u8]| {
            let d = describe_diff("codes", &c.name, codes, &c.codes)
                .or_else(|| describe_diff("scales", &c.name, scales, &c.scales));
            assert!(d.is_none(), "{what}: {}: {}", d.unwrap(), replay());
            compared += codes.len() + scales.len();
        };
        let xd = s.clone_htod(&c.x).unwrap();
        for layout in [ScaleLayout::Linear, ScaleLayout::Swizzled128x4] {
            let mut codes = poisoned_u8(s, c.rows * c.cols / 2);
            let mut scales = poisoned_u8(s, scale_len(layout, c.rows, c.cols));
            let desc = Nvfp4Desc { rows: c.rows, cols: c.cols, layout, decode_scale: c.g };
            quantize_nvfp4_into(s, &xd, desc, &mut codes, &mut scales).unwrap();
            let sc = linear_scales(layout, c.rows, c.cols, &s.clone_dtoh(&scales).unwrap());
            check(&format!("quantize_nvfp4 {layout:?}"), &s.clone_dtoh(&codes).unwrap(), &sc);
        }
        // The grouped quantizer, over three experts (one empty) sharing g, from a contiguous source
        // and from an Interleaved GEMM output whose swiglu slots hold x (random elsewhere).
        let offsets = three_way_offsets(c.rows);
        let offd = s.clone_htod(&offsets).unwrap();
        let gd = s.clone_htod(&[c.g]).unwrap();
        let mut inter = rng.normal_bf16(c.rows * 2 * c.cols, 3.0);
        for r in 0..c.rows {
            for j in 0..c.cols {
                inter[r * 2 * c.cols + 16 * (j / 8) + 8 + j % 8] = c.x[r * c.cols + j];
            }
        }
        let interd = s.clone_htod(&inter).unwrap();
        for (source, src) in [(GroupedSource::Contiguous, &xd), (GroupedSource::InterleavedSwiglu, &interd)] {
            let mut codes = poisoned_u8(s, c.rows * c.cols / 2);
            let mut scales = poisoned_u8(s, grouped_scale_len(c.rows, 3, c.cols));
            let desc = GroupedDesc { rows: c.rows, cols: c.cols, expert_offsets: &offd, decode_scales: &gd };
            quantize_nvfp4_grouped_into(s, source, src, &desc, &mut codes, &mut scales).unwrap();
            let sc = linear_from_grouped(&offsets, c.rows, c.cols, &s.clone_dtoh(&scales).unwrap());
            check(&format!("quantize_nvfp4_grouped {source:?}"), &s.clone_dtoh(&codes).unwrap(), &sc);
        }
        // Weight quantization from BF16 (ModelOpt's weight path: g derived from the tensor), with x as
        // the gate projection of a one-expert layer [I, H] = [rows, cols].
        if !c.given && c.rows.is_multiple_of(16) {
            let (i, h) = (c.rows, c.cols);
            let up = rng.normal_bf16(i * h, 0.02);
            let down = rng.normal_bf16(h * i, 0.02);
            let w = MoeWeightsBf16 { gate: &c.x, up: &up, down: &down, experts: 1, hidden: h, intermediate: i };
            let ck = quantize_bf16_experts(s, &w).unwrap();
            assert_eq!(
                ck.w13.decode_scales[0].to_bits(),
                c.g.to_bits(),
                "{}: weight decode scale: {}",
                c.name,
                replay()
            );
            check("quantize_bf16_experts (gate)", &ck.w13.codes[..i * h / 2], &ck.w13.scales[..i * h / 16]);
        }
        compared
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn cuda_quantizers_equal_modelopt_fixtures() {
        let s = stream();
        let mut rng = test_rng();
        let (cases, meta) = fixture();
        let bytes: usize = cases.iter().map(|c| cuda_paths_equal(&s, &mut rng, c)).sum();
        eprintln!("{} ModelOpt fixture cases ({meta:?}): {bytes} bytes compared, 0 differ", cases.len());
        report_exact("ModelOpt fixtures", bytes);
    }

    /// One oracle input: name, rows, cols, the bf16 data and a given decode scale (None: derived).
    type OracleInput = (String, usize, usize, Vec<bf16>, Option<f32>);

    fn write_inputs(path: &std::path::Path, inputs: &[OracleInput]) {
        use safetensors::tensor::TensorView;
        use safetensors::Dtype;
        let mut raw: Vec<(String, Vec<usize>, Dtype, Vec<u8>)> = Vec::new();
        for (name, rows, cols, x, g) in inputs {
            let bytes = x.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect();
            raw.push((format!("{name}.x"), vec![*rows, *cols], Dtype::BF16, bytes));
            if let Some(g) = g {
                raw.push((format!("{name}.g"), vec![1], Dtype::F32, g.to_le_bytes().to_vec()));
            }
        }
        let views: Vec<(String, TensorView<'_>)> =
            raw.iter().map(|(n, sh, dt, b)| (n.clone(), TensorView::new(*dt, sh.clone(), b).unwrap())).collect();
        safetensors::serialize_to_file(views, None, path).unwrap();
    }

    /// Runs ModelOpt 0.47 (tests/modelopt/oracle.py, python3 with torch on this GPU and
    /// nvidia-modelopt importable) on fresh random tensors: weights (g derived), heavy-tailed data,
    /// activations with a given g, and the compact SwiGLU output of a real L1 GEMM per expert. Every
    /// CPU and CUDA quantizer, and the `SwigluNvfp4` epilogue, must give ModelOpt's bytes.
    #[test]
    #[ignore = "needs a CUDA GPU, python3 with torch and nvidia-modelopt 0.47"]
    fn modelopt_on_fresh_random_data() {
        let s = stream();
        let mut rng = test_rng();
        let (seed, rp) = (rng.seed(), replay());
        let mut inputs: Vec<OracleInput> = Vec::new();
        for (i, &(rows, cols)) in
            [(1usize, 16usize), (7, 2880), (64, 7168), (300, 2048), (129, 1536)].iter().enumerate()
        {
            let x = rng.normal_bf16(rows * cols, 0.02);
            inputs.push((format!("weights_{i}"), rows, cols, x, None));
            let mut y: Vec<bf16> =
                (0..rows * cols).map(|_| bf16::from_f32(rng.normal() * (4.0 * rng.normal()).exp())).collect();
            for _ in 0..rows * cols / 50 {
                let j = rng.below((rows * cols) as u64) as usize;
                y[j] = if rng.below(2) == 0 { bf16::ZERO } else { bf16::NEG_ZERO };
            }
            inputs.push((format!("heavy_{i}"), rows, cols, y, None));
            let a = rng.varied_bf16(rows * cols);
            let g = rng.uniform(1e-4, 1e-1);
            inputs.push((format!("given_act_{i}"), rows, cols, a, Some(g)));
        }
        // The SwiGLU intermediate of a real L1 GEMM (SwigluBf16), per expert with its own g; the
        // SwigluNvfp4 epilogue's bytes must equal ModelOpt's for each expert's rows.
        let (e, inter, k) = (4usize, 768usize, 256usize);
        let (_, _, _, wd) = crate::gemm::swiglu::gate_up_weights(&s, &mut rng, e, 2 * inter, k);
        let off: Vec<i32> = vec![0, 37, 37, 170, 171];
        let rows = *off.last().unwrap() as usize;
        let xd = s.clone_htod(&rng.normal_bf16(rows * k, 1.0)).unwrap();
        let offd = s.clone_htod(&off).unwrap();
        let act_g: Vec<f32> = (0..e).map(|_| rng.uniform(2e-4, 2e-3)).collect();
        let gd = s.clone_htod(&act_g).unwrap();
        let mut compact = s.alloc_zeros::<bf16>(rows * inter).unwrap();
        GroupedGemm::<SwigluBf16>::new(&wd, GemmTile::Auto)
            .unwrap()
            .launch(&s, &xd, rows, &offd, &mut compact)
            .unwrap();
        let compact = s.clone_dtoh(&compact).unwrap();
        let (mut c3, mut s3) = (poisoned_u8(&s, rows * inter / 2), poisoned_u8(&s, grouped_scale_len(rows, e, inter)));
        GroupedGemm::<SwigluNvfp4>::new(&wd, GemmTile::Auto)
            .unwrap()
            .launch_nvfp4(
                &s,
                &xd,
                rows,
                &offd,
                SwigluNvfp4Out { act_decode_scales: &gd, codes: &mut c3, scales: &mut s3 },
            )
            .unwrap();
        let (c3, s3) = (s.clone_dtoh(&c3).unwrap(), s.clone_dtoh(&s3).unwrap());
        for ex in 0..e {
            let (b, en) = (off[ex] as usize, off[ex + 1] as usize);
            if b < en {
                let x = compact[b * inter..en * inter].to_vec();
                inputs.push((format!("given_swiglu_e{ex}"), en - b, inter, x, Some(act_g[ex])));
            }
        }

        let dir = std::env::temp_dir().join(format!("nvfp4moe-modelopt-{}-{seed:x}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (inp, outp) = (dir.join("in.safetensors"), dir.join("out.safetensors"));
        write_inputs(&inp, &inputs);
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/modelopt/oracle.py");
        let script = std::env::var("NVFP4MOE_MODELOPT_ORACLE").unwrap_or_else(|_| script.to_string());
        let status = std::process::Command::new(std::env::var("PYTHON").unwrap_or_else(|_| "python3".into()))
            .arg(&script)
            .arg(&inp)
            .arg(&outp)
            .status()
            .expect("python3 runs");
        assert!(
            status.success(),
            "ModelOpt oracle failed ({status}): it needs torch with CUDA and nvidia-modelopt 0.47"
        );
        let (ib, ob) = (std::fs::read(&inp).unwrap(), std::fs::read(&outp).unwrap());
        let cases = cases_from(&ob, Some(&ib));
        assert_eq!(cases.len(), inputs.len(), "the oracle answered every case: {rp}");
        let mut bytes = 0;
        for c in &cases {
            let given = inputs.iter().find(|i| i.0 == c.name).unwrap().4;
            if let Some(g) = given {
                assert_eq!(g.to_bits(), c.g.to_bits(), "{}: ModelOpt used the given g: {rp}", c.name);
            }
            let q = reference::quantize(&c.x, c.rows, c.cols, c.g, ScaleLayout::Linear).unwrap();
            assert_eq!(describe_diff("codes", &c.name, &q.codes, &c.codes), None, "CPU: {rp}");
            assert_eq!(describe_diff("scales", &c.name, &q.scales, &c.scales), None, "CPU: {rp}");
            bytes += cuda_paths_equal(&s, &mut rng, c);
            if let Some(ex) = c.name.strip_prefix("given_swiglu_e") {
                let ex: usize = ex.parse().unwrap();
                let b = off[ex] as usize;
                let codes = &c3[b * inter / 2..(b + c.rows) * inter / 2];
                let sc: Vec<u8> = (0..c.rows * inter / 16)
                    .map(|i| {
                        s3[nvfp4_moe::layout::grouped_swizzled_offset(
                            &off,
                            b + i / (inter / 16),
                            i % (inter / 16),
                            inter,
                        )]
                    })
                    .collect();
                assert_eq!(describe_diff("codes", &c.name, codes, &c.codes), None, "SwigluNvfp4: {rp}");
                assert_eq!(describe_diff("scales", &c.name, &sc, &c.scales), None, "SwigluNvfp4: {rp}");
                bytes += codes.len() + sc.len();
            }
        }
        std::fs::remove_dir_all(&dir).ok();
        eprintln!("ModelOpt on fresh data: {} tensors, {bytes} bytes compared, 0 differ (seed {seed:#x})", cases.len());
        report_exact(&format!("ModelOpt on fresh data (seed {seed:#x})"), bytes);
    }
}
