#include "nvfp4-moe/cpp/bridge/shim.h"
#include "nvfp4-moe/src/ffi.rs.h"

#include "nvfp4moe/nvfp4moe.h"

#include <stdexcept>
#include <string>

namespace nvfp4moe::bridge {
namespace {

void throw_on_error(Status s) {
  if (s != Status::kSuccess) {
    std::string msg = status_string(s);
    msg += ": ";
    msg += last_error_message();
    throw std::runtime_error(msg);
  }
}

void* stream_ptr(uint64_t s) { return reinterpret_cast<void*>(static_cast<uintptr_t>(s)); }
const void* dptr(uint64_t p) { return reinterpret_cast<const void*>(static_cast<uintptr_t>(p)); }
void* dptr_mut(uint64_t p) { return reinterpret_cast<void*>(static_cast<uintptr_t>(p)); }

}  // namespace

void quantize_nvfp4(const QuantizeParams& p) {
  QuantizeNvfp4Args a;
  a.x = dptr(p.x);
  a.rows = p.rows;
  a.cols = p.cols;
  a.decode_scale = p.decode_scale;
  a.layout = static_cast<ScaleLayout>(p.layout);
  a.codes = dptr_mut(p.codes);
  a.scales = dptr_mut(p.scales);
  throw_on_error(nvfp4moe::quantize_nvfp4(a, stream_ptr(p.stream)));
}

void dequantize_nvfp4(const DequantizeParams& p) {
  DequantizeNvfp4Args a;
  a.codes = dptr(p.codes);
  a.scales = dptr(p.scales);
  a.rows = p.rows;
  a.cols = p.cols;
  a.decode_scale = p.decode_scale;
  a.layout = static_cast<ScaleLayout>(p.layout);
  a.out = dptr_mut(p.out);
  throw_on_error(nvfp4moe::dequantize_nvfp4(a, stream_ptr(p.stream)));
}

void prepare_nvfp4_weights(const PrepareWeightsParams& p) {
  PrepareWeightsArgs a;
  a.codes = dptr(p.codes);
  a.scales = dptr(p.scales);
  a.experts = p.experts;
  a.n = p.n;
  a.k = p.k;
  a.row_order = static_cast<RowOrder>(p.row_order);
  a.prepared = dptr_mut(p.prepared);
  a.error = static_cast<int*>(dptr_mut(p.error));
  throw_on_error(nvfp4moe::prepare_nvfp4_weights(a, stream_ptr(p.stream)));
}

void grouped_gemm_nvfp4(const GroupedGemmParams& p) {
  GroupedGemmArgs a;
  a.prepared = dptr(p.prepared);
  a.decode_scale = static_cast<const float*>(dptr(p.decode_scale));
  a.experts = p.experts;
  a.n = p.n;
  a.k = p.k;
  a.x = dptr(p.x);
  a.total_rows = p.total_rows;
  a.expert_offsets = static_cast<const int*>(dptr(p.expert_offsets));
  a.out = dptr_mut(p.out);
  a.out_scales = dptr_mut(p.out_scales);
  a.act_decode_scales = static_cast<const float*>(dptr(p.act_decode_scales));
  a.num_act_decode_scales = p.num_act_decode_scales;
  a.tile = static_cast<GemmTile>(p.tile);
  a.epilogue = static_cast<GemmEpilogue>(p.epilogue);
  throw_on_error(nvfp4moe::grouped_gemm_nvfp4(a, stream_ptr(p.stream)));
}

// The same parameter struct as quantize_nvfp4_grouped: x is the bf16 output here.
void dequantize_nvfp4_grouped(const QuantizeGroupedParams& p) {
  DequantizeGroupedArgs a;
  a.codes = dptr(p.codes);
  a.scales = dptr(p.scales);
  a.rows = p.rows;
  a.cols = p.cols;
  a.expert_offsets = static_cast<const int*>(dptr(p.expert_offsets));
  a.experts = p.experts;
  a.decode_scales = static_cast<const float*>(dptr(p.decode_scales));
  a.num_decode_scales = p.num_decode_scales;
  a.out = dptr_mut(p.x);
  throw_on_error(nvfp4moe::dequantize_nvfp4_grouped(a, stream_ptr(p.stream)));
}

void quantize_nvfp4_grouped(const QuantizeGroupedParams& p) {
  QuantizeGroupedArgs a;
  a.x = dptr(p.x);
  a.source = static_cast<GroupedSource>(p.source);
  a.rows = p.rows;
  a.cols = p.cols;
  a.expert_offsets = static_cast<const int*>(dptr(p.expert_offsets));
  a.experts = p.experts;
  a.decode_scales = static_cast<const float*>(dptr(p.decode_scales));
  a.num_decode_scales = p.num_decode_scales;
  a.codes = dptr_mut(p.codes);
  a.scales = dptr_mut(p.scales);
  throw_on_error(nvfp4moe::quantize_nvfp4_grouped(a, stream_ptr(p.stream)));
}

void swiglu_bf16(uint64_t gate_up, int64_t rows, int64_t inter, uint64_t out, uint64_t stream) {
  throw_on_error(nvfp4moe::swiglu_bf16(dptr(gate_up), rows, inter, dptr_mut(out), stream_ptr(stream)));
}

void softmax_topk(uint64_t logits, int64_t tokens, int64_t experts, int64_t top_k, bool renormalize, uint64_t ids,
                  uint64_t weights, uint64_t stream) {
  throw_on_error(nvfp4moe::softmax_topk(static_cast<const float*>(dptr(logits)), tokens, experts, top_k, renormalize,
                                        static_cast<int*>(dptr_mut(ids)), static_cast<float*>(dptr_mut(weights)),
                                        stream_ptr(stream)));
}

void permute_and_gather(const PermuteParams& p) {
  PermuteArgs a;
  a.topk_ids = static_cast<const int*>(dptr(p.topk_ids));
  a.tokens = p.tokens;
  a.top_k = p.top_k;
  a.experts = p.experts;
  a.hidden = dptr(p.hidden);
  a.hidden_size = p.hidden_size;
  a.expert_offsets = static_cast<int*>(dptr_mut(p.expert_offsets));
  a.row_of_pair = static_cast<int*>(dptr_mut(p.row_of_pair));
  a.pair_of_row = static_cast<int*>(dptr_mut(p.pair_of_row));
  a.x_perm = dptr_mut(p.x_perm);
  a.error = static_cast<unsigned long long*>(dptr_mut(p.error));
  a.workspace = dptr_mut(p.workspace);
  throw_on_error(nvfp4moe::permute_and_gather(a, stream_ptr(p.stream)));
}

void combine(uint64_t y, uint64_t row_of_pair, uint64_t weights, int64_t tokens, int64_t top_k, int64_t hidden_size,
             uint64_t out, uint64_t stream) {
  throw_on_error(nvfp4moe::combine(dptr(y), static_cast<const int*>(dptr(row_of_pair)),
                                   static_cast<const float*>(dptr(weights)), tokens, top_k, hidden_size, dptr_mut(out),
                                   stream_ptr(stream)));
}

uint64_t core_permute_workspace_bytes(int64_t pairs, int64_t experts) { return permute_workspace_bytes(pairs, experts); }

uint64_t core_grouped_scale_bytes(int64_t rows, int64_t experts, int64_t cols) {
  return grouped_scale_bytes(rows, experts, cols);
}

uint64_t core_prepared_weight_bytes(int64_t experts, int64_t n, int64_t k) {
  return prepared_weight_bytes(experts, n, k);
}

int32_t core_choose_gemm_tile(int64_t total_rows, int64_t experts) {
  return static_cast<int32_t>(choose_gemm_tile(total_rows, experts));
}

CoreBuildInfo core_build_info() {
  BuildInfo b = build_info();
  CoreBuildInfo out;
  out.cuda_version = b.cuda_version;
  out.cuda_archs = rust::String(b.cuda_archs);
  out.cutlass_major = b.cutlass_major;
  out.cutlass_minor = b.cutlass_minor;
  out.cutlass_patch = b.cutlass_patch;
  out.runtime_version = runtime_version();
  out.driver_version = driver_version();
  return out;
}

uint64_t core_scale_bytes(uint32_t layout, int64_t rows, int64_t cols) {
  return scale_bytes(static_cast<ScaleLayout>(layout), rows, cols);
}

}  // namespace nvfp4moe::bridge
