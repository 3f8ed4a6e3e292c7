//! The NVFP4-weight grouped GEMM on Hopper: prepared weights ([`Nvfp4Weights`]) and a launch plan
//! ([`GroupedGemm`]).
//!
//! `out[rows of expert e] = x[rows of e] * W_e^T * g_e` for all experts in one launch; the row
//! ranges come from `expert_offsets` in device memory, so nothing synchronizes with the host.

use std::marker::PhantomData;
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;

use crate::abi::{GemmEpilogue, GroupedGemmArgs, PrepareWeightsArgs};
use crate::error::{Error, Result};
use crate::ffi::raw;
use crate::host::ExpertWeightsHost;
use crate::launch::{self, check_align, check_len, BufferInfo, Launch};

/// NVFP4 expert weights `[E, n, k]` prepared for the grouped GEMM: retiled once, at load, into
/// the chunk layout the mainloop reads (`cpp/src/nvfp4_weights.cuh`), plus each expert's decode
/// scale on the device. One prepared layout serves every tile configuration.
///
/// The weight chunks are contiguous, so the kernel moves them with bulk copies and needs no tensor
/// map for them; the activation tensor map is encoded per launch (its address changes per call).
///
/// # Threads, streams and drop
/// `Send + Sync`, read-only once prepared: launches from several threads and streams may read the
/// same weights at once. Dropping them while launches that read them still run, on any number of
/// streams, is safe with cudarc's event tracking (on by default): their memory is freed on the
/// stream they were prepared on (their home stream), stream-ordered after every launch that read
/// them. cudarc keeps one read event per buffer (the last recorded), which alone would cover one
/// stream's reads only, so the weights keep their own: each launch on a stream other than the home
/// stream records an event there (one event per such stream, re-recorded by its next launch), and
/// dropping the weights makes the home stream wait for each. Nothing synchronizes the host; a
/// launch on the home stream itself records nothing (the free is ordered after it there); the
/// per-thread default stream, one handle for a different stream in every thread, counts as
/// another stream in every thread; events already complete are not kept. The
/// weights keep these events, not the streams: a stream dropped with launches pending is released
/// by CUDA once they finish, so its handle is not reused before. With event tracking disabled
/// (e.g. for CUDA-graph capture) nothing is recorded and the caller must keep the weights alive
/// until every launch that reads them has finished.
#[derive(Debug)]
pub struct Nvfp4Weights {
    prepared: CudaSlice<u8>,
    /// [E, 2]: decode scale of output features f with f % 16 < 8, then of the others. Allocated
    /// on the same stream as `prepared` (the home stream).
    decode_scales: CudaSlice<f32>,
    /// The launches on other streams than the home stream ([`Nvfp4Weights::note_read`]).
    foreign_reads: Mutex<ForeignReads>,
    host_decode_scales: Vec<f32>,
    row_order: RowOrder,
    experts: usize,
    n: usize,
    k: usize,
}

/// The streams other than their home stream that launches read a [`Nvfp4Weights`] on: per stream
/// (keyed by its context, raw handle and, for the per-thread default stream, the thread) an event
/// recorded after its last such launch.
#[derive(Debug, Default)]
struct ForeignReads {
    events: Vec<(StreamKey, CudaEvent)>,
    /// An event could not be recorded after a launch: the drop synchronizes the context instead.
    synchronize_on_drop: bool,
}

/// A stream's identity for [`ForeignReads`]: context, raw handle, and the thread where the handle
/// is the per-thread default stream's.
type StreamKey = (usize, usize, Option<std::thread::ThreadId>);

/// `CU_STREAM_PER_THREAD`: the handle of every thread's own default stream (cudarc's
/// `CudaContext::per_thread_stream`).
const PER_THREAD_STREAM: usize = 0x2;

impl Drop for Nvfp4Weights {
    /// Orders the free of the weights' memory (on the home stream, by the fields' own drops, which
    /// follow) after every launch on another stream that read them: the home stream waits for each
    /// such stream's event (or, should that fail, the host waits for it).
    fn drop(&mut self) {
        let reads = self.foreign_reads.get_mut().unwrap_or_else(PoisonError::into_inner);
        let home = self.prepared.stream();
        let ctx = home.context();
        if reads.synchronize_on_drop {
            ctx.record_err(ctx.synchronize());
        }
        for (_, event) in &reads.events {
            if home.wait(event).is_err() {
                ctx.record_err(event.synchronize());
            }
        }
    }
}

