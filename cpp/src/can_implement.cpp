// can_implement: the host-side checks of each entry point, without a launch (pointers are not
// looked at, except which of two alternative sources is given: an expert map, the grouped GEMM's
// row source). The limits come from nvfp4moe/types.h, the one declaration every language shares.
// Each launch function checks the same rules before it enqueues; these let a plan (the Rust
// crate's GroupedGemm, MoeLayer) report a typed error once, at construction.
#include "nvfp4moe/nvfp4moe.h"
#include "grouped_gemm_warp.hpp"
#include "routing_limits.hpp"
#include "status.hpp"

#include <cmath>

namespace nvfp4moe {
namespace {

// Every count is range-checked here before any launch narrows it to a 32-bit kernel argument, and
// no product is formed before its factors are bounded (issue 21).
constexpr int64_t kMaxInt32 = 0x7FFFFFFF;
// A prepared weight tensor (E experts of n x k) is at most this many 64 x 64 chunks: its 16-weight
// blocks (256 per chunk) and prepare's thread count stay below 2^31 (34 G weights; the largest
// preset, kimi-k2, has 11.3 G per layer).
constexpr int64_t kMaxWeightChunks = kMaxInt32 / 256;

// experts in [1, kExpertLimit], n and k positive multiples of 64 whose chunks fit kMaxWeightChunks.
Status check_weights(const char* what, int64_t experts, int64_t n, int64_t k) {
  if (experts <= 0 || experts > kExpertLimit || n <= 0 || k <= 0 || n % 64 || k % 64 || n > kMaxInt32 ||
      k > kMaxInt32) {
    return fail(Status::kInvalidShape, "%s: experts in [1, %lld] and n, k positive multiples of 64 below 2^31 "
                "(experts=%lld n=%lld k=%lld)", what, (long long)kExpertLimit, (long long)experts, (long long)n,
                (long long)k);
  }
  if (experts * (n / 64) * (k / 64) > kMaxWeightChunks) {  // <= 2^10 * 2^25 * 2^25: no overflow
    return fail(Status::kInvalidShape, "%s: %lld experts of %lld x %lld weights exceed %lld 64x64 chunks", what,
                (long long)experts, (long long)n, (long long)k, (long long)kMaxWeightChunks);
  }
  return Status::kSuccess;
}

Status check_dense(const char* what, int64_t rows, int64_t cols, float g, ScaleLayout layout) {
  if (rows < 0 || cols <= 0 || cols % 16 != 0 || rows > kMaxInt32 || cols > (1 << 26)) {
    return fail(Status::kInvalidShape, "%s: rows must be in [0, 2^31) and cols a positive multiple of 16 up to 2^26 "
                "(rows=%lld, cols=%lld)", what, (long long)rows, (long long)cols);
  }
  if (!(std::isfinite(g) && g > 0.0f)) {
    return fail(Status::kInvalidDecodeScale, "%s: decode scale must be finite and > 0 (got %g)", what, double(g));
  }
  if (layout != ScaleLayout::kLinear && layout != ScaleLayout::kSwizzled128x4) {
    return fail(Status::kUnsupportedLayout, "%s: unknown scale layout %d", what, int(layout));
  }
  return Status::kSuccess;
}

Status check_grouped(const char* what, int64_t rows, int64_t cols, int64_t experts, int64_t num_decode_scales) {
  if (rows < 0 || cols <= 0 || cols % 16 || experts <= 0 || experts > kExpertLimit || rows > kMaxInt32 ||
      cols > (1 << 26)) {
    return fail(Status::kInvalidShape, "%s: rows in [0, 2^31), experts in [1, %lld], cols a positive multiple of 16 "
                "up to 2^26 (rows=%lld cols=%lld experts=%lld)", what, (long long)kExpertLimit, (long long)rows,
                (long long)cols, (long long)experts);
  }
  if (num_decode_scales != 1 && num_decode_scales != experts) {
    return fail(Status::kInvalidShape, "%s: 1 or E = %lld decode scales (got %lld)", what, (long long)experts,
                (long long)num_decode_scales);
  }
  return Status::kSuccess;
}

}  // namespace

Status quantize_nvfp4_can_implement(const QuantizeNvfp4Args& a) noexcept {
  return check_dense("quantize_nvfp4", a.rows, a.cols, a.decode_scale, a.layout);
}

Status dequantize_nvfp4_can_implement(const DequantizeNvfp4Args& a) noexcept {
  return check_dense("dequantize_nvfp4", a.rows, a.cols, a.decode_scale, a.layout);
}

Status quantize_nvfp4_grouped_can_implement(const QuantizeGroupedArgs& a) noexcept {
  if (Status s = check_grouped("quantize_nvfp4_grouped", a.rows, a.cols, a.experts, a.num_decode_scales);
      s != Status::kSuccess) {
    return s;
  }
  if (a.source != GroupedSource::kContiguous && a.source != GroupedSource::kInterleavedSwiglu) {
    return fail(Status::kInvalidShape, "quantize_nvfp4_grouped: unknown source %d", int(a.source));
  }
  return Status::kSuccess;
}

Status dequantize_nvfp4_grouped_can_implement(const DequantizeGroupedArgs& a) noexcept {
  return check_grouped("dequantize_nvfp4_grouped", a.rows, a.cols, a.experts, a.num_decode_scales);
}

Status permute_and_gather_can_implement(const PermuteArgs& a) noexcept {
  if (a.tokens < 0 || a.top_k <= 0 || a.experts <= 0 || a.experts > kExpertLimit || a.hidden_size <= 0 ||
      a.hidden_size % 8 || a.hidden_size > routing::kMaxHidden || a.tokens > kMaxInt32 || a.top_k > kMaxInt32 ||
      a.tokens * a.top_k > kMaxInt32) {
    return fail(Status::kInvalidShape, "permute_and_gather: need tokens >= 0, top_k > 0, 0 < experts <= %lld, "
                "hidden_size a positive multiple of 8 up to %lld (tokens=%lld top_k=%lld experts=%lld "
                "hidden_size=%lld)", (long long)kExpertLimit, (long long)routing::kMaxHidden, (long long)a.tokens,
                (long long)a.top_k, (long long)a.experts, (long long)a.hidden_size);
  }
  if (a.expert_map ? a.global_experts < a.experts || a.global_experts > kExpertLimit
                   : a.global_experts != 0 && a.global_experts != a.experts) {
    return fail(Status::kInvalidShape, "permute_and_gather: global_experts %lld: with an expert map it must be in "
                "[experts (%lld), %lld], without one 0 or experts", (long long)a.global_experts, (long long)a.experts,
                (long long)kExpertLimit);
  }
  return Status::kSuccess;
}

Status prepare_nvfp4_weights_can_implement(const PrepareWeightsArgs& a) noexcept {
  if (Status s = check_weights("prepare_nvfp4_weights", a.experts, a.n, a.k); s != Status::kSuccess) return s;
  if (a.row_order != RowOrder::kIdentity && a.row_order != RowOrder::kGateUpBands8) {
    return fail(Status::kInvalidShape, "prepare_nvfp4_weights: unknown row order %d", int(a.row_order));
  }
  return Status::kSuccess;
}

Status grouped_gemm_nvfp4_can_implement(const GroupedGemmArgs& a) noexcept {
  if (a.experts <= 0 || a.experts > kExpertLimit) {
    return fail(Status::kInvalidShape, "grouped_gemm_nvfp4: experts must be in [1, %lld] (got %lld)",
                (long long)kExpertLimit, (long long)a.experts);
  }
  if (a.epilogue != GemmEpilogue::kPlain && a.epilogue != GemmEpilogue::kInterleaved &&
      a.epilogue != GemmEpilogue::kSwigluBf16 && a.epilogue != GemmEpilogue::kSwigluNvfp4) {
    return fail(Status::kInvalidShape, "grouped_gemm_nvfp4: unknown epilogue %d", int(a.epilogue));
  }
  if (Status s = check_weights("grouped_gemm_nvfp4", a.experts, a.n, a.k); s != Status::kSuccess) return s;
  if (a.schedule_rows < 0 || a.schedule_rows > a.total_rows) {
    return fail(Status::kInvalidShape, "grouped_gemm_nvfp4: schedule_rows %lld must be in [0, total_rows (%lld)]",
                (long long)a.schedule_rows, (long long)a.total_rows);
  }
  if (a.schedule_experts != 0 && (a.schedule_experts < a.experts || a.schedule_experts > kExpertLimit)) {
    return fail(Status::kInvalidShape, "grouped_gemm_nvfp4: schedule_experts %lld must be 0 or in [experts (%lld), %lld]",
                (long long)a.schedule_experts, (long long)a.experts, (long long)kExpertLimit);
  }
  if (a.total_rows < 0 || a.total_rows > kMaxInt32) {
    return fail(Status::kInvalidShape, "grouped_gemm_nvfp4: total_rows too large (%lld)", (long long)a.total_rows);
  }
  // The pre-dispatched layout: every expert's stride of rows inside x and out (so e * stride + count
  // never passes total_rows), and one row source.
  if (a.expert_stride < 0 || (a.expert_stride > 0 && (a.expert_offsets || a.expert_stride > a.total_rows / a.experts))) {
    return fail(Status::kInvalidShape, "grouped_gemm_nvfp4: expert_stride %lld must be 0 or, with expert_counts and no "
                "expert_offsets, at most total_rows / experts (%lld / %lld)", (long long)a.expert_stride,
                (long long)a.total_rows, (long long)a.experts);
  }
  // (Narrowed to int at every launch, read only by SwigluNvfp4.)
  if (a.num_act_decode_scales < 0 || a.num_act_decode_scales > a.experts ||
      (a.epilogue == GemmEpilogue::kSwigluNvfp4 && a.num_act_decode_scales != 1 &&
       a.num_act_decode_scales != a.experts)) {
    return fail(Status::kInvalidShape, "grouped_gemm_nvfp4: 0 to E activation decode scales, 1 or E for kSwigluNvfp4 "
                "(got %lld for %lld experts)", (long long)a.num_act_decode_scales, (long long)a.experts);
  }
  if (a.tile != GemmTile::kAuto && a.tile != GemmTile::kM128N8 && a.tile != GemmTile::kM128N16 &&
      a.tile != GemmTile::kM128N32 && a.tile != GemmTile::kM128N64 && a.tile != GemmTile::kM128N128 &&
      a.tile != GemmTile::kM128N256 && a.tile != GemmTile::kWarpM16N8) {
    return fail(Status::kInvalidShape, "grouped_gemm_nvfp4: unknown tile %d", int(a.tile));
  }
  if (a.tile == GemmTile::kWarpM16N8 && !gemm::warp::supports(a.epilogue, a.total_rows, a.k)) {
    return fail(Status::kInvalidShape,
                "grouped_gemm_nvfp4: tile kWarpM16N8 takes at most %lld rows whose x (rows x k BF16) fits in %lld "
                "bytes, and no kSwigluNvfp4 (total_rows=%lld k=%lld)",
                (long long)gemm::warp::kMaxRows, (long long)gemm::warp::kMaxXBytes, (long long)a.total_rows,
                (long long)a.k);
  }
  if (a.max_splits < 0) {
    return fail(Status::kInvalidShape, "grouped_gemm_nvfp4: max_splits must be >= 0 (got %lld)",
                (long long)a.max_splits);
  }
  return Status::kSuccess;
}

}  // namespace nvfp4moe
