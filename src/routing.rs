//! MoE routing, permutation and combine on the device (softmax top-k, the stable counting sort
//! by expert with the gather of the hidden rows, and the weighted combine), all without host
//! synchronization. The CPU oracle of each is in [`crate::reference::routing`].

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;

use crate::abi::PermuteArgs;
use crate::error::{Error, Result};
use crate::ffi::raw;
use crate::host::checked_len;
use crate::launch::{check_align, check_len, Launch};

// ------------------------------------------------------------------------------------------------
// Device side

/// The shape of a softmax top-k routing: `tokens` rows of `experts` router logits, `top_k` experts
/// chosen per token, their weights renormalized to sum 1 if asked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TopK {
    /// Tokens T.
    pub tokens: usize,
    /// Experts E (logits per token).
    pub experts: usize,
    /// Experts chosen per token k.
    pub top_k: usize,
    /// Whether the k weights of a token are divided by their sum.
    pub renormalize: bool,
}

/// Softmax top-k routing on the device: `logits` f32 `[tokens, experts]` -> `ids` i32 and
/// `weights` f32 `[tokens, top_k]`, choosing as [`crate::reference::routing::softmax_topk`] does (ids identical, weights to
/// FP32 rounding). `1 <= top_k <= min(experts, 32)`, `experts <= 1024`.
///
/// # Errors
/// A shape out of those ranges or whose element counts overflow, a buffer too small, or a failed
/// launch.
pub fn softmax_topk_into<L: DevicePtr<f32>, I: DevicePtrMut<i32>, W: DevicePtrMut<f32>>(
    stream: &CudaStream,
    logits: &L,
    spec: TopK,
    ids: &mut I,
    weights: &mut W,
) -> Result<()> {
    let TopK { tokens, experts, top_k, renormalize } = spec;
    if experts == 0 || experts > 1024 || top_k == 0 || top_k > experts.min(32) {
        return Err(Error::InvalidShape(format!(
            "need 1 <= top_k ({top_k}) <= min(experts ({experts}), 32), experts <= 1024"
        )));
    }
    let (logits_len, pairs) = (checked_len(&[tokens, experts])?, checked_len(&[tokens, top_k])?);
    check_i32_count("tokens", tokens)?;
    let l = Launch::new(stream)?;
    let (lg, i, w) = (l.input(logits), l.output(ids), l.output(weights));
    check_len("router_logits", lg.len, logits_len)?;
    check_len("topk_ids", i.len, pairs)?;
    check_len("topk_weights", w.len, pairs)?;
    if tokens == 0 {
        return Ok(());
    }
    let (t, e, k) = (tokens as i64, experts as i64, top_k as i64);
    // SAFETY: lengths checked above.
    unsafe { l.run(|st| raw::softmax_topk(lg.addr, t, e, k, renormalize, i.addr, w.addr, st)) }
}

/// Device buffers of the permutation for up to `max_pairs` (token, slot) pairs: sized once, reused
/// by every forward (no allocation inside a forward).
#[derive(Debug)]
pub struct PermuteBuffers {
    /// i32 `[E + 1]`.
    pub expert_offsets: CudaSlice<i32>,
    /// i32 `[max_pairs]`: the permuted row of each pair (-1 for a pair with a bad id).
    pub row_of_pair: CudaSlice<i32>,
    /// i32 `[max_pairs]`: the pair at each permuted row.
    pub pair_of_row: CudaSlice<i32>,
    /// bf16 `[max_pairs, hidden]`: the hidden rows in permuted order.
    pub x_perm: CudaSlice<bf16>,
    error: CudaSlice<u64>,
    workspace: CudaSlice<u8>,
    max_pairs: usize,
    experts: usize,
    hidden: usize,
}

