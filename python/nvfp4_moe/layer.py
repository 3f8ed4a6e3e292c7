"""The NVFP4 MoE layer as a torch.nn.Module over the core's operator (torch.ops.nvfp4_moe.forward).

Weights come from torch tensors as checkpoints store them, in either NVFP4 dialect (per expert and
projection):

- ModelOpt: ``weight`` uint8 [N, K/2], ``weight_scale`` float8_e4m3fn [N, K/16], ``weight_scale_2``
  float32 = g (the decode scale);
- compressed-tensors: ``weight_packed`` uint8 [N, K/2], ``weight_scale`` float8_e4m3fn [N, K/16],
  ``weight_global_scale`` float32 = 1/g.

A weight is e2m1(code) * e4m3(scale) * g, element 2j of a row in the low nibble of byte j.
"""

from __future__ import annotations

import enum
from typing import Mapping, Optional, Sequence, Union

import torch

from . import _ops  # (loads the operators)

# The overloads themselves: calling a packet (torch.ops.nvfp4_moe.forward) resolves it on every call.
_FORWARD = torch.ops.nvfp4_moe.forward.default
# The eager path with top-k ids: nvfp4_moe._C's METH_FASTCALL entry points over a handle that holds
# the layer's state (issue 20's host cost; None where the library was built without them).
_EAGER_LAYER = _ops.eager.layer if _ops.eager is not None else None
_EAGER_FORWARD = _ops.eager.forward if _ops.eager is not None else None
# The module's cached operator state (dropped whenever a buffer may have been replaced).
_CACHES = ("_op_buffers", "_handle")
# The buffers the operator reads, in its argument order (scales as int32 bits, viewed as float32),
# and an expert shard's map (absent for a whole layer).
_OPERATOR_BUFFERS = ("w13", "w13_scales", "w2", "w2_scales", "workspace")
_EXPERT_MAP = "expert_map"

#: Gate, up and down projection names (Qwen3, DeepSeek-V3); Mixtral's are w1, w3, w2. (The layer
#: computes SwiGLU as silu(gate) * up: models with another activation, such as gpt-oss's clamped
#: one, need their own.)
DEFAULT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte spans of a and b intersect (same device; a span runs from a tensor's first
    element to its last, strides included): conservative, as PyTorch's partial-overlap check."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


class Tile(enum.IntEnum):
    """The grouped GEMM's tile (the core's GemmTile); AUTO chooses per forward."""

    AUTO = 0
    M128N16 = 1
    M128N128 = 2
    M128N64 = 3
    M128N32 = 4
    M128N8 = 5
    WARP_M16N8 = 6
    M128N256 = 7


class Projection:
    """One projection's NVFP4 weights for all experts, in checkpoint layout: ``codes`` uint8
    [E, N, K/2], ``scales`` float8_e4m3fn or uint8 [E, N, K/16], ``decode_scales`` float32 [E]."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, decode_scales: torch.Tensor) -> None:
        self.codes, self.scales, self.decode_scales = codes, scales, decode_scales

    @staticmethod
    def from_experts(tensors: Mapping[str, torch.Tensor], names: Sequence[str]) -> "Projection":
        """Stacks the experts' tensors; ``names[e]`` is expert e's tensor prefix (``...experts.e.gate_proj``).
        The dialect is read from each expert's field names."""
        codes, scales, gs = [], [], []
        for name in names:
            if f"{name}.weight" in tensors and f"{name}.weight_scale_2" in tensors:
                codes.append(tensors[f"{name}.weight"])
                g = tensors[f"{name}.weight_scale_2"].float().reshape(-1)
            elif f"{name}.weight_packed" in tensors and f"{name}.weight_global_scale" in tensors:
                codes.append(tensors[f"{name}.weight_packed"])
                # g is the float32 reciprocal of the global scale (correctly rounded), as the crate's
                # checkpoint loader computes it.
                g = torch.reciprocal(tensors[f"{name}.weight_global_scale"].float().reshape(-1))
            else:
                raise KeyError(
                    f"{name}: neither ModelOpt (weight, weight_scale, weight_scale_2) nor compressed-tensors "
                    "(weight_packed, weight_scale, weight_global_scale) tensors"
                )
            if g.numel() != 1:
                raise ValueError(f"{name}: the per-tensor scale must hold one value, got {g.numel()}")
            scales.append(tensors[f"{name}.weight_scale"])
            gs.append(g)
        for what, ts in (("weight", codes), ("weight_scale", scales)):
            if len({(t.shape, t.dtype, t.device) for t in ts}) != 1:
                raise ValueError(f"the experts' {what} tensors differ in shape, dtype or device")
        if codes[0].dtype != torch.uint8:
            raise TypeError(f"{names[0]}: codes must be uint8, got {codes[0].dtype}")
        return Projection(torch.stack(codes), torch.stack(scales), torch.cat(gs))


