#!/usr/bin/env python3
"""The operator against the C ABI (issue 20's targets) on the GPU, per preset and T: the host's cost
per eager call (CPU time to enqueue, GPU kept busy: median of rounds of 20 calls; the operator's
includes allocating its output, as a PyTorch caller's does), and CUDA-graph
replay times of both (the operator's graph and the C ABI's, L2 flushed by a 256 MiB write before
each replay, replayed interleaved, median), with the outputs compared bit for bit. Prints a table.
The host cost is also split, every path timed in interleaved rounds: the module's call (`host op`:
the eager fast path, `nvfp4_moe._C.forward` over the module's handle), the same with the caller's
`out` (`host op out`: no allocation, as the C ABI's caller), the 14-argument overload called directly
with its arguments made beforehand (`host overload`), `nvfp4_moe._C.forward` called directly (`host
fast`), and `torch.empty` of the output alone (`host empty`).

    PYTHONPATH=<site with nvfp4_moe>:python/tests python3 python/bench/bench_op.py \
        [--preset qwen3-30b-a3b,deepseek-v3,mixtral-8x7b] [--tokens 1,16,1024] [--json rows.json]

`--json` also writes the rows, for `readme_table.py` (beside PyTorch's layers).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time

import torch

import nvfp4_moe
from capi import CLayer
from nvfp4_moe.layer import Projection

PRESETS = {"deepseek-v3": (256, 7168, 2048, 8), "qwen3-30b-a3b": (128, 2048, 768, 8), "mixtral-8x7b": (8, 4096, 14336, 2),
           "qwen3-235b-a22b": (128, 4096, 1536, 8), "gpt-oss-120b": (128, 2880, 2880, 4), "kimi-k2": (384, 7168, 2048, 8)}


def projection(e: int, n: int, k: int) -> Projection:
    """Random NVFP4 weights made on the GPU (codes, E4M3 scales 0.125..3.75, g = 2^-8)."""
    codes = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device="cuda")
    scales = (torch.randint(4, 9, (e, n, k // 16), dtype=torch.uint8, device="cuda") << 3) | torch.randint(
        0, 8, (e, n, k // 16), dtype=torch.uint8, device="cuda")
    return Projection(codes, scales.view(torch.float8_e4m3fn), torch.full((e,), 2.0**-8, device="cuda"))


def host_costs(calls: dict, rounds: int = 20) -> dict:
    """Each call's host cost (us), the calls' rounds interleaved (round r of every call before round
    r + 1 of any), so that the host's drift is shared: per round the median of 20 timed calls after 4
    untimed ones, then the median over rounds."""
    per_round: dict = {k: [] for k in calls}
    for _ in range(rounds):
        for key, call in calls.items():
            ts = []
            for _ in range(24):
                t0 = time.perf_counter()
                call()
                ts.append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
            per_round[key].append(statistics.median(ts[4:]))
    return {k: statistics.median(v) for k, v in per_round.items()}


def graph_of(fn) -> torch.cuda.CUDAGraph:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-30b-a3b,deepseek-v3,mixtral-8x7b")
    ap.add_argument("--tokens", default="1,16,1024")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    eager = nvfp4_moe._ops.eager
    if eager is None:
        raise SystemExit("bench_op: the package was built without nvfp4_moe._C (no Python headers or no libtorch_python "
                         "at build time): the eager path's host cost is what this bench measures")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    rows = []
    for name in a.preset.split(","):
        e, h, i, k = PRESETS[name]
        gate, up, down = projection(e, i, h), projection(e, i, h), projection(e, h, i)
        max_t = max(int(t) for t in a.tokens.split(","))
        op = nvfp4_moe.MoeLayer(gate, up, down, max_tokens=max_t, top_k=k)
        c = CLayer(gate, up, down, max_tokens=max_t, top_k=k)
        for t in map(int, a.tokens.split(",")):
            x = torch.randn(t, h, device="cuda").to(torch.bfloat16)
            ids = torch.stack([torch.randperm(e, device="cuda")[:k] for _ in range(t)]).int()
            w = torch.rand(t, k, device="cuda") + 0.1
            c_out = torch.empty(t, h, dtype=torch.bfloat16, device="cuda")
            f = c.args(x, ids, w, c_out)
            same = torch.equal(op(x, topk_ids=ids, topk_weights=w), c(x, ids, w))
            b = op._operator_buffers()
            args = (x, *b[:4], ids, w, None, k, True, b[4], b[5], op._config, op._g)
            overload, fast, handle = torch.ops.nvfp4_moe.forward.default, eager.forward, op._eager_handle()
            op_out = torch.empty(t, h, dtype=torch.bfloat16, device="cuda")
            # (the 14-argument overload, the fast one and the module with out= give the same bytes too)
            want = overload(*args)
            same = same and torch.equal(fast(handle, x, ids, w, None), want)
            same = same and torch.equal(op(x, topk_ids=ids, topk_weights=w, out=op_out), want)
            stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)  # fixed outside a capture
            host = host_costs({
                "op": lambda: op(x, topk_ids=ids, topk_weights=w),
                "op_out": lambda: op(x, topk_ids=ids, topk_weights=w, out=op_out),
                "overload": lambda: overload(*args),
                "fast": lambda: fast(handle, x, ids, w, None),
                "empty": lambda: torch.empty(t, h, dtype=torch.bfloat16, device="cuda"),
                "c": lambda: c.forward_args(f, stream),
            })
            g_op, g_c = graph_of(lambda: op(x, topk_ids=ids, topk_weights=w)), graph_of(lambda: c.forward_args(f))
            times = {"op": [], "c": []}
            for _ in range(a.iters):
                for key, g in (("op", g_op), ("c", g_c)):
                    flush.add_(1)
                    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    t0.record()
                    g.replay()
                    t1.record()
                    torch.cuda.synchronize()
                    times[key].append(t0.elapsed_time(t1) * 1e3)
            r_op, r_c = statistics.median(times["op"]), statistics.median(times["c"])
            rows.append((name, t, host["op"], host["c"], r_op, r_c, same, host["overload"], host["empty"], host["fast"],
                         host["op_out"]))
        c.close()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, nvfp4_moe {nvfp4_moe.__version__}")
    print(f"{'preset':16} {'T':>5} {'host op us':>11} {'host C us':>10} {'graph op us':>12} {'graph C us':>11} "
          f"{'op/C':>6} same-bytes {'host overload':>14} {'host empty':>11} {'host fast':>10} {'host op out':>12}")
    for name, t, ho, hc, ro, rc, same, hov, he, hf, hoo in rows:
        print(f"{name:16} {t:5d} {ho:11.2f} {hc:10.2f} {ro:12.2f} {rc:11.2f} {ro / rc:6.3f} {same!s:10} {hov:14.2f} "
              f"{he:11.2f} {hf:10.2f} {hoo:12.2f}")
    if a.json:
        keys = ("preset", "T", "host_op_us", "host_c_us", "graph_op_us", "graph_c_us", "same_bytes",
                "host_overload_us", "host_empty_us", "host_fast_us", "host_op_out_us")
        with open(a.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": [dict(zip(keys, r)) for r in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
