//! The NVFP4 grouped GEMM at MoE shapes, the GEMM table of issue 14: L1 (n = 2I, k = H) with the
//! layer's default `SwigluBf16` epilogue ([rows, I] out) and L2 (n = H, k = I) with `PlainBf16`,
//! for every built-in preset (`nvfp4_moe::presets::PRESETS`), T in {1, 16, 128, 1024, 8192}
//! tokens x top-k rows, balanced routing.
//!
//! Timing: a CUDA graph of 10 pairs (an L2 flush, then the GEMM) minus a graph of the 10 flushes
//! alone, divided by 10; the median of 7 replays. The flush reads 256 MiB (`common::ReadFlush`):
//! a flush that writes leaves 50 MiB of dirty lines whose write-back the difference charges to
//! the GEMM. `NVFP4MOE_FLUSH=write` flushes with a 256 MiB memset instead (this bench's method
//! until 2026-12-03). The library's split-K, when it
//! picks one, happens inside the launch, so its reduction is in the time (the GEMM needs no memset
//! or workspace). Reports microseconds, TB/s of weight bytes (0.5625 B per weight of the experts
//! that got rows: min(E, rows)), TFLOP/s, the floor (max of weight bytes / 4.3 TB/s and FLOPs /
//! the dense BF16 rate: `$NVFP4MOE_BF16_TFLOPS`, which scripts/gpu-run.sh measures with PyTorch in
//! the same call, else 795 TFLOP/s) and floor/t.
//!
//! `cargo bench --bench gemm [-- FILTER]`, e.g. `-- deepseek-v3/L1` or `-- /T16`.
//! `NVFP4MOE_GEMM_TILE=n8|n16|n32|n64|n128` forces a tile instead of the library's choice;
//! `NVFP4MOE_BENCH_TOKENS=512,640` benches those token counts instead.
//! `NVFP4MOE_GEMM_SHAPES="8:256:2048:8;null"` benches those shapes instead of the presets: each
//! `E:n:k:rows` an L2-like launch (`PlainBf16`, rows balanced over the E experts), `null` a
//! kernel that reads 16 KiB (what any launch in the graph costs: the fixed part of a small GEMM),
//! `read:66.06` a plain streaming read of that many MB (what a launch of those bytes costs at best).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{
    balanced_offsets, bf16_tflops, capture, graph_pairs_us, hbm_tbps, report_noted, selected, time_events, tokens,
    ReadFlush, Row,
};
use criterion::{criterion_group, Criterion};
use cudarc::driver::{CudaContext, CudaGraph, CudaSlice, CudaStream};
use half::bf16;
use nvfp4_moe::gemm::{Bf16Output, GemmTile, GroupedGemm, Nvfp4Weights, PlainBf16, SwigluBf16};
use nvfp4_moe::presets::{Preset, PRESETS};
use nvfp4_moe::testing::{random_device_weights, Rng};

/// Flush + GEMM pairs per captured graph.
const PAIRS: usize = 10;
/// Replays of each graph; the table reports the median difference.
const REPS: usize = 7;
/// Bytes of the read (or write) that flushes L2 (50 MiB on the H200) before each GEMM.
const FLUSH_BYTES: usize = 256 << 20;

/// How L2 is flushed before each GEMM: `$NVFP4MOE_FLUSH` = read (the default) or write.
enum Flush {
    Read(ReadFlush),
    Write(CudaSlice<u8>),
}

impl Flush {
    fn from_env(s: &Arc<CudaStream>) -> Flush {
        match std::env::var("NVFP4MOE_FLUSH").as_deref() {
            Ok("write") => Flush::Write(s.alloc_zeros::<u8>(FLUSH_BYTES).unwrap()),
            Ok("") | Ok("read") | Err(_) => Flush::Read(ReadFlush::new(s, FLUSH_BYTES)),
            Ok(other) => panic!("NVFP4MOE_FLUSH={other}: expected read or write"),
        }
    }
    fn launch(&mut self, s: &Arc<CudaStream>) {
        match self {
            Flush::Read(r) => r.launch(s),
            Flush::Write(buf) => s.memset_zeros(buf).unwrap(),
        }
    }
    fn describe(&self) -> String {
        match self {
            Flush::Read(_) => format!("{} MiB read", FLUSH_BYTES >> 20),
            Flush::Write(_) => format!("{} MiB write", FLUSH_BYTES >> 20),
        }
    }
}

