// MoE routing (softmax top-k), the stable permutation of (token, slot) pairs by expert, the
// gather of hidden rows, and the deterministic combine. Everything runs on the device with no
// host synchronization; the permutation is deterministic (no atomics decide any order).
//
// Permutation over chunks of 1024 pairs, in three steps:
//   count:   per chunk, a shared-memory histogram of expert ids -> counts (chunks, E)
//   scan:    per expert, an exclusive scan over chunks, then over experts -> offsets
//   scatter: per chunk (scatter_chunk), each warp ranks its lanes within equal ids (match_any), and
//            the 32 warps claim their ids' slots in warp order, so pair i precedes every later pair
//            of its id.
// One launch when all pairs fit in one chunk (route_small_kernel: decode and small batches); one
// cooperative launch when the chunks' CTAs fit on the GPU at once (route_fused_kernel: a grid
// barrier between count and scan, each CTA scans what its chunk needs); three launches beyond
// (count_kernel, scan_kernel, scatter_kernel).
#include "env.hpp"
#include "nvfp4moe/nvfp4moe.h"
#include "pdl.cuh"
#include "routing_limits.hpp"
#include "status.hpp"

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cutlass/cutlass.h>

#include <atomic>
#include <cfloat>
#include <type_traits>

namespace nvfp4moe {
namespace {

constexpr int kChunk = 1024;
constexpr int kMaxExperts = 1024;
constexpr int kMaxTopK = 32;

CUTLASS_DEVICE bool better(float v, int id, float v2, int id2) { return v > v2 || (v == v2 && id < id2); }

// Where the routing ids point: the layer's experts (map null, ids in [0, experts)), or an expert
// shard's (ids in [0, global_experts), map[id] the local expert or -1 for another shard's).
struct ExpertIds {
  const int* __restrict__ map;
  int global_experts;  // the ids' range: experts without a map
  int experts;         // local experts

  // A pair's local expert, or -1: for a bad id (outside the ids' range: `*bad` set) and for an
  // expert of another shard (a map entry outside [0, experts) counts as one, never an index).
  CUTLASS_DEVICE int local(int id, bool* bad) const {
    *bad = id < 0 || id >= global_experts;
    if (*bad) return -1;
    const int e = map ? map[id] : id;
    return e >= 0 && e < experts ? e : -1;
  }
};

// One warp per token.
__global__ void softmax_topk_kernel(const float* __restrict__ logits, int tokens, int experts, int top_k,
                                    bool renormalize, int* __restrict__ ids, float* __restrict__ weights) {
  pdl::wait_and_release();
  __shared__ unsigned char chosen[8][kMaxExperts];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int t = blockIdx.x * 8 + warp;
  if (t >= tokens) return;
  const float* row = logits + int64_t(t) * experts;
  float mx = -FLT_MAX;
  for (int e = lane; e < experts; e += 32) {
    chosen[warp][e] = 0;
    float v = row[e];
    mx = fmaxf(mx, v != v ? -FLT_MAX : v);
  }
  for (int d = 16; d > 0; d /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, d));
  float sum = 0.0f;
  for (int e = lane; e < experts; e += 32) {
    float v = row[e];
    sum += v != v ? 0.0f : __expf(v - mx);
  }
  for (int d = 16; d > 0; d /= 2) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, d);
  __syncwarp();
  float picked = 0.0f, total = 0.0f;
  for (int j = 0; j < top_k; ++j) {
    float bv = -FLT_MAX;
    int bid = 0x7FFFFFFF;
    for (int e = lane; e < experts; e += 32) {
      float v = row[e];
      v = v != v ? -FLT_MAX : v;  // NaN logits rank last
      if (!chosen[warp][e] && better(v, e, bv, bid)) {
        bv = v;
        bid = e;
      }
    }
    for (int d = 16; d > 0; d /= 2) {
      float ov = __shfl_xor_sync(0xFFFFFFFFu, bv, d);
      int oid = __shfl_xor_sync(0xFFFFFFFFu, bid, d);
      if (better(ov, oid, bv, bid)) {
        bv = ov;
        bid = oid;
      }
    }
    if (lane == 0) chosen[warp][bid] = 1;
    __syncwarp();
    float p = __expf(bv - mx) / sum;
    if (lane == j) picked = p;
    if (lane == 0) ids[int64_t(t) * top_k + j] = bid;
    total += p;
  }
  if (lane < top_k) weights[int64_t(t) * top_k + lane] = renormalize ? picked / total : picked;
}

