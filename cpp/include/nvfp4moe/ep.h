// nvfp4moe: the row movers of expert parallelism (issue 24): what a token exchange needs around an
// expert shard's forward (pack rows for the peers, sum the partial rows that come back).
//
// Plain C++17 like nvfp4moe.h; device-side, no host synchronization, valid inside CUDA-graph
// capture. The runner in the Rust crate (`nvfp4_moe::ep`) calls them; any C++ dispatcher may.
#pragma once

#include <cstdint>

#include "nvfp4moe/export.h"
#include "nvfp4moe/types.h"

namespace nvfp4moe {

// dst[i, :] = src[index[i], :] for i < rows: rows of `row_bytes` bytes (a positive multiple of 4;
// 16-byte vectors when it is a multiple of 16 and both pointers are 16-byte aligned). An index
// outside [0, src_rows) copies nothing (its row of dst is left as it was): the index is on the
// device, so it is bounded there, not trusted.
// Errors: kInvalidShape (negative counts, row_bytes not a positive multiple of 4, rows or
// src_rows >= 2^31), kNullPointer, kMisaligned (a pointer not 4-byte aligned), kCudaError.
NVFP4MOE_API Status gather_rows(const void* src, int64_t src_rows, const int* index, int64_t rows, int64_t row_bytes,
                                void* dst, void* stream) noexcept;

// dst f32 [rows, cols]: dst[t, :] = sum over j < slots with 0 <= pos[t, j] < src_rows of
// src[pos[t, j], :], added in j order (a fixed order: the same inputs give the same bits), or
// zeros where no slot of t is valid. src f32 [src_rows, cols], pos i32 [rows, slots]. This is the
// combine of an exchange: slot j of token t is where peer j's partial sum for it arrived.
// Errors: kInvalidShape (cols not a positive multiple of 4, slots not in 1..=1024, counts >= 2^31),
// kNullPointer, kMisaligned (src or dst not 16-byte aligned), kCudaError.
NVFP4MOE_API Status sum_rows_fp32(const float* src, int64_t src_rows, const int* pos, int64_t rows, int64_t slots,
                                  int64_t cols, float* dst, void* stream) noexcept;

}  // namespace nvfp4moe
