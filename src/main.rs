//! `nvfp4-moe`: quantize safetensors weights to NVFP4 (ModelOpt's checkpoint layout) on the CPU or
//! a CUDA GPU, decode them back, run, check and benchmark the NVFP4 MoE layer on a GPU, and report
//! how the crate was built.
//!
//! Exit status: 0 success, 1 error, 2 usage error. Every error is one `error: ...` line on stderr.

use std::fmt;
use std::io::Write;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;
use nvfp4_moe::io::{self as nio, ModelOptWeight, SourceDtype};
use nvfp4_moe::layout::ScaleLayout;
use nvfp4_moe::presets::{self, Preset};
use nvfp4_moe::reference::{self, Nvfp4Host};
use nvfp4_moe::routing;
use nvfp4_moe::testing::Rng;
use nvfp4_moe::{info, Error};
use nvfp4_moe::{GemmTile, MoeLayer, MoeOptions, MoeWeights, MoeWorkspace};

/// Prints a line on stdout; a closed pipe (`| head`) is not an error worth a panic.
macro_rules! out {
    ($($t:tt)*) => {{
        let _ = writeln!(std::io::stdout(), $($t)*);
    }};
}

const VERSION: &str = env!("CARGO_PKG_VERSION");

const USAGE: &str = "\
Usage:
  nvfp4-moe quantize   --input X.safetensors --tensor NAME --output Y.safetensors
                       [--prefix P] [--backend cpu|cuda]
  nvfp4-moe dequantize --input Y.safetensors --output Z.safetensors
                       [--prefix P] [--name NAME] [--backend cpu|cuda]
  nvfp4-moe check      [--preset NAME] [--tokens T]
  nvfp4-moe run        --weights W --prefix P --input X.safetensors --output Y.safetensors
                       [--tile auto|n16|n64|n128]
  nvfp4-moe bench      [--preset NAME,...] [--tokens T,...] [--json FILE]
  nvfp4-moe info
  nvfp4-moe help [COMMAND]      (or: nvfp4-moe COMMAND --help)
  nvfp4-moe --version";

const COMMANDS: &str = "\
Commands:
  quantize    quantize one 2-D BF16 (or F32) tensor to NVFP4, written as ModelOpt's
              weight / weight_scale / weight_scale_2
  dequantize  decode a ModelOpt NVFP4 weight back to a BF16 tensor
  check       run the MoE layer of a preset shape on random weights on the GPU and compare it
              with the CPU f64 reference
  run         run one MoE layer of a ModelOpt NVFP4 checkpoint on given hidden states and routing
  bench       time the MoE layer forward (CUDA graph, L2 flushed) over preset shapes and token counts
  info        show the version, how the CUDA core was built, and the GPUs visible

Presets of check and bench: deepseek-v3, kimi-k2, qwen3-235b-a22b, qwen3-30b-a3b,
mixtral-8x7b, gpt-oss-120b (`nvfp4-moe check --help` lists their shapes).

NVFP4: value = e2m1 (4-bit code) x e4m3 (scale of each block of 16 along K) x g, where g is
the FP32 per-tensor decode scale (ModelOpt's weight_scale_2; other libraries' \"global
scale\" is 1/g).

Exit status: 0 success, 1 error, 2 usage error.";

const QUANTIZE_USAGE: &str =
    "nvfp4-moe quantize --input X.safetensors --tensor NAME --output Y.safetensors [--prefix P] [--backend cpu|cuda]";

const QUANTIZE_HELP: &str = "\
Options:
  --input FILE     safetensors file holding the tensor
  --tensor NAME    the tensor to quantize: 2-D [N, K] with K a multiple of 16, BF16 or F32
                   (F32 is rounded to BF16, round-to-nearest-even, first)
  --output FILE    safetensors file to write (replaced if it exists)
  --prefix P       name prefix of the written tensors, e.g. model.layers.0.mlp.gate_proj
                   (a final '.' is added when missing); default: none
  --backend B      cpu (the reference quantizer, all cores) or cuda (GPU 0); default: cuda
                   when a GPU this build supports is visible, else cpu. Both write the same bytes.
  -h, --help       this help

Writes, with value = e2m1 x e4m3 x g:
  {P}weight          U8       [N, K/2]   E2M1 codes, element 2j in the low nibble
  {P}weight_scale    F8_E4M3  [N, K/16]  block-16 scales, linear (row-major)
  {P}weight_scale_2  F32      []         g = amax / (6 * 448), amax over the finite elements
A tensor with no finite non-zero element cannot be quantized (g would be 0).";

const DEQUANTIZE_USAGE: &str =
    "nvfp4-moe dequantize --input Y.safetensors --output Z.safetensors [--prefix P] [--name NAME] [--backend cpu|cuda]";

const DEQUANTIZE_HELP: &str = "\
Options:
  --input FILE     safetensors file holding {P}weight (U8 [N, K/2]), {P}weight_scale
                   (F8_E4M3 [N, K/16], linear) and {P}weight_scale_2 (F32 scalar)
  --output FILE    safetensors file to write (replaced if it exists): one BF16 [N, K] tensor
  --prefix P       name prefix of the tensors read, e.g. model.layers.0.mlp.gate_proj
                   (a final '.' is added when missing); default: none
  --name NAME      name of the BF16 tensor written; default: weight
  --backend B      cpu or cuda (GPU 0); default: cuda when a GPU this build supports is
                   visible, else cpu. Both write the same bytes.
  -h, --help       this help

Each element is bf16(e2m1 x e4m3 x g), rounded to nearest even.";

const CHECK_USAGE: &str = "nvfp4-moe check [--preset NAME] [--tokens T] [--intermediate bf16|nvfp4]";

const CHECK_HELP: &str = "\
Options:
  --preset NAME    the layer shape (below); default: qwen3-30b-a3b
  --tokens T       tokens in the forward, 1..=4096; default: 4
  --intermediate F what the first GEMM hands the second: bf16 (default) or nvfp4 (packed in the
                   first GEMM's epilogue with a decode scale calibrated on these tokens,
                   dequantized for the second; tolerance 0.15 overall, 0.25 per token: NVFP4's
                   own error on SwiGLU data is ~9% RMS)
  -h, --help       this help

Generates a random NVFP4 checkpoint of the preset's shape on the host (random E2M1 codes, E4M3
block scales in 0.125..3.75, decode scales in [1e-3, 1e-2), up decode scales twice the gate's),
random hidden states and random routing (softmax top-k over random router logits, renormalized),
runs MoeLayer::forward on GPU 0, and compares the output with the CPU f64 reference layer.
Prints the relative Frobenius error overall and of the worst token; fails (exit 1) if either is
above 1e-2 (with --intermediate nvfp4: 0.15 overall, 0.25 for a token). Needs a CUDA GPU. The host holds the whole checkpoint (E x 3 x H x I x 9/16 bytes:
about 6.3 GB for deepseek-v3, 9.5 GB for kimi-k2).

Presets (experts, hidden, intermediate, top-k):
  deepseek-v3      256  7168   2048  8
  kimi-k2          384  7168   2048  8
  qwen3-235b-a22b  128  4096   1536  8
  qwen3-30b-a3b    128  2048    768  8
  mixtral-8x7b       8  4096  14336  2
  gpt-oss-120b     128  2880   2880  4";

const RUN_USAGE: &str =
    "nvfp4-moe run --weights W --prefix P --input X.safetensors --output Y.safetensors [--tile auto|n16|n64|n128]";

const RUN_HELP: &str = "\
Options:
  --weights W      ModelOpt NVFP4 checkpoint: a .safetensors file, a sharded index .json, or a
                   directory holding one
  --prefix P       the layer's experts, e.g. model.layers.3.mlp.experts (gate_proj/up_proj/
                   down_proj, w1/w3/w2, gate_up_proj/down_proj or w13/w2 under {P}.{e}.)
  --input FILE     safetensors file holding
                     hidden_states  BF16 [T, H]   (H: the checkpoint's hidden size)
                     topk_ids       I32  [T, k]   (expert ids in [0, E), 1 <= k <= min(E, 32))
                     topk_weights   F32  [T, k]
  --output FILE    safetensors file to write (replaced if it exists): out BF16 [T, H]
  --tile T         GEMM tile: auto (chosen from T x k and E), n16 (decode), n64 or n128 (prefill);
                   default: auto
  -h, --help       this help

out[t] = sum_j topk_weights[t, j] * down(silu(gate(x_t)) * up(x_t)) of expert topk_ids[t, j],
on GPU 0. An expert id outside [0, E) is an error. Needs a CUDA GPU.";

const BENCH_USAGE: &str =
    "nvfp4-moe bench [--preset NAME,...] [--tokens T,...] [--intermediate bf16|nvfp4] [--json FILE]";

const BENCH_HELP: &str = "\
Options:
  --preset LIST    comma-separated presets (see `nvfp4-moe check --help`); default: qwen3-30b-a3b
  --tokens LIST    comma-separated token counts; default: 1,16,128,1024,8192
  --intermediate F what the first GEMM hands the second: bf16 (default) or nvfp4 (packed in the
                   first GEMM's epilogue, dequantized for the second; its decode scale is
                   calibrated first on up to 64 tokens)
  --json FILE      also write the rows as JSON to FILE
  -h, --help       this help

For each preset: random NVFP4 weights made on the device (a 64 MiB random block replicated:
nothing large on the host), a MoeLayer sized for the largest T, and for each T balanced routing
(token t's slot j goes to expert (t * k + j) % E, weights 1/k) and random hidden states. The
forward is captured into a CUDA graph on its own stream; each of 20 replays runs after a 256 MiB
memset that flushes L2, and only the replay is timed (CUDA events). Reports the median:
  TB/s     weight bytes read / time: min(E, T x k) active experts x 3 x H x I x 0.5625 B
  TFLOP/s  2 x T x k x 3 x H x I / time
  floor/t  max(bytes / 4.3 TB/s, flops / 795 TFLOP/s) / time (H200 measured ceilings)
Progress goes to stderr, the table to stdout. Needs a CUDA GPU.";

const INFO_USAGE: &str = "nvfp4-moe info";

const INFO_HELP: &str = "\
Prints the crate version, how the CUDA core was built (CUDA version compiled against, target
architectures, CUTLASS version, CUDA runtime and driver versions) and every GPU visible (name,
compute capability, memory, SMs, whether this build has kernels for it).";

/// Why the command failed: a usage error (exit 2) or a failure while running (exit 1).
#[derive(Debug)]
enum Fail {
    Usage { msg: String, usage: &'static str, help_cmd: &'static str },
    Run(String),
}

impl From<Error> for Fail {
    fn from(e: Error) -> Self {
        Fail::Run(e.to_string())
    }
}

impl From<cudarc::driver::DriverError> for Fail {
    fn from(e: cudarc::driver::DriverError) -> Self {
        Fail::from(Error::from(e))
    }
}

type CliResult<T> = std::result::Result<T, Fail>;

fn usage_err(cmd: &Command, msg: impl fmt::Display) -> Fail {
    Fail::Usage { msg: msg.to_string(), usage: cmd.usage, help_cmd: cmd.name }
}

fn top_usage_err(msg: impl fmt::Display) -> Fail {
    Fail::Usage { msg: msg.to_string(), usage: USAGE, help_cmd: "" }
}

/// One subcommand: its flags (name, value placeholder, required) and help.
struct Command {
    name: &'static str,
    summary: &'static str,
    usage: &'static str,
    help: &'static str,
    flags: &'static [(&'static str, bool)],
}

