//! `nvfp4-moe dequantize`: a ModelOpt NVFP4 weight back to one BF16 tensor.

use std::time::{Duration, Instant};

use clap::builder::{NonEmptyStringValueParser, TypedValueParser};
use half::bf16;
use nvfp4_moe::io::{self as nio, ModelOptWeight};
use nvfp4_moe::layout::ScaleLayout;
use nvfp4_moe::Error;
use nvfp4_moe::{host::Nvfp4Host, reference};
use serde_json::json;
use tracing::info;

use crate::common::{
    file_ctx, fmt_bytes, fmt_dur, fmt_f32, normalize_prefix, out, print_json, progress, run_chunked, spinner,
    tensor_json, CliResult, Global,
};
use crate::gpu::{backend_label, resolve_backend, Backend};
use crate::quantize::{backend_name, chunk_rows};

pub const ABOUT: &str = "Decode a ModelOpt NVFP4 weight back to a BF16 tensor";

pub const AFTER_HELP: &str = "\
Reads {P}weight (U8 [N, K/2]), {P}weight_scale (F8_E4M3 [N, K/16], linear) and
{P}weight_scale_2 (F32 scalar) and writes one BF16 [N, K] tensor; each element is
bf16(e2m1 x e4m3 x g), rounded to nearest even. Both backends write the same bytes.

Example:
  nvfp4-moe dequantize --input gate.safetensors --prefix model.layers.0.mlp.gate_proj \\
      --output gate-bf16.safetensors --name weight --backend cpu";

/// The flags of `dequantize`.
#[derive(Debug, clap::Args)]
pub struct DequantizeArgs {
    /// safetensors file holding {P}weight, {P}weight_scale and {P}weight_scale_2
    #[arg(long, value_name = "FILE", value_parser = NonEmptyStringValueParser::new())]
    pub input: String,
    /// safetensors file to write (replaced if it exists): one BF16 [N, K] tensor
    #[arg(long, value_name = "FILE", value_parser = NonEmptyStringValueParser::new())]
    pub output: String,
    /// Name prefix of the tensors read, e.g. model.layers.0.mlp.gate_proj (a final '.' is added
    /// when missing); default: none
    #[arg(long, value_name = "P")]
    pub prefix: Option<String>,
    /// Name of the BF16 tensor written
    #[arg(
        long,
        value_name = "NAME",
        default_value = "weight",
        value_parser = NonEmptyStringValueParser::new().try_map(tensor_name)
    )]
    pub name: String,
    /// cpu or cuda (GPU 0); default: cuda when a GPU this build supports is visible, else cpu
    #[arg(long, value_enum, value_name = "B")]
    pub backend: Option<Backend>,
}

/// `--name`: a name a tensor can have. `__metadata__` is the safetensors header's metadata entry:
/// refused before anything is read or written.
fn tensor_name(s: String) -> Result<String, String> {
    if s == "__metadata__" {
        return Err("it is the safetensors header's metadata entry, not a tensor name".to_string());
    }
    Ok(s)
}

/// The CPU reference dequantizer over row chunks on all cores.
fn dequantize_cpu(w: &ModelOptWeight) -> nvfp4_moe::Result<Vec<bf16>> {
    let (rows, cols) = (w.rows, w.cols);
    // read_modelopt refuses these; a zero K would make every chunk size below 0.
    let n = rows.checked_mul(cols).filter(|&n| n > 0).ok_or_else(|| {
        Error::InvalidShape(format!("cannot dequantize a weight of shape [{rows}, {cols}]: it must be non-empty"))
    })?;
    let mut out = vec![bf16::ZERO; n];
    let ch = chunk_rows(cols);
    let items: Vec<_> = w
        .codes
        .chunks(ch * cols / 2)
        .zip(w.scales.chunks(ch * cols / 16))
        .zip(out.chunks_mut(ch * cols))
        .map(|((c, s), o)| (o.len() / cols, (c, s, o)))
        .collect();
    let pb = progress("cpu dequantize", rows as u64, "rows");
    run_chunked(&pb, items, |(c, s, o): (&[u8], &[u8], &mut [bf16])| {
        let h = Nvfp4Host {
            rows: o.len() / cols,
            cols,
            layout: ScaleLayout::Linear,
            decode_scale: w.decode_scale,
            codes: c.to_vec(),
            scales: s.to_vec(),
        };
        let y = reference::try_dequantize(&h)?;
        if y.len() != o.len() {
            return Err(Error::Invalid(format!(
                "reference dequantizer returned {} elements, expected {}",
                y.len(),
                o.len()
            )));
        }
        o.copy_from_slice(&y);
        Ok(())
    })?;
    pb.finish_and_clear();
    Ok(out)
}