/// The order of the prepared rows (declared in `cpp/include/nvfp4moe/types.h`, generated); see
/// [`gate_up_source_row`] for [`RowOrder::GateUpBands8`].
pub use crate::abi::RowOrder;

/// The source row (within an expert, `[gate; up]` order) of prepared row `p` for
/// [`RowOrder::GateUpBands8`] weights of `n = 2I` rows (the kernel's mapping, mirrored).
pub fn gate_up_source_row(p: usize, n: usize) -> usize {
    let (band, i) = (p / 16, p % 16);
    if i < 8 {
        band * 8 + i
    } else {
        n / 2 + band * 8 + (i - 8)
    }
}

/// Checks the shape rules of the grouped GEMM: the core's `can_implement` of the weight
/// preparation and of the GEMM (host code; no GPU).
///
/// # Errors
/// [`Error::InvalidShape`]: `experts` outside 1..=[`EXPERT_LIMIT`](crate::abi::EXPERT_LIMIT), `n`
/// or `k` not a positive multiple of 64, or an overflowing size.
pub fn check_gemm_shape(experts: usize, n: usize, k: usize) -> Result<()> {
    let overflow = || Error::InvalidShape(format!("{experts} x {n} x {k} overflows"));
    experts.checked_mul(n).and_then(|en| en.checked_mul(k)).ok_or_else(overflow)?;
    let (e, n, k) = (dim(experts)?, dim(n)?, dim(k)?);
    launch::status(raw::prepare_nvfp4_weights_can_implement(&PrepareWeightsArgs {
        experts: e,
        n,
        k,
        ..Default::default()
    }))?;
    launch::status(raw::grouped_gemm_nvfp4_can_implement(&GroupedGemmArgs { experts: e, n, k, ..Default::default() }))
}

/// A size as the core's `int64_t`.
fn dim(v: usize) -> Result<i64> {
    i64::try_from(v).map_err(|_| Error::InvalidShape(format!("{v} exceeds i64")))
}

/// The shape of a set of expert weights: `experts` matrices `[n, k]` (n output features, k the
/// reduction dimension).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertShape {
    /// Number of experts E.
    pub experts: usize,
    /// Output features (rows) per expert.
    pub n: usize,
    /// Input features (columns, K) per expert.
    pub k: usize,
}

impl ExpertShape {
    /// `experts` matrices `[n, k]`.
    pub fn new(experts: usize, n: usize, k: usize) -> Self {
        ExpertShape { experts, n, k }
    }
}

impl Nvfp4Weights {
    /// Prepares checkpoint-layout weights already on the device: `codes` u8 `[E, n, k/2]`, `scales`
    /// E4M3 `[E, n, k/16]` (linear), and one decode scale per expert (host). Synchronizes `stream`
    /// once to report a bad scale (NaN or negative) as an error naming the expert, row and block.
    ///
    /// # Errors
    /// A shape the GEMM does not take ([`check_gemm_shape`]), a decode scale count other than E or
    /// a bad decode scale, short buffers, a bad scale byte, or a CUDA error.
    pub fn prepare<C: DevicePtr<u8>, S: DevicePtr<u8>>(
        stream: &Arc<CudaStream>,
        codes: &C,
        scales: &S,
        decode_scales: &[f32],
        shape: ExpertShape,
    ) -> Result<Self> {
        let experts = shape.experts;
        if decode_scales.len() != experts {
            return Err(Error::InvalidShape(format!("{} decode scales for {experts} experts", decode_scales.len())));
        }
        Self::prepare_ordered(stream, codes, scales, (decode_scales, None), shape)
    }

