// The NVFP4-weight grouped GEMM for Hopper (sm_90a): a warp-specialized persistent kernel.
//
//   out[r, f] = sum_k x[r, k] * W_e[f, k] * g_e      for rows r of expert e
//
// GEMM view: M = output features f (weights, register-sourced wgmma A), N = rows/tokens (x, wgmma B
// from shared memory), K = k. A CTA tile is 64 kConsumers features (128 on the shipped tiles) x
// kBlockN rows; a K stage is kChunks x 64
// wide (N8 and N16 take 256 per stage, N32 and N64 128, N128 and N256 64: gemm_config.cuh's tile list); a
// partial last stage loads and converts only its parts with a chunk inside K, and its x pieces past
// K are zero-filled by the TMA unit.
//
// Roles (128 + 128 kConsumers threads; 384 on the shipped tiles):
//   warpgroup 0 (producer, one elected thread): per stage, one bulk copy of kChunks prepared
//     weight chunks per consumer warpgroup (nvfp4_weights.cuh) and kChunks TMA 2-D loads of the
//     x tile (kBlockN rows x 64 k each, on N256 up to four boxes of 64 rows; 128-byte swizzle, the
//     GMMA K-major SW128 layout), all
//     completing on the stage's full barrier (cutlass::PipelineTmaAsync).
//   warpgroups 1.. kConsumers (consumers): each owns 64 of the tile's features. Per 64-K chunk, each thread
//     reads its 16 code bytes and 8 scale bytes, converts them to BF16 A fragments exactly
//     (shift/mask/or and one bf16x2 multiply per pair), and issues 4 m64 x kBlockN x k16 wgmmas
//     as one group (narrower on a short row tile: N256 64, 128 or 192 wide, N128 64 or 96,
//     issue_rows(); N256's tails of at most 128 rows go to the N32 / N64 / N128 tiles, grouped_gemm.cu). Unpipelined (the tiles at two CTAs per SM: 80 registers): each fragment's
//     group retires before the next conversion, and the other CTA's warpgroups fill the wait.
//     Pipelined (N128 and N256, one CTA per SM): two fragments, one group in flight. The epilogue multiplies by g_e * 2^8, rounds to BF16 and stores through
//     shared memory with 16-byte row-masked stores (rows past the expert's end are never written).
//   kSwigluNvfp4 only: warps 1-3 of warpgroup 0 (idle otherwise) are the quantizer. Each consumer
//     hands over its staged BF16 SwiGLU tile through mbarriers (Config::EpiHandOff) and goes on to the next
//     tile's mainloop while these warps encode it to NVFP4, so the encoding overlaps the wgmmas
//     instead of stalling them (done by the consumers themselves it cost 2-8%, 2026-11-29).
//
// Structure: gemm_config.cuh (the tile list, Config, Params), gemm_scheduler.cuh (the persistent
// tile walk and its per-expert prefix), gemm_epilogue.cuh (SwiGLU, the NVFP4 encoder of a staged
// tile), gemm_splitk.cuh (the cluster reduction); this file: the kernel, composing the producer and
// consumer mainloops and the epilogue store, and its launch. grouped_gemm_instance.cu instantiates
// it once per tile and epilogue.
#pragma once

#include "nvfp4moe/nvfp4moe.h"
#include "gemm_config.cuh"
#include "gemm_epilogue.cuh"
#include "gemm_mainloop.cuh"
#include "gemm_scheduler.cuh"
#include "gemm_splitk.cuh"
#include "nvfp4_codec.cuh"
#include "nvfp4_weights.cuh"
#include "pdl.cuh"
#include "status.hpp"

#include <cuda.h>
#include <cuda_bf16.h>

#include <type_traits>

#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

