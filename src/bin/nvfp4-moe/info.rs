//! `nvfp4-moe info`: the version, how the CUDA core was built, and the GPUs visible; with
//! `--weights`, one MoE layer of a checkpoint checked on the CPU.

use clap::builder::NonEmptyStringValueParser;
use nvfp4_moe::io::{self as nio, LoadedExperts};
use serde_json::json;

use crate::common::{out, print_json, CliResult, Global};

pub const ABOUT: &str =
    "Show the version, how the CUDA core was built, and the GPUs visible; check a checkpoint's MoE layer";

pub const AFTER_HELP: &str = "\
Prints the crate version, how the CUDA core was built (CUDA version compiled against, target
architectures, CUTLASS version, CUDA runtime and driver versions) and every GPU visible (name,
compute capability, memory, SMs, whether this build has kernels for it). A build without the
`cuda` feature says so and lists no GPU.

With --weights W --prefix P, first loads the experts under P as `run` does and checks every
tensor's dtype, shape and scale (on the CPU: no GPU needed), then prints the checkpoint's dialect
and shape; a malformed checkpoint is an error (exit 1).

Example:
  nvfp4-moe info
  nvfp4-moe --json info
  nvfp4-moe info --weights DeepSeek-V3-NVFP4/ --prefix model.layers.3.mlp.experts";

/// The flags of `info`.
#[derive(Debug, clap::Args)]
pub struct InfoArgs {
    /// NVFP4 checkpoint to check (as `run --weights`: a .safetensors file, an index .json, a
    /// directory or a Hugging Face cache)
    #[arg(long, value_name = "W", requires = "prefix", value_parser = NonEmptyStringValueParser::new())]
    pub weights: Option<String>,
    /// The layer's experts in --weights, e.g. model.layers.3.mlp.experts
    #[arg(long, value_name = "P", requires = "weights")]
    pub prefix: Option<String>,
}

const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The checkpoint of `--weights`, loaded and checked (every tensor read) before anything looks at a
/// GPU, so a malformed one is reported on any machine.
fn checked_checkpoint(args: &InfoArgs) -> CliResult<Option<(String, String, LoadedExperts)>> {
    let (Some(w), Some(p)) = (&args.weights, &args.prefix) else { return Ok(None) };
    let loaded = nio::load_experts(w, p)?;
    Ok(Some((w.clone(), p.clone(), loaded)))
}

/// `info`'s JSON result with the checkpoint added (under `checkpoint`, only with `--weights`).
fn with_checkpoint(mut v: serde_json::Value, c: &Option<(String, String, LoadedExperts)>) -> serde_json::Value {
    let Some((w, p, l)) = c else { return v };
    let ck = &l.checkpoint;
    v["checkpoint"] = json!({
        "weights": w,
        "prefix": p,
        "dialect": l.format.dialect.to_string(),
        "scheme": l.format.scheme.to_string(),
        "naming": ck.naming.to_string(),
        "experts": ck.experts,
        "hidden": ck.hidden,
        "intermediate": ck.intermediate,
    });
    v
}

/// The checkpoint as text lines.
fn print_checkpoint(c: &Option<(String, String, LoadedExperts)>) {
    let Some((w, p, l)) = c else { return };
    let ck = &l.checkpoint;
    out!("checkpoint {w}, experts `{p}`: valid");
    out!("  {}, {}, naming {}", l.format.dialect, l.format.scheme, ck.naming);
    out!("  E={} H={} I={}", ck.experts, ck.hidden, ck.intermediate);
}

#[cfg(feature = "cuda")]
pub fn run(args: &InfoArgs, global: Global) -> CliResult {
    use nvfp4_moe::info;

    use crate::gpu::arch_supported;
    // The checkpoint first: checking it needs no GPU, and its errors come before any GPU query.
    let checkpoint = checked_checkpoint(args)?;
    let b = info::build_info();
    let (ma, mi, pa) = b.cutlass_version;
    let driver = (b.driver_version > 0).then(|| info::cuda_version_string(b.driver_version));
    let gpus = info::gpus();
    if global.json {
        let gpus: Vec<_> = gpus
            .iter()
            .map(|g| {
                json!({
                    "ordinal": g.ordinal,
                    "name": g.name,
                    "compute_capability": format!("{}.{}", g.compute_capability.0, g.compute_capability.1),
                    "memory_bytes": g.total_mem,
                    "multiprocessors": g.multiprocessors,
                    "supported": arch_supported(g.compute_capability, &b.cuda_archs),
                })
            })
            .collect();
        print_json(&with_checkpoint(
            json!({
            "command": "info",
            "version": VERSION,
            "cuda": true,
            "build": {
                "cuda_version": info::cuda_version_string(b.cuda_version),
                "cuda_archs": b.cuda_archs,
                "cutlass": format!("{ma}.{mi}.{pa}"),
                "cuda_runtime": info::cuda_version_string(b.runtime_version),
                "cuda_driver": driver,
            },
            "gpus": gpus,
            }),
            &checkpoint,
        ));
        return Ok(());
    }
    out!("nvfp4-moe {VERSION}");
    out!("build:");
    out!("  CUDA compiled against  {}", info::cuda_version_string(b.cuda_version));
    out!("  target archs           {}", if b.cuda_archs.is_empty() { "(none)" } else { &b.cuda_archs });
    out!("  CUTLASS                {ma}.{mi}.{pa}");
    out!("  CUDA runtime           {}", info::cuda_version_string(b.runtime_version));
    out!("  CUDA driver            {}", driver.as_deref().unwrap_or("none (no driver loaded)"));
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
    print_checkpoint(&checkpoint);
    Ok(())
}

#[cfg(not(feature = "cuda"))]
pub fn run(args: &InfoArgs, global: Global) -> CliResult {
    let checkpoint = checked_checkpoint(args)?;
    if global.json {
        print_json(&with_checkpoint(
            json!({ "command": "info", "version": VERSION, "cuda": false, "build": null, "gpus": [] }),
            &checkpoint,
        ));
    } else {
        out!("nvfp4-moe {VERSION}");
        out!("build: without CUDA (the `cuda` feature is off): the CPU commands only, no GPU is looked for");
        print_checkpoint(&checkpoint);
    }
    Ok(())
}
