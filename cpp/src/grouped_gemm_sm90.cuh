// The NVFP4-weight grouped GEMM for Hopper (sm_90a): a warp-specialized persistent kernel.
//
//   out[r, f] = sum_k x[r, k] * W_e[f, k] * g_e      for rows r of expert e
//
// GEMM view: M = output features f (weights, register-sourced wgmma A), N = rows/tokens (x, wgmma B
// from shared memory), K = k. A CTA tile is 128 features x kBlockN rows; a K stage is kChunks x 64
// wide (the N16 and N64 tiles take 128 per stage, so each barrier wait and release covers 9 KB of
// weights; a K whose 64-chunk count is odd ends in a half stage whose x part past K the TMA unit
// zero-fills).
//
// Roles (384 threads):
//   warpgroup 0 (producer, one elected thread): per stage, one bulk copy of kChunks prepared
//     weight chunks per consumer warpgroup (nvfp4_weights.cuh) and kChunks TMA 2-D loads of the
//     x tile (kBlockN rows x 64 k each, 128-byte swizzle, the GMMA K-major SW128 layout), all
//     completing on the stage's full barrier (cutlass::PipelineTmaAsync).
//   warpgroups 1, 2 (consumers): each owns 64 of the 128 features. Per 64-K chunk, each thread
//     reads its 16 code bytes and 8 scale bytes, converts them to BF16 A fragments exactly
//     (shift/mask/or and one bf16x2 multiply per pair), and issues 4 m64 x kBlockN x k16 wgmmas
//     as one group. Pipelined: two fragments, one group in flight, so a chunk is converted while
//     the previous chunk's wgmmas run (with two chunks per stage this fits the 80 registers of
//     two CTAs per SM). The epilogue multiplies by g_e * 2^8, rounds to BF16 and stores through
//     shared memory with 16-byte row-masked stores (rows past the expert's end are never written).
//   kSwigluNvfp4 only: warps 1-3 of warpgroup 0 (idle otherwise) are the quantizer. Each consumer
//     hands over its staged BF16 SwiGLU tile through named barriers and goes on to the next
//     tile's mainloop while these warps encode it to NVFP4, so the encoding overlaps the wgmmas
//     instead of stalling them (done by the consumers themselves it cost 2-8%, 2026-11-29).
//
// Scheduling: persistent CTAs walk a tile list laid out [expert][row tile][feature tile]. Each CTA
// builds the per-expert tile prefix sum in shared memory from expert_offsets (device memory), so
// the host never needs the row counts and experts with no rows cost nothing.
#pragma once

#include "nvfp4moe/nvfp4moe.h"
#include "nvfp4_codec.cuh"
#include "gemm_splitk.cuh"
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

constexpr int kMaxExperts = 1024;
// A producer warpgroup and two consumer warpgroups; setmaxnreg moves the producer's registers to
// the consumers. (A 288-thread CTA with one producer warp and no setmaxnreg was measured 5-10%
// slower on the N64 and N128 tiles, 2026-11-29.)
constexpr int kConsumerThreads = 256;
constexpr int kThreads = 128 + kConsumerThreads;
constexpr int kTileM = 128;  // two consumer warpgroups x 64 features
constexpr int kTileK = 64;   // K of one prepared chunk; a stage holds Cfg::kChunks of them per consumer
// kSwigluNvfp4: the quantizer warps (warps 1-3 of the producer warpgroup) and the named barriers
// (CUTLASS user ids) of the hand-over: consumer cw arrives on full + cw when its tile is staged;
// the quantizer warps arrive on empty + cw when they have read it.
constexpr int kQuantizerThreads = 96;
constexpr int kBarEpiFull = 3;
constexpr int kBarEpiEmpty = 5;
constexpr int kEpiHandOffThreads = 128 + kQuantizerThreads;

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
};

// Expert e's rows [begin, end), clamped so that malformed offsets can never address memory
// outside x or out (they then give wrong rows, not out-of-bounds accesses).
CUTLASS_DEVICE int2 expert_rows(const Params& p, int e) {
  int begin = min(max(p.expert_offsets[e], 0), p.total_rows);
  int end = min(max(p.expert_offsets[e + 1], begin), p.total_rows);
  return make_int2(begin, end);
}

