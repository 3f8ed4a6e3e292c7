//! Which GPU a command runs on: the `--backend` choice of quantize/dequantize and the GPU check of
//! check/run/bench. Without the `cuda` feature every GPU path is a clear error.

use clap::ValueEnum;

use crate::common::{CliResult, Fail};

/// Where `quantize` and `dequantize` run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    /// The reference quantizer on all CPU cores.
    Cpu,
    /// GPU 0.
    Cuda,
}

/// Parses a CMake architecture list (`90a-real;100a-real`, `90`, `90-virtual`) into
/// `(major*10 + minor, arch-specific 'a', has SASS, has PTX)`.
pub fn parse_archs(archs: &str) -> Vec<(i32, bool, bool, bool)> {
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
pub fn arch_supported(cc: (i32, i32), archs: &str) -> bool {
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

/// What a build without the `cuda` feature says when asked for a GPU.
#[cfg(not(feature = "cuda"))]
pub const NO_CUDA: &str = "this nvfp4-moe was built without CUDA support (the `cuda` feature)";

/// Picks the backend: an explicit one (cuda checked to be usable) or the default (cuda when a
/// supported GPU is visible, with a note when one is visible but unsupported). Returns the backend
/// and, for cuda, the GPU's name.
#[cfg(feature = "cuda")]
pub fn resolve_backend(requested: Option<Backend>) -> CliResult<(Backend, Option<String>)> {
    use nvfp4_moe::info;
    if requested == Some(Backend::Cpu) {
        return Ok((Backend::Cpu, None));
    }
    let gpus = info::gpus();
    let archs = info::build_info().cuda_archs;
    match (requested, gpus.first()) {
        (Some(_), None) => Err(Fail::Run("--backend cuda: no CUDA GPU visible (use --backend cpu)".into())),
        (Some(_), Some(g)) if !arch_supported(g.compute_capability, &archs) => Err(Fail::Run(format!(
            "--backend cuda: GPU 0 ({}, compute capability {}.{}) is not one this build has kernels for ({archs}); use --backend cpu",
            g.name, g.compute_capability.0, g.compute_capability.1
        ))),
        (_, Some(g)) if arch_supported(g.compute_capability, &archs) => Ok((Backend::Cuda, Some(g.name.clone()))),
        (_, Some(g)) => {
            tracing::info!(
                "note: GPU 0 ({}, compute capability {}.{}) is not one this build has kernels for ({archs}): using the cpu backend",
                g.name,
                g.compute_capability.0,
                g.compute_capability.1
            );
            Ok((Backend::Cpu, None))
        }
        (_, None) => Ok((Backend::Cpu, None)),
    }
}

/// Without the `cuda` feature: the CPU, and an error for an explicit `--backend cuda`.
#[cfg(not(feature = "cuda"))]
pub fn resolve_backend(requested: Option<Backend>) -> CliResult<(Backend, Option<String>)> {
    match requested {
        Some(Backend::Cuda) => Err(Fail::Run(format!("--backend cuda: {NO_CUDA}; use --backend cpu"))),
        _ => Ok((Backend::Cpu, None)),
    }
}

/// GPU 0's name, or why `cmd` cannot run on this machine.
#[cfg(feature = "cuda")]
pub fn require_gpu(cmd: &str) -> CliResult<String> {
    use nvfp4_moe::info;
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

/// Without the `cuda` feature no command runs on a GPU.
#[cfg(not(feature = "cuda"))]
pub fn require_gpu(cmd: &str) -> CliResult<String> {
    Err(Fail::Run(format!("`{cmd}` needs a CUDA GPU: {NO_CUDA}")))
}

/// The backend as the results name it.
pub fn backend_label(b: Backend, gpu: Option<&str>) -> String {
    match (b, gpu) {
        (Backend::Cpu, _) => "cpu (reference)".to_string(),
        (Backend::Cuda, Some(g)) => format!("cuda (GPU 0: {g})"),
        (Backend::Cuda, None) => "cuda (GPU 0)".to_string(),
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
    fn cpu_is_always_available() {
        assert_eq!(resolve_backend(Some(Backend::Cpu)).unwrap(), (Backend::Cpu, None));
        assert_eq!(backend_label(Backend::Cpu, None), "cpu (reference)");
        assert_eq!(backend_label(Backend::Cuda, Some("H200")), "cuda (GPU 0: H200)");
    }
}
