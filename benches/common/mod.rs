//! Shared bench plumbing: CUDA-event timing, a bench-name filter, and the summary table + JSON
//! that every bench binary prints last.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use criterion::Criterion;
use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaSlice, CudaStream};
pub use nvfp4_moe::presets::Preset;

/// Measured H200 ceilings (shared/design/BENCHMARKS.md): copy bandwidth counting read + written.
pub const HBM_TBPS: f64 = 4.3;

/// The copy bandwidth for floors (TB/s, read + written) and where it came from:
/// `$NVFP4MOE_HBM_TBPS` when set (scripts/gpu-run.sh measures it with PyTorch on a GPU other than
/// the H200, whose floors the issues' targets define with [`HBM_TBPS`]), else [`HBM_TBPS`].
pub fn hbm_tbps() -> (f64, String) {
    match std::env::var("NVFP4MOE_HBM_TBPS").ok().and_then(|v| v.trim().parse::<f64>().ok()) {
        Some(r) if r.is_finite() && r > 0.0 => (r, "from $NVFP4MOE_HBM_TBPS".into()),
        _ => (HBM_TBPS, "the H200 constant HBM_TBPS; NVFP4MOE_HBM_TBPS unset or invalid".into()),
    }
}

/// Measured dense BF16 matrix rate on the H200 (TFLOP/s).
pub const BF16_TFLOPS: f64 = 795.0;

/// The dense BF16 rate for floors (TFLOP/s) and where it came from: `$NVFP4MOE_BF16_TFLOPS` when
/// set (scripts/gpu-run.sh measures it with PyTorch in the same call, so the floor tracks this
/// GPU's clocks), else [`BF16_TFLOPS`].
pub fn bf16_tflops() -> (f64, String) {
    match std::env::var("NVFP4MOE_BF16_TFLOPS").ok().and_then(|v| v.trim().parse::<f64>().ok()) {
        Some(r) if r.is_finite() && r > 0.0 => (r, "NVFP4MOE_BF16_TFLOPS, measured in this run".into()),
        _ => (BF16_TFLOPS, "the H200 constant BF16_TFLOPS; NVFP4MOE_BF16_TFLOPS unset".into()),
    }
}

/// The crate's built-in presets of these names (shared/presets/moe-shapes.toml, one source of
/// the shapes).
pub fn presets(names: &[&str]) -> Vec<Preset> {
    names.iter().map(|n| nvfp4_moe::presets::preset(n).unwrap()).collect()
}

pub const TOKENS: [usize; 5] = [1, 16, 128, 1024, 8192];

/// The token counts to bench: `$NVFP4MOE_BENCH_TOKENS` (comma-separated, e.g. `640,1024`) or
/// [`TOKENS`].
pub fn tokens() -> Vec<usize> {
    match std::env::var("NVFP4MOE_BENCH_TOKENS") {
        Ok(list) => list
            .split(',')
            .map(|t| t.trim().parse().expect("NVFP4MOE_BENCH_TOKENS: comma-separated token counts"))
            .collect(),
        Err(_) => TOKENS.to_vec(),
    }
}

/// Balanced routing: rows spread evenly over the experts (the first rows % E get one more).
pub fn balanced_offsets(rows: usize, experts: usize) -> Vec<i32> {
    let mut off = vec![0i32];
    for e in 0..experts {
        let c = rows / experts + usize::from(e < rows % experts);
        off.push(off.last().unwrap() + c as i32);
    }
    off
}

/// Times `iters` back-to-back runs of `f` on `stream` with CUDA events; returns the total.
pub fn time_events(stream: &Arc<CudaStream>, iters: u64, mut f: impl FnMut()) -> Duration {
    let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).unwrap();
    for _ in 0..iters {
        f();
    }
    let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).unwrap();
    end.synchronize().unwrap();
    let ms = start.elapsed_ms(&end).unwrap();
    Duration::from_secs_f64(f64::from(ms) / 1e3)
}

