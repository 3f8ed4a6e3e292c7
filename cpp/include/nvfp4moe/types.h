/* nvfp4moe/types.h: every type that crosses a language boundary, declared once.
 *
 * The status codes, enums and launch argument structs of the core, in a header that compiles as
 * C99 and as C++17. The C++ API (nvfp4moe.h) includes it and sees scoped enums and structs with
 * default member initializers in namespace nvfp4moe; a C program (the later C ABI) sees int32_t
 * enum typedefs, NVFP4MOE_<Enum>_<name> constants and nvfp4moe_<Struct> structs of the same layout.
 * The Rust crate's build.rs generates its enums and `#[repr(C)]` structs from this file, and
 * static_asserts in both compilers that the generated layout is the compiled one
 * (see codegen/abi.rs): edit this file, never a Rust copy.
 *
 * Grammar the generator reads (keep to it; anything else between the markers fails the build):
 *   NVFP4MOE_CONST(NAME, value)                               an integer constant
 *   NVFP4MOE_ENUM(Name) {  NVFP4MOE_ENUMERATOR(Name, kVariant, value),  // doc   };
 *   NVFP4MOE_STRUCT(Name) {  type name NVFP4MOE_INIT(...);  // doc   };
 * where a field type is one of: int64_t, int32_t, float, NVFP4MOE_ENUM_T(Name), or a pointer
 * (`const void*`, `void*`, `const int*`, `int*`, `const float*`, `unsigned long long*`; device
 * addresses, which Rust passes as u64). A `//` comment after an item is its documentation; one
 * on the lines just before an item is too.
 */
#ifndef NVFP4MOE_TYPES_H_
#define NVFP4MOE_TYPES_H_

#include <stdint.h>

