//! The MoE feed-forward layer: routing -> permutation -> first GEMM with SwiGLU in the epilogue
//! (compact BF16) -> second GEMM -> combine, all on one stream with no host synchronization and
//! no allocation inside a forward (every buffer lives in a [`MoeWorkspace`] sized once).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;

use super::MoeWeights;
use crate::error::{Error, Result};
use crate::gemm::{Epilogue, GemmTile, GroupedGemm, Nvfp4Weights, PlainBf16, SwigluBf16, SwigluNvfp4, SwigluNvfp4Out};
use crate::host::weight_decode_scale;
use crate::launch::{check_align, check_len, BufferInfo, Launch};
use crate::layout::grouped_scale_len;
use crate::quantize::{dequantize_nvfp4_grouped_into, GroupedDesc};
use crate::routing::{combine_into, softmax_topk_into, CombineShape, PermuteBuffers, TopK};

/// What the first GEMM hands the second.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Intermediate {
    /// Compact BF16 from the `SwigluBf16` epilogue (the default).
    Bf16,
    /// NVFP4 packed in the first GEMM's epilogue (`SwigluNvfp4`) with this activation decode scale
    /// (e.g. a checkpoint's `down_proj.input_scale`), then dequantized by
    /// `dequantize_nvfp4_grouped` for the second GEMM (Hopper has no FP4 MMA). This is the path
    /// FP4 consumers (Blackwell GEMMs, expert-parallel transfers) take; it adds NVFP4's
    /// quantization error to the layer.
    Nvfp4 {
        /// The activation decode scale g of the intermediate (finite, > 0).
        decode_scale: f32,
    },
}

/// Options of a [`MoeLayer`].
#[derive(Clone, Copy, Debug)]
pub struct MoeOptions {
    /// The largest token count a forward may take (the workspace is sized for it).
    pub max_tokens: usize,
    /// The largest top-k a forward may take.
    pub max_top_k: usize,
    /// Tile configuration of both GEMMs (`Auto`: chosen per forward from tokens x top-k).
    pub tile: GemmTile,
    /// The format between the two GEMMs.
    pub intermediate: Intermediate,
    /// Batch invariance: no GEMM splits K, so a token's output bits do not depend on how many
    /// tokens share its forward ([`GroupedGemm::batch_invariant`]). Default `false`.
    pub batch_invariant: bool,
}

impl MoeOptions {
    /// `max_tokens` and `max_top_k` with the defaults: `GemmTile::Auto`, `Intermediate::Bf16`.
    pub fn new(max_tokens: usize, max_top_k: usize) -> Self {
        MoeOptions {
            max_tokens,
            max_top_k,
            tile: GemmTile::Auto,
            intermediate: Intermediate::Bf16,
            batch_invariant: false,
        }
    }
}

/// The input of one [`MoeLayer::forward`], on the device: `hidden` bf16 `[tokens, H]` and the
/// routing, `topk_ids` i32 `[tokens, top_k]` (expert ids) and `topk_weights` f32
/// `[tokens, top_k]`.
#[derive(Debug)]
pub struct MoeInput<'a, H, I, W> {
    /// bf16 `[tokens, H]`.
    pub hidden: &'a H,
    /// Tokens T in this forward (at most the layer's `max_tokens`).
    pub tokens: usize,
    /// i32 `[T, top_k]`: the experts of each token.
    pub topk_ids: &'a I,
    /// f32 `[T, top_k]`: the weight of each chosen expert.
    pub topk_weights: &'a W,
    /// Experts per token k (at most the layer's `max_top_k`).
    pub top_k: usize,
}

impl<H, I, W> Clone for MoeInput<'_, H, I, W> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<H, I, W> Copy for MoeInput<'_, H, I, W> {}

