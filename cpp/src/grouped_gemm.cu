// grouped_gemm_nvfp4: host-side validation, tile choice, the x tensor map, and dispatch to the
// per-configuration kernels (grouped_gemm_instance.cu, once per tile and epilogue).
#include "env.hpp"
#include "grouped_gemm_sm90.cuh"
#include "grouped_gemm_warp.hpp"

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <string>
#include <type_traits>

namespace nvfp4moe {
namespace {

// cuTensorMapEncodeTiled (driver API, CUDA 12.0 signature), reached through the runtime's driver
// entry point: no link against libcuda.
using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiledFn tensor_map_encoder() {
  static EncodeTiledFn fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    cudaDriverEntryPointQueryResult q;
    void* p = nullptr;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess) {
      fn = reinterpret_cast<EncodeTiledFn>(p);
    }
  });
  return fn;
}

// NVFP4MOE_WARP_KERNEL=0 in the environment keeps kAuto's 8-row launches on the N8 tile (for A/B
// timing; read once).
bool warp_kernel_on() {
  static const bool on = !env::switched_off("NVFP4MOE_WARP_KERNEL");
  return on;
}

// The N256 tile's L2 prefetch distance in 64-K stages (Params::l2_prefetch):
// NVFP4MOE_L2_PREFETCH in the environment (0: off; read once), else kL2PrefetchStages. Off: at 16
// stages the layer was 3.5-6.4% slower at deepseek-v3 T = 8192, 14% with every row tile short (H100,
// 2026-12-07, PERF_NOTES.md session 23); kept as an experiment's knob.
constexpr int kL2PrefetchStages = 0;
int l2_prefetch_stages() {
  static const int stages = int(env::integer("NVFP4MOE_L2_PREFETCH", kL2PrefetchStages, 0, 64));
  return stages;
}

// The 128x256 tile's tail split (Params::row_part): an expert's rows past its last whole 256-row
// tile, when at most 32, run on the 128x32 tile, when 33-64 on the 128x64 tile, when 65-128 on the
// 128x128 tile, each tail kind in a launch of its own after the head's, instead of as a 256-row
// tile of their own. Such a short
// tile streams and converts the expert's weights for a few rows: ~48 us of SM time on the 128x256
// tile (one CTA per SM, its 4 stages latency-bound) against ~29 us for a 64-row 128x64 tile (two
// CTAs per SM) at deepseek-v3 L1; with 64-row tails on 128x64 the layer was 8-11% faster at
// deepseek-v3 T = 8192 under uniform and skewed routing, with 32-row tails on 128x32 12.5% under
// uniform (whose tails are mostly under 32 rows) but 3% under skewed (H100, 2026-12-07,
// PERF_NOTES.md session 24). The 65-128-row tails on 128x128 took deepseek-v3 skewed from 11030
// to 10490 us (-5%), mixtral-8x7b skewed -1.3%, the other rows within the noise (H100, 2026-12-07,
// session 26, with the tails overlapping the head). Every tile gives the same bits, so only speed
// changes. NVFP4MOE_TAIL_TILES in the environment (read once; tail_split.hpp's parse_tail_tiles):
// 0 (off), or which of 32, 64 and 128 take tails (e.g. 32,128: 33-128-row tails on 128x128),
// else all three.
// NVFP4MOE_TAIL_LARGEST_FIRST=1 (an experiment, read once): the tail launches largest tile first
// (TailTiles::largest_first).
gemm::TailTiles tail_tiles() {
  static const gemm::TailTiles t = [] {
    gemm::TailTiles x = gemm::parse_tail_tiles(std::getenv("NVFP4MOE_TAIL_TILES"));
    x.largest_first = env::integer("NVFP4MOE_TAIL_LARGEST_FIRST", 0, 0, 1) == 1;
    return x;
  }();
  return t;
}