const QUANTIZE: Command = Command {
    name: "quantize",
    summary: "quantize one 2-D tensor to NVFP4 in ModelOpt's checkpoint layout",
    usage: QUANTIZE_USAGE,
    help: QUANTIZE_HELP,
    flags: &[("input", true), ("tensor", true), ("output", true), ("prefix", false), ("backend", false)],
};

const DEQUANTIZE: Command = Command {
    name: "dequantize",
    summary: "decode a ModelOpt NVFP4 weight to BF16",
    usage: DEQUANTIZE_USAGE,
    help: DEQUANTIZE_HELP,
    flags: &[("input", true), ("output", true), ("prefix", false), ("name", false), ("backend", false)],
};

const INFO: Command =
    Command { name: "info", summary: "version, build and GPUs", usage: INFO_USAGE, help: INFO_HELP, flags: &[] };

const CHECK: Command = Command {
    name: "check",
    summary: "check the MoE layer on random weights against the CPU f64 reference",
    usage: CHECK_USAGE,
    help: CHECK_HELP,
    flags: &[("preset", false), ("tokens", false), ("intermediate", false)],
};

const RUN: Command = Command {
    name: "run",
    summary: "run one MoE layer of a ModelOpt NVFP4 checkpoint on the GPU",
    usage: RUN_USAGE,
    help: RUN_HELP,
    flags: &[("weights", true), ("prefix", true), ("input", true), ("output", true), ("tile", false)],
};

const BENCH: Command = Command {
    name: "bench",
    summary: "time the MoE layer forward over preset shapes and token counts",
    usage: BENCH_USAGE,
    help: BENCH_HELP,
    flags: &[("preset", false), ("tokens", false), ("intermediate", false), ("json", false)],
};

const ALL: [&Command; 6] = [&QUANTIZE, &DEQUANTIZE, &CHECK, &RUN, &BENCH, &INFO];

fn print_command_help(cmd: &Command) {
    out!("nvfp4-moe {}: {}\n\nUsage:\n  {}\n\n{}", cmd.name, cmd.summary, cmd.usage, cmd.help);
}

fn print_help() {
    out!(
        "nvfp4-moe {VERSION}: NVFP4 quantization of safetensors weights and the NVFP4 MoE layer (CUDA, sm_90a)\n\n{USAGE}\n\n{COMMANDS}"
    );
}

/// The parsed `--flag value` pairs of one command.
struct Flags {
    values: Vec<(&'static str, String)>,
}

impl Flags {
    fn get(&self, name: &str) -> Option<&str> {
        self.values.iter().find(|(n, _)| *n == name).map(|(_, v)| v.as_str())
    }

    /// A required flag (presence is checked by [`parse_flags`]).
    fn req(&self, name: &str) -> &str {
        self.get(name).unwrap_or_default()
    }
}

/// Parses `--flag value` / `--flag=value` pairs. `Ok(None)` means help was asked for.
fn parse_flags(cmd: &Command, args: &[String]) -> CliResult<Option<Flags>> {
    let mut values: Vec<(&'static str, String)> = Vec::new();
    let mut i = 0;
    while i < args.len() {
        let a = &args[i];
        i += 1;
        if a == "-h" || a == "--help" {
            return Ok(None);
        }
        let Some(body) = a.strip_prefix("--") else {
            return Err(usage_err(cmd, format!("unexpected argument `{a}` (flags are `--name value`)")));
        };
        let (key, inline) = match body.split_once('=') {
            Some((k, v)) => (k, Some(v.to_string())),
            None => (body, None),
        };
        let Some(&(name, _)) = cmd.flags.iter().find(|(n, _)| *n == key) else {
            let known: Vec<String> = cmd.flags.iter().map(|(n, _)| format!("--{n}")).collect();
            let known =
                if known.is_empty() { "it takes none".to_string() } else { format!("it takes {}", known.join(", ")) };
            return Err(usage_err(cmd, format!("unknown flag `--{key}` for `{}` ({known})", cmd.name)));
        };
        let value = match inline {
            Some(v) => v,
            None => match args.get(i) {
                Some(v) if !v.starts_with("--") => {
                    i += 1;
                    v.clone()
                }
                _ => return Err(usage_err(cmd, format!("flag `--{name}` needs a value"))),
            },
        };
        if value.is_empty() && name != "prefix" {
            return Err(usage_err(cmd, format!("flag `--{name}` needs a non-empty value")));
        }
        if values.iter().any(|(n, _)| *n == name) {
            return Err(usage_err(cmd, format!("flag `--{name}` given twice")));
        }
        values.push((name, value));
    }
    let missing: Vec<String> = cmd
        .flags
        .iter()
        .filter(|(n, req)| *req && !values.iter().any(|(v, _)| v == n))
        .map(|(n, _)| format!("--{n}"))
        .collect();
    if !missing.is_empty() {
        let s = if missing.len() > 1 { "s" } else { "" };
        return Err(usage_err(cmd, format!("missing required flag{s} {}", missing.join(", "))));
    }
    Ok(Some(Flags { values }))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Backend {
    Cpu,
    Cuda,
}

fn parse_backend(cmd: &Command, flags: &Flags) -> CliResult<Option<Backend>> {
    match flags.get("backend") {
        None => Ok(None),
        Some("cpu") => Ok(Some(Backend::Cpu)),
        Some("cuda") => Ok(Some(Backend::Cuda)),
        Some(other) => Err(usage_err(cmd, format!("unknown backend `{other}` (expected cpu or cuda)"))),
    }
}

/// `--prefix` with a final '.' added when missing ("" stays "").
fn prefix_of(flags: &Flags) -> String {
    match flags.get("prefix") {
        None | Some("") => String::new(),
        Some(p) if p.ends_with('.') => p.to_string(),
        Some(p) => format!("{p}."),
    }
}

/// Parses a CMake architecture list (`90a-real;100a-real`, `90`, `90-virtual`) into
/// `(major*10 + minor, arch-specific 'a', has SASS, has PTX)`.
fn parse_archs(archs: &str) -> Vec<(i32, bool, bool, bool)> {
    archs
        .split([';', ',', ' '])
        .filter_map(|e| {
            let e = e.trim();
            let (body, sass, ptx) = if let Some(b) = e.strip_suffix("-real") {
                (b, true, false)
            } else if let Some(b) = e.strip_suffix("-virtual") {
                (b, false, true)
            } else {
                (e, true, true)
            };
            let digits: String = body.chars().take_while(char::is_ascii_digit).collect();
            let n: i32 = digits.parse().ok()?;
            Some((n, body[digits.len()..].starts_with('a'), sass, ptx))
        })
        .collect()
}

/// Whether the compiled architectures can run on a GPU of compute capability `cc`. An unknown
/// (unparsable) list counts as yes: the launch will say if it is not.
fn arch_supported(cc: (i32, i32), archs: &str) -> bool {
    let list = parse_archs(archs);
    if list.is_empty() {
        return true;
    }
    let dev = cc.0 * 10 + cc.1;
    list.iter().any(
        |&(n, specific, sass, ptx)| {
            if specific {
                n == dev
            } else {
                (sass && n / 10 == dev / 10 && n <= dev) || (ptx && n <= dev)
            }
        },
    )
}

/// Picks the backend: an explicit one (cuda checked to be usable) or the default (cuda when a
/// supported GPU is visible). Returns the backend and, for cuda, the GPU's name.
fn resolve_backend(requested: Option<Backend>) -> CliResult<(Backend, String)> {
    if requested == Some(Backend::Cpu) {
        return Ok((Backend::Cpu, String::new()));
    }
    let gpus = info::gpus();
    let archs = info::build_info().cuda_archs;
    match (requested, gpus.first()) {
        (Some(_), None) => Err(Fail::Run("--backend cuda: no CUDA GPU visible (use --backend cpu)".into())),
        (Some(_), Some(g)) if !arch_supported(g.compute_capability, &archs) => Err(Fail::Run(format!(
            "--backend cuda: GPU 0 ({}, compute capability {}.{}) is not one this build has kernels for ({archs}); use --backend cpu",
            g.name, g.compute_capability.0, g.compute_capability.1
        ))),
        (_, Some(g)) if arch_supported(g.compute_capability, &archs) => Ok((Backend::Cuda, g.name.clone())),
        (_, Some(g)) => {
            out!(
                "note: GPU 0 ({}, compute capability {}.{}) is not one this build has kernels for ({archs}): using the cpu backend",
                g.name,
                g.compute_capability.0,
                g.compute_capability.1
            );
            Ok((Backend::Cpu, String::new()))
        }
        (_, None) => Ok((Backend::Cpu, String::new())),
    }
}

/// A float for people: plain between 1e-3 and 1e4, else scientific (both exact round trips).
fn fmt_f32(v: f32) -> String {
    if v == 0.0 || (1e-3..1e4).contains(&v.abs()) {
        format!("{v}")
    } else {
        format!("{v:e}")
    }
}

fn fmt_dur(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s >= 1.0 {
        format!("{s:.2} s")
    } else if s >= 1e-3 {
        format!("{:.1} ms", s * 1e3)
    } else {
        format!("{:.0} us", s * 1e6)
    }
}

fn fmt_bytes(n: usize) -> String {
    let n = n as f64;
    if n >= (1u64 << 30) as f64 {
        format!("{:.2} GiB", n / (1u64 << 30) as f64)
    } else if n >= (1 << 20) as f64 {
        format!("{:.1} MiB", n / (1 << 20) as f64)
    } else if n >= 1024.0 {
        format!("{:.1} KiB", n / 1024.0)
    } else {
        format!("{n} B")
    }
}

/// Rows per CPU work item: about 4 Mi elements, at most 1024 rows, at least one row.
fn chunk_rows(cols: usize) -> usize {
    ((4usize << 20) / cols.max(1)).clamp(1, 1024)
}

/// `(number of non-finite elements, largest finite magnitude)` of `x`, on all cores. Works on the
/// bits (vectorizes): an all-ones exponent is Inf/NaN, and the magnitude bits of finite values
/// order like the values.
fn scan_amax(x: &[bf16]) -> (usize, bf16) {
    fn scan(x: &[bf16]) -> (usize, u16) {
        x.iter().fold((0usize, 0u16), |(n, m), v| {
            let mag = v.to_bits() & 0x7FFF;
            let finite = mag < 0x7F80;
            (n + usize::from(!finite), if finite { m.max(mag) } else { m })
        })
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let chunk = x.len().div_ceil(threads).max(1 << 20);
    let (n, m) = std::thread::scope(|s| {
        let parts: Vec<_> = x.chunks(chunk).map(|c| s.spawn(move || scan(c))).collect();
        parts
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .fold((0, 0), |(n, m), (a, b)| (n + a, m.max(b)))
    });
    (n, bf16::from_bits(m))
}

/// Runs `work` on every item (`(rows in it, item)`) on all cores, printing `what: done/total
/// rows` to stderr at most every ~0.5 s while it runs (so quick runs print nothing). Returns the
/// first error.
fn run_chunked<T: Send>(
    what: &str,
    total_rows: usize,
    items: Vec<(usize, T)>,
    work: impl Fn(T) -> nvfp4_moe::Result<()> + Sync,
) -> nvfp4_moe::Result<()> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, items.len().max(1));
    let queue = Mutex::new(items.into_iter());
    let done = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let first_err: Mutex<Option<Error>> = Mutex::new(None);
    // When progress was last printed, and whether it ever was.
    let progress = Mutex::new((Instant::now(), false));
    let worker = || {
        while !failed.load(Ordering::Relaxed) {
            let next = queue.lock().unwrap_or_else(|p| p.into_inner()).next();
            let Some((n, item)) = next else { break };
            if let Err(e) = work(item) {
                first_err.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
                failed.store(true, Ordering::Relaxed);
                break;
            }
            let d = done.fetch_add(n, Ordering::Relaxed) + n;
            let mut p = progress.lock().unwrap_or_else(|p| p.into_inner());
            if d < total_rows && p.0.elapsed() >= Duration::from_millis(500) {
                eprintln!("  {what}: {d}/{total_rows} rows ({:.0}%)", 100.0 * d as f64 / total_rows.max(1) as f64);
                *p = (Instant::now(), true);
            }
        }
    };
    std::thread::scope(|s| {
        for _ in 1..threads {
            s.spawn(worker);
        }
        worker();
    });
    if let Some(e) = first_err.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e);
    }
    if progress.into_inner().unwrap_or_else(|p| p.into_inner()).1 {
        eprintln!("  {what}: {total_rows}/{total_rows} rows (100%)");
    }
    Ok(())
}

