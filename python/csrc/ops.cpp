// The PyTorch operators of nvfp4_moe (torch.ops.nvfp4_moe.*), over the core's C++ API
// (nvfp4moe/nvfp4moe.h): weight preparation, the workspace, the layer forward and the bad-id check.
// Registered with TORCH_LIBRARY (the CUDA kernels) so that a call costs one dispatch; the fake
// (meta) kernels are Python's (nvfp4_moe/_ops.py). Every argument error is a Python exception
// (TypeError for dtypes, ValueError for shapes, devices and values, RuntimeError for CUDA), raised
// before anything is enqueued.
#ifdef NVFP4MOE_PYTHON_MODULE
#include <Python.h>  // (first, as Python's docs ask: it sets feature macros)
#endif
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/core/GradMode.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <nvfp4moe/nvfp4moe.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;

// A core status as a Python exception: shapes and values are ValueError, the rest RuntimeError.
void check_status(nvfp4moe::Status s, const char* what) {
  if (s == nvfp4moe::Status::kSuccess) return;
  const std::string msg = std::string(what) + ": " + nvfp4moe::status_string(s) + ": " + nvfp4moe::last_error_message();
  TORCH_CHECK_VALUE(s == nvfp4moe::Status::kCudaError || s == nvfp4moe::Status::kOutOfMemory, msg);
  TORCH_CHECK(false, msg);
}

void check_cuda_contiguous(const Tensor& t, const char* name, at::ScalarType dtype, const at::Device& device) {
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.device() == device, name, " must be on ", device, " (where the layer's weights are), got ",
                    t.device());
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK_VALUE(!(c10::GradMode::is_enabled() && t.requires_grad()), name,
                    " requires grad: the operator has no backward (call it under torch.no_grad())");
}

// The layer's configuration, as the Python module passes it: [experts, hidden, intermediate,
// max_tokens, max_top_k, tile, intermediate_format, batch_invariant, global_experts (0: not an
// expert shard), output_format]. The expert map's address is the forward's (its tensor argument).
nvfp4moe::MoeLayerDesc layer_desc(at::IntArrayRef config, double nvfp4_decode_scale) {
  TORCH_CHECK_VALUE(config.size() == 10, "config must hold 10 values, got ", config.size());
  nvfp4moe::MoeLayerDesc d;
  d.experts = config[0];
  d.hidden = config[1];
  d.intermediate = config[2];
  d.max_tokens = config[3];
  d.max_top_k = config[4];
  d.tile = static_cast<nvfp4moe::GemmTile>(config[5]);
  d.intermediate_format = static_cast<nvfp4moe::IntermediateFormat>(config[6]);
  d.batch_invariant = config[7] != 0;
  d.intermediate_decode_scale = static_cast<float>(nvfp4_decode_scale);
  d.global_experts = config[8];
  d.output_format = static_cast<nvfp4moe::OutputFormat>(config[9]);
  // The core checks a shard's counts only with a map: a non-null stand-in until the forward gives
  // the tensor's address (the checks and sizes never read it).
  static const int kMapStandIn = 0;
  if (d.global_experts != 0) d.expert_map = &kMapStandIn;
  return d;
}