/// The input of one [`MoeLayer::forward_with_router`], on the device: `hidden` bf16
/// `[tokens, H]` and `router_logits` f32 `[tokens, E]`, routed by softmax top-k.
#[derive(Debug)]
pub struct RouterInput<'a, H, L> {
    /// bf16 `[tokens, H]`.
    pub hidden: &'a H,
    /// Tokens T in this forward (at most the layer's `max_tokens`).
    pub tokens: usize,
    /// f32 `[T, E]`.
    pub router_logits: &'a L,
    /// Experts per token k (at most the layer's `max_top_k`).
    pub top_k: usize,
    /// Whether the k routing weights of a token are divided by their sum.
    pub renormalize: bool,
}

impl<H, L> Clone for RouterInput<'_, H, L> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<H, L> Copy for RouterInput<'_, H, L> {}

/// The routing a forward takes, as the buffer checks see it: lengths in elements.
#[derive(Clone, Copy, Debug)]
enum Routing {
    /// [`MoeLayer::forward`]: `topk_ids` and `topk_weights`.
    Ids { ids: usize, weights: usize },
    /// [`MoeLayer::forward_with_router`]: `router_logits` over `experts`.
    Logits { logits: usize, experts: usize },
}

/// Validates the caller's buffers of a forward of `tokens` x `top_k` with hidden size
/// `hidden_size` (pure; no GPU), every rule a launch of the forward checks, so that a forward
/// rejects them before it enqueues anything: lengths in the order hidden, routing, out; then
/// `hidden` and `out` 16-byte aligned (with tokens). `top_k` is checked against the layer first.
///
/// # Errors
/// [`Error::BufferTooSmall`] naming the buffer, or [`Error::Misaligned`].
fn check_forward_buffers(
    hidden_size: usize,
    tokens: usize,
    top_k: usize,
    hidden: BufferInfo,
    out: BufferInfo,
    routing: Routing,
) -> Result<()> {
    let (rows, pairs) = (tokens * hidden_size, tokens * top_k);
    check_len("hidden", hidden.len, rows)?;
    match routing {
        Routing::Ids { ids, weights } => {
            check_len("topk_ids", ids, pairs)?;
            check_len("topk_weights", weights, pairs)?;
        }
        Routing::Logits { logits, experts } => check_len("router_logits", logits, tokens * experts)?,
    }
    check_len("out", out.len, rows)?;
    if tokens > 0 {
        check_align("hidden", hidden.addr, 16)?;
        check_align("out", out.addr, 16)?;
    }
    Ok(())
}

/// The workspace buffers a forward writes (all but the router's).
struct Scratch<'a> {
    perm: &'a mut PermuteBuffers,
    act: &'a mut CudaSlice<bf16>,
    y: &'a mut CudaSlice<bf16>,
    fp4: Option<&'a mut Fp4Buffers>,
}

/// The NVFP4 intermediate's buffers ([`Intermediate::Nvfp4`]).
#[derive(Debug)]
struct Fp4Buffers {
    codes: CudaSlice<u8>,
    scales: CudaSlice<u8>,
    decode_scale: CudaSlice<f32>,
    /// The host value of `decode_scale`, to match the workspace to its layer.
    decode_scale_host: f32,
}

/// Every buffer a forward needs, allocated once by [`MoeLayer::workspace`] for that layer's shape
/// and intermediate format (a forward given another layer's workspace is refused).
///
/// `Send + Sync`. Every forward writes it (it is taken `&mut`), so one workspace serves one
/// forward at a time: concurrent forwards need one workspace each. It may move between threads and
/// streams; cudarc's stream-ordering events (on by default) order its next use after its last
/// one (with event tracking disabled, e.g. for graph capture, the caller orders the streams).
#[derive(Debug)]
pub struct MoeWorkspace {
    perm: PermuteBuffers,
    act: CudaSlice<bf16>,
    y: CudaSlice<bf16>,
    ids: CudaSlice<i32>,
    weights: CudaSlice<f32>,
    fp4: Option<Fp4Buffers>,
    max_pairs: usize,
    /// (E, H, I) of the layer that allocated it: a forward checks them against its own.
    shape: (usize, usize, usize),
}