/// The CPU reference quantizer over row chunks on all cores (valid for the linear layout: the
/// codes and scales of consecutive row ranges are consecutive).
fn quantize_cpu(x: &[bf16], rows: usize, cols: usize, g: f32) -> nvfp4_moe::Result<(Vec<u8>, Vec<u8>)> {
    let mut codes = vec![0u8; rows * cols / 2];
    let mut scales = vec![0u8; rows * cols / 16];
    let ch = chunk_rows(cols);
    let items: Vec<_> = x
        .chunks(ch * cols)
        .zip(codes.chunks_mut(ch * cols / 2))
        .zip(scales.chunks_mut(ch * cols / 16))
        .map(|((x, c), s)| (x.len() / cols, (x, c, s)))
        .collect();
    run_chunked("cpu quantize", rows, items, |(x, c, s)| {
        let h = reference::quantize(x, x.len() / cols, cols, g, ScaleLayout::Linear)?;
        if h.codes.len() != c.len() || h.scales.len() != s.len() {
            return Err(Error::Invalid(format!(
                "reference quantizer returned {} code and {} scale bytes for {} rows, expected {} and {}",
                h.codes.len(),
                h.scales.len(),
                x.len() / cols,
                c.len(),
                s.len()
            )));
        }
        c.copy_from_slice(&h.codes);
        s.copy_from_slice(&h.scales);
        Ok(())
    })?;
    Ok((codes, scales))
}

/// The CPU reference dequantizer over row chunks on all cores.
fn dequantize_cpu(w: &ModelOptWeight) -> nvfp4_moe::Result<Vec<bf16>> {
    let (rows, cols) = (w.rows, w.cols);
    let mut out = vec![bf16::ZERO; rows * cols];
    let ch = chunk_rows(cols);
    let items: Vec<_> = w
        .codes
        .chunks(ch * cols / 2)
        .zip(w.scales.chunks(ch * cols / 16))
        .zip(out.chunks_mut(ch * cols))
        .map(|((c, s), o)| (o.len() / cols, (c, s, o)))
        .collect();
    run_chunked("cpu dequantize", rows, items, |(c, s, o)| {
        let h = Nvfp4Host {
            rows: o.len() / cols,
            cols,
            layout: ScaleLayout::Linear,
            decode_scale: w.decode_scale,
            codes: c.to_vec(),
            scales: s.to_vec(),
        };
        let y = reference::try_dequantize(&h)?;
        if y.len() != o.len() {
            return Err(Error::Invalid(format!(
                "reference dequantizer returned {} elements, expected {}",
                y.len(),
                o.len()
            )));
        }
        o.copy_from_slice(&y);
        Ok(())
    })?;
    Ok(out)
}

fn phase(name: &str, bytes: usize, t: Instant) {
    let d = t.elapsed();
    let rate = bytes as f64 / d.as_secs_f64().max(1e-9) / 1e9;
    eprintln!("  cuda {name:<8} {:>10} in {} ({rate:.1} GB/s)", fmt_bytes(bytes), fmt_dur(d));
}

/// The GPU quantizer on GPU 0, printing its phases. Returns (codes, scales, kernel time).
fn quantize_cuda(x: &[bf16], rows: usize, cols: usize, g: f32) -> nvfp4_moe::Result<(Vec<u8>, Vec<u8>, Duration)> {
    if rows == 0 {
        return Ok((Vec::new(), Vec::new(), Duration::ZERO));
    }
    let ctx = cudarc::driver::CudaContext::new(0)?;
    let stream = ctx.default_stream();
    let t = Instant::now();
    let xd = stream.clone_htod(x)?;
    stream.synchronize()?;
    phase("upload", x.len() * 2, t);
    let t = Instant::now();
    let q = nvfp4_moe::quantize_nvfp4(&stream, &xd, rows, cols, g, ScaleLayout::Linear)?;
    stream.synchronize()?;
    let kernel = t.elapsed();
    phase("kernel", x.len() * 2 + x.len() / 2 + x.len() / 16, t);
    let t = Instant::now();
    let h = q.to_host(&stream)?;
    phase("download", h.codes.len() + h.scales.len(), t);
    Ok((h.codes, h.scales, kernel))
}

/// The GPU dequantizer on GPU 0, printing its phases. Returns (values, kernel time).
fn dequantize_cuda(w: &ModelOptWeight) -> nvfp4_moe::Result<(Vec<bf16>, Duration)> {
    let n = w.rows * w.cols;
    if n == 0 {
        return Ok((Vec::new(), Duration::ZERO));
    }
    let ctx = cudarc::driver::CudaContext::new(0)?;
    let stream = ctx.default_stream();
    let host = Nvfp4Host {
        rows: w.rows,
        cols: w.cols,
        layout: ScaleLayout::Linear,
        decode_scale: w.decode_scale,
        codes: w.codes.clone(),
        scales: w.scales.clone(),
    };
    let t = Instant::now();
    let q = nvfp4_moe::Nvfp4Tensor::from_host(&stream, &host)?;
    stream.synchronize()?;
    phase("upload", w.codes.len() + w.scales.len(), t);
    let t = Instant::now();
    let yd = nvfp4_moe::dequantize_nvfp4(&stream, &q)?;
    stream.synchronize()?;
    let kernel = t.elapsed();
    phase("kernel", n * 2 + n / 2 + n / 16, t);
    let t = Instant::now();
    let mut y = stream.clone_dtoh(&yd)?;
    y.truncate(n);
    phase("download", n * 2, t);
    Ok((y, kernel))
}

/// Adds the file to a safetensors parse error, which does not name it.
fn file_ctx(path: &str) -> impl Fn(Error) -> Fail + '_ {
    move |e| match e {
        Error::Safetensors(s) => Fail::Run(format!("`{path}` is not a valid safetensors file: {s}")),
        e => Fail::from(e),
    }
}

fn backend_label(b: Backend, gpu: &str) -> String {
    match b {
        Backend::Cpu => "cpu (reference)".to_string(),
        Backend::Cuda => format!("cuda (GPU 0: {gpu})"),
    }
}