#ifdef __cplusplus
#define NVFP4MOE_CONST(NAME, value) constexpr int64_t NAME = value
#define NVFP4MOE_ENUM(Name) enum class Name : int32_t
#define NVFP4MOE_ENUMERATOR(Enum, name, value) name = value
#define NVFP4MOE_ENUM_T(Name) Name
#define NVFP4MOE_STRUCT(Name) struct Name
/* Value-initialised (0, nullptr, the enum's 0 variant) unless given. */
#define NVFP4MOE_INIT(...) {__VA_ARGS__}
namespace nvfp4moe {
#else
#define NVFP4MOE_CONST(NAME, value) enum { NVFP4MOE_##NAME = value }
#define NVFP4MOE_ENUM(Name) typedef int32_t nvfp4moe_##Name; enum nvfp4moe_##Name##_values
#define NVFP4MOE_ENUMERATOR(Enum, name, value) NVFP4MOE_##Enum##_##name = value
#define NVFP4MOE_ENUM_T(Name) nvfp4moe_##Name
#define NVFP4MOE_STRUCT(Name) typedef struct nvfp4moe_##Name nvfp4moe_##Name; struct nvfp4moe_##Name
#define NVFP4MOE_INIT(...)
#endif

/* NVFP4MOE_ABI_BEGIN (the generator reads from here) */

// Most experts a grouped GEMM, a permutation or softmax_topk takes.
NVFP4MOE_CONST(kExpertLimit, 1024);
// Most experts per token softmax_topk picks.
NVFP4MOE_CONST(kTopKLimit, 32);

// What every entry point returns. Arguments are validated on the host before any launch; a
// non-success status means nothing was enqueued, except kCudaError after a failed launch.
NVFP4MOE_ENUM(Status) {
  NVFP4MOE_ENUMERATOR(Status, kSuccess, 0),             // Nothing went wrong.
  NVFP4MOE_ENUMERATOR(Status, kInvalidShape, 1),        // A shape or count is out of range (cols not a multiple of 16, ...).
  NVFP4MOE_ENUMERATOR(Status, kMisaligned, 2),          // A pointer is not aligned as the kernel requires.
  NVFP4MOE_ENUMERATOR(Status, kInvalidDecodeScale, 3),  // A decode scale g is not finite and > 0.
  NVFP4MOE_ENUMERATOR(Status, kUnsupportedLayout, 4),   // An unknown enum value (scale layout, ...).
  NVFP4MOE_ENUMERATOR(Status, kNullPointer, 5),         // A required pointer is null.
  NVFP4MOE_ENUMERATOR(Status, kCudaError, 6),           // A CUDA runtime call or a launch failed.
  NVFP4MOE_ENUMERATOR(Status, kInvalidValue, 7),        // A tensor holds a value its format forbids (a NaN or negative block scale).
  NVFP4MOE_ENUMERATOR(Status, kInvalidHandle, 8),       // A null handle, or handles that do not belong together.
  NVFP4MOE_ENUMERATOR(Status, kOutOfMemory, 9),         // A host or device allocation of the C ABI failed.
};

// How the E4M3 block scales of a `[rows, cols]` tensor are laid out in memory.
NVFP4MOE_ENUM(ScaleLayout) {
  // Row-major `[rows, cols/16]`, no padding (how checkpoints store weight scales).
  NVFP4MOE_ENUMERATOR(ScaleLayout, kLinear, 0),
  // 128x4 tiles (Blackwell block-scaled MMA's layout): rows padded to 128, scale columns to 4,
  // padding bytes 0. Row m, scale column k (kTiles = ceil(cols/16/4)) is at
  // `(m/128)*(kTiles*512) + (k/4)*512 + (m%32)*16 + ((m%128)/32)*4 + (k%4)`.
  NVFP4MOE_ENUMERATOR(ScaleLayout, kSwizzled128x4, 1),
};

// Where quantize_nvfp4_grouped reads its input from.
NVFP4MOE_ENUM(GroupedSource) {
  NVFP4MOE_ENUMERATOR(GroupedSource, kContiguous, 0),  // x is bf16 [rows, cols].
  // x is a GemmEpilogue::kInterleaved output [rows, 2 cols]; its swiglu columns
  // (16b + 8 .. 16b + 15) are quantized: swiglu_quantize.
  NVFP4MOE_ENUMERATOR(GroupedSource, kInterleavedSwiglu, 1),
};

// The order of the prepared weight rows, i.e. of the GEMM's output features.
NVFP4MOE_ENUM(RowOrder) {
  NVFP4MOE_ENUMERATOR(RowOrder, kIdentity, 0),  // Output feature f is weight row f.
  // First-layer (W13) weights whose source rows are `[gate (n/2); up (n/2)]` per expert: output
  // feature `16b + i` is gate feature `8b + i` for `i < 8` and up feature `8b + i - 8` otherwise,
  // so in every 16-row wgmma band a thread holds the gate and the up value of the same feature and
  // SwiGLU needs no data exchange. Needs n % 64 == 0.
  NVFP4MOE_ENUMERATOR(RowOrder, kGateUpBands8, 1),
};

// A tile configuration of the grouped GEMM (weight rows x tokens per CTA tile).
NVFP4MOE_ENUM(GemmTile) {
  NVFP4MOE_ENUMERATOR(GemmTile, kAuto, 0),      // Chosen from the total row count and the expert count.
  NVFP4MOE_ENUMERATOR(GemmTile, kM128N16, 1),   // 128 x 16: decode, few rows per expert.
  NVFP4MOE_ENUMERATOR(GemmTile, kM128N128, 2),  // 128 x 128: prefill, 65-128 rows per expert.
  NVFP4MOE_ENUMERATOR(GemmTile, kM128N64, 3),   // 128 x 64: tens of rows per expert.
  NVFP4MOE_ENUMERATOR(GemmTile, kM128N32, 4),   // 128 x 32: 17 to 32 rows per expert.
  NVFP4MOE_ENUMERATOR(GemmTile, kM128N8, 5),    // 128 x 8: at most 8 rows per expert (one token).
  // One warp per 16 features with mma.sync, at most 8 rows in all: the T = 1 decode step (not for
  // kSwigluNvfp4, nor with max_splits == 1; kAuto takes it there instead of kM128N8).
  NVFP4MOE_ENUMERATOR(GemmTile, kWarpM16N8, 6),
  // 128 x 256: prefill, more than 128 rows per expert. An expert's rows past its last whole 256-row
  // tile, when at most 32 or 64, run on 128 x 32 or 128 x 64 in launches of their own, also when
  // this tile is chosen explicitly (the same bits; NVFP4MOE_TAIL_TILES).
  NVFP4MOE_ENUMERATOR(GemmTile, kM128N256, 7),
};

// What the grouped GEMM's epilogue computes and writes.
NVFP4MOE_ENUM(GemmEpilogue) {
  NVFP4MOE_ENUMERATOR(GemmEpilogue, kPlain, 0),  // out [rows, n] = acc * g, in prepared feature order.
  // The first MoE GEMM on kGateUpBands8 weights (n = 2I), SwiGLU in the epilogue: out [rows, 2I] as
  // [gate 8b..8b+7, silu(gate)*up 8b..8b+7] for b = 0..I/8 (the old flow, a baseline).
  NVFP4MOE_ENUMERATOR(GemmEpilogue, kInterleaved, 1),
  // out [rows, I] = silu(gate) * up, compact (half the accumulator width).
  NVFP4MOE_ENUMERATOR(GemmEpilogue, kSwigluBf16, 2),
  // silu(gate) * up rounded to BF16 (as kSwigluBf16), then quantized to NVFP4 in the epilogue with
  // the recipe of quantize_nvfp4 and the activation decode scale of the row's expert: out = codes
  // u8 [rows, I/2], out_scales = E4M3 scales in the grouped 128x4 layout with per-expert regions
  // (grouped_scale_bytes(total_rows, E, I) bytes, zeroed by the launch first). The bytes equal
  // quantize_nvfp4_grouped(kContiguous) of the kSwigluBf16 output.
  NVFP4MOE_ENUMERATOR(GemmEpilogue, kSwigluNvfp4, 3),
};

// Arguments of quantize_nvfp4: bf16 [rows, cols] -> codes u8 [rows, cols/2] + e4m3 scales.
NVFP4MOE_STRUCT(QuantizeNvfp4Args) {
  const void* x NVFP4MOE_INIT();                            // bf16 [rows, cols], row-major, 16-byte aligned
  int64_t rows NVFP4MOE_INIT();                             // >= 0
  int64_t cols NVFP4MOE_INIT();                             // > 0, multiple of 16
  float decode_scale NVFP4MOE_INIT(1.0f);                   // g, finite and > 0
  NVFP4MOE_ENUM_T(ScaleLayout) layout NVFP4MOE_INIT();      // layout of `scales`
  void* codes NVFP4MOE_INIT();                              // u8 [rows, cols/2], element 2j in the low nibble; 8-byte aligned
  void* scales NVFP4MOE_INIT();                             // scale_bytes(layout, rows, cols) bytes
};

// Arguments of dequantize_nvfp4: codes + scales -> bf16 [rows, cols].
NVFP4MOE_STRUCT(DequantizeNvfp4Args) {
  const void* codes NVFP4MOE_INIT();                        // u8 [rows, cols/2], 8-byte aligned
  const void* scales NVFP4MOE_INIT();                       // scale_bytes(layout, rows, cols) bytes
  int64_t rows NVFP4MOE_INIT();                             // >= 0
  int64_t cols NVFP4MOE_INIT();                             // > 0, multiple of 16
  float decode_scale NVFP4MOE_INIT(1.0f);                   // g, finite and > 0
  NVFP4MOE_ENUM_T(ScaleLayout) layout NVFP4MOE_INIT();      // layout of `scales`
  void* out NVFP4MOE_INIT();                                // bf16 [rows, cols], 16-byte aligned
};

// Arguments of quantize_nvfp4_grouped: permuted rows, one region per expert.
NVFP4MOE_STRUCT(QuantizeGroupedArgs) {
  const void* x NVFP4MOE_INIT();                            // see source; 16-byte aligned
  NVFP4MOE_ENUM_T(GroupedSource) source NVFP4MOE_INIT();    // what x holds
  int64_t rows NVFP4MOE_INIT();                             // rows of x (>= expert_offsets[E]; later rows are ignored)
  int64_t cols NVFP4MOE_INIT();                             // quantized columns, multiple of 16
  const int* expert_offsets NVFP4MOE_INIT();                // device i32 [E+1]
  int64_t experts NVFP4MOE_INIT();                          // in [1, kExpertLimit]
  const float* decode_scales NVFP4MOE_INIT();               // device f32 [num_decode_scales]: g per expert, or one
  int64_t num_decode_scales NVFP4MOE_INIT();                // 1 or E
  void* codes NVFP4MOE_INIT();                              // u8 [rows, cols/2], 8-byte aligned
  void* scales NVFP4MOE_INIT();                             // grouped_scale_bytes(rows, E, cols); padding written 0
};

// Arguments of dequantize_nvfp4_grouped: the inverse of quantize_nvfp4_grouped(kContiguous).
NVFP4MOE_STRUCT(DequantizeGroupedArgs) {
  const void* codes NVFP4MOE_INIT();                        // u8 [rows, cols/2], 8-byte aligned
  const void* scales NVFP4MOE_INIT();                       // grouped_scale_bytes(rows, E, cols)
  int64_t rows NVFP4MOE_INIT();                             // >= 0
  int64_t cols NVFP4MOE_INIT();                             // multiple of 16
  const int* expert_offsets NVFP4MOE_INIT();                // device i32 [E+1]
  int64_t experts NVFP4MOE_INIT();                          // in [1, kExpertLimit]
  const float* decode_scales NVFP4MOE_INIT();               // device f32 [num_decode_scales]
  int64_t num_decode_scales NVFP4MOE_INIT();                // 1 or E
  void* out NVFP4MOE_INIT();                                // bf16 [rows, cols], 16-byte aligned
};

// Arguments of permute_and_gather: the counting sort of (token, slot) pairs by expert.
NVFP4MOE_STRUCT(PermuteArgs) {
  const int* topk_ids NVFP4MOE_INIT();                      // device i32 [tokens, top_k]
  int64_t tokens NVFP4MOE_INIT();                           // >= 0
  int64_t top_k NVFP4MOE_INIT();                            // > 0
  int64_t experts NVFP4MOE_INIT();                          // in [1, kExpertLimit]
  const void* hidden NVFP4MOE_INIT();                       // bf16 [tokens, hidden_size], 16-byte aligned
  int64_t hidden_size NVFP4MOE_INIT();                      // multiple of 8
  int* expert_offsets NVFP4MOE_INIT();                      // out: i32 [E+1]
  int* row_of_pair NVFP4MOE_INIT();                         // out: i32 [pairs]: permuted row of each pair, -1 if its id is bad
  int* pair_of_row NVFP4MOE_INIT();                         // out: i32 [pairs]: the pair at each permuted row
  void* x_perm NVFP4MOE_INIT();                             // out: bf16 [pairs, hidden_size]: hidden rows in permuted order
  // Device u64, initialised by the caller to ~0: a pair whose id is outside [0, E) (with an expert
  // map: [0, global_experts)) is left out of the permutation and the smallest (pair index << 32 |
  // id) of them is recorded here.
  unsigned long long* error NVFP4MOE_INIT();
  void* workspace NVFP4MOE_INIT();                          // permute_workspace_bytes(pairs, experts)
  // An expert shard (expert parallelism): device i32 [global_experts], 4-byte aligned, the local
  // expert of each global id (in [0, E)) or -1 for an expert of another shard, whose pairs are left
  // out with no error (row_of_pair -1, no row, no work; an entry outside [0, E) counts as another
  // shard's); ids are then checked against [0, global_experts).
  // Null: ids are local, in [0, E).
  const int* expert_map NVFP4MOE_INIT();
  int64_t global_experts NVFP4MOE_INIT();                   // with expert_map: in [E, kExpertLimit]; without: 0 or E
};

// Arguments of prepare_nvfp4_weights: checkpoint-layout NVFP4 weights -> the GEMM's chunk layout.
NVFP4MOE_STRUCT(PrepareWeightsArgs) {
  const void* codes NVFP4MOE_INIT();                        // u8 [E, n, k/2], ModelOpt packing (element 2j in the low nibble)
  const void* scales NVFP4MOE_INIT();                       // e4m3 [E, n, k/16], linear (checkpoint layout)
  int64_t experts NVFP4MOE_INIT();                          // in [1, kExpertLimit]; E x n/64 x k/64 < 2^23
  int64_t n NVFP4MOE_INIT();                                // output features, multiple of 64
  int64_t k NVFP4MOE_INIT();                                // reduction size, multiple of 64
  NVFP4MOE_ENUM_T(RowOrder) row_order NVFP4MOE_INIT();      // order of the prepared rows
  void* prepared NVFP4MOE_INIT();                           // prepared_weight_bytes(E, n, k) bytes
  // Device int32 [2], set to {-1, 0} by the caller before the launch. After it, the first bad
  // scale found (NaN, or negative and non-zero) is reported as {flat scale index, byte}.
  int* error NVFP4MOE_INIT();
};

// Arguments of grouped_gemm_nvfp4: out[rows of expert e] = x[rows of e] * W[e]^T for all experts.
NVFP4MOE_STRUCT(GroupedGemmArgs) {
  const void* prepared NVFP4MOE_INIT();                     // prepare_nvfp4_weights output
  // Device f32 [E, 2]: per expert, the decode scale of the output features f with f % 16 < 8 and
  // of the others. Equal for plain weights; gate and up scales for kGateUpBands8 weights.
  const float* decode_scale NVFP4MOE_INIT();
  int64_t experts NVFP4MOE_INIT();                          // in [1, kExpertLimit]
  int64_t n NVFP4MOE_INIT();                                // multiple of 64
  int64_t k NVFP4MOE_INIT();                                // multiple of 64
  const void* x NVFP4MOE_INIT();                            // bf16 [total_rows, k], 16-byte aligned
  int64_t total_rows NVFP4MOE_INIT();                       // rows of x and out (may exceed expert_offsets[E])
  const int* expert_offsets NVFP4MOE_INIT();                // device i32 [E+1]: rows of expert e are [off[e], off[e+1])
  void* out NVFP4MOE_INIT();                                // bf16 [total_rows, n] (n / 2 for kSwigluBf16; codes for kSwigluNvfp4), 16-byte aligned
  void* out_scales NVFP4MOE_INIT();                         // kSwigluNvfp4: the E4M3 scales
  const float* act_decode_scales NVFP4MOE_INIT();           // kSwigluNvfp4: device f32 [1] or [E]
  int64_t num_act_decode_scales NVFP4MOE_INIT();            // kSwigluNvfp4: 1 or E; other epilogues: 0 to E, unread
  NVFP4MOE_ENUM_T(GemmTile) tile NVFP4MOE_INIT();           // the tile configuration (kAuto: choose_gemm_tile)
  NVFP4MOE_ENUM_T(GemmEpilogue) epilogue NVFP4MOE_INIT();   // the SwiGLU ones need kGateUpBands8 weights
  // Split-K: at most this many CTAs (the warp kernel: warps) share a tile's K (0: the library's
  // choice, up to 4 CTAs or 8 warps; 1: never, and no warp kernel under kAuto, so every row's K-sum
  // order, and with it its result, is the same whatever the launch's rows).
  int64_t max_splits NVFP4MOE_INIT();
  // The expert count the tile and split-K choice assume (0: experts). An expert shard passes its
  // whole layer's, so that each of its experts gets the whole layer's tile and K splits (the same
  // bits) and the choice sees the rows a shard's experts really have on average.
  int64_t schedule_experts NVFP4MOE_INIT();
  // The pre-dispatched (expert-major) layout instead of expert_offsets (which must then be null):
  // with expert_stride > 0, expert e's rows are [e * expert_stride, e * expert_stride +
  // expert_counts[e]) (each count clamped to [0, expert_stride]), E x expert_stride <= total_rows.
  const int* expert_counts NVFP4MOE_INIT();                 // device i32 [E] (with expert_stride)
  int64_t expert_stride NVFP4MOE_INIT();                    // 0: rows from expert_offsets
  // The rows the tile and split-K choice assume (0: total_rows; at most total_rows). The
  // pre-dispatched layout passes the step's routed rows: its padded total_rows would over-size the
  // tiles and leave no K split at decode, where the permuted forward of the same step splits.
  int64_t schedule_rows NVFP4MOE_INIT();
};

// The format between a MoE layer's two GEMMs.
NVFP4MOE_ENUM(IntermediateFormat) {
  // Compact BF16 from the first GEMM's kSwigluBf16 epilogue (the default).
  NVFP4MOE_ENUMERATOR(IntermediateFormat, kBf16, 0),
  // NVFP4 from its kSwigluNvfp4 epilogue with the layer's activation decode scale, dequantized by
  // dequantize_nvfp4_grouped for the second GEMM (Hopper has no FP4 MMA): the path FP4 consumers
  // take; it adds NVFP4's quantization error to the layer.
  NVFP4MOE_ENUMERATOR(IntermediateFormat, kNvfp4, 1),
};
// The element type of a MoE layer's output.
NVFP4MOE_ENUM(OutputFormat) {
  NVFP4MOE_ENUMERATOR(OutputFormat, kBf16, 0),  // bf16 [tokens, H] (the default)
  // f32 [tokens, H]: the combine's FP32 sum unrounded, so that the outputs of a layer's expert
  // shards add up to the whole layer's FP32 output up to the order of that addition.
  NVFP4MOE_ENUMERATOR(OutputFormat, kFp32, 1),
};
// A MoE feed-forward layer (moe_layer_*): non-owning views of its prepared weights and what its
// forwards may take. Nothing here is written by a forward: one descriptor serves any number of
// concurrent forwards, each with its own workspace.
NVFP4MOE_STRUCT(MoeLayerDesc) {
  // W13, gate and up: prepare_nvfp4_weights(E, n = 2I, k = H, kGateUpBands8) output (the layer
  // cannot tell the row order from the bytes: weights prepared otherwise give wrong results).
  const void* w13_prepared NVFP4MOE_INIT();
  const float* w13_decode_scales NVFP4MOE_INIT();           // device f32 [E, 2]: gate and up decode scale per expert
  const void* w2_prepared NVFP4MOE_INIT();                  // W2, down: prepare_nvfp4_weights(E, n = H, k = I, kIdentity)
  const float* w2_decode_scales NVFP4MOE_INIT();            // device f32 [E, 2]: the down decode scale, twice
  int64_t experts NVFP4MOE_INIT();                          // E, in [1, kExpertLimit]
  int64_t hidden NVFP4MOE_INIT();                           // H, a multiple of 64
  int64_t intermediate NVFP4MOE_INIT();                     // I, a multiple of 64
  int64_t max_tokens NVFP4MOE_INIT();                       // most tokens a forward takes (sizes the workspace)
  int64_t max_top_k NVFP4MOE_INIT();                        // most experts per token, in [1, min(global E, kTopKLimit)]
  NVFP4MOE_ENUM_T(GemmTile) tile NVFP4MOE_INIT();           // both GEMMs' tile (kAuto: chosen per launch)
  NVFP4MOE_ENUM_T(IntermediateFormat) intermediate_format NVFP4MOE_INIT();  // the format between the GEMMs
  float intermediate_decode_scale NVFP4MOE_INIT(1.0f);      // kNvfp4: the activation decode scale g (finite, > 0)
  // Non-zero: no GEMM splits K (max_splits 1), so a token's output bits do not depend on T.
  int32_t batch_invariant NVFP4MOE_INIT();
  // An expert shard of a layer of global_experts experts (expert parallelism): the E experts here
  // are some of them, expert_map (device i32 [global_experts]) gives each global id's local expert
  // or -1. Routing ids and router logits are global; slots routed to another shard cost no work,
  // a token with none here gets zeros. Null map: global_experts 0 or E, a whole layer.
  const int* expert_map NVFP4MOE_INIT();
  int64_t global_experts NVFP4MOE_INIT();                   // with expert_map: in [E, kExpertLimit]; without: 0 or E
  NVFP4MOE_ENUM_T(OutputFormat) output_format NVFP4MOE_INIT();  // the element type of `out`
};
// One forward of a MoE layer (moe_layer_forward): out = sum_j topk_weights[t, j] *
// expert_{topk_ids[t, j]}(hidden[t]), routed by the given top-k or by softmax top-k over logits.
NVFP4MOE_STRUCT(MoeForwardArgs) {
  const void* hidden NVFP4MOE_INIT();                       // bf16 [tokens, H], 16-byte aligned
  int64_t tokens NVFP4MOE_INIT();                           // in [0, max_tokens]
  int64_t top_k NVFP4MOE_INIT();                            // in [1, max_top_k]
  const int* topk_ids NVFP4MOE_INIT();                      // device i32 [tokens, top_k]; null: route with router_logits
  const float* topk_weights NVFP4MOE_INIT();                // device f32 [tokens, top_k] (with topk_ids)
  const float* router_logits NVFP4MOE_INIT();               // device f32 [tokens, global experts] (without topk_ids)
  int32_t renormalize NVFP4MOE_INIT();                      // router: a token's k weights divided by their sum
  void* out NVFP4MOE_INIT();                                // [tokens, H] of the layer's output_format, 16-byte aligned
  // moe_layer_workspace_bytes(desc) bytes, 16-byte aligned (256 is best), set up by moe_layer_initialize.
  void* workspace NVFP4MOE_INIT();
  int64_t workspace_bytes NVFP4MOE_INIT();                  // its size
};
// One forward of a MoE layer over pre-dispatched tokens (moe_layer_forward_dispatched): tokens
// already grouped by the layer's experts in the expert-major layout of dispatchers such as DeepEP's
// low-latency mode and pplx-kernels, out[e, r] = expert_e(hidden[e, r]) for r < counts[e] in the
// same layout (no routing, permutation or combine: the dispatcher's combine weighs and sums them).
// E is the descriptor's (local) experts; its expert map and output format are not used (out is
// bf16). The intermediate uses the workspace's act region, so E x M is bounded by the layer's
// max_tokens x max_top_k (whose other regions this forward leaves unused).
NVFP4MOE_STRUCT(MoeDispatchedArgs) {
  const void* hidden NVFP4MOE_INIT();                       // bf16 [E, max_tokens_per_expert, H], 16-byte aligned
  const int* counts NVFP4MOE_INIT();                        // device i32 [E]: rows of each expert (clamped to [0, max])
  int64_t max_tokens_per_expert NVFP4MOE_INIT();            // M: E x M <= max_tokens x max_top_k (the workspace's rows)
  void* out NVFP4MOE_INIT();                                // bf16 [E, M, H], 16-byte aligned; rows r >= counts[e] untouched
  void* workspace NVFP4MOE_INIT();                          // as MoeForwardArgs'
  int64_t workspace_bytes NVFP4MOE_INIT();                  // its size
  // About how many rows the counts add up to (e.g. tokens x top-k of the step), for the GEMMs' tile
  // choice only (the counts are on the device); 0: E x M, which over-sizes the tiles when M is a
  // dispatcher's padded capacity. For an expert shard: the whole layer's rows (the choice assumes
  // the whole layer's experts, schedule_experts).
  int64_t expected_rows NVFP4MOE_INIT();
};
/* NVFP4MOE_ABI_END (the generator reads up to here) */

#ifdef __cplusplus
}  // namespace nvfp4moe
#endif

#endif  // NVFP4MOE_TYPES_H_
