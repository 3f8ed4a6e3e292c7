//! ModelOpt NVFP4 Mixture-of-Experts checkpoints (Hugging Face layout): one MoE layer's experts
//! loaded onto the host ([`load_modelopt`]), and written back ([`write_modelopt_experts`]).
//!
//! Expert `e`'s tensors are `{prefix}.{e}.{projection}.{field}`, with the projections of one of the
//! [`ExpertNaming`] styles and the fields `weight` (U8 `[N, K/2]`), `weight_scale` (F8_E4M3
//! `[N, K/16]`, linear), `weight_scale_2` (F32 scalar, the decode scale g) and, optionally,
//! `input_scale` (F32 scalar). The checkpoint is a `.safetensors` file, a sharded checkpoint's
//! `*.index.json`, or a directory holding one of them.
//!
//! Loading reads each shard file once, one at a time, and copies out only the layer's tensors, so
//! peak memory is about one shard plus the result. Every dtype and shape is checked (from the
//! files' headers) before any tensor data is read. Every problem with a tensor (missing, wrong
//! dtype, wrong shape, bad value, unexpected) is an [`Error::Tensor`] naming it; an unreadable file
//! is an [`Error::Io`] naming the path; a malformed index or safetensors file, or a directory
//! without exactly one checkpoint, is an [`Error::Invalid`] naming the path.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, Metadata, SafeTensors, TensorView};

use crate::error::{Error, Result};
use crate::reference::{validate_decode_scale, ExpertWeightsHost};

/// One MoE layer's experts from a ModelOpt NVFP4 checkpoint, on the host.
#[derive(Clone, Debug)]
pub struct MoeCheckpoint {
    /// E, the number of experts.
    pub experts: usize,
    /// H, the hidden size (K of the first layer, N of the second).
    pub hidden: usize,
    /// I, the intermediate size of one expert (N of gate and of up, K of down).
    pub intermediate: usize,
    /// First layer, fused per expert as gate rows `[0, I)` then up rows `[I, 2I)`: `n = 2I`,
    /// `k = H`. `w13.decode_scales` are the gate decode scales (`weight_scale_2` of gate).
    pub w13: ExpertWeightsHost,
    /// `weight_scale_2` of the up projection per expert (may differ from the gate's: both are kept
    /// exactly). For the fused namings, which store one `weight_scale_2`, equal to the gate's.
    pub up_decode_scales: Vec<f32>,
    /// Second layer (down): `n = H`, `k = I`.
    pub w2: ExpertWeightsHost,
    /// `input_scale` of the first layer per expert: gate's (`gate_proj`, `w1`) or the fused
    /// projection's; `None` when the checkpoint has none.
    pub l1_input_scales: Option<Vec<f32>>,
    /// `input_scale` of the up projection (`up_proj`, `w3`) per expert, kept only where it differs
    /// from [`l1_input_scales`](Self::l1_input_scales) (bitwise, in some expert, or present where
    /// gate has none). `None` when up's equal gate's, are absent, or the naming is fused.
    pub up_input_scales: Option<Vec<f32>>,
    /// `input_scale` of the second layer (`down_proj`, `w2`) per expert; `None` when absent.
    pub l2_input_scales: Option<Vec<f32>>,
    /// The naming style the experts were found under.
    pub naming: ExpertNaming,
}

/// How a checkpoint names the projections of one expert.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExpertNaming {
    /// `gate_proj`, `up_proj`, `down_proj` (DeepSeek, Qwen3-MoE, Llama-4).
    GateUpDown,
    /// `w1` (gate), `w3` (up), `w2` (down) (Mixtral, under `block_sparse_moe.experts`).
    W1W3W2,
    /// `gate_up_proj` (gate rows first, then up) and `down_proj`.
    FusedGateUp,
    /// `w13` (gate rows first, then up) and `w2`.
    FusedW13,
}

impl ExpertNaming {
    /// Every naming style.
    pub const ALL: [ExpertNaming; 4] =
        [ExpertNaming::GateUpDown, ExpertNaming::W1W3W2, ExpertNaming::FusedGateUp, ExpertNaming::FusedW13];

    /// The projections of one expert in order: gate, up (one fused projection instead for the
    /// fused styles), down.
    pub fn projections(self) -> &'static [&'static str] {
        match self {
            ExpertNaming::GateUpDown => &["gate_proj", "up_proj", "down_proj"],
            ExpertNaming::W1W3W2 => &["w1", "w3", "w2"],
            ExpertNaming::FusedGateUp => &["gate_up_proj", "down_proj"],
            ExpertNaming::FusedW13 => &["w13", "w2"],
        }
    }

    /// Whether gate and up are one projection (`gate_up_proj`, `w13`) with one `weight_scale_2`.
    pub fn is_fused(self) -> bool {
        matches!(self, ExpertNaming::FusedGateUp | ExpertNaming::FusedW13)
    }
}

impl fmt::Display for ExpertNaming {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.projections().join("/"))
    }
}

/// The role of a projection: gate, up, the fused gate/up, or down.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Gate,
    Up,
    GateUp,
    Down,
}

/// The roles of [`ExpertNaming::projections`], in the same order.
fn roles(naming: ExpertNaming) -> &'static [Role] {
    if naming.is_fused() {
        &[Role::GateUp, Role::Down]
    } else {
        &[Role::Gate, Role::Up, Role::Down]
    }
}

/// The naming a projection name points to, and whether it decides it alone (`down_proj` and `w2`
/// each belong to a separate and a fused style).
fn style_of(proj: &str) -> Option<(ExpertNaming, bool)> {
    match proj {
        "gate_proj" | "up_proj" => Some((ExpertNaming::GateUpDown, true)),
        "w1" | "w3" => Some((ExpertNaming::W1W3W2, true)),
        "gate_up_proj" => Some((ExpertNaming::FusedGateUp, true)),
        "w13" => Some((ExpertNaming::FusedW13, true)),
        "down_proj" => Some((ExpertNaming::GateUpDown, false)),
        "w2" => Some((ExpertNaming::W1W3W2, false)),
        _ => None,
    }
}

