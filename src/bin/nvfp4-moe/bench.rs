//! `nvfp4-moe bench`: the MoE layer forward timed (CUDA-graph replays, L2 flushed) over preset
//! shapes and token counts.

use nvfp4_moe::presets::{self, Preset};
use nvfp4_moe::testing::Rng;
use serde_json::json;

use crate::check::{parse_count, parse_preset, IntermediateArg};
use crate::common::{out, print_json, usage, CliResult, Fail, Global};

pub const ABOUT: &str = "Time the MoE layer forward (CUDA graph, L2 flushed) over preset shapes and token counts";

pub const AFTER_HELP: &str = "\
For each preset: random NVFP4 weights made on the device (a 64 MiB random block replicated:
nothing large on the host), a MoeLayer sized for the largest T, and for each T balanced routing
(token t's slot j goes to expert (t * k + j) % E, weights 1/k) and random hidden states. The
forward is captured into a CUDA graph on its own stream; each of 20 replays runs after a 256 MiB
memset that flushes L2, and only the replay is timed (CUDA events). Reports the median:
  TB/s     weight bytes read / time: the active experts x 3 x H x I x 0.5625 B
  TFLOP/s  2 x T x k x 3 x H x I / time
  floor/t  max(bytes / 4.3 TB/s, flops / 795 TFLOP/s) / time (H200 measured ceilings)
--tile forces one GEMM tile for every T (auto: the library's choice per T, shown in the tile
column); --batch-invariant turns split-K off (what batch invariance costs). Progress goes to
stderr, the table (or with --json the JSON document) to stdout. Needs a CUDA GPU.

--routing balanced,uniform,skewed times each T under each routing (default balanced). balanced:
every expert exactly the same rows (+- 1). uniform: each token's k experts drawn uniformly without
replacement (seed 0x5ce70002), so the experts' rows vary as a router without preferences makes
them (binomial: ragged tiles). skewed: expert popularity proportional to 1 / rank^1.2 (the ranks a
permutation of the experts, seeded), each token's k experts drawn without replacement by
popularity (seed 0x5ce70001). Seeded routings give the same ids every run, and token t's ids do
not depend on T; TB/s counts the experts the routing reaches, so a skewed row reads fewer weight
bytes at small T. --dispatched takes balanced routing only (its expert-major layout pads every
expert to the busiest one's rows).

--dispatched also times, for each T, the pre-dispatched forward (MoeLayer::forward_dispatched)
over the same routing's rows grouped by expert: [E, M, H] with M the largest expert's rows, the
step's T x k as expected_rows; its rows carry `dispatched` in the tile column (the permuted
forward's row above it is the one to compare).

--ep N times expert parallelism instead (nvfp4_moe::ep): N ranks, rank r holding experts
r*E/N..(r+1)*E/N (random weights) and T/N of each step's T tokens (random top-k routing, weights
1/k), FP32 partial sums. Columns: step (median wall time of a whole step: routing read back,
plan, dispatch, the shards, combine, all ranks synchronized), the four phases of a profiled step
(each ends with every rank synchronized), remote (tokens that crossed ranks in the dispatch),
busiest (the most tokens one rank received), B/row (bytes of one dispatched row: its hidden
state as --payload sends it, ids and weights; nvfp4 quantizes with the step's amax / 2688 as the
decode scale and adds NVFP4's error), whole (the one-rank layer over the T tokens) and
shard (rank 0's shard over the same T tokens with the whole routing: its GEMMs' rows are its
experts' only), both the median GPU time of 20 eager forwards, each after an L2 flush. With --transport
loopback (the default) the N ranks are streams on GPU 0 sharing it: the step checks the exchange
and the shards, its time is not a multi-GPU time; --transport nccl runs rank r on GPU r (the
`nccl` feature, NCCL 2.28 or newer).

Example:
  nvfp4-moe bench --preset deepseek-v3,mixtral-8x7b --tokens 1,16,1024 --json-file layer.json
  nvfp4-moe bench --preset deepseek-v3 --tokens 8192 --routing balanced,skewed
  nvfp4-moe bench --preset deepseek-v3 --tokens 1,128,8192 --ep 8";

/// Replays timed per (preset, T).
pub const BENCH_REPS: usize = 20;

/// Bytes of the L2 flush before each timed replay.
pub const FLUSH_BYTES: usize = 256 << 20;

/// Measured H200 ceilings (shared/design/BENCHMARKS.md), as the benches use them.
const HBM_BYTES_PER_S: f64 = 4.3e12;
const BF16_FLOPS_PER_S: f64 = 795e12;

/// `--preset LIST`: distinct built-in presets.
#[derive(Clone, Debug)]
pub struct PresetList(pub Vec<Preset>);

/// `--tokens LIST`: positive token counts.
#[derive(Clone, Debug)]
pub struct TokenList(pub Vec<usize>);

/// A comma-separated list of preset names (each at most once).
pub fn parse_preset_list(s: &str) -> Result<PresetList, String> {
    let mut out: Vec<Preset> = Vec::new();
    for name in s.split(',').map(str::trim) {
        let p = parse_preset(name)?;
        if out.iter().any(|q| q.name == p.name) {
            return Err(format!("preset `{name}` given twice"));
        }
        out.push(p);
    }
    Ok(PresetList(out))
}

/// A comma-separated list of positive token counts.
pub fn parse_token_list(s: &str) -> Result<TokenList, String> {
    s.split(',').map(|v| parse_count(v).map_err(|e| format!("`{v}`: {e}"))).collect::<Result<_, _>>().map(TokenList)
}

/// The flags of `bench`.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Comma-separated presets (see `nvfp4-moe check --help`)
    #[arg(long, value_name = "LIST", default_value = "qwen3-30b-a3b", value_parser = parse_preset_list)]
    pub preset: PresetList,
    /// Comma-separated token counts
    #[arg(long, value_name = "LIST", default_value = "1,16,128,1024,8192", value_parser = parse_token_list)]
    pub tokens: TokenList,
    /// What the first GEMM hands the second: nvfp4 is packed in its epilogue and dequantized for
    /// the second (its decode scale calibrated first on up to 64 tokens)
    #[arg(long, value_enum, value_name = "F", default_value = "bf16")]
    pub intermediate: IntermediateArg,
    /// Also write the JSON document (as --json prints it) to FILE
    #[arg(long, value_name = "FILE")]
    pub json_file: Option<String>,
    /// GEMM tile of both GEMMs (auto: the library's choice per T, as a forward makes it)
    #[arg(long, value_enum, value_name = "T", default_value = "auto")]
    pub tile: crate::run::TileArg,
    /// No split-K: a token's output bits do not depend on T (MoeOptions::batch_invariant)
    #[arg(long)]
    pub batch_invariant: bool,
    /// Also time the pre-dispatched forward of each T (see below)
    #[arg(long, conflicts_with = "ep")]
    pub dispatched: bool,
    /// Comma-separated routings, each timed at every T: balanced, uniform, skewed (see below)
    #[arg(
        long,
        value_enum,
        value_name = "R",
        value_delimiter = ',',
        default_value = "balanced",
        conflicts_with = "ep"
    )]
    pub routing: Vec<RoutingArg>,
    /// Time expert parallelism over N ranks (see below) instead of the one-GPU layer
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=64))]
    pub ep: Option<u16>,
    /// The exchange of --ep: loopback (N ranks on GPU 0) or nccl (rank r on GPU r)
    #[arg(long, value_enum, value_name = "X", default_value = "loopback", requires = "ep")]
    pub transport: TransportArg,
    /// What --ep's tokens travel as: bf16, or nvfp4 (decode scale from the step's amax)
    #[arg(long, value_enum, value_name = "P", default_value = "bf16", requires = "ep")]
    pub payload: PayloadArg,
}

