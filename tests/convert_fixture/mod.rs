//! Tiny Hugging Face models written at test time for `convert` (nothing committed but this code):
//! a Qwen3-MoE-like layer with attention, a router, shared experts, routed experts, norms,
//! embeddings and `lm_head`, in BF16, F16 or F32, per-expert or stacked 3-D experts, and its
//! DeepSeek-style FP8 block-scaled twin (with the BF16 dequantization of that twin).
#![allow(dead_code)]

use std::path::Path;

use half::{bf16, f16};
use nvfp4_moe::format::e4m3_decode;
use nvfp4_moe::testing::Rng;
use safetensors::tensor::{Dtype, TensorView};
use serde_json::{json, Value};

pub const LAYER: &str = "model.layers.0.mlp";
pub const EXPERTS: usize = 4;
pub const HIDDEN: usize = 64;
pub const INTERMEDIATE: usize = 32;
pub const VOCAB: usize = 48;

/// One tensor: name, dtype, shape, little-endian bytes.
#[derive(Clone, Debug)]
pub struct T {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

/// A model: its tensors (in shard order) and `config.json`.
#[derive(Clone, Debug)]
pub struct Model {
    pub tensors: Vec<T>,
    pub config: Value,
}

pub fn bf16_bytes(x: &[bf16]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

pub fn bf16_of(bytes: &[u8]) -> Vec<bf16> {
    bytes.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]])).collect()
}

fn config(model_type: &str) -> Value {
    json!({
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": model_type,
        "hidden_size": HIDDEN,
        "moe_intermediate_size": INTERMEDIATE,
        "num_experts": EXPERTS,
        "num_hidden_layers": 1,
        "vocab_size": VOCAB,
        "torch_dtype": "bfloat16"
    })
}

/// The BF16 weights of the tiny model, per-expert names. Up is three times gate's size so their
/// amaxes (and separate g) differ; expert 2's down has a zero row.
pub fn bf16_model(seed: u64) -> Model {
    let mut r = Rng::new(seed);
    let (h, i, e, v) = (HIDDEN, INTERMEDIATE, EXPERTS, VOCAB);
    let mut t = Vec::new();
    let mut push = |name: String, shape: Vec<usize>, x: Vec<bf16>| {
        t.push(T { name, dtype: Dtype::BF16, shape, data: bf16_bytes(&x) });
    };
    push("model.embed_tokens.weight".into(), vec![v, h], r.normal_bf16(v * h, 0.5));
    push("model.layers.0.input_layernorm.weight".into(), vec![h], vec![bf16::ONE; h]);
    for p in ["q_proj", "k_proj", "v_proj", "o_proj"] {
        push(format!("model.layers.0.self_attn.{p}.weight"), vec![h, h], r.normal_bf16(h * h, 0.05));
    }
    push(format!("{LAYER}.gate.weight"), vec![e, h], r.normal_bf16(e * h, 0.1));
    for (p, shape, s) in [("gate_proj", [i, h], 0.02), ("up_proj", [i, h], 0.02), ("down_proj", [h, i], 0.02)] {
        push(format!("{LAYER}.shared_experts.{p}.weight"), shape.to_vec(), r.normal_bf16(i * h, s));
    }
    for x in 0..e {
        push(format!("{LAYER}.experts.{x}.gate_proj.weight"), vec![i, h], r.normal_bf16(i * h, 0.02));
        push(format!("{LAYER}.experts.{x}.up_proj.weight"), vec![i, h], r.normal_bf16(i * h, 0.06));
        let mut down = r.normal_bf16(h * i, 0.01 * (x + 1) as f32);
        if x == 2 {
            down[..i].iter_mut().for_each(|v| *v = bf16::ZERO);
        }
        push(format!("{LAYER}.experts.{x}.down_proj.weight"), vec![h, i], down);
    }
    push("model.norm.weight".into(), vec![h], vec![bf16::ONE; h]);
    push("lm_head.weight".into(), vec![v, h], r.normal_bf16(v * h, 0.05));
    Model { tensors: t, config: config("qwen3_moe") }
}

