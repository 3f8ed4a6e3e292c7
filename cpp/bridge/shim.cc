#include "nvfp4-moe/cpp/bridge/shim.h"
#include "nvfp4-moe/src/ffi.rs.h"

namespace nvfp4moe::bridge {
namespace {

void* stream_ptr(uint64_t s) { return reinterpret_cast<void*>(static_cast<uintptr_t>(s)); }
const void* dptr(uint64_t p) { return reinterpret_cast<const void*>(static_cast<uintptr_t>(p)); }
void* dptr_mut(uint64_t p) { return reinterpret_cast<void*>(static_cast<uintptr_t>(p)); }
int32_t raw(Status s) { return static_cast<int32_t>(s); }

}  // namespace

int32_t quantize_nvfp4(const QuantizeNvfp4Args& a, uint64_t s) {
  return raw(::nvfp4moe::quantize_nvfp4(a, stream_ptr(s)));
}
int32_t dequantize_nvfp4(const DequantizeNvfp4Args& a, uint64_t s) {
  return raw(::nvfp4moe::dequantize_nvfp4(a, stream_ptr(s)));
}
int32_t quantize_nvfp4_grouped(const QuantizeGroupedArgs& a, uint64_t s) {
  return raw(::nvfp4moe::quantize_nvfp4_grouped(a, stream_ptr(s)));
}
int32_t dequantize_nvfp4_grouped(const DequantizeGroupedArgs& a, uint64_t s) {
  return raw(::nvfp4moe::dequantize_nvfp4_grouped(a, stream_ptr(s)));
}
int32_t prepare_moe_weights(const PrepareWeightsArgs& a, rust::Slice<const float> decode_scales,
                            rust::Slice<const float> up_decode_scales, uint64_t pairs, uint64_t s) {
  // The core reads E values from each (the Rust side checked the lengths); empty: no up rows.
  return raw(::nvfp4moe::prepare_moe_weights(a, decode_scales.data(),
                                             up_decode_scales.empty() ? nullptr : up_decode_scales.data(),
                                             static_cast<float*>(dptr_mut(pairs)), stream_ptr(s)));
}
int32_t grouped_gemm_nvfp4(const GroupedGemmArgs& a, uint64_t s) {
  return raw(::nvfp4moe::grouped_gemm_nvfp4(a, stream_ptr(s)));
}
int32_t permute_and_gather(const PermuteArgs& a, uint64_t s) {
  return raw(::nvfp4moe::permute_and_gather(a, stream_ptr(s)));
}

int32_t swiglu_bf16(uint64_t gate_up, int64_t rows, int64_t inter, uint64_t out, uint64_t stream) {
  return raw(::nvfp4moe::swiglu_bf16(dptr(gate_up), rows, inter, dptr_mut(out), stream_ptr(stream)));
}

int32_t softmax_topk(uint64_t logits, int64_t tokens, int64_t experts, int64_t top_k, bool renormalize, uint64_t ids,
                     uint64_t weights, uint64_t stream) {
  return raw(::nvfp4moe::softmax_topk(static_cast<const float*>(dptr(logits)), tokens, experts, top_k, renormalize,
                                      static_cast<int*>(dptr_mut(ids)), static_cast<float*>(dptr_mut(weights)),
                                      stream_ptr(stream)));
}

int32_t combine(uint64_t y, uint64_t row_of_pair, uint64_t weights, int64_t tokens, int64_t top_k, int64_t hidden_size,
                uint64_t out, uint64_t stream) {
  return raw(::nvfp4moe::combine(dptr(y), static_cast<const int*>(dptr(row_of_pair)),
                                 static_cast<const float*>(dptr(weights)), tokens, top_k, hidden_size, dptr_mut(out),
                                 stream_ptr(stream)));
}

int32_t gather_rows(uint64_t src, int64_t src_rows, uint64_t index, int64_t rows, int64_t row_bytes, uint64_t dst,
                    uint64_t stream) {
  return raw(::nvfp4moe::gather_rows(dptr(src), src_rows, static_cast<const int*>(dptr(index)), rows, row_bytes,
                                     dptr_mut(dst), stream_ptr(stream)));
}

int32_t sum_rows_fp32(uint64_t src, int64_t src_rows, uint64_t pos, int64_t rows, int64_t slots, int64_t cols,
                      uint64_t dst, uint64_t stream) {
  return raw(::nvfp4moe::sum_rows_fp32(static_cast<const float*>(dptr(src)), src_rows,
                                       static_cast<const int*>(dptr(pos)), rows, slots, cols,
                                       static_cast<float*>(dptr_mut(dst)), stream_ptr(stream)));
}

int32_t moe_layer_initialize(const MoeLayerDesc& d, uint64_t workspace, int64_t workspace_bytes, uint64_t stream) {
  return raw(::nvfp4moe::moe_layer_initialize(d, dptr_mut(workspace), workspace_bytes, stream_ptr(stream)));
}
int32_t moe_layer_forward(const MoeLayerDesc& d, const MoeForwardArgs& a, uint64_t stream) {
  return raw(::nvfp4moe::moe_layer_forward(d, a, stream_ptr(stream)));
}

int32_t moe_layer_forward_dispatched(const MoeLayerDesc& d, const MoeDispatchedArgs& a, uint64_t stream) {
  return raw(::nvfp4moe::moe_layer_forward_dispatched(d, a, stream_ptr(stream)));
}
int32_t moe_layer_first_gemm(const MoeLayerDesc& d, const MoeForwardArgs& a, uint64_t act_out, uint64_t stream) {
  return raw(::nvfp4moe::moe_layer_first_gemm(d, a, dptr_mut(act_out), stream_ptr(stream)));
}
int32_t moe_layer_read_error(const MoeLayerDesc& d, uint64_t workspace, int64_t workspace_bytes, uint64_t stream,
                             uint64_t& word) {
  unsigned long long w = 0;
  const Status s = ::nvfp4moe::moe_layer_read_error(d, dptr_mut(workspace), workspace_bytes, stream_ptr(stream), &w);
  word = w;
  return raw(s);
}
int32_t moe_layer_can_implement(const MoeLayerDesc& d) { return raw(::nvfp4moe::moe_layer_can_implement(d)); }
uint64_t core_moe_layer_workspace_bytes(const MoeLayerDesc& d) { return ::nvfp4moe::moe_layer_workspace_bytes(d); }

int32_t quantize_nvfp4_can_implement(const QuantizeNvfp4Args& a) {
  return raw(::nvfp4moe::quantize_nvfp4_can_implement(a));
}
int32_t dequantize_nvfp4_can_implement(const DequantizeNvfp4Args& a) {
  return raw(::nvfp4moe::dequantize_nvfp4_can_implement(a));
}
int32_t quantize_nvfp4_grouped_can_implement(const QuantizeGroupedArgs& a) {
  return raw(::nvfp4moe::quantize_nvfp4_grouped_can_implement(a));
}
int32_t dequantize_nvfp4_grouped_can_implement(const DequantizeGroupedArgs& a) {
  return raw(::nvfp4moe::dequantize_nvfp4_grouped_can_implement(a));
}
int32_t permute_and_gather_can_implement(const PermuteArgs& a) {
  return raw(::nvfp4moe::permute_and_gather_can_implement(a));
}
int32_t prepare_nvfp4_weights_can_implement(const PrepareWeightsArgs& a) {
  return raw(::nvfp4moe::prepare_nvfp4_weights_can_implement(a));
}
int32_t grouped_gemm_nvfp4_can_implement(const GroupedGemmArgs& a) {
  return raw(::nvfp4moe::grouped_gemm_nvfp4_can_implement(a));
}

rust::String last_error_message() { return rust::String(::nvfp4moe::last_error_message()); }

uint64_t core_permute_workspace_bytes(int64_t pairs, int64_t experts) {
  return ::nvfp4moe::permute_workspace_bytes(pairs, experts);
}
uint64_t core_grouped_scale_bytes(int64_t rows, int64_t experts, int64_t cols) {
  return ::nvfp4moe::grouped_scale_bytes(rows, experts, cols);
}
uint64_t core_prepared_weight_bytes(int64_t experts, int64_t n, int64_t k) {
  return ::nvfp4moe::prepared_weight_bytes(experts, n, k);
}
int32_t core_choose_gemm_tile(int64_t total_rows, int64_t experts) {
  return static_cast<int32_t>(::nvfp4moe::choose_gemm_tile(total_rows, experts));
}
int32_t core_launch_gemm_tile(const GroupedGemmArgs& a, int32_t sms) {
  return static_cast<int32_t>(::nvfp4moe::launch_gemm_tile(a, sms));
}
uint64_t core_scale_bytes(int32_t layout, int64_t rows, int64_t cols) {
  return ::nvfp4moe::scale_bytes(static_cast<ScaleLayout>(layout), rows, cols);
}

CoreBuildInfo core_build_info() {
  BuildInfo b = build_info();
  CoreBuildInfo out;
  out.cuda_version = b.cuda_version;
  out.cuda_archs = rust::String(b.cuda_archs);
  out.cutlass_major = b.cutlass_major;
  out.cutlass_minor = b.cutlass_minor;
  out.cutlass_patch = b.cutlass_patch;
  out.runtime_version = ::nvfp4moe::runtime_version();
  out.driver_version = ::nvfp4moe::driver_version();
  return out;
}

}  // namespace nvfp4moe::bridge