/// `--routing`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum RoutingArg {
    /// Slot j of token t to expert (t k + j) % E: every expert the same count +- 1
    Balanced,
    /// A token's k experts drawn uniformly without replacement (seeded): ragged counts
    Uniform,
    /// Expert popularity 1 / rank^1.2, a token's k experts drawn without replacement (seeded)
    Skewed,
}

impl RoutingArg {
    pub fn name(self) -> &'static str {
        match self {
            RoutingArg::Balanced => "balanced",
            RoutingArg::Uniform => "uniform",
            RoutingArg::Skewed => "skewed",
        }
    }

    /// The ids of `tokens` tokens (token t's do not depend on `tokens`: a prefix serves every T).
    pub fn ids(self, tokens: usize, top_k: usize, experts: usize) -> Vec<i32> {
        match self {
            RoutingArg::Balanced => balanced_ids(tokens, top_k, experts),
            RoutingArg::Uniform => uniform_ids(tokens, top_k, experts, UNIFORM_SEED),
            RoutingArg::Skewed => skewed_ids(tokens, top_k, experts, SKEW_SEED),
        }
    }
}

/// `--payload`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PayloadArg {
    /// BF16 hidden states (exact)
    Bf16,
    /// NVFP4 hidden states, 0.5625 bytes per element (adds NVFP4's error)
    Nvfp4,
}

/// `--transport`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum TransportArg {
    /// N simulated ranks on GPU 0 (device copies)
    Loopback,
    /// Rank r on GPU r through NCCL (the `nccl` feature)
    Nccl,
}

/// One timed (preset, T) of `bench --ep N`.
#[derive(Debug)]
pub struct EpRow {
    pub preset: &'static str,
    pub tokens: usize,
    pub ranks: usize,
    pub transport: &'static str,
    /// Bytes of one dispatched row (hidden state as sent, ids, weights).
    pub row_bytes: usize,
    /// Median wall time of a step, us.
    pub step_us: f64,
    /// Plan, dispatch, layer, combine of a profiled step (median each), us.
    pub phases_us: [f64; 4],
    pub remote_rows: usize,
    pub busiest_rows: usize,
    /// The one-rank layer's median GPU time of one forward after an L2 flush, us.
    pub whole_us: f64,
    /// Rank 0's shard over all T tokens, median GPU time of one forward after an L2 flush, us.
    pub shard_us: f64,
}

/// Balanced routing of `tokens` tokens: slot j of token t goes to expert `(t * k + j) % E` (the
/// k ids of a token are distinct when k <= E, and every expert gets the same count +- 1).
pub fn balanced_ids(tokens: usize, top_k: usize, experts: usize) -> Vec<i32> {
    (0..tokens * top_k).map(|p| (p % experts) as i32).collect()
}

/// Weight bytes read and FLOPs of one forward of `tokens` tokens over preset `p`.
pub fn bench_work(p: &Preset, ids: &[i32]) -> (f64, f64) {
    let mut seen = vec![false; p.experts];
    for &id in ids {
        if let Some(s) = usize::try_from(id).ok().and_then(|e| seen.get_mut(e)) {
            *s = true;
        }
    }
    let active = seen.iter().filter(|&&s| s).count() as f64;
    let hi = (p.hidden * p.intermediate) as f64;
    (active * 3.0 * hi * 0.5625, 2.0 * ids.len() as f64 * 3.0 * hi)
}

/// Expert e's popularity rank (1 = the most popular) for `--routing skewed`: a permutation of
/// 1..=E, the first draws of `rng`.
pub fn skew_ranks(experts: usize, rng: &mut Rng) -> Vec<usize> {
    let mut rank: Vec<usize> = (1..=experts).collect();
    for i in (1..experts).rev() {
        rank.swap(i, rng.below(i as u64 + 1) as usize);
    }
    rank
}

/// The popularity exponent and seed of `--routing skewed`.
pub const SKEW_EXPONENT: f64 = 1.2;
pub const SKEW_SEED: u64 = 0x5ce7_0001;

/// Skewed routing of `tokens` tokens (`--routing skewed`): expert e's popularity is 1 / r(e)^1.2,
/// r a permutation of 1..=E drawn from `seed` (so that the popular experts are spread over the
/// expert order, as in a trained router); each token's `top_k` experts are drawn without
/// replacement by popularity (`top_k` <= E). Deterministic for its arguments; token t's ids do not
/// depend on `tokens`.
pub fn skewed_ids(tokens: usize, top_k: usize, experts: usize, seed: u64) -> Vec<i32> {
    assert!(top_k <= experts, "skewed_ids: top_k {top_k} > {experts} experts");
    let mut rng = Rng::new(seed);
    let rank = skew_ranks(experts, &mut rng);
    let popularity: Vec<f64> = rank.iter().map(|&r| (r as f64).powf(-SKEW_EXPONENT)).collect();
    let total: f64 = popularity.iter().sum();
    let mut ids = Vec::with_capacity(tokens * top_k);
    let mut taken = vec![false; experts];
    for _ in 0..tokens {
        let first = ids.len();
        let mut left = total;
        for _ in 0..top_k {
            // A uniform draw over the experts not taken yet, by popularity (53 random bits).
            let mut x = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * left;
            let mut pick = None;
            for (e, &w) in popularity.iter().enumerate() {
                if taken[e] {
                    continue;
                }
                pick = Some(e); // (the last one left, should rounding run x past the end)
                if x < w {
                    break;
                }
                x -= w;
            }
            let e = pick.unwrap_or(0);
            taken[e] = true;
            left -= popularity[e];
            ids.push(e as i32);
        }
        for &e in &ids[first..] {
            taken[e as usize] = false;
        }
    }
    ids
}

