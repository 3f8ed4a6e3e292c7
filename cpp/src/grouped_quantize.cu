// quantize_nvfp4_grouped (plain and swiglu_quantize) and the separate swiglu_bf16 kernel.
//
// quantize_nvfp4_grouped: one warp per row. Lane 0 finds the row's expert (binary search over the
// device offsets) and the warp shares it; lanes then walk the row two 16-element blocks at a time
// (blocks k and k + 32: coalesced, both loads issued before either is encoded) with the same
// per-block recipe as quantize_nvfp4 (codec::quantize_block16), so the bytes are identical. The scale buffer is
// zeroed first (cudaMemsetAsync), which writes every padding byte.
#include "nvfp4moe/nvfp4moe.h"
#include "grouped_quantize.hpp"
#include "nvfp4_codec.cuh"
#include "status.hpp"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>

namespace nvfp4moe {
namespace {

constexpr int kThreads = 256;

// A row's expert (the last one whose first row is <= row; lane 0 searches, the warp shares it) and
// its row in the grouped 128x4 scale layout (expert e's region starts at
// floor((offsets[e] + 127 e) / 128) * 128); scale_row is -1 when malformed offsets would put the
// row outside the buffers. Called by all 32 lanes of a warp.
struct GroupedRow {
  int expert;
  int64_t scale_row;
};

CUTLASS_DEVICE GroupedRow grouped_row(int row, int lane, const int* offsets, int experts, int rows) {
  int e = 0;
  if (lane == 0) {
    int lo = 0, hi = experts - 1;
    while (lo < hi) {
      int mid = (lo + hi + 1) / 2;
      if (offsets[mid] <= row) lo = mid; else hi = mid - 1;
    }
    e = lo;
  }
  e = __shfl_sync(0xFFFFFFFFu, e, 0);
  const int first = offsets[e];
  const int64_t scale_rows = (int64_t(rows) + int64_t(experts) * 127 + 127) / 128 * 128;
  const int64_t scale_row = (int64_t(first) + int64_t(e) * 127) / 128 * 128 + (row - first);
  return GroupedRow{e, row < first || scale_row >= scale_rows ? int64_t(-1) : scale_row};
}

// The 16-byte vectors of logical block k of a row: kContiguous reads columns 16k .. 16k+15; the
// interleaved SwiGLU source reads the swiglu slots of bands 2k and 2k+1, physical columns
// 32k + 8 .. 32k + 15 and 32k + 24 .. 32k + 31 of a [rows, 2 cols] row.
template <GroupedSource kSource>
CUTLASS_DEVICE void load_block(const __nv_bfloat16* row_ptr, int k, uint4& lo, uint4& hi) {
  if constexpr (kSource == GroupedSource::kContiguous) {
    const uint4* src = reinterpret_cast<const uint4*>(row_ptr) + 2 * k;
    lo = __ldg(src);
    hi = __ldg(src + 1);
  } else {
    const __nv_bfloat16* r = row_ptr + 32 * k;
    lo = __ldg(reinterpret_cast<const uint4*>(r + 8));
    hi = __ldg(reinterpret_cast<const uint4*>(r + 24));
  }
}

// Blocks k and k + 32 of a row, those that exist.
template <GroupedSource kSource>
CUTLASS_DEVICE void load_pair(const __nv_bfloat16* row_ptr, int k, int kb, uint4 (&u)[4]) {
  if (k < kb) load_block<kSource>(row_ptr, k, u[0], u[1]);
  if (k + 32 < kb) load_block<kSource>(row_ptr, k + 32, u[2], u[3]);
}

// One warp per row (its expert found once). Per step a lane loads blocks k and k + 32 of the row
// (every load instruction of the warp reads consecutive blocks), then encodes both with the same
// per-block recipe as quantize_nvfp4. (Prefetching the next step too made ptxas keep row values in
// local memory around the division slow-path calls.)
template <GroupedSource kSource>
__global__ void __launch_bounds__(kThreads) quantize_grouped_kernel(
    const __nv_bfloat16* __restrict__ x, int rows, int cols, const int* __restrict__ offsets, int experts,
    const float* __restrict__ decode_scales, int num_decode_scales, uint8_t* __restrict__ codes,
    uint8_t* __restrict__ scales) {
  const int lane = threadIdx.x % 32;
  const int warps = gridDim.x * (kThreads / 32);
  const int kb = cols / 16;
  const int k_tiles = (kb + 3) / 4;
  const int64_t row_elems = kSource == GroupedSource::kContiguous ? int64_t(cols) : 2 * int64_t(cols);
  const int total = min(max(offsets[experts], 0), rows);
  for (int row = blockIdx.x * (kThreads / 32) + threadIdx.x / 32; row < total; row += warps) {
    const GroupedRow gr = grouped_row(row, lane, offsets, experts, rows);
    if (gr.scale_row < 0) {
      continue;  // malformed offsets: never write outside the buffers
    }
    const float g = decode_scales[num_decode_scales == 1 ? 0 : gr.expert];
    const codec::TensorScale ts = codec::make_tensor_scale(g);
    const __nv_bfloat16* row_ptr = x + int64_t(row) * row_elems;
    uint2* row_codes = reinterpret_cast<uint2*>(codes + int64_t(row) * (cols / 2));
    for (int k = lane; k < kb; k += 64) {
      uint4 cur[4] = {};
      load_pair<kSource>(row_ptr, k, kb, cur);
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < 2; ++j) {
        const int kj = k + 32 * j;
        if (kj < kb) {
          const uint32_t w[8] = {cur[2 * j].x,     cur[2 * j].y,     cur[2 * j].z,     cur[2 * j].w,
                                 cur[2 * j + 1].x, cur[2 * j + 1].y, cur[2 * j + 1].z, cur[2 * j + 1].w};
          const codec::Block16 q = codec::quantize_block16(w, ts);
          row_codes[kj] = make_uint2(q.codes_lo, q.codes_hi);
          scales[codec::swizzled_offset(gr.scale_row, kj, k_tiles)] = uint8_t(q.scale);
        }
      }
    }
  }
}

// Decodes row `row` of codes [rows, cols / 2] whose scales are row `scale_row` of the grouped
// 128x4 layout into out [rows, cols] BF16; lane `lane` of the row's warp takes blocks lane,
// lane + 32, ... (one 16-element block each).
CUTLASS_DEVICE void dequantize_row(const uint8_t* __restrict__ codes, const uint8_t* __restrict__ scales, int row,
                                   int64_t scale_row, int cols, float g, int lane, __nv_bfloat16* __restrict__ out) {
  const int kb = cols / 16;
  const int k_tiles = (kb + 3) / 4;
  for (int k = lane; k < kb; k += 32) {
    codec::dequantize_block16(__ldg(reinterpret_cast<const uint2*>(codes + int64_t(row) * (cols / 2)) + k),
                              __ldg(scales + codec::swizzled_offset(scale_row, k, k_tiles)), g,
                              reinterpret_cast<uint4*>(out + int64_t(row) * cols) + 2 * k);
  }
}

// One warp per row, as quantize_grouped_kernel; each lane decodes 16-element blocks.
__global__ void __launch_bounds__(kThreads) dequantize_grouped_kernel(
    const uint8_t* __restrict__ codes, const uint8_t* __restrict__ scales, int rows, int cols,
    const int* __restrict__ offsets, int experts, const float* __restrict__ decode_scales, int num_decode_scales,
    __nv_bfloat16* __restrict__ out) {
  const int lane = threadIdx.x % 32;
  const int warps = gridDim.x * (kThreads / 32);
  const int total = min(max(offsets[experts], 0), rows);
  for (int row = blockIdx.x * (kThreads / 32) + threadIdx.x / 32; row < total; row += warps) {
    const GroupedRow gr = grouped_row(row, lane, offsets, experts, rows);
    if (gr.scale_row < 0) {
      continue;  // malformed offsets: never read or write outside the buffers
    }
    dequantize_row(codes, scales, row, gr.scale_row, cols, decode_scales[num_decode_scales == 1 ? 0 : gr.expert],
                   lane, out);
  }
}

// The pre-dispatched layout's dequantizer: one warp per row of the (experts x stride) layout,
// rows past their expert's count skipped (grouped_quantize.hpp).
__global__ void __launch_bounds__(kThreads) dequantize_dispatched_kernel(
    const uint8_t* __restrict__ codes, const uint8_t* __restrict__ scales, int experts, int stride,
    const int* __restrict__ counts, int cols, const float* __restrict__ decode_scales, int num_decode_scales,
    __nv_bfloat16* __restrict__ out) {
  const int lane = threadIdx.x % 32;
  const int warps = gridDim.x * (kThreads / 32);
  const int rows = experts * stride;  // < 2^31 (checked on the host)
  for (int row = blockIdx.x * (kThreads / 32) + threadIdx.x / 32; row < rows; row += warps) {
    const int e = row / stride, r = row % stride;
    if (r >= min(max(counts[e], 0), stride)) continue;
    // Expert e's region of the grouped scale layout, as the kSwigluNvfp4 epilogue addresses it.
    const int64_t scale_row = (int64_t(e) * stride + int64_t(e) * 127) / 128 * 128 + r;
    dequantize_row(codes, scales, row, scale_row, cols, decode_scales[num_decode_scales == 1 ? 0 : e], lane, out);
  }
}

// out[r, 8b + i] = silu(gate) * up with gate = in[r, 16b + i], up = in[r, 16b + 8 + i].
// One thread per 8 output features: one 16-byte load of gates, one of ups, one 16-byte store.
__global__ void __launch_bounds__(kThreads) swiglu_bf16_kernel(const __nv_bfloat16* __restrict__ in, int64_t groups,
                                                               __nv_bfloat16* __restrict__ out) {
  int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= groups) return;
  uint4 gv = __ldg(reinterpret_cast<const uint4*>(in) + 2 * i);
  uint4 uv = __ldg(reinterpret_cast<const uint4*>(in) + 2 * i + 1);
  const __nv_bfloat162* gp = reinterpret_cast<const __nv_bfloat162*>(&gv);
  const __nv_bfloat162* up = reinterpret_cast<const __nv_bfloat162*>(&uv);
  uint4 ov;
  __nv_bfloat162* op = reinterpret_cast<__nv_bfloat162*>(&ov);
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < 4; ++j) {
    float2 gf = __bfloat1622float2(gp[j]);
    float2 uf = __bfloat1622float2(up[j]);
    op[j] = __floats2bfloat162_rn(__fdividef(gf.x, 1.0f + __expf(-gf.x)) * uf.x,
                                   __fdividef(gf.y, 1.0f + __expf(-gf.y)) * uf.y);
  }
  reinterpret_cast<uint4*>(out)[i] = ov;
}

