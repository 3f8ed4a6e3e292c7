//! MoE routing, permutation and combine on the CPU, and the f64 reference of a whole MoE
//! feed-forward layer: the oracle of the device routing kernels and of the layer.
//!
//! Conventions shared with the device side:
//! - top-k selection breaks ties by the lower expert id;
//! - the permutation is a stable counting sort of the `T x k` (token, slot) pairs by expert: pair
//!   `(t, j)` (flattened `t * k + j`) goes before every later pair of the same expert;
//! - combine sums `topk_weights[t, j] * y[pos(t, j)]` over `j = 0..k` in that order.

use half::bf16;

use crate::error::{Error, Result};
use crate::host::MoeCheckpoint;

/// Softmax over each token's `experts` router logits (FP32, max-subtracted), then the `top_k`
/// largest probabilities. The experts are chosen by comparing the logits themselves (softmax is
/// monotonic), so the choice is exact and identical on every device; ties go to the lower expert
/// id. With `renormalize` the k weights are divided by their sum. Returns
/// `(topk_ids [T, k], topk_weights [T, k])`.
///
/// # Errors
/// [`Error::InvalidShape`] for a `top_k` outside `1..=experts` or logits of the wrong length.
pub fn softmax_topk(
    logits: &[f32],
    tokens: usize,
    experts: usize,
    top_k: usize,
    renormalize: bool,
) -> Result<(Vec<i32>, Vec<f32>)> {
    if experts == 0 || top_k == 0 || top_k > experts {
        return Err(Error::InvalidShape(format!("need 1 <= top_k ({top_k}) <= experts ({experts})")));
    }
    if tokens.checked_mul(experts) != Some(logits.len()) {
        return Err(Error::InvalidShape(format!(
            "router logits hold {} values, expected tokens x experts = {tokens} x {experts}",
            logits.len()
        )));
    }
    let mut ids = Vec::with_capacity(tokens * top_k);
    let mut weights = Vec::with_capacity(tokens * top_k);
    for row in logits.chunks_exact(experts) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let exps: Vec<f32> = row.iter().map(|&v| (v - max).exp()).collect();
        let sum: f32 = exps.iter().sum();
        let mut order: Vec<usize> = (0..experts).collect();
        // Stable sort by descending logit keeps the lower id first among ties.
        order.sort_by(|&a, &b| row[b].partial_cmp(&row[a]).unwrap_or(std::cmp::Ordering::Equal));
        let chosen = &order[..top_k];
        let probs: Vec<f32> = chosen.iter().map(|&e| exps[e] / sum).collect();
        let norm: f32 = if renormalize { probs.iter().sum() } else { 1.0 };
        for (&e, &p) in chosen.iter().zip(&probs) {
            ids.push(e as i32);
            weights.push(p / norm);
        }
    }
    Ok((ids, weights))
}

/// The stable counting sort of the (token, slot) pairs by expert.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Permutation {
    /// `[E + 1]`: rows of expert e are `[expert_offsets[e], expert_offsets[e + 1])`.
    pub expert_offsets: Vec<i32>,
    /// `[T * k]`: the permuted row of pair `t * k + j`.
    pub row_of_pair: Vec<i32>,
    /// `[T * k]`: the pair `t * k + j` at each permuted row.
    pub pair_of_row: Vec<i32>,
}

/// Sorts the pairs of `topk_ids` (`[T, k]`) by expert, stably. An id outside `[0, experts)` is an
/// error naming the first such (token, slot, id) in flattened order; the device kernels record
/// the same one in their error word.
///
/// # Errors
/// [`Error::InvalidShape`] for a length not a multiple of `top_k`, [`Error::Invalid`] for a bad id.
pub fn permute(topk_ids: &[i32], top_k: usize, experts: usize) -> Result<Permutation> {
    check_ids(topk_ids, top_k, experts)?;
    let mut counts = vec![0i32; experts];
    for &id in topk_ids {
        counts[id as usize] += 1;
    }
    let mut expert_offsets = Vec::with_capacity(experts + 1);
    expert_offsets.push(0);
    for c in &counts {
        expert_offsets.push(expert_offsets.last().unwrap() + c);
    }
    let mut next: Vec<i32> = expert_offsets[..experts].to_vec();
    let mut row_of_pair = vec![0i32; topk_ids.len()];
    let mut pair_of_row = vec![0i32; topk_ids.len()];
    for (pair, &id) in topk_ids.iter().enumerate() {
        let row = next[id as usize];
        next[id as usize] += 1;
        row_of_pair[pair] = row;
        pair_of_row[row as usize] = pair as i32;
    }
    Ok(Permutation { expert_offsets, row_of_pair, pair_of_row })
}

