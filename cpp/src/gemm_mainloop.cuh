// The grouped GEMM's mainloops (grouped_gemm_sm90.cuh). Producer: one elected thread of the producer
// warpgroup streams a tile's K stages into the pipeline: per stage one bulk copy of kChunks
// prepared weight chunks per consumer warpgroup (nvfp4_weights.cuh) and the x tile's TMA 2-D loads
// (per 64-K chunk one box, or on N256 up to four 64-row boxes), all completing on the stage's full
// barrier (cutlass::PipelineTmaAsync). Consumer:
// MainloopConsumer below.
#pragma once

#include "gemm_config.cuh"
#include "gemm_scheduler.cuh"

#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/tensor.hpp>

namespace nvfp4moe::gemm {

// One m64 x N x k16 register-A wgmma whose B descriptor is a 64-bit value. CuTe advances a
// descriptor with 32-bit arithmetic on its low word, which ptxas compiles to three uniform
// instructions per wgmma (an add and two moves into the descriptor registers); a 64-bit add is one
// (SASS, 2026-12-02: 24 -> 8 per 128-K stage of the N16 tile).
template <class MmaOp, class FragA, class Accum>
CUTLASS_DEVICE void wgmma_rs(FragA const& a, uint64_t desc_b, Accum& accum, GMMA::ScaleOut const& scale) {
  constexpr int kRegsA = extent<typename MmaOp::ARegisters>::value;
  constexpr int kRegsC = extent<typename MmaOp::CRegisters>::value;
  static_assert(extent<typename MmaOp::BRegisters>::value == 1, "B from shared memory: one descriptor");
  Tensor rA = recast<uint32_t>(a);   // (4): 8 BF16 values
  Tensor rC = recast<float>(accum);  // (>= kRegsC): a narrower wgmma takes the first kRegsC
  CUTE_STATIC_ASSERT_V(size(rA) == Int<kRegsA>{});
  CUTE_STATIC_ASSERT_V(size(rC) >= Int<kRegsC>{});
  const uint64_t b[1] = {desc_b};
  cute::detail::explode(MmaOp::fma, rA, make_int_sequence<kRegsA>{}, b, make_int_sequence<1>{}, rC,
                        make_int_sequence<kRegsC>{}, &scale, seq<0>{});
}

// The rows the tile's wgmmas span: kBlockN, or on kNarrowIssue tiles the least width of the
// tile's set that holds the tile's `tile_rows` rows (the consumers; the producer loads the x boxes
// that hold the rows, which the width covers).
// Params::narrow_issue 1: N256 64 / 128 / 256; 2: N256 also 192; 3: N128 (but kSwigluNvfp4's)
// also 64 / 96 / 128.
template <class Cfg>
CUTLASS_DEVICE int issue_rows(const Params& p, int tile_rows) {
  if constexpr (Cfg::kNarrowIssue && Cfg::kBlockN == 256) {
    if (p.narrow_issue > 0) {
      return tile_rows <= 64                            ? 64
             : tile_rows <= 128                         ? 128
             : tile_rows <= 192 && p.narrow_issue >= 2 ? 192
                                                        : 256;
    }
  } else if constexpr (Cfg::kNarrowIssue && Cfg::kBlockN == 128) {
    if (p.narrow_issue >= 3) return tile_rows <= 64 ? 64 : tile_rows <= 96 ? 96 : 128;
  }
  return Cfg::kBlockN;
}

template <class Cfg>
struct MainloopProducer {
  using Pipeline = typename Cfg::Pipeline;
  using SharedStorage = typename Cfg::SharedStorage;
  static constexpr int kBlockN = Cfg::kBlockN;