bool aligned(const void* p, uintptr_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

}  // namespace

size_t grouped_scale_bytes(int64_t rows, int64_t experts, int64_t cols) noexcept {
  if (rows < 0 || experts <= 0 || cols <= 0 || cols % 16) return 0;
  int64_t scale_rows = (rows + experts * 127 + 127) / 128 * 128;
  return size_t(scale_rows) * size_t((cols / 16 + 3) / 4 * 4);
}

// The grid of the one-warp-per-row kernels above over `rows` rows: at most 8 CTAs per SM of the
// current device (its SM count asked, and a failure to tell it an error, not a guess).
static Status row_grid(const char* what, int64_t rows, unsigned* grid) {
  int device = 0, sms = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e != cudaSuccess) return fail(Status::kCudaError, "%s: the device's SM count: %s", what, cudaGetErrorString(e));
  const int64_t want = (rows + kThreads / 32 - 1) / (kThreads / 32);
  *grid = unsigned(std::min<int64_t>(want, int64_t(std::max(sms, 1)) * 8));
  return Status::kSuccess;
}

Status quantize_nvfp4_grouped(const QuantizeGroupedArgs& a, void* stream) noexcept {
  // Shapes, counts and the source: the rules live in can_implement.cpp only.
  if (Status s = quantize_nvfp4_grouped_can_implement(a); s != Status::kSuccess) return s;
  if (!a.x || !a.expert_offsets || !a.decode_scales || !a.codes || !a.scales) {
    return fail(Status::kNullPointer, "quantize_nvfp4_grouped: null pointer");
  }
  if (!aligned(a.x, 16) || !aligned(a.codes, 8)) {
    return fail(Status::kMisaligned, "quantize_nvfp4_grouped: x must be 16-byte and codes 8-byte aligned");
  }
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  cudaError_t e = cudaMemsetAsync(a.scales, 0, grouped_scale_bytes(a.rows, a.experts, a.cols), st);
  if (e != cudaSuccess) {
    return fail(Status::kCudaError, "quantize_nvfp4_grouped: cudaMemsetAsync: %s", cudaGetErrorString(e));
  }
  if (a.rows == 0) return Status::kSuccess;
  unsigned grid = 0;
  if (Status s = row_grid("quantize_nvfp4_grouped", a.rows, &grid); s != Status::kSuccess) return s;
  auto kernel = a.source == GroupedSource::kContiguous ? quantize_grouped_kernel<GroupedSource::kContiguous>
                                                       : quantize_grouped_kernel<GroupedSource::kInterleavedSwiglu>;
  kernel<<<grid, kThreads, 0, st>>>(static_cast<const __nv_bfloat16*>(a.x), int(a.rows), int(a.cols), a.expert_offsets,
                                    int(a.experts), a.decode_scales, int(a.num_decode_scales),
                                    static_cast<uint8_t*>(a.codes), static_cast<uint8_t*>(a.scales));
  return check_launch("quantize_nvfp4_grouped");
}

