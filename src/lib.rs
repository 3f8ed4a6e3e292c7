//! # nvfp4-moe
//!
//! NVFP4 Mixture-of-Experts kernels for NVIDIA Hopper (sm_90a): a Rust crate over a CUTLASS C++
//! core. This crate holds the NVFP4 format (E2M1 codes + E4M3 block-16 scales + an FP32 decode
//! scale), its CPU reference (the oracle every GPU kernel is tested against), and safe wrappers
//! over the CUDA kernels, which take cudarc slices and a [`cudarc::driver::CudaStream`].
//!
//! Naming: the **decode scale** g is the FP32 multiplier with `value = e2m1 x e4m3 x g`
//! (ModelOpt's `weight_scale_2`). Other libraries' "global scale" is `1/g`.

pub mod error;
pub mod format;
pub mod layout;
pub mod reference;
pub mod rng;

mod checks;
mod ffi;
pub mod gemm;
pub mod info;
pub mod io;
pub mod quantize;

pub use error::{Error, Result};
pub use gemm::{GemmTile, GroupedGemm, Nvfp4Weights, PlainBf16};
pub use layout::ScaleLayout;
pub use quantize::{dequantize_nvfp4, quantize_nvfp4, Nvfp4Tensor};
