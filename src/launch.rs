//! The one place a launch is put together: the stream handle, each device buffer's address and
//! length (with the guard that keeps cudarc's stream ordering until the launch is enqueued), the
//! host-side length and alignment checks, and the core's status turned into a typed [`Error`].
//! Each wrapper states only what is specific to it: which buffers, how long, which `*Args`.

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};

use crate::abi::Status;
use crate::error::{Error, Result};
use crate::ffi::raw;

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

/// A core status as a typed error: a shape the core rejects is [`Error::InvalidShape`], an unknown
/// enum value [`Error::UnsupportedLayout`], a CUDA failure [`Error::Core`], anything else
/// [`Error::Rejected`]; each with the core's message.
pub(crate) fn status(raw_status: i32) -> Result<()> {
    let status = Status::from_raw(raw_status);
    if status == Some(Status::Success) {
        return Ok(());
    }
    let message = raw::last_error_message();
    Err(match status {
        Some(Status::InvalidShape) => Error::InvalidShape(message),
        Some(Status::UnsupportedLayout) => Error::UnsupportedLayout(message),
        Some(Status::CudaError) => Error::Core(message),
        Some(Status::InvalidValue) => Error::Invalid(message),
        Some(status) => Error::Rejected { status, message },
        None => Error::Core(format!("unknown status {raw_status}: {message}")),
    })
}

/// A device buffer as the checks see it: its address and its length in elements.
#[derive(Clone, Copy, Debug)]
pub struct BufferInfo {
    /// Device address.
    pub addr: u64,
    /// Length in elements.
    pub len: usize,
}

/// A device buffer as a launch sees it.
pub(crate) struct Buf<'a> {
    /// Its device address.
    pub addr: u64,
    /// Its length in elements.
    pub len: usize,
    _guard: SyncOnDrop<'a>,
}

impl Buf<'_> {
    /// Address and length, for the pure checks.
    pub fn info(&self) -> BufferInfo {
        BufferInfo { addr: self.addr, len: self.len }
    }
}

/// One launch on one stream.
pub(crate) struct Launch<'a> {
    stream: &'a CudaStream,
    handle: u64,
}

impl<'a> Launch<'a> {
    /// Makes the stream's context current on this thread (the core launches through the CUDA
    /// runtime, which uses the calling thread's context; cudarc uses the device's primary context,
    /// as the runtime does) and takes the raw stream.
    pub fn new(stream: &'a CudaStream) -> Result<Self> {
        stream.context().bind_to_thread()?;
        Ok(Launch { stream, handle: stream.cu_stream() as u64 })
    }

