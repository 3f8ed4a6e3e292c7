//! The host's cost of one `MoeLayer::forward`: CPU time to enqueue it, with the GPU kept busy so
//! that the host never waits (issue 19's target: the Rust layer over the core's layer no more than
//! 3% above the Rust layer before it; the C ABI's cost is printed by `examples/cpp`).
//!
//!   cargo run --release --example host_cost -- [PRESET] [TOKENS] [ROUNDS]
//!
//! Defaults: qwen3-30b-a3b, 16 tokens, 20 rounds. Each round enqueues 24 forwards back to back (the
//! first 4 start the GPU; a forward runs far longer on the GPU than its enqueue takes, so the queue
//! only grows) and times each call; the median of the calls after the first 4 is the round's
//! figure, and the median of the rounds is printed. Needs a CUDA GPU.

use std::time::Instant;

use cudarc::driver::CudaContext;
use half::bf16;
use nvfp4_moe::moe::MoeInput;
use nvfp4_moe::testing::{random_moe_checkpoint, Rng};
use nvfp4_moe::{presets, MoeLayer, MoeOptions, MoeWeights};

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let p = presets::preset(args.get(1).map_or("qwen3-30b-a3b", String::as_str))?;
    let tokens: usize = args.get(2).map_or(Ok(16), |s| s.parse())?;
    let rounds: usize = args.get(3).map_or(Ok(20), |s| s.parse())?;
    let s = CudaContext::new(0)?.new_stream()?;
    let mut rng = Rng::new(1);
    let ck = random_moe_checkpoint(&mut rng, p.experts, p.hidden, p.intermediate);
    let k = p.top_k;
    let layer = MoeLayer::new(MoeWeights::from_checkpoint(&s, &ck)?, MoeOptions::new(tokens, k))?;
    let mut ws = layer.workspace(&s)?;
    let ids: Vec<i32> = (0..tokens * k).map(|x| ((x * 7 + x / k) % p.experts) as i32).collect();
    let (hd, idd) = (s.clone_htod(&rng.normal_bf16(tokens * p.hidden, 1.0))?, s.clone_htod(&ids)?);
    let wd = s.clone_htod(&vec![1.0f32 / k as f32; tokens * k])?;
    let mut out = s.alloc_zeros::<bf16>(tokens * p.hidden)?;
    let input = MoeInput { hidden: &hd, tokens, topk_ids: &idd, topk_weights: &wd, top_k: k };
    let mut per_round = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let mut calls = Vec::with_capacity(24);
        for _ in 0..24 {
            let t0 = Instant::now();
            layer.forward(&s, &input, &mut out, &mut ws)?;
            calls.push(t0.elapsed().as_secs_f64() * 1e6);
        }
        s.synchronize()?;
        per_round.push(median(&mut calls[4..]));
    }
    let m = median(&mut per_round);
    println!(
        "host cost of MoeLayer::forward: {m:.2} us per call (median of {rounds} rounds of 20 calls; {}, T = {tokens})",
        p.name
    );
    Ok(())
}
