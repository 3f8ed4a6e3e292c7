//! Where a checkpoint's tensors are: a single safetensors file, a sharded checkpoint's index, a
//! directory holding one of them (a model directory or a Hugging Face cache snapshot, whose files
//! are symlinks into `../../blobs`), or a Hugging Face cache root `models--org--name/` (through
//! `refs/main`); every tensor's dtype, shape and shard from the files' headers.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Component, Path, PathBuf};

use safetensors::tensor::Dtype;

use crate::error::{Error, Result};
use crate::io::fs::read_small_file;
use crate::io::safetensors::{
    io_err, json_unique_problem, parse_json_unique, tensor_err, JsonError, RepeatedKey, SafetensorsFile,
};
use crate::io::shown::{shown, shown_path};

/// The largest index accepted (DeepSeek-V3's, with 91,991 tensors, has 9 MB).
const MAX_INDEX_BYTES: u64 = 256 << 20;
/// The largest `refs/<branch>` file of a Hugging Face cache accepted (it holds a commit hash).
const MAX_REF_BYTES: u64 = 4096;

/// Checks a shard name from an index lexically: a relative path with no `..`, root or drive part.
/// Lexical on purpose: a Hugging Face cache snapshot's shards are symlinks into `../../blobs`,
/// which must keep working; what an index may not do is name a path outside its directory.
fn check_shard_name(index: &Path, tensor: &str, shard: &str) -> Result<()> {
    let unsafe_path = |why: &'static str| Error::UnsafeShardPath {
        index: index.to_path_buf(),
        tensor: tensor.to_string(),
        shard: shard.to_string(),
        why,
    };
    if shard.is_empty() {
        return Err(unsafe_path("an empty name"));
    }
    if shard.contains('\0') {
        return Err(unsafe_path("a NUL byte"));
    }
    // Both separators and drive letters are judged on every platform, so an index means the same
    // wherever it is read.
    let absolute = shard.starts_with(['/', '\\'])
        || (shard.as_bytes().first().is_some_and(u8::is_ascii_alphabetic) && shard.as_bytes().get(1) == Some(&b':'))
        || Path::new(shard).components().any(|c| matches!(c, Component::Prefix(_) | Component::RootDir));
    if absolute {
        return Err(unsafe_path("an absolute path"));
    }
    let parts: Vec<&str> = shard.split(['/', '\\']).collect();
    if parts.contains(&"..") {
        return Err(unsafe_path("a `..` component"));
    }
    if parts.iter().all(|p| p.is_empty() || *p == ".") {
        return Err(unsafe_path("no file name"));
    }
    Ok(())
}

