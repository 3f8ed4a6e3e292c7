//! The expert-parallel runner (issue 24, `nvfp4_moe::ep`) on one GPU: N simulated ranks
//! ([`Loopback`]) each holding a shard of the experts and a share of the tokens give the whole
//! layer's FP32 output within 1e-5 relative (batch invariant: each expert's rows carry the whole
//! layer's bits, only the final sum's order differs), for 2, 4 and 8 ranks, contiguous and
//! scattered placements, uneven token shares (ranks with no tokens) and skewed routing (ranks
//! that receive nothing); one rank (loopback, and NCCL with the `nccl` feature) gives the local
//! layer's bytes; an NVFP4 payload equals the whole layer over the dequantized tokens; bad runners
//! and inputs are typed errors.

use super::*;
use crate::layer::moe_layer::random_checkpoint;
use crate::shard::{layer_of, partitions};
use crate::sweep::skewed_ids;
use nvfp4_moe::ep::{EpRunner, EpStepInfo, Loopback, Transport};
use nvfp4_moe::host::MoeCheckpoint;
use nvfp4_moe::moe::{MoeInput, OutputFormat};
use nvfp4_moe::{MoeLayer, MoeOptions};

/// One rank's step input on its stream: hidden, ids, weights (never empty buffers) and tokens.
type RankInput = (CudaSlice<bf16>, CudaSlice<i32>, CudaSlice<f32>, usize);

/// `v[a..b]` on `s`, or one element of `fill` for an empty range.
fn upload<T: cudarc::driver::DeviceRepr + Clone>(s: &Arc<CudaStream>, v: &[T], fill: T) -> CudaSlice<T> {
    if v.is_empty() {
        s.clone_htod(&[fill]).unwrap()
    } else {
        s.clone_htod(v).unwrap()
    }
}

/// Splits T tokens over `n` ranks at `bounds` and runs one step; returns the ranks' outputs
/// concatenated (f32 [T, H]), each rank's output NaN-poisoned first, and the step's report.
#[allow(clippy::too_many_arguments)]
fn step<X: Transport>(
    runner: &mut EpRunner<X>,
    bounds: &[usize],
    hidden: &[bf16],
    ids: &[i32],
    w: &[f32],
    h: usize,
    k: usize,
) -> nvfp4_moe::Result<(Vec<f32>, EpStepInfo)> {
    let n = bounds.len() - 1;
    let mut dev: Vec<RankInput> = Vec::new();
    let mut outs = Vec::new();
    for r in 0..n {
        let s = runner.transport().stream(r).clone();
        let (a, b) = (bounds[r], bounds[r + 1]);
        dev.push((
            upload(&s, &hidden[a * h..b * h], bf16::ZERO),
            upload(&s, &ids[a * k..b * k], 0),
            upload(&s, &w[a * k..b * k], 0.0),
            b - a,
        ));
        outs.push(s.clone_htod(&vec![f32::NAN; ((b - a) * h).max(1)]).unwrap());
    }
    let inputs: Vec<_> = dev
        .iter()
        .map(|(x, i, wt, t)| MoeInput { hidden: x, tokens: *t, topk_ids: i, topk_weights: wt, top_k: k })
        .collect();
    let info = runner.forward(&inputs, &mut outs)?;
    runner.synchronize()?;
    let mut all = Vec::new();
    for (r, o) in outs.iter().enumerate() {
        let got = runner.transport().stream(r).clone_dtoh(o).unwrap();
        all.extend_from_slice(&got[..(bounds[r + 1] - bounds[r]) * h]);
    }
    Ok((all, info))
}

/// Random cut points of `t` tokens over `n` ranks (sorted, some ranks empty).
fn token_bounds(rng: &mut Rng, t: usize, n: usize) -> Vec<usize> {
    let mut b: Vec<usize> = (0..n - 1).map(|_| rng.below(t as u64 + 1) as usize).collect();
    b.push(0);
    b.push(t);
    b.sort_unstable();
    b
}