/// The seed of `--routing uniform`.
pub const UNIFORM_SEED: u64 = 0x5ce7_0002;

/// Uniform routing of `tokens` tokens (`--routing uniform`): each token's `top_k` experts drawn
/// uniformly without replacement (`top_k` <= E; a partial Fisher-Yates shuffle of a permutation
/// carried from token to token). Deterministic for its arguments; token t's ids do not depend on
/// `tokens`.
pub fn uniform_ids(tokens: usize, top_k: usize, experts: usize, seed: u64) -> Vec<i32> {
    assert!(top_k <= experts, "uniform_ids: top_k {top_k} > {experts} experts");
    let mut rng = Rng::new(seed);
    let mut perm: Vec<i32> = (0..experts as i32).collect();
    let mut ids = Vec::with_capacity(tokens * top_k);
    for _ in 0..tokens {
        for j in 0..top_k {
            perm.swap(j, j + rng.below((experts - j) as u64) as usize);
        }
        ids.extend_from_slice(&perm[..top_k]);
    }
    ids
}

/// The roofline floor of `(bytes, flops)` in microseconds.
pub fn floor_us(bytes: f64, flops: f64) -> f64 {
    (bytes / HBM_BYTES_PER_S).max(flops / BF16_FLOPS_PER_S) * 1e6
}

/// One timed (preset, T) of `bench`.
#[derive(Debug)]
pub struct BenchRow {
    pub preset: &'static str,
    pub tokens: usize,
    /// The tile of the forward's first GEMM (`M128N16`, ...).
    pub tile: String,
    pub us: f64,
    pub bytes: f64,
    pub flops: f64,
    /// `--routing`'s name (`balanced`, `uniform`, `skewed`).
    pub routing: &'static str,
}

impl BenchRow {
    pub fn tbps(&self) -> f64 {
        self.bytes / (self.us * 1e-6) / 1e12
    }
    pub fn tflops(&self) -> f64 {
        self.flops / (self.us * 1e-6) / 1e12
    }
    pub fn floor_ratio(&self) -> f64 {
        floor_us(self.bytes, self.flops) / self.us
    }
}

/// The median (the upper one for an even count); NaN for none.
pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The JSON document of a bench (`--json` and `--json-file`).
pub fn bench_json(gpu: &str, intermediate: IntermediateArg, rows: &[BenchRow]) -> serde_json::Value {
    let items: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| {
            let p = presets::preset(r.preset).ok();
            json!({
                "preset": r.preset,
                "experts": p.map(|p| p.experts),
                "hidden": p.map(|p| p.hidden),
                "intermediate": p.map(|p| p.intermediate),
                "top_k": p.map(|p| p.top_k),
                "tokens": r.tokens,
                "routing": r.routing,
                "tile": r.tile,
                "us": r.us,
                "weight_bytes": r.bytes,
                "flops": r.flops,
                "tbps": r.tbps(),
                "tflops": r.tflops(),
                "floor_ratio": r.floor_ratio(),
            })
        })
        .collect();
    json!({
        "command": "bench",
        "gpu": gpu,
        "intermediate_format": intermediate.name(),
        "replays": BENCH_REPS,
        "l2_flush_bytes": FLUSH_BYTES,
        "rows": items,
    })
}

pub fn run(args: &BenchArgs, global: Global) -> CliResult {
    let (presets, tokens) = (&args.preset.0, &args.tokens.0);
    let max_t = tokens.iter().copied().max().unwrap_or(1);
    for p in presets {
        if max_t.checked_mul(p.top_k).is_none_or(|v| v > i32::MAX as usize) {
            return Err(usage("bench", format!("{max_t} tokens x top-k {} is too many for {}", p.top_k, p.name)));
        }
    }
    if let Some(n) = args.ep {
        return run_ep(args, global, usize::from(n), max_t);
    }
    if args.dispatched && args.tile == crate::run::TileArg::Warp {
        return Err(usage("bench", "--dispatched takes a tile other than warp (the warp kernel takes at most 8 rows)"));
    }
    if args.dispatched && args.routing.iter().any(|&r| r != RoutingArg::Balanced) {
        // (The expert-major layout pads every expert to the busiest one's rows: under skewed
        // routing E x ~0.9 T rows, far past the layer's workspace and the GPU's memory at large T;
        // under uniform routing past the workspace sized for T x k rows.)
        return Err(usage(
            "bench",
            "--dispatched takes balanced routing (its layout pads every expert to the busiest one)",
        ));
    }
    for (n, r) in args.routing.iter().enumerate() {
        if args.routing[..n].contains(r) {
            return Err(usage("bench", format!("--routing: `{}` given twice", r.name())));
        }
    }
    for p in presets {
        if p.top_k > p.experts {
            return Err(usage("bench", format!("{}: top-k {} exceeds its {} experts", p.name, p.top_k, p.experts)));
        }
    }
    let (gpu, rows) = gpu_run::bench(args, max_t)?;
    let doc = bench_json(&gpu, args.intermediate, &rows);
    if global.json {
        print_json(&doc);
    } else {
        out!(
            "{:<16} {:>6} {:>8} {:>10} {:>11} {:>8} {:>9} {:>8}",
            "preset",
            "T",
            "routing",
            "tile",
            "us",
            "TB/s",
            "TFLOP/s",
            "floor/t"
        );
        for r in &rows {
            out!(
                "{:<16} {:>6} {:>8} {:>10} {:>11.2} {:>8.3} {:>9.1} {:>8.2}",
                r.preset,
                r.tokens,
                r.routing,
                r.tile,
                r.us,
                r.tbps(),
                r.tflops(),
                r.floor_ratio()
            );
        }
        out!("(median of {BENCH_REPS} CUDA-graph replays, L2 flushed; floor/t = max(bytes / 4.3 TB/s, flops / 795 TFLOP/s) / time)");
    }
    if let Some(path) = &args.json_file {
        let mut s = serde_json::to_string_pretty(&doc).unwrap_or_default();
        s.push('\n');
        // The same safe writing as every other file (a temporary file renamed over the target;
        // never through a symlink or onto a device).
        nvfp4_moe::io::write_file_atomically(path, s.as_bytes()).map_err(Fail::from)?;
        tracing::info!("wrote {path} ({} rows)", rows.len());
    }
    Ok(())
}