// prepare(codes u8 [E, n, k/2], scales u8 or float8_e4m3fn [E, n, k/16], decode_scales f32 [E],
// up_decode_scales f32 [E] or None) -> (prepared u8, decode scale pairs f32 [E, 2]): the core's
// prepare_moe_weights on the codes' device (W13 when up_decode_scales is given: rows [gate; up]
// per expert). Synchronizes the current stream once (a bad scale byte is a ValueError).
std::tuple<Tensor, Tensor> prepare(const Tensor& codes, const Tensor& scales, const Tensor& decode_scales,
                                   const std::optional<Tensor>& up_decode_scales) {
  TORCH_CHECK_VALUE(codes.is_cuda(), "codes must be a CUDA tensor");
  const at::Device device = codes.device();
  check_cuda_contiguous(codes, "codes", at::kByte, device);
  TORCH_CHECK_TYPE(scales.scalar_type() == at::kByte || scales.scalar_type() == at::kFloat8_e4m3fn,
                   "scales must be uint8 or float8_e4m3fn, got ", scales.scalar_type());
  check_cuda_contiguous(scales.view(at::kByte), "scales", at::kByte, device);
  TORCH_CHECK_VALUE(codes.dim() == 3 && scales.dim() == 3, "codes and scales must be [E, n, k/2] and [E, n, k/16]");
  const int64_t e = codes.size(0), n = codes.size(1), k = codes.size(2) * 2;
  TORCH_CHECK_VALUE(scales.size(0) == e && scales.size(1) == n && scales.size(2) * 16 == k,
                    "scales must be [E, n, k/16] = [", e, ", ", n, ", ", k / 16, "], got ", scales.sizes());
  // The decode scales are read on the host (a few floats, once per projection).
  auto host_scales = [&](const Tensor& g, const char* name) {
    TORCH_CHECK_TYPE(g.scalar_type() == at::kFloat, name, " must be float32, got ", g.scalar_type());
    TORCH_CHECK_VALUE(g.numel() == e, name, " must hold ", e, " values (one per expert), got ", g.numel());
    return g.detach().to(at::kCPU).contiguous();
  };
  const Tensor g = host_scales(decode_scales, "decode_scales");
  const Tensor up = up_decode_scales ? host_scales(*up_decode_scales, "up_decode_scales") : Tensor();
  nvfp4moe::PrepareWeightsArgs a;
  a.experts = e;
  a.n = n;
  a.k = k;
  a.row_order = up.defined() ? nvfp4moe::RowOrder::kGateUpBands8 : nvfp4moe::RowOrder::kIdentity;
  check_status(nvfp4moe::prepare_moe_weights_can_implement(a, g.data_ptr<float>(),
                                                           up.defined() ? up.data_ptr<float>() : nullptr),
               "nvfp4_moe.prepare");
  const c10::cuda::CUDAGuard guard(device);
  const auto bytes = static_cast<int64_t>(nvfp4moe::prepared_weight_bytes(e, n, k));
  Tensor prepared = at::empty({bytes}, codes.options());
  Tensor pairs = at::empty({e, 2}, codes.options().dtype(at::kFloat));
  Tensor error = at::empty({2}, codes.options().dtype(at::kInt));
  a.codes = codes.data_ptr();
  a.scales = scales.data_ptr();
  a.prepared = prepared.data_ptr();
  a.error = error.data_ptr<int>();
  check_status(nvfp4moe::prepare_moe_weights(a, g.data_ptr<float>(), up.defined() ? up.data_ptr<float>() : nullptr,
                                             pairs.data_ptr<float>(), c10::cuda::getCurrentCUDAStream(device.index()).stream()),
               "nvfp4_moe.prepare");
  return {prepared, pairs};
}

// The workspace's size for a layer configuration (a ValueError for one the core refuses).
int64_t workspace_bytes(at::IntArrayRef config, double nvfp4_decode_scale) {
  const nvfp4moe::MoeLayerDesc d = layer_desc(config, nvfp4_decode_scale);
  check_status(nvfp4moe::moe_layer_can_implement(d), "nvfp4_moe.workspace_bytes");
  return static_cast<int64_t>(nvfp4moe::moe_layer_workspace_bytes(d));
}

void init_workspace(const Tensor& workspace, at::IntArrayRef config, double nvfp4_decode_scale) {
  TORCH_CHECK_VALUE(workspace.is_cuda(), "workspace must be a CUDA tensor");
  check_cuda_contiguous(workspace, "workspace", at::kByte, workspace.device());
  const c10::cuda::CUDAGuard guard(workspace.device());
  const nvfp4moe::MoeLayerDesc d = layer_desc(config, nvfp4_decode_scale);
  check_status(nvfp4moe::moe_layer_initialize(d, workspace.data_ptr(), workspace.numel(),
                                              c10::cuda::getCurrentCUDAStream().stream()),
               "nvfp4_moe.init_workspace");
}

