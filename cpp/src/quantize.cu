// quantize_nvfp4 / dequantize_nvfp4: bf16 <-> NVFP4 (E2M1 codes + E4M3 block-16 scales), by the
// pinned recipe, bit-exact with the CPU reference.
//
// Memory-bound: one thread per 16-element block, with every global access coalesced. A warp owns
// 32 consecutive blocks (1 KiB of bf16). Lane 2j loads the first halves and lane 2j+1 the second
// halves of blocks j and 16+j (so each 16-byte load instruction of the warp covers 512 contiguous
// bytes), then one shfl_xor swap gives lane 2j all of block j and lane 2j+1 all of block 16+j.
// The dequantizer runs the same swap in reverse before its 16-byte stores. Threads are laid over
// the *padded* scale index space, so the padding bytes of the swizzled layout are written by the
// same launch.
#include "nvfp4moe/nvfp4moe.h"
#include "nvfp4_codec.cuh"
#include "status.hpp"

#include <cutlass/fast_math.h>

#include <cuda_runtime.h>
#include <algorithm>
#include <cmath>

namespace nvfp4moe {
namespace {

constexpr int kThreads = 256;
// One launch covers at most this many scale positions (32-bit index arithmetic in the kernel);
// larger tensors are split into launches of whole 128-row tiles.
constexpr int64_t kMaxBlocksPerLaunch = int64_t(1) << 30;

struct Geometry {
  int64_t kb;        // scale columns with data: cols / 16
  int64_t kb_pad;    // scale columns laid out (kb, or round_up(kb, 4) swizzled)
  int64_t rows_pad;  // rows laid out (rows, or round_up(rows, 128) swizzled)
  int64_t k_tiles;   // swizzled: kb_pad / 4
};

Geometry geometry(ScaleLayout layout, int64_t rows, int64_t cols) {
  Geometry g;
  g.kb = cols / 16;
  if (layout == ScaleLayout::kSwizzled128x4) {
    g.kb_pad = (g.kb + 3) / 4 * 4;
    g.rows_pad = (rows + 127) / 128 * 128;
  } else {
    g.kb_pad = g.kb;
    g.rows_pad = rows;
  }
  g.k_tiles = g.kb_pad / 4;
  return g;
}

template <ScaleLayout kLayout>
CUTLASS_DEVICE int64_t scale_index(int m, int k, int kb_pad, int k_tiles) {
  if constexpr (kLayout == ScaleLayout::kSwizzled128x4) {
    return codec::swizzled_offset(m, k, k_tiles);
  } else {
    return int64_t(m) * kb_pad + k;
  }
}

CUTLASS_DEVICE uint4 shfl_xor_u4(uint4 v, int mask) {
  return make_uint4(__shfl_xor_sync(0xFFFFFFFFu, v.x, mask), __shfl_xor_sync(0xFFFFFFFFu, v.y, mask),
                    __shfl_xor_sync(0xFFFFFFFFu, v.z, mask), __shfl_xor_sync(0xFFFFFFFFu, v.w, mask));
}

CUTLASS_DEVICE uint4 select_u4(bool p, uint4 a, uint4 b) {
  return make_uint4(p ? a.x : b.x, p ? a.y : b.y, p ? a.z : b.z, p ? a.w : b.w);
}

// The two blocks a lane's loads/stores touch: A = warp*32 + lane/2, B = A + 16. The lane computes
// block A if it is even, B if odd.
struct LanePair {
  int block_a, block_b;
  bool odd;
};

CUTLASS_DEVICE LanePair lane_pair() {
  int lane = threadIdx.x & 31;
  int warp = int(blockIdx.x) * (kThreads / 32) + int(threadIdx.x >> 5);
  return LanePair{warp * 32 + (lane >> 1), warp * 32 + (lane >> 1) + 16, bool(lane & 1)};
}

// x: (rows, cols) bf16 -> codes (rows, cols/2) u8, scales per kLayout. This launch covers padded
// scale rows [0, rows_pad) of the pointers it is given (the host offsets them per chunk).
// n_blocks = rows_pad * kb_pad; div_kb_pad divides by kb_pad.
template <ScaleLayout kLayout>
__global__ void __launch_bounds__(kThreads) quantize_kernel(
    const __nv_bfloat16* __restrict__ x, int rows, int kb, int kb_pad, int n_blocks, int k_tiles,
    cutlass::FastDivmod div_kb_pad, float g, uint8_t* __restrict__ codes, uint8_t* __restrict__ scales) {
  LanePair lp = lane_pair();
  int half = lp.odd ? 1 : 0;
  int m_a, k_a, m_b, k_b;
  div_kb_pad(m_a, k_a, lp.block_a);
  div_kb_pad(m_b, k_b, lp.block_b);
  bool data_a = lp.block_a < n_blocks && m_a < rows && k_a < kb;
  bool data_b = lp.block_b < n_blocks && m_b < rows && k_b < kb;
  // Element offsets of the blocks in x (row-major, kb blocks per row).
  int64_t off_a = (int64_t(m_a) * kb + k_a) * 16;
  int64_t off_b = (int64_t(m_b) * kb + k_b) * 16;
  uint4 v_a = make_uint4(0, 0, 0, 0), v_b = make_uint4(0, 0, 0, 0);
  if (data_a) v_a = __ldg(reinterpret_cast<const uint4*>(x + off_a) + half);
  if (data_b) v_b = __ldg(reinterpret_cast<const uint4*>(x + off_b) + half);
  // Even lanes send B's first half and keep A's; odd lanes send A's second half and keep B's.
  uint4 recv = shfl_xor_u4(select_u4(lp.odd, v_a, v_b), 1);
  uint4 lo = select_u4(lp.odd, recv, v_a);  // elements 0..7 of my block
  uint4 hi = select_u4(lp.odd, v_b, recv);  // elements 8..15
  int block = lp.odd ? lp.block_b : lp.block_a;
  int m = lp.odd ? m_b : m_a;
  int k = lp.odd ? k_b : k_a;
  bool data = lp.odd ? data_b : data_a;
  int64_t off = lp.odd ? off_b : off_a;
  if (block >= n_blocks) {
    return;
  }
  uint32_t scale = 0;  // padding positions get 0
  if (data) {
    float xf[16];
    const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < 8; ++i) {
      // bf16 -> f32 is exact: the bf16 bits are the top half of the f32.
      xf[2 * i] = __uint_as_float(w[i] << 16);
      xf[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
    }
    codec::Block16 q = codec::quantize_block16(xf, g);
    *reinterpret_cast<uint2*>(codes + off / 2) = make_uint2(q.codes_lo, q.codes_hi);
    scale = q.scale;
  }
  scales[scale_index<kLayout>(m, k, kb_pad, k_tiles)] = uint8_t(scale);
}

// codes + scales -> out (rows, cols) bf16. n_blocks = rows * kb; div_kb divides by kb.
template <ScaleLayout kLayout>
__global__ void __launch_bounds__(kThreads) dequantize_kernel(
    const uint8_t* __restrict__ codes, const uint8_t* __restrict__ scales, int n_blocks, int kb_pad,
    int k_tiles, cutlass::FastDivmod div_kb, float g, __nv_bfloat16* __restrict__ out) {
  LanePair lp = lane_pair();
  int block = lp.odd ? lp.block_b : lp.block_a;
  uint32_t packed[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  if (block < n_blocks) {
    int m, k;
    div_kb(m, k, block);
    uint2 c = __ldg(reinterpret_cast<const uint2*>(codes + int64_t(block) * 8));
    float s = codec::e4m3_decode(__ldg(scales + scale_index<kLayout>(m, k, kb_pad, k_tiles)));
    if (isnan(s)) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < 8; ++i) packed[i] = 0x7FC07FC0u;  // canonical bf16 NaN
    } else {
      const uint32_t cw[2] = {c.x, c.y};
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < 8; ++i) {
        uint32_t nib = cw[i / 4] >> (8 * (i % 4));
        // (e2m1 * e4m3) is exact in FP32; then one rounding for * g; then RNE to bf16.
        float lo = __fmul_rn(__fmul_rn(codec::e2m1_decode(nib & 0xFu), s), g);
        float hi = __fmul_rn(__fmul_rn(codec::e2m1_decode((nib >> 4) & 0xFu), s), g);
        __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);
        packed[i] = *reinterpret_cast<uint32_t*>(&p);
      }
    }
  }
  uint4 lo = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  uint4 hi = make_uint4(packed[4], packed[5], packed[6], packed[7]);
  // Even lanes send their second half, odd lanes their first: then lane 2j stores the first halves
  // of blocks j and 16+j, lane 2j+1 the second halves (each store instruction: 512 contiguous B).
  uint4 recv = shfl_xor_u4(select_u4(lp.odd, lo, hi), 1);
  int half = lp.odd ? 1 : 0;
  if (lp.block_a < n_blocks) {
    reinterpret_cast<uint4*>(out + int64_t(lp.block_a) * 16)[half] = select_u4(lp.odd, recv, lo);
  }
  if (lp.block_b < n_blocks) {
    reinterpret_cast<uint4*>(out + int64_t(lp.block_b) * 16)[half] = select_u4(lp.odd, hi, recv);
  }
}

