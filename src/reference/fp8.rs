//! The CPU oracle of the FP8-compute mode (issue 23, W4A8): NVFP4 weights re-expressed as E4M3
//! with an f32 scale per row and K block, activations quantized to E4M3 per row and K block, and
//! the GEMM those two make, in f64.
//!
//! Why it is not exact (`design/HOPPER-KERNELS.md`, last section): a weight is an E2M1 value times
//! an E4M3 block scale per 16 elements of K (times the tensor's decode scale g). The product needs
//! up to five significant bits, E4M3 holds four, and an FP8 wgmma (K = 32 per instruction) cannot
//! apply a scale that changes every 16 elements of K. So the FP8 mode rounds each product `u` to
//! E4M3 under a coarser f32 scale S (one per row and `block_k` elements of K):
//! `q = e4m3(u / S)`, with `u / S` one f32 division. For the two power-of-two forms the exact
//! quotient is (E2M1 / 1.5 or E2M1) x (an E4M3 value) x 2^j: either a value of at most 5
//! significant bits, exact in f32 (it may be an E4M3 tie, as 1.6875 is, and is then rounded as
//! one either way: `u * RN(1/S)` is within 2^-25 of it, under half an f32 ulp, so it rounds back
//! to the same f32), or m / 3 for a 4-bit m, whose bits repeat 01 / 10, a third of an E4M3 ulp
//! from any tie. So a kernel that multiplies by the reciprocal (or looks the 8 magnitudes of a
//! 16-element block up in a table made once per block) gets the same byte
//! (`reciprocal_multiply_gives_the_division_bytes_for_the_pow2_forms` checks it exhaustively).
//! Under `amax / 448` the f32 quotient can land on a tie the exact one is not on (a double
//! rounding); the mode rounds the f32 quotient, so a kernel must divide as this does to match it
//! byte for byte.
//!
//! Every step is an IEEE f32 operation with round-to-nearest-even, as the kernels will do it; the
//! sums are f64 (a product of two quantized values is exact in f64 under the power-of-two forms;
//! under `amax / 448` two f32 scales' 24-bit significands with two E4M3 values' 4 can need 56 bits,
//! a relative error of 2^-53 per product; the FP8 wgmma's reduced-precision sums inside a
//! promotion block are the kernels' tolerance, not modelled here).

use half::bf16;

use crate::error::{Error, Result};
use crate::format::{e2m1_decode, e4m3_decode, e4m3_encode, E4M3_MAX};
use crate::host::ExpertWeightsHost;

/// How the re-expression scale S of one (row, K block) of weights is chosen. Each picks the
/// least S of its form that keeps every finite product of the block within E4M3's 448, so that
/// the small products keep as many bits as the block's largest allows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp8WeightScale {
    /// `S = 1.5 * 2^k`: a product whose E2M1 value is 1.5, 3 or 6 (most of the weight energy)
    /// stays exact, `u / S` being its block scale times a power of two.
    ThreeHalvesPow2,
    /// `S = 2^k`: the products of E2M1 values 0.5, 1, 2 and 4 stay exact.
    Pow2,
    /// `S = amax / 448` (f32 division), the usual FP8 recipe's scale.
    AmaxOver448,
}

impl Fp8WeightScale {
    /// Every rule, for studies and tests.
    pub const ALL: [Fp8WeightScale; 3] =
        [Fp8WeightScale::ThreeHalvesPow2, Fp8WeightScale::Pow2, Fp8WeightScale::AmaxOver448];

    /// The rule's S for a block whose largest finite |product| is `amax` (1.0 for a block of
    /// zeros, whose codes are 0 under any S). S is a normal f32: for an amax below 448 times
    /// f32's smallest normal, the smallest normal S of the form (every product then rounds to
    /// E4M3's subnormals or zero; NVFP4 products are never that small: at least 2^-10).
    pub fn scale(self, amax: f32) -> f32 {
        if amax.is_nan() || amax <= 0.0 || amax.is_infinite() {
            return 1.0;
        }
        match self {
            Fp8WeightScale::AmaxOver448 => (amax / E4M3_MAX).max(f32::MIN_POSITIVE),
            Fp8WeightScale::Pow2 => least_scaled_pow2(amax, 1.0),
            Fp8WeightScale::ThreeHalvesPow2 => least_scaled_pow2(amax, 1.5),
        }
    }
}

