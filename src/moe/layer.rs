//! The MoE feed-forward layer: routing -> permutation -> first GEMM with SwiGLU in the epilogue
//! (compact BF16) -> second GEMM -> combine, all on one stream with no host synchronization and
//! no allocation inside a forward (every buffer lives in a [`MoeWorkspace`] sized once). The
//! layer itself is the C++ core's (`moe_layer_*` in `cpp/include/nvfp4moe/nvfp4moe.h`, one
//! implementation for Rust, C++ and C): this module validates, keeps the buffers alive and
//! stream-ordered (cudarc), and maps the core's statuses to typed errors.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;

use super::MoeWeights;
pub use crate::abi::OutputFormat;
use crate::abi::{IntermediateFormat, MoeDispatchedArgs, MoeForwardArgs, MoeLayerDesc};
use crate::error::{Error, Result};
use crate::ffi::raw;
use crate::gemm::{Epilogue, GemmTile, GroupedGemm, Nvfp4Weights, PlainBf16, SwigluBf16, SwigluNvfp4};
use crate::host::weight_decode_scale;
use crate::launch::{check_align, check_len, status, BufferInfo, Launch};
use crate::routing::bad_id_error;

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
    /// The element type of a forward's `out`: `bf16` (the default) or `f32` (the combine's FP32
    /// sum unrounded: the outputs of a layer's expert shards, [`MoeLayer::new_shard`], add up to
    /// the whole layer's up to the order of that addition).
    pub output: OutputFormat,
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
            output: OutputFormat::Bf16,
        }
    }
}

/// An element type a layer writes: `bf16` ([`OutputFormat::Bf16`]) or `f32`
/// ([`OutputFormat::Fp32`]), as its options say.
pub trait OutputElement: sealed::Sealed {
    /// The layer output format that writes this type.
    const FORMAT: OutputFormat;
}

impl OutputElement for bf16 {
    const FORMAT: OutputFormat = OutputFormat::Bf16;
}

impl OutputElement for f32 {
    const FORMAT: OutputFormat = OutputFormat::Fp32;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for half::bf16 {}
    impl Sealed for f32 {}
}

/// Which experts of a larger layer a shard holds (expert parallelism, [`MoeLayer::new_shard`]).
#[derive(Debug)]
struct Shard {
    /// Experts of the whole layer (the routing ids' range).
    global_experts: usize,
    /// The global id of each local expert.
    expert_ids: Vec<usize>,
    /// i32 `[global_experts]`: each global id's local expert, or -1 (the core's `expert_map`).
    map: CudaSlice<i32>,
    /// `map`'s device address (fixed for its life), for descriptors that are only checked.
    map_addr: u64,
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
/// `[tokens, H]` and `router_logits` f32 `[tokens, E]` (E the layer's global experts), routed by
/// softmax top-k.
#[derive(Debug)]
pub struct RouterInput<'a, H, L> {
    /// bf16 `[tokens, H]`.
    pub hidden: &'a H,
    /// Tokens T in this forward (at most the layer's `max_tokens`).
    pub tokens: usize,
    /// f32 `[T, E]` (the global experts, for an expert shard).
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

/// The input of one [`MoeLayer::forward_dispatched`], on the device: tokens already grouped by
/// the layer's experts in the expert-major layout token dispatchers produce (DeepEP's low-latency
/// mode, pplx-kernels).
#[derive(Debug)]
pub struct DispatchedInput<'a, H, C> {
    /// bf16 `[E, max_tokens_per_expert, H]`: expert `e`'s rows first, then padding.
    pub hidden: &'a H,
    /// i32 `[E]`: the rows of each expert (each clamped to `[0, max_tokens_per_expert]`).
    pub counts: &'a C,
    /// M, the rows per expert of the layout (E x M at most the layer's `max_tokens x max_top_k`).
    pub max_tokens_per_expert: usize,
    /// About how many rows the counts add up to (the step's tokens x top-k), for the GEMMs' tile
    /// and K-split choice only (the counts are on the device): with the step's exact rows both are
    /// the permuted forward's, so are the bits, except where that one takes the warp kernel (at
    /// most 8 rows; this layout takes the 128x8 tile instead, another K order); 0: E x M, which
    /// over-sizes the tiles and leaves no split at decode when M is a dispatcher's padded
    /// capacity. For an expert shard, the whole layer's rows (its choice assumes the whole layer's
    /// experts, as its other forwards do).
    pub expected_rows: usize,
}

