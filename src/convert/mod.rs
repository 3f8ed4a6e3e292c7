//! A whole Hugging Face model to an NVFP4 checkpoint, streaming: [`Conversion`].
//!
//! In: a model directory (one `.safetensors` file or shards with an `*.index.json`), a Hugging
//! Face cache snapshot or root, or the index itself; weights in BF16, F16 or F32 (F16 and F32 are
//! rounded to BF16 first, round-to-nearest-even: their bytes are then ModelOpt's applied to that
//! BF16 tensor; a finite F32 beyond the BF16 range, which would round to infinity, is an
//! [`Error::Tensor`] naming the tensor and its first such element), or DeepSeek-V3 / Kimi-K2 FP8 block-scaled weights (E4M3 `weight` with an F32
//! `weight_scale_inv` per 128x128 block, `quantization_config.quant_method` `fp8`), dequantized on
//! the fly to BF16 as DeepSeek's own `weight_dequant` does (`bf16_rne(f32(e4m3) * scale_inv)`;
//! a non-finite `weight_scale_inv`, or an element whose product is beyond the BF16 range, is an
//! [`Error::Tensor`] naming the scale's block or the weight's first such element).
//! Any other quantized input is [`Error::AlreadyQuantized`].
//!
//! Converted by default: the routed experts' gate, up and down projections
//! (`…experts.{e}.{gate_proj,up_proj,down_proj,w1,w3,w2,gate_up_proj,w13}.weight`; stacked 3-D
//! `experts.gate_up_proj` `[E, 2I, H]` / `experts.down_proj` `[E, H, I]` of the model types whose
//! layout is known are split per expert); `include` / `exclude` globs over tensor names change the
//! set. Everything else is copied byte for byte, except that kept FP8 block-scaled weights are
//! written as their BF16 dequantization (the output then has one quantization config, which
//! lists them as ignored). Gate and up of one expert (and `w1`/`w3`, `q/k/v_proj` when included)
//! share one decode scale g, from the amax over both, so stacks that fuse them load it exactly.
//!
//! Out ([`OutputFormat`]): compressed-tensors NVFP4 weight-only (W4A16; `weight_packed`,
//! `weight_scale`, `weight_global_scale` = 1/g, F32 `[1]`; `config.json` gains the
//! `quantization_config` with an `ignore` list naming every Linear left unquantized) or ModelOpt
//! (`weight`, `weight_scale`, `weight_scale_2` = g; `hf_quant_config.json` with `quant_algo`
//! `W4A16_NVFP4`). The codes and scales are recipe v2's (ModelOpt 0.47's bytes) with
//! `g = max(amax) * RN_f32(1/2688)` over the g group's finite elements. Shards keep their file
//! names; the index is rewritten with `metadata.total_size`; every other file is copied.
//!
//! Memory: one shard is written at a time, tensors in input order through a writer thread that
//! holds at most two finished tensors; copied tensors go from the input's mapping (page cache)
//! straight to the file. Anonymous memory so stays under two tensors' BF16 copies (only for F16,
//! F32, FP8 or unaligned input: the tensor and its gate/up partner while their amax is taken) plus
//! four NVFP4 outputs (one being made, two in flight, one kept for reuse: output buffers go back
//! from the writer to be filled again).
//!
//! Safety of the output: everything is written into a new hidden directory beside the target
//! (`.{name}.nvfp4moe-{random}.tmp`), each file synced, then the directory is renamed into place:
//! an interrupted run leaves nothing under the target's name, an error removes the temporary
//! directory. An existing target is [`Error::OutputExists`] unless `force` (a directory is then
//! replaced; a symlink or anything else never is).

mod cpu;
mod plan;
mod run;

#[cfg(feature = "cuda")]
mod cuda;

use std::path::{Path, PathBuf};

use half::bf16;

use crate::error::{Error, Result};
use crate::layout::BLOCK_SIZE;

#[cfg(feature = "cuda")]
pub use cuda::CudaQuantizer;

use plan::{Plan, PlanOptions};

const BLOCK: usize = BLOCK_SIZE;