/// Median of `n` single-run event timings (after `warmup` runs), in microseconds.
pub fn median_us(stream: &Arc<CudaStream>, warmup: usize, n: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..warmup {
        f();
    }
    let mut v: Vec<f64> = (0..n).map(|_| time_events(stream, 1, &mut f).as_secs_f64() * 1e6).collect();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[n / 2]
}

/// One timed run of `f` after flushing L2 (a write of all of `flush`), in microseconds.
pub fn flushed_us(stream: &Arc<CudaStream>, flush: &mut CudaSlice<u8>, f: impl FnOnce()) -> f64 {
    stream.memset_zeros(flush).unwrap();
    let a = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).unwrap();
    f();
    let b = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).unwrap();
    b.synchronize().unwrap();
    f64::from(a.elapsed_ms(&b).unwrap()) * 1e3
}

/// Time of one run of `f` with L2 flushed before it, without the flush or launch gaps: `n` pairs
/// (flush, f) back to back, minus `n` flushes alone, both timed with CUDA events; the median of
/// `reps` such differences, in microseconds.
pub fn flushed_pairs_us(
    stream: &Arc<CudaStream>,
    flush: &mut CudaSlice<u8>,
    n: usize,
    reps: usize,
    mut f: impl FnMut(),
) -> f64 {
    let mut v: Vec<f64> = (0..reps)
        .map(|_| {
            let with = time_events(stream, n as u64, || {
                stream.memset_zeros(flush).unwrap();
                f();
            });
            let without = time_events(stream, n as u64, || stream.memset_zeros(flush).unwrap());
            (with.as_secs_f64() - without.as_secs_f64()) * 1e6 / n as f64
        })
        .collect();
    median(&mut v)
}

/// An L2 flush that only reads: a kernel reading all of a 256 MiB buffer (zeros) and writing nothing
/// (its one store is behind a test no zero buffer passes). A flush that writes (a memset) leaves
/// L2 full of dirty lines (50 MiB on the H200), whose write-back then runs during the timed kernel
/// and, in a pairs-minus-flushes difference, is charged to it: for a kernel that streams its
/// bytes near the HBM limit that is up to 50 MiB of extra DRAM traffic (H200, 2026-12-03: the graph
/// difference with a memset flush was 2.5-5.5 us above the profiler's kernel duration at T = 1).
/// After a read flush L2 holds clean lines: the difference is the kernel's own time. (A GEMM
/// launched with programmatic dependent launch after this kernel node in a graph gets a
/// programmatic edge, so its launch overlaps the flush's tail, as in the layer's forward; after a
/// memset node it did not. The GEMM still waits for the flush to finish before its first load.)
pub struct ReadFlush {
    function: cudarc::driver::sys::CUfunction,
    // The buffers, owned for the process's benches, and their device addresses.
    _buf: CudaSlice<u8>,
    _sink: CudaSlice<u32>,
    buf_ptr: u64,
    n16: u64,
    sink_ptr: u64,
}

/// The read-flush kernel, PTX compiled by the driver at load (no NVRTC needed): 16-byte loads
/// over a grid-stride loop, xor-folded so that none is dead.
const READ_FLUSH_PTX: &str = r#"
.version 8.0
.target sm_90
.address_size 64
.visible .entry nvfp4moe_bench_read_flush(.param .u64 buf, .param .u64 n16, .param .u64 sink)
{
    .reg .pred %p<3>;
    .reg .b32 %r<12>;
    .reg .b64 %rd<12>;
    ld.param.u64 %rd1, [buf];
    ld.param.u64 %rd2, [n16];
    ld.param.u64 %rd3, [sink];
    mov.u32 %r1, %ctaid.x;
    mov.u32 %r2, %ntid.x;
    mov.u32 %r3, %tid.x;
    mov.u32 %r4, %nctaid.x;
    cvt.u64.u32 %rd4, %r1;
    cvt.u64.u32 %rd5, %r2;
    cvt.u64.u32 %rd6, %r3;
    cvt.u64.u32 %rd7, %r4;
    mad.lo.u64 %rd8, %rd4, %rd5, %rd6;
    mul.lo.u64 %rd9, %rd7, %rd5;
    mov.u32 %r5, 0;
LOOP:
    setp.ge.u64 %p1, %rd8, %rd2;
    @%p1 bra DONE;
    shl.b64 %rd10, %rd8, 4;
    add.u64 %rd11, %rd1, %rd10;
    ld.global.v4.u32 {%r6, %r7, %r8, %r9}, [%rd11];
    xor.b32 %r5, %r5, %r6;
    xor.b32 %r5, %r5, %r7;
    xor.b32 %r5, %r5, %r8;
    xor.b32 %r5, %r5, %r9;
    add.u64 %rd8, %rd8, %rd9;
    bra LOOP;
DONE:
    setp.ne.u32 %p2, %r5, 1234567;
    @%p2 bra END;
    st.global.u32 [%rd3], %r5;
END:
    ret;
}
"#;

