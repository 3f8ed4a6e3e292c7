//! The one safetensors parser and writer of the crate.
//!
//! [`SafetensorsFile::open`] memory-maps the file (`memmap2`) and parses the header alone (the
//! 8-byte length, the JSON, every tensor's byte range checked against the file's length); a
//! tensor is then read from its byte range only, borrowed from the mapping without a copy
//! ([`SafetensorsFile::bytes`]) or copied into the caller's buffer ([`SafetensorsFile::read_into`],
//! on Unix with `pread` on the same open file). Opening a 2 GiB shard to read one 2 MiB tensor
//! touches about 2 MiB of it, and the pages read are the page cache's (file-backed), not the
//! process's anonymous memory. Only regular files are opened (`/dev/zero`, a FIFO or a directory
//! is an [`Error::NotRegularFile`] before anything is read; see [`super::fs`]).
//!
//! # The mapping's safety contract
//!
//! A mapped file is read by the CPU as memory: if another process truncates the file while it is
//! mapped, touching a page past the new end raises `SIGBUS` and ends the process (true of every
//! mmap-based reader, the `safetensors` crate's and PyTorch's included). What the crate does:
//! copies ([`read_into`](SafetensorsFile::read_into), [`read`](SafetensorsFile::read), and so
//! every checkpoint loader) do not read through the mapping on Unix, so truncation there is an
//! [`Error::FileChanged`], never a signal; the borrowing calls ([`bytes`](SafetensorsFile::bytes),
//! [`mapped`](SafetensorsFile::mapped)) and the header parse in `open` check on the open descriptor
//! that the file still has its length first (also [`Error::FileChanged`]), which narrows the window
//! but cannot close it while the caller holds the slice. So: do not truncate or rewrite a
//! checkpoint in place while it is open. Replacing it by rename, as every writer of this crate
//! does, is safe: the mapping keeps the old file.
//!
//! Writing goes through [`write_tensors`]: the header and data are streamed into
//! [`write_atomically`](super::fs::write_atomically) (a temporary file renamed over the target,
//! synced; only a regular file is replaced). The bytes equal those of the `safetensors` crate's
//! `serialize_to_file` (tensors sorted by dtype, then name; the header padded to 8 bytes).

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata, TensorInfo, TensorView};
use safetensors::View;

use crate::error::{Error, Result};
pub(crate) use crate::io::fs::io_err;
use crate::io::fs::{open_regular, write_atomically};
use crate::io::shown::{shown, shown_path};

/// An [`Error::Tensor`] naming the tensor (escaped and shortened: names come from files).
pub(crate) fn tensor_err(name: &str, what: impl Into<String>) -> Error {
    Error::Tensor { name: shown(name), what: what.into() }
}

/// `[d0, d1, ...]`.
pub(crate) fn shape_str(shape: &[usize]) -> String {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    format!("[{}]", dims.join(", "))
}

/// The largest header accepted (the `safetensors` crate's limit).
const MAX_HEADER: u64 = 100_000_000;

/// What went wrong in a JSON document, without quoting it: serde's messages can repeat a value
/// from the input ("invalid type: string \"...\""), so only the category and position are kept.
pub(crate) fn json_problem(e: &serde_json::Error) -> String {
    use serde_json::error::Category;
    let what = match e.classify() {
        Category::Io => "unreadable",
        Category::Syntax => "not valid JSON",
        Category::Data => "JSON of the wrong shape",
        Category::Eof => "JSON that ends too early",
    };
    if e.line() == 0 {
        what.to_string()
    } else {
        format!("{what} (at line {}, column {})", e.line(), e.column())
    }
}

/// A key repeated within one JSON object: the key of the object holding it (`None` at the top
/// level) and the key itself.
#[derive(Debug)]
pub(crate) struct RepeatedKey {
    pub parent: Option<String>,
    pub key: String,
}

/// Why [`parse_json_unique`] failed.
#[derive(Debug)]
pub(crate) enum JsonError {
    /// A key given twice in one object.
    Repeated(RepeatedKey),
    /// Not JSON (see [`json_problem`]).
    Json(serde_json::Error),
}

