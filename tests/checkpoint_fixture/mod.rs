//! The tiny checkpoints under `tests/fixtures/checkpoints/` that the crate writes itself: the
//! inputs of `scripts/fixtures/make_ct_fixtures.py`, which turns them into compressed-tensors
//! checkpoints with compressed-tensors' own code on a GPU machine (outputs committed beside them).
//!
//! - `bf16_moe/`: three Qwen3-MoE-style experts (`gate_proj`, `up_proj`, `down_proj`, H = 64,
//!   I = 64: the smallest shape the GPU layer takes) as BF16 weights, the input of compressed-tensors' NVFP4A16 (W4A16) compressor.
//! - `modelopt_w4a4/`: the same weights quantized by the crate's recipe-v2 quantizer (ModelOpt's
//!   bytes) as a ModelOpt NVFP4 W4A4 checkpoint with `input_scale`, the input of compressed-tensors'
//!   ModelOpt-NVFP4 converter. Expert 1's gate and up carry different `input_scale`s, and every
//!   expert's gate and up different `weight_scale_2`s (their amaxes differ).
//!
//! Deterministic: `tests/checkpoints.rs` regenerates them and checks the committed bytes
//! (`NVFP4MOE_WRITE_FIXTURES=1` rewrites them instead; then rerun the generator on a GPU machine).
//!
//! Beside them, compressed-tensors 0.20.1's work on an H200 (2026-12-02, torch 2.11.0+cu130,
//! `ct_versions.json` records versions and the inputs' sha256, `ct_run.log` the run):
//! - `ct_w4a4/`: `modelopt_w4a4/` converted by its `ModelOptNvfp4Converter`
//!   (`compressed_tensors.entrypoints.convert.convert_checkpoint`); its scalars keep ModelOpt's
//!   shape `[]`, and the converter copies `hf_quant_config.json` along.
//! - `ct_w4a16/`: `bf16_moe/` quantized with its `NVFP4A16` preset (`apply_quantization_config`,
//!   scales from `calculate_qparams` / `generate_gparam`, packed by `ModelCompressor.compress_model`);
//!   global scales of shape `[1]`.
//! - `ct_w4a4_decompressed.safetensors`, `ct_w4a16_decompressed.safetensors`: its own decompression
//!   of each (`NVFP4PackedCompressor.decompress`; for W4A16 through its `CompressedTensorsDequantizer`
//!   entry point, which refuses the W4A4 checkpoint's `input_global_scale`s as leftovers), BF16.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use half::bf16;
use nvfp4_moe::host::{self, ExpertNaming, ExpertWeightsHost, MoeCheckpoint};
use nvfp4_moe::io::write_modelopt_experts;
use nvfp4_moe::layout::ScaleLayout;
use nvfp4_moe::reference;
use nvfp4_moe::testing::Rng;
use safetensors::tensor::{Dtype, TensorView};

pub const PREFIX: &str = "model.layers.0.mlp.experts";
pub const EXPERTS: usize = 3;
pub const HIDDEN: usize = 64;
pub const INTERMEDIATE: usize = 64;
const SEED: u64 = 0x17_c0ffee;

/// `tests/fixtures/checkpoints/`.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/checkpoints")
}

/// One expert's BF16 weights, row-major: gate `[I, H]`, up `[I, H]`, down `[H, I]`.
pub struct Bf16Expert {
    pub gate: Vec<bf16>,
    pub up: Vec<bf16>,
    pub down: Vec<bf16>,
}

/// The BF16 experts (deterministic). Up is three times the size of gate, so their decode scales
/// differ; one expert's down holds a zero row.
pub fn bf16_experts() -> Vec<Bf16Expert> {
    let mut rng = Rng::new(SEED);
    (0..EXPERTS)
        .map(|e| {
            let gate = rng.normal_bf16(INTERMEDIATE * HIDDEN, 0.02);
            let up = rng.normal_bf16(INTERMEDIATE * HIDDEN, 0.06);
            let mut down = rng.normal_bf16(HIDDEN * INTERMEDIATE, 0.01 * (e + 1) as f32);
            if e == 2 {
                down[..INTERMEDIATE].iter_mut().for_each(|v| *v = bf16::ZERO);
            }
            Bf16Expert { gate, up, down }
        })
        .collect()
}

