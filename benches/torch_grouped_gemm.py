#!/usr/bin/env python3
"""PyTorch's BF16 grouped GEMM (torch._grouped_mm) at the crate's GEMM bench shapes, on the same GPU
in the same call, as the reference line for benches/gemm.rs.

Shapes: L1 (n = 2I, k = H) and L2 (n = H, k = I) of deepseek-v3, qwen3-30b-a3b, mixtral-8x7b;
T tokens x top-k rows, balanced routing (rows spread evenly over min(E, rows) experts, as the Rust
bench does). Timing: CUDA graph replay, L2 flushed by a 256 MiB write before each replay, median.
Case names match the Rust bench ("deepseek-v3/L1/T16"); --filter keeps names containing it.
Prints a table last; --json writes the rows.
"""
import argparse, json, sys

import torch

# The shared timing (CUDA graph, L2 flush, median) and balanced offsets; both scripts travel
# together in the GPU bundle, and Python puts this script's folder on sys.path.
from torch_moe_baseline import offsets as end_offsets, time_graph

PRESETS = {"deepseek-v3": (256, 7168, 2048, 8), "qwen3-30b-a3b": (128, 2048, 768, 8), "mixtral-8x7b": (8, 4096, 14336, 2)}
TOKENS = [1, 16, 128, 1024, 8192]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--filter", default="")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.float32, device="cuda")
    out = []
    for name, (E, H, I, k) in PRESETS.items():
        for layer, n, kk in (("L1", 2 * I, H), ("L2", H, I)):
            cases = [t for t in TOKENS if a.filter in f"{name}/{layer}/T{t}"]
            if not cases:
                continue
            W = torch.randn(E, n, kk, device="cuda", dtype=torch.bfloat16) * 0.02
            for t in cases:
                rows = t * k
                offs, active = end_offsets(E, rows)
                X = torch.randn(rows, kk, device="cuda", dtype=torch.bfloat16)
                us = time_graph(lambda: torch._grouped_mm(X, W.transpose(-2, -1), offs=offs), a.iters, flush)
                r = {"case": f"{name}/{layer}/T{t}", "us": us, "active_experts": active,
                     "tflops": 2 * rows * n * kk / (us * 1e-6) / 1e12}
                out.append(r)
                print(json.dumps(r), file=sys.stderr, flush=True)
            del W
            torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    print("== torch._grouped_mm BF16 (same GPU, same call) ==")
    print(f"{'case':<28s} {'us':>10s} {'TFLOP/s':>9s}")
    for r in out:
        print(f"{r['case']:<28s} {r['us']:10.1f} {r['tflops']:9.1f}")


if __name__ == "__main__":
    main()
