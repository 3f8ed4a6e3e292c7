// GPU-free tests of the C++ API (ctest; run on CI's machine, which has no GPU and no driver):
// every argument error is a status and a message from the host-side checks, before anything
// touches CUDA; the size helpers; the version and build information. Built twice, against the
// shared and the static library.
#include "nvfp4moe/nvfp4moe.h"

#include <cstdio>
#include <cstring>

namespace {

int failures = 0;

void expect(bool ok, const char* what, int line) {
  if (!ok) {
    std::fprintf(stderr, "api_errors.cpp:%d: FAILED: %s\n", line, what);
    ++failures;
  }
}
#define EXPECT(cond) expect((cond), #cond, __LINE__)

// `s` is `want` and the thread's last message contains `needle`.
void expect_status(nvfp4moe::Status s, nvfp4moe::Status want, const char* needle, int line) {
  const char* msg = nvfp4moe::last_error_message();
  if (s != want || std::strstr(msg, needle) == nullptr) {
    std::fprintf(stderr, "api_errors.cpp:%d: FAILED: status %d (%s), message \"%s\"; wanted %d with \"%s\"\n", line,
                 int(s), nvfp4moe::status_string(s), msg, int(want), needle);
    ++failures;
  }
}
#define EXPECT_STATUS(call, want, needle) expect_status((call), nvfp4moe::Status::want, (needle), __LINE__)

}  // namespace

