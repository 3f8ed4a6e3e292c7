// prepare_nvfp4_weights: ModelOpt-layout NVFP4 weights -> the chunked layout of nvfp4_weights.cuh.
// One thread per (chunk, consumer thread t): it gathers t's 32 nibbles (4 k-blocks x 8 values)
// and, for c == 0, its two rows' four scale bytes.
#include "nvfp4moe/nvfp4moe.h"
#include "nvfp4_weights.cuh"
#include "status.hpp"

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cmath>
#include <memory>
#include <new>

namespace nvfp4moe {
namespace {

using namespace weights;

// E4M3 scale byte -> prepared byte. Zero -> 0 (any byte works: the block's codes are zeroed).
// Returns false for NaN or a negative non-zero scale.
CUTLASS_DEVICE bool encode_scale(uint32_t s, uint32_t& out) {
  if ((s & 0x7Fu) == 0x7Fu || ((s & 0x80u) && (s & 0x7Fu))) {
    return false;
  }
  if ((s & 0x7Fu) == 0) {
    out = 0;
    return true;
  }
  __half_raw h = __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(s), __NV_E4M3);
  float v = __half2float(__half(h)) * 0x1p118f;  // exact: a power-of-two scaling in range
  uint32_t b = __float_as_uint(v);              // as FP32: exponent E, mantissa top 3 bits
  uint32_t e = (b >> 23) & 0xFFu;                // FP32 and BF16 share the exponent field
  out = ((e - 224u) << 3) | ((b >> 20) & 7u);
  return true;
}

// Source row (within an expert) of prepared row `p`.
CUTLASS_DEVICE int64_t source_row(int64_t p, int64_t n, RowOrder order) {
  if (order == RowOrder::kGateUpBands8) {
    int64_t band = p / 16, i = p % 16;
    return i < 8 ? band * 8 + i : n / 2 + band * 8 + (i - 8);
  }
  return p;
}

__global__ void prepare_kernel(const uint8_t* __restrict__ codes, const uint8_t* __restrict__ scales,
                               int64_t experts, int64_t n, int64_t k, RowOrder order,
                               uint8_t* __restrict__ prepared, int* __restrict__ error) {
  int64_t chunks_per_expert = (n / kChunkRows) * (k / kChunkK);
  int64_t gid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t chunk = gid / 128;
  if (chunk >= experts * chunks_per_expert) {
    return;
  }
  int t = int(gid % 128);
  int64_t e = chunk / chunks_per_expert;
  int64_t rem = chunk % chunks_per_expert;
  int64_t mt = rem / (k / kChunkK);
  int64_t kc = rem % (k / kChunkK);
  int w = t / 32, lane = t % 32, g = lane / 4, c = lane % 4;
  // Global source rows of the thread's two prepared rows m0 = 16w + g and m0 + 8.
  int64_t prow = mt * kChunkRows + 16 * w + g;
  int64_t row0 = e * n + source_row(prow, n, order);
  int64_t row8 = e * n + source_row(prow + 8, n, order);
  int64_t kbs = k / 16;                                  // scale columns per row

  uint32_t words[4];
  uint32_t sbytes[4][2];
  for (int kb = 0; kb < 4; ++kb) {
    int64_t kblock = kc * 4 + kb;  // global 16-wide block index along k
    uint32_t s0 = scales[row0 * kbs + kblock];
    uint32_t s8 = scales[row8 * kbs + kblock];
    uint32_t e0 = 0, e8 = 0;
    bool ok0 = encode_scale(s0, e0), ok8 = encode_scale(s8, e8);
    if ((!ok0 || !ok8) && c == 0) {
      int64_t bad = ok0 ? row8 * kbs + kblock : row0 * kbs + kblock;
      // bad < E n k / 16 < 2^31: can_implement bounds a tensor to kMaxWeightChunks 64x64 chunks.
      if (atomicCAS(error, -1, int(bad)) == -1) {
        error[1] = int(ok0 ? s8 : s0);
      }
    }
    sbytes[kb][0] = e0;
    sbytes[kb][1] = e8;
    // Source bytes: value pairs (v0 = 0, 1) share one byte (low nibble = even k).
    int64_t kbyte = (kblock * 16 + 2 * c) / 2;
    uint32_t b00 = codes[row0 * (k / 2) + kbyte];      // row m0,   k0, k0+1
    uint32_t b10 = codes[row8 * (k / 2) + kbyte];      // row m0+8, k0, k0+1
    uint32_t b01 = codes[row0 * (k / 2) + kbyte + 4];  // row m0,   k0+8, k0+9
    uint32_t b11 = codes[row8 * (k / 2) + kbyte + 4];  // row m0+8, k0+8, k0+9
    if ((s0 & 0x7Fu) == 0) b00 = b01 = 0;  // zero-scale blocks decode to zero
    if ((s8 & 0x7Fu) == 0) b10 = b11 = 0;
    // Pair j = (values 2j, 2j+1): j=0 -> b00, j=1 -> b10, j=2 -> b01, j=3 -> b11.
    const uint32_t pair[4] = {b00, b10, b01, b11};
    uint32_t word = 0;
    for (int j = 0; j < 4; ++j) {
      word |= place_nibble(pair[j] & 0xFu, j, 0) | place_nibble((pair[j] >> 4) & 0xFu, j, 1);
    }
    words[kb] = word;
  }
  uint8_t* dst = prepared + chunk * kChunkBytes;
  reinterpret_cast<uint4*>(dst)[t] = make_uint4(words[0], words[1], words[2], words[3]);
  if (c == 0) {
    uint8_t* sd = dst + kChunkCodeBytes + (w * 8 + g) * 8;
    for (int kb = 0; kb < 4; ++kb) {
      sd[2 * kb] = uint8_t(sbytes[kb][0]);
      sd[2 * kb + 1] = uint8_t(sbytes[kb][1]);
    }
  }
}

}  // namespace

