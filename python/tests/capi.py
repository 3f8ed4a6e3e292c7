"""The core's C ABI (nvfp4moe_c.h) through ctypes, over the library the package ships: the same
layer as nvfp4_moe.MoeLayer built from the same tensors, for the tests' byte comparison and the
bench's host-cost and graph-replay comparison. Not part of the package."""

from __future__ import annotations

import ctypes
import glob
import os
import re
from typing import Optional

import torch

import nvfp4_moe
from nvfp4_moe.layer import Projection

# The core library the package ships (under its SONAME): exactly one, the one the operator links.
_libs = glob.glob(os.path.join(os.path.dirname(nvfp4_moe.__file__), "libnvfp4moe.so*"))
assert len(_libs) == 1, f"expected one core library beside the package, found {_libs}"
lib = ctypes.CDLL(_libs[0])

c_i64, c_i32, c_f32, c_ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p


class WeightsCreateArgs(ctypes.Structure):
    _fields_ = [("struct_size", c_i64), ("codes", c_ptr), ("scales", c_ptr), ("experts", c_i64), ("n", c_i64),
                ("k", c_i64), ("decode_scales", c_ptr), ("up_decode_scales", c_ptr)]


class MoeLayerDesc(ctypes.Structure):
    _fields_ = [("w13_prepared", c_ptr), ("w13_decode_scales", c_ptr), ("w2_prepared", c_ptr),
                ("w2_decode_scales", c_ptr), ("experts", c_i64), ("hidden", c_i64), ("intermediate", c_i64),
                ("max_tokens", c_i64), ("max_top_k", c_i64), ("tile", c_i32), ("intermediate_format", c_i32),
                ("intermediate_decode_scale", c_f32), ("batch_invariant", c_i32), ("expert_map", c_ptr),
                ("global_experts", c_i64), ("output_format", c_i32)]


class LayerCreateArgs(ctypes.Structure):
    _fields_ = [("struct_size", c_i64), ("w13", c_ptr), ("w2", c_ptr), ("options", MoeLayerDesc)]


class MoeForwardArgs(ctypes.Structure):
    _fields_ = [("hidden", c_ptr), ("tokens", c_i64), ("top_k", c_i64), ("topk_ids", c_ptr), ("topk_weights", c_ptr),
                ("router_logits", c_ptr), ("renormalize", c_i32), ("out", c_ptr), ("workspace", c_ptr),
                ("workspace_bytes", c_i64)]


class ForwardArgs(ctypes.Structure):
    _fields_ = [("struct_size", c_i64), ("args", MoeForwardArgs)]


# (types.h's layout by C's rules: the core refuses a struct_size below its own sizeof.)
assert ctypes.sizeof(WeightsCreateArgs) == 64 and ctypes.sizeof(MoeLayerDesc) == 112
assert ctypes.sizeof(LayerCreateArgs) == 136
assert ctypes.sizeof(ForwardArgs) == 88

lib.nvfp4moe_last_error.restype = ctypes.c_char_p
lib.nvfp4moe_last_error.argtypes = []
lib.nvfp4moe_status_string.restype = ctypes.c_char_p
lib.nvfp4moe_status_string.argtypes = [c_i32]
lib.nvfp4moe_version.restype = ctypes.c_int
lib.nvfp4moe_version.argtypes = []
_major, _minor, _patch = (int(re.match(r"\d+", v).group()) for v in nvfp4_moe.__version__.split(".")[:3])  # type: ignore[union-attr]
assert lib.nvfp4moe_version() == _major * 10000 + _minor * 100 + _patch, "core library and package versions differ"
_P = ctypes.POINTER
for name, args in {
    "nvfp4moe_weights_create": [_P(WeightsCreateArgs), c_ptr, _P(c_ptr)],
    "nvfp4moe_weights_destroy": [c_ptr],
    "nvfp4moe_layer_create": [_P(LayerCreateArgs), _P(c_ptr)],
    "nvfp4moe_layer_destroy": [c_ptr],
    "nvfp4moe_layer_workspace_size": [c_ptr, _P(ctypes.c_size_t)],
    "nvfp4moe_layer_workspace_init": [c_ptr, c_ptr, ctypes.c_size_t, c_ptr],
    "nvfp4moe_layer_forward": [c_ptr, _P(ForwardArgs), c_ptr],
    "nvfp4moe_layer_check": [c_ptr, c_ptr, ctypes.c_size_t, c_i64, c_ptr, _P(c_i32), _P(c_i64), _P(c_i64), _P(c_i32)],
}.items():
    getattr(lib, name).argtypes = args
    getattr(lib, name).restype = c_i32


