// quantize_nvfp4 / dequantize_nvfp4: bf16 <-> NVFP4 (E2M1 codes + E4M3 block-16 scales), by the
// pinned recipe (v2: ModelOpt's bytes), bit-exact with the CPU reference.
//
// The quantizer is memory-bound at the limit only if it keeps enough bytes in flight and spends few
// instructions per byte (the exact recipe is ~13 per element). Consecutive threads take consecutive
// 16-element blocks (32 bytes in, 8 bytes of codes and a scale byte out) and walk the tensor with a
// grid stride over a grid sized to fill the GPU once, loading the next block before encoding the
// current one (43 registers: five CTAs of 256 per SM). Measured against a two-blocks-per-thread
// variant (64 registers, 16-byte code stores): as fast for the linear layout, 12% faster for the
// swizzled one (PERF_NOTES.md, 2026-12-02). The swizzled layout's padding bytes are written by the
// same launch, after the data.
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

// One launch's view of the tensor: padded scale rows [0, rows_pad) of the pointers it is given (the
// host offsets them per chunk). Blocks are numbered row-major, kb per row.
struct QuantizeParams {
  const uint4* x;              // (rows, cols) bf16 as 16-byte vectors: (n_blocks, 2)
  uint8_t* codes;              // (n_blocks, 8) bytes
  uint8_t* scales;             // per kLayout
  int n_blocks;                // rows * kb
  int rows, rows_pad, kb, kb_pad, k_tiles;
  cutlass::FastDivmod div_kb;  // block -> (row, column); swizzled layout only
  codec::TensorScale ts;
};

// The swizzled layout's padding: columns [kb, kb_pad) of the data rows, then every column of rows
// [rows, rows_pad), grid-strided over the launch's threads.
CUTLASS_DEVICE void write_swizzled_padding(const QuantizeParams& p, int first, int stride) {
  const int side = p.kb_pad - p.kb;
  const int n_side = p.rows * side;
  const int n_pad = n_side + (p.rows_pad - p.rows) * p.kb_pad;
  for (int i = first; i < n_pad; i += stride) {
    const int m = i < n_side ? i / side : p.rows + (i - n_side) / p.kb_pad;
    const int k = i < n_side ? p.kb + i % side : (i - n_side) % p.kb_pad;
    p.scales[codec::swizzled_offset(m, k, p.k_tiles)] = 0;
  }
}

// Encodes block b (its 32 input bytes in v) and stores its 8 code bytes and scale byte.
template <ScaleLayout kLayout>
CUTLASS_DEVICE void encode_store(const QuantizeParams& p, const codec::RcpTable& rcp, int b, const uint4 (&v)[2]) {
  const uint32_t w[8] = {v[0].x, v[0].y, v[0].z, v[0].w, v[1].x, v[1].y, v[1].z, v[1].w};
  const codec::Block16 q = codec::quantize_block16(w, p.ts, rcp);
  reinterpret_cast<uint2*>(p.codes)[b] = make_uint2(q.codes_lo, q.codes_hi);
  if constexpr (kLayout == ScaleLayout::kLinear) {
    p.scales[b] = uint8_t(q.scale);
  } else {
    int m, k;
    p.div_kb(m, k, b);
    p.scales[codec::swizzled_offset(m, k, p.k_tiles)] = uint8_t(q.scale);
  }
}

// x: (rows, cols) bf16 -> codes (rows, cols/2) u8, scales per kLayout (padding bytes 0). Thread i of
// the grid takes blocks i, i + stride, ...; the next one's two 16-byte loads go out before the
// current block is encoded.
template <ScaleLayout kLayout>
__global__ void __launch_bounds__(kThreads, 5) quantize_kernel(const QuantizeParams p) {
  static_assert(kThreads >= 128, "one thread per table entry");
  const int stride = int(gridDim.x) * kThreads;
  int b = int(blockIdx.x) * kThreads + int(threadIdx.x);
  uint4 cur[2] = {}, next[2] = {};
  if (b < p.n_blocks) {
    cur[0] = __ldg(p.x + 2 * int64_t(b));
    cur[1] = __ldg(p.x + 2 * int64_t(b) + 1);
  }
  // The fast-path reciprocal of every non-negative scale byte for this g, once per CTA (the grid is
  // persistent: each CTA then encodes ~20 blocks per thread).
  __shared__ codec::ScaleRcp rcp_table[128];  // (128) per scale byte
  if (threadIdx.x < 128) {
    rcp_table[threadIdx.x] = codec::scale_reciprocal<true>(threadIdx.x, p.ts.g);
  }
  __syncthreads();
  const codec::RcpTable rcp{rcp_table};
  // Two register sets in turn (the loop body unrolled twice), so no moves between them.
  for (; b < p.n_blocks; b += 2 * stride) {
    if (b + stride < p.n_blocks) {
      next[0] = __ldg(p.x + 2 * int64_t(b + stride));
      next[1] = __ldg(p.x + 2 * int64_t(b + stride) + 1);
    }
    encode_store<kLayout>(p, rcp, b, cur);
    if (b + stride >= p.n_blocks) {
      break;
    }
    if (b + 2 * stride < p.n_blocks) {
      cur[0] = __ldg(p.x + 2 * int64_t(b + 2 * stride));
      cur[1] = __ldg(p.x + 2 * int64_t(b + 2 * stride) + 1);
    }
    encode_store<kLayout>(p, rcp, b + stride, next);
  }
  if constexpr (kLayout == ScaleLayout::kSwizzled128x4) {
    write_swizzled_padding(p, int(blockIdx.x) * kThreads + int(threadIdx.x), stride);
  }
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


bool aligned(const void* p, uintptr_t a) { return (reinterpret_cast<uintptr_t>(p) % a) == 0; }

}  // namespace

