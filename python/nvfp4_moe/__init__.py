"""nvfp4_moe: the NVFP4 Mixture-of-Experts layer of the nvfp4-moe core for PyTorch on NVIDIA Hopper.

    import torch, safetensors.torch, nvfp4_moe
    tensors = safetensors.torch.load_file("model-00003-of-00009.safetensors", device="cuda")
    layer = nvfp4_moe.MoeLayer.from_tensors(tensors, "model.layers.3.mlp.experts", num_experts=128,
                                            max_tokens=1024, top_k=8)
    out = layer(hidden, topk_ids=ids, topk_weights=weights)   # or router_logits=logits
    layer.check()                                             # a bad expert id raises ValueError

The operators are torch.ops.nvfp4_moe.{prepare, workspace_bytes, init_workspace, forward,
read_error}; MoeLayer is the module over them.
"""

from ._ops import prepared_weight_bytes
from .layer import DEFAULT_PROJECTIONS, MoeLayer, Projection, Tile

__all__ = ["DEFAULT_PROJECTIONS", "MoeLayer", "Projection", "Tile", "prepared_weight_bytes"]
__version__ = "0.2.0"
