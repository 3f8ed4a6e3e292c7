//! The weights of one MoE layer, from where they come to where the GEMMs read them: BF16 experts
//! quantized on the GPU ([`quantize_bf16_experts`], the ModelOpt recipe) or an NVFP4 checkpoint in
//! either dialect ([`crate::io::load_experts`]) give a host [`MoeCheckpoint`]; [`MoeWeights::from_checkpoint`]
//! uploads it and prepares W13 (gate/up interleaved for the SwiGLU epilogue) and W2.

use std::path::Path;
use std::sync::Arc;

use cudarc::driver::CudaStream;
use half::bf16;

use crate::error::{Error, Result};
use crate::gemm::{ExpertShape, Nvfp4Weights};
use crate::host::{weight_decode_scale, ExpertWeightsHost, MoeCheckpoint};
use crate::io::{load_experts, load_modelopt};
use crate::launch::check_len;
use crate::layout::ScaleLayout;
use crate::quantize::quantize_nvfp4;

/// The prepared weights of one MoE layer: W13 (gate and up, interleaved for the SwiGLU epilogue,
/// `n = 2I`, `k = H`) and W2 (`n = H`, `k = I`).
///
/// `Send + Sync`, read-only once prepared: shared by threads and streams like [`super::MoeLayer`].
/// Dropping them while launches on any number of streams still read them is safe (with cudarc's
/// event tracking, on by default): see [`Nvfp4Weights`]' docs.
#[derive(Debug)]
pub struct MoeWeights {
    /// Gate and up, `[E, 2I, H]`, prepared in [`crate::RowOrder::GateUpBands8`] order.
    pub w13: Nvfp4Weights,
    /// Down, `[E, H, I]`.
    pub w2: Nvfp4Weights,
    /// Experts E.
    pub experts: usize,
    /// Hidden size H.
    pub hidden: usize,
    /// Expert intermediate size I.
    pub intermediate: usize,
}

impl MoeWeights {
    /// Uploads and prepares a checkpoint's experts (gate and up keep their own decode scales).
    ///
    /// # Errors
    /// A shape the grouped GEMM does not take, a bad scale byte or decode scale, or a CUDA error.
    pub fn from_checkpoint(stream: &Arc<CudaStream>, ckpt: &MoeCheckpoint) -> Result<Self> {
        let (e, h, i) = (ckpt.experts, ckpt.hidden, ckpt.intermediate);
        if !h.is_multiple_of(64) || !i.is_multiple_of(32) {
            return Err(Error::InvalidShape(format!(
                "the grouped GEMM needs hidden % 64 == 0 and intermediate % 32 == 0 (hidden {h}, intermediate {i})"
            )));
        }
        let codes = stream.clone_htod(&ckpt.w13.codes)?;
        let scales = stream.clone_htod(&ckpt.w13.scales)?;
        let shape = ExpertShape::new(e, 2 * i, h);
        let w13 = Nvfp4Weights::prepare_gate_up(
            stream,
            &codes,
            &scales,
            &ckpt.w13.decode_scales,
            &ckpt.up_decode_scales,
            shape,
        )?;
        let w2 = Nvfp4Weights::from_host(stream, &ckpt.w2)?;
        Ok(MoeWeights { w13, w2, experts: e, hidden: h, intermediate: i })
    }

    /// Quantizes BF16 expert weights with the crate's GPU quantizer (the ModelOpt recipe: one
    /// decode scale `amax / (6 * 448)` per expert and projection, E4M3 scales per 16 weights) and
    /// prepares them. See [`quantize_bf16_experts`].
    ///
    /// # Errors
    /// As [`quantize_bf16_experts`] and [`MoeWeights::from_checkpoint`].
    pub fn from_bf16(stream: &Arc<CudaStream>, w: &MoeWeightsBf16<'_>) -> Result<Self> {
        Self::from_checkpoint(stream, &quantize_bf16_experts(stream, w)?)
    }

    /// Loads `prefix` (e.g. `model.layers.3.mlp.experts`) from a ModelOpt NVFP4 checkpoint (a
    /// `.safetensors` file, a sharded index `.json`, or a directory holding one) and prepares it.
    ///
    /// # Errors
    /// As [`load_modelopt`] and [`MoeWeights::from_checkpoint`].
    pub fn from_modelopt(stream: &Arc<CudaStream>, path: impl AsRef<Path>, prefix: &str) -> Result<Self> {
        Self::from_checkpoint(stream, &load_modelopt(path, prefix)?)
    }

