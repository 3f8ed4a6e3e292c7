//! Load one MoE layer from an NVFP4 checkpoint (ModelOpt or compressed-tensors, detected from the
//! files) and run it on the GPU, against the crate's f64 oracle of the layer.
//!
//! ```sh
//! cargo run --release --example modelopt_layer -- CHECKPOINT PREFIX [TOKENS]
//! #   CHECKPOINT: a .safetensors file, a sharded checkpoint's *.index.json, a directory, a Hugging
//! #               Face cache snapshot or a models--org--name cache root
//! #   PREFIX:     the experts' module path, e.g. model.layers.3.mlp.experts
//! cargo run --release --example modelopt_layer        # writes a small checkpoint first
//! ```
//!
//! Without arguments it makes a small layer (8 experts, H = 256, I = 128) from BF16 weights with the
//! GPU quantizer, writes it as a ModelOpt checkpoint (`gate_proj`/`up_proj`/`down_proj` names) and
//! loads that. Routing is random top-2. Needs a CUDA GPU (sm_90a).

use std::path::PathBuf;

use half::bf16;
use nvfp4_moe::host::ExpertNaming;
use nvfp4_moe::io::{load_experts, write_modelopt_experts};
use nvfp4_moe::moe::{quantize_bf16_experts, MoeInput, MoeWeightsBf16};
use nvfp4_moe::reference::routing::moe_layer;
use nvfp4_moe::{MoeLayer, MoeOptions, MoeWeights};

/// A small deterministic generator (no RNG dependency): uniform in [-1, 1).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

fn main() -> nvfp4_moe::Result<()> {
    if nvfp4_moe::info::gpus().is_empty() {
        return Err(nvfp4_moe::Error::Invalid("this example needs a CUDA GPU".into()));
    }
    let stream = cudarc::driver::CudaContext::new(0)?.default_stream();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut rng = Lcg(0x5eed);
    let (path, prefix, tokens) = match args.as_slice() {
        [path, prefix, rest @ ..] => {
            let tokens = rest
                .first()
                .map_or(Ok(16), |t| t.parse())
                .map_err(|e| nvfp4_moe::Error::Invalid(format!("TOKENS: {e}")))?;
            (PathBuf::from(path), prefix.clone(), tokens)
        }
        [] => {
            // A small layer from BF16 weights, quantized on the GPU, written as ModelOpt writes it.
            let (e, h, i) = (8usize, 256usize, 128usize);
            let mut w = |n: usize, scale: f32| (0..n).map(|_| bf16::from_f32(scale * rng.next())).collect::<Vec<_>>();
            let (gate, up, down) = (w(e * i * h, 0.05), w(e * i * h, 0.05), w(e * h * i, 0.05));
            let bf = MoeWeightsBf16 { gate: &gate, up: &up, down: &down, experts: e, hidden: h, intermediate: i };
            let ck = quantize_bf16_experts(&stream, &bf)?;
            let path = std::env::temp_dir().join(format!("nvfp4-moe-layer-{}.safetensors", std::process::id()));
            let prefix = "model.layers.0.mlp.experts".to_string();
            write_modelopt_experts(&path, &prefix, ExpertNaming::GateUpDown, &ck)?;
            println!("wrote a {e}-expert layer (H = {h}, I = {i}) to {}", path.display());
            (path, prefix, 16)
        }
        _ => return Err(nvfp4_moe::Error::Invalid("usage: modelopt_layer [CHECKPOINT PREFIX [TOKENS]]".into())),
    };

    // The checkpoint on the host (for the oracle), then the prepared layer on the GPU.
    let loaded = load_experts(&path, &prefix)?;
    let ck = loaded.checkpoint;
    let (e, h, top_k) = (ck.experts, ck.hidden, 2usize.min(ck.experts));
    println!(
        "{}: {}, {}: {e} experts, hidden {h}, intermediate {}, naming {}",
        path.display(),
        loaded.format.dialect,
        loaded.format.scheme,
        ck.intermediate,
        ck.naming
    );
    let weights = MoeWeights::from_checkpoint(&stream, &ck)?;
    let layer = MoeLayer::new(weights, MoeOptions::new(tokens, top_k))?;
    let mut ws = layer.workspace(&stream)?;

    // Random hidden states and top-k routing (distinct experts per token).
    let hidden: Vec<bf16> = (0..tokens * h).map(|_| bf16::from_f32(rng.next())).collect();
    let mut ids = Vec::with_capacity(tokens * top_k);
    let mut wts = Vec::with_capacity(tokens * top_k);
    for t in 0..tokens {
        for j in 0..top_k {
            ids.push(((t * 7 + j * (e / top_k).max(1)) % e) as i32);
            wts.push(0.5 + 0.5 * rng.next().abs());
        }
    }
    let (xd, idd, wd) = (stream.clone_htod(&hidden)?, stream.clone_htod(&ids)?, stream.clone_htod(&wts)?);
    let mut out = stream.alloc_zeros::<bf16>(tokens * h)?;
    let input = MoeInput { hidden: &xd, tokens, topk_ids: &idd, topk_weights: &wd, top_k };
    layer.forward(&stream, &input, &mut out, &mut ws)?;
    layer.check(&stream, &mut ws, top_k)?;
    let got = stream.clone_dtoh(&out)?;

    let want = moe_layer(&hidden, tokens, &ids, &wts, top_k, &ck)?;
    let (mut num, mut den, mut max) = (0f64, 0f64, 0f64);
    for (g, w) in got.iter().zip(&want) {
        let d = f64::from(g.to_f32()) - w;
        num += d * d;
        den += w * w;
        max = max.max(d.abs());
    }
    let rel = (num / den.max(1e-300)).sqrt();
    println!(
        "forward of {tokens} tokens (top-{top_k}): relative error {rel:.3e}, max error {max:.3e} vs the f64 oracle"
    );
    if args.is_empty() {
        std::fs::remove_file(&path).ok();
    }
    if rel > 1e-2 {
        return Err(nvfp4_moe::Error::Invalid(format!("relative error {rel:.3e} > 1e-2")));
    }
    Ok(())
}