/// The checkpoint dialect written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum OutputFormat {
    /// compressed-tensors `nvfp4-pack-quantized` W4A16 (what vLLM and SGLang load for weight-only
    /// NVFP4 on Hopper).
    #[default]
    CompressedTensors,
    /// NVIDIA ModelOpt's layout, `quant_algo` `W4A16_NVFP4`.
    ModelOpt,
}

impl OutputFormat {
    /// `compressed-tensors` or `modelopt`.
    pub fn name(self) -> &'static str {
        match self {
            OutputFormat::CompressedTensors => "compressed-tensors",
            OutputFormat::ModelOpt => "modelopt",
        }
    }
}

/// What a conversion does besides its input and output paths.
#[derive(Clone, Debug, Default)]
pub struct ConvertOptions {
    /// The dialect written.
    pub format: OutputFormat,
    /// Globs (`*`, `?`) over tensor names: matching 2-D `.weight` tensors are converted too.
    pub include: Vec<String>,
    /// Globs over tensor names: matching tensors are copied unchanged, whatever else says.
    pub exclude: Vec<String>,
    /// Replace an existing output directory.
    pub force: bool,
    /// Checked between tensors: once it is true the run stops with [`Error::Interrupted`] and
    /// removes its temporary directory (the CLI sets one from SIGINT and SIGTERM).
    pub cancel: Option<&'static std::sync::atomic::AtomicBool>,
}

/// A quantizer of BF16 `[rows, cols]` row-major matrices to NVFP4 with linear block scales, by
/// recipe v2: the CPU one ([`CpuQuantizer`]) and the GPU one (`CudaQuantizer`) write the same
/// bytes.
pub trait Quantizer {
    /// Quantizes `x` with decode scale `g` into `codes` (`rows * cols / 2` bytes) and `scales`
    /// (`rows * cols / 16` bytes).
    ///
    /// # Errors
    /// A bad shape, decode scale or buffer length, or a device error.
    fn quantize(
        &mut self,
        x: &[bf16],
        rows: usize,
        cols: usize,
        g: f32,
        codes: &mut [u8],
        scales: &mut [u8],
    ) -> Result<()>;

    /// Where it runs, for reports (`cpu (16 threads)`, `cuda (GPU 0)`).
    fn describe(&self) -> String;
}

/// The checks every [`Quantizer`] makes first: the shape, the decode scale, and buffer lengths
/// for `rows * cols` elements.
pub(crate) fn check_quantize_args(
    x_len: usize,
    rows: usize,
    cols: usize,
    g: f32,
    codes_len: usize,
    scales_len: usize,
) -> Result<()> {
    crate::host::validate_quantize_shape(rows, cols)?;
    crate::host::validate_decode_scale(g)?;
    let n = rows * cols;
    if x_len != n || codes_len != n / 2 || scales_len != n / BLOCK {
        return Err(Error::InvalidShape(format!(
            "quantize [{rows}, {cols}]: x has {x_len} elements, codes {codes_len} and scales {scales_len} bytes \
             (need {n}, {}, {})",
            n / 2,
            n / BLOCK
        )));
    }
    Ok(())
}

/// Recipe v2 on the CPU over `threads` threads: the bytes of [`crate::reference::quantize`] with
/// linear scales (a table of code thresholds per block scale, built once per call from the
/// reference's own arithmetic, replaces its per-element divisions; see `src/convert/cpu.rs`). The
/// linear layout makes consecutive blocks' codes and scales consecutive, so the tensor is split
/// into runs of blocks, several per thread, and the bytes are the single-threaded ones.
#[derive(Clone, Copy, Debug)]
pub struct CpuQuantizer {
    threads: usize,
}

impl CpuQuantizer {
    /// On every core (`std::thread::available_parallelism`).
    pub fn all_cores() -> Self {
        CpuQuantizer { threads: available_threads() }
    }

    /// On `threads` threads (at least one).
    pub fn with_threads(threads: usize) -> Self {
        CpuQuantizer { threads: threads.max(1) }
    }
}

/// The cores this process may use.
pub fn available_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Blocks per CPU work item for `blocks` blocks on `threads` threads: about four items per thread
/// (so that threads finishing early take over the rest), at least 4096 blocks (64 Ki elements,
/// tens of microseconds of work) so that taking an item costs little.
fn chunk_blocks(blocks: usize, threads: usize) -> usize {
    blocks.div_ceil(threads.max(1) * 4).max(4096)
}

