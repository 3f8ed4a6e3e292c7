//! Loading: discover the experts under a prefix, check every dtype and shape from the headers,
//! then copy each tensor's bytes by range into the layer's buffers.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

use safetensors::tensor::Dtype;

use super::catalog::{Catalog, Meta};
use super::*;
use crate::error::{Error, Result};
use crate::host::{checked_len, validate_decode_scale, ExpertWeightsHost, MoeCheckpoint};
use crate::io::safetensors::{shape_str, tensor_err, SafetensorsFile};

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
                    return Err(tensor_err(name, format!("`{}` changed while it was being read", path.display())));
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