/// A JSON value whose objects' keys are checked to be distinct while it is parsed: `serde_json`
/// keeps the last of repeated keys silently, so a header or index naming a tensor twice would
/// be read as whichever came last. The first repeat is left in `repeated`.
struct UniqueKeys<'a> {
    repeated: &'a std::cell::RefCell<Option<RepeatedKey>>,
    parent: Option<&'a str>,
}

impl<'de> serde::de::DeserializeSeed<'de> for UniqueKeys<'_> {
    type Value = serde_json::Value;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> std::result::Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for UniqueKeys<'_> {
    type Value = serde_json::Value;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> std::result::Result<Self::Value, E> {
        Ok(v.into())
    }

    fn visit_i64<E>(self, v: i64) -> std::result::Result<Self::Value, E> {
        Ok(v.into())
    }

    fn visit_u64<E>(self, v: u64) -> std::result::Result<Self::Value, E> {
        Ok(v.into())
    }

    fn visit_f64<E>(self, v: f64) -> std::result::Result<Self::Value, E> {
        // JSON has no NaN or infinity, so the number always exists.
        Ok(serde_json::Number::from_f64(v).map_or(serde_json::Value::Null, serde_json::Value::Number))
    }

    fn visit_str<E>(self, v: &str) -> std::result::Result<Self::Value, E> {
        Ok(v.into())
    }

    fn visit_string<E>(self, v: String) -> std::result::Result<Self::Value, E> {
        Ok(v.into())
    }

    fn visit_unit<E>(self) -> std::result::Result<Self::Value, E> {
        Ok(serde_json::Value::Null)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut a: A) -> std::result::Result<Self::Value, A::Error> {
        let mut out = Vec::new();
        while let Some(v) = a.next_element_seed(UniqueKeys { repeated: self.repeated, parent: self.parent })? {
            out.push(v);
        }
        Ok(serde_json::Value::Array(out))
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut a: A) -> std::result::Result<Self::Value, A::Error> {
        let mut out = serde_json::Map::new();
        while let Some(key) = a.next_key::<String>()? {
            if out.contains_key(&key) {
                *self.repeated.borrow_mut() = Some(RepeatedKey { parent: self.parent.map(str::to_string), key });
                return Err(serde::de::Error::custom("a repeated key"));
            }
            let v = a.next_value_seed(UniqueKeys { repeated: self.repeated, parent: Some(&key) })?;
            out.insert(key, v);
        }
        Ok(serde_json::Value::Object(out))
    }
}

/// Parses one JSON object, refusing a key repeated within it or any object inside it. Anything
/// but an object is "JSON of the wrong shape" (see [`json_problem`]).
pub(crate) fn parse_json_unique(
    bytes: &[u8],
) -> std::result::Result<serde_json::Map<String, serde_json::Value>, JsonError> {
    use serde::Deserializer;
    let repeated = std::cell::RefCell::new(None);
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let parsed = (&mut de).deserialize_map(UniqueKeys { repeated: &repeated, parent: None }).and_then(|v| {
        de.end()?;
        match v {
            serde_json::Value::Object(m) => Ok(m),
            _ => Err(serde::de::Error::custom("not an object")),
        }
    });
    match (parsed, repeated.into_inner()) {
        (_, Some(r)) => Err(JsonError::Repeated(r)),
        (Ok(v), None) => Ok(v),
        (Err(e), None) => Err(JsonError::Json(e)),
    }
}

/// What [`parse_json_unique`] found wrong, as the predicate of a sentence about the document
/// ("`config.json` {...}"): "is not valid JSON (at line 1, column 7)", "has the key `a` twice in
/// `b`". Never quotes a value, only keys (escaped and shortened).
pub(crate) fn json_unique_problem(e: &JsonError) -> String {
    match e {
        JsonError::Json(e) => format!("is {}", json_problem(e)),
        JsonError::Repeated(RepeatedKey { parent: Some(p), key }) => {
            format!("has the key `{}` twice in `{}`", shown(key), shown(p))
        }
        JsonError::Repeated(RepeatedKey { parent: None, key }) => format!("has the key `{}` twice", shown(key)),
    }
}

