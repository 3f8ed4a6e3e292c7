//! The GPU quantizer and dequantizer, over cudarc slices and a [`CudaStream`].
//!
//! Every argument is validated on the host ([`check_quantize`], [`check_dequantize`]: pure
//! functions, so the error paths are tested without a GPU) before anything is enqueued. The GPU
//! output is byte-identical to [`crate::reference::quantize`] for any input.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;

use crate::abi::{DequantizeNvfp4Args, QuantizeNvfp4Args};
use crate::error::{Error, Result};
use crate::ffi::raw;
use crate::host::{validate_decode_scale, validate_quantize_shape, Nvfp4Host};
use crate::launch::{check_align, check_len, Launch};
use crate::layout::{scale_len, ScaleLayout};

/// An NVFP4 tensor `[rows, cols]` in device memory: packed E2M1 codes (`[rows, cols/2]`, element
/// 2j in the low nibble), E4M3 block-16 scales in `layout`, and the decode scale g
/// (`value = e2m1 * e4m3 * g`).
#[derive(Debug)]
pub struct Nvfp4Tensor {
    /// Packed E2M1 codes, `rows * cols / 2` bytes (at least 1).
    pub codes: CudaSlice<u8>,
    /// E4M3 block scales in `layout`, [`scale_len`] bytes (at least 1).
    pub scales: CudaSlice<u8>,
    /// Rows of the logical `[rows, cols]` tensor.
    pub rows: usize,
    /// Columns (K), a multiple of 16.
    pub cols: usize,
    /// Layout of `scales`.
    pub layout: ScaleLayout,
    /// The decode scale g.
    pub decode_scale: f32,
}

impl Nvfp4Tensor {
    /// Allocates an uninitialized tensor of this shape.
    ///
    /// # Errors
    /// A bad shape or decode scale, or a CUDA error (out of memory).
    pub fn alloc(
        stream: &Arc<CudaStream>,
        rows: usize,
        cols: usize,
        layout: ScaleLayout,
        decode_scale: f32,
    ) -> Result<Self> {
        validate_quantize_shape(rows, cols)?;
        validate_decode_scale(decode_scale)?;
        // SAFETY: both buffers are fully written by the quantizer (or by from_host) before any read.
        let codes = unsafe { stream.alloc::<u8>((rows * cols / 2).max(1))? };
        let scales = unsafe { stream.alloc::<u8>(scale_len(layout, rows, cols).max(1))? };
        Ok(Nvfp4Tensor { codes, scales, rows, cols, layout, decode_scale })
    }

    /// The tensor's shape, scale layout and decode scale.
    pub fn desc(&self) -> Nvfp4Desc {
        Nvfp4Desc { rows: self.rows, cols: self.cols, layout: self.layout, decode_scale: self.decode_scale }
    }

    /// Copies a host tensor to the device.
    ///
    /// # Errors
    /// A bad shape or decode scale, short buffers, or a CUDA error.
    pub fn from_host(stream: &Arc<CudaStream>, h: &Nvfp4Host) -> Result<Self> {
        validate_quantize_shape(h.rows, h.cols)?;
        validate_decode_scale(h.decode_scale)?;
        check_len("codes", h.codes.len(), h.rows * h.cols / 2)?;
        check_len("scales", h.scales.len(), scale_len(h.layout, h.rows, h.cols))?;
        let mut t = Self::alloc(stream, h.rows, h.cols, h.layout, h.decode_scale)?;
        if !h.codes.is_empty() {
            stream.memcpy_htod(&h.codes, &mut t.codes.slice_mut(..h.codes.len()))?;
        }
        if !h.scales.is_empty() {
            stream.memcpy_htod(&h.scales, &mut t.scales.slice_mut(..h.scales.len()))?;
        }
        Ok(t)
    }

    /// Copies the tensor back to the host (synchronizes the stream).
    ///
    /// # Errors
    /// A CUDA error (including one from earlier asynchronous work on `stream`).
    pub fn to_host(&self, stream: &Arc<CudaStream>) -> Result<Nvfp4Host> {
        let n_codes = self.rows * self.cols / 2;
        let n_scales = scale_len(self.layout, self.rows, self.cols);
        let mut codes = stream.clone_dtoh(&self.codes)?;
        let mut scales = stream.clone_dtoh(&self.scales)?;
        codes.truncate(n_codes);
        scales.truncate(n_scales);
        Ok(Nvfp4Host {
            rows: self.rows,
            cols: self.cols,
            layout: self.layout,
            decode_scale: self.decode_scale,
            codes,
            scales,
        })
    }
}

