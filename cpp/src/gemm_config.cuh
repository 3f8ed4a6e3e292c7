// The grouped GEMM's tile configurations (grouped_gemm_sm90.cuh): the CTA shape constants, the
// kernel parameters, the Config template, and NVFP4MOE_GEMM_TILES, the one list of the tiles the
// library builds. Adding a tile shape is one line there: the ConfigX aliases below, the explicit
// instantiations (cpp/CMakeLists.txt compiles grouped_gemm_instance.cu once per tile and epilogue,
// reading the list from this file) and their extern declarations come from it; the host side picks
// a tile by name (grouped_gemm.cu).
#pragma once

#include "nvfp4moe/nvfp4moe.h"
#include "gemm_splitk.cuh"
#include "nvfp4_weights.cuh"
#include "tail_split.hpp"

#include <cuda_bf16.h>

#include <type_traits>

#include <cute/atom/mma_atom.hpp>
#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

namespace nvfp4moe::gemm {

using namespace cute;

constexpr int kMaxExperts = 1024;
constexpr int kTileK = 64;  // K of one prepared chunk; a stage holds Cfg::kChunks of them per consumer
// kSwigluNvfp4: the quantizer warps (warps 1-3 of the producer warpgroup); their hand-over with
// the consumers is Config::SharedStorage's EpiHandOff.
constexpr int kQuantizerThreads = 96;

// v, through a volatile move: a value derived from it is computed where it is used instead of
// being hoisted out of a loop (and kept, or spilled, across it).
CUTLASS_DEVICE int unhoisted(int v) {
  int r;
  asm volatile("mov.b32 %0, %1;" : "=r"(r) : "r"(v));
  return r;
}

struct Params {
  const uint8_t* prepared;     // nvfp4_weights.cuh layout
  const float* decode_scale;   // [E, 2]: features f % 16 < 8, then the others
  const int* expert_offsets;   // [E+1]
  __nv_bfloat16* out;          // [total_rows, n] (kSwigluNvfp4: codes u8 [total_rows, n / 4])
  uint8_t* out_scales;         // kSwigluNvfp4: grouped 128x4 scales with per-expert regions
  const float* act_scale;      // kSwigluNvfp4: activation decode scales, [1] or [E]
  int num_act_scales;
  int experts;
  int n;
  int k;
  int total_rows;              // rows of x and out: offsets are clamped to [0, total_rows]
  int splits;                  // CTAs per tile (the cluster size; 1: no split-K), <= Cfg::kMaxSplits
  // The pre-dispatched layout (expert_stride > 0, expert_offsets unused): expert e's rows start at
  // e * expert_stride, expert_counts[e] of them (GroupedGemmArgs::expert_stride).
  const int* expert_counts;    // [E]
  int expert_stride;
  // Tiles with Config::kNarrowIssue: N256's row tiles of at most 64, 128 or (with 2 or more) 192
  // rows run m64n64, m64n128 or m64n192 wgmmas and load only their rows' x boxes; with 3, N128's
  // row tiles of at most 64 or 96 rows run m64n64 or m64n96 wgmmas (0: always the whole tile;
  // grouped_gemm.cu's narrow_issue_level()).
  int narrow_issue = 3;
  // Tiles with Config::kL2Prefetch (N256): the producer prefetches into L2 the weights of the stage
  // this many stages ahead of the one it loads (0: none; grouped_gemm.cu's l2_prefetch_stages()).
  int l2_prefetch = 0;
  // The launch's share of each expert's rows (grouped_gemm.cu's tail split of the 128x256 tile):
  // kAllRows every row; with the expert's rem = rows % kTailBlock (the rows past its last whole
  // kTailBlock-row tile), kHeadRows all but rem when tail_lo < rem <= tail_hi, kTailRows only
  // those rem rows (none otherwise). A head with (0, 64] and tails with (0, 32] and (32, 64]
  // cover every row once between them (tail_split.hpp's plan; cpp/tests/tail_split.cu checks it).
  int row_part = 0;
  int tail_lo = 0;
  int tail_hi = 0;
  // A tail launch overlapping the head (grouped_gemm.cu's tail_overlap()): it reads nothing its
  // predecessor (the head, or the tail before it) writes, so it starts work at once and waits for
  // the predecessor only before it exits (pdl.cuh's release(), wait()), letting its successor see both.
  int wait_at_exit = 0;
};

// Rows of one TMA box of x: the whole tile, but 64 on tiles over 128 rows, whose row tiles load
// only the boxes that hold rows (Config::kNarrowIssue). The host encodes the tensor map with it.
constexpr int x_box_rows(int block_n) { return block_n > 128 ? 64 : block_n; }

// kMinBlocks CTAs share an SM: with 2, the register budget per thread halves (the producer
// warpgroup keeps 40, consumers get 96; ptxas compiles for 80) and so must the shared memory;
// small-N tiles need few registers, and two CTAs double the warps that convert weights, which
// bounds decode throughput.
template <int kBlockN_, int kStages_, int kMinBlocks_, GemmEpilogue kEpilogue_, bool kPipelined_ = true,
          int kMaxSplits_ = 1, int kChunks_ = 1, int kConsumers_ = 2>
struct Config {
  // A producer warpgroup and kConsumers consumer warpgroups of 64 features each; setmaxnreg moves
  // the producer's registers to the consumers. (A 288-thread CTA with one producer warp and no
  // setmaxnreg was measured 5-10% slower on the N64 and N128 tiles, 2026-11-29.)
  static constexpr int kConsumers = kConsumers_;
  static constexpr int kConsumerThreads = 128 * kConsumers_;
  static constexpr int kThreads = 128 + kConsumerThreads;
  static constexpr int kTileM = 64 * kConsumers_;  // features per tile
  static_assert(kConsumers_ == 2 || (kConsumers_ == 4 && kMinBlocks_ == 1 && kMaxSplits_ == 1),
                "two consumer warpgroups, or four at one CTA per SM without split-K");
  // The other epilogues' staging buffer of consumer cw is guarded by named barrier 1 + cw (CUTLASS
  // user ids 0-7).
  static_assert(1 + kConsumers_ <= 8, "CUTLASS 4.2 leaves user ids 0-7 (hardware barriers 8-15)");
  static constexpr GemmEpilogue kEpilogue = kEpilogue_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr int kMinBlocks = kMinBlocks_;
  // kSwigluNvfp4: the producer warpgroup also quantizes (one CTA per SM: 56 registers, 40 spill,
  // its consumers keep 224; two: 48, which uses all of the 80 x 384 a CTA is given).
  static constexpr bool kQuantizerWarps = kEpilogue_ == GemmEpilogue::kSwigluNvfp4;
  // Four consumer warpgroups (640 threads, compiled for 96 registers): 104 each beside the
  // producer's 56.
  static constexpr int kProducerRegs = kQuantizerWarps || kConsumers_ == 4 ? (kMinBlocks == 1 ? 56 : 48) : 40;
  static constexpr int kConsumerRegs =
      kConsumers_ == 4 ? 104 : kMinBlocks == 1 ? (kQuantizerWarps ? 224 : 232) : 96;
  // Two A fragments, one wgmma group in flight (see the mainloop); false: one fragment, each
  // stage's wgmmas retired before the next stage's conversion (fewer registers).
  static constexpr bool kPipelined = kPipelined_;
  // Split-K over clusters of up to kMaxSplits CTAs (gemm_splitk.cuh); 1: never split.
  static constexpr int kMaxSplits = kMaxSplits_;
  // Prepared 64-K chunks per consumer warpgroup per stage: K per stage is 64 kChunks.
  static constexpr int kChunks = kChunks_;
  static constexpr int kStageK = kTileK * kChunks_;
  static_assert(kChunks_ == 1 || (!kPipelined_ && (kChunks_ == 2 || kChunks_ == 4)),
                "one chunk per stage, or two or four unpipelined");
  // One accumulator chain per tile on every tile shape: a row's K-sum order (and so its bits) must
  // not depend on which tile the launch picks (batch invariance). Two chains per N16 stage (one per
  // 64-K chunk) were 0.5% faster at deepseek-v3 T = 16 and broke that: 1 value in ~4000 differed
  // from the N32/N64/N128 tiles after BF16 rounding (batch_invariant_rows_do_not_depend_on_the_launch,
  // 2026-12-02).
  static constexpr int kAccum = 64 * kBlockN_ / 128;  // accumulator floats per consumer thread
  // The A fragment: pipelined, a whole stage (two of them, one group in flight). Unpipelined, as
  // many chunks (16 registers each) as fit beside the accumulators in 48 of the 80 registers of
  // two CTAs per SM, the stage converted and retired in parts: two for N8, N16 and N32 (a whole
  // 256-K stage would need 64 registers), one for N64 (32 registers of accumulators).
  // (Four consumers at one CTA per SM: ptxas compiles the 640-thread kernel for 96 registers, the
  // same budget: a whole 128-K N64 stage fragment spilled.)
  static constexpr int kUnpipelinedFragChunks = (48 - kAccum) / 16;
  static constexpr int kFragChunks =
      kPipelined_ || kChunks_ < kUnpipelinedFragChunks ? kChunks_ : kUnpipelinedFragChunks;
  static_assert(kFragChunks >= 1 && kChunks_ % kFragChunks == 0, "a stage is a whole number of fragments");
  static constexpr int kFragK = kTileK * kFragChunks;
  static_assert(kMinBlocks == 1 || kMinBlocks == 2, "one or two CTAs per SM");
  // The CTA's registers per thread at launch: ptxas compiles for the most (a multiple of 8) at
  // which kMinBlocks CTAs fit the SM's 64K (168 for one CTA of 384 threads, 80 for two, 96 for one
  // of 640). setmaxnreg only moves registers within the CTA's allocation: an increase past it
  // never completes (the N64Q variants, built in session 14, asked 56 + 4 x 112 of 96 x 640 and
  // hung on the GPU in sessions 15 and 16).
  static constexpr int kLaunchRegs = 65536 / (kMinBlocks * kThreads) / 8 * 8;
  static_assert(kProducerRegs % 8 == 0 && kConsumerRegs % 8 == 0 && kProducerRegs >= 24 && kConsumerRegs <= 256,
                "setmaxnreg takes multiples of 8 in [24, 256]");
  static_assert(128 * kProducerRegs + kConsumerThreads * kConsumerRegs <= kLaunchRegs * kThreads,
                "setmaxnreg's registers must fit the CTA's allocation");
  static_assert(kBlockN % 8 == 0 && kBlockN >= 8 && kBlockN <= 256, "wgmma N is a multiple of 8 up to 256");
  // N256 (issue 22): an expert's last row tile often holds a few rows (ragged routing: deepseek-v3
  // at T = 8192 has 256 +- 16 rows per expert, so half its experts need a second, nearly empty
  // tile; such tails of at most 128 rows now run on the N32, N64 and N128 tiles instead, grouped_gemm.cu,
  // so this serves last tiles of 129-255 rows, and every short one with NVFP4MOE_TAIL_TILES=0).
  // A short tile issues m64n64, m64n128 or m64n192 wgmmas on the first accumulators, which hold
  // the first 64, 128 or 192 rows (wgmma's D layout: value i is row 8 (i / 4) + ...), and loads only the x
  // boxes that hold rows: its MMA work and x bytes follow its rows; its weights are converted once
  // either way. The columns past the tile's rows read whatever the stage holds; a wgmma column
  // depends on its own B column only, and those rows are never stored.
  // N128 (the 65-128-row tails and prefill at 65-128 rows per expert): 64 or 96 wide likewise
  // (Params::narrow_issue 3); its one x box holds every row either way. Not with the quantizer
  // warps (kSwigluNvfp4): at their 224 consumer registers the extra widths made ptxas serialize
  // every wgmma (C7511, CUDA 13.0).
  static constexpr bool kNarrowIssue = kBlockN_ == 256 || (kBlockN_ == 128 && !kQuantizerWarps);
  // N256: a short row tile has little MMA work per 64-K stage, so its stages come as fast as
  // memory latency allows, and its 4 stages in flight (the x tiles' shared memory bounds them) do
  // not cover an HBM round trip: deepseek-v3 L1 under uniform routing spent ~48 us on each tile of
  // ~16 rows against ~75 us on a full one (H100, 2026-12-07: 430 ns per stage, ~4 stages per HBM
  // round trip). Its weights (the bytes no other tile is reading) can be prefetched into L2
  // Params::l2_prefetch stages ahead (off by default: measured slower, grouped_gemm.cu).
  static constexpr bool kL2Prefetch = kBlockN_ == 256;
  static constexpr int kBoxRows = x_box_rows(kBlockN_);
  static_assert(kBlockN_ % kBoxRows == 0, "a tile is a whole number of x boxes");

