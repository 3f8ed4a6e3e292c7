//! Files: one safetensors parser and writer ([`SafetensorsFile`], header-only, tensors read by
//! byte range), the single-tensor formats the CLI reads and writes ([`read_matrix_bf16`],
//! [`write_bf16`], one ModelOpt weight: [`read_modelopt`] / [`write_modelopt`]), and the ModelOpt
//! NVFP4 MoE checkpoint dialects ([`load_modelopt`], [`write_modelopt_experts`]).
//!
//! Everything read ends as a host type of [`crate::host`]; nothing here touches the GPU.

mod checkpoint;
mod fs;
mod matrix;
mod safetensors;
mod shown;

pub use self::checkpoint::{
    load_compressed_tensors, load_experts, load_modelopt, write_modelopt_experts, CheckpointFormat, Dialect,
    LoadedExperts, QuantScheme,
};
pub use self::fs::{write_file_atomically, FileKind};
pub use self::matrix::{read_matrix_bf16, read_modelopt, write_bf16, write_modelopt, ModelOptWeight, SourceDtype};
pub use self::safetensors::SafetensorsFile;
pub(crate) use self::shown::{shown, shown_path};
