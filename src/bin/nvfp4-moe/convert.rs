//! `nvfp4-moe convert`: a whole Hugging Face model to an NVFP4 checkpoint directory, streaming
//! (`nvfp4_moe::convert`), on the GPU or all CPU cores.

use std::sync::atomic::{AtomicBool, Ordering};

use clap::builder::NonEmptyStringValueParser;
use clap::ValueEnum;
use nvfp4_moe::convert::{Conversion, ConvertOptions, ConvertReport, CpuQuantizer, OutputFormat, Quantizer};
use serde_json::json;
use tracing::info;

use crate::common::{fmt_bytes, out, print_json, progress_bytes, spinner, CliResult, Fail, Global};
use crate::gpu::{resolve_backend, Backend};

pub const ABOUT: &str =
    "Convert a Hugging Face model (BF16/F16/F32 or FP8 block-scaled) to an NVFP4 checkpoint: the routed experts quantized, everything else copied";

pub const AFTER_HELP: &str = "\
In: a model directory (model.safetensors, or shards with *.index.json), a Hugging Face cache
snapshot (or its models--org--name root), or the index file. BF16 weights are quantized as they
are; F16 and F32 are rounded to BF16 first (round-to-nearest-even); DeepSeek-V3/Kimi-K2 FP8
block-scaled weights (E4M3 + weight_scale_inv per 128x128 block) are dequantized to BF16 on the
fly. Other quantized inputs are refused.

Converted: the routed experts' gate, up and down projections (…experts.<e>.<proj>.weight;
stacked 3-D experts.gate_up_proj/down_proj of known model types are split per expert). Gate and
up of one expert share one decode scale g (amax over both). --include/--exclude globs (* and ?)
over tensor names change the set; --exclude wins. Everything else is copied unchanged (kept FP8
weights become BF16).

Out (--format):
  compressed-tensors (default)  {module}.weight_packed U8 [N, K/2], weight_scale F8_E4M3
                                [N, K/16], weight_global_scale F32 [1] = 1/g; config.json gets
                                quantization_config (nvfp4-pack-quantized, W4A16, ignore = every
                                Linear left unquantized)
  modelopt                      {module}.weight, weight_scale, weight_scale_2 = g;
                                hf_quant_config.json with quant_algo W4A16_NVFP4
The codes and scales are ModelOpt 0.47's (recipe v2) with g = amax / (6 * 448). The output is
written to a hidden directory beside OUT and renamed into place at the end; an existing OUT is
an error unless --force.

Example:
  nvfp4-moe convert --input ~/.cache/huggingface/hub/models--Qwen--Qwen3-30B-A3B \\
      --output qwen3-30b-a3b-nvfp4 [--device cpu] [--format modelopt]";

/// The dialect written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum FormatArg {
    /// compressed-tensors nvfp4-pack-quantized, weight-only (vLLM, SGLang)
    CompressedTensors,
    /// NVIDIA ModelOpt, quant_algo W4A16_NVFP4
    Modelopt,
}

/// The flags of `convert`.
#[derive(Debug, clap::Args)]
pub struct ConvertArgs {
    /// The model: a directory, a Hugging Face cache snapshot or root, or an *.index.json
    #[arg(long, value_name = "MODEL", value_parser = NonEmptyStringValueParser::new())]
    pub input: String,
    /// The output directory (must not exist, unless --force)
    #[arg(long, value_name = "DIR", value_parser = NonEmptyStringValueParser::new())]
    pub output: String,
    /// The checkpoint dialect written
    #[arg(long, value_enum, value_name = "F", default_value = "compressed-tensors")]
    pub format: FormatArg,
    /// cuda (GPU 0) or cpu (all cores; the same bytes as the GPU and the reference); default: cuda
    /// when a GPU this build supports is visible, else cpu
    #[arg(long, value_enum, value_name = "D")]
    pub device: Option<Backend>,
    /// Also convert the 2-D `.weight` tensors whose names match this glob (repeatable)
    #[arg(long, value_name = "GLOB")]
    pub include: Vec<String>,
    /// Copy the tensors whose names match this glob unchanged (repeatable; wins over --include)
    #[arg(long, value_name = "GLOB")]
    pub exclude: Vec<String>,
    /// Replace an existing output directory
    #[arg(long)]
    pub force: bool,
}

/// The quantizer `--device` asks for.
fn quantizer(backend: Backend) -> CliResult<Box<dyn Quantizer>> {
    match backend {
        Backend::Cpu => Ok(Box::new(CpuQuantizer::all_cores())),
        #[cfg(feature = "cuda")]
        Backend::Cuda => Ok(Box::new(nvfp4_moe::convert::CudaQuantizer::new(0)?)),
        #[cfg(not(feature = "cuda"))]
        Backend::Cuda => unreachable!("resolve_backend never picks cuda without the `cuda` feature"),
    }
}

/// Set by SIGINT / SIGTERM during a conversion: the run stops between tensors and removes its
/// temporary directory instead of leaving it behind.
static CANCEL: AtomicBool = AtomicBool::new(false);

