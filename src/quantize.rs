//! The GPU quantizer and dequantizer, over cudarc slices and a [`CudaStream`].
//!
//! Every argument is validated on the host ([`check_quantize`], [`check_dequantize`]: pure
//! functions, so the error paths are tested without a GPU) before anything is enqueued. The GPU
//! output is byte-identical to [`crate::reference::quantize`] for any input.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;

use crate::abi::{DequantizeGroupedArgs, DequantizeNvfp4Args, QuantizeGroupedArgs, QuantizeNvfp4Args};
use crate::error::{Error, Result};
use crate::ffi::raw;
use crate::launch::{check_align, check_len, Launch};
use crate::layout::{scale_len, ScaleLayout};
use crate::reference::{validate_decode_scale, validate_quantize_shape, Nvfp4Host};

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

/// A device buffer as the checks see it: its address and its length in elements.
#[derive(Clone, Copy, Debug)]
pub struct BufferInfo {
    /// Device address.
    pub addr: u64,
    /// Length in elements.
    pub len: usize,
}

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
/// An `inter` that is not a positive multiple of 8, a buffer too small or misaligned, or a failed
/// launch.
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
    let l = Launch::new(stream)?;
    let (i, o) = (l.input(gate_up), l.output(out));
    check_len("gate_up", i.len, rows * 2 * inter)?;
    check_len("out", o.len, rows * inter)?;
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
