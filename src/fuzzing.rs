//! Entry points for the fuzz targets in `fuzz/` (the `fuzzing` feature): thin wrappers over the
//! crate's internal parsers and checks, each taking raw bytes. Not public API: hidden from the
//! docs, compiled only with the feature, changed whenever the targets need it.
//!
//! Each entry point must return normally on every input: an error is a finding of the checks, a
//! panic (an index out of bounds, an overflow, a failed assertion of the invariants below) is a
//! bug.

use safetensors::tensor::{Dtype, TensorInfo};

use crate::host::Nvfp4Host;
use crate::io::{check_modelopt_tensors, check_weight_scale_2, parse_file_bytes, resolve_in_memory};
use crate::layout::{scale_len, ScaleLayout};

/// A whole safetensors file's bytes through the header parser and layout check. On success every
/// tensor's byte range holds exactly its dtype and shape, inside the data, and the ranges fill
/// the data. Returns whether the file was accepted.
pub fn safetensors_file(data: &[u8]) -> bool {
    let Ok((start, tensors)) = parse_file_bytes(data) else { return false };
    assert!((8..=data.len()).contains(&start));
    let mut total = 0usize;
    for t in tensors.values() {
        let (begin, end) = t.data_offsets;
        assert!(begin <= end && start + end <= data.len(), "{t:?} outside {} bytes", data.len());
        let elements = t.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).expect("checked");
        assert_eq!((end - begin) * 8, elements * t.dtype.bitsize(), "{t:?}");
        total += end - begin;
    }
    assert_eq!(total, data.len() - start);
    true
}

/// The dtype of a name in the header format (`U8`, `F8_E4M3`, ...), if known.
fn dtype_named(s: &str) -> Option<Dtype> {
    serde_json::from_value(serde_json::Value::String(s.to_string())).ok()
}

/// The prefix and tensors of [`checkpoint_names`]'s input.
fn parse_names(data: &[u8]) -> (String, Vec<(String, Dtype, Vec<usize>)>) {
    let text = String::from_utf8_lossy(data);
    let mut lines = text.lines();
    let prefix = lines.next().unwrap_or("").to_string();
    let mut tensors = Vec::new();
    for line in lines {
        let mut parts = line.split(' ');
        let (Some(name), Some(dtype)) = (parts.next(), parts.next().and_then(dtype_named)) else { continue };
        let dims = parts.next().unwrap_or("");
        let shape: Option<Vec<usize>> =
            if dims.is_empty() { Some(Vec::new()) } else { dims.split(',').map(|d| d.parse().ok()).collect() };
        if let Some(shape) = shape {
            tensors.push((name.to_string(), dtype, shape));
        }
    }
    (prefix, tensors)
}

/// Checkpoint name and expert-index resolution ([`crate::io::load_experts`] without the files):
/// the input is text, its first line the experts' prefix, then one tensor a line, `name DTYPE
/// d0,d1,...` (no dims: a scalar). Lines that do not parse are skipped. On success E >= 1 and H,
/// I are positive multiples of 16. Returns whether the layer was accepted.
pub fn checkpoint_names(data: &[u8]) -> bool {
    let (prefix, tensors) = parse_names(data);
    let Ok((e, h, i)) = resolve_in_memory(&prefix, &tensors) else { return false };
    assert!(e >= 1 && h > 0 && h % 16 == 0 && i > 0 && i % 16 == 0, "E {e}, H {h}, I {i}");
    true
}

/// Reads the fuzz input front to back; missing bytes read as 0.
struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn byte(&mut self) -> u8 {
        let (&b, rest) = self.0.split_first().unwrap_or((&0, &[]));
        self.0 = rest;
        b
    }

    fn take(&mut self, n: usize) -> Vec<u8> {
        let (a, b) = self.0.split_at(n.min(self.0.len()));
        self.0 = b;
        a.to_vec()
    }

    /// A dimension: `0..=127` from one byte, or (high bit set) any u64 from the next 8 bytes.
    fn dim(&mut self) -> usize {
        let tag = self.byte();
        if tag & 0x80 == 0 {
            return usize::from(tag);
        }
        let mut b = [0u8; 8];
        b.copy_from_slice(&{
            let mut v = self.take(8);
            v.resize(8, 0);
            v
        });
        u64::from_le_bytes(b) as usize
    }
}

/// The dtypes the NVFP4 target draws from: the right ones and their usual confusions.
const DTYPES: [Dtype; 8] =
    [Dtype::U8, Dtype::F8_E4M3, Dtype::F32, Dtype::I8, Dtype::F8_E5M2, Dtype::BF16, Dtype::F16, Dtype::U32];