def _prepare(proj: Projection, up: Optional[Projection] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The core's preparation of a projection (W13 when ``up`` is given: [gate; up] rows per expert)."""
    codes, scales = proj.codes, proj.scales
    if up is not None:
        codes = torch.cat([codes, up.codes], dim=1)
        scales = torch.cat([scales, up.scales], dim=1)
    if scales.dtype == torch.float8_e4m3fn:
        scales = scales.view(torch.uint8)
    up_g = up.decode_scales if up is not None else None
    return torch.ops.nvfp4_moe.prepare(codes.contiguous(), scales.contiguous(), proj.decode_scales, up_g)


def _expert_map(
    expert_ids: Optional[Sequence[int]], global_experts: Optional[int], experts: int, device: torch.device
) -> Optional[torch.Tensor]:
    """An expert shard's map for the core: int32 [global_experts], each global id's local expert or
    -1 (None for a whole layer). The list is checked here, naming the problem."""
    if expert_ids is None:
        if global_experts is not None:
            raise ValueError("global_experts is given only with expert_ids (an expert shard)")
        return None
    if global_experts is None or not 1 <= int(global_experts) <= 1024:
        raise ValueError(f"an expert shard needs global_experts in 1..=1024, got {global_experts}")
    ids = [int(e) for e in expert_ids]
    if len(ids) != experts:
        raise ValueError(f"the shard lists {len(ids)} expert ids, its weights hold {experts} experts")
    table = [-1] * int(global_experts)
    for local, e in enumerate(ids):
        if not 0 <= e < int(global_experts):
            raise ValueError(f"expert_ids[{local}] = {e} is not in [0, {global_experts})")
        if table[e] >= 0:
            raise ValueError(f"expert_ids[{local}] = {e} repeats expert_ids[{table[e]}]")
        table[e] = local
    return torch.tensor(table, dtype=torch.int32, device=device)


class MoeLayer(torch.nn.Module):
    """One MoE feed-forward layer over prepared NVFP4 weights (on the weights' CUDA device).

    ``forward(hidden, topk_ids=..., topk_weights=...)`` or ``forward(hidden, router_logits=...)``:
    hidden bfloat16 [T, H] -> [T, H] (``output_dtype``), with top-k ids int32 [T, k] and weights float32
    [T, k], or softmax top-k over router logits float32 [T, E]. Runs on PyTorch's current stream;
    no host synchronization; valid under torch.compile (fullgraph) and CUDA-graph capture. No
    backward: inputs that require grad are refused.

    ``intermediate``: ``"bf16"`` (the default: the first GEMM's SwiGLU output in BF16) or a float,
    the activation decode scale g of an NVFP4 intermediate (packed in the first GEMM's epilogue).

    ``output_dtype``: ``torch.bfloat16`` (the default) or ``torch.float32`` (the combine's FP32 sums,
    unrounded).

    An expert shard (expert parallelism): ``expert_ids`` lists the global id of each of the given
    experts (any distinct ids below ``global_experts``). Its forwards take the whole layer's routing
    (global ids, or router logits over ``global_experts``); slots routed to other shards cost no work
    and add nothing. Each expert gets the whole layer's GEMM tiles and K splits, so with
    ``output_dtype=torch.float32`` the shards' outputs add up to the whole layer's up to the order of
    that sum.
    """

    def __init__(
        self,
        gate: Projection,
        up: Projection,
        down: Projection,
        max_tokens: int,
        top_k: int,
        *,
        intermediate: Union[str, float] = "bf16",
        tile: Tile = Tile.AUTO,
        batch_invariant: bool = False,
        output_dtype: torch.dtype = torch.bfloat16,
        expert_ids: Optional[Sequence[int]] = None,
        global_experts: Optional[int] = None,
    ) -> None:
        super().__init__()
        if not gate.codes.is_cuda:
            raise ValueError(f"the weights must be on a CUDA device, got {gate.codes.device}")
        experts, inter, hidden_half = gate.codes.shape
        hidden = 2 * hidden_half
        if up.codes.shape != gate.codes.shape or tuple(down.codes.shape) != (experts, hidden, inter // 2):
            raise ValueError(
                f"gate {tuple(gate.codes.shape)}, up {tuple(up.codes.shape)} and down {tuple(down.codes.shape)} codes "
                "are not [E, I, H/2], [E, I, H/2] and [E, H, I/2]"
            )
        if intermediate == "bf16":
            fmt, g = 0, 1.0
        elif isinstance(intermediate, (int, float)):
            fmt, g = 1, float(intermediate)
        else:
            raise ValueError(f'intermediate must be "bf16" or an NVFP4 decode scale, got {intermediate!r}')
        if output_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"output_dtype must be torch.bfloat16 or torch.float32, got {output_dtype}")
        expert_map = _expert_map(expert_ids, global_experts, experts, gate.codes.device)
        self.experts, self.hidden, self.intermediate, self.top_k = experts, hidden, inter, top_k
        #: The experts the routing counts (the whole layer's for an expert shard).
        self.global_experts = experts if expert_map is None else int(global_experts)  # type: ignore[arg-type]
        self.expert_ids = list(range(experts)) if expert_ids is None else [int(e) for e in expert_ids]
        self._config = [experts, hidden, inter, max_tokens, top_k, int(tile), fmt, int(batch_invariant),
                        0 if expert_map is None else self.global_experts, int(output_dtype == torch.float32)]
        self._g = g
        with torch.no_grad():
            w13, w13_scales = _prepare(gate, up)
            w2, w2_scales = _prepare(down)
            nbytes = torch.ops.nvfp4_moe.workspace_bytes(self._config, g)
            workspace = torch.empty(nbytes, dtype=torch.uint8, device=w13.device)
            torch.ops.nvfp4_moe.init_workspace(workspace, self._config, g)
        # The decode scale pairs are kept as int32 bits (viewed back as float32 per call), so that
        # Module.to(dtype) / .half() leave them alone.
        w13_scales, w2_scales = w13_scales.view(torch.int32), w2_scales.view(torch.int32)
        for name, t in (("w13", w13), ("w13_scales", w13_scales), ("w2", w2), ("w2_scales", w2_scales)):
            self.register_buffer(name, t, persistent=False)
        self.register_buffer("workspace", workspace, persistent=False)
        if expert_map is not None:
            self.register_buffer(_EXPERT_MAP, expert_map, persistent=False)

    @staticmethod
    def from_tensors(
        tensors: Mapping[str, torch.Tensor],
        prefix: str,
        num_experts: int,
        max_tokens: int,
        top_k: int,
        projections: Sequence[str] = DEFAULT_PROJECTIONS,
        expert_ids: Optional[Sequence[int]] = None,
        **kwargs: object,
    ) -> "MoeLayer":
        """A layer from checkpoint tensors named ``{prefix}.{e}.{projection}.{field}`` (either dialect),
        e.g. ``safetensors.torch.load_file(path, device="cuda")``'s dict and
        ``prefix="model.layers.3.mlp.experts"``. With ``expert_ids``, the expert shard of those of the
        ``num_experts`` experts (only their tensors are read). Keyword arguments go to the
        constructor."""
        ids = list(range(num_experts)) if expert_ids is None else list(expert_ids)
        gate, up, down = (Projection.from_experts(tensors, [f"{prefix}.{e}.{p}" for e in ids]) for p in projections)
        if expert_ids is not None:
            if kwargs.get("global_experts", num_experts) != num_experts:
                raise ValueError(f"global_experts {kwargs['global_experts']} differs from num_experts {num_experts}")
            kwargs = {**kwargs, "expert_ids": ids, "global_experts": num_experts}
        return MoeLayer(gate, up, down, max_tokens, top_k, **kwargs)  # type: ignore[arg-type]

    def _drop_caches(self) -> None:
        for c in _CACHES:
            self.__dict__.pop(c, None)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # (Module.to / .cuda / ... replace the buffers: drop the operator's cached state, which would
        # otherwise hold the old tensors, and read them, until the next forward.)
        self._drop_caches()
        return super()._apply(fn, recurse)

    def __setattr__(self, name: str, value: object) -> None:
        if name in _OPERATOR_BUFFERS or name == _EXPERT_MAP:
            self._drop_caches()  # (the same: a replaced buffer is neither kept alive nor read)
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if name in _OPERATOR_BUFFERS or name == _EXPERT_MAP:
            self._drop_caches()
        super().__delattr__(name)

    def register_buffer(self, name: str, tensor: Optional[torch.Tensor], persistent: bool = True) -> None:
        # (Module.register_buffer writes _buffers without __setattr__.)
        if name in _OPERATOR_BUFFERS or name == _EXPERT_MAP:
            self._drop_caches()
        super().register_buffer(name, tensor, persistent)

    def __getstate__(self) -> dict:
        # (torch.save refuses two views of one storage with different dtypes, and the eager handle
        # is no state: the caches are not saved.)
        state = dict(super().__getstate__())
        for c in _CACHES:
            state.pop(c, None)
        return state

    def _current_buffers(
        self,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """The buffers the operator reads, as registered now (scales as int32 bits); a RuntimeError
        names a removed one."""
        b = self._buffers
        w13, s13, w2, s2, ws = (b.get(n) for n in _OPERATOR_BUFFERS)
        em = b.get(_EXPERT_MAP)
        if w13 is None or s13 is None or w2 is None or s2 is None or ws is None or (em is None) != (self._config[8] == 0):
            if em is not None and self._config[8] == 0:
                raise RuntimeError(f"MoeLayer: a buffer {_EXPERT_MAP} was added to a layer that is not an expert shard")
            names = _OPERATOR_BUFFERS + ((_EXPERT_MAP,) if self._config[8] else ())
            missing = [n for n in names if b.get(n) is None]
            raise RuntimeError(f"MoeLayer: buffer {', '.join(missing)} was removed")
        return w13, s13, w2, s2, ws, em

    def _operator_buffers(
        self,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """(w13, w13 scales as float32, w2, w2 scales as float32, workspace, expert map) as the operator takes
        them, made again when a buffer was replaced or a scale buffer's storage or shape changed
        (``.data =``, ``set_``): in eager mode, the module's attribute lookups and the two views cost
        several microseconds of host time per forward."""
        w13, s13, w2, s2, ws, em = self._current_buffers()
        key, storage = (w13, s13, w2, s2, ws, em), (s13.data_ptr(), s13.shape, s2.data_ptr(), s2.shape)
        cached = self.__dict__.get("_op_buffers")
        if cached is None or cached[1] != storage or any(x is not y for x, y in zip(cached[0], key)):
            # Made outside a torch.jit trace: its tracer fails on a dtype view ("We don't have an op
            # for aten::view but it isn't a special case", torch 2.11), and the trace records the
            # views as the constants they are.
            tracing = torch._C._get_tracing_state()
            if tracing is not None:
                torch._C._set_tracing_state(None)
            try:
                s13f, s2f = s13.view(torch.float32), s2.view(torch.float32)
            finally:
                if tracing is not None:
                    torch._C._set_tracing_state(tracing)
            cached = (key, storage, (w13, s13f, w2, s2f, ws, em))
            self.__dict__["_op_buffers"] = cached
        return cached[2]

    def _eager_handle(self) -> object:
        """The eager forward's handle (``nvfp4_moe._C.layer``) of the current buffers: it holds
        them, so a forward passes five arguments. Cached with the buffers it was made of (the cache
        is a tuple, so torch.export's scan of module attributes does not take the handle for a
        constant): made again when one of them is no longer the registered one (a replacement that
        bypasses the module, e.g. ``_buffers[name] = t`` as torch.func.functional_call does)."""
        b = self._buffers
        c = self.__dict__.get("_handle")
        if (
            c is None
            or b.get("w13") is not c[1]
            or b.get("w13_scales") is not c[2]
            or b.get("w2") is not c[3]
            or b.get("w2_scales") is not c[4]
            or b.get("workspace") is not c[5]
            or b.get(_EXPERT_MAP) is not c[6]
        ):
            # The buffers themselves, scales as their int32 bits, not views: a buffer given new
            # storage in place (.data =, set_) is then what the next forward reads.
            bufs = self._current_buffers()
            c = (_EAGER_LAYER(*bufs, self._config, self._g), *bufs)
            self.__dict__["_handle"] = c
        return c[0]

    def forward(
        self,
        hidden: torch.Tensor,
        topk_ids: Optional[torch.Tensor] = None,
        topk_weights: Optional[torch.Tensor] = None,
        router_logits: Optional[torch.Tensor] = None,
        renormalize: bool = True,
        *,
        out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``out``: the caller's output [T, H] of the layer's output dtype, written and returned (no
        allocation; under torch.compile and with router logits it costs a copy)."""
        # Eager with top-k ids on plain tensors: the extension's entry point (issue 20's host cost).
        # It bypasses the dispatcher, so not where something records or intercepts operators: a
        # torch.jit trace, a TorchDispatchMode (make_fx, FakeTensorMode, ...) or a compile.
        # (is_compiling first: a traced forward never looks at the handle.)
        if (
            _EAGER_FORWARD is not None
            and not torch.compiler.is_compiling()
            and router_logits is None
            and topk_ids is not None
            and topk_weights is not None
            and type(hidden) is torch.Tensor
            and torch._C._len_torch_dispatch_stack() == 0
            and not torch._C._is_tracing()  # (torch.jit.is_tracing() without its Python frame)
        ):
            return _EAGER_FORWARD(self._eager_handle(), hidden, topk_ids, topk_weights, out)
        if out is not None:  # (checked before anything runs, as the eager entry point checks it)
            dtype = torch.float32 if self._config[9] else torch.bfloat16
            shape = (hidden.shape[0], self.hidden)
            if out.dtype != dtype:
                raise TypeError(f"out must be {dtype}, got {out.dtype}")
            if tuple(out.shape) != shape or out.device != self.w13.device or not out.is_contiguous():
                raise ValueError(f"out must be a contiguous [T, H] = {list(shape)} on {self.w13.device}, got "
                                 f"{list(out.shape)} on {out.device}")
            if torch.is_grad_enabled() and out.requires_grad:
                raise ValueError("out requires grad: the operator has no backward (call it under torch.no_grad())")
            for name, t in (("hidden", hidden), ("topk_ids", topk_ids), ("topk_weights", topk_weights),
                            ("router_logits", router_logits)):
                if t is not None and _overlap(out, t):
                    raise ValueError(f"out overlaps {name} (the forward reads it while it writes out)")
        top_k = topk_ids.shape[1] if topk_ids is not None else self.top_k
        if torch.compiler.is_compiling():
            # (Traced once: the plain lookups, which the graph then holds as inputs.)
            w13, s13, w2, s2 = self.w13, self.w13_scales.view(torch.float32), self.w2, self.w2_scales.view(torch.float32)
            ws, em = self.workspace, self._buffers.get(_EXPERT_MAP)
        else:
            w13, s13, w2, s2, ws, em = self._operator_buffers()
        y = _FORWARD(
            hidden, w13, s13, w2, s2, topk_ids, topk_weights, router_logits, top_k, renormalize, ws, em, self._config,
            self._g,
        )
        if out is None:
            return y
        out.copy_(y)
        return out

    @torch.compiler.disable
    def check(self, top_k: Optional[int] = None) -> None:
        """Synchronizes the current stream and raises ValueError naming the token, slot and id of the
        first expert id outside [0, E) that a forward met since the last check (that slot
        contributed nothing), then clears it. Eager only (it synchronizes): not inside a compiled
        region or a CUDA-graph capture."""
        word = torch.ops.nvfp4_moe.read_error(self.workspace, self._config, self._g)
        if word == -1:
            return
        k = top_k if top_k is not None else self.top_k
        pair, bad = (word >> 32) & 0xFFFFFFFF, word & 0xFFFFFFFF
        bad = bad - (1 << 32) if bad >= 1 << 31 else bad
        raise ValueError(
            f"topk_ids[{pair // k}, {pair % k}] = {bad} is not an expert id in [0, {self.global_experts}): "
            "that slot was routed nowhere"
        )
