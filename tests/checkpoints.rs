//! Checkpoints in both NVFP4 dialects against the committed fixtures.

mod checkpoint_fixture;

use checkpoint_fixture::{bf16_experts, inputs, modelopt_checkpoint, root, EXPERTS, HIDDEN, INTERMEDIATE, PREFIX};
#[cfg(unix)]
use std::collections::BTreeMap;
#[cfg(unix)]
use std::path::{Path, PathBuf};

use half::bf16;
use nvfp4_moe::io::{load_compressed_tensors, load_experts, load_modelopt, Dialect, QuantScheme, SafetensorsFile};
use nvfp4_moe::reference;

/// The committed fixture inputs are what the crate writes today (`NVFP4MOE_WRITE_FIXTURES=1`
/// rewrites them; then rerun scripts/fixtures/compressed_tensors.sh on a GPU machine).
#[test]
fn fixture_inputs_are_current() {
    let write = std::env::var_os("NVFP4MOE_WRITE_FIXTURES").is_some();
    for (rel, bytes) in inputs() {
        let path = root().join(&rel);
        if write {
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, &bytes).unwrap();
            continue;
        }
        let committed = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(committed == bytes, "{rel} differs from what the crate writes: rerun with NVFP4MOE_WRITE_FIXTURES=1");
    }
}

/// The ModelOpt fixture loads as ModelOpt W4A4 (declared by its hf_quant_config.json), holds
/// exactly what the crate's quantizer made of the BF16 experts, and keeps gate's and up's different
/// decode scales and expert 1's different up input scale.
#[test]
fn modelopt_fixture_loads_as_w4a4() {
    let dir = root().join("modelopt_w4a4");
    let got = load_experts(&dir, PREFIX).unwrap();
    assert_eq!((got.format.dialect, got.format.scheme), (Dialect::ModelOpt, QuantScheme::W4A4));
    assert_eq!(got.format.declared_in, Some(dir.join("hf_quant_config.json")));
    let want = modelopt_checkpoint(&bf16_experts());
    let c = &got.checkpoint;
    assert_eq!((c.experts, c.hidden, c.intermediate), (EXPERTS, HIDDEN, INTERMEDIATE));
    assert!(c.w13.codes == want.w13.codes && c.w13.scales == want.w13.scales);
    assert!(c.w2.codes == want.w2.codes && c.w2.scales == want.w2.scales);
    assert_eq!(c.w13.decode_scales, want.w13.decode_scales);
    assert_eq!(c.up_decode_scales, want.up_decode_scales);
    assert!(c.up_decode_scales.iter().zip(&c.w13.decode_scales).all(|(u, g)| u != g));
    let (l1, up) = (c.l1_input_scales.as_ref().unwrap(), c.up_input_scales.as_ref().unwrap());
    assert!(l1[1] != up[1] && l1[0] == up[0]);
    assert_eq!(load_modelopt(dir.join("model.safetensors"), PREFIX).unwrap().w2.decode_scales, want.w2.decode_scales);
}

/// Every file under `dir` (links not followed), with its kind and, for regular files, its bytes.
#[cfg(unix)]
fn tree(dir: &Path) -> BTreeMap<PathBuf, (String, Vec<u8>)> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let (p, t) = (e.path(), e.file_type().unwrap());
        if t.is_dir() {
            out.extend(tree(&p));
        }
        let bytes = if t.is_file() { std::fs::read(&p).unwrap() } else { vec![] };
        out.insert(p, (format!("{t:?}"), bytes));
    }
    out
}