/// The JSON type of a value, for messages that must not quote it.
fn json_type(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "an empty string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// The `weight_map` of a sharded checkpoint's index: tensor name to shard file (relative to the
/// index's directory, checked by [`check_shard_name`]).
fn read_index(path: &Path) -> Result<Vec<(String, String)>> {
    let bytes = read_small_file(path, MAX_INDEX_BYTES, "checkpoint index")?;
    let v = parse_json_unique(&bytes).map_err(|e| {
        let what = match &e {
            // Which shard holds a tensor listed twice would be whichever entry came last.
            JsonError::Repeated(RepeatedKey { parent: Some(p), key }) if p == "weight_map" => {
                format!("lists tensor `{}` twice in its weight_map", shown(key))
            }
            _ => json_unique_problem(&e),
        };
        Error::Invalid(format!("checkpoint index `{}` {what}", shown_path(path)))
    })?;
    let Some(map) = v.get("weight_map").and_then(|m| m.as_object()) else {
        return Err(Error::Invalid(format!(
            "checkpoint index `{}` has no \"weight_map\" object (tensor name -> shard file)",
            shown_path(path)
        )));
    };
    map.iter()
        .map(|(name, shard)| match shard.as_str() {
            Some(s) if !s.is_empty() => {
                check_shard_name(path, name, s)?;
                Ok((name.clone(), s.to_string()))
            }
            _ => Err(Error::Invalid(format!(
                "checkpoint index `{}`: the weight_map entry for `{}` is {}, not a shard file name",
                shown_path(path),
                shown(name),
                json_type(shard)
            ))),
        })
        .collect()
}

/// A checkpoint path after resolving a directory.
enum Resolved {
    File(PathBuf),
    Index(PathBuf),
}

/// The snapshot a Hugging Face cache root (`models--org--name/`, holding `refs/`, `snapshots/` and
/// `blobs/`) points to: `snapshots/<the commit in refs/main>`; without `refs/main`, its only
/// snapshot.
fn cache_snapshot(root: &Path) -> Result<PathBuf> {
    let snapshots = root.join("snapshots");
    let main = root.join("refs").join("main");
    let cache_err = |what: String| Error::Invalid(format!("Hugging Face cache `{}`: {what}", shown_path(root)));
    if main.exists() {
        let bytes = read_small_file(&main, MAX_REF_BYTES, "Hugging Face cache ref")?;
        let rev = String::from_utf8(bytes).map_err(|_| cache_err("refs/main is not UTF-8 text".to_string()))?;
        let rev = rev.trim();
        // One plain path component (a commit hash): a ref can never point outside `snapshots/`.
        let plain = !rev.is_empty()
            && rev != "."
            && rev != ".."
            && rev.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
        if !plain {
            return Err(cache_err(format!(
                "refs/main holds `{}`, not a revision (a commit hash naming a folder of snapshots/)",
                shown(rev)
            )));
        }
        let dir = snapshots.join(rev);
        if !dir.is_dir() {
            return Err(cache_err(format!(
                "refs/main names revision `{}`, but snapshots/{} is not there (an incomplete download?)",
                shown(rev),
                shown(rev)
            )));
        }
        return Ok(dir);
    }
    let mut revs = Vec::new();
    for entry in std::fs::read_dir(&snapshots).map_err(|e| io_err("list", &snapshots, e))? {
        let entry = entry.map_err(|e| io_err("list", &snapshots, e))?;
        if entry.path().is_dir() {
            revs.push(entry.path());
        }
    }
    match revs.len() {
        1 => Ok(revs.remove(0)),
        n => Err(cache_err(format!(
            "no refs/main and {n} snapshots: pass the snapshot folder (snapshots/<revision>) to load"
        ))),
    }
}

/// Whether `dir` is a Hugging Face cache root: `snapshots/` beside `refs/` or `blobs/`.
fn is_cache_root(dir: &Path) -> bool {
    dir.join("snapshots").is_dir() && (dir.join("refs").is_dir() || dir.join("blobs").is_dir())
}

fn resolve(path: &Path) -> Result<Resolved> {
    let md = std::fs::metadata(path).map_err(|e| io_err("read", path, e))?;
    if !md.is_dir() {
        // A FIFO or device is refused when opened, before anything is read.
        let is_json = path.extension().is_some_and(|x| x.eq_ignore_ascii_case("json"));
        return Ok(if is_json { Resolved::Index(path.to_path_buf()) } else { Resolved::File(path.to_path_buf()) });
    }
    if is_cache_root(path) {
        return resolve(&cache_snapshot(path)?);
    }
    let mut indexes = Vec::new();
    let mut files = Vec::new();
    for entry in std::fs::read_dir(path).map_err(|e| io_err("list", path, e))? {
        let entry = entry.map_err(|e| io_err("list", path, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let p = entry.path();
        // Not filtered on the file type: a FIFO, device or directory under a checkpoint file's name
        // is refused by name when opened (NotRegularFile), rather than reported as no checkpoint.
        // Opening follows symlinks, as a cache snapshot's entries are links into ../../blobs.
        if name.starts_with('.') {
            continue;
        }
        if name.ends_with(".index.json") {
            indexes.push(p);
        } else if name.ends_with(".safetensors") {
            files.push(p);
        }
    }
    indexes.sort();
    files.sort();
    let list = |ps: &[PathBuf]| {
        ps.iter().map(|p| format!("`{}`", shown_path(Path::new(p.file_name().unwrap_or_default())))).collect::<Vec<_>>()
    };
    match (indexes.len(), files.len()) {
        (1, _) => Ok(Resolved::Index(indexes.remove(0))),
        (0, 1) => Ok(Resolved::File(files.remove(0))),
        (0, 0) => Err(Error::Invalid(format!(
            "directory `{}` holds no `.safetensors` file and no `*.index.json`",
            shown_path(path)
        ))),
        (0, n) => Err(Error::Invalid(format!(
            "directory `{}` holds {n} `.safetensors` files ({}) and no `*.index.json`: pass one file or an index",
            shown_path(path),
            list(&files).join(", ")
        ))),
        (n, _) => Err(Error::Invalid(format!(
            "directory `{}` holds {n} `*.index.json` files ({}): pass one of them",
            shown_path(path),
            list(&indexes).join(", ")
        ))),
    }
}

/// Where a checkpoint's tensors are.
pub(crate) struct Catalog {
    /// The file named in "not found" messages: the safetensors file or the index.
    pub source: PathBuf,
    /// Whether `source` is an index.
    pub is_index: bool,
    /// The directory holding `source` (where `config.json` would be).
    pub dir: PathBuf,
    /// The shard files (one for a single file), sorted.
    pub shards: Vec<PathBuf>,
    /// Every tensor name of the checkpoint and the shard holding it.
    pub shard_of: HashMap<String, usize>,
    /// Where [`Catalog::metas`] finds the dtypes and shapes.
    headers: Headers,
}

/// Where a catalog's dtypes and shapes are.
enum Headers {
    /// In the single file's header, read once while opening.
    Single(SafetensorsFile),
    /// In each shard's header, read when asked.
    Shards,
    /// Given with the names (the fuzz targets' input: no file).
    #[cfg(feature = "fuzzing")]
    Given(HashMap<String, (Dtype, Vec<usize>)>),
}

/// The dtype, shape and shard of one tensor.
pub(crate) struct Meta {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub shard: usize,
}

impl Catalog {
    pub fn open(path: &Path) -> Result<Catalog> {
        match resolve(path)? {
            Resolved::File(file) => {
                let header = SafetensorsFile::open(&file)?;
                let shard_of = header.names().into_iter().map(|n| (n.to_string(), 0)).collect();
                Ok(Catalog {
                    source: file.clone(),
                    is_index: false,
                    dir: parent_dir(&file),
                    shards: vec![file],
                    shard_of,
                    headers: Headers::Single(header),
                })
            }
            Resolved::Index(index) => {
                let entries = read_index(&index)?;
                let dir = parent_dir(&index);
                let files: BTreeSet<&str> = entries.iter().map(|(_, s)| s.as_str()).collect();
                let files: Vec<&str> = files.into_iter().collect();
                let shards = files.iter().map(|f| dir.join(f)).collect();
                let shard_of = entries
                    .iter()
                    .map(|(n, s)| (n.clone(), files.binary_search(&s.as_str()).expect("listed shard")))
                    .collect();
                Ok(Catalog { source: index, is_index: true, dir, shards, shard_of, headers: Headers::Shards })
            }
        }
    }

    /// A catalog of one in-memory shard holding `tensors` (name, dtype, shape; the fuzz targets'
    /// input: no file). A name given twice keeps its last entry, as a map of names does.
    #[cfg(feature = "fuzzing")]
    pub fn in_memory(tensors: &[(String, Dtype, Vec<usize>)]) -> Catalog {
        let file = PathBuf::from("fuzz.safetensors");
        let given: HashMap<String, (Dtype, Vec<usize>)> =
            tensors.iter().map(|(n, dtype, shape)| (n.clone(), (*dtype, shape.clone()))).collect();
        Catalog {
            source: file.clone(),
            is_index: false,
            dir: PathBuf::from("."),
            shards: vec![file],
            shard_of: given.keys().map(|n| (n.clone(), 0)).collect(),
            headers: Headers::Given(given),
        }
    }

    pub fn not_found(&self, name: &str, hint: &str) -> Error {
        let place = if self.is_index {
            format!("the weight_map of `{}`", shown_path(&self.source))
        } else {
            format!("`{}`", shown_path(&self.source))
        };
        tensor_err(name, format!("not found in {place}{hint}"))
    }

    /// The dtype, shape and shard of each of `names`, read from the headers of the shards that
    /// hold them (a name the catalog does not list is not found).
    pub fn metas(&self, names: &[String]) -> Result<HashMap<String, Meta>> {
        let mut by_shard: BTreeMap<usize, Vec<&String>> = BTreeMap::new();
        for n in names {
            let Some(&shard) = self.shard_of.get(n) else { return Err(self.not_found(n, "")) };
            by_shard.entry(shard).or_default().push(n);
        }
        let mut out = HashMap::with_capacity(names.len());
        for (shard, wanted) in by_shard {
            let path = &self.shards[shard];
            let opened;
            let header = match &self.headers {
                Headers::Single(h) => h,
                Headers::Shards => {
                    opened = SafetensorsFile::open(path)?;
                    &opened
                }
                #[cfg(feature = "fuzzing")]
                Headers::Given(given) => {
                    for n in wanted {
                        let Some((dtype, shape)) = given.get(n) else { return Err(self.not_found(n, "")) };
                        out.insert(n.clone(), Meta { dtype: *dtype, shape: shape.clone(), shard });
                    }
                    continue;
                }
            };
            for n in wanted {
                let Some(info) = header.info(n) else {
                    return Err(tensor_err(
                        n,
                        format!(
                            "listed in the weight_map of `{}` as in `{}`, which does not hold it",
                            shown_path(&self.source),
                            shown_path(path)
                        ),
                    ));
                };
                out.insert(n.clone(), Meta { dtype: info.dtype, shape: info.shape.clone(), shard });
            }
        }
        Ok(out)
    }
}

/// The directory of a file path (`.` for a bare file name).
fn parent_dir(file: &Path) -> PathBuf {
    match file.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    }
}