fn cmd_quantize(flags: &Flags) -> CliResult<()> {
    let requested = parse_backend(&QUANTIZE, flags)?;
    let (input, name, output) = (flags.req("input"), flags.req("tensor"), flags.req("output"));
    let prefix = prefix_of(flags);
    let t_all = Instant::now();

    let (x, rows, cols, src) = nio::read_matrix_bf16(input, name).map_err(file_ctx(input))?;
    let tensor_err = |e: Error| Fail::Run(format!("tensor `{name}` [{rows}, {cols}]: {e}"));
    out!("read `{name}` [{rows}, {cols}] {} from {input} ({})", src.name(), fmt_dur(t_all.elapsed()));
    if src == SourceDtype::F32 {
        out!("note: `{name}` is F32: rounded to BF16 (round-to-nearest-even) before quantizing");
    }
    reference::validate_quantize_shape(rows, cols).map_err(tensor_err)?;
    let (non_finite, amax) = scan_amax(&x);
    if non_finite > 0 {
        out!("warning: `{name}` holds {non_finite} non-finite element(s): Inf saturates (scale 448, code ±6), a NaN makes its block's scale NaN (0x7F)");
    }
    if amax.to_f32() == 0.0 {
        return Err(tensor_err(Error::Invalid(format!(
            "cannot derive a decode scale: none of its {} elements is finite and non-zero",
            x.len()
        ))));
    }
    // The reference's g of a tensor depends on its finite amax alone: a one-element tensor holding
    // that amax gives the same g without a second pass over the whole tensor.
    let g = reference::weight_decode_scale(&[amax]).map_err(tensor_err)?;
    let amax = amax.to_f32();

    let (backend, gpu) = resolve_backend(requested)?;
    let t = Instant::now();
    let (codes, scales, kernel) = match backend {
        Backend::Cpu => {
            let (c, s) = quantize_cpu(&x, rows, cols, g)?;
            (c, s, None)
        }
        Backend::Cuda => {
            let (c, s, k) = quantize_cuda(&x, rows, cols, g)?;
            (c, s, Some(k))
        }
    };
    let t_q = t.elapsed();
    drop(x);
    let kernel = kernel.map(|k| format!(", kernel {}", fmt_dur(k))).unwrap_or_default();
    out!("quantized on {} in {}{kernel}", backend_label(backend, &gpu), fmt_dur(t_q));
    out!(
        "decode scale g = {} (weight_scale_2; amax {} / (6 * 448)), linear block-16 scales",
        fmt_f32(g),
        fmt_f32(amax)
    );

    let t = Instant::now();
    let w = ModelOptWeight { codes, scales, decode_scale: g, rows, cols };
    nio::write_modelopt(output, &prefix, &w)?;
    out!(
        "wrote {output} ({}): {prefix}weight U8 [{rows}, {}], {prefix}weight_scale F8_E4M3 [{rows}, {}], {prefix}weight_scale_2 F32 [] in {}",
        fmt_bytes(w.codes.len() + w.scales.len() + 4),
        cols / 2,
        cols / 16,
        fmt_dur(t.elapsed())
    );
    out!("total {}", fmt_dur(t_all.elapsed()));
    Ok(())
}

fn cmd_dequantize(flags: &Flags) -> CliResult<()> {
    let requested = parse_backend(&DEQUANTIZE, flags)?;
    let (input, output) = (flags.req("input"), flags.req("output"));
    let prefix = prefix_of(flags);
    let out_name = flags.get("name").unwrap_or("weight");
    let t_all = Instant::now();

    let w = nio::read_modelopt(input, &prefix).map_err(file_ctx(input))?;
    let (rows, cols) = (w.rows, w.cols);
    out!(
        "read `{prefix}weight` NVFP4 [{rows}, {cols}] from {input}: decode scale g = {} ({})",
        fmt_f32(w.decode_scale),
        fmt_dur(t_all.elapsed())
    );

    let (backend, gpu) = resolve_backend(requested)?;
    let t = Instant::now();
    let (y, kernel) = match backend {
        Backend::Cpu => (dequantize_cpu(&w)?, None),
        Backend::Cuda => {
            let (y, k) = dequantize_cuda(&w)?;
            (y, Some(k))
        }
    };
    let kernel = kernel.map(|k| format!(", kernel {}", fmt_dur(k))).unwrap_or_default();
    out!("dequantized on {} in {}{kernel}", backend_label(backend, &gpu), fmt_dur(t.elapsed()));

    let t = Instant::now();
    nio::write_bf16(output, out_name, &y, rows, cols)?;
    out!("wrote {output} ({}): {out_name} BF16 [{rows}, {cols}] in {}", fmt_bytes(y.len() * 2), fmt_dur(t.elapsed()));
    out!("total {}", fmt_dur(t_all.elapsed()));
    Ok(())
}

// ------------------------------------------------------------------------------------------------
// The MoE layer: check, run, bench

/// Tolerance of `check`: relative Frobenius error, overall and of every token.
const CHECK_TOL: f64 = 1e-2;

/// The most tokens `check` takes (the f64 reference costs T x k x 3 x H x I multiply-adds).
const CHECK_MAX_TOKENS: usize = 4096;

/// Replays timed per (preset, T) by `bench`.
const BENCH_REPS: usize = 20;

/// Bytes of the L2 flush before each timed replay.
const FLUSH_BYTES: usize = 256 << 20;

/// Measured H200 ceilings (shared/design/BENCHMARKS.md), as the benches use them.
const HBM_BYTES_PER_S: f64 = 4.3e12;
const BF16_FLOPS_PER_S: f64 = 795e12;

/// GPU 0's name, or why the command cannot run on this machine.
fn require_gpu(cmd: &str) -> CliResult<String> {
    let gpus = info::gpus();
    let archs = info::build_info().cuda_archs;
    match gpus.first() {
        None => Err(Fail::Run(format!("`{cmd}` needs a CUDA GPU: none is visible"))),
        Some(g) if !arch_supported(g.compute_capability, &archs) => Err(Fail::Run(format!(
            "`{cmd}` needs a GPU this build has kernels for ({archs}): GPU 0 is {} (compute capability {}.{})",
            g.name, g.compute_capability.0, g.compute_capability.1
        ))),
        Some(g) => Ok(g.name.clone()),
    }
}

/// A positive token count (`flag` names it in the error).
fn parse_count(flag: &str, s: &str) -> std::result::Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err(format!("`--{flag}` values must be at least 1, got `{s}`")),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("`--{flag}` takes positive integers, got `{s}`")),
    }
}

/// A comma-separated list of positive token counts.
fn parse_token_list(s: &str) -> std::result::Result<Vec<usize>, String> {
    s.split(',').map(|v| parse_count("tokens", v)).collect()
}

/// A comma-separated list of preset names (each at most once).
fn parse_preset_list(s: &str) -> std::result::Result<Vec<Preset>, String> {
    let mut out: Vec<Preset> = Vec::new();
    for name in s.split(',').map(str::trim) {
        let p = presets::preset(name).map_err(|e| e.to_string())?;
        if out.iter().any(|q| q.name == p.name) {
            return Err(format!("preset `{name}` given twice"));
        }
        out.push(p);
    }
    Ok(out)
}

fn parse_tile(s: &str) -> Option<GemmTile> {
    match s {
        "auto" => Some(GemmTile::Auto),
        "n16" => Some(GemmTile::M128N16),
        "n64" => Some(GemmTile::M128N64),
        "n128" => Some(GemmTile::M128N128),
        _ => None,
    }
}

/// Tolerances of `check --intermediate nvfp4` (overall, worst token): quantizing the SwiGLU
/// intermediate to NVFP4 alone costs ~9% relative RMS (simulated 8.8%), which the second GEMM
/// carries to the output; a token has only H outputs, so its error spreads more.
const CHECK_TOL_NVFP4: (f64, f64) = (0.15, 0.25);

/// Whether `check` passes: both errors within `(overall, worst token)` tolerances (a NaN fails).
fn within_tol(overall: f64, worst: f64, tol: (f64, f64)) -> bool {
    overall <= tol.0 && worst <= tol.1
}

/// `--intermediate`: whether the layer hands the second GEMM NVFP4 (true) or BF16.
fn parse_intermediate(flags: &Flags, cmd: &Command) -> CliResult<bool> {
    match flags.get("intermediate").unwrap_or("bf16") {
        "bf16" => Ok(false),
        "nvfp4" => Ok(true),
        other => Err(usage_err(cmd, format!("`--intermediate` is bf16 or nvfp4 (got `{other}`)"))),
    }
}

/// `||got - want|| / ||want||` (Frobenius); 0 when both are zero, infinite when only `want` is.
fn rel_frobenius(num_sq: f64, den_sq: f64) -> f64 {
    if num_sq == 0.0 {
        0.0
    } else if den_sq == 0.0 {
        f64::INFINITY
    } else {
        (num_sq / den_sq).sqrt()
    }
}

/// The relative Frobenius error of `got` against `want` (`[T, H]` each): `(overall, worst token,
/// its error)`. A NaN anywhere makes the errors NaN (and so fails every `<=` test).
fn rel_errors(got: &[bf16], want: &[f64], hidden: usize) -> (f64, usize, f64) {
    let (mut num, mut den) = (0f64, 0f64);
    let (mut worst_t, mut worst) = (0usize, 0f64);
    for (t, (g, w)) in got.chunks(hidden).zip(want.chunks(hidden)).enumerate() {
        let (mut n, mut d) = (0f64, 0f64);
        for (a, b) in g.iter().zip(w) {
            let diff = f64::from(a.to_f32()) - b;
            n += diff * diff;
            d += b * b;
        }
        num += n;
        den += d;
        let e = rel_frobenius(n, d);
        // The first NaN token is the worst; else the largest error.
        if t == 0 || (e.is_nan() && !worst.is_nan()) || e > worst {
            (worst_t, worst) = (t, e);
        }
    }
    (rel_frobenius(num, den), worst_t, worst)
}

/// Balanced routing of `tokens` tokens: slot j of token t goes to expert `(t * k + j) % E` (the
/// k ids of a token are distinct when k <= E, and every expert gets the same count +- 1).
fn balanced_ids(tokens: usize, top_k: usize, experts: usize) -> Vec<i32> {
    (0..tokens * top_k).map(|p| (p % experts) as i32).collect()
}

/// Weight bytes read and FLOPs of one forward of `tokens` tokens over preset `p`.
fn bench_work(p: &Preset, tokens: usize) -> (f64, f64) {
    let pairs = tokens * p.top_k;
    let active = p.experts.min(pairs) as f64;
    let hi = (p.hidden * p.intermediate) as f64;
    (active * 3.0 * hi * 0.5625, 2.0 * pairs as f64 * 3.0 * hi)
}