const WEIGHT: &str = "weight";
const WEIGHT_SCALE: &str = "weight_scale";
const WEIGHT_SCALE_2: &str = "weight_scale_2";
const INPUT_SCALE: &str = "input_scale";
/// The fields every projection must have.
const REQUIRED: [&str; 3] = [WEIGHT, WEIGHT_SCALE, WEIGHT_SCALE_2];

/// `prefix` with exactly one trailing `.` (none for an empty prefix).
fn expert_prefix(prefix: &str) -> String {
    let p = prefix.strip_suffix('.').unwrap_or(prefix);
    if p.is_empty() {
        String::new()
    } else {
        format!("{p}.")
    }
}

/// Splits what follows the prefix, `{e}.{rest}`, into the expert number and the rest. The number
/// must be written canonically (digits, no leading zero).
fn split_expert(after_prefix: &str) -> Option<(usize, &str)> {
    let (num, rest) = after_prefix.split_once('.')?;
    let canonical = !num.is_empty() && num.bytes().all(|b| b.is_ascii_digit()) && (num == "0" || !num.starts_with('0'));
    if !canonical {
        return None;
    }
    Some((num.parse().ok()?, rest))
}

fn tensor_err(name: &str, what: impl Into<String>) -> Error {
    Error::Tensor { name: name.to_string(), what: what.into() }
}

fn io_err(action: &str, path: &Path, e: std::io::Error) -> Error {
    Error::Io(std::io::Error::new(e.kind(), format!("cannot {action} `{}`: {e}", path.display())))
}

fn read_file(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| io_err("read", path, e))
}

fn shape_str(shape: &[usize]) -> String {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    format!("[{}]", dims.join(", "))
}

fn deserialize<'a>(bytes: &'a [u8], path: &Path) -> Result<SafeTensors<'a>> {
    SafeTensors::deserialize(bytes)
        .map_err(|e| Error::Invalid(format!("`{}` is not a valid safetensors file: {e}", path.display())))
}

/// The largest header safetensors accepts.
const MAX_HEADER: u64 = 100_000_000;

/// The dtype and shape of every tensor in a safetensors file, from its header alone (the tensor
/// data is not read). The header must describe exactly the file's length.
fn read_header(path: &Path) -> Result<HashMap<String, (Dtype, Vec<usize>)>> {
    let invalid =
        |what: String| Error::Invalid(format!("`{}` is not a valid safetensors file: {what}", path.display()));
    let mut f = std::fs::File::open(path).map_err(|e| io_err("read", path, e))?;
    let file_len = f.metadata().map_err(|e| io_err("read", path, e))?.len();
    if file_len < 8 {
        return Err(invalid(format!("it has {file_len} bytes, too few for a header")));
    }
    let mut n8 = [0u8; 8];
    f.read_exact(&mut n8).map_err(|e| io_err("read", path, e))?;
    let n = u64::from_le_bytes(n8);
    if n > MAX_HEADER || n > file_len - 8 {
        return Err(invalid(format!("header length {n} does not fit the file ({file_len} bytes)")));
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header).map_err(|e| io_err("read", path, e))?;
    let meta: Metadata = serde_json::from_slice(&header).map_err(|e| invalid(format!("bad header: {e}")))?;
    let want = 8 + n + meta.data_len() as u64;
    if want != file_len {
        return Err(invalid(format!("the header describes {want} bytes, the file has {file_len}")));
    }
    Ok(meta.tensors().into_iter().map(|(k, info)| (k, (info.dtype, info.shape.clone()))).collect())
}

/// The `weight_map` of a sharded checkpoint's index: tensor name to shard file (relative to the
/// index's directory).
fn read_index(path: &Path) -> Result<Vec<(String, String)>> {
    let bytes = read_file(path)?;
    let v: serde_json::Value = serde_json::from_slice(&bytes)
        .map_err(|e| Error::Invalid(format!("checkpoint index `{}` is not valid JSON: {e}", path.display())))?;
    let Some(map) = v.get("weight_map").and_then(|m| m.as_object()) else {
        return Err(Error::Invalid(format!(
            "checkpoint index `{}` has no \"weight_map\" object (tensor name -> shard file)",
            path.display()
        )));
    };
    map.iter()
        .map(|(name, shard)| match shard.as_str() {
            Some(s) if !s.is_empty() => Ok((name.clone(), s.to_string())),
            _ => Err(Error::Invalid(format!(
                "checkpoint index `{}`: the weight_map entry for `{name}` is {shard}, not a shard file name",
                path.display()
            ))),
        })
        .collect()
}

/// A checkpoint path after resolving a directory.
enum Resolved {
    File(PathBuf),
    Index(PathBuf),
}

