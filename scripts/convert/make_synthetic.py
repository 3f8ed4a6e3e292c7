"""Writes a synthetic BF16 Mixture-of-Experts checkpoint in the Hugging Face layout, for measuring
`nvfp4-moe convert` (scripts/convert/bench.sh) and for checking its output with compressed-tensors
(scripts/convert/ct_check.sh).

    python3 make_synthetic.py --out DIR [--layers 4 --experts 64 --hidden 4096 --intermediate 1536
                              --vocab 32000 --shard-gb 4]

The defaults give about 10.7 GB (4 layers of 64 routed experts of 3 x 4096 x 1536, attention, a
router, a shared expert, norms, embeddings and lm_head), sharded into files of at most --shard-gb
with a model.safetensors.index.json, and a Qwen3-MoE-like config.json. Weights are Gaussian (std
0.02, up 0.06) in BF16, drawn with torch (on the GPU when there is one) or numpy. Files are
written tensor by tensor (header first), so memory stays at one tensor.
"""

import argparse
import json
import os
import struct
import sys
import time


def bf16_normal(n, std, seed):
    """n BF16 values (little-endian bytes) ~ N(0, std^2)."""
    try:
        import torch

        dev = "cuda" if torch.cuda.is_available() else "cpu"
        g = torch.Generator(device=dev)
        g.manual_seed(seed)
        t = torch.randn(n, generator=g, device=dev, dtype=torch.float32).mul_(std).to(torch.bfloat16)
        t = t.cpu().contiguous()
        # The raw bytes without numpy (torch may be installed without it).
        import ctypes

        return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())
    except ImportError:
        pass
    try:
        import numpy as np

        x = np.random.default_rng(seed).standard_normal(n, dtype=np.float32) * np.float32(std)
        u = x.view(np.uint32).astype(np.uint64)
        u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even
        return u.tobytes()
    except ImportError:
        # Plain Python (slow: small models only).
        import random

        r = random.Random(seed)
        out = bytearray()
        for _ in range(n):
            (u,) = struct.unpack("<I", struct.pack("<f", r.gauss(0.0, std)))
            out += struct.pack("<H", (u + 0x7FFF + ((u >> 16) & 1)) >> 16)
        return bytes(out)


def tensors(a):
    """(name, shape, std) of every tensor, in file order."""
    h, i, e, v = a.hidden, a.intermediate, a.experts, a.vocab
    out = [("model.embed_tokens.weight", [v, h], 0.5)]
    for layer in range(a.layers):
        p = f"model.layers.{layer}"
        out.append((f"{p}.input_layernorm.weight", [h], None))
        out.append((f"{p}.post_attention_layernorm.weight", [h], None))
        for proj in ["q_proj", "k_proj", "v_proj", "o_proj"]:
            out.append((f"{p}.self_attn.{proj}.weight", [h, h], 0.02))
        out.append((f"{p}.mlp.gate.weight", [e, h], 0.1))
        for proj, shape in [("gate_proj", [i, h]), ("up_proj", [i, h]), ("down_proj", [h, i])]:
            out.append((f"{p}.mlp.shared_experts.{proj}.weight", shape, 0.02))
        for x in range(e):
            out.append((f"{p}.mlp.experts.{x}.gate_proj.weight", [i, h], 0.02))
            out.append((f"{p}.mlp.experts.{x}.up_proj.weight", [i, h], 0.06))
            out.append((f"{p}.mlp.experts.{x}.down_proj.weight", [h, i], 0.02))
    out.append(("model.norm.weight", [h], None))
    out.append(("lm_head.weight", [v, h], 0.02))
    return out


def write_shard(path, items, seed):
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, _ in items:
        n = 1
        for d in shape:
            n *= d
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + 2 * n]}
        offset += 2 * n
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for k, (name, shape, std) in enumerate(items):
            n = 1
            for d in shape:
                n *= d
            if std is None:
                f.write(b"\x80\x3f" * n)  # BF16 1.0 (norm weights)
            else:
                f.write(bf16_normal(n, std, seed * 100003 + k))
    return offset


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--shard-gb", type=float, default=4.0)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    all_t = tensors(a)
    limit = int(a.shard_gb * 1e9)
    shards, cur, size = [], [], 0
    for t in all_t:
        n = 2
        for d in t[1]:
            n *= d
        if cur and size + n > limit:
            shards.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += n
    shards.append(cur)
    weight_map, total = {}, 0
    for s, items in enumerate(shards):
        name = f"model-{s + 1:05d}-of-{len(shards):05d}.safetensors"
        total += write_shard(os.path.join(a.out, name), items, s + 1)
        for t in items:
            weight_map[t[0]] = name
        print(f"wrote {name} ({len(items)} tensors)", flush=True)
    with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": a.hidden,
        "intermediate_size": a.intermediate,
        "moe_intermediate_size": a.intermediate,
        "num_experts": a.experts,
        "num_experts_per_tok": 8 if a.experts >= 8 else a.experts,
        "num_hidden_layers": a.layers,
        "num_attention_heads": max(1, a.hidden // 128),
        "num_key_value_heads": max(1, a.hidden // 128),
        "head_dim": 128,
        "vocab_size": a.vocab,
        "torch_dtype": "bfloat16",
    }
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    print(f"synthetic model: {total / 1e9:.2f} GB of BF16 tensors in {len(shards)} shards, "
          f"{time.time() - t0:.1f} s -> {a.out}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
