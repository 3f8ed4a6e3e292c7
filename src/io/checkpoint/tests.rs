//! Round trips and every error path of the checkpoint reader and writer.

use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors, TensorView};

use super::write::expert_tensors;
use super::*;
use crate::error::{Error, Result};
use crate::host::{ExpertWeightsHost, MoeCheckpoint};
use crate::io::checkpoint::{
    load_compressed_tensors, load_expert_shard, load_experts, Dialect, LoadedExperts, QuantScheme,
};
use crate::io::safetensors::shape_str;
use crate::rng::Rng;
use crate::testing::expert_subset as subset;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A fresh directory under the temporary directory, removed on drop.
struct TmpDir(PathBuf);

impl TmpDir {
    fn new(tag: &str) -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let nanos =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        let dir = std::env::temp_dir().join(format!("nvfp4moe-ckpt-{}-{nanos}-{n}-{tag}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        TmpDir(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TmpDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[track_caller]
fn rng() -> (Rng, String) {
    let r = crate::testing::test_rng();
    let seed = format!("seed = {:#x}", r.seed());
    eprintln!("{seed}");
    (r, seed)
}

const QWEN: &str = "model.layers.3.mlp.experts";
const MIXTRAL: &str = "model.layers.0.block_sparse_moe.experts";

/// Random valid E4M3 scale bytes in 0x20..0x48 (about 2^-4 .. 2^1).
fn scale_bytes(r: &mut Rng, n: usize) -> Vec<u8> {
    (0..n).map(|_| 0x20 + r.below(0x28) as u8).collect()
}

/// A random checkpoint: gate and up decode scales 10x apart, up input scales different from
/// gate's, all input scales present.
fn random_ckpt(r: &mut Rng, experts: usize, h: usize, i: usize) -> MoeCheckpoint {
    let mut weights = |n: usize, k: usize, g: &mut dyn FnMut(&mut Rng) -> f32| ExpertWeightsHost {
        experts,
        n,
        k,
        codes: r.bytes(experts * n * k / 2),
        scales: scale_bytes(r, experts * n * k / 16),
        decode_scales: (0..experts).map(|_| g(r)).collect(),
    };
    let w13 = weights(2 * i, h, &mut |r| r.uniform(1e-4, 1e-3));
    let w2 = weights(h, i, &mut |r| r.uniform(1e-4, 1e-3));
    let up_decode_scales = w13.decode_scales.iter().map(|g| g * 10.0).collect();
    let mut vals = |s: f32| (0..experts).map(|_| r.uniform(0.01, 1.0) * s).collect::<Vec<f32>>();
    let l1 = vals(1.0);
    let up = l1.iter().map(|x| x * 2.0).collect();
    MoeCheckpoint {
        experts,
        hidden: h,
        intermediate: i,
        w13,
        up_decode_scales,
        w2,
        l1_input_scales: Some(l1),
        up_input_scales: Some(up),
        l2_input_scales: Some(vals(3.0)),
        naming: ExpertNaming::GateUpDown,
    }
}

/// The checkpoint a fused naming can hold: up's decode scales equal to gate's, no separate up
/// input scales.
fn fusable(c: &MoeCheckpoint) -> MoeCheckpoint {
    let mut c = c.clone();
    c.up_decode_scales = c.w13.decode_scales.clone();
    c.up_input_scales = None;
    c
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn opt_bits(v: &Option<Vec<f32>>) -> Option<Vec<u32>> {
    v.as_deref().map(bits)
}

fn assert_same_weights(a: &ExpertWeightsHost, b: &ExpertWeightsHost, what: &str, seed: &str) {
    assert_eq!((a.experts, a.n, a.k), (b.experts, b.n, b.k), "{what} dims; {seed}");
    assert!(a.codes == b.codes, "{what} codes differ; {seed}");
    assert!(a.scales == b.scales, "{what} scales differ; {seed}");
    assert_eq!(bits(&a.decode_scales), bits(&b.decode_scales), "{what} decode scales; {seed}");
}

/// Every field equal, bytes and f32 bits (the naming aside).
fn assert_same(a: &MoeCheckpoint, b: &MoeCheckpoint, seed: &str) {
    assert_eq!((a.experts, a.hidden, a.intermediate), (b.experts, b.hidden, b.intermediate), "{seed}");
    assert_same_weights(&a.w13, &b.w13, "w13", seed);
    assert_same_weights(&a.w2, &b.w2, "w2", seed);
    assert_eq!(bits(&a.up_decode_scales), bits(&b.up_decode_scales), "up decode scales; {seed}");
    assert_eq!(opt_bits(&a.l1_input_scales), opt_bits(&b.l1_input_scales), "l1 input scales; {seed}");
    assert_eq!(opt_bits(&a.up_input_scales), opt_bits(&b.up_input_scales), "up input scales; {seed}");
    assert_eq!(opt_bits(&a.l2_input_scales), opt_bits(&b.l2_input_scales), "l2 input scales; {seed}");
}

/// A raw tensor: name, dtype, shape, bytes.
type Raw = (String, Dtype, Vec<usize>, Vec<u8>);

fn raw_tensors(prefix: &str, naming: ExpertNaming, c: &MoeCheckpoint) -> Vec<Raw> {
    expert_tensors(prefix, naming, c)
        .unwrap()
        .into_iter()
        .map(|t| (t.name, t.dtype, t.shape, t.data.into_owned()))
        .collect()
}

fn write_raw(path: &Path, tensors: &[Raw]) {
    let views: Vec<(String, TensorView<'_>)> =
        tensors.iter().map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap())).collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// A safetensors file of exactly this header text (the 8-byte length, the JSON) and `data` zero
/// bytes: for headers no writer would make.
fn write_header_file(path: &Path, json: &str, data: usize) {
    let mut b = (json.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(json.as_bytes());
    b.extend(std::iter::repeat_n(0u8, data));
    std::fs::write(path, b).unwrap();
}

fn find(ts: &[Raw], name: &str) -> usize {
    ts.iter().position(|t| t.0 == name).unwrap_or_else(|| panic!("no `{name}`"))
}

fn assert_tensor_err(r: Result<MoeCheckpoint>, name: &str, contains: &[&str], seed: &str) {
    let e = r.err().unwrap_or_else(|| panic!("expected an error for `{name}`; {seed}"));
    let msg = e.to_string();
    match &e {
        Error::Tensor { name: n, what } => {
            assert_eq!(n, name, "{msg}; {seed}");
            for c in contains {
                assert!(what.contains(c), "`{msg}` lacks `{c}`; {seed}");
            }
        }
        _ => panic!("expected Error::Tensor for `{name}`, got {e:?}; {seed}"),
    }
    assert!(msg.contains(name), "{msg}; {seed}");
}

/// Writes the tensors of a random checkpoint (GateUpDown under [`QWEN`]) after `edit`, then
/// loads them.
fn load_edited(r: &mut Rng, edit: &dyn Fn(&mut Vec<Raw>)) -> Result<MoeCheckpoint> {
    let c = random_ckpt(r, 4, 64, 32);
    let mut ts = raw_tensors(QWEN, ExpertNaming::GateUpDown, &c);
    edit(&mut ts);
    let d = TmpDir::new("edit");
    let path = d.path("model.safetensors");
    write_raw(&path, &ts);
    load_modelopt(&path, QWEN)
}

#[test]
fn round_trip_every_naming() {
    let (mut r, seed) = rng();
    let d = TmpDir::new("rt");
    for naming in ExpertNaming::ALL {
        let experts = r.range(3, 5);
        let c = random_ckpt(&mut r, experts, 64, 32);
        assert!(c.w13.codes.iter().any(|&b| b != 0), "{seed}");
        let want = if naming.is_fused() { fusable(&c) } else { c.clone() };
        let path = d.path(&format!("{naming:?}.safetensors"));
        let proj0 = naming.projections()[0];
        if naming.is_fused() {
            // One weight_scale_2 for gate and up: different ones cannot be written.
            let e = write_modelopt_experts(&path, QWEN, naming, &c).unwrap_err();
            let name = format!("{QWEN}.0.{proj0}.weight_scale_2");
            assert!(matches!(&e, Error::Tensor { name: n, .. } if *n == name), "{e}; {seed}");
        }
        // A trailing dot in the prefix is tolerated, on writing and on loading.
        write_modelopt_experts(&path, &format!("{QWEN}."), naming, &want).unwrap();
        for prefix in [QWEN.to_string(), format!("{QWEN}.")] {
            let got = load_modelopt(&path, &prefix).unwrap();
            assert_eq!(got.naming, naming, "{seed}");
            assert_same(&got, &want, &seed);
        }

        // The file holds exactly the expected tensors, dtypes and shapes.
        let bytes = std::fs::read(&path).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let per_expert = 4 * naming.projections().len();
        assert_eq!(st.len(), experts * per_expert, "{seed}");
        let (rows0, k0) = if naming.is_fused() { (64, 64) } else { (32, 64) };
        let t = st.tensor(&format!("{QWEN}.1.{proj0}.weight")).unwrap();
        assert_eq!((t.dtype(), t.shape()), (Dtype::U8, &[rows0, k0 / 2][..]), "{seed}");
        let t = st.tensor(&format!("{QWEN}.1.{proj0}.weight_scale")).unwrap();
        assert_eq!((t.dtype(), t.shape()), (Dtype::F8_E4M3, &[rows0, k0 / 16][..]), "{seed}");
        let t = st.tensor(&format!("{QWEN}.1.{proj0}.weight_scale_2")).unwrap();
        assert_eq!((t.dtype(), t.shape()), (Dtype::F32, &[][..]), "{seed}");
        assert_eq!(t.data(), want.w13.decode_scales[1].to_le_bytes(), "{seed}");
        let down = naming.projections().last().unwrap();
        let t = st.tensor(&format!("{QWEN}.2.{down}.weight")).unwrap();
        assert_eq!((t.dtype(), t.shape()), (Dtype::U8, &[64, 16][..]), "{seed}");
        let t = st.tensor(&format!("{QWEN}.2.{down}.input_scale")).unwrap();
        assert_eq!((t.dtype(), t.shape()), (Dtype::F32, &[][..]), "{seed}");

        // Writing again gives the same bytes.
        let path2 = d.path(&format!("{naming:?}-2.safetensors"));
        write_modelopt_experts(&path2, QWEN, naming, &want).unwrap();
        assert_eq!(std::fs::read(&path2).unwrap(), bytes, "{seed}");
    }
    // Different gate and up decode scales survive a separate naming exactly.
    let c = random_ckpt(&mut r, 3, 64, 32);
    let path = d.path("scales.safetensors");
    write_modelopt_experts(&path, QWEN, ExpertNaming::GateUpDown, &c).unwrap();
    let got = load_modelopt(&path, QWEN).unwrap();
    assert!(got.up_decode_scales.iter().zip(&got.w13.decode_scales).all(|(u, g)| u != g), "{seed}");
    assert!(got.up_input_scales.is_some(), "{seed}");
    assert_same(&got, &c, &seed);
}

#[test]
fn mixtral_names() {
    let (mut r, seed) = rng();
    let c = random_ckpt(&mut r, 4, 64, 32);
    let d = TmpDir::new("mixtral");
    let path = d.path("model.safetensors");
    write_modelopt_experts(&path, MIXTRAL, ExpertNaming::W1W3W2, &c).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    for name in [
        "model.layers.0.block_sparse_moe.experts.0.w1.weight",
        "model.layers.0.block_sparse_moe.experts.3.w3.weight_scale",
        "model.layers.0.block_sparse_moe.experts.2.w2.weight_scale_2",
        "model.layers.0.block_sparse_moe.experts.1.w1.input_scale",
    ] {
        assert!(st.tensor(name).is_ok(), "{name}; {seed}");
    }
    // The up rows of expert 3 are w3's.
    let w3 = st.tensor("model.layers.0.block_sparse_moe.experts.3.w3.weight").unwrap();
    assert_eq!(w3.data(), &c.w13.codes[(3 * 64 + 32) * 32..4 * 64 * 32], "{seed}");
    let got = load_modelopt(&path, MIXTRAL).unwrap();
    assert_eq!(got.naming, ExpertNaming::W1W3W2, "{seed}");
    assert_same(&got, &c, &seed);
    // A wrong prefix finds nothing and says which expert prefixes there are.
    let e = load_modelopt(&path, "model.layers.0.mlp.experts").unwrap_err();
    assert!(matches!(e, Error::Invalid(_)) && e.to_string().contains(MIXTRAL), "{e}; {seed}");
}

/// Splits `ts` over two shard files (alternating, so one expert's tensors land in both) plus an
/// index in `dir`, with an unrelated tensor in the first shard; returns the index path.
fn write_sharded(dir: &Path, ts: &[Raw]) -> PathBuf {
    let mut shards: [Vec<Raw>; 2] = [vec![], vec![]];
    for (j, t) in ts.iter().enumerate() {
        shards[j % 2].push(t.clone());
    }
    shards[0].push(("model.layers.3.mlp.gate.weight".to_string(), Dtype::BF16, vec![4, 64], vec![1; 512]));
    let files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"];
    let mut map = serde_json::Map::new();
    for (shard, file) in shards.iter().zip(files) {
        write_raw(&dir.join(file), shard);
        for t in shard {
            map.insert(t.0.clone(), serde_json::Value::String(file.to_string()));
        }
    }
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": map});
    let path = dir.join("model.safetensors.index.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&index).unwrap()).unwrap();
    path
}

#[test]
fn sharded_checkpoint_via_index_and_directory() {
    let (mut r, seed) = rng();
    for naming in [ExpertNaming::GateUpDown, ExpertNaming::FusedW13] {
        let c = random_ckpt(&mut r, 3, 64, 32);
        let c = if naming.is_fused() { fusable(&c) } else { c };
        let d = TmpDir::new("sharded");
        let index = write_sharded(&d.0, &raw_tensors(QWEN, naming, &c));
        for path in [index.clone(), d.0.clone()] {
            let got = load_modelopt(&path, QWEN).unwrap();
            assert_eq!(got.naming, naming, "{seed}");
            assert_same(&got, &c, &seed);
        }
        // A shard that lacks a tensor the index lists for it.
        let name = format!("{QWEN}.1.{}.weight_scale", naming.projections()[0]);
        let ts = raw_tensors(QWEN, naming, &c);
        let j = find(&ts, &name);
        let index = write_sharded(&d.0, &ts);
        let files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"];
        let shard = d.path(files[j % 2]);
        let kept: Vec<Raw> =
            ts.iter().enumerate().filter(|(k, t)| k % 2 == j % 2 && t.0 != name).map(|(_, t)| t.clone()).collect();
        write_raw(&shard, &kept);
        assert_tensor_err(load_modelopt(&index, QWEN), &name, &["does not hold it"], &seed);
        // A shard file that is gone.
        std::fs::remove_file(&shard).unwrap();
        match load_modelopt(&index, QWEN).unwrap_err() {
            Error::Io(e) => assert!(e.to_string().contains(&*shard.to_string_lossy()), "{e}; {seed}"),
            e => panic!("expected Error::Io, got {e:?}; {seed}"),
        }
    }
}

#[test]
fn directory_with_one_file_and_ambiguous_directories() {
    let (mut r, seed) = rng();
    let c = random_ckpt(&mut r, 3, 64, 32);
    let d = TmpDir::new("dir");
    let invalid_with = |e: Error, what: &str| {
        assert!(matches!(e, Error::Invalid(_)), "{e:?}; {seed}");
        assert!(e.to_string().contains(&*d.0.to_string_lossy()) && e.to_string().contains(what), "{e}; {seed}");
    };
    invalid_with(load_modelopt(&d.0, QWEN).unwrap_err(), "no `.safetensors`");
    write_modelopt_experts(d.path("experts.safetensors"), QWEN, ExpertNaming::FusedGateUp, &fusable(&c)).unwrap();
    std::fs::write(d.path("config.json"), b"{}").unwrap();
    let got = load_modelopt(&d.0, QWEN).unwrap();
    assert_eq!(got.naming, ExpertNaming::FusedGateUp, "{seed}");
    assert_same(&got, &fusable(&c), &seed);
    // Two files and no index: ambiguous.
    write_modelopt_experts(d.path("other.safetensors"), QWEN, ExpertNaming::GateUpDown, &c).unwrap();
    invalid_with(load_modelopt(&d.0, QWEN).unwrap_err(), "2 `.safetensors` files");
    // An index is preferred over the files.
    let index = serde_json::json!({"weight_map": raw_tensors(QWEN, ExpertNaming::GateUpDown, &c)
        .iter().map(|t| (t.0.clone(), serde_json::Value::from("other.safetensors"))).collect::<serde_json::Map<_, _>>()});
    std::fs::write(d.path("a.safetensors.index.json"), index.to_string()).unwrap();
    let got = load_modelopt(&d.0, QWEN).unwrap();
    assert_eq!(got.naming, ExpertNaming::GateUpDown, "{seed}");
    assert_same(&got, &c, &seed);
    // Two indexes: ambiguous.
    std::fs::write(d.path("b.safetensors.index.json"), index.to_string()).unwrap();
    invalid_with(load_modelopt(&d.0, QWEN).unwrap_err(), "2 `*.index.json`");
}

#[test]
fn file_errors_name_the_path() {
    let d = TmpDir::new("files");
    let absent = d.path("absent.safetensors");
    match load_modelopt(&absent, QWEN).unwrap_err() {
        Error::Io(e) => assert!(e.to_string().contains(&*absent.to_string_lossy()), "{e}"),
        e => panic!("expected Error::Io, got {e:?}"),
    }
    let bad = d.path("bad.safetensors");
    std::fs::write(&bad, b"this is not a safetensors file").unwrap();
    let e = load_modelopt(&bad, QWEN).unwrap_err();
    assert!(matches!(e, Error::Invalid(_)) && e.to_string().contains(&*bad.to_string_lossy()), "{e:?}");
    let json = d.path("model.safetensors.index.json");
    std::fs::write(&json, b"{\"weight_map\": ").unwrap();
    let e = load_modelopt(&json, QWEN).unwrap_err();
    assert!(matches!(e, Error::Invalid(_)) && e.to_string().contains(&*json.to_string_lossy()), "{e:?}");
    std::fs::write(&json, b"{\"metadata\": {}}").unwrap();
    let e = load_modelopt(&json, QWEN).unwrap_err();
    assert!(e.to_string().contains("weight_map") && e.to_string().contains(&*json.to_string_lossy()), "{e}");
}

#[test]
fn missing_tensor_is_named() {
    let (mut r, seed) = rng();
    for field in ["weight", "weight_scale", "weight_scale_2"] {
        let name = format!("{QWEN}.2.up_proj.{field}");
        let res = load_edited(&mut r, &|ts| {
            let j = find(ts, &name);
            ts.remove(j);
        });
        assert_tensor_err(res, &name, &["not found"], &seed);
    }
    // Through an index too.
    let c = random_ckpt(&mut r, 3, 64, 32);
    let mut ts = raw_tensors(QWEN, ExpertNaming::GateUpDown, &c);
    let name = format!("{QWEN}.1.down_proj.weight");
    let j = find(&ts, &name);
    ts.remove(j);
    let d = TmpDir::new("missing-index");
    let index = write_sharded(&d.0, &ts);
    assert_tensor_err(load_modelopt(&index, QWEN), &name, &["not found", "weight_map"], &seed);
}

#[test]
fn wrong_dtype_and_shape_are_named() {
    let (mut r, seed) = rng();
    let name = format!("{QWEN}.1.gate_proj.weight");
    let res = load_edited(&mut r, &|ts| {
        let j = find(ts, &name);
        ts[j].1 = Dtype::F32;
        ts[j].3 = ts[j].3.repeat(4);
    });
    assert_tensor_err(res, &name, &["F32", "U8"], &seed);
    let name = format!("{QWEN}.2.down_proj.weight_scale");
    let res = load_edited(&mut r, &|ts| {
        let j = find(ts, &name);
        ts[j].1 = Dtype::U8;
    });
    assert_tensor_err(res, &name, &["U8", "F8_E4M3"], &seed);
    // Scale [N, K/8] instead of [N, K/16].
    let name = format!("{QWEN}.3.up_proj.weight_scale");
    let res = load_edited(&mut r, &|ts| {
        let j = find(ts, &name);
        ts[j].2 = vec![32, 8];
        ts[j].3 = ts[j].3.repeat(2);
    });
    assert_tensor_err(res, &name, &["[32, 8]", "expected [32, 4]"], &seed);
    let name = format!("{QWEN}.0.down_proj.weight_scale_2");
    let res = load_edited(&mut r, &|ts| {
        let j = find(ts, &name);
        ts[j].1 = Dtype::BF16;
        ts[j].3 = vec![0x80, 0x3f];
    });
    assert_tensor_err(res, &name, &["BF16", "F32"], &seed);
    let res = load_edited(&mut r, &|ts| {
        let j = find(ts, &name);
        ts[j].2 = vec![2];
        ts[j].3 = ts[j].3.repeat(2);
    });
    assert_tensor_err(res, &name, &["scalar"], &seed);
    // weight_scale_2 of shape [1] is accepted.
    let res = load_edited(&mut r, &|ts| {
        let j = find(ts, &name);
        ts[j].2 = vec![1];
    });
    assert!(res.is_ok(), "{res:?}; {seed}");
    // H or I not a multiple of 16 (expert 0's gate decides them).
    let name = format!("{QWEN}.0.gate_proj.weight");
    let res = load_edited(&mut r, &|ts| {
        let j = find(ts, &name);
        ts[j].2 = vec![24, 32];
        ts[j].3.truncate(24 * 32);
    });
    assert_tensor_err(res, &name, &["I = 24", "multiple of 16"], &seed);
}

#[test]
fn gap_in_experts_is_named() {
    let (mut r, seed) = rng();
    let res = load_edited(&mut r, &|ts| ts.retain(|t| !t.0.starts_with(&format!("{QWEN}.2."))));
    assert_tensor_err(res, &format!("{QWEN}.2.gate_proj.weight"), &["not found", "without gaps"], &seed);
    // Expert 0 missing: the naming comes from expert 1.
    let res = load_edited(&mut r, &|ts| ts.retain(|t| !t.0.starts_with(&format!("{QWEN}.0."))));
    assert_tensor_err(res, &format!("{QWEN}.0.gate_proj.weight"), &["not found"], &seed);
}

#[test]
fn bad_decode_scale_is_named() {
    let (mut r, seed) = rng();
    for bad in [f32::NAN, 0.0, -1.0, f32::INFINITY] {
        let name = format!("{QWEN}.2.up_proj.weight_scale_2");
        let res = load_edited(&mut r, &|ts| {
            let j = find(ts, &name);
            ts[j].3 = bad.to_le_bytes().to_vec();
        });
        assert_tensor_err(res, &name, &["finite and > 0"], &seed);
    }
    let name = format!("{QWEN}.1.down_proj.input_scale");
    let res = load_edited(&mut r, &|ts| {
        let j = find(ts, &name);
        ts[j].3 = f32::NAN.to_le_bytes().to_vec();
    });
    assert_tensor_err(res, &name, &["finite"], &seed);
}

#[test]
fn inconsistent_hidden_is_named() {
    let (mut r, seed) = rng();
    // Expert 1 with H = 128: every one of its tensors consistent with that.
    let other = random_ckpt(&mut r, 4, 128, 32);
    let other_ts = raw_tensors(QWEN, ExpertNaming::GateUpDown, &other);
    let res = load_edited(&mut r, &|ts| {
        for t in ts.iter_mut().filter(|t| t.0.starts_with(&format!("{QWEN}.1."))) {
            *t = other_ts.iter().find(|o| o.0 == t.0).unwrap().clone();
        }
    });
    assert_tensor_err(res, &format!("{QWEN}.1.gate_proj.weight"), &["[32, 64]", "expected [32, 32]", "H = 64"], &seed);
    // Up with another I than gate.
    let name = format!("{QWEN}.0.up_proj.weight");
    let res = load_edited(&mut r, &|ts| {
        let j = find(ts, &name);
        ts[j].2 = vec![16, 64];
    });
    assert_tensor_err(res, &name, &["[16, 64]", "expected [32, 32]"], &seed);
}

#[test]
fn input_scales_absent_or_partial() {
    let (mut r, seed) = rng();
    let got = load_edited(&mut r, &|ts| ts.retain(|t| !t.0.ends_with(".input_scale"))).unwrap();
    assert!(got.l1_input_scales.is_none() && got.up_input_scales.is_none(), "{seed}");
    assert!(got.l2_input_scales.is_none(), "{seed}");
    // Only down has them.
    let got =
        load_edited(&mut r, &|ts| ts.retain(|t| !t.0.ends_with("_proj.input_scale") || t.0.contains("down"))).unwrap();
    assert!(got.l1_input_scales.is_none() && got.l2_input_scales.is_some(), "{seed}");
    // Up's equal to gate's are not kept twice.
    let c = fusable(&random_ckpt(&mut r, 3, 64, 32));
    let d = TmpDir::new("inputs");
    let path = d.path("m.safetensors");
    write_modelopt_experts(&path, QWEN, ExpertNaming::GateUpDown, &c).unwrap();
    let got = load_modelopt(&path, QWEN).unwrap();
    assert!(got.up_input_scales.is_none(), "{seed}");
    assert_same(&got, &c, &seed);
    // In some experts only.
    let name = format!("{QWEN}.2.gate_proj.input_scale");
    let res = load_edited(&mut r, &|ts| {
        let j = find(ts, &name);
        ts.remove(j);
    });
    assert_tensor_err(res, &name, &["not found", "every expert or none"], &seed);
    let res = load_edited(&mut r, &|ts| {
        ts.retain(|t| !t.0.ends_with("gate_proj.input_scale") || t.0.starts_with(&format!("{QWEN}.3.")));
    });
    assert_tensor_err(res, &format!("{QWEN}.3.gate_proj.input_scale"), &["every expert or none"], &seed);
}

#[test]
fn mixed_or_unexpected_names_are_refused() {
    let (mut r, seed) = rng();
    // Expert 1 in the Mixtral naming while expert 0 uses gate_proj/up_proj/down_proj.
    let res = load_edited(&mut r, &|ts| {
        for t in ts.iter_mut().filter(|t| t.0.starts_with(&format!("{QWEN}.1."))) {
            t.0 = t.0.replace("gate_proj", "w1").replace("up_proj", "w3").replace("down_proj", "w2");
        }
    });
    assert_tensor_err(res, &format!("{QWEN}.1.w1.input_scale"), &["one naming"], &seed);
    // A bias.
    let name = format!("{QWEN}.0.down_proj.bias");
    let res = load_edited(&mut r, &|ts| ts.push((name.clone(), Dtype::BF16, vec![64], vec![0; 128])));
    assert_tensor_err(res, &name, &["bias"], &seed);
    // Expert 0 with both gate_proj and gate_up_proj.
    let name = format!("{QWEN}.0.gate_up_proj.weight");
    let res = load_edited(&mut r, &|ts| ts.push((name.clone(), Dtype::U8, vec![64, 32], vec![0; 2048])));
    assert_tensor_err(res, &name, &["mixes"], &seed);
    // Something under the prefix that is not an expert.
    let name = format!("{QWEN}.gate_up_proj_bias");
    let res = load_edited(&mut r, &|ts| ts.push((name.clone(), Dtype::BF16, vec![4], vec![0; 8])));
    assert_tensor_err(res, &name, &["unexpected"], &seed);
}

#[test]
fn write_refuses_inconsistent_checkpoints() {
    let (mut r, seed) = rng();
    let c = random_ckpt(&mut r, 3, 64, 32);
    let d = TmpDir::new("write");
    let path = d.path("w.safetensors");
    let mut bad = c.clone();
    bad.w13.codes.pop();
    assert!(matches!(write_modelopt_experts(&path, QWEN, ExpertNaming::GateUpDown, &bad), Err(Error::InvalidShape(_))));
    let mut bad = c.clone();
    bad.up_decode_scales[1] = f32::NAN;
    assert!(matches!(write_modelopt_experts(&path, QWEN, ExpertNaming::GateUpDown, &bad), Err(Error::Invalid(_))));
    let mut bad = c.clone();
    bad.l2_input_scales = Some(vec![1.0; 2]);
    assert!(matches!(write_modelopt_experts(&path, QWEN, ExpertNaming::GateUpDown, &bad), Err(Error::InvalidShape(_))));
    // Different up input scales cannot go into a fused naming.
    let mut bad = fusable(&c);
    bad.up_input_scales = c.up_input_scales.clone();
    let e = write_modelopt_experts(&path, QWEN, ExpertNaming::FusedW13, &bad).unwrap_err();
    assert!(matches!(&e, Error::Tensor { name, .. } if *name == format!("{QWEN}.0.w13.input_scale")), "{e}; {seed}");
    assert!(!path.exists(), "{seed}");
}

// ------------------------------------------------------------------------------------------------
// compressed-tensors, configs, Hugging Face cache layouts, unsafe shard names, non-regular inputs

/// The tensors of `c` renamed and inverted into compressed-tensors' NVFP4 fields (`weight_packed`,
/// `weight_global_scale` = 1/g, `input_global_scale` = 1/activation scale), scalars of `shape`.
fn ct_tensors(prefix: &str, naming: ExpertNaming, c: &MoeCheckpoint, shape: &[usize]) -> Vec<Raw> {
    raw_tensors(prefix, naming, c)
        .into_iter()
        .map(|(name, dtype, s, bytes)| {
            let (stem, field) = name.rsplit_once('.').unwrap();
            let inv = |b: &[u8]| (1.0f32 / f32::from_le_bytes(b.try_into().unwrap())).to_le_bytes().to_vec();
            match field {
                "weight" => (format!("{stem}.weight_packed"), dtype, s, bytes),
                "weight_scale_2" => (format!("{stem}.weight_global_scale"), dtype, shape.to_vec(), inv(&bytes)),
                "input_scale" => (format!("{stem}.input_global_scale"), dtype, shape.to_vec(), inv(&bytes)),
                _ => (name, dtype, s, bytes),
            }
        })
        .collect()
}

/// compressed-tensors' `quantization_config` as its ModelOpt converter writes it (W4A4), or with
/// `input_activations` null (W4A16).
fn ct_config(w4a4: bool) -> serde_json::Value {
    let inputs = if w4a4 {
        serde_json::json!({"num_bits": 4, "type": "float", "strategy": "tensor_group", "dynamic": "local",
                           "group_size": 16, "symmetric": true})
    } else {
        serde_json::Value::Null
    };
    serde_json::json!({"architectures": ["Qwen3MoeForCausalLM"], "quantization_config": {
        "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "format": "nvfp4-pack-quantized",
            "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                        "symmetric": true, "dynamic": false},
            "input_activations": inputs}},
        "ignore": ["lm_head"], "version": "0.20.1"}})
}

fn write_json(path: &Path, v: &serde_json::Value) {
    std::fs::write(path, serde_json::to_vec_pretty(v).unwrap()).unwrap();
}

/// f32s within one ulp (the double reciprocal 1/(1/g) may not return g exactly).
fn assert_within_ulp(a: &[f32], b: &[f32], what: &str, seed: &str) {
    assert_eq!(a.len(), b.len(), "{what}; {seed}");
    for (x, y) in a.iter().zip(b) {
        assert!((x.to_bits() as i64 - y.to_bits() as i64).abs() <= 1, "{what}: {x} vs {y}; {seed}");
    }
}

#[test]
fn compressed_tensors_round_trip_both_scalar_shapes() {
    let (mut r, seed) = rng();
    for (naming, shape, w4a4) in [
        (ExpertNaming::GateUpDown, vec![], true),
        (ExpertNaming::W1W3W2, vec![1], true),
        (ExpertNaming::GateUpDown, vec![1], false),
    ] {
        let mut c = random_ckpt(&mut r, 3, 64, 32);
        if !w4a4 {
            c.l1_input_scales = None;
            c.up_input_scales = None;
            c.l2_input_scales = None;
        }
        let d = TmpDir::new("ct");
        write_raw(&d.path("model.safetensors"), &ct_tensors(QWEN, naming, &c, &shape));
        write_json(&d.path("config.json"), &ct_config(w4a4));
        let got = load_experts(&d.0, QWEN).unwrap();
        assert_eq!(got.format.dialect, Dialect::CompressedTensors, "{seed}");
        assert_eq!(got.format.scheme, if w4a4 { QuantScheme::W4A4 } else { QuantScheme::W4A16 }, "{seed}");
        assert_eq!(got.format.declared_in.as_deref(), Some(d.path("config.json").as_path()), "{seed}");
        let g = &got.checkpoint;
        assert_eq!(g.naming, naming, "{seed}");
        assert!(g.w13.codes == c.w13.codes && g.w13.scales == c.w13.scales, "{seed}");
        assert!(g.w2.codes == c.w2.codes && g.w2.scales == c.w2.scales, "{seed}");
        assert_within_ulp(&g.w13.decode_scales, &c.w13.decode_scales, "gate g", &seed);
        // Gate and up keep their own (different) decode scales, as on the ModelOpt path.
        assert_within_ulp(&g.up_decode_scales, &c.up_decode_scales, "up g", &seed);
        assert_within_ulp(&g.w2.decode_scales, &c.w2.decode_scales, "down g", &seed);
        if w4a4 {
            assert_within_ulp(g.l1_input_scales.as_ref().unwrap(), c.l1_input_scales.as_ref().unwrap(), "l1", &seed);
            assert_within_ulp(g.up_input_scales.as_ref().unwrap(), c.up_input_scales.as_ref().unwrap(), "up", &seed);
            assert_within_ulp(g.l2_input_scales.as_ref().unwrap(), c.l2_input_scales.as_ref().unwrap(), "l2", &seed);
        } else {
            assert!(g.l1_input_scales.is_none() && g.l2_input_scales.is_none(), "{seed}");
        }
        // Without the config the tensor names decide; the one-dialect loaders refuse the other.
        std::fs::remove_file(d.path("config.json")).unwrap();
        let got = load_experts(&d.0, QWEN).unwrap();
        assert_eq!((got.format.dialect, got.format.declared_in), (Dialect::CompressedTensors, None), "{seed}");
        assert!(load_compressed_tensors(&d.0, QWEN).is_ok(), "{seed}");
        let e = load_modelopt(&d.0, QWEN).unwrap_err();
        assert!(matches!(&e, Error::Dialect { .. }) && e.to_string().contains("load_compressed_tensors"), "{e}");
    }
    // A ModelOpt file read as compressed-tensors is refused too.
    let c = random_ckpt(&mut r, 2, 64, 32);
    let d = TmpDir::new("ct-mo");
    write_modelopt_experts(d.path("m.safetensors"), QWEN, ExpertNaming::GateUpDown, &c).unwrap();
    assert!(matches!(load_compressed_tensors(&d.0, QWEN), Err(Error::Dialect { .. })), "{seed}");
    let got = load_experts(&d.0, QWEN).unwrap();
    assert_eq!((got.format.dialect, got.format.scheme), (Dialect::ModelOpt, QuantScheme::W4A4), "{seed}");
}

#[test]
fn compressed_tensors_bad_global_scales_are_named() {
    let (mut r, seed) = rng();
    let c = random_ckpt(&mut r, 3, 64, 32);
    let d = TmpDir::new("ct-bad");
    for (field, bad, want) in [
        ("weight_global_scale", 0.0f32, "finite and > 0"),
        ("weight_global_scale", f32::INFINITY, "finite and > 0"),
        ("weight_global_scale", -2.0, "finite and > 0"),
        ("weight_global_scale", 1e-40, "not finite"),
        ("input_global_scale", 0.0, "must be > 0"),
        ("input_global_scale", f32::NAN, "must be > 0"),
    ] {
        let mut ts = ct_tensors(QWEN, ExpertNaming::GateUpDown, &c, &[]);
        let name = format!("{QWEN}.1.up_proj.{field}");
        let j = find(&ts, &name);
        ts[j].3 = bad.to_le_bytes().to_vec();
        let path = d.path("m.safetensors");
        write_raw(&path, &ts);
        assert_tensor_err(load_compressed_tensors(&path, QWEN), &name, &[want], &seed);
    }
    // +inf as the input global scale (an uncalibrated expert) gives activation scale 0.
    let mut ts = ct_tensors(QWEN, ExpertNaming::GateUpDown, &c, &[]);
    let j = find(&ts, &format!("{QWEN}.2.down_proj.input_global_scale"));
    ts[j].3 = f32::INFINITY.to_le_bytes().to_vec();
    let path = d.path("m.safetensors");
    write_raw(&path, &ts);
    assert_eq!(load_compressed_tensors(&path, QWEN).unwrap().l2_input_scales.unwrap()[2], 0.0, "{seed}");
    // One ModelOpt field among compressed-tensors ones.
    let mut ts = ct_tensors(QWEN, ExpertNaming::GateUpDown, &c, &[]);
    let j = find(&ts, &format!("{QWEN}.2.gate_proj.weight_packed"));
    ts[j].0 = format!("{QWEN}.2.gate_proj.weight");
    write_raw(&path, &ts);
    let e = load_experts(&path, QWEN).unwrap_err();
    assert!(matches!(&e, Error::Tensor { what, .. } if what.contains("one dialect")), "{e}; {seed}");
}

#[test]
fn configs_must_agree_with_the_tensors() {
    let (mut r, seed) = rng();
    let c = random_ckpt(&mut r, 2, 64, 32);
    let d = TmpDir::new("cfg");
    let path = d.path("model.safetensors");
    let config = d.path("config.json");
    let dialect_err = |res: Result<LoadedExperts>, want: &str| {
        let e = res.unwrap_err();
        assert!(matches!(&e, Error::Dialect { .. }) && e.to_string().contains(want), "`{e}` lacks `{want}`; {seed}");
    };
    // compressed-tensors declared, ModelOpt tensors.
    write_modelopt_experts(&path, QWEN, ExpertNaming::GateUpDown, &c).unwrap();
    write_json(&config, &ct_config(true));
    dialect_err(load_experts(&d.0, QWEN), "declares compressed-tensors NVFP4");
    // Another method or format.
    write_json(&config, &serde_json::json!({"quantization_config": {"quant_method": "fp8"}}));
    dialect_err(load_experts(&d.0, QWEN), "quant_method is `fp8`");
    let mut ct = ct_config(true);
    ct["quantization_config"]["format"] = "float-quantized".into();
    ct["quantization_config"]["config_groups"]["group_0"]["format"] = "float-quantized".into();
    write_json(&config, &ct);
    dialect_err(load_experts(&d.0, QWEN), "not NVFP4");
    let mut ct = ct_config(true);
    ct["quantization_config"]["quantization_status"] = "frozen".into();
    write_json(&config, &ct);
    dialect_err(load_experts(&d.0, QWEN), "not stored compressed");
    let mut ct = ct_config(true);
    ct["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 32.into();
    write_json(&config, &ct);
    dialect_err(load_experts(&d.0, QWEN), "group_size 32");
    // ModelOpt's hf_quant_config.json: NVFP4 is W4A4, so every input_scale must be there.
    std::fs::remove_file(&config).unwrap();
    let hf = d.path("hf_quant_config.json");
    write_json(
        &hf,
        &serde_json::json!({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "group_size": 16}}),
    );
    let got = load_experts(&d.0, QWEN).unwrap();
    assert_eq!((got.format.scheme, got.format.declared_in.as_deref()), (QuantScheme::W4A4, Some(hf.as_path())));
    let mut no_inputs = c.clone();
    no_inputs.l1_input_scales = None;
    no_inputs.up_input_scales = None;
    no_inputs.l2_input_scales = None;
    write_modelopt_experts(&path, QWEN, ExpertNaming::GateUpDown, &no_inputs).unwrap();
    let name = format!("{QWEN}.0.gate_proj.input_scale");
    assert_tensor_err(load_modelopt(&d.0, QWEN), &name, &["not found", "declares W4A4"], &seed);
    write_json(&hf, &serde_json::json!({"quantization": {"quant_algo": "W4A16_NVFP4", "group_size": 16}}));
    assert_eq!(load_experts(&d.0, QWEN).unwrap().format.scheme, QuantScheme::W4A16, "{seed}");
    write_modelopt_experts(&path, QWEN, ExpertNaming::GateUpDown, &c).unwrap();
    assert_tensor_err(load_modelopt(&d.0, QWEN), &name, &["declares W4A16"], &seed);
    write_json(&hf, &serde_json::json!({"quantization": {"quant_algo": "FP8"}}));
    dialect_err(load_experts(&d.0, QWEN), "quant_algo `FP8`");
    // compressed-tensors' converter copies hf_quant_config.json along: config.json outranks it.
    write_raw(&path, &ct_tensors(QWEN, ExpertNaming::GateUpDown, &c, &[]));
    write_json(&hf, &serde_json::json!({"quantization": {"quant_algo": "NVFP4", "group_size": 16}}));
    write_json(&config, &ct_config(true));
    assert_eq!(load_experts(&d.0, QWEN).unwrap().format.dialect, Dialect::CompressedTensors, "{seed}");
    // A config that is not JSON is named, its bytes are not quoted.
    std::fs::write(&config, b"{\"quantization_config\": SECRET-BYTES").unwrap();
    let e = load_experts(&d.0, QWEN).unwrap_err();
    assert!(matches!(&e, Error::Dialect { .. }) && !e.to_string().contains("SECRET"), "{e}");
}

#[cfg(unix)]
#[test]
fn hugging_face_cache_snapshot_and_root() {
    use std::os::unix::fs::symlink;
    let (mut r, seed) = rng();
    let c = random_ckpt(&mut r, 3, 64, 32);
    let d = TmpDir::new("hub");
    // A checkpoint made elsewhere, then laid out as huggingface_hub does: blobs named by hash,
    // snapshot entries symlinks to ../../blobs/<hash>, refs/main holding the commit.
    let src = TmpDir::new("hub-src");
    let index = write_sharded(&src.0, &raw_tensors(QWEN, ExpertNaming::GateUpDown, &c));
    write_json(&src.path("config.json"), &serde_json::json!({"model_type": "qwen3_moe"}));
    let root = d.0.join("models--nvfp4--tiny-moe");
    let rev = "0123456789abcdef0123456789abcdef01234567";
    let snap = root.join("snapshots").join(rev);
    std::fs::create_dir_all(root.join("blobs")).unwrap();
    std::fs::create_dir_all(root.join("refs")).unwrap();
    std::fs::create_dir_all(&snap).unwrap();
    for (k, entry) in std::fs::read_dir(&src.0).unwrap().enumerate() {
        let entry = entry.unwrap();
        let blob = format!("{k:064x}");
        std::fs::copy(entry.path(), root.join("blobs").join(&blob)).unwrap();
        symlink(format!("../../blobs/{blob}"), snap.join(entry.file_name())).unwrap();
    }
    assert!(index.exists());
    std::fs::write(root.join("refs").join("main"), format!("{rev}\n")).unwrap();
    for path in [snap.clone(), snap.join("model.safetensors.index.json"), root.clone()] {
        let got = load_experts(&path, QWEN).unwrap_or_else(|e| panic!("{}: {e}; {seed}", path.display()));
        assert_same(&got.checkpoint, &c, &seed);
    }
    // Without refs/main, the only snapshot; a second one makes it ambiguous.
    std::fs::remove_file(root.join("refs").join("main")).unwrap();
    assert_same(&load_modelopt(&root, QWEN).unwrap(), &c, &seed);
    std::fs::create_dir_all(root.join("snapshots").join("other")).unwrap();
    assert!(matches!(load_modelopt(&root, QWEN), Err(Error::Invalid(m)) if m.contains("2 snapshots")), "{seed}");
    // A ref that tries to leave snapshots/.
    std::fs::write(root.join("refs").join("main"), "../../etc").unwrap();
    let e = load_modelopt(&root, QWEN).unwrap_err();
    assert!(matches!(&e, Error::Invalid(_)) && e.to_string().contains("not a revision"), "{e}");
    std::fs::write(root.join("refs").join("main"), "feedbeef").unwrap();
    let e = load_modelopt(&root, QWEN).unwrap_err();
    assert!(e.to_string().contains("incomplete download"), "{e}");
}

#[test]
fn shard_names_must_stay_inside_the_index_directory() {
    let (mut r, seed) = rng();
    let c = random_ckpt(&mut r, 2, 64, 32);
    let ts = raw_tensors(QWEN, ExpertNaming::GateUpDown, &c);
    let d = TmpDir::new("escape");
    std::fs::create_dir_all(d.path("sub")).unwrap();
    write_raw(&d.path("sub/model.safetensors"), &ts);
    write_raw(&d.path("outside.safetensors"), &ts);
    let index = d.path("sub/model.safetensors.index.json");
    let with_shard = |shard: &str| {
        let map: serde_json::Map<String, serde_json::Value> = ts.iter().map(|t| (t.0.clone(), shard.into())).collect();
        write_json(&index, &serde_json::json!({"weight_map": map}));
        load_modelopt(&index, QWEN)
    };
    assert!(with_shard("model.safetensors").is_ok(), "{seed}");
    assert!(with_shard("./model.safetensors").is_ok(), "{seed}");
    for (shard, why) in [
        ("../outside.safetensors", "`..`"),
        ("a/../../outside.safetensors", "`..`"),
        ("..\\outside.safetensors", "`..`"),
        ("/etc/passwd", "absolute"),
        ("\\\\server\\share\\x.safetensors", "absolute"),
        ("C:\\x.safetensors", "absolute"),
        ("./", "no file name"),
    ] {
        let abs = d.path("outside.safetensors");
        for shard in [shard.to_string(), shard.replace("/etc/passwd", &abs.to_string_lossy())] {
            match with_shard(&shard) {
                Err(Error::UnsafeShardPath { shard: s, why: w, .. }) => {
                    assert_eq!(s, shard, "{seed}");
                    assert!(w.contains(why.trim_matches('`')) || w.contains(why), "{shard}: {w}; {seed}");
                }
                other => panic!("`{shard}`: expected UnsafeShardPath, got {other:?}; {seed}"),
            }
        }
    }
    // A shard entry that is not a string is named without quoting the JSON.
    let map: serde_json::Map<String, serde_json::Value> =
        ts.iter().map(|t| (t.0.clone(), serde_json::json!({"SECRET": [1, 2, 3]}))).collect();
    write_json(&index, &serde_json::json!({"weight_map": map}));
    let e = load_modelopt(&index, QWEN).unwrap_err();
    assert!(e.to_string().contains("an object") && !e.to_string().contains("SECRET"), "{e}");
}

#[cfg(unix)]
fn mkfifo(path: &Path) {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo {}", path.display());
}

#[cfg(unix)]
#[test]
fn non_regular_inputs_are_refused_before_reading() {
    let d = TmpDir::new("nonreg");
    // /dev/zero would be read until memory runs out.
    match load_modelopt("/dev/zero", QWEN) {
        Err(Error::NotRegularFile { kind: crate::io::FileKind::CharDevice, .. }) => {}
        other => panic!("expected NotRegularFile, got {other:?}"),
    }
    assert!(matches!(
        crate::io::SafetensorsFile::open("/dev/zero"),
        Err(Error::NotRegularFile { kind: crate::io::FileKind::CharDevice, .. })
    ));
    // A FIFO with no writer: opening it for reading would block forever.
    let fifo = d.path("pipe.safetensors");
    mkfifo(&fifo);
    match load_modelopt(&fifo, QWEN) {
        Err(Error::NotRegularFile { kind: crate::io::FileKind::Fifo, path }) => assert_eq!(path, fifo),
        other => panic!("expected NotRegularFile, got {other:?}"),
    }
    // A shard named by an index, and a config, that are FIFOs.
    let (mut r, _) = rng();
    let index = d.path("m.safetensors.index.json");
    let ts = raw_tensors(QWEN, ExpertNaming::GateUpDown, &random_ckpt(&mut r, 2, 64, 32));
    let map: serde_json::Map<String, serde_json::Value> =
        ts.iter().map(|t| (t.0.clone(), "pipe.safetensors".into())).collect();
    write_json(&index, &serde_json::json!({ "weight_map": map }));
    let e = load_modelopt(&index, QWEN);
    assert!(matches!(e, Err(Error::NotRegularFile { kind: crate::io::FileKind::Fifo, .. })), "{e:?}");
    write_modelopt_experts(
        d.path("pipe2.safetensors.tmp"),
        QWEN,
        ExpertNaming::GateUpDown,
        &random_ckpt(&mut r, 2, 64, 32),
    )
    .unwrap();
    std::fs::rename(d.path("pipe2.safetensors.tmp"), d.path("model.safetensors")).unwrap();
    std::fs::remove_file(&index).unwrap();
    std::fs::remove_file(&fifo).unwrap();
    mkfifo(&d.path("config.json"));
    assert!(matches!(load_experts(&d.0, QWEN), Err(Error::NotRegularFile { kind: crate::io::FileKind::Fifo, .. })));
}

#[test]
fn truncated_files_are_errors_not_crashes() {
    let (mut r, seed) = rng();
    let c = random_ckpt(&mut r, 2, 64, 32);
    let d = TmpDir::new("trunc");
    let path = d.path("m.safetensors");
    write_modelopt_experts(&path, QWEN, ExpertNaming::GateUpDown, &c).unwrap();
    let full = std::fs::read(&path).unwrap();
    // Truncated before opening: the header no longer matches the file.
    for cut in [full.len() - 1, full.len() / 2, 9, 7, 0] {
        std::fs::write(&path, &full[..cut]).unwrap();
        let e = load_modelopt(&path, QWEN).unwrap_err();
        assert!(matches!(&e, Error::Invalid(m) if m.contains("not a valid safetensors file")), "{cut}: {e}; {seed}");
    }
    // Truncated while open (mapped): reported, never read past the end (which would be SIGBUS).
    std::fs::write(&path, &full).unwrap();
    let f = crate::io::SafetensorsFile::open(&path).unwrap();
    let name = format!("{QWEN}.1.down_proj.weight");
    assert!(f.read(&name).is_ok());
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(64).unwrap();
    match f.read(&name) {
        Err(Error::FileChanged { path: p, what }) => assert!(p == path && what.contains("truncated"), "{what}"),
        other => panic!("expected FileChanged, got {other:?}"),
    }
}

#[test]
fn header_problems_are_named_without_quoting_the_header() {
    let d = TmpDir::new("header");
    let path = d.path("h.safetensors");
    let write_header = |json: &str, data: usize| write_header_file(&path, json, data);
    let open_err = || crate::io::SafetensorsFile::open(&path).unwrap_err().to_string();
    write_header(r#"{"a\nb": {"dtype": "SECRET_DTYPE", "shape": [2], "data_offsets": [0, 2]}}"#, 2);
    let m = open_err();
    assert!(m.contains("a\\u{a}b") && !m.contains("SECRET"), "{m}");
    write_header(r#"{"x": {"dtype": "U8", "shape": [4], "data_offsets": [0, 3]}}"#, 3);
    assert!(open_err().contains("do not hold U8 [4]"), "{}", open_err());
    write_header(
        r#"{"x": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, "y": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]}}"#,
        3,
    );
    assert!(open_err().contains("overlaps"), "{}", open_err());
    write_header(r#"{"x": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]}}"#, 3);
    assert!(open_err().contains("gap"), "{}", open_err());
    write_header(r#"{"x": {"dtype": "U8", "shape": [4611686018427387904, 8], "data_offsets": [0, 0]}}"#, 0);
    assert!(open_err().contains("fits in memory"), "{}", open_err());
    write_header(r#"{"__metadata__": {"k": 1}}"#, 0);
    assert!(open_err().contains("__metadata__"), "{}", open_err());
    write_header("[SECRET]", 0);
    assert!(open_err().contains("JSON of the wrong shape") && !open_err().contains("SECRET"), "{}", open_err());
    write_header(r#"{"__metadata__": {"format": "pt"}}"#, 0);
    assert!(crate::io::SafetensorsFile::open(&path).unwrap().names().is_empty());
}

/// Renames expert `from`'s tensors to expert `to` (a number written as given).
fn renumber(ts: &mut [Raw], from: usize, to: &str) {
    let (old, new) = (format!("{QWEN}.{from}."), format!("{QWEN}.{to}."));
    for t in ts.iter_mut() {
        if let Some(rest) = t.0.strip_prefix(&old) {
            t.0 = format!("{new}{rest}");
        }
    }
}

/// Expert numbers at the end of `usize`'s range (issue 21): a typed error naming the first
/// missing expert, never an overflow of E = last + 1 or an index past the end.
#[test]
fn expert_numbers_near_usize_max_are_named() {
    let (mut r, seed) = rng();
    for big in [usize::MAX, usize::MAX - 1] {
        // Experts 0, 1, 2 and `big`.
        let res = load_edited(&mut r, &|ts| renumber(ts, 3, &big.to_string()));
        assert_tensor_err(res, &format!("{QWEN}.3.gate_proj.weight"), &["not found", "without gaps"], &seed);
        // Expert `big` alone: the naming comes from it, expert 0 is missing.
        let res = load_edited(&mut r, &|ts| {
            ts.retain(|t| t.0.starts_with(&format!("{QWEN}.3.")));
            renumber(ts, 3, &big.to_string());
        });
        assert_tensor_err(res, &format!("{QWEN}.0.gate_proj.weight"), &["not found", "without gaps"], &seed);
    }
    // One past usize::MAX does not parse as an expert number: an unexpected tensor.
    let past = format!("{}0", usize::MAX);
    let res = load_edited(&mut r, &|ts| renumber(ts, 3, &past));
    // The first such name, sorted.
    assert_tensor_err(res, &format!("{QWEN}.{past}.down_proj.input_scale"), &["unexpected tensor"], &seed);
}

/// Zero-sized dimensions and shapes whose element count is 0 but whose other dimension is huge
/// (accepted by the header: 0 bytes) are typed errors naming the tensor, never an overflow.
#[test]
fn zero_sized_and_huge_dimensions_are_named() {
    let (mut r, seed) = rng();
    let name = format!("{QWEN}.0.gate_proj.weight");
    let scale = format!("{QWEN}.0.gate_proj.weight_scale");
    for (shape, want) in [
        (vec![32, 0], "H = 2 x 0 = 0 is not a positive multiple of 16"),
        (vec![0, 32], "I = 0 is not a positive multiple of 16"),
        (vec![0, 1usize << 63], "H = 2 x 9223372036854775808 does not fit"),
        (vec![0, usize::MAX], "does not fit"),
        (vec![0, 0], "is not a positive multiple of 16"),
    ] {
        let res = load_edited(&mut r, &|ts| {
            let j = find(ts, &name);
            ts[j].2 = shape.clone();
            ts[j].3 = vec![];
            let j = find(ts, &scale);
            ts[j].2 = vec![0, 0];
            ts[j].3 = vec![];
        });
        assert_tensor_err(res, &name, &[&shape_str(&shape), want], &seed);
    }
    // Another expert's zero-sized tensor is a shape mismatch.
    let name = format!("{QWEN}.2.down_proj.weight");
    let res = load_edited(&mut r, &|ts| {
        let j = find(ts, &name);
        ts[j].2 = vec![64, 0];
        ts[j].3 = vec![];
    });
    assert_tensor_err(res, &name, &["[64, 0]", "expected [64, 16]"], &seed);
}

/// A header that names a tensor twice, or repeats any key at any depth, is refused naming the
/// key (a JSON parser would silently keep the last one).
#[test]
fn repeated_header_keys_are_refused() {
    let d = TmpDir::new("dup");
    let path = d.path("h.safetensors");
    let write_header = |json: &str, data: usize| write_header_file(&path, json, data);
    let x = r#""x": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}"#;
    let x2 = r#""x": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}"#;
    let y = r#""y": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}"#;
    for (json, data, want) in [
        (format!("{{{x}, {x2}}}"), 4, "tensor `x` twice"),
        (format!("{{{x}, {y}, {x}}}"), 4, "tensor `x` twice"),
        (format!(r#"{{"__metadata__": {{}}, {x}, "__metadata__": {{}}}}"#), 2, "`__metadata__` twice"),
        (format!(r#"{{"__metadata__": {{"a": "1", "a": "2"}}, {x}}}"#), 2, "key `a` twice in `__metadata__`"),
        (
            r#"{"x": {"dtype": "U8", "dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}"#.into(),
            2,
            "key `dtype` twice in `x`",
        ),
        (
            r#"{"x": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2], "shape": [2]}}"#.into(),
            2,
            "key `shape` twice in `x`",
        ),
    ] {
        write_header(&json, data);
        let e = crate::io::SafetensorsFile::open(&path).unwrap_err();
        let m = e.to_string();
        assert!(matches!(e, Error::Invalid(_)) && m.contains(want) && m.contains("h.safetensors"), "{json}: {m}");
    }
    // The same tensors without the repetition are fine.
    write_header(&format!("{{{x}, {y}}}"), 4);
    assert_eq!(crate::io::SafetensorsFile::open(&path).unwrap().names(), ["x", "y"]);
}

/// An index whose weight_map lists a tensor twice is refused naming it.
#[test]
fn repeated_index_entries_are_refused() {
    let (mut r, seed) = rng();
    let d = TmpDir::new("dup-index");
    let ts = raw_tensors(QWEN, ExpertNaming::GateUpDown, &random_ckpt(&mut r, 2, 64, 32));
    let index = write_sharded(&d.0, &ts);
    let text = std::fs::read_to_string(&index).unwrap();
    let name = format!("{QWEN}.1.up_proj.weight");
    let entry = format!("\"{name}\":");
    let at = text.find(&entry).unwrap();
    let end = at + text[at..].find([',', '\n']).unwrap();
    // The entry again, naming the other shard: which one holds the tensor would be ambiguous.
    let other =
        text[at..end].replace("00001-of", "0000X-of").replace("00002-of", "00001-of").replace("0000X-of", "00002-of");
    std::fs::write(&index, format!("{}, {other}{}", &text[..end], &text[end..])).unwrap();
    let e = load_modelopt(&index, QWEN).unwrap_err();
    let m = e.to_string();
    assert!(matches!(e, Error::Invalid(_)) && m.contains(&format!("`{name}` twice")), "{m}; {seed}");
}

/// A config (`config.json`, `hf_quant_config.json`) with a key given twice is refused naming the
/// key and the file: serde_json would keep the last one silently, so a config declaring two
/// methods (or two group sizes) would be read as whichever came last (issue 21).
#[test]
fn repeated_config_keys_are_refused() {
    let (mut r, seed) = rng();
    let c = random_ckpt(&mut r, 2, 64, 32);
    let d = TmpDir::new("dup-config");
    let path = d.path("model.safetensors");
    write_modelopt_experts(&path, QWEN, ExpertNaming::GateUpDown, &c).unwrap();
    let config = d.path("config.json");
    let modelopt = r#"{"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}"#;
    let ct = serde_json::to_string(&ct_config(true)["quantization_config"]).unwrap();
    let refused = |file: &str, text: String, want: &str| {
        let p = d.path(file);
        std::fs::write(&p, text).unwrap();
        let e = load_experts(&d.0, QWEN).unwrap_err();
        let m = e.to_string();
        assert!(matches!(&e, Error::Dialect { path, .. } if path == Path::new(&p)), "{m}; {seed}");
        assert!(m.contains(want), "`{m}` lacks `{want}`; {seed}");
    };
    // The last of two quantization_configs is the ModelOpt one the tensors agree with.
    refused(
        "config.json",
        format!(r#"{{"quantization_config": {ct}, "model_type": "qwen3_moe", "quantization_config": {modelopt}}}"#),
        "has the key `quantization_config` twice",
    );
    refused(
        "config.json",
        r#"{"quantization_config": {"quant_method": "fp8", "quant_algo": "NVFP4", "quant_method": "modelopt"}}"#.into(),
        "has the key `quant_method` twice in `quantization_config`",
    );
    // A config that is not a JSON object (an array here) is refused too.
    refused("config.json", "[1, 2]".into(), "wrong shape");
    // Without the repetition the config is read.
    std::fs::write(&config, format!(r#"{{"model_type": "qwen3_moe", "quantization_config": {modelopt}}}"#)).unwrap();
    let got = load_experts(&d.0, QWEN).unwrap();
    assert_eq!(got.format.declared_in.as_deref(), Some(Path::new(&config)), "{seed}");
    // ModelOpt's own record.
    std::fs::remove_file(&config).unwrap();
    refused(
        "hf_quant_config.json",
        r#"{"quantization": {"quant_algo": "NVFP4", "group_size": 32, "group_size": 16}}"#.into(),
        "has the key `group_size` twice in `quantization`",
    );
}

#[test]
fn expert_shards_load_the_layers_bytes_for_their_experts() {
    let (mut r, seed) = rng();
    let c = random_ckpt(&mut r, 6, 64, 32);
    let shards: [&[usize]; 5] = [&[0, 1, 2, 3, 4, 5], &[2, 3], &[5, 0, 3], &[4], &[1, 0]];
    for naming in [ExpertNaming::GateUpDown, ExpertNaming::FusedW13, ExpertNaming::W1W3W2] {
        let c = if naming.is_fused() { fusable(&c) } else { c.clone() };
        let prefix = if naming == ExpertNaming::W1W3W2 { MIXTRAL } else { QWEN };
        let d = TmpDir::new("shard");
        // ModelOpt in one file and sharded over two; compressed-tensors in one file.
        let single = d.path("m.safetensors");
        write_modelopt_experts(&single, prefix, naming, &c).unwrap();
        let sub = TmpDir::new("shard-index");
        let index = write_sharded(&sub.0, &raw_tensors(prefix, naming, &c));
        let ct = d.path("ct.safetensors");
        write_raw(&ct, &ct_tensors(prefix, naming, &c, &[]));
        for path in [&single, &index, &ct] {
            let full = load_experts(path, prefix).unwrap();
            assert_eq!(full.expert_ids, (0..6).collect::<Vec<_>>(), "{seed}");
            for &ids in &shards {
                let got = load_expert_shard(path, prefix, ids).unwrap();
                assert_eq!(got.expert_ids, ids, "{seed}");
                assert_eq!(got.format, full.format, "{seed}");
                assert_eq!(got.checkpoint.naming, naming, "{seed}");
                assert_same(&got.checkpoint, &subset(&full.checkpoint, ids), &format!("{naming} {ids:?}: {seed}"));
            }
        }
    }
}

#[test]
fn an_expert_shard_sees_only_its_experts_values() {
    // Expert 4's decode scale is NaN: the layer refuses it (a value check, after reading), a shard
    // without expert 4 never takes it. Every header is still checked: a shard does not hide a
    // malformed expert.
    let (mut r, seed) = rng();
    let c = random_ckpt(&mut r, 6, 64, 32);
    let mut ts = raw_tensors(QWEN, ExpertNaming::GateUpDown, &c);
    let bad = format!("{QWEN}.4.down_proj.weight_scale_2");
    let j = find(&ts, &bad);
    ts[j].3 = f32::NAN.to_le_bytes().to_vec();
    let d = TmpDir::new("shard-nan");
    let path = d.path("m.safetensors");
    write_raw(&path, &ts);
    assert_tensor_err(load_experts(&path, QWEN).map(|l| l.checkpoint), &bad, &["finite"], &seed);
    let got = load_expert_shard(&path, QWEN, &[0, 5, 2]).unwrap();
    assert_same(&got.checkpoint, &subset(&c, &[0, 5, 2]), &seed);
    assert_tensor_err(load_expert_shard(&path, QWEN, &[3, 4]).map(|l| l.checkpoint), &bad, &["finite"], &seed);
    // A wrong shape in an expert outside the shard is still an error.
    let wrong = format!("{QWEN}.4.up_proj.weight");
    let k = find(&ts, &wrong);
    let half = ts[k].3.len() / 2;
    ts[k].2 = vec![ts[k].2[0], ts[k].2[1] / 2];
    ts[k].3.truncate(half);
    write_raw(&path, &ts);
    assert_tensor_err(load_expert_shard(&path, QWEN, &[0]).map(|l| l.checkpoint), &wrong, &["shape"], &seed);
}

#[test]
fn expert_shards_without_or_with_some_activation_scales() {
    // Weight-only (no input_scale anywhere) and down alone carrying one: the names a shard skips
    // per projection depend on it.
    let (mut r, seed) = rng();
    let c = random_ckpt(&mut r, 5, 64, 32);
    for keep in [None, Some("down_proj")] {
        let mut ts = raw_tensors(QWEN, ExpertNaming::GateUpDown, &c);
        ts.retain(|t| !t.0.ends_with(".input_scale") || keep.is_some_and(|k| t.0.contains(k)));
        let d = TmpDir::new("shard-inputs");
        let path = d.path("m.safetensors");
        write_raw(&path, &ts);
        let full = load_experts(&path, QWEN).unwrap();
        for ids in [&[3, 1][..], &[4][..], &[0, 2, 4][..]] {
            let got = load_expert_shard(&path, QWEN, ids).unwrap();
            assert_same(&got.checkpoint, &subset(&full.checkpoint, ids), &format!("{keep:?} {ids:?}: {seed}"));
        }
    }
}

#[test]
fn bad_expert_shards_are_named() {
    let (mut r, seed) = rng();
    let c = random_ckpt(&mut r, 3, 64, 32);
    let d = TmpDir::new("shard-bad");
    let path = d.path("m.safetensors");
    write_modelopt_experts(&path, QWEN, ExpertNaming::GateUpDown, &c).unwrap();
    // An empty or repeated list is refused before any file is opened: the path need not exist.
    for ids in [&[][..], &[1, 1][..]] {
        match load_expert_shard(d.path("missing.safetensors"), QWEN, ids) {
            Err(Error::Invalid(_)) => {}
            other => panic!("{ids:?}: expected Error::Invalid before opening, got {other:?}; {seed}"),
        }
    }
    for (ids, want) in [
        (&[][..], "at least one expert"),
        (&[3][..], "expert 3 of the shard is not in"),
        (&[0, usize::MAX][..], "has 3 experts (0 to 2)"),
        (&[1, 2, 1][..], "expert 1 is listed twice"),
    ] {
        match load_expert_shard(&path, QWEN, ids) {
            Err(Error::Invalid(msg)) => assert!(msg.contains(want), "{ids:?}: `{msg}` lacks `{want}`; {seed}"),
            other => panic!("{ids:?}: expected Error::Invalid, got {other:?}; {seed}"),
        }
    }
}