/// NVFP4 tensor validation: the input encodes the dtypes and shapes of a ModelOpt weight's three
/// tensors (a dtype byte, a rank byte, then each dimension as [`Bytes::dim`] reads it), the four
/// bytes of g, then the codes and the scales. Through the reader's checks
/// ([`crate::io::read_modelopt`]'s) to [`Nvfp4Host::validate`] and the reference dequantizer, in
/// both scale layouts; the first two dimensions also go to [`Nvfp4Host::validate`] as they are.
/// Returns whether the weight was dequantized (in the linear layout).
pub fn nvfp4_weight(data: &[u8]) -> bool {
    let mut r = Bytes(data);
    let mut infos: Vec<TensorInfo> = Vec::new();
    for _ in 0..3 {
        let dtype = DTYPES[usize::from(r.byte()) % DTYPES.len()];
        let rank = usize::from(r.byte() % 4);
        let shape = (0..rank).map(|_| r.dim()).collect();
        infos.push(TensorInfo { dtype, shape, data_offsets: (0, 0) });
    }
    let g_bytes = r.take(4);
    let rest = r.0;
    let names = ["w.weight", "w.weight_scale", "w.weight_scale_2"];

    // The shape of the codes as given, straight into the host type's own checks.
    let (rows, half) = (infos[0].shape.first().copied().unwrap_or(0), infos[0].shape.get(1).copied().unwrap_or(0));
    for layout in [ScaleLayout::Linear, ScaleLayout::Swizzled128x4] {
        let h = Nvfp4Host {
            rows,
            cols: half.wrapping_mul(2),
            layout,
            decode_scale: 1.0,
            codes: rest.to_vec(),
            scales: Vec::new(),
        };
        let _ = h.validate();
    }

    let Ok((rows, cols)) = check_modelopt_tensors(names, [&infos[0], &infos[1], &infos[2]]) else { return false };
    let Ok(g) = check_weight_scale_2(names[2], &g_bytes) else { return false };
    assert!(rows > 0 && cols > 0 && cols % 16 == 0 && g.is_finite() && g > 0.0);
    let codes_len = rows.checked_mul(cols / 2).expect("checked: N x K fits");
    let (codes, after) = rest.split_at(codes_len.min(rest.len()));
    let mut accepted = false;
    for layout in [ScaleLayout::Linear, ScaleLayout::Swizzled128x4] {
        let scales_len = scale_len(layout, rows, cols);
        let scales = &after[..scales_len.min(after.len())];
        let h = Nvfp4Host { rows, cols, layout, decode_scale: g, codes: codes.to_vec(), scales: scales.to_vec() };
        match crate::reference::try_dequantize(&h) {
            Ok(v) => {
                assert_eq!(v.len(), rows * cols);
                assert!(codes.len() == codes_len && scales.len() == scales_len);
                accepted |= layout == ScaleLayout::Linear;
            }
            Err(_) => assert!(codes.len() != codes_len || scales.len() != scales_len),
        }
    }
    accepted
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seed(target: &str, name: &str) -> Vec<u8> {
        let path = format!("{}/fuzz/corpus/{target}/{name}", env!("CARGO_MANIFEST_DIR"));
        std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    /// The committed seeds reach past the checks they are meant to pass (a seed refused early
    /// would leave the checks after it to chance) and the invalid ones are refused.
    #[test]
    fn the_seed_corpus_reaches_the_checks() {
        for name in ["golden-q-f32", "golden-d-f32", "golden-q-bf16", "modelopt-expert", "zero-dim-huge", "every-dtype"]
        {
            assert!(safetensors_file(&seed("safetensors_header", name)), "{name}");
        }
        for name in ["repeated-key", "overlap", "metadata-not-strings"] {
            assert!(!safetensors_file(&seed("safetensors_header", name)), "{name}");
        }
        for name in
            ["modelopt_w4a4", "ct_w4a16", "ct_w4a4", "mixtral-w1w3w2", "fused-gate-up", "fused-w13", "ct-fields"]
        {
            let (prefix, tensors) = parse_names(&seed("checkpoint_names", name));
            if let Err(e) = resolve_in_memory(&prefix, &tensors) {
                panic!("{name}: {e}");
            }
        }
        for name in ["bf16_moe", "expert-usize-max", "zero-dims"] {
            assert!(!checkpoint_names(&seed("checkpoint_names", name)), "{name}");
        }
        for name in ["normal_1x16", "ties_derived_g", "subnormal_2x32", "given_tiny_g", "zero_tiny_8x128"] {
            assert!(nvfp4_weight(&seed("nvfp4_weight", name)), "{name}");
        }
        for name in ["huge-k", "scalar-g-nan"] {
            assert!(!nvfp4_weight(&seed("nvfp4_weight", name)), "{name}");
        }
    }
}
