//! Loading: discover the experts under a prefix, check every dtype and shape from the headers,
//! then copy each tensor's bytes by range into the layer's buffers.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use safetensors::tensor::Dtype;

use super::catalog::{Catalog, Meta};
use super::dialect::{declared, Declared, Dialect, Fields, QuantScheme};
use super::*;
use crate::error::{Error, Result};
use crate::host::{checked_len, validate_decode_scale, ExpertWeightsHost, MoeCheckpoint};
use crate::io::safetensors::{shape_str, tensor_err, SafetensorsFile};
use crate::io::shown::{shown, shown_path};

/// What [`discover`] finds: the naming, E, and for each projection whether it has `input_scale`.
struct Layout {
    naming: ExpertNaming,
    experts: usize,
    has_input: Vec<bool>,
}

impl Layout {
    /// The tensor names to read, expert by expert in projection order.
    fn names(&self, p: &str, f: &Fields) -> Vec<String> {
        let mut out = Vec::new();
        for e in 0..self.experts {
            for (proj, &input) in self.naming.projections().iter().zip(&self.has_input) {
                for field in f.required() {
                    out.push(format!("{p}{e}.{proj}.{field}"));
                }
                if input {
                    out.push(format!("{p}{e}.{proj}.{}", f.input));
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

/// Why `{p}{e}.{proj}.{field}` does not belong to an expert of `naming` in `dialect`.
fn unexpected_what(e: usize, naming: ExpertNaming, dialect: Dialect, proj: &str, field: &str) -> String {
    let f = dialect.fields();
    if naming.projections().contains(&proj) {
        return match field {
            "bias" => "biases are not supported (NVFP4 MoE experts have none)".to_string(),
            "pre_quant_scale" => "AWQ's pre_quant_scale is not supported (plain NVFP4 only)".to_string(),
            "weight_zero_point" => "a zero point: NVFP4 is symmetric (asymmetric 4-bit is not supported)".to_string(),
            "weight_shape" => "compressed-tensors' int4 pack-quantized layout, not NVFP4".to_string(),
            _ if Dialect::of_field(field).is_some_and(|d| d != dialect) => format!(
                "a {} field, but the other experts' tensors are {dialect} ({}, {}, {}, {}): one dialect per layer",
                Dialect::of_field(field).expect("checked"),
                f.codes,
                f.scales,
                f.per_tensor,
                f.input
            ),
            _ => format!("unexpected field: expected {}, {}, {} or {}", f.codes, f.scales, f.per_tensor, f.input),
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
fn discover(cat: &Catalog, p: &str, dialect: Dialect) -> Result<Layout> {
    let f = dialect.fields();
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
                let listed: Vec<String> = v.iter().take(6).map(|s| format!("`{}`", shown(s))).collect();
                let more = if v.len() > 6 { format!(" and {} more", v.len() - 6) } else { String::new() };
                format!(" (expert prefixes present: {}{more})", listed.join(", "))
            }
        };
        return Err(Error::Invalid(format!(
            "no expert tensors `{}<expert>.<projection>.<field>` in `{}`{hint}",
            shown(p),
            shown_path(&cat.source)
        )));
    };
    if let Some(s) = stray.first() {
        return Err(tensor_err(
            s,
            format!("unexpected tensor under the experts prefix: expected `{}<expert>.<projection>.<field>`", shown(p)),
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
            let found: Vec<String> = first_names.iter().map(|(_, n)| format!("`{}`", shown(n))).take(8).collect();
            return Err(Error::Invalid(format!(
                "expert {first} under `{}` in `{}` has no recognised projection (it has {}): expected one of the \
                 namings {}",
                shown(p),
                shown_path(&cat.source),
                found.join(", "),
                ExpertNaming::ALL.map(|n| n.to_string()).join(", ")
            )));
        }
    };
    let projections = naming.projections();

    // E, without gaps: the experts are numbered 0..E exactly when the last number is E - 1 (never
    // `last + 1`, which overflows for an expert numbered usize::MAX).
    let experts = by_expert.len();
    let last = by_expert.keys().next_back().copied().unwrap_or(0);
    if last != experts - 1 {
        // Some number below `last` is missing: there are fewer keys than numbers up to it.
        let gap = (0..last).find(|e| !by_expert.contains_key(e)).unwrap_or(last);
        let present: Vec<String> = by_expert.keys().take(8).map(|e| e.to_string()).collect();
        let more = if by_expert.len() > 8 { ", ..." } else { "" };
        return Err(cat.not_found(
            &format!("{p}{gap}.{}.{}", projections[0], f.codes),
            format!(
                " (experts {}{more} are present: expert numbers must run from 0 to {last} without gaps)",
                present.join(", ")
            )
            .as_str(),
        ));
    }

    let mut has_input: Vec<bool> = Vec::new();
    for (&e, names) in &by_expert {
        for &(rest, name) in names {
            let (proj, field) = rest.rsplit_once('.').unwrap_or((rest, ""));
            if !(projections.contains(&proj) && f.is_known(field)) {
                return Err(tensor_err(name, unexpected_what(e, naming, dialect, proj, field)));
            }
        }
        let has = |rest: &str| names.binary_search_by(|(r, _)| (*r).cmp(rest)).is_ok();
        for (i, proj) in projections.iter().enumerate() {
            for field in f.required() {
                if !has(&format!("{proj}.{field}")) {
                    let listed: Vec<String> = names.iter().map(|(_, n)| format!("`{}`", shown(n))).collect();
                    return Err(cat.not_found(
                        &format!("{p}{e}.{proj}.{field}"),
                        &format!(" (expert {e} has {})", listed.join(", ")),
                    ));
                }
            }
            let input = has(&format!("{proj}.{}", f.input));
            if e == 0 {
                has_input.push(input);
            } else if input != has_input[i] {
                let name = format!("{p}{e}.{proj}.{}", f.input);
                return Err(if input {
                    tensor_err(
                        &name,
                        format!("present, but expert 0's has none: {} must be in every expert or none", f.input),
                    )
                } else {
                    cat.not_found(&name, &format!(" (expert 0 has one: {} must be in every expert or none)", f.input))
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

/// Checks every dtype and shape; H and I come from expert 0's first weight. Returns `(H, I)`.
fn check_shapes(layout: &Layout, p: &str, f: &Fields, metas: &HashMap<String, Meta>) -> Result<(usize, usize)> {
    let projections = layout.naming.projections();
    let roles = roles(layout.naming);
    let fused = layout.naming.is_fused();

    let first = format!("{p}0.{}.{}", projections[0], f.codes);
    let m = &metas[&first];
    check_dtype(&first, m, Dtype::U8)?;
    let rows_name = if fused { "2I" } else { "I" };
    let &[rows, half] = m.shape.as_slice() else {
        return Err(tensor_err(&first, format!("shape is {}, expected 2-D [{rows_name}, H/2]", shape_str(&m.shape))));
    };
    // A header accepts any dimension beside a zero one: `2 * half` must not overflow.
    let Some(h) = half.checked_mul(2) else {
        return Err(tensor_err(
            &first,
            format!("shape is {}: H = 2 x {half} does not fit in usize", shape_str(&m.shape)),
        ));
    };
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
    // Every size derived from H and I below is at most 2 x I x H.
    if checked_len(&[2, i, h]).is_err() {
        return Err(tensor_err(&first, format!("shape is {}: 2 x I x H does not fit in usize", shape_str(&m.shape))));
    }
    let from = format!("H = {h}, I = {i} from `{}`", shown(&first));

    for e in 0..layout.experts {
        for ((proj, &role), &input) in projections.iter().zip(roles).zip(&layout.has_input) {
            let (n, k) = dims(role, h, i);
            let name = |field: &str| format!("{p}{e}.{proj}.{field}");
            for (field, dtype, shape) in [(f.codes, Dtype::U8, [n, k / 2]), (f.scales, Dtype::F8_E4M3, [n, k / 16])] {
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
            let name_g = name(f.per_tensor);
            check_scalar(&name_g, &metas[&name_g])?;
            if input {
                let name_in = name(f.input);
                check_scalar(&name_in, &metas[&name_in])?;
            }
        }
    }
    Ok((h, i))
}

/// The bytes of one expert's w13 codes, w13 scales, w2 codes and w2 scales, and of all E experts'.
/// Every size checked: H and I come from a header, E from tensor names.
fn buffer_lens(experts: usize, h: usize, i: usize) -> Result<([usize; 4], [usize; 4])> {
    let per_expert = [
        checked_len(&[2, i, h / 2])?,
        checked_len(&[2, i, h / 16])?,
        checked_len(&[h, i / 2])?,
        checked_len(&[h, i / 16])?,
    ];
    let mut all = [0usize; 4];
    for (a, &e) in all.iter_mut().zip(&per_expert) {
        *a = checked_len(&[experts, e])?;
    }
    Ok((per_expert, all))
}

/// The name resolution and header checks of [`load_experts`] on tensors given as names, dtypes and
/// shapes (one in-memory shard, no configs, nothing read): [`resolve`] over an in-memory catalog,
/// the layer's buffer sizes computed, not allocated. Returns `(E, H, I)`. For the fuzz targets.
#[cfg(feature = "fuzzing")]
pub(crate) fn resolve_in_memory(
    prefix: &str,
    tensors: &[(String, Dtype, Vec<usize>)],
) -> Result<(usize, usize, usize)> {
    let r = resolve(&Catalog::in_memory(tensors), prefix, None, |_| Ok(Declared::default()))?;
    Ok((r.layout.experts, r.h, r.i))
}

/// One layer's experts as the names and headers describe them: what [`load`] copies.
struct Resolved {
    /// The experts' prefix (with its trailing `.`).
    p: String,
    dialect: Dialect,
    scheme: QuantScheme,
    /// What the configs declared (and in which file).
    decl: Declared,
    layout: Layout,
    /// Every tensor to read, in [`Layout::names`] order, with its dtype, shape and shard.
    names: Vec<String>,
    metas: HashMap<String, Meta>,
    h: usize,
    i: usize,
    /// Bytes of the four buffers per expert and in all ([`buffer_lens`]).
    lens: ([usize; 4], [usize; 4]),
}

/// The checks before any tensor data is read, shared by [`load`] and [`resolve_in_memory`] so that
/// the fuzz targets run the loader's own sequence: the dialect from the tensors' field names
/// against the configs' declaration (`declared`, read after the tensors are looked at) and `want`;
/// the experts and their naming ([`discover`]); the scheme against the declaration; every dtype and
/// shape ([`check_shapes`]); the layer's buffer sizes ([`buffer_lens`]).
fn resolve(
    cat: &Catalog,
    prefix: &str,
    want: Option<Dialect>,
    declared: impl FnOnce(&Catalog) -> Result<Declared>,
) -> Result<Resolved> {
    let p = expert_prefix(prefix);
    let from_tensors = tensor_dialect(cat, &p)?;
    let decl = declared(cat)?;
    let dialect = match (from_tensors, decl.dialect) {
        (Some(t), Some(d)) if t != d => {
            return Err(Error::Dialect {
                path: decl.file.clone().unwrap_or_else(|| cat.source.clone()),
                what: format!("it declares {d}, but the experts' tensors under `{}` are {t}", shown(&p)),
            });
        }
        (Some(t), _) => t,
        (None, Some(d)) => d,
        (None, None) => want.unwrap_or(Dialect::ModelOpt),
    };
    if let Some(w) = want.filter(|&w| w != dialect) {
        let how = match dialect {
            Dialect::ModelOpt => "load_modelopt or load_experts",
            Dialect::CompressedTensors => "load_compressed_tensors or load_experts",
        };
        return Err(Error::Dialect {
            path: cat.source.clone(),
            what: format!("the experts under `{}` are {dialect}, not {w}: read it with {how}", shown(&p)),
        });
    }
    let f = dialect.fields();
    let layout = discover(cat, &p, dialect)?;
    let first_input = |has: bool| {
        let j = layout.has_input.iter().position(|&x| x == has).expect("one projection is");
        format!("{p}0.{}.{}", layout.naming.projections()[j], f.input)
    };
    let scheme = match decl.scheme {
        Some(QuantScheme::W4A4) if layout.has_input.contains(&false) => {
            let why = format!(
                " (`{}` declares W4A4: every projection carries its activation scale)",
                decl.file.as_deref().map(shown_path).unwrap_or_default()
            );
            return Err(cat.not_found(&first_input(false), &why));
        }
        Some(QuantScheme::W4A16) if layout.has_input.contains(&true) => {
            return Err(tensor_err(
                &first_input(true),
                format!(
                    "present, but `{}` declares W4A16 (weight-only, no activation scales)",
                    decl.file.as_deref().map(shown_path).unwrap_or_default()
                ),
            ));
        }
        Some(s) => s,
        None if layout.has_input.contains(&true) => QuantScheme::W4A4,
        None => QuantScheme::W4A16,
    };
    let names = layout.names(&p, f);
    let metas = cat.metas(&names)?;
    let (h, i) = check_shapes(&layout, &p, f, &metas)?;
    let lens = buffer_lens(layout.experts, h, i)?;
    Ok(Resolved { p, dialect, scheme, decl, layout, names, metas, h, i, lens })
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

/// The dialect the tensors under `p` are in, from their field names (`weight_scale` alone
/// belongs to both): `None` if nothing under `p` says.
fn tensor_dialect(cat: &Catalog, p: &str) -> Result<Option<Dialect>> {
    let mut names: Vec<&str> = cat.shard_of.keys().map(String::as_str).filter(|n| n.starts_with(p)).collect();
    names.sort_unstable();
    let mut found: Option<(Dialect, &str)> = None;
    for name in names {
        let field = name.rsplit_once('.').map_or(name, |(_, f)| f);
        let Some(d) = Dialect::of_field(field) else { continue };
        match found {
            None => found = Some((d, name)),
            Some((first, first_name)) if first != d => {
                return Err(tensor_err(
                    name,
                    format!(
                        "a {d} field, but `{}` is a {first} field: the experts of one layer use one dialect",
                        shown(first_name)
                    ),
                ));
            }
            Some(_) => {}
        }
    }
    Ok(found.map(|(d, _)| d))
}

/// How a checkpoint's experts were stored, as [`load_experts`] detected it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct CheckpointFormat {
    /// The dialect of the experts' tensors.
    pub dialect: Dialect,
    /// Weights and activations (the checkpoint carries activation scales) or weights only.
    pub scheme: QuantScheme,
    /// The config file that declared the dialect (`config.json` or `hf_quant_config.json`), if
    /// any; without one, the tensors' names decided.
    pub declared_in: Option<PathBuf>,
}

/// One MoE layer's experts and how they were stored.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct LoadedExperts {
    /// The experts, in the crate's convention: decode scales g (compressed-tensors' global scales
    /// inverted), gate rows then up rows in `w13`.
    pub checkpoint: MoeCheckpoint,
    /// The dialect and scheme found.
    pub format: CheckpointFormat,
    /// The layer's number of each expert in `checkpoint`, in order: `0..E` from [`load_experts`],
    /// the shard's list from [`load_expert_shard`].
    pub expert_ids: Vec<usize>,
}

/// Loads one MoE layer's experts from an NVFP4 checkpoint in either dialect, detected from the
/// files: the experts' tensor names ([`Dialect::ModelOpt`]: `weight`, `weight_scale`,
/// `weight_scale_2`, `input_scale`; [`Dialect::CompressedTensors`]: `weight_packed`, `weight_scale`,
/// `weight_global_scale`, `input_global_scale`), checked against the configs beside them
/// (`config.json`'s `quantization_config`, ModelOpt's `hf_quant_config.json`), which also say W4A4
/// or W4A16.
///
/// `path` is a `.safetensors` file, a sharded checkpoint's index `.json` (`{"weight_map": {name:
/// shard file}}`, shard files relative to the index's directory: a path with `..` or an absolute
/// one is refused), a directory holding one `*.index.json` (preferred) or else exactly one
/// `.safetensors` file (a model directory, or a Hugging Face cache snapshot
/// `models--org--name/snapshots/<revision>/`, whose files are symlinks into `../../blobs`), or a
/// Hugging Face cache root `models--org--name/` (the snapshot `refs/main` names; without
/// `refs/main`, its only snapshot). Files are memory-mapped and only the layer's byte ranges are
/// read ([`SafetensorsFile`]). `prefix` is the experts' module path, e.g.
/// `model.layers.3.mlp.experts` (a trailing `.` is tolerated): expert `e`'s tensors are
/// `{prefix}.{e}.{projection}.{field}` in one of the [`ExpertNaming`] styles.
///
/// The experts must be numbered 0..E without gaps and all use the naming of expert 0; every
/// projection must have the codes (U8 `[N, K/2]`), the block scales (F8_E4M3 `[N, K/16]`) and the
/// per-tensor scale (F32 `[]` or `[1]`): ModelOpt's `weight_scale_2` is the decode scale g (finite
/// and > 0); compressed-tensors' `weight_global_scale` is 1/g (finite and > 0; g is its f32
/// reciprocal, which must be finite too). Activation scales (F32 `[]` or `[1]`) are in every
/// expert or none: ModelOpt's `input_scale` is the activation's decode scale (finite and >= 0: an
/// uncalibrated expert's 0 is kept); compressed-tensors' `input_global_scale` its reciprocal (> 0;
/// +inf gives 0). A config that declares W4A4 requires them on every projection, one that declares
/// W4A16 forbids them. Gate and up are `[I, H/2]` (fused: `[2I, H/2]`), down `[H, I/2]`, with H
/// and I positive multiples of 16 and the same in every expert; gate and up may carry different
/// per-tensor and activation scales (kept separately, see [`MoeCheckpoint`]). Any other tensor under
/// the prefix is an error.
///
/// Memory: the result's buffers (the layer's bytes) plus the mapped pages, which are the page
/// cache's, not the process's.
///
/// # Errors
/// An unreadable file ([`Error::Io`]), one that is not a regular file
/// ([`Error::NotRegularFile`]), a malformed file or index ([`Error::Invalid`]), an index shard
/// name outside its directory ([`Error::UnsafeShardPath`]), configs that are not a JSON object, give a
/// key twice, name another method or disagree with the tensors ([`Error::Dialect`]), no experts under `prefix`, or a tensor missing,
/// of the wrong dtype or shape, or unexpected ([`Error::Tensor`], naming it).
pub fn load_experts(path: impl AsRef<Path>, prefix: &str) -> Result<LoadedExperts> {
    load(path.as_ref(), prefix, None, None)
}

/// Loads a shard of one MoE layer's experts, for expert parallelism: [`load_experts`] for the
/// experts numbered `experts` (any distinct numbers below the layer's E, in the order given; the
/// result's expert `j` is the layer's expert `experts[j]`, [`LoadedExperts::expert_ids`]). Every
/// expert's names, dtypes and shapes are checked from the headers as for the whole layer, but only
/// the shard's tensor data is read. The result numbers its experts `0..experts.len()`: a router's
/// expert ids go through `expert_ids` to reach them. (One difference from the same experts taken
/// from the whole layer: with separate gate and up projections, `up_input_scales` is `None` when
/// up's activation scales equal gate's on the shard's experts, though not on the layer's.)
///
/// # Errors
/// An empty list or a number listed twice is an [`Error::Invalid`] before any file is opened; then
/// as [`load_experts`], and a number that is not one of the layer's experts is an
/// [`Error::Invalid`].
pub fn load_expert_shard(path: impl AsRef<Path>, prefix: &str, experts: &[usize]) -> Result<LoadedExperts> {
    if experts.is_empty() {
        return Err(Error::Invalid("an expert shard needs at least one expert".into()));
    }
    let mut sorted = experts.to_vec();
    sorted.sort_unstable();
    if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
        return Err(Error::Invalid(format!("expert {} is listed twice in the shard", w[0])));
    }
    load(path.as_ref(), prefix, None, Some(experts))
}

/// The shard's expert numbers (not empty, distinct: [`load_expert_shard`]), checked against the
/// layer's `all` experts.
fn shard_ids(shard: &[usize], all: usize, p: &str, cat: &Catalog) -> Result<Vec<usize>> {
    if let Some(&e) = shard.iter().find(|&&e| e >= all) {
        return Err(Error::Invalid(format!(
            "expert {e} of the shard is not in `{}`: the layer `{}` has {all} experts (0 to {})",
            shown_path(&cat.source),
            shown(p.trim_end_matches('.')),
            all - 1
        )));
    }
    Ok(shard.to_vec())
}

/// Loads one MoE layer's experts from a ModelOpt NVFP4 checkpoint: [`load_experts`] that refuses
/// any other dialect.
///
/// # Errors
/// As [`load_experts`]; a compressed-tensors checkpoint is an [`Error::Dialect`].
pub fn load_modelopt(path: impl AsRef<Path>, prefix: &str) -> Result<MoeCheckpoint> {
    Ok(load(path.as_ref(), prefix, Some(Dialect::ModelOpt), None)?.checkpoint)
}

/// Loads one MoE layer's experts from a compressed-tensors NVFP4 checkpoint
/// (`nvfp4-pack-quantized`): [`load_experts`] that refuses any other dialect.
///
/// # Errors
/// As [`load_experts`]; a ModelOpt checkpoint is an [`Error::Dialect`].
pub fn load_compressed_tensors(path: impl AsRef<Path>, prefix: &str) -> Result<MoeCheckpoint> {
    Ok(load(path.as_ref(), prefix, Some(Dialect::CompressedTensors), None)?.checkpoint)
}

/// `shard`: the experts to load (their numbers in the layer; `None`: all of them).
fn load(path: &Path, prefix: &str, want: Option<Dialect>, shard: Option<&[usize]>) -> Result<LoadedExperts> {
    let cat = Catalog::open(path)?;
    let Resolved { p, dialect, scheme, decl, layout, names, metas, h, i, lens } =
        resolve(&cat, prefix, want, |cat| declared(&cat.dir))?;
    let f = dialect.fields();
    let naming = layout.naming;
    let expert_ids = match shard {
        None => (0..layout.experts).collect(),
        Some(list) => shard_ids(list, layout.experts, &p, &cat)?,
    };
    let experts = expert_ids.len();
    // Where each of the layer's experts goes in the result (`None`: not loaded).
    let mut local = vec![None; layout.experts];
    for (j, &e) in expert_ids.iter().enumerate() {
        // (Distinct: load_expert_shard checked; a repeat would silently drop an expert here.)
        debug_assert!(local[e].is_none(), "expert {e} listed twice");
        local[e] = Some(j);
    }

    // Destinations: per expert, gate rows then up rows of w13; down into w2.
    let ([w13_codes_e, w13_scales_e, w2_codes_e, w2_scales_e], _) = lens;
    let (_, lens) = buffer_lens(experts, h, i)?;
    let mut bufs = lens.map(|n| vec![0u8; n]);
    // Per loaded expert: the scalars of the six slots.
    let mut slots = vec![[0f32; 6]; experts];
    let mut jobs: Vec<(&String, Dest)> = Vec::with_capacity(names.len());
    let mut it = names.iter();
    for le in local {
        for (&role, &input) in roles(naming).iter().zip(&layout.has_input) {
            // (The layer's names, expert by expert, are consumed whether or not this one is loaded:
            // `f.required()`'s three, then the activation scale's.)
            let Some(e) = le else {
                it.nth(f.required().len() + usize::from(input) - 1);
                continue;
            };
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

    // Copy by byte range, one shard at a time (each shard's header read once more, so a file that
    // changed since the catalog read it is caught).
    for (s, path) in cat.shards.iter().enumerate() {
        if !jobs.iter().any(|(n, _)| metas[*n].shard == s) {
            continue;
        }
        let file = SafetensorsFile::open(path)?;
        for &(name, dest) in jobs.iter().filter(|(n, _)| metas[*n].shard == s) {
            let m = &metas[name];
            let len = match file.info(name) {
                Some(t) if t.dtype == m.dtype && t.shape == m.shape => t.data_offsets.1 - t.data_offsets.0,
                _ => {
                    return Err(Error::FileChanged {
                        path: path.clone(),
                        what: format!("the header entry of tensor `{}` differs from the first read", shown(name)),
                    });
                }
            };
            match dest {
                Dest::Bytes { buf, offset } => {
                    file.read_into(name, &mut bufs[buf][offset..offset + len])?;
                }
                Dest::Scalar { slot, expert } => {
                    let mut b = [0u8; 4];
                    file.read_into(name, &mut b)?;
                    slots[expert][slot] = f32::from_le_bytes(b);
                }
            }
        }
    }

    // Values, in expert order: checked as stored, then turned into the crate's decode scales.
    for (vals, &e) in slots.iter_mut().zip(&expert_ids) {
        for ((proj, &role), &input) in naming.projections().iter().zip(roles(naming)).zip(&layout.has_input) {
            let (g_slot, in_slot) = match role {
                Role::Gate | Role::GateUp => (SLOT_GATE_G, SLOT_GATE_IN),
                Role::Up => (SLOT_UP_G, SLOT_UP_IN),
                Role::Down => (SLOT_DOWN_G, SLOT_DOWN_IN),
            };
            vals[g_slot] = weight_decode_scale(f, &format!("{p}{e}.{proj}.{}", f.per_tensor), vals[g_slot])?;
            if input {
                vals[in_slot] = activation_decode_scale(f, &format!("{p}{e}.{proj}.{}", f.input), vals[in_slot])?;
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
    let checkpoint = MoeCheckpoint {
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
    };
    Ok(LoadedExperts { checkpoint, format: CheckpointFormat { dialect, scheme, declared_in: decl.file }, expert_ids })
}

/// The weight decode scale g from the stored per-tensor value: ModelOpt's `weight_scale_2` is g;
/// compressed-tensors' `weight_global_scale` is 1/g, and g is its f32 reciprocal (correctly
/// rounded; compressed-tensors' own decompression divides by the global scale instead, which can
/// differ in the last bit of an f32, well inside one BF16 ulp of the decoded weight).
fn weight_decode_scale(f: &Fields, name: &str, stored: f32) -> Result<f32> {
    if !f.reciprocal {
        return match validate_decode_scale(stored) {
            Ok(()) => Ok(stored),
            Err(_) => Err(tensor_err(name, format!("decode scale must be finite and > 0, got {stored}"))),
        };
    }
    if !(stored.is_finite() && stored > 0.0) {
        return Err(tensor_err(name, format!("global scale (1/g) must be finite and > 0, got {stored}")));
    }
    let g = 1.0 / stored;
    if validate_decode_scale(g).is_err() {
        return Err(tensor_err(
            name,
            format!("global scale {stored} gives the decode scale 1/{stored} = {g}, not finite"),
        ));
    }
    Ok(g)
}

/// The activation decode scale from the stored value: ModelOpt's `input_scale` as is (finite and
/// at least 0; an uncalibrated expert's 0 is kept); compressed-tensors' `input_global_scale` is its
/// reciprocal (positive; +inf, what an uncalibrated expert can get, gives 0).
fn activation_decode_scale(f: &Fields, name: &str, stored: f32) -> Result<f32> {
    if !f.reciprocal {
        if stored.is_finite() && stored >= 0.0 {
            return Ok(stored);
        }
        return Err(tensor_err(name, format!("input scale must be finite and >= 0, got {stored}")));
    }
    if stored > 0.0 {
        return Ok(1.0 / stored);
    }
    Err(tensor_err(name, format!("input global scale (1/activation scale) must be > 0, got {stored}")))
}