namespace nvfp4moe::gemm {

using namespace cute;

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap tma_x, Params p) {
  using SharedStorage = typename Cfg::SharedStorage;
  using Pipeline = typename Cfg::Pipeline;
  constexpr int kBlockN = Cfg::kBlockN;

  extern __shared__ __align__(1024) char smem_raw[];
  SharedStorage& ss = *reinterpret_cast<SharedStorage*>(smem_raw);

  const int warp_group = threadIdx.x / 128;
  const bool producer = warp_group == 0;
  constexpr int kTileM = Cfg::kTileM;
  const int m_tiles = (p.n + kTileM - 1) / kTileM;
  const int k_tiles = p.k / kTileK;                                // 64-K chunks
  const int k_stages = (k_tiles + Cfg::kChunks - 1) / Cfg::kChunks;  // the last one may be partial

  // Launched with programmatic dependent launch: nothing global is touched before this (but for a
  // tail launch with wait_at_exit, which waits before it exits instead, pdl.cuh). Only the tail
  // tiles (128x32, 128x64, 128x128) compile the choice: reading the flag in the 128x256 tile's
  // prologue made ptxas serialize three of its four epilogues' wgmmas (C7511, CUDA 13.0).
  constexpr bool kTailTile = kBlockN >= 32 && kBlockN <= 128;
  if constexpr (kTailTile) {
    if (p.wait_at_exit) {
      pdl::release();
      pdl::fence_acquire();
    } else {
      pdl::wait_and_release();
    }
  } else {
    pdl::wait_and_release();
  }
  build_tile_prefix<kBlockN, Cfg::kThreads>(ss.tile_prefix, p, m_tiles);
  const int total_tiles = ss.tile_prefix[p.experts];
  // Split-K: the cluster of `splits` CTAs is one unit of the persistent tile walk; CTA `rank`
  // takes K stages [kc_begin, kc_end) of every tile, an even partition (non-empty: the host keeps
  // k_stages >= splits).
  const int splits = Cfg::kMaxSplits > 1 ? p.splits : 1;
  const int rank = splits > 1 ? int(cute::block_rank_in_cluster()) : 0;
  const int unit0 = int(blockIdx.x) / splits, units = int(gridDim.x) / splits;
  const int kc_begin = rank * k_stages / splits, kc_end = (rank + 1) * k_stages / splits;

  typename Pipeline::Params pp;
  pp.transaction_bytes = Cfg::kStageBytes;
  pp.role = producer ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pp.is_leader = threadIdx.x == 0;
  pp.num_consumers = Cfg::kConsumerThreads;
  pp.num_producers = 1;
  Pipeline pipeline(ss.pipeline, pp, Shape<_1, _1, _1>{});
  if constexpr (Cfg::kQuantizerWarps) {
    if (threadIdx.x == 0) {
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < Cfg::kConsumers; ++c) {
        cutlass::arch::ClusterBarrier::init(&ss.epi_sync.full[c], 128);
        cutlass::arch::ClusterBarrier::init(&ss.epi_sync.empty[c], kQuantizerThreads);
      }
      cutlass::arch::fence_barrier_init();
    }
  }
  __syncthreads();
  if constexpr (Cfg::kMaxSplits > 1) {
    if (splits > 1) {
      splitk::init(ss.split, splits);
    }
  }
  // Split-K: no CTA of a cluster exits while another may still access its shared memory (the
  // non-leaders' stores into the leader's, the leader's arrivals on theirs). The hand-over barriers
  // already order those accesses before the last reads, but the leader's producer and quantizer
  // warps would exit early, and racecheck reports the non-leaders' stores as writes into a CTA
  // that "might have already exited" (H100, 2026-12-06): every thread of every CTA meets at one
  // cluster barrier before exiting, as the CUDA programming guide asks of distributed shared memory.
  // (The split count is read again from the parameters: kept live across the quantizer warps'
  // loop, at 48 registers, it spilled.)
  auto cluster_exit = [&] {
    if constexpr (Cfg::kMaxSplits > 1) {
      if (unhoisted(p.splits) > 1) {
        __syncwarp();  // the barrier is .aligned: the warp reconverges first
        cute::cluster_arrive();
        cute::cluster_wait();
      }
    }
  };

  if (producer) {
    cutlass::arch::warpgroup_reg_dealloc<Cfg::kProducerRegs>();
    if (threadIdx.x == 0) {
      cute::prefetch_tma_descriptor(&tma_x);
      auto state = cutlass::make_producer_start_state<Pipeline>();
      for (int tile = unit0; tile < total_tiles; tile += units) {
        TileCoord tc = decode_tile(tile, ss.tile_prefix, p.experts, m_tiles);
        MainloopProducer<Cfg>::load_tile(pipeline, state, ss, tma_x, p, tc, kc_begin, kc_end, k_tiles);
      }
      pipeline.producer_tail(state);
      // (One thread of one CTA keeps the grid from completing; the other CTAs leave, freeing their
      // SM for the next tail launch.)
      if constexpr (kTailTile) {
        if (p.wait_at_exit && blockIdx.x == 0) pdl::wait();
      }
    }
    if constexpr (Cfg::kEpilogue == GemmEpilogue::kSwigluNvfp4) {
      if (threadIdx.x >= 32 && rank == 0 && unit0 < total_tiles) {
        // (The first tile and the stride recomputed here, not carried over the role split: a value
        // live in both the quantizer warps, at 48 registers, and the consumers was spilled in both.)
        const int per_unit = Cfg::kMaxSplits > 1 ? unhoisted(p.splits) : 1;
        quantizer_warps<Cfg>(ss, p, int(threadIdx.x) - 32, unhoisted(int(blockIdx.x)) / per_unit,
                             (unhoisted(p.n) + kTileM - 1) / kTileM);
      }
    }
    cluster_exit();
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegs>();
  const int cw = warp_group - 1;  // which 64 features of the tile
  const int t = threadIdx.x % 128;

  typename Cfg::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(t);
  Tensor sB = make_tensor(make_smem_ptr(ss.b), typename Cfg::SmemLayoutB{});  // (BN, 64, stages)
  Tensor tCsB = thr_mma.partition_B(sB);                                       // (MMA, MMA_N, MMA_K, stages)
  Tensor tCrB = thr_mma.make_fragment_B(tCsB);
  // Two A fragments in registers, (MMA = 8 values, MMA_M = 1, MMA_K = kFragK / 16) each: the
  // weights of the next stage (or chunk) are converted into one while the wgmmas of the current
  // one still read the other.
  auto a_layout = make_layout(make_shape(_64{}, Int<Cfg::kFragK>{}), LayoutRight{});
  Tensor tCrA0 = thr_mma.partition_fragment_A(make_tensor(make_smem_ptr(ss.b), a_layout));
  Tensor tCrA1 = thr_mma.partition_fragment_A(make_tensor(make_smem_ptr(ss.b), a_layout));
  Tensor accum = partition_fragment_C(tiled_mma, make_shape(_64{}, Int<kBlockN>{}));  // (MMA, 1, 1)
  Tensor cC = make_identity_tensor(make_shape(_64{}, Int<kBlockN>{}));
  Tensor tCcC = thr_mma.partition_C(cC);  // (feature, row) coordinates of each accumulator

  auto state = typename Pipeline::PipelineState{};
  bfloat16_t* epi = ss.epi[cw];
  int handed = 0;  // split-K hand-overs so far (leader: reductions)
  uint32_t epi_parity = 0;  // kSwigluNvfp4: the parity of the quantizer's next read (epi_sync.empty)

  // The bound is read from shared memory on each step rather than kept in a register across the
  // mainloop (with the 128x32 tile's 16 accumulators it was the one value that spilled).
  for (int tile = unit0; tile < ss.tile_prefix[p.experts]; tile += units) {
    // The tile's coordinates, rows and decode scales. Undo the 2^-8 of the weight encoding: rows
    // 16w + g (f % 16 < 8) and 16w + g + 8 may carry different decode scales (gate and up rows of
    // interleaved W13 weights).
    struct TileValues {
      int row_begin, row_end, feature0;
      float scale_lo, scale_hi;
    };
    auto tile_values = [&] {
      // m_tiles recomputed from the parameters: one value less live across the mainloop.
      TileCoord tc = decode_tile(tile, ss.tile_prefix, p.experts, (unhoisted(p.n) + kTileM - 1) / kTileM);
      int2 rr = expert_rows<kBlockN>(p, tc.expert);
      return TileValues{rr.x + tc.n_tile * kBlockN, rr.y, tc.m_tile * kTileM + cw * 64,
                        p.decode_scale[2 * tc.expert] * 256.0f, p.decode_scale[2 * tc.expert + 1] * 256.0f};
    };
    // Loaded before the mainloop, so that their latency hides behind it (loaded after it,
    // qwen3-30b-a3b's one-tile-per-CTA launches at T = 1 took 6% longer, 2026-12-02); after it
    // where the accumulators leave no registers for them (the unpipelined N64 tiles, whose other
    // warpgroups hide the latency; kept across the mainloop they spilled).
    constexpr bool kLateTileValues = kBlockN >= 64 && !Cfg::kPipelined;
    TileValues tv{};
    if constexpr (!kLateTileValues) tv = tile_values();

    // There, too, the K range of an unsplit tile is derived from the parameters again for each
    // tile (through an asm move the compiler cannot hoist) instead of staying live across the
    // tile walk.
    int tile_k_tiles = k_tiles, tile_kc_end = kc_end;
    if constexpr (kLateTileValues && Cfg::kMaxSplits == 1) {
      tile_k_tiles = unhoisted(p.k) / kTileK;
      tile_kc_end = (tile_k_tiles + Cfg::kChunks - 1) / Cfg::kChunks;
    }
    // kNarrowIssue: the rows the tile's wgmmas span (issue_rows()).
    int issue_n = kBlockN;
    if constexpr (Cfg::kNarrowIssue) {
      static_assert(!kLateTileValues, "the tile's rows are known before its mainloop");
      issue_n = issue_rows<Cfg>(p, min(tv.row_end - tv.row_begin, kBlockN));
    }
    MainloopConsumer<Cfg>::mma_tile(pipeline, state, ss, cw, t, tiled_mma, tCrB, tCrA0, tCrA1, accum, kc_begin,
                                    tile_kc_end, tile_k_tiles, issue_n);
    if constexpr (kLateTileValues) tv = tile_values();
    const int row_begin = tv.row_begin, row_end = tv.row_end, feature0 = tv.feature0;
    const float scale_lo = tv.scale_lo, scale_hi = tv.scale_hi;
    if constexpr (Cfg::kMaxSplits > 1) {
      if (splits > 1) {
        // Non-leaders hand their partial sums to the leader and go on; the leader adds them (in
        // rank order) and runs the epilogue.
        if (rank != 0) {
          splitk::send<Cfg::kAccum>(ss.split, rank, cw, t, handed++, accum);
          continue;
        }
        splitk::reduce<Cfg::kAccum>(ss.split, splits, cw, t, handed++, accum);
      }
    }

    // Epilogue: scale, round to BF16, stage through shared memory, store 16-byte pieces of rows
    // that belong to the expert. Accumulator value i holds feature f = 16w + g + 8 v1 and row
    // r = 8j + 2c + v0 with i = v0 + 2 v1 + 4j: for v1 = 0 (f % 16 < 8), value i + 2 is feature
    // f + 8 of the same row, which for kGateUpBands8 weights is the up value of gate feature f.
    constexpr bool kNvfp4 = Cfg::kEpilogue == GemmEpilogue::kSwigluNvfp4;
    if constexpr (kNvfp4) {
      // Hand-over j = this CTA's j-th tile: before staging it, the quantizer warps must have read
      // hand-over j - 1 (the buffer starts empty).
      if (tile != unit0) {
        handoff_wait(&ss.epi_sync.empty[cw], epi_parity);
        epi_parity ^= 1u;
      }
    } else {
      cutlass::arch::NamedBarrier::sync(128, 1 + cw);  // the previous tile's stores have read epi
    }
    constexpr bool kSwiglu = Cfg::kEpilogue != GemmEpilogue::kPlain;
    constexpr bool kCompact = Cfg::kEpilogue == GemmEpilogue::kSwigluBf16 || Cfg::kEpilogue == GemmEpilogue::kSwigluNvfp4;
    constexpr int kStageCols = kCompact ? 32 : 64;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(accum); ++i) {
      int f = get<0>(tCcC(i));
      int r = get<1>(tCcC(i));
      if constexpr (!kSwiglu) {
        epi[r * 64 + f] = bfloat16_t(accum(i) * (f % 16 < 8 ? scale_lo : scale_hi));
      } else if ((i % 4) < 2) {  // v1 == 0: a gate value; its up value is i + 2
        float gate = accum(i) * scale_lo;
        float sw = swiglu(gate, accum(i + 2) * scale_hi);
        if constexpr (Cfg::kEpilogue == GemmEpilogue::kInterleaved) {
          epi[r * 64 + f] = bfloat16_t(gate);
          epi[r * 64 + f + 8] = bfloat16_t(sw);
        } else {
          epi[r * 32 + (f / 16) * 8 + f % 16] = bfloat16_t(sw);  // local logical feature 8w + g
        }
      }
    }
    if constexpr (kNvfp4) {
      // Hand the staged tile to the quantizer warps (the arrive, a release, orders the stores above
      // before their reads) and go on to the next tile.
      handoff_arrive(&ss.epi_sync.full[cw]);
      continue;
    }
    cutlass::arch::NamedBarrier::sync(128, 1 + cw);
    bool half_valid = feature0 < p.n;
    constexpr int kPieces = kStageCols / 8;  // 16-byte pieces per staged row
    const int out_cols = kCompact ? p.n / 2 : p.n;
    const int out_col0 = kCompact ? feature0 / 2 : feature0;
    CUTLASS_PRAGMA_UNROLL
    for (int piece = t; piece < kBlockN * kPieces; piece += 128) {
      int r = piece / kPieces, c8 = (piece % kPieces) * 8;
      int row = row_begin + r;
      if (half_valid && row < row_end) {
        uint4 v = *reinterpret_cast<const uint4*>(epi + r * kStageCols + c8);
        *reinterpret_cast<uint4*>(p.out + int64_t(row) * out_cols + out_col0 + c8) = v;
      }
    }
  }
  if constexpr (Cfg::kMaxSplits > 1) {
    if (splits > 1 && rank != 0) {
      splitk::drain(ss.split, cw, handed);
    }
  }
  cluster_exit();
}