impl PermuteBuffers {
    /// Buffers for up to `max_pairs` (token, slot) pairs over `experts` experts and hidden size
    /// `hidden`.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for `experts` outside 1..=1024 or `hidden` not a positive multiple of 8,
    /// or a CUDA error (out of memory).
    pub fn new(stream: &Arc<CudaStream>, max_pairs: usize, experts: usize, hidden: usize) -> Result<Self> {
        // The core's shape rules (experts, hidden size, pair count), as a typed error.
        let shape = PermuteArgs {
            tokens: i64::try_from(max_pairs).unwrap_or(i64::MAX),
            top_k: 1,
            experts: i64::try_from(experts).unwrap_or(i64::MAX),
            hidden_size: i64::try_from(hidden).unwrap_or(i64::MAX),
            ..Default::default()
        };
        crate::launch::status(raw::permute_and_gather_can_implement(&shape))?;
        let ws = raw::core_permute_workspace_bytes(max_pairs as i64, experts as i64) as usize;
        Ok(PermuteBuffers {
            expert_offsets: stream.alloc_zeros::<i32>(experts + 1)?,
            row_of_pair: stream.alloc_zeros::<i32>(max_pairs.max(1))?,
            pair_of_row: stream.alloc_zeros::<i32>(max_pairs.max(1))?,
            x_perm: stream.alloc_zeros::<bf16>((max_pairs * hidden).max(1))?,
            error: stream.clone_htod(&[u64::MAX])?,
            workspace: stream.alloc_zeros::<u8>(ws.max(4))?,
            max_pairs,
            experts,
            hidden,
        })
    }

    /// Sorts the pairs of `topk_ids` (i32 `[tokens, top_k]`) by expert (stable) and gathers the
    /// rows of `hidden` (bf16 `[tokens, hidden]`) into [`Self::x_perm`]. Ids outside `[0, E)` are
    /// left out and the first one is recorded for [`Self::check`]. No host synchronization.
    ///
    /// # Errors
    /// A zero top-k, more pairs than the buffers hold, a shape whose element counts overflow, short
    /// or misaligned inputs, or a failed launch.
    pub fn permute<I: DevicePtr<i32>, H: DevicePtr<bf16>>(
        &mut self,
        stream: &CudaStream,
        topk_ids: &I,
        tokens: usize,
        top_k: usize,
        hidden: &H,
    ) -> Result<()> {
        let pairs = tokens.checked_mul(top_k).filter(|&p| top_k > 0 && p <= self.max_pairs).ok_or_else(|| {
            Error::InvalidShape(format!(
                "{tokens} tokens x top_k {top_k}: need top_k > 0 and at most the {} pairs these buffers hold",
                self.max_pairs
            ))
        })?;
        let hidden_len = checked_len(&[tokens, self.hidden])?;
        let l = Launch::new(stream)?;
        let (ids, h) = (l.input(topk_ids), l.input(hidden));
        check_len("topk_ids", ids.len, pairs)?;
        check_len("hidden", h.len, hidden_len)?;
        if tokens > 0 {
            check_align("hidden", h.addr, 16)?;
        }
        let (o, r) = (l.output(&mut self.expert_offsets), l.output(&mut self.row_of_pair));
        let (p, x) = (l.output(&mut self.pair_of_row), l.output(&mut self.x_perm));
        let (e, w) = (l.output(&mut self.error), l.output(&mut self.workspace));
        let args = PermuteArgs {
            topk_ids: ids.addr,
            tokens: tokens as i64,
            top_k: top_k as i64,
            experts: self.experts as i64,
            hidden: h.addr,
            hidden_size: self.hidden as i64,
            expert_offsets: o.addr,
            row_of_pair: r.addr,
            pair_of_row: p.addr,
            x_perm: x.addr,
            error: e.addr,
            workspace: w.addr,
            // (The layer's expert shards map ids in the core; this permutation is a whole layer's.)
            expert_map: 0,
            global_experts: 0,
        };
        // SAFETY: every buffer holds max_pairs >= pairs entries (checked); inputs checked above.
        unsafe { l.launch(&args, raw::permute_and_gather_can_implement, raw::permute_and_gather) }
    }