// Pair i's local expert (-1: none, or i >= pairs), counted in the shared-memory histogram `hist`;
// a bad id is recorded in the error word (the lowest pair index wins).
CUTLASS_DEVICE int count_pair(const int* __restrict__ ids, int i, int pairs, const ExpertIds& x, int* hist,
                              unsigned long long* __restrict__ error) {
  if (i >= pairs) return -1;
  const int given = ids[i];
  bool bad;
  const int e = x.local(given, &bad);
  if (e >= 0) atomicAdd(&hist[e], 1);
  if (bad) atomicMin(error, (static_cast<unsigned long long>(i) << 32) | static_cast<unsigned int>(given));
  return e;
}

__global__ void count_kernel(const int* __restrict__ ids, int pairs, ExpertIds x, int* __restrict__ counts,
                             unsigned long long* __restrict__ error) {
  pdl::wait_and_release();
  const int experts = x.experts;
  __shared__ int hist[kMaxExperts];
  for (int e = threadIdx.x; e < experts; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  for (int i = blockIdx.x * kChunk + threadIdx.x; i < min(pairs, (blockIdx.x + 1) * kChunk); i += blockDim.x) {
    count_pair(ids, i, pairs, x, hist, error);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < experts; e += blockDim.x) counts[int64_t(blockIdx.x) * experts + e] = hist[e];
}

// One CTA of 1024 threads: counts (chunks, E) -> each chunk's rows of expert e before it, within
// e's rows (in place: an exclusive scan over the chunks, per expert), and offsets [E+1]. The
// scatter adds offsets[e] (so the counts are read and written once, not twice). Thread e reads its
// column kScanBatch chunks at a time, all loads of a batch issued before any store: a load after a
// store to the same array was one dependent L2 round trip per chunk (19 us at 64 chunks, deepseek-v3
// T = 8192, H100 2026-12-06). The column walked by a pointer: 64-bit indices recomputed per load
// made ptxas spill (sass-check).
constexpr int kScanBatch = 16;
__global__ void __launch_bounds__(1024) scan_kernel(int* __restrict__ counts, int chunks, int experts,
                                                    int* __restrict__ offsets) {
  pdl::wait_and_release();
  __shared__ int total[kMaxExperts];
  const int e = threadIdx.x;
  int run = 0;
  if (e < experts) {
    int* col = counts + e;  // (c, e) at col[c * experts]
    const int64_t step = experts;
    for (int c0 = 0; c0 < chunks; c0 += kScanBatch, col += kScanBatch * step) {
      int v[kScanBatch];
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kScanBatch; ++j) v[j] = c0 + j < chunks ? col[j * step] : 0;
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kScanBatch; ++j) {
        if (c0 + j < chunks) col[j * step] = run;
        run += v[j];
      }
    }
  }
  total[e] = e < experts ? run : 0;
  __syncthreads();
  // Inclusive Hillis-Steele scan over the 1024 slots.
  for (int d = 1; d < kMaxExperts; d *= 2) {
    int v = e >= d ? total[e - d] : 0;
    __syncthreads();
    total[e] += v;
    __syncthreads();
  }
  if (e < experts) offsets[e] = total[e] - run;  // exclusive
  if (e == experts - 1) offsets[experts] = total[e];
}

// The scatter of one chunk, called by all 1024 threads of a CTA after a __syncthreads: thread `t`
// holds pair i's expert id (or -1) and places it after every earlier pair of that id. Each warp
// ranks its lanes within equal ids (match_any); then warp 0 claims the slots from next[] for the
// 32 warps in warp order (its lane l serves lane l of every warp; within a warp the claiming lanes
// hold distinct ids), so the permutation is deterministic and stable. (The 32 warps claiming in
// turn, one __syncthreads per turn, made this most of route_small_kernel's time, 2026-12-02.)
CUTLASS_DEVICE void scatter_chunk(int id, int i, int pairs, int* next, int* claimed, int* __restrict__ row_of_pair,
                                  int* __restrict__ pair_of_row) {
  const int t = threadIdx.x, lane = t % 32, warp = t / 32;
  const unsigned peers = __match_any_sync(0xFFFFFFFFu, id);
  const int leader = __ffs(peers) - 1;
  const int rank = __popc(peers & ((1u << lane) - 1));
  // A claim request: (id << 8) | count at the leader of each id's lanes, -1 elsewhere.
  claimed[t] = id >= 0 && lane == leader ? (id << 8) | __popc(peers) : -1;
  __syncthreads();
  if (warp == 0) {
    int req[32];
    CUTLASS_PRAGMA_UNROLL
    for (int w = 0; w < 32; ++w) req[w] = claimed[w * 32 + lane];
    CUTLASS_PRAGMA_UNROLL
    for (int w = 0; w < 32; ++w) {
      if (req[w] >= 0) {
        const int e = req[w] >> 8;
        const int first = next[e];
        next[e] = first + (req[w] & 0xFF);
        req[w] = first;
      }
      __syncwarp();
    }
    CUTLASS_PRAGMA_UNROLL
    for (int w = 0; w < 32; ++w) claimed[w * 32 + lane] = req[w];
  }
  __syncthreads();
  if (i < pairs) {
    if (id >= 0) {
      int row = claimed[warp * 32 + leader] + rank;
      row_of_pair[i] = row;
      pair_of_row[row] = i;
    } else {
      row_of_pair[i] = -1;
    }
  }
}

