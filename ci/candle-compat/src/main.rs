//! Uses cudarc the way candle does, side by side with nvfp4-moe's API.
use cudarc::driver::CudaContext;
use nvfp4_moe::{quantize_nvfp4, ScaleLayout};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let ctx = CudaContext::new(0)?;
    let stream = ctx.default_stream();
    let x = stream.clone_htod(&vec![half::bf16::ONE; 16 * 64])?;
    let q = quantize_nvfp4(&stream, &x, 16, 64, 1.0, ScaleLayout::Linear)?;
    println!("{} codes", q.codes.len());
    Ok(())
}
