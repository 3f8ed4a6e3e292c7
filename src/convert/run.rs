//! Executing a [`Plan`]: the output directory (temporary, renamed into place), each shard streamed
//! through a writer thread, the index, the configs and the other files.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, sync_channel, Receiver};
use std::sync::Arc;
use std::time::Instant;

use half::{bf16, f16};
use safetensors::tensor::Dtype;
use serde_json::{json, Value};

use super::plan::{Item, OutTensor, Plan, Source};
use super::{
    available_threads, group_decode_scale, run_parallel, ConvertOptions, ConvertReport, OutputFormat, Quantizer, BLOCK,
};
use crate::error::{Error, Result};
use crate::format::e4m3_decode;
use crate::io::{
    beyond_bf16_err, element_at, f32_to_bf16, io_err, shown, shown_path, sync_dir, tensor_err, unpredictable_u64,
    FileKind, SafetensorsFile,
};

/// Refuses an output path that exists, unless it is a directory and `force` is given.
pub(super) fn check_output(output: &Path, force: bool) -> Result<()> {
    if output.file_name().is_none() {
        return Err(Error::Invalid(format!("output `{}` does not end in a directory name", shown_path(output))));
    }
    match std::fs::symlink_metadata(output) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(io_err("inspect", output, e)),
        Ok(md) if md.file_type().is_dir() && force => Ok(()),
        Ok(md) if md.file_type().is_dir() => Err(Error::OutputExists {
            path: output.to_path_buf(),
            what: "a directory; pass --force to replace it".into(),
        }),
        Ok(md) => Err(Error::OutputExists {
            path: output.to_path_buf(),
            what: format!("{}, not a directory: never replaced, even with --force", FileKind::of(&md.file_type())),
        }),
    }
}

/// Refuses an output that is the input's directory or holds it (with `force` the input would be
/// deleted).
pub(super) fn check_not_overlapping(input_dir: &Path, output: &Path) -> Result<()> {
    let Ok(input) = std::fs::canonicalize(input_dir) else { return Ok(()) };
    let parent = match output.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let parent = std::fs::canonicalize(&parent).map_err(|e| io_err("find the directory of", output, e))?;
    let target = parent.join(output.file_name().expect("checked"));
    if input.starts_with(&target) {
        return Err(Error::Invalid(format!(
            "output `{}` is the input model's directory or holds it: write elsewhere",
            shown_path(output)
        )));
    }
    Ok(())
}

/// The temporary output directory beside the target, removed on drop unless committed.
struct OutputDir {
    target: PathBuf,
    temp: PathBuf,
    parent: PathBuf,
    armed: bool,
}

impl OutputDir {
    fn create(target: &Path) -> Result<OutputDir> {
        let parent = match target.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let name = target.file_name().expect("checked").to_string_lossy();
        // Short enough for any target name: at most 120 bytes of it are kept.
        let stem: String = name.chars().take(120).collect();
        for _ in 0..16 {
            let temp = parent.join(format!(".{stem}.nvfp4moe-{:016x}.tmp", unpredictable_u64()));
            match std::fs::create_dir(&temp) {
                Ok(()) => return Ok(OutputDir { target: target.to_path_buf(), temp, parent, armed: true }),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(io_err("create a temporary directory beside", target, e)),
            }
        }
        Err(Error::Invalid(format!("cannot create a temporary directory beside `{}`", shown_path(target))))
    }

    /// A new file inside (never an existing one).
    fn create_file(&self, rel: &Path) -> Result<File> {
        let path = self.temp.join(rel);
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| io_err("create", dir, e))?;
        }
        let mut o = OpenOptions::new();
        o.write(true).create_new(true);
        o.open(&path).map_err(|e| io_err("create", &path, e))
    }

    fn write_file(&self, rel: &Path, bytes: &[u8]) -> Result<()> {
        let f = self.create_file(rel)?;
        let path = self.temp.join(rel);
        (&f).write_all(bytes).map_err(|e| io_err("write", &path, e))?;
        f.sync_all().map_err(|e| io_err("sync", &path, e))
    }

    /// Renames the finished directory into place (an existing target directory, allowed by
    /// `force`, is moved aside first and removed after).
    fn commit(mut self) -> Result<()> {
        sync_dir(&self.temp).map_err(|e| io_err("sync", &self.temp, e))?;
        let old = match std::fs::symlink_metadata(&self.target) {
            Ok(md) if md.file_type().is_dir() => {
                let name =
                    self.target.file_name().expect("checked").to_string_lossy().chars().take(120).collect::<String>();
                let old = self.parent.join(format!(".{name}.nvfp4moe-{:016x}.old", unpredictable_u64()));
                std::fs::rename(&self.target, &old).map_err(|e| io_err("move aside", &self.target, e))?;
                Some(old)
            }
            Ok(md) => {
                return Err(Error::OutputExists {
                    path: self.target.clone(),
                    what: format!("{} appeared there during the run", FileKind::of(&md.file_type())),
                })
            }
            Err(_) => None,
        };
        std::fs::rename(&self.temp, &self.target).map_err(|e| io_err("rename into place", &self.target, e))?;
        self.armed = false;
        if let Some(old) = old {
            std::fs::remove_dir_all(&old).map_err(|e| io_err("remove the replaced", &old, e))?;
        }
        sync_dir(&self.parent).map_err(|e| io_err("sync the directory of", &self.target, e))
    }
}

