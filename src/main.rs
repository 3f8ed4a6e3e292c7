//! `nvfp4-moe`: quantize safetensors weights to NVFP4 (ModelOpt's checkpoint layout) on the CPU or
//! a CUDA GPU, decode them back, and report how the crate was built.
//!
//! Exit status: 0 success, 1 error, 2 usage error. Every error is one `error: ...` line on stderr.

use std::fmt;
use std::io::Write;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use half::bf16;
use nvfp4_moe::io::{self as nio, ModelOptWeight, SourceDtype};
use nvfp4_moe::layout::ScaleLayout;
use nvfp4_moe::reference::{self, Nvfp4Host};
use nvfp4_moe::{info, Error};

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
  nvfp4-moe info
  nvfp4-moe help [COMMAND]      (or: nvfp4-moe COMMAND --help)
  nvfp4-moe --version";

const COMMANDS: &str = "\
Commands:
  quantize    quantize one 2-D BF16 (or F32) tensor to NVFP4, written as ModelOpt's
              weight / weight_scale / weight_scale_2
  dequantize  decode a ModelOpt NVFP4 weight back to a BF16 tensor
  info        show the version, how the CUDA core was built, and the GPUs visible

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

const ALL: [&Command; 3] = [&QUANTIZE, &DEQUANTIZE, &INFO];

fn print_command_help(cmd: &Command) {
    out!("nvfp4-moe {}: {}\n\nUsage:\n  {}\n\n{}", cmd.name, cmd.summary, cmd.usage, cmd.help);
}

fn print_help() {
    out!(
        "nvfp4-moe {VERSION}: NVFP4 quantization of safetensors weights (CPU or CUDA, sm_90a)\n\n{USAGE}\n\n{COMMANDS}"
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
        let mut r = nvfp4_moe::rng::Rng::from_entropy();
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
}
