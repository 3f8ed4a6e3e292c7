//! Safetensors input and output: a 2-D BF16 (or F32) matrix, a BF16 result, and one ModelOpt NVFP4
//! weight (`weight`, `weight_scale`, `weight_scale_2`).
//!
//! Every problem with a tensor (missing, wrong dtype, wrong shape, bad value) is an
//! [`Error::Tensor`] naming it; an unreadable file is an [`Error::Io`] naming the path; a malformed
//! file is an [`Error::Invalid`] naming it. Files are written with a fixed tensor order (safetensors sorts
//! by dtype, then name), so the same tensors always give the same bytes.

use std::borrow::Cow;
use std::path::Path;

use half::bf16;
use safetensors::tensor::{Dtype, TensorInfo};

use super::safetensors::{check_dtype, shape_str, tensor_err, view, write_tensors, SafetensorsFile};
#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;

/// The dtype a matrix had in its file before [`read_matrix_bf16`] turned it into BF16.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourceDtype {
    /// Stored as BF16: read as is.
    Bf16,
    /// Stored as F32: rounded to BF16 (round-to-nearest-even).
    F32,
}

impl SourceDtype {
    /// The safetensors name of the dtype (`BF16`, `F32`).
    pub fn name(self) -> &'static str {
        match self {
            SourceDtype::Bf16 => "BF16",
            SourceDtype::F32 => "F32",
        }
    }
}

/// One NVFP4 weight as ModelOpt checkpoints store it: `codes` `[rows, cols/2]` (element 2j in the
/// low nibble), `scales` E4M3 `[rows, cols/16]` in the linear layout, and the decode scale g
/// (`weight_scale_2`, `value = e2m1 * e4m3 * g`).
#[derive(Clone, Debug, PartialEq)]
pub struct ModelOptWeight {
    /// Packed E2M1 codes, `[rows, cols/2]`.
    pub codes: Vec<u8>,
    /// E4M3 block-16 scales, `[rows, cols/16]`, linear (row-major).
    pub scales: Vec<u8>,
    /// The decode scale g (`weight_scale_2`).
    pub decode_scale: f32,
    /// Rows (N, output features).
    pub rows: usize,
    /// Columns of the unpacked weight (K, input features); a multiple of 16.
    pub cols: usize,
}

/// Reads the 2-D tensor `name` as BF16 `(data, rows, cols, source dtype)`. BF16 is read as is; F32
/// is rounded to BF16 (round-to-nearest-even, NaN and infinities kept) and reported as
/// [`SourceDtype::F32`]. A finite F32 value that rounds beyond the BF16 range is an error naming
/// the tensor and the first such index (it would silently become an infinity). Any other dtype,
/// or a tensor that is not 2-D or has a zero-sized dimension, is an [`Error::Tensor`].
///
/// # Errors
/// An unreadable file ([`Error::Io`]), a malformed one ([`Error::Invalid`]), or a missing, non-2-D,
/// zero-sized or non-BF16/F32 tensor, or finite F32 beyond the BF16 range ([`Error::Tensor`]).
pub fn read_matrix_bf16(path: impl AsRef<Path>, name: &str) -> Result<(Vec<bf16>, usize, usize, SourceDtype)> {
    let file = SafetensorsFile::open(path)?;
    let t = file.get(name)?;
    check_dtype(t, name, &[Dtype::BF16, Dtype::F32])?;
    let &[rows, cols] = t.shape.as_slice() else {
        return Err(tensor_err(name, format!("shape is {}, expected a 2-D matrix [rows, cols]", shape_str(&t.shape))));
    };
    if rows == 0 || cols == 0 {
        return Err(tensor_err(
            name,
            format!("shape is {}: a zero-sized matrix has nothing to read", shape_str(&t.shape)),
        ));
    }
    let data = file.read(name)?;
    match t.dtype {
        Dtype::BF16 => {
            let v = data.chunks_exact(2).map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]]))).collect();
            Ok((v, rows, cols, SourceDtype::Bf16))
        }
        _ => {
            let mut v = Vec::with_capacity(data.len() / 4);
            for (i, c) in data.chunks_exact(4).enumerate() {
                let x = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                v.push(f32_to_bf16(x).ok_or_else(|| beyond_bf16_err(name, &t.shape, i, x))?);
            }
            Ok((v, rows, cols, SourceDtype::F32))
        }
    }
}

