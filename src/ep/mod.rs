//! Expert parallelism (issue 24): one MoE layer over N ranks (GPUs, or simulated ranks on one GPU),
//! each holding a shard of the experts and a share of the step's tokens.
//!
//! A step ([`EpRunner::forward`]), from each rank's tokens (`hidden`, `topk_ids`, `topk_weights`)
//! to each rank's FP32 outputs:
//!
//! 1. **plan** (host): each rank's routing is read back and every token is assigned to the ranks
//!    holding one of its experts, once per rank, not once per slot ([`ExchangePlan`]);
//! 2. **dispatch**: each rank gathers those rows (and their routing) destination-major and an
//!    all-to-all ([`Transport`]) delivers them source-major;
//! 3. **layer**: each rank runs its expert shard ([`crate::MoeLayer::new_shard`], FP32 output) over
//!    the tokens it received with their whole routing; slots of other ranks' experts add nothing;
//! 4. **combine**: the partial FP32 rows travel back the same way and each rank adds its tokens'
//!    partials in rank order (`sum_rows_fp32`, a fixed order).
//!
//! With [`crate::MoeOptions::batch_invariant`] every expert's rows carry the bits they have in
//! the whole layer (no GEMM splits K, and without splits every tile gives the same bits), so
//! the step's outputs equal the whole layer's FP32 output up to the order of the final sum
//! (the GPU tests' bound: 1e-5 relative). Without it, each shard chooses its tiles and splits for
//! the rows it received (faster at decode; the bits then depend on the split count).
//!
//! The plan reads the routing back to the host: one synchronization of each rank's stream per
//! step (NCCL's send and receive counts are host values; a capacity-padded device-side dispatch,
//! as DeepEP's low-latency mode does, is the step that removes it). Everything after the plan is
//! enqueued without host synchronization.
//!
//! Two transports: [`Loopback`] (N simulated ranks on one GPU, the exchange as device copies: the
//! whole step tested on one GPU) and, with the `nccl` feature, `NcclTransport` (one process
//! driving N GPUs of one host through NCCL).

#[cfg(feature = "nccl")]
mod nccl;
mod plan;

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, PinnedHostSlice};
use half::bf16;

#[cfg(feature = "nccl")]
pub use nccl::NcclTransport;
pub use plan::{all_to_all_offsets, contiguous_shards, ExchangePlan, ExpertOwners};

use crate::error::{Error, Result};
use crate::ffi::raw;
use crate::launch::{check_align, check_len, Launch};
use crate::layout::ScaleLayout;
use crate::moe::{MoeInput, MoeLayer, MoeWorkspace, OutputFormat};
use crate::quantize::{dequantize_nvfp4_into, quantize_nvfp4_into, Nvfp4Desc};

/// One buffer set of an all-to-all: per rank, a send buffer (rows destination-major) and a receive
/// buffer (rows source-major), rows of `row_bytes` bytes.
#[derive(Debug)]
pub struct Lane<'a> {
    /// Bytes per row.
    pub row_bytes: usize,
    /// `send[r]`: rank `r`'s rows for every destination, destination 0's first.
    pub send: Vec<&'a CudaSlice<u8>>,
    /// `recv[r]`: the rows rank `r` receives, source 0's first.
    pub recv: Vec<&'a mut CudaSlice<u8>>,
}

/// What a dispatched token's hidden state travels as.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Payload {
    /// BF16, as the layer takes it (2 bytes per element; exact).
    Bf16,
    /// NVFP4 with this per-tensor decode scale (e.g. a checkpoint's `gate_up_proj.input_scale`):
    /// each rank quantizes its tokens once (E2M1 codes and E4M3 scales of 16 elements, NVFP4.md's
    /// recipe), sends 0.5625 bytes per element, and the receiver dequantizes to BF16 for its
    /// layer. It adds NVFP4's quantization error to the layer's input (the step equals the whole
    /// layer over the dequantized hidden states); H must be a multiple of 64.
    Nvfp4 {
        /// The decode scale g (finite, > 0).
        decode_scale: f32,
    },
}

impl Payload {
    /// Bytes one token's hidden state of `hidden` elements takes on the wire.
    pub fn row_bytes(self, hidden: usize) -> usize {
        match self {
            Payload::Bf16 => hidden * 2,
            Payload::Nvfp4 { .. } => hidden / 2 + hidden / 16,
        }
    }
}