impl Quantizer for CpuQuantizer {
    fn quantize(
        &mut self,
        x: &[bf16],
        rows: usize,
        cols: usize,
        g: f32,
        codes: &mut [u8],
        scales: &mut [u8],
    ) -> Result<()> {
        check_quantize_args(x.len(), rows, cols, g, codes.len(), scales.len())?;
        let n = rows * cols;
        if n == 0 {
            return Ok(());
        }
        let table = cpu::CodeTable::new(g);
        let ch = chunk_blocks(n / BLOCK, self.threads);
        let items: Vec<_> = x
            .chunks(ch * BLOCK)
            .zip(codes.chunks_mut(ch * BLOCK / 2))
            .zip(scales.chunks_mut(ch))
            .map(|((x, c), s)| (x, c, s))
            .collect();
        run_parallel(self.threads, items, |(x, c, s)| -> Result<()> {
            cpu::quantize_blocks(x, &table, c, s);
            Ok(())
        })
    }

    fn describe(&self) -> String {
        format!("cpu ({} threads)", self.threads)
    }
}

/// Runs `work` on every item on up to `threads` threads; stops at, and returns, the first error.
/// (Shared with the CLI's progress-reporting runner; not a stable API.)
#[doc(hidden)]
pub fn run_parallel<T: Send, E: Send>(
    threads: usize,
    items: Vec<T>,
    work: impl Fn(T) -> std::result::Result<(), E> + Sync,
) -> std::result::Result<(), E> {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Mutex;
    let n_threads = threads.clamp(1, items.len().max(1));
    if n_threads == 1 {
        return items.into_iter().try_for_each(work);
    }
    let queue = Mutex::new(items.into_iter());
    let failed = AtomicBool::new(false);
    let first_err: Mutex<Option<E>> = Mutex::new(None);
    let worker = || {
        while !failed.load(Ordering::Relaxed) {
            let next = queue.lock().unwrap_or_else(|p| p.into_inner()).next();
            let Some(item) = next else { break };
            if let Err(e) = work(item) {
                first_err.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e);
                failed.store(true, Ordering::Relaxed);
                break;
            }
        }
    };
    std::thread::scope(|s| {
        for _ in 1..n_threads {
            s.spawn(worker);
        }
        worker();
    });
    match first_err.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// What a finished conversion did.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct ConvertReport {
    /// The dialect written.
    pub format: OutputFormat,
    /// `none` or `fp8-block` (the input's quantization).
    pub input_quant: &'static str,
    /// Matrices quantized to NVFP4 (a stacked 3-D tensor counts once per expert projection).
    pub converted: usize,
    /// Tensors copied unchanged.
    pub copied: usize,
    /// Kept FP8 block-scaled weights written as BF16.
    pub dequantized: usize,
    /// Tensors in the output.
    pub tensors_out: usize,
    /// Tensor bytes read (converted, copied and dequantized).
    pub bytes_in: u64,
    /// Tensor bytes written (the index's `total_size`).
    pub bytes_out: u64,
    /// Of `bytes_in`, those of converted matrices.
    pub bytes_converted_in: u64,
    /// Of `bytes_out`, those of the NVFP4 tensors.
    pub bytes_converted_out: u64,
    /// Output shard files.
    pub shards: usize,
    /// Other files copied (tokenizer, generation config, ...).
    pub files_copied: usize,
    /// Linear modules left unquantized (the `ignore` / `exclude_modules` list).
    pub ignored: Vec<String>,
    /// Wall time of the whole run (planning included), seconds.
    pub seconds: f64,
    /// Of it, time inside the quantizer, seconds.
    pub quantize_seconds: f64,
    /// Peak anonymous resident memory of the process (RssAnon, sampled every 5 ms), bytes; `None`
    /// where `/proc/self/status` has no RssAnon.
    pub peak_rss_anon: Option<u64>,
    /// The largest input tensor, bytes (the memory bound is stated against it).
    pub largest_tensor_bytes: u64,
    /// Where it ran ([`Quantizer::describe`]).
    pub quantizer: String,
}

