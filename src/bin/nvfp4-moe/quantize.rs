//! `nvfp4-moe quantize`: one 2-D BF16 (or F32) tensor to NVFP4, written as ModelOpt's `weight`,
//! `weight_scale` and `weight_scale_2`.

use std::time::{Duration, Instant};

use clap::builder::NonEmptyStringValueParser;
use half::bf16;
use nvfp4_moe::io::{self as nio, ModelOptWeight, SourceDtype};
use nvfp4_moe::layout::ScaleLayout;
use nvfp4_moe::{host, reference, Error};
use serde_json::json;
use tracing::{info, warn};

use crate::common::{
    file_ctx, fmt_bytes, fmt_dur, fmt_f32, normalize_prefix, out, print_json, progress, run_chunked, shape_text,
    spinner, tensor_json, threads, CliResult, Fail, Global,
};
use crate::gpu::{backend_label, resolve_backend, Backend};

pub const ABOUT: &str =
    "Quantize one 2-D BF16 (or F32) tensor to NVFP4, written as ModelOpt's weight / weight_scale / weight_scale_2";

pub const AFTER_HELP: &str = "\
Writes, with value = e2m1 x e4m3 x g:
  {P}weight          U8       [N, K/2]   E2M1 codes, element 2j in the low nibble
  {P}weight_scale    F8_E4M3  [N, K/16]  block-16 scales, linear (row-major)
  {P}weight_scale_2  F32      []         g = amax / (6 * 448), amax over the finite elements
A tensor with no finite non-zero element cannot be quantized (g would be 0). Both backends write
the same bytes.

Example:
  nvfp4-moe quantize --input model-00001.safetensors --tensor model.layers.0.mlp.gate_proj.weight \\
      --output gate.safetensors --prefix model.layers.0.mlp.gate_proj --backend cpu";

/// The flags of `quantize`.
#[derive(Debug, clap::Args)]
pub struct QuantizeArgs {
    /// safetensors file holding the tensor
    #[arg(long, value_name = "FILE", value_parser = NonEmptyStringValueParser::new())]
    pub input: String,
    /// The tensor to quantize: 2-D [N, K] with K a multiple of 16, BF16 or F32 (F32 is rounded to
    /// BF16, round-to-nearest-even, first)
    #[arg(long, value_name = "NAME", value_parser = NonEmptyStringValueParser::new())]
    pub tensor: String,
    /// safetensors file to write (replaced if it exists)
    #[arg(long, value_name = "FILE", value_parser = NonEmptyStringValueParser::new())]
    pub output: String,
    /// Name prefix of the written tensors, e.g. model.layers.0.mlp.gate_proj (a final '.' is added
    /// when missing); default: none
    #[arg(long, value_name = "P")]
    pub prefix: Option<String>,
    /// cpu (the reference quantizer, all cores) or cuda (GPU 0); default: cuda when a GPU this
    /// build supports is visible, else cpu
    #[arg(long, value_enum, value_name = "B")]
    pub backend: Option<Backend>,
}

/// Rows per CPU work item: about 4 Mi elements, at most 1024 rows, at least one row.
pub fn chunk_rows(cols: usize) -> usize {
    ((4usize << 20) / cols.max(1)).clamp(1, 1024)
}

/// `(number of non-finite elements, largest finite magnitude)` of `x`, on all cores. Works on the
/// bits (vectorizes): an all-ones exponent is Inf/NaN, and the magnitude bits of finite values
/// order like the values.
pub fn scan_amax(x: &[bf16]) -> (usize, bf16) {
    fn scan(x: &[bf16]) -> (usize, u16) {
        x.iter().fold((0usize, 0u16), |(n, m), v| {
            let mag = v.to_bits() & 0x7FFF;
            let finite = mag < 0x7F80;
            (n + usize::from(!finite), if finite { m.max(mag) } else { m })
        })
    }
    let chunk = x.len().div_ceil(threads()).max(1 << 20);
    let (n, m) = std::thread::scope(|s| {
        let parts: Vec<_> = x.chunks(chunk).map(|c| s.spawn(move || scan(c))).collect();
        parts
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .fold((0, 0), |(n, m), (a, b)| (n + a, m.max(b)))
    });
    (n, bf16::from_bits(m))
}