Status check_common(int64_t rows, int64_t cols, float g, ScaleLayout layout) {
  if (rows < 0 || cols <= 0 || cols % 16 != 0) {
    return fail(Status::kInvalidShape, "rows must be >= 0 and cols a positive multiple of 16 (rows=%lld, cols=%lld)",
                (long long)rows, (long long)cols);
  }
  if (!(std::isfinite(g) && g > 0.0f)) {
    return fail(Status::kInvalidDecodeScale, "decode scale must be finite and > 0 (got %g)", double(g));
  }
  if (layout != ScaleLayout::kLinear && layout != ScaleLayout::kSwizzled128x4) {
    return fail(Status::kUnsupportedLayout, "unknown scale layout %d", int(layout));
  }
  return Status::kSuccess;
}

bool aligned(const void* p, uintptr_t a) { return (reinterpret_cast<uintptr_t>(p) % a) == 0; }

}  // namespace

size_t scale_bytes(ScaleLayout layout, int64_t rows, int64_t cols) noexcept {
  if (rows < 0 || cols <= 0 || cols % 16 != 0) return 0;
  if (layout != ScaleLayout::kLinear && layout != ScaleLayout::kSwizzled128x4) return 0;
  Geometry g = geometry(layout, rows, cols);
  return size_t(g.rows_pad) * size_t(g.kb_pad);
}