// kMinBlocks CTAs share an SM: with 2, the register budget per thread halves (the producer
// warpgroup keeps 40, consumers get 96; ptxas compiles for 80) and so must the shared memory;
// small-N tiles need few registers, and two CTAs double the warps that convert weights, which
// bounds decode throughput.
template <int kBlockN_, int kStages_, int kMinBlocks_, GemmEpilogue kEpilogue_, bool kPipelined_ = true,
          int kMaxSplits_ = 1, int kChunks_ = 1>
struct Config {
  static constexpr GemmEpilogue kEpilogue = kEpilogue_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr int kMinBlocks = kMinBlocks_;
  // kSwigluNvfp4: the producer warpgroup also quantizes (one CTA per SM: 56 registers, 40 spill,
  // its consumers keep 224; two: 48, which uses all of the 80 x 384 a CTA is given).
  static constexpr bool kQuantizerWarps = kEpilogue_ == GemmEpilogue::kSwigluNvfp4;
  static constexpr int kProducerRegs = kQuantizerWarps ? (kMinBlocks == 1 ? 56 : 48) : 40;
  static constexpr int kConsumerRegs = kMinBlocks == 1 ? (kQuantizerWarps ? 224 : 232) : 96;
  // Two A fragments, one wgmma group in flight (see the mainloop); false: one fragment, each
  // stage's wgmmas retired before the next stage's conversion (fewer registers).
  static constexpr bool kPipelined = kPipelined_;
  // Split-K over clusters of up to kMaxSplits CTAs (gemm_splitk.cuh); 1: never split.
  static constexpr int kMaxSplits = kMaxSplits_;
  // Prepared 64-K chunks per consumer warpgroup per stage: K per stage is 64 kChunks.
  static constexpr int kChunks = kChunks_;
  static constexpr int kStageK = kTileK * kChunks_;
  static_assert(kChunks_ == 1 || kChunks_ == 2, "one or two chunks per stage");
  // The A fragment: a whole stage, or with two pipelined chunks per stage one chunk (the wgmmas
  // of one chunk run while the next chunk is converted into the other fragment).
  static constexpr bool kChunkPipelined = kPipelined_ && kChunks_ == 2;
  static constexpr int kFragK = kChunkPipelined ? kTileK : kStageK;
  static constexpr int kAccum = 64 * kBlockN_ / 128;  // accumulator floats per consumer thread
  static_assert(kMinBlocks == 1 || kMinBlocks == 2, "one or two CTAs per SM");
  // setmaxnreg moves registers within the CTA's allocation (ptxas compiles for 80 at two per SM).
  static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= (kMinBlocks == 1 ? 65536 : 80 * kThreads),
                "register budget");
  static_assert(kBlockN % 8 == 0 && kBlockN >= 8 && kBlockN <= 256, "wgmma N is a multiple of 8 up to 256");

  using MmaOp = decltype(SM90::GMMA::rs_op_selector<bfloat16_t, bfloat16_t, float,
                                                    Shape<_64, Int<kBlockN>, Int<kStageK>>>());
  using TiledMma = decltype(make_tiled_mma(MmaOp{}));
  // x tile per stage: (kBlockN, 64 kChunks, stages), K-major with the 128-byte swizzle TMA writes;
  // the swizzle atoms are 64 wide, so each 64-K piece is one contiguous (kBlockN, 64) TMA box.
  using SmemLayoutB = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<bfloat16_t>{},
                                             make_shape(Int<kBlockN>{}, Int<kStageK>{}, Int<kStages>{})));
  using Pipeline = cutlass::PipelineTmaAsync<kStages>;

  struct alignas(1024) SharedStorage {
    alignas(1024) bfloat16_t b[kBlockN * kStageK * kStages];           // (kBlockN, kStageK, stages)
    alignas(128) uint8_t a[kStages][2][kChunks * weights::kChunkBytes];  // (stage, consumer, chunk)
    alignas(16) bfloat16_t epi[2][kBlockN * 64];                   // per consumer: (rows, 64 features)
    int tile_prefix[kMaxExperts + 1];
    typename Pipeline::SharedStorage pipeline;
    std::conditional_t<(kMaxSplits > 1), splitk::Storage<kMaxSplits, kAccum>, splitk::NoStorage> split;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static constexpr uint32_t kStageBytes = kChunks * (2 * weights::kChunkBytes + kBlockN * kTileK * 2);
};