/// The bad inputs of issue 17, through the public API: each gives its typed error, and afterwards
/// every file is as it was and nothing was added (no temporary file left behind).
#[cfg(unix)]
#[test]
fn bad_inputs_give_typed_errors_and_change_nothing() {
    use nvfp4_moe::io::{write_bf16, FileKind};
    use nvfp4_moe::Error;
    use safetensors::tensor::TensorView;

    let tmp = std::env::temp_dir().join(format!("nvfp4moe-bad-inputs-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).unwrap();
    let good = root().join("modelopt_w4a4").join("model.safetensors");
    let bytes = std::fs::read(&good).unwrap();
    let file = SafetensorsFile::open(&good).unwrap();
    let names: Vec<String> = file.names().into_iter().map(String::from).collect();
    let raw: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = names
        .iter()
        .map(|n| {
            let t = file.get(n).unwrap();
            (n.clone(), t.dtype, t.shape.clone(), file.read(n).unwrap())
        })
        .collect();
    let write = |path: &Path, ts: &[(String, safetensors::Dtype, Vec<usize>, Vec<u8>)]| {
        let views: Vec<(String, TensorView<'_>)> =
            ts.iter().map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap())).collect();
        safetensors::serialize_to_file(views, None, path).unwrap();
    };
    let index = |path: &Path, skip: Option<&str>, shard: &str| {
        let map: serde_json::Map<String, serde_json::Value> =
            names.iter().filter(|n| Some(n.as_str()) != skip).map(|n| (n.clone(), shard.into())).collect();
        std::fs::write(path, serde_json::to_vec(&serde_json::json!({ "weight_map": map })).unwrap()).unwrap();
    };

    // The inputs.
    let truncated = tmp.join("truncated.safetensors");
    std::fs::write(&truncated, &bytes[..bytes.len() - 100]).unwrap();
    let wrong_dtype = tmp.join("wrong-dtype.safetensors");
    let bad_name = format!("{PREFIX}.1.up_proj.weight_scale");
    let mut ts = raw.clone();
    ts.iter_mut().filter(|t| t.0 == bad_name).for_each(|t| t.1 = safetensors::Dtype::U8);
    write(&wrong_dtype, &ts);
    std::fs::create_dir_all(tmp.join("missing")).unwrap();
    std::fs::copy(&good, tmp.join("missing").join("model.safetensors")).unwrap();
    let missing_entry = format!("{PREFIX}.2.down_proj.weight_scale_2");
    index(&tmp.join("missing").join("model.safetensors.index.json"), Some(&missing_entry), "model.safetensors");
    std::fs::create_dir_all(tmp.join("escape")).unwrap();
    index(&tmp.join("escape").join("model.safetensors.index.json"), None, "../wrong-dtype.safetensors");
    let fifo = tmp.join("fifo.safetensors");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    // The outputs: a symlink to an existing file, the FIFO, a device node.
    let victim = tmp.join("victim.safetensors");
    std::fs::copy(&good, &victim).unwrap();
    let link = tmp.join("link.safetensors");
    std::os::unix::fs::symlink(&victim, &link).unwrap();
    let node = tmp.join("null");
    let c = std::ffi::CString::new(node.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path; makedev(1, 3) is the null device (root only; else
    // /dev/null itself, which only root could replace).
    let device = if unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) } == 0 {
        node
    } else {
        "/dev/null".into()
    };

    let before = tree(&tmp);
    let e = load_experts(&truncated, PREFIX).unwrap_err();
    assert!(matches!(&e, Error::Invalid(m) if m.contains("truncated.safetensors")), "{e}");
    let e = load_experts(&wrong_dtype, PREFIX).unwrap_err();
    assert!(matches!(&e, Error::Tensor { name, what } if *name == bad_name && what.contains("F8_E4M3")), "{e}");
    let e = load_experts(tmp.join("missing"), PREFIX).unwrap_err();
    assert!(matches!(&e, Error::Tensor { name, what } if *name == missing_entry && what.contains("weight_map")), "{e}");
    let e = load_experts(tmp.join("escape"), PREFIX).unwrap_err();
    assert!(matches!(&e, Error::UnsafeShardPath { shard, .. } if shard == "../wrong-dtype.safetensors"), "{e}");
    for input in [fifo.as_path(), Path::new("/dev/zero")] {
        let e = load_experts(input, PREFIX).unwrap_err();
        assert!(matches!(&e, Error::NotRegularFile { .. }), "{e}");
        let e = SafetensorsFile::open(input).unwrap_err();
        assert!(matches!(&e, Error::NotRegularFile { .. }), "{e}");
    }
    let one = [bf16::ONE; 16];
    for (out, kind) in [(&link, FileKind::Symlink), (&fifo, FileKind::Fifo), (&device, FileKind::CharDevice)] {
        let e = write_bf16(out, "w", &one, 1, 16).unwrap_err();
        assert!(matches!(&e, Error::NotRegularFile { kind: k, .. } if *k == kind), "{}: {e}", out.display());
        let ck = load_experts(root().join("modelopt_w4a4"), PREFIX).unwrap().checkpoint;
        let e = nvfp4_moe::io::write_modelopt_experts(out, PREFIX, ck.naming, &ck).unwrap_err();
        assert!(matches!(&e, Error::NotRegularFile { .. }), "{e}");
        let e = nvfp4_moe::io::write_file_atomically(out, b"{}").unwrap_err();
        assert!(matches!(&e, Error::NotRegularFile { .. }), "{e}");
    }
    assert_eq!(tree(&tmp), before, "a failed read or write changed or added a file");
    assert!(std::os::unix::fs::FileTypeExt::is_char_device(&std::fs::symlink_metadata(&device).unwrap().file_type()));
    std::fs::remove_dir_all(&tmp).unwrap();
}

// ------------------------------------------------------------------------------------------------
// compressed-tensors' own fixtures (scripts/fixtures/make_ct_fixtures.py on an H200)

/// `versions.json` of the compressed-tensors fixtures.
fn ct_versions() -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(root().join("ct_versions.json")).unwrap()).unwrap()
}