// One CTA of 1024 threads per chunk: expert e's first row for this chunk is offsets[e] plus the
// chunk's base within e's rows (scan_kernel).
__global__ void __launch_bounds__(1024) scatter_kernel(const int* __restrict__ ids, int pairs, ExpertIds x,
                                                       const int* __restrict__ bases, const int* __restrict__ offsets,
                                                       int* __restrict__ row_of_pair, int* __restrict__ pair_of_row) {
  pdl::wait_and_release();
  const int experts = x.experts;
  __shared__ int next[kMaxExperts];
  __shared__ int claimed[1024];
  for (int e = threadIdx.x; e < experts; e += 1024) next[e] = offsets[e] + bases[int64_t(blockIdx.x) * experts + e];
  const int i = blockIdx.x * kChunk + threadIdx.x;
  bool bad;
  const int id = i < pairs ? x.local(ids[i], &bad) : -1;  // (count_kernel recorded the bad ones)
  __syncthreads();
  scatter_chunk(id, i, pairs, next, claimed, row_of_pair, pair_of_row);
}

// The inclusive scan of one value per thread over a CTA of 1024 threads: within each warp by
// shuffles, then over the 32 warp totals (two __syncthreads; a Hillis-Steele scan over shared
// memory took twenty). Called by all threads; warp_total is 32 ints of shared memory.
CUTLASS_DEVICE int block_inclusive_scan(int value, int* warp_total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int incl = value;
  CUTLASS_PRAGMA_UNROLL
  for (int d = 1; d < 32; d *= 2) {
    int v = __shfl_up_sync(0xFFFFFFFFu, incl, d);
    if (lane >= d) incl += v;
  }
  if (lane == 31) warp_total[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int wt = warp_total[lane], wincl = wt;
    CUTLASS_PRAGMA_UNROLL
    for (int d = 1; d < 32; d *= 2) {
      int v = __shfl_up_sync(0xFFFFFFFFu, wincl, d);
      if (lane >= d) wincl += v;
    }
    warp_total[lane] = wincl - wt;  // exclusive: the counts of the warps before
  }
  __syncthreads();
  return incl + warp_total[warp];
}

// pairs <= kChunk (decode and small batches): count, scan and scatter in one CTA of 1024 threads,
// one launch instead of three, writing exactly what the three-launch path writes (with one chunk,
// the chunk's bases are the expert offsets, and the scatter claims slots in the same warp order).
__global__ void __launch_bounds__(1024) route_small_kernel(const int* __restrict__ ids, int pairs, ExpertIds x,
                                                           int* __restrict__ offsets, int* __restrict__ row_of_pair,
                                                           int* __restrict__ pair_of_row,
                                                           unsigned long long* __restrict__ error) {
  pdl::wait_and_release();
  const int experts = x.experts;
  static_assert(kChunk == 1024 && kMaxExperts == 1024, "one thread per pair and per expert slot");
  __shared__ int next[kMaxExperts];   // counts, then each expert's next free row
  __shared__ int warp_total[32];
  __shared__ int claimed[kChunk];
  const int t = threadIdx.x;
  next[t] = 0;
  __syncthreads();
  const int id = count_pair(ids, t, pairs, x, next, error);
  __syncthreads();
  const int count = t < experts ? next[t] : 0;
  const int incl = block_inclusive_scan(count, warp_total);
  const int base = incl - count;  // exclusive
  if (t < experts) {
    offsets[t] = base;
    next[t] = base;
  }
  if (t == experts - 1) offsets[experts] = incl;
  __syncthreads();
  scatter_chunk(id, t, pairs, next, claimed, row_of_pair, pair_of_row);
}

