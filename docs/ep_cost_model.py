#!/usr/bin/env python3
"""Expert parallelism on paper (issue 24): one MoE layer of deepseek-v3 and kimi-k2 over N GPUs of one
host (NVLink), T tokens per step in all, against the same layer on one GPU. Prints the tables of
docs/EXPERT_PARALLELISM.md. Assumptions (each a parameter below, explained in that file):

- one GPU's layer time: this crate's measured deepseek-v3 sweep (H200, session 7); kimi-k2 derived
  from it (same expert shape, 384 experts: more weight bytes where the layer reads weights);
- a shard's GEMM time: the one-GPU GEMM time scaled by its share of the active experts (the
  weight-bound part) and of the routed slots (the compute-bound part), on the most loaded GPU
  (Monte Carlo over the routing), plus the layer's fixed non-GEMM time;
- dispatch and combine: the bytes the busiest GPU sends or receives over the NVLink rate one GPU
  reaches in an all-to-all, plus a fixed latency per exchange; no overlap with compute.

    python3 docs/ep_cost_model.py [--trials 200] [--latency-us 15] [--link-gbps 330]
"""

from __future__ import annotations

import argparse
import math
import random

# deepseek-v3 on one H200: the layer (routing, both GEMMs, combine; CUDA-graph replay, L2 flushed),
# microseconds, README "The layer over T" (session 7, 2026-12-02).
DS_LAYER_US = {1: 79.1, 2: 133.5, 4: 233.5, 8: 437.5, 16: 838.3, 32: 1669, 64: 1805, 128: 1859, 256: 1858,
               512: 1902, 1024: 2280, 2048: 3163, 4096: 5125, 8192: 10178}
FIXED_US = 18.6  # the layer's non-GEMM time at T = 128 (routing, gather, combine), same session
# What a GEMM launch costs however few weights it reads (the expert table's DRAM trip, then the
# first weights', the grid's ramp and tail): a T = 1 launch of 7 MB takes ~7 us where a bare read
# of its bytes takes 3 us (PERF_NOTES, sessions 11-12). Two GEMMs per layer.
GEMM_FIXED_US = 2 * 4.0
HBM_TBPS, BF16_TFLOPS = 4.3, 795.0  # H200 measured ceilings (floors)
H, I = 7168, 2048  # both presets' expert shape
MODELS = {  # experts, top_k, groups, groups per token (DeepSeek-V3's node-limited routing: 4 of 8)
    "deepseek-v3": (256, 8, 8, 4),
    "kimi-k2": (384, 8, 1, 1),
}
EXPERT_BYTES = 3 * H * I * 0.5625  # gate, up and down of one expert, NVFP4
PAYLOAD_BYTES = {"BF16": 2.0, "FP8": 1.0 + 4 / 128, "NVFP4": 0.5 + 1 / 16}  # per element, scales included


def route(rng: random.Random, experts: int, k: int, groups: int, groups_per_token: int) -> list[int]:
    """One token's k distinct experts: uniform, within groups_per_token random groups when grouped."""
    if groups == 1:
        return rng.sample(range(experts), k)
    per = experts // groups
    chosen = rng.sample(range(groups), groups_per_token)
    return rng.sample([g * per + e for g in chosen for e in range(per)], k)


def floors(active: float, rows: int) -> tuple[float, float]:
    """(weight-read, compute) floors in us of a layer with `active` experts and `rows` routed slots."""
    return active * EXPERT_BYTES / (HBM_TBPS * 1e12) * 1e6, 2 * rows * 3 * H * I / (BF16_TFLOPS * 1e12) * 1e6


def active_experts(model: str, t: int) -> float:
    """Expected experts with at least one of T tokens (each token picks a given expert with
    probability k / E under either routing)."""
    e, k, g, gpt = MODELS[model]
    return e * (1 - (1 - k / e) ** t)


def one_gpu_us(model: str, t: int) -> float:
    """The layer on one GPU. kimi-k2: deepseek-v3's GEMM time with its weight-bound share scaled by the
    ratio of active experts (the compute-bound share is the same: same shape, same slots)."""
    if model == "deepseek-v3":
        return DS_LAYER_US[t]
    ds_active, active = active_experts("deepseek-v3", t), active_experts(model, t)
    wb, cb = floors(ds_active, t * MODELS["deepseek-v3"][1])
    w = wb / (wb + cb)
    return FIXED_US + (DS_LAYER_US[t] - FIXED_US) * (w * active / ds_active + (1 - w))