/// The fixtures are compressed-tensors 0.20.1's own work on a GPU, every step ran, from the
/// committed inputs.
#[test]
fn ct_fixtures_are_compressed_tensors_own() {
    let v = ct_versions();
    assert_eq!(v["compressed_tensors"], "0.20.1", "{v}");
    assert!(v["device"].as_str().is_some_and(|d| d.contains("NVIDIA")), "{v}");
    assert_eq!(v["failed"], serde_json::json!([]), "{v}");
    assert_eq!(v["w4a4"]["converter"], "ModelOptNvfp4Converter", "{v}");
    assert_eq!(v["w4a16"]["preset"], "NVFP4A16", "{v}");
}

/// The W4A4 checkpoint compressed-tensors' converter made from the ModelOpt fixture: detected as
/// compressed-tensors W4A4 from its config.json (the copied ModelOpt hf_quant_config.json beside
/// it notwithstanding), the same codes and block scales, and decode scales that are the
/// reciprocals of its global scales (within one f32 ulp of ModelOpt's: 1/(1/g)), gate and up
/// kept apart as on the ModelOpt path.
#[test]
fn ct_w4a4_is_the_modelopt_fixture_converted() {
    let dir = root().join("ct_w4a4");
    let ct = load_experts(&dir, PREFIX).unwrap();
    assert_eq!((ct.format.dialect, ct.format.scheme), (Dialect::CompressedTensors, QuantScheme::W4A4));
    assert_eq!(ct.format.declared_in, Some(dir.join("config.json")));
    let mo = load_experts(root().join("modelopt_w4a4"), PREFIX).unwrap().checkpoint;
    let c = &ct.checkpoint;
    assert!(c.w13.codes == mo.w13.codes && c.w13.scales == mo.w13.scales);
    assert!(c.w2.codes == mo.w2.codes && c.w2.scales == mo.w2.scales);
    for (what, a, b) in [
        ("gate g", &c.w13.decode_scales, &mo.w13.decode_scales),
        ("up g", &c.up_decode_scales, &mo.up_decode_scales),
        ("down g", &c.w2.decode_scales, &mo.w2.decode_scales),
        ("l1 input", c.l1_input_scales.as_ref().unwrap(), mo.l1_input_scales.as_ref().unwrap()),
        ("up input", c.up_input_scales.as_ref().unwrap(), mo.up_input_scales.as_ref().unwrap()),
        ("l2 input", c.l2_input_scales.as_ref().unwrap(), mo.l2_input_scales.as_ref().unwrap()),
    ] {
        for (x, y) in a.iter().zip(b.iter()) {
            assert!((x.to_bits() as i64 - y.to_bits() as i64).abs() <= 1, "{what}: {x} vs {y}");
        }
    }
    assert!(c.up_decode_scales.iter().zip(&c.w13.decode_scales).all(|(u, g)| u != g));
    assert!(load_modelopt(&dir, PREFIX).is_err());
}

