// The warp-MMA decode kernel of the grouped NVFP4 GEMM, for launches of at most 8 rows in all
// (one token's top-k: the T = 1 decode step).
//
//   out[r, f] = sum_k x[r, k] * W_e[f, k] * g_e      for rows r of expert e
//
// At <= 8 rows the wgmma tiles (gemm_config.cuh) stream whole 128-feature tiles through a TMA
// pipeline shared by two consumer warpgroups: the launch is bound by the consumers' instructions
// and synchronizations, and by how 128-feature tiles divide over the CTA slots (deepseek-v3's L2
// at T = 1: 448 tiles on 264 slots, two rounds for 1.7 rounds of work). Here every warp is a
// consumer on its own: a unit is one expert's 16 output features over the whole K (the four warps'
// quarters of a prepared chunk are independent: each thread's A fragment of the SM90 64x16 RS
// layout is, per warp, exactly the A fragment of mma.sync m16n8k16), the warp streams its unit's
// code and scale words through its own ring of shared-memory slots (cp.async; four 64-K chunks in
// flight while it works on a fifth), decodes them exactly as the wgmma mainloop does (nvfp4_weights.cuh) and issues mma.sync
// m16n8k16 with the expert's rows (<= 8) as N, read with ldmatrix from x staged once per CTA in
// shared memory. No barrier after the prologue, no pipeline hand-off; units are dealt round-robin
// over the CTAs so that every SM gets the same number within one.
//
// Two accumulator chains per unit (or K split), the even and the odd k-blocks, each in K order and
// added at the end; the K splits, where there are several, added in split order: bit-identical
// across runs, but a row's K-sum order differs from the wgmma tiles' one chain and, with a split,
// depends on the launch (as with the wgmma tiles' split-K); not used for batch-invariant plans.
#include "grouped_gemm_warp.hpp"

#include "gemm_config.cuh"
#include "gemm_epilogue.cuh"
#include "gemm_scheduler.cuh"
#include "nvfp4_weights.cuh"
#include "pdl.cuh"
#include "status.hpp"

#include <cuda_bf16.h>

#include <cstdlib>
#include <string>

// A timeline probe, off unless built with -DNVFP4MOE_WARP_TRACE (the production SASS is unchanged):
// per CTA, %globaltimer at entry, after the dependency wait, after the expert table, after x is
// staged, when warp 0's first chunk has arrived, when its first and last warps leave the main loop,
// and at exit; the last CTA of every 512th launch prints each stage's earliest and latest CTA, in
// ns after the earliest entry. PERF_NOTES.md (session 10) has what it showed.
#if defined(NVFP4MOE_WARP_TRACE)
#include <cstdio>
namespace nvfp4moe::gemm::warp::trace {
__device__ unsigned long long g_stamps[1024 * 8];
__device__ unsigned int g_done, g_launch;
__device__ __forceinline__ unsigned long long now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// Thread 0 of each CTA, after a CTA barrier: publishes the CTA's stamps; the last CTA reports.
// (g_stamps holds 1024 CTAs: the grid is one CTA per SM.)
__device__ void publish(const unsigned long long (&tr)[8], const Params& p) {
  if (gridDim.x > 1024) return;
  for (int i = 0; i < 8; ++i) g_stamps[blockIdx.x * 8 + i] = tr[i];
  __threadfence();
  if (atomicAdd(&g_done, 1u) != gridDim.x - 1) return;
  __threadfence();
  const unsigned launch = atomicAdd(&g_launch, 1u);
  g_done = 0;
  if (launch % 512 != 5) return;
  unsigned long long t0 = ~0ull;
  for (int b = 0; b < int(gridDim.x); ++b) t0 = min(t0, g_stamps[b * 8]);
  long long lo[8], hi[8];
  for (int i = 0; i < 8; ++i) lo[i] = 1ll << 60, hi[i] = -1;
  for (int b = 0; b < int(gridDim.x); ++b) {
    for (int i = 0; i < 8; ++i) {
      const unsigned long long v = g_stamps[b * 8 + i];
      if (v == ~0ull || v == 0) continue;  // a CTA without units
      lo[i] = min(lo[i], (long long)(v - t0));
      hi[i] = max(hi[i], (long long)(v - t0));
    }
  }
  printf("TRACE n=%d k=%d rows=%d launch=%u | entry %lld-%lld wait %lld-%lld table %lld-%lld x %lld-%lld "
         "first %lld-%lld loopend %lld-%lld/%lld-%lld end %lld-%lld\n",
         p.n, p.k, p.total_rows, launch, lo[0], hi[0], lo[1], hi[1], lo[2], hi[2], lo[3], hi[3], lo[4], hi[4], lo[5],
         hi[5], lo[6], hi[6], lo[7], hi[7]);
}
}  // namespace nvfp4moe::gemm::warp::trace
#define NVFP4MOE_TRACE(...) __VA_ARGS__
#else
#define NVFP4MOE_TRACE(...)
#endif

