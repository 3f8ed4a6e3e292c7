//! Host-side weight types and their validation: what the checkpoint reader produces, what the
//! quantizers return, and what the GPU side uploads and prepares. No I/O, no GPU, no oracle:
//! [`Nvfp4Host`] (one NVFP4 tensor), [`ExpertWeightsHost`] (E experts of one projection),
//! [`MoeCheckpoint`] (one MoE layer's experts), [`ExpertNaming`], and the checks every layer above
//! uses ([`validate_quantize_shape`], [`validate_decode_scale`]) plus the weight decode scale rule
//! ([`weight_decode_scale`]).

use std::fmt;

use half::bf16;

use crate::error::{Error, Result};
use crate::format::{e2m1_decode, e4m3_decode};
use crate::layout::{scale_len, ScaleLayout, BLOCK_SIZE};

/// `RN_f32(1 / (6 * 448))`: the factor PyTorch on CUDA multiplies a weight's amax by when
/// ModelOpt divides it by `E2M1_MAX * E4M3_MAX` (see [`weight_decode_scale`]).
pub const WEIGHT_DECODE_SCALE_FACTOR: f32 = 1.0 / 2688.0;

/// An NVFP4 tensor on the host: packed E2M1 codes, E4M3 block scales in `layout`, and the f32
/// decode scale g (value = e2m1 x e4m3 x g).
#[derive(Clone, Debug, PartialEq)]
pub struct Nvfp4Host {
    /// Rows of the logical `[rows, cols]` tensor.
    pub rows: usize,
    /// Columns (K, the reduction dimension), a multiple of 16.
    pub cols: usize,
    /// Layout of `scales`.
    pub layout: ScaleLayout,
    /// The per-tensor decode scale g.
    pub decode_scale: f32,
    /// `rows * cols / 2` bytes; element 2j in the low nibble, 2j+1 in the high nibble.
    pub codes: Vec<u8>,
    /// `scale_len(layout, rows, cols)` E4M3 bytes; padding bytes are 0.
    pub scales: Vec<u8>,
}

impl Nvfp4Host {
    /// Checks that the fields agree with each other (shape, buffer lengths, decode scale), so
    /// that [`crate::reference::dequantize`] can index without going out of bounds.
    ///
    /// # Errors
    /// As [`validate_quantize_shape`] and [`validate_decode_scale`], or [`Error::BufferTooSmall`] /
    /// [`Error::InvalidShape`] for a buffer shorter or longer than the shape needs.
    pub fn validate(&self) -> Result<()> {
        validate_quantize_shape(self.rows, self.cols)?;
        validate_decode_scale(self.decode_scale)?;
        let elements = checked_elements(self.rows, self.cols)?;
        check_len("codes", self.codes.len(), elements / 2)?;
        check_len("scales", self.scales.len(), scale_len(self.layout, self.rows, self.cols))?;
        Ok(())
    }
}

/// Checks a shape for quantization: `cols` must be a positive multiple of 16 (one block is 16
/// elements along K); `rows` may be 0.
///
/// # Errors
/// [`Error::InvalidShape`].
pub fn validate_quantize_shape(rows: usize, cols: usize) -> Result<()> {
    if cols == 0 || !cols.is_multiple_of(BLOCK_SIZE) {
        return Err(Error::InvalidShape(format!(
            "cols (K) must be a positive multiple of {BLOCK_SIZE}, got {cols} (rows {rows})"
        )));
    }
    // The element count, and the swizzled scale count (rows padded to 128, at most `cols`
    // bytes a row), must fit in usize.
    match rows.checked_next_multiple_of(128).and_then(|r| r.checked_mul(cols)) {
        Some(_) => Ok(()),
        None => Err(Error::InvalidShape(format!("shape [{rows}, {cols}] is too large"))),
    }
}

/// Checks a decode scale g: it must be finite and > 0 (subnormal is allowed).
///
/// # Errors
/// [`Error::InvalidDecodeScale`].
pub fn validate_decode_scale(decode_scale: f32) -> Result<()> {
    if decode_scale.is_finite() && decode_scale > 0.0 {
        Ok(())
    } else {
        Err(Error::InvalidDecodeScale(decode_scale))
    }
}

pub(crate) fn checked_elements(rows: usize, cols: usize) -> Result<usize> {
    rows.checked_mul(cols).ok_or_else(|| Error::InvalidShape(format!("shape [{rows}, {cols}] is too large")))
}