def simulate(model: str, t: int, n: int, trials: int) -> dict[str, float]:
    """Expected maxima over the GPUs of one step: active-expert and slot shares, tokens sent and received
    (its own random stream per model, T and N: every table cell of one setting uses the same draws)."""
    e, k, g, gpt = MODELS[model]
    if e % n or (g > 1 and (g % n and n % g)):
        raise SystemExit(f"{model}: {e} experts in {g} groups do not shard evenly over {n} GPUs")
    rng = random.Random(f"{model}/{t}/{n}")
    per_gpu = e // n
    acc = {"max_expert_share": 0.0, "max_slot_share": 0.0, "max_tokens_moved": 0.0}
    for _ in range(trials):
        active = [set() for _ in range(n)]
        slots = [0] * n
        sent = [0] * n  # token payloads a GPU sends to other GPUs (one per destination GPU)
        recv = [0] * n
        for tok in range(t):
            home = tok * n // t if t >= n else tok  # T / N tokens start on each GPU
            dests = set()
            for x in route(rng, e, k, g, gpt):
                d = x // per_gpu
                active[d].add(x)
                slots[d] += 1
                dests.add(d)
            for d in dests - {home}:
                sent[home] += 1
                recv[d] += 1
        n_active = sum(len(a) for a in active)
        acc["max_expert_share"] += max(len(a) for a in active) / n_active
        acc["max_slot_share"] += max(slots) / (t * k)
        acc["max_tokens_moved"] += max(max(sent), max(recv))
    return {key: v / trials for key, v in acc.items()}


def step(model: str, t: int, n: int, sim: dict[str, float], latency_us: float, link_gbps: float,
         combine_bytes: float = 2.0) -> dict[str, float]:
    """One step's times in us from one routing simulation: one GPU, the busiest shard's GEMMs,
    dispatch per payload, combine."""
    one = one_gpu_us(model, t)
    wb, cb = floors(active_experts(model, t), t * MODELS[model][1])
    w = wb / (wb + cb)
    share = w * sim["max_expert_share"] + (1 - w) * sim["max_slot_share"]
    shard = GEMM_FIXED_US + (one - FIXED_US - GEMM_FIXED_US) * share
    move = lambda b: latency_us + sim["max_tokens_moved"] * H * b / (link_gbps * 1e9) * 1e6
    r = {"one": one, "shard_gemm": shard, "combine": move(combine_bytes)}
    for p, b in PAYLOAD_BYTES.items():
        r["dispatch_" + p] = move(b)
        r["step_" + p] = move(b) + shard + FIXED_US + r["combine"]
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--latency-us", type=float, default=15.0, help="fixed cost of one dispatch or combine")
    ap.add_argument("--link-gbps", type=float, default=330.0, help="NVLink GB/s one GPU reaches in an all-to-all")
    ap.add_argument("--gpus", default="2,4,8")
    a = ap.parse_args()
    ns = sorted(set(map(int, a.gpus.split(","))))
    big = ns[-1]
    sims: dict[tuple[str, int, int], dict[str, float]] = {}

    def sim(model: str, t: int, n: int) -> dict[str, float]:
        if (model, t, n) not in sims:
            sims[(model, t, n)] = simulate(model, t, n, max(4, min(a.trials, int(a.trials * 256 / t))))
        return sims[(model, t, n)]

    for model in MODELS:
        print(f"\n### {model}: {a.latency_us:g} us per exchange, {a.link_gbps:g} GB/s per GPU\n")
        print(f"| T | one GPU | " + " | ".join(f"N = {n}: BF16 / NVFP4 dispatch" for n in ns[:-1])
              + f" | N = {big}: shard GEMMs | dispatch BF16 / FP8 / NVFP4 | combine (BF16) | step (BF16) "
              f"| speedup BF16 / NVFP4 |")
        print("|" + "---|" * (len(ns) + 6))
        for t in DS_LAYER_US:
            cells = []
            for n in ns[:-1]:
                r = step(model, t, n, sim(model, t, n), a.latency_us, a.link_gbps)
                cells.append(f"{r['one'] / r['step_BF16']:.2f}x / {r['one'] / r['step_NVFP4']:.2f}x")
            r = step(model, t, big, sim(model, t, big), a.latency_us, a.link_gbps)
            print(f"| {t} | {r['one']:.0f} | " + "".join(c + " | " for c in cells) + f"{r['shard_gemm']:.0f} | "
                  f"{r['dispatch_BF16']:.0f} / {r['dispatch_FP8']:.0f} / {r['dispatch_NVFP4']:.0f} | {r['combine']:.0f} | "
                  f"{r['step_BF16']:.0f} | {r['one'] / r['step_BF16']:.2f}x / {r['one'] / r['step_NVFP4']:.2f}x |")
    print(f"\n### Sensitivity (deepseek-v3, N = {big}, BF16 dispatch): speedup over one GPU\n")
    lat, bw = (5.0, a.latency_us, 30.0), (a.link_gbps / 2, a.link_gbps)
    print("| T | " + " | ".join(f"{l:g} us, {b:g} GB/s" for b in bw for l in lat)
          + f" | FP32 combine ({a.latency_us:g} us, {a.link_gbps:g} GB/s) |")
    print("|" + "---|" * (2 + len(lat) * len(bw)))
    for t in (1, 4, 16, 128, 1024, 8192):
        s = sim("deepseek-v3", t, big)
        cells = [step("deepseek-v3", t, big, s, l, b) for b in bw for l in lat]
        f32 = step("deepseek-v3", t, big, s, a.latency_us, a.link_gbps, combine_bytes=4.0)
        print(f"| {t} | " + " | ".join(f"{r['one'] / r['step_BF16']:.2f}x" for r in cells)
              + f" | {f32['one'] / f32['step_BF16']:.2f}x |")


if __name__ == "__main__":
    main()