    /// Prepares fused first-layer weights: per expert the gate rows then the up rows (`n = 2I`
    /// rows: ModelOpt's fused `gate_up_proj`, or gate and up concatenated), with the gate and up
    /// decode scales of each expert (ModelOpt checkpoints may give them different
    /// `weight_scale_2`; both are applied exactly). Output features come in
    /// [`RowOrder::GateUpBands8`] order.
    ///
    /// # Errors
    /// As [`Nvfp4Weights::prepare`].
    pub fn prepare_gate_up<C: DevicePtr<u8>, S: DevicePtr<u8>>(
        stream: &Arc<CudaStream>,
        codes: &C,
        scales: &S,
        gate_decode_scales: &[f32],
        up_decode_scales: &[f32],
        shape: ExpertShape,
    ) -> Result<Self> {
        let experts = shape.experts;
        if gate_decode_scales.len() != experts || up_decode_scales.len() != experts {
            return Err(Error::InvalidShape(format!(
                "{} gate and {} up decode scales for {experts} experts",
                gate_decode_scales.len(),
                up_decode_scales.len()
            )));
        }
        Self::prepare_ordered(stream, codes, scales, (gate_decode_scales, Some(up_decode_scales)), shape)
    }

    /// Prepares with the core's `prepare_moe_weights` (the one preparation of every API): the
    /// decode scales are `(all, None)` for a plain projection, `(gate, Some(up))` for gate/up
    /// weights, whose rows then come in [`RowOrder::GateUpBands8`] order.
    fn prepare_ordered<C: DevicePtr<u8>, S: DevicePtr<u8>>(
        stream: &Arc<CudaStream>,
        codes: &C,
        scales: &S,
        decode_scales: (&[f32], Option<&[f32]>),
        shape: ExpertShape,
    ) -> Result<Self> {
        let ExpertShape { experts, n, k } = shape;
        let (gate, up) = decode_scales;
        let row_order = if up.is_some() { RowOrder::GateUpBands8 } else { RowOrder::Identity };
        check_gemm_shape(experts, n, k)?;
        for &g in gate.iter().chain(up.unwrap_or_default()) {
            crate::host::validate_decode_scale(g)?;
        }
        check_len("codes", codes.len(), experts * n * k / 2)?;
        check_len("scales", scales.len(), experts * n * k / 16)?;
        let bytes = raw::core_prepared_weight_bytes(experts as i64, n as i64, k as i64) as usize;
        // SAFETY: the kernel writes every byte of `prepared` (every chunk, every thread's slot), and
        // the core every pair of `decode_scales`.
        let mut prepared = unsafe { stream.alloc::<u8>(bytes)? };
        let mut decode_scales = unsafe { stream.alloc::<f32>(2 * experts)? };
        let mut error = stream.alloc_zeros::<i32>(2)?;
        {
            let l = Launch::new(stream)?;
            // The buffers (and their stream-ordering guards) live until the call returns (it
            // synchronizes the stream).
            let (c, sc) = (l.input(codes), l.input(scales));
            let (p, d, e) = (l.output(&mut prepared), l.output(&mut decode_scales), l.output(&mut error));
            let args = PrepareWeightsArgs {
                codes: c.addr,
                scales: sc.addr,
                experts: experts as i64,
                n: n as i64,
                k: k as i64,
                row_order,
                prepared: p.addr,
                error: e.addr,
            };
            let up = up.unwrap_or_default();
            // SAFETY: lengths checked above; `prepared` has prepared_weight_bytes bytes, `decode_scales`
            // 2 E floats, `error` 2 ints; gate and up have E decode scales (the callers checked).
            unsafe { l.run(|st| raw::prepare_moe_weights(&args, gate, up, d.addr, st))? };
        }
        let host_decode_scales = match up {
            None => gate.iter().flat_map(|&g| [g, g]).collect(),
            Some(up) => gate.iter().zip(up).flat_map(|(&g, &u)| [g, u]).collect(),
        };
        Ok(Nvfp4Weights {
            prepared,
            decode_scales,
            foreign_reads: Mutex::default(),
            host_decode_scales,
            row_order,
            experts,
            n,
            k,
        })
    }