/// The least `c * 2^k` (k an integer; k >= -126, so that the product is a normal f32 and exact)
/// with `amax / (c * 2^k) <= 448` in f32 arithmetic. amax is finite and positive, c is 1 or 1.5.
fn least_scaled_pow2(amax: f32, c: f32) -> f32 {
    // 2^k from its bits (exact for k in [-126, 127]); 448 * 2^127 is past f32's largest finite
    // value, so k <= 127 fits every finite amax.
    let s = |k: i32| c * f32::from_bits(((k + 127) as u32) << 23);
    // A first guess from the exponents, then exact correction: the test is the one the
    // quantization makes (an f32 division), so the chosen S never lets a product saturate.
    let guess = (f64::from(amax) / (f64::from(c) * f64::from(E4M3_MAX))).log2().ceil();
    let mut k = (guess as i32).clamp(-126, 127);
    while k < 127 && amax / s(k) > E4M3_MAX {
        k += 1;
    }
    while k > -126 && amax / s(k - 1) <= E4M3_MAX {
        k -= 1;
    }
    s(k)
}

/// A `[rows, cols]` matrix in E4M3 with an f32 scale per row and `block_k` columns (the last block
/// of a row may be shorter): element ~= e4m3(code) x scale. The FP8 mode's activations, and its
/// weights' codes and re-expression scales S ([`Fp8Weights`]).
#[derive(Clone, Debug)]
pub struct Fp8Tensor {
    /// Rows (tokens, or output features).
    pub rows: usize,
    /// Columns (K).
    pub cols: usize,
    /// Columns per scale block.
    pub block_k: usize,
    /// `[rows, cols]` E4M3 bytes.
    pub codes: Vec<u8>,
    /// `[rows, ceil(cols / block_k)]` scales.
    pub scales: Vec<f32>,
}

impl Fp8Tensor {
    /// Scale blocks per row.
    pub fn blocks(&self) -> usize {
        self.cols.div_ceil(self.block_k)
    }

    /// Element `(r, k)`: `e4m3(code) * scale` (in f64, exact).
    pub fn value(&self, r: usize, k: usize) -> f64 {
        f64::from(e4m3_decode(self.codes[r * self.cols + k]))
            * f64::from(self.scales[r * self.blocks() + k / self.block_k])
    }
}

/// One expert matrix re-expressed for FP8 compute, with the NVFP4 tensor's decode scale g kept
/// apart: weight ~= e4m3(q) x S x g.
#[derive(Clone, Debug)]
pub struct Fp8Weights {
    /// The codes q and the re-expression scales S, per row and K block.
    pub q: Fp8Tensor,
    /// The NVFP4 tensor's decode scale g.
    pub decode_scale: f32,
}

/// Re-expresses expert `e` of `w` (`[n, k]` of `[E, n, k]`) for FP8 compute with K blocks of
/// `block_k` columns (a positive multiple of 16; one of at least `k` makes one block per row). A product
/// whose block scale byte is NaN (a NaN block of the checkpoint) stays NaN (E4M3 0x7F) and does
/// not enter its block's amax; finite products never saturate past 448 and never become NaN.
///
/// # Errors
/// [`Error::InvalidShape`] for `e` outside the experts or a `block_k` that is not a positive
/// multiple of 16; as [`ExpertWeightsHost::validate`].
pub fn reexpress_expert(w: &ExpertWeightsHost, e: usize, block_k: usize, rule: Fp8WeightScale) -> Result<Fp8Weights> {
    w.validate()?;
    if e >= w.experts {
        return Err(Error::InvalidShape(format!("expert {e} of {}", w.experts)));
    }
    if block_k == 0 || !block_k.is_multiple_of(16) {
        return Err(Error::InvalidShape(format!("FP8 weight block of {block_k} columns: a positive multiple of 16")));
    }
    let (rows, cols) = (w.n, w.k);
    let blocks = cols.div_ceil(block_k);
    let mut codes = vec![0u8; rows * cols];
    let mut scales = vec![0f32; rows * blocks];
    let mut u = vec![0f32; block_k.min(cols)];
    for r in 0..rows {
        for b in 0..blocks {
            let (k0, k1) = (b * block_k, ((b + 1) * block_k).min(cols));
            let mut amax = 0f32;
            for (i, kk) in (k0..k1).enumerate() {
                u[i] = product(w, e, r, kk);
                if u[i].is_finite() {
                    amax = amax.max(u[i].abs());
                }
            }
            let s = rule.scale(amax);
            scales[r * blocks + b] = s;
            for (i, kk) in (k0..k1).enumerate() {
                codes[r * cols + kk] = e4m3_encode(u[i] / s);
            }
        }
    }
    Ok(Fp8Weights { q: Fp8Tensor { rows, cols, block_k, codes, scales }, decode_scale: w.decode_scales[e] })
}