fn resolve(path: &Path) -> Result<Resolved> {
    let md = std::fs::metadata(path).map_err(|e| io_err("read", path, e))?;
    if !md.is_dir() {
        let is_json = path.extension().is_some_and(|x| x.eq_ignore_ascii_case("json"));
        return Ok(if is_json { Resolved::Index(path.to_path_buf()) } else { Resolved::File(path.to_path_buf()) });
    }
    let mut indexes = Vec::new();
    let mut files = Vec::new();
    for entry in std::fs::read_dir(path).map_err(|e| io_err("list", path, e))? {
        let entry = entry.map_err(|e| io_err("list", path, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let p = entry.path();
        if name.starts_with('.') || !p.is_file() {
            continue;
        }
        if name.ends_with(".index.json") {
            indexes.push(p);
        } else if name.ends_with(".safetensors") {
            files.push(p);
        }
    }
    indexes.sort();
    files.sort();
    let list = |ps: &[PathBuf]| {
        ps.iter().map(|p| format!("`{}`", p.file_name().unwrap_or_default().to_string_lossy())).collect::<Vec<_>>()
    };
    match (indexes.len(), files.len()) {
        (1, _) => Ok(Resolved::Index(indexes.remove(0))),
        (0, 1) => Ok(Resolved::File(files.remove(0))),
        (0, 0) => Err(Error::Invalid(format!(
            "directory `{}` holds no `.safetensors` file and no `*.index.json`",
            path.display()
        ))),
        (0, n) => Err(Error::Invalid(format!(
            "directory `{}` holds {n} `.safetensors` files ({}) and no `*.index.json`: pass one file or an index",
            path.display(),
            list(&files).join(", ")
        ))),
        (n, _) => Err(Error::Invalid(format!(
            "directory `{}` holds {n} `*.index.json` files ({}): pass one of them",
            path.display(),
            list(&indexes).join(", ")
        ))),
    }
}

/// Where a checkpoint's tensors are.
struct Catalog {
    /// The file named in "not found" messages: the safetensors file or the index.
    source: PathBuf,
    /// Whether `source` is an index.
    is_index: bool,
    /// The shard files (one for a single file), sorted.
    shards: Vec<PathBuf>,
    /// Every tensor name of the checkpoint and the shard holding it.
    shard_of: HashMap<String, usize>,
    /// A single file's bytes, read once while opening.
    preloaded: Option<Vec<u8>>,
}

/// The dtype, shape and shard of one tensor.
struct Meta {
    dtype: Dtype,
    shape: Vec<usize>,
    shard: usize,
}

impl Catalog {
    fn open(path: &Path) -> Result<Catalog> {
        match resolve(path)? {
            Resolved::File(file) => {
                let bytes = read_file(&file)?;
                let shard_of = deserialize(&bytes, &file)?.names().into_iter().map(|n| (n.to_string(), 0)).collect();
                Ok(Catalog {
                    source: file.clone(),
                    is_index: false,
                    shards: vec![file],
                    shard_of,
                    preloaded: Some(bytes),
                })
            }
            Resolved::Index(index) => {
                let entries = read_index(&index)?;
                let dir = index.parent().map(Path::to_path_buf).unwrap_or_default();
                let files: BTreeSet<&str> = entries.iter().map(|(_, s)| s.as_str()).collect();
                let files: Vec<&str> = files.into_iter().collect();
                let shards = files.iter().map(|f| dir.join(f)).collect();
                let shard_of = entries
                    .iter()
                    .map(|(n, s)| (n.clone(), files.binary_search(&s.as_str()).expect("listed shard")))
                    .collect();
                Ok(Catalog { source: index, is_index: true, shards, shard_of, preloaded: None })
            }
        }
    }

    fn not_found(&self, name: &str, hint: &str) -> Error {
        let place = if self.is_index {
            format!("the weight_map of `{}`", self.source.display())
        } else {
            format!("`{}`", self.source.display())
        };
        tensor_err(name, format!("not found in {place}{hint}"))
    }

    /// The dtype, shape and shard of each of `names` (all listed in the catalog), read from the
    /// headers of the shards that hold them.
    fn metas(&self, names: &[String]) -> Result<HashMap<String, Meta>> {
        let mut by_shard: BTreeMap<usize, Vec<&String>> = BTreeMap::new();
        for n in names {
            by_shard.entry(self.shard_of[n]).or_default().push(n);
        }
        let mut out = HashMap::with_capacity(names.len());
        for (shard, wanted) in by_shard {
            let path = &self.shards[shard];
            let mut header = match &self.preloaded {
                Some(bytes) => deserialize(bytes, path)?
                    .iter()
                    .map(|(n, t)| (n.to_string(), (t.dtype(), t.shape().to_vec())))
                    .collect(),
                None => read_header(path)?,
            };
            for n in wanted {
                let Some((dtype, shape)) = header.remove(n) else {
                    return Err(tensor_err(
                        n,
                        format!(
                            "listed in the weight_map of `{}` as in `{}`, which does not hold it",
                            self.source.display(),
                            path.display()
                        ),
                    ));
                };
                out.insert(n.clone(), Meta { dtype, shape, shard });
            }
        }
        Ok(out)
    }
}

/// What [`discover`] finds: the naming, E, and for each projection whether it has `input_scale`.
struct Layout {
    naming: ExpertNaming,
    experts: usize,
    has_input: Vec<bool>,
}

impl Layout {
    /// The tensor names to read, expert by expert in projection order.
    fn names(&self, p: &str) -> Vec<String> {
        let mut out = Vec::new();
        for e in 0..self.experts {
            for (proj, &input) in self.naming.projections().iter().zip(&self.has_input) {
                for field in REQUIRED {
                    out.push(format!("{p}{e}.{proj}.{field}"));
                }
                if input {
                    out.push(format!("{p}{e}.{proj}.{INPUT_SCALE}"));
                }
            }
        }
        out
    }
}

/// The expert prefixes (`….experts`) present among `names`, as a hint for a wrong prefix.
fn prefixes_present(names: &[&str]) -> Vec<String> {
    let mut found = BTreeSet::new();
    for n in names {
        let parts: Vec<&str> = n.split('.').collect();
        for i in 1..parts.len() {
            if parts[i - 1].contains("expert") && parts[i].bytes().all(|b| b.is_ascii_digit()) && !parts[i].is_empty() {
                found.insert(parts[..i].join("."));
                break;
            }
        }
    }
    found.into_iter().collect()
}

/// Why `{p}{e}.{proj}.{field}` does not belong to an expert of `naming`.
fn unexpected_what(e: usize, naming: ExpertNaming, proj: &str, field: &str) -> String {
    if naming.projections().contains(&proj) {
        return match field {
            "bias" => "biases are not supported (ModelOpt NVFP4 experts have none)".to_string(),
            "pre_quant_scale" => "AWQ's pre_quant_scale is not supported (plain NVFP4 only)".to_string(),
            "weight_packed" | "weight_global_scale" | "input_global_scale" => {
                "a compressed-tensors field: this loader reads ModelOpt NVFP4 (weight, weight_scale, weight_scale_2, \
                 input_scale)"
                    .to_string()
            }
            _ => "unexpected field: expected weight, weight_scale, weight_scale_2 or input_scale".to_string(),
        };
    }
    match style_of(proj) {
        Some((other, _)) if e == 0 => format!("expert 0 mixes the {naming} and {other} namings"),
        Some((other, _)) => {
            format!("expert {e} uses the {other} naming but expert 0 uses {naming}: all experts must use one naming")
        }
        None => format!("unexpected projection `{proj}`: the {naming} naming has {}", naming.projections().join(", ")),
    }
}

/// Finds the experts under `p` (E, with no gaps), their naming (from expert 0, the same for all),
/// and which projections carry `input_scale`; checks that every required tensor is listed and
/// nothing unexpected is.
fn discover(cat: &Catalog, p: &str) -> Result<Layout> {
    let mut by_expert: BTreeMap<usize, Vec<(&str, &str)>> = BTreeMap::new();
    let mut stray = Vec::new();
    for name in cat.shard_of.keys() {
        let Some(after) = name.strip_prefix(p) else { continue };
        match split_expert(after) {
            Some((e, rest)) => by_expert.entry(e).or_default().push((rest, name.as_str())),
            None => stray.push(name.as_str()),
        }
    }
    for v in by_expert.values_mut() {
        v.sort_unstable();
    }
    stray.sort_unstable();

    let Some((&first, first_names)) = by_expert.iter().next() else {
        let all: Vec<&str> = cat.shard_of.keys().map(String::as_str).collect();
        let hint = match prefixes_present(&all) {
            v if v.is_empty() => String::new(),
            v => {
                let shown: Vec<String> = v.iter().take(6).map(|s| format!("`{s}`")).collect();
                let more = if v.len() > 6 { format!(" and {} more", v.len() - 6) } else { String::new() };
                format!(" (expert prefixes present: {}{more})", shown.join(", "))
            }
        };
        return Err(Error::Invalid(format!(
            "no expert tensors `{p}<expert>.<projection>.<field>` in `{}`{hint}",
            cat.source.display()
        )));
    };
    if let Some(s) = stray.first() {
        return Err(tensor_err(
            s,
            format!("unexpected tensor under the experts prefix: expected `{p}<expert>.<projection>.<field>`"),
        ));
    }

    // The naming, from the first expert (expert 0 unless it is missing).
    let mut strong: Vec<(ExpertNaming, &str)> = Vec::new();
    let mut weak: Vec<(ExpertNaming, &str)> = Vec::new();
    for &(rest, name) in first_names {
        let proj = rest.rsplit_once('.').map_or(rest, |(proj, _)| proj);
        match style_of(proj) {
            Some((s, true)) if !strong.iter().any(|(t, _)| *t == s) => strong.push((s, name)),
            Some((s, false)) if !weak.iter().any(|(t, _)| *t == s) => weak.push((s, name)),
            _ => {}
        }
    }
    let naming = match (strong.as_slice(), weak.as_slice()) {
        ([(s, _)], _) | ([], [(s, _)]) => *s,
        ([(a, _), (b, name), ..], _) | ([], [(a, _), (b, name), ..]) => {
            return Err(tensor_err(name, format!("expert {first} mixes the {a} and {b} namings")));
        }
        ([], []) => {
            let found: Vec<String> = first_names.iter().map(|(_, n)| format!("`{n}`")).take(8).collect();
            return Err(Error::Invalid(format!(
                "expert {first} under `{p}` in `{}` has no recognised projection (it has {}): expected one of the \
                 namings {}",
                cat.source.display(),
                found.join(", "),
                ExpertNaming::ALL.map(|n| n.to_string()).join(", ")
            )));
        }
    };
    let projections = naming.projections();

    // E, without gaps.
    let experts = by_expert.keys().next_back().map_or(0, |&last| last + 1);
    if let Some(gap) = (0..experts).find(|e| !by_expert.contains_key(e)) {
        let present: Vec<String> = by_expert.keys().take(8).map(|e| e.to_string()).collect();
        let more = if by_expert.len() > 8 { ", ..." } else { "" };
        return Err(cat.not_found(
            &format!("{p}{gap}.{}.{WEIGHT}", projections[0]),
            format!(
                " (experts {}{more} are present: expert numbers must run from 0 to {} without gaps)",
                present.join(", "),
                experts - 1
            )
            .as_str(),
        ));
    }

    let mut has_input: Vec<bool> = Vec::new();
    for (&e, names) in &by_expert {
        for &(rest, name) in names {
            let (proj, field) = rest.rsplit_once('.').unwrap_or((rest, ""));
            let known_field = REQUIRED.contains(&field) || field == INPUT_SCALE;
            if !(projections.contains(&proj) && known_field) {
                return Err(tensor_err(name, unexpected_what(e, naming, proj, field)));
            }
        }
        let has = |rest: &str| names.binary_search_by(|(r, _)| (*r).cmp(rest)).is_ok();
        for (i, proj) in projections.iter().enumerate() {
            for field in REQUIRED {
                if !has(&format!("{proj}.{field}")) {
                    let listed: Vec<String> = names.iter().map(|(_, n)| format!("`{n}`")).collect();
                    return Err(cat.not_found(
                        &format!("{p}{e}.{proj}.{field}"),
                        &format!(" (expert {e} has {})", listed.join(", ")),
                    ));
                }
            }
            let input = has(&format!("{proj}.{INPUT_SCALE}"));
            if e == 0 {
                has_input.push(input);
            } else if input != has_input[i] {
                let name = format!("{p}{e}.{proj}.{INPUT_SCALE}");
                return Err(if input {
                    tensor_err(&name, "present, but expert 0's has none: input_scale must be in every expert or none")
                } else {
                    cat.not_found(&name, " (expert 0 has one: input_scale must be in every expert or none)")
                });
            }
        }
    }
    Ok(Layout { naming, experts, has_input })
}

fn check_dtype(name: &str, m: &Meta, want: Dtype) -> Result<()> {
    if m.dtype == want {
        Ok(())
    } else {
        Err(tensor_err(name, format!("dtype is {}, expected {want}", m.dtype)))
    }
}

fn check_scalar(name: &str, m: &Meta) -> Result<()> {
    check_dtype(name, m, Dtype::F32)?;
    if m.shape.is_empty() || m.shape == [1] {
        Ok(())
    } else {
        Err(tensor_err(name, format!("shape is {}, expected a scalar ([] or [1])", shape_str(&m.shape))))
    }
}

/// The rows of a projection of `role` for hidden size `h` and intermediate size `i`, and its K.
fn dims(role: Role, h: usize, i: usize) -> (usize, usize) {
    match role {
        Role::Gate | Role::Up => (i, h),
        Role::GateUp => (2 * i, h),
        Role::Down => (h, i),
    }
}

/// Checks every dtype and shape; H and I come from expert 0's first weight. Returns `(H, I)`.
fn check_shapes(layout: &Layout, p: &str, metas: &HashMap<String, Meta>) -> Result<(usize, usize)> {
    let projections = layout.naming.projections();
    let roles = roles(layout.naming);
    let fused = layout.naming.is_fused();

    let first = format!("{p}0.{}.{WEIGHT}", projections[0]);
    let m = &metas[&first];
    check_dtype(&first, m, Dtype::U8)?;
    let rows_name = if fused { "2I" } else { "I" };
    let &[rows, half] = m.shape.as_slice() else {
        return Err(tensor_err(&first, format!("shape is {}, expected 2-D [{rows_name}, H/2]", shape_str(&m.shape))));
    };
    let h = 2 * half;
    if h == 0 || !h.is_multiple_of(16) {
        return Err(tensor_err(
            &first,
            format!("shape is {}: H = 2 x {half} = {h} is not a positive multiple of 16", shape_str(&m.shape)),
        ));
    }
    if fused && !rows.is_multiple_of(2) {
        return Err(tensor_err(
            &first,
            format!("shape is {}: {rows} rows is odd, but fused gate/up holds 2I rows", shape_str(&m.shape)),
        ));
    }
    let i = if fused { rows / 2 } else { rows };
    if i == 0 || !i.is_multiple_of(16) {
        return Err(tensor_err(
            &first,
            format!("shape is {}: I = {i} is not a positive multiple of 16", shape_str(&m.shape)),
        ));
    }
    let from = format!("H = {h}, I = {i} from `{first}`");

    for e in 0..layout.experts {
        for ((proj, &role), &input) in projections.iter().zip(roles).zip(&layout.has_input) {
            let (n, k) = dims(role, h, i);
            let name = |field: &str| format!("{p}{e}.{proj}.{field}");
            for (field, dtype, shape) in [(WEIGHT, Dtype::U8, [n, k / 2]), (WEIGHT_SCALE, Dtype::F8_E4M3, [n, k / 16])]
            {
                let name = name(field);
                let m = &metas[&name];
                check_dtype(&name, m, dtype)?;
                if m.shape != shape {
                    return Err(tensor_err(
                        &name,
                        format!("shape is {}, expected {} ({from})", shape_str(&m.shape), shape_str(&shape)),
                    ));
                }
            }
            let name_g = name(WEIGHT_SCALE_2);
            check_scalar(&name_g, &metas[&name_g])?;
            if input {
                let name_in = name(INPUT_SCALE);
                check_scalar(&name_in, &metas[&name_in])?;
            }
        }
    }
    Ok((h, i))
}

/// Where a tensor's data goes.
#[derive(Clone, Copy)]
enum Dest {
    /// Into one of the four byte buffers at an offset.
    Bytes { buf: usize, offset: usize },
    /// Into one of the scalar slots ([`SLOT_GATE_G`] ...) for an expert.
    Scalar { slot: usize, expert: usize },
}

const W13_CODES: usize = 0;
const W13_SCALES: usize = 1;
const W2_CODES: usize = 2;
const W2_SCALES: usize = 3;
const SLOT_GATE_G: usize = 0;
const SLOT_UP_G: usize = 1;
const SLOT_DOWN_G: usize = 2;
const SLOT_GATE_IN: usize = 3;
const SLOT_UP_IN: usize = 4;
const SLOT_DOWN_IN: usize = 5;

fn checked_len(dims: &[usize]) -> Result<usize> {
    dims.iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| Error::InvalidShape(format!("{} is too large", shape_str(dims))))
}

/// Loads one MoE layer's experts from a ModelOpt NVFP4 checkpoint.
///
/// `path` is a `.safetensors` file, a sharded checkpoint's index `.json` (`{"weight_map": {name:
/// shard file}}`, shard files relative to the index's directory), or a directory holding one
/// `*.index.json` (preferred) or else exactly one `.safetensors` file. `prefix` is the experts'
/// module path, e.g. `model.layers.3.mlp.experts` (a trailing `.` is tolerated): expert `e`'s
/// tensors are `{prefix}.{e}.{projection}.{field}` in one of the [`ExpertNaming`] styles.
///
/// The experts must be numbered 0..E without gaps and all use the naming of expert 0; every
/// projection must have `weight` (U8 `[N, K/2]`), `weight_scale` (F8_E4M3 `[N, K/16]`) and
/// `weight_scale_2` (F32 `[]` or `[1]`, finite and > 0), and either every expert or none an
/// `input_scale` (F32 `[]` or `[1]`, finite and >= 0: an uncalibrated expert's 0 is kept). Gate
/// and up are `[I, H/2]` (fused: `[2I, H/2]`), down `[H, I/2]`, with H and I positive multiples of
/// 16 and the same in every expert. Any other tensor under the prefix is an error.
///
/// # Errors
/// An unreadable or malformed file or index ([`Error::Io`], [`Error::Safetensors`], [`Error::Json`]), no
/// experts under `prefix`, or a tensor missing, of the wrong dtype or shape, or unexpected
/// ([`Error::Tensor`], naming it).
pub fn load_modelopt(path: impl AsRef<Path>, prefix: &str) -> Result<MoeCheckpoint> {
    let p = expert_prefix(prefix);
    let cat = Catalog::open(path.as_ref())?;
    let layout = discover(&cat, &p)?;
    let names = layout.names(&p);
    let metas = cat.metas(&names)?;
    let (h, i) = check_shapes(&layout, &p, &metas)?;
    let experts = layout.experts;
    let naming = layout.naming;

    // Destinations: per expert, gate rows then up rows of w13; down into w2.
    let w13_codes_e = checked_len(&[2 * i, h / 2])?;
    let w13_scales_e = 2 * i * (h / 16);
    let w2_codes_e = h * (i / 2);
    let w2_scales_e = h * (i / 16);
    let mut bufs = [
        vec![0u8; checked_len(&[experts, w13_codes_e])?],
        vec![0u8; experts * w13_scales_e],
        vec![0u8; experts * w2_codes_e],
        vec![0u8; experts * w2_scales_e],
    ];
    // Per expert: the scalars of the six slots.
    let mut slots = vec![[0f32; 6]; experts];
    let mut jobs: Vec<(&String, Dest)> = Vec::with_capacity(names.len());
    let mut it = names.iter();
    for e in 0..experts {
        for (&role, &input) in roles(naming).iter().zip(&layout.has_input) {
            let (codes_off, scales_off, g_slot, in_slot) = match role {
                Role::Gate | Role::GateUp => (e * w13_codes_e, e * w13_scales_e, SLOT_GATE_G, SLOT_GATE_IN),
                Role::Up => {
                    (e * w13_codes_e + w13_codes_e / 2, e * w13_scales_e + w13_scales_e / 2, SLOT_UP_G, SLOT_UP_IN)
                }
                Role::Down => (e * w2_codes_e, e * w2_scales_e, SLOT_DOWN_G, SLOT_DOWN_IN),
            };
            let (cb, sb) = if role == Role::Down { (W2_CODES, W2_SCALES) } else { (W13_CODES, W13_SCALES) };
            // The same order as `Layout::names`.
            jobs.push((it.next().expect("name"), Dest::Bytes { buf: cb, offset: codes_off }));
            jobs.push((it.next().expect("name"), Dest::Bytes { buf: sb, offset: scales_off }));
            jobs.push((it.next().expect("name"), Dest::Scalar { slot: g_slot, expert: e }));
            if input {
                jobs.push((it.next().expect("name"), Dest::Scalar { slot: in_slot, expert: e }));
            }
        }
    }

    // Copy, one shard at a time.
    for (s, path) in cat.shards.iter().enumerate() {
        if !jobs.iter().any(|(n, _)| metas[*n].shard == s) {
            continue;
        }
        let owned;
        let bytes: &[u8] = match &cat.preloaded {
            Some(b) => b,
            None => {
                owned = read_file(path)?;
                &owned
            }
        };
        let st = deserialize(bytes, path)?;
        for &(name, dest) in jobs.iter().filter(|(n, _)| metas[*n].shard == s) {
            let m = &metas[name];
            let t = match st.tensor(name) {
                Ok(t) if t.dtype() == m.dtype && t.shape() == m.shape => t,
                _ => {
                    return Err(tensor_err(name, format!("`{}` changed while it was being read", path.display())));
                }
            };
            let data = t.data();
            match dest {
                Dest::Bytes { buf, offset } => bufs[buf][offset..offset + data.len()].copy_from_slice(data),
                Dest::Scalar { slot, expert } => {
                    slots[expert][slot] = f32::from_le_bytes([data[0], data[1], data[2], data[3]]);
                }
            }
        }
    }

    // Values, in expert order.
    for (e, vals) in slots.iter().enumerate() {
        for ((proj, &role), &input) in naming.projections().iter().zip(roles(naming)).zip(&layout.has_input) {
            let (g_slot, in_slot) = match role {
                Role::Gate | Role::GateUp => (SLOT_GATE_G, SLOT_GATE_IN),
                Role::Up => (SLOT_UP_G, SLOT_UP_IN),
                Role::Down => (SLOT_DOWN_G, SLOT_DOWN_IN),
            };
            let g = vals[g_slot];
            if validate_decode_scale(g).is_err() {
                return Err(tensor_err(
                    &format!("{p}{e}.{proj}.{WEIGHT_SCALE_2}"),
                    format!("decode scale must be finite and > 0, got {g}"),
                ));
            }
            let x = vals[in_slot];
            if input && !(x.is_finite() && x >= 0.0) {
                return Err(tensor_err(
                    &format!("{p}{e}.{proj}.{INPUT_SCALE}"),
                    format!("input scale must be finite and >= 0, got {x}"),
                ));
            }
        }
    }

    let [w13_codes, w13_scales, w2_codes, w2_scales] = bufs;
    let slot = |s: usize| slots.iter().map(|v| v[s]).collect::<Vec<f32>>();
    let [gate_g, up_g, down_g, gate_in, up_in, down_in] =
        [SLOT_GATE_G, SLOT_UP_G, SLOT_DOWN_G, SLOT_GATE_IN, SLOT_UP_IN, SLOT_DOWN_IN].map(slot);
    let has_input = &layout.has_input;
    let (l1_input_scales, up_input_scales, l2_input_scales, up_decode_scales) = if naming.is_fused() {
        (has_input[0].then_some(gate_in), None, has_input[1].then_some(down_in), gate_g.clone())
    } else {
        let same = has_input[0] && gate_in.iter().zip(&up_in).all(|(a, b)| a.to_bits() == b.to_bits());
        let up = (has_input[1] && !same).then_some(up_in);
        (has_input[0].then_some(gate_in), up, has_input[2].then_some(down_in), up_g)
    };
    Ok(MoeCheckpoint {
        experts,
        hidden: h,
        intermediate: i,
        w13: ExpertWeightsHost { experts, n: 2 * i, k: h, codes: w13_codes, scales: w13_scales, decode_scales: gate_g },
        up_decode_scales,
        w2: ExpertWeightsHost { experts, n: h, k: i, codes: w2_codes, scales: w2_scales, decode_scales: down_g },
        l1_input_scales,
        up_input_scales,
        l2_input_scales,
        naming,
    })
}

impl MoeCheckpoint {
    /// Experts made in memory (no input scales, `gate_proj`/`up_proj`/`down_proj` names): E, H and
    /// I are read from `w13` (`n = 2I`, `k = H`). Not validated; see [`validate`](Self::validate).
    pub fn from_experts(w13: ExpertWeightsHost, up_decode_scales: Vec<f32>, w2: ExpertWeightsHost) -> Self {
        MoeCheckpoint {
            experts: w13.experts,
            hidden: w13.k,
            intermediate: w13.n / 2,
            w13,
            up_decode_scales,
            w2,
            l1_input_scales: None,
            up_input_scales: None,
            l2_input_scales: None,
            naming: ExpertNaming::GateUpDown,
        }
    }

    /// Checks that the sizes agree (E, H, I with every buffer and vector; H and I positive
    /// multiples of 16; at least one expert), that every decode scale is finite and > 0, and that
    /// every input scale is finite and >= 0.
    ///
    /// # Errors
    /// The first disagreement found, as [`Error::InvalidShape`], [`Error::InvalidDecodeScale`] or
    /// [`Error::Invalid`].
    pub fn validate(&self) -> Result<()> {
        let (e, h, i) = (self.experts, self.hidden, self.intermediate);
        let shape = |what: String| Err(Error::InvalidShape(format!("MoE checkpoint: {what}")));
        if e == 0 {
            return shape("no experts".to_string());
        }
        if h == 0 || !h.is_multiple_of(16) || i == 0 || !i.is_multiple_of(16) {
            return shape(format!("hidden {h} and intermediate {i} must be positive multiples of 16"));
        }
        for (what, w, n, k) in [("w13", &self.w13, 2 * i, h), ("w2", &self.w2, h, i)] {
            if (w.experts, w.n, w.k) != (e, n, k) {
                return shape(format!(
                    "{what} is {} experts x [{}, {}], expected {e} x [{n}, {k}]",
                    w.experts, w.n, w.k
                ));
            }
            let codes = checked_len(&[e, n, k / 2])?;
            if w.codes.len() != codes || w.scales.len() != e * n * (k / 16) {
                return shape(format!(
                    "{what} has {} code and {} scale bytes, [{e}, {n}, {k}] needs {codes} and {}",
                    w.codes.len(),
                    w.scales.len(),
                    e * n * (k / 16)
                ));
            }
        }
        let vectors = [
            ("w13.decode_scales", Some(&self.w13.decode_scales), true),
            ("up_decode_scales", Some(&self.up_decode_scales), true),
            ("w2.decode_scales", Some(&self.w2.decode_scales), true),
            ("l1_input_scales", self.l1_input_scales.as_ref(), false),
            ("up_input_scales", self.up_input_scales.as_ref(), false),
            ("l2_input_scales", self.l2_input_scales.as_ref(), false),
        ];
        for (what, v, decode) in vectors {
            let Some(v) = v else { continue };
            if v.len() != e {
                return shape(format!("{what} has {} values for {e} experts", v.len()));
            }
            for (x, &g) in v.iter().enumerate() {
                let ok = if decode { validate_decode_scale(g).is_ok() } else { g.is_finite() && g >= 0.0 };
                if !ok {
                    let want = if decode { "finite and > 0" } else { "finite and >= 0" };
                    return Err(Error::Invalid(format!("MoE checkpoint: {what}[{x}] = {g}, must be {want}")));
                }
            }
        }
        Ok(())
    }
}

/// One tensor to write: name, dtype, shape, little-endian bytes.
struct OutTensor<'a> {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    data: Cow<'a, [u8]>,
}

