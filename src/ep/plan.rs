//! The host plan of one expert-parallel step: which of each rank's tokens go to which rank, where
//! each lands, and where its partial sums come back. Pure (no GPU), so every rule is tested here.

use crate::error::{Error, Result};

/// Which rank holds each global expert: checked to be a partition (every expert on exactly one
/// rank).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertOwners {
    /// `owner[e]`: the rank holding global expert `e`.
    owner: Vec<usize>,
    ranks: usize,
}

impl ExpertOwners {
    /// The owners of `shards[r]` (the global expert ids of rank `r`'s shard) over `global_experts`.
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for no ranks, an id not below `global_experts`, an id on two ranks, or
    /// an expert on no rank (its tokens' slots would be silently dropped).
    pub fn new(global_experts: usize, shards: &[&[usize]]) -> Result<Self> {
        if shards.is_empty() {
            return Err(Error::InvalidShape("an expert-parallel layer needs at least one rank".into()));
        }
        let mut owner = vec![usize::MAX; global_experts];
        for (rank, ids) in shards.iter().enumerate() {
            for &id in ids.iter() {
                let slot = owner.get_mut(id).ok_or_else(|| {
                    Error::InvalidShape(format!(
                        "rank {rank} holds expert {id}, not below global_experts {global_experts}"
                    ))
                })?;
                if *slot != usize::MAX {
                    return Err(Error::InvalidShape(format!("expert {id} is on rank {} and rank {rank}", *slot)));
                }
                *slot = rank;
            }
        }
        if let Some(e) = owner.iter().position(|&r| r == usize::MAX) {
            return Err(Error::InvalidShape(format!("expert {e} is on no rank: the shards must hold every expert")));
        }
        Ok(ExpertOwners { owner, ranks: shards.len() })
    }

    /// Ranks N.
    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// Global experts E.
    pub fn experts(&self) -> usize {
        self.owner.len()
    }

    /// The rank holding global expert `e` (`None` outside `[0, E)`).
    pub fn owner(&self, e: usize) -> Option<usize> {
        self.owner.get(e).copied()
    }
}

/// The plan of one step: for every source rank `s` and destination `d`, the rows `s` sends `d`
/// (one per token of `s` with at least one expert on `d`, in token order), laid out
/// destination-major in `s`'s send buffer and source-major in `d`'s receive buffer; the returned
/// partial sums travel the same rows back, into `s`'s return buffer in its send layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExchangePlan {
    ranks: usize,
    /// `counts[s][d]`: rows `s` sends `d`.
    counts: Vec<Vec<usize>>,
    /// `send_index[s]`: the token (of `s`) of each row of `s`'s send buffer.
    send_index: Vec<Vec<i32>>,
    /// `return_pos[s]`: i32 `[tokens_s, N]`, the row of `s`'s return buffer that holds rank `d`'s
    /// partial sum of token `t` at `[t, d]`, or -1 where `t` has no expert on `d`.
    return_pos: Vec<Vec<i32>>,
}

impl ExchangePlan {
    /// The plan for ranks whose tokens route to `ids[s]` (i32 `[tokens_s, top_k]`, global expert
    /// ids, as the router wrote them).
    ///
    /// # Errors
    /// [`Error::InvalidShape`] for a rank count other than the owners', an `ids[s]` whose length is
    /// not a multiple of `top_k` (or `top_k` 0), more rows than an i32 holds; [`Error::Invalid`]
    /// naming the rank, token, slot and value of an expert id outside `[0, E)` (its slot would be
    /// dropped silently).
    pub fn new(owners: &ExpertOwners, ids: &[Vec<i32>], top_k: usize) -> Result<Self> {
        let n = owners.ranks();
        if ids.len() != n {
            return Err(Error::InvalidShape(format!("{} ranks' routing for {n} ranks", ids.len())));
        }
        if top_k == 0 {
            return Err(Error::InvalidShape("top_k must be at least 1".into()));
        }
        let mut counts = vec![vec![0usize; n]; n];
        let mut per_dst: Vec<Vec<Vec<i32>>> = vec![vec![Vec::new(); n]; n];
        let mut return_pos = Vec::with_capacity(n);
        for (s, rank_ids) in ids.iter().enumerate() {
            if rank_ids.len() % top_k != 0 {
                return Err(Error::InvalidShape(format!(
                    "rank {s}'s topk_ids hold {} ids, not a multiple of top_k {top_k}",
                    rank_ids.len()
                )));
            }
            let tokens = rank_ids.len() / top_k;
            if tokens.checked_mul(n).is_none_or(|v| v > i32::MAX as usize) {
                return Err(Error::InvalidShape(format!("rank {s}: {tokens} tokens x {n} ranks exceed 2^31")));
            }
            let mut hit = vec![false; n];
            for t in 0..tokens {
                hit.iter_mut().for_each(|h| *h = false);
                for (j, &id) in rank_ids[t * top_k..(t + 1) * top_k].iter().enumerate() {
                    let owner = usize::try_from(id).ok().and_then(|e| owners.owner(e)).ok_or_else(|| {
                        Error::Invalid(format!(
                            "rank {s}: topk_ids[{t}, {j}] = {id} is outside [0, {})",
                            owners.experts()
                        ))
                    })?;
                    hit[owner] = true;
                }
                for (d, &h) in hit.iter().enumerate() {
                    if h {
                        per_dst[s][d].push(t as i32);
                    }
                }
            }
            let mut pos = vec![-1i32; tokens * n];
            let mut row = 0usize;
            for (d, rows) in per_dst[s].iter().enumerate() {
                counts[s][d] = rows.len();
                for &t in rows {
                    pos[t as usize * n + d] = row as i32;
                    row += 1;
                }
            }
            return_pos.push(pos);
        }
        let send_index = per_dst.into_iter().map(|rows| rows.concat()).collect();
        Ok(ExchangePlan { ranks: n, counts, send_index, return_pos })
    }