  // The register-A wgmma of N rows (kBlockN; kNarrowIssue tiles also 64, 128 and 192).
  template <int N>
  using MmaOpN =
      decltype(SM90::GMMA::rs_op_selector<bfloat16_t, bfloat16_t, float, Shape<_64, Int<N>, Int<kStageK>>>());
  using MmaOp = MmaOpN<kBlockN>;
  using TiledMma = decltype(make_tiled_mma(MmaOp{}));
  // x tile per stage: (kBlockN, 64 kChunks, stages), K-major with the 128-byte swizzle TMA writes;
  // the swizzle atoms are 64 wide, so each 64-K piece is contiguous: one (kBlockN, 64) TMA box, or
  // (N256) kBlockN / kBoxRows boxes of (kBoxRows, 64) one after another.
  using SmemLayoutB = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<bfloat16_t>{},
                                             make_shape(Int<kBlockN>{}, Int<kStageK>{}, Int<kStages>{})));
  using Pipeline = cutlass::PipelineTmaAsync<kStages>;

  // kSwigluNvfp4's hand-over of consumer cw's staged tile to the quantizer warps, on mbarriers:
  // full[cw] completes a phase when the consumer's 128 threads have staged a tile, empty[cw] when
  // the 96 quantizer threads have read it. (Until session 15 named barriers, bar.arrive / bar.sync,
  // did the same; compute-sanitizer racecheck does not take bar.arrive as ordering the arriving
  // threads' accesses and reported the hand-over as a race, scripts/racecheck-probe.cu. It does
  // model mbarriers, as the split-K hand-over through distributed shared memory shows. The
  // mbarrier build's time is not yet measured: expected the same.)
  struct EpiHandOff {
    alignas(8) uint64_t full[kConsumers_];
    alignas(8) uint64_t empty[kConsumers_];
  };
  struct NoEpiHandOff {};

  struct alignas(1024) SharedStorage {
    alignas(1024) bfloat16_t b[kBlockN * kStageK * kStages];           // (kBlockN, kStageK, stages)
    alignas(128) uint8_t a[kStages][kConsumers][kChunks * weights::kChunkBytes];  // (stage, consumer, chunk)
    alignas(16) bfloat16_t epi[kConsumers][kBlockN * 64];  // per consumer: (rows, 64 features)
    int tile_prefix[kMaxExperts + 1];
    typename Pipeline::SharedStorage pipeline;
    std::conditional_t<(kMaxSplits > 1), splitk::Storage<kMaxSplits, kAccum>, splitk::NoStorage> split;
    std::conditional_t<kQuantizerWarps, EpiHandOff, NoEpiHandOff> epi_sync;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static constexpr uint32_t kStageBytes = kChunks * (kConsumers * weights::kChunkBytes + kBlockN * kTileK * 2);
};