#[cfg_attr(not(unix), allow(dead_code))]
extern "C" fn on_signal(_: libc::c_int) {
    // Only an atomic store: async-signal-safe.
    CANCEL.store(true, Ordering::Relaxed);
}

/// Routes SIGINT and SIGTERM to [`CANCEL`] (a second signal still ends the process: the handler
/// is installed once, with SA_RESETHAND).
fn install_cancel_handler() {
    #[cfg(unix)]
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: a zeroed sigaction is valid; the handler only stores to an atomic.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
            sa.sa_flags = libc::SA_RESETHAND;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
}

pub fn run(args: &ConvertArgs, global: Global) -> CliResult {
    let options = ConvertOptions {
        format: match args.format {
            FormatArg::CompressedTensors => OutputFormat::CompressedTensors,
            FormatArg::Modelopt => OutputFormat::ModelOpt,
        },
        include: args.include.clone(),
        exclude: args.exclude.clone(),
        force: args.force,
        cancel: Some(&CANCEL),
    };
    install_cancel_handler();
    // The shared resolver speaks of quantize's `--backend`; this command's flag is `--device`.
    let (backend, gpu) = resolve_backend(args.device).map_err(|e| match e {
        Fail::Run(m) => Fail::Run(m.replace("--backend", "--device")),
        other => other,
    })?;
    let pb = spinner(&format!("reading {}", args.input));
    let conversion = Conversion::plan(&args.input, &args.output, &options)?;
    drop(pb);
    info!(
        "planned: {} matrices to quantize, {} of tensors to read",
        conversion.matrices(),
        fmt_bytes(conversion.input_bytes() as usize)
    );
    let mut q = quantizer(backend)?;
    let pb = progress_bytes("convert", conversion.input_bytes());
    let report = conversion.run(q.as_mut(), &|n| pb.inc(n))?;
    pb.finish_and_clear();
    print_report(args, &report, gpu.as_deref(), global);
    Ok(())
}

fn gbps(bytes: u64, seconds: f64) -> f64 {
    bytes as f64 / seconds.max(1e-9) / 1e9
}

fn print_report(args: &ConvertArgs, r: &ConvertReport, gpu: Option<&str>, global: Global) {
    let rate = gbps(r.bytes_in, r.seconds);
    if global.json {
        print_json(&json!({
            "command": "convert",
            "input": args.input,
            "output": args.output,
            "format": r.format.name(),
            "input_quantization": r.input_quant,
            "device": r.quantizer,
            "gpu": gpu,
            "tensors": {
                "converted": r.converted,
                "copied": r.copied,
                "dequantized": r.dequantized,
                "written": r.tensors_out,
            },
            "bytes": {
                "input": r.bytes_in,
                "output": r.bytes_out,
                "converted_input": r.bytes_converted_in,
                "converted_output": r.bytes_converted_out,
                "largest_tensor": r.largest_tensor_bytes,
            },
            "shards": r.shards,
            "files_copied": r.files_copied,
            "ignored": r.ignored,
            "gb_per_s": rate,
            "peak_rss_anon_bytes": r.peak_rss_anon,
            "seconds": {"quantize": r.quantize_seconds, "total": r.seconds},
        }));
        return;
    }
    let dialect = match r.format {
        OutputFormat::CompressedTensors => "compressed-tensors NVFP4 W4A16",
        OutputFormat::ModelOpt => "ModelOpt W4A16_NVFP4",
    };
    out!("converted {} -> {} ({dialect}) on {}", args.input, args.output, r.quantizer);
    out!("{:<12} {:>8} {:>12} {:>12}", "", "tensors", "bytes in", "bytes out");
    let copied_in = r.bytes_in - r.bytes_converted_in;
    let copied_out = r.bytes_out - r.bytes_converted_out;
    out!(
        "{:<12} {:>8} {:>12} {:>12}",
        "quantized",
        r.converted,
        fmt_bytes(r.bytes_converted_in as usize),
        fmt_bytes(r.bytes_converted_out as usize)
    );
    let kept = if r.dequantized > 0 { "kept (+bf16)" } else { "kept" };
    out!(
        "{:<12} {:>8} {:>12} {:>12}",
        kept,
        r.copied + r.dequantized,
        fmt_bytes(copied_in as usize),
        fmt_bytes(copied_out as usize)
    );
    out!(
        "{:<12} {:>8} {:>12} {:>12}",
        "total",
        r.converted + r.copied + r.dequantized,
        fmt_bytes(r.bytes_in as usize),
        fmt_bytes(r.bytes_out as usize)
    );
    let peak = r.peak_rss_anon.map_or("n/a".to_string(), |b| fmt_bytes(b as usize));
    out!(
        "{:.2} s ({:.2} s quantizing), {rate:.2} GB/s of input; peak RssAnon {peak}; {} shard(s), {} other file(s), {} Linear module(s) kept unquantized",
        r.seconds,
        r.quantize_seconds,
        r.shards,
        r.files_copied,
        r.ignored.len()
    );
}
