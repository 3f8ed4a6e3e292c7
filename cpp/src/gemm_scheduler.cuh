// The grouped GEMM's tile scheduler (grouped_gemm_sm90.cuh): persistent CTAs walk a tile list laid
// out [expert][row tile][feature tile]. Each CTA builds the per-expert tile prefix sum in shared
// memory from expert_offsets, or in the pre-dispatched layout from expert_counts (device memory),
// so the host never needs the row counts and experts with no rows cost nothing.
#pragma once

#include "gemm_config.cuh"

namespace nvfp4moe::gemm {

// Expert e's rows [begin, end), clamped so that malformed offsets can never address memory
// outside x or out (they then give wrong rows, not out-of-bounds accesses).
// In the pre-dispatched layout, e's rows start at e * expert_stride (the host checked that
// E x expert_stride <= total_rows < 2^31), expert_counts[e] of them, clamped the same way.
CUTLASS_HOST_DEVICE int2 expert_span(const Params& p, int e) {
  if (p.expert_stride > 0) {
    const int begin = e * p.expert_stride;
    const int count = min(max(p.expert_counts[e], 0), p.expert_stride);
    return make_int2(begin, begin + count);
  }
  int begin = min(max(p.expert_offsets[e], 0), p.total_rows);
  int end = min(max(p.expert_offsets[e + 1], begin), p.total_rows);
  return make_int2(begin, end);
}

// The rows of expert e that this launch covers (Params::row_part): all of expert_span, or its
// head or a tail of it. The kTailBlock-row tile's launches (a head, or all rows) always have
// tail_lo = 0, so its code reads tail_hi only: its consumers have no register to spare, and with
// tail_lo read there too ptxas serialized the 128x256 SwigluBf16 tile's wgmmas (C7511) and its L1
// ran ~8% slower (H100, 2026-12-07, PERF_NOTES.md session 24). Of the forms tried, this one (the
// tail as a select, then one branch on the part) left all four 128x256 epilogues pipelined.
// (Host too: cpp/tests/tail_split.cu runs it over tail_split_plan's launches.)
template <int kBlockN>
CUTLASS_HOST_DEVICE int2 expert_rows(const Params& p, int e) {
  int2 rr = expert_span(p, e);
  if (p.row_part != kAllRows) {
    const int rem = int(unsigned(rr.y - rr.x) % unsigned(kTailBlock));  // (rows >= 0)
    const int tail = (kBlockN == kTailBlock || rem > p.tail_lo) && rem <= p.tail_hi ? rem : 0;
    if (p.row_part == kHeadRows) rr.y -= tail; else rr.x = rr.y - tail;
  }
  return rr;
}

// Which expert and tiles a linear tile index names. prefix[e] = first tile of expert e.
struct TileCoord {
  int expert;
  int m_tile;  // 128-feature tile
  int n_tile;  // kBlockN-row tile within the expert
};

CUTLASS_DEVICE TileCoord decode_tile(int tile, const int* prefix, int experts, int m_tiles) {
  int lo = 0, hi = experts - 1;  // largest e with prefix[e] <= tile
  while (lo < hi) {
    int mid = (lo + hi + 1) / 2;
    if (prefix[mid] <= tile) lo = mid; else hi = mid - 1;
  }
  int local = tile - prefix[lo];
  return TileCoord{lo, local % m_tiles, local / m_tiles};
}

// The tile prefix in shared memory, prefix[e] = the first tile of expert e (prefix[E] = all
// tiles): counts first (e's count stored at e + 1), then an exclusive scan. Called by all kThreads
// threads of the CTA; ends with __syncthreads().
template <int kBlockN, int kThreads>
CUTLASS_DEVICE void build_tile_prefix(int* prefix, const Params& p, int m_tiles) {
  for (int e = threadIdx.x; e < p.experts; e += kThreads) {
    int2 rr = expert_rows<kBlockN>(p, e);
    int rows = rr.y - rr.x;
    prefix[e + 1] = rows > 0 ? m_tiles * ((rows + kBlockN - 1) / kBlockN) : 0;
  }
  if (threadIdx.x == 0) prefix[0] = 0;
  __syncthreads();
  if (threadIdx.x < 32) {
    // Warp-wide scan over consecutive runs of experts.
    int lane = threadIdx.x;
    int per = (p.experts + 31) / 32;
    int begin = min(lane * per, p.experts), end = min(begin + per, p.experts);
    int sum = 0;
    for (int e = begin; e < end; ++e) sum += prefix[e + 1];
    int incl = sum;
    CUTLASS_PRAGMA_UNROLL
    for (int d = 1; d < 32; d *= 2) {
      int v = __shfl_up_sync(0xFFFFFFFFu, incl, d);
      if (lane >= d) incl += v;
    }
    int run = incl - sum;
    for (int e = begin; e < end; ++e) {
      run += prefix[e + 1];
      prefix[e + 1] = run;
    }
  }
  __syncthreads();
}

}  // namespace nvfp4moe::gemm