impl Drop for OutputDir {
    fn drop(&mut self) {
        if self.armed {
            let _ = std::fs::remove_dir_all(&self.temp);
        }
    }
}

/// Samples the process's RssAnon every 5 ms on a thread and keeps the peak.
pub(crate) struct RssAnonPeak {
    stop: Arc<AtomicBool>,
    peak: Arc<AtomicU64>,
    handle: Option<std::thread::JoinHandle<()>>,
}

/// The process's anonymous resident memory in bytes (`RssAnon` of `/proc/self/status`).
pub(crate) fn rss_anon_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("RssAnon:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

impl RssAnonPeak {
    pub fn start() -> RssAnonPeak {
        let stop = Arc::new(AtomicBool::new(false));
        let peak = Arc::new(AtomicU64::new(rss_anon_bytes().unwrap_or(0)));
        let handle = rss_anon_bytes().is_some().then(|| {
            let (stop, peak) = (stop.clone(), peak.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if let Some(v) = rss_anon_bytes() {
                        peak.fetch_max(v, Ordering::Relaxed);
                    }
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
            })
        });
        RssAnonPeak { stop, peak, handle }
    }

    pub fn finish(mut self) -> Option<u64> {
        self.stop.store(true, Ordering::Relaxed);
        let h = self.handle.take()?;
        let _ = h.join();
        if let Some(v) = rss_anon_bytes() {
            self.peak.fetch_max(v, Ordering::Relaxed);
        }
        Some(self.peak.load(Ordering::Relaxed))
    }
}

impl Drop for RssAnonPeak {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Bytes for the writer thread: borrowed from an input mapping or owned.
enum Chunk<'a> {
    Borrowed(&'a [u8]),
    Owned(Vec<u8>),
    /// An output buffer ([`Spare::take`]), handed back once written.
    Reused(Vec<u8>),
}

impl Chunk<'_> {
    fn bytes(&self) -> &[u8] {
        match self {
            Chunk::Borrowed(b) => b,
            Chunk::Owned(v) | Chunk::Reused(v) => v,
        }
    }
}

/// Codes and scales buffers the writer has finished with, for the next tensors: no allocation,
/// page faults, zeroing or unmapping per tensor. Keeps at most [`Spare::KEEP`] of them (one
/// tensor's codes and scales) besides those in flight.
struct Spare {
    back: Receiver<Vec<u8>>,
    kept: Vec<Vec<u8>>,
}

impl Spare {
    const KEEP: usize = 2;

    /// A buffer of `len` bytes: the smallest kept one that holds them, else a new one. Its
    /// contents are stale: the quantizer overwrites every byte.
    fn take(&mut self, len: usize) -> Vec<u8> {
        self.kept.extend(self.back.try_iter());
        let excess = self.kept.len().saturating_sub(Self::KEEP);
        self.kept.drain(..excess);
        let fit =
            (0..self.kept.len()).filter(|&i| self.kept[i].capacity() >= len).min_by_key(|&i| self.kept[i].capacity());
        let mut v = fit.map_or_else(Vec::new, |i| self.kept.swap_remove(i));
        v.resize(len, 0);
        v
    }
}

/// The header of a safetensors file holding `tensors` in this order, padded to 8 bytes.
fn header(tensors: &[OutTensor]) -> Result<Vec<u8>> {
    let mut map = serde_json::Map::new();
    map.insert("__metadata__".into(), json!({"format": "pt"}));
    let mut offset = 0usize;
    for t in tensors {
        let len = t.len();
        map.insert(
            t.name.clone(),
            json!({"dtype": t.dtype.to_string(), "shape": t.shape, "data_offsets": [offset, offset + len]}),
        );
        offset += len;
    }
    let mut h = serde_json::to_vec(&Value::Object(map))?;
    h.resize(h.len().next_multiple_of(8), b' ');
    Ok(h)
}