/// The crate's dequantization (`e2m1 x e4m3 x g`, g = 1/global scale, rounded to BF16) of each
/// projection of a compressed-tensors fixture against compressed-tensors' own decompression (it
/// divides the block scale by the global scale and casts to BF16): within one BF16 ulp.
fn check_against_ct_decompression(dir: &str, decompressed: &str) -> (usize, usize) {
    let ck = load_compressed_tensors(root().join(dir), PREFIX).unwrap();
    let theirs = SafetensorsFile::open(root().join(decompressed)).unwrap();
    let (h, i) = (ck.hidden, ck.intermediate);
    let (mut exact, mut total) = (0usize, 0usize);
    for e in 0..ck.experts {
        for (proj, w, row0, rows, k, g) in [
            ("gate_proj", &ck.w13, e * 2 * i, i, h, ck.w13.decode_scales[e]),
            ("up_proj", &ck.w13, e * 2 * i + i, i, h, ck.up_decode_scales[e]),
            ("down_proj", &ck.w2, e * h, h, i, ck.w2.decode_scales[e]),
        ] {
            let name = format!("{PREFIX}.{e}.{proj}.weight");
            let t = theirs.get(&name).unwrap();
            assert_eq!((t.dtype, t.shape.as_slice()), (safetensors::Dtype::BF16, &[rows, k][..]), "{name}");
            let want: Vec<bf16> =
                theirs.read(&name).unwrap().chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]])).collect();
            for r in 0..rows {
                for c in 0..k {
                    let byte = w.codes[(row0 + r) * (k / 2) + c / 2];
                    let code = if c % 2 == 0 { byte & 0xF } else { byte >> 4 };
                    let scale = w.scales[(row0 + r) * (k / 16) + c / 16];
                    let got = reference::dequantize_element(code, scale, g);
                    let theirs = want[r * k + c];
                    let (a, b) = (got.to_f32(), theirs.to_f32());
                    total += 1;
                    if a == b {
                        exact += 1;
                        continue;
                    }
                    // One BF16 ulp at the larger magnitude (same sign: a sign flip is never within).
                    let ulp = bf16::from_f32(a.abs().max(b.abs())).to_bits();
                    let one_ulp = (f32::from_bits(((ulp as u32) + 1) << 16) - f32::from_bits((ulp as u32) << 16)).abs();
                    assert!(
                        a.signum() == b.signum() && (a - b).abs() <= one_ulp,
                        "{dir}: `{name}` [{r}, {c}]: crate {a}, compressed-tensors {b} (code {code:#x}, scale {scale:#04x}, g {g})"
                    );
                }
            }
        }
    }
    eprintln!("{dir}: {exact} of {total} weights equal compressed-tensors' decompression bit for bit, the rest within one BF16 ulp");
    (exact, total)
}

/// W4A4: the converter keeps ModelOpt's 0-dim scalars, and a 0-dim F32 global scale does not
/// promote PyTorch's BF16 block scale, so compressed-tensors divides in BF16 and rounds twice:
/// about 70% of the weights are bit-identical, the rest one BF16 ulp apart.
#[test]
fn ct_w4a4_decompression_equals_the_crates_dequantization() {
    let f = SafetensorsFile::open(root().join("ct_w4a4/model.safetensors")).unwrap();
    assert_eq!(f.get(&format!("{PREFIX}.0.gate_proj.weight_global_scale")).unwrap().shape, Vec::<usize>::new());
    let (exact, total) = check_against_ct_decompression("ct_w4a4", "ct_w4a4_decompressed.safetensors");
    assert_eq!(total, EXPERTS * 3 * HIDDEN * INTERMEDIATE);
    assert!(exact > 0);
}

/// W4A16: global scales of shape `[1]` make compressed-tensors divide in F32: every weight is
/// bit-identical to the crate's.
#[test]
fn ct_w4a16_decompression_equals_the_crates_dequantization() {
    let f = SafetensorsFile::open(root().join("ct_w4a16/model.safetensors")).unwrap();
    assert_eq!(f.get(&format!("{PREFIX}.0.gate_proj.weight_global_scale")).unwrap().shape, vec![1]);
    let (exact, total) = check_against_ct_decompression("ct_w4a16", "ct_w4a16_decompressed.safetensors");
    assert_eq!(total, EXPERTS * 3 * HIDDEN * INTERMEDIATE);
    assert_eq!(exact, total);
}