// The tile list: X(name, kBlockN, stages, CTAs per SM, pipelined, max split-K CTAs, 64-K chunks
// per stage, consumer warpgroups), one line per tile (the build parses the lines that start with
// "  X(").
// - N8 (and N8SplitK), at most 8 rows in all (T = 1): N16's schedule with m64n8k16 wgmmas, half
//   the MMA work and half the x bytes per stage (15/16 of N16's are padding at one row): 4-8% faster
//   than N16 on the T = 1 launches with few tiles, 1.5% slower on deepseek-v3 L1 (2026-12-02).
// - N16, the decode tile: four chunks (256 K) per stage, unpipelined, converted and retired in two
//   128-K fragments (each fragment's wgmmas retire before the next conversion; four consumer
//   warpgroups per SM hide that). 256-K stages made the GEMMs 8-10% faster at T = 16 than 128-K
//   ones (and those the layer 4-10% faster than 64-K ones); pipelining two chunks in flight made it
//   3-20% slower (PERF_NOTES.md, 2026-12-02). 3 stages of 26.6 KB: the bytes in flight of 6 x 128 K.
// - N16SplitK: the same tile for launches with few tiles, split over K by clusters of up to 4 CTAs.
//   A separate instantiation: the reduction's 24 KB of shared memory and its code made the unsplit
//   N16 kernel 4-7% slower (2026-12-02).
// - N32, 17-32 rows per expert: N16's schedule at two CTAs per SM with 128-K stages (5 fit 99 KB
//   each; 3 of 256 K do not fit). Against
//   N64 (one CTA per SM, half the converting warps, half its MMA work padding at 32 rows) the layer
//   at 32 rows per expert took 2592 vs 3448 us (deepseek-v3 T = 1024), 168 vs 219 (qwen3-30b-a3b
//   T = 512), 287 vs 369 (mixtral-8x7b T = 128); at 64 rows N64 wins (2026-12-02, PERF_NOTES.md).
// - N64, 33-64 rows per expert: N32's schedule (two CTAs per SM, unpipelined, 128-K stages) with
//   each stage converted and retired in two 64-K parts (32 registers of accumulators). Against the
//   one-CTA, chunk-pipelined N64 (8 stages) at 64 rows per expert: the GEMMs 5-11% faster
//   (qwen3-30b-a3b L2 71.2 -> 63.5 us), the layer 5-8% (2026-12-02, PERF_NOTES.md).
// - N128, prefill at 65-128 rows per expert.
// - N256 (issue 22), prefill beyond 128 rows per expert: each converted A fragment feeds a 64x256
//   wgmma (the wgmma probe: in-register conversion does not hide under N128's wgmmas, 604 against
//   967 TFLOP/s without it, and mostly does under N256's, 927; H100 2026-12-06); an expert's short
//   last row tile issues 64, 128 or 192 wide (Config::kNarrowIssue), and its last 1-128 rows run on
//   N32, N64 or N128 in launches of their own (grouped_gemm.cu's tail split). 128 accumulators per consumer
//   thread, 4 stages of 36.5 KiB and a 64 KiB epilogue buffer (215 KiB). Against N128 at T = 8192
//   (H100, 2026-12-07): the layer 4-14% faster (deepseek-v3, mixtral-8x7b, qwen3-30b-a3b; balanced,
//   uniform and skewed routing), deepseek-v3 L1 / L2 5284 / 2890 us against 6177 / 3332; at exactly
//   128 rows per expert 10-23% slower (its 4 stages against N128's 8), hence N128 up to 128.
#define NVFP4MOE_GEMM_TILES(X)             \
  X(N8, 8, 4, 2, false, 1, 4, 2)           \
  X(N8SplitK, 8, 4, 2, false, 4, 4, 2)     \
  X(N16, 16, 3, 2, false, 1, 4, 2)         \
  X(N16SplitK, 16, 3, 2, false, 4, 4, 2)   \
  X(N32, 32, 5, 2, false, 1, 2, 2)         \
  X(N64, 64, 3, 2, false, 1, 2, 2)         \
  X(N128, 128, 8, 1, true, 1, 1, 2)        \
  X(N256, 256, 4, 1, true, 1, 1, 2)