/// The CPU reference quantizer over row chunks on all cores (valid for the linear layout: the
/// codes and scales of consecutive row ranges are consecutive).
fn quantize_cpu(x: &[bf16], rows: usize, cols: usize, g: f32) -> nvfp4_moe::Result<(Vec<u8>, Vec<u8>)> {
    let mut codes = vec![0u8; rows * cols / 2];
    let mut scales = vec![0u8; rows * cols / 16];
    let ch = chunk_rows(cols);
    let items: Vec<_> = x
        .chunks(ch * cols)
        .zip(codes.chunks_mut(ch * cols / 2))
        .zip(scales.chunks_mut(ch * cols / 16))
        .map(|((x, c), s)| (x.len() / cols, (x, c, s)))
        .collect();
    let pb = progress("cpu quantize", rows as u64, "rows");
    run_chunked(&pb, items, |(x, c, s): (&[bf16], &mut [u8], &mut [u8])| {
        let h = reference::quantize(x, x.len() / cols, cols, g, ScaleLayout::Linear)?;
        if h.codes.len() != c.len() || h.scales.len() != s.len() {
            return Err(Error::Invalid(format!(
                "reference quantizer returned {} code and {} scale bytes for {} rows, expected {} and {}",
                h.codes.len(),
                h.scales.len(),
                x.len() / cols,
                c.len(),
                s.len()
            )));
        }
        c.copy_from_slice(&h.codes);
        s.copy_from_slice(&h.scales);
        Ok(())
    })?;
    pb.finish_and_clear();
    Ok((codes, scales))
}

/// The GPU quantizer on GPU 0, logging its phases. Returns (codes, scales, kernel time).
#[cfg(feature = "cuda")]
fn quantize_cuda(x: &[bf16], rows: usize, cols: usize, g: f32) -> nvfp4_moe::Result<(Vec<u8>, Vec<u8>, Duration)> {
    if rows == 0 {
        return Ok((Vec::new(), Vec::new(), Duration::ZERO));
    }
    let ctx = cudarc::driver::CudaContext::new(0)?;
    let stream = ctx.default_stream();
    let pb = spinner("cuda quantize: upload");
    let t = Instant::now();
    let xd = stream.clone_htod(x)?;
    stream.synchronize()?;
    phase("upload", x.len() * 2, t);
    pb.set_message("cuda quantize: kernel");
    let t = Instant::now();
    let q = nvfp4_moe::quantize_nvfp4(&stream, &xd, rows, cols, g, ScaleLayout::Linear)?;
    stream.synchronize()?;
    let kernel = t.elapsed();
    phase("kernel", x.len() * 2 + x.len() / 2 + x.len() / 16, t);
    pb.set_message("cuda quantize: download");
    let t = Instant::now();
    let h = q.to_host(&stream)?;
    phase("download", h.codes.len() + h.scales.len(), t);
    pb.finish_and_clear();
    Ok((h.codes, h.scales, kernel))
}

#[cfg(not(feature = "cuda"))]
fn quantize_cuda(_: &[bf16], _: usize, _: usize, _: f32) -> CliResult<(Vec<u8>, Vec<u8>, Duration)> {
    unreachable!("resolve_backend never picks cuda without the `cuda` feature")
}

/// Logs one GPU phase: bytes moved, time and rate.
pub fn phase(name: &str, bytes: usize, t: Instant) {
    let d = t.elapsed();
    let rate = bytes as f64 / d.as_secs_f64().max(1e-9) / 1e9;
    info!("  cuda {name:<8} {:>10} in {} ({rate:.1} GB/s)", fmt_bytes(bytes), fmt_dur(d));
}

