//! Grouped activations (rows permuted by expert, one 128x4 scale region per expert): the grouped
//! quantizer and dequantizer, and the separate SwiGLU kernel (a baseline for the fused epilogue).

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;

use super::BufferInfo;
use crate::abi::{DequantizeGroupedArgs, QuantizeGroupedArgs};
use crate::error::{Error, Result};
use crate::ffi::raw;
use crate::host::{checked_len, validate_quantize_shape};
use crate::launch::{check_align, check_len, Launch};

/// Where [`quantize_nvfp4_grouped_into`] reads from: bf16 `[rows, cols]`, or an
/// [`crate::gemm::Interleaved`] GEMM output whose SwiGLU columns are quantized (declared in
/// `cpp/include/nvfp4moe/types.h`, generated).
pub use crate::abi::GroupedSource;

/// The device buffers of a grouped quantize or dequantize call as the checks see them (`x` is the
/// BF16 side: the input of a quantize, the output of a dequantize).
#[derive(Clone, Copy, Debug)]
pub struct GroupedBuffers {
    /// BF16 `[rows, cols]` (or `[rows, 2 cols]` for [`GroupedSource::InterleavedSwiglu`]).
    pub x: BufferInfo,
    /// i32 `[E + 1]`.
    pub expert_offsets: BufferInfo,
    /// f32 `[E]` or `[1]`.
    pub decode_scales: BufferInfo,
    /// Packed E2M1 codes, `[rows, cols / 2]` bytes.
    pub codes: BufferInfo,
    /// Grouped 128x4 E4M3 scales, [`crate::layout::grouped_scale_len`] bytes.
    pub scales: BufferInfo,
}

/// Validates a grouped quantize call (pure; no GPU).
///
/// # Errors
/// A bad shape, fewer than 2 expert offsets, a decode scale count that is neither 1 nor E, or a
/// buffer too small or misaligned.
pub fn check_quantize_grouped(source: GroupedSource, rows: usize, cols: usize, bufs: &GroupedBuffers) -> Result<()> {
    let (offsets_len, decode_scales_len) = (bufs.expert_offsets.len, bufs.decode_scales.len);
    validate_quantize_shape(rows, cols)?;
    if offsets_len < 2 {
        return Err(Error::InvalidShape("expert_offsets needs at least 2 entries (E + 1, E >= 1)".into()));
    }
    let experts = offsets_len - 1;
    if decode_scales_len != 1 && decode_scales_len != experts {
        return Err(Error::InvalidShape(format!(
            "need 1 shared decode scale or one per expert ({experts}), got {decode_scales_len}"
        )));
    }
    if rows > i32::MAX as usize || cols > 1 << 26 {
        return Err(Error::InvalidShape(format!("[{rows}, {cols}] is too large")));
    }
    let width = match source {
        GroupedSource::Contiguous => cols,
        GroupedSource::InterleavedSwiglu => 2 * cols,
    };
    check_len("x", bufs.x.len, rows * width)?;
    check_len("codes", bufs.codes.len, rows * cols / 2)?;
    check_len("scales", bufs.scales.len, crate::layout::grouped_scale_len(rows, experts, cols))?;
    if rows > 0 {
        check_align("x", bufs.x.addr, 16)?;
        check_align("codes", bufs.codes.addr, 8)?;
    }
    Ok(())
}

/// A grouped NVFP4 tensor's rows and how they are grouped: `rows` rows of `cols` columns permuted
/// by expert (rows of expert e are `expert_offsets[e]..expert_offsets[e + 1]`, i32 `[E + 1]` on
/// the device), with one decode scale per expert or one for all (f32 `[E]` or `[1]`, device).
#[derive(Debug)]
pub struct GroupedDesc<'a, O, G> {
    /// Rows of the `[rows, cols]` tensor (the permuted (token, slot) pairs).
    pub rows: usize,
    /// Columns (K), a multiple of 16.
    pub cols: usize,
    /// i32 `[E + 1]` on the device.
    pub expert_offsets: &'a O,
    /// f32 `[E]` or `[1]` on the device.
    pub decode_scales: &'a G,
}