/// A safetensors file, memory-mapped, whose header has been read and checked: every tensor's
/// dtype, shape and byte range.
#[derive(Debug)]
pub struct SafetensorsFile {
    path: PathBuf,
    /// The open file: its length is checked before each read (a truncated file is reported, not
    /// read past its end).
    file: File,
    /// The whole file, mapped read-only.
    map: Mmap,
    /// Offset of the data section (8 + header length).
    data_start: usize,
    tensors: HashMap<String, TensorInfo>,
}

/// The byte length of `shape` in `dtype`, if it fits in `usize` and is whole bytes.
fn byte_len(dtype: Dtype, shape: &[usize]) -> Option<usize> {
    let elements = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))?;
    let bits = elements.checked_mul(dtype.bitsize())?;
    bits.is_multiple_of(8).then_some(bits / 8)
}

/// Parses and checks a header against `data_len`, the bytes after it: every entry a tensor of a
/// known dtype whose byte range matches its shape, the ranges contiguous from 0 and filling the
/// data exactly. Messages name the tensor (escaped), never quote the JSON.
fn parse_header(header: &[u8], data_len: usize) -> std::result::Result<HashMap<String, TensorInfo>, String> {
    let doc = match parse_json_unique(header) {
        Ok(doc) => doc,
        Err(JsonError::Json(e)) => return Err(format!("its header is {}", json_problem(&e))),
        Err(JsonError::Repeated(RepeatedKey { parent: None, key })) if key == "__metadata__" => {
            return Err("its header has `__metadata__` twice".to_string())
        }
        Err(JsonError::Repeated(RepeatedKey { parent: None, key })) => {
            return Err(format!("its header names tensor `{}` twice", shown(&key)))
        }
        Err(JsonError::Repeated(RepeatedKey { parent: Some(p), key })) => {
            return Err(format!("its header has the key `{}` twice in `{}`", shown(&key), shown(&p)))
        }
    };
    let mut tensors = HashMap::with_capacity(doc.len());
    for (name, entry) in doc {
        if name == "__metadata__" {
            let ok = entry.as_object().is_some_and(|m| m.values().all(|v| v.is_string()));
            if !ok {
                return Err("its header's __metadata__ is not a map of strings".to_string());
            }
            continue;
        }
        let info: TensorInfo = serde_json::from_value(entry).map_err(|e| {
            format!(
                "the header entry of tensor `{}` is {}: expected {{\"dtype\", \"shape\", \"data_offsets\"}} with a \
                 known dtype",
                shown(&name),
                json_problem(&e)
            )
        })?;
        tensors.insert(name, info);
    }
    let mut ranges: Vec<(&String, &TensorInfo)> = tensors.iter().collect();
    ranges.sort_by_key(|(name, t)| (t.data_offsets, name.as_str()));
    let mut next = 0usize;
    for (name, t) in ranges {
        let (begin, end) = t.data_offsets;
        let Some(len) = byte_len(t.dtype, &t.shape) else {
            return Err(format!(
                "tensor `{}`: {} {} is not a whole number of bytes that fits in memory",
                shown(name),
                t.dtype,
                shape_str(&t.shape)
            ));
        };
        if begin != next {
            let what = if begin < next { "overlaps the tensor before it" } else { "leaves a gap before it" };
            return Err(format!(
                "tensor `{}` at bytes {begin}..{end} {what} (the data must be contiguous)",
                shown(name)
            ));
        }
        if end < begin || end - begin != len {
            return Err(format!(
                "tensor `{}`: bytes {begin}..{end} do not hold {} {} ({len} bytes)",
                shown(name),
                t.dtype,
                shape_str(&t.shape)
            ));
        }
        next = end;
    }
    if next != data_len {
        return Err(format!("the header describes {next} bytes of data, the file holds {data_len}"));
    }
    Ok(tensors)
}

/// Parses a whole safetensors file's bytes: the 8-byte header length, the header, and its layout
/// against the data after it ([`parse_header`]). Returns the data's offset and the tensors.
pub(crate) fn parse_file_bytes(bytes: &[u8]) -> std::result::Result<(usize, HashMap<String, TensorInfo>), String> {
    let len = bytes.len();
    let Some((head, rest)) = bytes.split_first_chunk::<8>() else {
        return Err(format!("it has {len} bytes, too few for a header"));
    };
    let n = u64::from_le_bytes(*head);
    if n > MAX_HEADER || n > rest.len() as u64 {
        return Err(format!("header length {n} does not fit the file ({len} bytes)"));
    }
    let (header, data) = rest.split_at(n as usize);
    let tensors = parse_header(header, data.len())?;
    Ok((8 + header.len(), tensors))
}

