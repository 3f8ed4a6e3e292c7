// Internal to the core (not the public API): the grouped dequantizer over the pre-dispatched
// (expert-major) layout, for moe_layer_forward_dispatched's NVFP4 intermediate.
#pragma once

#include "nvfp4moe/nvfp4moe.h"

#include <cstdint>

namespace nvfp4moe {

// out bf16 [experts x stride, cols]: row e x stride + r, for r < counts[e] (clamped to
// [0, stride]), = the NVFP4 row at the same position: codes [experts x stride, cols / 2], scales
// in the grouped 128x4 layout whose expert e region starts at floor((e x stride + 127 e) / 128) x
// 128, as the kSwigluNvfp4 epilogue writes them over GroupedGemmArgs::expert_stride. Rows past a
// count are not read or written. decode_scales: 1 or `experts` of them.
Status dequantize_nvfp4_dispatched(const void* codes, const void* scales, int64_t experts, int64_t stride,
                                   const int* counts, int64_t cols, const float* decode_scales,
                                   int64_t num_decode_scales, void* out, void* stream) noexcept;

}  // namespace nvfp4moe