/// Too short is `BufferTooSmall`; too long is a shape mismatch (the caller gave the wrong shape).
pub(crate) fn check_len(name: &'static str, actual: usize, needed: usize) -> Result<()> {
    if actual < needed {
        Err(Error::BufferTooSmall { name, needed, actual })
    } else if actual > needed {
        Err(Error::InvalidShape(format!("`{name}` holds {actual} elements, the shape needs {needed}")))
    } else {
        Ok(())
    }
}

/// ModelOpt's decode scale for a weight the crate quantizes itself: `g = amax / (6 * 448)` as
/// PyTorch computes it on CUDA, where ModelOpt checkpoints are exported: a tensor divided by a
/// Python scalar is multiplied by the scalar's f32 reciprocal, so `g = amax * RN_f32(1/2688)`
/// (a true division differs by one ulp for about a fifth of all amax values). amax is taken over
/// the finite elements only (so one stray Inf/NaN does not flatten the whole tensor).
///
/// # Errors
/// [`Error::Invalid`] when `x` has no finite non-zero element (no positive g follows from it).
pub fn weight_decode_scale(x: &[bf16]) -> Result<f32> {
    let amax = x.iter().map(|v| v.to_f32()).filter(|v| v.is_finite()).fold(0.0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 {
        return Err(Error::Invalid(format!(
            "cannot derive a decode scale: the tensor of {} elements has no finite non-zero element",
            x.len()
        )));
    }
    let decode_scale = amax * WEIGHT_DECODE_SCALE_FACTOR;
    validate_decode_scale(decode_scale)?;
    Ok(decode_scale)
}

/// NVFP4 weights of E experts on the host in the checkpoint (ModelOpt) layout: codes
/// `[E, n, k/2]` (element 2j in the low nibble), linear E4M3 scales `[E, n, k/16]`, and one decode
/// scale per expert.
#[derive(Clone, Debug)]
pub struct ExpertWeightsHost {
    /// Experts E.
    pub experts: usize,
    /// Output features (rows) per expert.
    pub n: usize,
    /// Input features (K) per expert, a multiple of 16.
    pub k: usize,
    /// Packed E2M1 codes, `[E, n, k/2]`.
    pub codes: Vec<u8>,
    /// Linear E4M3 block scales, `[E, n, k/16]`.
    pub scales: Vec<u8>,
    /// One decode scale g per expert.
    pub decode_scales: Vec<f32>,
}

impl ExpertWeightsHost {
    /// Checks that the buffers hold `[experts, n, k]` (codes, scales, one decode scale per expert)
    /// and that `k` is a multiple of 16.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for a `k` that is not a positive multiple of 16 or a shape whose
    /// sizes overflow, [`Error::BufferTooSmall`] for a buffer shorter than the shape needs.
    pub fn validate(&self) -> Result<()> {
        let rows = self.experts.checked_mul(self.n).ok_or_else(|| {
            Error::InvalidShape(format!("expert weights: {} x {} rows overflow", self.experts, self.n))
        })?;
        validate_quantize_shape(rows, self.k)?;
        let elements = checked_elements(rows, self.k)?;
        let need = |name: &'static str, needed: usize, actual: usize| {
            if actual < needed {
                Err(Error::BufferTooSmall { name, needed, actual })
            } else {
                Ok(())
            }
        };
        need("codes", elements / 2, self.codes.len())?;
        need("scales", elements / BLOCK_SIZE, self.scales.len())?;
        need("decode_scales", self.experts, self.decode_scales.len())
    }

    /// Weight `(e, f, kk)` exactly as the format defines it: e2m1 x e4m3 (f32, exact), without
    /// the expert's decode scale.
    ///
    /// # Panics
    /// If `(e, f, kk)` is outside `[experts, n, k]` or the buffers are shorter than that shape
    /// needs (an indexing accessor of the oracle, like slice indexing, for loops over a shape
    /// checked once); [`ExpertWeightsHost::try_weight`] returns an error instead.
    pub fn weight(&self, e: usize, f: usize, kk: usize) -> f32 {
        let row = e * self.n + f;
        let byte = self.codes[row * (self.k / 2) + kk / 2];
        let code = if kk.is_multiple_of(2) { byte & 0xF } else { byte >> 4 };
        e2m1_decode(code) * e4m3_decode(self.scales[row * (self.k / 16) + kk / 16])
    }

    /// [`ExpertWeightsHost::weight`] that checks the buffers ([`ExpertWeightsHost::validate`])
    /// and the index first.
    ///
    /// # Errors
    /// As [`ExpertWeightsHost::validate`], and [`Error::InvalidShape`] for `(e, f, kk)` outside
    /// `[experts, n, k]`.
    pub fn try_weight(&self, e: usize, f: usize, kk: usize) -> Result<f32> {
        self.validate()?;
        if e >= self.experts || f >= self.n || kk >= self.k {
            return Err(Error::InvalidShape(format!(
                "weight ({e}, {f}, {kk}) is outside [{}, {}, {}]",
                self.experts, self.n, self.k
            )));
        }
        Ok(self.weight(e, f, kk))
    }
}

