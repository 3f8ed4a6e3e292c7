//! The two NVFP4 checkpoint dialects, told apart from the files: the tensors' field names decide,
//! the configs (`config.json`'s `quantization_config`, ModelOpt's `hf_quant_config.json`) must
//! agree with them and say whether activations are quantized too (W4A4) or not (W4A16).
//!
//! | | ModelOpt | compressed-tensors |
//! |---|---|---|
//! | codes | `weight` U8 `[N, K/2]` | `weight_packed` U8 `[N, K/2]` |
//! | block scales | `weight_scale` F8_E4M3 `[N, K/16]` | `weight_scale` F8_E4M3 `[N, K/16]` |
//! | per-tensor | `weight_scale_2` F32 = g | `weight_global_scale` F32 = 1/g |
//! | activation (W4A4) | `input_scale` F32 = activation g | `input_global_scale` F32 = 1/(activation g) |
//! | config | `quant_algo` `NVFP4` (W4A4) or `W4A16_NVFP4` | `quant_method` `compressed-tensors`, `format` `nvfp4-pack-quantized` |
//!
//! compressed-tensors' converter from ModelOpt copies `hf_quant_config.json` along, so a
//! compressed-tensors `config.json` outranks a ModelOpt `hf_quant_config.json` beside it.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::{Error, Result};
use crate::io::fs::read_small_file;
use crate::io::safetensors::{json_unique_problem, parse_json_unique};
use crate::io::shown::shown;

/// The largest `config.json` / `hf_quant_config.json` accepted.
const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// An NVFP4 checkpoint dialect: how the tensors of one quantized linear layer are named and what
/// their per-tensor scales mean.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dialect {
    /// NVIDIA ModelOpt's export (`weight`, `weight_scale`, `weight_scale_2` = g, `input_scale`).
    ModelOpt,
    /// compressed-tensors' `nvfp4-pack-quantized` (llm-compressor's output, what vLLM loads):
    /// `weight_packed`, `weight_scale`, `weight_global_scale` = 1/g, `input_global_scale`.
    CompressedTensors,
}

impl std::fmt::Display for Dialect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Dialect::ModelOpt => "ModelOpt NVFP4",
            Dialect::CompressedTensors => "compressed-tensors NVFP4",
        })
    }
}

/// What is quantized: weights and activations (W4A4: the checkpoint carries each layer's
/// activation scale), or weights only (W4A16).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantScheme {
    /// NVFP4 weights and NVFP4 activations with a calibrated per-tensor activation scale.
    W4A4,
    /// NVFP4 weights, 16-bit activations.
    W4A16,
}

impl std::fmt::Display for QuantScheme {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            QuantScheme::W4A4 => "W4A4",
            QuantScheme::W4A16 => "W4A16 (weight-only)",
        })
    }
}

/// The field names of one dialect and what its per-tensor values are.
#[derive(Debug)]
pub(super) struct Fields {
    pub codes: &'static str,
    pub scales: &'static str,
    /// The per-tensor weight scale: g (ModelOpt) or 1/g (compressed-tensors).
    pub per_tensor: &'static str,
    /// The activation scale: g of the activation or its reciprocal.
    pub input: &'static str,
    /// Whether `per_tensor` and `input` hold reciprocals (compressed-tensors' "global scales").
    pub reciprocal: bool,
}

impl Fields {
    /// The fields every projection must have.
    pub fn required(&self) -> [&'static str; 3] {
        [self.codes, self.scales, self.per_tensor]
    }

    pub fn is_known(&self, field: &str) -> bool {
        self.required().contains(&field) || field == self.input
    }
}

pub(super) const MODELOPT_FIELDS: Fields = Fields {
    codes: "weight",
    scales: "weight_scale",
    per_tensor: "weight_scale_2",
    input: "input_scale",
    reciprocal: false,
};

pub(super) const COMPRESSED_TENSORS_FIELDS: Fields = Fields {
    codes: "weight_packed",
    scales: "weight_scale",
    per_tensor: "weight_global_scale",
    input: "input_global_scale",
    reciprocal: true,
};

