//! Files: one safetensors parser and writer ([`SafetensorsFile`], header-only, tensors read by
//! byte range), the single-tensor formats the CLI reads and writes ([`read_matrix_bf16`],
//! [`write_bf16`], one ModelOpt weight: [`read_modelopt`] / [`write_modelopt`]), and the ModelOpt
//! NVFP4 MoE checkpoint dialects ([`load_modelopt`], [`write_modelopt_experts`]).
//!
//! Everything read ends as a host type of [`crate::host`]; nothing here touches the GPU.

mod checkpoint;
mod matrix;
mod safetensors;

pub use self::checkpoint::{load_modelopt, write_modelopt_experts};
pub use self::matrix::{read_matrix_bf16, read_modelopt, write_bf16, write_modelopt, ModelOptWeight, SourceDtype};
pub use self::safetensors::SafetensorsFile;