impl SafetensorsFile {
    /// Maps `path` and reads and checks its header (no tensor data is read): it must be a regular
    /// file, its header valid JSON describing non-overlapping tensors that exactly fill the rest
    /// of the file.
    ///
    /// # Errors
    /// Something that is not a regular file ([`Error::NotRegularFile`]), an unreadable file
    /// ([`Error::Io`], naming it), or a malformed one ([`Error::Invalid`]: "`path` is not a valid
    /// safetensors file: ...", never quoting the file's JSON).
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let invalid =
            |what: String| Error::Invalid(format!("`{}` is not a valid safetensors file: {what}", shown_path(path)));
        let file = open_regular(path)?;
        let file_len = file.metadata().map_err(|e| io_err("read", path, e))?.len();
        if file_len < 8 {
            return Err(invalid(format!("it has {file_len} bytes, too few for a header")));
        }
        if usize::try_from(file_len).is_err() {
            return Err(invalid(format!("its {file_len} bytes do not fit in this platform's address space")));
        }
        // SAFETY: the mapping is read-only and private to this value; the contract on concurrent
        // truncation is the module's (documented above): lengths are re-checked before reads.
        let map = unsafe { memmap2::MmapOptions::new().map(&file) }.map_err(|e| io_err("map", path, e))?;
        let len = map.len();
        // The file may have changed between the `metadata` call and the mapping.
        check_len(&file, path, len)?;
        let (data_start, tensors) = parse_file_bytes(&map).map_err(invalid)?;
        Ok(SafetensorsFile { path: path.to_path_buf(), file, map, data_start, tensors })
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
        let shown_names: Vec<String> = names.iter().take(8).map(|n| format!("`{}`", shown(n))).collect();
        let more = if names.len() > 8 { format!(" and {} more", names.len() - 8) } else { String::new() };
        let present = if names.is_empty() {
            "it holds no tensors".to_string()
        } else {
            format!("it holds {}{more}", shown_names.join(", "))
        };
        Err(tensor_err(name, format!("not found in `{}` ({present})", shown_path(&self.path))))
    }

    /// The whole file as mapped (header and data), for another safetensors parser to read in
    /// place (`safetensors::SafeTensors::deserialize`); pages are read only as they are touched.
    /// The module's safety contract applies.
    ///
    /// # Errors
    /// A file that has shrunk since it was opened ([`Error::FileChanged`]).
    pub fn mapped(&self) -> Result<&[u8]> {
        check_len(&self.file, &self.path, self.map.len())?;
        Ok(&self.map)
    }

    /// The bytes of `name`, borrowed from the mapping (no copy). See the module's safety contract:
    /// the file must not be truncated while the slice is in use.
    ///
    /// # Errors
    /// A missing tensor ([`Error::Tensor`]) or a file that has shrunk since it was opened
    /// ([`Error::FileChanged`]).
    pub fn bytes(&self, name: &str) -> Result<&[u8]> {
        let (begin, end) = self.get(name)?.data_offsets;
        check_len(&self.file, &self.path, self.map.len())?;
        let range = self.data_start + begin..self.data_start + end;
        #[cfg(unix)]
        if range.len() >= 1 << 20 {
            // Large tensors: ask the kernel to start reading the whole range now rather than page
            // by page as it is touched (a hint; failure is harmless).
            let _ = self.map.advise_range(memmap2::Advice::WillNeed, range.start, range.len());
        }
        Ok(&self.map[range])
    }

    /// Copies the bytes of `name` into `dst`, which must be exactly as long as the tensor (on
    /// Unix with `pread` on the open file, bypassing the mapping: see the comment inside).
    ///
    /// # Errors
    /// A missing tensor or a `dst` of another length ([`Error::Tensor`]), or a file that has
    /// shrunk since it was opened ([`Error::FileChanged`]).
    pub fn read_into(&self, name: &str, dst: &mut [u8]) -> Result<()> {
        let (begin, end) = self.get(name)?.data_offsets;
        if dst.len() != end - begin {
            return Err(tensor_err(name, format!("holds {} bytes, the reader expected {}", end - begin, dst.len())));
        }
        #[cfg(unix)]
        {
            // A copy is read with pread on the open file rather than from the mapping: the same
            // one copy out of the page cache, but a file truncated meanwhile gives a short read,
            // an error, instead of SIGBUS, and no page-table entries are made for pages the
            // caller does not keep. (A deepseek-v3 layer loads as fast either way: filling the
            // fresh destination pages is what takes the time.)
            use std::os::unix::fs::FileExt;
            let at = (self.data_start + begin) as u64;
            self.file.read_exact_at(dst, at).map_err(|e| {
                if e.kind() == std::io::ErrorKind::UnexpectedEof {
                    Error::FileChanged {
                        path: self.path.clone(),
                        what: format!("tensor `{}` ends past the end of the file (truncated while open)", shown(name)),
                    }
                } else {
                    io_err("read", &self.path, e)
                }
            })
        }
        #[cfg(not(unix))]
        {
            dst.copy_from_slice(self.bytes(name)?);
            Ok(())
        }
    }

    /// The bytes of `name`, copied.
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