/// Quantizes grouped activations `x` (as `desc` says) into codes `[rows, cols/2]` and 128x4 scales
/// with one region per expert ([`crate::layout::grouped_scale_len`] bytes, padding written 0).
/// Bit-exact with [`crate::reference::quantize_grouped`]. No host synchronization.
///
/// # Errors
/// As [`check_quantize_grouped`], or a failed launch.
pub fn quantize_nvfp4_grouped_into<X, O, G, C, S>(
    stream: &CudaStream,
    source: GroupedSource,
    x: &X,
    desc: &GroupedDesc<'_, O, G>,
    codes: &mut C,
    scales: &mut S,
) -> Result<()>
where
    X: DevicePtr<bf16>,
    O: DevicePtr<i32>,
    G: DevicePtr<f32>,
    C: DevicePtrMut<u8>,
    S: DevicePtrMut<u8>,
{
    let l = Launch::new(stream)?;
    let (x, off, g) = (l.input(x), l.input(desc.expert_offsets), l.input(desc.decode_scales));
    let (c, sc) = (l.output(codes), l.output(scales));
    let bufs = GroupedBuffers {
        x: x.info(),
        expert_offsets: off.info(),
        decode_scales: g.info(),
        codes: c.info(),
        scales: sc.info(),
    };
    check_quantize_grouped(source, desc.rows, desc.cols, &bufs)?;
    let args = QuantizeGroupedArgs {
        x: x.addr,
        source,
        rows: desc.rows as i64,
        cols: desc.cols as i64,
        expert_offsets: off.addr,
        experts: (off.len - 1) as i64,
        decode_scales: g.addr,
        num_decode_scales: g.len as i64,
        codes: c.addr,
        scales: sc.addr,
    };
    // SAFETY: check_quantize_grouped proved the lengths and alignment.
    unsafe { l.launch(&args, raw::quantize_nvfp4_grouped_can_implement, raw::quantize_nvfp4_grouped) }
}

/// Dequantizes grouped activations (the inverse of [`quantize_nvfp4_grouped_into`], e.g. the
/// output of [`crate::gemm::SwigluNvfp4`]): codes `[rows, cols/2]` + grouped scales + the decode
/// scales of `desc` -> `out` bf16 `[rows, cols]` = `bf16_rne((e2m1 * e4m3) * g)`. Rows past
/// `expert_offsets[E]` are not written. No host synchronization.
///
/// # Errors
/// As [`check_quantize_grouped`] (with `out` in the place of `x`), or a failed launch.
pub fn dequantize_nvfp4_grouped_into<C, S, O, G, X>(
    stream: &CudaStream,
    codes: &C,
    scales: &S,
    desc: &GroupedDesc<'_, O, G>,
    out: &mut X,
) -> Result<()>
where
    C: DevicePtr<u8>,
    S: DevicePtr<u8>,
    O: DevicePtr<i32>,
    G: DevicePtr<f32>,
    X: DevicePtrMut<bf16>,
{
    let l = Launch::new(stream)?;
    let (c, sc) = (l.input(codes), l.input(scales));
    let (off, g, o) = (l.input(desc.expert_offsets), l.input(desc.decode_scales), l.output(out));
    // The same lengths and alignment as the quantizer's, with `out` in the place of `x`.
    let bufs = GroupedBuffers {
        x: o.info(),
        expert_offsets: off.info(),
        decode_scales: g.info(),
        codes: c.info(),
        scales: sc.info(),
    };
    check_quantize_grouped(GroupedSource::Contiguous, desc.rows, desc.cols, &bufs)?;
    let args = DequantizeGroupedArgs {
        codes: c.addr,
        scales: sc.addr,
        rows: desc.rows as i64,
        cols: desc.cols as i64,
        expert_offsets: off.addr,
        experts: (off.len - 1) as i64,
        decode_scales: g.addr,
        num_decode_scales: g.len as i64,
        out: o.addr,
    };
    // SAFETY: check_quantize_grouped proved the lengths and alignment.
    unsafe { l.launch(&args, raw::dequantize_nvfp4_grouped_can_implement, raw::dequantize_nvfp4_grouped) }
}

