// The grouped GEMM's epilogue pieces (grouped_gemm_sm90.cuh): the SwiGLU shared by the
// Interleaved, SwigluBf16 and SwigluNvfp4 epilogues, and SwigluNvfp4's encoder of a staged tile.
#pragma once

#include "gemm_config.cuh"
#include "gemm_scheduler.cuh"
#include "nvfp4_codec.cuh"

#include <cutlass/arch/barrier.h>

namespace nvfp4moe::gemm {

// silu(g) * u in FP32, shared by the Interleaved, SwigluBf16 and SwigluNvfp4 epilogues so that
// their SwiGLU values are bit-identical. The approximate division (MUFU.RCP and a multiply, 2 ulp)
// replaces an IEEE one whose range checks and slow-path call were most of the epilogue's
// arithmetic; __expf is approximate already, and gate < -88 still gives -0 (gate / inf).
CUTLASS_DEVICE float swiglu(float gate, float up) {
  return __fdividef(gate, 1.0f + __expf(-gate)) * up;
}

// SwigluNvfp4's hand-over barriers (Config::EpiHandOff): an mbarrier arrive that releases this
// thread's earlier accesses and waits that acquire the completed phase's. All are compiler memory
// barriers too: CUTLASS's static ClusterBarrier::wait has no "memory" clobber, so the compiler could
// move the staged tile's shared-memory reads above it.
CUTLASS_DEVICE void handoff_arrive(const uint64_t* bar) {
  asm volatile(
      "{\n"
      ".reg .b64 state;\n"
      "mbarrier.arrive.release.cta.shared::cta.b64 state, [%0];\n"
      "}\n" ::"r"(cute::cast_smem_ptr_to_uint(bar))
      : "memory");
}

// (splitk::wait_cluster: the warp leaves the loop at once, and a cluster-scope acquire covers this
// CTA's own threads.)
CUTLASS_DEVICE void handoff_wait(const uint64_t* bar, uint32_t parity) {
  splitk::wait_cluster(splitk::smem_addr(bar), parity);
}

// The quantizer warps' wait: a per-thread exit, as CUTLASS's waits (they carry no uniform mainloop
// state), acquiring at CTA scope.
CUTLASS_DEVICE void handoff_wait_thread(const uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_HANDOFF:\n"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_HANDOFF;\n"
      "}\n" ::"r"(cute::cast_smem_ptr_to_uint(bar)),
      "r"(parity)
      : "memory");
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

// SwigluNvfp4's quantizer warps (warps 1-3 of the producer warpgroup, thread qt of 96): they walk
// the same tiles as the consumers and encode each consumer's staged tile while the consumer runs
// the next tile's mainloop. Hand-over j (the CTA's j-th tile) is phase j of epi_sync.full[c] (the
// consumer staged it) and of epi_sync.empty[c] (read; the consumer waits for it before staging
// hand-over j + 1, and nobody for the last one).
// The loop's stride and bound are derived again on each step (from the grid, the launch's split
// count and the shared tile prefix) rather than kept in registers: at 48 registers (two CTAs per
// SM) the quantizer warps spilled them.
template <class Cfg>
CUTLASS_DEVICE void quantizer_warps(typename Cfg::SharedStorage& ss, const Params& p, int qt, int unit0,
                                    int m_tiles) {
  constexpr int kBlockN = Cfg::kBlockN;
  auto units = [&] { return unhoisted(int(gridDim.x)) / (Cfg::kMaxSplits > 1 ? unhoisted(p.splits) : 1); };
  uint32_t phase = 0;  // parity of hand-over j
  for (int tile = unit0; tile < ss.tile_prefix[p.experts]; tile += units(), phase ^= 1u) {
    TileCoord tc = decode_tile(tile, ss.tile_prefix, p.experts, m_tiles);
    int2 rr = expert_rows<kBlockN>(p, tc.expert);
    int row_begin = rr.x + tc.n_tile * kBlockN;
    // (The scale region starts at the expert's first row, also in a tail launch.)
    const int expert_row0 = expert_span(p, tc.expert).x;
    CUTLASS_PRAGMA_UNROLL
    for (int c = 0; c < Cfg::kConsumers; ++c) {
      int feature0 = tc.m_tile * Cfg::kTileM + c * 64;
      handoff_wait_thread(&ss.epi_sync.full[c], phase);  // the consumer's staged tile
      if (feature0 < p.n) {
        quantize_staged_tile<kBlockN>(p, ss.epi[c], qt, kQuantizerThreads, tc.expert, expert_row0, row_begin, rr.y,
                                      feature0);
      }
      handoff_arrive(&ss.epi_sync.empty[c]);  // our reads of it are done
    }
  }
}

}  // namespace nvfp4moe::gemm
