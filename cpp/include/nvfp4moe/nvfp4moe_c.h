/* nvfp4moe_c.h: the C ABI of the nvfp4-moe core (plain C99; usable from C, Python ctypes/cffi, Go,
 * Zig). One MoE feed-forward layer over NVFP4 weights on NVIDIA Hopper:
 *
 *   nvfp4moe_weights_create   prepare a projection's NVFP4 weights (already in device memory)
 *   nvfp4moe_layer_create     a layer over prepared W13 (gate and up) and W2 (down) weights
 *   nvfp4moe_layer_workspace_size, nvfp4moe_layer_workspace_init
 *   nvfp4moe_layer_forward    one forward: with precomputed top-k ids and weights, or router logits
 *   nvfp4moe_layer_check      the first bad expert id since the last check
 *   nvfp4moe_layer_destroy, nvfp4moe_weights_destroy
 *
 * Every function returns an nvfp4moe_Status (NVFP4MOE_Status_kSuccess = 0); on any other status,
 * nvfp4moe_last_error() is this thread's message for it. Arguments are checked before anything is
 * enqueued. No C++ exception crosses this interface.
 *
 * Devices and streams: `stream` is a cudaStream_t passed as void*; the device is the stream's
 * (cudaStreamGetDevice), and the calling thread's current device is the same after a call as
 * before it (switched with cudaSetDevice: the devices' primary contexts, as the CUDA runtime uses
 * them). The null stream means the current device's legacy default stream. Every pointer must be
 * on that device. The one exception: a stream that is capturing a CUDA graph cannot be asked its
 * device (cudaStreamGetDevice would invalidate the capture), so during capture the current device
 * is taken for the stream's. Make the stream's device current before capturing (PyTorch's
 * torch.cuda.graph does): otherwise a layer on another device than the current one is refused
 * (kInvalidHandle, naming the current device), and a stream of another device than the current
 * one, which is also the layer's, fails at the first kernel launch with a CUDA error.
 *
 * Threads: handles are immutable after creation. Forwards of one layer may run concurrently on
 * different streams, each with its own workspace; a workspace serves one forward at a time.
 * Destroying a handle while work that uses it is enqueued is the caller's error: synchronize first.
 *
 * Growth: every argument struct starts with `struct_size`, which the caller sets to
 * sizeof(the struct) as its header declares it; a later version accepts the sizes of earlier ones
 * (this one, the first, needs its own).
 *
 * NVFP4 (shared/design/NVFP4.md): value = e2m1(code) * e4m3(block scale) * g, g the FP32 per-tensor
 * decode scale (ModelOpt's weight_scale_2; a "global scale" elsewhere is 1/g). */
#ifndef NVFP4MOE_C_H_
#define NVFP4MOE_C_H_

#include <stddef.h>
#include <stdint.h>

#include "nvfp4moe/export.h"
#include "nvfp4moe/types.h"
#include "nvfp4moe/version.h"

#ifdef __cplusplus
/* C++ sees the C names too: the status as the C int32_t, the parameter structs as the C++ API's
 * (the same declaration in types.h, the same layout). */