    /// Ranks N.
    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// `counts()[s][d]`: the rows rank `s` sends rank `d`.
    pub fn counts(&self) -> &[Vec<usize>] {
        &self.counts
    }

    /// The rows rank `s` sends (over all destinations, itself included).
    pub fn sent(&self, s: usize) -> usize {
        self.counts[s].iter().sum()
    }

    /// The rows rank `d` receives (over all sources, itself included).
    pub fn received(&self, d: usize) -> usize {
        self.counts.iter().map(|c| c[d]).sum()
    }

    /// Rank `s`'s token of each row of its send buffer (destination-major).
    pub fn send_index(&self, s: usize) -> &[i32] {
        &self.send_index[s]
    }

    /// Rank `s`'s i32 `[tokens_s, N]`: the row of its return buffer holding rank `d`'s partial sum
    /// of token `t`, or -1.
    pub fn return_pos(&self, s: usize) -> &[i32] {
        &self.return_pos[s]
    }

    /// Transposed counts (`[d][s]` = rows `d` returns to `s`): the plan of the return trip.
    pub fn transposed_counts(&self) -> Vec<Vec<usize>> {
        (0..self.ranks).map(|d| (0..self.ranks).map(|s| self.counts[s][d]).collect()).collect()
    }
}

/// Byte offsets of an all-to-all over `counts[s][d]` rows of `row_bytes`: `send[s][d]` in `s`'s
/// send buffer (destination-major), `recv[d][s]` in `d`'s receive buffer (source-major).
pub fn all_to_all_offsets(counts: &[Vec<usize>], row_bytes: usize) -> (Vec<Vec<usize>>, Vec<Vec<usize>>) {
    let n = counts.len();
    let mut send = vec![vec![0usize; n]; n];
    let mut recv = vec![vec![0usize; n]; n];
    for s in 0..n {
        let mut off = 0;
        for d in 0..n {
            send[s][d] = off;
            off += counts[s][d] * row_bytes;
        }
    }
    for d in 0..n {
        let mut off = 0;
        for s in 0..n {
            recv[d][s] = off;
            off += counts[s][d] * row_bytes;
        }
    }
    (send, recv)
}

