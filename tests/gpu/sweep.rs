//! A randomized shape sweep (issue 21): the quantizers, the grouped GEMMs (every epilogue) and the
//! whole layer against the CPU reference at shapes drawn from everything the API admits.
//!
//! - Sizes: `NVFP4MOE_SWEEP_SIZE=small|medium|large` (default `medium`). `small` and `medium` are
//!   meant for compute-sanitizer memcheck (`scripts/gpu-sanitize.sh`), `large` runs without it.
//! - Cases: `NVFP4MOE_SWEEP_CASES=N` cases per test (default per size: [`Size::default_cases`]; the
//!   three tests at the default size take well under a minute on an H200).
//! - Seeds: each test's generator is `test_rng` (its seed printed, replayed by
//!   `NVFP4MOE_TEST_SEED`); each case draws its own seed from it and prints it with its shape and
//!   the line that replays it (the test's seed, the size and `NVFP4MOE_SWEEP_CASES` = the case's
//!   index + 1), which every assertion's context carries.
//!
//! Shapes: experts from 1 to the size's bound (and the API's limit, 1024, in `medium`/`large`);
//! GEMM `n` and `k` and the layer's H and I positive multiples of 64 (the grouped GEMM's rule:
//! `can_implement.cpp` `check_weights`; the layer's W2 has `k = I`), drawn at every power-of-two
//! class of the multiple (64 x odd, 128 x odd, ...) with the minimum (64) often; quantizer columns
//! multiples of 16 likewise (`check_dense`); T from 1 to 5000 (`large`; 300 and 1200 in `small` and
//! `medium`); top-k from 1 to `min(E, 32)` (`MoeLayer::new`); skewed routing (a few hot experts,
//! others empty) with and without distinct experts per token. Every third GEMM and layer case is a
//! decode step (at most 8 rows in all), and every case of at most 8 rows also runs with the
//! warp-MMA tile forced (`GemmTile::WarpM16N8`; `Auto` takes it only where its heuristic says),
//! each case's context naming the tile every launch ran on. Every output is poisoned before the
//! launch, so an unwritten byte cannot pass, and rows past `expert_offsets[E]` must stay poisoned.
//!
//! Bounds are the existing tests' (not loosened): quantizers bit-exact; GEMM elements 1e-2 relative
//! (Frobenius) per expert; layer 1e-2 per token and overall (BF16 intermediate), 0.15 overall and
//! 0.25 per token for the NVFP4 intermediate, which is run where its bound was justified
//! (`layer_with_nvfp4_intermediate`: I >= 192).

use super::*;
use crate::gemm::grouped::expert_of;
use crate::gemm::swiglu::{gate_up_weights, quantize_compact_and_interleaved};
use crate::layer::moe_layer::random_checkpoint;
use nvfp4_moe::gemm::SwigluNvfp4Out;
use nvfp4_moe::gemm::{GemmTile, GroupedGemm, Interleaved, Nvfp4Weights, PlainBf16, SwigluBf16, SwigluNvfp4};
use nvfp4_moe::layout::{grouped_scale_len, grouped_swizzled_offset};
use nvfp4_moe::moe::{MoeInput, MoeWorkspace, RouterInput};
use nvfp4_moe::quantize::{dequantize_nvfp4_grouped_into, quantize_nvfp4_grouped_into, GroupedDesc, GroupedSource};
use nvfp4_moe::reference::{dequantize_element, grouped_gemm_element, swiglu_element};
use nvfp4_moe::{Intermediate, MoeLayer, MoeOptions, MoeWeights};

const CASES_ENV: &str = "NVFP4MOE_SWEEP_CASES";
const SIZE_ENV: &str = "NVFP4MOE_SWEEP_SIZE";

/// The size class of a sweep run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Size {
    Small,
    Medium,
    Large,
}

/// The bounds of one size class.
struct Bounds {
    /// Largest expert count drawn (the API's limit, 1024, is drawn too when this is 1024).
    experts: usize,
    /// Largest hidden size H (GEMM `k` of W13, `n` of W2) and GEMM `n`/`k`.
    hidden: usize,
    /// Largest intermediate size I.
    intermediate: usize,
    /// Largest token count T.
    tokens: usize,
    /// Largest E x n x k of one weight tensor (host memory and preparation time).
    weights: usize,
    /// Largest rows x cols of one quantizer case (the CPU reference quantizes every element).
    elements: usize,
}

impl Size {
    fn from_env() -> Size {
        match std::env::var(SIZE_ENV) {
            Err(_) => Size::Medium,
            Ok(v) => match v.trim() {
                "small" => Size::Small,
                "medium" => Size::Medium,
                "large" => Size::Large,
                _ => panic!("{SIZE_ENV}={v:?}: expected small, medium or large"),
            },
        }
    }

