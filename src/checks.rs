//! Host-side argument checks and stream plumbing shared by the safe launch wrappers.

use cudarc::driver::CudaStream;

use crate::error::{Error, Result};

/// `actual` elements are at least `needed`.
pub(crate) fn check_len(name: &'static str, actual: usize, needed: usize) -> Result<()> {
    if actual < needed {
        return Err(Error::BufferTooSmall { name, needed, actual });
    }
    Ok(())
}

/// The device address is a multiple of `align` bytes.
pub(crate) fn check_align(name: &'static str, addr: u64, align: usize) -> Result<()> {
    if !addr.is_multiple_of(align as u64) {
        return Err(Error::Misaligned { name, align, addr });
    }
    Ok(())
}

/// The raw stream for the core. The core launches through the CUDA runtime, which uses the
/// calling thread's current context: make it the stream's (cudarc uses the device's primary
/// context, as the runtime does).
pub(crate) fn stream_handle(stream: &CudaStream) -> Result<u64> {
    stream.context().bind_to_thread()?;
    Ok(stream.cu_stream() as u64)
}