// 1 < chunks <= the CTAs that fit on the GPU at once (a cooperative launch; 64 registers x 1024
// threads fill an SM, so one per SM: 132 on an H100 SXM or H200; deepseek-v3 at T = 8192 has 64
// chunks): count, scan and scatter in one launch of one 1024-thread CTA per chunk. Each CTA
// counts its chunk into counts (chunks, E); after the grid barrier each CTA reads the counts it
// needs itself (expert e's rows in the chunks before its own, and in all of them): thread t reads
// column e = t % E for the chunks c = g, g + G, ... (g = t / E, G = min(1024 / E, chunks) groups),
// sixteen loads in flight, so that one pass of loads covers 64 chunks of 256 experts. CTA 0 writes
// the offsets.
// Writes exactly what the three-launch path writes. The three launches took 4.7 + 6.4 + 6.9 us
// at deepseek-v3 T = 8192 (H100, 2026-12-07), mostly launch and L2 latency, not bytes.
// (counts: neither const nor __restrict__, so that its reads after the barrier never take the
// non-coherent path, ld.global.nc, which may return data from before other CTAs' writes.)
__global__ void __launch_bounds__(1024) route_fused_kernel(const int* __restrict__ ids, int pairs, ExpertIds x,
                                                           int* counts, int* __restrict__ offsets,
                                                           int* __restrict__ row_of_pair, int* __restrict__ pair_of_row,
                                                           unsigned long long* __restrict__ error) {
  pdl::wait_and_release();
  static_assert(kChunk == 1024 && kMaxExperts == 1024, "one thread per pair and per expert slot");
  const int experts = x.experts, chunks = gridDim.x, c = blockIdx.x, t = threadIdx.x;
  __shared__ int next[kMaxExperts];     // counts, then each expert's next free row
  __shared__ int before[kMaxExperts];   // per (group, expert): rows in the group's chunks before c
  __shared__ int all[kMaxExperts];      // per (group, expert): rows in all the group's chunks
  __shared__ int warp_total[32];
  __shared__ int claimed[kChunk];
  next[t] = 0;
  __syncthreads();
  const int i = c * kChunk + t;
  const int id = count_pair(ids, i, pairs, x, next, error);
  __syncthreads();
  if (t < experts) counts[int64_t(c) * experts + t] = next[t];
  // The barrier orders every CTA's counts before any read below (grid.sync fences memory).
  cooperative_groups::this_grid().sync();
  const int groups = min(kMaxExperts / experts, chunks);  // (more would only sum zeros below)
  {
    const int e = t % experts, g = t / experts;
    int below = 0, sum = 0;
    if (g < groups) {
      // Group g's chunks g, g + groups, ...; the column walked by a pointer (cf. scan_kernel).
      const int* col = counts + int64_t(g) * experts + e;
      const int64_t step = int64_t(groups) * experts;
      for (int c0 = g; c0 < chunks; c0 += kScanBatch * groups, col += kScanBatch * step) {
        int v[kScanBatch];
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kScanBatch; ++j) v[j] = c0 + j * groups < chunks ? col[j * step] : 0;
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kScanBatch; ++j) {
          below += c0 + j * groups < c ? v[j] : 0;
          sum += v[j];
        }
      }
      before[t] = below;
      all[t] = sum;
    }
  }
  __syncthreads();
  int base = 0, total = 0;
  if (t < experts) {
    for (int g = 0; g < groups; ++g) {
      base += before[g * experts + t];
      total += all[g * experts + t];
    }
  }
  const int incl = block_inclusive_scan(total, warp_total);
  if (t < experts) {
    next[t] = incl - total + base;
    if (c == 0) offsets[t] = incl - total;
  }
  if (c == 0 && t == experts - 1) offsets[experts] = incl;
  __syncthreads();
  scatter_chunk(id, i, pairs, next, claimed, row_of_pair, pair_of_row);
}

// Rows are copied and combined in pieces of kVecsPerCta vectors (routing_limits.hpp).
using routing::kMaxHidden;
using routing::kVecsPerCta;

// With many rows, a CTA takes kGatherWide pieces of its row instead of one, each thread's
// vectors loaded together before they are stored: one vector per thread in flight left the copy
// latency-bound (deepseek-v3 T = 128: 1024 rows of 7168 in 10.6 us, 1.6 TB/s, 2026-12-02).
constexpr int kGatherWide = 8;
constexpr int64_t kGatherWideRows = 256;  // from this many rows on (below, pieces spread the rows)

