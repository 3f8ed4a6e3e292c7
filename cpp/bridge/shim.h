// The cxx bridge shim: the only C++ that knows about Rust. It forwards to the plain C++ core
// (nvfp4moe/nvfp4moe.h) and turns a non-success Status into an exception, which cxx hands to Rust
// as Err. The Rust side validates every argument before calling, so an exception here means a CUDA
// error or a disagreement between the two validations.
#pragma once

#include "rust/cxx.h"
#include <cstdint>

namespace nvfp4moe::bridge {

struct QuantizeParams;
struct DequantizeParams;
struct CoreBuildInfo;
struct PrepareWeightsParams;
struct GroupedGemmParams;
struct QuantizeGroupedParams;
struct PermuteParams;

void quantize_nvfp4(const QuantizeParams& p);
void dequantize_nvfp4(const DequantizeParams& p);
void prepare_nvfp4_weights(const PrepareWeightsParams& p);
void grouped_gemm_nvfp4(const GroupedGemmParams& p);
void quantize_nvfp4_grouped(const QuantizeGroupedParams& p);
void dequantize_nvfp4_grouped(const QuantizeGroupedParams& p);
void swiglu_bf16(uint64_t gate_up, int64_t rows, int64_t inter, uint64_t out, uint64_t stream);
void softmax_topk(uint64_t logits, int64_t tokens, int64_t experts, int64_t top_k, bool renormalize, uint64_t ids,
                  uint64_t weights, uint64_t stream);
void permute_and_gather(const PermuteParams& p);
void combine(uint64_t y, uint64_t row_of_pair, uint64_t weights, int64_t tokens, int64_t top_k, int64_t hidden_size,
             uint64_t out, uint64_t stream);
uint64_t core_permute_workspace_bytes(int64_t pairs, int64_t experts);
uint64_t core_grouped_scale_bytes(int64_t rows, int64_t experts, int64_t cols);
uint64_t core_prepared_weight_bytes(int64_t experts, int64_t n, int64_t k);
int32_t core_choose_gemm_tile(int64_t total_rows, int64_t experts);
CoreBuildInfo core_build_info();
uint64_t core_scale_bytes(uint32_t layout, int64_t rows, int64_t cols);

}  // namespace nvfp4moe::bridge
