"""Loads the operator library (torch.ops.nvfp4_moe.*) and registers its fake kernels.

The CUDA kernels are registered by the C++ library (csrc/ops.cpp, TORCH_LIBRARY); the fake
(meta) kernels here let torch.compile and torch.library.opcheck trace the operators without
running them. The library is the extension module ``nvfp4_moe._C`` where the build found the
interpreter's headers (then ``eager`` is that module: the eager forward's entry points, ``layer``
and ``forward``), else a plain library loaded with ``torch.ops.load_library`` (``eager`` is None).
"""

from __future__ import annotations

import glob
import importlib.machinery
import os
from types import ModuleType
from typing import Optional, Sequence

import torch

_here = os.path.dirname(os.path.abspath(__file__))
eager: Optional[ModuleType]
# The extension built for this interpreter (a leftover one of another Python version is not it).
if any(os.path.exists(os.path.join(_here, "_C" + suffix)) for suffix in importlib.machinery.EXTENSION_SUFFIXES):
    from . import _C as eager  # (after torch: the import registers the operators)
else:
    _libs = sorted(glob.glob(os.path.join(_here, "libnvfp4_moe_ops*.so")))
    if not _libs:
        raise ImportError(f"nvfp4_moe: the operator library (_C or libnvfp4_moe_ops.so) is not in {_here} (was the "
                          "package built?)")
    torch.ops.load_library(_libs[0])
    eager = None

#: Bytes of one prepared weight chunk: 64 rows x 64 K of E2M1 codes and their E4M3 scales.
WEIGHT_CHUNK_BYTES = 64 * 64 // 2 + 64 * 64 // 16


def prepared_weight_bytes(experts: int, n: int, k: int) -> int:
    """Bytes of the prepared copy of `experts` NVFP4 weights of [n, k] (the core's layout)."""
    return experts * (n // 64) * (k // 64) * WEIGHT_CHUNK_BYTES


@torch.library.register_fake("nvfp4_moe::prepare")
def _prepare_fake(
    codes: torch.Tensor, scales: torch.Tensor, decode_scales: torch.Tensor, up_decode_scales: Optional[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    e, n, half_k = codes.shape
    prepared = codes.new_empty((prepared_weight_bytes(e, n, 2 * half_k),), dtype=torch.uint8)
    return prepared, codes.new_empty((e, 2), dtype=torch.float32)


@torch.library.register_fake("nvfp4_moe::init_workspace")
def _init_workspace_fake(workspace: torch.Tensor, config: Sequence[int], nvfp4_decode_scale: float) -> None:
    return None


@torch.library.register_fake("nvfp4_moe::forward")
def _forward_fake(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w13_scales: torch.Tensor,
    w2: torch.Tensor,
    w2_scales: torch.Tensor,
    topk_ids: Optional[torch.Tensor],
    topk_weights: Optional[torch.Tensor],
    router_logits: Optional[torch.Tensor],
    top_k: int,
    renormalize: bool,
    workspace: torch.Tensor,
    expert_map: Optional[torch.Tensor],
    config: Sequence[int],
    nvfp4_decode_scale: float,
) -> torch.Tensor:
    # config[9]: the output format (0 bf16, 1 float32).
    return hidden.new_empty((hidden.shape[0], config[1]), dtype=torch.float32 if config[9] else torch.bfloat16)
