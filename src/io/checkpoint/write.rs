//! Writing a layer's experts back as a ModelOpt NVFP4 checkpoint.

use std::borrow::Cow;
use std::path::Path;

use safetensors::tensor::{Dtype, TensorView};

use super::*;
use crate::error::Result;
use crate::host::MoeCheckpoint;
use crate::io::safetensors::{tensor_err, write_tensors};

/// One tensor to write: name, dtype, shape, little-endian bytes.
pub(super) struct OutTensor<'a> {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: Cow<'a, [u8]>,
}

/// The tensors of `ckpt` under `prefix` in `naming` (borrowing the weight bytes), in expert and
/// projection order. A fused naming needs the gate and up decode scales (and input scales) to be
/// equal, as it stores one of each.
pub(super) fn expert_tensors<'a>(
    prefix: &str,
    naming: ExpertNaming,
    ckpt: &'a MoeCheckpoint,
) -> Result<Vec<OutTensor<'a>>> {
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
