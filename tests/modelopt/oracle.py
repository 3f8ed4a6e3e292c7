"""ModelOpt 0.47 on CUDA as a live oracle for the crate's GPU test `modelopt_on_fresh_random_data`.

    python3 tests/modelopt/oracle.py IN.safetensors OUT.safetensors

IN holds cases `C.x` (bf16 2-D) and optionally `C.g` (f32 [1], a given decode scale; without it
ModelOpt derives g from the tensor as for a weight). OUT gets `C.codes`, `C.scales` (E4M3 bytes,
linear) and `C.g` for every case. Exits non-zero (with the reason) when torch, CUDA or ModelOpt is
missing, so the test fails rather than passing without its oracle.
"""

import sys

import torch
from safetensors.torch import load_file, save_file

import modelopt_nvfp4


def main():
    src, dst = sys.argv[1], sys.argv[2]
    if not torch.cuda.is_available():
        sys.exit("oracle.py: no CUDA device")
    qt, version = modelopt_nvfp4.load()
    inputs = load_file(src)
    out = {}
    for key in sorted(k for k in inputs if k.endswith(".x")):
        name = key[:-2]
        g = inputs.get(f"{name}.g")
        codes, scales, g_out = modelopt_nvfp4.quantize(qt, inputs[key].cuda(), None if g is None else g.item())
        out[f"{name}.codes"], out[f"{name}.scales"], out[f"{name}.g"] = codes, scales, g_out
    save_file(out, dst, metadata={"modelopt": version, "device": torch.cuda.get_device_name()})
    print(f"oracle.py: ModelOpt {version} on {torch.cuda.get_device_name()}: {len(out) // 3} cases")


if __name__ == "__main__":
    main()