/// Weight `(e, r, kk)` without the decode scale: e2m1 x e4m3 in f32 (exact; NaN for a NaN scale).
fn product(w: &ExpertWeightsHost, e: usize, r: usize, kk: usize) -> f32 {
    let row = e * w.n + r;
    let byte = w.codes[row * (w.k / 2) + kk / 2];
    let code = if kk.is_multiple_of(2) { byte & 0xF } else { byte >> 4 };
    e2m1_decode(code) * e4m3_decode(w.scales[row * (w.k / 16) + kk / 16])
}

/// Quantizes `x` (`[rows, cols]`, f32) to E4M3 per row and `block_k` columns, DeepSeek-V3's
/// recipe: `a = amax / 448` (f32 division; 1.0 for a block without a finite non-zero value),
/// `q = e4m3(x / a)` (saturating: an infinite element gives ±448, a NaN stays NaN).
///
/// # Errors
/// [`Error::InvalidShape`] for a zero `block_k`, [`Error::BufferTooSmall`] for an `x` shorter than
/// `rows * cols`.
pub fn quantize_activations(x: &[f32], rows: usize, cols: usize, block_k: usize) -> Result<Fp8Tensor> {
    if block_k == 0 {
        return Err(Error::InvalidShape("FP8 activation block of 0 columns".into()));
    }
    let needed = rows.checked_mul(cols).ok_or_else(|| Error::InvalidShape(format!("{rows} x {cols} overflows")))?;
    if x.len() < needed {
        return Err(Error::BufferTooSmall { name: "x", needed, actual: x.len() });
    }
    let blocks = cols.div_ceil(block_k);
    let mut codes = vec![0u8; needed];
    let mut scales = vec![0f32; rows * blocks];
    for r in 0..rows {
        for b in 0..blocks {
            let (k0, k1) = (r * cols + b * block_k, r * cols + ((b + 1) * block_k).min(cols));
            let amax = x[k0..k1].iter().filter(|v| v.is_finite()).fold(0f32, |m, v| m.max(v.abs()));
            // (A quotient that underflows to 0, amax below ~6e-43, counts as no value: 1.0.)
            let a = amax / E4M3_MAX;
            let a = if a > 0.0 { a } else { 1.0 };
            scales[r * blocks + b] = a;
            for i in k0..k1 {
                codes[i] = e4m3_encode(x[i] / a);
            }
        }
    }
    Ok(Fp8Tensor { rows, cols, block_k, codes, scales })
}

/// The FP8 mode's GEMM in f64: `out[r, f] = g * sum_k x(r, k) * w(f, k)` over the quantized
/// values (each product exact; f64 sums). `[x.rows, w.rows]`.
///
/// # Errors
/// [`Error::InvalidShape`] when the two K differ.
pub fn gemm(x: &Fp8Tensor, weights: &Fp8Weights) -> Result<Vec<f64>> {
    let w = &weights.q;
    if x.cols != w.cols {
        return Err(Error::InvalidShape(format!("FP8 GEMM: activations K {} against weights K {}", x.cols, w.cols)));
    }
    let k = x.cols;
    // Decoded once: rows of values (the products below are then exact f64 multiplies).
    let xv: Vec<f64> = (0..x.rows * k).map(|i| x.value(i / k, i % k)).collect();
    let wv: Vec<f64> = (0..w.rows * k).map(|i| w.value(i / k, i % k)).collect();
    let g = f64::from(weights.decode_scale);
    let mut out = vec![0f64; x.rows * w.rows];
    for r in 0..x.rows {
        let xr = &xv[r * k..(r + 1) * k];
        for f in 0..w.rows {
            let wr = &wv[f * k..(f + 1) * k];
            out[r * w.rows + f] = g * xr.iter().zip(wr).map(|(a, b)| a * b).sum::<f64>();
        }
    }
    Ok(out)
}