/// The roofline floor of `(bytes, flops)` in microseconds.
fn floor_us(bytes: f64, flops: f64) -> f64 {
    (bytes / HBM_BYTES_PER_S).max(flops / BF16_FLOPS_PER_S) * 1e6
}

/// The f64 reference layer, tokens split over all cores.
fn reference_layer(
    ck: &nvfp4_moe::checkpoint::MoeCheckpoint,
    hidden: &[bf16],
    tokens: usize,
    ids: &[i32],
    weights: &[f32],
    top_k: usize,
) -> nvfp4_moe::Result<Vec<f64>> {
    let h = ck.hidden;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, tokens.max(1));
    let per = tokens.div_ceil(threads).max(1);
    let parts: Vec<nvfp4_moe::Result<Vec<f64>>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..tokens)
            .step_by(per)
            .map(|t0| {
                let t1 = (t0 + per).min(tokens);
                s.spawn(move || {
                    routing::moe_layer(
                        &hidden[t0 * h..t1 * h],
                        t1 - t0,
                        &ids[t0 * top_k..t1 * top_k],
                        &weights[t0 * top_k..t1 * top_k],
                        top_k,
                        ck,
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e))).collect()
    });
    let mut out = Vec::with_capacity(tokens * h);
    for p in parts {
        out.extend(p?);
    }
    Ok(out)
}

fn cmd_check(flags: &Flags) -> CliResult<()> {
    let p = presets::preset(flags.get("preset").unwrap_or("qwen3-30b-a3b")).map_err(|e| usage_err(&CHECK, e))?;
    let tokens = match flags.get("tokens") {
        None => 4,
        Some(s) => parse_count("tokens", s).map_err(|e| usage_err(&CHECK, e))?,
    };
    if tokens > CHECK_MAX_TOKENS {
        return Err(usage_err(&CHECK, format!("`--tokens` is at most {CHECK_MAX_TOKENS} (got {tokens})")));
    }
    let nvfp4 = parse_intermediate(flags, &CHECK)?;
    let tol = if nvfp4 { CHECK_TOL_NVFP4 } else { (CHECK_TOL, CHECK_TOL) };
    let gpu = require_gpu("check")?;
    let (e, h, i, k) = (p.experts, p.hidden, p.intermediate, p.top_k);
    let t_all = Instant::now();
    out!("check {}: E={e} H={h} I={i} top-k={k}, {tokens} token(s), GPU 0: {gpu}", p.name);
    if p.layer_bytes() >= 1 << 30 {
        eprintln!("note: the random checkpoint is held on the host: {} of host memory", fmt_bytes(p.layer_bytes()));
    }

    let mut rng = Rng::from_entropy();
    eprintln!("generating a random checkpoint ({})...", fmt_bytes(p.layer_bytes()));
    let t = Instant::now();
    let ck = nvfp4_moe::testing::random_moe_checkpoint(&mut rng, e, h, i);
    let logits: Vec<f32> = (0..tokens * e).map(|_| rng.normal()).collect();
    let (ids, weights) = routing::softmax_topk(&logits, tokens, e, k, true)?;
    let hidden = rng.normal_bf16(tokens * h, 1.0);
    eprintln!("  done in {}", fmt_dur(t.elapsed()));

    eprintln!("uploading and preparing the weights on GPU 0...");
    let t = Instant::now();
    let ctx = cudarc::driver::CudaContext::new(0)?;
    let stream = ctx.default_stream();
    let mut layer = MoeLayer::new(MoeWeights::from_checkpoint(&stream, &ck)?, MoeOptions::new(tokens, k))?;
    let mut ws = layer.workspace(&stream)?;
    let (hd, idd, wd) = (stream.clone_htod(&hidden)?, stream.clone_htod(&ids)?, stream.clone_htod(&weights)?);
    if nvfp4 {
        let g = layer.calibrate_nvfp4_scale(&stream, &hd, tokens, &idd, k, &mut ws)?;
        out!("NVFP4 intermediate, calibrated decode scale {g:.4e}");
        layer = layer.with_intermediate(nvfp4_moe::Intermediate::Nvfp4 { decode_scale: g })?;
        ws = layer.workspace(&stream)?;
    }
    stream.synchronize()?;
    eprintln!("  done in {}", fmt_dur(t.elapsed()));

    eprintln!("running the forward...");
    let t = Instant::now();
    let mut out_d = stream.alloc_zeros::<bf16>(tokens * h)?;
    let input = nvfp4_moe::moe::MoeInput { hidden: &hd, tokens, topk_ids: &idd, topk_weights: &wd, top_k: k };
    layer.forward(&stream, &input, &mut out_d, &mut ws)?;
    layer.check(&stream, &mut ws, k)?;
    let got = stream.clone_dtoh(&out_d)?;
    eprintln!("  done in {}", fmt_dur(t.elapsed()));
    drop((layer, ws, hd, idd, wd, out_d));

    eprintln!("computing the CPU f64 reference ({} multiply-adds)...", tokens * k * 3 * h * i);
    let t = Instant::now();
    let want = reference_layer(&ck, &hidden, tokens, &ids, &weights, k)?;
    eprintln!("  done in {}", fmt_dur(t.elapsed()));

    let (overall, worst_t, worst) = rel_errors(&got, &want, h);
    out!(
        "relative Frobenius error: overall {overall:.3e}, worst token {worst_t}: {worst:.3e} (tolerance {} / {})",
        tol.0,
        tol.1
    );
    out!("total {}", fmt_dur(t_all.elapsed()));
    if !within_tol(overall, worst, tol) {
        return Err(Fail::Run(format!(
            "check {} failed: relative error overall {overall:.3e}, token {worst_t} {worst:.3e} (tolerance {} / {})",
            p.name, tol.0, tol.1
        )));
    }
    out!("ok");
    Ok(())
}

/// The inputs of `run`, validated.
#[derive(Debug)]
struct RunInputs {
    hidden: Vec<bf16>,
    ids: Vec<i32>,
    weights: Vec<f32>,
    tokens: usize,
    hidden_size: usize,
    top_k: usize,
}

fn shape_text(shape: &[usize]) -> String {
    format!("[{}]", shape.iter().map(usize::to_string).collect::<Vec<_>>().join(", "))
}

/// Tensor `name` of `st`, of `dtype`, 2-D: `(view, rows, cols)`.
fn tensor_2d<'a>(
    st: &'a safetensors::SafeTensors<'a>,
    file: &str,
    name: &str,
    dtype: safetensors::Dtype,
    dims: &str,
) -> std::result::Result<(safetensors::tensor::TensorView<'a>, usize, usize), String> {
    let t = st.tensor(name).map_err(|_| {
        let mut names = st.names();
        names.sort();
        let held = if names.is_empty() {
            "none".to_string()
        } else {
            names.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ")
        };
        format!("`{file}` has no tensor `{name}` (it holds {held})")
    })?;
    if t.dtype() != dtype {
        return Err(format!("tensor `{name}`: dtype is {}, expected {dtype} {dims}", t.dtype()));
    }
    let &[rows, cols] = t.shape() else {
        return Err(format!("tensor `{name}`: shape is {}, expected 2-D {dims}", shape_text(t.shape())));
    };
    Ok((t, rows, cols))
}

/// Reads and validates `hidden_states` (BF16 `[T, H]`), `topk_ids` (I32 `[T, k]`) and
/// `topk_weights` (F32 `[T, k]`) with T, H, k >= 1 and k <= 32.
fn parse_run_inputs(st: &safetensors::SafeTensors<'_>, file: &str) -> std::result::Result<RunInputs, String> {
    use safetensors::Dtype;
    let (hs, tokens, hidden_size) = tensor_2d(st, file, "hidden_states", Dtype::BF16, "[T, H]")?;
    if tokens == 0 || hidden_size == 0 {
        return Err(format!(
            "tensor `hidden_states`: shape is {}, expected [T, H] with T, H >= 1",
            shape_text(hs.shape())
        ));
    }
    let (ti, t2, top_k) = tensor_2d(st, file, "topk_ids", Dtype::I32, "[T, k]")?;
    if t2 != tokens || top_k == 0 || top_k > 32 {
        return Err(format!(
            "tensor `topk_ids`: shape is {}, expected [{tokens}, k] with 1 <= k <= 32 (T = {tokens} from `hidden_states`)",
            shape_text(ti.shape())
        ));
    }
    let (tw, _, _) = tensor_2d(st, file, "topk_weights", Dtype::F32, "[T, k]")?;
    if tw.shape() != [tokens, top_k] {
        return Err(format!(
            "tensor `topk_weights`: shape is {}, expected [{tokens}, {top_k}] (the shape of `topk_ids`)",
            shape_text(tw.shape())
        ));
    }
    let hidden = hs.data().chunks_exact(2).map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]]))).collect();
    let ids = ti.data().chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    let weights = tw.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    Ok(RunInputs { hidden, ids, weights, tokens, hidden_size, top_k })
}

/// `run`'s checks of the inputs against the checkpoint's shape.
fn check_run_shape(inp: &RunInputs, experts: usize, hidden: usize) -> std::result::Result<(), String> {
    if inp.hidden_size != hidden {
        return Err(format!(
            "tensor `hidden_states`: shape is [{}, {}], but the checkpoint's hidden size is {hidden}",
            inp.tokens, inp.hidden_size
        ));
    }
    if inp.top_k > experts.min(32) {
        return Err(format!("tensor `topk_ids`: k = {} exceeds min(experts ({experts}), 32)", inp.top_k));
    }
    Ok(())
}