    /// The value of `NVFP4MOE_SWEEP_SIZE` that selects this size.
    fn name(self) -> &'static str {
        match self {
            Size::Small => "small",
            Size::Medium => "medium",
            Size::Large => "large",
        }
    }

    /// How to replay case `case` of a sweep at this size: the test's seed, this size and as many
    /// cases (each case's seed is the next draw of the test's generator, so the first `case + 1`
    /// cases are the same).
    fn replay(self, case: usize) -> String {
        replay_with(&format!("{SIZE_ENV}={} {CASES_ENV}={}", self.name(), case + 1))
    }

    /// Cases per test when `NVFP4MOE_SWEEP_CASES` is not set: (quantizers, GEMMs, layer).
    fn default_cases(self) -> (usize, usize, usize) {
        match self {
            Size::Small => (16, 12, 12),
            Size::Medium => (16, 12, 10),
            Size::Large => (10, 8, 6),
        }
    }

    fn bounds(self) -> Bounds {
        match self {
            Size::Small => {
                Bounds { experts: 16, hidden: 512, intermediate: 384, tokens: 300, weights: 1 << 22, elements: 1 << 18 }
            }
            Size::Medium => Bounds {
                experts: 1024,
                hidden: 2048,
                intermediate: 1024,
                tokens: 1200,
                weights: 1 << 25,
                elements: 1 << 21,
            },
            Size::Large => Bounds {
                experts: 1024,
                hidden: 7168,
                intermediate: 2880,
                tokens: 5000,
                weights: 1 << 27,
                elements: 1 << 23,
            },
        }
    }
}

/// The number of cases of a test: `NVFP4MOE_SWEEP_CASES` or the size's default.
fn cases(default: usize) -> usize {
    match std::env::var(CASES_ENV) {
        Err(_) => default,
        Ok(v) => v.trim().parse().unwrap_or_else(|_| panic!("{CASES_ENV}={v:?} is not a count")),
    }
}

/// The run's size and case count, printed.
fn setup(test: &str, pick: fn((usize, usize, usize)) -> usize) -> (Size, Bounds, usize) {
    let size = Size::from_env();
    let n = cases(pick(size.default_cases()));
    assert!(n > 0, "{CASES_ENV}=0: a sweep of no cases would pass without testing anything");
    eprintln!("sweep {test}: size {size:?}, {n} cases ({SIZE_ENV}, {CASES_ENV})");
    (size, size.bounds(), n)
}

/// A positive multiple of `unit` at most `max` (>= `unit`): the minimum (`unit`) one time in six,
/// else `(2j + 1) << c` units with the class `c` uniform over the classes that fit, so that every
/// alignment (odd multiples of `unit`, of `2 unit`, of `4 unit`, ...) is drawn.
fn aligned(rng: &mut Rng, unit: usize, max: usize) -> usize {
    let max_m = (max / unit).max(1);
    if rng.below(6) == 0 {
        return unit;
    }
    let classes = u64::from(usize::BITS - max_m.leading_zeros());
    let c = rng.below(classes) as u32;
    let odd = (max_m >> c).div_ceil(2);
    let j = rng.below(odd as u64) as usize;
    ((2 * j + 1) << c) * unit
}

/// A count in `[1, max]`: 1 one time in five, `max` one time in ten, else log-uniform.
fn count(rng: &mut Rng, max: usize) -> usize {
    match rng.below(10) {
        0 | 1 => 1,
        2 => max,
        _ => ((rng.f32() * (max as f32).ln()).exp() as usize).clamp(1, max),
    }
}

/// Expert offsets of `experts` experts for about `rows` rows in all, skewed: one to three hot
/// experts take about half of the rows, a random third of the others none, the rest share the
/// remainder unevenly.
fn skewed_offsets(rng: &mut Rng, experts: usize, rows: usize) -> Vec<i32> {
    let hot: Vec<usize> = (0..rng.range(1, 4)).map(|_| rng.below(experts as u64) as usize).collect();
    let empty: Vec<bool> = (0..experts).map(|_| rng.below(3) == 0).collect();
    let mut counts = vec![0usize; experts];
    for _ in 0..rows {
        let e = if rng.below(2) == 0 {
            hot[rng.below(hot.len() as u64) as usize]
        } else {
            rng.below(experts as u64) as usize
        };
        if !empty[e] || hot.contains(&e) {
            counts[e] += 1;
        }
    }
    let mut off = vec![0i32];
    for c in counts {
        off.push(off.last().unwrap() + c as i32);
    }
    off
}

/// Skewed routing of `tokens` tokens over `experts` experts, `top_k` slots each: hot experts take
/// about half of the slots and a third of the experts is never chosen (unless too few are left for
/// distinct ids); with `distinct` a token's experts are distinct.
pub(crate) fn skewed_ids(rng: &mut Rng, tokens: usize, top_k: usize, experts: usize, distinct: bool) -> Vec<i32> {
    let mut allowed: Vec<usize> = (0..experts).filter(|_| rng.below(3) != 0).collect();
    if allowed.len() < top_k.max(1) {
        allowed = (0..experts).collect();
    }
    let hot: Vec<usize> = (0..rng.range(1, 4)).map(|_| allowed[rng.below(allowed.len() as u64) as usize]).collect();
    let mut ids = Vec::with_capacity(tokens * top_k);
    for _ in 0..tokens {
        let start = ids.len();
        while ids.len() < start + top_k {
            let e = if rng.below(2) == 0 {
                hot[rng.below(hot.len() as u64) as usize]
            } else {
                allowed[rng.below(allowed.len() as u64) as usize]
            } as i32;
            if distinct && ids[start..].contains(&e) {
                // Hot experts repeat: fall back to a uniform draw among the allowed ones.
                let e = allowed[rng.below(allowed.len() as u64) as usize] as i32;
                if !ids[start..].contains(&e) {
                    ids.push(e);
                }
                continue;
            }
            ids.push(e);
        }
    }
    ids
}