int main() {
  using namespace nvfp4moe;
  // Version: the library's is the headers'.
  EXPECT(version() == NVFP4MOE_VERSION);
  EXPECT(std::strcmp(status_string(Status::kNullPointer), "null pointer") == 0);
  EXPECT(std::strcmp(status_string(static_cast<Status>(99)), "unknown status") == 0);
  const BuildInfo bi = build_info();
  EXPECT(bi.cuda_version >= 13000 && bi.cutlass_major == 4 && bi.cuda_archs != nullptr);

  // Size helpers (pure).
  EXPECT(scale_bytes(ScaleLayout::kLinear, 3, 32) == 6);
  EXPECT(scale_bytes(ScaleLayout::kSwizzled128x4, 3, 32) == 128 * 4);
  EXPECT(scale_bytes(ScaleLayout::kLinear, 3, 33) == 0);  // cols not a multiple of 16
  EXPECT(prepared_weight_bytes(2, 128, 128) == size_t(2) * 2 * 2 * kWeightChunkBytes);
  EXPECT(choose_gemm_tile(1024 * 8, 128) == GemmTile::kM128N64);
  EXPECT(choose_gemm_tile(128 * 128, 128) == GemmTile::kM128N128);
  EXPECT(choose_gemm_tile(128 * 128 + 1, 128) == GemmTile::kM128N256);

  // Bad shapes and null pointers: a status and a message, nothing enqueued (no GPU here).
  QuantizeNvfp4Args q;
  q.rows = 4;
  q.cols = 30;
  EXPECT_STATUS(quantize_nvfp4(q, nullptr), kInvalidShape, "");
  q.cols = 32;
  EXPECT_STATUS(quantize_nvfp4(q, nullptr), kNullPointer, "quantize_nvfp4");
  q.decode_scale = -1.0f;
  EXPECT_STATUS(quantize_nvfp4(q, nullptr), kInvalidDecodeScale, "");
  q.decode_scale = 1.0f;
  q.layout = static_cast<ScaleLayout>(7);
  EXPECT_STATUS(quantize_nvfp4(q, nullptr), kUnsupportedLayout, "");

  EXPECT_STATUS(softmax_topk(nullptr, 2, 8, 0, false, nullptr, nullptr, nullptr), kInvalidShape, "softmax_topk");
  EXPECT_STATUS(softmax_topk(nullptr, 2, 8, 2, false, nullptr, nullptr, nullptr), kNullPointer, "softmax_topk");
  EXPECT_STATUS(combine(nullptr, nullptr, nullptr, 2, 2, 64, nullptr, nullptr), kNullPointer, "combine");
  EXPECT_STATUS(combine(nullptr, nullptr, nullptr, 2, 0, 64, nullptr, nullptr), kInvalidShape, "combine");
  EXPECT_STATUS(combine_fp32(nullptr, nullptr, nullptr, 2, 2, 64, nullptr, nullptr), kNullPointer, "combine");
  EXPECT_STATUS(combine_fp32(nullptr, nullptr, nullptr, 2, 2, 60, nullptr, nullptr), kInvalidShape, "combine");
  EXPECT_STATUS(swiglu_bf16(nullptr, 2, 64, nullptr, nullptr), kNullPointer, "");

  GroupedGemmArgs g;
  g.experts = 4;
  g.n = 256;
  g.k = 100;  // not a multiple of 64
  EXPECT_STATUS(grouped_gemm_nvfp4_can_implement(g), kInvalidShape, "");
  g.k = 256;
  EXPECT(grouped_gemm_nvfp4_can_implement(g) == Status::kSuccess);
  g.schedule_experts = 3;  // fewer than the experts
  EXPECT_STATUS(grouped_gemm_nvfp4_can_implement(g), kInvalidShape, "schedule_experts");
  g.schedule_experts = 256;
  EXPECT(grouped_gemm_nvfp4_can_implement(g) == Status::kSuccess);
  g.schedule_experts = 0;
  // The pre-dispatched layout: 4 experts x a stride of 4 rows in 16, counts instead of offsets.
  static const int counts[4] = {1, 0, 4, 2};
  g.total_rows = 16;
  g.expert_counts = counts;
  g.expert_stride = 4;
  EXPECT(grouped_gemm_nvfp4_can_implement(g) == Status::kSuccess);
  g.expert_stride = 5;  // 20 rows of 16
  EXPECT_STATUS(grouped_gemm_nvfp4_can_implement(g), kInvalidShape, "expert_stride");
  g.expert_stride = 4;
  g.expert_offsets = counts;  // both row sources
  EXPECT_STATUS(grouped_gemm_nvfp4_can_implement(g), kInvalidShape, "expert_stride");
  g.expert_stride = -1;
  g.expert_offsets = nullptr;
  EXPECT_STATUS(grouped_gemm_nvfp4_can_implement(g), kInvalidShape, "expert_stride");
  g.expert_stride = 0;
  g.expert_counts = nullptr;
  g.total_rows = 8;
  EXPECT_STATUS(grouped_gemm_nvfp4(g, nullptr), kNullPointer, "grouped_gemm_nvfp4");
  g.experts = kExpertLimit + 1;
  EXPECT_STATUS(grouped_gemm_nvfp4(g, nullptr), kInvalidShape, "");

  PrepareWeightsArgs pw;
  pw.experts = 2;
  pw.n = 128;
  pw.k = 128;
  EXPECT_STATUS(prepare_nvfp4_weights(pw, nullptr), kNullPointer, "");
  pw.n = 96;
  EXPECT_STATUS(prepare_nvfp4_weights_can_implement(pw), kInvalidShape, "");

  PermuteArgs pa;
  pa.tokens = 3;
  pa.top_k = 2;
  pa.experts = 8;
  pa.hidden_size = 64;
  EXPECT_STATUS(permute_and_gather(pa, nullptr), kNullPointer, "");
  pa.hidden_size = 60;  // not a multiple of 8
  EXPECT_STATUS(permute_and_gather_can_implement(pa), kInvalidShape, "");
  pa.hidden_size = 64;
  pa.global_experts = 16;  // a global count needs an expert map
  EXPECT_STATUS(permute_and_gather_can_implement(pa), kInvalidShape, "global_experts");
  static const int fake_map[1] = {0};
  pa.expert_map = fake_map;  // (not read by the check)
  EXPECT(permute_and_gather_can_implement(pa) == Status::kSuccess);
  pa.global_experts = 4;  // fewer than the local experts
  EXPECT_STATUS(permute_and_gather_can_implement(pa), kInvalidShape, "global_experts");
  pa.global_experts = 1025;
  EXPECT_STATUS(permute_and_gather_can_implement(pa), kInvalidShape, "global_experts");

  // The MoE layer: the descriptor's rules, the workspace size, and a forward's argument errors.
  MoeLayerDesc d;
  d.experts = 8;
  d.hidden = 256;
  d.intermediate = 128;
  d.max_tokens = 16;
  d.max_top_k = 2;
  EXPECT(moe_layer_can_implement(d) == Status::kSuccess);
  const size_t ws_bytes = moe_layer_workspace_bytes(d);
  // At least x_perm, act and y of 32 pairs.
  EXPECT(ws_bytes >= size_t(32) * (256 + 128 + 256) * 2);
  MoeLayerDesc bad = d;
  bad.max_top_k = 9;  // more than the experts
  EXPECT_STATUS(moe_layer_can_implement(bad), kInvalidShape, "max_top_k");
  EXPECT(moe_layer_workspace_bytes(bad) == 0);
  bad = d;
  bad.intermediate = 96;  // not a multiple of 64
  EXPECT_STATUS(moe_layer_can_implement(bad), kInvalidShape, "intermediate");
  bad = d;
  bad.max_tokens = int64_t(1) << 31;
  EXPECT_STATUS(moe_layer_can_implement(bad), kInvalidShape, "max_tokens");
  bad = d;
  bad.intermediate_format = IntermediateFormat::kNvfp4;
  bad.intermediate_decode_scale = 0.0f;
  EXPECT_STATUS(moe_layer_can_implement(bad), kInvalidDecodeScale, "decode scale");
  bad.intermediate_decode_scale = 0.5f;
  EXPECT(moe_layer_can_implement(bad) == Status::kSuccess);
  EXPECT(moe_layer_workspace_bytes(bad) > ws_bytes);  // the NVFP4 codes and scales
  bad.tile = GemmTile::kWarpM16N8;
  EXPECT_STATUS(moe_layer_can_implement(bad), kInvalidShape, "kWarpM16N8");
  bad = d;
  bad.intermediate_format = static_cast<IntermediateFormat>(5);
  EXPECT_STATUS(moe_layer_can_implement(bad), kUnsupportedLayout, "intermediate format");
  bad = d;
  bad.output_format = static_cast<OutputFormat>(2);
  EXPECT_STATUS(moe_layer_can_implement(bad), kUnsupportedLayout, "output format");
  // An expert shard: 8 local experts of 32; top-k counts the global experts.
  static const int shard_map[1] = {0};
  MoeLayerDesc shard = d;
  shard.global_experts = 32;
  EXPECT_STATUS(moe_layer_can_implement(shard), kInvalidShape, "global_experts");  // no map
  shard.expert_map = shard_map;
  shard.max_top_k = 9;
  EXPECT(moe_layer_can_implement(shard) == Status::kSuccess);
  shard.global_experts = 7;
  EXPECT_STATUS(moe_layer_can_implement(shard), kInvalidShape, "global_experts");
  shard.global_experts = 8;
  EXPECT_STATUS(moe_layer_can_implement(shard), kInvalidShape, "max_top_k");

  MoeForwardArgs f;
  f.tokens = 4;
  f.top_k = 2;
  EXPECT_STATUS(moe_layer_forward(d, f, nullptr), kNullPointer, "workspace");
  EXPECT_STATUS(moe_layer_initialize(d, nullptr, int64_t(ws_bytes), nullptr), kNullPointer, "workspace");
  // A fake, never dereferenced workspace address: the checks before any launch read no memory.
  alignas(16) static char fake[16];
  f.workspace = fake;
  f.workspace_bytes = int64_t(ws_bytes) - 1;
  EXPECT_STATUS(moe_layer_forward(d, f, nullptr), kInvalidShape, "moe_layer_workspace_bytes");
  f.workspace_bytes = int64_t(ws_bytes);
  f.workspace = fake + 1;
  EXPECT_STATUS(moe_layer_forward(d, f, nullptr), kMisaligned, "workspace");
  f.workspace = fake;
  // The descriptor's weights: null (can_implement does not look at them), then misaligned, then
  // fake 16-byte aligned addresses for the checks after them.
  EXPECT_STATUS(moe_layer_forward(d, f, nullptr), kNullPointer, "weight pointers");
  d.w13_prepared = fake + 4;
  d.w13_decode_scales = reinterpret_cast<const float*>(fake);
  d.w2_prepared = fake;
  d.w2_decode_scales = reinterpret_cast<const float*>(fake);
  EXPECT_STATUS(moe_layer_forward(d, f, nullptr), kMisaligned, "prepared weights");
  d.w13_prepared = fake;
  EXPECT_STATUS(moe_layer_forward(d, f, nullptr), kNullPointer, "hidden");
  f.tokens = 17;
  EXPECT_STATUS(moe_layer_forward(d, f, nullptr), kInvalidShape, "tokens");
  f.tokens = 4;
  f.top_k = 3;
  EXPECT_STATUS(moe_layer_forward(d, f, nullptr), kInvalidShape, "top_k");
  f.top_k = 2;
  f.hidden = fake;
  f.out = fake;
  EXPECT_STATUS(moe_layer_forward(d, f, nullptr), kNullPointer, "router_logits");
  f.topk_ids = reinterpret_cast<const int*>(fake);
  EXPECT_STATUS(moe_layer_forward(d, f, nullptr), kNullPointer, "topk_weights");
  EXPECT_STATUS(moe_layer_first_gemm(d, f, nullptr, nullptr), kNullPointer, "act_out");
  f.topk_weights = reinterpret_cast<const float*>(fake);
  f.out = fake + 2;
  EXPECT_STATUS(moe_layer_forward(d, f, nullptr), kMisaligned, "16-byte");
  f.out = fake;
  f.topk_ids = reinterpret_cast<const int*>(fake + 2);
  EXPECT_STATUS(moe_layer_forward(d, f, nullptr), kMisaligned, "4-byte");
  f.topk_ids = reinterpret_cast<const int*>(fake);
  // A forced kWarpM16N8 tile: a layer of 32 pairs is accepted (its forwards of <= 8 rows run),
  // a forward of more rows is refused before anything is enqueued.
  MoeLayerDesc warp = d;
  warp.tile = GemmTile::kWarpM16N8;
  EXPECT(moe_layer_can_implement(warp) == Status::kSuccess);
  f.tokens = 5;  // 10 rows
  EXPECT_STATUS(moe_layer_forward(warp, f, nullptr), kInvalidShape, "");
  f.tokens = 4;
  f.tokens = 0;  // an empty forward: nothing to do, nothing enqueued
  EXPECT(moe_layer_forward(d, f, nullptr) == Status::kSuccess);
  unsigned long long word = 0;
  EXPECT_STATUS(moe_layer_read_error(d, fake, int64_t(ws_bytes), nullptr, nullptr), kNullPointer, "word");
  EXPECT_STATUS(moe_layer_read_error(d, fake, 8, nullptr, &word), kInvalidShape, "workspace");

  // The pre-dispatched forward: its own rules before anything is enqueued (8 experts, 32 rows).
  MoeDispatchedArgs da;
  da.max_tokens_per_expert = 4;
  EXPECT_STATUS(moe_layer_forward_dispatched(d, da, nullptr), kNullPointer, "workspace");
  da.workspace = fake;
  da.workspace_bytes = int64_t(ws_bytes);
  da.max_tokens_per_expert = 5;  // 8 x 5 rows > 16 x 2
  EXPECT_STATUS(moe_layer_forward_dispatched(d, da, nullptr), kInvalidShape, "max_tokens_per_expert");
  da.max_tokens_per_expert = 4;
  EXPECT_STATUS(moe_layer_forward_dispatched(d, da, nullptr), kNullPointer, "counts");
  MoeLayerDesc fp4 = d;
  fp4.intermediate_format = IntermediateFormat::kNvfp4;
  fp4.intermediate_decode_scale = 0.5f;
  // The NVFP4 intermediate takes the layout too: the same argument checks apply (with its larger
  // workspace).
  MoeDispatchedArgs da4 = da;
  da4.workspace_bytes = int64_t(moe_layer_workspace_bytes(fp4));
  EXPECT_STATUS(moe_layer_forward_dispatched(fp4, da, nullptr), kInvalidShape, "workspace");
  EXPECT_STATUS(moe_layer_forward_dispatched(fp4, da4, nullptr), kNullPointer, "counts");
  MoeLayerDesc warp_tile = d;
  warp_tile.tile = GemmTile::kWarpM16N8;
  EXPECT_STATUS(moe_layer_forward_dispatched(warp_tile, da, nullptr), kInvalidShape, "kWarpM16N8");
  da.max_tokens_per_expert = 0;  // nothing to do
  EXPECT(moe_layer_forward_dispatched(d, da, nullptr) == Status::kSuccess);

  if (failures) {
    std::fprintf(stderr, "api_errors: %d failed\n", failures);
    return 1;
  }
  std::printf("api_errors: all passed (nvfp4moe %d, CUDA %d)\n", version(), bi.cuda_version);
  return 0;
}