    /// Records that a launch just enqueued on `stream` reads the weights (see the type's docs):
    /// nothing for the home stream or with event tracking off, else an event on `stream`, so that
    /// the drop orders the free after it. Cheap: a stream comparison in the single-stream case.
    /// A per-thread default stream (one handle, a different stream in every thread) is never
    /// taken for the home stream, and its events are kept per thread. Events already complete
    /// are dropped before a new one is kept, so a caller that makes a stream per request does
    /// not grow the list. If no event can be recorded the drop synchronizes the context instead
    /// (the launch itself is not failed: it was enqueued).
    pub(crate) fn note_read(&self, stream: &CudaStream) {
        let ctx = stream.context();
        let per_thread = stream.cu_stream() as usize == PER_THREAD_STREAM;
        if (!per_thread && *stream == **self.prepared.stream()) || !ctx.is_managing_stream_synchronization() {
            return;
        }
        let thread = per_thread.then(|| std::thread::current().id());
        let key = (ctx.cu_ctx() as usize, stream.cu_stream() as usize, thread);
        let mut reads = self.foreign_reads.lock().unwrap_or_else(PoisonError::into_inner);
        let recorded = match reads.events.iter().position(|(k, _)| *k == key) {
            // Re-recorded: it now covers every launch on `stream` so far (stream order).
            Some(i) => reads.events[i].1.record(stream),
            None => {
                reads.events.retain(|(_, event)| !event.is_complete());
                stream.record_event(None).map(|event| reads.events.push((key, event)))
            }
        };
        if let Err(e) = recorded {
            reads.synchronize_on_drop = true;
            ctx.record_err(Err::<(), _>(e));
        }
    }

    /// The stream the weights were prepared on, which frees them (after every other stream's
    /// reads: see the type's `Drop`).
    pub(crate) fn home_stream(&self) -> &Arc<CudaStream> {
        self.prepared.stream()
    }

    /// The prepared chunks and the `[E, 2]` decode scales, for a launch that reads them (which
    /// then calls [`Nvfp4Weights::note_read`]).
    pub(crate) fn device_buffers(&self) -> (&CudaSlice<u8>, &CudaSlice<f32>) {
        (&self.prepared, &self.decode_scales)
    }

    /// Uploads host weights and prepares them.
    ///
    /// # Errors
    /// As [`Nvfp4Weights::prepare`].
    pub fn from_host(stream: &Arc<CudaStream>, w: &ExpertWeightsHost) -> Result<Self> {
        check_gemm_shape(w.experts, w.n, w.k)?;
        check_len("codes", w.codes.len(), w.experts * w.n * w.k / 2)?;
        check_len("scales", w.scales.len(), w.experts * w.n * w.k / 16)?;
        let codes = stream.clone_htod(&w.codes)?;
        let scales = stream.clone_htod(&w.scales)?;
        Self::prepare(stream, &codes, &scales, &w.decode_scales, ExpertShape::new(w.experts, w.n, w.k))
    }

    /// Number of experts E.
    pub fn experts(&self) -> usize {
        self.experts
    }
    /// Output features (rows) per expert.
    pub fn n(&self) -> usize {
        self.n
    }
    /// Input features (K) per expert.
    pub fn k(&self) -> usize {
        self.k
    }
    /// The decode scales, `[E, 2]`: per expert, of output features f with f % 16 < 8 and of the
    /// others (equal unless the weights are [`RowOrder::GateUpBands8`]: then gate, up).
    pub fn decode_scale_pairs(&self) -> &[f32] {
        &self.host_decode_scales
    }
    /// The order of the output features.
    pub fn row_order(&self) -> RowOrder {
        self.row_order
    }
    /// Bytes of the prepared weights on the device.
    pub fn prepared_bytes(&self) -> usize {
        self.prepared.len()
    }
}

/// A tile configuration of the grouped GEMM (declared in `cpp/include/nvfp4moe/types.h`,
/// generated); [`GemmTile::Auto`] is resolved per launch by the core ([`GemmTile::choose`], and the warp
/// kernel for launches of at most 8 rows: [`GroupedGemm::tile_for`]).
pub use crate::abi::GemmTile;

impl GemmTile {
    /// The documented heuristic (the core's `choose_gemm_tile`): with at most 8 rows in all (so at
    /// most 8 per expert) N8; with at most 16 rows per expert on average N16, at most 32 N32, at
    /// most 64 N64, at most 128 N128, else N256. Uses only what the host knows without
    /// synchronizing.
    pub fn choose(total_rows: usize, experts: usize) -> GemmTile {
        GemmTile::from_raw(raw::core_choose_gemm_tile(total_rows as i64, experts as i64)).unwrap_or(GemmTile::M128N128)
    }
}

