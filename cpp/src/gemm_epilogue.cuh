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
// the next tile's mainloop. Each hand-over buffer starts empty (one arrive, only in a CTA that has
// a tile), and after a CTA's last tile nobody waits for it: every arrive is matched by one consumer
// wait.
template <class Cfg>
CUTLASS_DEVICE void quantizer_warps(typename Cfg::SharedStorage& ss, const Params& p, int qt, int unit0, int units,
                                    int total_tiles, int m_tiles) {
  constexpr int kBlockN = Cfg::kBlockN;
  CUTLASS_PRAGMA_UNROLL
  for (int c = 0; c < Cfg::kConsumers; ++c) {
    cutlass::arch::NamedBarrier::arrive(kEpiHandOffThreads, Cfg::kBarEpiEmpty + c);
  }
  for (int tile = unit0; tile < total_tiles; tile += units) {
    TileCoord tc = decode_tile(tile, ss.tile_prefix, p.experts, m_tiles);
    int2 rr = expert_rows(p, tc.expert);
    int row_begin = rr.x + tc.n_tile * kBlockN;
    bool more = tile + units < total_tiles;
    CUTLASS_PRAGMA_UNROLL
    for (int c = 0; c < Cfg::kConsumers; ++c) {
      int feature0 = tc.m_tile * Cfg::kTileM + c * 64;
      cutlass::arch::NamedBarrier::sync(kEpiHandOffThreads, Cfg::kBarEpiFull + c);
      if (feature0 < p.n) {
        quantize_staged_tile<kBlockN>(p, ss.epi[c], qt, kQuantizerThreads, tc.expert, rr.x, row_begin, rr.y,
                                      feature0);
      }
      if (more) {
        cutlass::arch::NamedBarrier::arrive(kEpiHandOffThreads, Cfg::kBarEpiEmpty + c);
      }
    }
  }
}

}  // namespace nvfp4moe::gemm