def _ok(status: int, what: str) -> None:
    if status != 0:
        msg = lib.nvfp4moe_last_error()
        raise RuntimeError(f"{what}: status {status}: {msg.decode() if msg else ''}")


class CLayer:
    """The C ABI's layer over the same checkpoint tensors (gate, up, down) as a MoeLayer."""

    def __init__(self, gate: Projection, up: Projection, down: Projection, max_tokens: int, top_k: int) -> None:
        stream = c_ptr(torch.cuda.current_stream().cuda_stream)

        def create(p: Projection, up_p: Optional[Projection]) -> c_ptr:
            codes = (p.codes if up_p is None else torch.cat([p.codes, up_p.codes], dim=1)).contiguous()
            scales = (p.scales if up_p is None else torch.cat([p.scales, up_p.scales], dim=1)).contiguous()
            # The core reads E host decode scales (and E up ones): exactly E, or it reads past them.
            g = p.decode_scales.float().cpu().contiguous()
            ug = up_p.decode_scales.float().cpu().contiguous() if up_p is not None else None
            assert g.numel() == codes.shape[0] and (ug is None or ug.numel() == codes.shape[0])
            a = WeightsCreateArgs(ctypes.sizeof(WeightsCreateArgs), codes.data_ptr(), scales.data_ptr(),
                                  codes.shape[0], codes.shape[1], codes.shape[2] * 2, g.data_ptr(),
                                  ug.data_ptr() if ug is not None else None)
            h = c_ptr()
            _ok(lib.nvfp4moe_weights_create(ctypes.byref(a), stream, ctypes.byref(h)), "nvfp4moe_weights_create")
            return h

        self.w13, self.w2 = create(gate, up), create(down, None)
        la = LayerCreateArgs(ctypes.sizeof(LayerCreateArgs), self.w13, self.w2)
        la.options.max_tokens, la.options.max_top_k, la.options.intermediate_decode_scale = max_tokens, top_k, 1.0
        self.layer = c_ptr()
        _ok(lib.nvfp4moe_layer_create(ctypes.byref(la), ctypes.byref(self.layer)), "nvfp4moe_layer_create")
        size = ctypes.c_size_t()
        _ok(lib.nvfp4moe_layer_workspace_size(self.layer, ctypes.byref(size)), "workspace_size")
        self.workspace = torch.empty(size.value, dtype=torch.uint8, device="cuda")
        _ok(lib.nvfp4moe_layer_workspace_init(self.layer, c_ptr(self.workspace.data_ptr()), ctypes.c_size_t(size.value),
                                              stream), "workspace_init")
        self.hidden = gate.codes.shape[2] * 2

    def args(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> ForwardArgs:
        """The forward's argument struct (reusable: the C call copies nothing). It keeps the tensors
        whose addresses it holds alive."""
        f = ForwardArgs(ctypes.sizeof(ForwardArgs))
        f._keep = (x, ids, w, out)  # type: ignore[attr-defined]
        f.args.hidden, f.args.tokens, f.args.top_k = x.data_ptr(), x.shape[0], ids.shape[1]
        f.args.topk_ids, f.args.topk_weights, f.args.out = ids.data_ptr(), w.data_ptr(), out.data_ptr()
        f.args.workspace, f.args.workspace_bytes = self.workspace.data_ptr(), self.workspace.numel()
        return f

    def forward_args(self, f: ForwardArgs, stream: Optional[c_ptr] = None) -> None:
        """One forward on `stream` (default: PyTorch's current stream, looked up per call: a capture
        runs on its own stream)."""
        s = stream if stream is not None else c_ptr(torch.cuda.current_stream().cuda_stream)
        _ok(lib.nvfp4moe_layer_forward(self.layer, ctypes.byref(f), s), "nvfp4moe_layer_forward")

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], self.hidden, dtype=torch.bfloat16, device=x.device)
        self.forward_args(self.args(x, ids, w, out))
        return out

    def close(self) -> None:
        """Frees the handles (once: a second close does nothing)."""
        if self.layer is None:
            return
        torch.cuda.synchronize()
        _ok(lib.nvfp4moe_layer_destroy(self.layer), "nvfp4moe_layer_destroy")
        _ok(lib.nvfp4moe_weights_destroy(self.w13), "nvfp4moe_weights_destroy")
        _ok(lib.nvfp4moe_weights_destroy(self.w2), "nvfp4moe_weights_destroy")
        self.layer = self.w13 = self.w2 = None  # type: ignore[assignment]
