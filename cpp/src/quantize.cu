// quantize_nvfp4 / dequantize_nvfp4: bf16 <-> NVFP4 (E2M1 codes + E4M3 block-16 scales), by the
// pinned recipe, bit-exact with the CPU reference.
//
// Memory-bound: one thread per 16-element block reads 32 bytes (two 16-byte loads) and writes 8
// code bytes and one scale byte. Threads are laid over the *padded* scale index space, so the
// padding bytes of the swizzled layout are written by the same launch. The quantizer is close to
// issue-bound (the exact recipe costs ~12 instructions per element), so the per-block work is kept
// small: amax with packed 16-bit max, hardware E4M3 conversion, one reciprocal per block.
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

// x: (rows, cols) bf16 -> codes (rows, cols/2) u8, scales per kLayout. This launch covers padded
// scale rows [0, rows_pad) of the pointers it is given (the host offsets them per chunk).
// n_blocks = rows_pad * kb_pad; div_kb_pad divides by kb_pad.
template <ScaleLayout kLayout>
__global__ void __launch_bounds__(kThreads, 6) quantize_kernel(
    const __nv_bfloat16* __restrict__ x, int rows, int kb, int kb_pad, int n_blocks, int k_tiles,
    cutlass::FastDivmod div_kb_pad, float g, float six_g, uint8_t* __restrict__ codes,
    uint8_t* __restrict__ scales) {
  int block = int(blockIdx.x) * kThreads + int(threadIdx.x);
  if (block >= n_blocks) {
    return;
  }
  int m, k;
  div_kb_pad(m, k, block);
  uint32_t scale = 0;  // padding positions get 0
  if (m < rows && k < kb) {
    int64_t off = int64_t(m) * kb + k;  // the block's index in x (row-major, kb blocks per row)
    const uint4* src = reinterpret_cast<const uint4*>(x) + off * 2;
    uint4 lo = __ldg(src), hi = __ldg(src + 1);
    const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    codec::Block16 q = codec::quantize_block16(w, g, six_g);
    reinterpret_cast<uint2*>(codes)[off] = make_uint2(q.codes_lo, q.codes_hi);
    scale = q.scale;
  }
  scales[scale_index<kLayout>(m, k, kb_pad, k_tiles)] = uint8_t(scale);
}

// codes + scales -> out (rows, cols) bf16. n_blocks = rows * kb; div_kb divides by kb.
template <ScaleLayout kLayout>
__global__ void __launch_bounds__(kThreads) dequantize_kernel(
    const uint8_t* __restrict__ codes, const uint8_t* __restrict__ scales, int n_blocks, int kb_pad,
    int k_tiles, cutlass::FastDivmod div_kb, float g, __nv_bfloat16* __restrict__ out) {
  int block = int(blockIdx.x) * kThreads + int(threadIdx.x);
  if (block >= n_blocks) {
    return;
  }
  int m, k;
  div_kb(m, k, block);
  codec::dequantize_block16(__ldg(reinterpret_cast<const uint2*>(codes) + block),
                            __ldg(scales + scale_index<kLayout>(m, k, kb_pad, k_tiles)), g,
                            reinterpret_cast<uint4*>(out) + int64_t(block) * 2);
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
                                      div_kb_pad, a.decode_scale, 6.0f * a.decode_scale, codes, scales);
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