namespace nvfp4moe::gemm::warp {
namespace {

static_assert(kSlotBytes == weights::kChunkCodeBytes / 4 + 32 * 8,
              "a slot holds one warp's quarter of a chunk: 16 code bytes and 8 scale bytes per lane");
static_assert(kTableExperts == kMaxExperts, "the host's table size");

struct Smem {
  int count[2 * kWarps];  // active experts per 32-expert slice
  int active[kMaxExperts];
  int num_active;
  float red[2][kWarps][4][32];  // K-split partial sums: (round parity, warp, accumulator, lane)
};
// The warps' weight rings follow Smem (warp w's slot i at kRingOffset + (w * kDepth + i) *
// kSlotBytes: the lane's 16 code bytes at lane * 16, its 8 scale bytes at 512 + lane * 8), then x,
// rows of k * 2 + 16 bytes: the 16-byte skew puts the 8 rows of an ldmatrix 8x8 matrix in 8
// different bank groups.
constexpr int kRingOffset = (int(sizeof(Smem)) + 127) / 128 * 128;
static_assert(kRingOffset == kTableBytes, "the host's shared-memory rule (supports) counts the table");
template <int kSlots>
constexpr int kXOffset = kRingOffset + kWarps * kSlots * kSlotBytes;
static_assert(kXOffset<kDepth> == kRingOffset + kRingBytes, "the host's rule counts the shipped ring");
constexpr int kCtaThreads = kWarps * 32;  // one CTA per SM
static_assert(kCtaThreads * 2 >= kMaxExperts, "one pass over the expert offsets: two experts per thread");
static_assert(kWarps % 8 == 0, "teams of 1, 2, 4 or 8 warps");
static_assert(kWarps / 2 + 1 <= 16, "a named barrier per team of two or more warps");
static_assert(kWeightChunkK == weights::kChunkK && kTileK == weights::kChunkK, "64-K chunks");
constexpr uint32_t kXChunkBytes = weights::kChunkK * 2;  // one chunk's K of one x row (BF16)

// 16 (8) bytes global -> shared, asynchronously (LDGSTS; the 16-byte copy bypasses L1), where
// `p` holds.
CUTLASS_DEVICE void cp_async_16(bool p, uint32_t dst, const void* src) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %0, 0;\n @p cp.async.cg.shared.global [%1], [%2], 16;\n}\n" ::"r"(
          int(p)),
      "r"(dst), "l"(src)
      : "memory");
}
CUTLASS_DEVICE void cp_async_8(bool p, uint32_t dst, const void* src) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %0, 0;\n @p cp.async.ca.shared.global [%1], [%2], 8;\n}\n" ::"r"(
          int(p)),
      "r"(dst), "l"(src)
      : "memory");
}
CUTLASS_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Until at most kPending of this thread's most recent groups are in flight.
template <int kPending>
CUTLASS_DEVICE void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}
CUTLASS_DEVICE uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}
CUTLASS_DEVICE uint2 lds64(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr));
  return v;
}

// mma.sync m16n8k16, BF16 inputs, FP32 accumulators in place.
CUTLASS_DEVICE void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

CUTLASS_DEVICE void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// How x reaches shared memory: after the ring's first loads are issued (plain loads by every
// thread), or first (cp.async, one group, before the expert table is read, so that its latency
// overlaps the table's and x is not queued behind the ring's first loads). (x in 8 K segments,
// bulk-copied by one thread with an mbarrier each so that a warp waited only for the segment of
// its next chunk, was 2-47% slower on every warp launch: PERF_NOTES.md session 12.)
enum class XStaging { kAfterRing, kFirst };