// The layer's buffers, as the forward reads them: the prepared weights (u8), their decode scale
// pairs (f32; an EagerLayer holds the module's buffers, which keep them as their i32 bits so that
// Module.to(dtype) leaves them alone), the workspace (u8) and an expert shard's map (i32
// [global_experts]). Checked on every forward (a buffer may have been given new storage in place
// since it was last seen).
struct LayerBuffers {
  Tensor w13, w13_scales, w2, w2_scales, workspace;
  std::optional<Tensor> expert_map;
  bool scales_as_bits = false;  // the scales are i32 (an EagerLayer's), else f32
};

void check_buffers(const LayerBuffers& b, const nvfp4moe::MoeLayerDesc& d, const at::Device& device) {
  for (const auto& [t, name, dtype] :
       {std::tuple<const Tensor&, const char*, at::ScalarType>{b.w13, "w13", at::kByte}, {b.w2, "w2", at::kByte},
        {b.workspace, "workspace", at::kByte}}) {
    check_cuda_contiguous(t, name, dtype, device);
  }
  for (const auto& [t, name] : {std::pair<const Tensor&, const char*>{b.w13_scales, "w13_scales"},
                                {b.w2_scales, "w2_scales"}}) {
    check_cuda_contiguous(t, name, b.scales_as_bits ? at::kInt : at::kFloat, device);
  }
  // An expert shard's map: int32 [global_experts] on the layer's device; none for a whole layer.
  TORCH_CHECK_VALUE(b.expert_map.has_value() == (d.global_experts != 0),
                    "expert_map is given exactly for an expert shard (config's global_experts non-zero)");
  if (b.expert_map) {
    check_cuda_contiguous(*b.expert_map, "expert_map", at::kInt, device);
    TORCH_CHECK_VALUE(b.expert_map->dim() == 1 && b.expert_map->size(0) == d.global_experts, "expert_map must be [",
                      d.global_experts, "], got ", b.expert_map->sizes());
  }
  TORCH_CHECK_VALUE(
      b.w13.numel() == static_cast<int64_t>(nvfp4moe::prepared_weight_bytes(d.experts, 2 * d.intermediate, d.hidden)) &&
          b.w2.numel() == static_cast<int64_t>(nvfp4moe::prepared_weight_bytes(d.experts, d.hidden, d.intermediate)) &&
          b.w13_scales.numel() == 2 * d.experts && b.w2_scales.numel() == 2 * d.experts,
      "the prepared weights do not match the layer's shape");
}

// hidden bf16 [T, H] on the layer's device.
void check_hidden(const Tensor& hidden, const nvfp4moe::MoeLayerDesc& d, const at::Device& device) {
  check_cuda_contiguous(hidden, "hidden", at::kBFloat16, device);
  TORCH_CHECK_VALUE(hidden.dim() == 2 && hidden.size(1) == d.hidden, "hidden must be [T, ", d.hidden, "], got ",
                    hidden.sizes());
}

// topk_ids i32 and topk_weights f32, both [T, top_k].
void check_topk(const Tensor& ids, const Tensor& weights, int64_t tokens, int64_t top_k, const at::Device& device) {
  check_cuda_contiguous(ids, "topk_ids", at::kInt, device);
  check_cuda_contiguous(weights, "topk_weights", at::kFloat, device);
  TORCH_CHECK_VALUE(ids.dim() == 2 && ids.size(0) == tokens && ids.size(1) == top_k && weights.sizes() == ids.sizes(),
                    "topk_ids and topk_weights must be [T, top_k] = [", tokens, ", ", top_k, "]");
}