/// `m` with every BF16 tensor stored as `dtype` (F16 or F32; the values are BF16 values, so
/// rounding back to BF16 is exact) or, with `noise`, F32 values that are not BF16 values.
pub fn with_dtype(m: &Model, dtype: Dtype, seed: u64) -> Model {
    let mut r = Rng::new(seed);
    let tensors = m
        .tensors
        .iter()
        .map(|t| {
            let x = bf16_of(&t.data);
            let data = match dtype {
                Dtype::F16 => x.iter().flat_map(|v| f16::from_f32(v.to_f32()).to_le_bytes()).collect(),
                Dtype::F32 => {
                    x.iter().flat_map(|v| (v.to_f32() * (1.0 + (r.f32() - 0.5) * 1e-3)).to_le_bytes()).collect()
                }
                _ => t.data.clone(),
            };
            T { name: t.name.clone(), dtype, shape: t.shape.clone(), data }
        })
        .collect();
    Model { tensors, config: m.config.clone() }
}

/// `m` with the routed experts stacked as transformers 5 stores them: `experts.gate_up_proj`
/// `[E, 2I, H]` (gate rows first) and `experts.down_proj` `[E, H, I]`.
pub fn stacked(m: &Model) -> Model {
    let mut tensors = Vec::new();
    let (mut gate_up, mut down) = (Vec::new(), Vec::new());
    for t in &m.tensors {
        if t.name.contains(".experts.") {
            if t.name.contains("down_proj") {
                down.extend_from_slice(&t.data);
            } else {
                // Per expert: gate then up, in that order in `m`.
                gate_up.extend_from_slice(&t.data);
            }
            continue;
        }
        tensors.push(t.clone());
    }
    tensors.push(T {
        name: format!("{LAYER}.experts.gate_up_proj"),
        dtype: Dtype::BF16,
        shape: vec![EXPERTS, 2 * INTERMEDIATE, HIDDEN],
        data: gate_up,
    });
    tensors.push(T {
        name: format!("{LAYER}.experts.down_proj"),
        dtype: Dtype::BF16,
        shape: vec![EXPERTS, HIDDEN, INTERMEDIATE],
        data: down,
    });
    Model { tensors, config: m.config.clone() }
}

/// A DeepSeek-style FP8 block-scaled model (blocks of `block` x `block`): every 2-D projection
/// `.weight` but the router E4M3 with an F32 `weight_scale_inv`; the rest BF16. Returns it and
/// its BF16 dequantization (`bf16_rne(f32(e4m3) * scale_inv)`, what DeepSeek's `weight_dequant`
/// writes), the model a user would get from DeepSeek's own FP8-to-BF16 cast.
pub fn fp8_model(seed: u64, block: usize) -> (Model, Model) {
    let base = bf16_model(seed);
    let mut r = Rng::new(seed ^ 0xf8);
    let (mut fp8, mut bf) = (Vec::new(), Vec::new());
    for t in &base.tensors {
        let is_proj = t.shape.len() == 2 && t.name.ends_with("_proj.weight");
        if !is_proj {
            fp8.push(t.clone());
            bf.push(t.clone());
            continue;
        }
        let (n, k) = (t.shape[0], t.shape[1]);
        let grid = [n.div_ceil(block), k.div_ceil(block)];
        // E4M3 codes without NaN (0x7F / 0xFF), and positive block scales around 1e-3.
        let codes: Vec<u8> = r.bytes(n * k).into_iter().map(|b| if b & 0x7F == 0x7F { b ^ 1 } else { b }).collect();
        let scales: Vec<f32> = (0..grid[0] * grid[1]).map(|_| 1e-4 * (1.0 + 9.0 * r.f32())).collect();
        let deq: Vec<bf16> = (0..n * k)
            .map(|j| {
                let s = scales[(j / k / block) * grid[1] + (j % k) / block];
                bf16::from_f32(e4m3_decode(codes[j]) * s)
            })
            .collect();
        fp8.push(T { name: t.name.clone(), dtype: Dtype::F8_E4M3, shape: t.shape.clone(), data: codes });
        fp8.push(T {
            name: t.name.replace(".weight", ".weight_scale_inv"),
            dtype: Dtype::F32,
            shape: grid.to_vec(),
            data: scales.iter().flat_map(|v| v.to_le_bytes()).collect(),
        });
        bf.push(T { name: t.name.clone(), dtype: Dtype::BF16, shape: t.shape.clone(), data: bf16_bytes(&deq) });
    }
    let mut config = base.config.clone();
    config["quantization_config"] = json!({
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block]
    });
    (Model { tensors: fp8, config }, Model { tensors: bf, config: base.config })
}

