//! The CPU/f64 oracle, and nothing else: every GPU kernel is tested against it.
//!
//! - this file: NVFP4 quantization and dequantization (dense and grouped), one GEMM element and
//!   one SwiGLU element in f64;
//! - [`routing`]: softmax top-k, the stable permutation, combine, and a whole MoE layer in f64;
//! - [`fp8`]: the FP8-compute mode's quantizations and GEMM (issue 23), and its error against the
//!   exact expert block.
//!
//! The host types it reads and returns ([`Nvfp4Host`], [`ExpertWeightsHost`]) and their checks
//! live in [`crate::host`].
//!
//! The CPU reference of NVFP4 quantization: the pinned recipe of `design/NVFP4.md`, written
//! plainly in f32 so that it is the oracle every GPU quantizer, fused epilogue and dequantizer is
//! compared against byte for byte.
//!
//! Every step is one IEEE f32 operation with round-to-nearest-even and a true division, in the
//! order the recipe gives; do not "simplify" the arithmetic (a reciprocal multiply, a fused
//! multiply-add or a reordered product changes bytes at ties).

use half::bf16;

pub mod fp8;
pub mod routing;

/// The weight decode scale rule, defined in [`crate::host`] (production code uses it); kept at
/// this path too because `benches/quantize.rs`, which is being reworked elsewhere, calls it here.
pub use crate::host::weight_decode_scale;

use crate::error::{Error, Result};
use crate::format::{e2m1_decode, e2m1_encode, e4m3_decode, e4m3_encode, E4M3_MAX, E4M3_NAN_BYTE};
use crate::host::{
    check_len, checked_elements, validate_decode_scale, validate_quantize_shape, ExpertWeightsHost, Nvfp4Host,
};
use crate::layout::{
    grouped_scale_len, grouped_swizzled_offset, scale_cols, scale_len, scale_offset, validate_expert_offsets,
    ScaleLayout, BLOCK_SIZE,
};

/// Largest E2M1 magnitude; the block scale maps the block's amax onto it.
const E2M1_MAX: f32 = 6.0;

/// One quantized block of 16 elements: its E4M3 scale byte and its unpacked E2M1 codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockQuant {
    /// E4M3 scale byte (0x7F for a block holding a NaN).
    pub scale: u8,
    /// One 4-bit code per element (`sign << 3 | magnitude index`), unpacked.
    pub codes: [u8; 16],
}

/// Smallest positive E4M3 value (the subnormal 2^-9): recipe v2 clamps block scales to it.
const E4M3_MIN: f32 = 1.0 / 512.0;

/// Quantizes one block with decode scale `g` (value = e2m1 x e4m3 x g) by recipe v2 of
/// `design/NVFP4.md`, which is ModelOpt 0.47's `NVFP4QTensor.quantize` as it runs on CUDA:
///
/// 1. a NaN anywhere gives scale 0x7F and all codes 0 (the crate's own rule; checked first, so it
///    wins over Inf);
/// 2. `amax = max |x_i|`; `t = amax / (6 * g)` (the product rounded first); `t == 0` (an all-zero
///    block, or a quotient that underflows) becomes 1.0; `t` is clamped to `[2^-9, 448]` (an
///    infinite amax saturates to 448, the crate's rule for Inf); `s = e4m3_rne(t)`;
/// 3. `d = e4m3(s) * g`;
/// 4. `q_i = x_i / d` (a true division); the magnitude index is `q_i` rounded to the nearest E2M1
///    value (ties to even, saturating at 6; a NaN quotient, 0/0 when `d` underflows, counts as
///    above every decision point, as PyTorch's `searchsorted` puts it); the sign bit is `q_i < 0`,
///    so -0.0 gives code 0 and a negative that rounds to zero code 8. An infinite element gets
///    ±6 (code 7 or 15) whatever `d` is (the crate's rule).
///
/// The recipe needs `g` finite and > 0 (see [`validate_decode_scale`]); other `g` never panic but
/// give meaningless bytes.
pub fn quantize_block(x: &[f32; 16], decode_scale: f32) -> BlockQuant {
    if x.iter().any(|v| v.is_nan()) {
        return BlockQuant { scale: E4M3_NAN_BYTE, codes: [0; 16] };
    }
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let scale = block_scale_byte(amax, decode_scale);
    let block_decode = e4m3_decode(scale) * decode_scale;
    let mut codes = [0u8; 16];
    for (code, &v) in codes.iter_mut().zip(x) {
        *code = element_code(v, block_decode);
    }
    BlockQuant { scale, codes }
}