/// The GPU dequantizer on GPU 0, logging its phases. Returns (values, kernel time).
#[cfg(feature = "cuda")]
fn dequantize_cuda(w: &ModelOptWeight) -> nvfp4_moe::Result<(Vec<bf16>, Duration)> {
    use crate::quantize::phase;
    let n = w.rows * w.cols;
    if n == 0 {
        return Ok((Vec::new(), Duration::ZERO));
    }
    let ctx = cudarc::driver::CudaContext::new(0)?;
    let stream = ctx.default_stream();
    let host = Nvfp4Host {
        rows: w.rows,
        cols: w.cols,
        layout: ScaleLayout::Linear,
        decode_scale: w.decode_scale,
        codes: w.codes.clone(),
        scales: w.scales.clone(),
    };
    let pb = spinner("cuda dequantize: upload");
    let t = Instant::now();
    let q = nvfp4_moe::Nvfp4Tensor::from_host(&stream, &host)?;
    stream.synchronize()?;
    phase("upload", w.codes.len() + w.scales.len(), t);
    pb.set_message("cuda dequantize: kernel");
    let t = Instant::now();
    let yd = nvfp4_moe::dequantize_nvfp4(&stream, &q)?;
    stream.synchronize()?;
    let kernel = t.elapsed();
    phase("kernel", n * 2 + n / 2 + n / 16, t);
    pb.set_message("cuda dequantize: download");
    let t = Instant::now();
    let mut y = stream.clone_dtoh(&yd)?;
    y.truncate(n);
    phase("download", n * 2, t);
    pb.finish_and_clear();
    Ok((y, kernel))
}

#[cfg(not(feature = "cuda"))]
fn dequantize_cuda(_: &ModelOptWeight) -> CliResult<(Vec<bf16>, Duration)> {
    unreachable!("resolve_backend never picks cuda without the `cuda` feature")
}

pub fn run(args: &DequantizeArgs, global: Global) -> CliResult {
    let (input, output, out_name) = (args.input.as_str(), args.output.as_str(), args.name.as_str());
    let prefix = normalize_prefix(args.prefix.as_deref());
    let t_all = Instant::now();

    let pb = spinner(&format!("reading `{prefix}weight` from {input}"));
    let w = nio::read_modelopt(input, &prefix).map_err(file_ctx(input))?;
    pb.finish_and_clear();
    let t_read = t_all.elapsed();
    let (rows, cols) = (w.rows, w.cols);
    info!("read `{prefix}weight` NVFP4 [{rows}, {cols}] from {input} ({})", fmt_dur(t_read));

    let (backend, gpu) = resolve_backend(args.backend)?;
    let t = Instant::now();
    let (y, kernel) = match backend {
        Backend::Cpu => (dequantize_cpu(&w)?, None),
        Backend::Cuda => {
            let (y, k) = dequantize_cuda(&w)?;
            (y, Some(k))
        }
    };
    let t_dq = t.elapsed();
    let label = backend_label(backend, gpu.as_deref());
    let kernel_text = kernel.map(|k| format!(", kernel {}", fmt_dur(k))).unwrap_or_default();
    info!("dequantized on {label} in {}{kernel_text}", fmt_dur(t_dq));

    let t = Instant::now();
    let pb = spinner(&format!("writing {output}"));
    nio::write_bf16(output, out_name, &y, rows, cols)?;
    pb.finish_and_clear();
    let t_write = t.elapsed();
    let bytes = std::fs::metadata(output).map(|m| m.len() as usize).unwrap_or(y.len() * 2);
    info!("wrote {output} in {}; total {}", fmt_dur(t_write), fmt_dur(t_all.elapsed()));

    if global.json {
        print_json(&json!({
            "command": "dequantize",
            "input": input,
            "prefix": prefix,
            "rows": rows,
            "cols": cols,
            "decode_scale": w.decode_scale,
            "backend": backend_name(backend),
            "gpu": gpu,
            "output": output,
            "bytes": bytes,
            "tensors": [tensor_json(out_name, "BF16", &[rows, cols])],
            "seconds": {
                "read": t_read.as_secs_f64(),
                "dequantize": t_dq.as_secs_f64(),
                "kernel": kernel.map(|k| k.as_secs_f64()),
                "write": t_write.as_secs_f64(),
                "total": t_all.elapsed().as_secs_f64(),
            },
        }));
    } else {
        out!(
            "dequantized `{prefix}weight` NVFP4 [{rows}, {cols}] (decode scale g = {}) on {label}",
            fmt_f32(w.decode_scale)
        );
        out!("wrote {output} ({}): {out_name} BF16 [{rows}, {cols}]", fmt_bytes(bytes));
    }
    Ok(())
}