/// `x` rounded to BF16 (round-to-nearest-even; NaN and infinities kept), or `None` for a finite
/// `x` beyond the BF16 range, which would round to infinity and pass itself off as a non-finite
/// input. Every reader that turns F32 into BF16 uses it, with [`beyond_bf16_err`] for the `None`.
pub(crate) fn f32_to_bf16(x: f32) -> Option<bf16> {
    let b = bf16::from_f32(x);
    (!(x.is_finite() && b.is_infinite())).then_some(b)
}

/// The typed error for the first F32 element of tensor `name` (of `shape`, at flat index
/// `index`) that [`f32_to_bf16`] refuses: it names the tensor, the element and its value.
pub(crate) fn beyond_bf16_err(name: &str, shape: &[usize], index: usize, x: f32) -> crate::error::Error {
    tensor_err(
        name,
        format!(
            "F32 element {} (index {index}) is {x:e}, finite but beyond the BF16 range (largest finite BF16: {:e}): \
             it would round to infinity",
            element_at(shape, index),
            bf16::MAX.to_f32()
        ),
    )
}

/// The multi-index of flat element `index` of a tensor of `shape` (last dimension fastest; a zero
/// dimension cannot hold an element), as `[i, j, ...]`.
pub(crate) fn element_at(shape: &[usize], index: usize) -> String {
    let mut at = vec![0usize; shape.len()];
    let mut rest = index;
    for (a, &d) in at.iter_mut().zip(shape).rev() {
        if d > 0 {
            *a = rest % d;
            rest /= d;
        }
    }
    shape_str(&at)
}

/// The little-endian bytes of `data`: borrowed on a little-endian machine (no copy of what may be
/// gigabytes), converted elsewhere.
fn bf16_le_bytes(data: &[bf16]) -> Cow<'_, [u8]> {
    use half::slice::HalfFloatSliceExt;
    let bits: &[u16] = data.reinterpret_cast();
    if cfg!(target_endian = "little") {
        // SAFETY: `bits` is a valid, initialized `[u16]`; viewing its memory as twice as many `u8`
        // (alignment 1, no padding, every bit pattern valid) for the same lifetime is sound.
        Cow::Borrowed(unsafe { std::slice::from_raw_parts(bits.as_ptr().cast::<u8>(), std::mem::size_of_val(bits)) })
    } else {
        Cow::Owned(bits.iter().flat_map(|b| b.to_le_bytes()).collect())
    }
}

/// Writes one BF16 tensor `name` `[rows, cols]` to a new safetensors file at `path`.
///
/// # Errors
/// `data` not of `rows * cols` elements ([`Error::Tensor`]) or a failed write ([`Error::Io`]); a failed
/// write leaves `path` as it was.
pub fn write_bf16(path: impl AsRef<Path>, name: &str, data: &[bf16], rows: usize, cols: usize) -> Result<()> {
    let n = rows.checked_mul(cols).ok_or_else(|| tensor_err(name, format!("shape [{rows}, {cols}] overflows")))?;
    if data.len() != n {
        return Err(tensor_err(name, format!("has {} elements, shape [{rows}, {cols}] needs {n}", data.len())));
    }
    let bytes = bf16_le_bytes(data);
    let t = view(name, Dtype::BF16, vec![rows, cols], &bytes)?;
    write_tensors(path.as_ref(), vec![(name.to_string(), t)])
}