impl ReadFlush {
    /// A read flush of `bytes` (a multiple of 16) on `stream`'s device.
    pub fn new(stream: &Arc<CudaStream>, bytes: usize) -> Self {
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        assert_eq!(bytes % 16, 0);
        let src = std::ffi::CString::new(READ_FLUSH_PTX).unwrap();
        let name = std::ffi::CString::new("nvfp4moe_bench_read_flush").unwrap();
        stream.context().bind_to_thread().unwrap();
        // SAFETY: a NUL-terminated PTX image; the module lives as long as the process (benches
        // load it once), so the function handle stays valid.
        let function = unsafe {
            let module = cudarc::driver::result::module::load_data(src.as_ptr().cast()).unwrap();
            cudarc::driver::result::module::get_function(module, name).unwrap()
        };
        let buf = stream.alloc_zeros::<u8>(bytes).unwrap();
        let mut sink = stream.alloc_zeros::<u32>(1).unwrap();
        let buf_ptr = buf.device_ptr(stream).0;
        let sink_ptr = sink.device_ptr_mut(stream).0;
        ReadFlush { function, _buf: buf, _sink: sink, buf_ptr, n16: (bytes / 16) as u64, sink_ptr }
    }

    /// Enqueues the flush on `stream` (capturable).
    pub fn launch(&self, stream: &Arc<CudaStream>) {
        let (mut b, mut n, mut k) = (self.buf_ptr, self.n16, self.sink_ptr);
        let mut params: [*mut std::ffi::c_void; 3] =
            [(&mut b as *mut u64).cast(), (&mut n as *mut u64).cast(), (&mut k as *mut u64).cast()];
        // SAFETY: the parameters match the kernel's (.u64 x 3) and are copied at launch; the
        // buffers live as long as self. 1056 CTAs = 8 per SM of the H200 (132 SMs) with 512
        // threads each: enough 16-byte loads in flight to read at the HBM limit on any sm_90 part.
        unsafe {
            cudarc::driver::result::launch_kernel(
                self.function,
                (1056, 1, 1),
                (512, 1, 1),
                0,
                stream.cu_stream(),
                &mut params,
            )
            .unwrap();
        }
    }
}

/// A CUDA graph of `n` copies of the work `f` enqueues on `stream` (captured, instantiated and
/// uploaded). `stream` must not be the legacy default stream (it cannot be captured), and buffers
/// `f` uses must not track events (`CudaContext::disable_event_tracking` before allocating them):
/// a wait on an event recorded before the capture would break it.
pub fn capture(stream: &Arc<CudaStream>, n: usize, mut f: impl FnMut()) -> CudaGraph {
    stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
    for _ in 0..n {
        f();
    }
    let graph = stream.end_capture(CUgraphInstantiate_flags(0)).unwrap().expect("a non-empty capture");
    graph.upload().unwrap();
    graph
}