/// The W4A16 checkpoint compressed-tensors' NVFP4A16 compressor made of the BF16 fixture:
/// detected as weight-only, no activation scales, and its weights, dequantized by the crate, are
/// the BF16 inputs within NVFP4's error (so it was made from the committed inputs).
#[test]
fn ct_w4a16_quantizes_the_bf16_fixture() {
    let loaded = load_experts(root().join("ct_w4a16"), PREFIX).unwrap();
    assert_eq!((loaded.format.dialect, loaded.format.scheme), (Dialect::CompressedTensors, QuantScheme::W4A16));
    let c = &loaded.checkpoint;
    assert!(c.l1_input_scales.is_none() && c.up_input_scales.is_none() && c.l2_input_scales.is_none());
    let (h, i) = (HIDDEN, INTERMEDIATE);
    for (e, x) in bf16_experts().iter().enumerate() {
        for (proj, src, w, row0, rows, k, g) in [
            ("gate", &x.gate, &c.w13, e * 2 * i, i, h, c.w13.decode_scales[e]),
            ("up", &x.up, &c.w13, e * 2 * i + i, i, h, c.up_decode_scales[e]),
            ("down", &x.down, &c.w2, e * h, h, i, c.w2.decode_scales[e]),
        ] {
            let (mut num, mut den) = (0f64, 0f64);
            for r in 0..rows {
                for col in 0..k {
                    let byte = w.codes[(row0 + r) * (k / 2) + col / 2];
                    let code = if col % 2 == 0 { byte & 0xF } else { byte >> 4 };
                    let y = reference::dequantize_element(code, w.scales[(row0 + r) * (k / 16) + col / 16], g).to_f32()
                        as f64;
                    let v = src[r * k + col].to_f32() as f64;
                    num += (y - v) * (y - v);
                    den += v * v;
                }
            }
            let rel = (num / den).sqrt();
            assert!(rel < 0.15, "expert {e} {proj}: relative error {rel:.3} against the BF16 input");
        }
    }
}

/// On the CPU, the f64 reference layer from each dialect's fixture: the compressed-tensors W4A4
/// checkpoint gives the ModelOpt one's output (decode scales within an f32 ulp: relative 1e-6),
/// and the W4A16 one stays within NVFP4's error of the ModelOpt W4A4 layer (both quantize the same
/// BF16 weights, by different recipes). The GPU layer runs the same fixtures in tests/gpu.
#[test]
fn reference_layer_from_each_dialect() {
    use nvfp4_moe::testing::Rng;
    let mut rng = Rng::new(17);
    let (t, k) = (9usize, 2usize);
    let ids: Vec<i32> = (0..t * k).map(|x| ((x + rng.below(EXPERTS as u64) as usize) % EXPERTS) as i32).collect();
    let w: Vec<f32> = (0..t * k).map(|_| rng.uniform(0.1, 1.0)).collect();
    let hidden = rng.normal_bf16(t * HIDDEN, 1.0);
    let layer = |dir: &str| {
        let c = load_experts(root().join(dir), PREFIX).unwrap().checkpoint;
        reference::routing::moe_layer(&hidden, t, &ids, &w, k, &c).unwrap()
    };
    let rel = |a: &[f64], b: &[f64]| {
        let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
        let den: f64 = b.iter().map(|y| y * y).sum();
        (num / den).sqrt()
    };
    let modelopt = layer("modelopt_w4a4");
    let ct_w4a4 = layer("ct_w4a4");
    let ct_w4a16 = layer("ct_w4a16");
    assert!(rel(&ct_w4a4, &modelopt) < 1e-6, "{:e}", rel(&ct_w4a4, &modelopt));
    assert!(rel(&ct_w4a16, &modelopt) < 0.2, "{:e}", rel(&ct_w4a16, &modelopt));
    eprintln!(
        "f64 layer: ct_w4a4 vs modelopt_w4a4 {:.2e}, ct_w4a16 vs modelopt_w4a4 {:.2e}",
        rel(&ct_w4a4, &modelopt),
        rel(&ct_w4a16, &modelopt)
    );
}