// A/B variants (the same parameters), compiled only with the CMake option NVFP4MOE_GEMM_VARIANTS
// (which defines the macro of that name for the dispatcher; not for release), chosen at run time by
// NVFP4MOE_GEMM_VARIANT (grouped_gemm.cu). N64Q and N64QP: the N64 tile as four consumer
// warpgroups (256 features) sharing one x tile at one CTA per SM (640 threads, 104 registers per
// consumer): unpipelined with whole 128-K stage fragments, and pipelined with 64-K stages.
#define NVFP4MOE_GEMM_VARIANT_TILES(V)     \
  V(N64Q, 64, 5, 1, false, 1, 2, 4)        \
  V(N64QP, 64, 10, 1, true, 1, 1, 4)

// ConfigN16<E>, ConfigN16SplitK<E>, ...: each tile of the lists for epilogue E.
#define NVFP4MOE_GEMM_ALIAS(name, block_n, stages, min_blocks, pipelined, max_splits, chunks, consumers) \
  template <GemmEpilogue E>                                                                               \
  using Config##name = Config<block_n, stages, min_blocks, E, pipelined, max_splits, chunks, consumers>;
NVFP4MOE_GEMM_TILES(NVFP4MOE_GEMM_ALIAS)
NVFP4MOE_GEMM_VARIANT_TILES(NVFP4MOE_GEMM_ALIAS)
#undef NVFP4MOE_GEMM_ALIAS

}  // namespace nvfp4moe::gemm