/// The shards of `ck` at `placement` on the loopback's streams, in a runner (each shard takes
/// the N x `per_rank` tokens a rank may receive).
fn loopback_runner(
    s: &Arc<CudaStream>,
    ck: &MoeCheckpoint,
    placement: &[Vec<usize>],
    opts: MoeOptions,
    per_rank: usize,
) -> EpRunner<Loopback> {
    let lb = Loopback::new(s, placement.len()).unwrap();
    let opts = MoeOptions { max_tokens: placement.len() * per_rank, ..opts };
    let layers: Vec<MoeLayer> =
        placement.iter().enumerate().map(|(r, ids)| layer_of(lb.stream(r), ck, Some(ids), opts)).collect();
    EpRunner::new(lb, layers, per_rank).unwrap()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn loopback_ranks_add_up_to_the_whole_layer() {
    let s = stream();
    let mut rng = test_rng();
    let rp = replay();
    for &(name, e, h, i, k) in
        &[("deepseek-v3 (32 experts)", 32usize, 7168usize, 2048usize, 8usize), ("mixtral-8x7b", 8, 4096, 14336, 2)]
    {
        let ck = random_checkpoint(&mut rng, e, h, i);
        let max_t = 160;
        let opts = MoeOptions { output: OutputFormat::Fp32, batch_invariant: true, ..MoeOptions::new(max_t, k) };
        let whole = layer_of(&s, &ck, None, opts);
        let mut whole_ws = whole.workspace(&s).unwrap();
        for n in [2usize, 4, 8].into_iter().filter(|&n| n <= e) {
            for (p, placement) in partitions(&mut rng, e, n).iter().enumerate() {
                let mut runner = loopback_runner(&s, &ck, placement, opts, max_t);
                for t in [1usize, 16, 160] {
                    let ctx = format!("{name}, {n} ranks ({}), T={t}: {rp}", ["contiguous", "scattered"][p]);
                    let ids = skewed_ids(&mut rng, t, k, e, true);
                    let w: Vec<f32> = (0..t * k).map(|_| rng.uniform(0.1, 1.0)).collect();
                    let hidden = rng.normal_bf16(t * h, 1.0);
                    let want = {
                        let (hd, idd, wd) =
                            (s.clone_htod(&hidden).unwrap(), s.clone_htod(&ids).unwrap(), s.clone_htod(&w).unwrap());
                        let mut out = s.clone_htod(&vec![f32::NAN; t * h]).unwrap();
                        let input = MoeInput { hidden: &hd, tokens: t, topk_ids: &idd, topk_weights: &wd, top_k: k };
                        whole.forward(&s, &input, &mut out, &mut whole_ws).unwrap();
                        s.clone_dtoh(&out).unwrap()
                    };
                    let bounds = token_bounds(&mut rng, t, n);
                    let (got, info) = step(&mut runner, &bounds, &hidden, &ids, &w, h, k).unwrap();
                    assert!(got.iter().all(|v| v.is_finite()), "not every output written: {ctx}");
                    // At T = 1 some rank has no tokens and some receives none (N >= 2, top-k < N
                    // experts' ranks at most): the edge cases happen, not by chance.
                    let received = |d: usize| info.counts.iter().map(|c| c[d]).sum::<usize>();
                    if t == 1 {
                        assert!(bounds.windows(2).any(|b| b[0] == b[1]), "no empty rank at T=1: {ctx}");
                        assert!((0..n).any(|d| received(d) == 0) || k >= n, "every rank received a row at T=1: {ctx}");
                    }
                    let mut err = RelErr::default();
                    for (g, x) in got.iter().zip(&want) {
                        err.add(f64::from(*g), f64::from(*x));
                    }
                    assert!(err.rel() <= 1e-5, "ranks sum to rel {:.3e} of the whole layer: {ctx}", err.rel());
                    err.report(&format!("loopback step, {ctx}"));
                }
            }
        }
    }
}

/// One rank holding the whole layer: the step is the local forward (the same rows in the same
/// order, the sum's first term copied), so the same FP32 bytes; with the `nccl` feature the NCCL
/// transport too (a send and receive to itself).
#[test]
#[ignore = "needs a CUDA GPU"]
fn one_rank_gives_the_local_layers_bytes() {
    let s = stream();
    let mut rng = test_rng();
    let rp = replay();
    let (e, h, i, k) = (16usize, 1024usize, 512usize, 4usize);
    let ck = random_checkpoint(&mut rng, e, h, i);
    let max_t = 64;
    let opts = MoeOptions { output: OutputFormat::Fp32, ..MoeOptions::new(max_t, k) };
    let local = layer_of(&s, &ck, None, opts);
    let mut ws = local.workspace(&s).unwrap();
    let lb = Loopback::new(&s, 1).unwrap();
    let mut loopback = EpRunner::new(lb, vec![layer_of(&s, &ck, None, opts)], max_t).unwrap();
    #[cfg(feature = "nccl")]
    let mut nccl = {
        let tr = nvfp4_moe::ep::NcclTransport::new(&[0]).unwrap();
        let layer = layer_of(tr.stream(0), &ck, None, opts);
        EpRunner::new(tr, vec![layer], max_t).unwrap()
    };
    for t in [1usize, 5, 64] {
        let ctx = format!("T={t}: {rp}");
        let ids = skewed_ids(&mut rng, t, k, e, true);
        let w: Vec<f32> = (0..t * k).map(|_| rng.uniform(0.1, 1.0)).collect();
        let hidden = rng.normal_bf16(t * h, 1.0);
        let (hd, idd, wd) = (s.clone_htod(&hidden).unwrap(), s.clone_htod(&ids).unwrap(), s.clone_htod(&w).unwrap());
        let mut out = s.clone_htod(&vec![f32::NAN; t * h]).unwrap();
        let input = MoeInput { hidden: &hd, tokens: t, topk_ids: &idd, topk_weights: &wd, top_k: k };
        local.forward(&s, &input, &mut out, &mut ws).unwrap();
        let want = s.clone_dtoh(&out).unwrap();
        assert!(want.iter().all(|v| v.is_finite()), "local output not all written: {ctx}");
        let same = |got: &[f32]| got.iter().zip(&want).filter(|(a, b)| a.to_bits() == b.to_bits()).count();
        let (got, _) = step(&mut loopback, &[0, t], &hidden, &ids, &w, h, k).unwrap();
        assert_eq!(same(&got), t * h, "loopback, one rank: {ctx}");
        #[cfg(feature = "nccl")]
        {
            let (got, _) = step(&mut nccl, &[0, t], &hidden, &ids, &w, h, k).unwrap();
            assert_eq!(same(&got), t * h, "NCCL, one rank: {ctx}");
        }
    }
}

/// Runners of shards that do not partition the experts, of BF16 output, of another layer or of
/// whole layers on several ranks are refused; a step with a bad expert id, ranks of different
/// top-k or too many tokens is an error before anything runs, and the next step gives the whole
/// layer's output; a step of no tokens does nothing.
#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_runners_and_steps_are_errors() {
    let s = stream();
    let mut rng = test_rng();
    let rp = replay();
    let (e, h, i, k) = (8usize, 256usize, 128usize, 2usize);
    let ck = random_checkpoint(&mut rng, e, h, i);
    let opts = MoeOptions { output: OutputFormat::Fp32, batch_invariant: true, ..MoeOptions::new(16, k) };
    let make = |placement: &[&[usize]], opts: MoeOptions, per_rank: usize| {
        let lb = Loopback::new(&s, placement.len()).unwrap();
        let layers =
            placement.iter().enumerate().map(|(r, ids)| layer_of(lb.stream(r), &ck, Some(ids), opts)).collect();
        EpRunner::new(lb, layers, per_rank)
    };
    let says = |r: nvfp4_moe::Result<EpRunner<Loopback>>, text: &str| match r {
        Err(Error::InvalidShape(m) | Error::Invalid(m)) => assert!(m.contains(text), "{m:?} should say {text:?}: {rp}"),
        other => panic!("expected an error saying {text:?}, got {:?}: {rp}", other.map(|_| ())),
    };
    says(make(&[&[0, 1, 2], &[4, 5, 6, 7]], opts, 8), "expert 3 is on no rank");
    says(make(&[&[0, 1, 2, 3], &[3, 4, 5, 6, 7]], opts, 8), "expert 3 is on rank 0 and rank 1");
    says(make(&[&[0, 1, 2, 3], &[4, 5, 6, 7]], MoeOptions { output: OutputFormat::Bf16, ..opts }, 8), "Fp32");
    says(make(&[&[0, 1, 2, 3], &[4, 5, 6, 7]], opts, 9), "a rank may receive 2 x 9");
    // A whole layer on each of two ranks; a shard of a layer of another hidden size.
    {
        let lb = Loopback::new(&s, 2).unwrap();
        let layers = (0..2).map(|r| layer_of(lb.stream(r), &ck, None, opts)).collect();
        says(EpRunner::new(lb, layers, 8), "layer 0 is a whole layer");
        let other = random_checkpoint(&mut rng, e, 512, i);
        let lb = Loopback::new(&s, 2).unwrap();
        let layers = vec![
            layer_of(lb.stream(0), &ck, Some(&[0, 1, 2, 3]), opts),
            layer_of(lb.stream(1), &other, Some(&[4, 5, 6, 7]), opts),
        ];
        says(EpRunner::new(lb, layers, 8), "shard 1 is of another layer");
    }
    let mut runner = make(&[&[0, 1, 2, 3], &[4, 5, 6, 7]], opts, 8).unwrap();
    let whole = layer_of(&s, &ck, None, MoeOptions { max_tokens: 16, ..opts });
    let mut ws = whole.workspace(&s).unwrap();
    let t = 6;
    let hidden = rng.normal_bf16(t * h, 1.0);
    let w = vec![0.5f32; t * k];
    let mut ids = skewed_ids(&mut rng, t, k, e, true);
    let good = ids.clone();
    ids[2 * k + 1] = 8;
    match step(&mut runner, &[0, 1, t], &hidden, &ids, &w, h, k) {
        Err(Error::Invalid(m)) => assert!(m.contains("rank 1: topk_ids[1, 1] = 8 is outside [0, 8)"), "{m}: {rp}"),
        other => panic!("a bad id: {:?}: {rp}", other.map(|_| ())),
    }
    // The next step is the whole layer's, as if the refused one had not been asked for.
    let (got, _) = step(&mut runner, &[0, 0, t], &hidden, &good, &w, h, k).unwrap();
    let want = {
        let (hd, idd, wd) = (s.clone_htod(&hidden).unwrap(), s.clone_htod(&good).unwrap(), s.clone_htod(&w).unwrap());
        let mut out = s.clone_htod(&vec![f32::NAN; t * h]).unwrap();
        let input = MoeInput { hidden: &hd, tokens: t, topk_ids: &idd, topk_weights: &wd, top_k: k };
        whole.forward(&s, &input, &mut out, &mut ws).unwrap();
        s.clone_dtoh(&out).unwrap()
    };
    let mut err = RelErr::default();
    for (a, b) in got.iter().zip(&want) {
        err.add(f64::from(*a), f64::from(*b));
    }
    assert!(err.rel() <= 1e-5, "the step after a refused one: rel {:.3e}: {rp}", err.rel());
    // A step of no tokens on any rank: nothing to do, no error.
    let (got, info) = step(&mut runner, &[0, 0, 0], &hidden, &good, &w, h, k).unwrap();
    assert!(got.is_empty() && info.remote_rows() == 0 && info.max_received() == 0, "{rp}");
    let big = rng.normal_bf16(9 * h, 1.0);
    match step(&mut runner, &[0, 9, 9], &big, &vec![0; 9 * k], &vec![0.5; 9 * k], h, k) {
        Err(Error::InvalidShape(m)) => {
            assert!(m.contains("rank 0: 9 tokens exceed max_tokens_per_rank 8"), "{m}: {rp}")
        }
        other => panic!("too many tokens: {:?}: {rp}", other.map(|_| ())),
    }
    // Ranks with different top-k.
    let (d0, d1) = (runner.transport().stream(0).clone(), runner.transport().stream(1).clone());
    let x0 = d0.clone_htod(&hidden[..h]).unwrap();
    let (i0, w0) = (d0.clone_htod(&good[..k]).unwrap(), d0.clone_htod(&w[..k]).unwrap());
    let x1 = d1.clone_htod(&hidden[..h]).unwrap();
    let (i1, w1) = (d1.clone_htod(&good[..1]).unwrap(), d1.clone_htod(&w[..1]).unwrap());
    let inputs = [
        MoeInput { hidden: &x0, tokens: 1, topk_ids: &i0, topk_weights: &w0, top_k: k },
        MoeInput { hidden: &x1, tokens: 1, topk_ids: &i1, topk_weights: &w1, top_k: 1 },
    ];
    let mut outs = vec![d0.alloc_zeros::<f32>(h).unwrap(), d1.alloc_zeros::<f32>(h).unwrap()];
    match runner.forward(&inputs, &mut outs) {
        Err(Error::InvalidShape(m)) => assert!(m.contains("rank 1: top_k 1"), "{m}: {rp}"),
        other => panic!("mismatched top-k: {:?}: {rp}", other.map(|_| ())),
    }
}