// Each warp reads one 576-byte quarter of every 2304-byte chunk of its unit. (A probe that read a
// unit's bytes as one contiguous run instead, as a unit-major weight layout would, ran as fast:
// the access pattern does not bound these launches, PERF_NOTES.md session 13.)
//
// kDepth: the ring's slots per warp (4 or 5 in the shipped kernels: ring_choice; others for A/B).
template <GemmEpilogue kEpilogue, int kDepth, XStaging kX>
__global__ void __launch_bounds__(kCtaThreads, 1) grouped_gemm_warp_kernel(Params p, const __nv_bfloat16* x) {
  static_assert(kEpilogue != GemmEpilogue::kSwigluNvfp4, "SwigluNvfp4 runs on the wgmma tiles");
  extern __shared__ __align__(128) char smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
  char* xs = smem_raw + kXOffset<kDepth>;  // (total_rows, k) BF16, row stride k * 2 + 16 bytes
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, c = lane % 4;

  NVFP4MOE_TRACE(__shared__ unsigned long long tr[8];
                 if (threadIdx.x == 0) tr[0] = trace::now(), tr[4] = ~0ull, tr[5] = ~0ull, tr[6] = 0;)
  pdl::wait_and_release();
  NVFP4MOE_TRACE(if (threadIdx.x == 0) tr[1] = trace::now();)
  if constexpr (kX == XStaging::kFirst) {
    const uint32_t xs_addr = uint32_t(__cvta_generic_to_shared(xs));
    // x into shared memory: 16-byte pieces (k % 64 == 0).
    const int pieces_per_row = p.k / 8;
    const uint32_t row_bytes = uint32_t(p.k) * 2u + 16u;
    for (int i = threadIdx.x; i < p.total_rows * pieces_per_row; i += kCtaThreads) {
      const int r = i / pieces_per_row, q = i % pieces_per_row;
      cp_async_16(true, xs_addr + uint32_t(r) * row_bytes + uint32_t(q) * 16u, x + int64_t(r) * p.k + q * 8);
    }
    cp_async_commit();
  }
  // The experts with rows, in expert order: two per thread, a ballot per warp, a scan of the
  // 32 warp-slice counts.
  bool has[2];
  CUTLASS_PRAGMA_UNROLL
  for (int h = 0; h < 2; ++h) {
    const int e = h * kCtaThreads + int(threadIdx.x);
    bool any = false;
    if (e < p.experts) {
      int2 rr = expert_span(p, e);
      any = rr.y > rr.x;
    }
    has[h] = any;
    const uint32_t ballot = __ballot_sync(0xFFFFFFFFu, any);
    if (lane == 0) sm.count[h * kWarps + warp] = __popc(ballot);
  }
  __syncthreads();
  CUTLASS_PRAGMA_UNROLL
  for (int h = 0; h < 2; ++h) {
    const int slice = h * kWarps + warp;
    int pos = __popc(__ballot_sync(0xFFFFFFFFu, has[h]) & ((1u << lane) - 1u));
    for (int s = 0; s < slice; ++s) pos += sm.count[s];
    if (has[h]) sm.active[pos] = h * kCtaThreads + int(threadIdx.x);
    if (h == 1 && warp == kWarps - 1 && lane == 31) {
      int total = 0;
      for (int s = 0; s < 2 * kWarps; ++s) total += sm.count[s];
      sm.num_active = total;
    }
  }

  __syncthreads();  // the expert table is complete
  NVFP4MOE_TRACE(if (threadIdx.x == 0) tr[2] = trace::now();)

  const int k = p.k;
  const int groups = p.n / kUnitFeatures;  // 16-feature units per expert
  const int units = sm.num_active * groups;
  const int k_chunks = k / weights::kChunkK;
  // K split over `splits` consecutive warps of the CTA (a power of two, 1 to 8): split `split`
  // takes chunks [split C / S, (split + 1) C / S); split 0 adds the others' partial sums in split
  // order (the same bits on every run) and runs the epilogue.
  const int splits = p.splits, split = warp % splits, team = warp / splits;
  const int teams = kWarps / splits;
  const int kc_begin = split * k_chunks / splits, chunks = (split + 1) * k_chunks / splits - kc_begin;

  // Unit u's weights for this lane: its 16 code bytes of each chunk (at (32 wq + lane) * 16) and
  // its row pair's 8 scale bytes (at 2048 + (8 wq + g) * 8), from chunk kc_begin on.
  struct Unit {
    int expert, mt, wq;
    const uint8_t* codes_at;
    const uint8_t* scales_at;
  };
  auto unit_at = [&](int u) {
    const int expert = sm.active[u / groups];
    const int fg = u % groups;
    const int mt = fg / 4, wq = fg % 4;  // the chunk row (64 features) and the warp's quarter of it
    const uint8_t* base = p.prepared + weights::chunk_offset(expert, mt, kc_begin, p.n, k);
    return Unit{expert, mt, wq, base + (wq * 32 + lane) * 16, base + weights::kChunkCodeBytes + (wq * 8 + g) * 8};
  };
  // The warp's ring: slot i holds the chunk it consumes at event i of a round of kDepth events.
  // Every event commits one cp.async group (empty where nothing is copied), and a slot is refilled
  // right after it is read, so the group of the chunk an event reads is always the kDepth-th most
  // recent: cp.async.wait_group(kDepth - 1) before reading it, whatever the units' lengths. Each
  // lane copies exactly the bytes it reads (the scales once per lane): no barrier between lanes.
  // (A register ring loaded with ld.global, the kernel's first form, had its loads placed by
  // ptxas: it issued a round's eight in a cluster after its sixth chunk, leaving two chunks of work
  // to hide a round's load latency.)
  const uint32_t ring = uint32_t(__cvta_generic_to_shared(smem_raw)) + uint32_t(kRingOffset) +
                        uint32_t(warp * kDepth * kSlotBytes);
  auto copy_chunk = [&](int i, const uint8_t* codes, const uint8_t* scales, bool on) {
    const uint32_t slot = ring + uint32_t(i * kSlotBytes);
    cp_async_16(on, slot + uint32_t(lane) * 16u, codes);
    cp_async_8(on, slot + 512u + uint32_t(lane) * 8u, scales);
  };
  // The first unit's weights are requested before x is staged, so that both latencies overlap.
  const int u0 = team * int(gridDim.x) + int(blockIdx.x);
  if (u0 < units) {
    const Unit un = unit_at(u0);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kDepth; ++i) {
      copy_chunk(i, un.codes_at + i * weights::kChunkBytes, un.scales_at + i * weights::kChunkBytes, i < chunks);
      cp_async_commit();
    }
  }

  // x into shared memory: 16-byte pieces (k % 64 == 0).
  const int pieces_per_row = k / 8;
  const uint32_t row_bytes = uint32_t(k) * 2u + 16u;
  if constexpr (kX == XStaging::kFirst) {
    // x's group is older than the ring's kDepth groups (or, without a unit, the only one).
    if (u0 < units) {
      cp_async_wait<kDepth>();
    } else {
      cp_async_wait<0>();
    }
  } else {
    for (int i = threadIdx.x; i < p.total_rows * pieces_per_row; i += kCtaThreads) {
      const int r = i / pieces_per_row, q = i % pieces_per_row;
      *reinterpret_cast<uint4*>(xs + r * row_bytes + q * 16) =
          *reinterpret_cast<const uint4*>(x + int64_t(r) * k + q * 8);
    }
  }
  __syncthreads();
  const uint32_t xs_addr = uint32_t(__cvta_generic_to_shared(xs));
  NVFP4MOE_TRACE(if (threadIdx.x == 0) tr[3] = trace::now();
                 if (warp == 0 && u0 < units) {
                   cp_async_wait<kDepth - 1>();
                   if (lane == 0) tr[4] = trace::now();
                 })
  int round = 0;

  const int stride = int(gridDim.x) * teams;
  for (int u = u0; u < units; u += stride, ++round) {
    const Unit un = unit_at(u);
    const int expert = un.expert, mt = un.mt, wq = un.wq;
    const int2 rr = expert_span(p, expert);
    const int rows = rr.y - rr.x;  // 1..8 (at most total_rows <= 8)
    // ldmatrix row addresses: lane l reads row l % 8 of matrix l / 8 (matrices: k-block kb's
    // k 0-7 and 8-15, then kb + 1's); rows past the expert's end repeat its last row (their
    // columns of the product are not stored).
    const int b_row = rr.x + min(lane % 8, rows - 1);
    uint32_t b_addr = xs_addr + uint32_t(b_row) * row_bytes + uint32_t(kc_begin) * kXChunkBytes + uint32_t(lane / 8) * 16u;

    // Two accumulator chains, the even k-blocks' and the odd ones', added after the unit's K
    // (half the dependent mma.sync latency per chunk: 1.5-2% faster at T = 1, H200 2026-12-03).
    float d[4] = {0.f, 0.f, 0.f, 0.f};
    float d1[4] = {0.f, 0.f, 0.f, 0.f};
    // Event i of a round: read slot i (chunk kc0 + i) and multiply it into d.
    auto consume = [&](int i) {
      cp_async_wait<kDepth - 1>();
      const uint32_t slot = ring + uint32_t(i * kSlotBytes);
      const uint4 cw = lds128(slot + uint32_t(lane) * 16u);
      const uint2 sw2 = lds64(slot + 512u + uint32_t(lane) * 8u);
      uint32_t b[2][4];  // (k-block pair) x {kb b0, kb b1, kb+1 b0, kb+1 b1}
      const uint32_t b_chunk = b_addr + uint32_t(i) * kXChunkBytes;
      ldmatrix_x4(b[0], b_chunk);
      ldmatrix_x4(b[1], b_chunk + 64u);
      const uint32_t cw4[4] = {cw.x, cw.y, cw.z, cw.w};
      CUTLASS_PRAGMA_UNROLL
      for (int kb = 0; kb < 4; ++kb) {
        uint32_t a[4];
        weights::decode_kblock(cw4[kb], sw2, kb, a);
        mma_m16n8k16(kb % 2 ? d1 : d, a, b[kb / 2][(kb % 2) * 2], b[kb / 2][(kb % 2) * 2 + 1]);
      }
    };
    // Rounds whose every refill is this unit's chunk kDepth further: addresses as immediate
    // offsets from one pointer per round.
    const uint8_t* codes_next = un.codes_at + kDepth * weights::kChunkBytes;
    const uint8_t* scales_next = un.scales_at + kDepth * weights::kChunkBytes;
    int kc0 = 0;
    for (; kc0 + 2 * kDepth <= chunks; kc0 += kDepth) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kDepth; ++i) {
        consume(i);
        copy_chunk(i, codes_next + i * weights::kChunkBytes, scales_next + i * weights::kChunkBytes, true);
        cp_async_commit();
      }
      codes_next += kDepth * weights::kChunkBytes;
      scales_next += kDepth * weights::kChunkBytes;
      b_addr += kDepth * kXChunkBytes;
    }
    // Fewer than 2 kDepth chunks are left. A round with more after it refills only the slots whose
    // chunk kDepth further exists (the others commit empty groups); then the last round reads its
    // r chunks and every slot i takes the warp's next unit's chunk i, so that those loads overlap
    // this unit's tail, reduction and epilogue. Every event still commits exactly one group, in the
    // order the chunks are read (a slot past r was read last in the round before, and is filled at
    // the same event of the last round). No per-event choice between two sources: the predicated
    // copies keep the tail's instructions near the full rounds'.
    if (kc0 + kDepth < chunks) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kDepth; ++i) {
        consume(i);
        copy_chunk(i, codes_next + i * weights::kChunkBytes, scales_next + i * weights::kChunkBytes,
                   kc0 + kDepth + i < chunks);
        cp_async_commit();
      }
      b_addr += kDepth * kXChunkBytes;
      kc0 += kDepth;
    }
    const bool has_next = u + stride < units;
    const Unit next = has_next ? unit_at(u + stride) : un;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kDepth; ++i) {
      if (kc0 + i < chunks) consume(i);
      copy_chunk(i, next.codes_at + i * weights::kChunkBytes, next.scales_at + i * weights::kChunkBytes,
                 has_next && i < chunks);
      cp_async_commit();
    }

    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < 4; ++j) d[j] += d1[j];
    if (splits > 1) {
      // The team's partial sums meet in shared memory (two buffers by round parity: a split can
      // be at most one round ahead of split 0's reads).
      float(&mine)[4][32] = sm.red[round & 1][warp];
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < 4; ++j) mine[j][lane] = d[j];
      asm volatile("bar.sync %0, %1;" ::"r"(1 + team), "r"(splits * 32) : "memory");
      if (split != 0) continue;
      for (int o = 1; o < splits; ++o) {
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < 4; ++j) d[j] += sm.red[round & 1][warp + o][j][lane];
      }
    }
    // d: (feature g, row 2c), (g, 2c + 1), (g + 8, 2c), (g + 8, 2c + 1). Undo the 2^-8 of the
    // weight encoding with the decode scale of each half (gate and up rows of kGateUpBands8).
    const float scale_lo = p.decode_scale[2 * expert] * 256.0f;
    const float scale_hi = p.decode_scale[2 * expert + 1] * 256.0f;
    const int f = mt * 64 + wq * 16 + g;  // feature of d[0], d[1]; d[2], d[3] are f + 8
    CUTLASS_PRAGMA_UNROLL
    for (int v1 = 0; v1 < 2; ++v1) {
      const int r = 2 * c + v1;
      if (r < rows) {
        const int64_t row = rr.x + r;
        const float lo = d[v1] * scale_lo, hi = d[2 + v1] * scale_hi;
        if constexpr (kEpilogue == GemmEpilogue::kPlain) {
          p.out[row * p.n + f] = __float2bfloat16_rn(lo);
          p.out[row * p.n + f + 8] = __float2bfloat16_rn(hi);
        } else if constexpr (kEpilogue == GemmEpilogue::kInterleaved) {
          p.out[row * p.n + f] = __float2bfloat16_rn(lo);
          p.out[row * p.n + f + 8] = __float2bfloat16_rn(swiglu(lo, hi));
        } else {
          p.out[row * (p.n / 2) + mt * 32 + wq * 8 + g] = __float2bfloat16_rn(swiglu(lo, hi));
        }
      }
    }
  }
  NVFP4MOE_TRACE(if (lane == 0 && u0 < units) {
    const unsigned long long t = trace::now();
    atomicMin(&tr[5], t);
    atomicMax(&tr[6], t);
  } __syncthreads();
                 if (threadIdx.x == 0) {
                   tr[7] = trace::now();
                   trace::publish(tr, p);
                 })
  cp_async_wait<0>();  // (nothing is in flight here: the last unit loads no next unit)
}