/// The K blocks of the FP8 mode's quantizations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fp8Blocks {
    /// Weight re-expression blocks (both GEMMs).
    pub weight_k: usize,
    /// The first GEMM's input (the gathered hidden states).
    pub l1_input_k: usize,
    /// The intermediate (SwiGLU output, the second GEMM's input): one L1 tile yields 64 features
    /// per token, so 64-wide blocks keep its quantization inside the tile.
    pub intermediate_k: usize,
}

impl Default for Fp8Blocks {
    fn default() -> Self {
        Fp8Blocks { weight_k: 128, l1_input_k: 128, intermediate_k: 64 }
    }
}

/// One expert's feed-forward block on `t` tokens, `[t, hidden]` in f64, computed exactly as the
/// default (BF16-compute) layer defines it: gate and up from the dequantized W13 (gate rows
/// `[0, I)`, up rows `[I, 2I)`, decode scales `g_gate` = `w13.decode_scales[e]` and `g_up`),
/// SwiGLU rounded to BF16 (the compact intermediate), then W2.
///
/// # Errors
/// As [`ExpertWeightsHost::validate`]; [`Error::InvalidShape`] for mismatched shapes.
pub fn expert_ffn_exact(
    x: &[bf16],
    t: usize,
    w13: &ExpertWeightsHost,
    g_up: f32,
    w2: &ExpertWeightsHost,
    e: usize,
) -> Result<Vec<f64>> {
    let (hidden, inter) = check_ffn(x, t, w13, w2, e)?;
    let dense = |w: &ExpertWeightsHost| -> Vec<f64> {
        (0..w.n * w.k).map(|i| f64::from(product(w, e, i / w.k, i % w.k))).collect()
    };
    let (d13, d2) = (dense(w13), dense(w2));
    let (g_gate, g_up, g2) = (f64::from(w13.decode_scales[e]), f64::from(g_up), f64::from(w2.decode_scales[e]));
    let mut h = vec![0f64; t * inter];
    for r in 0..t {
        let xr: Vec<f64> = x[r * hidden..(r + 1) * hidden].iter().map(|v| f64::from(v.to_f32())).collect();
        for f in 0..inter {
            let dot =
                |row: usize| xr.iter().zip(&d13[row * hidden..(row + 1) * hidden]).map(|(a, b)| a * b).sum::<f64>();
            let (gate, up) = (dot(f) * g_gate, dot(inter + f) * g_up);
            h[r * inter + f] = f64::from(bf16::from_f64(gate / (1.0 + (-gate).exp()) * up).to_f32());
        }
    }
    let mut y = vec![0f64; t * hidden];
    for r in 0..t {
        for o in 0..hidden {
            y[r * hidden + o] = g2
                * h[r * inter..(r + 1) * inter]
                    .iter()
                    .zip(&d2[o * inter..(o + 1) * inter])
                    .map(|(a, b)| a * b)
                    .sum::<f64>();
        }
    }
    Ok(y)
}