// ------------------------------------------------------------------------------------------------
// Quantizers

/// The dense quantizer and dequantizer (`codec::check_case`: every byte and every bf16 against the
/// reference) and the grouped quantizer and dequantizer (every code, scale and padding byte, every
/// dequantized element), at random rows and column alignments, data kinds, layouts and decode
/// scales; grouped with skewed offsets, empty experts, rows past `expert_offsets[E]`, and one or
/// per-expert decode scales.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sweep_quantizers_match_reference() {
    let (size, b, n) = setup("quantizers", |c| c.0);
    let s = stream();
    let mut rng = test_rng();
    let kinds = [Data::Normal, Data::Varied, Data::Tiny, Data::Huge, Data::NonFinite, Data::Ties];
    for case in 0..n {
        let seed = rng.next_u64();
        let mut r = Rng::new(seed);
        // Dense: rows 1..=tokens x 8, cols a multiple of 16.
        let cols = aligned(&mut r, 16, b.hidden);
        let rows = count(&mut r, (b.elements / cols).clamp(1, b.tokens * 8));
        let kind = kinds[r.below(kinds.len() as u64) as usize];
        let layout = if r.below(2) == 0 { ScaleLayout::Linear } else { ScaleLayout::Swizzled128x4 };
        let g = match (kind, r.below(3)) {
            (Data::Ties, c) => Some([1.0f32, 0.0078125, 64.0][c as usize]),
            (_, 0) => None,
            (_, 1) => Some(1.0),
            (_, _) => Some(r.uniform(1e-3, 10.0)),
        };
        let case_ctx = format!("sweep quantizers case {case}: seed {seed:#x}: {}", size.replay(case));
        eprintln!("sweep quantizers case {case}: seed {seed:#x} dense rows={rows} cols={cols} {kind:?} {layout:?}");
        crate::codec::check_case(&s, &mut r, rows, cols, kind, layout, g, &case_ctx);

        // Grouped: E experts, skewed offsets, 0..4 rows past offsets[E].
        let e = count(&mut r, b.experts);
        let cols = aligned(&mut r, 16, b.intermediate);
        let rows = count(&mut r, (b.elements / cols).clamp(1, b.tokens * 8));
        let off = skewed_offsets(&mut r, e, rows);
        let shared = r.below(2) == 0;
        // At least one row in all (an empty device buffer is not allocated).
        let extra = r.range(usize::from(off[e] == 0), 5);
        let ctx = format!(
            "sweep quantizers case {case}: seed {seed:#x} grouped E={e} rows={} +{extra} cols={cols} shared={shared}: \
             {}",
            off[e],
            size.replay(case)
        );
        eprintln!("{ctx}");
        grouped_case(&s, &mut r, &off, cols, extra, shared, &ctx);
    }
}

/// Grouped quantize then dequantize over `off[E] + extra` rows of `cols` columns into poisoned
/// buffers, against `reference::quantize_grouped` (every byte; padding 0; codes of rows past
/// `off[E]` untouched) and `reference::dequantize_element` (every element; rows past untouched).
fn grouped_case(s: &Arc<CudaStream>, rng: &mut Rng, off: &[i32], cols: usize, extra: usize, shared: bool, ctx: &str) {
    let e = off.len() - 1;
    let rows = *off.last().unwrap() as usize;
    let total = rows + extra;
    let x = rng.varied_bf16(total * cols);
    let g: Vec<f32> = (0..if shared { 1 } else { e }).map(|_| rng.uniform(1e-3, 1.0)).collect();
    let (want_codes, want_scales) = reference::quantize_grouped(&x[..rows * cols], off, cols, &g).unwrap();
    let (xd, offd, gd) = (s.clone_htod(&x).unwrap(), s.clone_htod(off).unwrap(), s.clone_htod(&g).unwrap());
    let mut codes = poisoned_u8(s, (total * cols / 2).max(1));
    let mut scales = poisoned_u8(s, grouped_scale_len(total, e, cols));
    let desc = GroupedDesc { rows: total, cols, expert_offsets: &offd, decode_scales: &gd };
    quantize_nvfp4_grouped_into(s, GroupedSource::Contiguous, &xd, &desc, &mut codes, &mut scales).unwrap();
    let (ch, sh) = (s.clone_dtoh(&codes).unwrap(), s.clone_dtoh(&scales).unwrap());
    let nc = rows * cols / 2;
    assert!(ch[..nc] == want_codes[..], "codes {:?}: {ctx}", first_diff(&ch[..nc], &want_codes));
    assert!(ch[nc..total * cols / 2].iter().all(|&v| v == POISON), "codes past offsets[E] written: {ctx}");
    assert!(sh[..want_scales.len()] == want_scales[..], "scales {:?}: {ctx}", first_diff(&sh, &want_scales));
    assert!(sh[want_scales.len()..].iter().all(|&v| v == 0), "scale padding: {ctx}");
    let mut out = poisoned_bf16(s, (total * cols).max(1));
    dequantize_nvfp4_grouped_into(s, &codes, &scales, &desc, &mut out).unwrap();
    let got = s.clone_dtoh(&out).unwrap();
    for row in 0..total {
        for col in 0..cols {
            let v = got[row * cols + col];
            if row >= rows {
                assert_eq!(v.to_bits(), POISON_BF16, "dequantized row {row} past offsets[E] written: {ctx}");
                continue;
            }
            let ex = expert_of(off, row);
            let byte = ch[row * cols / 2 + col / 2];
            let code = if col % 2 == 0 { byte & 0xF } else { byte >> 4 };
            let scale = sh[grouped_swizzled_offset(off, row, col / 16, cols)];
            let want = dequantize_element(code, scale, g[if shared { 0 } else { ex }]);
            assert_eq!(v.to_bits(), want.to_bits(), "dequantized [{row}, {col}]: {ctx}");
        }
    }
    report_exact(ctx, ch.len() + sh.len() + 2 * got.len());
}