fn cmd_run(flags: &Flags) -> CliResult<()> {
    let (weights_path, prefix, input, output) =
        (flags.req("weights"), flags.req("prefix"), flags.req("input"), flags.req("output"));
    let tile = match flags.get("tile") {
        None => GemmTile::Auto,
        Some(s) => {
            parse_tile(s).ok_or_else(|| usage_err(&RUN, format!("unknown tile `{s}` (expected auto, n16 or n128)")))?
        }
    };
    let gpu = require_gpu("run")?;
    let t_all = Instant::now();

    let t = Instant::now();
    let bytes = std::fs::read(input).map_err(|e| Fail::Run(format!("cannot read `{input}`: {e}")))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| Fail::Run(format!("`{input}` is not a valid safetensors file: {e}")))?;
    let inp = parse_run_inputs(&st, input).map_err(Fail::Run)?;
    drop(st);
    drop(bytes);
    let (tokens, k) = (inp.tokens, inp.top_k);
    out!(
        "read {input}: hidden_states BF16 [{tokens}, {}], topk_ids I32 [{tokens}, {k}], topk_weights F32 [{tokens}, {k}] ({})",
        inp.hidden_size,
        fmt_dur(t.elapsed())
    );

    let t = Instant::now();
    eprintln!("loading `{prefix}` from {weights_path}...");
    let ck = nvfp4_moe::checkpoint::load_modelopt(weights_path, prefix)?;
    let (e, h, i) = (ck.experts, ck.hidden, ck.intermediate);
    check_run_shape(&inp, e, h).map_err(Fail::Run)?;
    out!("loaded `{prefix}` (naming {}): E={e} H={h} I={i} ({})", ck.naming, fmt_dur(t.elapsed()));

    let t = Instant::now();
    eprintln!("uploading and preparing the weights on GPU 0 ({gpu})...");
    let ctx = cudarc::driver::CudaContext::new(0)?;
    let stream = ctx.default_stream();
    let weights = MoeWeights::from_checkpoint(&stream, &ck)?;
    drop(ck);
    stream.synchronize()?;
    eprintln!("  done in {}", fmt_dur(t.elapsed()));

    let layer = MoeLayer::new(weights, MoeOptions { tile, ..MoeOptions::new(tokens, k) })?;
    let mut ws = layer.workspace(&stream)?;
    let (hd, idd, wd) =
        (stream.clone_htod(&inp.hidden)?, stream.clone_htod(&inp.ids)?, stream.clone_htod(&inp.weights)?);
    let mut out_d = stream.alloc_zeros::<bf16>(tokens * h)?;
    stream.synchronize()?;
    let t = Instant::now();
    let input = nvfp4_moe::moe::MoeInput { hidden: &hd, tokens, topk_ids: &idd, topk_weights: &wd, top_k: k };
    layer.forward(&stream, &input, &mut out_d, &mut ws)?;
    layer.check(&stream, &mut ws, k)?;
    let fwd = t.elapsed();
    let tile_used = match tile {
        GemmTile::Auto => GemmTile::choose(tokens * k, e),
        t => t,
    };
    out!(
        "forward on GPU 0 ({gpu}): {tokens} token(s) x top-{k}, tile {tile_used:?}, {} (wall clock, first call)",
        fmt_dur(fwd)
    );
    let y = stream.clone_dtoh(&out_d)?;

    let t = Instant::now();
    nio::write_bf16(output, "out", &y, tokens, h)?;
    out!("wrote {output} ({}): out BF16 [{tokens}, {h}] in {}", fmt_bytes(y.len() * 2), fmt_dur(t.elapsed()));
    out!("total {}", fmt_dur(t_all.elapsed()));
    Ok(())
}

/// One timed (preset, T) of `bench`.
struct BenchRow {
    preset: &'static str,
    tokens: usize,
    tile: GemmTile,
    us: f64,
    bytes: f64,
    flops: f64,
}

impl BenchRow {
    fn tbps(&self) -> f64 {
        self.bytes / (self.us * 1e-6) / 1e12
    }
    fn tflops(&self) -> f64 {
        self.flops / (self.us * 1e-6) / 1e12
    }
    fn floor_ratio(&self) -> f64 {
        floor_us(self.bytes, self.flops) / self.us
    }
}

/// Captures one forward into a CUDA graph and returns the median replay time (us) over
/// [`BENCH_REPS`] replays, each after an L2 flush.
#[allow(clippy::too_many_arguments)]
fn time_forward(
    stream: &Arc<CudaStream>,
    layer: &MoeLayer,
    ws: &mut MoeWorkspace,
    hidden: &CudaSlice<bf16>,
    ids: &CudaSlice<i32>,
    weights: &CudaSlice<f32>,
    out: &mut CudaSlice<bf16>,
    tokens: usize,
    top_k: usize,
    flush: &mut CudaSlice<u8>,
) -> nvfp4_moe::Result<f64> {
    use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
    stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    let input = nvfp4_moe::moe::MoeInput { hidden, tokens, topk_ids: ids, topk_weights: weights, top_k };
    let captured = layer.forward(stream, &input, out, ws);
    let graph = stream.end_capture(CUgraphInstantiate_flags(0));
    captured?;
    let graph = graph?.ok_or_else(|| Error::Invalid("capturing the forward gave an empty CUDA graph".into()))?;
    graph.upload()?;
    for _ in 0..3 {
        graph.launch()?;
    }
    layer.check(stream, ws, top_k)?;
    let ctx = stream.context();
    let (start, end) =
        (ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?, ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?);
    let mut times = Vec::with_capacity(BENCH_REPS);
    for _ in 0..BENCH_REPS {
        stream.memset_zeros(flush)?;
        start.record(stream)?;
        graph.launch()?;
        end.record(stream)?;
        end.synchronize()?;
        times.push(f64::from(start.elapsed_ms(&end)?) * 1e3);
    }
    layer.check(stream, ws, top_k)?;
    Ok(median(&mut times))
}

/// The median (the upper one for an even count); NaN for none.
fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn bench_json(rows: &[BenchRow]) -> String {
    let items: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| {
            let p = presets::preset(r.preset).ok();
            serde_json::json!({
                "preset": r.preset,
                "experts": p.map(|p| p.experts),
                "hidden": p.map(|p| p.hidden),
                "intermediate": p.map(|p| p.intermediate),
                "top_k": p.map(|p| p.top_k),
                "tokens": r.tokens,
                "tile": format!("{:?}", r.tile),
                "us": r.us,
                "weight_bytes": r.bytes,
                "flops": r.flops,
                "tbps": r.tbps(),
                "tflops": r.tflops(),
                "floor_ratio": r.floor_ratio(),
            })
        })
        .collect();
    let mut s = serde_json::to_string_pretty(&serde_json::Value::Array(items)).unwrap_or_default();
    s.push('\n');
    s
}

fn cmd_bench(flags: &Flags) -> CliResult<()> {
    let presets =
        parse_preset_list(flags.get("preset").unwrap_or("qwen3-30b-a3b")).map_err(|e| usage_err(&BENCH, e))?;
    let tokens =
        parse_token_list(flags.get("tokens").unwrap_or("1,16,128,1024,8192")).map_err(|e| usage_err(&BENCH, e))?;
    let nvfp4 = parse_intermediate(flags, &BENCH)?;
    let max_t = tokens.iter().copied().max().unwrap_or(1);
    for p in &presets {
        if max_t.checked_mul(p.top_k).is_none_or(|v| v > i32::MAX as usize) {
            return Err(usage_err(&BENCH, format!("{max_t} tokens x top-k {} is too many for {}", p.top_k, p.name)));
        }
    }
    let gpu = require_gpu("bench")?;
    eprintln!("bench on GPU 0 ({gpu}): {} preset(s), tokens {:?}, {BENCH_REPS} replays each", presets.len(), tokens);

    let ctx = cudarc::driver::CudaContext::new(0)?;
    // SAFETY: everything below runs on one stream, so no cross-stream synchronization is needed;
    // without event tracking nothing records an event inside the graph capture.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream()?;
    let mut flush = stream.alloc_zeros::<u8>(FLUSH_BYTES)?;
    let mut rng = Rng::from_entropy();
    let mut rows = Vec::new();
    for p in &presets {
        let (e, h, i, k) = (p.experts, p.hidden, p.intermediate, p.top_k);
        eprintln!(
            "{}: E={e} H={h} I={i} top-k={k}: making {} of random weights on the device...",
            p.name,
            fmt_bytes(p.layer_bytes())
        );
        let t = Instant::now();
        let w13 = nvfp4_moe::testing::random_device_weights(&stream, &mut rng, e, 2 * i, h, true)?;
        let w2 = nvfp4_moe::testing::random_device_weights(&stream, &mut rng, e, h, i, false)?;
        let weights = MoeWeights { w13, w2, experts: e, hidden: h, intermediate: i };
        let mut layer = MoeLayer::new(weights, MoeOptions::new(max_t, k))?;
        let mut ws = layer.workspace(&stream)?;
        let hidden = stream.clone_htod(&rng.normal_bf16(max_t * h, 1.0))?;
        // Token t's routing does not depend on T: one buffer serves every T as a prefix.
        let ids = stream.clone_htod(&balanced_ids(max_t, k, e))?;
        if nvfp4 {
            let g = layer.calibrate_nvfp4_scale(&stream, &hidden, max_t.min(64), &ids, k, &mut ws)?;
            eprintln!("  NVFP4 intermediate, calibrated decode scale {g:.4e}");
            layer = layer.with_intermediate(nvfp4_moe::Intermediate::Nvfp4 { decode_scale: g })?;
            ws = layer.workspace(&stream)?;
        }
        let weights = stream.clone_htod(&vec![1.0 / k as f32; max_t * k])?;
        let mut out = stream.alloc_zeros::<bf16>(max_t * h)?;
        stream.synchronize()?;
        eprintln!("  ready in {}", fmt_dur(t.elapsed()));
        for &t in &tokens {
            let us = time_forward(&stream, &layer, &mut ws, &hidden, &ids, &weights, &mut out, t, k, &mut flush)?;
            let (bytes, flops) = bench_work(p, t);
            let row = BenchRow { preset: p.name, tokens: t, tile: GemmTile::choose(t * k, e), us, bytes, flops };
            eprintln!(
                "  T={t}: {us:.1} us, {:.2} TB/s, {:.1} TFLOP/s, floor/t {:.2}",
                row.tbps(),
                row.tflops(),
                row.floor_ratio()
            );
            rows.push(row);
        }
    }

    out!("{:<16} {:>6} {:>9} {:>11} {:>8} {:>9} {:>8}", "preset", "T", "tile", "us", "TB/s", "TFLOP/s", "floor/t");
    for r in &rows {
        out!(
            "{:<16} {:>6} {:>9} {:>11.2} {:>8.3} {:>9.1} {:>8.2}",
            r.preset,
            r.tokens,
            format!("{:?}", r.tile),
            r.us,
            r.tbps(),
            r.tflops(),
            r.floor_ratio()
        );
    }
    out!("(median of {BENCH_REPS} CUDA-graph replays, L2 flushed; floor/t = max(bytes / 4.3 TB/s, flops / 795 TFLOP/s) / time)");
    if let Some(path) = flags.get("json") {
        std::fs::write(path, bench_json(&rows)).map_err(|e| Fail::Run(format!("cannot write `{path}`: {e}")))?;
        out!("wrote {path} ({} rows)", rows.len());
    }
    Ok(())
}