typedef int32_t nvfp4moe_Status;
typedef ::nvfp4moe::MoeLayerDesc nvfp4moe_MoeLayerDesc;
typedef ::nvfp4moe::MoeForwardArgs nvfp4moe_MoeForwardArgs;
extern "C" {
#endif

typedef struct nvfp4moe_weights nvfp4moe_weights; /* prepared NVFP4 weights of one projection */
typedef struct nvfp4moe_layer nvfp4moe_layer;     /* a MoE layer over two prepared projections */

/* One projection's NVFP4 weights in checkpoint layout, in device memory. */
typedef struct nvfp4moe_WeightsCreateArgs {
  int64_t struct_size;          /* sizeof(nvfp4moe_WeightsCreateArgs) */
  const void* codes;            /* device u8 [E, n, k/2], element 2j in the low nibble (ModelOpt packing) */
  const void* scales;           /* device E4M3 [E, n, k/16], row-major (checkpoint layout) */
  int64_t experts;              /* E, in [1, NVFP4MOE_kExpertLimit] */
  int64_t n;                    /* rows per expert (output features), a multiple of 64 */
  int64_t k;                    /* columns (reduction size), a multiple of 64 */
  /* Host f32 [E]: each expert's decode scale g (finite, > 0). For W13, the gate rows' (the first
   * n/2 rows of each expert). */
  const float* decode_scales;
  /* Host f32 [E], or NULL. Non-NULL makes this W13 (gate and up, n = 2I): each expert's rows are
   * [gate (n/2); up (n/2)] and these are the up rows' decode scales; the rows are prepared in the
   * order the SwiGLU epilogue needs. NULL: a plain projection (W2). */
  const float* up_decode_scales;
} nvfp4moe_WeightsCreateArgs;

/* A layer over W13 and W2 handles. The handles must outlive the layer. */
typedef struct nvfp4moe_LayerCreateArgs {
  int64_t struct_size;              /* sizeof(nvfp4moe_LayerCreateArgs) */
  const nvfp4moe_weights* w13;      /* gate and up: created with up_decode_scales, n = 2I, k = H */
  const nvfp4moe_weights* w2;       /* down: n = H, k = I */
  /* max_tokens, max_top_k, tile, intermediate_format, intermediate_decode_scale, batch_invariant,
   * output_format, and for an expert shard expert_map and global_experts, as in
   * nvfp4moe_MoeLayerDesc (types.h); its weight pointers, experts, hidden and intermediate are
   * ignored (they come from w13 and w2). An expert_map is the caller's device array on the weights'
   * device (4-byte aligned), read by every forward: it must outlive the layer, like the handles,
   * and must not be written while a forward that reads it is enqueued. */
  nvfp4moe_MoeLayerDesc options;
} nvfp4moe_LayerCreateArgs;

/* One forward: the fields of nvfp4moe_MoeForwardArgs (types.h) after struct_size. */
typedef struct nvfp4moe_ForwardArgs {
  int64_t struct_size;              /* sizeof(nvfp4moe_ForwardArgs) */
  nvfp4moe_MoeForwardArgs args;
} nvfp4moe_ForwardArgs;

/* NVFP4MOE_VERSION of the library (version.h holds the headers'). */
NVFP4MOE_API int nvfp4moe_version(void);
/* A short static description of a status. */
NVFP4MOE_API const char* nvfp4moe_status_string(nvfp4moe_Status status);
/* This thread's message for the last non-success status (valid until the next call on this thread). */
NVFP4MOE_API const char* nvfp4moe_last_error(void);

/* Prepares weights on the stream's device (allocates the prepared copy, device memory owned by the
 * handle). Synchronizes `stream` once, to report a bad scale byte (NaN or negative) as an error
 * naming the expert, row and block. The inputs may be freed when it returns. */
NVFP4MOE_API nvfp4moe_Status nvfp4moe_weights_create(const nvfp4moe_WeightsCreateArgs* args, void* stream,
                                                     nvfp4moe_weights** out);
/* Frees the handle and its device memory (NULL: nothing). */
NVFP4MOE_API nvfp4moe_Status nvfp4moe_weights_destroy(nvfp4moe_weights* weights);

/* A layer over two prepared projections (host memory only; nothing is allocated on the device). */
NVFP4MOE_API nvfp4moe_Status nvfp4moe_layer_create(const nvfp4moe_LayerCreateArgs* args, nvfp4moe_layer** out);
NVFP4MOE_API nvfp4moe_Status nvfp4moe_layer_destroy(nvfp4moe_layer* layer);

/* Bytes of a workspace for forwards of up to max_tokens x max_top_k pairs. */
NVFP4MOE_API nvfp4moe_Status nvfp4moe_layer_workspace_size(const nvfp4moe_layer* layer, size_t* bytes);
/* Sets a workspace up (enqueued on `stream`), once before its first forward. It holds the
 * layer's NVFP4 intermediate decode scale from then on: a workspace serves the layer it was set up
 * for (another layer of the same shape and format would run with this one's decode scale). */
NVFP4MOE_API nvfp4moe_Status nvfp4moe_layer_workspace_init(const nvfp4moe_layer* layer, void* workspace,
                                                           size_t workspace_bytes, void* stream);
/* One forward, enqueued on `stream`: no allocation, no host synchronization, valid inside CUDA-graph
 * capture. With args.topk_ids NULL, routes by softmax top-k over args.router_logits. */
NVFP4MOE_API nvfp4moe_Status nvfp4moe_layer_forward(const nvfp4moe_layer* layer, const nvfp4moe_ForwardArgs* args,
                                                    void* stream);
/* Synchronizes `stream` (the caller chooses when) and reports the first bad expert id (outside
 * [0, E)) that a forward on this workspace met since the last check, then clears it: *found = 0
 * when none, else 1 with the token, slot and id (forwards of `top_k` experts per token). Not an
 * error status: that slot contributed nothing to its token's output. */
NVFP4MOE_API nvfp4moe_Status nvfp4moe_layer_check(const nvfp4moe_layer* layer, void* workspace,
                                                  size_t workspace_bytes, int64_t top_k, void* stream, int32_t* found,
                                                  int64_t* token, int64_t* slot, int32_t* id);

#ifdef __cplusplus
}
#endif

#endif /* NVFP4MOE_C_H_ */
