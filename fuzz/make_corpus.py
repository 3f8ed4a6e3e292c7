#!/usr/bin/env python3
"""Writes the committed seed corpus of the fuzz targets (fuzz/corpus/<target>/) from the test
fixtures (tests/fixtures/, tests/golden/) plus a few hand-made edge cases. Standard library only;
deterministic (re-running it gives the same files). Run from anywhere: python3 fuzz/make_corpus.py
"""
import json
import struct
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "fuzz" / "corpus"
PREFIX = "model.layers.0.mlp.experts"


def header_of(path):
    b = path.read_bytes()
    n = struct.unpack("<Q", b[:8])[0]
    return json.loads(b[8 : 8 + n]), b[8 + n :]


def safetensors(tensors, metadata=None, pad=True):
    """A safetensors file: tensors = [(name, dtype, shape, bytes)] in this order."""
    head, data, off = {}, b"", 0
    if metadata is not None:
        head["__metadata__"] = metadata
    for name, dtype, shape, raw in tensors:
        head[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(raw)]}
        data += raw
        off += len(raw)
    h = json.dumps(head, separators=(",", ":")).encode()
    if pad:
        h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def raw_header(text, data=b""):
    h = text.encode()
    return struct.pack("<Q", len(h)) + h + data


def write(target, name, data):
    d = CORPUS / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data)


