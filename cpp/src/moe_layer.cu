// The MoE feed-forward layer (nvfp4moe.h, "The MoE feed-forward layer"): the workspace's layout and
// the forward's launches, composed from the core's entry points (softmax_topk,
// permute_and_gather, grouped_gemm_nvfp4, dequantize_nvfp4_grouped, combine). Host code only,
// plus one tiny kernel that sets a workspace up.
#include "nvfp4moe/nvfp4moe.h"
#include "grouped_gemm_warp.hpp"
#include "grouped_quantize.hpp"
#include "routing_limits.hpp"
#include "status.hpp"

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace nvfp4moe {
namespace {

constexpr int64_t kRegionAlign = 256;
constexpr unsigned long long kNoBadId = ~0ull;

int64_t align_up(int64_t v) { return (v + kRegionAlign - 1) / kRegionAlign * kRegionAlign; }

// Where each buffer of a forward lives in the workspace (byte offsets), for max_tokens x max_top_k
// pairs. Every region starts 256 bytes apart from the base (which must be 16-byte aligned, what
// the kernels' vector accesses and TMA need; cudaMalloc's 256 is better).
struct Layout {
  int64_t error, act_scale, expert_offsets, row_of_pair, pair_of_row, ids, weights, permute, x_perm, act, y,
      codes, scales, bytes;
};

// desc must have passed moe_layer_can_implement (so no product below overflows: each region is
// bounded by the checks of the launch that uses it).
Layout layout_of(const MoeLayerDesc& d) {
  const int64_t pairs = d.max_tokens * d.max_top_k;
  const int64_t rows = pairs > 0 ? pairs : 1;
  Layout l{};
  int64_t at = 0;
  auto take = [&](int64_t bytes) {
    const int64_t here = at;
    at += align_up(bytes > 0 ? bytes : 1);
    return here;
  };
  l.error = take(sizeof(unsigned long long));
  l.act_scale = take(sizeof(float));
  l.expert_offsets = take((d.experts + 1) * 4);
  l.row_of_pair = take(rows * 4);
  l.pair_of_row = take(rows * 4);
  l.ids = take(rows * 4);
  l.weights = take(rows * 4);
  l.permute = take(int64_t(permute_workspace_bytes(rows, d.experts)));
  l.x_perm = take(rows * d.hidden * 2);
  l.act = take(rows * d.intermediate * 2);
  l.y = take(rows * d.hidden * 2);
  const bool nvfp4 = d.intermediate_format == IntermediateFormat::kNvfp4;
  l.codes = nvfp4 ? take(rows * d.intermediate / 2) : 0;
  l.scales = nvfp4 ? take(int64_t(grouped_scale_bytes(rows, d.experts, d.intermediate))) : 0;
  l.bytes = at;
  return l;
}

// The experts the routing ids and router logits count: the whole layer's for an expert shard.
int64_t global_experts(const MoeLayerDesc& d) { return d.expert_map ? d.global_experts : d.experts; }

template <class T>
T* at(void* ws, int64_t offset) {
  return reinterpret_cast<T*>(static_cast<char*>(ws) + offset);
}

// The first GEMM's arguments (epilogue kSwigluBf16 into `act`; the caller switches to NVFP4).
GroupedGemmArgs first_gemm_args(const MoeLayerDesc& d, const void* x_perm, int64_t pairs, const int* offsets,
                                void* act) {
  GroupedGemmArgs g;
  g.prepared = d.w13_prepared;
  g.decode_scale = d.w13_decode_scales;
  g.experts = d.experts;
  g.n = 2 * d.intermediate;
  g.k = d.hidden;
  g.x = x_perm;
  g.total_rows = pairs;
  g.expert_offsets = offsets;
  g.out = act;
  g.tile = d.tile;
  g.epilogue = GemmEpilogue::kSwigluBf16;
  g.max_splits = d.batch_invariant ? 1 : 0;
  // A shard's experts get the whole layer's tiles and K splits (the same bits as in the whole layer).
  g.schedule_experts = global_experts(d);
  return g;
}

__global__ void initialize_kernel(unsigned long long* error, float* act_scale, float g) {
  *error = kNoBadId;
  *act_scale = g;
}

bool aligned(const void* p, uintptr_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

Status check_workspace(const Layout& l, const void* ws, int64_t bytes, const char* what) {
  const int64_t need = l.bytes;
  if (!ws) return fail(Status::kNullPointer, "%s: null workspace", what);
  if (!aligned(ws, 16)) return fail(Status::kMisaligned, "%s: the workspace must be 16-byte aligned", what);
  if (bytes < need) {
    return fail(Status::kInvalidShape, "%s: the workspace has %lld bytes, this layer needs %lld (moe_layer_workspace_bytes)",
                what, static_cast<long long>(bytes), static_cast<long long>(need));
  }
  return Status::kSuccess;
}

// Both GEMMs' own rules (pointers are not looked at) for a launch of `pairs` rows: the first with
// the layer's intermediate epilogue (`whole`) or kSwigluBf16 (moe_layer_first_gemm), the second
// plain.
Status check_gemms(const MoeLayerDesc& d, int64_t pairs, bool whole) {
  GroupedGemmArgs l1 = first_gemm_args(d, nullptr, pairs, nullptr, nullptr);
  if (whole && d.intermediate_format == IntermediateFormat::kNvfp4) {
    l1.epilogue = GemmEpilogue::kSwigluNvfp4;
    l1.num_act_decode_scales = 1;
  }
  if (Status s = grouped_gemm_nvfp4_can_implement(l1); s != Status::kSuccess) return s;
  if (!whole) return Status::kSuccess;
  GroupedGemmArgs l2 = first_gemm_args(d, nullptr, pairs, nullptr, nullptr);
  l2.prepared = d.w2_prepared;
  l2.decode_scale = d.w2_decode_scales;
  l2.n = d.hidden;
  l2.k = d.intermediate;
  l2.epilogue = GemmEpilogue::kPlain;
  return grouped_gemm_nvfp4_can_implement(l2);
}

// A forward's checks (after the descriptor's), all before anything is enqueued: counts against
// the descriptor, both GEMMs at this forward's rows, the weights' pointers, the pointers a forward
// of `tokens` reads and writes (`whole`: a whole forward, which reads topk_weights and W2 and
// writes out; the first GEMM alone needs none of them) and their alignment, the workspace.
Status check_forward(const MoeLayerDesc& d, const Layout& l, const MoeForwardArgs& a, bool whole, const char* what) {
  const bool needs_out = whole;
  if (a.tokens < 0 || a.tokens > d.max_tokens) {
    return fail(Status::kInvalidShape, "%s: %lld tokens, this layer takes 0..=%lld", what,
                static_cast<long long>(a.tokens), static_cast<long long>(d.max_tokens));
  }
  if (a.top_k < 1 || a.top_k > d.max_top_k) {
    return fail(Status::kInvalidShape, "%s: top_k %lld, this layer takes 1..=%lld", what, static_cast<long long>(a.top_k),
                static_cast<long long>(d.max_top_k));
  }
  if (Status s = check_workspace(l, a.workspace, a.workspace_bytes, what); s != Status::kSuccess) return s;
  if (a.tokens == 0) return Status::kSuccess;
  if (Status s = check_gemms(d, a.tokens * a.top_k, whole); s != Status::kSuccess) return s;
  if (!d.w13_prepared || !d.w13_decode_scales || (whole && (!d.w2_prepared || !d.w2_decode_scales))) {
    return fail(Status::kNullPointer, "%s: the descriptor's weight pointers are null", what);
  }
  if (!aligned(d.w13_prepared, 16) || !aligned(d.w2_prepared, 16) || !aligned(d.w13_decode_scales, 4) ||
      !aligned(d.w2_decode_scales, 4)) {
    return fail(Status::kMisaligned, "%s: prepared weights must be 16-byte aligned, decode scales 4-byte", what);
  }
  if (!a.hidden || (needs_out && !a.out)) return fail(Status::kNullPointer, "%s: null hidden or out", what);
  if (a.topk_ids ? whole && !a.topk_weights : !a.router_logits) {
    return fail(Status::kNullPointer, "%s: topk_ids needs topk_weights; without topk_ids, router_logits", what);
  }
  if (!aligned(a.hidden, 16) || (needs_out && !aligned(a.out, 16))) {
    return fail(Status::kMisaligned, "%s: hidden and out must be 16-byte aligned", what);
  }
  if (!aligned(a.topk_ids, 4) || !aligned(a.topk_weights, 4) || !aligned(a.router_logits, 4) ||
      !aligned(d.expert_map, 4)) {
    return fail(Status::kMisaligned, "%s: topk_ids, topk_weights, router_logits and expert_map must be 4-byte aligned",
                what);
  }
  return Status::kSuccess;
}

// Routing (the caller's top-k, or softmax top-k into the workspace) and the permutation, then the
// first GEMM with `l1`'s epilogue and output. Returns the routing weights used in *weights.
Status route_permute_first(const MoeLayerDesc& d, const MoeForwardArgs& a, const Layout& l, GroupedGemmArgs& l1,
                           const float** weights, cudaStream_t st) {
  void* ws = a.workspace;
  const int* ids = a.topk_ids;
  *weights = a.topk_weights;
  if (!ids) {
    int* ids_ws = at<int>(ws, l.ids);
    float* weights_ws = at<float>(ws, l.weights);
    Status s = softmax_topk(a.router_logits, a.tokens, global_experts(d), a.top_k, a.renormalize != 0, ids_ws,
                            weights_ws, st);
    if (s != Status::kSuccess) return s;
    ids = ids_ws;
    *weights = weights_ws;
  }
  PermuteArgs p;
  p.topk_ids = ids;
  p.tokens = a.tokens;
  p.top_k = a.top_k;
  p.experts = d.experts;
  p.hidden = a.hidden;
  p.hidden_size = d.hidden;
  p.expert_offsets = at<int>(ws, l.expert_offsets);
  p.row_of_pair = at<int>(ws, l.row_of_pair);
  p.pair_of_row = at<int>(ws, l.pair_of_row);
  p.x_perm = at<void>(ws, l.x_perm);
  p.error = at<unsigned long long>(ws, l.error);
  p.workspace = at<void>(ws, l.permute);
  p.expert_map = d.expert_map;
  p.global_experts = d.expert_map ? d.global_experts : 0;
  if (Status s = permute_and_gather(p, st); s != Status::kSuccess) return s;
  return grouped_gemm_nvfp4(l1, st);
}

}  // namespace

Status moe_layer_can_implement(const MoeLayerDesc& d) noexcept {
  constexpr const char* what = "moe_layer";
  if (d.experts < 1 || d.experts > kExpertLimit) {
    return fail(Status::kInvalidShape, "%s: %lld experts (1..=%lld)", what, static_cast<long long>(d.experts),
                static_cast<long long>(kExpertLimit));
  }
  if (d.expert_map ? d.global_experts < d.experts || d.global_experts > kExpertLimit
                   : d.global_experts != 0 && d.global_experts != d.experts) {
    return fail(Status::kInvalidShape, "%s: global_experts %lld: with an expert map it must be in [experts (%lld), "
                "%lld], without one 0 or experts", what, static_cast<long long>(d.global_experts),
                static_cast<long long>(d.experts), static_cast<long long>(kExpertLimit));
  }
  if (d.output_format != OutputFormat::kBf16 && d.output_format != OutputFormat::kFp32) {
    return fail(Status::kUnsupportedLayout, "%s: unknown output format %d", what, int(d.output_format));
  }
  // Top-k picks among the global experts (an expert shard's forward takes the whole layer's routing).
  const int64_t top_k_limit = global_experts(d) < kTopKLimit ? global_experts(d) : kTopKLimit;
  if (d.max_top_k < 1 || d.max_top_k > top_k_limit) {
    return fail(Status::kInvalidShape, "%s: max_top_k %lld must be in 1..=min(global experts, %lld)", what,
                static_cast<long long>(d.max_top_k), static_cast<long long>(kTopKLimit));
  }
  if (d.max_tokens < 0 || d.max_tokens > (int64_t(1) << 31) / d.max_top_k ||
      d.max_tokens * d.max_top_k > int64_t(0x7FFFFFFF)) {
    return fail(Status::kInvalidShape, "%s: max_tokens %lld x max_top_k %lld must be below 2^31", what,
                static_cast<long long>(d.max_tokens), static_cast<long long>(d.max_top_k));
  }
  if (d.hidden <= 0 || d.intermediate <= 0 || d.hidden % 64 || d.intermediate % 64) {
    return fail(Status::kInvalidShape, "%s: hidden (%lld) and intermediate (%lld) must be positive multiples of 64", what,
                static_cast<long long>(d.hidden), static_cast<long long>(d.intermediate));
  }
  const bool nvfp4 = d.intermediate_format == IntermediateFormat::kNvfp4;
  if (!nvfp4 && d.intermediate_format != IntermediateFormat::kBf16) {
    return fail(Status::kUnsupportedLayout, "%s: unknown intermediate format %d", what, int(d.intermediate_format));
  }
  if (nvfp4) {
    const float g = d.intermediate_decode_scale;
    if (!(std::isfinite(g) && g > 0.0f)) {
      return fail(Status::kInvalidDecodeScale, "%s: the NVFP4 intermediate's decode scale %g must be finite and > 0", what,
                  double(g));
    }
    if (d.tile == GemmTile::kWarpM16N8) {
      return fail(Status::kInvalidShape, "%s: tile kWarpM16N8 has no kSwigluNvfp4 epilogue: the NVFP4 intermediate needs another tile",
                  what);
    }
  }
  // The launches' own rules at the largest forward (each refuses what it cannot run). A forced
  // kWarpM16N8 tile takes at most 8 rows: it is checked at that many here (a layer of more may
  // still run forwards of up to 8), and every forward checks its own rows.
  const int64_t pairs = d.max_tokens * d.max_top_k;
  PermuteArgs p;
  p.tokens = d.max_tokens;
  p.top_k = d.max_top_k;
  p.experts = d.experts;
  p.hidden_size = d.hidden;
  p.expert_map = d.expert_map;
  p.global_experts = d.expert_map ? d.global_experts : 0;
  if (Status s = permute_and_gather_can_implement(p); s != Status::kSuccess) return s;
  constexpr int64_t kWarpRows = gemm::warp::kMaxRows;
  const int64_t gemm_rows = d.tile == GemmTile::kWarpM16N8 && pairs > kWarpRows ? kWarpRows : pairs;
  if (Status s = check_gemms(d, gemm_rows, true); s != Status::kSuccess) return s;
  if (nvfp4) {
    DequantizeGroupedArgs dq;
    dq.rows = pairs;
    dq.cols = d.intermediate;
    dq.experts = d.experts;
    dq.num_decode_scales = 1;
    if (Status s = dequantize_nvfp4_grouped_can_implement(dq); s != Status::kSuccess) return s;
  }
  return Status::kSuccess;
}

size_t moe_layer_workspace_bytes(const MoeLayerDesc& d) noexcept {
  if (moe_layer_can_implement(d) != Status::kSuccess) return 0;
  return size_t(layout_of(d).bytes);
}

Status moe_layer_initialize(const MoeLayerDesc& d, void* workspace, int64_t workspace_bytes, void* stream) noexcept {
  if (Status s = moe_layer_can_implement(d); s != Status::kSuccess) return s;
  const Layout l = layout_of(d);
  if (Status s = check_workspace(l, workspace, workspace_bytes, "moe_layer_initialize"); s != Status::kSuccess) {
    return s;
  }
  // The one-launch permutation's capacity, asked now rather than in a forward under capture.
  (void)routing::route_fused_capacity();
  initialize_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(
      at<unsigned long long>(workspace, l.error), at<float>(workspace, l.act_scale), d.intermediate_decode_scale);
  return check_launch("moe_layer_initialize");
}

Status moe_layer_forward(const MoeLayerDesc& d, const MoeForwardArgs& a, void* stream) noexcept {
  if (Status s = moe_layer_can_implement(d); s != Status::kSuccess) return s;
  const Layout l = layout_of(d);
  if (Status s = check_forward(d, l, a, true, "moe_layer_forward"); s != Status::kSuccess) return s;
  if (a.tokens == 0) return Status::kSuccess;
  const auto st = static_cast<cudaStream_t>(stream);
  void* ws = a.workspace;
  const int64_t pairs = a.tokens * a.top_k;
  const int* offsets = at<int>(ws, l.expert_offsets);
  void* act = at<void>(ws, l.act);
  GroupedGemmArgs l1 = first_gemm_args(d, at<void>(ws, l.x_perm), pairs, offsets, act);
  const bool nvfp4 = d.intermediate_format == IntermediateFormat::kNvfp4;
  const float* act_scale = at<float>(ws, l.act_scale);
  if (nvfp4) {
    l1.epilogue = GemmEpilogue::kSwigluNvfp4;
    l1.out = at<void>(ws, l.codes);
    l1.out_scales = at<void>(ws, l.scales);
    l1.act_decode_scales = act_scale;
    l1.num_act_decode_scales = 1;
  }
  const float* weights = nullptr;
  if (Status s = route_permute_first(d, a, l, l1, &weights, st); s != Status::kSuccess) return s;
  if (nvfp4) {
    DequantizeGroupedArgs dq;
    dq.codes = l1.out;
    dq.scales = l1.out_scales;
    dq.rows = pairs;
    dq.cols = d.intermediate;
    dq.expert_offsets = offsets;
    dq.experts = d.experts;
    dq.decode_scales = act_scale;
    dq.num_decode_scales = 1;
    dq.out = act;
    if (Status s = dequantize_nvfp4_grouped(dq, st); s != Status::kSuccess) return s;
  }
  GroupedGemmArgs l2 = first_gemm_args(d, act, pairs, offsets, at<void>(ws, l.y));
  l2.prepared = d.w2_prepared;
  l2.decode_scale = d.w2_decode_scales;
  l2.n = d.hidden;
  l2.k = d.intermediate;
  l2.epilogue = GemmEpilogue::kPlain;
  if (Status s = grouped_gemm_nvfp4(l2, st); s != Status::kSuccess) return s;
  const auto combine_into = d.output_format == OutputFormat::kFp32 ? combine_fp32 : combine;
  return combine_into(at<void>(ws, l.y), at<int>(ws, l.row_of_pair), weights, a.tokens, a.top_k, d.hidden, a.out, st);
}

Status moe_layer_forward_dispatched(const MoeLayerDesc& d, const MoeDispatchedArgs& a, void* stream) noexcept {
  constexpr const char* what = "moe_layer_forward_dispatched";
  if (Status s = moe_layer_can_implement(d); s != Status::kSuccess) return s;
  if (d.tile == GemmTile::kWarpM16N8) {
    return fail(Status::kInvalidShape, "%s: the kWarpM16N8 tile (at most 8 rows) does not take pre-dispatched tokens: "
                "choose another tile", what);
  }
  const Layout l = layout_of(d);
  if (Status s = check_workspace(l, a.workspace, a.workspace_bytes, what); s != Status::kSuccess) return s;
  // The intermediate lives in the workspace's act region, sized for max_tokens x max_top_k rows.
  const int64_t capacity = d.max_tokens * d.max_top_k;
  const int64_t m = a.max_tokens_per_expert;
  if (m < 0 || m > capacity / d.experts) {
    return fail(Status::kInvalidShape, "%s: max_tokens_per_expert %lld: experts (%lld) x it must be at most "
                "max_tokens x max_top_k (%lld), the workspace's rows", what, static_cast<long long>(m),
                static_cast<long long>(d.experts), static_cast<long long>(capacity));
  }
  if (a.expected_rows < 0) {
    return fail(Status::kInvalidShape, "%s: expected_rows %lld must be >= 0", what, static_cast<long long>(a.expected_rows));
  }
  if (m == 0) return Status::kSuccess;
  if (!a.hidden || !a.counts || !a.out) return fail(Status::kNullPointer, "%s: null hidden, counts or out", what);
  if (!d.w13_prepared || !d.w13_decode_scales || !d.w2_prepared || !d.w2_decode_scales) {
    return fail(Status::kNullPointer, "%s: the descriptor's weight pointers are null", what);
  }
  if (!aligned(a.hidden, 16) || !aligned(a.out, 16) || !aligned(a.counts, 4) || !aligned(d.w13_prepared, 16) ||
      !aligned(d.w2_prepared, 16) || !aligned(d.w13_decode_scales, 4) || !aligned(d.w2_decode_scales, 4)) {
    return fail(Status::kMisaligned, "%s: hidden, out and the prepared weights must be 16-byte aligned, counts and "
                "decode scales 4-byte", what);
  }
  const int64_t rows = d.experts * m;
  void* act = at<void>(a.workspace, l.act);
  GroupedGemmArgs l1 = first_gemm_args(d, a.hidden, rows, nullptr, act);
  l1.expert_counts = a.counts;
  l1.expert_stride = m;
  GroupedGemmArgs l2 = l1;
  // The NVFP4 intermediate: the first GEMM packs it in the same layout (its epilogue addresses
  // expert e's scale region from e x M as from an offset), then it is dequantized in place of the
  // BF16 one; the workspace's codes and scales regions hold max_tokens x max_top_k >= E x M rows.
  const bool nvfp4 = d.intermediate_format == IntermediateFormat::kNvfp4;
  const float* act_scale = at<float>(a.workspace, l.act_scale);
  if (nvfp4) {
    l1.epilogue = GemmEpilogue::kSwigluNvfp4;
    l1.out = at<void>(a.workspace, l.codes);
    l1.out_scales = at<void>(a.workspace, l.scales);
    l1.act_decode_scales = act_scale;
    l1.num_act_decode_scales = 1;
  }
  l2.prepared = d.w2_prepared;
  l2.decode_scale = d.w2_decode_scales;
  l2.n = d.hidden;
  l2.k = d.intermediate;
  l2.x = act;
  l2.out = a.out;
  l2.epilogue = GemmEpilogue::kPlain;
  // The tile and K splits from the rows the step routes (the counts are on the device; the padded
  // E x M rows would over-size the tiles and leave no split at decode), as the permuted forward of
  // the same step chooses them, but never the warp kernel (it takes at most 8 rows in all, which
  // E x M padded rows exceed).
  const int64_t routed = a.expected_rows > 0 && a.expected_rows < rows ? a.expected_rows : 0;
  l1.schedule_rows = routed;
  l2.schedule_rows = routed;
  auto tile_for = [&](const GroupedGemmArgs& g) {
    if (d.tile != GemmTile::kAuto) return d.tile;
    const GemmTile t = launch_gemm_tile(g, 0);
    return t == GemmTile::kWarpM16N8 ? GemmTile::kM128N8 : t;
  };
  l1.tile = tile_for(l1);
  l2.tile = tile_for(l2);
  if (Status s = grouped_gemm_nvfp4_can_implement(l1); s != Status::kSuccess) return s;
  if (Status s = grouped_gemm_nvfp4_can_implement(l2); s != Status::kSuccess) return s;
  const auto st = static_cast<cudaStream_t>(stream);
  if (Status s = grouped_gemm_nvfp4(l1, st); s != Status::kSuccess) return s;
  if (nvfp4) {
    if (Status s = dequantize_nvfp4_dispatched(l1.out, l1.out_scales, d.experts, m, a.counts, d.intermediate,
                                               act_scale, 1, act, st);
        s != Status::kSuccess) {
      return s;
    }
  }
  return grouped_gemm_nvfp4(l2, st);
}

Status moe_layer_first_gemm(const MoeLayerDesc& d, const MoeForwardArgs& a, void* act_out, void* stream) noexcept {
  if (Status s = moe_layer_can_implement(d); s != Status::kSuccess) return s;
  const Layout l = layout_of(d);
  if (Status s = check_forward(d, l, a, false, "moe_layer_first_gemm"); s != Status::kSuccess) return s;
  if (a.tokens == 0) return Status::kSuccess;
  if (!act_out) return fail(Status::kNullPointer, "moe_layer_first_gemm: null act_out");
  if (!aligned(act_out, 16)) return fail(Status::kMisaligned, "moe_layer_first_gemm: act_out must be 16-byte aligned");
  void* ws = a.workspace;
  GroupedGemmArgs l1 = first_gemm_args(d, at<void>(ws, l.x_perm), a.tokens * a.top_k, at<int>(ws, l.expert_offsets),
                                       act_out);
  const float* weights = nullptr;
  return route_permute_first(d, a, l, l1, &weights, static_cast<cudaStream_t>(stream));
}

Status moe_layer_read_error(const MoeLayerDesc& d, void* workspace, int64_t workspace_bytes, void* stream,
                            unsigned long long* word) noexcept {
  if (Status s = moe_layer_can_implement(d); s != Status::kSuccess) return s;
  const Layout l = layout_of(d);
  if (Status s = check_workspace(l, workspace, workspace_bytes, "moe_layer_read_error"); s != Status::kSuccess) {
    return s;
  }
  if (!word) return fail(Status::kNullPointer, "moe_layer_read_error: null word");
  const auto st = static_cast<cudaStream_t>(stream);
  auto* error = at<unsigned long long>(workspace, l.error);
  unsigned long long host = kNoBadId;
  cudaError_t e = cudaMemcpyAsync(&host, error, sizeof(host), cudaMemcpyDeviceToHost, st);
  if (e == cudaSuccess) e = cudaStreamSynchronize(st);
  // Cleared only when something was recorded (0xFF bytes: ~0, no bad id).
  if (e == cudaSuccess && host != kNoBadId) e = cudaMemsetAsync(error, 0xFF, sizeof(*error), st);
  if (e != cudaSuccess) {
    return fail(Status::kCudaError, "moe_layer_read_error: %s (%s)", cudaGetErrorString(e), cudaGetErrorName(e));
  }
  *word = host;
  return Status::kSuccess;
}

}  // namespace nvfp4moe
