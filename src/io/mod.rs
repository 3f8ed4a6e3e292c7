//! Files: one safetensors reader and writer ([`SafetensorsFile`]: memory-mapped, the header
//! parsed and checked, tensors read by byte range), the single-tensor formats the CLI reads and
//! writes ([`read_matrix_bf16`], [`write_bf16`], one ModelOpt weight: [`read_modelopt`] /
//! [`write_modelopt`]), NVFP4 MoE checkpoints in both dialects, ModelOpt and compressed-tensors
//! ([`load_experts`], [`load_modelopt`], [`load_compressed_tensors`], [`write_modelopt_experts`];
//! model directories and Hugging Face cache layouts), and safe writing
//! ([`write_file_atomically`], the path of every file the crate writes).
//!
//! Inputs must be regular files ([`Error::NotRegularFile`](crate::Error::NotRegularFile)
//! otherwise, before anything is read). Messages name tensors and files escaped and shortened,
//! never quoting tensor data or a file's JSON.
//!
//! Everything read ends as a host type of [`crate::host`]; nothing here touches the GPU.

mod checkpoint;
mod fs;
mod matrix;
mod safetensors;
mod shown;

#[cfg(feature = "fuzzing")]
pub(crate) use self::checkpoint::resolve_in_memory;
pub(crate) use self::checkpoint::Catalog;
pub use self::checkpoint::{
    load_compressed_tensors, load_expert_shard, load_experts, load_modelopt, write_modelopt_experts, CheckpointFormat,
    Dialect, LoadedExperts, QuantScheme,
};
pub(crate) use self::fs::{io_err, open_regular, read_small_file, sync_dir, unpredictable_u64};
pub use self::fs::{write_file_atomically, FileKind};
pub(crate) use self::matrix::{beyond_bf16_err, element_at, f32_to_bf16};
#[cfg(feature = "fuzzing")]
pub(crate) use self::matrix::{check_modelopt_tensors, check_weight_scale_2};
pub use self::matrix::{read_matrix_bf16, read_modelopt, write_bf16, write_modelopt, ModelOptWeight, SourceDtype};
#[cfg(feature = "fuzzing")]
pub(crate) use self::safetensors::parse_file_bytes;
pub use self::safetensors::SafetensorsFile;
pub(crate) use self::safetensors::{json_unique_problem, parse_json_unique, tensor_err};
pub(crate) use self::shown::{shown, shown_path};