pub use crate::launch::BufferInfo;

/// Validates a quantize call: shape, decode scale, buffer lengths and alignment (x 16 bytes,
/// codes 8 bytes). Pure: no GPU needed.
///
/// # Errors
/// [`Error::InvalidShape`], [`Error::InvalidDecodeScale`], [`Error::BufferTooSmall`] or
/// [`Error::Misaligned`], naming the buffer.
pub fn check_quantize(
    rows: usize,
    cols: usize,
    decode_scale: f32,
    layout: ScaleLayout,
    x: BufferInfo,
    codes: BufferInfo,
    scales: BufferInfo,
) -> Result<()> {
    validate_quantize_shape(rows, cols)?;
    validate_decode_scale(decode_scale)?;
    check_kernel_limits(rows, cols)?;
    check_len("x", x.len, rows * cols)?;
    check_len("codes", codes.len, rows * cols / 2)?;
    check_len("scales", scales.len, scale_len(layout, rows, cols))?;
    if rows > 0 {
        check_align("x", x.addr, 16)?;
        check_align("codes", codes.addr, 8)?;
    }
    Ok(())
}

/// Validates a dequantize call: shape, decode scale, buffer lengths and alignment (codes 8 bytes,
/// out 16 bytes). Pure: no GPU needed.
///
/// # Errors
/// As [`check_quantize`].
pub fn check_dequantize(
    rows: usize,
    cols: usize,
    decode_scale: f32,
    layout: ScaleLayout,
    codes: BufferInfo,
    scales: BufferInfo,
    out: BufferInfo,
) -> Result<()> {
    validate_quantize_shape(rows, cols)?;
    validate_decode_scale(decode_scale)?;
    check_kernel_limits(rows, cols)?;
    check_len("codes", codes.len, rows * cols / 2)?;
    check_len("scales", scales.len, scale_len(layout, rows, cols))?;
    check_len("out", out.len, rows * cols)?;
    if rows > 0 {
        check_align("codes", codes.addr, 8)?;
        check_align("out", out.addr, 16)?;
    }
    Ok(())
}

/// The kernels index one row's blocks with 32 bits and launch whole 128-row tiles.
fn check_kernel_limits(rows: usize, cols: usize) -> Result<()> {
    if cols / 16 > (1 << 22) {
        return Err(Error::InvalidShape(format!("cols = {cols} exceeds the supported maximum {}", 16usize << 22)));
    }
    if rows > i64::MAX as usize / cols {
        return Err(Error::InvalidShape(format!("rows x cols = {rows} x {cols} overflows")));
    }
    Ok(())
}

/// What an NVFP4 tensor `[rows, cols]` is, apart from its bytes: its shape, the layout of its
/// scales and its decode scale g (`value = e2m1 * e4m3 * g`; the "global scale" of other libraries
/// is 1/g).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Nvfp4Desc {
    /// Rows of the logical `[rows, cols]` tensor.
    pub rows: usize,
    /// Columns (K, the block direction), a multiple of 16.
    pub cols: usize,
    /// Layout of the E4M3 block scales.
    pub layout: ScaleLayout,
    /// The per-tensor decode scale g.
    pub decode_scale: f32,
}

/// Quantizes `x` (bf16 `[rows, cols]`) into caller-provided buffers: `codes` (`rows * cols / 2`
/// bytes) and `scales` ([`scale_len`]`(layout, rows, cols)` bytes, padding written as 0), as
/// `desc` says.
///
/// # Errors
/// A bad shape or decode scale, a buffer too small or misaligned ([`check_quantize`]), or a
/// failed launch.
pub fn quantize_nvfp4_into<X, C, S>(
    stream: &CudaStream,
    x: &X,
    desc: Nvfp4Desc,
    codes: &mut C,
    scales: &mut S,
) -> Result<()>
where
    X: DevicePtr<bf16>,
    C: DevicePtrMut<u8>,
    S: DevicePtrMut<u8>,
{
    let Nvfp4Desc { rows, cols, layout, decode_scale } = desc;
    let l = Launch::new(stream)?;
    let (x, c, sc) = (l.input(x), l.output(codes), l.output(scales));
    check_quantize(rows, cols, decode_scale, layout, x.info(), c.info(), sc.info())?;
    if rows == 0 {
        return Ok(());
    }
    let args = QuantizeNvfp4Args {
        x: x.addr,
        rows: rows as i64,
        cols: cols as i64,
        decode_scale,
        layout,
        codes: c.addr,
        scales: sc.addr,
    };
    // SAFETY: check_quantize proved every buffer is large enough and aligned; the buffers' guards
    // keep their stream ordering until the launch is enqueued.
    unsafe { l.launch(&args, raw::quantize_nvfp4_can_implement, raw::quantize_nvfp4) }
}