at::ScalarType output_dtype(const nvfp4moe::MoeLayerDesc& d) {
  return d.output_format == nvfp4moe::OutputFormat::kFp32 ? at::kFloat : at::kBFloat16;
}

// out [T, H] of the layer's output dtype: a new tensor, or the caller's (checked; it must not
// overlap the inputs the forward reads while it writes out).
Tensor output_for(const Tensor& hidden, const Tensor& topk_ids, const Tensor& topk_weights,
                  const nvfp4moe::MoeLayerDesc& d, const std::optional<Tensor>& given, const at::Device& device) {
  if (!given) return at::empty({hidden.size(0), d.hidden}, hidden.options().dtype(output_dtype(d)));
  check_cuda_contiguous(*given, "out", output_dtype(d), device);
  TORCH_CHECK_VALUE(given->dim() == 2 && given->size(0) == hidden.size(0) && given->size(1) == d.hidden,
                    "out must be [T, H] = [", hidden.size(0), ", ", d.hidden, "], got ", given->sizes());
  for (const auto& [t, name] : {std::pair<const Tensor&, const char*>{hidden, "hidden"}, {topk_ids, "topk_ids"},
                                {topk_weights, "topk_weights"}}) {
    const at::MemOverlapStatus overlap = at::get_overlap_status(*given, t);
    TORCH_CHECK_VALUE(overlap != at::MemOverlapStatus::Full && overlap != at::MemOverlapStatus::Partial,
                      "out overlaps ", name, " (the forward reads it while it writes out)");
  }
  return *given;
}

// The core's forward over checked arguments, on PyTorch's current stream of the layer's device.
void launch_forward(nvfp4moe::MoeLayerDesc d, const LayerBuffers& b, const Tensor& hidden, const Tensor* topk_ids,
                    const Tensor* topk_weights, const Tensor* router_logits, int64_t top_k, bool renormalize,
                    const Tensor& out, const at::Device& device) {
  if (b.expert_map) d.expert_map = b.expert_map->data_ptr<int>();
  d.w13_prepared = b.w13.data_ptr();
  d.w13_decode_scales = static_cast<const float*>(b.w13_scales.data_ptr());
  d.w2_prepared = b.w2.data_ptr();
  d.w2_decode_scales = static_cast<const float*>(b.w2_scales.data_ptr());
  nvfp4moe::MoeForwardArgs a;
  a.hidden = hidden.data_ptr();
  a.tokens = hidden.size(0);
  a.top_k = top_k;
  a.topk_ids = topk_ids ? topk_ids->data_ptr<int>() : nullptr;
  a.topk_weights = topk_weights ? topk_weights->data_ptr<float>() : nullptr;
  a.router_logits = router_logits ? router_logits->data_ptr<float>() : nullptr;
  a.renormalize = renormalize;
  a.out = out.data_ptr();
  a.workspace = b.workspace.data_ptr();
  a.workspace_bytes = b.workspace.numel();
  check_status(nvfp4moe::moe_layer_forward(d, a, c10::cuda::getCurrentCUDAStream(device.index()).stream()),
               "nvfp4_moe.forward");
}

