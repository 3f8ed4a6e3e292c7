// The cxx bridge shim: the only C++ that knows about Rust. It forwards to the plain C++ core
// (nvfp4moe/nvfp4moe.h). The argument structs are the core's own (nvfp4moe/types.h, which the Rust
// side is generated from), so nothing is converted field by field; statuses cross as int32_t and
// the Rust side turns them into typed errors. The Rust side validates every argument before
// calling, so a non-success status here means a CUDA error or a shape only the core rejects.
#pragma once

#include "nvfp4moe/ep.h"
#include "nvfp4moe/nvfp4moe.h"
#include "rust/cxx.h"

#include <cstdint>

namespace nvfp4moe::bridge {

struct CoreBuildInfo;

int32_t quantize_nvfp4(const QuantizeNvfp4Args& a, uint64_t stream);
int32_t dequantize_nvfp4(const DequantizeNvfp4Args& a, uint64_t stream);
int32_t quantize_nvfp4_grouped(const QuantizeGroupedArgs& a, uint64_t stream);
int32_t dequantize_nvfp4_grouped(const DequantizeGroupedArgs& a, uint64_t stream);
int32_t prepare_moe_weights(const PrepareWeightsArgs& a, rust::Slice<const float> decode_scales,
                            rust::Slice<const float> up_decode_scales, uint64_t pairs, uint64_t stream);
int32_t grouped_gemm_nvfp4(const GroupedGemmArgs& a, uint64_t stream);
int32_t permute_and_gather(const PermuteArgs& a, uint64_t stream);
int32_t swiglu_bf16(uint64_t gate_up, int64_t rows, int64_t inter, uint64_t out, uint64_t stream);
int32_t softmax_topk(uint64_t logits, int64_t tokens, int64_t experts, int64_t top_k, bool renormalize, uint64_t ids,
                     uint64_t weights, uint64_t stream);
int32_t combine(uint64_t y, uint64_t row_of_pair, uint64_t weights, int64_t tokens, int64_t top_k, int64_t hidden_size,
                uint64_t out, uint64_t stream);
int32_t gather_rows(uint64_t src, int64_t src_rows, uint64_t index, int64_t rows, int64_t row_bytes, uint64_t dst,
                    uint64_t stream);
int32_t sum_rows_fp32(uint64_t src, int64_t src_rows, uint64_t pos, int64_t rows, int64_t slots, int64_t cols,
                      uint64_t dst, uint64_t stream);

int32_t moe_layer_initialize(const MoeLayerDesc& d, uint64_t workspace, int64_t workspace_bytes, uint64_t stream);
int32_t moe_layer_forward(const MoeLayerDesc& d, const MoeForwardArgs& a, uint64_t stream);
int32_t moe_layer_forward_dispatched(const MoeLayerDesc& d, const MoeDispatchedArgs& a, uint64_t stream);
int32_t moe_layer_first_gemm(const MoeLayerDesc& d, const MoeForwardArgs& a, uint64_t act_out, uint64_t stream);
int32_t moe_layer_read_error(const MoeLayerDesc& d, uint64_t workspace, int64_t workspace_bytes, uint64_t stream,
                             uint64_t& word);
int32_t moe_layer_can_implement(const MoeLayerDesc& d);
uint64_t core_moe_layer_workspace_bytes(const MoeLayerDesc& d);

int32_t quantize_nvfp4_can_implement(const QuantizeNvfp4Args& a);
int32_t dequantize_nvfp4_can_implement(const DequantizeNvfp4Args& a);
int32_t quantize_nvfp4_grouped_can_implement(const QuantizeGroupedArgs& a);
int32_t dequantize_nvfp4_grouped_can_implement(const DequantizeGroupedArgs& a);
int32_t permute_and_gather_can_implement(const PermuteArgs& a);
int32_t prepare_nvfp4_weights_can_implement(const PrepareWeightsArgs& a);
int32_t grouped_gemm_nvfp4_can_implement(const GroupedGemmArgs& a);
rust::String last_error_message();

uint64_t core_permute_workspace_bytes(int64_t pairs, int64_t experts);
uint64_t core_grouped_scale_bytes(int64_t rows, int64_t experts, int64_t cols);
uint64_t core_prepared_weight_bytes(int64_t experts, int64_t n, int64_t k);
int32_t core_choose_gemm_tile(int64_t total_rows, int64_t experts);
int32_t core_launch_gemm_tile(const GroupedGemmArgs& a, int32_t sms);
uint64_t core_scale_bytes(int32_t layout, int64_t rows, int64_t cols);
CoreBuildInfo core_build_info();

}  // namespace nvfp4moe::bridge