/// The tensors of `ckpt` under `prefix` in `naming` (borrowing the weight bytes), in expert and
/// projection order. A fused naming needs the gate and up decode scales (and input scales) to be
/// equal, as it stores one of each.
fn expert_tensors<'a>(prefix: &str, naming: ExpertNaming, ckpt: &'a MoeCheckpoint) -> Result<Vec<OutTensor<'a>>> {
    ckpt.validate()?;
    let p = expert_prefix(prefix);
    let (h, i) = (ckpt.hidden, ckpt.intermediate);
    let mut out = Vec::new();
    let scalar = |name: String, v: f32| OutTensor {
        name,
        dtype: Dtype::F32,
        shape: vec![],
        data: Cow::Owned(v.to_le_bytes().to_vec()),
    };
    for e in 0..ckpt.experts {
        for (proj, &role) in naming.projections().iter().zip(roles(naming)) {
            let name = |field: &str| format!("{p}{e}.{proj}.{field}");
            let (n, k) = dims(role, h, i);
            let (w, row0) = match role {
                Role::Gate | Role::GateUp => (&ckpt.w13, e * 2 * i),
                Role::Up => (&ckpt.w13, e * 2 * i + i),
                Role::Down => (&ckpt.w2, e * h),
            };
            let codes = &w.codes[row0 * (k / 2)..(row0 + n) * (k / 2)];
            let scales = &w.scales[row0 * (k / 16)..(row0 + n) * (k / 16)];
            let (g, input) = match role {
                Role::Gate | Role::GateUp => (ckpt.w13.decode_scales[e], ckpt.l1_input_scales.as_ref().map(|v| v[e])),
                Role::Up => (
                    ckpt.up_decode_scales[e],
                    ckpt.up_input_scales.as_ref().or(ckpt.l1_input_scales.as_ref()).map(|v| v[e]),
                ),
                Role::Down => (ckpt.w2.decode_scales[e], ckpt.l2_input_scales.as_ref().map(|v| v[e])),
            };
            if role == Role::GateUp {
                let u = ckpt.up_decode_scales[e];
                if u.to_bits() != g.to_bits() {
                    return Err(tensor_err(
                        &name(WEIGHT_SCALE_2),
                        format!(
                            "expert {e}'s gate and up decode scales differ ({g} and {u}), but the fused {proj} \
                             stores one: write a naming with separate gate and up"
                        ),
                    ));
                }
                if let (Some(gi), Some(ui)) = (input, ckpt.up_input_scales.as_ref().map(|v| v[e])) {
                    if gi.to_bits() != ui.to_bits() {
                        return Err(tensor_err(
                            &name(INPUT_SCALE),
                            format!(
                                "expert {e}'s gate and up input scales differ ({gi} and {ui}), but the fused {proj} \
                                 stores one: write a naming with separate gate and up"
                            ),
                        ));
                    }
                }
                if input.is_none() && ckpt.up_input_scales.is_some() {
                    return Err(tensor_err(
                        &name(INPUT_SCALE),
                        format!("up has input scales and gate none, but the fused {proj} stores one for both"),
                    ));
                }
            }
            out.push(OutTensor { name: name(WEIGHT), dtype: Dtype::U8, shape: vec![n, k / 2], data: codes.into() });
            out.push(OutTensor {
                name: name(WEIGHT_SCALE),
                dtype: Dtype::F8_E4M3,
                shape: vec![n, k / 16],
                data: scales.into(),
            });
            out.push(scalar(name(WEIGHT_SCALE_2), g));
            if let Some(x) = input {
                out.push(scalar(name(INPUT_SCALE), x));
            }
        }
    }
    Ok(out)
}

