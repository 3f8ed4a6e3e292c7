"""ModelOpt 0.47's NVFP4 quantizer as the crate's oracle (recipe v2, design/NVFP4.md).

Shared by generate_fixtures.py (the committed fixtures) and oracle.py (the fresh comparison the
GPU test runs on the H200). Needs torch with CUDA and nvidia-modelopt==0.47.0 importable (carried
as wheels; see the scripts' docstrings).
"""

import torch


def load():
    """Imports ModelOpt's NVFP4QTensor; raises with the reason if ModelOpt is missing."""
    import modelopt  # noqa: F401  (the version check below needs the package's metadata)
    from importlib.metadata import version

    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    return NVFP4QTensor, version("nvidia-modelopt")


def quantize(qt, x, g=None):
    """ModelOpt's NVFP4 quantization of a 2-D bf16 CUDA tensor, block 16.

    g: None derives the decode scale from the data (the weight path: amax / (6 * 448) computed by
    PyTorch on CUDA); else a float, passed as ModelOpt's `weights_scaling_factor_2` (the decode
    scale of a calibrated activation). Returns (codes u8 [rows, cols/2], scales u8 [rows, cols/16]
    as E4M3 bytes, g as a 1-element f32 tensor), all on the CPU.
    """
    assert x.is_cuda and x.dtype == torch.bfloat16 and x.dim() == 2
    wsf2 = None if g is None else torch.tensor(g, dtype=torch.float32, device=x.device)
    packed, scales, g_out = qt.quantize(x, 16, weights_scaling_factor_2=wsf2)
    codes = packed._quantized_data
    assert codes.dtype == torch.uint8 and tuple(codes.shape) == (x.shape[0], x.shape[1] // 2)
    assert scales.dtype == torch.float8_e4m3fn and tuple(scales.shape) == (x.shape[0], x.shape[1] // 16)
    g_out = g_out.reshape(1).to(torch.float32)
    return codes.cpu().contiguous(), scales.view(torch.uint8).cpu().contiguous(), g_out.cpu()