/// One MoE layer's experts from a ModelOpt NVFP4 checkpoint, on the host.
#[derive(Clone, Debug)]
pub struct MoeCheckpoint {
    /// E, the number of experts.
    pub experts: usize,
    /// H, the hidden size (K of the first layer, N of the second).
    pub hidden: usize,
    /// I, the intermediate size of one expert (N of gate and of up, K of down).
    pub intermediate: usize,
    /// First layer, fused per expert as gate rows `[0, I)` then up rows `[I, 2I)`: `n = 2I`,
    /// `k = H`. `w13.decode_scales` are the gate decode scales (`weight_scale_2` of gate).
    pub w13: ExpertWeightsHost,
    /// `weight_scale_2` of the up projection per expert (may differ from the gate's: both are kept
    /// exactly). For the fused namings, which store one `weight_scale_2`, equal to the gate's.
    pub up_decode_scales: Vec<f32>,
    /// Second layer (down): `n = H`, `k = I`.
    pub w2: ExpertWeightsHost,
    /// `input_scale` of the first layer per expert: gate's (`gate_proj`, `w1`) or the fused
    /// projection's; `None` when the checkpoint has none.
    pub l1_input_scales: Option<Vec<f32>>,
    /// `input_scale` of the up projection (`up_proj`, `w3`) per expert, kept only where it differs
    /// from [`l1_input_scales`](Self::l1_input_scales) (bitwise, in some expert, or present where
    /// gate has none). `None` when up's equal gate's, are absent, or the naming is fused.
    pub up_input_scales: Option<Vec<f32>>,
    /// `input_scale` of the second layer (`down_proj`, `w2`) per expert; `None` when absent.
    pub l2_input_scales: Option<Vec<f32>>,
    /// The naming style the experts were found under.
    pub naming: ExpertNaming,
}

/// How a checkpoint names the projections of one expert.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExpertNaming {
    /// `gate_proj`, `up_proj`, `down_proj` (DeepSeek, Qwen3-MoE, Llama-4).
    GateUpDown,
    /// `w1` (gate), `w3` (up), `w2` (down) (Mixtral, under `block_sparse_moe.experts`).
    W1W3W2,
    /// `gate_up_proj` (gate rows first, then up) and `down_proj`.
    FusedGateUp,
    /// `w13` (gate rows first, then up) and `w2`.
    FusedW13,
}

impl ExpertNaming {
    /// Every naming style.
    pub const ALL: [ExpertNaming; 4] =
        [ExpertNaming::GateUpDown, ExpertNaming::W1W3W2, ExpertNaming::FusedGateUp, ExpertNaming::FusedW13];

    /// The projections of one expert in order: gate, up (one fused projection instead for the
    /// fused styles), down.
    pub fn projections(self) -> &'static [&'static str] {
        match self {
            ExpertNaming::GateUpDown => &["gate_proj", "up_proj", "down_proj"],
            ExpertNaming::W1W3W2 => &["w1", "w3", "w2"],
            ExpertNaming::FusedGateUp => &["gate_up_proj", "down_proj"],
            ExpertNaming::FusedW13 => &["w13", "w2"],
        }
    }

    /// Whether gate and up are one projection (`gate_up_proj`, `w13`) with one `weight_scale_2`.
    pub fn is_fused(self) -> bool {
        matches!(self, ExpertNaming::FusedGateUp | ExpertNaming::FusedW13)
    }
}

impl fmt::Display for ExpertNaming {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.projections().join("/"))
    }
}