fn write_safetensors(path: &Path, tensors: &[T]) {
    let views: Vec<(String, TensorView<'_>)> =
        tensors.iter().map(|t| (t.name.clone(), TensorView::new(t.dtype, t.shape.clone(), &t.data).unwrap())).collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// Writes `m` into `dir` (created): `shards` files (`model-0000k-of-0000n.safetensors` with an
/// index for more than one, else `model.safetensors`), `config.json`, and a tokenizer file and a
/// file in a subdirectory (copied unchanged by `convert`).
pub fn write_model(dir: &Path, m: &Model, shards: usize) {
    std::fs::create_dir_all(dir.join("extra")).unwrap();
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&m.config).unwrap()).unwrap();
    std::fs::write(dir.join("tokenizer.json"), b"{\"version\": \"1.0\", \"model\": {}}\n").unwrap();
    std::fs::write(dir.join("extra/notes.txt"), b"copied as is\n").unwrap();
    if shards <= 1 {
        write_safetensors(&dir.join("model.safetensors"), &m.tensors);
        return;
    }
    // Shards by position among the weights, a `weight_scale_inv` beside its weight: an FP8 model
    // and its BF16 twin are sharded alike.
    let weights = m.tensors.iter().filter(|t| !t.name.ends_with("_scale_inv")).count();
    let per = weights.div_ceil(shards);
    let mut files: Vec<Vec<T>> = vec![Vec::new(); shards];
    let mut k = 0usize;
    for t in &m.tensors {
        if t.name.ends_with("_scale_inv") {
            files[(k - 1) / per].push(t.clone());
        } else {
            files[k / per].push(t.clone());
            k += 1;
        }
    }
    let mut map = serde_json::Map::new();
    for (s, chunk) in files.iter().enumerate() {
        let name = format!("model-{:05}-of-{:05}.safetensors", s + 1, shards);
        write_safetensors(&dir.join(&name), chunk);
        for t in chunk {
            map.insert(t.name.clone(), json!(name));
        }
    }
    let index = json!({"metadata": {"total_size": 0}, "weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), serde_json::to_string_pretty(&index).unwrap()).unwrap();
}

/// The BF16 values of tensor `name` of `m`.
pub fn bf16_tensor(m: &Model, name: &str) -> Vec<bf16> {
    let t = m.tensors.iter().find(|t| t.name == name).unwrap_or_else(|| panic!("no {name}"));
    assert_eq!(t.dtype, Dtype::BF16);
    bf16_of(&t.data)
}

/// Every file under `dir` (relative path -> bytes), hidden ones included.
pub fn snapshot(dir: &Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    fn walk(base: &Path, d: &Path, out: &mut std::collections::BTreeMap<String, Vec<u8>>) {
        for e in std::fs::read_dir(d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(base, &p, out);
            } else {
                out.insert(p.strip_prefix(base).unwrap().to_string_lossy().into_owned(), std::fs::read(&p).unwrap());
            }
        }
    }
    let mut out = std::collections::BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}