// forward: the layer on PyTorch's current stream; returns out [T, H], bf16 or f32 (config's output_format).
Tensor forward(const Tensor& hidden, const Tensor& w13, const Tensor& w13_scales, const Tensor& w2,
               const Tensor& w2_scales, const std::optional<Tensor>& topk_ids, const std::optional<Tensor>& topk_weights,
               const std::optional<Tensor>& router_logits, int64_t top_k, bool renormalize, const Tensor& workspace,
               const std::optional<Tensor>& expert_map, at::IntArrayRef config, double nvfp4_decode_scale) {
  TORCH_CHECK_VALUE(w13.is_cuda(), "the layer's weights must be CUDA tensors");
  const at::Device device = w13.device();
  const nvfp4moe::MoeLayerDesc d = layer_desc(config, nvfp4_decode_scale);
  check_hidden(hidden, d, device);
  const LayerBuffers b{w13, w13_scales, w2, w2_scales, workspace, expert_map};
  check_buffers(b, d, device);
  const int64_t tokens = hidden.size(0);
  TORCH_CHECK_VALUE(topk_ids.has_value() != router_logits.has_value() && !(router_logits && topk_weights),
                    "give either topk_ids and topk_weights or router_logits");
  if (topk_ids) {
    TORCH_CHECK_VALUE(topk_weights.has_value(), "topk_ids needs topk_weights");
    check_topk(*topk_ids, *topk_weights, tokens, top_k, device);
  } else {
    const int64_t e = d.global_experts ? d.global_experts : d.experts;
    check_cuda_contiguous(*router_logits, "router_logits", at::kFloat, device);
    TORCH_CHECK_VALUE(router_logits->dim() == 2 && router_logits->size(0) == tokens && router_logits->size(1) == e,
                      "router_logits must be [T, E] = [", tokens, ", ", e, "], got ", router_logits->sizes());
  }
  const c10::cuda::CUDAGuard guard(device);
  const Tensor out = at::empty({tokens, d.hidden}, hidden.options().dtype(output_dtype(d)));
  launch_forward(d, b, hidden, topk_ids ? &*topk_ids : nullptr, topk_weights ? &*topk_weights : nullptr,
                 router_logits ? &*router_logits : nullptr, top_k, renormalize, out, device);
  return out;
}

// An eager forward's state made once (nvfp4_moe._C.layer): the layer's buffers, held by reference
// so they stay alive, scales as their i32 bits, and its descriptor, checked by the core, so that a
// forward with top-k ids passes five arguments through one CPython call instead of fourteen
// through the dispatcher (issue 20's host cost: the 14-argument operator's dispatch, 3-4 us beside
// the output's allocation, was most of what the operator added to the C ABI; a torch.classes
// object as an argument cost 10 us more, H100 2026-12-06). The buffers are checked again on every
// call, as the 14-argument forward checks them.
struct EagerLayer {
  LayerBuffers buffers;
  nvfp4moe::MoeLayerDesc desc;
  at::Device device;

  EagerLayer(Tensor w13, Tensor w13_scales, Tensor w2, Tensor w2_scales, Tensor workspace,
             std::optional<Tensor> expert_map, at::IntArrayRef config, double nvfp4_decode_scale)
      : buffers{std::move(w13),       std::move(w13_scales), std::move(w2), std::move(w2_scales),
                std::move(workspace), std::move(expert_map), /*scales_as_bits=*/true},
        desc(layer_desc(config, nvfp4_decode_scale)),
        device(buffers.w13.device()) {
    TORCH_CHECK_VALUE(device.is_cuda(), "the layer's weights must be CUDA tensors");
    check_buffers(buffers, desc, device);
    check_status(nvfp4moe::moe_layer_can_implement(desc), "nvfp4_moe._C.layer");
  }
};

// The forward with top-k ids (top_k = their columns) of an EagerLayer, into a new tensor or the
// caller's out [T, H] (checked: dtype, shape, no overlap with the inputs).
Tensor forward_topk(const Tensor& hidden, const Tensor& topk_ids, const Tensor& topk_weights,
                    const std::optional<Tensor>& out, const EagerLayer& l) {
  check_hidden(hidden, l.desc, l.device);
  check_topk(topk_ids, topk_weights, hidden.size(0), topk_ids.dim() == 2 ? topk_ids.size(1) : 0, l.device);
  check_buffers(l.buffers, l.desc, l.device);
  const c10::cuda::CUDAGuard guard(l.device);
  Tensor o = output_for(hidden, topk_ids, topk_weights, l.desc, out, l.device);
  // The caller's out is written in place outside the dispatcher: its version counter moves as an
  // in-place operator's would (an inference tensor outside InferenceMode is refused here, before
  // anything is enqueued, as copy_ would refuse it).
  if (out) out->unsafeGetTensorImpl()->bump_version();
  launch_forward(l.desc, l.buffers, hidden, &topk_ids, &topk_weights, nullptr, topk_ids.size(1), false, o, l.device);
  return o;
}