// Host side. How many clusters of `splits` CTAs of Cfg's kernel can be resident at once on the
// current device (`ctas` = its SM count; 0 with the CUDA error left cleared when none fits). The
// GPCs bound it, not only the CTA slots: on the H200 (2 CTAs per SM, 264 slots) clusters of 2 fill
// all 264, clusters of 4 only 248 (62 clusters), of 8 240 (2026-12-02).
template <class Cfg>
int max_active_clusters(int splits, int ctas) {
  auto kernel = grouped_gemm_kernel<Cfg>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1] = {};
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = unsigned(splits);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.gridDim = dim3(unsigned(ctas * Cfg::kMinBlocks / splits * splits));
  cfg.blockDim = dim3(Cfg::kThreads);
  cfg.dynamicSmemBytes = Cfg::kSmemBytes;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return clusters;
}

// Launches Cfg's kernel on `ctas` x kMinBlocks persistent CTAs (ctas = SM count); with split-K, on
// as many clusters of p.splits CTAs as can be resident at once. Instantiated once per
// configuration, each in its own translation unit (grouped_gemm_instance.cu).
template <class Cfg>
Status launch_grouped_gemm(const CUtensorMap& tma_x, const Params& p, int ctas, cudaStream_t stream) {
  static_assert(Cfg::kSmemBytes * Cfg::kMinBlocks <= 227 * 1024, "shared memory per SM");
  auto kernel = grouped_gemm_kernel<Cfg>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  if (e != cudaSuccess) {
    return fail(Status::kCudaError, "grouped_gemm_nvfp4: cudaFuncSetAttribute: %s", cudaGetErrorString(e));
  }
  if (p.splits < 1 || p.splits > Cfg::kMaxSplits) {
    return fail(Status::kInvalidShape, "grouped_gemm_nvfp4: %d splits (this tile allows 1..%d)", p.splits,
                Cfg::kMaxSplits);
  }
  // Programmatic dependent launch (pdl.cuh); with split-K, the cluster shape.
  cudaLaunchConfig_t cfg = {};
  const bool pdl_on = pdl::enabled(p.splits > 1);
  cudaLaunchAttribute attr[2] = {pdl::attribute(), {}};
  cfg.gridDim = dim3(unsigned(ctas * Cfg::kMinBlocks));
  cfg.blockDim = dim3(Cfg::kThreads);
  cfg.dynamicSmemBytes = Cfg::kSmemBytes;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = pdl_on ? 1 : 0;
  if (p.splits > 1) {
    const int clusters = max_active_clusters<Cfg>(p.splits, ctas);
    if (clusters < 1) {
      return fail(Status::kCudaError, "grouped_gemm_nvfp4: no cluster of %d CTAs fits", p.splits);
    }
    attr[1].id = cudaLaunchAttributeClusterDimension;
    attr[1].val.clusterDim.x = unsigned(p.splits);
    attr[1].val.clusterDim.y = 1;
    attr[1].val.clusterDim.z = 1;
    cfg.attrs = pdl_on ? attr : attr + 1;
    cfg.numAttrs = pdl_on ? 2 : 1;
    cfg.gridDim = dim3(unsigned(clusters * p.splits));
  }
  e = cudaLaunchKernelEx(&cfg, kernel, tma_x, p);
  if (e != cudaSuccess) {
    return fail(Status::kCudaError, "grouped_gemm_nvfp4: cudaLaunchKernelEx: %s", cudaGetErrorString(e));
  }
  return check_launch("grouped_gemm_nvfp4");
}