/// `[{prefix}.{e}.{proj}.weight]` of the BF16 experts, in expert order.
pub fn bf16_tensors(experts: &[Bf16Expert]) -> Vec<(String, Vec<usize>, &[bf16])> {
    let mut out = Vec::new();
    for (e, x) in experts.iter().enumerate() {
        out.push((format!("{PREFIX}.{e}.gate_proj.weight"), vec![INTERMEDIATE, HIDDEN], &x.gate[..]));
        out.push((format!("{PREFIX}.{e}.up_proj.weight"), vec![INTERMEDIATE, HIDDEN], &x.up[..]));
        out.push((format!("{PREFIX}.{e}.down_proj.weight"), vec![HIDDEN, INTERMEDIATE], &x.down[..]));
    }
    out
}

fn quantize(x: &[bf16], rows: usize, cols: usize) -> nvfp4_moe::host::Nvfp4Host {
    let g = host::weight_decode_scale(x).unwrap();
    reference::quantize(x, rows, cols, g, ScaleLayout::Linear).unwrap()
}

/// The BF16 experts quantized with recipe v2, with input scales: gate/up 0.0123 (expert 1's up
/// 0.0456), down 0.0031 x (e + 1).
pub fn modelopt_checkpoint(experts: &[Bf16Expert]) -> MoeCheckpoint {
    let (h, i) = (HIDDEN, INTERMEDIATE);
    let mut w13 =
        ExpertWeightsHost { experts: EXPERTS, n: 2 * i, k: h, codes: vec![], scales: vec![], decode_scales: vec![] };
    let mut w2 =
        ExpertWeightsHost { experts: EXPERTS, n: h, k: i, codes: vec![], scales: vec![], decode_scales: vec![] };
    let mut up_decode_scales = Vec::new();
    for x in experts {
        let (gate, up, down) = (quantize(&x.gate, i, h), quantize(&x.up, i, h), quantize(&x.down, h, i));
        w13.codes.extend_from_slice(&gate.codes);
        w13.codes.extend_from_slice(&up.codes);
        w13.scales.extend_from_slice(&gate.scales);
        w13.scales.extend_from_slice(&up.scales);
        w13.decode_scales.push(gate.decode_scale);
        up_decode_scales.push(up.decode_scale);
        w2.codes.extend_from_slice(&down.codes);
        w2.scales.extend_from_slice(&down.scales);
        w2.decode_scales.push(down.decode_scale);
    }
    let mut ckpt = MoeCheckpoint::from_experts(w13, up_decode_scales, w2);
    let l1 = vec![0.0123f32; EXPERTS];
    let mut up = l1.clone();
    up[1] = 0.0456;
    ckpt.l1_input_scales = Some(l1);
    ckpt.up_input_scales = Some(up);
    ckpt.l2_input_scales = Some((0..EXPERTS).map(|e| 0.0031 * (e + 1) as f32).collect());
    ckpt.naming = ExpertNaming::GateUpDown;
    ckpt.validate().unwrap();
    ckpt
}

/// A tiny Qwen3-MoE `config.json` (what the converters read and rewrite), with `extra` merged in.
fn config_json(extra: Option<serde_json::Value>) -> String {
    let mut v = serde_json::json!({
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": HIDDEN,
        "moe_intermediate_size": INTERMEDIATE,
        "num_experts": EXPERTS,
        "num_hidden_layers": 1,
        "torch_dtype": "bfloat16"
    });
    if let Some(serde_json::Value::Object(m)) = extra {
        v.as_object_mut().unwrap().extend(m);
    }
    serde_json::to_string_pretty(&v).unwrap() + "\n"
}

/// ModelOpt's quantization description (`hf_quant_config.json`'s `quantization` and the
/// `quantization_config` of `config.json`), as ModelOpt 0.47 writes them for NVFP4 W4A4.
fn modelopt_quant() -> serde_json::Value {
    serde_json::json!({"quant_algo": "NVFP4", "kv_cache_quant_algo": null, "group_size": 16, "exclude_modules": []})
}