/// [`Error::FileChanged`] unless the open file still has at least `len` bytes.
fn check_len(file: &File, path: &Path, len: usize) -> Result<()> {
    let now = file.metadata().map_err(|e| io_err("read", path, e))?.len();
    if now < len as u64 {
        return Err(Error::FileChanged {
            path: path.to_path_buf(),
            what: format!("it had {len} bytes when opened and has {now} now (truncated while open)"),
        });
    }
    Ok(())
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

/// Writes `tensors` to `path` through [`write_atomically`] (a temporary file in the same
/// directory, synced and renamed over `path`; only a regular file is replaced; nothing is left
/// behind on an error), with the permissions a newly created file gets here. The bytes are those
/// of `safetensors::serialize_to_file`: tensors sorted by dtype (descending), then name, the header
/// padded with spaces to a multiple of 8, so the same tensors always give the same bytes. The data
/// is streamed from the views (no second copy of it in memory).
pub(crate) fn write_tensors(path: &Path, tensors: Vec<(String, TensorView<'_>)>) -> Result<()> {
    let mut tensors = tensors;
    if let Some((name, _)) = tensors.iter().find(|(n, _)| n == "__metadata__") {
        // The header's metadata entry has this key: a tensor of that name would make a header
        // with the key twice, which readers resolve differently (or refuse).
        return Err(tensor_err(name, "cannot be written: the name is reserved for the header's metadata"));
    }
    tensors.sort_by(|(ln, lt), (rn, rt)| rt.dtype().cmp(&lt.dtype()).then(ln.cmp(rn)));
    let mut infos = Vec::with_capacity(tensors.len());
    let mut offset = 0usize;
    for (name, t) in &tensors {
        let n = t.data_len();
        infos.push((
            name.clone(),
            TensorInfo { dtype: t.dtype(), shape: t.shape().to_vec(), data_offsets: (offset, offset + n) },
        ));
        offset += n;
    }
    let metadata = Metadata::new(file_metadata(), infos).map_err(Error::Safetensors)?;
    let mut header = serde_json::to_string(&metadata)
        .map_err(|e| Error::Invalid(format!("cannot write `{}`: {}", shown_path(path), json_problem(&e))))?
        .into_bytes();
    header.resize(header.len().next_multiple_of(8), b' ');
    if header.len() as u64 > MAX_HEADER {
        return Err(Error::Safetensors(safetensors::SafeTensorError::HeaderTooLarge));
    }
    write_atomically(path, |w| {
        let io = |e: std::io::Error| io_err("write", path, e);
        w.write_all(&(header.len() as u64).to_le_bytes()).map_err(io)?;
        w.write_all(&header).map_err(io)?;
        for (_, t) in &tensors {
            w.write_all(t.data()).map_err(io)?;
        }
        Ok(())
    })
}