/// The file-level metadata every file written here carries (one entry, so the header is
/// deterministic).
fn file_metadata() -> Option<HashMap<String, String>> {
    Some(HashMap::from([("format".to_string(), "pt".to_string())]))
}

/// Writes `tensors` to a sibling temporary file that is then renamed over `path` (a failed write
/// never leaves a truncated file), with the permissions a newly created file gets here.
fn write_tensors(path: &Path, tensors: Vec<(String, TensorView<'_>)>) -> Result<()> {
    let io = |e: std::io::Error| io_err("write", path, e);
    let Some(file_name) = path.file_name() else {
        return Err(io(std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a file name")));
    };
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(file_name);
    tmp_name.push(format!(".tmp{}", std::process::id()));
    let tmp = path.with_file_name(tmp_name);
    let perms = std::fs::File::create(&tmp).and_then(|f| f.metadata()).map(|m| m.permissions()).map_err(io)?;
    let written = safetensors::serialize_to_file(tensors, file_metadata(), &tmp)
        .map_err(|e| match e {
            safetensors::SafeTensorError::IoError(e) => io(e),
            e => Error::Safetensors(e),
        })
        .and_then(|()| std::fs::set_permissions(&tmp, perms).and_then(|()| std::fs::rename(&tmp, path)).map_err(io));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// Writes `ckpt`'s experts as a single-file ModelOpt NVFP4 checkpoint at `path`, named
/// `{prefix}.{e}.{projection}.{field}` in `naming` (the inverse of [`load_modelopt`]):
/// `weight` U8 `[N, K/2]`, `weight_scale` F8_E4M3 `[N, K/16]`, `weight_scale_2` F32 `[]`, and
/// `input_scale` F32 `[]` where `ckpt` has input scales (up gets
/// [`up_input_scales`](MoeCheckpoint::up_input_scales), else the first layer's).
///
/// `ckpt` must pass [`MoeCheckpoint::validate`]. A fused naming stores one `weight_scale_2` (and one
/// `input_scale`) for gate and up, so it is refused, naming the tensor, when an expert's differ.
///
/// # Errors
/// A checkpoint that fails [`MoeCheckpoint::validate`], gate and up scales that a fused naming
/// cannot store, or an i/o error writing `path`.
pub fn write_modelopt_experts(
    path: impl AsRef<Path>,
    prefix: &str,
    naming: ExpertNaming,
    ckpt: &MoeCheckpoint,
) -> Result<()> {
    let tensors = expert_tensors(prefix, naming, ckpt)?;
    let views = tensors
        .iter()
        .map(|t| {
            TensorView::new(t.dtype, t.shape.clone(), &t.data)
                .map(|v| (t.name.clone(), v))
                .map_err(|e| tensor_err(&t.name, format!("cannot be written: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    write_tensors(path.as_ref(), views)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;
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

    fn rng() -> (Rng, String) {
        let r = Rng::from_entropy();
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
        assert_tensor_err(
            res,
            &format!("{QWEN}.1.gate_proj.weight"),
            &["[32, 64]", "expected [32, 32]", "H = 64"],
            &seed,
        );
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
        let got = load_edited(&mut r, &|ts| ts.retain(|t| !t.0.ends_with("_proj.input_scale") || t.0.contains("down")))
            .unwrap();
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
        assert!(matches!(
            write_modelopt_experts(&path, QWEN, ExpertNaming::GateUpDown, &bad),
            Err(Error::InvalidShape(_))
        ));
        let mut bad = c.clone();
        bad.up_decode_scales[1] = f32::NAN;
        assert!(matches!(write_modelopt_experts(&path, QWEN, ExpertNaming::GateUpDown, &bad), Err(Error::Invalid(_))));
        let mut bad = c.clone();
        bad.l2_input_scales = Some(vec![1.0; 2]);
        assert!(matches!(
            write_modelopt_experts(&path, QWEN, ExpertNaming::GateUpDown, &bad),
            Err(Error::InvalidShape(_))
        ));
        // Different up input scales cannot go into a fused naming.
        let mut bad = fusable(&c);
        bad.up_input_scales = c.up_input_scales.clone();
        let e = write_modelopt_experts(&path, QWEN, ExpertNaming::FusedW13, &bad).unwrap_err();
        assert!(
            matches!(&e, Error::Tensor { name, .. } if *name == format!("{QWEN}.0.w13.input_scale")),
            "{e}; {seed}"
        );
        assert!(!path.exists(), "{seed}");
    }
}