/// Writes one NVFP4 weight in the ModelOpt layout: `{prefix}weight` (U8 `[N, K/2]`),
/// `{prefix}weight_scale` (F8_E4M3 `[N, K/16]`) and `{prefix}weight_scale_2` (F32, shape `[]`).
/// The prefix is used verbatim (pass `"model.layers.0.mlp.gate_proj."` with its final dot).
///
/// # Errors
/// Buffers that disagree with `rows` and `cols` ([`Error::Tensor`]) or a failed write
/// ([`Error::Io`]); a failed write leaves `path` as it was.
pub fn write_modelopt(path: impl AsRef<Path>, prefix: &str, w: &ModelOptWeight) -> Result<()> {
    let (n_w, n_s, n_g) =
        (format!("{prefix}weight"), format!("{prefix}weight_scale"), format!("{prefix}weight_scale_2"));
    if !w.cols.is_multiple_of(16) {
        return Err(tensor_err(&n_w, format!("K = {} is not a multiple of 16", w.cols)));
    }
    let overflow = || tensor_err(&n_w, format!("shape [{}, {}] overflows", w.rows, w.cols));
    let want_codes = w.rows.checked_mul(w.cols / 2).ok_or_else(overflow)?;
    let want_scales = w.rows * (w.cols / 16);
    if w.codes.len() != want_codes {
        return Err(tensor_err(
            &n_w,
            format!("has {} bytes, [{}, {}] needs {want_codes}", w.codes.len(), w.rows, w.cols / 2),
        ));
    }
    if w.scales.len() != want_scales {
        return Err(tensor_err(
            &n_s,
            format!("has {} bytes, [{}, {}] needs {want_scales}", w.scales.len(), w.rows, w.cols / 16),
        ));
    }
    let g = w.decode_scale.to_le_bytes();
    let tensors = vec![
        (n_w.clone(), view(&n_w, Dtype::U8, vec![w.rows, w.cols / 2], &w.codes)?),
        (n_s.clone(), view(&n_s, Dtype::F8_E4M3, vec![w.rows, w.cols / 16], &w.scales)?),
        (n_g.clone(), view(&n_g, Dtype::F32, vec![], &g)?),
    ];
    write_tensors(path.as_ref(), tensors)
}

/// The dtype and shape checks of one ModelOpt NVFP4 weight (`names`: its `weight`,
/// `weight_scale` and `weight_scale_2`, whose header entries are `infos`): U8 `[N, K/2]` with N,
/// K > 0, K a multiple of 16 and N x K countable, F8_E4M3 `[N, K/16]`, F32 `[]` or `[1]`. Returns
/// `(N, K)`.
pub(crate) fn check_modelopt_tensors(names: [&str; 3], infos: [&TensorInfo; 3]) -> Result<(usize, usize)> {
    let [n_w, n_s, n_g] = names;
    let [tw, ts, tg] = infos;
    check_dtype(tw, n_w, &[Dtype::U8])?;
    let &[rows, half_cols] = tw.shape.as_slice() else {
        return Err(tensor_err(n_w, format!("shape is {}, expected 2-D [N, K/2]", shape_str(&tw.shape))));
    };
    if rows == 0 || half_cols == 0 {
        return Err(tensor_err(
            n_w,
            format!("shape is {}: a zero-sized weight has nothing to read", shape_str(&tw.shape)),
        ));
    }
    // K = 2 x K/2, and the N x K BF16 values it decodes to, must be countable: a header may give
    // any dimension beside a zero one.
    let cols = half_cols.checked_mul(2).filter(|&k| rows.checked_mul(k).is_some()).ok_or_else(|| {
        tensor_err(
            n_w,
            format!("shape is {}: N x K = {rows} x 2 x {half_cols} does not fit in memory", shape_str(&tw.shape)),
        )
    })?;
    if cols % 16 != 0 {
        return Err(tensor_err(
            n_w,
            format!("shape is {}: K = 2 x {half_cols} = {cols} is not a multiple of 16", shape_str(&tw.shape)),
        ));
    }

    check_dtype(ts, n_s, &[Dtype::F8_E4M3])?;
    if ts.shape != [rows, cols / 16] {
        return Err(tensor_err(
            n_s,
            format!(
                "shape is {}, expected [{rows}, {}] for `{n_w}` of shape {}",
                shape_str(&ts.shape),
                cols / 16,
                shape_str(&tw.shape)
            ),
        ));
    }

    check_dtype(tg, n_g, &[Dtype::F32])?;
    if !(tg.shape.is_empty() || tg.shape == [1]) {
        return Err(tensor_err(n_g, format!("shape is {}, expected a scalar ([] or [1])", shape_str(&tg.shape))));
    }
    Ok((rows, cols))
}