/// `bench --ep N`.
fn run_ep(args: &BenchArgs, global: Global, n: usize, max_t: usize) -> CliResult {
    if args.intermediate != IntermediateArg::Bf16 {
        return Err(usage("bench", "--ep takes the BF16 intermediate"));
    }
    for p in &args.preset.0 {
        if n > p.experts {
            return Err(usage("bench", format!("--ep {n}: {} has only {} experts", p.name, p.experts)));
        }
    }
    let (gpu, rows) = gpu_run::bench_ep(args, n, max_t)?;
    let items: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| {
            json!({
                "preset": r.preset, "tokens": r.tokens, "ranks": r.ranks, "transport": r.transport, "row_bytes": r.row_bytes,
                "step_us": r.step_us, "plan_us": r.phases_us[0], "dispatch_us": r.phases_us[1],
                "layer_us": r.phases_us[2], "combine_us": r.phases_us[3], "remote_rows": r.remote_rows,
                "busiest_rows": r.busiest_rows, "whole_us": r.whole_us, "shard_us": r.shard_us,
            })
        })
        .collect();
    let doc = json!({
        "command": "bench", "ep": n, "gpu": gpu, "steps": BENCH_REPS, "rows": items,
        "payload": format!("{:?}", args.payload).to_lowercase(), "batch_invariant": args.batch_invariant,
    });
    if global.json {
        print_json(&doc);
    } else {
        out!(
            "{:<14} {:>5} {:>3} {:>9} {:>6} {:>9} | {:>8} {:>9} {:>9} {:>9} | {:>6} {:>7} | {:>9} {:>9}",
            "preset",
            "T",
            "N",
            "transport",
            "B/row",
            "step",
            "plan",
            "dispatch",
            "layer",
            "combine",
            "remote",
            "busiest",
            "whole",
            "shard"
        );
        for r in &rows {
            out!(
                "{:<14} {:>5} {:>3} {:>9} {:>6} {:>9.1} | {:>8.1} {:>9.1} {:>9.1} {:>9.1} | {:>6} {:>7} | {:>9.1} {:>9.1}",
                r.preset,
                r.tokens,
                r.ranks,
                r.transport,
                r.row_bytes,
                r.step_us,
                r.phases_us[0],
                r.phases_us[1],
                r.phases_us[2],
                r.phases_us[3],
                r.remote_rows,
                r.busiest_rows,
                r.whole_us,
                r.shard_us
            );
        }
        out!("(us; step: median of {BENCH_REPS} steps' wall time; phases: a profiled step's, ranks synchronized after each; whole and shard: median GPU time of {BENCH_REPS} forwards, each after an L2 flush)");
    }
    if let Some(path) = &args.json_file {
        let mut s = serde_json::to_string_pretty(&doc).unwrap_or_default();
        s.push('\n');
        nvfp4_moe::io::write_file_atomically(path, s.as_bytes()).map_err(Fail::from)?;
    }
    Ok(())
}

#[cfg(feature = "cuda")]
mod gpu_run {
    use std::sync::Arc;
    use std::time::Instant;

    use cudarc::driver::{CudaSlice, CudaStream};
    use half::bf16;
    use nvfp4_moe::ep::{contiguous_shards, EpRunner, Loopback, Payload, Transport};
    use nvfp4_moe::moe::{DispatchedInput, MoeInput, OutputFormat};
    use nvfp4_moe::testing::{random_device_weights, Rng};
    use nvfp4_moe::{Error, Intermediate, MoeLayer, MoeOptions, MoeWeights, MoeWorkspace};
    use tracing::info;

    use super::{bench_work, median, BenchArgs, BenchRow, EpRow, PayloadArg, TransportArg, BENCH_REPS, FLUSH_BYTES};
    use crate::check::IntermediateArg;
    use crate::common::{fmt_bytes, fmt_dur, progress, CliResult};
    use crate::gpu::require_gpu;