// read_error: synchronizes the current stream and returns the workspace's error word (-1: no bad
// expert id since the last read, else (pair << 32) | id), clearing it.
int64_t read_error(const Tensor& workspace, at::IntArrayRef config, double nvfp4_decode_scale) {
  TORCH_CHECK_VALUE(workspace.is_cuda(), "workspace must be a CUDA tensor");
  check_cuda_contiguous(workspace, "workspace", at::kByte, workspace.device());
  const c10::cuda::CUDAGuard guard(workspace.device());
  unsigned long long word = 0;
  check_status(nvfp4moe::moe_layer_read_error(layer_desc(config, nvfp4_decode_scale), workspace.data_ptr(),
                                              workspace.numel(), c10::cuda::getCurrentCUDAStream().stream(), &word),
               "nvfp4_moe.read_error");
  return static_cast<int64_t>(word);
}

}  // namespace

TORCH_LIBRARY(nvfp4_moe, m) {
  m.def("prepare(Tensor codes, Tensor scales, Tensor decode_scales, Tensor? up_decode_scales) -> (Tensor, Tensor)");
  m.def("workspace_bytes(int[] config, float nvfp4_decode_scale) -> int", &workspace_bytes);
  m.def("init_workspace(Tensor(a!) workspace, int[] config, float nvfp4_decode_scale) -> ()");
  m.def(
      "forward(Tensor hidden, Tensor w13, Tensor w13_scales, Tensor w2, Tensor w2_scales, Tensor? topk_ids, "
      "Tensor? topk_weights, Tensor? router_logits, int top_k, bool renormalize, Tensor(a!) workspace, "
      "Tensor? expert_map, int[] config, float nvfp4_decode_scale) -> Tensor");
  m.def("read_error(Tensor(a!) workspace, int[] config, float nvfp4_decode_scale) -> int");
}

TORCH_LIBRARY_IMPL(nvfp4_moe, CUDA, m) {
  m.impl("prepare", &prepare);
  m.impl("init_workspace", &init_workspace);
  m.impl("forward", &forward);
  m.impl("read_error", &read_error);
}

#ifdef NVFP4MOE_PYTHON_MODULE
// nvfp4_moe._C: this library as a CPython extension module (python/CMakeLists.txt builds it so
// where the interpreter's headers are found). Importing it registers the operators above and gives
// the eager entry points, called with METH_FASTCALL (no argument tuple, no schema parsing):
//   layer(w13, w13_scales, w2, w2_scales, workspace, expert_map, config, nvfp4_decode_scale) -> handle
//   forward(handle, hidden, topk_ids, topk_weights, out) -> out (a new tensor where out is None)
// Argument errors raise TypeError or ValueError, CUDA errors RuntimeError (HANDLE_TH_ERRORS maps
// c10's exceptions), before anything is enqueued.
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