impl<H, C> Clone for DispatchedInput<'_, H, C> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<H, C> Copy for DispatchedInput<'_, H, C> {}

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

/// The arguments every forward shares (device addresses): `hidden`, the counts, `out` and the
/// workspace; the routing fields are the caller's.
fn forward_args(hidden: u64, tokens: usize, top_k: usize, out: u64, ws: BufferInfo) -> MoeForwardArgs {
    MoeForwardArgs {
        hidden,
        tokens: tokens as i64,
        top_k: top_k as i64,
        out,
        workspace: ws.addr,
        workspace_bytes: ws.len as i64,
        ..Default::default()
    }
}

/// Every buffer a forward needs, in one device allocation whose layout is the core's
/// (`moe_layer_workspace_bytes`), allocated once by [`MoeLayer::workspace`] for that layer's shape
/// and intermediate format (a forward given another layer's workspace is refused).
///
/// `Send + Sync`. Every forward writes it (it is taken `&mut`), so one workspace serves one
/// forward at a time: concurrent forwards need one workspace each. It may move between threads and
/// streams; cudarc's stream-ordering events (on by default) order its next use after its last
/// one (with event tracking disabled, e.g. for graph capture, the caller orders the streams).
#[derive(Debug)]
pub struct MoeWorkspace {
    buf: CudaSlice<u8>,
    max_pairs: usize,
    /// (E, H, I) of the layer that allocated it: a forward checks them against its own.
    shape: (usize, usize, usize),
    /// The intermediate format (and the NVFP4 decode scale) it was set up for.
    intermediate: Intermediate,
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
/// several streams at once: its weights ([`Nvfp4Weights`], the device memory a layer holds beside
/// an expert shard's map) record an event on each stream other than the one they were made on, and
/// their free waits for every such stream, not only for the last one cudarc recorded; a shard's map
/// lives on the same stream and is freed after them (every forward that read it read them). A
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
    /// `Some` for an expert shard of a larger layer. (Declared after `weights`, so dropped after
    /// them: the map lives on the weights' home stream, whose free already waits for every
    /// stream that ran a forward, and every forward that read the map read the weights too.)
    shard: Option<Shard>,
}

impl MoeLayer {
    /// A layer over `weights` for forwards of up to `opts.max_tokens` tokens and `opts.max_top_k`
    /// experts per token.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for a `max_top_k` outside `1..=min(E, 32)` or too many rows, and
    /// [`Error::InvalidDecodeScale`] for a bad NVFP4 intermediate decode scale.
    pub fn new(weights: MoeWeights, opts: MoeOptions) -> Result<Self> {
        Self::build(weights, opts, None)
    }

    /// An expert shard (expert parallelism): the experts of `weights` are the experts
    /// `expert_ids` (local expert `i` is global expert `expert_ids[i]`, any distinct ids in any
    /// order, e.g. [`crate::io::LoadedExperts::expert_ids`]) of a layer of `global_experts`
    /// experts. Its forwards take the whole layer's routing (global ids, or router logits over
    /// `global_experts`); slots routed to other shards cost no work and add nothing, a token routed
    /// to none of these experts gets zeros. Each expert gets the whole layer's GEMM tile and K
    /// splits, so with [`OutputFormat::Fp32`] the shards' outputs add up to the whole layer's FP32
    /// output up to the order of that addition. The expert map (4 bytes per global expert) is
    /// uploaded on the weights' stream and freed with them (the type's "Drop" holds for it).
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for a list whose length is not the weights' expert count, an id not
    /// below `global_experts`, a repeated id, or more than the core's 1024 experts; then as
    /// [`MoeLayer::new`] (its top-k limit counts the global experts); a CUDA error.
    pub fn new_shard(
        weights: MoeWeights,
        opts: MoeOptions,
        global_experts: usize,
        expert_ids: &[usize],
    ) -> Result<Self> {
        let map = shard_map(global_experts, expert_ids, weights.experts)?;
        let home = weights.w13.home_stream().clone();
        let map = home.clone_htod(&map)?;
        let map_addr = map.device_ptr(&home).0;
        let shard = Shard { global_experts, expert_ids: expert_ids.to_vec(), map, map_addr };
        Self::build(weights, opts, Some(shard))
    }