/// [`permute`]'s checks of `topk_ids` (`[T, k]`): whole rows of `top_k >= 1` slots, every id in
/// `[0, experts)` (the first bad one named by token, slot and id).
fn check_ids(topk_ids: &[i32], top_k: usize, experts: usize) -> Result<()> {
    if top_k == 0 || !topk_ids.len().is_multiple_of(top_k) {
        return Err(Error::InvalidShape(format!(
            "topk_ids has {} entries, not a multiple of k = {top_k}",
            topk_ids.len()
        )));
    }
    if let Some((i, &id)) = topk_ids.iter().enumerate().find(|(_, &id)| id < 0 || id as usize >= experts) {
        return Err(Error::Invalid(format!(
            "topk_ids[{}, {}] = {id} is not an expert id in [0, {experts})",
            i / top_k,
            i % top_k
        )));
    }
    Ok(())
}

/// The rows of `hidden` (`[T, H]`) in permuted order (`[T * k, H]`). `top_k = 0` means no pairs:
/// the result is empty ([`permute`] refuses it).
///
/// # Panics
/// If `perm` is not [`permute`]'s for `T x top_k` pairs or `hidden` holds fewer than `T` rows (an
/// oracle helper: [`moe_layer`] checks its arguments and then calls it); [`try_gather_rows`]
/// returns an error instead.
pub fn gather_rows(hidden: &[bf16], hidden_size: usize, perm: &Permutation, top_k: usize) -> Vec<bf16> {
    if top_k == 0 {
        return Vec::new();
    }
    let mut out = Vec::with_capacity(perm.pair_of_row.len() * hidden_size);
    for &pair in &perm.pair_of_row {
        let t = pair as usize / top_k;
        out.extend_from_slice(&hidden[t * hidden_size..(t + 1) * hidden_size]);
    }
    out
}

/// `out[t] = sum_j topk_weights[t, j] * y[row_of_pair(t, j)]` over `j = 0..k` in order, in f64.
/// `top_k = 0` means no pairs: the result is empty ([`permute`] refuses it).
///
/// # Panics
/// If `perm` is not [`permute`]'s for the pairs of `topk_weights` or `y` holds fewer rows than
/// it permutes (an oracle helper: [`moe_layer`] checks its arguments and then calls it);
/// [`try_combine`] returns an error instead.
pub fn combine(y: &[f64], hidden_size: usize, perm: &Permutation, topk_weights: &[f32], top_k: usize) -> Vec<f64> {
    let Some(tokens) = topk_weights.len().checked_div(top_k) else {
        return Vec::new();
    };
    let mut out = vec![0f64; tokens * hidden_size];
    for t in 0..tokens {
        for j in 0..top_k {
            let row = perm.row_of_pair[t * top_k + j] as usize;
            let w = f64::from(topk_weights[t * top_k + j]);
            for (o, v) in out[t * hidden_size..(t + 1) * hidden_size].iter_mut().zip(&y[row * hidden_size..]) {
                *o += w * v;
            }
        }
    }
    out
}

/// Checks that `perm` permutes `pairs` pairs: both maps hold `pairs` entries in `[0, pairs)`.
fn check_permutation(perm: &Permutation, pairs: usize) -> Result<()> {
    let in_range = |v: &[i32]| v.len() == pairs && v.iter().all(|&i| i >= 0 && (i as usize) < pairs);
    if in_range(&perm.row_of_pair) && in_range(&perm.pair_of_row) {
        Ok(())
    } else {
        Err(Error::InvalidShape(format!(
            "the permutation does not map {pairs} pairs (row_of_pair: {}, pair_of_row: {} entries, or one out of range)",
            perm.row_of_pair.len(),
            perm.pair_of_row.len()
        )))
    }
}

/// [`gather_rows`] that checks its arguments first: `perm` maps `T x top_k` pairs for the `T`
/// rows of `hidden` (`[T, hidden_size]`).
///
/// # Errors
/// [`Error::InvalidShape`] for a `hidden_size` of 0, a `hidden` that is not whole rows, or a
/// permutation of another number of pairs.
pub fn try_gather_rows(hidden: &[bf16], hidden_size: usize, perm: &Permutation, top_k: usize) -> Result<Vec<bf16>> {
    if hidden_size == 0 || !hidden.len().is_multiple_of(hidden_size) {
        return Err(Error::InvalidShape(format!("hidden holds {} elements, not rows of {hidden_size}", hidden.len())));
    }
    let pairs = (hidden.len() / hidden_size).checked_mul(top_k).ok_or_else(|| {
        Error::InvalidShape(format!("T x top_k = {} x {top_k} overflows", hidden.len() / hidden_size))
    })?;
    check_permutation(perm, pairs)?;
    Ok(gather_rows(hidden, hidden_size, perm, top_k))
}