/// How ranks exchange rows. Implementations enqueue on the ranks' streams
/// ([`Transport::stream`]) and never synchronize the host.
///
/// Ordering: every buffer of rank `r` is written and read on rank `r`'s stream, except the
/// exchange's reads of other ranks' send buffers, which [`Loopback`] orders with cudarc's
/// per-buffer events (it requires event tracking) and NCCL orders itself. A buffer's next step
/// reuses it only after the step's plan has synchronized every rank's stream.
pub trait Transport: std::fmt::Debug {
    /// Ranks N.
    fn ranks(&self) -> usize;
    /// Rank `r`'s stream: its buffers live on its device, its work runs there.
    fn stream(&self, rank: usize) -> &Arc<CudaStream>;
    /// A short name for reports (`loopback`, `nccl`).
    fn name(&self) -> &'static str;
    /// For every lane and every pair (`s`, `d`), `counts[s][d]` rows from `s`'s send buffer
    /// (offsets [`all_to_all_offsets`]) into `d`'s receive buffer, the lanes in one exchange
    /// where the transport can group them. Implementations check the lanes first
    /// ([`check_lanes`]).
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for counts or lanes not of N ranks or buffers too small for their
    /// rows (nothing enqueued); a CUDA or NCCL error.
    fn all_to_all(&self, lanes: &mut [Lane<'_>], counts: &[Vec<usize>]) -> Result<()>;
}

impl<X: Transport + ?Sized> Transport for Box<X> {
    fn ranks(&self) -> usize {
        (**self).ranks()
    }

    fn stream(&self, rank: usize) -> &Arc<CudaStream> {
        (**self).stream(rank)
    }

    fn name(&self) -> &'static str {
        (**self).name()
    }

    fn all_to_all(&self, lanes: &mut [Lane<'_>], counts: &[Vec<usize>]) -> Result<()> {
        (**self).all_to_all(lanes, counts)
    }
}

/// Checks an all-to-all's arguments for `n` ranks: `counts` is N x N, every lane has N send and N
/// receive buffers, each send buffer holds its rows for every destination and each receive buffer
/// its rows from every source (pure; what every [`Transport`] runs before enqueuing).
///
/// # Errors
/// [`Error::InvalidShape`] naming the lane and rank, or [`Error::BufferTooSmall`].
pub fn check_lanes(lanes: &[Lane<'_>], counts: &[Vec<usize>], n: usize) -> Result<()> {
    if counts.len() != n || counts.iter().any(|c| c.len() != n) {
        return Err(Error::InvalidShape(format!("an all-to-all of {n} ranks needs {n} x {n} counts")));
    }
    for (l, lane) in lanes.iter().enumerate() {
        if lane.send.len() != n || lane.recv.len() != n {
            return Err(Error::InvalidShape(format!(
                "lane {l} has {} send and {} receive buffers for {n} ranks",
                lane.send.len(),
                lane.recv.len()
            )));
        }
        for r in 0..n {
            let bytes = |rows: usize| rows.saturating_mul(lane.row_bytes);
            check_len("all-to-all send buffer", lane.send[r].len(), bytes(counts[r].iter().sum()))?;
            check_len("all-to-all receive buffer", lane.recv[r].len(), bytes(counts.iter().map(|c| c[r]).sum()))?;
        }
    }
    Ok(())
}

/// N simulated ranks on one GPU: rank `r` works on its own stream (made from `stream`'s context),
/// the exchange is device-to-device copies on the receiving rank's stream (cudarc's stream
/// ordering makes each copy wait for the sender's rows).
#[derive(Debug)]
pub struct Loopback {
    streams: Vec<Arc<CudaStream>>,
}

impl Loopback {
    /// `ranks` streams on `stream`'s device.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for 0 ranks, [`Error::Invalid`] for a context without cudarc's event
    /// tracking (the copies are ordered after the senders' gathers by the buffers' events); a CUDA
    /// error.
    pub fn new(stream: &Arc<CudaStream>, ranks: usize) -> Result<Self> {
        if ranks == 0 {
            return Err(Error::InvalidShape("a loopback transport needs at least one rank".into()));
        }
        let ctx = stream.context();
        if !ctx.is_event_tracking() {
            return Err(Error::Invalid(
                "a loopback transport orders its ranks' streams with cudarc's events: this context has event \
                 tracking disabled"
                    .into(),
            ));
        }
        let streams = (0..ranks).map(|_| ctx.new_stream()).collect::<std::result::Result<Vec<_>, _>>()?;
        Ok(Loopback { streams })
    }
}

impl Transport for Loopback {
    fn ranks(&self) -> usize {
        self.streams.len()
    }

    fn stream(&self, rank: usize) -> &Arc<CudaStream> {
        &self.streams[rank]
    }

    fn name(&self) -> &'static str {
        "loopback"
    }

    fn all_to_all(&self, lanes: &mut [Lane<'_>], counts: &[Vec<usize>]) -> Result<()> {
        check_lanes(lanes, counts, self.streams.len())?;
        for lane in lanes.iter_mut() {
            let (send_off, recv_off) = all_to_all_offsets(counts, lane.row_bytes);
            for (d, recv) in lane.recv.iter_mut().enumerate() {
                let stream = &self.streams[d];
                for (s, send) in lane.send.iter().enumerate() {
                    let bytes = counts[s][d] * lane.row_bytes;
                    if bytes == 0 {
                        continue;
                    }
                    let src = send.slice(send_off[s][d]..send_off[s][d] + bytes);
                    let mut dst = recv.slice_mut(recv_off[d][s]..recv_off[d][s] + bytes);
                    stream.memcpy_dtod(&src, &mut dst)?;
                }
            }
        }
        Ok(())
    }
}

/// One rank's part of an [`EpRunner`]: its shard, workspace and exchange buffers (bytes, sized for
/// the runner's capacity).
#[derive(Debug)]
struct Rank {
    layer: MoeLayer,
    ws: MoeWorkspace,
    /// Rows this rank sends: hidden (bf16 H), ids (i32 k), weights (f32 k), destination-major.
    send_x: CudaSlice<u8>,
    send_ids: CudaSlice<u8>,
    send_w: CudaSlice<u8>,
    /// Rows it receives, source-major.
    recv_x: CudaSlice<u8>,
    recv_ids: CudaSlice<u8>,
    recv_w: CudaSlice<u8>,
    /// Its shard's FP32 partial rows of what it received (the return trip's send buffer).
    partial: CudaSlice<u8>,
    /// The partial rows of its own tokens, back from every rank (destination-major, as sent).
    back: CudaSlice<u8>,
    /// With [`Payload::Nvfp4`]: its tokens quantized (codes, scales), those rows gathered for
    /// sending and the rows received.
    fp4: Option<Fp4Buffers>,
    /// Pinned host copies: its routing read back (`max_tokens_per_rank x max_top_k` ids) and its
    /// plan (the send index, then the return positions, `send_rows + max_tokens_per_rank x N`),
    /// so that the read-backs of all ranks are in flight together and the uploads are
    /// asynchronous.
    host_ids: PinnedHostSlice<i32>,
    host_plan: PinnedHostSlice<i32>,
    /// The plan on the device (the layout of `host_plan`).
    plan: CudaSlice<i32>,
    /// Where the return positions start in `plan` (the send index's capacity).
    plan_split: usize,
}

/// The NVFP4 payload's buffers of one rank (bytes; linear scale layout, H / 16 per row).
#[derive(Debug)]
struct Fp4Buffers {
    codes: CudaSlice<u8>,
    scales: CudaSlice<u8>,
    send_codes: CudaSlice<u8>,
    send_scales: CudaSlice<u8>,
    recv_codes: CudaSlice<u8>,
    recv_scales: CudaSlice<u8>,
}

/// What one step moved, for reports and the cost model.
#[derive(Clone, Debug, Default)]
pub struct EpStepInfo {
    /// `counts[s][d]`: tokens rank `s` sent rank `d` (its own included at `[s][s]`).
    pub counts: Vec<Vec<usize>>,
    /// Wall time of each phase, seconds: plan (routing read back, plan built, indices uploaded),
    /// dispatch (gathers and the exchange), layer (every rank's shard), combine (the return trip
    /// and the sums). Measured only with [`EpRunner::set_profile`] (every rank's stream is
    /// synchronized after each phase, which costs the overlap of a normal step); zeros otherwise
    /// but for the plan.
    pub phase_seconds: [f64; 4],
    /// Bytes of one dispatched row: its hidden state as the payload sends it, ids and weights.
    pub row_bytes: usize,
}

impl EpStepInfo {
    /// Tokens that crossed between different ranks in the dispatch (the combine returns as many).
    pub fn remote_rows(&self) -> usize {
        let n = self.counts.len();
        (0..n).flat_map(|s| (0..n).filter(move |&d| d != s).map(move |d| (s, d))).map(|(s, d)| self.counts[s][d]).sum()
    }

    /// The largest number of rows one rank received (its layer's tokens): the busiest rank.
    pub fn max_received(&self) -> usize {
        let n = self.counts.len();
        (0..n).map(|d| (0..n).map(|s| self.counts[s][d]).sum()).max().unwrap_or(0)
    }
}

/// One expert-parallel MoE layer over a [`Transport`]'s ranks: rank `r` holds `shards[r]` (an
/// expert shard of the same global layer, FP32 output) and up to `max_tokens_per_rank` tokens of
/// each step. See the module docs for the step.
///
/// Buffers are allocated once, for the worst case (every token of every rank sent to every rank
/// holding one of its experts); a step allocates only its small index arrays.
#[derive(Debug)]
pub struct EpRunner<T: Transport> {
    transport: T,
    ranks: Vec<Rank>,
    owners: ExpertOwners,
    hidden: usize,
    max_tokens_per_rank: usize,
    max_top_k: usize,
    profile: bool,
    payload: Payload,
}

impl<T: Transport> EpRunner<T> {
    /// A runner over `transport` with rank `r` running `shards[r]`: layers of the same global
    /// layer (the same global expert count, hidden size and top-k limit), FP32 output
    /// ([`OutputFormat::Fp32`]), whose expert lists partition the global experts, each made on
    /// rank `r`'s device (its weights on that device; with one rank, the whole layer may be a plain
    /// [`MoeLayer::new`]), each with `max_tokens` of at least N x `max_tokens_per_rank` (the most a
    /// rank can receive).
    ///
    /// # Errors
    /// [`Error::InvalidShape`] or [`Error::Invalid`] naming the rule a shard breaks; a CUDA error
    /// (out of memory).
    pub fn new(transport: T, shards: Vec<MoeLayer>, max_tokens_per_rank: usize) -> Result<Self> {
        let n = transport.ranks();
        // (The combine's sums take at most 1024 slots, one per rank.)
        if n == 0 || n > 1024 {
            return Err(Error::InvalidShape(format!("{n} ranks: an expert-parallel runner takes 1 to 1024")));
        }
        if shards.len() != n {
            return Err(Error::InvalidShape(format!("{} shards for {n} ranks", shards.len())));
        }
        let first = &shards[0];
        let (global, hidden) = (first.global_experts(), first.weights().hidden);
        let max_top_k = first.options().max_top_k;
        let all: Vec<usize>;
        let mut lists: Vec<&[usize]> = Vec::with_capacity(n);
        for (r, layer) in shards.iter().enumerate() {
            let o = layer.options();
            if layer.global_experts() != global || layer.weights().hidden != hidden || o.max_top_k != max_top_k {
                return Err(Error::InvalidShape(format!(
                    "shard {r} is of another layer: (global experts, hidden, max_top_k) = {:?}, shard 0's {:?}",
                    (layer.global_experts(), layer.weights().hidden, o.max_top_k),
                    (global, hidden, max_top_k)
                )));
            }
            if o.output != OutputFormat::Fp32 {
                return Err(Error::Invalid(format!(
                    "shard {r} writes {:?}: an expert-parallel step adds FP32 partial sums (MoeOptions::output = Fp32)",
                    o.output
                )));
            }
            if max_tokens_per_rank.checked_mul(n).is_none_or(|m| m > o.max_tokens) {
                return Err(Error::InvalidShape(format!(
                    "shard {r} takes {} tokens, a rank may receive {n} x {max_tokens_per_rank}",
                    o.max_tokens
                )));
            }
        }
        if n == 1 && first.shard_expert_ids().is_none() {
            all = (0..global).collect();
            lists.push(&all);
        } else {
            for (r, layer) in shards.iter().enumerate() {
                lists.push(layer.shard_expert_ids().ok_or_else(|| {
                    Error::Invalid(format!("layer {r} is a whole layer: each of several ranks needs an expert shard"))
                })?);
            }
        }
        let owners = ExpertOwners::new(global, &lists)?;
        let mut ranks = Vec::with_capacity(n);
        let per_rank = max_tokens_per_rank;
        let (send_rows, recv_rows) = (per_rank * n.min(max_top_k), per_rank * n);
        let (x_bytes, meta_bytes, out_bytes) = (hidden * 2, max_top_k * 4, hidden * 4);
        for (r, layer) in shards.into_iter().enumerate() {
            let s = transport.stream(r);
            if s.context().ordinal() != layer.weights().w13.home_stream().context().ordinal() {
                return Err(Error::Invalid(format!(
                    "shard {r}'s weights are on device {}, rank {r}'s stream on device {}",
                    layer.weights().w13.home_stream().context().ordinal(),
                    s.context().ordinal()
                )));
            }
            let alloc = |bytes: usize| s.alloc_zeros::<u8>(bytes.max(16));
            ranks.push(Rank {
                ws: layer.workspace(s)?,
                send_x: alloc(send_rows * x_bytes)?,
                send_ids: alloc(send_rows * meta_bytes)?,
                send_w: alloc(send_rows * meta_bytes)?,
                recv_x: alloc(recv_rows * x_bytes)?,
                recv_ids: alloc(recv_rows * meta_bytes)?,
                recv_w: alloc(recv_rows * meta_bytes)?,
                partial: alloc(recv_rows * out_bytes)?,
                back: alloc(send_rows * out_bytes)?,
                fp4: None,
                // SAFETY: pinned buffers of i32 (plain data), written before they are read.
                // (Not write-combined, as alloc_pinned's memory is: the CPU reads these ids.)
                host_ids: unsafe { s.context().alloc_pinned_with_flags::<i32>((per_rank * max_top_k).max(1), 0)? },
                host_plan: unsafe { s.context().alloc_pinned::<i32>(send_rows + per_rank * n)? },
                plan: s.alloc_zeros::<i32>(send_rows + per_rank * n)?,
                plan_split: send_rows,
                layer,
            });
        }
        Ok(EpRunner {
            transport,
            ranks,
            owners,
            hidden,
            max_tokens_per_rank,
            max_top_k,
            profile: false,
            payload: Payload::Bf16,
        })
    }

    /// With `true`, every step synchronizes all ranks after each phase and reports the phases'
    /// wall times ([`EpStepInfo::phase_seconds`]), for benches.
    pub fn set_profile(&mut self, on: bool) {
        self.profile = on;
    }

    /// Sends hidden states as `payload` from the next step on (the default is [`Payload::Bf16`]);
    /// allocates the NVFP4 payload's buffers on each rank the first time it is asked for.
    ///
    /// # Errors
    /// [`Error::InvalidDecodeScale`] for a bad decode scale, [`Error::InvalidShape`] for an NVFP4
    /// payload with H not a multiple of 64 (its scale rows must be whole 4-byte words); a CUDA
    /// error (out of memory).
    pub fn set_payload(&mut self, payload: Payload) -> Result<()> {
        if let Payload::Nvfp4 { decode_scale } = payload {
            crate::host::validate_decode_scale(decode_scale)?;
            let h = self.hidden;
            if !h.is_multiple_of(64) {
                return Err(Error::InvalidShape(format!(
                    "an NVFP4 payload needs a hidden size that is a multiple of 64, not {h}"
                )));
            }
            let n = self.ranks.len();
            let per_rank = self.max_tokens_per_rank;
            let (send_rows, recv_rows) = (per_rank * n.min(self.max_top_k), per_rank * n);
            for (r, rank) in self.ranks.iter_mut().enumerate() {
                if rank.fp4.is_some() {
                    continue;
                }
                let s = self.transport.stream(r);
                let alloc = |bytes: usize| s.alloc_zeros::<u8>(bytes.max(16));
                rank.fp4 = Some(Fp4Buffers {
                    codes: alloc(per_rank * h / 2)?,
                    scales: alloc(per_rank * h / 16)?,
                    send_codes: alloc(send_rows * h / 2)?,
                    send_scales: alloc(send_rows * h / 16)?,
                    recv_codes: alloc(recv_rows * h / 2)?,
                    recv_scales: alloc(recv_rows * h / 16)?,
                });
            }
        }
        self.payload = payload;
        Ok(())
    }

    /// What hidden states travel as.
    pub fn payload(&self) -> Payload {
        self.payload
    }

    /// With profiling on: waits for every rank and returns the seconds since `*since`, restarting it.
    fn lap(&self, since: &mut Instant) -> Result<f64> {
        if !self.profile {
            return Ok(0.0);
        }
        self.synchronize()?;
        let now = Instant::now();
        let secs = now.duration_since(*since).as_secs_f64();
        *since = now;
        Ok(secs)
    }

    /// The transport (its streams are the ranks').
    pub fn transport(&self) -> &T {
        &self.transport
    }

    /// Which rank holds each global expert.
    pub fn owners(&self) -> &ExpertOwners {
        &self.owners
    }

    /// Rank `r`'s shard.
    ///
    /// # Panics
    /// For `rank` not below the rank count.
    pub fn layer(&self, rank: usize) -> &MoeLayer {
        &self.ranks[rank].layer
    }

    /// One step: rank `r`'s tokens `inputs[r]` (on rank `r`'s device, the same `top_k` for every
    /// rank) into `outs[r]` f32 `[tokens_r, H]`, each row the sum of the partial rows of the ranks
    /// holding the token's experts, added in rank order (every row is written: the shards hold
    /// every expert). Synchronizes each rank's stream once (the plan reads the routing back);
    /// the rest is enqueued on the ranks' streams.
    ///
    /// Every buffer of rank `r` must be on rank `r`'s device (its home stream's device).
    ///
    /// # Errors
    /// Before anything is enqueued: a rank count, token count or top-k out of range, a buffer on
    /// another device than its rank's ([`Error::Invalid`]), too small ([`Error::BufferTooSmall`]) or
    /// misaligned ([`Error::Misaligned`]: `hidden` 4 bytes,
    /// 16 with an NVFP4 payload; ids and weights 4; `out` 16), an expert id outside `[0, E)`
    /// ([`Error::Invalid`], named by rank, token and slot); then a failed launch or exchange.
    pub fn forward<H, I, W>(
        &mut self,
        inputs: &[MoeInput<'_, H, I, W>],
        outs: &mut [CudaSlice<f32>],
    ) -> Result<EpStepInfo>
    where
        H: DevicePtr<bf16>,
        I: DevicePtr<i32>,
        W: DevicePtr<f32>,
    {
        let n = self.ranks.len();
        if inputs.len() != n || outs.len() != n {
            return Err(Error::InvalidShape(format!(
                "{} inputs and {} outputs for {n} ranks",
                inputs.len(),
                outs.len()
            )));
        }
        let top_k = inputs[0].top_k;
        let h = self.hidden;
        for (r, (input, out)) in inputs.iter().zip(outs.iter()).enumerate() {
            if input.top_k != top_k || top_k == 0 || top_k > self.max_top_k {
                return Err(Error::InvalidShape(format!(
                    "rank {r}: top_k {} (every rank's must be the same, in 1..={})",
                    input.top_k, self.max_top_k
                )));
            }
            if input.tokens > self.max_tokens_per_rank {
                return Err(Error::InvalidShape(format!(
                    "rank {r}: {} tokens exceed max_tokens_per_rank {}",
                    input.tokens, self.max_tokens_per_rank
                )));
            }
            check_len("hidden", input.hidden.len(), input.tokens * h)?;
            check_len("topk_ids", input.topk_ids.len(), input.tokens * top_k)?;
            check_len("topk_weights", input.topk_weights.len(), input.tokens * top_k)?;
            check_len("out", out.len(), input.tokens * h)?;
            // Each buffer on its rank's device (a buffer of another device would fault the kernels
            // that read it; its home stream tells its device without a driver call).
            let device = self.transport.stream(r).context().ordinal();
            for (what, on) in [
                ("hidden", input.hidden.stream().context().ordinal()),
                ("topk_ids", input.topk_ids.stream().context().ordinal()),
                ("topk_weights", input.topk_weights.stream().context().ordinal()),
                ("out", out.stream().context().ordinal()),
            ] {
                if on != device {
                    return Err(Error::Invalid(format!(
                        "rank {r}: {what} is on device {on}, the rank's stream on device {device}"
                    )));
                }
            }
            if input.tokens > 0 {
                // The gathers copy 4-byte words; the NVFP4 quantizer reads 16-byte vectors; the
                // sums write float4.
                let hidden_align = if matches!(self.payload, Payload::Nvfp4 { .. }) { 16 } else { 4 };
                let s = self.transport.stream(r);
                check_align("hidden", input.hidden.device_ptr(s).0, hidden_align)?;
                check_align("topk_ids", input.topk_ids.device_ptr(s).0, 4)?;
                check_align("topk_weights", input.topk_weights.device_ptr(s).0, 4)?;
                check_align("out", out.device_ptr(s).0, 16)?;
            }
        }

        // 1. The plan (host): every rank's routing read back (the copies of all ranks in flight
        // together, into pinned memory), the plan built, its indices uploaded asynchronously.
        let started = Instant::now();
        for (r, (rank, input)) in self.ranks.iter_mut().zip(inputs).enumerate() {
            let s = self.transport.stream(r);
            let pairs = input.tokens * top_k;
            if pairs == 0 {
                continue;
            }
            s.context().bind_to_thread()?;
            // (The pinned buffer's own event is never recorded: nothing else writes it.)
            let host = &mut rank.host_ids.as_mut_slice()?[..pairs];
            let (src, _read) = input.topk_ids.device_ptr(s);
            // SAFETY: `topk_ids` holds at least `pairs` ids (checked above), `host` exactly
            // `pairs`; the copy is waited for below before `host` is read or written again.
            unsafe { cudarc::driver::result::memcpy_dtoh_async(host, src, s.cu_stream())? };
        }
        let mut ids = Vec::with_capacity(n);
        for (r, (rank, input)) in self.ranks.iter_mut().zip(inputs).enumerate() {
            self.transport.stream(r).synchronize()?;
            ids.push(rank.host_ids.as_slice()?[..input.tokens * top_k].to_vec());
        }
        let plan = ExchangePlan::new(&self.owners, &ids, top_k)?;
        for (r, rank) in self.ranks.iter_mut().enumerate() {
            let s = self.transport.stream(r);
            let (index, pos) = (plan.send_index(r), plan.return_pos(r));
            let split = rank.plan_split;
            if index.len() > split || split + pos.len() > rank.host_plan.len() {
                return Err(capacity("plan"));
            }
            let host = rank.host_plan.as_mut_slice()?;
            host[..index.len()].copy_from_slice(index);
            host[split..split + pos.len()].copy_from_slice(pos);
            let used = split + pos.len();
            s.context().bind_to_thread()?;
            let (dst, _written) = rank.plan.device_ptr_mut(s);
            // SAFETY: `plan` holds the host buffer's length; the pinned host bytes are not
            // written again before this stream's next read-back synchronization (next step).
            unsafe { cudarc::driver::result::memcpy_htod_async(dst, &host[..used], s.cu_stream())? };
        }
        let mut phase = [started.elapsed().as_secs_f64(), 0.0, 0.0, 0.0];
        let mut since = Instant::now();
        self.lap(&mut since)?;

        // 2. Dispatch: gather each rank's rows destination-major (quantized first for an NVFP4
        // payload), exchange.
        let meta = top_k * 4;
        let payload = self.payload;
        for (r, (rank, input)) in self.ranks.iter_mut().zip(inputs).enumerate() {
            let s = self.transport.stream(r);
            let rows = plan.sent(r);
            let (t, index) = (input.tokens, rank.plan.slice(..rank.plan_split));
            match (payload, rank.fp4.as_mut()) {
                (Payload::Nvfp4 { decode_scale }, Some(q)) => {
                    let desc = Nvfp4Desc { rows: t, cols: h, layout: ScaleLayout::Linear, decode_scale };
                    quantize_nvfp4_into(s, input.hidden, desc, &mut q.codes, &mut q.scales)?;
                    gather(s, &q.codes, t, &index, rows, h / 2, &mut q.send_codes)?;
                    gather(s, &q.scales, t, &index, rows, h / 16, &mut q.send_scales)?;
                }
                _ => gather(s, input.hidden, t, &index, rows, h * 2, &mut rank.send_x)?,
            }
            gather(s, input.topk_ids, t, &index, rows, meta, &mut rank.send_ids)?;
            gather(s, input.topk_weights, t, &index, rows, meta, &mut rank.send_w)?;
        }
        {
            let (mut i, mut w) = (Lane::new(meta), Lane::new(meta));
            let (mut x, mut codes, mut scales) = (Lane::new(h * 2), Lane::new(h / 2), Lane::new(h / 16));
            for rank in self.ranks.iter_mut() {
                i.push(&rank.send_ids, &mut rank.recv_ids);
                w.push(&rank.send_w, &mut rank.recv_w);
                match (payload, rank.fp4.as_mut()) {
                    (Payload::Nvfp4 { .. }, Some(q)) => {
                        codes.push(&q.send_codes, &mut q.recv_codes);
                        scales.push(&q.send_scales, &mut q.recv_scales);
                    }
                    _ => x.push(&rank.send_x, &mut rank.recv_x),
                }
            }
            let mut lanes = match payload {
                Payload::Bf16 => vec![x, i, w],
                Payload::Nvfp4 { .. } => vec![codes, scales, i, w],
            };
            self.transport.all_to_all(&mut lanes, plan.counts())?;
        }
        if let Payload::Nvfp4 { decode_scale } = payload {
            for (r, rank) in self.ranks.iter_mut().enumerate() {
                let s = self.transport.stream(r);
                let rows = plan.received(r);
                let q = rank.fp4.as_ref().ok_or_else(|| capacity("NVFP4 payload"))?;
                // SAFETY: recv_x holds N x max_tokens_per_rank rows of H bf16, rows <= that.
                let mut x = unsafe { rank.recv_x.transmute_mut::<bf16>(rows * h).ok_or_else(|| capacity("recv_x"))? };
                let desc = Nvfp4Desc { rows, cols: h, layout: ScaleLayout::Linear, decode_scale };
                dequantize_nvfp4_into(s, &q.recv_codes, &q.recv_scales, desc, &mut x)?;
            }
        }
        phase[1] = self.lap(&mut since)?;

        // 3. Each rank's shard over what it received (FP32 partial sums).
        for (r, rank) in self.ranks.iter_mut().enumerate() {
            let s = self.transport.stream(r);
            let rows = plan.received(r);
            // SAFETY (of the views): each buffer holds at least N x max_tokens_per_rank rows of its
            // element type (allocated so), and `rows` <= that; the bytes are plain data.
            let (x, i, w) = unsafe {
                (
                    rank.recv_x.transmute::<bf16>(rows * h).ok_or_else(|| capacity("recv_x"))?,
                    rank.recv_ids.transmute::<i32>(rows * top_k).ok_or_else(|| capacity("recv_ids"))?,
                    rank.recv_w.transmute::<f32>(rows * top_k).ok_or_else(|| capacity("recv_w"))?,
                )
            };
            let mut p = unsafe { rank.partial.transmute_mut::<f32>(rows * h).ok_or_else(|| capacity("partial"))? };
            let input = MoeInput { hidden: &x, tokens: rows, topk_ids: &i, topk_weights: &w, top_k };
            rank.layer.forward(s, &input, &mut p, &mut rank.ws)?;
        }
        phase[2] = self.lap(&mut since)?;

        // 4. Combine: the partial rows go back the way they came, each rank adds its tokens'.
        {
            let back = plan.transposed_counts();
            let mut lane = Lane::new(h * 4);
            for rank in self.ranks.iter_mut() {
                lane.push(&rank.partial, &mut rank.back);
            }
            self.transport.all_to_all(&mut [lane], &back)?;
        }
        for (r, (rank, out)) in self.ranks.iter().zip(outs.iter_mut()).enumerate() {
            let s = self.transport.stream(r);
            let tokens = inputs[r].tokens;
            let l = Launch::new(s)?;
            let pos = rank.plan.slice(rank.plan_split..);
            let (b, p, o) = (l.input(&rank.back), l.input(&pos), l.output(out));
            // SAFETY: `back` holds plan.sent(r) rows of H f32 (positions are below that and the
            // kernel bounds them), `pos` tokens x N i32, `out` tokens x H f32 (checked above).
            unsafe {
                l.run(|st| {
                    raw::sum_rows_fp32(
                        b.addr,
                        plan.sent(r) as i64,
                        p.addr,
                        tokens as i64,
                        n as i64,
                        h as i64,
                        o.addr,
                        st,
                    )
                })?
            };
        }
        phase[3] = self.lap(&mut since)?;
        let row_bytes = payload.row_bytes(h) + 2 * meta;
        Ok(EpStepInfo { counts: plan.counts().to_vec(), phase_seconds: phase, row_bytes })
    }

    /// Waits for every rank's stream.
    ///
    /// # Errors
    /// A CUDA error (including one from earlier asynchronous work).
    pub fn synchronize(&self) -> Result<()> {
        for r in 0..self.ranks.len() {
            self.transport.stream(r).synchronize()?;
        }
        Ok(())
    }
}

impl<T: Transport> Drop for EpRunner<T> {
    /// Waits for every rank's stream: a step returns with its plan's uploads from pinned host
    /// memory possibly in flight, which must finish before that memory is freed. Errors are
    /// ignored (a drop cannot report them).
    fn drop(&mut self) {
        let _ = self.synchronize();
    }
}

impl<'a> Lane<'a> {
    fn new(row_bytes: usize) -> Self {
        Lane { row_bytes, send: Vec::new(), recv: Vec::new() }
    }

    fn push(&mut self, send: &'a CudaSlice<u8>, recv: &'a mut CudaSlice<u8>) {
        self.send.push(send);
        self.recv.push(recv);
    }
}

fn capacity(what: &str) -> Error {
    Error::Core(format!("expert-parallel buffer {what} is smaller than the step (a runner bug)"))
}

/// `dst` rows `0..rows` of `row_bytes` = `src` rows (of `src_rows`) at `index` (device i32).
fn gather<S: DevicePtr<E>, E, I: DevicePtr<i32>>(
    s: &CudaStream,
    src: &S,
    src_rows: usize,
    index: &I,
    rows: usize,
    row_bytes: usize,
    dst: &mut CudaSlice<u8>,
) -> Result<()> {
    if rows == 0 {
        return Ok(());
    }
    check_len("expert-parallel send buffer", dst.len(), rows * row_bytes)?;
    let l = Launch::new(s)?;
    let (x, i, d) = (l.input(src), l.input(index), l.output(dst));
    // SAFETY: `src` holds src_rows rows of row_bytes (the caller checked its length), `index`
    // rows i32 (the plan's send list), `dst` rows rows (checked above); the kernel bounds the
    // index values by src_rows.
    unsafe { l.run(|st| raw::gather_rows(x.addr, src_rows as i64, i.addr, rows as i64, row_bytes as i64, d.addr, st)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a step reports: rows that crossed ranks (not a rank's rows to itself), the busiest
    /// receiver, and the wire bytes of a row per payload.
    #[test]
    fn step_info_counts_remote_rows_and_the_busiest_rank() {
        let info = EpStepInfo {
            counts: vec![vec![3, 1, 0], vec![2, 5, 4], vec![0, 0, 7]],
            phase_seconds: [0.0; 4],
            row_bytes: 0,
        };
        assert_eq!(info.remote_rows(), 1 + 2 + 4);
        assert_eq!(info.max_received(), 11);
        assert_eq!(EpStepInfo::default().max_received(), 0);
        assert_eq!(Payload::Bf16.row_bytes(7168), 14336);
        assert_eq!(Payload::Nvfp4 { decode_scale: 1.0 }.row_bytes(7168), 3584 + 448);
    }

    /// The NCCL transport refuses bad device lists before touching CUDA or NCCL.
    #[cfg(feature = "nccl")]
    #[test]
    fn nccl_transport_refuses_bad_device_lists() {
        for (devices, says) in [(&[][..], "at least one device"), (&[0, 1, 0][..], "device 0 is listed twice")] {
            match NcclTransport::new(devices) {
                Err(Error::Invalid(m)) => assert!(m.contains(says), "{m:?} should say {says:?}"),
                other => panic!("{devices:?}: {:?}", other.map(|_| ())),
            }
        }
    }
}