pub fn run(args: &QuantizeArgs, global: Global) -> CliResult {
    let (input, name, output) = (args.input.as_str(), args.tensor.as_str(), args.output.as_str());
    let prefix = normalize_prefix(args.prefix.as_deref());
    let t_all = Instant::now();

    let pb = spinner(&format!("reading `{name}` from {input}"));
    let (x, rows, cols, src) = nio::read_matrix_bf16(input, name).map_err(file_ctx(input))?;
    pb.finish_and_clear();
    let t_read = t_all.elapsed();
    let tensor_err = |e: Error| Fail::Run(format!("tensor `{name}` [{rows}, {cols}]: {e}"));
    info!("read `{name}` [{rows}, {cols}] {} from {input} ({})", src.name(), fmt_dur(t_read));
    if src == SourceDtype::F32 {
        info!("note: `{name}` is F32: rounded to BF16 (round-to-nearest-even) before quantizing");
    }
    host::validate_quantize_shape(rows, cols).map_err(tensor_err)?;
    let (non_finite, amax) = scan_amax(&x);
    if non_finite > 0 {
        warn!("`{name}` holds {non_finite} non-finite element(s): Inf saturates (scale 448, code ±6), a NaN makes its block's scale NaN (0x7F)");
    }
    if amax.to_f32() == 0.0 {
        return Err(tensor_err(Error::Invalid(format!(
            "cannot derive a decode scale: none of its {} elements is finite and non-zero",
            x.len()
        ))));
    }
    // The reference's g of a tensor depends on its finite amax alone: a one-element tensor holding
    // that amax gives the same g without a second pass over the whole tensor.
    let g = host::weight_decode_scale(&[amax]).map_err(tensor_err)?;
    let amax = amax.to_f32();

    let (backend, gpu) = resolve_backend(args.backend)?;
    let t = Instant::now();
    let (codes, scales, kernel) = match backend {
        Backend::Cpu => {
            let (c, s) = quantize_cpu(&x, rows, cols, g)?;
            (c, s, None)
        }
        Backend::Cuda => {
            let (c, s, k) = quantize_cuda(&x, rows, cols, g)?;
            (c, s, Some(k))
        }
    };
    let t_q = t.elapsed();
    drop(x);
    let label = backend_label(backend, gpu.as_deref());
    let kernel_text = kernel.map(|k| format!(", kernel {}", fmt_dur(k))).unwrap_or_default();
    info!("quantized on {label} in {}{kernel_text}", fmt_dur(t_q));

    let t = Instant::now();
    let w = ModelOptWeight { codes, scales, decode_scale: g, rows, cols };
    let pb = spinner(&format!("writing {output}"));
    nio::write_modelopt(output, &prefix, &w)?;
    pb.finish_and_clear();
    let t_write = t.elapsed();
    let bytes = std::fs::metadata(output).map(|m| m.len() as usize).unwrap_or(w.codes.len() + w.scales.len() + 4);
    let tensors = [
        (format!("{prefix}weight"), "U8", vec![rows, cols / 2]),
        (format!("{prefix}weight_scale"), "F8_E4M3", vec![rows, cols / 16]),
        (format!("{prefix}weight_scale_2"), "F32", vec![]),
    ];
    info!("wrote {output} in {}; total {}", fmt_dur(t_write), fmt_dur(t_all.elapsed()));

    if global.json {
        print_json(&json!({
            "command": "quantize",
            "input": input,
            "tensor": name,
            "source_dtype": src.name(),
            "rows": rows,
            "cols": cols,
            "non_finite": non_finite,
            "amax": amax,
            "decode_scale": g,
            "backend": backend_name(backend),
            "gpu": gpu,
            "output": output,
            "bytes": bytes,
            "tensors": tensors.iter().map(|(n, d, s)| tensor_json(n, d, s)).collect::<Vec<_>>(),
            "seconds": {
                "read": t_read.as_secs_f64(),
                "quantize": t_q.as_secs_f64(),
                "kernel": kernel.map(|k| k.as_secs_f64()),
                "write": t_write.as_secs_f64(),
                "total": t_all.elapsed().as_secs_f64(),
            },
        }));
    } else {
        out!(
            "quantized `{name}` {} [{rows}, {cols}] on {label}: decode scale g = {} (weight_scale_2 = amax {} / (6 * 448)), linear block-16 scales",
            src.name(),
            fmt_f32(g),
            fmt_f32(amax)
        );
        let list: Vec<String> = tensors.iter().map(|(n, d, s)| format!("{n} {d} {}", shape_text(s))).collect();
        out!("wrote {output} ({}): {}", fmt_bytes(bytes), list.join(", "));
    }
    Ok(())
}

/// `cpu` or `cuda`, as `--backend` spells it.
pub fn backend_name(b: Backend) -> &'static str {
    match b {
        Backend::Cpu => "cpu",
        Backend::Cuda => "cuda",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amax_scan_matches_a_plain_scan_and_gives_the_reference_g() {
        let mut r = nvfp4_moe::testing::test_rng();
        for n in [1usize, 17, 1000, (1 << 20) + 3, 3 << 20] {
            let mut x = r.varied_bf16(n);
            for _ in 0..r.range(0, 4) {
                let i = r.range(0, n);
                x[i] =
                    [bf16::NAN, bf16::INFINITY, bf16::NEG_INFINITY, bf16::from_bits(0xFF81), bf16::from_bits(0x0001)]
                        [r.range(0, 5)];
            }
            let want_nf = x.iter().filter(|v| !v.is_finite()).count();
            let want_amax = x.iter().map(|v| v.to_f32()).filter(|v| v.is_finite()).fold(0f32, |m, v| m.max(v.abs()));
            let (nf, amax) = scan_amax(&x);
            assert_eq!((nf, amax.to_f32()), (want_nf, want_amax), "n = {n}");
            if want_amax > 0.0 {
                let g = host::weight_decode_scale(&x).unwrap();
                assert_eq!(host::weight_decode_scale(&[amax]).unwrap().to_bits(), g.to_bits(), "n = {n}");
            }
        }
        assert_eq!(scan_amax(&[]), (0, bf16::ZERO));
        assert_eq!(scan_amax(&[bf16::NAN, bf16::from_f32(-0.0)]), (1, bf16::ZERO));
    }

    #[test]
    fn chunks() {
        assert_eq!(chunk_rows(16), 1024);
        assert_eq!(chunk_rows(7168), 585);
        assert_eq!(chunk_rows(1 << 24), 1);
    }
}
