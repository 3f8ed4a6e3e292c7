//! What the crate was built with and which GPUs it sees.

use crate::ffi::raw;

/// Build and run-time versions of the CUDA core.
#[derive(Clone, Debug)]
pub struct BuildInfo {
    /// CUDA runtime version the core was compiled against (e.g. 13000).
    pub cuda_version: i32,
    /// CUDA architectures compiled in (CMake syntax, e.g. `90a-real`).
    pub cuda_archs: String,
    /// CUTLASS version of the headers the core was compiled with.
    pub cutlass_version: (i32, i32, i32),
    /// CUDA runtime version linked in (0 if unavailable).
    pub runtime_version: i32,
    /// The installed driver's CUDA version (0 if no driver).
    pub driver_version: i32,
}

/// Reads the core's build information (no GPU needed; the driver version is 0 without a driver).
pub fn build_info() -> BuildInfo {
    let b = raw::core_build_info();
    BuildInfo {
        cuda_version: b.cuda_version,
        cuda_archs: b.cuda_archs,
        cutlass_version: (b.cutlass_major, b.cutlass_minor, b.cutlass_patch),
        runtime_version: b.runtime_version,
        driver_version: b.driver_version,
    }
}

/// Formats a CUDA version integer (13000 -> "13.0").
pub fn cuda_version_string(v: i32) -> String {
    if v <= 0 {
        return "none".to_string();
    }
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// One visible GPU.
#[derive(Clone, Debug)]
pub struct GpuInfo {
    /// The device ordinal (as `CudaContext::new` takes it).
    pub ordinal: usize,
    /// The device name (e.g. `NVIDIA H200`).
    pub name: String,
    /// Compute capability (major, minor), e.g. (9, 0).
    pub compute_capability: (i32, i32),
    /// Device memory in bytes.
    pub total_mem: usize,
    /// Streaming multiprocessors.
    pub multiprocessors: i32,
}

/// The GPUs the CUDA driver reports; an empty list when there is no driver or no GPU.
pub fn gpus() -> Vec<GpuInfo> {
    use cudarc::driver::{sys::CUdevice_attribute, CudaContext};
    // With dynamic loading, cudarc panics when libcuda is absent: treat that as "no GPU", quietly.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let n = std::panic::catch_unwind(CudaContext::device_count);
    std::panic::set_hook(hook);
    let Ok(Ok(n)) = n else {
        return Vec::new();
    };
    (0..n.max(0) as usize)
        .filter_map(|i| {
            let ctx = CudaContext::new(i).ok()?;
            Some(GpuInfo {
                ordinal: i,
                name: ctx.name().ok()?,
                compute_capability: ctx.compute_capability().ok()?,
                total_mem: ctx.total_mem().ok()?,
                multiprocessors: ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).ok()?,
            })
        })
        .collect()
}
