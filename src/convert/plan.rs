//! Planning a conversion from the files' headers and configs alone: which tensors are converted,
//! which are copied (or, from an FP8 block-scaled model, dequantized to BF16), which gate/up
//! tensors share one decode scale, and every output shard's tensors in write order. Every check
//! that can fail on the input runs here, before the output directory exists.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::Dtype;
use serde_json::Value;

use super::{OutputFormat, BLOCK};
use crate::error::{Error, Result};
use crate::io::{read_small_file, shown, shown_path, Catalog, SafetensorsFile};

/// The largest `config.json` accepted.
const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// Field names of tensors that only quantized checkpoints hold (NVFP4 in either dialect, GPTQ/AWQ,
/// MXFP4): their presence means the model is already quantized.
const QUANTIZED_FIELDS: [&str; 12] = [
    "weight_packed",
    "weight_scale",
    "weight_scale_2",
    "weight_global_scale",
    "input_scale",
    "input_global_scale",
    "weight_zero_point",
    "qweight",
    "qzeros",
    "g_idx",
    "blocks",
    "weight_shape",
];

/// Model types whose stacked expert tensors (transformers 5's `experts.gate_up_proj`
/// `[E, 2I, H]`, gate rows first, and `experts.down_proj` `[E, H, I]`) the converter splits.
const ROW_MAJOR_FUSED_MODEL_TYPES: [&str; 11] = [
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "qwen3_next",
    "deepseek_v2",
    "deepseek_v3",
    "kimi_k2",
    "glm4_moe",
    "olmoe",
    "minimax",
    "phimoe",
];

/// How the input stores its weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum InputQuant {
    /// Plain floating-point weights.
    None,
    /// DeepSeek-V3 style FP8: E4M3 `weight` with an F32 `weight_scale_inv` per `[rows, cols]` block.
    Fp8Block { rows: usize, cols: usize },
}

/// Where the BF16 values of one converted matrix come from.
#[derive(Clone, Debug)]
pub(super) struct Source {
    pub shard: usize,
    pub name: String,
    pub dtype: Dtype,
    /// The rows of the (2-D view of the) input tensor this matrix is: all of them, or one
    /// expert's gate, up or down slice of a stacked 3-D tensor.
    pub first_row: usize,
    pub rows: usize,
    pub cols: usize,
    /// FP8 only: the shard and name of `weight_scale_inv`, its shape and the block shape.
    pub fp8: Option<Fp8Scales>,
}

#[derive(Clone, Debug)]
pub(super) struct Fp8Scales {
    pub shard: usize,
    pub name: String,
    pub grid: [usize; 2],
    pub block: [usize; 2],
}

impl Source {
    /// Bytes read from the input for this matrix (the FP8 scales not counted).
    pub fn input_bytes(&self) -> u64 {
        (self.rows * self.cols * (self.dtype.bitsize() / 8)) as u64
    }
}

/// One matrix to quantize: its source, the module name it is written under, and its g group.
#[derive(Clone, Debug)]
pub(super) struct QuantJob {
    pub source: Source,
    /// `model.layers.0.mlp.experts.3.gate_proj`: the output gets `{module}.weight_packed` etc.
    pub module: String,
    /// Index into [`Plan::units`]: the matrices that share one decode scale.
    pub unit: usize,
}

/// One item of an output shard, in write order.
#[derive(Clone, Debug)]
pub(super) enum Item {
    /// A tensor copied byte for byte.
    Copy { shard: usize, name: String, dtype: Dtype, shape: Vec<usize> },
    /// An FP8 block-scaled weight that is kept: written as its BF16 dequantization.
    Dequantize { source: Source, name: String },
    /// A matrix quantized to NVFP4 (three or four output tensors).
    Quantize(QuantJob),
}

/// One output tensor's header entry.
#[derive(Clone, Debug)]
pub(super) struct OutTensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
}

impl OutTensor {
    pub fn len(&self) -> usize {
        self.shape.iter().product::<usize>() * (self.dtype.bitsize() / 8)
    }
}