fn cmd_info() -> CliResult<()> {
    let b = info::build_info();
    let (ma, mi, pa) = b.cutlass_version;
    out!("nvfp4-moe {VERSION}");
    out!("build:");
    out!("  CUDA compiled against  {}", info::cuda_version_string(b.cuda_version));
    out!("  target archs           {}", if b.cuda_archs.is_empty() { "(none)" } else { &b.cuda_archs });
    out!("  CUTLASS                {ma}.{mi}.{pa}");
    out!("  CUDA runtime           {}", info::cuda_version_string(b.runtime_version));
    out!(
        "  CUDA driver            {}",
        if b.driver_version > 0 {
            info::cuda_version_string(b.driver_version)
        } else {
            "none (no driver loaded)".into()
        }
    );
    let gpus = info::gpus();
    if gpus.is_empty() {
        out!("no CUDA GPU visible");
    } else {
        out!("GPUs:");
        for g in &gpus {
            let (ma, mi) = g.compute_capability;
            let ok = if arch_supported(g.compute_capability, &b.cuda_archs) {
                "supported by this build"
            } else {
                "NOT supported by this build"
            };
            out!(
                "  [{}] {}: compute capability {ma}.{mi}, {:.1} GiB, {} SMs ({ok})",
                g.ordinal,
                g.name,
                g.total_mem as f64 / (1u64 << 30) as f64,
                g.multiprocessors
            );
        }
    }
    Ok(())
}

fn run(args: &[String]) -> CliResult<()> {
    let Some(first) = args.first() else {
        return Err(top_usage_err("no command given"));
    };
    let rest = &args[1..];
    match first.as_str() {
        "-h" | "--help" => {
            print_help();
            Ok(())
        }
        "-V" | "--version" | "version" => {
            out!("nvfp4-moe {VERSION}");
            Ok(())
        }
        "help" => match rest {
            [] => {
                print_help();
                Ok(())
            }
            [c] => match ALL.iter().find(|cmd| cmd.name == c.as_str()) {
                Some(cmd) => {
                    print_command_help(cmd);
                    Ok(())
                }
                None => Err(top_usage_err(format!("unknown command `{c}`"))),
            },
            _ => Err(top_usage_err("`help` takes at most one command")),
        },
        c => {
            let Some(cmd) = ALL.iter().find(|cmd| cmd.name == c) else {
                return Err(top_usage_err(format!("unknown command `{c}`")));
            };
            let Some(flags) = parse_flags(cmd, rest)? else {
                print_command_help(cmd);
                return Ok(());
            };
            match cmd.name {
                "quantize" => cmd_quantize(&flags),
                "dequantize" => cmd_dequantize(&flags),
                "check" => cmd_check(&flags),
                "run" => cmd_run(&flags),
                "bench" => cmd_bench(&flags),
                _ => cmd_info(),
            }
        }
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_string()
    }
}