Status dequantize_nvfp4_grouped(const DequantizeGroupedArgs& a, void* stream) noexcept {
  if (Status s = dequantize_nvfp4_grouped_can_implement(a); s != Status::kSuccess) return s;
  if (a.rows == 0) return Status::kSuccess;
  if (!a.codes || !a.scales || !a.expert_offsets || !a.decode_scales || !a.out) {
    return fail(Status::kNullPointer, "dequantize_nvfp4_grouped: null pointer");
  }
  if (!aligned(a.codes, 8) || !aligned(a.out, 16)) {
    return fail(Status::kMisaligned, "dequantize_nvfp4_grouped: codes must be 8-byte and out 16-byte aligned");
  }
  unsigned grid = 0;
  if (Status s = row_grid("dequantize_nvfp4_grouped", a.rows, &grid); s != Status::kSuccess) return s;
  dequantize_grouped_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const uint8_t*>(a.codes), static_cast<const uint8_t*>(a.scales), int(a.rows), int(a.cols),
      a.expert_offsets, int(a.experts), a.decode_scales, int(a.num_decode_scales),
      static_cast<__nv_bfloat16*>(a.out));
  return check_launch("dequantize_nvfp4_grouped");
}

Status dequantize_nvfp4_dispatched(const void* codes, const void* scales, int64_t experts, int64_t stride,
                                   const int* counts, int64_t cols, const float* decode_scales,
                                   int64_t num_decode_scales, void* out, void* stream) noexcept {
  constexpr const char* what = "dequantize_nvfp4_dispatched";
  if (experts <= 0 || stride < 0 || cols <= 0 || cols % 16 || cols > 0x7FFFFFFF ||
      (stride > 0 && experts > 0x7FFFFFFF / stride) || (num_decode_scales != 1 && num_decode_scales != experts)) {
    return fail(Status::kInvalidShape, "%s: need experts > 0, experts x stride < 2^31, cols a positive multiple of 16, "
                "1 or E decode scales (experts=%lld stride=%lld cols=%lld scales=%lld)", what, (long long)experts,
                (long long)stride, (long long)cols, (long long)num_decode_scales);
  }
  if (stride == 0) return Status::kSuccess;
  if (!codes || !scales || !counts || !decode_scales || !out) return fail(Status::kNullPointer, "%s: null pointer", what);
  if (!aligned(codes, 8) || !aligned(out, 16)) {
    return fail(Status::kMisaligned, "%s: codes must be 8-byte and out 16-byte aligned", what);
  }
  unsigned grid = 0;
  if (Status s = row_grid(what, experts * stride, &grid); s != Status::kSuccess) return s;
  dequantize_dispatched_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const uint8_t*>(codes), static_cast<const uint8_t*>(scales), int(experts), int(stride), counts,
      int(cols), decode_scales, int(num_decode_scales), static_cast<__nv_bfloat16*>(out));
  return check_launch(what);
}

