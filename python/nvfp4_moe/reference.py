"""A pure-PyTorch reference of the same NVFP4 MoE layer (for tests): dequantize the weights
exactly, then float64 matmuls, SwiGLU and the weighted combine (stricter than BF16 ones). Slow;
any device."""

from __future__ import annotations

from typing import Optional

import torch

from .layer import Projection

_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def dequantize(proj: Projection, expert: int) -> torch.Tensor:
    """Expert ``expert``'s weights as float64 [N, K]: e2m1(code) * e4m3(scale) * g, element 2j of a
    row in the low nibble of byte j."""
    codes = proj.codes[expert]
    table = torch.tensor(_E2M1 + [-v for v in _E2M1], dtype=torch.float64, device=codes.device)
    nibbles = torch.stack([codes & 15, codes >> 4], dim=-1).reshape(codes.shape[0], -1).long()
    scales = proj.scales[expert]
    if scales.dtype == torch.uint8:
        scales = scales.view(torch.float8_e4m3fn)
    s = scales.to(torch.float64).repeat_interleave(16, dim=-1)
    return table[nibbles] * s * float(proj.decode_scales[expert])


def moe_layer(
    hidden: torch.Tensor,
    gate: Projection,
    up: Projection,
    down: Projection,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    intermediate_decode_scale: Optional[float] = None,
) -> torch.Tensor:
    """out[t] = sum_j w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j], in float64
    (ids outside [0, E) contribute nothing). ``intermediate_decode_scale`` is not modelled: an NVFP4
    intermediate adds its own quantization error, which the tests bound separately."""
    x = hidden.to(torch.float64)
    out = torch.zeros_like(x)
    experts = gate.codes.shape[0]
    for e in topk_ids.unique().tolist():
        if not 0 <= e < experts:
            continue
        rows, slots = (topk_ids == e).nonzero(as_tuple=True)
        xe = x[rows]
        act = torch.nn.functional.silu(xe @ dequantize(gate, e).T) * (xe @ dequantize(up, e).T)
        y = act @ dequantize(down, e).T
        out.index_add_(0, rows, y * topk_weights[rows, slots].to(torch.float64)[:, None])
    return out