impl Dialect {
    pub(super) fn fields(self) -> &'static Fields {
        match self {
            Dialect::ModelOpt => &MODELOPT_FIELDS,
            Dialect::CompressedTensors => &COMPRESSED_TENSORS_FIELDS,
        }
    }

    /// The dialect a field name belongs to alone (`weight_scale` belongs to both).
    pub(super) fn of_field(field: &str) -> Option<Dialect> {
        match field {
            "weight" | "weight_scale_2" | "input_scale" => Some(Dialect::ModelOpt),
            "weight_packed" | "weight_global_scale" | "input_global_scale" => Some(Dialect::CompressedTensors),
            _ => None,
        }
    }
}

/// What the configs beside a checkpoint declare.
#[derive(Debug, Default)]
pub(super) struct Declared {
    pub dialect: Option<Dialect>,
    pub scheme: Option<QuantScheme>,
    /// The config file that declared it.
    pub file: Option<PathBuf>,
}

fn dialect_err(path: &Path, what: impl Into<String>) -> Error {
    Error::Dialect { path: path.to_path_buf(), what: what.into() }
}

/// A JSON config beside the checkpoint, if there is one: an object without repeated keys.
fn read_config(path: &Path) -> Result<Option<Value>> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        _ => {}
    }
    let bytes = read_small_file(path, MAX_CONFIG_BYTES, "config")?;
    // A key given twice would be read as whichever came last (serde_json keeps it silently).
    let v = parse_json_unique(&bytes).map_err(|e| dialect_err(path, format!("it {}", json_unique_problem(&e))))?;
    Ok(Some(Value::Object(v)))
}

/// A string field of a JSON object, if it is one.
fn str_field<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key).and_then(Value::as_str)
}

/// compressed-tensors' quantization config: `format` must be `nvfp4-pack-quantized` (at the top
/// or, for `mixed-precision`, in a config group), the weights compressed, and the NVFP4 group's
/// weights 4-bit floats in groups of 16; activations 4-bit floats too make it W4A4.
fn compressed_tensors_scheme(path: &Path, qc: &Value) -> Result<QuantScheme> {
    const NVFP4: &str = "nvfp4-pack-quantized";
    let top = str_field(qc, "format");
    let groups: Vec<&Value> =
        qc.get("config_groups").and_then(Value::as_object).map(|m| m.values().collect()).unwrap_or_default();
    let nvfp4_groups: Vec<&Value> =
        groups.iter().copied().filter(|g| str_field(g, "format").map_or(top == Some(NVFP4), |f| f == NVFP4)).collect();
    if nvfp4_groups.is_empty() {
        let what = match top {
            Some(f) => format!("format `{}`", shown(f)),
            None => "no format".to_string(),
        };
        return Err(dialect_err(
            path,
            format!("compressed-tensors quantization_config with {what} and no config group in `{NVFP4}`: not NVFP4"),
        ));
    }
    if let Some(status) = str_field(qc, "quantization_status") {
        if status != "compressed" {
            return Err(dialect_err(
                path,
                format!(
                    "quantization_status is `{}`: the weights are not stored compressed (expected `compressed`)",
                    shown(status)
                ),
            ));
        }
    }
    let mut w4a4 = false;
    for g in nvfp4_groups {
        if let Some(w) = g.get("weights").filter(|w| !w.is_null()) {
            let bits = w.get("num_bits").and_then(Value::as_u64);
            let kind = str_field(w, "type");
            let group = w.get("group_size").and_then(Value::as_u64);
            if bits != Some(4) || kind != Some("float") || group != Some(16) {
                return Err(dialect_err(
                    path,
                    format!(
                        "an `{NVFP4}` config group's weights are not 4-bit floats in groups of 16 (num_bits {}, type \
                         {}, group_size {})",
                        bits.map_or("missing".into(), |b| b.to_string()),
                        kind.map_or("missing".into(), |k| format!("`{}`", shown(k))),
                        group.map_or("missing".into(), |b| b.to_string())
                    ),
                ));
            }
        }
        if let Some(a) = g.get("input_activations").filter(|a| !a.is_null()) {
            let bits = a.get("num_bits").and_then(Value::as_u64);
            let kind = str_field(a, "type");
            if bits != Some(4) || kind != Some("float") {
                return Err(dialect_err(
                    path,
                    "an `nvfp4-pack-quantized` config group quantizes activations to something other than 4-bit \
                     floats: not NVFP4 W4A4",
                ));
            }
            w4a4 = true;
        }
    }
    Ok(if w4a4 { QuantScheme::W4A4 } else { QuantScheme::W4A16 })
}