// silu(g) * u in FP32, shared by the Interleaved, SwigluBf16 and SwigluNvfp4 epilogues so that
// their SwiGLU values are bit-identical. The approximate division (MUFU.RCP and a multiply, 2 ulp)
// replaces an IEEE one whose range checks and slow-path call were most of the epilogue's
// arithmetic; __expf is approximate already, and gate < -88 still gives -0 (gate / inf).
CUTLASS_DEVICE float swiglu(float gate, float up) {
  return __fdividef(gate, 1.0f + __expf(-gate)) * up;
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

// Encodes one consumer's staged compact tile, (kBlockN rows, 32 features) BF16 in `epi`, to NVFP4:
// 16-feature blocks with the same codec as quantize_nvfp4 (so the bytes are identical), codes to
// [rows, n / 4] and scales to the expert's 128x4 region. Thread `t` of `nthreads` takes blocks
// t, t + nthreads, ...; rows at or past row_end are not written.
template <int kBlockN>
CUTLASS_DEVICE void quantize_staged_tile(const Params& p, const bfloat16_t* epi, int t, int nthreads, int expert,
                                         int expert_row0, int row_begin, int row_end, int feature0) {
  const int inter = p.n / 2;
  const int sf_k_tiles = (inter / 16 + 3) / 4;  // 4-column tiles of the scale layout
  const float act_g = p.act_scale[p.num_act_scales == 1 ? 0 : expert];
  const codec::TensorScale ts = codec::make_tensor_scale(act_g);
  uint8_t* codes = reinterpret_cast<uint8_t*>(p.out);
  // The expert's first scale row (< total_rows + 127 E < 2^32: one register across the encoder).
  const uint32_t region = uint32_t((int64_t(expert_row0) + int64_t(expert) * 127) / 128 * 128);
  for (int piece = t; piece < kBlockN * 2; piece += nthreads) {
    int r = piece / 2, blk = piece % 2;
    int row = row_begin + r;
    if (row < row_end) {
      const uint4* src = reinterpret_cast<const uint4*>(epi + r * 32 + blk * 16);
      uint4 lo = src[0], hi = src[1];
      const uint32_t w8[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
      codec::Block16 q = codec::quantize_block16_compact(w8, ts);
      int col = feature0 / 2 + blk * 16;  // first logical output feature of the block
      *reinterpret_cast<uint2*>(codes + int64_t(row) * (inter / 2) + col / 2) = make_uint2(q.codes_lo, q.codes_hi);
      p.out_scales[codec::swizzled_offset(int64_t(region) + (row - expert_row0), col / 16, sf_k_tiles)] = uint8_t(q.scale);
    }
  }
}

template <class Cfg>
__global__ void __launch_bounds__(kThreads, Cfg::kMinBlocks)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap tma_x, Params p) {
  using SharedStorage = typename Cfg::SharedStorage;
  using Pipeline = typename Cfg::Pipeline;
  constexpr int kBlockN = Cfg::kBlockN;

  extern __shared__ __align__(1024) char smem_raw[];
  SharedStorage& ss = *reinterpret_cast<SharedStorage*>(smem_raw);

  const int warp_group = threadIdx.x / 128;
  const bool producer = warp_group == 0;
  const int m_tiles = (p.n + kTileM - 1) / kTileM;
  const int k_tiles = p.k / kTileK;                                // 64-K chunks
  const int k_stages = (k_tiles + Cfg::kChunks - 1) / Cfg::kChunks;  // the last one may be partial
  const int chunks_m = p.n / weights::kChunkRows;

  // Launched with programmatic dependent launch: nothing global is touched before this.
  pdl::wait_and_release();
  // Tile prefix: counts first (e's count stored at e + 1), then an exclusive scan.
  {
    int* prefix = ss.tile_prefix;
    for (int e = threadIdx.x; e < p.experts; e += kThreads) {
      int2 rr = expert_rows(p, e);
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
  pp.num_consumers = kConsumerThreads;
  pp.num_producers = 1;
  Pipeline pipeline(ss.pipeline, pp, Shape<_1, _1, _1>{});
  __syncthreads();
  if constexpr (Cfg::kMaxSplits > 1) {
    if (splits > 1) {
      splitk::init(ss.split, splits);
    }
  }

  if (producer) {
    cutlass::arch::warpgroup_reg_dealloc<Cfg::kProducerRegs>();
    if (threadIdx.x == 0) {
      cute::prefetch_tma_descriptor(&tma_x);
      auto state = cutlass::make_producer_start_state<Pipeline>();
      for (int tile = unit0; tile < total_tiles; tile += units) {
        TileCoord tc = decode_tile(tile, ss.tile_prefix, p.experts, m_tiles);
        int row0 = expert_rows(p, tc.expert).x + tc.n_tile * kBlockN;
        int mt0 = tc.m_tile * 2;
        // With n % 128 == 64 the last tile has one 64-row half: the second consumer gets the
        // first half again (its results are not stored), so every stage moves the same bytes.
        int mt1 = mt0 + 1 < chunks_m ? mt0 + 1 : mt0;
        // Not unrolled: with split-K's runtime K range, unrolling spills on the producer's
        // kProducerRegs registers (and measured no faster without split-K, 2026-12-02).
#pragma unroll 1
        for (int kc = kc_begin; kc < kc_end; ++kc) {
          pipeline.producer_acquire(state);
          uint64_t* bar = pipeline.producer_get_barrier(state);
          int s = state.index();
          const int c0 = kc * Cfg::kChunks;
          if (c0 + Cfg::kChunks <= k_tiles) {
            // A stage's chunks are consecutive in K, so adjacent in the prepared layout: one bulk
            // copy per consumer.
            SM90_BULK_COPY_G2S::copy(p.prepared + weights::chunk_offset(tc.expert, mt0, c0, p.n, p.k), bar,
                                     ss.a[s][0], Cfg::kChunks * weights::kChunkBytes);
            SM90_BULK_COPY_G2S::copy(p.prepared + weights::chunk_offset(tc.expert, mt1, c0, p.n, p.k), bar,
                                     ss.a[s][1], Cfg::kChunks * weights::kChunkBytes);
          } else {
            // The partial last stage: its missing weight chunks repeat the last one, so every
            // stage completes the same transaction bytes, and its x pieces past K are zero-filled
            // by the TMA unit, so those products add exact zeros (the weights are finite).
            CUTLASS_PRAGMA_UNROLL
            for (int h = 0; h < Cfg::kChunks; ++h) {
              const int c = min(c0 + h, k_tiles - 1);
              SM90_BULK_COPY_G2S::copy(p.prepared + weights::chunk_offset(tc.expert, mt0, c, p.n, p.k), bar,
                                       ss.a[s][0] + h * weights::kChunkBytes, weights::kChunkBytes);
              SM90_BULK_COPY_G2S::copy(p.prepared + weights::chunk_offset(tc.expert, mt1, c, p.n, p.k), bar,
                                       ss.a[s][1] + h * weights::kChunkBytes, weights::kChunkBytes);
            }
          }
          CUTLASS_PRAGMA_UNROLL
          for (int h = 0; h < Cfg::kChunks; ++h) {
            SM90_TMA_LOAD_2D::copy(&tma_x, bar, uint64_t(cute::TMA::CacheHintSm90::EVICT_NORMAL),
                                   ss.b + s * (kBlockN * Cfg::kStageK) + h * (kBlockN * kTileK),
                                   (c0 + h) * kTileK, row0);
          }
          ++state;
        }
      }
      pipeline.producer_tail(state);
    }
    if constexpr (Cfg::kEpilogue == GemmEpilogue::kSwigluNvfp4) {
      // The quantizer warps walk the same tiles as the consumers. Each hand-over buffer starts
      // empty (one arrive, only in a CTA that has a tile), and after a CTA's last tile nobody
      // waits for it: every arrive is matched by one consumer wait.
      if (threadIdx.x >= 32 && rank == 0 && unit0 < total_tiles) {
        const int qt = threadIdx.x - 32;
        cutlass::arch::NamedBarrier::arrive(kEpiHandOffThreads, kBarEpiEmpty + 0);
        cutlass::arch::NamedBarrier::arrive(kEpiHandOffThreads, kBarEpiEmpty + 1);
        for (int tile = unit0; tile < total_tiles; tile += units) {
          TileCoord tc = decode_tile(tile, ss.tile_prefix, p.experts, m_tiles);
          int2 rr = expert_rows(p, tc.expert);
          int row_begin = rr.x + tc.n_tile * kBlockN;
          bool more = tile + units < total_tiles;
          CUTLASS_PRAGMA_UNROLL
          for (int c = 0; c < 2; ++c) {
            int feature0 = tc.m_tile * kTileM + c * 64;
            cutlass::arch::NamedBarrier::sync(kEpiHandOffThreads, kBarEpiFull + c);
            if (feature0 < p.n) {
              quantize_staged_tile<kBlockN>(p, ss.epi[c], qt, kQuantizerThreads, tc.expert, rr.x, row_begin, rr.y,
                                            feature0);
            }
            if (more) {
              cutlass::arch::NamedBarrier::arrive(kEpiHandOffThreads, kBarEpiEmpty + c);
            }
          }
        }
      }
    }
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegs>();
  const int cw = warp_group - 1;  // which 64 features of the tile
  const int t = threadIdx.x % 128;
  const int w = t / 32, lane = t % 32, g = lane / 4;

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
  // A stage's shared memory is free again: arrive on this CTA's empty barrier. (The pipeline's own
  // consumer_release, built for a cluster of one, would signal the cluster's rank 0.)
  auto release_stage = [&](auto st) { ss.pipeline.empty_barrier_[st.index()].arrive(); };
  const int n_k = kc_end - kc_begin;  // K stages per tile for this CTA
  int handed = 0;                     // split-K hand-overs so far (leader: reductions)

  // Chunk h of stage s's weights -> BF16 A fragment `frag` from k-block 4 h0 on (exact; see
  // nvfp4_weights.cuh).
  auto convert_chunk = [&](int s, int h, auto& frag, int h0) {
    Tensor a_words = recast<uint32_t>(frag);  // 16 registers per chunk: bf16 pairs, 4 per k-block
    {
      const uint8_t* chunk = ss.a[s][cw] + h * weights::kChunkBytes;
      uint4 codes = reinterpret_cast<const uint4*>(chunk)[t];
      uint2 sc = *reinterpret_cast<const uint2*>(chunk + weights::kChunkCodeBytes + (w * 8 + g) * 8);
      const uint32_t cw4[4] = {codes.x, codes.y, codes.z, codes.w};
      CUTLASS_PRAGMA_UNROLL
      for (int kb = 0; kb < 4; ++kb) {
        uint32_t sw = kb < 2 ? sc.x : sc.y;
        // Bytes (row m0, row m0 + 8) of this k-block -> BF16 (s_r, s_r8) in one word; each pair
        // multiplies by its row's half broadcast (an HMUL2 operand swizzle, no extra instruction).
        uint32_t sel0 = (kb % 2) * 2, sel8 = sel0 + 1;
        uint32_t s_both = weights::scale_pair_to_bf16x2(__byte_perm(sw, 0, 0x4040 | sel0 | (sel8 << 8)));
        const __nv_bfloat162 s_r = __low2bfloat162(*reinterpret_cast<const __nv_bfloat162*>(&s_both));
        const __nv_bfloat162 s_r8 = __high2bfloat162(*reinterpret_cast<const __nv_bfloat162*>(&s_both));
        const uint32_t v[4] = {weights::pair_to_bf16x2_scaled<0>(cw4[kb]), weights::pair_to_bf16x2_scaled<1>(cw4[kb]),
                               weights::pair_to_bf16x2_scaled<2>(cw4[kb]), weights::pair_to_bf16x2_scaled<3>(cw4[kb])};
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < 4; ++j) {
          __nv_bfloat162 prod = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&v[j]), j % 2 ? s_r8 : s_r);
          a_words((h0 * 4 + kb) * 4 + j) = *reinterpret_cast<uint32_t*>(&prod);
        }
      }
    }
  };
  // All of stage s's chunks -> `frag` (a whole-stage fragment).
  auto convert = [&](int s, auto& frag) {
    CUTLASS_PRAGMA_UNROLL
    for (int h = 0; h < Cfg::kChunks; ++h) {
      convert_chunk(s, h, frag, h);
    }
  };
  // Keeps the compiler from moving fragment writes across the asynchronous wgmmas that read them.
  auto fence_a = [](auto& frag) {
    Tensor a_words = recast<uint32_t>(frag);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(a_words); ++i) {
      asm volatile("" : "+r"(a_words(i))::"memory");
    }
  };
  // 4 kChunks m64 x kBlockN x k16 wgmmas over stage s, committed as one group. (All of them in a
  // partial last stage too: a predicated wgmma makes ptxas inject a warpgroup.arrive before each.)
  auto issue = [&](int s, auto& frag) {
    fence_a(frag);
    warpgroup_fence_operand(accum);
    warpgroup_arrive();
    CUTLASS_PRAGMA_UNROLL
    for (int kb = 0; kb < 4 * Cfg::kChunks; ++kb) {
      cute::gemm(tiled_mma, frag(_, _, kb), tCrB(_, _, kb, s), accum);
      tiled_mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    warpgroup_fence_operand(accum);
  };
  // The 4 wgmmas of chunk h of stage s from a one-chunk fragment, committed as one group.
  auto issue_chunk = [&](int s, int h, auto& frag) {
    fence_a(frag);
    warpgroup_fence_operand(accum);
    warpgroup_arrive();
    CUTLASS_PRAGMA_UNROLL
    for (int kb = 0; kb < 4; ++kb) {
      cute::gemm(tiled_mma, frag(_, _, kb), tCrB(_, _, 4 * h + kb, s), accum);
      tiled_mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    warpgroup_fence_operand(accum);
  };

  for (int tile = unit0; tile < total_tiles; tile += units) {
    TileCoord tc = decode_tile(tile, ss.tile_prefix, p.experts, m_tiles);
    int2 rr = expert_rows(p, tc.expert);
    int row_begin = rr.x + tc.n_tile * kBlockN;
    int row_end = rr.y;
    int feature0 = tc.m_tile * kTileM + cw * 64;
    // Undo the 2^-8 of the weight encoding. Rows 16w + g (f % 16 < 8) and 16w + g + 8 may carry
    // different decode scales (gate and up rows of interleaved W13 weights).
    float scale_lo = p.decode_scale[2 * tc.expert] * 256.0f;
    float scale_hi = p.decode_scale[2 * tc.expert + 1] * 256.0f;

    tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
    if constexpr (Cfg::kChunkPipelined) {
      // Two chunks per stage, one wgmma group in flight: chunk 0 goes to A0, chunk 1 to A1; each
      // chunk is converted while the previous chunk's group runs. A stage is released once its
      // chunk 1 group has retired (seen by the wait after the next stage's chunk 0 is issued).
      auto release = state;
      for (int kc = kc_begin; kc < kc_end; ++kc) {
        pipeline.consumer_wait(state);
        const int s = state.index();
        convert_chunk(s, 0, tCrA0, 0);
        issue_chunk(s, 0, tCrA0);
        if (kc > kc_begin) {
          warpgroup_wait<1>();  // the previous stage's chunk 1: A1 and that stage are free
          fence_a(tCrA1);
          release_stage(release);
        }
        release = state;
        convert_chunk(s, 1, tCrA1, 0);
        issue_chunk(s, 1, tCrA1);
        warpgroup_wait<1>();  // this stage's chunk 0: A0 is free
        fence_a(tCrA0);
        ++state;
      }
      warpgroup_wait<0>();
      warpgroup_fence_operand(accum);
      fence_a(tCrA1);
      release_stage(release);
    } else if constexpr (Cfg::kPipelined) {
      // Software pipeline, one wgmma group in flight: stage kc's group is issued, then the wait for
      // at most one outstanding group retires stage kc - 1's, whose shared memory is released and
      // whose A fragment is free for stage kc + 1. Fragments alternate A0, A1 (k_tiles >= 1).
      pipeline.consumer_wait(state);
      convert(state.index(), tCrA0);
      issue(state.index(), tCrA0);
      auto release = state;
      ++state;
      auto step = [&](auto& frag) {
        pipeline.consumer_wait(state);
        int s = state.index();
        convert(s, frag);
        issue(s, frag);
        warpgroup_wait<1>();
        fence_a(frag);
        release_stage(release);
        release = state;
        ++state;
      };
      int kc = 1;
      for (; kc + 1 < n_k; kc += 2) {
        step(tCrA1);
        step(tCrA0);
      }
      if (kc < n_k) {
        step(tCrA1);
      }
      warpgroup_wait<0>();
      warpgroup_fence_operand(accum);
      release_stage(release);
    } else {
      for (int kc = kc_begin; kc < kc_end; ++kc) {
        pipeline.consumer_wait(state);
        convert(state.index(), tCrA0);
        issue(state.index(), tCrA0);
        warpgroup_wait<0>();
        warpgroup_fence_operand(accum);
        release_stage(state);
        ++state;
      }
    }
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
      cutlass::arch::NamedBarrier::sync(kEpiHandOffThreads, kBarEpiEmpty + cw);  // the quantizer has read epi
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
      // Hand the staged tile to the quantizer warps (the arrive orders the stores above before
      // their reads) and go on to the next tile.
      cutlass::arch::NamedBarrier::arrive(kEpiHandOffThreads, kBarEpiFull + cw);
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
}

// Host side: launches Cfg's kernel on `ctas` x kMinBlocks persistent CTAs (ctas = SM count). Instantiated once per configuration,
// each in its own .cu file (grouped_gemm_m128n*.cu).
template <class Cfg>
Status launch_grouped_gemm(const CUtensorMap& tma_x, const Params& p, int ctas, cudaStream_t stream) {
  static_assert(Cfg::kSmemBytes * Cfg::kMinBlocks <= 227 * 1024, "shared memory per SM");
  auto kernel = grouped_gemm_kernel<Cfg>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  if (e != cudaSuccess) {
    return fail(Status::kCudaError, "grouped_gemm_nvfp4: cudaFuncSetAttribute: %s", cudaGetErrorString(e));
  }
  if (p.splits < 1 || p.splits > Cfg::kMaxSplits || (p.splits & (p.splits - 1)) != 0) {
    return fail(Status::kInvalidShape, "grouped_gemm_nvfp4: %d splits (this tile allows 1..%d, powers of two)",
                p.splits, Cfg::kMaxSplits);
  }
  // Programmatic dependent launch (pdl.cuh), and for split-K clusters of `splits` CTAs, as many as
  // can be resident at once (the walk is persistent).
  cudaLaunchConfig_t cfg = {};
  const bool pdl_on = pdl::enabled(p.splits > 1);
  cudaLaunchAttribute attr[2] = {pdl::attribute(), {}};
  cfg.gridDim = dim3(unsigned(ctas * Cfg::kMinBlocks));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = Cfg::kSmemBytes;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = pdl_on ? 1 : 0;
  if (p.splits > 1) {
    attr[1].id = cudaLaunchAttributeClusterDimension;
    attr[1].val.clusterDim.x = unsigned(p.splits);
    attr[1].val.clusterDim.y = 1;
    attr[1].val.clusterDim.z = 1;
    cfg.gridDim = dim3(unsigned(ctas * Cfg::kMinBlocks / p.splits * p.splits));
    cfg.attrs = attr + 1;  // the occupancy query sees the cluster shape only
    cfg.numAttrs = 1;
    int clusters = 0;
    e = cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg);
    cfg.attrs = pdl_on ? attr : attr + 1;
    cfg.numAttrs = pdl_on ? 2 : 1;
    if (e != cudaSuccess || clusters < 1) {
      (void)cudaGetLastError();
      return fail(Status::kCudaError, "grouped_gemm_nvfp4: no cluster of %d CTAs fits (%s)", p.splits,
                  cudaGetErrorString(e));
    }
    cfg.gridDim = dim3(unsigned(clusters * p.splits));
  }
  e = cudaLaunchKernelEx(&cfg, kernel, tma_x, p);
  if (e != cudaSuccess) {
    return fail(Status::kCudaError, "grouped_gemm_nvfp4: cudaLaunchKernelEx: %s", cudaGetErrorString(e));
  }
  return check_launch("grouped_gemm_nvfp4");
}

// The configurations (declared here, each defined in its own translation unit).
// The decode tile: two 64-K chunks per stage, unpipelined (each stage's wgmmas retire before the
// next conversion; four consumer warpgroups per SM hide that). 128-K stages made the layer 4-10%
// faster at T = 1-128 than 64-K ones; pipelining the two chunks made it 3-20% slower again
// (PERF_NOTES.md, 2026-12-02).
template <GemmEpilogue E>
using ConfigN16 = Config<16, 6, 2, E, false, 1, 2>;
// The same tile for launches with few tiles, split over K by clusters of up to 4 CTAs. A separate
// instantiation: the reduction's 24 KB of shared memory and its code made the unsplit N16 kernel
// 4-7% slower (measured 2026-12-02, PERF_NOTES.md).
template <GemmEpilogue E>
using ConfigN16SplitK = Config<16, 6, 2, E, false, 4, 2>;
// 17-80 rows per expert: two chunks per stage, chunk-pipelined (mixtral-8x7b's layer at T = 128
// 4% faster than with 64-K stages, 2026-12-02).
template <GemmEpilogue E>
using ConfigN64 = Config<64, 8, 1, E, true, 1, 2>;
template <GemmEpilogue E>
using ConfigN128 = Config<128, 8, 1, E>;
extern template Status launch_grouped_gemm<ConfigN16<GemmEpilogue::kPlain>>(const CUtensorMap&, const Params&, int,
                                                                                   cudaStream_t);
extern template Status launch_grouped_gemm<ConfigN16<GemmEpilogue::kInterleaved>>(const CUtensorMap&, const Params&, int,
                                                                                   cudaStream_t);
extern template Status launch_grouped_gemm<ConfigN16<GemmEpilogue::kSwigluBf16>>(const CUtensorMap&, const Params&, int,
                                                                                   cudaStream_t);
extern template Status launch_grouped_gemm<ConfigN16<GemmEpilogue::kSwigluNvfp4>>(const CUtensorMap&, const Params&, int,
                                                                                    cudaStream_t);
extern template Status launch_grouped_gemm<ConfigN16SplitK<GemmEpilogue::kPlain>>(const CUtensorMap&, const Params&,
                                                                                        int, cudaStream_t);
extern template Status launch_grouped_gemm<ConfigN16SplitK<GemmEpilogue::kInterleaved>>(const CUtensorMap&,
                                                                                              const Params&, int,
                                                                                              cudaStream_t);
extern template Status launch_grouped_gemm<ConfigN16SplitK<GemmEpilogue::kSwigluBf16>>(const CUtensorMap&,
                                                                                             const Params&, int,
                                                                                             cudaStream_t);
extern template Status launch_grouped_gemm<ConfigN16SplitK<GemmEpilogue::kSwigluNvfp4>>(const CUtensorMap&,
                                                                                              const Params&, int,
                                                                                              cudaStream_t);
extern template Status launch_grouped_gemm<ConfigN64<GemmEpilogue::kPlain>>(const CUtensorMap&, const Params&, int,
                                                                                  cudaStream_t);
extern template Status launch_grouped_gemm<ConfigN64<GemmEpilogue::kInterleaved>>(const CUtensorMap&, const Params&, int,
                                                                                  cudaStream_t);
extern template Status launch_grouped_gemm<ConfigN64<GemmEpilogue::kSwigluBf16>>(const CUtensorMap&, const Params&, int,
                                                                                  cudaStream_t);
extern template Status launch_grouped_gemm<ConfigN64<GemmEpilogue::kSwigluNvfp4>>(const CUtensorMap&, const Params&, int,
                                                                                    cudaStream_t);
extern template Status launch_grouped_gemm<ConfigN128<GemmEpilogue::kPlain>>(const CUtensorMap&, const Params&, int,
                                                                                   cudaStream_t);
extern template Status launch_grouped_gemm<ConfigN128<GemmEpilogue::kInterleaved>>(const CUtensorMap&, const Params&, int,
                                                                                   cudaStream_t);
extern template Status launch_grouped_gemm<ConfigN128<GemmEpilogue::kSwigluBf16>>(const CUtensorMap&, const Params&, int,
                                                                                   cudaStream_t);
extern template Status launch_grouped_gemm<ConfigN128<GemmEpilogue::kSwigluNvfp4>>(const CUtensorMap&, const Params&, int,
                                                                                    cudaStream_t);

}  // namespace nvfp4moe::gemm
