//! `nvfp4-moe info`: the version, how the CUDA core was built, and the GPUs visible.

use serde_json::json;

use crate::common::{out, print_json, CliResult, Global};

pub const ABOUT: &str = "Show the version, how the CUDA core was built, and the GPUs visible";

pub const AFTER_HELP: &str = "\
Prints the crate version, how the CUDA core was built (CUDA version compiled against, target
architectures, CUTLASS version, CUDA runtime and driver versions) and every GPU visible (name,
compute capability, memory, SMs, whether this build has kernels for it). A build without the
`cuda` feature says so and lists no GPU.

Example:
  nvfp4-moe info
  nvfp4-moe --json info";

/// The flags of `info` (none but the global ones).
#[derive(Debug, clap::Args)]
pub struct InfoArgs {}

const VERSION: &str = env!("CARGO_PKG_VERSION");

#[cfg(feature = "cuda")]
pub fn run(_: &InfoArgs, global: Global) -> CliResult {
    use nvfp4_moe::info;

    use crate::gpu::arch_supported;
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
        print_json(&json!({
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
        }));
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
    Ok(())
}

#[cfg(not(feature = "cuda"))]
pub fn run(_: &InfoArgs, global: Global) -> CliResult {
    if global.json {
        print_json(&json!({ "command": "info", "version": VERSION, "cuda": false, "build": null, "gpus": [] }));
    } else {
        out!("nvfp4-moe {VERSION}");
        out!("build: without CUDA (the `cuda` feature is off): the CPU commands only, no GPU is looked for");
    }
    Ok(())
}