/// Step 2 of [`quantize_block`]: the E4M3 scale byte of a block whose amax (`max |x_i|`, not NaN)
/// is `amax`. The block's `d` is then `e4m3_decode(scale) * decode_scale` (step 3).
#[inline]
pub fn block_scale_byte(amax: f32, decode_scale: f32) -> u8 {
    let mut t = if amax.is_infinite() { E4M3_MAX } else { amax / (E2M1_MAX * decode_scale) };
    if t == 0.0 {
        t = 1.0;
    }
    // `t` is not NaN here: amax is finite and 6g > 0 (or +Inf, giving t = 0 -> 1).
    e4m3_encode(t.clamp(E4M3_MIN, E4M3_MAX))
}

/// Step 4 of [`quantize_block`]: the 4-bit code of one non-NaN element `v` of a block whose
/// `d = e4m3(s) * g` is `block_decode`.
#[inline]
pub fn element_code(v: f32, block_decode: f32) -> u8 {
    if v.is_infinite() {
        0x7 | (((v < 0.0) as u8) << 3)
    } else {
        let q = v / block_decode;
        let magnitude = if q.is_nan() { 0x7 } else { e2m1_encode(q) & 0x7 };
        magnitude | (((q < 0.0) as u8) << 3)
    }
}

/// Quantizes the 16-element blocks of one row into packed codes (`row_codes`, cols/2 bytes) and
/// hands each block's scale to `store_scale(block index, byte)`.
fn quantize_row(row: &[bf16], decode_scale: f32, row_codes: &mut [u8], mut store_scale: impl FnMut(usize, u8)) {
    for (k, (block, block_codes)) in
        row.chunks_exact(BLOCK_SIZE).zip(row_codes.chunks_exact_mut(BLOCK_SIZE / 2)).enumerate()
    {
        let mut values = [0.0f32; 16];
        for (v, b) in values.iter_mut().zip(block) {
            *v = b.to_f32();
        }
        let q = quantize_block(&values, decode_scale);
        for (byte, pair) in block_codes.iter_mut().zip(q.codes.chunks_exact(2)) {
            *byte = pair[0] | (pair[1] << 4);
        }
        store_scale(k, q.scale);
    }
}

/// Quantizes a row-major BF16 `[rows, cols]` tensor with decode scale g, writing the scales in
/// `layout` (padding bytes 0).
///
/// # Errors
/// A bad shape or decode scale, or `x` not of `rows * cols` elements.
pub fn quantize(x: &[bf16], rows: usize, cols: usize, decode_scale: f32, layout: ScaleLayout) -> Result<Nvfp4Host> {
    validate_quantize_shape(rows, cols)?;
    validate_decode_scale(decode_scale)?;
    check_len("x", x.len(), checked_elements(rows, cols)?)?;
    let mut codes = vec![0u8; rows * cols / 2];
    let mut scales = vec![0u8; scale_len(layout, rows, cols)];
    for (m, (row, row_codes)) in x.chunks_exact(cols).zip(codes.chunks_exact_mut(cols / 2)).enumerate() {
        quantize_row(row, decode_scale, row_codes, |k, s| {
            scales[scale_offset(layout, rows, cols, m, k)] = s;
        });
    }
    Ok(Nvfp4Host { rows, cols, layout, decode_scale, codes, scales })
}

/// Quantizes an f32 tensor: the quantizer takes BF16, so each element is first rounded to BF16
/// (round-to-nearest-even), then [`quantize`]d.
///
/// # Errors
/// As [`quantize`].
pub fn quantize_f32(x: &[f32], rows: usize, cols: usize, decode_scale: f32, layout: ScaleLayout) -> Result<Nvfp4Host> {
    let rounded: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
    quantize(&rounded, rows, cols, decode_scale, layout)
}

/// Decodes one element in the pinned order, which the GPU dequantizer mirrors:
/// `bf16_rne((e2m1(code) * e4m3(scale)) * g)`. The first product is exact in f32; the multiply by
/// g is one f32 rounding; then one rounding to BF16. A NaN scale gives NaN.
#[inline]
pub fn dequantize_element(code: u8, scale: u8, decode_scale: f32) -> bf16 {
    let s = e4m3_decode(scale);
    if s.is_nan() {
        // Pinned to the canonical bf16 NaN (0x7FC0), as the GPU dequantizer writes it.
        return bf16::from_bits(0x7FC0);
    }
    bf16::from_f32((e2m1_decode(code) * s) * decode_scale)
}