// ------------------------------------------------------------------------------------------------
// Grouped GEMMs

/// The largest K the warp kernel takes at 8 rows (it stages x in shared memory beside its expert
/// table and rings: `kMaxXBytes` in the core's `grouped_gemm_warp.hpp`; the lib test
/// `launch_tile_takes_the_warp_kernel_for_at_most_8_rows` checks the bound). Every sweep size stays
/// below it, so every case of at most 8 rows can force the warp tile.
const WARP_MAX_K: usize = 9344;

/// Every epilogue at random (E, n, k), skewed rows with empty experts and rows past
/// `expert_offsets[E]`, a random tile (or `Auto`, which takes the warp kernel for at most 8 rows
/// where its heuristic says) and batch invariance on or off: `PlainBf16` over identity-order
/// weights and `SwigluBf16` within 1e-2 of the f64 reference per expert (sampled elements);
/// `Interleaved`'s SwiGLU columns equal `SwigluBf16`'s bit for bit and its gate columns are within
/// 1e-2; `SwigluNvfp4` equals `reference::quantize_grouped` of the `SwigluBf16` output in every
/// byte (and the old flow's `swiglu_quantize(Interleaved)`); every row of an expert written, no
/// row past `off[E]`. Every case of at most 8 rows in all (every third case is one: a decode step)
/// also runs the three BF16 epilogues on `WarpM16N8`, forced, with the same checks, and where the
/// drawn tile resolves to the warp kernel (`Auto`) both give the same bits. The context of every
/// case names the tile each epilogue ran on.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sweep_grouped_gemms_match_reference() {
    let (size, b, n) = setup("grouped GEMMs", |c| c.1);
    assert!(b.hidden <= WARP_MAX_K, "k up to {} would not fit the warp kernel at 8 rows", b.hidden);
    let s = stream();
    let mut rng = test_rng();
    let tiles: Vec<GemmTile> = std::iter::once(GemmTile::Auto).chain(WGMMA_TILES).collect();
    let mut warp_cases = 0;
    for case in 0..n {
        let seed = rng.next_u64();
        let mut r = Rng::new(seed);
        let (e, nn, k) = loop {
            let e = count(&mut r, b.experts);
            let inter = aligned(&mut r, 32, b.intermediate);
            let k = aligned(&mut r, 64, b.hidden);
            if e * 2 * inter * k <= b.weights {
                break (e, 2 * inter, k);
            }
        };
        let inter = nn / 2;
        // Every third case a decode step (at most 8 rows in all, the warp kernel's launches);
        // others up to 8 x T rows in all (top-k 8), bounded so that x and the outputs stay
        // host-sized.
        let decode = case % 3 == 0;
        let want_rows =
            if decode { r.range(1, 9) } else { count(&mut r, (b.tokens * 8).min(4 * b.elements / nn.max(k)).max(1)) };
        let off = if want_rows <= 8 && (decode || r.below(2) == 0) {
            // A decode step: rows on a few experts.
            let mut c = vec![0usize; e];
            for _ in 0..want_rows {
                c[r.below(e as u64) as usize] += 1;
            }
            crate::gemm::grouped::offsets_of(&c)
        } else {
            skewed_offsets(&mut r, e, want_rows)
        };
        let rows = *off.last().unwrap() as usize;
        let total = rows + r.range(usize::from(rows == 0), 4);
        // (A decode step's rows are at most 8: its rows past offsets[E] stay within 8 in all.)
        let total = if decode { total.min(8) } else { total };
        let tile = tiles[r.below(tiles.len() as u64) as usize];
        let invariant = r.below(3) == 0;
        let ctx = format!(
            "sweep GEMM case {case}: seed {seed:#x} E={e} n={nn} k={k} rows={rows} total={total} {tile:?} \
             invariant={invariant}"
        );
        let rp = size.replay(case);
        eprintln!("{ctx}: {rp}");
        let x = r.normal_bf16(total * k, 1.0);
        let (xd, offd) = (s.clone_htod(&x).unwrap(), s.clone_htod(&off).unwrap());
        let (w, gate_g, up_g, wgu) = gate_up_weights(&s, &mut r, e, nn, k);
        // PlainBf16 runs over the same codes in identity order.
        let wid = Nvfp4Weights::from_host(&s, &w).unwrap();
        let c =
            GemmCase { off, rows, total, x, xd, offd, w, gate_g, up_g, wid, wgu, samples: (4000 / e).clamp(24, 200) };
        // The tile each launch runs (Auto's choice per epilogue), named in the context.
        let [plain_tile, swiglu_tile, interleaved_tile, nvfp4_tile] = [
            c.tile_for::<PlainBf16>(tile, invariant),
            c.tile_for::<SwigluBf16>(tile, invariant),
            c.tile_for::<Interleaved>(tile, invariant),
            c.tile_for::<SwigluNvfp4>(tile, invariant),
        ];
        let ctx = format!(
            "{ctx} (runs: plain {plain_tile:?}, swiglu {swiglu_tile:?}, interleaved {interleaved_tile:?}, \
             nvfp4 {nvfp4_tile:?}): {rp}"
        );
        let drawn = c.bf16_epilogues(&s, &mut r, tile, invariant, &ctx);

        if total <= 8 {
            // The warp kernel forced, each BF16 epilogue checked as above; where the drawn tile
            // resolves to it (Auto, not batch invariant), the same launch: the same bits.
            let wctx = format!("{ctx} forced WarpM16N8");
            let warp = c.bf16_epilogues(&s, &mut r, GemmTile::WarpM16N8, invariant, &wctx);
            for (name, runs, a, b) in [
                ("plain", plain_tile, &drawn.plain, &warp.plain),
                ("swiglu", swiglu_tile, &drawn.ch, &warp.ch),
                ("interleaved", interleaved_tile, &drawn.ih, &warp.ih),
            ] {
                if runs == GemmTile::WarpM16N8 {
                    assert!(
                        a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits()),
                        "{name}: {tile:?} (runs WarpM16N8) vs WarpM16N8 forced differ at {:?}: {wctx}",
                        a.iter().zip(b).position(|(p, q)| p.to_bits() != q.to_bits())
                    );
                }
            }
            warp_cases += 1;
        }

        // SwigluNvfp4 (never the warp kernel): the reference quantization of the SwigluBf16 output.
        let act_g: Vec<f32> = (0..if r.below(2) == 0 { 1 } else { e }).map(|_| r.uniform(1e-3, 1e-1)).collect();
        let gd = s.clone_htod(&act_g).unwrap();
        let sl = grouped_scale_len(total, e, inter);
        let (mut c3, mut s3) = (poisoned_u8(&s, (total * inter / 2).max(1)), poisoned_u8(&s, sl));
        GroupedGemm::<SwigluNvfp4>::new(&c.wgu, tile)
            .unwrap()
            .batch_invariant(invariant)
            .launch_nvfp4(
                &s,
                &c.xd,
                total,
                &c.offd,
                SwigluNvfp4Out { act_decode_scales: &gd, codes: &mut c3, scales: &mut s3 },
            )
            .unwrap();
        let (c3, s3) = (s.clone_dtoh(&c3).unwrap(), s.clone_dtoh(&s3).unwrap());
        let (want_c, want_s) = reference::quantize_grouped(&drawn.ch[..rows * inter], &c.off, inter, &act_g).unwrap();
        let nc = rows * inter / 2;
        assert!(c3[..nc] == want_c[..], "SwigluNvfp4 codes {:?}: {ctx}", first_diff(&c3[..nc], &want_c));
        assert!(c3[nc..total * inter / 2].iter().all(|&v| v == POISON), "SwigluNvfp4 codes past offsets[E]: {ctx}");
        assert!(s3[..want_s.len()] == want_s[..], "SwigluNvfp4 scales {:?}: {ctx}", first_diff(&s3, &want_s));
        assert!(s3[want_s.len()..].iter().all(|&v| v == 0), "SwigluNvfp4 scale padding: {ctx}");
        if rows > 0 {
            // The old flow's quantizer over Interleaved, the same bytes (over the rows with experts).
            let [_, (c2, s2)] =
                quantize_compact_and_interleaved(&s, &drawn.compact, &drawn.interleaved, total, inter, e, &c.offd, &gd);
            assert!(c2[..nc] == c3[..nc], "swiglu_quantize codes {:?}: {ctx}", first_diff(&c2[..nc], &c3[..nc]));
            assert!(s2 == s3, "swiglu_quantize scales {:?}: {ctx}", first_diff(&s2, &s3));
        }
        report_exact(&format!("SwigluNvfp4 {ctx}"), c3.len() + s3.len());
    }
    eprintln!("sweep grouped GEMMs: {warp_cases} of {n} cases also ran WarpM16N8 (at most 8 rows in all)");
    assert!(warp_cases >= n.div_ceil(3), "every decode-step case runs the warp kernel: {warp_cases} of {n}");
}