    /// One forward to time: the layer, its workspace and buffers, and the L2 flush buffer.
    struct Timed<'a> {
        stream: &'a Arc<CudaStream>,
        layer: &'a MoeLayer,
        ws: &'a mut MoeWorkspace,
        hidden: &'a CudaSlice<bf16>,
        ids: &'a CudaSlice<i32>,
        /// `ids` on the host (the pre-dispatched layout is made from them).
        host_ids: &'a [i32],
        weights: &'a CudaSlice<f32>,
        out: &'a mut CudaSlice<bf16>,
        flush: &'a mut CudaSlice<u8>,
    }

    /// Captures one forward of `tokens` tokens into a CUDA graph and returns the median replay
    /// time (us) over [`BENCH_REPS`] replays, each after an L2 flush.
    fn time_forward(f: &mut Timed<'_>, tokens: usize, top_k: usize) -> nvfp4_moe::Result<f64> {
        use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        let stream = f.stream;
        let input = MoeInput { hidden: f.hidden, tokens, topk_ids: f.ids, topk_weights: f.weights, top_k };
        stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let captured = f.layer.forward(stream, &input, f.out, f.ws);
        let graph = stream.end_capture(CUgraphInstantiate_flags(0));
        captured?;
        let graph = graph?.ok_or_else(|| Error::Invalid("capturing the forward gave an empty CUDA graph".into()))?;
        let (layer, ws) = (f.layer, &mut *f.ws);
        let us = replay_median(stream, f.flush, &graph, || layer.check(stream, ws, top_k))?;
        f.layer.check(stream, f.ws, top_k)?;
        Ok(us)
    }

    /// Uploads `graph`, replays it 3 times, runs `after_warmup`, then returns the median time (us)
    /// of [`BENCH_REPS`] replays, each after an L2 flush (`flush` zeroed).
    fn replay_median(
        stream: &Arc<CudaStream>,
        flush: &mut CudaSlice<u8>,
        graph: &cudarc::driver::CudaGraph,
        mut after_warmup: impl FnMut() -> nvfp4_moe::Result<()>,
    ) -> nvfp4_moe::Result<f64> {
        graph.upload()?;
        for _ in 0..3 {
            graph.launch()?;
        }
        after_warmup()?;
        flushed_median(stream, flush, || Ok(graph.launch()?))
    }

    /// The median time (us) of [`BENCH_REPS`] runs of `run` on `stream`, each after an L2 flush
    /// (`flush` zeroed; the memset also lets the host enqueue the run ahead of the GPU), between
    /// two events.
    fn flushed_median(
        stream: &Arc<CudaStream>,
        flush: &mut CudaSlice<u8>,
        mut run: impl FnMut() -> nvfp4_moe::Result<()>,
    ) -> nvfp4_moe::Result<f64> {
        use cudarc::driver::sys::CUevent_flags;
        let ctx = stream.context();
        let (start, end) = (
            ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?,
            ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?,
        );
        let mut times = Vec::with_capacity(BENCH_REPS);
        for _ in 0..BENCH_REPS {
            stream.memset_zeros(flush)?;
            start.record(stream)?;
            run()?;
            end.record(stream)?;
            end.synchronize()?;
            times.push(f64::from(start.elapsed_ms(&end)?) * 1e3);
        }
        Ok(median(&mut times))
    }

    /// Captures one pre-dispatched forward of the routing's first `tokens` tokens (rows grouped by
    /// expert, M the largest count) into a CUDA graph; the median replay time (us) over
    /// [`BENCH_REPS`] replays, each after an L2 flush.
    fn time_dispatched(f: &mut Timed<'_>, tokens: usize, top_k: usize, experts: usize) -> nvfp4_moe::Result<f64> {
        use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        let stream = f.stream;
        let h = f.layer.weights().hidden;
        let mut counts = vec![0i32; experts];
        for &id in &f.host_ids[..tokens * top_k] {
            counts[id as usize] += 1;
        }
        let m = counts.iter().copied().max().unwrap_or(0).max(1) as usize;
        let hidden = stream.clone_htod(&Rng::from_entropy().normal_bf16(experts * m * h, 1.0))?;
        let counts_d = stream.clone_htod(&counts)?;
        let mut out = stream.alloc_zeros::<bf16>(experts * m * h)?;
        let input = DispatchedInput {
            hidden: &hidden,
            counts: &counts_d,
            max_tokens_per_expert: m,
            expected_rows: tokens * top_k,
        };
        stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let captured = f.layer.forward_dispatched(stream, &input, &mut out, f.ws);
        let graph = stream.end_capture(CUgraphInstantiate_flags(0));
        captured?;
        let graph = graph?.ok_or_else(|| Error::Invalid("capturing the forward gave an empty CUDA graph".into()))?;
        let us = replay_median(stream, f.flush, &graph, || Ok(()))?;
        stream.synchronize()?;
        Ok(us)
    }

    pub fn bench(args: &BenchArgs, max_t: usize) -> CliResult<(String, Vec<BenchRow>)> {
        let (presets, tokens) = (&args.preset.0, &args.tokens.0);
        let gpu = require_gpu("bench")?;
        info!("bench on GPU 0 ({gpu}): {} preset(s), tokens {:?}, {BENCH_REPS} replays each", presets.len(), tokens);

        let ctx = cudarc::driver::CudaContext::new(0)?;
        // SAFETY: everything below runs on one stream, so no cross-stream synchronization is
        // needed; without event tracking nothing records an event inside the graph capture.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        let mut flush = stream.alloc_zeros::<u8>(FLUSH_BYTES)?;
        let mut rng = Rng::from_entropy();
        let mut rows = Vec::new();
        let pb = progress("bench", (presets.len() * tokens.len() * args.routing.len()) as u64, "cases");
        for p in presets {
            let (e, h, i, k) = (p.experts, p.hidden, p.intermediate, p.top_k);
            pb.set_message(format!("{}: making weights", p.name));
            let t = Instant::now();
            let w13 = random_device_weights(&stream, &mut rng, e, 2 * i, h, true)?;
            let w2 = random_device_weights(&stream, &mut rng, e, h, i, false)?;
            let weights = MoeWeights { w13, w2, experts: e, hidden: h, intermediate: i };
            let tile = args.tile.gemm_tile();
            // --dispatched: the layout's E x M rows (M = ceil(T k / E)) reach T k + E, which the
            // workspace must hold.
            let max_tokens = if args.dispatched { max_t + e.div_ceil(k) } else { max_t };
            let opts = MoeOptions { tile, batch_invariant: args.batch_invariant, ..MoeOptions::new(max_tokens, k) };
            let mut layer = MoeLayer::new(weights, opts)?;
            let mut ws = layer.workspace(&stream)?;
            let hidden = stream.clone_htod(&rng.normal_bf16(max_t * h, 1.0))?;
            // Token t's routing does not depend on T: one buffer per routing serves every T as a
            // prefix.
            let routings: Vec<(super::RoutingArg, Vec<i32>)> =
                args.routing.iter().map(|&r| (r, r.ids(max_t, k, e))).collect();
            if args.intermediate == IntermediateArg::Nvfp4 {
                // (Calibrated once per preset, over the first routing's first tokens.)
                let ids = stream.clone_htod(&routings[0].1)?;
                let g = layer.calibrate_nvfp4_scale(&stream, &hidden, max_t.min(64), &ids, k, &mut ws)?;
                info!("{}: NVFP4 intermediate, calibrated decode scale {g:.4e}", p.name);
                layer = layer.with_intermediate(Intermediate::Nvfp4 { decode_scale: g })?;
                ws = layer.workspace(&stream)?;
            }
            let weights = stream.clone_htod(&vec![1.0 / k as f32; max_t * k])?;
            let mut out = stream.alloc_zeros::<bf16>(max_t * h)?;
            stream.synchronize()?;
            info!(
                "{}: E={e} H={h} I={i} top-k={k}: {} of random weights ready in {}",
                p.name,
                fmt_bytes(p.layer_bytes()),
                fmt_dur(t.elapsed())
            );
            for (routing, host_ids) in &routings {
                let ids = stream.clone_htod(host_ids)?;
                let mut timed = Timed {
                    stream: &stream,
                    layer: &layer,
                    ws: &mut ws,
                    hidden: &hidden,
                    ids: &ids,
                    host_ids,
                    weights: &weights,
                    out: &mut out,
                    flush: &mut flush,
                };
                for &t in tokens {
                    pb.set_message(format!("{} T={t} ({})", p.name, routing.name()));
                    let us = time_forward(&mut timed, t, k)?;
                    let (bytes, flops) = bench_work(p, &host_ids[..t * k]);
                    let row = BenchRow {
                        preset: p.name,
                        tokens: t,
                        tile: format!("{:?}", layer.gemm_tiles(t, k)?.0),
                        us,
                        bytes,
                        flops,
                        routing: routing.name(),
                    };
                    info!(
                        "  {} T={t} ({}): {us:.1} us, {:.2} TB/s, {:.1} TFLOP/s, floor/t {:.2}",
                        p.name,
                        routing.name(),
                        row.tbps(),
                        row.tflops(),
                        row.floor_ratio()
                    );
                    rows.push(row);
                    if args.dispatched {
                        let us = time_dispatched(&mut timed, t, k, e)?;
                        info!("  {} T={t} ({}): pre-dispatched {us:.1} us", p.name, routing.name());
                        // (The same rows and work as the permuted forward's row above.)
                        rows.push(BenchRow {
                            preset: p.name,
                            tokens: t,
                            tile: "dispatched".into(),
                            us,
                            bytes,
                            flops,
                            routing: routing.name(),
                        });
                    }
                    pb.inc(1);
                }
            }
        }
        pb.finish_and_clear();
        Ok((gpu, rows))
    }

    /// GPU time of one forward of `f` (us): 3 warm-up runs, then the median of [`BENCH_REPS`] runs,
    /// each after an L2 flush ([`flushed_median`]). (Not back to back: a forward repeated over the
    /// same routing finds a small expert set's weights in L2, e.g. one deepseek-v3 expert's 25 MB
    /// at T = 1.)
    fn time_flushed(
        stream: &Arc<CudaStream>,
        flush: &mut CudaSlice<u8>,
        mut f: impl FnMut() -> nvfp4_moe::Result<()>,
    ) -> nvfp4_moe::Result<f64> {
        for _ in 0..3 {
            f()?;
        }
        flushed_median(stream, flush, f)
    }

    /// The ranks' transport of `--transport`.
    fn transport(arg: TransportArg, stream: &Arc<CudaStream>, n: usize) -> CliResult<Box<dyn Transport>> {
        match arg {
            TransportArg::Loopback => Ok(Box::new(Loopback::new(stream, n)?)),
            #[cfg(feature = "nccl")]
            TransportArg::Nccl => Ok(Box::new(nvfp4_moe::ep::NcclTransport::new(&(0..n).collect::<Vec<_>>())?)),
            #[cfg(not(feature = "nccl"))]
            TransportArg::Nccl => Err(crate::common::Fail::Run(
                "--transport nccl needs a build with the `nccl` feature (cargo build --features nccl)".into(),
            )),
        }
    }

    pub fn bench_ep(args: &BenchArgs, n: usize, max_t: usize) -> CliResult<(String, Vec<EpRow>)> {
        let (presets, tokens) = (&args.preset.0, &args.tokens.0);
        let gpu = require_gpu("bench")?;
        let ctx = cudarc::driver::CudaContext::new(0)?;
        let stream = ctx.new_stream()?;
        let mut flush = stream.alloc_zeros::<u8>(FLUSH_BYTES)?;
        let mut rng = Rng::from_entropy();
        let mut rows = Vec::new();
        let per_rank_max = max_t.div_ceil(n);
        info!("bench --ep {n} on {gpu}: {} preset(s), tokens {:?}, {BENCH_REPS} steps each", presets.len(), tokens);
        let pb = progress("bench", (presets.len() * tokens.len()) as u64, "cases");
        for p in presets {
            let (e, h, i, k) = (p.experts, p.hidden, p.intermediate, p.top_k);
            let tile = args.tile.gemm_tile();
            let opts = |max_tokens: usize| MoeOptions {
                tile,
                batch_invariant: args.batch_invariant,
                output: OutputFormat::Fp32,
                ..MoeOptions::new(max_tokens, k)
            };
            pb.set_message(format!("{}: making weights", p.name));
            let tr = transport(args.transport, &stream, n)?;
            let shards = contiguous_shards(e, n);
            let mut layers = Vec::with_capacity(n);
            for (r, ids) in shards.iter().enumerate() {
                let s = tr.stream(r);
                let w13 = random_device_weights(s, &mut rng, ids.len(), 2 * i, h, true)?;
                let w2 = random_device_weights(s, &mut rng, ids.len(), h, i, false)?;
                let w = MoeWeights { w13, w2, experts: ids.len(), hidden: h, intermediate: i };
                layers.push(MoeLayer::new_shard(w, opts(per_rank_max * n), e, ids)?);
            }
            let mut runner = EpRunner::new(tr, layers, per_rank_max)?;
            // (Rank 0's flush buffer, on its stream, for its shard's timing.)
            let mut flush0 = runner.transport().stream(0).alloc_zeros::<u8>(FLUSH_BYTES)?;
            // The one-rank layer over the same tokens, on GPU 0.
            let w13 = random_device_weights(&stream, &mut rng, e, 2 * i, h, true)?;
            let w2 = random_device_weights(&stream, &mut rng, e, h, i, false)?;
            let whole = MoeLayer::new(MoeWeights { w13, w2, experts: e, hidden: h, intermediate: i }, opts(max_t))?;
            let mut whole_ws = whole.workspace(&stream)?;
            for &t in tokens {
                pb.set_message(format!("{} T={t} --ep {n}", p.name));
                // Random top-k (distinct experts per token), uniform weights; T split over ranks.
                let mut ids = Vec::with_capacity(t * k);
                for _ in 0..t {
                    let mut row: Vec<i32> = Vec::with_capacity(k);
                    while row.len() < k {
                        let id = rng.below(e as u64) as i32;
                        if !row.contains(&id) {
                            row.push(id);
                        }
                    }
                    ids.extend(row);
                }
                let hidden = rng.normal_bf16(t * h, 1.0);
                let wts = vec![1.0 / k as f32; t * k];
                let bounds: Vec<usize> = (0..=n).map(|r| r * t / n).collect();
                let mut inputs_dev = Vec::with_capacity(n);
                let mut outs = Vec::with_capacity(n);
                for r in 0..n {
                    let s = runner.transport().stream(r);
                    let (a, b) = (bounds[r], bounds[r + 1]);
                    inputs_dev.push((
                        s.clone_htod(&nonempty(&hidden[a * h..b * h]))?,
                        s.clone_htod(&nonempty(&ids[a * k..b * k]))?,
                        s.clone_htod(&nonempty(&wts[a * k..b * k]))?,
                        b - a,
                    ));
                    outs.push(s.alloc_zeros::<f32>(((b - a) * h).max(1))?);
                }
                if args.payload == PayloadArg::Nvfp4 {
                    // The decode scale of the step's tokens (ModelOpt's input_scale recipe).
                    let amax = hidden.iter().map(|v| v.to_f32().abs()).filter(|v| v.is_finite()).fold(0f32, f32::max);
                    runner
                        .set_payload(Payload::Nvfp4 { decode_scale: (amax / (6.0 * 448.0)).max(f32::MIN_POSITIVE) })?;
                }
                let inputs: Vec<MoeInput<'_, _, _, _>> = inputs_dev
                    .iter()
                    .map(|(x, i, w, tk)| MoeInput { hidden: x, tokens: *tk, topk_ids: i, topk_weights: w, top_k: k })
                    .collect();
                for _ in 0..2 {
                    runner.forward(&inputs, &mut outs)?;
                }
                runner.synchronize()?;
                let mut steps = Vec::with_capacity(BENCH_REPS);
                let mut info_last = None;
                for _ in 0..BENCH_REPS {
                    let t0 = Instant::now();
                    let info = runner.forward(&inputs, &mut outs)?;
                    runner.synchronize()?;
                    steps.push(t0.elapsed().as_secs_f64() * 1e6);
                    info_last = Some(info);
                }
                runner.set_profile(true);
                let mut phases: [Vec<f64>; 4] = Default::default();
                for _ in 0..BENCH_REPS {
                    let info = runner.forward(&inputs, &mut outs)?;
                    for (v, s) in phases.iter_mut().zip(info.phase_seconds) {
                        v.push(s * 1e6);
                    }
                }
                runner.set_profile(false);
                let info = info_last.unwrap_or_default();
                // The whole layer and rank 0's shard over all T tokens (device copies on GPU 0 /
                // rank 0's device).
                let (xd, idd, wd) = (stream.clone_htod(&hidden)?, stream.clone_htod(&ids)?, stream.clone_htod(&wts)?);
                let mut out = stream.alloc_zeros::<f32>(t * h)?;
                let input = MoeInput { hidden: &xd, tokens: t, topk_ids: &idd, topk_weights: &wd, top_k: k };
                let whole_us =
                    time_flushed(&stream, &mut flush, || whole.forward(&stream, &input, &mut out, &mut whole_ws))?;
                let s0 = runner.transport().stream(0).clone();
                let (xs, ids0, ws0) = (s0.clone_htod(&hidden)?, s0.clone_htod(&ids)?, s0.clone_htod(&wts)?);
                let mut out0 = s0.alloc_zeros::<f32>(t * h)?;
                let shard = runner.layer(0);
                let mut shard_ws = shard.workspace(&s0)?;
                let input0 = MoeInput { hidden: &xs, tokens: t, topk_ids: &ids0, topk_weights: &ws0, top_k: k };
                let shard_us =
                    time_flushed(&s0, &mut flush0, || shard.forward(&s0, &input0, &mut out0, &mut shard_ws))?;
                let row = EpRow {
                    preset: p.name,
                    tokens: t,
                    ranks: n,
                    transport: runner.transport().name(),
                    row_bytes: info.row_bytes,
                    step_us: median(&mut steps),
                    phases_us: phases.map(|mut v| median(&mut v)),
                    remote_rows: info.remote_rows(),
                    busiest_rows: info.max_received(),
                    whole_us,
                    shard_us,
                };
                info!(
                    "  {} T={t} --ep {n}: step {:.1} us, whole {:.1} us, shard {:.1} us",
                    p.name, row.step_us, row.whole_us, row.shard_us
                );
                rows.push(row);
                pb.inc(1);
            }
        }
        pb.finish_and_clear();
        Ok((gpu, rows))
    }

    /// `v`, or one default element for an empty slice (a rank with no tokens still passes buffers).
    fn nonempty<T: Clone + Default>(v: &[T]) -> Vec<T> {
        if v.is_empty() {
            vec![T::default()]
        } else {
            v.to_vec()
        }
    }
}