    fn build(weights: MoeWeights, opts: MoeOptions, shard: Option<Shard>) -> Result<Self> {
        // The layer first: an early return then drops its fields in declaration order (the map
        // after the weights, whose drop orders it after every stream's forwards), not the
        // arguments in reverse.
        let layer = MoeLayer { weights, opts, shard };
        let (opts, shard) = (&layer.opts, &layer.shard);
        let global = layer.global_experts();
        if opts.max_top_k == 0 || opts.max_top_k > global.min(32) {
            return Err(Error::InvalidShape(format!(
                "max_top_k ({}) must be in 1..=min(experts ({global}{}), 32)",
                opts.max_top_k,
                if shard.is_some() { ", the whole layer's" } else { "" }
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
        // The core's own rules for the layer (both GEMMs' and the permutation's shapes).
        status(raw::moe_layer_can_implement(&layer.desc([0; 4])))?;
        Ok(layer)
    }

    /// The core's descriptor of the layer, with `ptrs` = the device addresses of W13's prepared
    /// chunks and decode scales, then W2's (zeros where nothing is launched: the core's checks and
    /// sizes do not read them).
    fn desc(&self, ptrs: [u64; 4]) -> MoeLayerDesc {
        let w = &self.weights;
        let (format, g) = match self.opts.intermediate {
            Intermediate::Bf16 => (IntermediateFormat::Bf16, 1.0),
            Intermediate::Nvfp4 { decode_scale } => (IntermediateFormat::Nvfp4, decode_scale),
        };
        MoeLayerDesc {
            w13_prepared: ptrs[0],
            w13_decode_scales: ptrs[1],
            w2_prepared: ptrs[2],
            w2_decode_scales: ptrs[3],
            experts: w.experts as i64,
            hidden: w.hidden as i64,
            intermediate: w.intermediate as i64,
            max_tokens: self.opts.max_tokens as i64,
            max_top_k: self.opts.max_top_k as i64,
            tile: self.opts.tile,
            intermediate_format: format,
            intermediate_decode_scale: g,
            batch_invariant: i32::from(self.opts.batch_invariant),
            expert_map: self.shard.as_ref().map_or(0, |s| s.map_addr),
            global_experts: self.shard.as_ref().map_or(0, |s| s.global_experts as i64),
            output_format: self.opts.output,
        }
    }

    /// The experts the routing counts: the whole layer's for an expert shard.
    pub fn global_experts(&self) -> usize {
        self.shard.as_ref().map_or(self.weights.experts, |s| s.global_experts)
    }

    /// The options the layer was made with.
    pub fn options(&self) -> &MoeOptions {
        &self.opts
    }

    /// For an expert shard ([`MoeLayer::new_shard`]): the global id of each local expert.
    pub fn shard_expert_ids(&self) -> Option<&[usize]> {
        self.shard.as_ref().map(|s| s.expert_ids.as_slice())
    }

    /// Runs `f` (a core call enqueuing on the launch's stream) with the descriptor over the
    /// weights' device buffers, held (and stream-ordered) for the call; notes the weights' read on
    /// that stream afterwards, also after a failure (part of it may have been enqueued).
    fn with_weights(&self, l: &Launch<'_>, f: impl FnOnce(&MoeLayerDesc, u64) -> i32) -> Result<()> {
        let (w13, w2) = (&self.weights.w13, &self.weights.w2);
        let ((p13, s13), (p2, s2)) = (w13.device_buffers(), w2.device_buffers());
        let (p13, s13, p2, s2) = (l.input(p13), l.input(s13), l.input(p2), l.input(s2));
        // The shard's map is read by the routing: ordered on the stream like the weights.
        let _map = self.shard.as_ref().map(|s| l.input(&s.map));
        let desc = self.desc([p13.addr, s13.addr, p2.addr, s2.addr]);
        // SAFETY (of the callers' `f`): the weights were prepared for the descriptor's shape (they
        // are the layer's); the callers checked every other buffer.
        let r = unsafe { l.run(|st| f(&desc, st)) };
        w13.note_read(l.stream());
        w2.note_read(l.stream());
        r
    }

    /// The layer's prepared weights.
    pub fn weights(&self) -> &MoeWeights {
        &self.weights
    }

    /// The same layer (an expert shard stays one) with another intermediate format (allocate a new
    /// workspace for it).
    ///
    /// # Errors
    /// As [`MoeLayer::new`].
    pub fn with_intermediate(self, intermediate: Intermediate) -> Result<Self> {
        Self::build(self.weights, MoeOptions { intermediate, ..self.opts }, self.shard)
    }

    /// The plan of one of the layer's GEMMs over `w` with epilogue `E` (the options' tile and batch
    /// invariance): what every forward launches and what [`MoeLayer::gemm_tiles`] reports.
    fn plan<'a, E: Epilogue>(&self, w: &'a Nvfp4Weights) -> Result<GroupedGemm<'a, E>> {
        GroupedGemm::<E>::new(w, self.opts.tile)?
            .batch_invariant(self.opts.batch_invariant)
            .schedule_experts(self.global_experts())
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
    /// permutation and the first GEMM with the BF16 intermediate (the core's
    /// `moe_layer_first_gemm`, into a buffer of its own) and returns `amax / (6 * 448)` over its
    /// finite values (ModelOpt's `input_scale` recipe). Synchronizes `stream` and reads the
    /// intermediate back; meant for set-up and benches, not per forward.
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
        let (pairs, inter) = (tokens * top_k, self.weights.intermediate);
        let mut act = stream.alloc_zeros::<bf16>((pairs * inter).max(1))?;
        {
            let l = Launch::new(stream)?;
            let (h, ids) = (l.input(hidden), l.input(topk_ids));
            check_len("hidden", h.len, tokens * self.weights.hidden)?;
            check_len("topk_ids", ids.len, pairs)?;
            if tokens > 0 {
                check_align("hidden", h.addr, 16)?;
            }
            let (a, w) = (l.output(&mut act), l.output(&mut ws.buf));
            let args = MoeForwardArgs { topk_ids: ids.addr, ..forward_args(h.addr, tokens, top_k, 0, w.info()) };
            // SAFETY: `act` holds pairs x I, the inputs were checked above, the workspace is this
            // layer's (check_tokens).
            self.with_weights(&l, |d, st| unsafe { raw::moe_layer_first_gemm(d, &args, a.addr, st) })?;
        }
        let host = stream.clone_dtoh(&act.slice(..pairs * inter))?;
        weight_decode_scale(&host).map_err(|e| Error::Invalid(format!("calibrating the NVFP4 intermediate: {e}")))
    }

    /// Allocates the workspace for `max_tokens` x `max_top_k` rows and sets it up (the core's
    /// `moe_layer_initialize`, enqueued on `stream`).
    ///
    /// # Errors
    /// A CUDA error (out of memory).
    pub fn workspace(&self, stream: &Arc<CudaStream>) -> Result<MoeWorkspace> {
        let desc = self.desc([0; 4]);
        let bytes = raw::core_moe_layer_workspace_bytes(&desc) as usize;
        if bytes == 0 {
            // The layer passed the same check at construction.
            status(raw::moe_layer_can_implement(&desc))?;
        }
        let mut buf = stream.alloc_zeros::<u8>(bytes)?;
        {
            let l = Launch::new(stream)?;
            let b = l.output(&mut buf);
            // SAFETY: `buf` holds the bytes the core asked for; the descriptor's weights are not read.
            unsafe { l.run(|st| raw::moe_layer_initialize(&desc, b.addr, b.len as i64, st))? };
        }
        let w = &self.weights;
        Ok(MoeWorkspace {
            buf,
            max_pairs: self.opts.max_tokens * self.opts.max_top_k,
            shape: (w.experts, w.hidden, w.intermediate),
            intermediate: self.opts.intermediate,
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
        self.check_workspace(ws)
    }

    /// `ws` was made by this layer's [`MoeLayer::workspace`] (or one of the same shape and
    /// intermediate): its layout and decode scale are the core's for this layer.
    fn check_workspace(&self, ws: &MoeWorkspace) -> Result<()> {
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
        // The forward takes its path from the layer's format, the workspace's layout and decode
        // scale from the one it was made for: they must be the same.
        let matches = match (self.opts.intermediate, ws.intermediate) {
            (Intermediate::Bf16, Intermediate::Bf16) => true,
            (Intermediate::Nvfp4 { decode_scale: a }, Intermediate::Nvfp4 { decode_scale: b }) => {
                a.to_bits() == b.to_bits()
            }
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
    /// tokens and routing of `input` (device buffers, see [`MoeInput`]) into `out` `[T, H]` of the
    /// options' [`OutputFormat`] (`bf16` or `f32`). Expert ids outside `[0, E)` (E the global
    /// experts, for an expert shard) are never used as an index: those slots contribute nothing and
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
    /// `out` of the other element type than the options' output ([`Error::Invalid`]), more tokens
    /// or a larger top-k than the layer was made for, a workspace of another layer
    /// (another shape or intermediate format), a buffer too small, `hidden` or `out` not 16-byte
    /// aligned, or a failed launch. All but the last are found before anything is enqueued.
    pub fn forward<H, I, W, O, T>(
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
        O: DevicePtrMut<T>,
        T: OutputElement,
    {
        let MoeInput { hidden, tokens, topk_ids, topk_weights, top_k } = *input;
        self.check_output::<T>()?;
        self.check_tokens(tokens, top_k, ws)?;
        let l = Launch::new(stream)?;
        let (h, ids, w) = (l.input(hidden), l.input(topk_ids), l.input(topk_weights));
        let o = l.output(out);
        let routing = Routing::Ids { ids: ids.len, weights: w.len };
        check_forward_buffers(self.weights.hidden, tokens, top_k, h.info(), o.info(), routing)?;
        let b = l.output(&mut ws.buf);
        let args = MoeForwardArgs {
            topk_ids: ids.addr,
            topk_weights: w.addr,
            ..forward_args(h.addr, tokens, top_k, o.addr, b.info())
        };
        // SAFETY: every buffer checked above; the workspace is this layer's (check_tokens).
        self.with_weights(&l, |d, st| unsafe { raw::moe_layer_forward(d, &args, st) })
    }

    /// `out[e, r] = expert_e(hidden[e, r])` for `r < counts[e]`, over tokens already grouped by
    /// expert (see [`DispatchedInput`]), into `out` bf16 `[E, M, H]` in the same layout (rows past
    /// an expert's count are not written): both GEMMs straight over the layout, no routing,
    /// permutation or combine (the dispatcher's combine weighs and sums the rows). Both
    /// intermediates take the layout (the NVFP4 one is packed by the first GEMM in it and
    /// dequantized row by row, as the internal-permutation forward does). For an expert shard E and
    /// the layout are the shard's own experts. No host synchronization; valid inside CUDA-graph
    /// capture.
    ///
    /// # Errors
    /// The `WarpM16N8` tile (at most 8 rows: not this layout's padded E x M), E x M above
    /// the layer's `max_tokens x max_top_k`, a workspace of another layer, a buffer too small,
    /// `hidden` or `out` not 16-byte aligned (all before anything is enqueued), or a failed launch.
    pub fn forward_dispatched<H, C, O>(
        &self,
        stream: &CudaStream,
        input: &DispatchedInput<'_, H, C>,
        out: &mut O,
        ws: &mut MoeWorkspace,
    ) -> Result<()>
    where
        H: DevicePtr<bf16>,
        C: DevicePtr<i32>,
        O: DevicePtrMut<bf16>,
    {
        let DispatchedInput { hidden, counts, max_tokens_per_expert: m, expected_rows } = *input;
        if self.opts.tile == GemmTile::WarpM16N8 {
            return Err(Error::Invalid("pre-dispatched tokens take a tile other than WarpM16N8".into()));
        }
        self.check_workspace(ws)?;
        let (e, h) = (self.weights.experts, self.weights.hidden);
        let capacity = self.opts.max_tokens * self.opts.max_top_k;
        if m > capacity / e {
            return Err(Error::InvalidShape(format!(
                "max_tokens_per_expert {m}: experts ({e}) x it must be at most max_tokens x max_top_k ({capacity})"
            )));
        }
        let l = Launch::new(stream)?;
        let (x, c) = (l.input(hidden), l.input(counts));
        let o = l.output(out);
        check_len("hidden", x.len, e * m * h)?;
        check_len("counts", c.len, e)?;
        check_len("out", o.len, e * m * h)?;
        if m > 0 {
            check_align("hidden", x.addr, 16)?;
            check_align("out", o.addr, 16)?;
        }
        let b = l.output(&mut ws.buf);
        let args = MoeDispatchedArgs {
            hidden: x.addr,
            counts: c.addr,
            max_tokens_per_expert: m as i64,
            out: o.addr,
            workspace: b.addr,
            workspace_bytes: b.len as i64,
            expected_rows: expected_rows as i64,
        };
        // SAFETY: every buffer checked above; the workspace is this layer's (check_workspace).
        self.with_weights(&l, |d, st| unsafe { raw::moe_layer_forward_dispatched(d, &args, st) })
    }

    /// Routes with softmax top-k over the router logits of `input` (renormalized if asked), then
    /// [`MoeLayer::forward`].
    ///
    /// Every argument (the router logits' length included) is checked before the router's launch:
    /// an argument error enqueues no kernel or copy, as for [`MoeLayer::forward`].
    ///
    /// # Errors
    /// As [`MoeLayer::forward`], or bad routing arguments.
    pub fn forward_with_router<H, L, O, T>(
        &self,
        stream: &CudaStream,
        input: &RouterInput<'_, H, L>,
        out: &mut O,
        ws: &mut MoeWorkspace,
    ) -> Result<()>
    where
        H: DevicePtr<bf16>,
        L: DevicePtr<f32>,
        O: DevicePtrMut<T>,
        T: OutputElement,
    {
        let RouterInput { hidden, tokens, router_logits, top_k, renormalize } = *input;
        self.check_output::<T>()?;
        self.check_tokens(tokens, top_k, ws)?;
        let l = Launch::new(stream)?;
        let (h, lg) = (l.input(hidden), l.input(router_logits));
        let o = l.output(out);
        let routing = Routing::Logits { logits: lg.len, experts: self.global_experts() };
        check_forward_buffers(self.weights.hidden, tokens, top_k, h.info(), o.info(), routing)?;
        let b = l.output(&mut ws.buf);
        let args = MoeForwardArgs {
            router_logits: lg.addr,
            renormalize: i32::from(renormalize),
            ..forward_args(h.addr, tokens, top_k, o.addr, b.info())
        };
        // SAFETY: every buffer checked above; the workspace is this layer's (check_tokens).
        self.with_weights(&l, |d, st| unsafe { raw::moe_layer_forward(d, &args, st) })
    }

    /// Synchronizes `stream` and reports the first bad expert id seen since the last check (the
    /// core's `moe_layer_read_error`, which clears it).
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the token, slot and id of the first bad expert id, or a CUDA error
    /// (including one from earlier asynchronous work on `stream`), or a workspace of another layer.
    pub fn check(&self, stream: &Arc<CudaStream>, ws: &mut MoeWorkspace, top_k: usize) -> Result<()> {
        self.check_workspace(ws)?;
        let desc = self.desc([0; 4]);
        let mut word = u64::MAX;
        {
            let l = Launch::new(stream)?;
            let b = l.output(&mut ws.buf);
            // SAFETY: the workspace's own bytes; the descriptor's weights are not read.
            unsafe { l.run(|st| raw::moe_layer_read_error(&desc, b.addr, b.len as i64, st, &mut word))? };
        }
        bad_id_error(word, top_k, self.global_experts())
    }

    /// `out`'s element type is the one the options say the layer writes.
    fn check_output<T: OutputElement>(&self) -> Result<()> {
        if T::FORMAT != self.opts.output {
            return Err(Error::Invalid(format!(
                "this layer writes {:?} output (MoeOptions::output), out holds {:?} elements",
                self.opts.output,
                T::FORMAT
            )));
        }
        Ok(())
    }
}

/// The core's expert map of a shard: i32 `[global_experts]`, each global id's local expert or -1,
/// for local experts `expert_ids` (`experts` of them; pure, checked).
///
/// # Errors
/// [`Error::InvalidShape`] naming the problem: a length other than `experts`, an id not below
/// `global_experts`, a repeated id, `global_experts` above the core's limit.
pub(crate) fn shard_map(global_experts: usize, expert_ids: &[usize], experts: usize) -> Result<Vec<i32>> {
    let limit = crate::abi::EXPERT_LIMIT;
    if global_experts > limit {
        return Err(Error::InvalidShape(format!("global_experts {global_experts} exceeds the core's {limit}")));
    }
    if expert_ids.len() != experts {
        return Err(Error::InvalidShape(format!(
            "the shard lists {} expert ids, its weights hold {experts} experts",
            expert_ids.len()
        )));
    }
    let mut map = vec![-1i32; global_experts];
    for (local, &id) in expert_ids.iter().enumerate() {
        let slot = map.get_mut(id).ok_or_else(|| {
            Error::InvalidShape(format!("expert_ids[{local}] = {id} is not below global_experts {global_experts}"))
        })?;
        if *slot >= 0 {
            return Err(Error::InvalidShape(format!("expert_ids[{local}] = {id} repeats expert_ids[{}]", *slot)));
        }
        // (local < experts <= global_experts <= 1024: fits i32.)
        *slot = local as i32;
    }
    Ok(map)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The core's layer rules surface as typed errors (what `MoeLayer::new` reports for a shape
    /// its own checks let through), and its workspace grows with the NVFP4 intermediate.
    #[test]
    fn the_cores_layer_checks_are_typed_errors() {
        let d = MoeLayerDesc {
            experts: 8,
            hidden: 256,
            intermediate: 128,
            max_tokens: 16,
            max_top_k: 2,
            ..Default::default()
        };
        assert!(status(raw::moe_layer_can_implement(&d)).is_ok());
        let bf16_bytes = raw::core_moe_layer_workspace_bytes(&d);
        assert!(bf16_bytes >= 32 * (256 + 128 + 256) * 2, "{bf16_bytes}");
        let fp4 = MoeLayerDesc { intermediate_format: IntermediateFormat::Nvfp4, intermediate_decode_scale: 0.5, ..d };
        assert!(raw::core_moe_layer_workspace_bytes(&fp4) > bf16_bytes);
        let odd = MoeLayerDesc { intermediate: 96, ..d };
        match status(raw::moe_layer_can_implement(&odd)) {
            Err(Error::InvalidShape(m)) => assert!(m.contains("intermediate"), "{m}"),
            other => panic!("{other:?}"),
        }
        assert_eq!(raw::core_moe_layer_workspace_bytes(&odd), 0);
        let bad_g = MoeLayerDesc { intermediate_decode_scale: f32::NAN, ..fp4 };
        assert!(matches!(
            status(raw::moe_layer_can_implement(&bad_g)),
            Err(Error::Rejected { status: crate::abi::Status::InvalidDecodeScale, .. })
        ));
        let too_many = MoeLayerDesc { max_tokens: 1 << 31, ..d };
        assert!(matches!(status(raw::moe_layer_can_implement(&too_many)), Err(Error::InvalidShape(_))));
    }

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

    /// A shard's expert map: each listed global id maps to its position, every other id to -1;
    /// a wrong count, an id out of range, a repeat or too many global experts is named.
    #[test]
    fn shard_map_inverts_the_expert_list_and_names_bad_lists() {
        assert_eq!(shard_map(6, &[4, 1, 5], 3).unwrap(), vec![-1, 1, -1, -1, 0, 2]);
        assert_eq!(shard_map(3, &[2, 0, 1], 3).unwrap(), vec![1, 2, 0]);
        let says = |r: Result<Vec<i32>>, text: &str| match r {
            Err(Error::InvalidShape(m)) => assert!(m.contains(text), "{m:?} should say {text:?}"),
            other => panic!("expected a shape error saying {text:?}, got {other:?}"),
        };
        says(shard_map(6, &[4, 1], 3), "lists 2 expert ids, its weights hold 3");
        says(shard_map(6, &[4, 6, 1], 3), "expert_ids[1] = 6 is not below global_experts 6");
        says(shard_map(6, &[4, 1, 4], 3), "expert_ids[2] = 4 repeats expert_ids[0]");
        says(shard_map(1025, &[0], 1), "global_experts 1025 exceeds the core's 1024");
        says(shard_map(2, &[0, 1, 1], 3), "repeats");
    }
}