/// What every case shares.
struct Bench<'a> {
    c: &'a mut Criterion,
    s: Arc<CudaStream>,
    flush: Flush,
    /// `PAIRS` flushes alone: what is subtracted from a pairs graph.
    flushes: CudaGraph,
    /// Activations for the largest case; a case reads its first rows x k.
    x: CudaSlice<bf16>,
    bf16_tflops: f64,
    hbm_tbps: f64,
    /// The token counts benched (`common::tokens`).
    tokens: Vec<usize>,
    table: Vec<Row>,
}

/// `len` bf16 activations ~ N(0, 1) on the device: a block of 16 Mi random values replicated.
/// Generating the largest case's ~470 M values on the host would take seconds; what the GEMM's
/// power (and so its clocks) depends on is the values' statistics, not their period.
fn device_activations(s: &Arc<CudaStream>, rng: &mut Rng, len: usize) -> CudaSlice<bf16> {
    let src = s.clone_htod(&rng.normal_bf16(len.min(16 << 20), 1.0)).unwrap();
    // SAFETY: the copies below write every element before any read.
    let mut dst = unsafe { s.alloc::<bf16>(len) }.unwrap();
    let mut off = 0;
    while off < len {
        let m = src.len().min(len - off);
        s.memcpy_dtod(&src.slice(..m), &mut dst.slice_mut(off..off + m)).unwrap();
        off += m;
    }
    dst
}

/// Times the GEMM over `w` with epilogue `E` at every selected T, into criterion and the table.
fn layer<E: Bf16Output>(b: &mut Bench<'_>, p: &Preset, layer: &str, w: &Nvfp4Weights) {
    let s = b.s.clone();
    let (n, k) = (w.n(), w.k());
    let max_rows = b.tokens.iter().max().unwrap() * p.top_k;
    let mut out = s.alloc_zeros::<bf16>(max_rows * E::out_cols(n)).unwrap();
    let plan = GroupedGemm::<E>::new(w, forced_tile()).unwrap();
    for t in b.tokens.clone() {
        let name = format!("{}/{layer}/T{t}", p.name);
        if !selected(&name) {
            continue;
        }
        let rows = t * p.top_k;
        let off = s.clone_htod(&balanced_offsets(rows, p.experts)).unwrap();
        // One launch outside the capture, so that first-launch work (module loading) stays out
        // of the graph.
        plan.launch(&s, &b.x, rows, &off, &mut out).unwrap();
        let pairs = capture(&s, PAIRS, || {
            b.flush.launch(&s);
            plan.launch(&s, &b.x, rows, &off, &mut out).unwrap();
        });
        // Criterion replays the same graphs (each whole: PAIRS GEMMs), so its numbers and the
        // table's agree.
        let mut grp = b.c.benchmark_group("grouped_gemm");
        grp.bench_function(&name, |bch| {
            bch.iter_custom(|iters| {
                let g = iters.div_ceil(PAIRS as u64);
                let with = time_events(&s, g, || pairs.launch().unwrap());
                let without = time_events(&s, g, || b.flushes.launch().unwrap());
                let per_gemm = (with.as_secs_f64() - without.as_secs_f64()) / (g as f64 * PAIRS as f64);
                // Noise can make a difference of tiny kernels negative; a Duration cannot be.
                Duration::from_secs_f64(per_gemm.max(0.0) * iters as f64)
            })
        });
        grp.finish();
        let us = graph_pairs_us(&s, &pairs, &b.flushes, PAIRS, REPS);
        let active = p.experts.min(rows);
        let wbytes = active as f64 * n as f64 * k as f64 * 0.5625;
        let flops = 2.0 * rows as f64 * n as f64 * k as f64;
        let floor = (wbytes / (b.hbm_tbps * 1e12)).max(flops / (b.bf16_tflops * 1e12)) * 1e6;
        b.table.push(Row {
            name: format!("{name} ({:?})", plan.tile_for(rows)),
            us,
            bytes: wbytes,
            flops,
            floor_us: floor,
        });
    }
}