/// Dequantizes to a row-major BF16 `[rows, cols]` tensor (see [`dequantize_element`] for the
/// arithmetic).
///
/// # Panics
/// If the fields of `q` disagree (a hand-built [`Nvfp4Host`]; [`quantize`] never makes one);
/// [`try_dequantize`] returns an error instead.
pub fn dequantize(q: &Nvfp4Host) -> Vec<bf16> {
    match try_dequantize(q) {
        Ok(v) => v,
        Err(e) => panic!("dequantize: inconsistent Nvfp4Host: {e}"),
    }
}

/// [`dequantize`] that checks the fields of `q` first ([`Nvfp4Host::validate`]).
///
/// # Errors
/// As [`Nvfp4Host::validate`].
pub fn try_dequantize(q: &Nvfp4Host) -> Result<Vec<bf16>> {
    q.validate()?;
    let (rows, cols) = (q.rows, q.cols);
    let mut out = Vec::with_capacity(rows * cols);
    for (m, row_codes) in q.codes.chunks_exact(cols / 2).enumerate() {
        for (k, block_codes) in row_codes.chunks_exact(BLOCK_SIZE / 2).enumerate() {
            let scale = q.scales[scale_offset(q.layout, rows, cols, m, k)];
            for &byte in block_codes {
                out.push(dequantize_element(byte & 0xF, scale, q.decode_scale));
                out.push(dequantize_element(byte >> 4, scale, q.decode_scale));
            }
        }
    }
    Ok(out)
}

/// Quantizes expert-permuted activations `[total_rows, cols]` (rows of expert e are
/// `expert_offsets[e]..expert_offsets[e+1]`) into packed codes and a grouped swizzled scale buffer
/// of [`grouped_scale_len`] bytes (padding 0), one 128-row-aligned region per expert
/// (TensorRT-LLM's convention). Rows of expert e use `decode_scales[e]`, or `decode_scales[0]`
/// for all experts when one shared scale is given.
///
/// # Errors
/// Bad expert offsets, shape or decode scales, a decode scale count neither 1 nor E, or `x` of the
/// wrong length.
pub fn quantize_grouped(
    x: &[bf16],
    expert_offsets: &[i32],
    cols: usize,
    decode_scales: &[f32],
) -> Result<(Vec<u8>, Vec<u8>)> {
    let num_experts = expert_offsets.len().saturating_sub(1);
    let total_rows = expert_offsets.last().map_or(0, |&t| t.max(0) as usize);
    validate_expert_offsets(expert_offsets, total_rows)?;
    validate_quantize_shape(total_rows, cols)?;
    if decode_scales.len() != 1 && decode_scales.len() != num_experts {
        return Err(Error::InvalidShape(format!(
            "need 1 shared decode scale or one per expert ({num_experts}), got {}",
            decode_scales.len()
        )));
    }
    for &g in decode_scales {
        validate_decode_scale(g)?;
    }
    check_len("x", x.len(), checked_elements(total_rows, cols)?)?;
    // grouped_scale_len, overflow-checked.
    let scales_len = num_experts
        .checked_mul(127)
        .and_then(|r| r.checked_add(total_rows))
        .and_then(|r| r.checked_next_multiple_of(128))
        .and_then(|r| r.checked_mul(scale_cols(cols).next_multiple_of(4)))
        .ok_or_else(|| Error::InvalidShape(format!("grouped shape [{total_rows}, {cols}] is too large")))?;
    debug_assert_eq!(scales_len, grouped_scale_len(total_rows, num_experts, cols));

    let mut codes = vec![0u8; total_rows * cols / 2];
    let mut scales = vec![0u8; scales_len];
    for e in 0..num_experts {
        let g = decode_scales[if decode_scales.len() == 1 { 0 } else { e }];
        let (begin, end) = (expert_offsets[e] as usize, expert_offsets[e + 1] as usize);
        for row in begin..end {
            let x_row = &x[row * cols..(row + 1) * cols];
            let row_codes = &mut codes[row * cols / 2..(row + 1) * cols / 2];
            quantize_row(x_row, g, row_codes, |k, s| {
                scales[grouped_swizzled_offset(expert_offsets, row, k, cols)] = s;
            });
        }
    }
    Ok((codes, scales))
}

