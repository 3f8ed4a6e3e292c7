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

// The kernel's two CTA shapes (one CTA per SM): 16 warps with 7-slot rings (86016 ring bytes, the
// most room for x: 8 rows up to K = 7808) and 24 warps with 5-slot rings (92160 ring bytes; 8 rows
// up to K = 6912). The same bytes are in flight per SM (96 chunk quarters); the wide CTA has more
// warps to hide latency and more slots to spread few units over (a launch picks by balance:
// plan_launch).
struct Shape {
  int warps;
  int depth;
};
constexpr Shape kNarrow{16, 7};
constexpr Shape kWide{24, 5};
// The expert table and the K-split buffers (the kernel's Smem<warps>, which checks this).
constexpr int64_t table_bytes(int warps) noexcept {
  return (int64_t(2 * warps + kTableExperts + 1) * 4 + int64_t(2 * warps) * 4 * 32 * 4 + 127) / 128 * 128;
}
constexpr int64_t ring_bytes(Shape s) noexcept { return int64_t(s.warps) * s.depth * kSlotBytes; }
constexpr int64_t max_x_bytes(Shape s) noexcept { return kSmemLimit - table_bytes(s.warps) - ring_bytes(s); }
static_assert(table_bytes(16) == 20736 && table_bytes(24) == 28928, "the layout the kernel checks");
constexpr int64_t kMaxXBytes = max_x_bytes(kNarrow) > max_x_bytes(kWide) ? max_x_bytes(kNarrow) : max_x_bytes(kWide);

inline bool x_fits(Shape s, int64_t total_rows, int64_t k) noexcept {
  return k > 0 && k <= max_x_bytes(s) && total_rows * (k * 2 + 16) <= max_x_bytes(s);
}

// Whether the kernel can run a launch: at most kMaxRows rows whose x fits (in the narrow CTA),
// and an epilogue other than SwigluNvfp4 (whose encoder runs on the wgmma tiles' quantizer warps).
inline bool supports(GemmEpilogue epilogue, int64_t total_rows, int64_t k) noexcept {
  return epilogue != GemmEpilogue::kSwigluNvfp4 && total_rows >= 0 && total_rows <= kMaxRows &&
         x_fits(kNarrow, total_rows, k);
}

// How many warps share each unit's K (1, 2, 4 or 8) in a CTA of `warps`: the most for which an
// upper bound of the units (16 features of an expert with rows) still fits the resident warps,
// each split keeping at least two 64-K chunks. A launch with few units otherwise leaves SMs with
// too few loads in flight (mixtral-8x7b's L2 at T = 1: 512 units, 4 warps per SM).
// `max_splits` (the API's: 0 = the library's choice, 1 = never split) caps it.
inline int choose_splits(int64_t total_rows, int64_t experts, int64_t n, int64_t k, int sms, int64_t max_splits,
                         int warps) noexcept {
  const int64_t units = (total_rows < experts ? total_rows : experts) * (n / kUnitFeatures);
  const int64_t chunks = k / kWeightChunkK;
  const int64_t cap = max_splits > 0 ? max_splits : 8;
  int s = 1;
  while (s < 8 && 2 * s <= cap && units * s * 2 <= int64_t(sms) * warps && chunks >= 4 * s) s *= 2;
  return s;
}

// The CTA shape and K split of a launch: the shape whose work items (units x splits) fill its
// rounds of warp slots best (items / (rounds x slots)), the narrow one on a tie; the wide one only
// where x fits in it. (deepseek-v3's L2 at T = 1: 3584 units fill two rounds of 2112 narrow slots
// to 85%, of 3168 wide ones to 57%; gpt-oss-120b's L1: 1440 units fill 68% of the narrow slots,
// split in two 91% of the wide ones.) NVFP4MOE_WARP_SHAPE=narrow|wide in the environment forces one
// (for A/B measurements and the tests; the wide one only where x fits; other values: the choice).
struct Plan {
  Shape shape;
  int splits;
};
Plan plan_launch(int64_t total_rows, int64_t experts, int64_t n, int64_t k, int sms, int64_t max_splits) noexcept;

// One CTA of `shape` per SM (`sms`), programmatic dependent launch; p.splits from plan_launch (1,
// 2, 4 or 8, dividing the shape's warps, else kInvalidShape). x: BF16 [p.total_rows, p.k], 16-byte
// aligned. The caller checked supports() (and x_fits(shape), which plan_launch's shape does).
Status launch(const Params& p, const void* x, GemmEpilogue epilogue, Shape shape, int sms, void* stream) noexcept;

}  // namespace nvfp4moe::gemm::warp
