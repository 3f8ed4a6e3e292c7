//! Expert shards (expert parallelism, issue 24) on the GPU: a layer built from a subset of the
//! experts with the whole layer's routing. The FP32 outputs of the shards of a partition add up to
//! the whole layer's FP32 output within 1e-5 relative (each shard's experts get the whole layer's
//! tiles and K splits, so only the order of the final sum differs), for contiguous and scattered
//! partitions into 2, 4 and 8 shards, skewed routing with shards that get no rows, the caller's
//! top-k and the router; each shard's BF16 output is within the f64 oracle's tolerance
//! (`reference::routing::moe_layer_shard`); a shard holding every expert in a shuffled order gives
//! the whole layer's bytes; a shard routed nothing gives zeros; bad shards and a wrong output type
//! are typed errors.

use super::*;
use crate::layer::moe_layer::random_checkpoint;
use crate::sweep::skewed_ids;
use nvfp4_moe::host::MoeCheckpoint;
use nvfp4_moe::moe::{MoeInput, OutputFormat, RouterInput};
use nvfp4_moe::testing::expert_subset;
use nvfp4_moe::{MoeLayer, MoeOptions, MoeWeights};

/// 0..e in a random order (Fisher-Yates).
fn shuffled(rng: &mut Rng, e: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..e).collect();
    for i in (1..e).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
    order
}

/// The shards of `n` partitions of `e` experts: contiguous ranges, then a shuffled assignment with
/// shards of unequal sizes (each at least one expert: a shard of no experts is no layer).
fn partitions(rng: &mut Rng, e: usize, n: usize) -> [Vec<Vec<usize>>; 2] {
    let contiguous = (0..n).map(|s| (s * e / n..(s + 1) * e / n).collect()).collect();
    let order = shuffled(rng, e);
    // Cut points: n - 1 distinct positions in 1..e, so every shard is non-empty and sizes differ.
    let mut cuts: Vec<usize> = Vec::new();
    while cuts.len() < n - 1 {
        let c = rng.range(1, e);
        if !cuts.contains(&c) {
            cuts.push(c);
        }
    }
    cuts.sort_unstable();
    cuts.insert(0, 0);
    cuts.push(e);
    let scattered = cuts.windows(2).map(|w| order[w[0]..w[1]].to_vec()).collect();
    [contiguous, scattered]
}

/// A layer over `ck`'s experts `ids` as a shard of `ck`'s layer (or the whole layer for `None`).
fn layer_of(s: &Arc<CudaStream>, ck: &MoeCheckpoint, ids: Option<&[usize]>, opts: MoeOptions) -> MoeLayer {
    match ids {
        None => MoeLayer::new(MoeWeights::from_checkpoint(s, ck).unwrap(), opts).unwrap(),
        Some(ids) => {
            let w = MoeWeights::from_checkpoint(s, &expert_subset(ck, ids)).unwrap();
            MoeLayer::new_shard(s, w, opts, ck.w13.experts, ids).unwrap()
        }
    }
}