/// The BF16 values of `src` (borrowed from the mapping when the input is aligned little-endian
/// BF16, else converted on `threads` threads).
fn load_bf16<'a>(files: &'a [SafetensorsFile], src: &Source, threads: usize) -> Result<Cow<'a, [bf16]>> {
    let bytes = files[src.shard].bytes(&src.name)?;
    let elem = src.dtype.bitsize() / 8;
    let n = src.rows * src.cols;
    let begin = src.first_row * src.cols * elem;
    let bytes = bytes
        .get(begin..begin + n * elem)
        .ok_or_else(|| Error::Tensor { name: shown(&src.name), what: "shorter than its header says".into() })?;
    if src.dtype == Dtype::BF16 && cfg!(target_endian = "little") && (bytes.as_ptr() as usize).is_multiple_of(2) {
        // SAFETY: `bf16` is `repr(transparent)` over `u16`; the pointer is 2-byte aligned (checked),
        // the length is whole elements, and the bytes live as long as the mapping borrowed for 'a.
        let x = unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<bf16>(), n) };
        return Ok(Cow::Borrowed(x));
    }
    let mut out = vec![bf16::ZERO; n];
    let cols = src.cols.max(1);
    let rows_per = (1usize << 20).div_ceil(cols).max(1);
    match src.dtype {
        Dtype::BF16 | Dtype::F16 | Dtype::F32 => {
            let items: Vec<_> =
                out.chunks_mut(rows_per * cols).zip(bytes.chunks(rows_per * cols * elem)).enumerate().collect();
            let dtype = src.dtype;
            // The first (lowest) index of a finite F32 beyond the BF16 range, over all chunks
            // whatever the order they run in, so the error names the same element every time.
            let first_beyond = AtomicUsize::new(usize::MAX);
            run_parallel(threads, items, |(i, (o, b))| -> Result<()> {
                for (j, (v, e)) in o.iter_mut().zip(b.chunks_exact(elem)).enumerate() {
                    *v = match dtype {
                        Dtype::BF16 => bf16::from_le_bytes([e[0], e[1]]),
                        // F16 -> f32 is exact; one rounding to BF16 (nearest-even).
                        Dtype::F16 => bf16::from_f32(f16::from_le_bytes([e[0], e[1]]).to_f32()),
                        _ => match f32_to_bf16(f32::from_le_bytes([e[0], e[1], e[2], e[3]])) {
                            Some(b) => b,
                            None => {
                                first_beyond.fetch_min(i * rows_per * cols + j, Ordering::Relaxed);
                                break;
                            }
                        },
                    };
                }
                Ok(())
            })?;
            let k = first_beyond.into_inner();
            if k != usize::MAX {
                let e = &bytes[k * elem..(k + 1) * elem];
                let x = f32::from_le_bytes([e[0], e[1], e[2], e[3]]);
                // (The index is tensor-relative: without the header's shape, rows up to this piece's end.)
                let shape = files[src.shard]
                    .info(&src.name)
                    .map_or_else(|| vec![src.first_row + src.rows, src.cols], |t| t.shape.clone());
                return Err(beyond_bf16_err(&src.name, &shape, src.first_row * src.cols + k, x));
            }
        }
        Dtype::F8_E4M3 => {
            let fp8 = src
                .fp8
                .as_ref()
                .ok_or_else(|| Error::Tensor { name: shown(&src.name), what: "F8_E4M3 without block scales".into() })?;
            let raw = files[fp8.shard].read(&fp8.name)?;
            let scales: Vec<f32> = raw.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            // A non-finite block scale would turn its whole block into Inf or NaN: refused, named.
            if let Some((j, s)) = scales.iter().enumerate().find(|(_, s)| !s.is_finite()) {
                return Err(tensor_err(
                    &fp8.name,
                    format!("block scale {} (index {j}) is {s}: it must be finite", element_at(&fp8.grid, j)),
                ));
            }
            let [br, bc] = fp8.block;
            let grid_cols = fp8.grid[1];
            let items: Vec<_> =
                out.chunks_mut(rows_per * cols).zip(bytes.chunks(rows_per * cols)).enumerate().collect();
            // The first (lowest) index whose dequantized value is beyond the BF16 range, as for F32.
            let first_beyond = AtomicUsize::new(usize::MAX);
            run_parallel(threads, items, |(i, (o, b))| -> Result<()> {
                let row0 = src.first_row + i * rows_per;
                for (r, (orow, brow)) in o.chunks_mut(cols).zip(b.chunks(cols)).enumerate() {
                    let srow = &scales[((row0 + r) / br) * grid_cols..][..grid_cols];
                    for (c, (v, &code)) in orow.iter_mut().zip(brow).enumerate() {
                        // DeepSeek's weight_dequant: f32(e4m3) * scale_inv in f32, stored as BF16.
                        // E4M3 has no infinity and the scales are finite: an infinite result
                        // (in F32 or after the rounding to BF16) is an overflow.
                        let x = bf16::from_f32(e4m3_decode(code) * srow[c / bc]);
                        if x.is_infinite() {
                            first_beyond.fetch_min(i * rows_per * cols + r * cols + c, Ordering::Relaxed);
                            return Ok(());
                        }
                        *v = x;
                    }
                }
                Ok(())
            })?;
            let k = first_beyond.into_inner();
            if k != usize::MAX {
                let (row, col) = (src.first_row + k / cols, k % cols);
                let code = bytes[k];
                let s = scales[(row / br) * grid_cols + col / bc];
                let shape = files[src.shard]
                    .info(&src.name)
                    .map_or_else(|| vec![src.first_row + src.rows, src.cols], |t| t.shape.clone());
                let index = src.first_row * src.cols + k;
                return Err(tensor_err(
                    &src.name,
                    format!(
                        "element {} (index {index}) dequantizes to {:e} (E4M3 {code:#04x} x weight_scale_inv {s:e}), \
                         beyond the BF16 range (largest finite BF16: {:e}): it would round to infinity",
                        element_at(&shape, index),
                        e4m3_decode(code) * s,
                        bf16::MAX.to_f32()
                    ),
                ));
            }
        }
        other => {
            return Err(Error::Tensor {
                name: shown(&src.name),
                what: format!("dtype is {other}, expected BF16, F16, F32 or F8_E4M3"),
            })
        }
    }
    Ok(Cow::Owned(out))
}