/// A planned conversion: the input read (headers, configs) and checked, the output path checked.
/// Nothing is written until [`run`](Self::run).
#[derive(Debug)]
pub struct Conversion {
    plan: Plan,
    output: PathBuf,
    options: ConvertOptions,
    started: std::time::Instant,
}

impl Conversion {
    /// Reads and checks everything about the input and the output path; writes nothing.
    ///
    /// # Errors
    /// [`Error::OutputExists`] (an existing output without `force`, or one that is not a
    /// directory), [`Error::AlreadyQuantized`], [`Error::Tensor`] (a converted tensor of the wrong
    /// dtype or shape, a stacked expert tensor of unknown layout, an index that disagrees with
    /// the shards), [`Error::Invalid`] (a malformed file, an output inside or equal to the input),
    /// [`Error::Io`], [`Error::NotRegularFile`], [`Error::UnsafeShardPath`].
    pub fn plan(input: impl AsRef<Path>, output: impl AsRef<Path>, options: &ConvertOptions) -> Result<Conversion> {
        let started = std::time::Instant::now();
        let (input, output) = (input.as_ref(), output.as_ref());
        run::check_output(output, options.force)?;
        let plan = Plan::new(
            input,
            &PlanOptions { include: &options.include, exclude: &options.exclude, format: options.format },
        )?;
        run::check_not_overlapping(&plan.dir, output)?;
        Ok(Conversion { plan, output: output.to_path_buf(), options: options.clone(), started })
    }

    /// Tensor bytes the run reads (the progress total).
    pub fn input_bytes(&self) -> u64 {
        self.plan.input_bytes()
    }

    /// Matrices to quantize.
    pub fn matrices(&self) -> usize {
        self.plan.counts().0
    }

    /// Runs it: `progress` is called with the input bytes each finished tensor consumed.
    ///
    /// # Errors
    /// As [`plan`](Self::plan) where an input changed since; a converted tensor with no finite
    /// non-zero element in its g group ([`Error::Tensor`]); quantizer errors; [`Error::Io`]. On
    /// every error the temporary directory is removed and the target is left as it was.
    pub fn run(self, quantizer: &mut dyn Quantizer, progress: &(dyn Fn(u64) + Sync)) -> Result<ConvertReport> {
        run::execute(&self.plan, &self.output, &self.options, quantizer, progress, self.started)
    }
}

/// Plans and runs a conversion ([`Conversion::plan`], then [`Conversion::run`]).
///
/// # Errors
/// As those two.
pub fn convert(
    input: impl AsRef<Path>,
    output: impl AsRef<Path>,
    options: &ConvertOptions,
    quantizer: &mut dyn Quantizer,
) -> Result<ConvertReport> {
    Conversion::plan(input, output, options)?.run(quantizer, &|_| {})
}

/// The decode scale of a g group whose finite amax is `amax` (ModelOpt's `amax * RN(1/2688)`).
fn group_decode_scale(amax: bf16, what: &str) -> Result<f32> {
    crate::host::weight_decode_scale(&[amax]).map_err(|_| Error::Tensor {
        name: crate::io::shown(what),
        what: "no finite non-zero element in it (or its gate/up group): no decode scale; --exclude it".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::ScaleLayout;

    #[test]
    fn cpu_quantizer_equals_the_reference_on_any_thread_count() {
        let mut r = crate::rng::Rng::new(0x18);
        for (rows, cols) in [(1usize, 16usize), (37, 80), (3000, 64)] {
            let x = r.varied_bf16(rows * cols);
            let g = crate::host::weight_decode_scale(&x).unwrap();
            let want = crate::reference::quantize(&x, rows, cols, g, ScaleLayout::Linear).unwrap();
            for threads in [1, 3] {
                let (mut c, mut s) = (vec![0u8; rows * cols / 2], vec![0u8; rows * cols / 16]);
                CpuQuantizer::with_threads(threads).quantize(&x, rows, cols, g, &mut c, &mut s).unwrap();
                assert!(c == want.codes && s == want.scales, "{rows}x{cols}, {threads} threads");
            }
        }
    }
}