// Whether the tail launches overlap the head (with PDL only): they start work at once
// (Params::wait_at_exit, pdl.cuh's release() and wait()) instead of after the head completes, so
// their CTAs take each SM the head's last wave leaves, and their weight streams run beside the
// head's last tiles. Measured 1-5% faster at T = 8192 under uniform and skewed routing and no
// slower under balanced (three presets, three rounds; H100, 2026-12-07, PERF_NOTES.md session 26).
// NVFP4MOE_TAIL_OVERLAP=0 in the environment turns it off (read once). (Giving the tails SMs of
// their own for the whole GEMM, session 25's NVFP4MOE_TAIL_SMS=N, made deepseek-v3 skewed 36%
// slower with 12 SMs, 17% with 16: a tail tile costs too much SM time for a few SMs to keep up.)
bool tail_overlap() {
  static const bool on = !env::switched_off("NVFP4MOE_TAIL_OVERLAP");
  return on && pdl::enabled(false);
}

// Params::narrow_issue: which short row tiles issue narrower wgmmas than their tile, so that their
// MMA work follows their rows. 1: the 128x256 tile's of at most 64 and 128 rows (session 24); 2:
// also its 129-192-row tiles (the head's last tile of an expert whose rows past its whole 256-row
// tiles number 129-192: a quarter of the partial tiles of qwen3-30b-a3b and deepseek-v3 under
// skewed routing) 192 wide; 3 (default): also the 128x128 tile's of at most 64 and 96 rows (the
// 65-128-row tails; not with the kSwigluNvfp4 epilogue: gemm_config.cuh).
// NVFP4MOE_NARROW_ISSUE=0..3 in the environment picks one (read once).
int narrow_issue_level() {
  static const int level = int(env::integer("NVFP4MOE_NARROW_ISSUE", 3, 0, 3));
  return level;
}

#if defined(NVFP4MOE_GEMM_VARIANTS)
// NVFP4MOE_GEMM_VARIANT (A/B builds only): "n64q" or "n64qp" runs that variant of the N64 tile
// (gemm_config.cuh's NVFP4MOE_GEMM_VARIANT_TILES); read once. (NVFP4MOE_NARROW_ISSUE=0 replaces
// its former "n256full".)
const std::string& gemm_variant() {
  static const std::string v = [] {
    const char* e = std::getenv("NVFP4MOE_GEMM_VARIANT");
    return std::string(e ? e : "");
  }();
  return v;
}
#endif

}  // namespace

GemmTile choose_gemm_tile(int64_t total_rows, int64_t experts) noexcept {
  if (experts <= 0) return GemmTile::kM128N128;
  // Average rows per expert (routing skew only makes some experts bigger, which the larger tiles
  // serve well). Up to 16 rows, one N16 tile per expert streams the weights once with the least
  // wasted MMA work; up to 32 the N32 tile (at 32 rows it beat N64 by 1.2-1.3x, at 40 N64 beat it
  // by 1.4x: qwen3-30b-a3b, 2026-12-02); up to 64 rows (decode batches, mid-size prefill over many
  // experts) the N64 tile reads each expert's weights once; beyond that the N128 tile (at 80 rows
  // 1.1-1.25x faster than N64's two row tiles per expert, and its MMA-to-conversion ratio wins);
  // beyond 128 rows the N256 tile, whose wgmmas hide the weight conversion (the layer 4-14% faster
  // at T = 8192 on the three presets and routings; at exactly 128 rows N256 was 10-23% slower,
  // H100 2026-12-07: gemm_config.cuh).
  // At most 8 rows in all (one token's top-k): no expert can have more than 8, so the N8 tile
  // reads every expert's weights once with half of N16's MMA work and x bytes.
  if (total_rows <= 8) return GemmTile::kM128N8;
  if (total_rows <= 16 * experts) return GemmTile::kM128N16;
  if (total_rows <= 32 * experts) return GemmTile::kM128N32;
  if (total_rows <= 64 * experts) return GemmTile::kM128N64;
  if (total_rows <= 128 * experts) return GemmTile::kM128N128;
  return GemmTile::kM128N256;
}

namespace {
// The expert count the tile and split choice assume (GroupedGemmArgs::schedule_experts).
int64_t schedule_experts(const GroupedGemmArgs& a) noexcept {
  return a.schedule_experts > 0 ? a.schedule_experts : a.experts;
}
// The rows the tile and split choice assume (GroupedGemmArgs::schedule_rows).
int64_t schedule_rows(const GroupedGemmArgs& a) noexcept {
  return a.schedule_rows > 0 ? std::min(a.schedule_rows, a.total_rows) : a.total_rows;
}
}  // namespace