/// One MoE feed-forward layer over prepared NVFP4 weights.
///
/// # Threads and streams
/// `MoeLayer` (like its [`MoeWeights`]) is `Send + Sync`, and nothing in it is written after
/// construction: one layer may serve forwards on several threads and streams at once, each forward
/// with its own [`MoeWorkspace`]; concurrent forwards give the bytes serial ones do. A forward's
/// result does not depend on the stream it runs on.
///
/// # Drop
/// With cudarc's event tracking (on by default), dropping a layer, its workspace or a forward's
/// buffers (or the caller's stream and context handles) while forwards still run on the GPU is
/// safe, without synchronizing the host: each buffer keeps its stream alive and its memory is freed
/// stream-ordered after the work that uses it. This holds for a layer whose forwards run on
/// several streams at once: its weights ([`Nvfp4Weights`], the only
/// device memory a layer holds) record an event on each stream other than the one they were made
/// on, and their free waits for every such stream, not only for the last one cudarc recorded. A
/// workspace or a caller's buffer is freed after its last use (each use of a workspace is ordered
/// after the one before, as it is written); a caller's input buffer read by forwards on two
/// streams at once is the caller's to keep alive until both finish (cudarc keeps one read event per
/// buffer). With event tracking disabled (e.g. for CUDA-graph capture) the caller keeps every
/// handle alive until the work that uses it has finished.
///
/// # Non-finite input
/// A NaN or Inf in one token's hidden state, in one token's routing weight ([`MoeLayer::forward`])
/// or in one token's router logits ([`MoeLayer::forward_with_router`]) changes only that token's
/// output row: every other row is bit-identical to the same forward without it. Nothing is shared
/// across tokens (no amax over the batch: the NVFP4 intermediate's decode scale is fixed by the
/// options; tiles and split-K are chosen from the token count, not the values), and a row's
/// result does not depend on where the permutation puts it. The faulted row itself is not
/// specified beyond this: a NaN or Inf in the hidden state or a routing weight makes it non-finite
/// in practice; NaN logits rank last in the top-k choice (a token whose logits are all NaN gets
/// NaN weights), a +Inf logit gives NaN weights. Nothing is sticky: the next forward is as if the
/// faulted one had not run. (Tested by the GPU suite's `faults::nan_in_one_token_changes_only_its_row`.)
#[derive(Debug)]
pub struct MoeLayer {
    weights: MoeWeights,
    opts: MoeOptions,
}

impl MoeLayer {
    /// A layer over `weights` for forwards of up to `opts.max_tokens` tokens and `opts.max_top_k`
    /// experts per token.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for a `max_top_k` outside `1..=min(E, 32)` or too many rows, and
    /// [`Error::InvalidDecodeScale`] for a bad NVFP4 intermediate decode scale.
    pub fn new(weights: MoeWeights, opts: MoeOptions) -> Result<Self> {
        if opts.max_top_k == 0 || opts.max_top_k > weights.experts.min(32) {
            return Err(Error::InvalidShape(format!(
                "max_top_k ({}) must be in 1..=min(experts ({}), 32)",
                opts.max_top_k, weights.experts
            )));
        }
        if opts.max_tokens.checked_mul(opts.max_top_k).is_none_or(|p| p > i32::MAX as usize) {
            return Err(Error::InvalidShape(format!("max_tokens x max_top_k is too large ({})", opts.max_tokens)));
        }
        if let Intermediate::Nvfp4 { decode_scale } = opts.intermediate {
            crate::host::validate_decode_scale(decode_scale)?;
            if opts.tile == GemmTile::WarpM16N8 {
                return Err(Error::InvalidShape(
                    "tile WarpM16N8 has no SwigluNvfp4 epilogue: the NVFP4 intermediate needs another tile".into(),
                ));
            }
        }
        Ok(MoeLayer { weights, opts })
    }

    /// The layer's prepared weights.
    pub fn weights(&self) -> &MoeWeights {
        &self.weights
    }

    /// The same layer with another intermediate format (allocate a new workspace for it).
    ///
    /// # Errors
    /// As [`MoeLayer::new`].
    pub fn with_intermediate(self, intermediate: Intermediate) -> Result<Self> {
        MoeLayer::new(self.weights, MoeOptions { intermediate, ..self.opts })
    }