/// Quantizes `x` (bf16 `[rows, cols]`) into a newly allocated [`Nvfp4Tensor`].
///
/// # Errors
/// As [`quantize_nvfp4_into`], or a CUDA error allocating the output.
pub fn quantize_nvfp4<X: DevicePtr<bf16>>(
    stream: &Arc<CudaStream>,
    x: &X,
    rows: usize,
    cols: usize,
    decode_scale: f32,
    layout: ScaleLayout,
) -> Result<Nvfp4Tensor> {
    validate_quantize_shape(rows, cols)?;
    check_len("x", x.len(), rows * cols)?;
    let mut t = Nvfp4Tensor::alloc(stream, rows, cols, layout, decode_scale)?;
    let desc = t.desc();
    quantize_nvfp4_into(stream, x, desc, &mut t.codes, &mut t.scales)?;
    Ok(t)
}

/// Dequantizes into a caller-provided bf16 buffer `out` (`rows * cols`):
/// `out = bf16_rne((e2m1 * e4m3) * g)`, bit-identical to [`crate::reference::dequantize`].
///
/// # Errors
/// A bad shape or decode scale, a buffer too small or misaligned ([`check_dequantize`]), or a
/// failed launch.
pub fn dequantize_nvfp4_into<C, S, O>(
    stream: &CudaStream,
    codes: &C,
    scales: &S,
    desc: Nvfp4Desc,
    out: &mut O,
) -> Result<()>
where
    C: DevicePtr<u8>,
    S: DevicePtr<u8>,
    O: DevicePtrMut<bf16>,
{
    let Nvfp4Desc { rows, cols, layout, decode_scale } = desc;
    let l = Launch::new(stream)?;
    let (c, sc, o) = (l.input(codes), l.input(scales), l.output(out));
    check_dequantize(rows, cols, decode_scale, layout, c.info(), sc.info(), o.info())?;
    if rows == 0 {
        return Ok(());
    }
    let args = DequantizeNvfp4Args {
        codes: c.addr,
        scales: sc.addr,
        rows: rows as i64,
        cols: cols as i64,
        decode_scale,
        layout,
        out: o.addr,
    };
    // SAFETY: check_dequantize proved every buffer is large enough and aligned.
    unsafe { l.launch(&args, raw::dequantize_nvfp4_can_implement, raw::dequantize_nvfp4) }
}

/// Dequantizes a tensor into a newly allocated bf16 `[rows, cols]` buffer.
///
/// # Errors
/// As [`dequantize_nvfp4_into`], or a CUDA error allocating the output.
pub fn dequantize_nvfp4(stream: &Arc<CudaStream>, t: &Nvfp4Tensor) -> Result<CudaSlice<bf16>> {
    // SAFETY: every element is written by the kernel before any read.
    let mut out = unsafe { stream.alloc::<bf16>((t.rows * t.cols).max(1))? };
    dequantize_nvfp4_into(stream, &t.codes, &t.scales, t.desc(), &mut out)?;
    Ok(out)
}