// A thread's vectors v0, v0 + kVecsPerCta, ... of a row (kPieces of them, those below
// vecs_per_row), all loaded before any is used.
template <int kPieces>
CUTLASS_DEVICE void load_pieces(const uint4* __restrict__ src, int64_t v0, int64_t vecs_per_row, uint4 (&q)[kPieces]) {
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kPieces; ++i) {
    const int64_t v = v0 + i * kVecsPerCta;
    if (v < vecs_per_row) q[i] = __ldg(src + v);
  }
}
// The same vectors of another row, stored.
template <int kPieces>
CUTLASS_DEVICE void store_pieces(uint4* __restrict__ dst, int64_t v0, int64_t vecs_per_row, const uint4 (&q)[kPieces]) {
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kPieces; ++i) {
    const int64_t v = v0 + i * kVecsPerCta;
    if (v < vecs_per_row) dst[v] = q[i];
  }
}

// CTA (r, c): pieces [kPieces c, kPieces (c + 1)) of permuted row r, copied from its token's hidden
// row; thread x copies vectors x, x + kVecsPerCta, ... of them.
template <int kPieces>
__global__ void __launch_bounds__(kVecsPerCta) gather_kernel(const __nv_bfloat16* __restrict__ hidden,
                                                             int64_t vecs_per_row, int top_k,
                                                             const int* __restrict__ offsets, int experts,
                                                             const int* __restrict__ pair_of_row,
                                                             __nv_bfloat16* __restrict__ x_perm) {
  pdl::wait_and_release();
  const int r = blockIdx.x;
  const int64_t v0 = int64_t(blockIdx.y) * kVecsPerCta * kPieces + threadIdx.x;
  if (r >= offsets[experts] || v0 >= vecs_per_row) return;
  const int64_t t = pair_of_row[r] / top_k;
  uint4 q[kPieces];
  load_pieces(reinterpret_cast<const uint4*>(hidden) + t * vecs_per_row, v0, vecs_per_row, q);
  store_pieces(reinterpret_cast<uint4*>(x_perm) + int64_t(r) * vecs_per_row, v0, vecs_per_row, q);
}

// From kGatherTokenMajor tokens on, CTA (t, c) reads pieces [kPieces c, kPieces (c + 1)) of token
// t's hidden row once and writes them to the permuted row of each of its top_k slots (row_of_pair;
// -1, another shard's expert or a bad id, is skipped): the same rows and bytes as gather_kernel,
// but each token read once whatever the routing. gather_kernel (a CTA per permuted row) reads a
// token once per slot, and where the slots of a token lie far apart in the permuted order (uniform
// or skewed routing) those reads miss L2 once the tokens outgrow it: deepseek-v3 T = 8192 took
// 609 us with uniform routing against 374 balanced, whose slots of a token are adjacent rows
// (H100, 2026-12-07). Below it gather_kernel's grid of one CTA per row keeps decode steps' copies
// spread over the SMs.
constexpr int64_t kGatherTokenMajor = 4096;
template <int kPieces>
__global__ void __launch_bounds__(kVecsPerCta) gather_tokens_kernel(const __nv_bfloat16* __restrict__ hidden,
                                                                    int64_t vecs_per_row, int top_k,
                                                                    const int* __restrict__ offsets, int experts,
                                                                    const int* __restrict__ row_of_pair,
                                                                    __nv_bfloat16* __restrict__ x_perm) {
  pdl::wait_and_release();
  const int64_t t = blockIdx.x;
  const int64_t v0 = int64_t(blockIdx.y) * kVecsPerCta * kPieces + threadIdx.x;
  if (v0 >= vecs_per_row) return;
  const int rows = offsets[experts];
  // A token with no slot here (an expert shard's foreign experts, bad ids) is not read.
  bool any = false;
  for (int j = 0; j < top_k; ++j) {
    const int r = row_of_pair[t * top_k + j];
    any |= r >= 0 && r < rows;
  }
  if (!any) return;
  uint4 q[kPieces];
  load_pieces(reinterpret_cast<const uint4*>(hidden) + t * vecs_per_row, v0, vecs_per_row, q);
  for (int j = 0; j < top_k; ++j) {
    const int r = row_of_pair[t * top_k + j];
    if (r >= 0 && r < rows) {
      store_pieces(reinterpret_cast<uint4*>(x_perm) + int64_t(r) * vecs_per_row, v0, vecs_per_row, q);
    }
  }
}

