//! Expert parallelism (issue 24) on the GPU. Expert shards: a layer built from a subset of the
//! experts with the whole layer's routing. The FP32 outputs of the shards of a partition add up to
//! the whole layer's FP32 output within 1e-5 relative (each shard's experts get the whole layer's
//! tiles and K splits, so only the order of the final sum differs), for contiguous and scattered
//! partitions into 2, 4 and 8 shards, skewed routing with shards that get no rows, the caller's
//! top-k and the router; each shard's FP32 output is within the f64 oracle's tolerance
//! (`reference::routing::moe_layer_shard`); with one expert per token a shard's rows are the whole
//! layer's bits and its GEMM tiles the whole layer's; a shard holding every expert in a shuffled
//! order gives the whole layer's bytes; a shard routed nothing gives zeros; bad shards and a wrong
//! output type are typed errors. The pre-dispatched forward (the expert-major layout of token
//! dispatchers) gives each expert's rows of the internal-permutation forward, bit for bit.

use super::*;
use crate::layer::moe_layer::random_checkpoint;
use crate::sweep::skewed_ids;
use nvfp4_moe::host::MoeCheckpoint;
use nvfp4_moe::moe::{MoeInput, OutputFormat, RouterInput};
use nvfp4_moe::testing::expert_subset;
use nvfp4_moe::{MoeLayer, MoeOptions, MoeWeights, MoeWorkspace};

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
pub(crate) fn partitions(rng: &mut Rng, e: usize, n: usize) -> [Vec<Vec<usize>>; 2] {
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
pub(crate) fn layer_of(s: &Arc<CudaStream>, ck: &MoeCheckpoint, ids: Option<&[usize]>, opts: MoeOptions) -> MoeLayer {
    match ids {
        None => MoeLayer::new(MoeWeights::from_checkpoint(s, ck).unwrap(), opts).unwrap(),
        Some(ids) => {
            let w = MoeWeights::from_checkpoint(s, &expert_subset(ck, ids)).unwrap();
            MoeLayer::new_shard(w, opts, ck.w13.experts, ids).unwrap()
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

/// The internal-permutation forward of `tokens` (`[t, h]`, one expert each: `ids`, weight 1) as
/// host BF16, each row the reference the pre-dispatched forward's row must match bit for bit (on
/// the workspace the dispatched forward then reuses).
fn permuted_forward(
    s: &Arc<CudaStream>,
    layer: &MoeLayer,
    tokens: &[bf16],
    ids: &[i32],
    ws: &mut MoeWorkspace,
) -> Vec<bf16> {
    let (t, h) = (ids.len(), layer.weights().hidden);
    let mut out = poisoned_bf16(s, t * h);
    let (td, idd, wd) =
        (s.clone_htod(tokens).unwrap(), s.clone_htod(ids).unwrap(), s.clone_htod(&vec![1f32; t]).unwrap());
    let input = MoeInput { hidden: &td, tokens: t, topk_ids: &idd, topk_weights: &wd, top_k: 1 };
    layer.forward(s, &input, &mut out, ws).unwrap();
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
    // cooperative one-launch permutation).
    for &(name, e, h, i, k) in
        &[("deepseek-v3 (32 experts)", 32usize, 7168usize, 2048usize, 8usize), ("mixtral-8x7b", 8, 4096, 14336, 2)]
    {
        let ck = random_checkpoint(&mut rng, e, h, i);
        let max_t = 160;
        let opts = MoeOptions { output: OutputFormat::Fp32, ..MoeOptions::new(max_t, k) };
        let whole = layer_of(&s, &ck, None, opts);
        // The steps first (inputs and the whole layer's outputs), then each partition's shards
        // made once and run over every step (making shards is the test's slow part).
        struct Step {
            t: usize,
            ids: Vec<i32>,
            w: Vec<f32>,
            hidden: Vec<bf16>,
            dev: (CudaSlice<bf16>, CudaSlice<i32>, CudaSlice<f32>, CudaSlice<f32>),
            want: Vec<f32>,
            want_router: Vec<f32>,
        }
        let mut steps = Vec::new();
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
            steps.push(Step { t, ids, w, hidden, dev: (hd, idd, wd, ld), want, want_router });
        }
        for n in [2usize, 4, 8].into_iter().filter(|&n| n <= e) {
            for (p, shards) in partitions(&mut rng, e, n).iter().enumerate() {
                let layers: Vec<MoeLayer> = shards.iter().map(|ids| layer_of(&s, &ck, Some(ids), opts)).collect();
                for Step { t, ids, w, hidden, dev: (hd, idd, wd, ld), want, want_router } in &steps {
                    let t = *t;
                    let ctx = format!("{name} T={t}, {n} shards ({}): {rp}", ["contiguous", "scattered"][p]);
                    let (mut sum, mut sum_router) = (vec![0f64; t * h], vec![0f64; t * h]);
                    for (si, (shard, layer)) in shards.iter().zip(&layers).enumerate() {
                        assert_eq!(layer.shard_expert_ids(), Some(shard.as_slice()));
                        let got = forward_f32(&s, layer, hd, t, k, idd, wd, None);
                        assert!(got.iter().all(|v| v.is_finite()), "shard {si} output not all written: {ctx}");
                        // A token with none of its slots here gets exact zeros.
                        for tok in 0..t {
                            let here = ids[tok * k..(tok + 1) * k].iter().any(|&id| shard.contains(&(id as usize)));
                            if !here {
                                let row = &got[tok * h..(tok + 1) * h];
                                assert!(row.iter().all(|v| v.to_bits() == 0), "shard {si} token {tok} not zero: {ctx}");
                            }
                        }
                        if p == 0 && n == 2 && t <= 16 {
                            // Against the f64 oracle of the shard (the layer tests' bound; one
                            // thread's f64 work grows with T x H x I: T <= 16, as the C ABI test).
                            let sub = expert_subset(&ck, shard);
                            let oracle =
                                reference::routing::moe_layer_shard(hidden, t, ids, w, k, &sub, shard, e).unwrap();
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
                        let got = forward_f32(&s, layer, hd, t, k, idd, wd, Some(ld));
                        for (a, g) in sum_router.iter_mut().zip(&got) {
                            *a += f64::from(*g);
                        }
                    }
                    for (what, sum, want) in [("top-k", &sum, want), ("router", &sum_router, want_router)] {
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

/// With one expert per token, every token's output comes from one shard: its FP32 row there is
/// the whole layer's, bit for bit, which holds only if the shard's GEMMs split K as the whole
/// layer's do for that expert (`schedule_experts`; a shard's own choice would see 8x the rows per
/// expert and split less, or take the N8 tile where the whole layer takes the warp kernel). Split
/// K and the warp kernel are decode's (at most 16 rows per expert on the N8 and N16 tiles; larger
/// tiles never split, and without splits every tile gives the same bits), so T = 1 to 16.
#[test]
#[ignore = "needs a CUDA GPU"]
fn shards_take_the_whole_layers_tiles_and_bits() {
    let s = stream();
    let mut rng = test_rng();
    let rp = replay();
    let (e, h, i, k) = (32usize, 1024usize, 512usize, 1usize);
    let ck = random_checkpoint(&mut rng, e, h, i);
    let opts = MoeOptions { output: OutputFormat::Fp32, ..MoeOptions::new(512, k) };
    let whole = layer_of(&s, &ck, None, opts);
    let shards = partitions(&mut rng, e, 8)[1].clone();
    let layers: Vec<MoeLayer> = shards.iter().map(|ids| layer_of(&s, &ck, Some(ids), opts)).collect();
    // T = 1, 2 and 8 (the warp kernel or N8, by the SM count), 16 (N16, split K).
    for t in [1usize, 2, 8, 16] {
        let ctx = format!("T={t}: {rp}");
        let ids = skewed_ids(&mut rng, t, k, e, true);
        let w: Vec<f32> = (0..t).map(|_| rng.uniform(0.1, 1.0)).collect();
        let (hd, idd, wd) = (
            s.clone_htod(&rng.normal_bf16(t * h, 1.0)).unwrap(),
            s.clone_htod(&ids).unwrap(),
            s.clone_htod(&w).unwrap(),
        );
        let want = forward_f32(&s, &whole, &hd, t, k, &idd, &wd, None);
        for (si, (layer, here)) in layers.iter().zip(&shards).enumerate() {
            let got = forward_f32(&s, layer, &hd, t, k, &idd, &wd, None);
            for tok in (0..t).filter(|&tok| here.contains(&(ids[tok] as usize))) {
                let (a, b) = (&got[tok * h..(tok + 1) * h], &want[tok * h..(tok + 1) * h]);
                let same = a.iter().zip(b).filter(|(x, y)| x.to_bits() == y.to_bits()).count();
                assert_eq!(same, h, "shard {si}, token {tok} (expert {}): {ctx}", ids[tok]);
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
        MoeLayer::new_shard(MoeWeights::from_checkpoint(&s, &sub).unwrap(), MoeOptions::new(4, k), global, ids)
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
        MoeLayer::new_shard(MoeWeights::from_checkpoint(&s, &sub).unwrap(), MoeOptions::new(4, 4), e, &[5, 2]).unwrap();
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
    assert!(got[..h].iter().all(|v| v.to_bits() != POISON_BF16), "token 0 not all written: {rp}");
    assert!(got[..h].iter().any(|v| v.to_bits() != 0), "token 0 has two slots here: {rp}");
}

/// The pre-dispatched forward over the expert-major layout of token dispatchers: `out[e, r]` is
/// the whole-layer forward's row for a token of `hidden[e, r]` routed to expert `e` alone with
/// weight 1 (bit for bit, both batch invariant), and within the f64 oracle's bound; rows past an
/// expert's count stay poisoned (counts of 0, of M, and above M, clamped); a small
/// `expected_rows` (a decode step) gives the same bits; with the NVFP4 intermediate the rows are the
/// permuted forward's with it, bit for bit; at decode without batch invariance the expected rows
/// give the permuted forward's tile and K splits (the same bits); an E x M above the workspace's
/// rows and the warp tile are errors.
#[test]
#[ignore = "needs a CUDA GPU"]
fn dispatched_forward_gives_each_experts_rows() {
    use nvfp4_moe::moe::DispatchedInput;
    let s = stream();
    let mut rng = test_rng();
    let rp = replay();
    let (e, h, i, m) = (16usize, 1024usize, 512usize, 24usize);
    let ck = random_checkpoint(&mut rng, e, h, i);
    let opts = MoeOptions { batch_invariant: true, ..MoeOptions::new(e * m, 1) };
    let layer = layer_of(&s, &ck, None, opts);
    let mut ws = layer.workspace(&s).unwrap();
    // Counts: empty experts, a full one, one above M (clamped to M), the rest random.
    let mut counts: Vec<i32> = (0..e).map(|_| rng.below(m as u64 + 1) as i32).collect();
    (counts[0], counts[1], counts[2], counts[3]) = (0, m as i32, m as i32 + 5, 0);
    let x = rng.normal_bf16(e * m * h, 1.0);
    let (xd, cd) = (s.clone_htod(&x).unwrap(), s.clone_htod(&counts).unwrap());
    let rows_of = |c: i32| c.clamp(0, m as i32) as usize;
    // The same rows as tokens of the internal-permutation forward, one expert each, weight 1.
    let (mut tokens, mut ids) = (Vec::new(), Vec::new());
    for (ex, &c) in counts.iter().enumerate() {
        for r in 0..rows_of(c) {
            tokens.extend_from_slice(&x[(ex * m + r) * h..(ex * m + r + 1) * h]);
            ids.push(ex as i32);
        }
    }
    let t = ids.len();
    let w = vec![1f32; t];
    let want = permuted_forward(&s, &layer, &tokens, &ids, &mut ws);
    let oracle = reference::routing::moe_layer(&tokens, t, &ids, &w, 1, &ck).unwrap();
    for expected_rows in [0usize, t, 8] {
        let ctx = format!("expected_rows {expected_rows}: {rp}");
        let mut out = poisoned_bf16(&s, e * m * h);
        let input = DispatchedInput { hidden: &xd, counts: &cd, max_tokens_per_expert: m, expected_rows };
        layer.forward_dispatched(&s, &input, &mut out, &mut ws).unwrap();
        let got = s.clone_dtoh(&out).unwrap();
        let (mut tok, mut err) = (0usize, RelErr::default());
        for (ex, &c) in counts.iter().enumerate() {
            for r in 0..m {
                let row = &got[(ex * m + r) * h..(ex * m + r + 1) * h];
                if r >= rows_of(c) {
                    assert!(row.iter().all(|v| v.to_bits() == POISON_BF16), "expert {ex} row {r} written: {ctx}");
                    continue;
                }
                let same = row.iter().zip(&want[tok * h..(tok + 1) * h]).filter(|(a, b)| a.to_bits() == b.to_bits());
                assert_eq!(same.count(), h, "expert {ex} row {r} differs from the permuted forward: {ctx}");
                for (g, o) in row.iter().zip(&oracle[tok * h..(tok + 1) * h]) {
                    err.add(f64::from(g.to_f32()), *o);
                }
                tok += 1;
            }
        }
        assert!(err.rel() <= 1e-2, "vs f64: rel {:.3e}: {ctx}", err.rel());
        err.report(&format!("dispatched forward, {ctx}"));
    }
    // Decode without batch invariance: 12 rows over 4 experts of a padded M = 24 (E x M = 384).
    // The permuted forward of those 12 rows takes the 128x16 tile and splits K; the dispatched one,
    // told the step's 12 rows (expected_rows), chooses the same tile and splits from them, so the
    // rows are the same bits (with E x M it would take larger tiles and no split).
    {
        let split = layer_of(&s, &ck, None, MoeOptions::new(e * m, 1));
        let mut ws_split = split.workspace(&s).unwrap();
        let dec_counts: Vec<i32> = (0..e).map(|ex| if ex % 4 == 1 { 3 } else { 0 }).collect();
        let cd2 = s.clone_htod(&dec_counts).unwrap();
        let (mut dec_tokens, mut dec_ids) = (Vec::new(), Vec::new());
        for (ex, &c) in dec_counts.iter().enumerate() {
            for r in 0..c as usize {
                dec_tokens.extend_from_slice(&x[(ex * m + r) * h..(ex * m + r + 1) * h]);
                dec_ids.push(ex as i32);
            }
        }
        let t2 = dec_ids.len();
        assert_eq!(split.gemm_tiles(t2, 1).unwrap().0, nvfp4_moe::GemmTile::M128N16, "{rp}");
        let want2 = permuted_forward(&s, &split, &dec_tokens, &dec_ids, &mut ws_split);
        let mut out = poisoned_bf16(&s, e * m * h);
        let input = DispatchedInput { hidden: &xd, counts: &cd2, max_tokens_per_expert: m, expected_rows: t2 };
        split.forward_dispatched(&s, &input, &mut out, &mut ws_split).unwrap();
        let got = s.clone_dtoh(&out).unwrap();
        let mut tok = 0;
        for (ex, &c) in dec_counts.iter().enumerate() {
            for r in 0..c as usize {
                let row = &got[(ex * m + r) * h..(ex * m + r + 1) * h];
                let same = row.iter().zip(&want2[tok * h..(tok + 1) * h]).filter(|(a, b)| a.to_bits() == b.to_bits());
                assert_eq!(
                    same.count(),
                    h,
                    "decode, split K: expert {ex} row {r} differs from the permuted forward: {rp}"
                );
                tok += 1;
            }
        }
    }
    // Refusals before anything runs.
    let big = DispatchedInput { hidden: &xd, counts: &cd, max_tokens_per_expert: m + 1, expected_rows: 0 };
    let mut out = poisoned_bf16(&s, e * (m + 1) * h);
    match layer.forward_dispatched(&s, &big, &mut out, &mut ws) {
        Err(Error::InvalidShape(msg)) => assert!(msg.contains("max_tokens_per_expert 25"), "{msg}: {rp}"),
        other => panic!("E x M above the workspace's rows: {other:?}: {rp}"),
    }
    // The NVFP4 intermediate in the same layout: each expert's rows are the permuted forward's
    // with the same intermediate, bit for bit (the packing and dequantization are per row); rows
    // past a count stay poisoned.
    let (td, idd) = (s.clone_htod(&tokens).unwrap(), s.clone_htod(&ids).unwrap());
    let g = layer.calibrate_nvfp4_scale(&s, &td, t, &idd, 1, &mut ws).unwrap();
    let fp4 = layer_of(
        &s,
        &ck,
        None,
        MoeOptions { intermediate: nvfp4_moe::Intermediate::Nvfp4 { decode_scale: g }, ..opts },
    );
    let mut ws4 = fp4.workspace(&s).unwrap();
    let want4 = permuted_forward(&s, &fp4, &tokens, &ids, &mut ws4);
    let mut out4 = poisoned_bf16(&s, e * m * h);
    let input = DispatchedInput { hidden: &xd, counts: &cd, max_tokens_per_expert: m, expected_rows: t };
    fp4.forward_dispatched(&s, &input, &mut out4, &mut ws4).unwrap();
    let got4 = s.clone_dtoh(&out4).unwrap();
    let (mut tok, mut err) = (0usize, RelErr::default());
    for (ex, &c) in counts.iter().enumerate() {
        for r in 0..m {
            let row = &got4[(ex * m + r) * h..(ex * m + r + 1) * h];
            if r >= rows_of(c) {
                assert!(row.iter().all(|v| v.to_bits() == POISON_BF16), "NVFP4: expert {ex} row {r} written: {rp}");
                continue;
            }
            let same = row.iter().zip(&want4[tok * h..(tok + 1) * h]).filter(|(a, b)| a.to_bits() == b.to_bits());
            assert_eq!(same.count(), h, "NVFP4: expert {ex} row {r} differs from the permuted forward: {rp}");
            for (g, o) in row.iter().zip(&oracle[tok * h..(tok + 1) * h]) {
                err.add(f64::from(g.to_f32()), *o);
            }
            tok += 1;
        }
    }
    // NVFP4's own error on top of the layer's: the layer tests' NVFP4 bound (0.15 overall).
    assert!(err.rel() <= 0.15, "NVFP4 intermediate vs f64: rel {:.3e}: {rp}", err.rel());
    err.report(&format!("dispatched forward, NVFP4 intermediate: {rp}"));
    let mut ws_bad = fp4.workspace(&s).unwrap();
    let warp = layer_of(&s, &ck, None, MoeOptions { tile: nvfp4_moe::GemmTile::WarpM16N8, ..opts });
    match warp.forward_dispatched(&s, &input, &mut out4, &mut ws_bad) {
        Err(Error::Invalid(msg)) => assert!(msg.contains("WarpM16N8"), "{msg}: {rp}"),
        other => panic!("the warp tile: {other:?}: {rp}"),
    }
}
