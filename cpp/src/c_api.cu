// The C ABI (nvfp4moe/nvfp4moe_c.h) over the C++ core: handles, the device of the caller's
// stream, struct_size checks. Host code only. Nothing here throws (allocations are nothrow) and
// every path returns a status.
#include "nvfp4moe/nvfp4moe.h"
#include "nvfp4moe/nvfp4moe_c.h"
#include "status.hpp"

#include <cuda_runtime.h>

#include <new>

using nvfp4moe::fail;
using nvfp4moe::Status;

struct nvfp4moe_weights {
  int device;
  void* prepared;         // prepared_weight_bytes(experts, n, k)
  float* decode_scales;   // [experts, 2]
  int64_t experts, n, k;
  nvfp4moe::RowOrder row_order;
};

struct nvfp4moe_layer {
  int device;
  nvfp4moe::MoeLayerDesc desc;
};

namespace {

nvfp4moe_Status raw(Status s) { return static_cast<int32_t>(s); }

Status cuda_fail(const char* what, cudaError_t e) {
  return fail(e == cudaErrorMemoryAllocation ? Status::kOutOfMemory : Status::kCudaError, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
}

// Makes the stream's device current for the guard's life, and the caller's current device current
// again after it.
class DeviceGuard {
 public:
  ~DeviceGuard() {
    if (switched_) (void)cudaSetDevice(previous_);
  }
  Status enter(void* stream, const char* what) {
    cudaError_t e = cudaGetDevice(&previous_);
    if (e != cudaSuccess) return cuda_fail(what, e);
    device_ = previous_;
    if (stream) {
      // cudaStreamGetDevice is not permitted while the stream captures (it invalidates a capture in
      // global mode, PyTorch's default), so a capturing stream is taken to be on the current
      // device: a capture on another device's stream then fails at the first kernel launch
      // (launches need the stream's device current), never runs on the wrong device.
      cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
      e = cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &capture);
      if (e != cudaSuccess) return cuda_fail(what, e);
      if (capture == cudaStreamCaptureStatusNone) {
        e = cudaStreamGetDevice(static_cast<cudaStream_t>(stream), &device_);
        if (e != cudaSuccess) return cuda_fail(what, e);
      }
    }
    if (device_ != previous_) {
      e = cudaSetDevice(device_);
      if (e != cudaSuccess) return cuda_fail(what, e);
      switched_ = true;
    }
    return Status::kSuccess;
  }
  int device() const { return device_; }

 private:
  int previous_ = 0, device_ = 0;
  bool switched_ = false;
};

// Device memory freed on scope exit unless released.
struct DeviceBuffer {
  void* p = nullptr;
  ~DeviceBuffer() {
    if (p) (void)cudaFree(p);
  }
  void* release() {
    void* r = p;
    p = nullptr;
    return r;
  }
};

template <class T>
Status check_struct(const T* args, const char* what) {
  if (!args) return fail(Status::kNullPointer, "%s: null arguments", what);
  if (args->struct_size < static_cast<int64_t>(sizeof(T))) {
    return fail(Status::kInvalidShape, "%s: struct_size %lld, this library needs at least %lld (set it to sizeof)", what,
                static_cast<long long>(args->struct_size), static_cast<long long>(sizeof(T)));
  }
  return Status::kSuccess;
}

Status weights_create(const nvfp4moe_WeightsCreateArgs* a, void* stream, nvfp4moe_weights** out) {
  constexpr const char* what = "nvfp4moe_weights_create";
  if (!out) return fail(Status::kNullPointer, "%s: null out", what);
  *out = nullptr;
  if (Status s = check_struct(a, what); s != Status::kSuccess) return s;
  const bool gate_up = a->up_decode_scales != nullptr;
  nvfp4moe::PrepareWeightsArgs p;
  p.codes = a->codes;
  p.scales = a->scales;
  p.experts = a->experts;
  p.n = a->n;
  p.k = a->k;
  p.row_order = gate_up ? nvfp4moe::RowOrder::kGateUpBands8 : nvfp4moe::RowOrder::kIdentity;
  // The shapes and the decode scales before anything is allocated.
  if (Status s = nvfp4moe::prepare_moe_weights_can_implement(p, a->decode_scales, a->up_decode_scales);
      s != Status::kSuccess) {
    return s;
  }
  if (!a->codes || !a->scales) return fail(Status::kNullPointer, "%s: codes and scales are required", what);
  DeviceGuard guard;
  if (Status s = guard.enter(stream, what); s != Status::kSuccess) return s;
  DeviceBuffer prepared, pairs, error;
  const size_t bytes = nvfp4moe::prepared_weight_bytes(a->experts, a->n, a->k);
  cudaError_t e = cudaMalloc(&prepared.p, bytes);
  if (e == cudaSuccess) e = cudaMalloc(&pairs.p, size_t(2 * a->experts) * sizeof(float));
  if (e == cudaSuccess) e = cudaMalloc(&error.p, 2 * sizeof(int));
  if (e != cudaSuccess) return cuda_fail(what, e);
  p.prepared = prepared.p;
  p.error = static_cast<int*>(error.p);
  if (Status s = nvfp4moe::prepare_moe_weights(p, a->decode_scales, a->up_decode_scales, static_cast<float*>(pairs.p),
                                               stream);
      s != Status::kSuccess) {
    return s;
  }
  auto* w = new (std::nothrow) nvfp4moe_weights{guard.device(), nullptr, nullptr, a->experts, a->n, a->k, p.row_order};
  if (!w) return fail(Status::kOutOfMemory, "%s: out of host memory", what);
  w->prepared = prepared.release();
  w->decode_scales = static_cast<float*>(pairs.release());
  *out = w;
  return Status::kSuccess;
}

Status layer_create(const nvfp4moe_LayerCreateArgs* a, nvfp4moe_layer** out) {
  constexpr const char* what = "nvfp4moe_layer_create";
  if (!out) return fail(Status::kNullPointer, "%s: null out", what);
  *out = nullptr;
  if (Status s = check_struct(a, what); s != Status::kSuccess) return s;
  const nvfp4moe_weights *w13 = a->w13, *w2 = a->w2;
  if (!w13 || !w2) return fail(Status::kInvalidHandle, "%s: null weights handle", what);
  if (w13->row_order != nvfp4moe::RowOrder::kGateUpBands8 || w2->row_order != nvfp4moe::RowOrder::kIdentity) {
    return fail(Status::kInvalidHandle,
                "%s: w13 must be created with up_decode_scales (gate and up), w2 without (a plain projection)", what);
  }
  if (w13->device != w2->device) {
    return fail(Status::kInvalidHandle, "%s: w13 is on device %d, w2 on device %d", what, w13->device, w2->device);
  }
  if (w13->experts != w2->experts || w13->n != 2 * w2->k || w13->k != w2->n) {
    return fail(Status::kInvalidShape,
                "%s: w13 [%lld, %lld, %lld] and w2 [%lld, %lld, %lld] are not [E, 2I, H] and [E, H, I]", what,
                static_cast<long long>(w13->experts), static_cast<long long>(w13->n), static_cast<long long>(w13->k),
                static_cast<long long>(w2->experts), static_cast<long long>(w2->n), static_cast<long long>(w2->k));
  }
  nvfp4moe::MoeLayerDesc d = a->options;
  d.w13_prepared = w13->prepared;
  d.w13_decode_scales = w13->decode_scales;
  d.w2_prepared = w2->prepared;
  d.w2_decode_scales = w2->decode_scales;
  d.experts = w13->experts;
  d.hidden = w2->n;
  d.intermediate = w2->k;
  if (Status s = nvfp4moe::moe_layer_can_implement(d); s != Status::kSuccess) return s;
  auto* l = new (std::nothrow) nvfp4moe_layer{w13->device, d};
  if (!l) return fail(Status::kOutOfMemory, "%s: out of host memory", what);
  *out = l;
  return Status::kSuccess;
}

// The stream's device made current, and checked to be the layer's.
Status enter_layer(DeviceGuard& guard, const nvfp4moe_layer* layer, void* stream, const char* what) {
  if (!layer) return fail(Status::kInvalidHandle, "%s: null layer", what);
  if (Status s = guard.enter(stream, what); s != Status::kSuccess) return s;
  if (guard.device() != layer->device) {
    return fail(Status::kInvalidHandle, "%s: the stream is on device %d (the current device, for a capturing stream), "
                "the layer's weights on device %d", what, guard.device(), layer->device);
  }
  return Status::kSuccess;
}

}  // namespace

