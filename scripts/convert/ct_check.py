"""Checks `nvfp4-moe convert`'s compressed-tensors output with compressed-tensors' own code
(issue 18): the converted directory is decompressed by compressed-tensors (its
CompressedTensorsDequantizer through convert_checkpoint, or, if that entry point refuses, its
NVFP4PackedCompressor.decompress per module) and compared with the crate's own dequantization
within one BF16 ulp.

    python3 ct_check.py --cli NVFP4MOE --model BF16_DIR --work DIR --out DIR

Steps: converts BF16_DIR with the CLI twice (--format compressed-tensors and --format modelopt);
checks that both hold the same codes and block scales and that weight_global_scale is 1/g of
weight_scale_2 (F32); dequantizes every ModelOpt module with `nvfp4-moe dequantize` (the crate's
decode, `bf16((e2m1 x e4m3) x g)`); decompresses the compressed-tensors directory with
compressed-tensors; compares each weight (max distance in BF16 ulps; must be <= 1). Writes
summary.json and prints one line per check.
"""

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file

import compressed_tensors


def device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def tensors_of(d):
    out = {}
    for fn in sorted(os.listdir(d)):
        if fn.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, fn)))
    return out


def shard_of(d, name):
    for fn in sorted(os.listdir(d)):
        if fn.endswith(".safetensors"):
            with safe_open(os.path.join(d, fn), "pt") as f:
                if name in f.keys():
                    return os.path.join(d, fn)
    raise KeyError(name)


def ct_decompress(ct_dir, work):
    """compressed-tensors' own decompression into BF16 `{module}.weight` tensors."""
    from compressed_tensors.entrypoints.convert import convert_checkpoint

    try:
        from compressed_tensors.entrypoints.convert import CompressedTensorsDequantizer

        tmp = os.path.join(work, "ct-decompressed")
        shutil.rmtree(tmp, ignore_errors=True)
        convert_checkpoint(ct_dir, tmp, CompressedTensorsDequantizer(ct_dir, dtype=torch.bfloat16),
                           max_workers=1, device=device())
        return tensors_of(tmp), "convert_checkpoint + CompressedTensorsDequantizer"
    except Exception as e:
        print(f"CompressedTensorsDequantizer refused ({type(e).__name__}: {str(e)[:300]}); per module", flush=True)
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    with open(os.path.join(ct_dir, "config.json")) as f:
        config = QuantizationConfig.model_validate(json.load(f)["quantization_config"])
    t = {k: v.to(device()) for k, v in tensors_of(ct_dir).items()}
    out = {}
    for scheme in config.config_groups.values():
        fmt = scheme.format or config.format
        compressor = BaseCompressor.get_value_from_registry(getattr(fmt, "value", fmt))
        names = compressor.compression_param_names(scheme)
        for key in [k for k in t if k.endswith("." + names[0])]:
            module = key[: -len(names[0]) - 1]
            sd = {n: t.pop(f"{module}.{n}") for n in names if f"{module}.{n}" in t}
            out[f"{module}.weight"] = compressor.decompress(sd, scheme)["weight"].to(torch.bfloat16)
    return out, "NVFP4PackedCompressor.decompress per module"


def ulps(a, b):
    """Largest distance in BF16 ulps (on the ordered integer line of the bit patterns)."""
    def ordered(x):
        i = x.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -32768 - i, i)
    return int((ordered(a) - ordered(b)).abs().max().item()) if a.numel() else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cli", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.work, exist_ok=True)
    ct, mo = os.path.join(a.work, "ct"), os.path.join(a.work, "modelopt")
    for d, fmt in [(ct, "compressed-tensors"), (mo, "modelopt")]:
        subprocess.run([a.cli, "convert", "--input", a.model, "--output", d, "--format", fmt, "--force"], check=True)

    summary = {"compressed_tensors": getattr(compressed_tensors, "__version__", "?"), "torch": torch.__version__,
               "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    t_ct, t_mo = tensors_of(ct), tensors_of(mo)
    modules = sorted(k[: -len(".weight_packed")] for k in t_ct if k.endswith(".weight_packed"))
    # Same codes and block scales; global scale = 1/g in F32.
    bad_bytes = []
    for m in modules:
        same = torch.equal(t_ct[f"{m}.weight_packed"], t_mo[f"{m}.weight"]) and torch.equal(
            t_ct[f"{m}.weight_scale"].view(torch.uint8), t_mo[f"{m}.weight_scale"].view(torch.uint8))
        g = t_mo[f"{m}.weight_scale_2"].float().reshape(())
        gs = t_ct[f"{m}.weight_global_scale"].float().reshape(())
        if not same or gs.item() != (torch.tensor(1.0) / g).item():
            bad_bytes.append(m)
    summary["modules"] = len(modules)
    summary["same_bytes_both_dialects"] = not bad_bytes
    print(f"{len(modules)} converted modules; codes/scales identical in both dialects and global scale = 1/g: "
          f"{not bad_bytes} {bad_bytes[:3]}", flush=True)

    # The crate's decode, from the ModelOpt output.
    crate = {}
    deq = os.path.join(a.work, "crate-dequantized")
    os.makedirs(deq, exist_ok=True)
    for m in modules:
        f = os.path.join(deq, m + ".safetensors")
        subprocess.run([a.cli, "-q", "dequantize", "--input", shard_of(mo, m + ".weight"), "--prefix", m,
                        "--output", f], check=True)
        crate[m] = load_file(f)["weight"]

    theirs, how = ct_decompress(ct, a.work)
    summary["decompression"] = how
    worst, exact, total, missing = 0, 0, 0, []
    for m in modules:
        w = theirs.get(m + ".weight")
        if w is None:
            missing.append(m)
            continue
        w = w.to("cpu", torch.bfloat16)
        c = crate[m]
        assert w.shape == c.shape, (m, w.shape, c.shape)
        worst = max(worst, ulps(w, c))
        exact += int((w.view(torch.int16) == c.view(torch.int16)).sum().item())
        total += w.numel()
    summary.update({"max_bf16_ulps": worst, "bit_exact": exact, "weights": total, "missing": missing})
    ok = not bad_bytes and not missing and worst <= 1
    summary["passed"] = ok
    print(f"compressed-tensors ({how}) vs the crate: max {worst} BF16 ulp(s), {exact} of {total} bit-exact, "
          f"{len(missing)} module(s) missing -> {'PASS' if ok else 'FAIL'}", flush=True)
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