/// Every file of the two fixture inputs: (path relative to [`root`], bytes).
pub fn inputs() -> Vec<(String, Vec<u8>)> {
    let experts = bf16_experts();
    let tmp = std::env::temp_dir().join(format!("nvfp4moe-fixture-inputs-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();

    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = bf16_tensors(&experts)
        .into_iter()
        .map(|(n, s, d)| (n, s, d.iter().flat_map(|v| v.to_le_bytes()).collect()))
        .collect();
    let views: Vec<(String, TensorView<'_>)> =
        bytes.iter().map(|(n, s, b)| (n.clone(), TensorView::new(Dtype::BF16, s.clone(), b).unwrap())).collect();
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    let bf16_file = safetensors::serialize(views, Some(meta)).unwrap();

    let modelopt_path = tmp.join("model.safetensors");
    write_modelopt_experts(&modelopt_path, PREFIX, ExpertNaming::GateUpDown, &modelopt_checkpoint(&experts)).unwrap();
    let modelopt_file = std::fs::read(&modelopt_path).unwrap();
    let _ = std::fs::remove_dir_all(&tmp);

    let mut q = modelopt_quant();
    q.as_object_mut().unwrap().insert("quant_method".into(), "modelopt".into());
    let hf_quant = serde_json::json!({
        "producer": {"name": "nvfp4-moe", "version": env!("CARGO_PKG_VERSION")},
        "quantization": modelopt_quant()
    });
    vec![
        ("bf16_moe/config.json".into(), config_json(None).into_bytes()),
        ("bf16_moe/model.safetensors".into(), bf16_file),
        (
            "modelopt_w4a4/config.json".into(),
            config_json(Some(serde_json::json!({"quantization_config": q}))).into_bytes(),
        ),
        (
            "modelopt_w4a4/hf_quant_config.json".into(),
            (serde_json::to_string_pretty(&hf_quant).unwrap() + "\n").into_bytes(),
        ),
        ("modelopt_w4a4/model.safetensors".into(), modelopt_file),
    ]
}

/// A fixture's files: (file name, bytes).
pub type Files = &'static [(&'static str, &'static [u8])];

/// The checkpoint fixtures of each dialect, built into the test binaries (the GPU tests run from
/// the GPU bundle, away from the source tree): (folder, files).
pub const DIALECT_FIXTURES: &[(&str, Files)] = &[
    (
        "modelopt_w4a4",
        &[
            ("config.json", include_bytes!("../fixtures/checkpoints/modelopt_w4a4/config.json")),
            ("hf_quant_config.json", include_bytes!("../fixtures/checkpoints/modelopt_w4a4/hf_quant_config.json")),
            ("model.safetensors", include_bytes!("../fixtures/checkpoints/modelopt_w4a4/model.safetensors")),
        ],
    ),
    (
        "ct_w4a4",
        &[
            ("config.json", include_bytes!("../fixtures/checkpoints/ct_w4a4/config.json")),
            ("hf_quant_config.json", include_bytes!("../fixtures/checkpoints/ct_w4a4/hf_quant_config.json")),
            ("model.safetensors", include_bytes!("../fixtures/checkpoints/ct_w4a4/model.safetensors")),
            (
                "model.safetensors.index.json",
                include_bytes!("../fixtures/checkpoints/ct_w4a4/model.safetensors.index.json"),
            ),
        ],
    ),
    (
        "ct_w4a16",
        &[
            ("config.json", include_bytes!("../fixtures/checkpoints/ct_w4a16/config.json")),
            ("model.safetensors", include_bytes!("../fixtures/checkpoints/ct_w4a16/model.safetensors")),
        ],
    ),
];

/// Writes one of [`DIALECT_FIXTURES`] into `dir`.
pub fn unpack(files: &[(&str, &[u8])], dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    for (name, bytes) in files {
        std::fs::write(dir.join(name), bytes).unwrap();
    }
}