/// One forward of `layer` into a NaN-poisoned f32 `[t, h]` output: the caller's top-k (`logits`
/// `None`) or the router over `logits`.
#[allow(clippy::too_many_arguments)]
fn forward_f32(
    s: &Arc<CudaStream>,
    layer: &MoeLayer,
    hidden: &CudaSlice<bf16>,
    t: usize,
    k: usize,
    ids: &CudaSlice<i32>,
    weights: &CudaSlice<f32>,
    logits: Option<&CudaSlice<f32>>,
) -> Vec<f32> {
    let h = layer.weights().hidden;
    let mut out = s.clone_htod(&vec![f32::NAN; t * h]).unwrap();
    let mut ws = layer.workspace(s).unwrap();
    match logits {
        None => {
            let input = MoeInput { hidden, tokens: t, topk_ids: ids, topk_weights: weights, top_k: k };
            layer.forward(s, &input, &mut out, &mut ws).unwrap();
        }
        Some(router_logits) => {
            let input = RouterInput { hidden, tokens: t, router_logits, top_k: k, renormalize: true };
            layer.forward_with_router(s, &input, &mut out, &mut ws).unwrap();
        }
    }
    layer.check(s, &mut ws, k).unwrap();
    s.clone_dtoh(&out).unwrap()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn shards_add_up_to_the_whole_layer() {
    let s = stream();
    let mut rng = test_rng();
    let rp = replay();
    // (name, E, H, I, k, T): deepseek-v3's expert shape with 32 of its experts, mixtral-8x7b whole;
    // T = 1 and 16 (decode, most shards empty at T = 1), 160 (more than 1024 pairs with k = 8: the
    // three-launch permutation).
    for &(name, e, h, i, k) in
        &[("deepseek-v3 (32 experts)", 32usize, 7168usize, 2048usize, 8usize), ("mixtral-8x7b", 8, 4096, 14336, 2)]
    {
        let ck = random_checkpoint(&mut rng, e, h, i);
        let max_t = 160;
        let opts = MoeOptions { output: OutputFormat::Fp32, ..MoeOptions::new(max_t, k) };
        let whole = layer_of(&s, &ck, None, opts);
        for t in [1usize, 16, 160] {
            let ids = skewed_ids(&mut rng, t, k, e, true);
            let w: Vec<f32> = (0..t * k).map(|_| rng.uniform(0.1, 1.0)).collect();
            let logits: Vec<f32> = (0..t * e).map(|_| rng.normal()).collect();
            let hidden = rng.normal_bf16(t * h, 1.0);
            let (hd, idd, wd, ld) = (
                s.clone_htod(&hidden).unwrap(),
                s.clone_htod(&ids).unwrap(),
                s.clone_htod(&w).unwrap(),
                s.clone_htod(&logits).unwrap(),
            );
            let want = forward_f32(&s, &whole, &hd, t, k, &idd, &wd, None);
            assert!(want.iter().all(|v| v.is_finite()), "{name} T={t}: whole layer output not all written: {rp}");
            let want_router = forward_f32(&s, &whole, &hd, t, k, &idd, &wd, Some(&ld));
            for n in [2usize, 4, 8].into_iter().filter(|&n| n <= e) {
                for (p, shards) in partitions(&mut rng, e, n).iter().enumerate() {
                    let ctx = format!("{name} T={t}, {n} shards ({}): {rp}", ["contiguous", "scattered"][p]);
                    let (mut sum, mut sum_router) = (vec![0f64; t * h], vec![0f64; t * h]);
                    for (si, shard) in shards.iter().enumerate() {
                        let layer = layer_of(&s, &ck, Some(shard), opts);
                        assert_eq!(layer.shard_expert_ids(), Some(shard.as_slice()));
                        let got = forward_f32(&s, &layer, &hd, t, k, &idd, &wd, None);
                        assert!(got.iter().all(|v| v.is_finite()), "shard {si} output not all written: {ctx}");
                        // A token with none of its slots here gets exact zeros.
                        for tok in 0..t {
                            let here = ids[tok * k..(tok + 1) * k].iter().any(|&id| shard.contains(&(id as usize)));
                            if !here {
                                let row = &got[tok * h..(tok + 1) * h];
                                assert!(row.iter().all(|v| v.to_bits() == 0), "shard {si} token {tok} not zero: {ctx}");
                            }
                        }
                        if p == 0 && n == 2 {
                            // Against the f64 oracle of the shard (the layer tests' bound).
                            let sub = expert_subset(&ck, shard);
                            let oracle =
                                reference::routing::moe_layer_shard(&hidden, t, &ids, &w, k, &sub, shard, e).unwrap();
                            let mut err = RelErr::default();
                            for (g, x) in got.iter().zip(&oracle) {
                                err.add(f64::from(*g), *x);
                            }
                            if err.den > 0.0 {
                                assert!(err.rel() <= 1e-2, "shard {si} vs f64: rel {:.3e}: {ctx}", err.rel());
                                err.report(&format!("shard {si} of 2, {name} T={t}"));
                            }
                        }
                        for (a, g) in sum.iter_mut().zip(&got) {
                            *a += f64::from(*g);
                        }
                        let got = forward_f32(&s, &layer, &hd, t, k, &idd, &wd, Some(&ld));
                        for (a, g) in sum_router.iter_mut().zip(&got) {
                            *a += f64::from(*g);
                        }
                    }
                    for (what, sum, want) in [("top-k", &sum, &want), ("router", &sum_router, &want_router)] {
                        let mut err = RelErr::default();
                        for (g, x) in sum.iter().zip(want.iter()) {
                            err.add(*g, f64::from(*x));
                        }
                        assert!(err.rel() <= 1e-5, "{what}: shards sum to rel {:.3e} of the whole: {ctx}", err.rel());
                        err.report(&format!("{what} shards sum, {ctx}"));
                    }
                }
            }
        }
    }
}

/// A shard holding every expert, listed in a shuffled order, is the whole layer: the same BF16
/// bytes (its map permutes the ids, its tiles and splits are the whole layer's).
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_shard_of_every_expert_gives_the_whole_layers_bytes() {
    let s = stream();
    let mut rng = test_rng();
    let rp = replay();
    let (e, h, i, k) = (16usize, 1024usize, 512usize, 4usize);
    let ck = random_checkpoint(&mut rng, e, h, i);
    let opts = MoeOptions::new(300, k);
    let whole = layer_of(&s, &ck, None, opts);
    let order = shuffled(&mut rng, e);
    let shard = layer_of(&s, &ck, Some(&order), opts);
    for t in [1usize, 7, 300] {
        let ids = skewed_ids(&mut rng, t, k, e, true);
        let w: Vec<f32> = (0..t * k).map(|_| rng.uniform(0.1, 1.0)).collect();
        let (hd, idd, wd) = (
            s.clone_htod(&rng.normal_bf16(t * h, 1.0)).unwrap(),
            s.clone_htod(&ids).unwrap(),
            s.clone_htod(&w).unwrap(),
        );
        let input = MoeInput { hidden: &hd, tokens: t, topk_ids: &idd, topk_weights: &wd, top_k: k };
        let run = |layer: &MoeLayer| {
            let mut out = poisoned_bf16(&s, t * h);
            let mut ws = layer.workspace(&s).unwrap();
            layer.forward(&s, &input, &mut out, &mut ws).unwrap();
            s.clone_dtoh(&out).unwrap()
        };
        let (a, b) = (run(&whole), run(&shard));
        assert!(a.iter().all(|v| v.to_bits() != POISON_BF16), "T={t}: not all written: {rp}");
        let same = a.iter().zip(&b).filter(|(x, y)| x.to_bits() == y.to_bits()).count();
        assert_eq!(same, t * h, "T={t}: a shard of every expert differs from the whole layer: {rp}");
    }
}

/// Bad shards are refused before anything runs, naming the problem; a bad global id is reported
/// by `check` against the global expert count; out of the wrong element type is an error.
#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_shards_and_outputs_are_errors() {
    let s = stream();
    let mut rng = test_rng();
    let rp = replay();
    let (e, h, i, k) = (8usize, 256usize, 128usize, 2usize);
    let ck = random_checkpoint(&mut rng, e, h, i);
    let sub = expert_subset(&ck, &[5, 2]);
    let shard = |global: usize, ids: &[usize]| {
        MoeLayer::new_shard(&s, MoeWeights::from_checkpoint(&s, &sub).unwrap(), MoeOptions::new(4, k), global, ids)
    };
    for (global, ids, says) in [
        (e, &[5usize, 2, 1][..], "lists 3 expert ids"),
        (e, &[5, 8], "not below global_experts 8"),
        (e, &[5, 5], "repeats"),
        (2000, &[5, 2], "exceeds"),
    ] {
        match shard(global, ids) {
            Err(Error::InvalidShape(m)) => assert!(m.contains(says), "{m:?} should say {says:?}: {rp}"),
            other => panic!("shard of {ids:?} in {global}: {other:?}: {rp}"),
        }
    }
    // The top-k limit counts the global experts: k = 4 > 2 local experts is fine.
    let layer =
        MoeLayer::new_shard(&s, MoeWeights::from_checkpoint(&s, &sub).unwrap(), MoeOptions::new(4, 4), e, &[5, 2])
            .unwrap();
    assert_eq!(layer.global_experts(), e);
    let t = 2usize;
    let (hd, wd) = (s.clone_htod(&rng.normal_bf16(t * h, 1.0)).unwrap(), s.clone_htod(&vec![0.5f32; t * 4]).unwrap());
    // Global id 9 is outside [0, 8): reported as such (slot 1 of token 1).
    let idd = s.clone_htod(&[0i32, 5, 2, 7, 1, 9, 3, 4]).unwrap();
    let input = MoeInput { hidden: &hd, tokens: t, topk_ids: &idd, topk_weights: &wd, top_k: 4 };
    let mut ws = layer.workspace(&s).unwrap();
    let mut f32_out = s.clone_htod(&vec![0f32; t * h]).unwrap();
    match layer.forward(&s, &input, &mut f32_out, &mut ws) {
        Err(Error::Invalid(m)) => assert!(m.contains("writes Bf16 output"), "{m}: {rp}"),
        other => panic!("f32 out for a BF16 layer: {other:?}: {rp}"),
    }
    let mut out = poisoned_bf16(&s, t * h);
    layer.forward(&s, &input, &mut out, &mut ws).unwrap();
    match layer.check(&s, &mut ws, 4) {
        Err(Error::Invalid(m)) => assert!(m.contains("topk_ids[1, 1] = 9") && m.contains("[0, 8)"), "{m}: {rp}"),
        other => panic!("a bad global id: {other:?}: {rp}"),
    }
    // Token 0 routes to 5 and 2 (here), token 1 to 9 (bad) and 4, 1, 3 (elsewhere): zeros.
    let got = s.clone_dtoh(&out).unwrap();
    assert!(got[h..].iter().all(|v| v.to_bits() == 0), "token 1 has no slot here: {rp}");
    assert!(got[..h].iter().any(|v| v.to_bits() != 0), "token 0 has two slots here: {rp}");
}