/// The epilogue of a grouped GEMM plan, as a type.
pub trait Epilogue {
    /// The core's epilogue.
    const KIND: GemmEpilogue;
    /// Whether the weights must be [`RowOrder::GateUpBands8`] (the SwiGLU epilogues).
    const NEEDS_GATE_UP: bool;
    /// Output columns per row for a weight of `n` rows.
    fn out_cols(n: usize) -> usize;
}

/// The plain epilogue: `out = acc * g`, rounded once to BF16, `[rows, n]` in the weights' row
/// order.
#[derive(Clone, Copy, Debug, Default)]
pub struct PlainBf16;

impl Epilogue for PlainBf16 {
    const KIND: GemmEpilogue = GemmEpilogue::Plain;
    const NEEDS_GATE_UP: bool = false;
    fn out_cols(n: usize) -> usize {
        n
    }
}

/// The old MoE flow, kept as a measured baseline: SwiGLU in the epilogue, but the full width
/// `[rows, 2I]` is written as `[gate 8b..8b+7, silu(gate)*up 8b..8b+7]` for b = 0..I/8 (gate
/// columns: the decoded gate values rounded to BF16). Needs gate/up weights.
#[derive(Clone, Copy, Debug, Default)]
pub struct Interleaved;

impl Epilogue for Interleaved {
    const KIND: GemmEpilogue = GemmEpilogue::Interleaved;
    const NEEDS_GATE_UP: bool = true;
    fn out_cols(n: usize) -> usize {
        n
    }
}

/// The target MoE flow: `silu(gate * g_gate) * (up * g_up)` in FP32 from the accumulators,
/// rounded once to BF16, written compact as `[rows, I]` (half the accumulator width). Needs
/// gate/up weights.
#[derive(Clone, Copy, Debug, Default)]
pub struct SwigluBf16;

impl Epilogue for SwigluBf16 {
    const KIND: GemmEpilogue = GemmEpilogue::SwigluBf16;
    const NEEDS_GATE_UP: bool = true;
    fn out_cols(n: usize) -> usize {
        n / 2
    }
}

/// Epilogues whose output is one BF16 tensor (launched with [`GroupedGemm::launch`]).
pub trait Bf16Output: Epilogue {}
impl Bf16Output for PlainBf16 {}
impl Bf16Output for Interleaved {}
impl Bf16Output for SwigluBf16 {}

/// The SwiGLU result of [`SwigluBf16`] (rounded to BF16 first, as the recipe says), quantized to
/// NVFP4 inside the epilogue: codes `[rows, I/2]` and E4M3 scales in the grouped 128x4 layout with
/// per-expert regions ([`crate::layout::grouped_scale_len`]), with an activation decode scale per
/// expert or one for all. The bytes equal `quantize_nvfp4_grouped` of the `SwigluBf16` output.
/// Launched with [`GroupedGemm::launch_nvfp4`]. Needs gate/up weights.
#[derive(Clone, Copy, Debug, Default)]
pub struct SwigluNvfp4;

impl Epilogue for SwigluNvfp4 {
    const KIND: GemmEpilogue = GemmEpilogue::SwigluNvfp4;
    const NEEDS_GATE_UP: bool = true;
    /// Code bytes per row.
    fn out_cols(n: usize) -> usize {
        n / 4
    }
}

/// A launch plan for one weight set: validated once, launched many times.
///
/// `Send + Sync` (a borrow of the weights and two settings): one plan may launch on several
/// threads and streams at once, each launch with its own outputs.
#[derive(Debug)]
pub struct GroupedGemm<'w, E: Epilogue = PlainBf16> {
    weights: &'w Nvfp4Weights,
    tile: GemmTile,
    batch_invariant: bool,
    /// The expert count the tile and split choice assume (0: the weights').
    schedule_experts: usize,
    _epilogue: PhantomData<E>,
}

