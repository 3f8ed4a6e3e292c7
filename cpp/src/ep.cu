// The row movers of expert parallelism (include/nvfp4moe/ep.h): gather rows for a peer, and sum
// the partial rows the peers return in a fixed order. Both are bandwidth kernels: one CTA row
// (blockIdx.x) per output row, 16-byte (or 4-byte) words across threads, grid-y over wide rows.

#include "nvfp4moe/ep.h"
#include "status.hpp"

#include <cuda_runtime.h>

#include <cstdint>

namespace nvfp4moe {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxSlots = 1024;
constexpr int64_t kIndexLimit = 0x7FFFFFFF;
constexpr int64_t kMaxGridY = 65535;
static_assert(kThreads % 32 == 0 && kThreads <= 1024, "whole warps, one CTA");
static_assert(sizeof(uint4) == 16 && sizeof(float4) == 16, "16-byte words");

// dst (rows, words) <- src (src_rows, words) at index[row]; Word = uint4 or uint32_t.
template <class Word>
__global__ void __launch_bounds__(kThreads) gather_rows_kernel(const Word* __restrict__ src, int src_rows,
                                                               const int* __restrict__ index, int64_t words,
                                                               Word* __restrict__ dst) {
  const int row = blockIdx.x;
  const int from = index[row];
  if (from < 0 || from >= src_rows) return;  // bounded on the device: an index is never trusted
  const int64_t w = int64_t(blockIdx.y) * kThreads + threadIdx.x;
  if (w >= words) return;
  dst[int64_t(row) * words + w] = src[int64_t(from) * words + w];
}

// dst (rows, vecs) float4 = sum over the valid slots of src (src_rows, vecs) at pos[row, j].
__global__ void __launch_bounds__(kThreads) sum_rows_kernel(const float4* __restrict__ src, int src_rows,
                                                            const int* __restrict__ pos, int slots, int64_t vecs,
                                                            float4* __restrict__ dst) {
  const int row = blockIdx.x;
  const int64_t v = int64_t(blockIdx.y) * kThreads + threadIdx.x;
  if (v >= vecs) return;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  bool any = false;
  for (int j = 0; j < slots; ++j) {
    const int p = pos[int64_t(row) * slots + j];
    if (p < 0 || p >= src_rows) continue;
    const float4 x = src[int64_t(p) * vecs + v];
    if (!any) {
      acc = x;  // the first term as is (0 + x would turn -0 into +0)
      any = true;
    } else {
      acc.x += x.x;
      acc.y += x.y;
      acc.z += x.z;
      acc.w += x.w;
    }
  }
  dst[int64_t(row) * vecs + v] = acc;
}

bool aligned(const void* p, uintptr_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

// Grid of one CTA row per output row and enough CTAs across for `words` (rows < 2^31 checked).
dim3 grid_of(int64_t rows, int64_t words) { return dim3(unsigned(rows), unsigned((words + kThreads - 1) / kThreads)); }

}  // namespace

Status gather_rows(const void* src, int64_t src_rows, const int* index, int64_t rows, int64_t row_bytes, void* dst,
                   void* stream) noexcept {
  if (src_rows < 0 || rows < 0 || row_bytes <= 0 || row_bytes % 4 || src_rows > kIndexLimit || rows > kIndexLimit ||
      row_bytes / 4 > kThreads * kMaxGridY) {
    return fail(Status::kInvalidShape,
                "gather_rows: need 0 <= rows, src_rows < 2^31 and row_bytes a positive multiple of 4 up to %lld (%lld, "
                "%lld, %lld)",
                (long long)(4 * kThreads * kMaxGridY), (long long)rows, (long long)src_rows, (long long)row_bytes);
  }
  if (rows == 0) return Status::kSuccess;
  if (!src || !index || !dst) return fail(Status::kNullPointer, "gather_rows: null pointer");
  if (!aligned(src, 4) || !aligned(dst, 4) || !aligned(index, 4)) {
    return fail(Status::kMisaligned, "gather_rows: src, index and dst must be 4-byte aligned");
  }
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (row_bytes % 16 == 0 && aligned(src, 16) && aligned(dst, 16)) {
    const int64_t words = row_bytes / 16;
    gather_rows_kernel<uint4><<<grid_of(rows, words), kThreads, 0, st>>>(
        static_cast<const uint4*>(src), int(src_rows), index, words, static_cast<uint4*>(dst));
  } else {
    const int64_t words = row_bytes / 4;
    gather_rows_kernel<uint32_t><<<grid_of(rows, words), kThreads, 0, st>>>(
        static_cast<const uint32_t*>(src), int(src_rows), index, words, static_cast<uint32_t*>(dst));
  }
  return check_launch("gather_rows");
}

Status sum_rows_fp32(const float* src, int64_t src_rows, const int* pos, int64_t rows, int64_t slots, int64_t cols,
                     float* dst, void* stream) noexcept {
  if (src_rows < 0 || rows < 0 || slots <= 0 || slots > kMaxSlots || cols <= 0 || cols % 4 ||
      src_rows > kIndexLimit || rows > kIndexLimit || rows * slots > kIndexLimit ||
      cols / 4 > kThreads * kMaxGridY) {
    return fail(Status::kInvalidShape,
                "sum_rows_fp32: need 0 <= rows, src_rows, rows x slots < 2^31, 1 <= slots <= %lld, cols a positive "
                "multiple of 4 up to %lld (%lld, %lld, %lld, %lld)",
                (long long)kMaxSlots, (long long)(4 * kThreads * kMaxGridY), (long long)rows, (long long)src_rows, (long long)slots, (long long)cols);
  }
  if (rows == 0) return Status::kSuccess;
  if (!pos || !dst || (src_rows > 0 && !src)) return fail(Status::kNullPointer, "sum_rows_fp32: null pointer");
  if (!aligned(src, 16) || !aligned(dst, 16) || !aligned(pos, 4)) {
    return fail(Status::kMisaligned, "sum_rows_fp32: src and dst must be 16-byte aligned, pos 4-byte");
  }
  const int64_t vecs = cols / 4;
  sum_rows_kernel<<<grid_of(rows, vecs), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const float4*>(src), int(src_rows), pos, int(slots), vecs, reinterpret_cast<float4*>(dst));
  return check_launch("sum_rows_fp32");
}

}  // namespace nvfp4moe
