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

namespace nvfp4moe {

// Every entry point returns a Status. Arguments are validated on the host before any launch; a
// non-success status means nothing was enqueued, except kCudaError after a failed launch.
enum class Status : int32_t {
  kSuccess = 0,
  kInvalidShape = 1,         // e.g. cols not a multiple of 16, negative sizes
  kMisaligned = 2,           // a pointer is not aligned as the kernel requires
  kInvalidDecodeScale = 3,   // g is not finite and > 0
  kUnsupportedLayout = 4,    // unknown ScaleLayout value
  kNullPointer = 5,          // a required pointer is null
  kCudaError = 6,            // a CUDA runtime call or a launch failed; see last_error_message()
};

// A short static description of a status.
const char* status_string(Status status) noexcept;

// The message of the last non-success status returned on this thread (with CUDA's own error text
// for kCudaError). Valid until the next call into the core on this thread.
const char* last_error_message() noexcept;

// Where the E4M3 block scales of a [rows, cols] NVFP4 tensor live.
enum class ScaleLayout : int32_t {
  // e4m3 [rows, cols/16] row-major: how checkpoints store weight scales.
  kLinear = 0,
  // Blackwell block-scaled MMA's "128x4" layout: rows padded to a multiple of 128, scale columns
  // to a multiple of 4, padding bytes 0. For row m, scale column k (kTiles = ceil(cols/16/4)):
  //   offset = (m/128)*(kTiles*512) + (k/4)*512 + (m%32)*16 + ((m%128)/32)*4 + (k%4)
  kSwizzled128x4 = 1,
};

// Bytes of the scale buffer of a [rows, cols] NVFP4 tensor in `layout` (padding included).
// Returns 0 for invalid arguments.
size_t scale_bytes(ScaleLayout layout, int64_t rows, int64_t cols) noexcept;

// quantize_nvfp4: bf16 [rows, cols] -> codes u8 [rows, cols/2] + e4m3 scales, by recipe v2 (ModelOpt's
// bytes on every finite input; a NaN block gets scale 0x7F and zero codes, Inf saturates).
// Byte-identical to the crate's CPU reference for any input, NaN and Inf included. Padding bytes of
// the swizzled layout are written (0).
struct QuantizeNvfp4Args {
  const void* x = nullptr;     // bf16 [rows, cols], row-major, 16-byte aligned
  int64_t rows = 0;            // >= 0
  int64_t cols = 0;            // > 0, multiple of 16
  float decode_scale = 1.0f;   // g, finite and > 0
  ScaleLayout layout = ScaleLayout::kLinear;
  void* codes = nullptr;       // u8 [rows, cols/2], element 2j in the low nibble; 8-byte aligned
  void* scales = nullptr;      // scale_bytes(layout, rows, cols) bytes
};
Status quantize_nvfp4(const QuantizeNvfp4Args& args, void* stream) noexcept;

// dequantize_nvfp4: codes + scales -> bf16 [rows, cols]:
//   out = bf16_rne((e2m1(code) * e4m3(scale)) * g)   (the first product is exact in FP32)
// A NaN scale gives the canonical bf16 NaN 0x7FC0 for its 16 elements.
struct DequantizeNvfp4Args {
  const void* codes = nullptr;   // u8 [rows, cols/2], 8-byte aligned
  const void* scales = nullptr;  // scale_bytes(layout, rows, cols) bytes
  int64_t rows = 0;
  int64_t cols = 0;              // > 0, multiple of 16
  float decode_scale = 1.0f;     // g, finite and > 0
  ScaleLayout layout = ScaleLayout::kLinear;
  void* out = nullptr;           // bf16 [rows, cols], 16-byte aligned
};
Status dequantize_nvfp4(const DequantizeNvfp4Args& args, void* stream) noexcept;

// ---------------------------------------------------------------------------------------------
// Grouped activations (one region per expert, rows permuted by expert): NVFP4 with 128x4 scales
// whose per-expert regions start at floor((offset(e) + 127 e) / 128) * 128 (TensorRT-LLM's
// convention), and a decode scale per expert or one shared.

// Bytes of a grouped 128x4 scale buffer for `rows` permuted rows (padding included):
// round_up(rows + 127 E, 128) * round_up(cols / 16, 4).
size_t grouped_scale_bytes(int64_t rows, int64_t experts, int64_t cols) noexcept;

// Where quantize_nvfp4_grouped reads its input from.
enum class GroupedSource : int32_t {
  kContiguous = 0,         // x is bf16 [rows, cols]
  kInterleavedSwiglu = 1,  // x is a GemmEpilogue::kInterleaved output [rows, 2 cols]; its swiglu
                           // columns (16b + 8 .. 16b + 15) are quantized: swiglu_quantize
};

struct QuantizeGroupedArgs {
  const void* x = nullptr;               // see source; 16-byte aligned
  GroupedSource source = GroupedSource::kContiguous;
  int64_t rows = 0;                      // rows of x (>= expert_offsets[E]; later rows are ignored)
  int64_t cols = 0;                      // quantized columns, multiple of 16
  const int* expert_offsets = nullptr;   // device i32 [E+1]
  int64_t experts = 0;
  const float* decode_scales = nullptr;  // device f32 [num_decode_scales]: g per expert, or one
  int64_t num_decode_scales = 0;         // 1 or E
  void* codes = nullptr;                 // u8 [rows, cols/2], 8-byte aligned
  void* scales = nullptr;                // grouped_scale_bytes(rows, E, cols); padding written 0
};
// Bit-exact with the CPU reference (reference::quantize_grouped) for the rows of every expert.
// No host synchronization; rows past expert_offsets[E] are not written.
Status quantize_nvfp4_grouped(const QuantizeGroupedArgs& args, void* stream) noexcept;

// The inverse for grouped activations: codes [rows, cols/2] + grouped 128x4 scales with
// per-expert regions + decode scale(s) -> bf16 [rows, cols], out = bf16_rne((e2m1 * e4m3) * g)
// like dequantize_nvfp4 (a NaN scale gives NaN for the block). Rows past expert_offsets[E] are
// not written. No host synchronization.
struct DequantizeGroupedArgs {
  const void* codes = nullptr;           // u8 [rows, cols/2], 8-byte aligned
  const void* scales = nullptr;          // grouped_scale_bytes(rows, E, cols)
  int64_t rows = 0;
  int64_t cols = 0;                      // multiple of 16
  const int* expert_offsets = nullptr;   // device i32 [E+1]
  int64_t experts = 0;
  const float* decode_scales = nullptr;  // device f32 [num_decode_scales]
  int64_t num_decode_scales = 0;         // 1 or E
  void* out = nullptr;                   // bf16 [rows, cols], 16-byte aligned
};
Status dequantize_nvfp4_grouped(const DequantizeGroupedArgs& args, void* stream) noexcept;

// The "separate SwiGLU kernel" of other libraries (a measured baseline for the fused epilogue):
// gate_up is a GemmEpilogue::kPlain output of kGateUpBands8 weights, bf16 [rows, 2 inter]
// ([gate 8b..8b+7, up 8b..8b+7] per 16 columns); out bf16 [rows, inter] = silu(gate) * up
// computed in FP32 from the BF16 inputs.
Status swiglu_bf16(const void* gate_up, int64_t rows, int64_t inter, void* out, void* stream) noexcept;

// ---------------------------------------------------------------------------------------------
// MoE routing, permutation and combine (device-side; no host synchronization).

// Softmax top-k over router logits f32 [tokens, experts]: experts chosen by comparing the logits
// (ties: the lower id), weights = their softmax probabilities, divided by their sum when
// `renormalize`. 1 <= top_k <= min(experts, 32), experts <= 1024.
Status softmax_topk(const float* logits, int64_t tokens, int64_t experts, int64_t top_k, bool renormalize,
                    int* topk_ids, float* topk_weights, void* stream) noexcept;

// Scratch bytes of permute_and_gather for `pairs` = tokens x top_k pairs.
size_t permute_workspace_bytes(int64_t pairs, int64_t experts) noexcept;

struct PermuteArgs {
  const int* topk_ids = nullptr;      // device i32 [tokens, top_k]
  int64_t tokens = 0, top_k = 0, experts = 0;
  const void* hidden = nullptr;       // bf16 [tokens, hidden_size], 16-byte aligned
  int64_t hidden_size = 0;            // multiple of 8
  int* expert_offsets = nullptr;      // out: i32 [E+1]
  int* row_of_pair = nullptr;         // out: i32 [pairs]: permuted row of each pair, -1 if its id is bad
  int* pair_of_row = nullptr;         // out: i32 [pairs]: the pair at each permuted row
  void* x_perm = nullptr;             // out: bf16 [pairs, hidden_size]: hidden rows in permuted order
  // Device u64, initialised by the caller to ~0: a pair whose id is outside [0, E) is left out of
  // the permutation and the smallest (pair index << 32 | id) of them is recorded here.
  unsigned long long* error = nullptr;
  void* workspace = nullptr;          // permute_workspace_bytes(pairs, experts)
};
// The stable counting sort of the (token, slot) pairs by expert (deterministic: pair t*k + j goes
// before every later pair of its expert), and the gather of the hidden rows.
Status permute_and_gather(const PermuteArgs& args, void* stream) noexcept;

// out[t] = sum over j = 0..k-1 (in order, FP32) of topk_weights[t, j] * y[row_of_pair[t, j]]
// (pairs with row -1 skipped), rounded to bf16: bit-identical across runs.
Status combine(const void* y, const int* row_of_pair, const float* topk_weights, int64_t tokens, int64_t top_k,
               int64_t hidden_size, void* out, void* stream) noexcept;

// What this core was built with.
struct BuildInfo {
  int cuda_version;          // CUDART_VERSION at build time, e.g. 13000
  const char* cuda_archs;    // the CUDA architectures compiled in, e.g. "90a-real"
  int cutlass_major, cutlass_minor, cutlass_patch;
};
BuildInfo build_info() noexcept;

// The CUDA runtime and driver versions found at run time (0 when unavailable).
int runtime_version() noexcept;
int driver_version() noexcept;


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
size_t prepared_weight_bytes(int64_t experts, int64_t n, int64_t k) noexcept;

// The order of the prepared rows (the GEMM's output features).
enum class RowOrder : int32_t {
  kIdentity = 0,
  // For the first MoE GEMM (W13): the source holds, per expert, the gate rows [0, n/2) then the
  // up rows [n/2, n); prepared row 16b + i is gate feature 8b + i for i < 8 and up feature
  // 8b + i - 8 otherwise, so in every 16-row wgmma band a thread holds the gate and the up value of
  // the same feature (rows r and r + 8) and SwiGLU needs no data exchange. Needs n % 64 == 0.
  kGateUpBands8 = 1,
};

struct PrepareWeightsArgs {
  const void* codes = nullptr;   // u8 [E, n, k/2], ModelOpt packing (element 2j in the low nibble)
  const void* scales = nullptr;  // e4m3 [E, n, k/16], linear (checkpoint layout)
  int64_t experts = 0;
  int64_t n = 0;                 // output features, multiple of 64
  int64_t k = 0;                 // reduction size, multiple of 64
  RowOrder row_order = RowOrder::kIdentity;
  void* prepared = nullptr;      // prepared_weight_bytes(E, n, k) bytes
  // Device int32 [2], set to {-1, 0} by the caller before the launch. After it, the first bad
  // scale found (NaN, or negative and non-zero) is reported as {flat scale index, byte}.
  int* error = nullptr;
};
// Enqueues the preparation. Blocks whose scale is zero get zero codes (they decode to 0 whatever
// the encoded scale). The caller checks `error` after synchronizing.
Status prepare_nvfp4_weights(const PrepareWeightsArgs& args, void* stream) noexcept;

// Tile configurations of the grouped GEMM (weights rows x tokens per CTA tile).
enum class GemmTile : int32_t {
  kAuto = 0,       // pick from total rows and experts (see choose_gemm_tile)
  kM128N16 = 1,    // decode: few rows per expert
  kM128N128 = 2,   // prefill: many rows per expert
  kM128N64 = 3,    // between: tens of rows per expert
};

// The heuristic: the host knows total_rows (= tokens x top-k) and the expert count, not how many
// rows each expert got. Average rows per expert <= 16: N16; <= 80: N64; else N128.
GemmTile choose_gemm_tile(int64_t total_rows, int64_t experts) noexcept;

// What the grouped GEMM's epilogue computes and writes.
enum class GemmEpilogue : int32_t {
  kPlain = 0,        // out [rows, n] = acc * g, in prepared feature order
  // The first MoE GEMM on kGateUpBands8 weights (n = 2I), SwiGLU in the epilogue:
  kInterleaved = 1,  // out [rows, 2I] as [gate 8b..8b+7, silu(gate)*up 8b..8b+7] for b = 0..I/8
  kSwigluBf16 = 2,   // out [rows, I] = silu(gate) * up, compact (half the width)
  // silu(gate) * up rounded to BF16 (as kSwigluBf16), then quantized to NVFP4 in the epilogue
  // with the recipe of quantize_nvfp4 and the activation decode scale of the row's expert: out =
  // codes u8 [rows, I/2], out_scales = E4M3 scales in the grouped 128x4 layout with per-expert
  // regions (grouped_scale_bytes(total_rows, E, I) bytes, zeroed by the launch first). The bytes
  // equal quantize_nvfp4_grouped(kContiguous) of the kSwigluBf16 output.
  kSwigluNvfp4 = 3,
};

struct GroupedGemmArgs {
  const void* prepared = nullptr;        // prepare_nvfp4_weights output
  // Device f32 [E, 2]: per expert, the decode scale of the output features f with f % 16 < 8 and
  // of the others. Equal for plain weights; gate and up scales for kGateUpBands8 weights.
  const float* decode_scale = nullptr;
  int64_t experts = 0;
  int64_t n = 0;                         // multiple of 64
  int64_t k = 0;                         // multiple of 64
  const void* x = nullptr;               // bf16 [total_rows, k], 16-byte aligned
  int64_t total_rows = 0;                // rows of x and out (may exceed expert_offsets[E])
  const int* expert_offsets = nullptr;   // device i32 [E+1]: rows of expert e are [off[e], off[e+1])
  void* out = nullptr;                   // bf16 [total_rows, n] (n / 2 for kSwigluBf16; codes for kSwigluNvfp4), 16-byte aligned
  void* out_scales = nullptr;            // kSwigluNvfp4: the E4M3 scales (see above)
  const float* act_decode_scales = nullptr;  // kSwigluNvfp4: device f32 [1] or [E]
  int64_t num_act_decode_scales = 0;     // kSwigluNvfp4: 1 or E
  GemmTile tile = GemmTile::kAuto;
  GemmEpilogue epilogue = GemmEpilogue::kPlain;  // the SwiGLU ones need kGateUpBands8 weights
};
// One launch for all experts; per-expert row counts are read on the device (no host sync; valid
// inside CUDA-graph capture). Rows past expert_offsets[E] are not written.
Status grouped_gemm_nvfp4(const GroupedGemmArgs& args, void* stream) noexcept;

}  // namespace nvfp4moe