template <GemmEpilogue kEpilogue, int kDepth, XStaging kX>
Status launch_one(const Params& p, const void* x, int sms, cudaStream_t stream) {
  static_assert(kXOffset<kDepth> == kTableBytes + kWarps * kDepth * kSlotBytes, "smem_bytes's layout");
  const size_t smem = size_t(smem_bytes(kDepth, p.total_rows, p.k));
  auto kernel = grouped_gemm_warp_kernel<kEpilogue, kDepth, kX>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (e != cudaSuccess) {
    return fail(Status::kCudaError, "grouped_gemm_nvfp4 (warp kernel): cudaFuncSetAttribute: %s",
                cudaGetErrorString(e));
  }
  e = pdl::launch(kernel, dim3(unsigned(sms)), dim3(kCtaThreads), smem, stream, p,
                  static_cast<const __nv_bfloat16*>(x));
  if (e != cudaSuccess) {
    return fail(Status::kCudaError, "grouped_gemm_nvfp4 (warp kernel): launch: %s", cudaGetErrorString(e));
  }
  return check_launch("grouped_gemm_nvfp4 (warp kernel)");
}

// The shipped choice of ring and x staging (ring_choice, grouped_gemm_warp.hpp).
template <GemmEpilogue kEpilogue>
Status launch_shipped(const Params& p, const void* x, int sms, cudaStream_t stream) {
  const RingChoice r = ring_choice(p.total_rows, p.k, p.splits);
  constexpr XStaging kFirst = XStaging::kFirst, kAfter = XStaging::kAfterRing;
  if (r.slots == 4) {
    return r.x_first ? launch_one<kEpilogue, 4, kFirst>(p, x, sms, stream)
                     : launch_one<kEpilogue, 4, kAfter>(p, x, sms, stream);
  }
  return r.x_first ? launch_one<kEpilogue, kDepth, kFirst>(p, x, sms, stream)
                   : launch_one<kEpilogue, kDepth, kAfter>(p, x, sms, stream);
}