impl<'w, E: Epilogue> GroupedGemm<'w, E> {
    /// A plan over `weights` with tile configuration `tile` (`GemmTile::Auto` decides per launch).
    /// The SwiGLU epilogues need weights prepared with [`Nvfp4Weights::prepare_gate_up`].
    ///
    /// # Errors
    /// [`Error::Invalid`] for a SwiGLU epilogue over weights not prepared as gate/up.
    pub fn new(weights: &'w Nvfp4Weights, tile: GemmTile) -> Result<Self> {
        if E::NEEDS_GATE_UP && weights.row_order != RowOrder::GateUpBands8 {
            return Err(Error::Invalid(
                "this epilogue computes SwiGLU: it needs gate/up weights (Nvfp4Weights::prepare_gate_up)".into(),
            ));
        }
        Ok(GroupedGemm { weights, tile, batch_invariant: false, schedule_experts: 0, _epilogue: PhantomData })
    }

    /// Batch invariance: with `true`, no launch splits K over a cluster of CTAs, so a row's
    /// K-sum order, and with it every output bit, does not depend on how many rows the launch has
    /// (split-K speeds up launches with fewer tiles than CTA slots: decode at small T; the cost of
    /// turning it off is in the README). Default `false`.
    pub fn batch_invariant(mut self, on: bool) -> Self {
        self.batch_invariant = on;
        self
    }

    /// The expert count the tile and K-split choice assume (the core's `schedule_experts`):
    /// `experts` (at least the weights' count) for the experts of an expert shard of a layer of
    /// that many, so that each gets the whole layer's tile and splits (the same bits) and the
    /// choice sees the rows a shard's experts have on average. Default: the weights' count.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for fewer experts than the weights have, or more than the core takes.
    pub fn schedule_experts(mut self, experts: usize) -> Result<Self> {
        let limit = crate::abi::EXPERT_LIMIT;
        if experts < self.weights.experts || experts > limit {
            return Err(Error::InvalidShape(format!(
                "schedule_experts {experts} must be in {}..={limit} (the weights' experts to the core's limit)",
                self.weights.experts
            )));
        }
        self.schedule_experts = experts;
        Ok(self)
    }

    /// The expert count of the tile and split choice.
    fn scheduled_experts(&self) -> usize {
        if self.schedule_experts > 0 {
            self.schedule_experts
        } else {
            self.weights.experts
        }
    }

    /// Scratch memory a launch needs: none (the per-expert tile prefix is built in shared memory).
    pub fn workspace_bytes(&self) -> usize {
        0
    }

    /// The tile a launch over `total_rows` rows uses: the plan's, or for [`GemmTile::Auto`] the
    /// core's choice for this launch ([`GemmTile::choose`], with launches of at most 8 rows in
    /// all on [`GemmTile::WarpM16N8`] where that kernel takes them, which depends on the SM count
    /// of the calling thread's current device).
    pub fn tile_for(&self, total_rows: usize) -> GemmTile {
        let w = self.weights;
        // (The core reads the expert count only for its choice.)
        launch_tile(self.tile, total_rows, self.scheduled_experts(), w.n, w.k, E::KIND, self.batch_invariant, 0)
    }

    /// The core's `max_splits`: 1 (never split K) when batch invariant, else the library's choice.
    fn max_splits(&self) -> i64 {
        max_splits(self.batch_invariant)
    }

    /// Validates a launch (pure; no GPU): buffer lengths and alignment.
    ///
    /// # Errors
    /// As [`check_gemm_launch`].
    pub fn check(&self, total_rows: usize, x: BufferInfo, offsets_len: usize, out: BufferInfo) -> Result<()> {
        let w = self.weights;
        check_gemm_launch(w.experts, w.k, E::out_cols(w.n), total_rows, x, offsets_len, out)
    }