size_t prepared_weight_bytes(int64_t experts, int64_t n, int64_t k) noexcept {
  if (experts <= 0 || n <= 0 || k <= 0 || n % 64 || k % 64) return 0;
  return size_t(experts) * size_t(n / 64) * size_t(k / 64) * size_t(kChunkBytes);
}

Status prepare_nvfp4_weights(const PrepareWeightsArgs& a, void* stream) noexcept {
  // Shapes (at most 2^31 / 256 chunks: the grid and every block index fit 32 bits) and the row
  // order: the rules live in can_implement.cpp only.
  if (Status s = prepare_nvfp4_weights_can_implement(a); s != Status::kSuccess) return s;
  if (!a.codes || !a.scales || !a.prepared || !a.error) {
    return fail(Status::kNullPointer, "prepare_nvfp4_weights: null pointer");
  }
  if (reinterpret_cast<uintptr_t>(a.prepared) % 16) {
    return fail(Status::kMisaligned, "prepare_nvfp4_weights: prepared must be 16-byte aligned");
  }
  int64_t threads = a.experts * (a.n / 64) * (a.k / 64) * 128;
  unsigned grid = unsigned((threads + 255) / 256);
  prepare_kernel<<<grid, 256, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const uint8_t*>(a.codes), static_cast<const uint8_t*>(a.scales), a.experts, a.n, a.k,
      a.row_order, static_cast<uint8_t*>(a.prepared), a.error);
  return check_launch("prepare_nvfp4_weights");
}

Status prepare_moe_weights_can_implement(const PrepareWeightsArgs& a, const float* g, const float* up) noexcept {
  constexpr const char* what = "prepare_moe_weights";
  if (Status s = prepare_nvfp4_weights_can_implement(a); s != Status::kSuccess) return s;
  const bool gate_up = a.row_order == RowOrder::kGateUpBands8;
  if (!g || gate_up != (up != nullptr)) {
    return fail(Status::kNullPointer, "%s: decode scales (and, for kGateUpBands8 weights only, the up rows') are required",
                what);
  }
  for (int64_t e = 0; e < a.experts; ++e) {
    for (const float* s : {g, up}) {
      if (s && !(std::isfinite(s[e]) && s[e] > 0.0f)) {
        return fail(Status::kInvalidDecodeScale, "%s: the %sdecode scale of expert %lld is %g: not finite and > 0", what,
                    s == up ? "up rows' " : gate_up ? "gate rows' " : "", static_cast<long long>(e), double(s[e]));
      }
    }
  }
  return Status::kSuccess;
}

Status prepare_moe_weights(const PrepareWeightsArgs& a, const float* g, const float* up, float* pairs_out,
                           void* stream) noexcept {
  constexpr const char* what = "prepare_moe_weights";
  if (Status s = prepare_moe_weights_can_implement(a, g, up); s != Status::kSuccess) return s;
  const bool gate_up = a.row_order == RowOrder::kGateUpBands8;
  if (!pairs_out || !a.codes || !a.scales || !a.prepared || !a.error) return fail(Status::kNullPointer, "%s: null pointer", what);
  // [E, 2]: the decode scale of output features f % 16 < 8 (gate), then of the others (up).
  const size_t n_pairs = size_t(2 * a.experts);
  std::unique_ptr<float[]> pairs(new (std::nothrow) float[n_pairs]);
  if (!pairs) return fail(Status::kOutOfMemory, "%s: out of host memory", what);
  for (int64_t e = 0; e < a.experts; ++e) {
    pairs[size_t(2 * e)] = g[e];
    pairs[size_t(2 * e + 1)] = gate_up ? up[e] : g[e];
  }
  const auto st = static_cast<cudaStream_t>(stream);
  int error[2] = {-1, 0};
  // Pageable host memory: each copy has read its source when it returns.
  cudaError_t e = cudaMemcpyAsync(pairs_out, pairs.get(), n_pairs * sizeof(float), cudaMemcpyHostToDevice, st);
  if (e == cudaSuccess) e = cudaMemcpyAsync(a.error, error, sizeof(error), cudaMemcpyHostToDevice, st);
  if (e != cudaSuccess) return fail(Status::kCudaError, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
  if (Status s = prepare_nvfp4_weights(a, stream); s != Status::kSuccess) return s;
  e = cudaMemcpyAsync(error, a.error, sizeof(error), cudaMemcpyDeviceToHost, st);
  if (e == cudaSuccess) e = cudaStreamSynchronize(st);
  if (e != cudaSuccess) return fail(Status::kCudaError, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
  if (error[0] >= 0) {
    const int64_t kbs = a.k / 16, row = error[0] / kbs;
    return fail(Status::kInvalidValue,
                "weight_scale of expert %lld row %lld block %lld is 0x%02x (NaN or negative): not a valid NVFP4 scale",
                static_cast<long long>(row / a.n), static_cast<long long>(row % a.n),
                static_cast<long long>(error[0] % kbs), unsigned(error[1]) & 0xFFu);
  }
  return Status::kSuccess;
}

}  // namespace nvfp4moe
