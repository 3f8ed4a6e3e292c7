//! The one safetensors parser and writer of the crate.
//!
//! [`SafetensorsFile::open`] reads the header alone (the 8-byte length, the JSON, checked against
//! the file's length); tensors are then read by byte range ([`SafetensorsFile::read_into`]), so a
//! reader touches only the tensors it needs and never holds a whole shard. Writing goes through
//! [`write_tensors`]: a sibling temporary file renamed over the target, so a failed write never
//! leaves a truncated file.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, Metadata, TensorInfo, TensorView};

use crate::error::{Error, Result};

/// An [`Error::Tensor`] naming the tensor.
pub(crate) fn tensor_err(name: &str, what: impl Into<String>) -> Error {
    Error::Tensor { name: name.to_string(), what: what.into() }
}

/// An [`Error::Io`] naming the path and what was being done.
pub(crate) fn io_err(action: &str, path: &Path, e: std::io::Error) -> Error {
    Error::Io(std::io::Error::new(e.kind(), format!("cannot {action} `{}`: {e}", path.display())))
}

/// `[d0, d1, ...]`.
pub(crate) fn shape_str(shape: &[usize]) -> String {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    format!("[{}]", dims.join(", "))
}

/// The largest header safetensors accepts.
const MAX_HEADER: u64 = 100_000_000;

/// A safetensors file whose header has been read: every tensor's dtype, shape and byte range.
#[derive(Debug)]
pub struct SafetensorsFile {
    path: PathBuf,
    /// File offset of the data section (8 + header length).
    data_start: u64,
    tensors: HashMap<String, TensorInfo>,
}

impl SafetensorsFile {
    /// Reads and checks the header of `path` (no tensor data is read): it must be valid JSON
    /// describing non-overlapping tensors that exactly fill the rest of the file.
    ///
    /// # Errors
    /// An unreadable file ([`Error::Io`], naming it) or a malformed one ([`Error::Invalid`]:
    /// "`path` is not a valid safetensors file: ...").
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let invalid =
            |what: String| Error::Invalid(format!("`{}` is not a valid safetensors file: {what}", path.display()));
        let mut f = File::open(path).map_err(|e| io_err("read", path, e))?;
        let file_len = f.metadata().map_err(|e| io_err("read", path, e))?.len();
        if file_len < 8 {
            return Err(invalid(format!("it has {file_len} bytes, too few for a header")));
        }
        let mut n8 = [0u8; 8];
        f.read_exact(&mut n8).map_err(|e| io_err("read", path, e))?;
        let n = u64::from_le_bytes(n8);
        if n > MAX_HEADER || n > file_len - 8 {
            return Err(invalid(format!("header length {n} does not fit the file ({file_len} bytes)")));
        }
        let mut header = vec![0u8; n as usize];
        f.read_exact(&mut header).map_err(|e| io_err("read", path, e))?;
        // Metadata's deserializer checks that the byte ranges are contiguous and match each
        // tensor's dtype and shape.
        let meta: Metadata = serde_json::from_slice(&header).map_err(|e| invalid(format!("bad header: {e}")))?;
        let want = 8 + n + meta.data_len() as u64;
        if want != file_len {
            return Err(invalid(format!("the header describes {want} bytes, the file has {file_len}")));
        }
        let tensors = meta.tensors().into_iter().map(|(k, info)| (k, info.clone())).collect();
        Ok(SafetensorsFile { path: path.to_path_buf(), data_start: 8 + n, tensors })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The tensor names, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.tensors.keys().map(String::as_str).collect();
        names.sort_unstable();
        names
    }

    /// Dtype, shape and byte range of `name`, if the file holds it.
    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }

    /// As [`info`](Self::info); a missing tensor is an [`Error::Tensor`] that lists a few of the
    /// names present.
    ///
    /// # Errors
    /// [`Error::Tensor`] for a tensor the file does not hold.
    pub fn get(&self, name: &str) -> Result<&TensorInfo> {
        if let Some(t) = self.tensors.get(name) {
            return Ok(t);
        }
        let names = self.names();
        let shown: Vec<String> = names.iter().take(8).map(|n| format!("`{n}`")).collect();
        let more = if names.len() > 8 { format!(" and {} more", names.len() - 8) } else { String::new() };
        let present = if names.is_empty() {
            "it holds no tensors".to_string()
        } else {
            format!("it holds {}{more}", shown.join(", "))
        };
        Err(tensor_err(name, format!("not found in `{}` ({present})", self.path.display())))
    }

    /// Reads the bytes of `name` into `dst`, which must be exactly as long as the tensor.
    ///
    /// # Errors
    /// A missing tensor or a `dst` of another length ([`Error::Tensor`]), or an i/o error.
    pub fn read_into(&self, name: &str, dst: &mut [u8]) -> Result<()> {
        let (begin, end) = self.get(name)?.data_offsets;
        if dst.len() != end - begin {
            return Err(tensor_err(name, format!("holds {} bytes, the reader expected {}", end - begin, dst.len())));
        }
        let mut f = File::open(&self.path).map_err(|e| io_err("read", &self.path, e))?;
        f.seek(SeekFrom::Start(self.data_start + begin as u64)).map_err(|e| io_err("read", &self.path, e))?;
        f.read_exact(dst).map_err(|e| io_err("read", &self.path, e))
    }

    /// The bytes of `name`.
    ///
    /// # Errors
    /// As [`read_into`](Self::read_into).
    pub fn read(&self, name: &str) -> Result<Vec<u8>> {
        let (begin, end) = self.get(name)?.data_offsets;
        let mut out = vec![0u8; end - begin];
        self.read_into(name, &mut out)?;
        Ok(out)
    }
}