/// Time of one kernel of `pairs` (a graph of `n` pairs: L2 flush, then the kernel) without the
/// flushes: a replay of `pairs` minus a replay of `flushes` (the same `n` flushes alone), each
/// timed with CUDA events, divided by `n`; the median of `reps` such differences, in
/// microseconds. The two replays alternate so that clock drift cancels.
pub fn graph_pairs_us(stream: &Arc<CudaStream>, pairs: &CudaGraph, flushes: &CudaGraph, n: usize, reps: usize) -> f64 {
    // The first replays after upload pay one-time costs.
    pairs.launch().unwrap();
    flushes.launch().unwrap();
    let mut v: Vec<f64> = (0..reps)
        .map(|_| {
            let with = time_events(stream, 1, || pairs.launch().unwrap());
            let without = time_events(stream, 1, || flushes.launch().unwrap());
            (with.as_secs_f64() - without.as_secs_f64()) * 1e6 / n as f64
        })
        .collect();
    median(&mut v)
}

/// The median of `v` (sorts it).
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// The first free argument (criterion's filter), if any.
pub fn filter() -> Option<String> {
    std::env::args().skip(1).find(|a| !a.starts_with('-') && a != "--bench")
}

/// Whether case `name` passes the filter: a substring, or `a|b` (either), each `...$` matching the
/// name's end, so that the same filter means the same cases to criterion's regex (`/T1$` is T = 1
/// only; `/T1` also takes T16, T128 and T1024).
pub fn selected(name: &str) -> bool {
    filter().is_none_or(|f| {
        f.split('|').any(|alt| match alt.strip_suffix('$') {
            Some(end) => name.ends_with(end),
            None => name.contains(alt),
        })
    })
}

/// One row of the summary table.
pub struct Row {
    pub name: String,
    pub us: f64,
    pub bytes: f64,
    pub flops: f64,
    /// The floor in microseconds (bytes / HBM or flops / peak) for the ratio column.
    pub floor_us: f64,
}

/// Prints the summary table last (the GPU runner shows the end of the output) and writes JSON to
/// `$NVFP4MOE_BENCH_JSON` (a directory) when set.
pub fn report(bench: &str, rows: &[Row]) {
    report_noted(bench, "median of CUDA-event timings", &[], rows);
}

/// [`report`] with `how` (how the times were taken) in the title and `notes` under it (lines the
/// GPU runner's summary keeps: it prints from the title on).
pub fn report_noted(bench: &str, how: &str, notes: &[String], rows: &[Row]) {
    println!();
    println!("== {bench}: summary ({how}) ==");
    for n in notes {
        println!("{n}");
    }
    let (bw, _) = hbm_tbps();
    println!(
        "{:<44} {:>10} {:>9} {:>9} {:>10} {:>10} {:>8}",
        "case",
        "us",
        "TB/s",
        format!("%{bw:.1}TB/s"),
        "TFLOP/s",
        "floor us",
        "floor/t"
    );
    for r in rows {
        let tbps = r.bytes / (r.us * 1e-6) / 1e12;
        let tflops = r.flops / (r.us * 1e-6) / 1e12;
        println!(
            "{:<44} {:>10.2} {:>9.3} {:>8.1}% {:>10.1} {:>10.2} {:>8.2}",
            r.name,
            r.us,
            tbps,
            100.0 * tbps / bw,
            tflops,
            r.floor_us,
            r.floor_us / r.us
        );
    }
    if let Some(dir) = std::env::var_os("NVFP4MOE_BENCH_JSON") {
        let items: Vec<String> = rows
            .iter()
            .map(|r| {
                format!(
                    "{{\"case\":\"{}\",\"us\":{:.3},\"bytes\":{},\"flops\":{},\"floor_us\":{:.3}}}",
                    r.name, r.us, r.bytes, r.flops, r.floor_us
                )
            })
            .collect();
        let path = std::path::Path::new(&dir).join(format!("{bench}.json"));
        let _ = std::fs::create_dir_all(&dir);
        std::fs::write(&path, format!("[\n{}\n]\n", items.join(",\n"))).unwrap();
    }
}

/// Criterion kept short for the GPU machine's time budget: 10 samples, no plots; the tables the
/// benches print come from their own CUDA-event timings.
pub fn short_criterion(warm_up_ms: u64, measurement_ms: u64) -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(warm_up_ms))
        .measurement_time(Duration::from_millis(measurement_ms))
        .sample_size(10)
        .without_plots()
}