/// One GEMM sweep case: its rows, x and weights on the host and the device.
struct GemmCase {
    off: Vec<i32>,
    /// Rows with an expert (`off[E]`) and rows launched (some past `off[E]`).
    rows: usize,
    total: usize,
    x: Vec<bf16>,
    xd: CudaSlice<bf16>,
    offd: CudaSlice<i32>,
    /// The gate/up weights `[E, 2I, k]` on the host and their decode scales.
    w: nvfp4_moe::host::ExpertWeightsHost,
    gate_g: Vec<f32>,
    up_g: Vec<f32>,
    /// `w` prepared in identity row order (`PlainBf16`) and as gate/up (the SwiGLU epilogues).
    wid: Nvfp4Weights,
    wgu: Nvfp4Weights,
    /// Sampled elements per expert and output.
    samples: usize,
}

/// The BF16 epilogues' outputs of one tile: `PlainBf16`'s, `SwigluBf16`'s (compact) and
/// `Interleaved`'s on the host, the latter two also on the device (the old flow's quantizer reads
/// them).
struct Bf16Outputs {
    plain: Vec<bf16>,
    ch: Vec<bf16>,
    ih: Vec<bf16>,
    compact: CudaSlice<bf16>,
    interleaved: CudaSlice<bf16>,
}