Status swiglu_bf16(const void* gate_up, int64_t rows, int64_t inter, void* out, void* stream) noexcept {
  // One thread per 8 outputs, at most 2^31 - 1 CTAs (the grid's x limit): the product is formed
  // only as a bound on rows, never from two unbounded factors.
  constexpr int64_t kMaxGroups = int64_t(0x7FFFFFFF) * kThreads;
  if (rows < 0 || inter <= 0 || inter % 8 || inter > 0x7FFFFFFF || rows > kMaxGroups / (inter / 8)) {
    return fail(Status::kInvalidShape, "swiglu_bf16: rows >= 0 and inter a positive multiple of 8 below 2^31, rows x "
                "inter / 8 at most %lld (rows=%lld inter=%lld)", (long long)kMaxGroups, (long long)rows,
                (long long)inter);
  }
  if (rows == 0) return Status::kSuccess;
  if (!gate_up || !out) return fail(Status::kNullPointer, "swiglu_bf16: null pointer");
  if (!aligned(gate_up, 16) || !aligned(out, 16)) return fail(Status::kMisaligned, "swiglu_bf16: 16-byte alignment");
  int64_t groups = rows * (inter / 8);
  swiglu_bf16_kernel<<<unsigned((groups + kThreads - 1) / kThreads), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const __nv_bfloat16*>(gate_up), groups, static_cast<__nv_bfloat16*>(out));
  return check_launch("swiglu_bf16");
}

}  // namespace nvfp4moe
