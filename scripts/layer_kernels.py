#!/usr/bin/env python3
"""Issue 22's per-kernel table of the layer at prefill: each kernel's duration (Nsight Compute's
gpu__time_duration, the median over the forwards profiled) against its floor. Input: the CSVs that
scripts/gpu-prefill-kernels.sh writes (`ncu --csv --metrics gpu__time_duration.sum` over `nvfp4-moe
bench --preset P --tokens T --routing R`), named `P.T.R.csv`.

Floors (H200 ceilings as the benches use them: 4.3 TB/s, and the dense BF16 rate given with
--bf16-tflops, default 795), each byte counted once (T tokens, P = T k pairs, H hidden, I
intermediate, E experts, A the experts the routing reaches):
  routing kernels (route_small, route_fused, count, scan, scatter)   ids read P x 4 + the row maps written 2 P x 4
  gather (row- or token-major)   hidden read T H 2 + permuted rows written P H 2
  combine      y read P H 2 + weights P 4 + out written T H 2
  L1 GEMM      max(A x 2 I H x 0.5625 + P H 2 + P I 2, 2 P 2I H flops)   (SwigluBf16: P x I written)
  L2 GEMM      max(A x H I x 0.5625 + P I 2 + P H 2, 2 P H I flops)

    python3 scripts/layer_kernels.py [--bf16-tflops R] gpu-out/kernels/*.csv
"""

from __future__ import annotations

import argparse
import collections
import csv
import os
import re
import statistics

# (E, H, I, k) as in ../shared/presets/moe-shapes.toml.
PRESETS = {"deepseek-v3": (256, 7168, 2048, 8), "qwen3-30b-a3b": (128, 2048, 768, 8), "mixtral-8x7b": (8, 4096, 14336, 2),
           "qwen3-235b-a22b": (128, 4096, 1536, 8), "gpt-oss-120b": (128, 2880, 2880, 4), "kimi-k2": (384, 7168, 2048, 8)}
HBM = 4.3e12
# Nsight Compute's duration units, in microseconds.
UNIT_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6, "s": 1e6}
# Kernels of the bench's set-up, not of a forward (weight preparation, the workspace's initialization).
NOT_FORWARD = ("prepare_kernel", "initialize_kernel")


def kernel_kind(name: str) -> str:
    """A short name per layer kernel (the GEMMs by epilogue: 0 = Plain is L2, the SwiGLU ones L1)."""
    # (ncu prints `gemm::Config<16, 3, 2, 2, ...>`; a fully demangled name reads
    # `nvfp4moe::gemm::Config<16, 3, 2, (nvfp4moe::GemmEpilogue)2, ...>`.)
    m = re.search(r"grouped_gemm_kernel<(?:[\w:]+::)?Config<(\d+), \d+, \d+, (?:\([\w:]+\))?(\d+)", name)
    if m:
        return f"gemm {'L2' if m.group(2) == '0' else 'L1'} N{m.group(1)}"
    if "grouped_gemm_warp" in name:
        return "gemm warp"
    m = re.search(r"(\w+_kernel)", name)
    return m.group(1) if m else name[:40]


def floor_us(kind: str, e: int, h: int, i: int, k: int, t: int, active: int, bf16: float) -> float | None:
    p = t * k
    if kind in ("count_kernel", "scan_kernel", "scatter_kernel", "route_small_kernel", "route_fused_kernel"):
        return (p * 4 + 2 * p * 4) / HBM * 1e6
    if kind.startswith(("gather_kernel", "gather_tokens_kernel")):
        return (t * h * 2 + p * h * 2) / HBM * 1e6
    if kind.startswith("combine_kernel"):
        return (p * h * 2 + p * 4 + t * h * 2) / HBM * 1e6
    if kind.startswith("gemm L1"):
        return max((active * 2 * i * h * 0.5625 + p * h * 2 + p * i * 2) / HBM, 2.0 * p * 2 * i * h / bf16) * 1e6
    if kind.startswith("gemm L2"):
        return max((active * h * i * 0.5625 + p * i * 2 + p * h * 2) / HBM, 2.0 * p * h * i / bf16) * 1e6
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bf16-tflops", type=float, default=795.0)
    ap.add_argument("csv", nargs="+")
    a = ap.parse_args()
    bf16 = a.bf16_tflops * 1e12
    for path in a.csv:
        preset, t, routing = os.path.basename(path)[: -len(".csv")].rsplit(".", 2)
        e, h, i, k = PRESETS[preset]
        t = int(t)
        durations: dict = collections.defaultdict(list)
        with open(path, newline="") as f:
            rows = [r for r in csv.reader(line for line in f if line.startswith('"'))]
        if len(rows) < 2:
            print(f"== {preset} T={t} routing={routing}: no kernel rows in {path} (see its .err)")
            continue
        header, body = rows[0], rows[1:]
        col = {name: n for n, name in enumerate(header)}
        for r in body:
            if r[col["Metric Name"]] != "gpu__time_duration.sum":
                continue
            unit = r[col["Metric Unit"]]
            if unit not in UNIT_US:
                raise SystemExit(f"{path}: unknown duration unit {unit!r}")
            scale = UNIT_US[unit]
            durations[kernel_kind(r[col["Kernel Name"]])].append(float(r[col["Metric Value"]].replace(",", "")) * scale)
        print(f"== {preset} T={t} routing={routing} (medians over the profiled forwards; floors at 4.3 TB/s and "
              f"{a.bf16_tflops:.0f} TFLOP/s)")
        print(f"{'kernel':28} {'n':>3} {'us':>10} {'floor us':>10} {'us/floor':>9}")
        small = 0.0
        for kind in NOT_FORWARD:
            durations.pop(kind, None)
        for kind, ds in sorted(durations.items(), key=lambda kv: -statistics.median(kv[1])):
            us = statistics.median(ds)
            fl = floor_us(kind, e, h, i, k, t, e, bf16)  # (at T = 8192 every routing reaches every expert)
            print(f"{kind:28} {len(ds):3d} {us:10.1f} {fl if fl is not None else float('nan'):10.1f} "
                  f"{us / fl if fl else float('nan'):9.2f}")
            if not kind.startswith("gemm") and (fl is None or fl < 10):
                small += us
        print(f"non-GEMM kernels with a floor under 10 us, together: {small:.1f} us (target <= 10)")
        # The 128x256 tile's tail split runs each GEMM as up to three launches (the head's 128x256
        # tiles, the tails' 128x32 and 128x64): their sum against the GEMM's floor.
        for layer in ("L1", "L2"):
            parts = {kind: statistics.median(ds) for kind, ds in durations.items() if kind.startswith(f"gemm {layer} ")}
            if len(parts) > 1:
                fl = floor_us(f"gemm {layer}", e, h, i, k, t, e, bf16)
                us = sum(parts.values())
                print(f"gemm {layer} launches together ({' + '.join(sorted(parts))}): {us:.1f} us, "
                      f"{us / fl:.2f} x floor {fl:.1f}")


if __name__ == "__main__":
    main()
