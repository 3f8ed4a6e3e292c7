#!/usr/bin/env python3
# Copied from the team tooling (shared/tools/torch_moe_baseline.py) so that it travels with the GPU bundle.
"""PyTorch baselines for one MoE layer on the GPU, to run beside the crate's benches in the same call.

BF16: torch._grouped_mm (L1, gate|up) -> silu(gate) * up -> torch._grouped_mm (L2).
FP8:  torch._scaled_grouped_mm with row-wise scales for L1 and L2 (GEMMs only: no SwiGLU, no quantization).
Neither includes permutation or combine. Balanced routing: rows spread evenly over experts.
Timing: CUDA graph of the step, L2 flushed with a 256 MiB write before each replay, median of --iters.

usage: torch_moe_baseline.py [--preset deepseek-v3,qwen3-30b-a3b] [--tokens 1,16,1024] [--json out.json]
Prints a table last. Needs torch >= 2.8 with a Hopper GPU.
"""
import argparse, json, sys
import torch
import torch.nn.functional as F

PRESETS = {  # experts, hidden, intermediate, top_k (shared/presets/moe-shapes.toml)
    "deepseek-v3": (256, 7168, 2048, 8), "kimi-k2": (384, 7168, 2048, 8),
    "qwen3-235b-a22b": (128, 4096, 1536, 8), "qwen3-30b-a3b": (128, 2048, 768, 8),
    "mixtral-8x7b": (8, 4096, 14336, 2), "gpt-oss-120b": (128, 2880, 2880, 4),
}


def time_graph(fn, iters, flush):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    ts = []
    for _ in range(iters):
        flush.add_(1)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def offsets(E, rows):
    active = min(E, rows)
    counts = torch.zeros(E, dtype=torch.int32)
    counts[:active] = rows // active
    counts[: rows % active] += 1
    return torch.cumsum(counts, 0).to(torch.int32).cuda(), active


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="deepseek-v3,qwen3-30b-a3b,mixtral-8x7b")
    ap.add_argument("--tokens", default="1,16,128,1024,8192")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-fp8", action="store_true")
    a = ap.parse_args()
    torch.manual_seed(0)
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.float32, device="cuda")
    rows_out = []
    for name in a.preset.split(","):
        E, H, I, k = PRESETS[name]
        W1 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.02
        W2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * 0.02
        if not a.no_fp8:
            W1q, W2q = W1.to(torch.float8_e4m3fn), W2.to(torch.float8_e4m3fn)
            s1 = torch.rand(E, 2 * I, device="cuda") + 0.5
            s2 = torch.rand(E, H, device="cuda") + 0.5
        for T in [int(t) for t in a.tokens.split(",")]:
            rows = T * k
            offs, active = offsets(E, rows)
            X = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16)

            def bf16_layer():
                h = torch._grouped_mm(X, W1.transpose(-2, -1), offs=offs)
                y = F.silu(h[:, :I]) * h[:, I:]
                return torch._grouped_mm(y, W2.transpose(-2, -1), offs=offs)

            r = {"preset": name, "T": T, "active_experts": active,
                 "bf16_us": time_graph(bf16_layer, a.iters, flush)}
            if not a.no_fp8:
                Xq = X.to(torch.float8_e4m3fn); sx = torch.rand(rows, device="cuda") + 0.5
                Yq = torch.randn(rows, I, device="cuda").to(torch.float8_e4m3fn); sy = torch.rand(rows, device="cuda") + 0.5

                def fp8_gemms():
                    torch._scaled_grouped_mm(Xq, W1q.transpose(-2, -1), sx, s1, offs=offs, out_dtype=torch.bfloat16)
                    return torch._scaled_grouped_mm(Yq, W2q.transpose(-2, -1), sy, s2, offs=offs, out_dtype=torch.bfloat16)
                r["fp8_gemms_us"] = time_graph(fp8_gemms, a.iters, flush)
            wbytes = active * 3 * H * I * 0.5625
            r["nvfp4_weight_floor_us"] = wbytes / 4.3e12 * 1e6
            r["bf16_compute_floor_us"] = 2 * rows * H * 3 * I / 795e12 * 1e6
            rows_out.append(r)
            print(json.dumps(r), file=sys.stderr, flush=True)
        del W1, W2
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows_out, f, indent=1)
    print(f"{'preset':16s} {'T':>6s} {'BF16 us':>10s} {'FP8 GEMMs us':>13s} {'FP4 floor us':>13s}")
    for r in rows_out:
        print(f"{r['preset']:16s} {r['T']:6d} {r['bf16_us']:10.1f} {r.get('fp8_gemms_us', float('nan')):13.1f} {max(r['nvfp4_weight_floor_us'], r['bf16_compute_floor_us']):13.1f}")


if __name__ == "__main__":
    main()