size_t scale_bytes(ScaleLayout layout, int64_t rows, int64_t cols) noexcept {
  if (rows < 0 || cols <= 0 || cols % 16 != 0) return 0;
  if (layout != ScaleLayout::kLinear && layout != ScaleLayout::kSwizzled128x4) return 0;
  Geometry g = geometry(layout, rows, cols);
  return size_t(g.rows_pad) * size_t(g.kb_pad);
}

Status quantize_nvfp4(const QuantizeNvfp4Args& a, void* stream) noexcept {
  // Shapes, the decode scale and the layout: the rules live in can_implement.cpp only.
  if (Status s = quantize_nvfp4_can_implement(a); s != Status::kSuccess) return s;
  Geometry geo = geometry(a.layout, a.rows, a.cols);
  if (geo.rows_pad == 0) return Status::kSuccess;
  if (!a.x || !a.codes || !a.scales) return fail(Status::kNullPointer, "quantize_nvfp4: null pointer");
  if (!aligned(a.x, 16)) return fail(Status::kMisaligned, "quantize_nvfp4: x must be 16-byte aligned");
  if (!aligned(a.codes, 8)) return fail(Status::kMisaligned, "quantize_nvfp4: codes must be 8-byte aligned");
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  const bool swizzled = a.layout == ScaleLayout::kSwizzled128x4;
  auto kernel = swizzled ? quantize_kernel<ScaleLayout::kSwizzled128x4> : quantize_kernel<ScaleLayout::kLinear>;
  // A grid that fills the GPU once: the SM count and blocks per SM come from the device.
  int device = 0, sms = 0, per_sm = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0) != cudaSuccess) {
    return check_launch("quantize_nvfp4 (device query)");
  }
  const int64_t max_grid = int64_t(std::max(sms, 1)) * std::max(per_sm, 1);
  // Chunks of whole 128-row tiles keep both layouts' offsets relative to the chunk's pointers.
  int64_t rows_per_chunk = std::max<int64_t>(128, kMaxBlocksPerLaunch / geo.kb_pad / 128 * 128);
  for (int64_t r0 = 0; r0 < geo.rows_pad; r0 += rows_per_chunk) {
    int64_t chunk_pad = std::min(rows_per_chunk, geo.rows_pad - r0);
    int64_t chunk_rows = std::max<int64_t>(0, std::min(chunk_pad, a.rows - r0));
    QuantizeParams p;
    p.x = reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(a.x) + r0 * a.cols);
    p.codes = static_cast<uint8_t*>(a.codes) + r0 * (a.cols / 2);
    p.scales = static_cast<uint8_t*>(a.scales) + r0 * geo.kb_pad;
    p.n_blocks = int(chunk_rows * geo.kb);
    p.rows = int(chunk_rows);
    p.rows_pad = int(chunk_pad);
    p.kb = int(geo.kb);
    p.kb_pad = int(geo.kb_pad);
    p.k_tiles = int(geo.k_tiles);
    p.div_kb = cutlass::FastDivmod(int(geo.kb));
    p.ts = codec::make_tensor_scale(a.decode_scale);
    int64_t work = std::max<int64_t>(p.n_blocks, swizzled ? chunk_pad * geo.kb_pad - int64_t(p.n_blocks) : 0);
    unsigned grid = unsigned(std::max<int64_t>(1, std::min(max_grid, (work + kThreads - 1) / kThreads)));
    kernel<<<grid, kThreads, 0, st>>>(p);
    if (Status s = check_launch("quantize_nvfp4"); s != Status::kSuccess) return s;
  }
  return Status::kSuccess;
}

Status dequantize_nvfp4(const DequantizeNvfp4Args& a, void* stream) noexcept {
  if (Status s = dequantize_nvfp4_can_implement(a); s != Status::kSuccess) return s;
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