#[cfg(not(feature = "cuda"))]
mod gpu_run {
    use super::{BenchArgs, BenchRow};
    use crate::common::CliResult;
    use crate::gpu::require_gpu;

    pub fn bench(_: &BenchArgs, _: usize) -> CliResult<(String, Vec<BenchRow>)> {
        Err(require_gpu("bench").unwrap_err())
    }

    pub fn bench_ep(_: &BenchArgs, _: usize, _: usize) -> CliResult<(String, Vec<super::EpRow>)> {
        Err(require_gpu("bench").unwrap_err())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists() {
        assert_eq!(parse_token_list("1,16,128,1024,8192").unwrap().0, vec![1, 16, 128, 1024, 8192]);
        assert_eq!(parse_token_list(" 3 , 5").unwrap().0, vec![3, 5]);
        for bad in ["", "0", "1,,2", "1,-2", "x", "1.5", "4,0"] {
            assert!(parse_token_list(bad).is_err(), "{bad}");
        }
        let ps = parse_preset_list("qwen3-30b-a3b,gpt-oss-120b").unwrap().0;
        assert_eq!(ps.iter().map(|p| p.name).collect::<Vec<_>>(), ["qwen3-30b-a3b", "gpt-oss-120b"]);
        assert_eq!(ps[1].hidden, 2880);
        let e = parse_preset_list("qwen3-30b-a3b,llama").unwrap_err();
        assert!(e.contains("unknown preset `llama`") && e.contains("deepseek-v3") && e.contains("kimi-k2"), "{e}");
        assert!(parse_preset_list("kimi-k2,kimi-k2").unwrap_err().contains("twice"));
    }

    /// A seeded routing's ids for (t, k, e), checked for what every seeded routing promises: the
    /// CLI's routing gives them, token i's ids do not depend on T, the seed matters, and with
    /// k = E every token gets every expert once.
    fn seeded_ids(
        ids_of: fn(usize, usize, usize, u64) -> Vec<i32>,
        arg: RoutingArg,
        seed: u64,
        t: usize,
        k: usize,
        e: usize,
    ) -> Vec<i32> {
        let ids = ids_of(t, k, e, seed);
        assert_eq!(ids, arg.ids(t, k, e));
        assert_eq!(&ids_of(100, k, e, seed)[..], &ids[..100 * k], "token t's ids depend on T");
        assert_ne!(ids_of(100, k, e, seed + 1), &ids[..100 * k], "the seed is ignored");
        for tok in ids_of(5, 4, 4, 7).chunks(4) {
            let mut s = tok.to_vec();
            s.sort();
            assert_eq!(s, [0, 1, 2, 3]);
        }
        ids
    }

    /// Each expert's rows under `ids` (k per token), asserting that a token's k ids are distinct
    /// experts in [0, e).
    fn expert_counts(ids: &[i32], k: usize, e: usize) -> Vec<usize> {
        let mut counts = vec![0usize; e];
        for tok in ids.chunks(k) {
            let mut s = tok.to_vec();
            s.sort();
            s.dedup();
            assert_eq!(s.len(), k, "{tok:?}");
            for &id in tok {
                assert!((0..e as i32).contains(&id));
                counts[id as usize] += 1;
            }
        }
        counts
    }

    /// `--routing uniform`: seeded and repeatable, distinct ids per token, T-independent tokens,
    /// every expert reached with counts spread as binomial draws (ragged, unlike balanced).
    #[test]
    fn uniform_routing() {
        let (t, k, e) = (8192usize, 8usize, 256usize);
        let ids = seeded_ids(uniform_ids, RoutingArg::Uniform, UNIFORM_SEED, t, k, e);
        let counts = expert_counts(&ids, k, e);
        // Mean 256 rows per expert, binomial sd ~15.75: the counts within +-6 sd, and spread (a
        // balanced routing's are all 256).
        let mean = (t * k / e) as f64;
        let sd = (counts.iter().map(|&c| (c as f64 - mean).powi(2)).sum::<f64>() / e as f64).sqrt();
        assert!(counts.iter().all(|&c| (c as f64 - mean).abs() < 6.0 * 16.0), "{counts:?}");
        assert!((8.0..24.0).contains(&sd), "sd {sd}");
        assert!(counts.iter().filter(|&&c| c > 256).count() > e / 4, "few experts past one 256-row tile");
    }

    /// `--routing skewed`: seeded and repeatable, distinct ids per token, T-independent tokens,
    /// popularity falling with rank (the counts of the experts in rank order, by decile), the work
    /// counting only the experts it routes to.
    #[test]
    fn skewed_routing() {
        let (t, k, e) = (4096usize, 8usize, 256usize);
        let ids = seeded_ids(skewed_ids, RoutingArg::Skewed, SKEW_SEED, t, k, e);
        let counts = expert_counts(&ids, k, e);
        // By popularity rank (the seed's permutation): 1 / r^1.2 over 256 experts, 8 drawn without
        // replacement, gives rank 1 ~93% of the tokens, rank 26 ~220, rank 128 ~33 and rank 256
        // ~7 of 4096 (a simulation of the same rule); each rank decile's mean count below the last.
        let rank = skew_ranks(e, &mut Rng::new(SKEW_SEED));
        let mut by_rank = vec![0usize; e];
        for (x, &r) in rank.iter().enumerate() {
            by_rank[r - 1] = counts[x];
        }
        assert!(by_rank[0] > t * 8 / 10, "rank 1: {}", by_rank[0]);
        assert!(by_rank[0] > 50 * by_rank[e / 2], "rank 1 {} vs rank {} {}", by_rank[0], e / 2 + 1, by_rank[e / 2]);
        let deciles: Vec<f64> =
            by_rank.chunks(e.div_ceil(10)).map(|c| c.iter().sum::<usize>() as f64 / c.len() as f64).collect();
        assert!(deciles.windows(2).all(|w| w[0] > w[1]), "decile means {deciles:?}");
        // The work follows the routing: its active experts only.
        let p = presets::preset("deepseek-v3").unwrap();
        let one = skewed_ids(1, 8, 256, SKEW_SEED);
        assert_eq!(bench_work(&p, &one).0, 8.0 * 3.0 * 7168.0 * 2048.0 * 0.5625);
        let (b, _) = bench_work(&p, &ids[..16 * 8]);
        let active = {
            let mut s = ids[..16 * 8].to_vec();
            s.sort();
            s.dedup();
            s.len()
        };
        assert!(active < 16 * 8, "16 skewed tokens share experts");
        assert_eq!(b, active as f64 * 3.0 * 7168.0 * 2048.0 * 0.5625);
    }

    #[test]
    fn balanced_routing_and_bench_metrics() {
        let ids = balanced_ids(5, 3, 4);
        assert_eq!(ids, vec![0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2]);
        // Distinct ids per token and counts within one of each other.
        let (t, k, e) = (37usize, 8usize, 128usize);
        let ids = balanced_ids(t, k, e);
        for tok in ids.chunks(k) {
            let mut s = tok.to_vec();
            s.sort();
            s.dedup();
            assert_eq!(s.len(), k);
        }
        let p = presets::preset("deepseek-v3").unwrap();
        // T = 1: 8 active experts.
        let (b, f) = bench_work(&p, &balanced_ids(1, 8, 256));
        assert_eq!(b, 8.0 * 3.0 * 7168.0 * 2048.0 * 0.5625);
        assert_eq!(f, 2.0 * 8.0 * 3.0 * 7168.0 * 2048.0);
        // T = 1024: every expert active.
        let (b, f) = bench_work(&p, &balanced_ids(1024, 8, 256));
        assert_eq!(b, 256.0 * 3.0 * 7168.0 * 2048.0 * 0.5625);
        assert_eq!(f, 2.0 * 8192.0 * 3.0 * 7168.0 * 2048.0);
        assert!((floor_us(4.3e12, 0.0) - 1e6).abs() < 1e-6);
        assert!((floor_us(0.0, 795e12) - 1e6).abs() < 1e-6);
        let r = BenchRow {
            preset: p.name,
            tokens: 1,
            tile: "M128N16".into(),
            us: 1e6,
            bytes: 2.15e12,
            flops: 795e12,
            routing: "balanced",
        };
        assert!((r.tbps() - 2.15).abs() < 1e-9 && (r.tflops() - 795.0).abs() < 1e-9);
        assert!((r.floor_ratio() - 1.0).abs() < 1e-9);
        let json = bench_json("H200", IntermediateArg::Bf16, &[r]);
        let json: serde_json::Value = serde_json::from_str(&json.to_string()).unwrap();
        assert_eq!(json["command"], "bench");
        assert_eq!(json["replays"], 20);
        assert_eq!(json["intermediate_format"], "bf16");
        assert_eq!(json["rows"][0]["preset"], "deepseek-v3");
        assert_eq!(json["rows"][0]["experts"], 256);
        assert_eq!(json["rows"][0]["tokens"], 1);
        assert_eq!(json["rows"][0]["tile"], "M128N16");
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 3.0);
    }
}