  // Tile tc's K stages [kc_begin, kc_end) (k_tiles: the 64-K chunks of K).
  template <class State>
  CUTLASS_DEVICE static void load_tile(Pipeline& pipeline, State& state, SharedStorage& ss, const CUtensorMap& tma_x,
                                       const Params& p, const TileCoord& tc, int kc_begin, int kc_end,
                                       int k_tiles) {
    const int chunks_m = p.n / weights::kChunkRows;
    const int2 rr = expert_rows<kBlockN>(p, tc.expert);
    const int row0 = rr.x + tc.n_tile * kBlockN;
    // kNarrowIssue: the x boxes that hold the tile's rows (the wgmmas span issue_rows(); columns
    // past the rows read stale stage contents, never stored); the others' bytes are counted off
    // the stage's barrier.
    constexpr int kBoxes = kBlockN / Cfg::kBoxRows;
    // (At least one: box 0 is always loaded, and a tile has rows.)
    const int boxes = Cfg::kNarrowIssue && p.narrow_issue
                          ? max(1, min(kBoxes, (min(rr.y - row0, kBlockN) + Cfg::kBoxRows - 1) / Cfg::kBoxRows))
                          : kBoxes;
    constexpr int kConsumers = Cfg::kConsumers;
    // Consumer c's 64-feature chunk row. Where the last tile reaches past n (n % kTileM != 0), the
    // consumers past it get the tile's first row again (their results are not stored), so every
    // stage moves the same bytes.
    const int mt0 = tc.m_tile * kConsumers;
    auto chunk_row = [&](int c) { return mt0 + c < chunks_m ? mt0 + c : mt0; };
    // Config::kL2Prefetch: stage kc's weight chunks (each consumer's are contiguous in K) into L2,
    // a hint the memory system may drop; issued before the stage is acquired, so while waiting.
    const int ahead = Cfg::kL2Prefetch ? p.l2_prefetch : 0;
    auto prefetch_weights = [&](int kc) __attribute__((always_inline)) {
      const int c0 = kc * Cfg::kChunks;
      const int chunks = min(Cfg::kChunks, k_tiles - c0);
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < kConsumers; ++c) {
        SM90_BULK_COPY_G2S::PREFETCH::copy(p.prepared + weights::chunk_offset(tc.expert, chunk_row(c), c0, p.n, p.k),
                                           chunks * weights::kChunkBytes);
      }
    };
    if constexpr (Cfg::kL2Prefetch) {
      // The tile's first stages too: after a CTA's first tile they are loaded only as the previous
      // tile's stages are freed.
#pragma unroll 1
      for (int kc = kc_begin; kc < min(kc_begin + ahead, kc_end); ++kc) prefetch_weights(kc);
    }
    // Not unrolled: with split-K's runtime K range, unrolling spills on the producer's
    // kProducerRegs registers (and measured no faster without split-K, 2026-12-02).
#pragma unroll 1
    for (int kc = kc_begin; kc < kc_end; ++kc) {
      if constexpr (Cfg::kL2Prefetch) {
        if (ahead > 0 && kc + ahead < kc_end) prefetch_weights(kc + ahead);
      }
      pipeline.producer_acquire(state);
      uint64_t* bar = pipeline.producer_get_barrier(state);
      int s = state.index();
      const int c0 = kc * Cfg::kChunks;
      if (c0 + Cfg::kChunks <= k_tiles) {
        // A stage's chunks are consecutive in K, so adjacent in the prepared layout: one bulk
        // copy per consumer.
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < kConsumers; ++c) {
          SM90_BULK_COPY_G2S::copy(p.prepared + weights::chunk_offset(tc.expert, chunk_row(c), c0, p.n, p.k), bar,
                                   ss.a[s][c], Cfg::kChunks * weights::kChunkBytes);
        }
      } else {
        // The partial last stage. Its x pieces past K are zero-filled by the TMA unit. Its weight
        // chunks past K repeat the last one where they share an A fragment with a chunk inside K
        // (their products add exact zeros: the weights are finite). With two fragments per stage
        // (Config::kFragChunks), a fragment wholly past K is neither loaded nor converted
        // (MainloopConsumer), and its bytes are counted off the stage's barrier here, so every
        // stage still completes its kStageBytes.
        constexpr bool kSkipParts = !Cfg::kPipelined && Cfg::kFragChunks < Cfg::kChunks;
        const int loaded = kSkipParts ? min(Cfg::kChunks, (k_tiles - c0 + Cfg::kFragChunks - 1) / Cfg::kFragChunks *
                                                              Cfg::kFragChunks)
                                      : Cfg::kChunks;
        CUTLASS_PRAGMA_UNROLL
        for (int h = 0; h < Cfg::kChunks; ++h) {
          if (!kSkipParts || h < loaded) {
            const int kt = min(c0 + h, k_tiles - 1);
            CUTLASS_PRAGMA_UNROLL
            for (int c = 0; c < kConsumers; ++c) {
              SM90_BULK_COPY_G2S::copy(p.prepared + weights::chunk_offset(tc.expert, chunk_row(c), kt, p.n, p.k), bar,
                                       ss.a[s][c] + h * weights::kChunkBytes, weights::kChunkBytes);
            }
          }
        }
        if (kSkipParts && loaded < Cfg::kChunks) {
          const uint32_t skipped = uint32_t(Cfg::kChunks - loaded) * kConsumers * weights::kChunkBytes;
          asm volatile("mbarrier.complete_tx.shared::cta.b64 [%0], %1;" ::"r"(cute::cast_smem_ptr_to_uint(bar)),
                       "r"(skipped)
                       : "memory");
        }
      }
      CUTLASS_PRAGMA_UNROLL
      for (int h = 0; h < Cfg::kChunks; ++h) {
        CUTLASS_PRAGMA_UNROLL
        for (int b = 0; b < kBoxes; ++b) {
          if (b == 0 || b < boxes) {
            SM90_TMA_LOAD_2D::copy(&tma_x, bar, uint64_t(cute::TMA::CacheHintSm90::EVICT_NORMAL),
                                   ss.b + s * (kBlockN * Cfg::kStageK) + h * (kBlockN * kTileK) +
                                       b * (Cfg::kBoxRows * kTileK),
                                   (c0 + h) * kTileK, row0 + b * Cfg::kBoxRows);
          }
        }
      }
      if (kBoxes > 1 && boxes < kBoxes) {
        const uint32_t skipped = uint32_t(kBoxes - boxes) * Cfg::kChunks * (Cfg::kBoxRows * kTileK * 2);
        asm volatile("mbarrier.complete_tx.shared::cta.b64 [%0], %1;" ::"r"(cute::cast_smem_ptr_to_uint(bar)),
                     "r"(skipped)
                     : "memory");
      }
      ++state;
    }
  }
};