/// With an NVFP4 payload each token's hidden state travels quantized (0.5625 bytes per element)
/// and is dequantized by the receiver: the step equals the whole layer over the dequantized hidden
/// states (quantized on the GPU by the crate's quantizer, whose rows do not depend on each other)
/// within the BF16 payload's 1e-5, and the payload's bytes per row are reported; a bad decode
/// scale is refused.
#[test]
#[ignore = "needs a CUDA GPU"]
fn an_nvfp4_payload_is_the_layer_over_its_dequantized_tokens() {
    use nvfp4_moe::ep::Payload;
    let s = stream();
    let mut rng = test_rng();
    let rp = replay();
    let (e, h, i, k, n) = (16usize, 1024usize, 512usize, 4usize, 4usize);
    let ck = random_checkpoint(&mut rng, e, h, i);
    let max_t = 128;
    let opts = MoeOptions { output: OutputFormat::Fp32, batch_invariant: true, ..MoeOptions::new(max_t, k) };
    let whole = layer_of(&s, &ck, None, opts);
    let mut ws = whole.workspace(&s).unwrap();
    let placement = partitions(&mut rng, e, n)[1].clone();
    let mut runner = loopback_runner(&s, &ck, &placement, opts, max_t);
    assert!(matches!(runner.set_payload(Payload::Nvfp4 { decode_scale: f32::NAN }), Err(Error::InvalidDecodeScale(_))));
    assert_eq!(runner.payload(), Payload::Bf16);
    let g = 4.0 / (6.0 * 448.0);
    runner.set_payload(Payload::Nvfp4 { decode_scale: g }).unwrap();
    for t in [1usize, 37, 128] {
        let ctx = format!("T={t}: {rp}");
        let ids = skewed_ids(&mut rng, t, k, e, true);
        let w: Vec<f32> = (0..t * k).map(|_| rng.uniform(0.1, 1.0)).collect();
        let hidden = rng.normal_bf16(t * h, 1.0);
        // The whole layer over dequantize(quantize(hidden)).
        let desc = Nvfp4Desc { rows: t, cols: h, layout: ScaleLayout::Linear, decode_scale: g };
        let hd = s.clone_htod(&hidden).unwrap();
        let (mut codes, mut scales) = (poisoned_u8(&s, t * h / 2), poisoned_u8(&s, t * h / 16));
        quantize_nvfp4_into(&s, &hd, desc, &mut codes, &mut scales).unwrap();
        let mut xq = poisoned_bf16(&s, t * h);
        dequantize_nvfp4_into(&s, &codes, &scales, desc, &mut xq).unwrap();
        let (idd, wd) = (s.clone_htod(&ids).unwrap(), s.clone_htod(&w).unwrap());
        let mut out = s.clone_htod(&vec![f32::NAN; t * h]).unwrap();
        let input = MoeInput { hidden: &xq, tokens: t, topk_ids: &idd, topk_weights: &wd, top_k: k };
        whole.forward(&s, &input, &mut out, &mut ws).unwrap();
        let want = s.clone_dtoh(&out).unwrap();
        let bounds = token_bounds(&mut rng, t, n);
        let (got, info) = step(&mut runner, &bounds, &hidden, &ids, &w, h, k).unwrap();
        assert_eq!(info.row_bytes, h / 2 + h / 16 + 2 * 4 * k, "{ctx}");
        assert!(got.iter().all(|v| v.is_finite()), "not every output written: {ctx}");
        let mut err = RelErr::default();
        for (a, b) in got.iter().zip(&want) {
            err.add(f64::from(*a), f64::from(*b));
        }
        assert!(err.rel() <= 1e-5, "NVFP4 payload vs the layer over dequantized tokens: {:.3e}: {ctx}", err.rel());
        err.report(&format!("NVFP4 payload, {ctx}"));
    }
}