    /// Synchronizes `stream` and reports the first bad expert id a [`Self::permute`] met since the
    /// last check (then clears it): `Error::Invalid` naming the token, slot and id.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a bad id, or a CUDA error.
    pub fn check(&mut self, stream: &Arc<CudaStream>, top_k: usize) -> Result<()> {
        let word = stream.clone_dtoh(&self.error)?[0];
        if word == u64::MAX {
            return Ok(());
        }
        stream.memcpy_htod(&[u64::MAX], &mut self.error)?;
        bad_id_error(word, top_k, self.experts)
    }
}

/// The error a permutation's error word (`(pair << 32) | id` of the smallest bad pair, `u64::MAX`
/// for none) reports for a forward of `top_k` experts per token over `experts` experts.
pub(crate) fn bad_id_error(word: u64, top_k: usize, experts: usize) -> Result<()> {
    if word == u64::MAX {
        return Ok(());
    }
    let (pair, id) = ((word >> 32) as usize, word as u32 as i32);
    // The recorded pair is flattened t * k + j: it cannot be placed without k.
    let (Some(t), Some(j)) = (pair.checked_div(top_k), pair.checked_rem(top_k)) else {
        return Err(Error::InvalidShape(format!(
            "top_k must be >= 1 to name the bad expert id {id} recorded at pair {pair}"
        )));
    };
    Err(Error::Invalid(format!(
        "topk_ids[{t}, {j}] = {id} is not an expert id in [0, {experts}): that slot was routed nowhere"
    )))
}

/// A count the kernels index with 32-bit integers: more is a shape error here, before anything is
/// enqueued (the core refuses it too, at the launch).
fn check_i32_count(what: &str, count: usize) -> Result<()> {
    if count > i32::MAX as usize {
        return Err(Error::InvalidShape(format!("{count} {what} exceed 2^31 - 1")));
    }
    Ok(())
}

/// The shape of a combine: `tokens` tokens of `top_k` expert rows of `hidden` features.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CombineShape {
    /// Tokens T.
    pub tokens: usize,
    /// Expert rows per token k.
    pub top_k: usize,
    /// Features per row H.
    pub hidden: usize,
}

/// `out[t] = sum_j topk_weights[t, j] * y[row_of_pair[t, j]]` (j in order, FP32, bad slots
/// skipped) rounded to bf16 `[tokens, hidden]`: bit-identical across runs.
///
/// # Errors
/// A zero top-k, a hidden size that is not a positive multiple of 8, a shape whose element counts
/// overflow, a buffer too small or misaligned, or a failed launch.
pub fn combine_into<Y, R, W, O>(
    stream: &CudaStream,
    y: &Y,
    row_of_pair: &R,
    topk_weights: &W,
    shape: CombineShape,
    out: &mut O,
) -> Result<()>
where
    Y: DevicePtr<bf16>,
    R: DevicePtr<i32>,
    W: DevicePtr<f32>,
    O: DevicePtrMut<bf16>,
{
    let CombineShape { tokens, top_k, hidden } = shape;
    if top_k == 0 || hidden == 0 || !hidden.is_multiple_of(8) {
        return Err(Error::InvalidShape(format!("need top_k > 0 and hidden ({hidden}) a positive multiple of 8")));
    }
    let (y_len, pairs) = (checked_len(&[tokens, top_k, hidden])?, checked_len(&[tokens, top_k])?);
    let out_len = checked_len(&[tokens, hidden])?;
    check_i32_count("(token, slot) pairs", pairs)?;
    let l = Launch::new(stream)?;
    let (y, r, w, o) = (l.input(y), l.input(row_of_pair), l.input(topk_weights), l.output(out));
    check_len("y", y.len, y_len)?;
    check_len("row_of_pair", r.len, pairs)?;
    check_len("topk_weights", w.len, pairs)?;
    check_len("out", o.len, out_len)?;
    if tokens == 0 {
        return Ok(());
    }
    check_align("y", y.addr, 16)?;
    check_align("out", o.addr, 16)?;
    let (t, k, h) = (tokens as i64, top_k as i64, hidden as i64);
    // SAFETY: lengths and alignment checked; the kernel skips rows outside [0, tokens * top_k).
    unsafe { l.run(|st| raw::combine(y.addr, r.addr, w.addr, t, k, h, o.addr, st)) }
}