    /// The stream the launch is enqueued on.
    pub fn stream(&self) -> &'a CudaStream {
        self.stream
    }

    /// A buffer the launch reads.
    pub fn input<'b, T, B: DevicePtr<T>>(&'b self, buf: &'b B) -> Buf<'b> {
        let len = buf.len();
        let (addr, guard) = buf.device_ptr(self.stream);
        Buf { addr, len, _guard: guard }
    }

    /// A buffer the launch writes.
    pub fn output<'b, T, B: DevicePtrMut<T>>(&'b self, buf: &'b mut B) -> Buf<'b> {
        let len = buf.len();
        let (addr, guard) = buf.device_ptr_mut(self.stream);
        Buf { addr, len, _guard: guard }
    }

    /// Runs the core's `can_implement` on `args` (a typed error for a shape the core rejects),
    /// then enqueues `launch` with them.
    ///
    /// # Safety
    /// `launch` must be the core entry point of `args`, whose pointers the caller checked: each a
    /// live device allocation of the size the arguments imply, alive until the work finished.
    pub unsafe fn launch<A>(
        &self,
        args: &A,
        can_implement: fn(&A) -> i32,
        launch: unsafe fn(&A, u64) -> i32,
    ) -> Result<()> {
        status(can_implement(args))?;
        // SAFETY: the caller's contract.
        status(unsafe { launch(args, self.handle) })
    }

    /// Enqueues the call `f` makes with the raw stream (entry points without an `*Args` struct),
    /// and types its status.
    ///
    /// # Safety
    /// `f` must call one core entry point with arguments that the caller checked: every pointer a
    /// live device allocation of the size the arguments imply, alive until the work finished.
    pub unsafe fn run(&self, f: impl FnOnce(u64) -> i32) -> Result<()> {
        status(f(self.handle))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::{GroupedGemmArgs, QuantizeNvfp4Args};

    /// The core's can_implement runs on the host and its statuses arrive as typed errors.
    #[test]
    fn core_checks_surface_as_typed_errors() {
        let ok = QuantizeNvfp4Args { rows: 3, cols: 32, ..Default::default() };
        assert!(status(raw::quantize_nvfp4_can_implement(&ok)).is_ok());
        let bad_cols = QuantizeNvfp4Args { cols: 40, ..ok };
        match status(raw::quantize_nvfp4_can_implement(&bad_cols)) {
            Err(Error::InvalidShape(m)) => assert!(m.contains("multiple of 16"), "{m}"),
            other => panic!("{other:?}"),
        }
        let bad_g = QuantizeNvfp4Args { decode_scale: f32::NAN, ..ok };
        assert!(matches!(
            status(raw::quantize_nvfp4_can_implement(&bad_g)),
            Err(Error::Rejected { status: Status::InvalidDecodeScale, .. })
        ));
        let gemm = GroupedGemmArgs { experts: 8, n: 128, k: 256, ..Default::default() };
        assert!(status(raw::grouped_gemm_nvfp4_can_implement(&gemm)).is_ok());
        let too_many = GroupedGemmArgs { experts: crate::abi::EXPERT_LIMIT as i64 + 1, ..gemm };
        assert!(matches!(status(raw::grouped_gemm_nvfp4_can_implement(&too_many)), Err(Error::InvalidShape(_))));
    }

    /// Every count is range-checked before a launch narrows it to 32 bits, and no product is formed
    /// from unbounded factors (issue 21): each case but softmax_topk's was accepted (or overflowed,
    /// or got past the shape checks to the pointer checks) before; the limits themselves pass. The
    /// launch functions run the same checks (the GPU tests' launches go through them).
    #[test]
    fn core_range_checks_come_before_any_narrowing() {
        use crate::abi::{DequantizeGroupedArgs, PermuteArgs, PrepareWeightsArgs, QuantizeGroupedArgs};
        let shape = |r: i32| matches!(status(r), Err(Error::InvalidShape(_)));
        // Dense quantizer: rows beyond i32 (and the swizzled layout's cols beyond 2^26).
        let q = QuantizeNvfp4Args { rows: 3, cols: 32, decode_scale: 1.0, ..Default::default() };
        assert!(status(raw::quantize_nvfp4_can_implement(&q)).is_ok());
        assert!(shape(raw::quantize_nvfp4_can_implement(&QuantizeNvfp4Args { rows: 1 << 31, ..q })));
        assert!(shape(raw::quantize_nvfp4_can_implement(&QuantizeNvfp4Args { cols: 1 << 28, ..q })));
        // Grouped quantizers: more experts than any layer has.
        let g = QuantizeGroupedArgs { rows: 4, cols: 32, experts: 2, num_decode_scales: 1, ..Default::default() };
        assert!(status(raw::quantize_nvfp4_grouped_can_implement(&g)).is_ok());
        let g_many = QuantizeGroupedArgs { experts: 1 << 40, num_decode_scales: 1 << 40, ..g };
        assert!(shape(raw::quantize_nvfp4_grouped_can_implement(&g_many)));
        let d =
            DequantizeGroupedArgs { rows: 4, cols: 32, experts: 1 << 40, num_decode_scales: 1, ..Default::default() };
        assert!(shape(raw::dequantize_nvfp4_grouped_can_implement(&d)));
        // Permutation: tokens x top_k would overflow i64 (and did, before the check).
        let p = PermuteArgs { tokens: 5, top_k: 2, experts: 4, hidden_size: 64, ..Default::default() };
        assert!(status(raw::permute_and_gather_can_implement(&p)).is_ok());
        assert!(shape(raw::permute_and_gather_can_implement(&PermuteArgs { tokens: 1 << 40, top_k: 1 << 40, ..p })));
        // Weight preparation: n beyond i32, and more chunks than 32-bit block indices reach.
        let w = PrepareWeightsArgs { experts: 2, n: 128, k: 256, ..Default::default() };
        assert!(status(raw::prepare_nvfp4_weights_can_implement(&w)).is_ok());
        assert!(shape(raw::prepare_nvfp4_weights_can_implement(&PrepareWeightsArgs { n: 1 << 32, ..w })));
        let huge = PrepareWeightsArgs { experts: 1024, n: 1 << 16, k: 1 << 16, ..w };
        assert!(shape(raw::prepare_nvfp4_weights_can_implement(&huge)));
        assert!(shape(raw::prepare_nvfp4_weights_can_implement(&PrepareWeightsArgs { experts: 2048, ..w })));
        // Grouped GEMM: n x total_rows with n unbounded used to overflow inside the guard.
        let gemm = GroupedGemmArgs { experts: 8, n: 128, k: 256, total_rows: 16, ..Default::default() };
        assert!(status(raw::grouped_gemm_nvfp4_can_implement(&gemm)).is_ok());
        assert!(shape(raw::grouped_gemm_nvfp4_can_implement(&GroupedGemmArgs { n: 1 << 40, ..gemm })));
        assert!(shape(raw::grouped_gemm_nvfp4_can_implement(&GroupedGemmArgs { k: 1 << 40, ..gemm })));
        assert!(shape(raw::grouped_gemm_nvfp4_can_implement(&GroupedGemmArgs {
            experts: 1024,
            n: 1 << 16,
            k: 1 << 16,
            ..gemm
        })));
        // Only the NVFP4 epilogue reads the activation decode scales, but every launch narrows
        // their count.
        for count in [-1, 9, 1 << 40] {
            let bad = GroupedGemmArgs { num_act_decode_scales: count, ..gemm };
            assert!(shape(raw::grouped_gemm_nvfp4_can_implement(&bad)), "{count} activation decode scales");
        }
        let e_scales = GroupedGemmArgs { num_act_decode_scales: 8, ..gemm };
        assert!(status(raw::grouped_gemm_nvfp4_can_implement(&e_scales)).is_ok());
        // Permutation: rows wider than the gather's grid reaches (65535 pieces of 128 x 8).
        let widest = 65535 * 128 * 8;
        assert!(status(raw::permute_and_gather_can_implement(&PermuteArgs { hidden_size: widest, ..p })).is_ok());
        assert!(shape(raw::permute_and_gather_can_implement(&PermuteArgs { hidden_size: widest + 8, ..p })));
        // combine: top_k unbounded (the kernel takes it as an i32). Pointers are never read when
        // the shape is rejected.
        // SAFETY: the core rejects the shape before it looks at any pointer or the stream.
        let r = unsafe { raw::combine(0, 0, 0, 1 << 20, 1 << 40, 64, 0, 0) };
        assert!(shape(r));
        // softmax_topk: tokens beyond i32; swiglu_bf16: rows x inter / 8 beyond the grid's CTAs
        // (a product of unbounded factors before), inter beyond i32.
        // SAFETY: as above, each shape is rejected before any pointer or the stream is looked at.
        assert!(shape(unsafe { raw::softmax_topk(0, 1 << 40, 8, 2, false, 0, 0, 0) }));
        assert!(shape(unsafe { raw::swiglu_bf16(0, 1 << 40, 16, 0, 0) }));
        assert!(shape(unsafe { raw::swiglu_bf16(0, 1 << 30, 1 << 16, 0, 0) }));
        assert!(shape(unsafe { raw::swiglu_bf16(0, 1, 1 << 32, 0, 0) }));
        // At the limit the shape passes and the null pointers are what is refused.
        let null = |r: i32| matches!(status(r), Err(Error::Rejected { status: Status::NullPointer, .. }));
        assert!(null(unsafe { raw::swiglu_bf16(0, 0x7FFF_FFFF * 256 / 2, 16, 0, 0) }));
    }
}
