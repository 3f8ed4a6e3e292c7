//! The GPU quantizer of `convert`: the crate's CUDA kernel (`quantize_nvfp4_into`) on one GPU,
//! with device buffers kept between tensors (grown, never shrunk).

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use half::bf16;

use super::{Quantizer, BLOCK};
use crate::error::{Error, Result};
use crate::layout::ScaleLayout;
use crate::quantize::{quantize_nvfp4_into, Nvfp4Desc};

/// The CUDA quantizer on one GPU: the same bytes as [`super::CpuQuantizer`] (the GPU tests check
/// it).
#[derive(Debug)]
pub struct CudaQuantizer {
    stream: Arc<CudaStream>,
    ordinal: usize,
    x: Option<CudaSlice<bf16>>,
    codes: Option<CudaSlice<u8>>,
    scales: Option<CudaSlice<u8>>,
}

impl CudaQuantizer {
    /// On GPU `ordinal`.
    ///
    /// # Errors
    /// [`Error::Driver`] when the GPU cannot be opened.
    pub fn new(ordinal: usize) -> Result<Self> {
        let ctx = CudaContext::new(ordinal)?;
        Ok(CudaQuantizer { stream: ctx.default_stream(), ordinal, x: None, codes: None, scales: None })
    }
}

/// `slot` holding at least `n` elements (a new, larger buffer when it holds fewer).
fn ensure<'a, T: DeviceRepr + ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    slot: &'a mut Option<CudaSlice<T>>,
    n: usize,
) -> Result<&'a mut CudaSlice<T>> {
    if slot.as_ref().is_none_or(|s| s.len() < n) {
        *slot = None;
        *slot = Some(stream.alloc_zeros::<T>(n.max(1))?);
    }
    slot.as_mut().ok_or_else(|| Error::Core("device buffer missing".into()))
}

impl Quantizer for CudaQuantizer {
    fn quantize(
        &mut self,
        x: &[bf16],
        rows: usize,
        cols: usize,
        g: f32,
        codes: &mut [u8],
        scales: &mut [u8],
    ) -> Result<()> {
        super::check_quantize_args(x.len(), rows, cols, g, codes.len(), scales.len())?;
        let n = rows * cols;
        if n == 0 {
            return Ok(());
        }
        let stream = self.stream.clone();
        let xd = ensure(&stream, &mut self.x, n)?;
        stream.memcpy_htod(x, &mut xd.slice_mut(0..n))?;
        let cd = ensure(&stream, &mut self.codes, n / 2)?;
        let sd = ensure(&stream, &mut self.scales, n / BLOCK)?;
        let xd = self.x.as_ref().ok_or_else(|| Error::Core("device buffer missing".into()))?;
        let desc = Nvfp4Desc { rows, cols, layout: ScaleLayout::Linear, decode_scale: g };
        quantize_nvfp4_into(
            &stream,
            &xd.slice(0..n),
            desc,
            &mut cd.slice_mut(0..n / 2),
            &mut sd.slice_mut(0..n / BLOCK),
        )?;
        stream.memcpy_dtoh(&cd.slice(0..n / 2), codes)?;
        stream.memcpy_dtoh(&sd.slice(0..n / BLOCK), scales)?;
        stream.synchronize()?;
        Ok(())
    }

    fn describe(&self) -> String {
        format!("cuda (GPU {})", self.ordinal)
    }
}