    /// Loads `prefix` from an NVFP4 checkpoint in either dialect (ModelOpt or compressed-tensors,
    /// detected from the files; see [`load_experts`]) and prepares it.
    ///
    /// # Errors
    /// As [`load_experts`] and [`MoeWeights::from_checkpoint`].
    pub fn from_checkpoint_files(stream: &Arc<CudaStream>, path: impl AsRef<Path>, prefix: &str) -> Result<Self> {
        Self::from_checkpoint(stream, &load_experts(path, prefix)?.checkpoint)
    }
}

/// BF16 expert weights of one MoE layer, in PyTorch's `[out, in]` orientation: `gate` and `up`
/// `[E, I, H]`, `down` `[E, H, I]`.
#[derive(Clone, Copy, Debug)]
pub struct MoeWeightsBf16<'a> {
    /// `[E, I, H]`.
    pub gate: &'a [bf16],
    /// `[E, I, H]`.
    pub up: &'a [bf16],
    /// `[E, H, I]`.
    pub down: &'a [bf16],
    /// Experts E.
    pub experts: usize,
    /// Hidden size H, a multiple of 16.
    pub hidden: usize,
    /// Expert intermediate size I, a multiple of 16.
    pub intermediate: usize,
}

/// Quantizes BF16 experts to an NVFP4 [`MoeCheckpoint`] on the GPU, one `quantize_nvfp4` launch
/// per expert and projection, each with its own decode scale `amax / (6 * 448)` over the finite
/// weights (gate and up keep separate scales, as ModelOpt's exporter writes them). The bytes equal
/// [`crate::reference::quantize`]'s. Synchronizes `stream` (the codes are read back).
///
/// # Errors
/// A bad shape or short slices ([`Error::InvalidShape`], [`Error::BufferTooSmall`]), a projection with
/// no finite non-zero weight ([`Error::Invalid`], naming it), or a CUDA error.
pub fn quantize_bf16_experts(stream: &Arc<CudaStream>, w: &MoeWeightsBf16<'_>) -> Result<MoeCheckpoint> {
    let (e, h, i) = (w.experts, w.hidden, w.intermediate);
    if e == 0 || h == 0 || i == 0 || !h.is_multiple_of(16) || !i.is_multiple_of(16) {
        return Err(Error::InvalidShape(format!(
            "experts, hidden and intermediate must be positive, hidden and intermediate multiples of 16 \
             (experts {e}, hidden {h}, intermediate {i})"
        )));
    }
    let per = h
        .checked_mul(i)
        .and_then(|v| v.checked_mul(e))
        .ok_or_else(|| Error::InvalidShape(format!("experts x hidden x intermediate overflows ({e} x {h} x {i})")))?;
    check_len("gate", w.gate.len(), per)?;
    check_len("up", w.up.len(), per)?;
    check_len("down", w.down.len(), per)?;
    let empty = |n, k| ExpertWeightsHost {
        experts: e,
        n,
        k,
        codes: Vec::with_capacity(e * n * k / 2),
        scales: Vec::with_capacity(e * n * k / 16),
        decode_scales: Vec::with_capacity(e),
    };
    let (mut w13, mut w2) = (empty(2 * i, h), empty(h, i));
    let mut up_decode_scales = Vec::with_capacity(e);
    let quantize = |what: &str, x: &[bf16], rows: usize, cols: usize| -> Result<(f32, Vec<u8>, Vec<u8>)> {
        let g = weight_decode_scale(x).map_err(|err| Error::Invalid(format!("{what}: {err}")))?;
        let xd = stream.clone_htod(x)?;
        let q = quantize_nvfp4(stream, &xd, rows, cols, g, ScaleLayout::Linear)?.to_host(stream)?;
        Ok((g, q.codes, q.scales))
    };
    let n = i * h;
    for x in 0..e {
        let (g_gate, c, sc) = quantize(&format!("expert {x} gate"), &w.gate[x * n..(x + 1) * n], i, h)?;
        w13.codes.extend_from_slice(&c);
        w13.scales.extend_from_slice(&sc);
        w13.decode_scales.push(g_gate);
        let (g_up, c, sc) = quantize(&format!("expert {x} up"), &w.up[x * n..(x + 1) * n], i, h)?;
        w13.codes.extend_from_slice(&c);
        w13.scales.extend_from_slice(&sc);
        up_decode_scales.push(g_up);
        let (g_down, c, sc) = quantize(&format!("expert {x} down"), &w.down[x * n..(x + 1) * n], h, i)?;
        w2.codes.extend_from_slice(&c);
        w2.scales.extend_from_slice(&sc);
        w2.decode_scales.push(g_down);
    }
    let ck = MoeCheckpoint::from_experts(w13, up_decode_scales, w2);
    ck.validate()?;
    Ok(ck)
}