/// [`combine`] that checks its arguments first: `perm` maps the pairs of `topk_weights`
/// (`[T, top_k]`) and `y` holds a row of `hidden_size` for each.
///
/// # Errors
/// [`Error::InvalidShape`] for a `topk_weights` length not a multiple of `top_k`, a permutation of
/// another number of pairs, or a `y` of another number of rows.
pub fn try_combine(
    y: &[f64],
    hidden_size: usize,
    perm: &Permutation,
    topk_weights: &[f32],
    top_k: usize,
) -> Result<Vec<f64>> {
    let pairs = topk_weights.len();
    if (top_k == 0 && pairs != 0) || (top_k != 0 && !pairs.is_multiple_of(top_k)) {
        return Err(Error::InvalidShape(format!("topk_weights has {pairs} entries, not a multiple of k = {top_k}")));
    }
    check_permutation(perm, pairs)?;
    if pairs.checked_mul(hidden_size) != Some(y.len()) {
        return Err(Error::InvalidShape(format!(
            "y holds {} elements, the {pairs} pairs need rows of {hidden_size}",
            y.len()
        )));
    }
    Ok(combine(y, hidden_size, perm, topk_weights, top_k))
}

/// One MoE feed-forward layer in f64: route, `silu(x W_gate^T g_gate) * (x W_up^T g_up)` per
/// chosen expert, `W_down`, and the weighted sum over the k experts. `w13` holds per expert the
/// gate rows then the up rows (`n = 2I`, `k = H`), its decode scales the gate's; `w2` is `n = H`,
/// `k = I` (the fields of a [`MoeCheckpoint`] `ckpt`). The oracle for the device layer (which
/// rounds the SwiGLU output to BF16 between the GEMMs, well inside the 1e-2 tolerance).
///
/// # Errors
/// Weights that do not make one layer, inputs of the wrong length, or an expert id outside
/// `[0, E)`.
pub fn moe_layer(
    hidden: &[bf16],
    tokens: usize,
    topk_ids: &[i32],
    topk_weights: &[f32],
    top_k: usize,
    ckpt: &MoeCheckpoint,
) -> Result<Vec<f64>> {
    check_layer(hidden, tokens, topk_ids, topk_weights, top_k, ckpt)?;
    let (h, inter, experts) = (ckpt.w13.k, ckpt.w13.n / 2, ckpt.w13.experts);
    let perm = permute(topk_ids, top_k, experts)?;
    let rows = perm.pair_of_row.len();
    let mut y = vec![0f64; rows * h];
    let mut act = vec![0f64; inter];
    for row in 0..rows {
        let pair = perm.pair_of_row[row] as usize;
        let (t, e) = (pair / top_k, topk_ids[pair] as usize);
        expert_ffn(&hidden[t * h..(t + 1) * h], e, ckpt, &mut act, &mut y[row * h..(row + 1) * h]);
    }
    Ok(combine(&y, h, &perm, topk_weights, top_k))
}