impl GemmCase {
    /// The tile a launch of epilogue `E` with plan tile `tile` runs on.
    fn tile_for<E: nvfp4_moe::gemm::Epilogue>(&self, tile: GemmTile, invariant: bool) -> GemmTile {
        let w = if E::NEEDS_GATE_UP { &self.wgu } else { &self.wid };
        GroupedGemm::<E>::new(w, tile).unwrap().batch_invariant(invariant).tile_for(self.total)
    }

    /// `PlainBf16`, `SwigluBf16` and `Interleaved` on `tile` into poisoned outputs: every row of an
    /// expert written and none past `off[E]`, `Interleaved`'s SwiGLU columns `SwigluBf16`'s bits,
    /// sampled elements within 1e-2 of the f64 reference per expert (`err` lines).
    fn bf16_epilogues(
        &self,
        s: &Arc<CudaStream>,
        r: &mut Rng,
        tile: GemmTile,
        invariant: bool,
        ctx: &str,
    ) -> Bf16Outputs {
        let GemmCase { off, rows, total, x, xd, offd, w, gate_g, up_g, wid, wgu, samples } = self;
        let (rows, total, samples) = (*rows, *total, *samples);
        let (nn, inter) = (wgu.n(), wgu.n() / 2);
        let mut out = poisoned_bf16(s, (total * nn).max(1));
        GroupedGemm::<PlainBf16>::new(wid, tile)
            .unwrap()
            .batch_invariant(invariant)
            .launch(s, xd, total, offd, &mut out)
            .unwrap();
        let plain = s.clone_dtoh(&out).unwrap();
        check_written(&plain[..total * nn], nn, rows, &format!("plain {ctx}"));
        let [err] = sampled_expert_errors(r, off, nn, samples, 1e-2, ["plain"], ctx, |ex, row, f| {
            [(f64::from(plain[row * nn + f].to_f32()), grouped_gemm_element(x, w, ex, row, f))]
        });
        err.report(&format!("plain {ctx}"));

        let mut compact = poisoned_bf16(s, (total * inter).max(1));
        let mut interleaved = poisoned_bf16(s, (total * nn).max(1));
        GroupedGemm::<SwigluBf16>::new(wgu, tile)
            .unwrap()
            .batch_invariant(invariant)
            .launch(s, xd, total, offd, &mut compact)
            .unwrap();
        GroupedGemm::<Interleaved>::new(wgu, tile)
            .unwrap()
            .batch_invariant(invariant)
            .launch(s, xd, total, offd, &mut interleaved)
            .unwrap();
        let ch = s.clone_dtoh(&compact).unwrap();
        let ih = s.clone_dtoh(&interleaved).unwrap();
        check_written(&ch[..total * inter], inter, rows, &format!("swiglu {ctx}"));
        check_written(&ih[..total * nn], nn, rows, &format!("interleaved {ctx}"));
        for row in 0..rows {
            for f in 0..inter {
                let sw = ih[row * nn + 16 * (f / 8) + 8 + f % 8];
                assert_eq!(sw.to_bits(), ch[row * inter + f].to_bits(), "interleaved swiglu [{row}, {f}]: {ctx}");
            }
        }
        let names = ["swiglu", "interleaved gate"];
        let [sw_all, gate_all] = sampled_expert_errors(r, off, inter, samples, 1e-2, names, ctx, |ex, row, f| {
            let (gv, want) = swiglu_element(x, w, ex, row, f, gate_g[ex], up_g[ex]);
            [
                (f64::from(ch[row * inter + f].to_f32()), want),
                (f64::from(ih[row * nn + 16 * (f / 8) + f % 8].to_f32()), gv),
            ]
        });
        sw_all.report(&format!("swiglu {ctx}"));
        gate_all.report(&format!("interleaved gate {ctx}"));
        Bf16Outputs { plain, ch, ih, compact, interleaved }
    }
}

/// Every element of the rows of an expert written (not the poison), none past `rows`.
fn check_written(out: &[bf16], cols: usize, rows: usize, ctx: &str) {
    for (i, v) in out.iter().enumerate() {
        let row = i / cols;
        assert_eq!(v.to_bits() != POISON_BF16, row < rows, "element {i} (row {row}) written: {ctx}");
    }
}

// ------------------------------------------------------------------------------------------------
// The layer