    fn launch_raw(&self, l: &Launch<'_>, r: RawLaunch) -> Result<()> {
        let RawLaunch { x: x_ptr, total_rows, expert_offsets: off_ptr, out: out_ptr, out_scales, act_scales } = r;
        let w = self.weights;
        let (prepared, decode_scales) = (l.input(&w.prepared), l.input(&w.decode_scales));
        let args = GroupedGemmArgs {
            prepared: prepared.addr,
            decode_scale: decode_scales.addr,
            experts: w.experts as i64,
            n: w.n as i64,
            k: w.k as i64,
            x: x_ptr,
            total_rows: total_rows as i64,
            expert_offsets: off_ptr,
            out: out_ptr,
            out_scales,
            act_decode_scales: act_scales.0,
            num_act_decode_scales: act_scales.1 as i64,
            tile: self.tile,
            epilogue: E::KIND,
            max_splits: self.max_splits(),
            schedule_experts: self.schedule_experts as i64,
            // (The expert-major layout is the layer's pre-dispatched forward's, in the core.)
            expert_counts: 0,
            expert_stride: 0,
            schedule_rows: 0,
        };
        // SAFETY: the callers checked every buffer's length and alignment; the weights were
        // prepared for (E, n, k).
        let launched = unsafe { l.launch(&args, raw::grouped_gemm_nvfp4_can_implement, raw::grouped_gemm_nvfp4) };
        // Noted even when the launch failed: part of it may have been enqueued.
        w.note_read(l.stream());
        launched
    }
}

/// The core's `max_splits` for a plan: 1 (never split K) when batch invariant, else 0 (the
/// library's choice).
fn max_splits(batch_invariant: bool) -> i64 {
    if batch_invariant {
        1
    } else {
        0
    }
}

/// The tile a launch runs (the core's `launch_gemm_tile`) on a device of `sms` SMs (0: the
/// current device's): `tile`, or for [`GemmTile::Auto`] [`GemmTile::choose`]'s, except launches of
/// at most 8 rows in all on [`GemmTile::WarpM16N8`] where that kernel takes them (not
/// `SwigluNvfp4`, not batch invariant, x small enough for shared memory) and the N8 tile would
/// neither fill one round of its CTA slots to 90% nor need more than two rounds (there N8 measured
/// as fast or faster).
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_tile(
    tile: GemmTile,
    total_rows: usize,
    experts: usize,
    n: usize,
    k: usize,
    epilogue: GemmEpilogue,
    batch_invariant: bool,
    sms: i32,
) -> GemmTile {
    let args = GroupedGemmArgs {
        tile,
        total_rows: total_rows as i64,
        experts: experts as i64,
        n: n as i64,
        k: k as i64,
        epilogue,
        max_splits: max_splits(batch_invariant),
        ..Default::default()
    };
    let raw_tile = raw::core_launch_gemm_tile(&args, sms);
    GemmTile::from_raw(raw_tile).unwrap_or(GemmTile::M128N128)
}

/// The device addresses of one launch, checked by the caller.
struct RawLaunch {
    x: u64,
    total_rows: usize,
    expert_offsets: u64,
    out: u64,
    out_scales: u64,
    /// Activation decode scales: address and count (0 and 0 unless [`SwigluNvfp4`]).
    act_scales: (u64, usize),
}

/// Where [`GroupedGemm::launch_nvfp4`] writes: the NVFP4 output of [`SwigluNvfp4`] and the decode
/// scales it is quantized with.
#[derive(Debug)]
pub struct SwigluNvfp4Out<'a, G, C, S> {
    /// f32 `[1]` or `[E]` (device): the activation decode scale of every expert, or one for all.
    pub act_decode_scales: &'a G,
    /// u8 `[total_rows, I/2]`: the packed E2M1 codes.
    pub codes: &'a mut C,
    /// [`grouped_scale_len`](crate::layout::grouped_scale_len)`(total_rows, E, I)` bytes of E4M3
    /// scales (zeroed first, so padding reads 0).
    pub scales: &'a mut S,
}