// CTA (t, c): piece c of token t's output, 8 values per thread, FP32 accumulation in slot order.
// The slots are taken kCombineGroup at a time, their row indices, weights and y vectors all loaded
// before any is added: a loop that loaded one slot's index, then its vector, then added it kept one
// load in flight per thread (deepseek-v3 T = 128: 7.3 us for 14.7 MB, 2026-12-02).
// Out is __nv_bfloat16 (the sum rounded) or float (the sum as is: expert shards' outputs add up).
constexpr int kCombineGroup = 8;
template <class Out>
__global__ void __launch_bounds__(kVecsPerCta) combine_kernel(const __nv_bfloat16* __restrict__ y, int64_t y_rows,
                                                              const int* __restrict__ row_of_pair,
                                                              const float* __restrict__ w, int top_k,
                                                              int64_t vecs_per_row, Out* __restrict__ out) {
  static_assert(std::is_same_v<Out, __nv_bfloat16> || std::is_same_v<Out, float>, "bf16 or f32 output");
  pdl::wait_and_release();
  const int64_t t = blockIdx.x;
  const int64_t v = int64_t(blockIdx.y) * kVecsPerCta + threadIdx.x;
  if (v >= vecs_per_row) return;
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int j0 = 0; j0 < top_k; j0 += kCombineGroup) {
    int row[kCombineGroup];
    float wj[kCombineGroup];
    uint4 q[kCombineGroup];
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kCombineGroup; ++j) {
      row[j] = j0 + j < top_k ? row_of_pair[t * top_k + j0 + j] : -1;
      // Bad slots (and any foreign index) are skipped.
      if (row[j] < 0 || int64_t(row[j]) >= y_rows) row[j] = -1;
      wj[j] = row[j] >= 0 ? w[t * top_k + j0 + j] : 0.0f;
    }
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kCombineGroup; ++j) {
      if (row[j] >= 0) q[j] = __ldg(reinterpret_cast<const uint4*>(y) + int64_t(row[j]) * vecs_per_row + v);
    }
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kCombineGroup; ++j) {
      if (row[j] < 0) continue;
      const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&q[j]);
      CUTLASS_PRAGMA_UNROLL
      for (int p = 0; p < 4; ++p) {
        float2 f = __bfloat1622float2(h[p]);
        acc[2 * p] = __fmaf_rn(wj[j], f.x, acc[2 * p]);
        acc[2 * p + 1] = __fmaf_rn(wj[j], f.y, acc[2 * p + 1]);
      }
    }
  }
  if constexpr (std::is_same_v<Out, float>) {
    float4* o = reinterpret_cast<float4*>(out) + 2 * (t * vecs_per_row + v);
    o[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    o[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
  } else {
    uint4 o;
    __nv_bfloat162* op = reinterpret_cast<__nv_bfloat162*>(&o);
    CUTLASS_PRAGMA_UNROLL
    for (int p = 0; p < 4; ++p) op[p] = __floats2bfloat162_rn(acc[2 * p], acc[2 * p + 1]);
    reinterpret_cast<uint4*>(out)[t * vecs_per_row + v] = o;
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// A launch's status: the launch call's own error, then any pending one (check_launch).
Status launched(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return fail(Status::kCudaError, "%s: launch failed: %s", what, cudaGetErrorString(e));
  }
  return check_launch(what);
}

// route_fused_kernel as a cooperative launch: the runtime guarantees its CTAs are resident together
// or refuses the grid (cudaErrorCooperativeLaunchTooLarge). Without the programmatic-serialization
// attribute (a cooperative launch with it is not something the docs promise), so it waits for its
// predecessor to finish: about a microsecond of launch overlap given up.
cudaError_t launch_route_fused(int chunks, cudaStream_t st, const int* ids, int pairs, ExpertIds x, int* counts,
                               int* offsets, int* row_of_pair, int* pair_of_row, unsigned long long* error) {
  cudaLaunchAttribute attr[1] = {};
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(chunks));
  cfg.blockDim = dim3(1024);
  cfg.stream = st;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, route_fused_kernel, ids, pairs, x, counts, offsets, row_of_pair, pair_of_row, error);
}

}  // namespace