/// The whole layer at random (E, H, I, T, k), skewed routing with empty experts (precomputed top-k,
/// or the router path from skewed logits one case in four), random tile option and batch
/// invariance, `max_tokens`/`max_top_k` at or above the forward's: every output element written,
/// no bad id reported, the same bits on a second forward, and the sampled tokens (token 0, T - 1
/// and random ones; the f64 reference of a token depends on that token only) within the existing
/// bounds of the f64 reference. Where I >= 192 the NVFP4 intermediate runs too, its activation
/// decode scale calibrated by `MoeLayer::calibrate_nvfp4_scale`. Every case of at most 8 rows in
/// all (T x k; every third case is one: a decode step) also runs the BF16 layer with the warp tile
/// forced (`GemmTile::WarpM16N8`), with the same checks, and where the drawn tile resolves to the
/// warp kernel for both GEMMs (`Auto`) both give the same bits. The context of every layer names
/// the tiles its GEMMs ran on.
#[test]
#[ignore = "needs a CUDA GPU"]
fn sweep_layer_matches_reference() {
    let (size, b, n) = setup("layer", |c| c.2);
    let s = stream();
    let mut rng = test_rng();
    let tiles: Vec<GemmTile> = [GemmTile::Auto, GemmTile::Auto].into_iter().chain(WGMMA_TILES).collect();
    assert!(b.hidden.max(b.intermediate) <= WARP_MAX_K, "H or I would not fit the warp kernel at 8 rows");
    let mut warp_cases = 0;
    for case in 0..n {
        let seed = rng.next_u64();
        let mut r = Rng::new(seed);
        // Every third case a decode step: T x k at most 8 (the warp kernel's launches).
        let decode = case % 3 == 0;
        let (e, h, i, t, k) = loop {
            let e = count(&mut r, b.experts);
            let h = aligned(&mut r, 64, b.hidden);
            let i = aligned(&mut r, 64, b.intermediate);
            let (t, k) = if decode {
                let t = r.range(1, 9);
                (t, r.range(1, (8 / t).min(e.min(32)) + 1))
            } else {
                let k = match r.below(5) {
                    0 => 1,
                    1 => e.min(32),
                    _ => r.range(1, e.min(32) + 1),
                };
                (count(&mut r, b.tokens), k)
            };
            // Host weights and the per-token reference (3 k H I multiply-adds) stay bounded.
            if e * 3 * h * i <= 2 * b.weights && 3 * k * h * i <= 150_000_000 {
                break (e, h, i, t, k);
            }
        };
        let router = r.below(4) == 0;
        let distinct = r.below(2) == 0;
        let tile = tiles[r.below(tiles.len() as u64) as usize];
        let invariant = r.below(3) == 0;
        let (max_t, max_k) = (t + r.range(0, 3) * r.range(0, 64), r.range(k, e.min(32) + 1));
        let ctx = format!(
            "sweep layer case {case}: seed {seed:#x} E={e} H={h} I={i} T={t} k={k} router={router} distinct={distinct} \
             {tile:?} invariant={invariant} max_tokens={max_t} max_top_k={max_k}: {}",
            size.replay(case)
        );
        eprintln!("{ctx}");
        let ck = random_checkpoint(&mut r, e, h, i);
        let hidden = r.normal_bf16(t * h, 1.0);
        let hd = s.clone_htod(&hidden).unwrap();
        // Routing: precomputed skewed ids, or skewed logits (hot experts biased up, a third of
        // the experts biased far down) routed on the device and by the reference (same ids).
        let (ids, wts, logits) = if router {
            let bias: Vec<f32> = (0..e)
                .map(|_| match r.below(6) {
                    0 => 3.0,
                    1 | 2 => -30.0,
                    _ => 0.0,
                })
                .collect();
            let logits: Vec<f32> = (0..t * e).map(|x| r.normal() + bias[x % e]).collect();
            let (ids, w) = reference::routing::softmax_topk(&logits, t, e, k, true).unwrap();
            (ids, w, Some(logits))
        } else {
            let ids = skewed_ids(&mut r, t, k, e, distinct);
            (ids, (0..t * k).map(|_| r.uniform(0.1, 1.0)).collect::<Vec<f32>>(), None)
        };
        let (idd, wd) = (s.clone_htod(&ids).unwrap(), s.clone_htod(&wts).unwrap());
        let ld = logits.as_ref().map(|l| s.clone_htod(l).unwrap());
        // Sampled tokens and their f64 reference (threads over tokens).
        let per_token = 3 * k * h * i;
        let ns = (400_000_000 / per_token).clamp(2, 24).min(t);
        let mut toks: Vec<usize> = vec![0, t - 1];
        while toks.len() < ns + 2 {
            toks.push(r.below(t as u64) as usize);
        }
        toks.sort_unstable();
        toks.dedup();
        let want = reference_rows(&hidden, h, &ids, &wts, k, &ck, &toks);

        let opts = MoeOptions { tile, batch_invariant: invariant, ..MoeOptions::new(max_t, max_k) };
        let layer = MoeLayer::new(MoeWeights::from_checkpoint(&s, &ck).unwrap(), opts).unwrap();
        let layer_g = (i >= 192).then(|| {
            let mut ws = layer.workspace(&s).unwrap();
            layer.calibrate_nvfp4_scale(&s, &hd, t, &idd, k, &mut ws).unwrap()
        });
        let drawn_tiles = layer.gemm_tiles(t, k).unwrap();
        // (label, intermediate, layer): the label names the tiles the layer's GEMMs run on.
        let mut layers = vec![(format!("Bf16 on {drawn_tiles:?}"), Intermediate::Bf16, layer)];
        if let Some(g) = layer_g {
            let inter = Intermediate::Nvfp4 { decode_scale: g };
            let l = MoeLayer::new(
                MoeWeights::from_checkpoint(&s, &ck).unwrap(),
                MoeOptions { intermediate: inter, ..opts },
            )
            .unwrap();
            layers.push((format!("{inter:?} on {:?}", l.gemm_tiles(t, k).unwrap()), inter, l));
        }
        let warp = t * k <= 8;
        if warp {
            // The warp kernel forced for both GEMMs (BF16 intermediate: it has no SwigluNvfp4).
            let opts = MoeOptions { tile: GemmTile::WarpM16N8, ..opts };
            let l = MoeLayer::new(MoeWeights::from_checkpoint(&s, &ck).unwrap(), opts).unwrap();
            let runs = l.gemm_tiles(t, k).unwrap();
            assert_eq!(runs, (GemmTile::WarpM16N8, GemmTile::WarpM16N8), "a forced tile is the launches' tile: {ctx}");
            layers.push((format!("Bf16 forced WarpM16N8 on {runs:?}"), Intermediate::Bf16, l));
            warp_cases += 1;
        }
        let mut outputs = Vec::with_capacity(layers.len());
        for (label, inter, layer) in &layers {
            let mut ws = layer.workspace(&s).unwrap();
            let run = |ws: &mut MoeWorkspace| {
                let mut out = poisoned_bf16(&s, t * h);
                match &ld {
                    Some(l) => layer
                        .forward_with_router(
                            &s,
                            &RouterInput { hidden: &hd, tokens: t, router_logits: l, top_k: k, renormalize: true },
                            &mut out,
                            ws,
                        )
                        .unwrap(),
                    None => layer
                        .forward(
                            &s,
                            &MoeInput { hidden: &hd, tokens: t, topk_ids: &idd, topk_weights: &wd, top_k: k },
                            &mut out,
                            ws,
                        )
                        .unwrap(),
                }
                layer.check(&s, ws, k).unwrap_or_else(|err| panic!("{label}: {err}: {ctx}"));
                s.clone_dtoh(&out).unwrap()
            };
            let got = run(&mut ws);
            assert!(got.iter().all(|v| v.to_bits() != POISON_BF16), "{label}: an output element not written: {ctx}");
            let again = run(&mut ws);
            assert!(
                got.iter().zip(&again).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{label}: not deterministic: {ctx}"
            );
            let (tok_bound, all_bound) = match inter {
                Intermediate::Bf16 => (1e-2, 1e-2),
                Intermediate::Nvfp4 { .. } => (0.25, 0.15),
            };
            let (mut all, mut worst) = (RelErr::default(), 0f64);
            for (j, &tok) in toks.iter().enumerate() {
                let mut err = RelErr::default();
                for o in 0..h {
                    err.add(f64::from(got[tok * h + o].to_f32()), want[j * h + o]);
                }
                assert!(err.rel() <= tok_bound, "{label} token {tok}: relative error {:.3e}: {ctx}", err.rel());
                worst = worst.max(err.rel());
                all.merge(&err);
            }
            assert!(all.rel() <= all_bound, "{label}: overall relative error {:.3e}: {ctx}", all.rel());
            all.report(&format!("layer {label} ({} tokens sampled, worst {worst:.3e}) {ctx}", toks.len()));
            outputs.push(got);
        }
        if warp && drawn_tiles == (GemmTile::WarpM16N8, GemmTile::WarpM16N8) {
            // The drawn tile (Auto) runs the warp kernel for both GEMMs: the forced layer's
            // launches are the same (same batch invariance), so are its bytes.
            let (a, b) = (&outputs[0], outputs.last().unwrap());
            assert!(
                a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits()),
                "Bf16 on {drawn_tiles:?} vs forced WarpM16N8 differ at {:?}: {ctx}",
                a.iter().zip(b).position(|(p, q)| p.to_bits() != q.to_bits())
            );
        }
    }
    eprintln!("sweep layer: {warp_cases} of {n} cases also ran WarpM16N8 forced (T x k at most 8)");
    assert!(warp_cases >= n.div_ceil(3), "every decode-step case runs the warp kernel: {warp_cases} of {n}");
}

