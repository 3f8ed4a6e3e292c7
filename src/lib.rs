//! # nvfp4-moe
//!
//! NVFP4 Mixture-of-Experts kernels for NVIDIA Hopper (sm_90a): a Rust crate over a CUTLASS C++
//! core. This crate holds the NVFP4 format (E2M1 codes + E4M3 block-16 scales + an FP32 decode
//! scale), its CPU reference (the oracle every GPU kernel is tested against), and safe wrappers
//! over the CUDA kernels, which take cudarc slices and a `cudarc::driver::CudaStream`.
//!
//! Features: `cuda` (default) brings the GPU side: cudarc, the cxx bridge and the CUDA core build
//! (nvcc, CUTLASS and CMake; see the README). `cuda-13000` (default) picks cudarc's CUDA version
//! and implies `cuda`. `candle` adds `nvfp4_moe::candle::MoeOp`, the layer as a `candle_core::CustomOp3`.
//! `nccl` adds the expert-parallel runner's NCCL transport (`nvfp4_moe::ep::NcclTransport`).
//! Without `cuda` the crate is the format ([`mod@format`], [`layout`]), the host weight types
//! ([`host`]), files ([`io`]), model conversion on the CPU ([`convert`]), the CPU oracle
//! ([`mod@reference`]) and the [`presets`], and builds with no CUDA toolkit.
//!
//! ## Layout: the modules in the order data flows through them
//!
//! | layer | module | what it owns |
//! |---|---|---|
//! | whole models | [`convert`] | a Hugging Face model to an NVFP4 checkpoint, streaming: `io/` for the files, recipe v2 on the CPU (the `reference` quantizer on all cores) or the GPU (`quantize/`) |
//! | several GPUs | `ep` | expert parallelism: a layer's expert shards over N ranks, the token exchange (`Transport`: loopback on one GPU, NCCL) |
//! | the layer | [`moe`] | [`moe::weights`] (BF16 or a checkpoint -> prepared weights), [`moe::layer`] (a forward) |
//! | GPU operations | `gemm`, `routing`, `quantize` | weight preparation and the grouped GEMM; routing, permutation, combine; the quantizers |
//! | launch | `launch` (private) | stream, device buffers with their guards, host checks, core status -> [`Error`] |
//! | bridge | `ffi` (private) | the cxx bridge: the core's entry points, its own argument structs |
//! | files | [`io`] | one safetensors parser (header only, tensors by byte range) and writer; checkpoint dialects |
//! | host types | [`host`] | [`host::Nvfp4Host`], [`host::ExpertWeightsHost`], [`host::MoeCheckpoint`] and their checks |
//! | format | [`mod@format`], [`layout`] | E2M1/E4M3 codecs, scale layouts |
//! | FFI types | [`abi`] | generated from `cpp/include/nvfp4moe/types.h`: status, enums, `*Args` (no dependencies) |
//! | oracle | [`mod@reference`] | the CPU/f64 reference of every kernel, for tests only |
//!
//! Each module calls only modules below it (the oracle is beside them: only tests call it).
//! Followed as data:
//!
//! - preparation from BF16 ([`MoeWeights::from_bf16`]): `moe/weights.rs` -> `quantize/` ->
//!   `gemm/` -> `launch.rs` -> `ffi.rs`, with `host.rs` types handed down;
//! - preparation from a checkpoint ([`MoeWeights::from_modelopt`]): `moe/weights.rs` ->
//!   `io/checkpoint/` -> `io/safetensors.rs`, then `gemm/` -> `launch.rs` -> `ffi.rs`;
//! - the forward ([`MoeLayer::forward`]): `moe/layer.rs` -> `routing.rs` -> `gemm/` ->
//!   `quantize/grouped.rs` (NVFP4 intermediate only) -> `launch.rs` -> `ffi.rs`;
//! - quantization ([`quantize_nvfp4`]): `quantize/` -> `launch.rs` -> `ffi.rs` -> the core's
//!   `quantize_nvfp4` (`cpp/src/quantize.cu`).
//!
//! Naming: the **decode scale** g is the FP32 multiplier with `value = e2m1 x e4m3 x g`
//! (ModelOpt's `weight_scale_2`). Other libraries' "global scale" is `1/g`.
//!
//! The CPU reference (the same bytes the GPU quantizer writes):
//!
//! ```
//! use half::bf16;
//! use nvfp4_moe::{reference, ScaleLayout};
//!
//! let mut x = vec![bf16::ZERO; 16];
//! x[0] = bf16::from_f32(6.0);
//! x[1] = bf16::from_f32(-3.0);
//! x[2] = bf16::from_f32(0.5);
//! let q = reference::quantize(&x, 1, 16, 1.0, ScaleLayout::Linear).unwrap();
//! assert_eq!(q.scales, vec![0x38]); // E4M3 1.0 = amax / (6 g)
//! assert_eq!(&q.codes[..2], &[0xD7, 0x01]); // codes 7 (6.0), 0xD (-3.0), 1 (0.5), 0
//! assert_eq!(reference::dequantize(&q), x); // these values are exact in NVFP4
//! ```

#![warn(missing_docs, missing_debug_implementations, clippy::missing_errors_doc, clippy::missing_safety_doc)]

// Without a GPU: the FFI types, the format, host weight types, files, the CPU oracle, presets.
pub mod abi;
/// The generator of `abi` (build.rs runs it), for the drift tests.
#[cfg(test)]
#[path = "../codegen/abi.rs"]
#[allow(dead_code, missing_docs)]
mod codegen_abi;
pub mod convert;
pub mod error;
pub mod format;
// Entry points of the fuzz targets (`fuzz/`): not public API.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
pub mod host;
pub mod io;
pub mod layout;
pub mod presets;
pub mod reference;
mod rng;
#[doc(hidden)]
pub mod testing;

// The GPU side (the `cuda` feature): the CUDA core through the cxx bridge, over cudarc.
#[cfg(feature = "cuda")]
pub mod ep;
#[cfg(feature = "cuda")]
mod ffi;
#[cfg(feature = "cuda")]
pub mod gemm;
#[cfg(feature = "cuda")]
pub mod info;
#[cfg(feature = "cuda")]
mod launch;
#[cfg(feature = "cuda")]
pub mod moe;
#[cfg(feature = "cuda")]
pub mod quantize;
#[cfg(feature = "cuda")]
pub mod routing;

#[cfg(feature = "candle")]
pub mod candle;

pub use error::{Error, Result};
#[cfg(feature = "cuda")]
pub use gemm::{GemmTile, GroupedGemm, Interleaved, Nvfp4Weights, PlainBf16, RowOrder, SwigluBf16, SwigluNvfp4};
pub use layout::ScaleLayout;
#[cfg(feature = "cuda")]
pub use moe::{Intermediate, MoeLayer, MoeOptions, MoeWeights, MoeWeightsBf16, MoeWorkspace};
#[cfg(feature = "cuda")]
pub use quantize::{dequantize_nvfp4, quantize_nvfp4, Nvfp4Tensor};