namespace routing {

// routing_limits.hpp. Asked once per device: the occupancy query costs microseconds of host time.
int route_fused_capacity() noexcept {
  // NVFP4MOE_ROUTE_FUSED=0 in the environment (read once): always the three launches (their tests
  // on a GPU that would hold every chunk; A/B timing).
  static const bool off = env::switched_off("NVFP4MOE_ROUTE_FUSED");
  if (off) return 0;
  constexpr int kDevices = 64;
  static std::atomic<int> known[kDevices];  // capacity + 1; 0 = not asked yet
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kDevices) {
    (void)cudaGetLastError();
    return 0;
  }
  if (int k = known[dev].load(std::memory_order_relaxed); k > 0) return k - 1;
  int coop = 0, sms = 0, per_sm = 0;
  if (cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, route_fused_kernel, 1024, 0) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  const int capacity = coop ? sms * per_sm : 0;
  known[dev].store(capacity + 1, std::memory_order_relaxed);
  return capacity;
}

}  // namespace routing

Status softmax_topk(const float* logits, int64_t tokens, int64_t experts, int64_t top_k, bool renormalize,
                    int* topk_ids, float* topk_weights, void* stream) noexcept {
  if (tokens < 0 || experts <= 0 || experts > kMaxExperts || top_k <= 0 || top_k > experts || top_k > kMaxTopK ||
      tokens > 0x7FFFFFFF) {
    return fail(Status::kInvalidShape, "softmax_topk: need 1 <= top_k <= min(experts, %d), experts <= %d", kMaxTopK,
                kMaxExperts);
  }
  if (tokens == 0) return Status::kSuccess;
  if (!logits || !topk_ids || !topk_weights) return fail(Status::kNullPointer, "softmax_topk: null pointer");
  cudaError_t e = pdl::launch(softmax_topk_kernel, dim3(unsigned((tokens + 7) / 8)), dim3(256), 0,
                              static_cast<cudaStream_t>(stream), logits, int(tokens), int(experts), int(top_k),
                              renormalize, topk_ids, topk_weights);
  return launched(e, "softmax_topk");
}

size_t permute_workspace_bytes(int64_t pairs, int64_t experts) noexcept {
  if (pairs < 0 || experts <= 0) return 0;
  if (pairs > kChunk) (void)routing::route_fused_capacity();  // asked here, before any capture
  return size_t((pairs + kChunk - 1) / kChunk) * size_t(experts) * sizeof(int);
}

Status permute_and_gather(const PermuteArgs& a, void* stream) noexcept {
  // Shapes and counts: the rules live in can_implement.cpp only.
  static_assert(kMaxExperts == kExpertLimit, "the routing kernels' expert table holds every expert the API allows");
  if (Status s = permute_and_gather_can_implement(a); s != Status::kSuccess) return s;
  const int64_t pairs = a.tokens * a.top_k;
  if (!a.topk_ids || !a.hidden || !a.expert_offsets || !a.row_of_pair || !a.pair_of_row || !a.x_perm || !a.error ||
      (pairs > 0 && !a.workspace)) {
    return fail(Status::kNullPointer, "permute_and_gather: null pointer");
  }
  if (!aligned16(a.hidden) || !aligned16(a.x_perm)) {
    return fail(Status::kMisaligned, "permute_and_gather: hidden and x_perm must be 16-byte aligned");
  }
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const int chunks = int((pairs + kChunk - 1) / kChunk);
  int* counts = static_cast<int*>(a.workspace);
  const ExpertIds x{a.expert_map, int(a.expert_map ? a.global_experts : a.experts), int(a.experts)};
  if (pairs <= kChunk) {
    // Decode and small batches: one launch for count, scan and scatter.
    cudaError_t e = pdl::launch(route_small_kernel, dim3(1), dim3(1024), 0, st, a.topk_ids, int(pairs), x,
                                a.expert_offsets, a.row_of_pair, a.pair_of_row, a.error);
    if (Status s = launched(e, "permute_and_gather (route)"); s != Status::kSuccess) return s;
    if (pairs == 0) return Status::kSuccess;
  } else {
    // One cooperative launch where the chunks' CTAs fit on the GPU at once; else, or where the GPU
    // refuses the grid (another tenant's share of the SMs, e.g. under MPS: that launch error is
    // cleared), three launches.
    const bool fused = chunks <= routing::route_fused_capacity();
    cudaError_t e = fused ? launch_route_fused(chunks, st, a.topk_ids, int(pairs), x, counts, a.expert_offsets,
                                               a.row_of_pair, a.pair_of_row, a.error)
                          : cudaErrorCooperativeLaunchTooLarge;
    if (e != cudaErrorCooperativeLaunchTooLarge) {
      if (Status s = launched(e, "permute_and_gather (route)"); s != Status::kSuccess) return s;
    } else {
      if (fused) (void)cudaGetLastError();
      e = pdl::launch(count_kernel, dim3(chunks), dim3(256), 0, st, a.topk_ids, int(pairs), x, counts, a.error);
      if (Status s = launched(e, "permute_and_gather (count)"); s != Status::kSuccess) return s;
      e = pdl::launch(scan_kernel, dim3(1), dim3(1024), 0, st, counts, chunks, int(a.experts), a.expert_offsets);
      if (Status s = launched(e, "permute_and_gather (scan)"); s != Status::kSuccess) return s;
      e = pdl::launch(scatter_kernel, dim3(chunks), dim3(1024), 0, st, a.topk_ids, int(pairs), x,
                      static_cast<const int*>(counts), static_cast<const int*>(a.expert_offsets), a.row_of_pair,
                      a.pair_of_row);
      if (Status s = launched(e, "permute_and_gather (scatter)"); s != Status::kSuccess) return s;
    }
  }
  const int64_t vecs = a.hidden_size / 8;
  const bool wide = pairs >= kGatherWideRows;
  const int64_t per_cta = int64_t(kVecsPerCta) * (wide ? kGatherWide : 1);
  if (a.tokens >= kGatherTokenMajor) {
    cudaError_t e = pdl::launch(gather_tokens_kernel<kGatherWide>,
                                dim3(unsigned(a.tokens), unsigned((vecs + per_cta - 1) / per_cta)), dim3(kVecsPerCta),
                                0, st, static_cast<const __nv_bfloat16*>(a.hidden), vecs, int(a.top_k),
                                static_cast<const int*>(a.expert_offsets), int(a.experts),
                                static_cast<const int*>(a.row_of_pair), static_cast<__nv_bfloat16*>(a.x_perm));
    return launched(e, "permute_and_gather (gather)");
  }
  cudaError_t e = pdl::launch(wide ? gather_kernel<kGatherWide> : gather_kernel<1>,
                              dim3(unsigned(pairs), unsigned((vecs + per_cta - 1) / per_cta)), dim3(kVecsPerCta), 0,
                              st, static_cast<const __nv_bfloat16*>(a.hidden), vecs, int(a.top_k),
                              static_cast<const int*>(a.expert_offsets), int(a.experts),
                              static_cast<const int*>(a.pair_of_row), static_cast<__nv_bfloat16*>(a.x_perm));
  return launched(e, "permute_and_gather (gather)");
}