// A/B variants, compiled only with NVFP4MOE_WARP_VARIANTS defined (a build with the environment
// variable NVFP4MOE_WARP_VARIANTS=1: build.rs sets the CMake option; the default build has the
// shipped kernels alone, the only ones its GPU tests run): then NVFP4MOE_WARP_VARIANT (read once;
// PERF_NOTES.md sessions 11-12) = d5 (session 11's kernel: 5 slots, x after the ring's first
// loads, for every launch), d7, d4 or d3 (that many slots where x fits beside them, else the
// shipped choice), or x (5 slots, x staged first, for every launch); unset or anything else: the
// shipped choice.
#if defined(NVFP4MOE_WARP_VARIANTS)
enum class Variant { kShipped, kDepth5, kDepth7, kDepth4, kDepth3, kXFirst };
Variant variant() {
  static const Variant v = [] {
    const char* e = std::getenv("NVFP4MOE_WARP_VARIANT");
    const std::string s(e ? e : "");
    return s == "d5"   ? Variant::kDepth5
           : s == "d7" ? Variant::kDepth7
           : s == "d4" ? Variant::kDepth4
           : s == "d3" ? Variant::kDepth3
           : s == "x"  ? Variant::kXFirst
                       : Variant::kShipped;
  }();
  return v;
}

