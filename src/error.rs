//! The crate's one error type. Every fallible call returns [`Result`]; bad input is reported here
//! before any kernel is launched.

/// Everything that can go wrong in `nvfp4-moe`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A shape argument is out of range (e.g. K not a multiple of 16, zero-sized where not allowed).
    #[error("invalid shape: {0}")]
    InvalidShape(String),
    /// A buffer holds fewer elements than the call needs.
    #[error("buffer `{name}` too small: needs {needed} elements, has {actual}")]
    BufferTooSmall {
        /// The buffer, as the function's argument names it.
        name: &'static str,
        /// Elements the call needs.
        needed: usize,
        /// Elements the buffer holds.
        actual: usize,
    },
    /// A device pointer is not aligned as the kernel requires.
    #[error("buffer `{name}` is not {align}-byte aligned (address {addr:#x})")]
    Misaligned {
        /// The buffer, as the function's argument names it.
        name: &'static str,
        /// The alignment the kernel needs, in bytes.
        align: usize,
        /// The buffer's device address.
        addr: u64,
    },
    /// A decode scale (the per-tensor multiplier g, value = e2m1 x e4m3 x g) is not finite and > 0.
    #[error("decode scale must be finite and > 0, got {0}")]
    InvalidDecodeScale(f32),
    /// A scale layout that this operation does not support.
    #[error("unsupported scale layout: {0}")]
    UnsupportedLayout(String),
    /// A tensor in a file has a missing name, a wrong dtype or a wrong shape.
    #[error("tensor `{name}`: {what}")]
    Tensor {
        /// The tensor's full name in the file.
        name: String,
        /// What is wrong with it.
        what: String,
    },
    /// An error from the CUDA driver (through cudarc).
    #[cfg(feature = "cuda")]
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    /// An error reported by the C++ core (a CUDA runtime error or a failed launch).
    #[error("CUDA core: {0}")]
    Core(String),
    /// The C++ core rejected the arguments (its `can_implement` checks) with this status; shapes
    /// it rejects are [`Error::InvalidShape`] instead.
    #[error("CUDA core rejected the call ({status:?}): {message}")]
    Rejected {
        /// The core's status code.
        status: crate::abi::Status,
        /// The core's message.
        message: String,
    },
    /// A path that must be a regular file is something else: an input that is a directory, FIFO,
    /// socket or device (refused before anything is read; symlinks to regular files are fine),
    /// or an output that exists as a symlink, FIFO, socket, device or directory (never replaced).
    #[error("`{}` is {kind}, not a regular file", crate::io::shown_path(.path))]
    NotRegularFile {
        /// The path as given.
        path: std::path::PathBuf,
        /// What it is.
        kind: crate::io::FileKind,
    },
    /// A file changed while the crate had it open (a mapped checkpoint truncated, a shard's
    /// header rewritten between two reads).
    #[error("`{}` changed while it was open: {what}", crate::io::shown_path(.path))]
    FileChanged {
        /// The file.
        path: std::path::PathBuf,
        /// What changed.
        what: String,
    },
    /// A checkpoint index names a shard by a path that could leave the index's directory (an
    /// absolute path, a `..` component, a drive or root prefix, an empty name). Checked lexically,
    /// so shards that are symlinks (a Hugging Face cache snapshot's) still work.
    #[error(
        "checkpoint index `{}`: the shard of tensor `{}` is `{}`, not a relative path inside the index's \
         directory ({why})",
        crate::io::shown_path(.index),
        crate::io::shown(.tensor),
        crate::io::shown(.shard)
    )]
    UnsafeShardPath {
        /// The index file.
        index: std::path::PathBuf,
        /// A tensor the entry is for.
        tensor: String,
        /// The shard name as the index gives it.
        shard: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// A checkpoint's files do not describe one supported NVFP4 dialect: an unsupported
    /// quantization method or format, or configs and tensors that disagree.
    #[error("checkpoint `{}`: {what}", crate::io::shown_path(.path))]
    Dialect {
        /// The checkpoint (file, index or directory) or the config file concerned.
        path: std::path::PathBuf,
        /// What is wrong.
        what: String,
    },
    /// A model that `convert` cannot take: it is already quantized (other than the FP8 block-scaled
    /// form it dequantizes), so converting it again would quantize twice.
    #[error("`{}` is already quantized: {what}", crate::io::shown_path(.path))]
    AlreadyQuantized {
        /// The config file or tensor file that says so.
        path: std::path::PathBuf,
        /// What was found.
        what: String,
    },
    /// An output directory that exists (and `--force` / `ConvertOptions::force` was not given), or
    /// an output path that names something other than a directory.
    #[error("output `{}` already exists ({what})", crate::io::shown_path(.path))]
    OutputExists {
        /// The output path.
        path: std::path::PathBuf,
        /// What it is, and how to proceed.
        what: String,
    },
    /// A long operation stopped because its caller asked it to (`convert`'s cancel flag, set by
    /// the CLI on SIGINT or SIGTERM); what it had written is removed.
    #[error("interrupted")]
    Interrupted,
    /// File input/output.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// A malformed safetensors file.
    #[error("safetensors: {0}")]
    Safetensors(#[from] safetensors::SafeTensorError),
    /// A malformed JSON file (checkpoint index or config).
    #[error("json: {0}")]
    Json(#[from] serde_json::Error),
    /// Anything else the caller asked for that cannot be done.
    #[error("{0}")]
    Invalid(String),
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