/// The f64 reference layer of tokens `toks` only (a token's output depends on its own hidden
/// row and routing): `[toks.len(), H]`, computed on several threads.
fn reference_rows(
    hidden: &[bf16],
    h: usize,
    ids: &[i32],
    wts: &[f32],
    k: usize,
    ck: &nvfp4_moe::host::MoeCheckpoint,
    toks: &[usize],
) -> Vec<f64> {
    let threads = std::thread::available_parallelism().map_or(4, |p| p.get()).clamp(1, 16);
    let chunk = toks.len().div_ceil(threads).max(1);
    std::thread::scope(|sc| {
        let handles: Vec<_> = toks
            .chunks(chunk)
            .map(|part| {
                sc.spawn(move || {
                    let sub_h: Vec<bf16> = part.iter().flat_map(|&t| hidden[t * h..(t + 1) * h].to_vec()).collect();
                    let sub_i: Vec<i32> = part.iter().flat_map(|&t| ids[t * k..(t + 1) * k].to_vec()).collect();
                    let sub_w: Vec<f32> = part.iter().flat_map(|&t| wts[t * k..(t + 1) * k].to_vec()).collect();
                    reference::routing::moe_layer(&sub_h, part.len(), &sub_i, &sub_w, k, ck).unwrap()
                })
            })
            .collect();
        handles.into_iter().flat_map(|j| j.join().unwrap()).collect()
    })
}