/// ModelOpt's `quant_algo` (from `hf_quant_config.json`'s `quantization` or `config.json`'s
/// `quantization_config`): `NVFP4` is W4A4, `W4A16_NVFP4` weight-only; `MIXED_PRECISION` leaves
/// it to the tensors.
fn modelopt_scheme(path: &Path, q: &Value) -> Result<Option<QuantScheme>> {
    if let Some(g) = q.get("group_size").and_then(Value::as_u64) {
        if g != 16 {
            return Err(dialect_err(path, format!("ModelOpt group_size is {g}: NVFP4 blocks are 16")));
        }
    }
    match str_field(q, "quant_algo") {
        Some("NVFP4") => Ok(Some(QuantScheme::W4A4)),
        Some("W4A16_NVFP4") => Ok(Some(QuantScheme::W4A16)),
        Some("MIXED_PRECISION") | None => Ok(None),
        Some(other) => Err(dialect_err(
            path,
            format!("ModelOpt quant_algo `{}` is not NVFP4 (supported: NVFP4, W4A16_NVFP4)", shown(other)),
        )),
    }
}

/// Reads `config.json` and `hf_quant_config.json` in `dir` (either may be absent).
pub(super) fn declared(dir: &Path) -> Result<Declared> {
    let config_path = dir.join("config.json");
    let hf_quant_path = dir.join("hf_quant_config.json");
    if let Some(config) = read_config(&config_path)? {
        // Where vLLM and compressed-tensors look for it, in their order.
        let qc = config
            .get("quantization_config")
            .or_else(|| config.get("text_config").and_then(|t| t.get("quantization_config")))
            .or_else(|| config.get("compression_config"))
            .filter(|q| !q.is_null());
        if let Some(qc) = qc {
            let method = str_field(qc, "quant_method");
            // ModelOpt writes quant_method "modelopt"; older exports only quant_algo.
            let modelopt = method == Some("modelopt") || (method.is_none() && qc.get("quant_algo").is_some());
            if method == Some("compressed-tensors") {
                let scheme = compressed_tensors_scheme(&config_path, qc)?;
                if hf_quant_path.exists() {
                    tracing::debug!(
                        "{}: config.json declares compressed-tensors; the hf_quant_config.json beside it is \
                         ModelOpt's original (compressed-tensors' converter copies it), ignored",
                        crate::io::shown_path(dir)
                    );
                }
                return Ok(Declared {
                    dialect: Some(Dialect::CompressedTensors),
                    scheme: Some(scheme),
                    file: Some(config_path),
                });
            }
            if modelopt {
                // hf_quant_config.json is ModelOpt's own record; config.json's copy is transformers'.
                if hf_quant_path.exists() {
                    return hf_quant(&hf_quant_path);
                }
                let scheme = modelopt_scheme(&config_path, qc)?;
                return Ok(Declared { dialect: Some(Dialect::ModelOpt), scheme, file: Some(config_path) });
            }
            return Err(dialect_err(
                &config_path,
                match method {
                    Some(other) => format!(
                        "quantization_config's quant_method is `{}`: not an NVFP4 dialect this crate reads \
                         (modelopt, compressed-tensors)",
                        shown(other)
                    ),
                    None => {
                        "quantization_config has no quant_method (expected modelopt or compressed-tensors)".to_string()
                    }
                },
            ));
        }
    }
    if hf_quant_path.exists() {
        return hf_quant(&hf_quant_path);
    }
    Ok(Declared::default())
}

/// ModelOpt's `hf_quant_config.json`: `{"producer": ..., "quantization": {"quant_algo": ...}}`.
fn hf_quant(path: &Path) -> Result<Declared> {
    let Some(v) = read_config(path)? else { return Ok(Declared::default()) };
    let Some(q) = v.get("quantization") else {
        return Err(dialect_err(path, "it has no \"quantization\" object (ModelOpt's hf_quant_config.json has one)"));
    };
    let scheme = modelopt_scheme(path, q)?;
    Ok(Declared { dialect: Some(Dialect::ModelOpt), scheme, file: Some(path.to_path_buf()) })
}