impl MoeCheckpoint {
    /// Experts made in memory (no input scales, `gate_proj`/`up_proj`/`down_proj` names): E, H and
    /// I are read from `w13` (`n = 2I`, `k = H`). Not validated; see [`validate`](Self::validate).
    pub fn from_experts(w13: ExpertWeightsHost, up_decode_scales: Vec<f32>, w2: ExpertWeightsHost) -> Self {
        MoeCheckpoint {
            experts: w13.experts,
            hidden: w13.k,
            intermediate: w13.n / 2,
            w13,
            up_decode_scales,
            w2,
            l1_input_scales: None,
            up_input_scales: None,
            l2_input_scales: None,
            naming: ExpertNaming::GateUpDown,
        }
    }

    /// Checks that the sizes agree (E, H, I with every buffer and vector; H and I positive
    /// multiples of 16; at least one expert), that every decode scale is finite and > 0, and that
    /// every input scale is finite and >= 0.
    ///
    /// # Errors
    /// The first disagreement found, as [`Error::InvalidShape`], [`Error::InvalidDecodeScale`] or
    /// [`Error::Invalid`].
    pub fn validate(&self) -> Result<()> {
        let (e, h, i) = (self.experts, self.hidden, self.intermediate);
        let shape = |what: String| Err(Error::InvalidShape(format!("MoE checkpoint: {what}")));
        if e == 0 {
            return shape("no experts".to_string());
        }
        if h == 0 || !h.is_multiple_of(16) || i == 0 || !i.is_multiple_of(16) {
            return shape(format!("hidden {h} and intermediate {i} must be positive multiples of 16"));
        }
        // I and H come from the caller: 2I may not fit (every size below is then checked).
        let Some(two_i) = i.checked_mul(2) else {
            return shape(format!("intermediate {i}: 2 x I does not fit in usize"));
        };
        for (what, w, n, k) in [("w13", &self.w13, two_i, h), ("w2", &self.w2, h, i)] {
            if (w.experts, w.n, w.k) != (e, n, k) {
                return shape(format!(
                    "{what} is {} experts x [{}, {}], expected {e} x [{n}, {k}]",
                    w.experts, w.n, w.k
                ));
            }
            let codes = checked_len(&[e, n, k / 2])?;
            if w.codes.len() != codes || w.scales.len() != e * n * (k / 16) {
                return shape(format!(
                    "{what} has {} code and {} scale bytes, [{e}, {n}, {k}] needs {codes} and {}",
                    w.codes.len(),
                    w.scales.len(),
                    e * n * (k / 16)
                ));
            }
        }
        let vectors = [
            ("w13.decode_scales", Some(&self.w13.decode_scales), true),
            ("up_decode_scales", Some(&self.up_decode_scales), true),
            ("w2.decode_scales", Some(&self.w2.decode_scales), true),
            ("l1_input_scales", self.l1_input_scales.as_ref(), false),
            ("up_input_scales", self.up_input_scales.as_ref(), false),
            ("l2_input_scales", self.l2_input_scales.as_ref(), false),
        ];
        for (what, v, decode) in vectors {
            let Some(v) = v else { continue };
            if v.len() != e {
                return shape(format!("{what} has {} values for {e} experts", v.len()));
            }
            for (x, &g) in v.iter().enumerate() {
                let ok = if decode { validate_decode_scale(g).is_ok() } else { g.is_finite() && g >= 0.0 };
                if !ok {
                    let want = if decode { "finite and > 0" } else { "finite and >= 0" };
                    return Err(Error::Invalid(format!("MoE checkpoint: {what}[{x}] = {g}, must be {want}")));
                }
            }
        }
        Ok(())
    }
}

/// The element count of `dims`, or [`Error::InvalidShape`] when it overflows.
pub(crate) fn checked_len(dims: &[usize]) -> Result<usize> {
    dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).ok_or_else(|| {
        let dims: Vec<String> = dims.iter().map(|d| d.to_string()).collect();
        Error::InvalidShape(format!("[{}] is too large", dims.join(", ")))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hand-made checkpoint whose 2I does not fit in usize is an error, not an overflow panic
    /// (issue 21).
    #[test]
    fn validate_refuses_sizes_that_overflow() {
        let mut rng = crate::testing::test_rng();
        let mut ck = crate::testing::random_moe_checkpoint(&mut rng, 1, 16, 16);
        ck.validate().unwrap();
        ck.intermediate = 1 << (usize::BITS - 1);
        assert!(matches!(ck.validate(), Err(Error::InvalidShape(m)) if m.contains("2 x I")));
    }
}