    /// The plan of one of the layer's GEMMs over `w` with epilogue `E` (the options' tile and batch
    /// invariance): what every forward launches and what [`MoeLayer::gemm_tiles`] reports.
    fn plan<'a, E: Epilogue>(&self, w: &'a Nvfp4Weights) -> Result<GroupedGemm<'a, E>> {
        Ok(GroupedGemm::<E>::new(w, self.opts.tile)?.batch_invariant(self.opts.batch_invariant))
    }

    /// The tiles of the first and second GEMM of a forward over `tokens` x `top_k` rows (the
    /// option's tile, or the core's choice per launch for [`GemmTile::Auto`]).
    ///
    /// # Errors
    /// None in practice (the plans were checked at construction); the plan constructors' errors.
    pub fn gemm_tiles(&self, tokens: usize, top_k: usize) -> Result<(GemmTile, GemmTile)> {
        let (rows, w) = (tokens * top_k, &self.weights);
        let l1 = match self.opts.intermediate {
            Intermediate::Bf16 => self.plan::<SwigluBf16>(&w.w13)?.tile_for(rows),
            Intermediate::Nvfp4 { .. } => self.plan::<SwigluNvfp4>(&w.w13)?.tile_for(rows),
        };
        let l2 = self.plan::<PlainBf16>(&w.w2)?.tile_for(rows);
        Ok((l1, l2))
    }

    /// Calibrates [`Intermediate::Nvfp4`]'s activation decode scale on these tokens: runs the
    /// permutation and the first GEMM with the BF16 intermediate into the workspace and returns
    /// `amax / (6 * 448)` over its finite values (ModelOpt's `input_scale` recipe). Synchronizes
    /// `stream` and reads the intermediate back; meant for set-up and benches, not per forward.
    ///
    /// # Errors
    /// As [`MoeLayer::forward`], or an intermediate with no finite non-zero value.
    pub fn calibrate_nvfp4_scale<H, I>(
        &self,
        stream: &Arc<CudaStream>,
        hidden: &H,
        tokens: usize,
        topk_ids: &I,
        top_k: usize,
        ws: &mut MoeWorkspace,
    ) -> Result<f32>
    where
        H: DevicePtr<bf16>,
        I: DevicePtr<i32>,
    {
        self.check_tokens(tokens, top_k, ws)?;
        let pairs = tokens * top_k;
        let MoeWorkspace { perm, act, .. } = ws;
        perm.permute(stream, topk_ids, tokens, top_k, hidden)?;
        let l1 = self.plan::<SwigluBf16>(&self.weights.w13)?;
        l1.launch(stream, &perm.x_perm, pairs, &perm.expert_offsets, act)?;
        let host = stream.clone_dtoh(&act.slice(..pairs * self.weights.intermediate))?;
        weight_decode_scale(&host).map_err(|e| Error::Invalid(format!("calibrating the NVFP4 intermediate: {e}")))
    }

    /// Allocates the workspace for `max_tokens` x `max_top_k` rows.
    ///
    /// # Errors
    /// A CUDA error (out of memory).
    pub fn workspace(&self, stream: &Arc<CudaStream>) -> Result<MoeWorkspace> {
        let pairs = self.opts.max_tokens * self.opts.max_top_k;
        let (h, i) = (self.weights.hidden, self.weights.intermediate);
        let fp4 = match self.opts.intermediate {
            Intermediate::Bf16 => None,
            Intermediate::Nvfp4 { decode_scale } => Some(Fp4Buffers {
                codes: stream.alloc_zeros::<u8>((pairs * i / 2).max(1))?,
                scales: stream.alloc_zeros::<u8>(grouped_scale_len(pairs, self.weights.experts, i).max(1))?,
                decode_scale: stream.clone_htod(&[decode_scale])?,
                decode_scale_host: decode_scale,
            }),
        };
        Ok(MoeWorkspace {
            fp4,
            perm: PermuteBuffers::new(stream, pairs, self.weights.experts, h)?,
            act: stream.alloc_zeros::<bf16>((pairs * i).max(1))?,
            y: stream.alloc_zeros::<bf16>((pairs * h).max(1))?,
            ids: stream.alloc_zeros::<i32>(pairs.max(1))?,
            weights: stream.alloc_zeros::<f32>(pairs.max(1))?,
            max_pairs: pairs,
            shape: (self.weights.experts, h, i),
        })
    }

    fn check_tokens(&self, tokens: usize, top_k: usize, ws: &MoeWorkspace) -> Result<()> {
        if tokens > self.opts.max_tokens {
            return Err(Error::InvalidShape(format!("{tokens} tokens exceed max_tokens {}", self.opts.max_tokens)));
        }
        if top_k == 0 || top_k > self.opts.max_top_k {
            return Err(Error::InvalidShape(format!("top_k {top_k} must be in 1..={}", self.opts.max_top_k)));
        }
        if tokens * top_k > ws.max_pairs {
            return Err(Error::InvalidShape("the workspace is smaller than this forward needs".into()));
        }
        let w = &self.weights;
        if ws.shape != (w.experts, w.hidden, w.intermediate) {
            // Its buffers are sized and strided for another (E, H, I): the permutation would
            // write rows of one width that the GEMM reads at another.
            return Err(Error::Invalid(format!(
                "the workspace was made for a layer of (experts, hidden, intermediate) = {:?}, this layer is {:?}: \
                 allocate it with this layer's MoeLayer::workspace",
                ws.shape,
                (w.experts, w.hidden, w.intermediate)
            )));
        }
        // The forward takes its path from the workspace's buffers: they must be this layer's.
        let matches = match (self.opts.intermediate, &ws.fp4) {
            (Intermediate::Bf16, None) => true,
            (Intermediate::Nvfp4 { decode_scale }, Some(b)) => decode_scale.to_bits() == b.decode_scale_host.to_bits(),
            _ => false,
        };
        if !matches {
            return Err(Error::Invalid(
                "the workspace was made for another intermediate format or decode scale: allocate it with this \
                 layer's MoeLayer::workspace"
                    .into(),
            ));
        }
        Ok(())
    }

    /// `out [T, H] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t])` over the
    /// tokens and routing of `input` (device buffers, see [`MoeInput`]) into `out` bf16 `[T, H]`.
    /// Expert ids outside `[0, E)` are never used as an index: those slots contribute nothing and
    /// the next [`MoeLayer::check`] reports the first one. No host synchronization.
    ///
    /// Argument errors are returned before any kernel, copy or memset is enqueued (with cudarc's
    /// event tracking on, taking the buffers' addresses for the checks enqueues its event waits
    /// and records, nothing else): `out` is untouched and the next forward is unaffected. A bad expert id is not an argument error (the ids are on the
    /// device): its slot contributes nothing (a token whose slots are all bad gets a zero row) and
    /// the forward's other tokens are computed as usual. See the type's docs for non-finite
    /// input.
    ///
    /// # Errors
    /// More tokens or a larger top-k than the layer was made for, a workspace of another layer
    /// (another shape or intermediate format), a buffer too small, `hidden` or `out` not 16-byte
    /// aligned, or a failed launch. All but the last are found before anything is enqueued.
    pub fn forward<H, I, W, O>(
        &self,
        stream: &CudaStream,
        input: &MoeInput<'_, H, I, W>,
        out: &mut O,
        ws: &mut MoeWorkspace,
    ) -> Result<()>
    where
        H: DevicePtr<bf16>,
        I: DevicePtr<i32>,
        W: DevicePtr<f32>,
        O: DevicePtrMut<bf16>,
    {
        self.check_tokens(input.tokens, input.top_k, ws)?;
        let routing = Routing::Ids { ids: input.topk_ids.len(), weights: input.topk_weights.len() };
        self.check_buffers(stream, input.hidden, out, input.tokens, input.top_k, routing)?;
        let MoeWorkspace { perm, act, y, fp4, .. } = ws;
        self.run(stream, input, out, Scratch { perm, act, y, fp4: fp4.as_mut() })
    }

    /// Checks the caller's buffers of a forward ([`check_forward_buffers`]) before any kernel or
    /// copy is enqueued (taking their addresses enqueues only cudarc's event bookkeeping, with
    /// event tracking on).
    fn check_buffers<H, O>(
        &self,
        stream: &CudaStream,
        hidden: &H,
        out: &mut O,
        tokens: usize,
        top_k: usize,
        routing: Routing,
    ) -> Result<()>
    where
        H: DevicePtr<bf16>,
        O: DevicePtrMut<bf16>,
    {
        let l = Launch::new(stream)?;
        let (hidden, out) = (l.input(hidden).info(), l.output(out).info());
        check_forward_buffers(self.weights.hidden, tokens, top_k, hidden, out, routing)
    }

    /// The forward's launches over the workspace's parts (split so that the router path can
    /// read its own workspace buffers while the rest are written).
    fn run<H, I, W, O>(
        &self,
        stream: &CudaStream,
        input: &MoeInput<'_, H, I, W>,
        out: &mut O,
        scratch: Scratch<'_>,
    ) -> Result<()>
    where
        H: DevicePtr<bf16>,
        I: DevicePtr<i32>,
        W: DevicePtr<f32>,
        O: DevicePtrMut<bf16>,
    {
        let MoeInput { hidden, tokens, topk_ids, topk_weights, top_k } = *input;
        let Scratch { perm, act, y, fp4 } = scratch;
        let (h, pairs) = (self.weights.hidden, tokens * top_k);
        // Checked by both callers (check_buffers) before anything was enqueued.
        debug_assert!(hidden.len() >= tokens * h && out.len() >= tokens * h);
        debug_assert!(topk_ids.len() >= pairs && topk_weights.len() >= pairs);
        let l1 = self.plan::<SwigluBf16>(&self.weights.w13)?;
        let l2 = self.plan::<PlainBf16>(&self.weights.w2)?;
        perm.permute(stream, topk_ids, tokens, top_k, hidden)?;
        match fp4 {
            None => l1.launch(stream, &perm.x_perm, pairs, &perm.expert_offsets, act)?,
            Some(b) => {
                let l1 = self.plan::<SwigluNvfp4>(&self.weights.w13)?;
                let nvfp4 =
                    SwigluNvfp4Out { act_decode_scales: &b.decode_scale, codes: &mut b.codes, scales: &mut b.scales };
                l1.launch_nvfp4(stream, &perm.x_perm, pairs, &perm.expert_offsets, nvfp4)?;
                let desc = GroupedDesc {
                    rows: pairs,
                    cols: self.weights.intermediate,
                    expert_offsets: &perm.expert_offsets,
                    decode_scales: &b.decode_scale,
                };
                dequantize_nvfp4_grouped_into(stream, &b.codes, &b.scales, &desc, act)?;
            }
        }
        l2.launch(stream, &*act, pairs, &perm.expert_offsets, y)?;
        let shape = CombineShape { tokens, top_k, hidden: h };
        combine_into(stream, &*y, &perm.row_of_pair, topk_weights, shape, out)
    }

    /// Routes with softmax top-k over the router logits of `input` (renormalized if asked), then
    /// [`MoeLayer::forward`].
    ///
    /// Every argument (the router logits' length included) is checked before the router's launch:
    /// an argument error enqueues no kernel or copy, as for [`MoeLayer::forward`].
    ///
    /// # Errors
    /// As [`MoeLayer::forward`], or bad routing arguments ([`softmax_topk_into`]).
    pub fn forward_with_router<H, L, O>(
        &self,
        stream: &CudaStream,
        input: &RouterInput<'_, H, L>,
        out: &mut O,
        ws: &mut MoeWorkspace,
    ) -> Result<()>
    where
        H: DevicePtr<bf16>,
        L: DevicePtr<f32>,
        O: DevicePtrMut<bf16>,
    {
        let RouterInput { hidden, tokens, router_logits, top_k, renormalize } = *input;
        self.check_tokens(tokens, top_k, ws)?;
        // Every argument before the router's launch (its own checks come first too: top_k and
        // experts are the layer's, its ids and weights the workspace's, sized by check_tokens).
        let routing = Routing::Logits { logits: router_logits.len(), experts: self.weights.experts };
        self.check_buffers(stream, hidden, out, tokens, top_k, routing)?;
        let MoeWorkspace { perm, act, y, ids, weights, fp4, .. } = ws;
        let spec = TopK { tokens, experts: self.weights.experts, top_k, renormalize };
        softmax_topk_into(stream, router_logits, spec, ids, weights)?;
        let input = MoeInput { hidden, tokens, topk_ids: &*ids, topk_weights: &*weights, top_k };
        self.run(stream, &input, out, Scratch { perm, act, y, fp4: fp4.as_mut() })
    }

    /// Synchronizes `stream` and reports the first bad expert id seen since the last check.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the token, slot and id of the first bad expert id, or a CUDA error
    /// (including one from earlier asynchronous work on `stream`).
    pub fn check(&self, stream: &Arc<CudaStream>, ws: &mut MoeWorkspace, top_k: usize) -> Result<()> {
        ws.perm.check(stream, top_k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every buffer rule of a forward is checked by the one function both forwards call before
    /// they enqueue anything: each short buffer is named with its sizes, a misaligned `hidden` or
    /// `out` is refused (the combine used to find a misaligned `out` after the permutation and
    /// both GEMMs were enqueued), and buffers of an empty forward need no alignment.
    #[test]
    fn forward_buffers_are_checked_in_one_place() {
        let (h, t, k, e) = (64usize, 3usize, 2usize, 8usize);
        let buf = |addr: u64, len: usize| BufferInfo { addr, len };
        let (hidden, out) = (buf(0x1000, t * h), buf(0x9000, t * h));
        let ids = Routing::Ids { ids: t * k, weights: t * k };
        let logits = Routing::Logits { logits: t * e, experts: e };
        for routing in [ids, logits] {
            assert!(check_forward_buffers(h, t, k, hidden, out, routing).is_ok());
        }
        let too_small = |r: Result<()>| match r {
            Err(Error::BufferTooSmall { name, needed, actual }) => Some((name, needed, actual)),
            _ => None,
        };
        let short_hidden = buf(0x1000, t * h - 1);
        assert_eq!(
            too_small(check_forward_buffers(h, t, k, short_hidden, out, logits)),
            Some(("hidden", t * h, t * h - 1))
        );
        let short_out = buf(0x9000, t * h - 1);
        assert_eq!(
            too_small(check_forward_buffers(h, t, k, hidden, short_out, logits)),
            Some(("out", t * h, t * h - 1))
        );
        assert_eq!(too_small(check_forward_buffers(h, t, k, hidden, short_out, ids)), Some(("out", t * h, t * h - 1)));
        let short_logits = Routing::Logits { logits: t * e - 1, experts: e };
        assert_eq!(
            too_small(check_forward_buffers(h, t, k, hidden, out, short_logits)),
            Some(("router_logits", t * e, t * e - 1))
        );
        for (routing, name) in [
            (Routing::Ids { ids: t * k - 1, weights: t * k }, "topk_ids"),
            (Routing::Ids { ids: t * k, weights: t * k - 1 }, "topk_weights"),
        ] {
            assert_eq!(too_small(check_forward_buffers(h, t, k, hidden, out, routing)), Some((name, t * k, t * k - 1)));
        }
        for (hb, ob, name) in [(buf(0x1002, t * h), out, "hidden"), (hidden, buf(0x9008, t * h), "out")] {
            for routing in [ids, logits] {
                match check_forward_buffers(h, t, k, hb, ob, routing) {
                    Err(Error::Misaligned { name: n, align: 16, .. }) => assert_eq!(n, name),
                    other => panic!("misaligned {name}: {other:?}"),
                }
            }
        }
        let empty = Routing::Logits { logits: 0, experts: e };
        assert!(check_forward_buffers(h, 0, k, buf(0x1002, 0), buf(0x9008, 0), empty).is_ok());
    }
}