// Each tile of NVFP4MOE_GEMM_TILES for each epilogue, instantiated by its own translation unit
// (grouped_gemm_instance.cu).
#define NVFP4MOE_GEMM_EXTERN_ONE(name, E)                                                                   \
  extern template Status launch_grouped_gemm<Config##name<GemmEpilogue::E>>(const CUtensorMap&, const Params&, int, \
                                                                            cudaStream_t);                      \
  extern template int max_active_clusters<Config##name<GemmEpilogue::E>>(int, int);
#define NVFP4MOE_GEMM_EXTERN(name, ...)                \
  NVFP4MOE_GEMM_EXTERN_ONE(name, kPlain)               \
  NVFP4MOE_GEMM_EXTERN_ONE(name, kInterleaved)         \
  NVFP4MOE_GEMM_EXTERN_ONE(name, kSwigluBf16)          \
  NVFP4MOE_GEMM_EXTERN_ONE(name, kSwigluNvfp4)
NVFP4MOE_GEMM_TILES(NVFP4MOE_GEMM_EXTERN)
#if defined(NVFP4MOE_GEMM_VARIANTS)
NVFP4MOE_GEMM_VARIANT_TILES(NVFP4MOE_GEMM_EXTERN)
#endif
#undef NVFP4MOE_GEMM_EXTERN
#undef NVFP4MOE_GEMM_EXTERN_ONE

}  // namespace nvfp4moe::gemm