/// The separate SwiGLU kernel (a baseline for the fused epilogue): `gate_up` is a plain GEMM
/// output of gate/up weights, bf16 `[rows, 2 inter]` in `[gate x8, up x8]` bands; `out` bf16
/// `[rows, inter]` = `silu(gate) * up` in FP32 from the BF16 inputs.
///
/// # Errors
/// An `inter` that is not a positive multiple of 8, a shape whose element counts overflow, a
/// buffer too small or misaligned, or a failed launch.
pub fn swiglu_bf16_into<X: DevicePtr<bf16>, O: DevicePtrMut<bf16>>(
    stream: &CudaStream,
    gate_up: &X,
    rows: usize,
    inter: usize,
    out: &mut O,
) -> Result<()> {
    if inter == 0 || !inter.is_multiple_of(8) {
        return Err(Error::InvalidShape(format!("inter must be a positive multiple of 8, got {inter}")));
    }
    let (in_len, out_len) = (checked_len(&[rows, 2, inter])?, checked_len(&[rows, inter])?);
    let l = Launch::new(stream)?;
    let (i, o) = (l.input(gate_up), l.output(out));
    check_len("gate_up", i.len, in_len)?;
    check_len("out", o.len, out_len)?;
    if rows == 0 {
        return Ok(());
    }
    check_align("gate_up", i.addr, 16)?;
    check_align("out", o.addr, 16)?;
    // SAFETY: lengths and alignment checked.
    unsafe { l.run(|st| raw::swiglu_bf16(i.addr, rows as i64, inter as i64, o.addr, st)) }
}

/// Bytes of a grouped scale buffer as the C++ core computes it (checked equal to
/// [`crate::layout::grouped_scale_len`] in tests).
pub fn core_grouped_scale_bytes(rows: usize, experts: usize, cols: usize) -> usize {
    raw::core_grouped_scale_bytes(rows as i64, experts as i64, cols as i64) as usize
}

#[cfg(test)]
mod grouped_tests {
    use super::*;

    #[test]
    fn grouped_checks() {
        let b = |addr: u64, len: usize| BufferInfo { addr, len };
        let (rows, cols, e) = (300usize, 2048usize, 8usize);
        let sl = crate::layout::grouped_scale_len(rows, e, cols);
        let (x, c, s) = (b(0x1000, rows * cols), b(0x2000, rows * cols / 2), b(0x3001, sl));
        // (source, rows, cols, expert offsets, decode scales, x, codes, scales)
        let check = |source, rows, cols, n_offsets, n_scales, x, codes, scales| {
            let bufs = GroupedBuffers {
                x,
                expert_offsets: b(0x5000, n_offsets),
                decode_scales: b(0x6000, n_scales),
                codes,
                scales,
            };
            check_quantize_grouped(source, rows, cols, &bufs)
        };
        assert!(check(GroupedSource::Contiguous, rows, cols, e + 1, e, x, c, s).is_ok());
        assert!(check(GroupedSource::Contiguous, rows, cols, e + 1, 1, x, c, s).is_ok());
        // The interleaved source is twice as wide.
        assert!(matches!(
            check(GroupedSource::InterleavedSwiglu, rows, cols, e + 1, 1, x, c, s),
            Err(Error::BufferTooSmall { name: "x", .. })
        ));
        assert!(matches!(check(GroupedSource::Contiguous, rows, cols, e + 1, 3, x, c, s), Err(Error::InvalidShape(_))));
        assert!(matches!(check(GroupedSource::Contiguous, rows, cols, 1, 1, x, c, s), Err(Error::InvalidShape(_))));
        assert!(matches!(
            check(GroupedSource::Contiguous, rows, cols, e + 1, e, x, c, b(0x3000, sl - 1)),
            Err(Error::BufferTooSmall { name: "scales", .. })
        ));
        assert!(matches!(
            check(GroupedSource::Contiguous, rows, cols, e + 1, e, b(0x1004, rows * cols), c, s),
            Err(Error::Misaligned { name: "x", .. })
        ));
        assert!(matches!(check(GroupedSource::Contiguous, rows, 40, e + 1, e, x, c, s), Err(Error::InvalidShape(_))));
        for rows in [0usize, 1, 127, 128, 5000] {
            for (e, cols) in [(1usize, 16usize), (8, 2048), (256, 768)] {
                assert_eq!(core_grouped_scale_bytes(rows, e, cols), crate::layout::grouped_scale_len(rows, e, cols));
            }
        }
    }
}