/// `experts` global experts in `ranks` contiguous ranges of `experts / ranks` experts, rounded
/// down or up (rank `r` holds `r * E / N .. (r + 1) * E / N`), the usual expert-parallel placement.
pub fn contiguous_shards(experts: usize, ranks: usize) -> Vec<Vec<usize>> {
    (0..ranks).map(|r| (r * experts / ranks..(r + 1) * experts / ranks).collect()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owners(e: usize, shards: &[Vec<usize>]) -> ExpertOwners {
        let refs: Vec<&[usize]> = shards.iter().map(|s| s.as_slice()).collect();
        ExpertOwners::new(e, &refs).unwrap()
    }

    /// A token goes once to each rank holding one of its experts (not once per slot), rows keep
    /// token order within a destination, and the return positions invert the send layout.
    #[test]
    fn a_plan_sends_each_token_once_to_each_rank_of_its_experts() {
        // 6 experts on 3 ranks: rank 0 {0, 1}, rank 1 {2, 3}, rank 2 {4, 5}; top-2.
        let o = owners(6, &contiguous_shards(6, 3));
        let ids = vec![
            vec![0, 1, 2, 4, 5, 3], // rank 0: t0 -> ranks {0}, t1 -> {1, 2}, t2 -> {2, 1}
            vec![],                 // rank 1: no tokens
            vec![3, 2],             // rank 2: t0 -> rank {1}
        ];
        let p = ExchangePlan::new(&o, &ids, 2).unwrap();
        assert_eq!(p.counts(), &[vec![1, 2, 2], vec![0, 0, 0], vec![0, 1, 0]]);
        assert_eq!(p.send_index(0), &[0, 1, 2, 1, 2]);
        assert_eq!(p.send_index(1), &[] as &[i32]);
        assert_eq!(p.send_index(2), &[0]);
        assert_eq!(p.return_pos(0), &[0, -1, -1, -1, 1, 3, -1, 2, 4]);
        assert_eq!(p.return_pos(2), &[-1, 0, -1]);
        assert_eq!((p.sent(0), p.received(1), p.received(2)), (5, 3, 2));
        assert_eq!(p.transposed_counts(), vec![vec![1, 0, 0], vec![2, 0, 1], vec![2, 0, 0]]);
        let (send, recv) = all_to_all_offsets(p.counts(), 10);
        assert_eq!(send[0], vec![0, 10, 30]);
        assert_eq!(recv[1], vec![0, 20, 20]);
    }

    /// Random routings: every (token, rank of one of its experts) pair is sent exactly once and
    /// its return position points at the row that carried it; nothing else is sent.
    #[test]
    fn random_plans_are_consistent() {
        let mut rng = crate::testing::test_rng();
        for case in 0..50 {
            let (e, n, k) = (rng.range(1, 40), rng.range(1, 9), rng.range(1, 9));
            let (n, k) = (n.min(e), k.min(e));
            let shards = contiguous_shards(e, n);
            let o = owners(e, &shards);
            let ids: Vec<Vec<i32>> =
                (0..n).map(|_| (0..rng.below(20) as usize * k).map(|_| rng.below(e as u64) as i32).collect()).collect();
            let p = ExchangePlan::new(&o, &ids, k).unwrap();
            for (s, rank_ids) in ids.iter().enumerate() {
                let tokens = rank_ids.len() / k;
                let index = p.send_index(s);
                assert_eq!(index.len(), p.sent(s), "case {case}");
                for t in 0..tokens {
                    for d in 0..n {
                        let wants = rank_ids[t * k..(t + 1) * k].iter().any(|&id| o.owner(id as usize) == Some(d));
                        let pos = p.return_pos(s)[t * n + d];
                        assert_eq!(pos >= 0, wants, "case {case} rank {s} token {t} dest {d}");
                        if pos >= 0 {
                            assert_eq!(index[pos as usize], t as i32, "case {case}");
                            // The row lies in d's block of the send buffer.
                            let start: usize = p.counts()[s][..d].iter().sum();
                            assert!((start..start + p.counts()[s][d]).contains(&(pos as usize)), "case {case}");
                        }
                    }
                }
            }
            let total: usize = (0..n).map(|s| p.sent(s)).sum();
            assert_eq!(total, (0..n).map(|d| p.received(d)).sum::<usize>());
        }
    }

    /// Bad placements and routings are named.
    #[test]
    fn bad_placements_and_ids_are_errors() {
        let says = |r: Result<ExpertOwners>, text: &str| match r {
            Err(Error::InvalidShape(m)) => assert!(m.contains(text), "{m:?} should say {text:?}"),
            other => panic!("{other:?}"),
        };
        says(ExpertOwners::new(4, &[&[0, 1], &[2]]), "expert 3 is on no rank");
        says(ExpertOwners::new(4, &[&[0, 1], &[1, 2, 3]]), "expert 1 is on rank 0 and rank 1");
        says(ExpertOwners::new(4, &[&[0, 1, 4], &[2, 3]]), "not below global_experts 4");
        says(ExpertOwners::new(4, &[]), "at least one rank");
        let o = owners(4, &contiguous_shards(4, 2));
        match ExchangePlan::new(&o, &[vec![0, 1], vec![3, 4]], 2) {
            Err(Error::Invalid(m)) => assert!(m.contains("rank 1: topk_ids[0, 1] = 4 is outside [0, 4)"), "{m}"),
            other => panic!("{other:?}"),
        }
        match ExchangePlan::new(&o, &[vec![0, -1], vec![]], 2) {
            Err(Error::Invalid(m)) => assert!(m.contains("= -1"), "{m}"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(ExchangePlan::new(&o, &[vec![0, 1, 2], vec![]], 2), Err(Error::InvalidShape(_))));
        assert!(matches!(ExchangePlan::new(&o, &[vec![]], 2), Err(Error::InvalidShape(_))));
        assert!(matches!(ExchangePlan::new(&o, &[vec![], vec![]], 0), Err(Error::InvalidShape(_))));
    }

    #[test]
    fn contiguous_shards_cover_every_expert_once() {
        assert_eq!(contiguous_shards(5, 2), vec![vec![0, 1], vec![2, 3, 4]]);
        for (e, n) in [(256, 8), (8, 8), (7, 3), (1, 1)] {
            let s = contiguous_shards(e, n);
            let refs: Vec<&[usize]> = s.iter().map(|v| v.as_slice()).collect();
            assert!(ExpertOwners::new(e, &refs).is_ok());
        }
    }
}
