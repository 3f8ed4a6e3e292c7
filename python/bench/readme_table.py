#!/usr/bin/env python3
"""Issue 20's README table from one GPU call: the operator's CUDA-graph replay (bench_op.py --json)
beside PyTorch's BF16 layer and FP8 grouped GEMMs (benches/torch_moe_baseline.py --json), per
preset and T, as Markdown.

    python3 python/bench/readme_table.py bench_op.json torch_moe.json
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    with open(sys.argv[1]) as f:
        op = json.load(f)
    with open(sys.argv[2]) as f:
        base = {(r["preset"], r["T"]): r for r in json.load(f)}
    print(f"{op['gpu']}; us per layer, CUDA-graph replay, L2 flushed; the operator and the C ABI: the whole layer with"
          " random top-k ids; PyTorch: rows spread evenly over the experts, without routing, permutation and combine")
    print()
    print("| preset | T | nvfp4_moe operator | C ABI | PyTorch BF16 | PyTorch FP8 GEMMs | BF16 / operator |")
    print("|---|---|---|---|---|---|---|")
    for r in op["rows"]:
        b = base.get((r["preset"], r["T"]))
        bf16 = f"{b['bf16_us']:.1f}" if b else "-"
        fp8 = f"{b['fp8_gemms_us']:.1f}" if b and "fp8_gemms_us" in b else "-"
        ratio = f"{b['bf16_us'] / r['graph_op_us']:.2f}x" if b else "-"
        print(f"| {r['preset']} | {r['T']} | {r['graph_op_us']:.1f} | {r['graph_c_us']:.1f} | {bf16} | {fp8} | {ratio} |")


if __name__ == "__main__":
    main()
