//! Drive the NVFP4 MoE layer from candle tensors: `nvfp4_moe::candle::MoeOp` is a
//! `candle_core::CustomOp3` over (hidden bf16 `[T, H]`, topk_ids i32 `[T, k]`, topk_weights f32
//! `[T, k]`), run on candle's CUDA stream.
//!
//! ```sh
//! cargo run --release --features candle --example candle_moe
//! ```
//!
//! Linking needs cuBLAS, cuRAND and NVRTC (candle's CUDA backend links them), and candle's kernels
//! need `CUDA_COMPUTE_CAP=90` when no GPU is visible at build time. Needs a CUDA GPU (sm_90a).

use candle_core::{Device, Tensor};
use half::bf16;
use nvfp4_moe::candle::MoeOp;
use nvfp4_moe::moe::{quantize_bf16_experts, MoeWeightsBf16};
use nvfp4_moe::reference::routing::moe_layer;
use nvfp4_moe::{MoeLayer, MoeOptions, MoeWeights};

/// A small deterministic generator: uniform in [-1, 1).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let device = Device::new_cuda(0)?;
    let Device::Cuda(cuda) = &device else { unreachable!("new_cuda gives a CUDA device") };
    let stream = cuda.cuda_stream();

    // A small layer from BF16 weights, quantized and prepared on candle's stream.
    let (e, h, i, tokens, top_k) = (8usize, 256usize, 128usize, 32usize, 2usize);
    let mut rng = Lcg(0xca2d1e);
    let mut w = |n: usize| (0..n).map(|_| bf16::from_f32(0.05 * rng.next())).collect::<Vec<_>>();
    let (gate, up, down) = (w(e * i * h), w(e * i * h), w(e * h * i));
    let bf = MoeWeightsBf16 { gate: &gate, up: &up, down: &down, experts: e, hidden: h, intermediate: i };
    let ck = quantize_bf16_experts(&stream, &bf)?;
    let layer = MoeLayer::new(MoeWeights::from_checkpoint(&stream, &ck)?, MoeOptions::new(tokens, top_k))?;
    let op = MoeOp::new(layer, cuda)?;

    // The inputs as candle tensors.
    let hidden: Vec<bf16> = (0..tokens * h).map(|_| bf16::from_f32(rng.next())).collect();
    let ids: Vec<i32> = (0..tokens * top_k).map(|p| ((p / top_k * 3 + (p % top_k) * 4) % e) as i32).collect();
    let wts: Vec<f32> = (0..tokens * top_k).map(|_| 0.5 + 0.5 * rng.next().abs()).collect();
    let x = Tensor::from_vec(hidden.clone(), (tokens, h), &device)?;
    let topk_ids = Tensor::from_vec(ids.clone(), (tokens, top_k), &device)?;
    let topk_weights = Tensor::from_vec(wts.clone(), (tokens, top_k), &device)?;

    let y = x.apply_op3_no_bwd(&topk_ids, &topk_weights, &op)?;
    println!("candle: {:?} {:?} -> {:?} {:?}", x.shape(), x.dtype(), y.shape(), y.dtype());

    let got: Vec<bf16> = y.flatten_all()?.to_vec1()?;
    let want = moe_layer(&hidden, tokens, &ids, &wts, top_k, &ck)?;
    let (mut num, mut den, mut max) = (0f64, 0f64, 0f64);
    for (g, w) in got.iter().zip(&want) {
        let d = f64::from(g.to_f32()) - w;
        num += d * d;
        den += w * w;
        max = max.max(d.abs());
    }
    let rel = (num / den.max(1e-300)).sqrt();
    println!("relative error {rel:.3e}, max error {max:.3e} vs the f64 oracle");
    if rel > 1e-2 {
        return Err(format!("relative error {rel:.3e} > 1e-2").into());
    }
    Ok(())
}