Status quantize_nvfp4(const QuantizeNvfp4Args& a, void* stream) noexcept {
  if (Status s = check_common(a.rows, a.cols, a.decode_scale, a.layout); s != Status::kSuccess) return s;
  Geometry geo = geometry(a.layout, a.rows, a.cols);
  if (geo.rows_pad == 0) return Status::kSuccess;
  if (!a.x || !a.codes || !a.scales) return fail(Status::kNullPointer, "quantize_nvfp4: null pointer");
  if (!aligned(a.x, 16)) return fail(Status::kMisaligned, "quantize_nvfp4: x must be 16-byte aligned");
  if (!aligned(a.codes, 8)) return fail(Status::kMisaligned, "quantize_nvfp4: codes must be 8-byte aligned");
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  // Chunks of whole 128-row tiles keep both layouts' offsets relative to the chunk's pointers.
  int64_t rows_per_chunk = std::max<int64_t>(128, kMaxBlocksPerLaunch / geo.kb_pad / 128 * 128);
  for (int64_t r0 = 0; r0 < geo.rows_pad; r0 += rows_per_chunk) {
    int64_t chunk_pad = std::min(rows_per_chunk, geo.rows_pad - r0);
    int64_t chunk_rows = std::max<int64_t>(0, std::min(chunk_pad, a.rows - r0));
    int64_t n = chunk_pad * geo.kb_pad;
    unsigned grid = unsigned((n + kThreads - 1) / kThreads);
    const auto* x = static_cast<const __nv_bfloat16*>(a.x) + r0 * a.cols;
    auto* codes = static_cast<uint8_t*>(a.codes) + r0 * (a.cols / 2);
    auto* scales = static_cast<uint8_t*>(a.scales) + r0 * geo.kb_pad;
    cutlass::FastDivmod div_kb_pad(int(geo.kb_pad));
    auto kernel = a.layout == ScaleLayout::kSwizzled128x4 ? quantize_kernel<ScaleLayout::kSwizzled128x4>
                                                          : quantize_kernel<ScaleLayout::kLinear>;
    kernel<<<grid, kThreads, 0, st>>>(x, int(chunk_rows), int(geo.kb), int(geo.kb_pad), int(n), int(geo.k_tiles),
                                      div_kb_pad, a.decode_scale, codes, scales);
    if (Status s = check_launch("quantize_nvfp4"); s != Status::kSuccess) return s;
  }
  return Status::kSuccess;
}

Status dequantize_nvfp4(const DequantizeNvfp4Args& a, void* stream) noexcept {
  if (Status s = check_common(a.rows, a.cols, a.decode_scale, a.layout); s != Status::kSuccess) return s;
  Geometry geo = geometry(a.layout, a.rows, a.cols);
  if (a.rows == 0) return Status::kSuccess;
  if (!a.codes || !a.scales || !a.out) return fail(Status::kNullPointer, "dequantize_nvfp4: null pointer");
  if (!aligned(a.codes, 8)) return fail(Status::kMisaligned, "dequantize_nvfp4: codes must be 8-byte aligned");
  if (!aligned(a.out, 16)) return fail(Status::kMisaligned, "dequantize_nvfp4: out must be 16-byte aligned");
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  int64_t rows_per_chunk = std::max<int64_t>(128, kMaxBlocksPerLaunch / geo.kb_pad / 128 * 128);
  for (int64_t r0 = 0; r0 < a.rows; r0 += rows_per_chunk) {
    int64_t chunk_rows = std::min(rows_per_chunk, a.rows - r0);
    int64_t n = chunk_rows * geo.kb;
    unsigned grid = unsigned((n + kThreads - 1) / kThreads);
    const auto* codes = static_cast<const uint8_t*>(a.codes) + r0 * (a.cols / 2);
    const auto* scales = static_cast<const uint8_t*>(a.scales) + r0 * geo.kb_pad;
    auto* out = static_cast<__nv_bfloat16*>(a.out) + r0 * a.cols;
    cutlass::FastDivmod div_kb(int(geo.kb));
    auto kernel = a.layout == ScaleLayout::kSwizzled128x4 ? dequantize_kernel<ScaleLayout::kSwizzled128x4>
                                                          : dequantize_kernel<ScaleLayout::kLinear>;
    kernel<<<grid, kThreads, 0, st>>>(codes, scales, int(n), int(geo.kb_pad), int(geo.k_tiles), div_kb,
                                      a.decode_scale, out);
    if (Status s = check_launch("dequantize_nvfp4"); s != Status::kSuccess) return s;
  }
  return Status::kSuccess;
}

}  // namespace nvfp4moe
