//! Where a checkpoint's tensors are: a single safetensors file, a sharded checkpoint's index, or a
//! directory holding one of them; every tensor's dtype, shape and shard from the files' headers.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use safetensors::tensor::Dtype;

use crate::error::{Error, Result};
use crate::io::safetensors::{io_err, tensor_err, SafetensorsFile};

/// The `weight_map` of a sharded checkpoint's index: tensor name to shard file (relative to the
/// index's directory).
fn read_index(path: &Path) -> Result<Vec<(String, String)>> {
    let bytes = std::fs::read(path).map_err(|e| io_err("read", path, e))?;
    let v: serde_json::Value = serde_json::from_slice(&bytes)
        .map_err(|e| Error::Invalid(format!("checkpoint index `{}` is not valid JSON: {e}", path.display())))?;
    let Some(map) = v.get("weight_map").and_then(|m| m.as_object()) else {
        return Err(Error::Invalid(format!(
            "checkpoint index `{}` has no \"weight_map\" object (tensor name -> shard file)",
            path.display()
        )));
    };
    map.iter()
        .map(|(name, shard)| match shard.as_str() {
            Some(s) if !s.is_empty() => Ok((name.clone(), s.to_string())),
            _ => Err(Error::Invalid(format!(
                "checkpoint index `{}`: the weight_map entry for `{name}` is {shard}, not a shard file name",
                path.display()
            ))),
        })
        .collect()
}

/// A checkpoint path after resolving a directory.
enum Resolved {
    File(PathBuf),
    Index(PathBuf),
}

fn resolve(path: &Path) -> Result<Resolved> {
    let md = std::fs::metadata(path).map_err(|e| io_err("read", path, e))?;
    if !md.is_dir() {
        let is_json = path.extension().is_some_and(|x| x.eq_ignore_ascii_case("json"));
        return Ok(if is_json { Resolved::Index(path.to_path_buf()) } else { Resolved::File(path.to_path_buf()) });
    }
    let mut indexes = Vec::new();
    let mut files = Vec::new();
    for entry in std::fs::read_dir(path).map_err(|e| io_err("list", path, e))? {
        let entry = entry.map_err(|e| io_err("list", path, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let p = entry.path();
        if name.starts_with('.') || !p.is_file() {
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
        ps.iter().map(|p| format!("`{}`", p.file_name().unwrap_or_default().to_string_lossy())).collect::<Vec<_>>()
    };
    match (indexes.len(), files.len()) {
        (1, _) => Ok(Resolved::Index(indexes.remove(0))),
        (0, 1) => Ok(Resolved::File(files.remove(0))),
        (0, 0) => Err(Error::Invalid(format!(
            "directory `{}` holds no `.safetensors` file and no `*.index.json`",
            path.display()
        ))),
        (0, n) => Err(Error::Invalid(format!(
            "directory `{}` holds {n} `.safetensors` files ({}) and no `*.index.json`: pass one file or an index",
            path.display(),
            list(&files).join(", ")
        ))),
        (n, _) => Err(Error::Invalid(format!(
            "directory `{}` holds {n} `*.index.json` files ({}): pass one of them",
            path.display(),
            list(&indexes).join(", ")
        ))),
    }
}

/// Where a checkpoint's tensors are.
pub(super) struct Catalog {
    /// The file named in "not found" messages: the safetensors file or the index.
    pub source: PathBuf,
    /// Whether `source` is an index.
    pub is_index: bool,
    /// The shard files (one for a single file), sorted.
    pub shards: Vec<PathBuf>,
    /// Every tensor name of the checkpoint and the shard holding it.
    pub shard_of: HashMap<String, usize>,
    /// A single file's header, read once while opening.
    single: Option<SafetensorsFile>,
}

/// The dtype, shape and shard of one tensor.
pub(super) struct Meta {
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
                    shards: vec![file],
                    shard_of,
                    single: Some(header),
                })
            }
            Resolved::Index(index) => {
                let entries = read_index(&index)?;
                let dir = index.parent().map(Path::to_path_buf).unwrap_or_default();
                let files: BTreeSet<&str> = entries.iter().map(|(_, s)| s.as_str()).collect();
                let files: Vec<&str> = files.into_iter().collect();
                let shards = files.iter().map(|f| dir.join(f)).collect();
                let shard_of = entries
                    .iter()
                    .map(|(n, s)| (n.clone(), files.binary_search(&s.as_str()).expect("listed shard")))
                    .collect();
                Ok(Catalog { source: index, is_index: true, shards, shard_of, single: None })
            }
        }
    }

    pub fn not_found(&self, name: &str, hint: &str) -> Error {
        let place = if self.is_index {
            format!("the weight_map of `{}`", self.source.display())
        } else {
            format!("`{}`", self.source.display())
        };
        tensor_err(name, format!("not found in {place}{hint}"))
    }

    /// The dtype, shape and shard of each of `names` (all listed in the catalog), read from the
    /// headers of the shards that hold them.
    pub fn metas(&self, names: &[String]) -> Result<HashMap<String, Meta>> {
        let mut by_shard: BTreeMap<usize, Vec<&String>> = BTreeMap::new();
        for n in names {
            by_shard.entry(self.shard_of[n]).or_default().push(n);
        }
        let mut out = HashMap::with_capacity(names.len());
        for (shard, wanted) in by_shard {
            let path = &self.shards[shard];
            let opened;
            let header = match &self.single {
                Some(h) => h,
                None => {
                    opened = SafetensorsFile::open(path)?;
                    &opened
                }
            };
            for n in wanted {
                let Some(info) = header.info(n) else {
                    return Err(tensor_err(
                        n,
                        format!(
                            "listed in the weight_map of `{}` as in `{}`, which does not hold it",
                            self.source.display(),
                            path.display()
                        ),
                    ));
                };
                out.insert(n.clone(), Meta { dtype: info.dtype, shape: info.shape.clone(), shard });
            }
        }
        Ok(out)
    }
}
