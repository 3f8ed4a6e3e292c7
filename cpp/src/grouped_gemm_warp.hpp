// The warp-MMA decode kernel of the grouped GEMM (grouped_gemm_warp.cu): the rules of when it runs
// (plain C++: can_implement.cpp reads them too) and its launch.
#pragma once

#include "nvfp4moe/nvfp4moe.h"

#include <cstddef>
#include <cstdint>

namespace nvfp4moe::gemm {
struct Params;
}

namespace nvfp4moe::gemm::warp {

// At most this many rows in all: every expert's rows are one mma.sync N = 8.
constexpr int64_t kMaxRows = 8;
// Output features per unit (one mma.sync M).
constexpr int kUnitFeatures = 16;
// Each warp streams its weights through a ring of shared-memory slots, one 64-K chunk's quarter
// each (512 code bytes, and 8 scale bytes per lane), filled with cp.async. x is staged whole in
// shared memory, rows of k * 2 + 16 bytes, after the expert table with the K-split buffers and the
// rings: together within the 227 KB a CTA of any sm_90 device may use.
constexpr int kSlotBytes = 768;
constexpr int64_t kSmemLimit = 227 * 1024;
constexpr int kTableExperts = 1024;  // the expert table's capacity (gemm_config.cuh's kMaxExperts)

// The CTA: 16 warps (one CTA per SM), each with a ring of at most 5 slots (ring_choice: 4 or 5): 3-4
// chunk quarters in flight per warp while it works on one, 48-64 per SM (27-36 KiB of weights in
// flight; the rings take 48-60 KiB). Fewer bytes in flight were faster: 5 slots were faster than 7
// on 8 of 9 T = 1 launches (up to 5.5%; the others within 0.5%), and 12 slots slower by 3-13% on
// all but one (equal) (H200 2026-12-03, PERF_NOTES.md session 11).
// (A 24-warp CTA with 5-slot rings was slower than 16 warps with 7 on every T = 1 launch but
// mixtral-8x7b's L2, by 1.5%: session 9.)
constexpr int kWarps = 16;
constexpr int kDepth = 5;
// The expert table and the K-split buffers (the kernel's Smem, which checks this), the rings.
constexpr int64_t kTableBytes =
    (int64_t(2 * kWarps + kTableExperts + 1) * 4 + int64_t(2 * kWarps) * 4 * 32 * 4 + 127) / 128 * 128;
constexpr int64_t kRingBytes = int64_t(kWarps) * kDepth * kSlotBytes;
static_assert(kTableBytes == 20736 && kRingBytes == 61440, "the layout the kernel checks");
// What x may use (8 rows: K up to 9344).
constexpr int64_t kMaxXBytes = kSmemLimit - kTableBytes - kRingBytes;
// A launch's dynamic shared memory with rings of `slots` slots: the table, the rings, then x's
// rows of k * 2 + 16 bytes (the kernel's layout). Whether x fits is judged at kDepth slots, the
// deepest ring ring_choice picks.
constexpr int64_t smem_bytes(int slots, int64_t total_rows, int64_t k) noexcept {
  return kTableBytes + int64_t(kWarps) * slots * kSlotBytes + total_rows * (k * 2 + 16);
}

// Whether the kernel can run a launch: at most kMaxRows rows whose x fits, and an epilogue other than
// SwigluNvfp4 (whose encoder runs on the wgmma tiles' quantizer warps).
inline bool supports(GemmEpilogue epilogue, int64_t total_rows, int64_t k) noexcept {
  return epilogue != GemmEpilogue::kSwigluNvfp4 && total_rows >= 0 && total_rows <= kMaxRows && k > 0 &&
         k <= kMaxXBytes && smem_bytes(kDepth, total_rows, k) <= kSmemLimit;
}

// How many warps share each unit's K (1, 2, 4 or 8): the most for which an upper bound of the
// units (16 features of an expert with rows) still fits the resident warps, each split keeping at
// least two 64-K chunks. A launch with few units otherwise leaves SMs with too few loads in flight
// (mixtral-8x7b's L2 at T = 1: 512 units, 4 warps per SM).
// `max_splits` (the API's: 0 = the library's choice, 1 = never split) caps it.
inline int choose_splits(int64_t total_rows, int64_t experts, int64_t n, int64_t k, int sms,
                         int64_t max_splits) noexcept {
  const int64_t units = (total_rows < experts ? total_rows : experts) * (n / kUnitFeatures);
  const int64_t chunks = k / kWeightChunkK;
  const int64_t cap = max_splits > 0 ? max_splits : 8;
  int s = 1;
  while (s < 8 && 2 * s <= cap && units * s * 2 <= int64_t(sms) * kWarps && chunks >= 4 * s) s *= 2;
  return s;
}

// The ring and x's staging per launch (H200, PERF_NOTES.md sessions 11-12; every T = 1 warp
// launch of the presets timed against a 5-slot ring with x after the ring's first loads, in one
// call, interleaved): 4 slots where a warp's work item (a unit's K share) has at most 32 chunks,
// since short items lose less to a shallow ring than they gain from its smaller first burst
// (deepseek-v3 L2, 32 chunks: 22.36 -> 21.86 us; qwen3-30b-a3b L1, 16: 8.82 -> 8.41), and 5 where
// items are longer (64 chunks: 4 slots were 1.5-1.7% slower); x staged first (its copies issued
// before the expert table is read, each warp waiting for all of x before its first chunk) where
// it is at most 24 KB per CTA, since then it arrives before the ring's first burst instead of
// behind it (qwen3-30b-a3b L2, 12 KB: 7.59 -> 6.85 us; gpt-oss-120b L1, 23 KB: 14.81 -> 14.40),
// while a larger x (32-64 KB) made every warp's first chunk wait longer (+5-8%).
struct RingChoice {
  int slots;     // 4 or kDepth
  bool x_first;  // x's copies issued before the expert table is read
};
constexpr RingChoice ring_choice(int64_t total_rows, int64_t k, int splits) noexcept {
  const int64_t item_chunks = (k / kWeightChunkK + splits - 1) / splits;
  return RingChoice{item_chunks <= 32 ? 4 : kDepth, total_rows * k * 2 <= 24 * 1024};
}

// One CTA per SM (`sms`), programmatic dependent launch; p.splits from choose_splits (1, 2, 4 or
// 8, else kInvalidShape). x: BF16 [p.total_rows, p.k], 16-byte aligned. The caller checked
// supports().
Status launch(const Params& p, const void* x, GemmEpilogue epilogue, int sms, void* stream) noexcept;

}  // namespace nvfp4moe::gemm::warp