template <GemmEpilogue kEpilogue>
Status launch_variant(const Params& p, const void* x, int sms, cudaStream_t stream) {
  constexpr XStaging kAfter = XStaging::kAfterRing;
  switch (variant()) {
    case Variant::kDepth5: return launch_one<kEpilogue, 5, kAfter>(p, x, sms, stream);
    case Variant::kDepth7:
      if (smem_bytes(7, p.total_rows, p.k) <= kSmemLimit) return launch_one<kEpilogue, 7, kAfter>(p, x, sms, stream);
      break;
    case Variant::kDepth4: return launch_one<kEpilogue, 4, kAfter>(p, x, sms, stream);
    case Variant::kDepth3: return launch_one<kEpilogue, 3, kAfter>(p, x, sms, stream);
    case Variant::kXFirst: return launch_one<kEpilogue, kDepth, XStaging::kFirst>(p, x, sms, stream);
    default: break;
  }
  return launch_shipped<kEpilogue>(p, x, sms, stream);
}
#else
template <GemmEpilogue kEpilogue>
Status launch_variant(const Params& p, const void* x, int sms, cudaStream_t stream) {
  return launch_shipped<kEpilogue>(p, x, sms, stream);
}
#endif

}  // namespace

Status launch(const Params& p, const void* x, GemmEpilogue epilogue, int sms, void* stream_ptr) noexcept {
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  if (p.splits != 1 && p.splits != 2 && p.splits != 4 && p.splits != 8) {
    return fail(Status::kInvalidShape, "grouped_gemm_nvfp4 (warp kernel): %d splits (1, 2, 4 or 8)", p.splits);
  }
  switch (epilogue) {
    case GemmEpilogue::kPlain: return launch_variant<GemmEpilogue::kPlain>(p, x, sms, stream);
    case GemmEpilogue::kInterleaved: return launch_variant<GemmEpilogue::kInterleaved>(p, x, sms, stream);
    case GemmEpilogue::kSwigluBf16: return launch_variant<GemmEpilogue::kSwigluBf16>(p, x, sms, stream);
    default: break;
  }
  return fail(Status::kInvalidShape, "grouped_gemm_nvfp4: the warp kernel does not write SwigluNvfp4");
}

}  // namespace nvfp4moe::gemm::warp
