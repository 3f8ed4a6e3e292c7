//! The MoE layer as a candle operation (the `candle` feature, candle-core 0.11): [`MoeOp`] is a
//! `candle_core::CustomOp3` over `(hidden, topk_ids, topk_weights)`, so a candle model calls the
//! layer as `hidden.apply_op3_no_bwd(&ids, &weights, &op)`.
//!
//! The tensors must be on a CUDA device (the one the layer's weights were prepared on), contiguous,
//! of dtypes bf16 `[T, H]`, i32 `[T, k]` and f32 `[T, k]`. The forward runs on candle's stream for
//! the device, with a workspace sized once for `max_tokens x max_top_k` and reused; the output is a
//! new bf16 `[T, H]` tensor. There is no CPU implementation (the layer is a GPU kernel; the f64
//! oracle is [`crate::reference::routing::moe_layer`]).

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CudaStorage, DType, Layout, Shape};
use cudarc::driver::CudaSlice;
use half::bf16;

use crate::moe::{MoeInput, MoeLayer, MoeWorkspace};

/// [`MoeLayer`] as a `candle_core::CustomOp3`.
#[derive(Debug)]
pub struct MoeOp {
    layer: MoeLayer,
    workspace: Mutex<MoeWorkspace>,
}

impl MoeOp {
    /// Wraps `layer`, with its workspace allocated on `device`'s stream.
    ///
    /// # Errors
    /// A CUDA error allocating the workspace.
    pub fn new(layer: MoeLayer, device: &candle_core::CudaDevice) -> crate::Result<Self> {
        let workspace = layer.workspace(&device.cuda_stream())?;
        Ok(MoeOp { layer, workspace: Mutex::new(workspace) })
    }

    /// The wrapped layer.
    pub fn layer(&self) -> &MoeLayer {
        &self.layer
    }
}

fn err(e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("nvfp4-moe: {e}"))
}

/// The contiguous `[rows, cols]` view of a 2-D input, or an error naming it.
fn matrix(name: &str, l: &Layout, dtype: DType, want: DType) -> candle_core::Result<(usize, usize, usize, usize)> {
    if dtype != want {
        return Err(err(format!("{name} must be {want:?}, got {dtype:?}")));
    }
    let &[rows, cols] = l.dims() else {
        return Err(err(format!("{name} must be 2-D, got shape {:?}", l.dims())));
    };
    let Some((start, end)) = l.contiguous_offsets() else {
        return Err(err(format!("{name} must be contiguous")));
    };
    Ok((rows, cols, start, end))
}

impl candle_core::CustomOp3 for MoeOp {
    fn name(&self) -> &'static str {
        "nvfp4-moe"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(err("the MoE layer runs on a CUDA device only"))
    }

    fn cuda_fwd(
        &self,
        hidden: &CudaStorage,
        lh: &Layout,
        ids: &CudaStorage,
        li: &Layout,
        weights: &CudaStorage,
        lw: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let (tokens, h, hs, he) = matrix("hidden", lh, hidden.dtype(), DType::BF16)?;
        let (ti, top_k, is, ie) = matrix("topk_ids", li, ids.dtype(), DType::I32)?;
        let (tw, kw, ws, we) = matrix("topk_weights", lw, weights.dtype(), DType::F32)?;
        if ti != tokens || tw != tokens || kw != top_k {
            return Err(err(format!(
                "topk_ids {:?} and topk_weights {:?} must both be [{tokens}, k]",
                li.dims(),
                lw.dims()
            )));
        }
        if h != self.layer.weights().hidden {
            return Err(err(format!("hidden size {h}, the layer's is {}", self.layer.weights().hidden)));
        }
        let device = hidden.device().clone();
        let stream = device.cuda_stream();
        let x = hidden.as_cuda_slice::<bf16>()?.slice(hs..he);
        let i = ids.as_cuda_slice::<i32>()?.slice(is..ie);
        let w = weights.as_cuda_slice::<f32>()?.slice(ws..we);
        // SAFETY: every element is written by the forward's combine before any read.
        let mut out: CudaSlice<bf16> = unsafe { stream.alloc::<bf16>((tokens * h).max(1)) }.map_err(err)?;
        let input = MoeInput { hidden: &x, tokens, topk_ids: &i, topk_weights: &w, top_k };
        let mut ws = self.workspace.lock().map_err(|_| err("workspace lock poisoned"))?;
        self.layer.forward(&stream, &input, &mut out, &mut ws).map_err(err)?;
        Ok((CudaStorage::wrap_cuda_slice(out, device), Shape::from_dims(&[tokens, h])))
    }
}