namespace {

constexpr const char* kLayerCapsule = "nvfp4_moe.Layer";

// A copy (a reference count), not a reference into the Python object: with the GIL released,
// another thread's torch.utils.swap_tensors could change what the object holds between the checks
// and the launch.
Tensor tensor_arg(PyObject* o, const char* name) {
  TORCH_CHECK_TYPE(THPVariable_Check(o), name, " must be a torch.Tensor, got ", Py_TYPE(o)->tp_name);
  return THPVariable_Unpack(o);
}

// The GIL released while the forward checks and enqueues (as PyTorch's own operators do), taken
// back on the way out, an exception's included.
struct ReleasedGil {
  PyThreadState* state = PyEval_SaveThread();
  ReleasedGil() = default;
  ReleasedGil(const ReleasedGil&) = delete;
  ReleasedGil& operator=(const ReleasedGil&) = delete;
  ~ReleasedGil() { PyEval_RestoreThread(state); }
};

void destroy_layer(PyObject* capsule) {
  delete static_cast<EagerLayer*>(PyCapsule_GetPointer(capsule, kLayerCapsule));
}

PyObject* eager_layer(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(nargs == 8,
                   "layer(w13, w13_scales, w2, w2_scales, workspace, expert_map, config, nvfp4_decode_scale) takes 8 "
                   "arguments, got ",
                   nargs);
  std::optional<Tensor> expert_map;
  if (args[5] != Py_None) expert_map = tensor_arg(args[5], "expert_map");
  std::vector<int64_t> config;
  {
    PyObject* seq = PySequence_Fast(args[6], "config must be a sequence of ints");
    if (seq == nullptr) return nullptr;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < n; ++i) {
      const long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
      if (v == -1 && PyErr_Occurred()) {
        Py_DECREF(seq);
        return nullptr;
      }
      config.push_back(v);
    }
    Py_DECREF(seq);
  }
  const double g = PyFloat_AsDouble(args[7]);
  if (g == -1.0 && PyErr_Occurred()) return nullptr;
  auto layer = std::make_unique<EagerLayer>(tensor_arg(args[0], "w13"), tensor_arg(args[1], "w13_scales"),
                                            tensor_arg(args[2], "w2"), tensor_arg(args[3], "w2_scales"),
                                            tensor_arg(args[4], "workspace"), std::move(expert_map), config, g);
  PyObject* capsule = PyCapsule_New(layer.get(), kLayerCapsule, destroy_layer);
  if (capsule != nullptr) layer.release();
  return capsule;
  END_HANDLE_TH_ERRORS
}

PyObject* eager_forward(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK_TYPE(nargs == 5, "forward(layer, hidden, topk_ids, topk_weights, out) takes 5 arguments, got ", nargs);
  TORCH_CHECK_TYPE(PyCapsule_IsValid(args[0], kLayerCapsule), "layer must be a handle from nvfp4_moe._C.layer, got ",
                   Py_TYPE(args[0])->tp_name);
  const auto* layer = static_cast<const EagerLayer*>(PyCapsule_GetPointer(args[0], kLayerCapsule));
  const Tensor hidden = tensor_arg(args[1], "hidden");
  const Tensor topk_ids = tensor_arg(args[2], "topk_ids");
  const Tensor topk_weights = tensor_arg(args[3], "topk_weights");
  std::optional<Tensor> out;
  if (args[4] != Py_None) out = tensor_arg(args[4], "out");
  Tensor result;
  {
    const ReleasedGil released;
    result = forward_topk(hidden, topk_ids, topk_weights, out, *layer);
  }
  if (out) {  // the caller's tensor object itself
    Py_INCREF(args[4]);
    return args[4];
  }
  return THPVariable_Wrap(std::move(result));
  END_HANDLE_TH_ERRORS
}

PyMethodDef eager_methods[] = {
    {"layer", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(eager_layer)), METH_FASTCALL,
     "layer(w13, w13_scales, w2, w2_scales, workspace, expert_map, config, nvfp4_decode_scale): an eager forward's "
     "state (the buffers held, scales as int32 bits)"},
    {"forward", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(eager_forward)), METH_FASTCALL,
     "forward(layer, hidden, topk_ids, topk_weights, out): the layer with top-k ids on the current stream; returns "
     "out, or a new tensor where out is None"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef eager_module = {PyModuleDef_HEAD_INIT,
                            "nvfp4_moe._C",
                            "nvfp4_moe's operator library: the torch.ops.nvfp4_moe operators and the eager entry "
                            "points",
                            -1,
                            eager_methods,
                            nullptr,
                            nullptr,
                            nullptr,
                            nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__C() { return PyModule_Create(&eager_module); }
#endif  // NVFP4MOE_PYTHON_MODULE
