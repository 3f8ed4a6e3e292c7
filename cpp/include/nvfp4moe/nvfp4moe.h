// nvfp4moe: NVFP4 Mixture-of-Experts kernels for NVIDIA Hopper (sm_90a).
//
// The C++ core API. Plain C++17: no CUDA, CUTLASS or Rust headers are needed to use it. Streams are
// passed as `void*` (a `cudaStream_t` / `CUstream`); device pointers as raw pointers.
//
// NVFP4 (see shared/design/NVFP4.md; quantizers follow its recipe v2, the bytes of ModelOpt 0.47's
// NVFP4QTensor.quantize on CUDA):
//   value = e2m1(code) * e4m3(block scale) * g
// where g is the FP32 per-tensor *decode scale* (ModelOpt's `weight_scale_2`). Other libraries'
// "global scale" is 1/g; nothing in this API takes a global scale.
#pragma once

#include <cstddef>
#include <cstdint>

// Status, the enums (ScaleLayout, GroupedSource, RowOrder, GemmTile, GemmEpilogue) and the launch
// argument structs (*Args): declared once, C-compatible, for every language that calls the core.
#include "nvfp4moe/types.h"
#include "nvfp4moe/export.h"
#include "nvfp4moe/version.h"

namespace nvfp4moe {

// A short static description of a status.
NVFP4MOE_API const char* status_string(Status status) noexcept;

// The message of the last non-success status returned on this thread (with CUDA's own error text
// for kCudaError). Valid until the next call into the core on this thread.
NVFP4MOE_API const char* last_error_message() noexcept;

// Bytes of the scale buffer of a [rows, cols] NVFP4 tensor in `layout` (padding included).
// Returns 0 for invalid arguments.
NVFP4MOE_API size_t scale_bytes(ScaleLayout layout, int64_t rows, int64_t cols) noexcept;

// quantize_nvfp4: bf16 [rows, cols] -> codes u8 [rows, cols/2] + e4m3 scales, by recipe v2 (ModelOpt's
// bytes on every finite input; a NaN block gets scale 0x7F and zero codes, Inf saturates).
// Byte-identical to the crate's CPU reference for any input, NaN and Inf included. Padding bytes of
// the swizzled layout are written (0).
NVFP4MOE_API Status quantize_nvfp4(const QuantizeNvfp4Args& args, void* stream) noexcept;

// dequantize_nvfp4: codes + scales -> bf16 [rows, cols]:
//   out = bf16_rne((e2m1(code) * e4m3(scale)) * g)   (the first product is exact in FP32)
// A NaN scale gives the canonical bf16 NaN 0x7FC0 for its 16 elements.
NVFP4MOE_API Status dequantize_nvfp4(const DequantizeNvfp4Args& args, void* stream) noexcept;

// ---------------------------------------------------------------------------------------------
// Grouped activations (one region per expert, rows permuted by expert): NVFP4 with 128x4 scales
// whose per-expert regions start at floor((offset(e) + 127 e) / 128) * 128 (TensorRT-LLM's
// convention), and a decode scale per expert or one shared.

// Bytes of a grouped 128x4 scale buffer for `rows` permuted rows (padding included):
// round_up(rows + 127 E, 128) * round_up(cols / 16, 4).
NVFP4MOE_API size_t grouped_scale_bytes(int64_t rows, int64_t experts, int64_t cols) noexcept;

// Bit-exact with the CPU reference (reference::quantize_grouped) for the rows of every expert.
// No host synchronization; rows past expert_offsets[E] are not written.
NVFP4MOE_API Status quantize_nvfp4_grouped(const QuantizeGroupedArgs& args, void* stream) noexcept;

// The inverse for grouped activations: codes [rows, cols/2] + grouped 128x4 scales with
// per-expert regions + decode scale(s) -> bf16 [rows, cols], out = bf16_rne((e2m1 * e4m3) * g)
// like dequantize_nvfp4 (a NaN scale gives NaN for the block). Rows past expert_offsets[E] are
// not written. No host synchronization.
NVFP4MOE_API Status dequantize_nvfp4_grouped(const DequantizeGroupedArgs& args, void* stream) noexcept;

// The "separate SwiGLU kernel" of other libraries (a measured baseline for the fused epilogue):
// gate_up is a GemmEpilogue::kPlain output of kGateUpBands8 weights, bf16 [rows, 2 inter]
// ([gate 8b..8b+7, up 8b..8b+7] per 16 columns); out bf16 [rows, inter] = silu(gate) * up
// computed in FP32 from the BF16 inputs.
NVFP4MOE_API Status swiglu_bf16(const void* gate_up, int64_t rows, int64_t inter, void* out, void* stream) noexcept;

// ---------------------------------------------------------------------------------------------
// MoE routing, permutation and combine (device-side; no host synchronization).

// Softmax top-k over router logits f32 [tokens, experts]: experts chosen by comparing the logits
// (ties: the lower id), weights = their softmax probabilities, divided by their sum when
// `renormalize`. 1 <= top_k <= min(experts, 32), experts <= 1024.
NVFP4MOE_API Status softmax_topk(const float* logits, int64_t tokens, int64_t experts, int64_t top_k, bool renormalize,
                    int* topk_ids, float* topk_weights, void* stream) noexcept;

// Scratch bytes of permute_and_gather for `pairs` = tokens x top_k pairs. With more than 1024
// pairs it also asks the current device, once, how many chunks the one-launch permutation takes
// (an occupancy query: made here, before any stream capture, rather than in the first call).
NVFP4MOE_API size_t permute_workspace_bytes(int64_t pairs, int64_t experts) noexcept;

// The stable counting sort of the (token, slot) pairs by expert (deterministic: pair t*k + j goes
// before every later pair of its expert), and the gather of the hidden rows. Up to 1024 pairs one
// launch; beyond, one cooperative launch while the 1024-pair chunks fit on the GPU at once (one
// CTA per SM: 132 chunks on an H100 SXM or H200), else three. A graph captured with the
// cooperative launch fails on replay where the GPU can no longer hold the grid (a smaller SM share).
NVFP4MOE_API Status permute_and_gather(const PermuteArgs& args, void* stream) noexcept;

// out[t] = sum over j = 0..k-1 (in order, FP32) of topk_weights[t, j] * y[row_of_pair[t, j]]
// (pairs with row -1 skipped), rounded to bf16: bit-identical across runs.
NVFP4MOE_API Status combine(const void* y, const int* row_of_pair, const float* topk_weights, int64_t tokens, int64_t top_k,
               int64_t hidden_size, void* out, void* stream) noexcept;
// combine with out f32 [tokens, hidden_size]: the same FP32 sum, not rounded.
NVFP4MOE_API Status combine_fp32(const void* y, const int* row_of_pair, const float* topk_weights, int64_t tokens,
                                 int64_t top_k, int64_t hidden_size, void* out, void* stream) noexcept;

// What this core was built with.
struct BuildInfo {
  int cuda_version;          // CUDART_VERSION at build time, e.g. 13000
  const char* cuda_archs;    // the CUDA architectures compiled in, e.g. "90a-real"
  int cutlass_major, cutlass_minor, cutlass_patch;
};
NVFP4MOE_API BuildInfo build_info() noexcept;

// The library's version, NVFP4MOE_VERSION as it was built (version.h): equal to the headers' when
// they match.
NVFP4MOE_API int version() noexcept;

// The CUDA runtime and driver versions found at run time (0 when unavailable).
NVFP4MOE_API int runtime_version() noexcept;
NVFP4MOE_API int driver_version() noexcept;


// ---------------------------------------------------------------------------------------------
// NVFP4-weight grouped GEMM (Hopper, sm_90a): out[rows of expert e] = x[rows of e] * W[e]^T.
//
// Weights are the wgmma M side (output features), tokens the N side. NVFP4 weights are
// dequantized to BF16 exactly in the mainloop and fed to register-sourced wgmma; the per-expert
// FP32 decode scale is applied in the epilogue.

// Prepared weights: the checkpoint layout retiled once at load into contiguous "chunks" of 64
// rows x 64 K (one wgmma M atom x four NVFP4 blocks), each 2048 code bytes + 256 scale bytes,
// ordered [expert][row / 64][k / 64]. Inside a chunk every consumer thread finds its A-fragment
// nibbles as one 32-bit word per 16-wide k-block and its two rows' scales as bytes that decode
// to BF16 (s * 2^118) with a shift and an or. See prepare_weights.cu for the exact layout.
constexpr int kWeightChunkRows = 64;
constexpr int kWeightChunkK = 64;
constexpr int kWeightChunkBytes = 64 * 64 / 2 + 64 * 64 / 16;  // 2304

// Bytes of the prepared weight buffer for E experts of [n, k] weights.
NVFP4MOE_API size_t prepared_weight_bytes(int64_t experts, int64_t n, int64_t k) noexcept;

// Enqueues the preparation. Blocks whose scale is zero get zero codes (they decode to 0 whatever
// the encoded scale). The caller checks `error` after synchronizing.
NVFP4MOE_API Status prepare_nvfp4_weights(const PrepareWeightsArgs& args, void* stream) noexcept;

// One MoE projection's weights prepared, the way every API of this library prepares them:
// `args` as for prepare_nvfp4_weights (args.row_order kGateUpBands8 for W13, whose rows per expert
// are [gate (n/2); up (n/2)], kIdentity otherwise; args.error a device int32 [2] of scratch) and
// the decode scales g from host memory: `decode_scales` [E] (W13: the gate rows'), and for W13
// `up_decode_scales` [E] (null otherwise). Checks every g (finite, > 0), writes the [E, 2] decode
// scale pairs the GEMM reads into `decode_scale_pairs` (device f32 [E, 2]), enqueues the
// preparation and synchronizes `stream` once, to report a bad block scale byte (NaN or negative):
// kInvalidValue naming the expert, row and block.
NVFP4MOE_API Status prepare_moe_weights(const PrepareWeightsArgs& args, const float* decode_scales,
                                        const float* up_decode_scales, float* decode_scale_pairs,
                                        void* stream) noexcept;
// Its host-side checks (the shapes, the row order against up_decode_scales, every decode scale),
// before anything is allocated; device pointers are not looked at.
NVFP4MOE_API Status prepare_moe_weights_can_implement(const PrepareWeightsArgs& args, const float* decode_scales,
                                                      const float* up_decode_scales) noexcept;

// The heuristic: the host knows total_rows (= tokens x top-k) and the expert count, not how many
// rows each expert got. At most 8 rows in all: N8; average rows per expert <= 16: N16; <= 32: N32;
// <= 64: N64; <= 128: N128; else N256.
NVFP4MOE_API GemmTile choose_gemm_tile(int64_t total_rows, int64_t experts) noexcept;

// The tile a grouped_gemm_nvfp4 launch with these arguments runs on a device of `sms` SMs (<= 0:
// the current device's; with none, as if the warp kernel never took a launch): args.tile, or for
// kAuto choose_gemm_tile's, except that at most 8 rows in all run on kWarpM16N8 (one warp per 16
// features, mma.sync) where it takes the launch (an epilogue other than kSwigluNvfp4, x fitting in
// shared memory, max_splits != 1: its bits may differ from the wgmma tiles') and the N8 tile would
// neither fill one round of its CTA slots (2 per SM) to at least 90% nor need more than two rounds
// (an upper bound of its tiles: ceil(n / 128) x min(total_rows, experts)): there N8 was as fast or faster
// (deepseek-v3 L1 and qwen3-235b-a22b L2 at T = 1, 256 tiles on 264 slots: 5% and 7% faster than
// the warp kernel of 2026-12-03, session 9; mixtral-8x7b at T = 2 and 4 3-4%, session 8; every
// other T = 1 launch of the presets faster on the warp kernel, H200 2026-12-03).
NVFP4MOE_API GemmTile launch_gemm_tile(const GroupedGemmArgs& args, int sms) noexcept;

// One launch for all experts; per-expert row counts are read on the device (no host sync; valid
// inside CUDA-graph capture). Rows past expert_offsets[E] are not written.
NVFP4MOE_API Status grouped_gemm_nvfp4(const GroupedGemmArgs& args, void* stream) noexcept;

// ---------------------------------------------------------------------------------------------
// The MoE feed-forward layer: routing (or the caller's top-k) -> permutation -> first GEMM with
// SwiGLU in the epilogue (compact BF16, or NVFP4 then dequantized) -> second GEMM -> combine, on
// one stream, in the CUTLASS manner: can_implement, workspace_bytes, initialize, forward. The
// layer works over non-owning views (MoeLayerDesc) and a caller-supplied workspace: it allocates
// nothing, never synchronizes the host in a forward, and a forward is valid inside CUDA-graph
// capture. The caller makes the stream's device current (the tile choice reads the current
// device; the C ABI does this itself), and every pointer must be on it.
//
// Concurrency: a descriptor and the weights it names are read-only; forwards on several streams
// at once are allowed, each with its own workspace. A workspace serves one forward at a time (in
// stream order).
//
// Non-finite input: a NaN or Inf in one token's hidden state, routing weight or router logits
// changes only that token's output row. Expert ids outside [0, E) are never used as an index:
// the slot contributes nothing, and the smallest such (pair, id) since the last
// moe_layer_read_error is kept in the workspace's error word.
//
// Expert shards (expert parallelism): a descriptor with an expert_map runs the experts of one
// shard of a layer of global_experts experts. Its forwards take the whole layer's routing (global
// ids in [0, global_experts), or router logits over them; bad ids are those outside that range);
// slots routed to another shard's experts cost no work (no row, no GEMM tile) and add nothing, so
// a token routed to none of the shard's experts gets zeros. Each local expert gets the tiles and
// K splits the whole layer would give it, so with output_format kFp32 the shards' outputs add up
// to the whole layer's FP32 output up to the order of that addition.

// The descriptor's shapes, counts, enum values and decode scale, and both GEMMs' and the
// permutation's rules for them (pointers are not looked at).
NVFP4MOE_API Status moe_layer_can_implement(const MoeLayerDesc& desc) noexcept;

// Bytes of the workspace for forwards of up to max_tokens x max_top_k pairs (0 for a descriptor
// that moe_layer_can_implement refuses).
NVFP4MOE_API size_t moe_layer_workspace_bytes(const MoeLayerDesc& desc) noexcept;

// Prepares a workspace (once, before its first forward; again to reuse it for another layer):
// enqueues the writes of its error word (no bad id yet) and of the intermediate's decode scale.
NVFP4MOE_API Status moe_layer_initialize(const MoeLayerDesc& desc, void* workspace, int64_t workspace_bytes,
                                         void* stream) noexcept;

// One forward (see MoeForwardArgs). All arguments are checked before anything is enqueued.
NVFP4MOE_API Status moe_layer_forward(const MoeLayerDesc& desc, const MoeForwardArgs& args, void* stream) noexcept;

// One forward over pre-dispatched tokens (see MoeDispatchedArgs): both GEMMs straight over the
// expert-major layout, the intermediate in the workspace (BF16, or NVFP4 packed by the first GEMM
// in the same layout and dequantized row by row); not the kWarpM16N8 tile. All arguments are
// checked before anything is enqueued; no host synchronization; valid inside CUDA-graph capture.
NVFP4MOE_API Status moe_layer_forward_dispatched(const MoeLayerDesc& desc, const MoeDispatchedArgs& args,
                                                 void* stream) noexcept;

// The routing, permutation and first GEMM of a forward with the BF16 SwiGLU epilogue, its output
// written to act_out (bf16 [tokens x top_k, I] in permuted order, 16-byte aligned) instead of the
// workspace: what calibrating the NVFP4 intermediate's decode scale reads (args.out is unused).
NVFP4MOE_API Status moe_layer_first_gemm(const MoeLayerDesc& desc, const MoeForwardArgs& args, void* act_out,
                                         void* stream) noexcept;

// Synchronizes `stream` (the caller chooses when), reads the workspace's error word into *word
// and clears it: ~0 when no forward since the last read met a bad expert id, else
// (pair << 32) | uint32(id) of the smallest bad pair t * top_k + j.
NVFP4MOE_API Status moe_layer_read_error(const MoeLayerDesc& desc, void* workspace, int64_t workspace_bytes,
                                         void* stream, unsigned long long* word) noexcept;

// ---------------------------------------------------------------------------------------------
// can_implement: the host-side checks of an entry point (shapes, counts, enum values, decode
// scales) without launching anything. Pointers are not looked at: a plan checks its shapes once,
// before any buffer exists. Returns the status the launch would return for these arguments (with
// last_error_message() set), so a wrapper can report a typed error at construction.
NVFP4MOE_API Status quantize_nvfp4_can_implement(const QuantizeNvfp4Args& args) noexcept;
NVFP4MOE_API Status dequantize_nvfp4_can_implement(const DequantizeNvfp4Args& args) noexcept;
NVFP4MOE_API Status quantize_nvfp4_grouped_can_implement(const QuantizeGroupedArgs& args) noexcept;
NVFP4MOE_API Status dequantize_nvfp4_grouped_can_implement(const DequantizeGroupedArgs& args) noexcept;
NVFP4MOE_API Status permute_and_gather_can_implement(const PermuteArgs& args) noexcept;
NVFP4MOE_API Status prepare_nvfp4_weights_can_implement(const PrepareWeightsArgs& args) noexcept;
NVFP4MOE_API Status grouped_gemm_nvfp4_can_implement(const GroupedGemmArgs& args) noexcept;

}  // namespace nvfp4moe
