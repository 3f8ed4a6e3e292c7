//! NVFP4 Mixture-of-Experts checkpoints (Hugging Face layout) in both dialects, ModelOpt and
//! compressed-tensors: one MoE layer's experts loaded onto the host as a
//! [`MoeCheckpoint`](crate::host::MoeCheckpoint) ([`load_experts`], or one dialect only:
//! [`load_modelopt`], [`load_compressed_tensors`]), and written back in ModelOpt's
//! ([`write_modelopt_experts`]).
//!
//! Files: `catalog.rs` finds the tensors (a file, an index, a directory, a Hugging Face cache) from
//! the files' headers; `dialect.rs` tells the dialects apart and reads the configs; `load.rs`
//! discovers the experts, checks every dtype and shape and copies the bytes by range; `write.rs`
//! writes them back.
//!
//! Expert `e`'s tensors are `{prefix}.{e}.{projection}.{field}`, with the projections of one of the
//! [`ExpertNaming`] styles and the fields of the dialect (`dialect.rs` has the table): ModelOpt's
//! `weight` (U8 `[N, K/2]`), `weight_scale` (F8_E4M3 `[N, K/16]`, linear), `weight_scale_2` (F32
//! scalar, the decode scale g) and optionally `input_scale`; compressed-tensors' `weight_packed`,
//! `weight_scale`, `weight_global_scale` (1/g) and optionally `input_global_scale`. The checkpoint
//! is a `.safetensors` file, a sharded checkpoint's `*.index.json`, a directory holding one of them
//! (a Hugging Face cache snapshot too), or a Hugging Face cache root.
//!
//! Loading maps each shard (nothing is read but headers and the layer's byte ranges) and copies
//! out only the layer's tensors, so peak anonymous memory is the result (a deepseek-v3 layer: its
//! 6.34 GB + 0.1%, measured). Every dtype and shape is checked (from the files' headers) before
//! any tensor data is read. Every problem with a tensor (missing, wrong dtype, wrong shape, bad
//! value, unexpected) is an [`Error::Tensor`] naming it; an unreadable file is an [`Error::Io`]
//! naming the path; something that is not a regular file an [`Error::NotRegularFile`]; a
//! malformed index or safetensors file, a bad cache layout, or a directory without exactly one
//! checkpoint, an [`Error::Invalid`] naming the path; an index shard name leaving its directory an
//! [`Error::UnsafeShardPath`]; configs that disagree with the tensors or name another method an
//! [`Error::Dialect`].

mod catalog;
mod dialect;
mod load;
#[cfg(test)]
mod tests;
mod write;

pub(crate) use catalog::Catalog;
pub use dialect::{Dialect, QuantScheme};
#[cfg(feature = "fuzzing")]
pub(crate) use load::resolve_in_memory;
pub use load::{
    load_compressed_tensors, load_expert_shard, load_experts, load_modelopt, CheckpointFormat, LoadedExperts,
};
pub use write::write_modelopt_experts;

use crate::host::ExpertNaming;

/// The role of a projection: gate, up, the fused gate/up, or down.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Role {
    Gate,
    Up,
    GateUp,
    Down,
}

/// The roles of [`ExpertNaming::projections`], in the same order.
pub(super) fn roles(naming: ExpertNaming) -> &'static [Role] {
    if naming.is_fused() {
        &[Role::GateUp, Role::Down]
    } else {
        &[Role::Gate, Role::Up, Role::Down]
    }
}

/// The naming a projection name points to, and whether it decides it alone (`down_proj` and `w2`
/// each belong to a separate and a fused style).
pub(super) fn style_of(proj: &str) -> Option<(ExpertNaming, bool)> {
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

pub(super) const WEIGHT: &str = "weight";
pub(super) const WEIGHT_SCALE: &str = "weight_scale";
pub(super) const WEIGHT_SCALE_2: &str = "weight_scale_2";
pub(super) const INPUT_SCALE: &str = "input_scale";

/// `prefix` with exactly one trailing `.` (none for an empty prefix).
pub(super) fn expert_prefix(prefix: &str) -> String {
    let p = prefix.strip_suffix('.').unwrap_or(prefix);
    if p.is_empty() {
        String::new()
    } else {
        format!("{p}.")
    }
}

/// Splits what follows the prefix, `{e}.{rest}`, into the expert number and the rest. The number
/// must be written canonically (digits, no leading zero).
pub(super) fn split_expert(after_prefix: &str) -> Option<(usize, &str)> {
    let (num, rest) = after_prefix.split_once('.')?;
    let canonical = !num.is_empty() && num.bytes().all(|b| b.is_ascii_digit()) && (num == "0" || !num.starts_with('0'));
    if !canonical {
        return None;
    }
    Some((num.parse().ok()?, rest))
}

/// The rows of a projection of `role` for hidden size `h` and intermediate size `i`, and its K.
pub(super) fn dims(role: Role, h: usize, i: usize) -> (usize, usize) {
    match role {
        Role::Gate | Role::Up => (i, h),
        Role::GateUp => (2 * i, h),
        Role::Down => (h, i),
    }
}