extern "C" {

int nvfp4moe_version(void) { return nvfp4moe::version(); }

const char* nvfp4moe_status_string(nvfp4moe_Status status) {
  return nvfp4moe::status_string(static_cast<Status>(status));
}

const char* nvfp4moe_last_error(void) { return nvfp4moe::last_error_message(); }

nvfp4moe_Status nvfp4moe_weights_create(const nvfp4moe_WeightsCreateArgs* args, void* stream, nvfp4moe_weights** out) {
  return raw(weights_create(args, stream, out));
}

nvfp4moe_Status nvfp4moe_weights_destroy(nvfp4moe_weights* w) {
  if (!w) return raw(Status::kSuccess);
  // The weights' device current for the frees (its allocations are there), the caller's after.
  int previous = 0;
  cudaError_t e = cudaGetDevice(&previous);
  const bool switched = e == cudaSuccess && previous != w->device;
  if (switched) e = cudaSetDevice(w->device);
  cudaError_t f1 = cudaFree(w->prepared), f2 = cudaFree(w->decode_scales);
  if (switched) (void)cudaSetDevice(previous);
  delete w;
  if (e == cudaSuccess) e = f1 != cudaSuccess ? f1 : f2;
  return raw(e == cudaSuccess ? Status::kSuccess : cuda_fail("nvfp4moe_weights_destroy", e));
}

nvfp4moe_Status nvfp4moe_layer_create(const nvfp4moe_LayerCreateArgs* args, nvfp4moe_layer** out) {
  return raw(layer_create(args, out));
}

nvfp4moe_Status nvfp4moe_layer_destroy(nvfp4moe_layer* layer) {
  delete layer;
  return raw(Status::kSuccess);
}

nvfp4moe_Status nvfp4moe_layer_workspace_size(const nvfp4moe_layer* layer, size_t* bytes) {
  if (!layer) return raw(fail(Status::kInvalidHandle, "nvfp4moe_layer_workspace_size: null layer"));
  if (!bytes) return raw(fail(Status::kNullPointer, "nvfp4moe_layer_workspace_size: null bytes"));
  *bytes = nvfp4moe::moe_layer_workspace_bytes(layer->desc);
  return raw(Status::kSuccess);
}

nvfp4moe_Status nvfp4moe_layer_workspace_init(const nvfp4moe_layer* layer, void* workspace, size_t workspace_bytes,
                                              void* stream) {
  DeviceGuard guard;
  if (Status s = enter_layer(guard, layer, stream, "nvfp4moe_layer_workspace_init"); s != Status::kSuccess) {
    return raw(s);
  }
  return raw(nvfp4moe::moe_layer_initialize(layer->desc, workspace, static_cast<int64_t>(workspace_bytes), stream));
}

nvfp4moe_Status nvfp4moe_layer_forward(const nvfp4moe_layer* layer, const nvfp4moe_ForwardArgs* args, void* stream) {
  constexpr const char* what = "nvfp4moe_layer_forward";
  if (!layer) return raw(fail(Status::kInvalidHandle, "%s: null layer", what));
  if (Status s = check_struct(args, what); s != Status::kSuccess) return raw(s);
  DeviceGuard guard;
  if (Status s = enter_layer(guard, layer, stream, what); s != Status::kSuccess) return raw(s);
  return raw(nvfp4moe::moe_layer_forward(layer->desc, args->args, stream));
}

nvfp4moe_Status nvfp4moe_layer_check(const nvfp4moe_layer* layer, void* workspace, size_t workspace_bytes, int64_t top_k,
                                     void* stream, int32_t* found, int64_t* token, int64_t* slot, int32_t* id) {
  constexpr const char* what = "nvfp4moe_layer_check";
  if (!layer) return raw(fail(Status::kInvalidHandle, "%s: null layer", what));
  if (!found || !token || !slot || !id) return raw(fail(Status::kNullPointer, "%s: null result pointer", what));
  if (top_k < 1 || top_k > layer->desc.max_top_k) {
    return raw(fail(Status::kInvalidShape, "%s: top_k %lld must be in 1..=%lld (the layer's max_top_k)", what,
                    static_cast<long long>(top_k), static_cast<long long>(layer->desc.max_top_k)));
  }
  DeviceGuard guard;
  if (Status s = enter_layer(guard, layer, stream, what); s != Status::kSuccess) return raw(s);
  unsigned long long word = 0;
  Status s = nvfp4moe::moe_layer_read_error(layer->desc, workspace, static_cast<int64_t>(workspace_bytes), stream, &word);
  if (s != Status::kSuccess) return raw(s);
  *found = word != ~0ull ? 1 : 0;
  const int64_t pair = *found ? static_cast<int64_t>(word >> 32) : 0;
  *token = *found ? pair / top_k : 0;
  *slot = *found ? pair % top_k : 0;
  *id = *found ? static_cast<int32_t>(static_cast<uint32_t>(word)) : 0;
  return raw(Status::kSuccess);
}

}  // extern "C"