/// The largest finite |x| (as BF16: exact), on `threads` threads, on the bits: an all-ones
/// exponent is Inf/NaN, and the magnitude bits of finite values order like the values.
fn finite_amax(x: &[bf16], threads: usize) -> bf16 {
    let chunk = x.len().div_ceil(threads.max(1)).max(1 << 18);
    let m = std::thread::scope(|s| {
        let parts: Vec<_> = x.chunks(chunk).skip(1).map(|c| s.spawn(move || super::cpu::finite_amax_bits(c))).collect();
        let first = x.chunks(chunk).next().map_or(0, super::cpu::finite_amax_bits);
        parts.into_iter().map(|h| h.join().unwrap_or(0x7FFF)).fold(first, u16::max)
    });
    bf16::from_bits(m)
}

/// compressed-tensors' `quantization_config` for NVFP4 W4A16 with `ignore`.
fn compressed_tensors_config(ignore: &[String]) -> Value {
    json!({
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "float",
                    "strategy": "tensor_group",
                    "group_size": 16,
                    "symmetric": true,
                    "dynamic": false,
                    "scale_dtype": "torch.float8_e4m3fn"
                },
                "input_activations": null,
                "output_activations": null,
                "format": "nvfp4-pack-quantized"
            }
        },
        "ignore": ignore,
        "kv_cache_scheme": null,
        "global_compression_ratio": null,
        "sparsity_config": {},
        "transform_config": {}
    })
}

/// ModelOpt's `quantization` object for W4A16 NVFP4 with `exclude_modules`.
fn modelopt_quantization(ignore: &[String]) -> Value {
    json!({
        "quant_algo": "W4A16_NVFP4",
        "group_size": 16,
        "kv_cache_quant_algo": null,
        "exclude_modules": ignore
    })
}