/// One element of the grouped GEMM, in f64: `sum_k x[row, k] * w_e[f, k] * g_e` where `e` is the
/// expert owning `row` (the CPU oracle for the GPU kernel).
///
/// # Panics
/// If `row` is not a row of `x` (`[rows, w.k]`) or `(e, f)` not a row of `w` (an indexing
/// helper of the GPU tests, like slice indexing, for loops over a shape checked once);
/// [`try_grouped_gemm_element`] returns an error instead.
pub fn grouped_gemm_element(x: &[bf16], w: &ExpertWeightsHost, e: usize, row: usize, f: usize) -> f64 {
    let k = w.k;
    let xr = &x[row * k..(row + 1) * k];
    let mut acc = 0.0f64;
    for (kk, xv) in xr.iter().enumerate() {
        acc += f64::from(xv.to_f32()) * f64::from(w.weight(e, f, kk));
    }
    acc * f64::from(w.decode_scales[e])
}

/// SwiGLU of one (row, feature) of the first MoE GEMM, in f64: `silu(gate) * up` with
/// `gate = x[row] . W[e, f] * g_gate` and `up = x[row] . W[e, I + f] * g_up`, where `w` holds per
/// expert the gate rows `[0, I)` then the up rows `[I, 2I)` (the CPU oracle of the SwiGLU
/// epilogues). Returns (gate, swiglu).
///
/// # Panics
/// As [`grouped_gemm_element`], for `f` and `I + f`; [`try_swiglu_element`] returns an error
/// instead.
pub fn swiglu_element(
    x: &[bf16],
    w: &ExpertWeightsHost,
    e: usize,
    row: usize,
    f: usize,
    gate_scale: f32,
    up_scale: f32,
) -> (f64, f64) {
    let (k, inter) = (w.k, w.n / 2);
    let xr = &x[row * k..(row + 1) * k];
    let (mut g, mut u) = (0.0f64, 0.0f64);
    for (kk, xv) in xr.iter().enumerate() {
        let xv = f64::from(xv.to_f32());
        g += xv * f64::from(w.weight(e, f, kk));
        u += xv * f64::from(w.weight(e, inter + f, kk));
    }
    let (g, u) = (g * f64::from(gate_scale), u * f64::from(up_scale));
    (g, g / (1.0 + (-g).exp()) * u)
}

/// Checks what [`grouped_gemm_element`] and [`swiglu_element`] index: `w`'s buffers, expert
/// `e`, output rows `fs` of `w`, and row `row` of `x` (`[rows, w.k]`).
fn check_element(x: &[bf16], w: &ExpertWeightsHost, e: usize, row: usize, fs: &[usize]) -> Result<()> {
    w.validate()?;
    if e >= w.experts || w.decode_scales.len() <= e {
        return Err(Error::InvalidShape(format!("expert {e} of {} experts", w.experts)));
    }
    if let Some(f) = fs.iter().find(|&&f| f >= w.n) {
        return Err(Error::InvalidShape(format!("feature {f} of {} (expert {e})", w.n)));
    }
    let end = row.checked_add(1).and_then(|r| r.checked_mul(w.k));
    match end {
        Some(end) if end <= x.len() => Ok(()),
        _ => Err(Error::InvalidShape(format!("row {row} of x is past its {} elements ([rows, {}])", x.len(), w.k))),
    }
}

/// [`grouped_gemm_element`] that checks its arguments first.
///
/// # Errors
/// [`Error::InvalidShape`] or [`Error::BufferTooSmall`] for weights whose buffers do not hold
/// their shape (see [`ExpertWeightsHost::validate`]), an expert or feature outside `w`, or a row
/// outside `x`.
pub fn try_grouped_gemm_element(x: &[bf16], w: &ExpertWeightsHost, e: usize, row: usize, f: usize) -> Result<f64> {
    check_element(x, w, e, row, &[f])?;
    Ok(grouped_gemm_element(x, w, e, row, f))
}

/// [`swiglu_element`] that checks its arguments first (`w.n` even, `f` and `w.n / 2 + f` rows of
/// `w`).
///
/// # Errors
/// As [`try_grouped_gemm_element`], and [`Error::InvalidShape`] for an odd `w.n` or `f` not in
/// `[0, w.n / 2)`.
pub fn try_swiglu_element(
    x: &[bf16],
    w: &ExpertWeightsHost,
    e: usize,
    row: usize,
    f: usize,
    gate_scale: f32,
    up_scale: f32,
) -> Result<(f64, f64)> {
    if !w.n.is_multiple_of(2) || f >= w.n / 2 {
        return Err(Error::InvalidShape(format!(
            "SwiGLU feature {f} of gate/up weights with {} rows (gate rows [0, n/2), up rows [n/2, n))",
            w.n
        )));
    }
    check_element(x, w, e, row, &[f, w.n / 2 + f])?;
    Ok(swiglu_element(x, w, e, row, f, gate_scale, up_scale))
}

#[cfg(test)]
mod tests;