/// The decode scale g from the 4 bytes of `weight_scale_2` (named `name`): finite and > 0.
pub(crate) fn check_weight_scale_2(name: &str, bytes: &[u8]) -> Result<f32> {
    let Ok(b) = <[u8; 4]>::try_from(bytes) else {
        return Err(tensor_err(name, format!("holds {} bytes, expected one F32 (4)", bytes.len())));
    };
    let g = f32::from_le_bytes(b);
    if !(g.is_finite() && g > 0.0) {
        return Err(tensor_err(name, format!("decode scale must be finite and > 0, got {g}")));
    }
    Ok(g)
}

/// Reads one ModelOpt NVFP4 weight `{prefix}weight` / `weight_scale` / `weight_scale_2`, checking
/// dtypes (U8, F8_E4M3, F32) and shapes (`[N, K/2]`, `[N, K/16]`, scalar or `[1]`) and that the
/// decode scale is finite and > 0.
///
/// # Errors
/// An unreadable or malformed file, or a missing tensor, a wrong dtype or shape, or a bad decode
/// scale ([`Error::Tensor`], naming the tensor).
pub fn read_modelopt(path: impl AsRef<Path>, prefix: &str) -> Result<ModelOptWeight> {
    let path = path.as_ref();
    let (n_w, n_s, n_g) =
        (format!("{prefix}weight"), format!("{prefix}weight_scale"), format!("{prefix}weight_scale_2"));
    let file = SafetensorsFile::open(path)?;
    let (rows, cols) = check_modelopt_tensors([&n_w, &n_s, &n_g], [file.get(&n_w)?, file.get(&n_s)?, file.get(&n_g)?])?;
    let g = check_weight_scale_2(&n_g, &file.read(&n_g)?)?;
    Ok(ModelOptWeight { codes: file.read(&n_w)?, scales: file.read(&n_s)?, decode_scale: g, rows, cols })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use crate::rng::Rng;
    use safetensors::tensor::TensorView;
    use safetensors::SafeTensors;
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A unique temporary file path, removed on drop.
    struct Tmp(PathBuf);

    impl Tmp {
        fn new(tag: &str) -> Self {
            static N: AtomicUsize = AtomicUsize::new(0);
            let n = N.fetch_add(1, Ordering::Relaxed);
            let nanos =
                std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
            Tmp(std::env::temp_dir().join(format!("nvfp4moe-io-{}-{nanos}-{n}-{tag}.safetensors", std::process::id())))
        }
    }

    impl Drop for Tmp {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    #[track_caller]
    fn rng() -> Rng {
        crate::testing::test_rng()
    }

    /// A raw tensor: name, dtype, shape, bytes.
    type Raw<'a> = (&'a str, Dtype, Vec<usize>, Vec<u8>);

    /// Writes raw tensors as they are.
    fn write_raw(path: &Path, tensors: &[Raw<'_>]) {
        let views: Vec<(String, TensorView<'_>)> =
            tensors.iter().map(|(n, d, s, b)| (n.to_string(), TensorView::new(*d, s.clone(), b).unwrap())).collect();
        safetensors::serialize_to_file(views, None, path).unwrap();
    }

    fn random_weight(r: &mut Rng, rows: usize, cols: usize) -> ModelOptWeight {
        // Scales: random E4M3 bytes without NaN (0x7F/0xFF) so the test data is a plausible weight.
        let scales = (0..rows * cols / 16).map(|_| (r.below(0x7F) as u8) | 1).collect();
        ModelOptWeight { codes: r.bytes(rows * cols / 2), scales, decode_scale: r.uniform(1e-6, 1e-2), rows, cols }
    }

    fn assert_tensor_err(e: Error, name: &str, contains: &str) {
        let msg = e.to_string();
        match &e {
            Error::Tensor { name: n, what } => {
                assert_eq!(n, name, "{msg}");
                assert!(what.contains(contains), "`{msg}` lacks `{contains}`");
            }
            _ => panic!("expected Error::Tensor for `{name}`, got {e:?}"),
        }
        assert!(msg.contains(name), "{msg}");
    }

    #[test]
    fn bf16_round_trip() {
        let mut r = rng();
        for (rows, cols) in [(1usize, 1usize), (3, 16), (37, 48)] {
            let x = r.varied_bf16(rows * cols);
            let t = Tmp::new("bf16");
            write_bf16(&t.0, "layer.w", &x, rows, cols).unwrap();
            let (y, r2, c2, src) = read_matrix_bf16(&t.0, "layer.w").unwrap();
            assert_eq!((r2, c2, src), (rows, cols, SourceDtype::Bf16));
            assert_eq!(
                x.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                y.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn f32_is_rounded_to_bf16() {
        let mut r = rng();
        let (rows, cols) = (5usize, 32usize);
        let mut x: Vec<f32> = (0..rows * cols).map(|_| r.normal() * 3.0).collect();
        // Specials and exact ties: 1 + 2^-8 is halfway between two bf16 neighbours (ties to even: 1.0).
        x[0] = f32::NAN;
        x[1] = f32::NEG_INFINITY;
        x[2] = -0.0;
        x[3] = 1.0 + 1.0 / 256.0;
        x[4] = 1.0 + 3.0 / 256.0;
        let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
        let t = Tmp::new("f32");
        write_raw(&t.0, &[("x", Dtype::F32, vec![rows, cols], bytes)]);
        let (y, r2, c2, src) = read_matrix_bf16(&t.0, "x").unwrap();
        assert_eq!((r2, c2, src), (rows, cols, SourceDtype::F32));
        for (a, b) in x.iter().zip(&y) {
            assert_eq!(bf16::from_f32(*a).to_bits(), b.to_bits());
        }
        assert!(y[0].is_nan());
        assert_eq!(y[3].to_f32(), 1.0);
        assert_eq!(y[4].to_f32(), 1.0 + 4.0 / 256.0);
        assert_eq!(y[2].to_bits(), 0x8000);
    }

    #[test]
    fn matrix_errors_name_the_tensor() {
        let mut r = rng();
        let t = Tmp::new("mat-err");
        write_raw(
            &t.0,
            &[
                ("good", Dtype::BF16, vec![2, 16], r.bytes(64)),
                ("half", Dtype::F16, vec![2, 16], r.bytes(64)),
                ("ints", Dtype::I32, vec![2, 16], r.bytes(128)),
                ("vec", Dtype::BF16, vec![32], r.bytes(64)),
                ("cube", Dtype::F32, vec![2, 2, 4], r.bytes(64)),
            ],
        );
        assert!(read_matrix_bf16(&t.0, "good").is_ok());
        assert_tensor_err(read_matrix_bf16(&t.0, "half").unwrap_err(), "half", "F16");
        assert_tensor_err(read_matrix_bf16(&t.0, "ints").unwrap_err(), "ints", "I32");
        assert_tensor_err(read_matrix_bf16(&t.0, "vec").unwrap_err(), "vec", "[32]");
        assert_tensor_err(read_matrix_bf16(&t.0, "cube").unwrap_err(), "cube", "[2, 2, 4]");
        let e = read_matrix_bf16(&t.0, "missing").unwrap_err();
        assert!(e.to_string().contains("`good`"), "lists present names: {e}");
        assert_tensor_err(e, "missing", "not found");
    }

    #[test]
    fn file_errors() {
        let t = Tmp::new("absent");
        match read_matrix_bf16(&t.0, "x").unwrap_err() {
            Error::Io(e) => assert!(e.to_string().contains(&*t.0.to_string_lossy()), "{e}"),
            e => panic!("expected Error::Io, got {e:?}"),
        }
        std::fs::write(&t.0, b"this is not a safetensors file").unwrap();
        let not_safetensors = |e: Error| match e {
            Error::Invalid(m) => {
                assert!(m.contains(&*t.0.to_string_lossy()) && m.contains("is not a valid safetensors file"), "{m}")
            }
            e => panic!("expected Error::Invalid naming the file, got {e:?}"),
        };
        not_safetensors(read_matrix_bf16(&t.0, "x").unwrap_err());
        not_safetensors(read_modelopt(&t.0, "").unwrap_err());
        let dir = std::env::temp_dir().join("nvfp4moe-io-no-such-dir").join("out.safetensors");
        assert!(matches!(write_bf16(&dir, "x", &[bf16::ONE], 1, 1).unwrap_err(), Error::Io(_)));
    }

    #[test]
    fn modelopt_round_trip() {
        let mut r = rng();
        for prefix in ["", "model.layers.3.mlp.experts.7.gate_proj."] {
            for (rows, cols) in [(1usize, 16usize), (7, 64), (130, 2880 / 10)] {
                let w = random_weight(&mut r, rows, cols);
                let t = Tmp::new("mo");
                write_modelopt(&t.0, prefix, &w).unwrap();
                assert_eq!(read_modelopt(&t.0, prefix).unwrap(), w);

                // The file holds exactly the three ModelOpt tensors with their dtypes and shapes.
                let bytes = std::fs::read(&t.0).unwrap();
                let st = SafeTensors::deserialize(&bytes).unwrap();
                let mut names = st.names();
                names.sort_unstable();
                let want =
                    [format!("{prefix}weight"), format!("{prefix}weight_scale"), format!("{prefix}weight_scale_2")];
                assert_eq!(names, want.iter().map(String::as_str).collect::<Vec<_>>());
                let tw = st.tensor(&want[0]).unwrap();
                assert_eq!((tw.dtype(), tw.shape()), (Dtype::U8, &[rows, cols / 2][..]));
                let ts = st.tensor(&want[1]).unwrap();
                assert_eq!((ts.dtype(), ts.shape()), (Dtype::F8_E4M3, &[rows, cols / 16][..]));
                let tg = st.tensor(&want[2]).unwrap();
                assert_eq!((tg.dtype(), tg.shape()), (Dtype::F32, &[][..]));
                assert_eq!(tg.data(), w.decode_scale.to_le_bytes());

                // Writing the same weight again gives the same bytes.
                let t2 = Tmp::new("mo2");
                write_modelopt(&t2.0, prefix, &w).unwrap();
                assert_eq!(std::fs::read(&t2.0).unwrap(), bytes);
            }
        }
    }

    #[test]
    fn modelopt_accepts_scale_2_of_shape_1() {
        let mut r = rng();
        let w = random_weight(&mut r, 4, 32);
        let t = Tmp::new("mo-s1");
        write_raw(
            &t.0,
            &[
                ("p.weight", Dtype::U8, vec![4, 16], w.codes.clone()),
                ("p.weight_scale", Dtype::F8_E4M3, vec![4, 2], w.scales.clone()),
                ("p.weight_scale_2", Dtype::F32, vec![1], w.decode_scale.to_le_bytes().to_vec()),
                ("p.input_scale", Dtype::F32, vec![], 1.0f32.to_le_bytes().to_vec()),
            ],
        );
        assert_eq!(read_modelopt(&t.0, "p.").unwrap(), w);
    }

    #[test]
    fn modelopt_errors_name_the_tensor() {
        let mut r = rng();
        let (rows, cols) = (4usize, 32usize);
        let w = random_weight(&mut r, rows, cols);
        let g = w.decode_scale.to_le_bytes().to_vec();
        let good = || {
            vec![
                ("m.weight", Dtype::U8, vec![rows, cols / 2], w.codes.clone()),
                ("m.weight_scale", Dtype::F8_E4M3, vec![rows, cols / 16], w.scales.clone()),
                ("m.weight_scale_2", Dtype::F32, vec![], g.clone()),
            ]
        };
        let case = |edit: &dyn Fn(&mut Vec<Raw<'static>>)| {
            let mut ts = good();
            edit(&mut ts);
            let t = Tmp::new("mo-err");
            write_raw(&t.0, &ts);
            read_modelopt(&t.0, "m.")
        };
        assert_eq!(case(&|_| {}).unwrap(), w);
        // Missing tensors.
        for i in 0..3 {
            let name = good()[i].0;
            assert_tensor_err(case(&|ts| drop(ts.remove(i))).unwrap_err(), name, "not found");
        }
        // Wrong dtypes.
        assert_tensor_err(case(&|ts| ts[0].1 = Dtype::I8).unwrap_err(), "m.weight", "I8");
        assert_tensor_err(case(&|ts| ts[1].1 = Dtype::U8).unwrap_err(), "m.weight_scale", "F8_E4M3");
        assert_tensor_err(case(&|ts| ts[1].1 = Dtype::F8_E5M2).unwrap_err(), "m.weight_scale", "F8_E5M2");
        assert_tensor_err(
            case(&|ts| {
                ts[2].1 = Dtype::BF16;
                ts[2].3 = vec![0x80, 0x3f];
            })
            .unwrap_err(),
            "m.weight_scale_2",
            "BF16",
        );
        // Wrong shapes.
        assert_tensor_err(case(&|ts| ts[0].2 = vec![rows * cols / 2]).unwrap_err(), "m.weight", "2-D");
        assert_tensor_err(case(&|ts| ts[0].2 = vec![rows * 4, cols / 8]).unwrap_err(), "m.weight", "multiple of 16");
        assert_tensor_err(
            case(&|ts| ts[1].2 = vec![rows * 2, cols / 32]).unwrap_err(),
            "m.weight_scale",
            "expected [4, 2]",
        );
        assert_tensor_err(
            case(&|ts| ts[1].2 = vec![rows * cols / 16]).unwrap_err(),
            "m.weight_scale",
            "expected [4, 2]",
        );
        assert_tensor_err(
            case(&|ts| {
                ts[2].2 = vec![2];
                ts[2].3 = [g.clone(), g.clone()].concat();
            })
            .unwrap_err(),
            "m.weight_scale_2",
            "scalar",
        );
        // A decode scale that cannot be one.
        for bad in [0.0f32, -1.0, f32::NAN, f32::INFINITY] {
            assert_tensor_err(
                case(&|ts| ts[2].3 = bad.to_le_bytes().to_vec()).unwrap_err(),
                "m.weight_scale_2",
                "finite and > 0",
            );
        }
        // The prefix is part of the name looked up.
        let t = Tmp::new("mo-prefix");
        write_raw(&t.0, &good());
        assert_tensor_err(read_modelopt(&t.0, "other.").unwrap_err(), "other.weight", "not found");
    }

    #[test]
    fn write_replaces_atomically_with_usual_permissions() {
        let mut r = rng();
        let dir = std::env::temp_dir().join(format!("nvfp4moe-io-dir-{}-{}", std::process::id(), r.next_u64()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("w.safetensors");
        let x = r.varied_bf16(64);
        write_bf16(&path, "a", &x, 4, 16).unwrap();
        let y = r.varied_bf16(32);
        write_bf16(&path, "b", &y, 2, 16).unwrap();
        let (z, ..) = read_matrix_bf16(&path, "b").unwrap();
        assert_eq!(z, y);
        assert!(matches!(read_matrix_bf16(&path, "a"), Err(Error::Tensor { .. })), "the old file is replaced");
        let files: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(files, vec![std::ffi::OsString::from("w.safetensors")], "no temporary file left");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let probe = dir.join("probe");
            std::fs::File::create(&probe).unwrap();
            let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode(&path), mode(&probe), "a written file gets the umask's permissions");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn write_checks_lengths() {
        let mut r = rng();
        let w = random_weight(&mut r, 3, 32);
        let t = Tmp::new("mo-len");
        let mut bad = w.clone();
        bad.codes.pop();
        assert_tensor_err(write_modelopt(&t.0, "a.", &bad).unwrap_err(), "a.weight", "needs 48");
        let mut bad = w.clone();
        bad.scales.push(0);
        assert_tensor_err(write_modelopt(&t.0, "a.", &bad).unwrap_err(), "a.weight_scale", "needs 6");
        let mut bad = w.clone();
        bad.cols = 24;
        assert_tensor_err(write_modelopt(&t.0, "a.", &bad).unwrap_err(), "a.weight", "multiple of 16");
        assert_tensor_err(write_bf16(&t.0, "y", &[bf16::ONE; 5], 2, 3).unwrap_err(), "y", "needs 6");
        assert!(!t.0.exists());
    }

    /// Zero-sized dimensions (an empty matrix, K = 0) and shapes with no elements but a huge other
    /// dimension are typed errors naming the tensor, in both readers (issue 21).
    #[test]
    fn zero_sized_and_huge_dimensions_are_named() {
        let t = Tmp::new("zero");
        let huge = 1usize << 63;
        write_raw(
            &t.0,
            &[
                ("rows0", Dtype::BF16, vec![0, 32], vec![]),
                ("cols0", Dtype::BF16, vec![4, 0], vec![]),
                ("f32", Dtype::F32, vec![0, 0], vec![]),
                ("huge", Dtype::BF16, vec![0, huge], vec![]),
            ],
        );
        for (name, shape) in
            [("rows0", "[0, 32]"), ("cols0", "[4, 0]"), ("f32", "[0, 0]"), ("huge", "[0, 9223372036854775808]")]
        {
            assert_tensor_err(read_matrix_bf16(&t.0, name).unwrap_err(), name, shape);
            assert_tensor_err(read_matrix_bf16(&t.0, name).unwrap_err(), name, "zero-sized");
        }
        // What the writer accepts (an empty matrix) the reader refuses.
        write_bf16(&t.0, "w", &[], 0, 32).unwrap();
        assert_tensor_err(read_matrix_bf16(&t.0, "w").unwrap_err(), "w", "zero-sized");

        // ModelOpt: K = 0, N = 0, and no rows of a K/2 so large that K = 2 x K/2 would overflow.
        let g = 0.5f32.to_le_bytes().to_vec();
        for (w, s, want) in [
            (vec![4, 0], vec![4, 0], "zero-sized"),
            (vec![0, 8], vec![0, 1], "zero-sized"),
            (vec![0, huge], vec![0, huge / 8], "zero-sized"),
            (vec![0, usize::MAX], vec![0, 0], "zero-sized"),
        ] {
            let t = Tmp::new("zero-mo");
            write_raw(
                &t.0,
                &[
                    ("m.weight", Dtype::U8, w.clone(), vec![]),
                    ("m.weight_scale", Dtype::F8_E4M3, s, vec![]),
                    ("m.weight_scale_2", Dtype::F32, vec![], g.clone()),
                ],
            );
            let e = read_modelopt(&t.0, "m.").unwrap_err();
            assert!(e.to_string().contains(&shape_str(&w)), "{e}");
            assert_tensor_err(e, "m.weight", want);
        }
    }

    /// A finite F32 beyond the BF16 range would become Inf: a typed error naming the tensor and
    /// the first such element. The largest F32 that rounds to BF16's largest finite value is kept.
    #[test]
    fn f32_beyond_the_bf16_range_is_named() {
        let mut r = rng();
        let (rows, cols) = (7usize, 48usize);
        // 0x7F7F_7FFF rounds down to BF16::MAX; 0x7F7F_8000 is the tie that rounds up to Inf.
        let (edge, over) = (f32::from_bits(0x7F7F_7FFF), f32::from_bits(0x7F7F_8000));
        let mut x: Vec<f32> = (0..rows * cols).map(|_| r.normal()).collect();
        // (From 2: index 0 holds the NaN, so the kept edge at first - 1 must not land there.)
        let first = r.range(2, rows * cols - 1);
        x[first - 1] = -edge;
        x[0] = f32::NAN;
        let t = Tmp::new("f32-range");
        let bytes = |x: &[f32]| x.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
        write_raw(&t.0, &[("ok", Dtype::F32, vec![rows, cols], bytes(&x))]);
        let (y, ..) = read_matrix_bf16(&t.0, "ok").unwrap();
        assert_eq!(y[first - 1], -bf16::MAX);
        for bad in [over, -over, f32::MAX, -f32::MAX] {
            let mut x = x.clone();
            x[first] = bad;
            // A later offending element and a later Inf do not change which one is named.
            x[rows * cols - 1] = f32::MAX;
            write_raw(&t.0, &[("w.f32", Dtype::F32, vec![rows, cols], bytes(&x))]);
            let e = read_matrix_bf16(&t.0, "w.f32").unwrap_err();
            let want = format!("element [{}, {}] (index {first}) is {bad:e}", first / cols, first % cols);
            assert!(e.to_string().contains("beyond the BF16 range"), "{e}");
            assert_tensor_err(e, "w.f32", &want);
        }
    }

    /// `__metadata__` is the header's metadata entry, never a tensor name: writing it is refused and
    /// nothing is written.
    #[test]
    fn the_metadata_key_is_not_a_tensor_name() {
        let t = Tmp::new("meta");
        assert_tensor_err(
            write_bf16(&t.0, "__metadata__", &[bf16::ONE; 16], 1, 16).unwrap_err(),
            "__metadata__",
            "reserved",
        );
        assert!(!t.0.exists());
        write_bf16(&t.0, "w", &[bf16::ONE; 16], 1, 16).unwrap();
        assert_tensor_err(read_matrix_bf16(&t.0, "__metadata__").unwrap_err(), "__metadata__", "not found");
    }
}
