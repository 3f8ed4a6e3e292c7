//! Checkpoints in both NVFP4 dialects against the committed fixtures.

mod checkpoint_fixture;

use checkpoint_fixture::{bf16_experts, inputs, modelopt_checkpoint, root, EXPERTS, HIDDEN, INTERMEDIATE, PREFIX};
#[cfg(unix)]
use std::collections::BTreeMap;
#[cfg(unix)]
use std::path::{Path, PathBuf};

#[cfg(unix)]
use half::bf16;
use nvfp4_moe::io::{load_experts, load_modelopt, Dialect, QuantScheme, SafetensorsFile};

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