pub(super) fn execute<'a>(
    plan: &'a Plan,
    output: &Path,
    options: &ConvertOptions,
    quantizer: &mut dyn Quantizer,
    progress: &(dyn Fn(u64) + Sync),
    started: Instant,
) -> Result<ConvertReport> {
    let rss = RssAnonPeak::start();
    let format = options.format;
    let threads = available_threads();
    let out = OutputDir::create(output)?;
    let mut unit_g: HashMap<usize, f32> = HashMap::new();
    let mut quantize_seconds = 0f64;
    let (mut bytes_converted_in, mut bytes_converted_out) = (0u64, 0u64);
    let files: &'a [SafetensorsFile] = &plan.files;
    let (back, returned) = channel::<Vec<u8>>();
    let mut spare = Spare { back: returned, kept: Vec::new() };

    for (s, shard) in plan.shards.iter().enumerate() {
        let outs: Vec<OutTensor> = shard.items.iter().flat_map(|i| i.outputs(format)).collect();
        let head = header(&outs)?;
        let rel = PathBuf::from(&shard.file_name);
        let file = out.create_file(&rel)?;
        let path = out.temp.join(&rel);
        let expected: Vec<(String, usize)> = outs.iter().map(|t| (t.name.clone(), t.len())).collect();
        std::thread::scope(|scope| -> Result<()> {
            // Two finished tensors in flight at most: bounded memory, and quantizing the next
            // tensor overlaps writing the last.
            let (tx, rx) = sync_channel::<Chunk<'a>>(2);
            let path_w = path.clone();
            let back = back.clone();
            let writer = scope.spawn(move || -> Result<()> {
                let io = |e: std::io::Error| io_err("write", &path_w, e);
                // Small tensors are gathered into larger writes; anything at least this large is
                // written straight from its own buffer (no copy into this one).
                let mut w = BufWriter::with_capacity(256 << 10, &file);
                w.write_all(&(head.len() as u64).to_le_bytes()).map_err(io)?;
                w.write_all(&head).map_err(io)?;
                let mut next = expected.iter();
                for chunk in rx {
                    let Some((name, len)) = next.next() else {
                        return Err(Error::Invalid(format!("`{}`: more tensors than planned", shown_path(&path_w))));
                    };
                    if chunk.bytes().len() != *len {
                        return Err(Error::Tensor {
                            name: shown(name),
                            what: format!("produced {} bytes, the header says {len}", chunk.bytes().len()),
                        });
                    }
                    w.write_all(chunk.bytes()).map_err(io)?;
                    if let Chunk::Reused(v) = chunk {
                        // The producer may have finished: then the buffer is simply dropped.
                        let _ = back.send(v);
                    }
                }
                if let Some((name, _)) = next.next() {
                    return Err(Error::Tensor { name: shown(name), what: "never produced".into() });
                }
                w.flush().map_err(io)?;
                drop(w);
                file.sync_all().map_err(|e| io_err("sync", &path_w, e))
            });
            let produced = (|| -> Result<()> {
                for (i, item) in shard.items.iter().enumerate() {
                    if options.cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
                        return Err(Error::Interrupted);
                    }
                    let send = |c: Chunk<'a>| tx.send(c).is_ok();
                    let sent = match item {
                        Item::Copy { shard: from, name, .. } => send(Chunk::Borrowed(files[*from].bytes(name)?)),
                        Item::Dequantize { source, .. } => {
                            let x = load_bf16(files, source, threads)?;
                            send(Chunk::Owned(x.iter().flat_map(|v| v.to_le_bytes()).collect()))
                        }
                        Item::Quantize(job) => {
                            let x = load_bf16(files, &job.source, threads)?;
                            let unit = job.unit;
                            let g = match unit_g.get(&unit) {
                                Some(&g) => g,
                                None => {
                                    let mut amax = finite_amax(&x, threads);
                                    for &(ms, mi) in plan.unit_members(unit) {
                                        if (ms, mi) == (s, i) {
                                            continue;
                                        }
                                        let Item::Quantize(other) = plan.item(ms, mi) else { continue };
                                        let y = load_bf16(files, &other.source, threads)?;
                                        let a = finite_amax(&y, threads);
                                        if a.to_bits() > amax.to_bits() {
                                            amax = a;
                                        }
                                    }
                                    let g = group_decode_scale(amax, &job.module)?;
                                    unit_g.insert(unit, g);
                                    g
                                }
                            };
                            let (n, k) = (job.source.rows, job.source.cols);
                            let mut codes = spare.take(n * k / 2);
                            let mut scales = spare.take(n * k / BLOCK);
                            let t = Instant::now();
                            quantizer.quantize(&x, n, k, g, &mut codes, &mut scales)?;
                            quantize_seconds += t.elapsed().as_secs_f64();
                            drop(x);
                            bytes_converted_in += job.source.input_bytes();
                            bytes_converted_out += (codes.len() + scales.len() + 4) as u64;
                            let per_tensor = match format {
                                OutputFormat::CompressedTensors => 1.0f32 / g,
                                OutputFormat::ModelOpt => g,
                            };
                            send(Chunk::Reused(codes))
                                && send(Chunk::Reused(scales))
                                && send(Chunk::Owned(per_tensor.to_le_bytes().to_vec()))
                        }
                    };
                    if !sent {
                        // The writer stopped: its error is the one to report.
                        return Ok(());
                    }
                    progress(item.input_bytes());
                }
                Ok(())
            })();
            drop(tx);
            let written = writer.join().unwrap_or_else(|_| Err(Error::Invalid("the writer thread panicked".into())));
            produced.and(written)
        })?;
    }

    if options.cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
        return Err(Error::Interrupted);
    }
    // The index, the configs and everything else.
    let weight_map = plan.weight_map(format);
    let total_size = plan.output_tensor_bytes(format);
    if let Some(index) = &plan.index {
        let mut metadata = serde_json::Map::new();
        if let Ok(bytes) = crate::io::read_small_file(index, 256 << 20, "checkpoint index") {
            if let Ok(v) = serde_json::from_slice::<Value>(&bytes) {
                if let Some(m) = v.get("metadata").and_then(Value::as_object) {
                    metadata = m.clone();
                }
            }
        }
        metadata.insert("total_size".into(), json!(total_size));
        let doc = json!({"metadata": metadata, "weight_map": weight_map});
        let name = index.file_name().map(PathBuf::from).unwrap_or_else(|| "model.safetensors.index.json".into());
        out.write_file(&name, &pretty(&doc)?)?;
    }
    let mut config = plan.config.clone().unwrap_or_else(|| json!({}));
    if let Some(c) = config.as_object_mut() {
        c.remove("compression_config");
        if let Some(t) = c.get_mut("text_config").and_then(Value::as_object_mut) {
            t.remove("quantization_config");
        }
        match format {
            OutputFormat::CompressedTensors => {
                c.insert("quantization_config".into(), compressed_tensors_config(&plan.ignore));
            }
            OutputFormat::ModelOpt => {
                let mut q = modelopt_quantization(&plan.ignore);
                q.as_object_mut().expect("object").insert("quant_method".into(), json!("modelopt"));
                c.insert("quantization_config".into(), q);
            }
        }
        if plan.input_quant != super::plan::InputQuant::None {
            // Every weight the output holds unquantized is BF16 now.
            c.insert("torch_dtype".into(), json!("bfloat16"));
        }
    }
    out.write_file(Path::new("config.json"), &pretty(&config)?)?;
    if format == OutputFormat::ModelOpt {
        let doc = json!({
            "producer": {"name": "nvfp4-moe", "version": env!("CARGO_PKG_VERSION")},
            "quantization": modelopt_quantization(&plan.ignore),
        });
        out.write_file(Path::new("hf_quant_config.json"), &pretty(&doc)?)?;
    }
    for rel in &plan.other_files {
        let from = plan.dir.join(rel);
        let mut src = crate::io::open_regular(&from)?;
        let mut dst = out.create_file(rel)?;
        std::io::copy(&mut src, &mut dst).map_err(|e| io_err("copy", &from, e))?;
        dst.sync_all().map_err(|e| io_err("sync", &out.temp.join(rel), e))?;
    }
    out.commit()?;

    let (converted, copied, dequantized) = plan.counts();
    let largest = plan.items().map(Item::input_bytes).max().unwrap_or(0);
    Ok(ConvertReport {
        format,
        input_quant: match plan.input_quant {
            super::plan::InputQuant::None => "none",
            super::plan::InputQuant::Fp8Block { .. } => "fp8-block",
        },
        converted,
        copied,
        dequantized,
        tensors_out: weight_map.len(),
        bytes_in: plan.input_bytes(),
        bytes_out: total_size,
        bytes_converted_in,
        bytes_converted_out,
        shards: plan.shards.len(),
        files_copied: plan.other_files.len(),
        ignored: plan.ignore.clone(),
        seconds: started.elapsed().as_secs_f64(),
        quantize_seconds,
        peak_rss_anon: rss.finish(),
        largest_tensor_bytes: largest,
        quantizer: quantizer.describe(),
    })
}

/// JSON as the Hugging Face tools write it: pretty, two-space indent, a final newline.
fn pretty(v: &Value) -> Result<Vec<u8>> {
    let mut s = serde_json::to_vec_pretty(v)?;
    s.push(b'\n');
    Ok(s)
}