/// Bytes of the scale buffer as the C++ core computes it (checked equal to [`scale_len`] in tests).
pub fn core_scale_bytes(layout: ScaleLayout, rows: usize, cols: usize) -> usize {
    raw::core_scale_bytes(layout as i32, rows as i64, cols as i64) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    fn buf(addr: u64, len: usize) -> BufferInfo {
        BufferInfo { addr, len }
    }

    #[test]
    fn rejects_bad_shapes_before_launch() {
        let ok = |n| buf(0x1000, n);
        for cols in [0usize, 8, 24, 100] {
            let e =
                check_quantize(4, cols, 1.0, ScaleLayout::Linear, ok(1 << 20), ok(1 << 20), ok(1 << 20)).unwrap_err();
            assert!(matches!(e, Error::InvalidShape(_)), "cols={cols}: {e}");
            let e =
                check_dequantize(4, cols, 1.0, ScaleLayout::Linear, ok(1 << 20), ok(1 << 20), ok(1 << 20)).unwrap_err();
            assert!(matches!(e, Error::InvalidShape(_)), "cols={cols}: {e}");
        }
    }

    #[test]
    fn rejects_bad_decode_scale() {
        let ok = |n| buf(0x1000, n);
        for g in [0.0f32, -1.0, f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let e = check_quantize(4, 32, g, ScaleLayout::Linear, ok(128), ok(64), ok(8)).unwrap_err();
            assert!(matches!(e, Error::InvalidDecodeScale(_)), "g={g}: {e}");
        }
    }

    #[test]
    fn rejects_small_buffers() {
        let (rows, cols) = (130usize, 48usize);
        let x = buf(0x1000, rows * cols);
        let c = buf(0x2000, rows * cols / 2);
        let s_lin = buf(0x3000, rows * 3);
        let s_swz = buf(0x3000, 256 * 4);
        assert!(check_quantize(rows, cols, 1.0, ScaleLayout::Linear, x, c, s_lin).is_ok());
        assert!(check_quantize(rows, cols, 1.0, ScaleLayout::Swizzled128x4, x, c, s_swz).is_ok());
        let small = |b: BufferInfo| buf(b.addr, b.len - 1);
        let cases = [
            ("x", check_quantize(rows, cols, 1.0, ScaleLayout::Linear, small(x), c, s_lin)),
            ("codes", check_quantize(rows, cols, 1.0, ScaleLayout::Linear, x, small(c), s_lin)),
            ("scales", check_quantize(rows, cols, 1.0, ScaleLayout::Linear, x, c, small(s_lin))),
            // The swizzled layout needs its padding too: the linear size is not enough.
            ("scales", check_quantize(rows, cols, 1.0, ScaleLayout::Swizzled128x4, x, c, s_lin)),
        ];
        for (name, r) in cases {
            match r {
                Err(Error::BufferTooSmall { name: n, .. }) => assert_eq!(n, name),
                other => panic!("{name}: expected BufferTooSmall, got {other:?}"),
            }
        }
        let out = buf(0x4000, rows * cols);
        assert!(check_dequantize(rows, cols, 1.0, ScaleLayout::Linear, c, s_lin, out).is_ok());
        match check_dequantize(rows, cols, 1.0, ScaleLayout::Linear, c, s_lin, small(out)) {
            Err(Error::BufferTooSmall { name: "out", .. }) => {}
            other => panic!("expected BufferTooSmall(out), got {other:?}"),
        }
    }

    #[test]
    fn rejects_misaligned_pointers() {
        let (rows, cols) = (3usize, 32usize);
        let x = buf(0x1000, rows * cols);
        let c = buf(0x2000, rows * cols / 2);
        let s = buf(0x3001, rows * 2); // scales are bytes: any alignment is fine
        assert!(check_quantize(rows, cols, 1.0, ScaleLayout::Linear, x, c, s).is_ok());
        match check_quantize(rows, cols, 1.0, ScaleLayout::Linear, buf(0x1008, x.len), c, s) {
            Err(Error::Misaligned { name: "x", align: 16, .. }) => {}
            other => panic!("expected Misaligned(x), got {other:?}"),
        }
        match check_quantize(rows, cols, 1.0, ScaleLayout::Linear, x, buf(0x2004, c.len), s) {
            Err(Error::Misaligned { name: "codes", align: 8, .. }) => {}
            other => panic!("expected Misaligned(codes), got {other:?}"),
        }
        match check_dequantize(rows, cols, 1.0, ScaleLayout::Linear, c, s, buf(0x4002, rows * cols)) {
            Err(Error::Misaligned { name: "out", align: 16, .. }) => {}
            other => panic!("expected Misaligned(out), got {other:?}"),
        }
    }

    #[test]
    fn zero_rows_is_valid() {
        let b = buf(0, 0);
        assert!(check_quantize(0, 64, 1.0, ScaleLayout::Swizzled128x4, b, b, b).is_ok());
        assert!(check_dequantize(0, 64, 1.0, ScaleLayout::Linear, b, b, b).is_ok());
    }

    #[test]
    fn core_and_rust_agree_on_scale_sizes() {
        for rows in [0usize, 1, 127, 128, 129, 300, 4096] {
            for cols in [16usize, 48, 64, 80, 2880, 7168] {
                for layout in [ScaleLayout::Linear, ScaleLayout::Swizzled128x4] {
                    assert_eq!(
                        core_scale_bytes(layout, rows, cols),
                        scale_len(layout, rows, cols),
                        "{layout:?} {rows}x{cols}"
                    );
                }
            }
        }
    }
}

mod grouped;
pub use grouped::{
    check_quantize_grouped, core_grouped_scale_bytes, dequantize_nvfp4_grouped_into, quantize_nvfp4_grouped_into,
    swiglu_bf16_into, GroupedBuffers, GroupedDesc, GroupedSource,
};