namespace {

template <class Out>
Status combine_into(const void* y, const int* row_of_pair, const float* topk_weights, int64_t tokens, int64_t top_k,
                    int64_t hidden_size, void* out, void* stream) noexcept {
  if (tokens < 0 || top_k <= 0 || hidden_size <= 0 || hidden_size % 8 || hidden_size > kMaxHidden ||
      tokens > 0x7FFFFFFF || top_k > 0x7FFFFFFF || tokens * top_k > 0x7FFFFFFF) {
    return fail(Status::kInvalidShape, "combine: need tokens >= 0, 0 < top_k, tokens x top_k < 2^31, hidden_size a "
                "positive multiple of 8 up to %lld", (long long)kMaxHidden);
  }
  if (tokens == 0) return Status::kSuccess;
  if (!y || !row_of_pair || !topk_weights || !out) return fail(Status::kNullPointer, "combine: null pointer");
  if (!aligned16(y) || !aligned16(out)) return fail(Status::kMisaligned, "combine: y and out must be 16-byte aligned");
  const int64_t vecs = hidden_size / 8;
  cudaError_t e = pdl::launch(combine_kernel<Out>, dim3(unsigned(tokens), unsigned((vecs + kVecsPerCta - 1) / kVecsPerCta)),
                              dim3(kVecsPerCta), 0, static_cast<cudaStream_t>(stream),
                              static_cast<const __nv_bfloat16*>(y), tokens * top_k, row_of_pair, topk_weights,
                              int(top_k), vecs, static_cast<Out*>(out));
  return launched(e, "combine");
}

}  // namespace

Status combine(const void* y, const int* row_of_pair, const float* topk_weights, int64_t tokens, int64_t top_k,
               int64_t hidden_size, void* out, void* stream) noexcept {
  return combine_into<__nv_bfloat16>(y, row_of_pair, topk_weights, tokens, top_k, hidden_size, out, stream);
}

Status combine_fp32(const void* y, const int* row_of_pair, const float* topk_weights, int64_t tokens, int64_t top_k,
                    int64_t hidden_size, void* out, void* stream) noexcept {
  return combine_into<float>(y, row_of_pair, topk_weights, tokens, top_k, hidden_size, out, stream);
}

}  // namespace nvfp4moe