/// [`moe_layer`]'s argument checks: the weights make one layer, in bounds, and the inputs have
/// `tokens` rows and `tokens x top_k` slots.
fn check_layer(
    hidden: &[bf16],
    tokens: usize,
    topk_ids: &[i32],
    topk_weights: &[f32],
    top_k: usize,
    ckpt: &MoeCheckpoint,
) -> Result<()> {
    let (w13, up_decode_scales, w2) = (&ckpt.w13, &ckpt.up_decode_scales, &ckpt.w2);
    let (h, inter, experts) = (w13.k, w13.n / 2, w13.experts);
    if w2.n != h || w2.k != inter || w2.experts != experts || up_decode_scales.len() != experts {
        return Err(Error::InvalidShape("w13, up scales and w2 do not describe one MoE layer".into()));
    }
    // The buffers must hold what the shapes say (the fields are public: a hand-made checkpoint
    // may not), so that the weights are read in bounds.
    for (what, w) in [("w13", w13), ("w2", w2)] {
        let codes = crate::host::checked_len(&[w.experts, w.n, w.k / 2])?;
        let scales = crate::host::checked_len(&[w.experts, w.n, w.k / 16])?;
        if w.k % 16 != 0 || w.codes.len() != codes || w.scales.len() != scales || w.decode_scales.len() != experts {
            return Err(Error::InvalidShape(format!(
                "{what}: {} code bytes, {} scale bytes and {} decode scales do not make {} experts x [{}, {}]",
                w.codes.len(),
                w.scales.len(),
                w.decode_scales.len(),
                w.experts,
                w.n,
                w.k
            )));
        }
    }
    let len_is = |len: usize, a: usize, b: usize| a.checked_mul(b) == Some(len);
    if !len_is(hidden.len(), tokens, h)
        || !len_is(topk_ids.len(), tokens, top_k)
        || !len_is(topk_weights.len(), tokens, top_k)
    {
        return Err(Error::InvalidShape("hidden, topk_ids or topk_weights has the wrong length".into()));
    }
    Ok(())
}

/// Expert `e` of `ckpt` on one token `x` (`[H]`) in f64, into `y` (`[H]`); `act` (`[I]`) is
/// scratch. [`moe_layer`]'s and [`moe_layer_shard`]'s one computation.
fn expert_ffn(x: &[bf16], e: usize, ckpt: &MoeCheckpoint, act: &mut [f64], y: &mut [f64]) {
    let (w13, up_decode_scales, w2) = (&ckpt.w13, &ckpt.up_decode_scales, &ckpt.w2);
    let inter = w13.n / 2;
    for (f, a) in act.iter_mut().enumerate() {
        let (mut g, mut u) = (0f64, 0f64);
        for (kk, xv) in x.iter().enumerate() {
            let xv = f64::from(xv.to_f32());
            g += xv * f64::from(w13.weight(e, f, kk));
            u += xv * f64::from(w13.weight(e, inter + f, kk));
        }
        let (g, u) = (g * f64::from(w13.decode_scales[e]), u * f64::from(up_decode_scales[e]));
        *a = g / (1.0 + (-g).exp()) * u;
    }
    for (o, yv) in y.iter_mut().enumerate() {
        let dot: f64 = act.iter().enumerate().map(|(kk, a)| a * f64::from(w2.weight(e, o, kk))).sum();
        *yv = dot * f64::from(w2.decode_scales[e]);
    }
}