def safetensors_seeds():
    t = "safetensors_header"
    # Small files of the repository as they are.
    for f in ["q-f32.safetensors", "d-f32.safetensors", "q-bf16.safetensors"]:
        write(t, "golden-" + f.replace(".safetensors", ""), (ROOT / "tests/golden" / f).read_bytes())
    # One expert of the ModelOpt fixture's header, with tiny shapes.
    g = struct.pack("<f", 0.001)
    write(t, "modelopt-expert", safetensors([
        (f"{PREFIX}.0.gate_proj.weight", "U8", [2, 8], bytes(range(16))),
        (f"{PREFIX}.0.gate_proj.weight_scale", "F8_E4M3", [2, 1], b"\x38\x40"),
        (f"{PREFIX}.0.gate_proj.weight_scale_2", "F32", [], g),
        (f"{PREFIX}.0.gate_proj.input_scale", "F32", [1], g),
    ], {"format": "pt"}))
    # Edge cases: a zero dimension beside a huge one, an empty file of tensors, unpadded header,
    # every dtype once, and invalid ones (a repeated key, overlapping ranges, a bad metadata).
    write(t, "zero-dim-huge", safetensors([("x", "BF16", [0, 1 << 63], b""), ("y", "U8", [1], b"\x01")]))
    write(t, "no-tensors", safetensors([], {"format": "pt"}))
    write(t, "unpadded", safetensors([("a", "F32", [1], g)], pad=False))
    dtypes = ["BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16", "I32", "U32", "F32",
              "F64", "I64", "U64", "F4", "F6_E2M3", "F6_E3M2", "F8_E8M0"]
    tensors = []
    for i, d in enumerate(dtypes):
        n = {"F4": 2, "F6_E2M3": 4, "F6_E3M2": 4}.get(d, 1)
        bits = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F4": 4,
                "F6_E2M3": 6, "F6_E3M2": 6}.get(d, 8 * {"I16": 2, "U16": 2, "F16": 2, "BF16": 2,
                                                        "I32": 4, "U32": 4, "F32": 4}.get(d, 8))
        tensors.append((f"t{i}", d, [n], bytes(n * bits // 8)))
    write(t, "every-dtype", safetensors(tensors))
    x = '"x":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}'
    write(t, "repeated-key", raw_header("{" + x + "," + x + "}", b"\x00\x01"))
    write(t, "overlap", raw_header('{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},'
                                   '"b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}', b"\x00" * 3))
    write(t, "metadata-not-strings", raw_header('{"__metadata__":{"a":1},' + x + "}", b"\x00\x01"))


def checkpoint_seeds():
    t = "checkpoint_names"
    fx = ROOT / "tests/fixtures/checkpoints"
    for name in ["modelopt_w4a4", "ct_w4a16", "ct_w4a4", "bf16_moe"]:
        head, _ = header_of(fx / name / "model.safetensors")
        lines = [PREFIX]
        for k in sorted(head):
            if k == "__metadata__":
                continue
            v = head[k]
            lines.append(f"{k} {v['dtype']} {','.join(str(d) for d in v['shape'])}".rstrip())
        write(t, name, ("\n".join(lines) + "\n").encode())

    def layer(projs, experts, fields, h=32, i=16, prefix=PREFIX, index=str):
        lines = [prefix]
        for e in range(experts):
            for p in projs:
                n, k = {"down_proj": (h, i), "w2": (h, i), "gate_up_proj": (2 * i, h), "w13": (2 * i, h)}.get(p, (i, h))
                for f in fields:
                    shape = {"weight": f"{n},{k // 2}", "weight_packed": f"{n},{k // 2}",
                             "weight_scale": f"{n},{k // 16}"}.get(f, "")
                    dtype = {"weight": "U8", "weight_packed": "U8", "weight_scale": "F8_E4M3"}.get(f, "F32")
                    lines.append(f"{prefix}.{index(e)}.{p}.{f} {dtype} {shape}".rstrip())
        return ("\n".join(lines) + "\n").encode()

    mo = ["weight", "weight_scale", "weight_scale_2", "input_scale"]
    write(t, "mixtral-w1w3w2", layer(["w1", "w3", "w2"], 2, mo, prefix="model.layers.0.block_sparse_moe.experts"))
    write(t, "fused-gate-up", layer(["gate_up_proj", "down_proj"], 2, mo[:3]))
    write(t, "fused-w13", layer(["w13", "w2"], 1, mo[:3]))
    write(t, "ct-fields", layer(["gate_proj", "up_proj", "down_proj"], 2,
                                ["weight_packed", "weight_scale", "weight_global_scale"]))
    write(t, "expert-usize-max", layer(["gate_proj", "up_proj", "down_proj"], 2, mo[:3],
                                       index=lambda e: str([0, 18446744073709551615][e])))
    write(t, "zero-dims", layer(["gate_proj", "up_proj", "down_proj"], 1, mo[:3], h=0, i=16))


def nvfp4_seeds():
    t = "nvfp4_weight"
    head, data = header_of(ROOT / "tests/fixtures/modelopt_nvfp4_v2.safetensors")
    dtype_index = {"U8": 0, "F8_E4M3": 1, "F32": 2}

    def dim(d):
        return bytes([d]) if d < 128 else b"\x80" + struct.pack("<Q", d)

    def encode(tensors, g, codes, scales):
        out = b""
        for dtype, shape in tensors:
            out += bytes([dtype_index.get(dtype, dtype) if isinstance(dtype, str) else dtype, len(shape)])
            out += b"".join(dim(d) for d in shape)
        return out + g + codes + scales

    def tensor(name):
        v = head[name]
        b, e = v["data_offsets"]
        return v, data[b:e]

    for case in ["normal_1x16", "ties_derived_g", "subnormal_2x32", "given_tiny_g", "zero_tiny_8x128"]:
        (cv, codes), (sv, scales), (gv, g) = tensor(case + ".codes"), tensor(case + ".scales"), tensor(case + ".g")
        write(t, case, encode([("U8", cv["shape"]), ("F8_E4M3", sv["shape"]), ("F32", gv["shape"])], g, codes, scales))
    one = struct.pack("<f", 1.0)
    write(t, "huge-k", encode([("U8", [0, 1 << 62]), ("F8_E4M3", [0, 1 << 59]), ("F32", [])], one, b"", b""))
    write(t, "scalar-g-nan", encode([("U8", [1, 8]), ("F8_E4M3", [1, 1]), ("F32", [])],
                                    struct.pack("<f", float("nan")), bytes(8), b"\x38"))


if __name__ == "__main__":
    safetensors_seeds()
    checkpoint_seeds()
    nvfp4_seeds()
    total = sum(p.stat().st_size for p in CORPUS.rglob("*") if p.is_file())
    print(f"{CORPUS}: {sum(1 for p in CORPUS.rglob('*') if p.is_file())} files, {total} bytes")
