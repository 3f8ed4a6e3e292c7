// Split-K over the CTAs of a thread-block cluster, reduced through distributed shared memory.
//
// When a launch has too few tiles to occupy every SM (decode at T = 1 on few experts), each tile
// is computed by the `splits` CTAs of one cluster, CTA `rank` taking the K stages
// [rank * kps, min(k_tiles, (rank + 1) * kps)). The non-leader CTAs store their FP32 accumulators
// into the leader's (rank 0) shared memory and arrive on its `red_full` barrier; the leader adds
// them to its own in rank order (so the sum is the same on every run: no atomics, no dependence on
// arrival order), tells each non-leader through its `red_empty` barrier that the buffer may be
// reused, and runs the epilogue. No global workspace, no counters to reset: CUDA-graph safe.
//
// One consumer warpgroup `cw` of a CTA pairs with warpgroup `cw` of the leader; its 128 threads
// store their accumulators as float4 at (rank - 1, cw, i4, thread), so each warp's stores are
// contiguous.
#pragma once

#include <cute/arch/cluster_sm90.hpp>
#include <cute/arch/util.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>

namespace nvfp4moe::gemm::splitk {

// Shared storage of the reduction: kAccum accumulator floats per consumer thread, two consumer
// warpgroups of 128 threads, kMaxSplits - 1 non-leader slices.
template <int kMaxSplits, int kAccum>
struct Storage {
  static_assert(kMaxSplits >= 2 && kAccum % 4 == 0, "a split needs a partner and float4 pieces");
  float4 red[kMaxSplits - 1][2][kAccum / 4][128];  // (slice, cw, i4, thread), leader only
  alignas(8) uint64_t red_full[2];                 // leader: (splits - 1) x 128 arrivals per tile
  alignas(8) uint64_t red_empty[2];                // non-leaders: 128 arrivals (the leader's cw)
};

struct NoStorage {};

CUTLASS_DEVICE uint32_t smem_addr(const void* p) { return cute::cast_smem_ptr_to_uint(p); }

// The same shared-memory offset in the CTA of cluster rank `rank`.
CUTLASS_DEVICE uint32_t at_rank(uint32_t addr, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}

CUTLASS_DEVICE void store_cluster(uint32_t addr, float a, float b, float c, float d) {
  asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "f"(a), "f"(b), "f"(c), "f"(d)
               : "memory");
}

// Arrive on an mbarrier anywhere in the cluster; release at cluster scope orders this thread's
// earlier accesses (the stores above, or the leader's reads) before the arrival.
CUTLASS_DEVICE void arrive_cluster(uint32_t cluster_addr) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(cluster_addr) : "memory");
}

// Wait for the phase of parity `parity` of a barrier in this CTA, acquiring at cluster scope. The
// loop exits for the whole warp at once: with a per-thread exit ptxas keeps the mainloop's pipeline
// state in vector registers (a move to a uniform register per wgmma descriptor: ~40 more
// instructions per stage of the split-K kernel, SASS 2026-12-02).
CUTLASS_DEVICE void wait_cluster(uint32_t addr, uint32_t parity) {
  auto done = [&] {
    uint32_t ok;
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(ok)
        : "r"(addr), "r"(parity)
        : "memory");
    return ok != 0;
  };
  while (!__all_sync(0xFFFFFFFFu, done())) {
  }
}

// One thread initializes the barriers; every thread of every CTA of the cluster then syncs, so no
// remote arrival can reach a barrier before it exists (and every CTA is running).
template <class S>
CUTLASS_DEVICE void init(S& s, int splits) {
  if (threadIdx.x == 0) {
    CUTLASS_PRAGMA_UNROLL
    for (int c = 0; c < 2; ++c) {
      cutlass::arch::ClusterBarrier::init(&s.red_full[c], uint32_t(splits - 1) * 128);
      cutlass::arch::ClusterBarrier::init(&s.red_empty[c], 128);
    }
    cutlass::arch::fence_barrier_init();
  }
  cute::cluster_arrive_relaxed();
  cute::cluster_wait();
}

// Non-leader, consumer warpgroup cw, thread t: hand this CTA's partial sums of one tile to the
// leader. `handed` counts earlier hand-overs: from the second on, wait until the leader has read
// the previous one.
template <int kAccum, class S, class Accum>
CUTLASS_DEVICE void send(S& s, int rank, int cw, int t, int handed, const Accum& accum) {
  if (handed > 0) {
    wait_cluster(smem_addr(&s.red_empty[cw]), uint32_t(handed - 1) & 1u);
  }
  const uint32_t dst = at_rank(smem_addr(&s.red[rank - 1][cw][0][t]), 0);
  CUTLASS_PRAGMA_UNROLL
  for (int i4 = 0; i4 < kAccum / 4; ++i4) {
    store_cluster(dst + uint32_t(i4) * 128u * 16u, accum(4 * i4), accum(4 * i4 + 1), accum(4 * i4 + 2),
                  accum(4 * i4 + 3));
  }
  arrive_cluster(at_rank(smem_addr(&s.red_full[cw]), 0));
}

// Non-leader, before exiting: the leader's last arrival on red_empty must land in a live CTA.
template <class S>
CUTLASS_DEVICE void drain(S& s, int cw, int handed) {
  if (handed > 0) {
    wait_cluster(smem_addr(&s.red_empty[cw]), uint32_t(handed - 1) & 1u);
  }
}

// Leader, consumer warpgroup cw, thread t: add the non-leaders' partial sums of the tile numbered
// `reduced` (counting from 0) to accum in rank order, then free their buffers.
template <int kAccum, class S, class Accum>
CUTLASS_DEVICE void reduce(S& s, int splits, int cw, int t, int reduced, Accum& accum) {
  wait_cluster(smem_addr(&s.red_full[cw]), uint32_t(reduced) & 1u);
  for (int j = 0; j < splits - 1; ++j) {
    CUTLASS_PRAGMA_UNROLL
    for (int i4 = 0; i4 < kAccum / 4; ++i4) {
      const float4 v = s.red[j][cw][i4][t];
      accum(4 * i4) += v.x;
      accum(4 * i4 + 1) += v.y;
      accum(4 * i4 + 2) += v.z;
      accum(4 * i4 + 3) += v.w;
    }
  }
  const uint32_t empty = smem_addr(&s.red_empty[cw]);
  for (int j = 1; j < splits; ++j) {
    arrive_cluster(at_rank(empty, uint32_t(j)));
  }
}

}  // namespace nvfp4moe::gemm::splitk