impl Item {
    /// The tensors this item writes, in order.
    pub fn outputs(&self, format: OutputFormat) -> Vec<OutTensor> {
        match self {
            Item::Copy { name, dtype, shape, .. } => {
                vec![OutTensor { name: name.clone(), dtype: *dtype, shape: shape.clone() }]
            }
            Item::Dequantize { source, name } => {
                vec![OutTensor { name: name.clone(), dtype: Dtype::BF16, shape: vec![source.rows, source.cols] }]
            }
            Item::Quantize(job) => {
                let (n, k, m) = (job.source.rows, job.source.cols, &job.module);
                let (codes, per_tensor, per_tensor_shape) = match format {
                    OutputFormat::CompressedTensors => ("weight_packed", "weight_global_scale", vec![1]),
                    OutputFormat::ModelOpt => ("weight", "weight_scale_2", vec![]),
                };
                vec![
                    OutTensor { name: format!("{m}.{codes}"), dtype: Dtype::U8, shape: vec![n, k / 2] },
                    OutTensor { name: format!("{m}.weight_scale"), dtype: Dtype::F8_E4M3, shape: vec![n, k / BLOCK] },
                    OutTensor { name: format!("{m}.{per_tensor}"), dtype: Dtype::F32, shape: per_tensor_shape },
                ]
            }
        }
    }

    /// Input bytes this item consumes (for progress and throughput).
    pub fn input_bytes(&self) -> u64 {
        match self {
            Item::Copy { dtype, shape, .. } => (shape.iter().product::<usize>() * (dtype.bitsize() / 8)) as u64,
            Item::Dequantize { source, .. } => source.input_bytes(),
            Item::Quantize(job) => job.source.input_bytes(),
        }
    }
}

/// One output shard: its file name (the input shard's) and items.
#[derive(Debug)]
pub(super) struct ShardPlan {
    pub file_name: String,
    pub items: Vec<Item>,
}

/// Everything a conversion does, decided before anything is written.
#[derive(Debug)]
pub(super) struct Plan {
    /// The model directory (config and other files).
    pub dir: PathBuf,
    /// The input shard files (index order), opened (headers checked, data mapped).
    pub files: Vec<SafetensorsFile>,
    /// The index file, if the input is sharded.
    pub index: Option<PathBuf>,
    /// The input's `config.json`, if any.
    pub config: Option<Value>,
    pub input_quant: InputQuant,
    pub shards: Vec<ShardPlan>,
    /// For each g group, the jobs (shard, item index) in it.
    pub units: Vec<Vec<(usize, usize)>>,
    /// Modules of kept 2-D `.weight` tensors (Linear layers that stay unquantized), sorted.
    pub ignore: Vec<String>,
    /// Files of the model directory other than shards, index, configs: copied.
    pub other_files: Vec<PathBuf>,
}