/// A shard of one MoE layer in f64 (expert parallelism, issue 24): the layer's routing
/// (`topk_ids` in `[0, layer_experts)`), of which only the slots whose expert is in the shard
/// contribute; `shard` holds the layer's experts `expert_ids` (its expert `j` is the layer's
/// `expert_ids[j]`, as [`crate::io::load_expert_shard`] returns them). Each token's sum runs over
/// its slots in order, as [`moe_layer`]'s: the shards of a partition of the experts add up to the
/// whole layer's output up to the order of that final sum (a shard with all experts in order gives
/// [`moe_layer`]'s bits).
///
/// # Errors
/// As [`moe_layer`], with ids checked against `layer_experts`; `expert_ids` not `shard.w13.experts`
/// distinct numbers below `layer_experts`.
// (moe_layer's arguments, then the shard's three: kept flat like the oracle's other entry points.)
#[allow(clippy::too_many_arguments)]
pub fn moe_layer_shard(
    hidden: &[bf16],
    tokens: usize,
    topk_ids: &[i32],
    topk_weights: &[f32],
    top_k: usize,
    shard: &MoeCheckpoint,
    expert_ids: &[usize],
    layer_experts: usize,
) -> Result<Vec<f64>> {
    check_layer(hidden, tokens, topk_ids, topk_weights, top_k, shard)?;
    if expert_ids.len() != shard.w13.experts {
        return Err(Error::InvalidShape(format!(
            "{} expert ids for a shard of {} experts",
            expert_ids.len(),
            shard.w13.experts
        )));
    }
    // (layer id, shard index), sorted: nothing sized by `layer_experts`, which is only a bound.
    let mut local: Vec<(usize, usize)> = expert_ids.iter().enumerate().map(|(j, &e)| (e, j)).collect();
    local.sort_unstable();
    let repeated = local.windows(2).find(|w| w[0].0 == w[1].0).map(|w| w[0].0);
    let beyond = local.last().map(|l| l.0).filter(|&e| e >= layer_experts);
    if let Some(e) = repeated.or(beyond) {
        return Err(Error::Invalid(format!(
            "expert id {e} of the shard is repeated or not below the layer's {layer_experts} experts"
        )));
    }
    // The same check and message as [`permute`]'s.
    check_ids(topk_ids, top_k, layer_experts)?;
    let h = shard.w13.k;
    let mut out = vec![0f64; tokens * h];
    let (mut act, mut y) = (vec![0f64; shard.w13.n / 2], vec![0f64; h]);
    for (pair, &id) in topk_ids.iter().enumerate() {
        let Ok(at) = local.binary_search_by_key(&(id as usize), |&(e, _)| e) else { continue };
        let e = local[at].1;
        let t = pair / top_k;
        expert_ffn(&hidden[t * h..(t + 1) * h], e, shard, &mut act, &mut y);
        let w = f64::from(topk_weights[pair]);
        for (o, v) in out[t * h..(t + 1) * h].iter_mut().zip(&y) {
            *o += w * v;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;
    use crate::testing::{expert_subset, random_moe_checkpoint};

    /// Shards of a partition of the experts add up to the whole layer (f64, up to the order of each
    /// token's final sum), one shard with every expert in order gives its bits, and a shard whose
    /// experts nobody chose gives zeros.
    #[test]
    fn expert_shards_add_up_to_the_layer() {
        let mut rng = crate::testing::test_rng();
        let seed = format!("seed = {:#x}", rng.seed());
        let (e, h, inter, t, k) = (8usize, 32usize, 16usize, 6usize, 3usize);
        let ck = random_moe_checkpoint(&mut rng, e, h, inter);
        let hidden = rng.normal_bf16(t * h, 1.0);
        // Experts 6 and 7 are never chosen.
        let mut ids = Vec::with_capacity(t * k);
        for _ in 0..t {
            let mut pool: Vec<i32> = (0..6).collect();
            for j in 0..k {
                let r = j + rng.below((6 - j) as u64) as usize;
                pool.swap(j, r);
                ids.push(pool[j]);
            }
        }
        let w: Vec<f32> = (0..t * k).map(|_| rng.uniform(0.1, 1.0)).collect();
        let full = moe_layer(&hidden, t, &ids, &w, k, &ck).unwrap();
        let all: Vec<usize> = (0..e).collect();
        let same = moe_layer_shard(&hidden, t, &ids, &w, k, &ck, &all, e).unwrap();
        assert!(same.iter().zip(&full).all(|(a, b)| a.to_bits() == b.to_bits()), "{seed}");
        for partition in [&[&[0usize, 1, 2, 3][..], &[4, 5, 6, 7]][..], &[&[5, 0, 3], &[7, 6], &[1, 4, 2]]] {
            let mut sum = vec![0f64; t * h];
            for &shard in partition {
                let got = moe_layer_shard(&hidden, t, &ids, &w, k, &expert_subset(&ck, shard), shard, e).unwrap();
                if shard == [7, 6] {
                    assert!(got.iter().all(|&v| v == 0.0), "an unchosen shard contributed; {seed}");
                }
                sum.iter_mut().zip(&got).for_each(|(s, g)| *s += g);
            }
            let num: f64 = sum.iter().zip(&full).map(|(a, b)| (a - b) * (a - b)).sum();
            let den: f64 = full.iter().map(|b| b * b).sum();
            assert!(den > 0.0 && (num / den).sqrt() < 1e-12, "{partition:?}: {:e}; {seed}", (num / den).sqrt());
        }
        // Bad shard descriptions and ids.
        let sub = expert_subset(&ck, &[1, 2]);
        for (shard_ids, layer, want) in [
            (&[1usize][..], e, "1 expert ids for a shard of 2 experts"),
            (&[1, 1][..], e, "expert id 1 of the shard is repeated"),
            (&[1, 8][..], e, "expert id 8 of the shard is repeated or not below the layer's 8"),
            (&[1, 2][..], 2, "expert id 2 of the shard is repeated or not below the layer's 2"),
            (&[1, 2][..], usize::MAX, ""),
        ] {
            match moe_layer_shard(&hidden, t, &ids, &w, k, &sub, shard_ids, layer) {
                Err(err) if !want.is_empty() => assert!(err.to_string().contains(want), "{err}; {seed}"),
                r => assert!(want.is_empty() && r.is_ok(), "{shard_ids:?} of {layer}: {r:?}; {seed}"),
            }
        }
        let mut bad = ids.clone();
        bad[4] = e as i32;
        let err = moe_layer_shard(&hidden, t, &bad, &w, k, &sub, &[1, 2], e).unwrap_err().to_string();
        assert!(err.contains("topk_ids[1, 1] = 8"), "{err}; {seed}");
    }

    /// The checked forms of the oracle's indexing helpers: the same result on valid arguments,
    /// an error (not a panic) on each kind of bad one (issue 21's no-panic rule).
    #[test]
    fn try_forms_of_the_routing_helpers_check_their_arguments() {
        let mut rng = crate::testing::test_rng();
        let (tokens, top_k, experts, h) = (5usize, 3usize, 4usize, 8usize);
        let ids: Vec<i32> = (0..tokens * top_k).map(|_| rng.below(experts as u64) as i32).collect();
        let perm = permute(&ids, top_k, experts).unwrap();
        let hidden = rng.normal_bf16(tokens * h, 1.0);
        let weights: Vec<f32> = (0..tokens * top_k).map(|_| rng.uniform(0.0, 1.0)).collect();
        let y: Vec<f64> = (0..tokens * top_k * h).map(|i| i as f64 * 0.5 - 3.0).collect();

        let g = try_gather_rows(&hidden, h, &perm, top_k).unwrap();
        assert!(g.iter().zip(gather_rows(&hidden, h, &perm, top_k)).all(|(a, b)| a.to_bits() == b.to_bits()));
        assert_eq!(try_combine(&y, h, &perm, &weights, top_k).unwrap(), combine(&y, h, &perm, &weights, top_k));

        let bad = |r: Result<Vec<bf16>>| assert!(matches!(r, Err(Error::InvalidShape(_))), "{r:?}");
        bad(try_gather_rows(&hidden, 0, &perm, top_k));
        bad(try_gather_rows(&hidden[..h * tokens - 1], h, &perm, top_k));
        bad(try_gather_rows(&hidden[..h * (tokens - 1)], h, &perm, top_k)); // a token short
        bad(try_gather_rows(&hidden, h, &perm, top_k + 1));
        let mut out_of_range = perm.clone();
        out_of_range.pair_of_row[2] = (tokens * top_k) as i32;
        bad(try_gather_rows(&hidden, h, &out_of_range, top_k));
        let mut short = perm.clone();
        short.row_of_pair.pop();
        bad(try_gather_rows(&hidden, h, &short, top_k));

        let bad = |r: Result<Vec<f64>>| assert!(matches!(r, Err(Error::InvalidShape(_))), "{r:?}");
        bad(try_combine(&y[..y.len() - h], h, &perm, &weights, top_k)); // a row short
        bad(try_combine(&y, h + 1, &perm, &weights, top_k));
        bad(try_combine(&y, h, &perm, &weights[1..], top_k));
        bad(try_combine(&y, h, &perm, &weights, 0));
        let mut negative = perm.clone();
        negative.row_of_pair[0] = -1;
        bad(try_combine(&y, h, &negative, &weights, top_k));
        assert_eq!(try_combine(&[], h, &permute(&[], 1, experts).unwrap(), &[], 1).unwrap(), Vec::<f64>::new());
    }

    /// Sizes whose product overflows, and buffers shorter than a hand-made checkpoint's shape
    /// says, are errors, not panics (issue 21).
    #[test]
    fn oracle_arguments_that_do_not_fit_are_errors() {
        assert!(matches!(softmax_topk(&[0.0; 4], usize::MAX, 2, 1, false), Err(Error::InvalidShape(_))));
        let mut rng = crate::testing::test_rng();
        let ck = crate::testing::random_moe_checkpoint(&mut rng, 2, 32, 16);
        let hidden = vec![bf16::ONE; 32];
        assert!(moe_layer(&hidden, 1, &[1], &[1.0], 1, &ck).is_ok());
        assert!(matches!(moe_layer(&hidden, usize::MAX, &[1], &[1.0], 1, &ck), Err(Error::InvalidShape(_))));
        for edit in [
            (|c: &mut MoeCheckpoint| {
                c.w13.codes.pop();
            }) as fn(&mut MoeCheckpoint),
            |c| {
                c.w2.scales.pop();
            },
            |c| {
                c.w2.decode_scales.pop();
            },
            // (w2.n follows, so that the shapes still describe one layer: the k % 16 check fires.)
            |c| {
                c.w13.k = 24;
                c.w2.n = 24;
            },
        ] {
            let mut bad = ck.clone();
            edit(&mut bad);
            let r = moe_layer(&hidden, 1, &[1], &[1.0], 1, &bad);
            assert!(matches!(&r, Err(Error::InvalidShape(m)) if m.contains("code bytes")), "{r:?}");
        }
    }

    #[test]
    fn topk_picks_the_largest_with_low_id_ties() {
        let logits = [0.5f32, 2.0, 2.0, -1.0, 1.0, 3.0, 0.0, 3.0];
        let (ids, w) = softmax_topk(&logits, 2, 4, 2, false).unwrap();
        assert_eq!(ids, vec![1, 2, 1, 3]);
        // Token 0: two equal probabilities; token 1: experts 1 and 3 tie at 3.0.
        assert_eq!(w[0], w[1]);
        let (_, wn) = softmax_topk(&logits, 2, 4, 2, true).unwrap();
        assert!((wn[0] + wn[1] - 1.0).abs() < 1e-6 && (wn[2] + wn[3] - 1.0).abs() < 1e-6);
        assert!(softmax_topk(&logits, 2, 4, 5, false).is_err());
        assert!(softmax_topk(&logits[..7], 2, 4, 2, false).is_err());
    }

    #[test]
    fn topk_weights_are_softmax_probabilities() {
        let mut rng = crate::testing::test_rng();
        let seed = rng.seed();
        let (t, e, k) = (37usize, 64usize, 8usize);
        let logits: Vec<f32> = (0..t * e).map(|_| rng.normal() * 3.0).collect();
        let (ids, w) = softmax_topk(&logits, t, e, k, false).unwrap();
        for tok in 0..t {
            let row = &logits[tok * e..(tok + 1) * e];
            let z: f64 = row.iter().map(|&v| f64::from(v).exp()).sum();
            for j in 0..k {
                let id = ids[tok * k + j] as usize;
                let p = f64::from(row[id]).exp() / z;
                assert!((f64::from(w[tok * k + j]) - p).abs() < 1e-5, "seed {seed}");
                // Every unchosen expert has a logit no larger than the chosen ones.
                if j + 1 < k {
                    assert!(row[id] >= row[ids[tok * k + j + 1] as usize], "seed {seed}");
                }
            }
            let min_chosen = (0..k).map(|j| row[ids[tok * k + j] as usize]).fold(f32::INFINITY, f32::min);
            let chosen: Vec<i32> = ids[tok * k..(tok + 1) * k].to_vec();
            for (x, &v) in row.iter().enumerate() {
                if !chosen.contains(&(x as i32)) {
                    assert!(v <= min_chosen, "seed {seed}");
                }
            }
        }
    }

    #[test]
    fn permutation_is_a_stable_sort_by_expert() {
        let mut rng = crate::testing::test_rng();
        let seed = rng.seed();
        let (t, k, e) = (300usize, 8usize, 16usize);
        // Skewed: experts 0..3 hot, some experts empty.
        let ids: Vec<i32> =
            (0..t * k).map(|_| if rng.below(2) == 0 { rng.below(4) as i32 } else { rng.range(8, 16) as i32 }).collect();
        let p = permute(&ids, k, e).unwrap();
        assert_eq!(p.expert_offsets[0], 0);
        assert_eq!(*p.expert_offsets.last().unwrap() as usize, t * k);
        assert_eq!(p.expert_offsets[5], p.expert_offsets[4], "expert 4 is empty (seed {seed})");
        for row in 0..t * k {
            let pair = p.pair_of_row[row] as usize;
            assert_eq!(p.row_of_pair[pair] as usize, row);
            let ex = ids[pair] as usize;
            assert!((p.expert_offsets[ex] as usize..p.expert_offsets[ex + 1] as usize).contains(&row));
            if row + 1 < t * k && ids[p.pair_of_row[row + 1] as usize] as usize == ex {
                assert!(p.pair_of_row[row + 1] as usize > pair, "not stable (seed {seed})");
            }
        }
    }

    #[test]
    fn bad_ids_are_named() {
        let ids = [0i32, 3, 1, 7, -1, 2];
        let msg = permute(&ids, 2, 4).unwrap_err().to_string();
        assert!(msg.contains("topk_ids[1, 1] = 7"), "{msg}");
        assert!(permute(&ids[..5], 2, 4).is_err());
    }

    #[test]
    fn gather_and_combine_invert_each_other_for_identity_experts() {
        let mut rng = crate::testing::test_rng();
        let (t, k, e, h) = (9usize, 2usize, 4usize, 16usize);
        let hidden = rng.normal_bf16(t * h, 1.0);
        let ids: Vec<i32> = (0..t * k).map(|_| rng.below(e as u64) as i32).collect();
        let p = permute(&ids, k, e).unwrap();
        let rows = gather_rows(&hidden, h, &p, k);
        let y: Vec<f64> = rows.iter().map(|v| f64::from(v.to_f32())).collect();
        let w = vec![0.5f32; t * k];
        let out = combine(&y, h, &p, &w, k);
        for (o, x) in out.iter().zip(&hidden) {
            assert!((o - f64::from(x.to_f32())).abs() < 1e-12);
        }
    }

    #[test]
    fn layer_reference_agrees_with_the_element_references() {
        use crate::reference::{swiglu_element, ExpertWeightsHost};
        let mut rng = crate::testing::test_rng();
        let seed = rng.seed();
        let (t, e, h, inter, k) = (5usize, 3usize, 32usize, 16usize, 2usize);
        let mk = |rng: &mut Rng, n: usize, kk: usize| ExpertWeightsHost {
            experts: e,
            n,
            k: kk,
            codes: rng.bytes(e * n * kk / 2),
            scales: (0..e * n * kk / 16).map(|_| rng.range(0x28, 0x40) as u8).collect(),
            decode_scales: (0..e).map(|_| rng.uniform(0.5, 2.0)).collect(),
        };
        let w13 = mk(&mut rng, 2 * inter, h);
        let w2 = mk(&mut rng, h, inter);
        let up: Vec<f32> = (0..e).map(|_| rng.uniform(0.5, 2.0)).collect();
        let hidden = rng.normal_bf16(t * h, 1.0);
        let ids: Vec<i32> = (0..t * k).map(|i| ((i * 7 + 1) % e) as i32).collect();
        let w: Vec<f32> = (0..t * k).map(|_| rng.uniform(0.1, 1.0)).collect();
        let layer = MoeCheckpoint::from_experts(w13.clone(), up.clone(), w2.clone());
        let out = moe_layer(&hidden, t, &ids, &w, k, &layer).unwrap();
        for tok in 0..t {
            for o in 0..h {
                let mut want = 0f64;
                for j in 0..k {
                    let ex = ids[tok * k + j] as usize;
                    let y: f64 = (0..inter)
                        .map(|f| {
                            let (_, a) = swiglu_element(&hidden, &w13, ex, tok, f, w13.decode_scales[ex], up[ex]);
                            a * f64::from(w2.weight(ex, o, f))
                        })
                        .sum();
                    want += f64::from(w[tok * k + j]) * y * f64::from(w2.decode_scales[ex]);
                }
                let got = out[tok * h + o];
                assert!(
                    (got - want).abs() <= 1e-9 * want.abs().max(1.0),
                    "token {tok} out {o}: {got} vs {want} (seed {seed})"
                );
            }
        }
    }

    /// k = 0 is a typed error wherever a count of pairs is taken from it, and never a division
    /// by zero (issue 21).
    #[test]
    fn top_k_zero_is_an_error_not_a_division_by_zero() {
        assert!(matches!(softmax_topk(&[0.5, 1.0], 1, 2, 0, true), Err(Error::InvalidShape(_))));
        assert!(matches!(permute(&[], 0, 4), Err(Error::InvalidShape(_))));
        assert!(matches!(permute(&[1, 2], 0, 4), Err(Error::InvalidShape(_))));
        let ck = crate::testing::random_moe_checkpoint(&mut crate::testing::test_rng(), 1, 16, 16);
        let x = vec![bf16::ONE; 16];
        assert!(moe_layer(&x, 1, &[0], &[1.0], 1, &ck).is_ok());
        for tokens in [0, 1] {
            let e = moe_layer(&x[..16 * tokens], tokens, &[], &[], 0, &ck).unwrap_err();
            assert!(matches!(&e, Error::InvalidShape(m) if m.contains("k = 0")), "{e}");
        }
        // The infallible helpers see no pairs: empty results.
        let p = Permutation { expert_offsets: vec![0, 0], row_of_pair: vec![], pair_of_row: vec![] };
        assert!(gather_rows(&x, 16, &p, 0).is_empty());
        assert!(combine(&[], 16, &p, &[], 0).is_empty());
        let p = Permutation { expert_offsets: vec![0, 1], row_of_pair: vec![0], pair_of_row: vec![0] };
        assert!(gather_rows(&x, 16, &p, 0).is_empty());
        assert!(combine(&[0.0; 16], 16, &p, &[1.0], 0).is_empty());
    }
}