// The grouped GEMM's consumer mainloop: a consumer warpgroup (cw: which 64 features of the tile;
// thread t of 128) runs one tile's K stages [kc_begin, kc_end) into `accum`. Per 64-K chunk, each
// thread reads its 16 code bytes and 8 scale bytes, converts them to BF16 A fragments exactly
// (shift/mask/or and one bf16x2 multiply per pair; nvfp4_weights.cuh), and issues 4 m64 x kBlockN x
// k16 wgmmas per chunk. Two schedules (Config): unpipelined (one fragment of kFragChunks chunks,
// each stage converted and retired in kChunks / kFragChunks parts, each part's group retired before
// the next conversion) and pipelined (two whole-stage fragments, one group in flight). (A third,
// two one-chunk fragments pipelined within 128-K stages, served the one-CTA N64 tile until N64 went
// to two CTAs per SM, 2026-12-02.)
//
// issue_n: the rows the wgmmas span (Cfg::kBlockN, or less on a kNarrowIssue tile's short row
// tiles: issue_rows()), on the first accumulators.
template <class Cfg>
struct MainloopConsumer {
  // Its lambdas are inlined by force: with the several wgmma widths of kNarrowIssue tiles, ptxas
  // otherwise got an outlined lambda (C7510) or too few registers (C7511) and serialized every
  // wgmma (N256, CUDA 13.0).
  template <class Pipeline, class State, class TiledMma, class FragB, class FragA, class Accum>
  CUTLASS_DEVICE static void mma_tile(Pipeline& pipeline, State& state, typename Cfg::SharedStorage& ss, int cw, int t,
                                      TiledMma& tiled_mma, FragB& tCrB, FragA& tCrA0, FragA& tCrA1, Accum& accum,
                                      int kc_begin, int kc_end, int k_tiles, int issue_n) {
    const int w = t / 32, g = (t % 32) / 4;
    const int n_k = kc_end - kc_begin;  // K stages per tile for this CTA
    // A stage's shared memory is free again: arrive on this CTA's empty barrier. (The pipeline's own
    // consumer_release, built for a cluster of one, would signal the cluster's rank 0.)
    auto release_stage = [&](auto st) __attribute__((always_inline)) {
      ss.pipeline.empty_barrier_[st.index()].arrive();
    };

    // A chunk's shared-memory words for this thread: its 16 code bytes (one u32 per k-block) and 8
    // scale bytes (the byte pairs of its two rows for k-blocks 0..3).
    struct ChunkWords {
      uint4 codes;
      uint2 scales;
    };
    auto load_codes = [&](int s, int h) __attribute__((always_inline)) {
      return reinterpret_cast<const uint4*>(ss.a[s][cw] + h * weights::kChunkBytes)[t];
    };
    auto load_scales = [&](int s, int h) __attribute__((always_inline)) {
      return *reinterpret_cast<const uint2*>(ss.a[s][cw] + h * weights::kChunkBytes + weights::kChunkCodeBytes +
                                             (w * 8 + g) * 8);
    };
    auto load_chunk = [&](int s, int h) __attribute__((always_inline)) {
      return ChunkWords{load_codes(s, h), load_scales(s, h)};
    };
    // A chunk's words -> BF16 A fragment `frag` from k-block 4 h0 on (exact; see nvfp4_weights.cuh).
    auto decode_chunk = [&](const ChunkWords& cwds, auto& frag, int h0) __attribute__((always_inline)) {
      Tensor a_words = recast<uint32_t>(frag);  // 16 registers per chunk: bf16 pairs, 4 per k-block
      const uint32_t cw4[4] = {cwds.codes.x, cwds.codes.y, cwds.codes.z, cwds.codes.w};
      CUTLASS_PRAGMA_UNROLL
      for (int kb = 0; kb < 4; ++kb) {
        uint32_t a[4];
        weights::decode_kblock(cw4[kb], cwds.scales, kb, a);
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < 4; ++j) a_words((h0 * 4 + kb) * 4 + j) = a[j];
      }
    };
    // Chunk h of stage s's weights -> BF16 A fragment `frag` from k-block 4 h0 on.
    auto convert_chunk = [&](int s, int h, auto& frag, int h0) __attribute__((always_inline)) {
      decode_chunk(load_chunk(s, h), frag, h0);
    };
    // All of stage s's chunks -> `frag` (a whole-stage fragment).
    auto convert = [&](int s, auto& frag) __attribute__((always_inline)) {
      CUTLASS_PRAGMA_UNROLL
      for (int h = 0; h < Cfg::kChunks; ++h) {
        convert_chunk(s, h, frag, h);
      }
    };
    // Keeps the compiler from moving fragment writes across the asynchronous wgmmas that read them.
    auto fence_a = [](auto& frag) __attribute__((always_inline)) {
      Tensor a_words = recast<uint32_t>(frag);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(a_words); ++i) {
        asm volatile("" : "+r"(a_words(i))::"memory");
      }
    };
    // B descriptors: tCrB (MMA, MMA_N, MMA_K, stages) holds descriptor offsets from its base; k-block
    // kb of stage s is base + offset(0, 0, kb, s), added as 64-bit values (wgmma_rs).
    const uint64_t desc_b0 = uint64_t(tCrB.data().desc_);
    auto desc_b = [&](int kb, int s) __attribute__((always_inline)) {
      return desc_b0 + uint64_t(int(tCrB.layout()(0, 0, kb, s)));
    };
    // The 4 kFragChunks m64 x issue_n x k16 wgmmas of one fragment, k-blocks [kb0, kb0 + 4
    // kFragChunks) of stage s, committed as one group. (All of them in a partial last stage too: a
    // predicated wgmma makes ptxas inject a warpgroup.arrive before each.)
    auto issue_range = [&](int s, int kb0, auto& frag) __attribute__((always_inline)) {
      fence_a(frag);
      warpgroup_fence_operand(accum);
      const uint64_t desc_s = desc_b(0, s);
      // The arrive and the commit in each branch: a commit after the branches merge made ptxas end
      // each branch's group and add an empty one, so that the wait for one group in flight waited
      // for the group just issued; an arrive before the branch made it inject one in each (C7519).
      auto wgmmas = [&](auto n) __attribute__((always_inline)) {
        // (Without CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED, rs_op_selector silently picks the widest
        // base shape that divides N, e.g. m64n32 for 160 and 224, m64n16 for 80 and 112.)
        static_assert(extent<typename Cfg::template MmaOpN<decltype(n)::value>::CRegisters>::value ==
                          64 * decltype(n)::value / 128,
                      "the wgmma spans the issue width");
        warpgroup_arrive();
        CUTLASS_PRAGMA_UNROLL
        for (int kb = 0; kb < 4 * Cfg::kFragChunks; ++kb) {
          wgmma_rs<typename Cfg::template MmaOpN<decltype(n)::value>>(
              frag(_, _, kb), desc_s + uint64_t(int(tCrB.layout()(0, 0, kb0 + kb, 0))), accum, tiled_mma.accumulate_);
          tiled_mma.accumulate_ = GMMA::ScaleOut::One;
        }
        warpgroup_commit_batch();
      };
      if constexpr (Cfg::kNarrowIssue) {
        // (N256: 64, 128, 192; N128: 64, 96: issue_rows().)
        constexpr int kHalf = Cfg::kBlockN / 2, kThreeQuarters = 3 * Cfg::kBlockN / 4;
        if (issue_n == kHalf) {
          wgmmas(Int<kHalf>{});
        } else if (issue_n == kThreeQuarters) {
          wgmmas(Int<kThreeQuarters>{});
        } else if constexpr (Cfg::kBlockN == 256) {
          if (issue_n == 64) {
            wgmmas(Int<64>{});
          } else {
            wgmmas(Int<Cfg::kBlockN>{});
          }
        } else {
          wgmmas(Int<Cfg::kBlockN>{});
        }
      } else {
        wgmmas(Int<Cfg::kBlockN>{});
      }
      warpgroup_fence_operand(accum);
    };
    auto issue = [&](int s, auto& frag) __attribute__((always_inline)) { issue_range(s, 0, frag); };  // a whole stage

    tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
    if constexpr (Cfg::kPipelined) {
      // Software pipeline, one wgmma group in flight: stage kc's group is issued, then the wait for
      // at most one outstanding group retires stage kc - 1's, whose shared memory is released and
      // whose A fragment is free for stage kc + 1. Fragments alternate A0, A1 (k_tiles >= 1).
      pipeline.consumer_wait(state);
      convert(state.index(), tCrA0);
      issue(state.index(), tCrA0);
      auto release = state;
      ++state;
      auto step = [&](auto& frag) __attribute__((always_inline)) {
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
      // One fragment of kFragChunks chunks, kParts per stage: each part's group retires before the
      // next part is converted. The next part's shared-memory words are read while the current
      // group runs (the next stage's full-barrier wait too), into the registers its conversion
      // needs anyway, so that the read latency and the wait overlap the wgmmas.
      constexpr int kParts = Cfg::kChunks / Cfg::kFragChunks;
      // The next part's code words (8 registers per chunk pair); its scale words are read when it
      // is converted (reading them early too made ptxas spill at 80 registers).
      uint4 next[Cfg::kFragChunks];
      auto load_part = [&](int s, int part) __attribute__((always_inline)) {
        CUTLASS_PRAGMA_UNROLL
        for (int h = 0; h < Cfg::kFragChunks; ++h) next[h] = load_codes(s, part * Cfg::kFragChunks + h);
      };
      auto retire = [&]() __attribute__((always_inline)) {
        warpgroup_wait<0>();
        warpgroup_fence_operand(accum);
        fence_a(tCrA0);
      };
      // Parts [0, parts) of stage s from its part 0's words (already read); ends with the last
      // part's group in flight.
      auto run_stage = [&](int s, int parts) __attribute__((always_inline)) {
        CUTLASS_PRAGMA_UNROLL
        for (int part = 0; part < kParts; ++part) {
          if (part == 0 || part < parts) {
            if (part > 0) retire();  // the previous part's group: the fragment is free
            CUTLASS_PRAGMA_UNROLL
            for (int h = 0; h < Cfg::kFragChunks; ++h) {
              decode_chunk(ChunkWords{next[h], load_scales(s, part * Cfg::kFragChunks + h)}, tCrA0, h);
            }
            issue_range(s, 4 * Cfg::kFragChunks * part, tCrA0);
            if (part + 1 < parts) load_part(s, part + 1);
          }
        }
      };
      // Parts of this CTA's last stage that hold a chunk inside K (the producer loads no others).
      // Only it and a count of the stages left stay live across the loop (kc, kc_end and k_tiles
      // made ptxas spill on N64).
      const int last_parts =
          min(kParts, (k_tiles - (kc_end - 1) * Cfg::kChunks + Cfg::kFragChunks - 1) / Cfg::kFragChunks);
      pipeline.consumer_wait(state);
      load_part(state.index(), 0);
      // The last stage is peeled off: every stage of the loop has a next one to read.
      for (int left = kc_end - kc_begin - 1; left > 0; --left) {
        run_stage(state.index(), kParts);
        const auto current = state;
        ++state;
        pipeline.consumer_wait(state);
        load_part(state.index(), 0);
        retire();
        release_stage(current);
      }
      run_stage(state.index(), last_parts);
      retire();
      release_stage(state);
      ++state;
    }
  }
};

}  // namespace nvfp4moe::gemm