/// `$NVFP4MOE_GEMM_SHAPES`: each `E:n:k:rows` (`PlainBf16`, balanced rows), `read:MB` or `null`,
/// into the table.
fn custom_shapes(b: &mut Bench<'_>, spec: &str, rng: &mut Rng) {
    let s = b.s.clone();
    for item in spec.split(';').map(str::trim).filter(|i| !i.is_empty()) {
        let (name, us, bytes, flops, tile) = if let Some(mb) = item.strip_prefix("read:") {
            // A plain streaming read of that many MB (the flush kernel: 16-byte loads, 8 CTAs of
            // 512 threads per SM): what one launch of those bytes costs at best, timed the same way.
            let mb: f64 = mb.parse().expect("read:MB");
            let bytes = ((mb * 1e6) as usize).max(16) / 16 * 16;
            let k = ReadFlush::new(&s, bytes);
            let pairs = capture(&s, PAIRS, || {
                b.flush.launch(&s);
                k.launch(&s);
            });
            (
                format!("read/{mb}MB"),
                graph_pairs_us(&s, &pairs, &b.flushes, PAIRS, REPS),
                bytes as f64,
                0.0,
                String::new(),
            )
        } else if item == "null" {
            let k = ReadFlush::new(&s, 16 << 10);
            let pairs = capture(&s, PAIRS, || {
                b.flush.launch(&s);
                k.launch(&s);
            });
            (
                "null (16 KiB read)".to_string(),
                graph_pairs_us(&s, &pairs, &b.flushes, PAIRS, REPS),
                16384.0,
                0.0,
                String::new(),
            )
        } else {
            let v: Vec<usize> = item.split(':').map(|f| f.parse().expect("E:n:k:rows")).collect();
            let [e, n, k, rows] = v[..] else { panic!("NVFP4MOE_GEMM_SHAPES: {item}: expected E:n:k:rows") };
            let w = random_device_weights(&s, rng, e, n, k, false).unwrap();
            let plan = GroupedGemm::<PlainBf16>::new(&w, forced_tile()).unwrap();
            let mut out = s.alloc_zeros::<bf16>(rows.max(1) * n).unwrap();
            let off = s.clone_htod(&balanced_offsets(rows, e)).unwrap();
            let x = device_activations(&s, rng, rows.max(1) * k);
            plan.launch(&s, &x, rows, &off, &mut out).unwrap();
            let pairs = capture(&s, PAIRS, || {
                b.flush.launch(&s);
                plan.launch(&s, &x, rows, &off, &mut out).unwrap();
            });
            let active = e.min(rows);
            (
                format!("shape/E{e}n{n}k{k}/R{rows}"),
                graph_pairs_us(&s, &pairs, &b.flushes, PAIRS, REPS),
                active as f64 * n as f64 * k as f64 * 0.5625,
                2.0 * rows as f64 * n as f64 * k as f64,
                format!(" ({:?})", plan.tile_for(rows)),
            )
        };
        let floor = (bytes / (b.hbm_tbps * 1e12)).max(flops / (b.bf16_tflops * 1e12)) * 1e6;
        b.table.push(Row { name: format!("{name}{tile}"), us, bytes, flops, floor_us: floor });
    }
}