/// A glob over tensor names: `*` any run of characters (dots included), `?` one character.
pub(super) fn glob_match(pattern: &str, name: &str) -> bool {
    let (p, n) = (pattern.as_bytes(), name.as_bytes());
    let (mut pi, mut ni) = (0usize, 0usize);
    let mut star: Option<(usize, usize)> = None;
    while ni < n.len() {
        if pi < p.len() && (p[pi] == b'?' || p[pi] == n[ni]) {
            pi += 1;
            ni += 1;
        } else if pi < p.len() && p[pi] == b'*' {
            star = Some((pi, ni));
            pi += 1;
        } else if let Some((sp, sn)) = star {
            pi = sp + 1;
            ni = sn + 1;
            star = Some((sp, sn + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == b'*')
}

/// What a 2-D expert projection is, for g sharing and naming.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Projection {
    Gate,
    Up,
    Down,
    /// Already fused gate and up (`gate_up_proj`, `w13`): one tensor, one g.
    GateUp,
}

fn projection(name: &str) -> Option<Projection> {
    match name {
        "gate_proj" | "w1" => Some(Projection::Gate),
        "up_proj" | "w3" => Some(Projection::Up),
        "down_proj" | "w2" => Some(Projection::Down),
        "gate_up_proj" | "w13" => Some(Projection::GateUp),
        _ => None,
    }
}

/// Whether `name` is a routed expert's 2-D projection weight: `…experts.{e}.{projection}.weight`
/// (`shared_experts` is not `experts`).
fn is_routed_expert_weight(name: &str) -> bool {
    let parts: Vec<&str> = name.split('.').collect();
    let n = parts.len();
    n >= 4
        && parts[n - 1] == "weight"
        && projection(parts[n - 2]).is_some()
        && !parts[n - 3].is_empty()
        && parts[n - 3].bytes().all(|b| b.is_ascii_digit())
        && parts[n - 4] == "experts"
}

/// A stacked 3-D expert tensor: `…experts.gate_up_proj` or `…experts.down_proj` (with or without
/// `.weight`). Returns the prefix before `.experts` and whether it is gate/up.
fn stacked_expert(name: &str) -> Option<(&str, bool)> {
    let base = name.strip_suffix(".weight").unwrap_or(name);
    for (suffix, gate_up) in [(".experts.gate_up_proj", true), (".experts.down_proj", false)] {
        if let Some(prefix) = base.strip_suffix(suffix) {
            return Some((prefix, gate_up));
        }
    }
    None
}

/// The g group of a converted module: gate and up (and `w1`/`w3`) of one parent share one, and so
/// do `q_proj`/`k_proj`/`v_proj` (serving stacks fuse each of these sets into one GEMM with one g,
/// as llm-compressor does); every other matrix has its own.
fn g_group(module: &str) -> String {
    let (parent, last) = module.rsplit_once('.').unwrap_or(("", module));
    let class = match last {
        "gate_proj" | "up_proj" => "gate_up",
        "w1" | "w3" => "w13",
        "q_proj" | "k_proj" | "v_proj" => "qkv",
        _ => return module.to_string(),
    };
    format!("{parent}.<{class}>")
}

fn already_quantized(path: &Path, what: String) -> Error {
    Error::AlreadyQuantized { path: path.to_path_buf(), what }
}

/// The input's quantization from `config.json`: none, FP8 block-scaled (taken), or anything else
/// (refused).
fn input_quant(config_path: &Path, config: Option<&Value>, dir: &Path) -> Result<InputQuant> {
    let hf_quant = dir.join("hf_quant_config.json");
    if hf_quant.exists() {
        return Err(already_quantized(&hf_quant, "ModelOpt's hf_quant_config.json is present".into()));
    }
    let Some(config) = config else { return Ok(InputQuant::None) };
    let qc = config
        .get("quantization_config")
        .or_else(|| config.get("text_config").and_then(|t| t.get("quantization_config")))
        .or_else(|| config.get("compression_config"))
        .filter(|q| !q.is_null());
    let Some(qc) = qc else { return Ok(InputQuant::None) };
    let method = qc.get("quant_method").and_then(Value::as_str).unwrap_or("unknown");
    if method != "fp8" {
        return Err(already_quantized(
            config_path,
            format!(
                "quantization_config's quant_method is `{}` (convert takes BF16/F16/F32 weights and FP8 block-scaled \
                 ones, quant_method fp8 with weight_block_size)",
                shown(method)
            ),
        ));
    }
    let block: Option<Vec<Option<u64>>> =
        qc.get("weight_block_size").and_then(Value::as_array).map(|a| a.iter().map(Value::as_u64).collect());
    match block {
        Some(v) if matches!(v.as_slice(), [Some(r), Some(c)] if *r > 0 && *c > 0) => {
            let fmt = qc.get("fmt").and_then(Value::as_str).unwrap_or("e4m3");
            if fmt != "e4m3" {
                return Err(already_quantized(
                    config_path,
                    format!("FP8 format `{}`: only e4m3 block-scaled weights are dequantized", shown(fmt)),
                ));
            }
            Ok(InputQuant::Fp8Block { rows: v[0].unwrap_or(128) as usize, cols: v[1].unwrap_or(128) as usize })
        }
        _ => Err(already_quantized(
            config_path,
            "FP8 without a weight_block_size [rows, cols] (per-tensor FP8 is not taken: only DeepSeek-style \
             block-scaled FP8 is dequantized)"
                .into(),
        )),
    }
}

/// Every file under `dir` that is not one of `skip` (shards, index, configs) and not hidden,
/// following symlinks (a Hugging Face snapshot's files are links into `../../blobs`).
fn other_files(dir: &Path, skip: &[PathBuf]) -> Result<Vec<PathBuf>> {
    fn walk(dir: &Path, rel: &Path, skip: &[PathBuf], depth: usize, out: &mut Vec<PathBuf>) -> Result<()> {
        if depth > 8 {
            return Ok(());
        }
        let rd = std::fs::read_dir(dir).map_err(|e| crate::io::io_err("list", dir, e))?;
        let mut entries: Vec<_> = rd.filter_map(|e| e.ok()).collect();
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            let name = e.file_name();
            if name.to_string_lossy().starts_with('.') {
                continue;
            }
            let path = e.path();
            let rel_path = rel.join(&name);
            if depth == 0 && skip.iter().any(|s| s.file_name() == Some(&name)) {
                continue;
            }
            if path.is_dir() {
                walk(&path, &rel_path, skip, depth + 1, out)?;
            } else if path.is_file() {
                out.push(rel_path);
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    walk(dir, Path::new(""), skip, 0, &mut out)?;
    Ok(out)
}

/// Options that decide the plan.
pub(super) struct PlanOptions<'a> {
    pub include: &'a [String],
    pub exclude: &'a [String],
    pub format: OutputFormat,
}

impl Plan {
    /// Plans the conversion of the model at `input` (a model directory, a Hugging Face cache
    /// snapshot or root, an index `.json`, or a `.safetensors` file in its model directory).
    pub fn new(input: &Path, opts: &PlanOptions<'_>) -> Result<Plan> {
        let cat = Catalog::open(input)?;
        let dir = cat.dir.clone();
        let config_path = dir.join("config.json");
        let config = if config_path.exists() {
            let bytes = read_small_file(&config_path, MAX_CONFIG_BYTES, "config")?;
            // An object without repeated keys (serde_json would keep the last of two silently).
            let v = crate::io::parse_json_unique(&bytes).map_err(|e| {
                Error::Invalid(format!("`{}` {}", shown_path(&config_path), crate::io::json_unique_problem(&e)))
            })?;
            Some(Value::Object(v))
        } else {
            None
        };
        let input_quant = input_quant(&config_path, config.as_ref(), &dir)?;
        let model_type = config
            .as_ref()
            .and_then(|c| c.get("model_type").or_else(|| c.get("text_config").and_then(|t| t.get("model_type"))))
            .and_then(Value::as_str)
            .map(str::to_string);

        // Every shard's header, checked against the index both ways.
        let files: Vec<SafetensorsFile> = cat.shards.iter().map(SafetensorsFile::open).collect::<Result<_>>()?;
        let mut names_of: Vec<Vec<String>> = vec![Vec::new(); files.len()];
        for (s, f) in files.iter().enumerate() {
            for n in f.names() {
                match cat.shard_of.get(n) {
                    Some(&t) if t == s => names_of[s].push(n.to_string()),
                    Some(&t) => {
                        return Err(Error::Tensor {
                            name: shown(n),
                            what: format!(
                                "held by `{}`, but the index lists it in `{}`",
                                shown_path(f.path()),
                                shown_path(&cat.shards[t])
                            ),
                        })
                    }
                    None => {
                        return Err(Error::Tensor {
                            name: shown(n),
                            what: format!(
                                "held by `{}` but missing from the weight_map of `{}` (an incomplete index)",
                                shown_path(f.path()),
                                shown_path(&cat.source)
                            ),
                        })
                    }
                }
            }
        }
        for (n, &s) in &cat.shard_of {
            if files[s].info(n).is_none() {
                return Err(Error::Tensor {
                    name: shown(n),
                    what: format!(
                        "listed in the weight_map of `{}` as in `{}`, which does not hold it",
                        shown_path(&cat.source),
                        shown_path(&cat.shards[s])
                    ),
                });
            }
        }
        let info = |n: &str| files[cat.shard_of[n]].info(n).expect("checked above");

        let wanted = |name: &str, default: bool| {
            (default || opts.include.iter().any(|p| glob_match(p, name)))
                && !opts.exclude.iter().any(|p| glob_match(p, name))
        };

        let mut shards = Vec::with_capacity(files.len());
        let mut groups: BTreeMap<String, usize> = BTreeMap::new();
        let mut units: Vec<Vec<(usize, usize)>> = Vec::new();
        let mut ignore = Vec::new();
        for (s, f) in files.iter().enumerate() {
            let names = names_of[s].clone();
            let mut items = Vec::new();
            for name in names {
                let t = info(&name);
                let field = name.rsplit_once('.').map_or(name.as_str(), |(_, f)| f);
                let stem = name.strip_suffix(".weight_scale_inv");
                if let Some(stem) = stem {
                    if matches!(input_quant, InputQuant::Fp8Block { .. }) {
                        // Consumed by its weight (checked there).
                        if !cat.shard_of.contains_key(&format!("{stem}.weight")) {
                            return Err(Error::Tensor {
                                name: shown(&name),
                                what: "an FP8 block scale without its `weight`".into(),
                            });
                        }
                        continue;
                    }
                }
                if QUANTIZED_FIELDS.contains(&field) || field.ends_with("_blocks") || stem.is_some() {
                    return Err(already_quantized(
                        f.path(),
                        format!("it holds `{}`, a tensor of a quantized checkpoint", shown(&name)),
                    ));
                }
                let fp8_scale = || -> Result<Option<Fp8Scales>> {
                    let InputQuant::Fp8Block { rows: br, cols: bc } = input_quant else { return Ok(None) };
                    let Some(stem) = name.strip_suffix(".weight") else { return Ok(None) };
                    let sname = format!("{stem}.weight_scale_inv");
                    let Some(&ss) = cat.shard_of.get(&sname) else {
                        return Err(already_quantized(
                            f.path(),
                            format!("`{}` is FP8 without a `weight_scale_inv` beside it", shown(&name)),
                        ));
                    };
                    let si = files[ss].info(&sname).expect("checked");
                    let (n, k) = (t.shape[0], t.shape[1]);
                    let grid = [n.div_ceil(br), k.div_ceil(bc)];
                    if si.dtype != Dtype::F32 || si.shape != grid {
                        return Err(Error::Tensor {
                            name: shown(&sname),
                            what: format!(
                                "{} {:?}, expected F32 {:?} (blocks of {br}x{bc} over {:?})",
                                si.dtype, si.shape, grid, t.shape
                            ),
                        });
                    }
                    Ok(Some(Fp8Scales { shard: ss, name: sname, grid, block: [br, bc] }))
                };
                let is_fp8 = t.dtype == Dtype::F8_E4M3;
                if is_fp8 && (t.shape.len() != 2 || !name.ends_with(".weight")) {
                    return Err(already_quantized(
                        f.path(),
                        format!("`{}` is F8_E4M3 but not a 2-D block-scaled weight", shown(&name)),
                    ));
                }
                if matches!(t.dtype, Dtype::F8_E5M2 | Dtype::F4 | Dtype::F6_E2M3 | Dtype::F6_E3M2 | Dtype::F8_E8M0)
                    || (matches!(t.dtype, Dtype::U8 | Dtype::I8 | Dtype::I32 | Dtype::U32) && name.ends_with(".weight"))
                    || (is_fp8 && input_quant == InputQuant::None)
                {
                    return Err(already_quantized(
                        f.path(),
                        format!("`{}` is {} (packed or low-precision weights)", shown(&name), t.dtype),
                    ));
                }
                let float_ok = matches!(t.dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32) || is_fp8;

                // Stacked 3-D experts: split when the layout is known.
                if let Some((prefix, gate_up)) = stacked_expert(&name).filter(|_| t.shape.len() == 3) {
                    if !wanted(&name, true) {
                        items.push(Item::Copy { shard: s, name: name.clone(), dtype: t.dtype, shape: t.shape.clone() });
                        continue;
                    }
                    let known = model_type.as_deref().is_some_and(|m| ROW_MAJOR_FUSED_MODEL_TYPES.contains(&m));
                    if !known || !float_ok || is_fp8 {
                        return Err(Error::Tensor {
                            name: shown(&name),
                            what: format!(
                                "a stacked 3-D expert tensor {} {:?} of model_type `{}`, whose layout convert does not \
                                 know (known: {} with [E, 2I, H] gate rows first and [E, H, I], BF16/F16/F32); \
                                 --exclude it to copy it unchanged",
                                t.dtype,
                                t.shape,
                                shown(model_type.as_deref().unwrap_or("none")),
                                ROW_MAJOR_FUSED_MODEL_TYPES.join(", ")
                            ),
                        });
                    }
                    check_not_empty(&name, &t.shape)?;
                    let (e, rows, k) = (t.shape[0], t.shape[1], t.shape[2]);
                    let parts: Vec<(&str, usize, usize)> = if gate_up {
                        if !rows.is_multiple_of(2) {
                            return Err(Error::Tensor {
                                name: shown(&name),
                                what: format!("shape {:?}: gate/up needs an even row count", t.shape),
                            });
                        }
                        vec![("gate_proj", 0, rows / 2), ("up_proj", rows / 2, rows / 2)]
                    } else {
                        vec![("down_proj", 0, rows)]
                    };
                    check_k(&name, k)?;
                    for x in 0..e {
                        let group = format!("{prefix}.experts.{x}.<{}>", if gate_up { "gate_up" } else { "down" });
                        let unit = *groups.entry(group).or_insert_with(|| {
                            units.push(Vec::new());
                            units.len() - 1
                        });
                        for &(proj, first, n) in &parts {
                            items.push(Item::Quantize(QuantJob {
                                source: Source {
                                    shard: s,
                                    name: name.clone(),
                                    dtype: t.dtype,
                                    first_row: x * rows + first,
                                    rows: n,
                                    cols: k,
                                    fp8: None,
                                },
                                module: format!("{prefix}.experts.{x}.{proj}"),
                                unit,
                            }));
                        }
                    }
                    continue;
                }

                let is_linear_weight = t.shape.len() == 2 && name.ends_with(".weight");
                let default = is_routed_expert_weight(&name) && t.shape.len() == 2;
                if is_linear_weight && float_ok && wanted(&name, default) {
                    let (n, k) = (t.shape[0], t.shape[1]);
                    check_not_empty(&name, &t.shape)?;
                    check_k(&name, k)?;
                    let module = name.strip_suffix(".weight").expect("checked").to_string();
                    let unit = *groups.entry(g_group(&module)).or_insert_with(|| {
                        units.push(Vec::new());
                        units.len() - 1
                    });
                    items.push(Item::Quantize(QuantJob {
                        source: Source {
                            shard: s,
                            name: name.clone(),
                            dtype: t.dtype,
                            first_row: 0,
                            rows: n,
                            cols: k,
                            fp8: if is_fp8 { fp8_scale()? } else { None },
                        },
                        module,
                        unit,
                    }));
                    continue;
                }
                if default && !float_ok {
                    return Err(Error::Tensor {
                        name: shown(&name),
                        what: format!("dtype is {}, expected BF16, F16, F32 or block-scaled F8_E4M3", t.dtype),
                    });
                }
                if is_linear_weight && !is_embedding_or_norm(&name) {
                    ignore.push(name.strip_suffix(".weight").expect("checked").to_string());
                }
                if is_fp8 {
                    check_not_empty(&name, &t.shape)?;
                    let (n, k) = (t.shape[0], t.shape[1]);
                    items.push(Item::Dequantize {
                        source: Source {
                            shard: s,
                            name: name.clone(),
                            dtype: t.dtype,
                            first_row: 0,
                            rows: n,
                            cols: k,
                            fp8: fp8_scale()?,
                        },
                        name,
                    });
                } else {
                    items.push(Item::Copy { shard: s, name, dtype: t.dtype, shape: t.shape.clone() });
                }
            }
            // Written in name order (the first output name of each item), whatever the input's
            // order: the same tensors give the same bytes however the input file was laid out.
            items.sort_by_cached_key(|item| item.outputs(opts.format).remove(0).name);
            for (i, item) in items.iter().enumerate() {
                if let Item::Quantize(job) = item {
                    units[job.unit].push((s, i));
                }
            }
            let file_name = cat.shards[s].file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            shards.push(ShardPlan { file_name, items });
        }
        ignore.sort();
        ignore.dedup();

        let mut skip: Vec<PathBuf> = cat.shards.clone();
        if cat.is_index {
            skip.push(cat.source.clone());
        }
        skip.push(dir.join("config.json"));
        let others = other_files(&dir, &skip)?;
        Ok(Plan {
            dir,
            files,
            index: cat.is_index.then(|| cat.source.clone()),
            config,
            input_quant,
            shards,
            units,
            ignore,
            other_files: others,
        })
    }

    /// Input bytes of every tensor (what the throughput is measured against).
    pub fn input_bytes(&self) -> u64 {
        self.shards.iter().flat_map(|s| &s.items).map(Item::input_bytes).sum()
    }

    pub fn items(&self) -> impl Iterator<Item = &Item> {
        self.shards.iter().flat_map(|s| &s.items)
    }

    /// The output tensor names and the shard file of each (for the index).
    pub fn weight_map(&self, format: OutputFormat) -> BTreeMap<String, String> {
        let mut map = BTreeMap::new();
        for s in &self.shards {
            for item in &s.items {
                for t in item.outputs(format) {
                    map.insert(t.name, s.file_name.clone());
                }
            }
        }
        map
    }

    /// Counts for the report: (converted, copied, dequantized) items.
    pub fn counts(&self) -> (usize, usize, usize) {
        let mut c = (0, 0, 0);
        for item in self.items() {
            match item {
                Item::Quantize(_) => c.0 += 1,
                Item::Copy { .. } => c.1 += 1,
                Item::Dequantize { .. } => c.2 += 1,
            }
        }
        c
    }

    /// Total output tensor bytes (the index's `metadata.total_size`).
    pub fn output_tensor_bytes(&self, format: OutputFormat) -> u64 {
        self.items().flat_map(|i| i.outputs(format)).map(|t| t.len() as u64).sum()
    }

    /// The (shard, item) of every matrix in g group `unit`.
    pub fn unit_members(&self, unit: usize) -> &[(usize, usize)] {
        &self.units[unit]
    }

    pub fn item(&self, shard: usize, item: usize) -> &Item {
        &self.shards[shard].items[item]
    }
}

/// A converted (or dequantized) tensor holds something: no zero dimension. A header may give any
/// size beside a zero one (the byte length is 0 whatever the rest), which would make a huge number
/// of empty matrices or overflow the conversion's size arithmetic.
fn check_not_empty(name: &str, shape: &[usize]) -> Result<()> {
    if shape.contains(&0) {
        return Err(Error::Tensor {
            name: shown(name),
            what: format!("shape {shape:?} has a zero dimension: an empty matrix cannot be converted (--exclude it)"),
        });
    }
    Ok(())
}

/// A converted matrix needs K (its columns) a positive multiple of 16.
fn check_k(name: &str, k: usize) -> Result<()> {
    if k == 0 || !k.is_multiple_of(BLOCK) {
        return Err(Error::Tensor {
            name: shown(name),
            what: format!("K = {k} columns is not a positive multiple of {BLOCK}: it cannot be NVFP4 (--exclude it)"),
        });
    }
    Ok(())
}

/// Embeddings and norms are not Linear layers: never in the ignore list.
fn is_embedding_or_norm(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    lower.contains("embed") || lower.contains("norm") || lower.ends_with("wte.weight") || lower.ends_with("wpe.weight")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        assert!(glob_match("*", "a.b.c"));
        assert!(glob_match("*.mlp.gate.weight", "model.layers.3.mlp.gate.weight"));
        assert!(!glob_match("*.mlp.gate.weight", "model.layers.3.mlp.gate_proj.weight"));
        assert!(glob_match("model.layers.?.self_attn.*", "model.layers.7.self_attn.q_proj.weight"));
        assert!(!glob_match("model.layers.?.self_attn.*", "model.layers.17.self_attn.q_proj.weight"));
        assert!(glob_match("*experts.1*", "m.experts.12.w1.weight"));
        assert!(glob_match("", ""));
        assert!(!glob_match("", "a"));
    }

    #[test]
    fn default_targets_are_routed_experts() {
        assert!(is_routed_expert_weight("model.layers.3.mlp.experts.17.gate_proj.weight"));
        assert!(is_routed_expert_weight("model.layers.0.block_sparse_moe.experts.7.w2.weight"));
        assert!(!is_routed_expert_weight("model.layers.3.mlp.shared_experts.gate_proj.weight"));
        assert!(!is_routed_expert_weight("model.layers.3.mlp.gate.weight"));
        assert!(!is_routed_expert_weight("model.layers.3.mlp.experts.17.gate_proj.bias"));
        assert!(!is_routed_expert_weight("model.layers.3.mlp.gate_proj.weight"));
        assert_eq!(stacked_expert("model.layers.0.mlp.experts.gate_up_proj"), Some(("model.layers.0.mlp", true)));
        assert_eq!(stacked_expert("model.layers.0.mlp.experts.down_proj"), Some(("model.layers.0.mlp", false)));
    }

    #[test]
    fn gate_and_up_share_a_group() {
        assert_eq!(g_group("m.experts.3.gate_proj"), g_group("m.experts.3.up_proj"));
        assert_ne!(g_group("m.experts.3.gate_proj"), g_group("m.experts.4.up_proj"));
        assert_ne!(g_group("m.experts.3.gate_proj"), g_group("m.experts.3.down_proj"));
        assert_eq!(g_group("m.experts.3.w1"), g_group("m.experts.3.w3"));
        assert_eq!(g_group("a.self_attn.q_proj"), g_group("a.self_attn.v_proj"));
    }
}
