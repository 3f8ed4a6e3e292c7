//! Quantize a BF16 tensor to NVFP4 the way ModelOpt 0.47 does (recipe v2), write it as a ModelOpt
//! checkpoint tensor, read it back and decode it. With a CUDA GPU (default features), the GPU
//! quantizer writes the tensor and its bytes are checked against the CPU oracle; without one, or
//! without a CUDA toolkit, the CPU oracle quantizes:
//!
//! ```sh
//! cargo run --release --example quantize_roundtrip                        # GPU if one is visible
//! cargo run --release --no-default-features --example quantize_roundtrip  # CPU, no toolkit
//! ```

use half::bf16;
use nvfp4_moe::host::Nvfp4Host;
use nvfp4_moe::io::{read_modelopt, write_modelopt, ModelOptWeight};
use nvfp4_moe::layout::ScaleLayout;
use nvfp4_moe::{host, reference};

/// The GPU quantizer's output, or `None` (with a note) when no GPU is visible.
#[cfg(feature = "cuda")]
fn gpu_quantize(w: &[bf16], rows: usize, cols: usize, g: f32) -> nvfp4_moe::Result<Option<Nvfp4Host>> {
    if nvfp4_moe::info::gpus().is_empty() {
        println!("no CUDA GPU visible: the CPU oracle quantizes");
        return Ok(None);
    }
    let stream = cudarc::driver::CudaContext::new(0)?.default_stream();
    let x = stream.clone_htod(w)?;
    let q = nvfp4_moe::quantize_nvfp4(&stream, &x, rows, cols, g, ScaleLayout::Linear)?;
    Ok(Some(q.to_host(&stream)?))
}

#[cfg(not(feature = "cuda"))]
fn gpu_quantize(_: &[bf16], _: usize, _: usize, _: f32) -> nvfp4_moe::Result<Option<Nvfp4Host>> {
    println!("built without the `cuda` feature: the CPU oracle quantizes");
    Ok(None)
}

fn main() -> nvfp4_moe::Result<()> {
    // A [256, 512] "weight": a smooth pattern with a few outliers (no RNG dependency needed).
    let (rows, cols) = (256usize, 512usize);
    let w: Vec<bf16> = (0..rows * cols)
        .map(|i| {
            let (r, c) = ((i / cols) as f32, (i % cols) as f32);
            let v = 0.02 * (0.37 * r + 0.11 * c).sin() + if i % 997 == 0 { 0.3 } else { 0.0 };
            bf16::from_f32(v)
        })
        .collect();

    // ModelOpt's weight path: g = amax / (6 * 448) (as PyTorch computes it on CUDA), then the blocks.
    let g = host::weight_decode_scale(&w)?;
    let oracle = reference::quantize(&w, rows, cols, g, ScaleLayout::Linear)?;
    let q = match gpu_quantize(&w, rows, cols, g)? {
        Some(q) => {
            assert!(q == oracle, "the GPU quantizer's bytes differ from the CPU oracle's");
            println!(
                "GPU quantizer: {} code and {} scale bytes, equal to the CPU oracle's",
                q.codes.len(),
                q.scales.len()
            );
            q
        }
        None => oracle,
    };
    println!("quantized [{rows}, {cols}]: {} code bytes, {} scale bytes, g = {g:e}", q.codes.len(), q.scales.len());

    // As ModelOpt names it in a checkpoint: {prefix}weight, weight_scale, weight_scale_2.
    let path = std::env::temp_dir().join(format!("nvfp4-moe-example-{}.safetensors", std::process::id()));
    let prefix = "model.layers.0.mlp.experts.0.gate_proj.";
    let weight = ModelOptWeight { codes: q.codes.clone(), scales: q.scales.clone(), decode_scale: g, rows, cols };
    write_modelopt(&path, prefix, &weight)?;
    let back = read_modelopt(&path, prefix)?;
    std::fs::remove_file(&path).ok();
    assert_eq!(back, weight, "the file holds exactly what was written");

    // Decode: bf16(e2m1 * e4m3 * g), and what 4 bits per weight cost here.
    let decoded = reference::dequantize(&q);
    let (mut num, mut den, mut max) = (0f64, 0f64, 0f64);
    for (a, b) in decoded.iter().zip(&w) {
        let (a, b) = (f64::from(a.to_f32()), f64::from(b.to_f32()));
        num += (a - b) * (a - b);
        den += b * b;
        max = max.max((a - b).abs());
    }
    println!("round trip through {}: relative error {:.3e}, max error {max:.3e}", path.display(), (num / den).sqrt());
    Ok(())
}