/// `$NVFP4MOE_GEMM_TILE` (n8, n16, n32, n64, n128, n256, warp), else the library's choice.
fn forced_tile() -> GemmTile {
    match std::env::var("NVFP4MOE_GEMM_TILE").as_deref() {
        Ok("n8") => GemmTile::M128N8,
        Ok("n16") => GemmTile::M128N16,
        Ok("n32") => GemmTile::M128N32,
        Ok("n64") => GemmTile::M128N64,
        Ok("n128") => GemmTile::M128N128,
        Ok("n256") => GemmTile::M128N256,
        Ok("warp") => GemmTile::WarpM16N8,
        Ok("") | Ok("auto") | Err(_) => GemmTile::Auto,
        Ok(other) => panic!("NVFP4MOE_GEMM_TILE={other}: expected n8, n16, n32, n64, n128, n256, warp or auto"),
    }
}

fn benches(c: &mut Criterion) {
    let ctx = CudaContext::new(0).expect("a CUDA GPU");
    // SAFETY: everything below runs on one stream, so no cross-stream synchronization is needed;
    // without event tracking no launch inside a capture waits on an event recorded outside it.
    unsafe { ctx.disable_event_tracking() };
    // Its own stream: the legacy default stream cannot be captured.
    let s = ctx.new_stream().unwrap();
    let mut rng = Rng::from_entropy();
    let mut flush = Flush::from_env(&s);
    let flushes = capture(&s, PAIRS, || flush.launch(&s));
    let tokens = tokens();
    let max_x = PRESETS.iter().map(|p| tokens.iter().max().unwrap() * p.top_k * p.hidden.max(p.intermediate)).max();
    let x = device_activations(&s, &mut rng, max_x.unwrap());
    let (rate, rate_source) = bf16_tflops();
    let (bw, bw_source) = hbm_tbps();
    let mut b = Bench {
        c,
        s: s.clone(),
        flush,
        flushes,
        x,
        bf16_tflops: rate,
        hbm_tbps: bw,
        tokens: tokens.clone(),
        table: Vec::new(),
    };
    let any = |p: &Preset, layer: &str| tokens.iter().any(|t| selected(&format!("{}/{layer}/T{t}", p.name)));
    let shapes = std::env::var("NVFP4MOE_GEMM_SHAPES").unwrap_or_default();
    if !shapes.is_empty() {
        custom_shapes(&mut b, &shapes, &mut rng);
    }
    for p in PRESETS.iter().filter(|_| shapes.is_empty()) {
        let (e, h, i) = (p.experts, p.hidden, p.intermediate);
        if any(p, "L1") {
            // Gate/up row order: the SwiGLU epilogue needs each gate row's up partner in its tile.
            let w = random_device_weights(&s, &mut rng, e, 2 * i, h, true).unwrap();
            layer::<SwigluBf16>(&mut b, p, "L1", &w);
        }
        if any(p, "L2") {
            let w = random_device_weights(&s, &mut rng, e, h, i, false).unwrap();
            layer::<PlainBf16>(&mut b, p, "L2", &w);
        }
    }
    let flush_kind = b.flush.describe();
    let notes = [
        "L1: n = 2I, k = H, SwigluBf16 epilogue ([rows, I] out); L2: n = H, k = I, PlainBf16; balanced routing".into(),
        format!(
            "t = (graph of {PAIRS} x (L2 flush: {flush_kind} + GEMM) - graph of {PAIRS} flushes) / {PAIRS}, median of {REPS} \
             replays; tile = the library's choice (or $NVFP4MOE_GEMM_TILE); its split-K (not reported by the API) is inside the launch"
        ),
        format!(
            "floor = max(weight bytes / {bw:.2} TB/s ({bw_source}), FLOPs / {rate:.1} TFLOP/s BF16 ({rate_source}))"
        ),
    ];
    report_noted("gemm", "CUDA-graph replays", &notes, &b.table);
}

criterion_group! {
    name = group;
    // Short: 60 cases share the GPU run's time budget.
    config = common::short_criterion(100, 300);
    targets = benches
}
criterion::criterion_main!(group);