impl GroupedGemm<'_, SwigluNvfp4> {
    /// Enqueues the first MoE GEMM with SwiGLU and NVFP4 quantization in the epilogue into `out`
    /// (see [`SwigluNvfp4Out`]). Rows past `expert_offsets[E]` are not written. No host
    /// synchronization; valid inside CUDA-graph capture.
    ///
    /// # Errors
    /// A buffer too small or misaligned, a decode scale count other than 1 or E, or a failed
    /// launch.
    pub fn launch_nvfp4<X, O, G, C, S>(
        &self,
        stream: &CudaStream,
        x: &X,
        total_rows: usize,
        expert_offsets: &O,
        out: SwigluNvfp4Out<'_, G, C, S>,
    ) -> Result<()>
    where
        X: DevicePtr<bf16>,
        O: DevicePtr<i32>,
        G: DevicePtr<f32>,
        C: DevicePtrMut<u8>,
        S: DevicePtrMut<u8>,
    {
        let w = self.weights;
        let SwigluNvfp4Out { act_decode_scales, codes, scales } = out;
        let l = Launch::new(stream)?;
        let (x, off, g) = (l.input(x), l.input(expert_offsets), l.input(act_decode_scales));
        let (c, sc) = (l.output(codes), l.output(scales));
        self.check(total_rows, x.info(), off.len, c.info())?;
        check_len("scales", sc.len, crate::layout::grouped_scale_len(total_rows, w.experts, w.n / 2))?;
        if g.len != 1 && g.len != w.experts {
            return Err(Error::InvalidShape(format!(
                "act_decode_scales has {} entries, expected 1 or experts = {}",
                g.len, w.experts
            )));
        }
        // Launched even with no rows: the core zeroes the scale buffer (its padding) either way.
        let r = RawLaunch {
            x: x.addr,
            total_rows,
            expert_offsets: off.addr,
            out: c.addr,
            out_scales: sc.addr,
            act_scales: (g.addr, g.len),
        };
        self.launch_raw(&l, r)
    }
}

/// Validates a grouped GEMM launch (pure; no GPU): `x` holds `total_rows x k` bf16, `out`
/// `total_rows x out_cols`, `expert_offsets` `experts + 1` entries, and both `x` and `out` are
/// 16-byte aligned (the kernel's TMA loads and vector stores need it).
///
/// # Errors
/// [`Error::InvalidShape`] (too many rows, wrong offset count), [`Error::BufferTooSmall`] or
/// [`Error::Misaligned`].
pub fn check_gemm_launch(
    experts: usize,
    k: usize,
    out_cols: usize,
    total_rows: usize,
    x: BufferInfo,
    offsets_len: usize,
    out: BufferInfo,
) -> Result<()> {
    if total_rows > i32::MAX as usize {
        return Err(Error::InvalidShape(format!("total_rows {total_rows} exceeds i32")));
    }
    check_len("x", x.len, total_rows * k)?;
    check_len("out", out.len, total_rows * out_cols)?;
    if offsets_len != experts + 1 {
        return Err(Error::InvalidShape(format!(
            "expert_offsets has {offsets_len} entries, expected experts + 1 = {}",
            experts + 1
        )));
    }
    if total_rows > 0 {
        check_align("x", x.addr, 16)?;
        check_align("out", out.addr, 16)?;
    }
    Ok(())
}

impl<E: Bf16Output> GroupedGemm<'_, E> {
    /// Enqueues `out[r, :] = epilogue(x[r, :] * W_e^T * g_e)` for the rows `r` of every expert `e`:
    /// `x` bf16 `[total_rows, k]`, `expert_offsets` i32 `[E+1]` (device; rows of expert e are
    /// `[off[e], off[e+1])`, clamped to `[0, total_rows]`), `out` bf16 `[total_rows, out_cols]`
    /// ([`Epilogue::out_cols`]). Rows past `off[E]` are not written. No host synchronization;
    /// valid inside CUDA-graph capture.
    ///
    /// # Errors
    /// As [`GroupedGemm::check`], or a failed launch ([`Error::Core`]).
    pub fn launch<X, O, F>(
        &self,
        stream: &CudaStream,
        x: &X,
        total_rows: usize,
        expert_offsets: &O,
        out: &mut F,
    ) -> Result<()>
    where
        X: DevicePtr<bf16>,
        O: DevicePtr<i32>,
        F: DevicePtrMut<bf16>,
    {
        let l = Launch::new(stream)?;
        let (x, off, out) = (l.input(x), l.input(expert_offsets), l.output(out));
        self.check(total_rows, x.info(), off.len, out.info())?;
        if total_rows == 0 {
            return Ok(());
        }
        let r = RawLaunch {
            x: x.addr,
            total_rows,
            expert_offsets: off.addr,
            out: out.addr,
            out_scales: 0,
            act_scales: (0, 0),
        };
        self.launch_raw(&l, r)
    }
}

#[cfg(test)]
mod tests;