/// The same block in the FP8 mode: the input quantized per token and `blocks.l1_input_k`, both
/// weights re-expressed by `rule` per row and `blocks.weight_k`, SwiGLU in f32 from the f64 gate
/// and up (as an epilogue computes it), quantized per token and `blocks.intermediate_k`.
///
/// # Errors
/// As [`expert_ffn_exact`], [`reexpress_expert`] and [`quantize_activations`].
#[allow(clippy::too_many_arguments)]
pub fn expert_ffn_fp8(
    x: &[bf16],
    t: usize,
    w13: &ExpertWeightsHost,
    g_up: f32,
    w2: &ExpertWeightsHost,
    e: usize,
    rule: Fp8WeightScale,
    blocks: Fp8Blocks,
) -> Result<Vec<f64>> {
    let (hidden, inter) = check_ffn(x, t, w13, w2, e)?;
    let xf: Vec<f32> = x[..t * hidden].iter().map(|v| v.to_f32()).collect();
    let xq = quantize_activations(&xf, t, hidden, blocks.l1_input_k)?;
    let q13 = reexpress_expert(w13, e, blocks.weight_k, rule)?;
    let q2 = reexpress_expert(w2, e, blocks.weight_k, rule)?;
    // gate_up carries g_gate on every row; the up rows are rescaled to g_up.
    let gate_up = gemm(&xq, &q13)?;
    let up_ratio = f64::from(g_up) / f64::from(w13.decode_scales[e]);
    let mut h = vec![0f32; t * inter];
    for r in 0..t {
        for f in 0..inter {
            let gate = gate_up[r * 2 * inter + f] as f32;
            let up = (gate_up[r * 2 * inter + inter + f] * up_ratio) as f32;
            h[r * inter + f] = gate / (1.0 + (-gate).exp()) * up;
        }
    }
    let hq = quantize_activations(&h, t, inter, blocks.intermediate_k)?;
    gemm(&hq, &q2)
}

fn check_ffn(
    x: &[bf16],
    t: usize,
    w13: &ExpertWeightsHost,
    w2: &ExpertWeightsHost,
    e: usize,
) -> Result<(usize, usize)> {
    w13.validate()?;
    w2.validate()?;
    let (hidden, inter) = (w13.k, w13.n / 2);
    if !w13.n.is_multiple_of(2) || w2.k != inter || w2.n != hidden || e >= w13.experts || e >= w2.experts {
        return Err(Error::InvalidShape(format!(
            "expert FFN: W13 [{}, {}, {}], W2 [{}, {}, {}], expert {e}",
            w13.experts, w13.n, w13.k, w2.experts, w2.n, w2.k
        )));
    }
    let needed = t.checked_mul(hidden).ok_or_else(|| Error::InvalidShape(format!("{t} x {hidden} overflows")))?;
    if x.len() < needed {
        return Err(Error::BufferTooSmall { name: "x", needed, actual: x.len() });
    }
    Ok((hidden, inter))
}

/// One expert `[n, k]` quantized from BF16 weights by the crate's recipe ([`super::quantize`] with
/// the decode scale [`crate::host::weight_decode_scale`] gives), as an [`ExpertWeightsHost`] of one
/// expert: what a ModelOpt checkpoint of those weights holds.
///
/// # Errors
/// As [`super::quantize`] and [`crate::host::weight_decode_scale`].
pub fn quantize_expert(x: &[bf16], n: usize, k: usize) -> Result<ExpertWeightsHost> {
    let g = crate::host::weight_decode_scale(x)?;
    let q = super::quantize(x, n, k, g, crate::layout::ScaleLayout::Linear)?;
    Ok(ExpertWeightsHost { experts: 1, n, k, codes: q.codes, scales: q.scales, decode_scales: vec![g] })
}

/// Relative errors of `y` against `reference` (`[rows, cols]`): the relative Frobenius error of
/// the whole, and the worst row's relative error (rows whose reference is all zero are skipped;
/// an all-zero reference gives 0 where `y` is zero too, else infinity).
///
/// # Panics
/// If the two lengths differ or are not a whole number of rows of `cols > 0` (a study's helper,
/// for outputs of one shape).
pub fn relative_errors(y: &[f64], reference: &[f64], cols: usize) -> (f64, f64) {
    assert!(
        cols > 0 && y.len() == reference.len() && y.len().is_multiple_of(cols),
        "relative_errors: {} against {} values in rows of {cols}",
        y.len(),
        reference.len()
    );
    let (mut num, mut den, mut worst) = (0f64, 0f64, 0f64);
    for (yr, rr) in y.chunks(cols).zip(reference.chunks(cols)) {
        let n: f64 = yr.iter().zip(rr).map(|(a, b)| (a - b) * (a - b)).sum();
        let d: f64 = rr.iter().map(|b| b * b).sum();
        num += n;
        den += d;
        if d > 0.0 {
            worst = worst.max((n / d).sqrt());
        }
    }
    let fro = if den > 0.0 {
        (num / den).sqrt()
    } else if num == 0.0 {
        0.0
    } else {
        f64::INFINITY
    };
    (fro, worst)
}

#[cfg(test)]
mod tests;