fn main() -> ExitCode {
    // Last resort: a panic prints one line (the first one only), never a trace.
    static PANICKED: AtomicBool = AtomicBool::new(false);
    std::panic::set_hook(Box::new(|p| {
        if !PANICKED.swap(true, Ordering::SeqCst) {
            let at = p.location().map(|l| format!(" (at {}:{})", l.file(), l.line())).unwrap_or_default();
            eprintln!("error: internal error: {}{at}", panic_message(p.payload()).replace('\n', " "));
        }
    }));

    let mut args = Vec::new();
    for a in std::env::args_os().skip(1) {
        match a.into_string() {
            Ok(s) => args.push(s),
            Err(a) => {
                eprintln!("error: argument {a:?} is not valid UTF-8\n\n{USAGE}");
                return ExitCode::from(2);
            }
        }
    }

    match std::panic::catch_unwind(|| run(&args)) {
        Ok(Ok(())) => ExitCode::SUCCESS,
        Ok(Err(Fail::Run(msg))) => {
            eprintln!("error: {msg}");
            ExitCode::from(1)
        }
        Ok(Err(Fail::Usage { msg, usage, help_cmd })) => {
            let more = if help_cmd.is_empty() {
                "nvfp4-moe --help".to_string()
            } else {
                format!("nvfp4-moe {help_cmd} --help")
            };
            if usage == USAGE {
                eprintln!("error: {msg}\n\n{usage}\n\nRun `{more}` for details.");
            } else {
                eprintln!("error: {msg}\n\nUsage:\n  {usage}\n\nRun `{more}` for details.");
            }
            ExitCode::from(2)
        }
        Err(_) => ExitCode::from(1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arch_lists() {
        assert!(arch_supported((9, 0), "90a-real"));
        assert!(!arch_supported((8, 0), "90a-real"));
        assert!(!arch_supported((10, 0), "90a-real"));
        assert!(arch_supported((10, 0), "90a-real;100a-real"));
        assert!(arch_supported((9, 0), "90"));
        assert!(arch_supported((12, 0), "90-virtual"));
        assert!(!arch_supported((8, 6), "90-virtual"));
        assert!(arch_supported((8, 9), "80-real"));
        assert!(!arch_supported((9, 0), "80-real"));
        assert!(arch_supported((9, 0), ""));
        assert!(arch_supported((9, 0), "garbage"));
    }

    #[test]
    fn amax_scan_matches_a_plain_scan_and_gives_the_reference_g() {
        let mut r = nvfp4_moe::testing::Rng::from_entropy();
        eprintln!("seed = {:#x}", r.seed());
        for n in [1usize, 17, 1000, (1 << 20) + 3, 3 << 20] {
            let mut x = r.varied_bf16(n);
            for _ in 0..r.range(0, 4) {
                let i = r.range(0, n);
                x[i] =
                    [bf16::NAN, bf16::INFINITY, bf16::NEG_INFINITY, bf16::from_bits(0xFF81), bf16::from_bits(0x0001)]
                        [r.range(0, 5)];
            }
            let want_nf = x.iter().filter(|v| !v.is_finite()).count();
            let want_amax = x.iter().map(|v| v.to_f32()).filter(|v| v.is_finite()).fold(0f32, |m, v| m.max(v.abs()));
            let (nf, amax) = scan_amax(&x);
            assert_eq!((nf, amax.to_f32()), (want_nf, want_amax), "n = {n}");
            if want_amax > 0.0 {
                let g = reference::weight_decode_scale(&x).unwrap();
                assert_eq!(reference::weight_decode_scale(&[amax]).unwrap().to_bits(), g.to_bits(), "n = {n}");
            }
        }
        assert_eq!(scan_amax(&[]), (0, bf16::ZERO));
        assert_eq!(scan_amax(&[bf16::NAN, bf16::from_f32(-0.0)]), (1, bf16::ZERO));
    }

    #[test]
    fn chunks() {
        assert_eq!(chunk_rows(16), 1024);
        assert_eq!(chunk_rows(7168), 585);
        assert_eq!(chunk_rows(1 << 24), 1);
    }

    fn args(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    fn usage_msg(r: CliResult<Option<Flags>>) -> String {
        match r {
            Err(Fail::Usage { msg, .. }) => msg,
            Err(Fail::Run(m)) => panic!("run error {m}"),
            Ok(_) => panic!("parsed"),
        }
    }

    #[test]
    fn moe_command_flags() {
        let f = parse_flags(&CHECK, &[]).unwrap().unwrap();
        assert_eq!((f.get("preset"), f.get("tokens")), (None, None));
        let f = parse_flags(&CHECK, &args(&["--preset", "kimi-k2", "--tokens=7"])).unwrap().unwrap();
        assert_eq!((f.get("preset"), f.get("tokens")), (Some("kimi-k2"), Some("7")));
        assert!(parse_flags(&CHECK, &args(&["--help"])).unwrap().is_none());
        assert!(usage_msg(parse_flags(&CHECK, &args(&["--json", "x"]))).contains("unknown flag `--json`"));

        let m = usage_msg(parse_flags(&RUN, &args(&["--weights", "w"])));
        assert!(m.contains("missing required flags --prefix, --input, --output"), "{m}");
        let f = parse_flags(&RUN, &args(&["--weights", "w", "--prefix", "", "--input", "x", "--output", "y"]))
            .unwrap()
            .unwrap();
        assert_eq!((f.req("weights"), f.req("prefix"), f.get("tile")), ("w", "", None));

        let f = parse_flags(&BENCH, &args(&["--preset", "deepseek-v3,mixtral-8x7b", "--tokens", "1,8", "--json", "o"]))
            .unwrap()
            .unwrap();
        assert_eq!(
            (f.get("preset"), f.get("tokens"), f.get("json")),
            (Some("deepseek-v3,mixtral-8x7b"), Some("1,8"), Some("o"))
        );
        assert!(usage_msg(parse_flags(&BENCH, &args(&["--tile", "n16"]))).contains("unknown flag `--tile`"));

        for cmd in [&CHECK, &RUN, &BENCH] {
            assert!(ALL.iter().any(|c| c.name == cmd.name));
            assert!(USAGE.contains(&format!("nvfp4-moe {}", cmd.name)), "{}", cmd.name);
            assert!(COMMANDS.contains(&format!("  {} ", cmd.name)), "{}", cmd.name);
            for (flag, _) in cmd.flags {
                assert!(cmd.usage.contains(&format!("--{flag}")), "{} --{flag}", cmd.name);
                assert!(cmd.help.contains(&format!("--{flag}")), "{} --{flag}", cmd.name);
            }
        }
        // The preset table in `check --help` is the built-in one.
        for p in presets::PRESETS {
            let line = format!("{:<16}{:>4}{:>6}{:>7}{:>3}", p.name, p.experts, p.hidden, p.intermediate, p.top_k);
            let line: String = line.split_whitespace().collect::<Vec<_>>().join(" ");
            assert!(CHECK_HELP.lines().any(|l| l.split_whitespace().collect::<Vec<_>>().join(" ") == line), "{line}");
            assert!(COMMANDS.contains(p.name), "{}", p.name);
        }
    }

    #[test]
    fn moe_value_parsing() {
        assert_eq!(parse_token_list("1,16,128,1024,8192").unwrap(), vec![1, 16, 128, 1024, 8192]);
        assert_eq!(parse_token_list(" 3 , 5").unwrap(), vec![3, 5]);
        for bad in ["", "0", "1,,2", "1,-2", "x", "1.5", "4,0"] {
            assert!(parse_token_list(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_count("tokens", "4"), Ok(4));
        assert!(parse_count("tokens", "0").unwrap_err().contains("at least 1"));
        let ps = parse_preset_list("qwen3-30b-a3b,gpt-oss-120b").unwrap();
        assert_eq!(ps.iter().map(|p| p.name).collect::<Vec<_>>(), ["qwen3-30b-a3b", "gpt-oss-120b"]);
        assert_eq!(ps[1].hidden, 2880);
        let e = parse_preset_list("qwen3-30b-a3b,llama").unwrap_err();
        assert!(e.contains("unknown preset `llama`") && e.contains("deepseek-v3") && e.contains("kimi-k2"), "{e}");
        assert!(parse_preset_list("kimi-k2,kimi-k2").unwrap_err().contains("twice"));
        assert_eq!(parse_tile("auto"), Some(GemmTile::Auto));
        assert_eq!(parse_tile("n16"), Some(GemmTile::M128N16));
        assert_eq!(parse_tile("n64"), Some(GemmTile::M128N64));
        assert_eq!(parse_tile("n128"), Some(GemmTile::M128N128));
        assert_eq!(parse_tile("N16"), None);
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
        let (b, f) = bench_work(&p, 1);
        assert_eq!(b, 8.0 * 3.0 * 7168.0 * 2048.0 * 0.5625);
        assert_eq!(f, 2.0 * 8.0 * 3.0 * 7168.0 * 2048.0);
        // T = 1024: every expert active.
        let (b, f) = bench_work(&p, 1024);
        assert_eq!(b, 256.0 * 3.0 * 7168.0 * 2048.0 * 0.5625);
        assert_eq!(f, 2.0 * 8192.0 * 3.0 * 7168.0 * 2048.0);
        assert!((floor_us(4.3e12, 0.0) - 1e6).abs() < 1e-6);
        assert!((floor_us(0.0, 795e12) - 1e6).abs() < 1e-6);
        let r = BenchRow { preset: p.name, tokens: 1, tile: GemmTile::M128N16, us: 1e6, bytes: 2.15e12, flops: 795e12 };
        assert!((r.tbps() - 2.15).abs() < 1e-9 && (r.tflops() - 795.0).abs() < 1e-9);
        assert!((r.floor_ratio() - 1.0).abs() < 1e-9);
        let json: serde_json::Value = serde_json::from_str(&bench_json(&[r])).unwrap();
        assert_eq!(json[0]["preset"], "deepseek-v3");
        assert_eq!(json[0]["experts"], 256);
        assert_eq!(json[0]["tokens"], 1);
        assert_eq!(json[0]["tile"], "M128N16");
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 3.0);
    }

    #[test]
    fn relative_errors() {
        let want = vec![1.0, 0.0, 2.0, 2.0, -3.0, 4.0];
        let got: Vec<bf16> = want.iter().map(|&v| bf16::from_f64(v)).collect();
        assert_eq!(rel_errors(&got, &want, 2), (0.0, 0, 0.0));
        let mut g = got.clone();
        g[2] = bf16::from_f64(2.5); // token 1: |0.5, 0| / |2, 2|
        let (all, t, w) = rel_errors(&g, &want, 2);
        assert_eq!(t, 1);
        assert!((w - 0.5 / 8f64.sqrt()).abs() < 1e-12);
        assert!((all - 0.5 / 34f64.sqrt()).abs() < 1e-12);
        g[5] = bf16::NAN;
        let (all, t, w) = rel_errors(&g, &want, 2);
        assert!(all.is_nan() && w.is_nan() && t == 2);
        let tol = (CHECK_TOL, CHECK_TOL);
        assert!(!within_tol(all, w, tol) && !within_tol(0.0, w, tol) && within_tol(CHECK_TOL, 0.0, tol));
        assert!(!within_tol(all, w, CHECK_TOL_NVFP4) && within_tol(0.15, 0.25, CHECK_TOL_NVFP4));
        assert!(!within_tol(0.151, 0.0, CHECK_TOL_NVFP4) && !within_tol(0.0, 0.251, CHECK_TOL_NVFP4));
        // An all-zero reference token: 0 if matched, infinite otherwise.
        assert_eq!(rel_errors(&[bf16::ZERO], &[0.0], 1), (0.0, 0, 0.0));
        assert_eq!(rel_errors(&[bf16::ONE], &[0.0], 1).2, f64::INFINITY);
    }

    fn st_bytes(tensors: &[(&str, safetensors::Dtype, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
            .iter()
            .map(|(n, d, s, b)| (n.to_string(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        safetensors::serialize(views, None).unwrap()
    }

    #[test]
    fn run_inputs_are_validated() {
        use safetensors::{Dtype, SafeTensors};
        let (t, h, k) = (3usize, 64usize, 2usize);
        let hidden: Vec<u8> = (0..t * h).flat_map(|i| bf16::from_f32(i as f32).to_bits().to_le_bytes()).collect();
        let ids: Vec<u8> = [0i32, 5, 1, 2, 7, 3].iter().flat_map(|v| v.to_le_bytes()).collect();
        let w: Vec<u8> = [0.5f32, 0.5, 1.0, 0.0, 0.25, 0.75].iter().flat_map(|v| v.to_le_bytes()).collect();
        let good = vec![
            ("hidden_states", Dtype::BF16, vec![t, h], hidden.clone()),
            ("topk_ids", Dtype::I32, vec![t, k], ids.clone()),
            ("topk_weights", Dtype::F32, vec![t, k], w.clone()),
        ];
        let bytes = st_bytes(&good);
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let inp = parse_run_inputs(&st, "x.safetensors").unwrap();
        assert_eq!((inp.tokens, inp.hidden_size, inp.top_k), (t, h, k));
        assert_eq!(inp.ids, vec![0, 5, 1, 2, 7, 3]);
        assert_eq!(inp.weights, vec![0.5, 0.5, 1.0, 0.0, 0.25, 0.75]);
        assert_eq!(inp.hidden[7].to_f32(), 7.0);
        assert!(check_run_shape(&inp, 8, h).is_ok());
        let e = check_run_shape(&inp, 8, 128).unwrap_err();
        assert!(e.contains("`hidden_states`") && e.contains("hidden size is 128"), "{e}");
        let e = check_run_shape(&inp, 1, h).unwrap_err();
        assert!(e.contains("`topk_ids`") && e.contains("k = 2"), "{e}");

        let i64_ids: Vec<u8> = [0i64, 5, 1, 2, 7, 3].iter().flat_map(|v| v.to_le_bytes()).collect();
        type Tensor = (&'static str, Dtype, Vec<usize>, Vec<u8>);
        let cases: Vec<(usize, Tensor, &str)> = vec![
            (
                0,
                ("hidden_states", Dtype::F32, vec![t, h / 2], hidden.clone()),
                "tensor `hidden_states`: dtype is F32, expected BF16",
            ),
            (
                0,
                ("hidden_states", Dtype::BF16, vec![t * h], hidden.clone()),
                "tensor `hidden_states`: shape is [192], expected 2-D",
            ),
            (
                0,
                ("hidden", Dtype::BF16, vec![t, h], hidden.clone()),
                "has no tensor `hidden_states` (it holds `hidden`, `topk_ids`, `topk_weights`)",
            ),
            (1, ("topk_ids", Dtype::I64, vec![t, k], i64_ids), "tensor `topk_ids`: dtype is I64, expected I32"),
            (
                1,
                ("topk_ids", Dtype::I32, vec![k, t], ids.clone()),
                "tensor `topk_ids`: shape is [2, 3], expected [3, k]",
            ),
            (
                1,
                ("topk_ids", Dtype::I32, vec![t, 2, 1], ids.clone()),
                "tensor `topk_ids`: shape is [3, 2, 1], expected 2-D",
            ),
            (
                2,
                ("topk_weights", Dtype::I32, vec![t, k], w.clone()),
                "tensor `topk_weights`: dtype is I32, expected F32",
            ),
            (
                2,
                ("topk_weights", Dtype::F32, vec![t * k, 1], w.clone()),
                "tensor `topk_weights`: shape is [6, 1], expected [3, 2]",
            ),
            (2, ("weights", Dtype::F32, vec![t, k], w.clone()), "has no tensor `topk_weights`"),
        ];
        for (slot, replace, want) in cases {
            let mut ts = good.clone();
            ts[slot] = replace;
            let bytes = st_bytes(&ts);
            let st = SafeTensors::deserialize(&bytes).unwrap();
            let e = parse_run_inputs(&st, "x.safetensors").unwrap_err();
            assert!(e.contains(want), "{e}\nwant: {want}");
        }
        // k above 32 and an empty T.
        let many: Vec<u8> = vec![0; t * 33 * 4];
        let mut ts = good.clone();
        ts[1] = ("topk_ids", Dtype::I32, vec![t, 33], many.clone());
        ts[2] = ("topk_weights", Dtype::F32, vec![t, 33], many);
        let bytes = st_bytes(&ts);
        let e = parse_run_inputs(&SafeTensors::deserialize(&bytes).unwrap(), "x").unwrap_err();
        assert!(e.contains("1 <= k <= 32"), "{e}");
        let ts = vec![
            ("hidden_states", Dtype::BF16, vec![0, h], vec![]),
            ("topk_ids", Dtype::I32, vec![0, k], vec![]),
            ("topk_weights", Dtype::F32, vec![0, k], vec![]),
        ];
        let bytes = st_bytes(&ts);
        let e = parse_run_inputs(&SafeTensors::deserialize(&bytes).unwrap(), "x").unwrap_err();
        assert!(e.contains("T, H >= 1"), "{e}");
    }
}