/// Checks a tensor's dtype against the accepted ones.
pub(crate) fn check_dtype(t: &TensorInfo, name: &str, want: &[Dtype]) -> Result<()> {
    if want.contains(&t.dtype) {
        return Ok(());
    }
    let want: Vec<String> = want.iter().map(|d| d.to_string()).collect();
    Err(tensor_err(name, format!("dtype is {}, expected {}", t.dtype, want.join(" or "))))
}

/// A view of `data` as a tensor to write.
pub(crate) fn view<'a>(name: &str, dtype: Dtype, shape: Vec<usize>, data: &'a [u8]) -> Result<TensorView<'a>> {
    TensorView::new(dtype, shape, data).map_err(|e| tensor_err(name, format!("cannot be written: {e}")))
}

/// The file-level metadata every file written here carries (one entry, so the header is
/// deterministic).
fn file_metadata() -> Option<HashMap<String, String>> {
    Some(HashMap::from([("format".to_string(), "pt".to_string())]))
}

/// Writes `tensors` to a sibling temporary file that is then renamed over `path` (a failed write
/// never leaves a truncated file), with the permissions a newly created file gets here. The order
/// is fixed (safetensors sorts by dtype, then name), so the same tensors always give the same bytes.
pub(crate) fn write_tensors(path: &Path, tensors: Vec<(String, TensorView<'_>)>) -> Result<()> {
    let io = |e: std::io::Error| io_err("write", path, e);
    let Some(file_name) = path.file_name() else {
        return Err(io(std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a file name")));
    };
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(file_name);
    tmp_name.push(format!(".tmp{}", std::process::id()));
    let tmp = path.with_file_name(tmp_name);
    let perms = File::create(&tmp).and_then(|f| f.metadata()).map(|m| m.permissions()).map_err(io)?;
    let written = safetensors::serialize_to_file(tensors, file_metadata(), &tmp)
        .map_err(|e| match e {
            safetensors::SafeTensorError::IoError(e) => io(e),
            e => Error::Safetensors(e),
        })
        .and_then(|()| std::fs::set_permissions(&tmp, perms).and_then(|()| std::fs::rename(&tmp, path)).map_err(io));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}
