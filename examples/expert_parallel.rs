//! Expert parallelism with `nvfp4_moe::ep`: one MoE layer sharded over N ranks, each holding E/N
//! experts and T/N of the step's tokens; the step dispatches each token to the ranks holding its
//! experts, runs the shards and returns and adds the partial sums. Checked against the whole
//! layer on one rank (FP32, batch invariant: equal up to the order of the final sum).
//!
//!   cargo run --release --example expert_parallel -- [PRESET] [RANKS] [TOKENS]
//!   cargo run --release --features nccl --example expert_parallel -- qwen3-30b-a3b 2 64 nccl
//!
//! Defaults: qwen3-30b-a3b, 4 ranks, 64 tokens, the loopback transport (N ranks as streams of
//! GPU 0); `nccl` as a fourth argument puts rank r on GPU r. Needs a CUDA GPU.

use cudarc::driver::{CudaContext, CudaSlice};
use half::bf16;
use nvfp4_moe::ep::{contiguous_shards, EpRunner, Loopback, Transport};
use nvfp4_moe::moe::{MoeInput, OutputFormat};
use nvfp4_moe::testing::{expert_subset, random_moe_checkpoint, Rng};
use nvfp4_moe::{presets, MoeLayer, MoeOptions, MoeWeights};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let p = presets::preset(args.get(1).map_or("qwen3-30b-a3b", String::as_str))?;
    let n: usize = args.get(2).map_or(Ok(4), |s| s.parse())?;
    let t: usize = args.get(3).map_or(Ok(64), |s| s.parse())?;
    let (e, h, k) = (p.experts, p.hidden, p.top_k);
    let s = CudaContext::new(0)?.new_stream()?;
    let transport: Box<dyn Transport> = match args.get(4).map(String::as_str) {
        #[cfg(feature = "nccl")]
        Some("nccl") => Box::new(nvfp4_moe::ep::NcclTransport::new(&(0..n).collect::<Vec<_>>())?),
        #[cfg(not(feature = "nccl"))]
        Some("nccl") => return Err("the nccl transport needs a build with `--features nccl`".into()),
        Some(other) if other != "loopback" => return Err(format!("unknown transport {other}").into()),
        _ => Box::new(Loopback::new(&s, n)?),
    };
    let mut rng = Rng::new(7);
    let ck = random_moe_checkpoint(&mut rng, e, h, p.intermediate);
    let per_rank = t.div_ceil(n);
    let opts = MoeOptions { output: OutputFormat::Fp32, batch_invariant: true, ..MoeOptions::new(n * per_rank, k) };

    // Rank r: experts r*E/N..(r+1)*E/N, on rank r's device (a checkpoint would load only those:
    // `nvfp4_moe::io` reads a shard's tensors alone).
    let placement = contiguous_shards(e, n);
    let mut shards = Vec::with_capacity(n);
    for (r, ids) in placement.iter().enumerate() {
        let w = MoeWeights::from_checkpoint(transport.stream(r), &expert_subset(&ck, ids))?;
        shards.push(MoeLayer::new_shard(w, opts, e, ids)?);
    }
    let mut runner = EpRunner::new(transport, shards, per_rank)?;

    // A step: random top-k routing, T/N tokens per rank.
    let ids: Vec<i32> = (0..t).flat_map(|x| (0..k).map(move |j| ((x * 31 + j * 17) % e) as i32)).collect();
    let weights: Vec<f32> = (0..t * k).map(|_| rng.uniform(0.1, 1.0) / k as f32).collect();
    let hidden = rng.normal_bf16(t * h, 1.0);
    let mut dev = Vec::new();
    let mut outs: Vec<CudaSlice<f32>> = Vec::new();
    for r in 0..n {
        let st = runner.transport().stream(r).clone();
        let (a, b) = (r * t / n, (r + 1) * t / n);
        // (Never empty: a rank with no tokens still passes buffers.)
        let pad = |v: usize| v.max(1);
        let mut x = st.alloc_zeros::<bf16>(pad((b - a) * h))?;
        let mut i = st.alloc_zeros::<i32>(pad((b - a) * k))?;
        let mut w = st.alloc_zeros::<f32>(pad((b - a) * k))?;
        if b > a {
            st.memcpy_htod(&hidden[a * h..b * h], &mut x)?;
            st.memcpy_htod(&ids[a * k..b * k], &mut i)?;
            st.memcpy_htod(&weights[a * k..b * k], &mut w)?;
        }
        dev.push((x, i, w, b - a));
        outs.push(st.alloc_zeros::<f32>(pad((b - a) * h))?);
    }
    let inputs: Vec<_> = dev
        .iter()
        .map(|(x, i, w, tk)| MoeInput { hidden: x, tokens: *tk, topk_ids: i, topk_weights: w, top_k: k })
        .collect();
    let info = runner.forward(&inputs, &mut outs)?;
    runner.synchronize()?;

    // The whole layer on one rank, for comparison.
    let whole = MoeLayer::new(MoeWeights::from_checkpoint(&s, &ck)?, MoeOptions { max_tokens: t, ..opts })?;
    let mut ws = whole.workspace(&s)?;
    let (hd, idd, wd) = (s.clone_htod(&hidden)?, s.clone_htod(&ids)?, s.clone_htod(&weights)?);
    let mut out = s.alloc_zeros::<f32>(t * h)?;
    whole.forward(
        &s,
        &MoeInput { hidden: &hd, tokens: t, topk_ids: &idd, topk_weights: &wd, top_k: k },
        &mut out,
        &mut ws,
    )?;
    let want = s.clone_dtoh(&out)?;
    let (mut num, mut den) = (0f64, 0f64);
    for r in 0..n {
        let got = runner.transport().stream(r).clone_dtoh(&outs[r])?;
        let a = r * t / n;
        for (j, g) in got[..(((r + 1) * t / n) - a) * h].iter().enumerate() {
            let x = f64::from(want[a * h + j]);
            num += (f64::from(*g) - x).powi(2);
            den += x * x;
        }
    }
    let rel = (num / den.max(1e-300)).sqrt();
    println!(
        "{} on {n} ranks ({}), T={t}: {} tokens crossed ranks, the busiest rank got {}; rel. difference from one rank {rel:.2e}",
        p.name,
        runner.transport().name(),
        info.remote_rows(),
        info.max_received()
    );
    if rel > 1e-5 {
        return Err(format!("the ranks' sum differs from the whole layer: {rel:.3e}").into());
    }
    Ok(())
}