GemmTile launch_gemm_tile(const GroupedGemmArgs& a, int sms) noexcept {
  if (a.tile != GemmTile::kAuto) return a.tile;
  const GemmTile tile = choose_gemm_tile(schedule_rows(a), schedule_experts(a));
  if (tile != GemmTile::kM128N8 || a.max_splits == 1 || !warp_kernel_on() ||
      !gemm::warp::supports(a.epilogue, a.total_rows, a.k)) {
    return tile;
  }
  if (sms <= 0) {
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
      (void)cudaGetLastError();
      return tile;
    }
  }
  // The N8 tiles (an upper bound: every expert with rows has one row tile) against its CTA slots.
  const int64_t n8_tiles = (a.n + 127) / 128 * std::min(schedule_rows(a), schedule_experts(a));
  const int64_t slots = 2 * int64_t(sms);
  const bool n8_fills_one_round = n8_tiles * 10 >= slots * 9 && n8_tiles <= slots;
  const bool n8_many_rounds = n8_tiles > 2 * slots;  // (mixtral-8x7b T = 2 and 4: N8 3-4% faster)
  return n8_fills_one_round || n8_many_rounds ? tile : GemmTile::kWarpM16N8;
}

Status grouped_gemm_nvfp4(const GroupedGemmArgs& a, void* stream) noexcept {
  // Shapes, counts and enum values: the rules live in can_implement.cpp only.
  if (Status s = grouped_gemm_nvfp4_can_implement(a); s != Status::kSuccess) return s;
  static_assert(gemm::kMaxExperts == kExpertLimit, "the kernel's expert table holds every expert the API allows");
  const bool nvfp4_out = a.epilogue == GemmEpilogue::kSwigluNvfp4;
  if (nvfp4_out) {
    if (!a.out_scales || !a.act_decode_scales) {
      return fail(Status::kNullPointer, "grouped_gemm_nvfp4: kSwigluNvfp4 needs out_scales and act_decode_scales");
    }
    // Every scale byte the kernel does not write (padding rows and columns of each expert's
    // region; all of them when there are no rows) reads as zero, as quantize_nvfp4_grouped
    // writes them. Stream-ordered before the kernel.
    cudaError_t e = cudaMemsetAsync(a.out_scales, 0, grouped_scale_bytes(a.total_rows, a.experts, a.n / 2),
                                    static_cast<cudaStream_t>(stream));
    if (e != cudaSuccess) {
      return fail(Status::kCudaError, "grouped_gemm_nvfp4: cudaMemsetAsync: %s", cudaGetErrorString(e));
    }
  }
  if (a.total_rows == 0) return Status::kSuccess;
  if (!a.prepared || !a.decode_scale || !a.x || !(a.expert_stride > 0 ? a.expert_counts : a.expert_offsets) || !a.out) {
    return fail(Status::kNullPointer, "grouped_gemm_nvfp4: null pointer");
  }
  if (reinterpret_cast<uintptr_t>(a.x) % 16 || reinterpret_cast<uintptr_t>(a.out) % 16 ||
      reinterpret_cast<uintptr_t>(a.prepared) % 16) {
    return fail(Status::kMisaligned, "grouped_gemm_nvfp4: x, out and prepared weights must be 16-byte aligned");
  }
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    return fail(Status::kCudaError, "grouped_gemm_nvfp4: cannot read the multiprocessor count");
  }
  gemm::Params p{static_cast<const uint8_t*>(a.prepared),
                 a.decode_scale,
                 a.expert_offsets,
                 static_cast<__nv_bfloat16*>(a.out),
                 static_cast<uint8_t*>(a.out_scales),
                 a.act_decode_scales,
                 int(a.num_act_decode_scales),
                 int(a.experts),
                 int(a.n),
                 int(a.k),
                 int(a.total_rows),
                 1,
                 a.expert_counts,
                 int(a.expert_stride)};
  cudaStream_t st = static_cast<cudaStream_t>(stream);

  const GemmTile tile = launch_gemm_tile(a, sms);
  if (tile == GemmTile::kWarpM16N8) {
    p.splits = gemm::warp::choose_splits(schedule_rows(a), schedule_experts(a), a.n, a.k, sms, a.max_splits);
    return gemm::warp::launch(p, a.x, a.epilogue, sms, stream);
  }
  auto encode = tensor_map_encoder();
  if (!encode) return fail(Status::kCudaError, "grouped_gemm_nvfp4: cuTensorMapEncodeTiled is unavailable");
  int block_n = tile == GemmTile::kM128N8    ? 8
                : tile == GemmTile::kM128N16 ? 16
                : tile == GemmTile::kM128N32 ? 32
                : tile == GemmTile::kM128N64 ? 64
                : tile == GemmTile::kM128N128 ? 128
                                              : 256;
  p.narrow_issue = narrow_issue_level();
  p.l2_prefetch = l2_prefetch_stages();

  // x as a 2-D tensor (k inner, rows outer); boxes of 64 k x block_n rows (64 rows on N256:
  // gemm::x_box_rows) with the 128-byte swizzle that the wgmma K-major SW128 layout expects. Rows
  // past total_rows read as zero.
  auto encode_x = [&](CUtensorMap* map, int tile_rows) {
    cuuint64_t dims[2] = {cuuint64_t(a.k), cuuint64_t(a.total_rows)};
    cuuint64_t strides[1] = {cuuint64_t(a.k) * 2};
    cuuint32_t box[2] = {64, cuuint32_t(gemm::x_box_rows(tile_rows))};
    cuuint32_t elem_strides[2] = {1, 1};
    CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(a.x), dims, strides, box,
                        elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    return r == CUDA_SUCCESS ? Status::kSuccess
                             : fail(Status::kCudaError, "grouped_gemm_nvfp4: cuTensorMapEncodeTiled failed (%d)", int(r));
  };
  CUtensorMap map;
  if (Status s = encode_x(&map, block_n); s != Status::kSuccess) return s;
  // The 128x256 tile's tail split: the tails' tiles and the 128x32 and 128x128 tiles' x boxes (the
  // 128x64 tile's are the 128x256 tile's 64 rows).
  const gemm::TailTiles tails = tile == GemmTile::kM128N256 ? tail_tiles() : gemm::TailTiles{false, false, false};
  CUtensorMap n32_map = map, n128_map = map;
  if (tails.n32) {
    if (Status s = encode_x(&n32_map, 32); s != Status::kSuccess) return s;
  }
  if (tails.n128) {
    if (Status s = encode_x(&n128_map, 128); s != Status::kSuccess) return s;
  }
  static_assert(gemm::x_box_rows(64) == gemm::x_box_rows(256), "the 128x64 tail reuses the head's x boxes");

  // Split-K (N8 and N16 tiles only): when even an upper bound of the tiles leaves CTA slots idle,
  // clusters of 4, 3 or 2 CTAs share each tile's K (each CTA keeping >= 4 64-K chunks, one 256-K
  // stage of these tiles; a CTA with 1-2 stages no longer overlaps loads with conversion, which
  // cost qwen3-30b-a3b L2 at T = 1 0.7 us, PERF_NOTES.md): the most CTAs per tile
  // for which every tile still gets a cluster at once (as many as the device holds resident, which
  // the GPCs bound: 62 clusters of 4 on the H200, so mixtral-8x7b's 64 L2 tiles at T = 1 take
  // clusters of 3; with 4 they took two rounds, 40 us instead of ~24, 2026-12-02). The bound:
  // expert e has ceil(rows_e / block_n) row tiles, and sum_e ceil(rows_e / block_n) is at most
  // total_rows and at most total_rows / block_n + (experts with rows). (Splitting whenever it
  // saves >= 10% of the walk's rounds, counted in whole-tile times, was measured 1.3-1.7x slower on
  // launches with 320-448 tiles, 2026-12-02: a split CTA does not stream faster per byte.)
  auto choose_splits = [&](auto epilogue) {
    constexpr GemmEpilogue E = decltype(epilogue)::value;
    const bool n8 = tile == GemmTile::kM128N8;
    if ((!n8 && tile != GemmTile::kM128N16) || a.max_splits == 1) return 1;
    const int64_t m_tiles = (a.n + 127) / 128, k_tiles = a.k / 64;
    const int64_t rows = schedule_rows(a);
    const int64_t row_tiles = std::min(rows, rows / block_n + std::min(schedule_experts(a), rows));
    const int64_t tiles = m_tiles * row_tiles;
    if (tiles * 2 > int64_t(sms) * 2) return 1;  // two CTAs per SM: no idle slot to give
    for (int s : {4, 3, 2}) {
      if (k_tiles >= 4 * s && (a.max_splits == 0 || s <= a.max_splits) &&
          tiles <= (n8 ? gemm::max_active_clusters<gemm::ConfigN8SplitK<E>>(s, sms)
                       : gemm::max_active_clusters<gemm::ConfigN16SplitK<E>>(s, sms))) {
        return s;
      }
    }
    return 1;
  };
  using gemm::launch_grouped_gemm;
  auto launch = [&](auto epilogue) {
    constexpr GemmEpilogue E = decltype(epilogue)::value;
    p.splits = choose_splits(epilogue);
    switch (tile) {
      case GemmTile::kM128N8:
        return p.splits > 1 ? launch_grouped_gemm<gemm::ConfigN8SplitK<E>>(map, p, sms, st)
                            : launch_grouped_gemm<gemm::ConfigN8<E>>(map, p, sms, st);
      case GemmTile::kM128N16:
        return p.splits > 1 ? launch_grouped_gemm<gemm::ConfigN16SplitK<E>>(map, p, sms, st)
                            : launch_grouped_gemm<gemm::ConfigN16<E>>(map, p, sms, st);
      case GemmTile::kM128N32: return launch_grouped_gemm<gemm::ConfigN32<E>>(map, p, sms, st);
#if defined(NVFP4MOE_GEMM_VARIANTS)
      case GemmTile::kM128N64:
        if (gemm_variant() == "n64q") return launch_grouped_gemm<gemm::ConfigN64Q<E>>(map, p, sms, st);
        if (gemm_variant() == "n64qp") return launch_grouped_gemm<gemm::ConfigN64QP<E>>(map, p, sms, st);
        return launch_grouped_gemm<gemm::ConfigN64<E>>(map, p, sms, st);
#else
      case GemmTile::kM128N64: return launch_grouped_gemm<gemm::ConfigN64<E>>(map, p, sms, st);
#endif
      case GemmTile::kM128N256: {
        // tail_split_plan's launches: disjoint rows of out (cpp/tests/tail_split.cu), each
        // waiting for the one before it (pdl.cuh), or, when they overlap, only before it exits.
        gemm::TailLaunch plan[gemm::kMaxTailLaunches];
        const int launches = gemm::tail_split_plan(tails, plan);
        const bool overlap = launches > 1 && tail_overlap();
        for (int i = 0; i < launches; ++i) {
          p.row_part = plan[i].row_part;
          p.tail_lo = plan[i].tail_lo;
          p.tail_hi = plan[i].tail_hi;
          p.wait_at_exit = i > 0 && overlap;
          Status s = plan[i].block_n == 32  ? launch_grouped_gemm<gemm::ConfigN32<E>>(n32_map, p, sms, st)
                     : plan[i].block_n == 64  ? launch_grouped_gemm<gemm::ConfigN64<E>>(map, p, sms, st)
                     : plan[i].block_n == 128 ? launch_grouped_gemm<gemm::ConfigN128<E>>(n128_map, p, sms, st)
                                              : launch_grouped_gemm<gemm::ConfigN256<E>>(map, p, sms, st);
          if (s != Status::kSuccess) return s;
        }
        return Status::kSuccess;
      }
      default: return launch_grouped_gemm<gemm::ConfigN128<E>>(map, p, sms, st);
    }
  };
  switch (a.epilogue) {
    case GemmEpilogue::kPlain:
      return launch(std::integral_constant<GemmEpilogue, GemmEpilogue::kPlain>{});
    case GemmEpilogue::kInterleaved:
      return launch(std::integral_constant<GemmEpilogue, GemmEpilogue::kInterleaved>{});
    case GemmEpilogue::kSwigluBf16:
      return launch(std::integral_constant<GemmEpilogue, GemmEpilogue::kSwigluBf16>{});
    case GemmEpilogue::kSwigluNvfp4:
      return launch(std::integral_constant<GemmEpilogue, GemmEpilogue::kSwigluNvfp4>{});
  }
  return fail(Status::kInvalidShape, "grouped_gemm_nvfp4: unknown epilogue %d", int(a.epilogue));
}

}  // namespace nvfp4moe
