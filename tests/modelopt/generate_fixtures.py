"""Writes tests/fixtures/modelopt_nvfp4_v2.safetensors: NVFP4 bytes produced by ModelOpt 0.47 itself on
CUDA, the oracle of recipe v2 (design/NVFP4.md). Run once on a CUDA machine; the output is committed
and compared byte for byte by the crate's CPU tests (in CI) and GPU tests (on the H200).

    python3 tests/modelopt/generate_fixtures.py OUT.safetensors

Each case `C` stores `C.x` (bf16 [rows, cols], the input), `C.codes` (u8 [rows, cols/2]), `C.scales`
(u8 [rows, cols/16], E4M3 bytes, linear) and `C.g` (f32 [1], the decode scale ModelOpt used). Cases
named `given_*` pass g to ModelOpt (the activation path: a calibrated decode scale); all others let
ModelOpt derive g from the tensor (the weight path: amax / (6 * 448)). The header's metadata records
the device, the versions and, per case, what the data exercises. Deterministic (seeded).
"""

import json
import sys

import torch
from safetensors.torch import save_file

import modelopt_nvfp4

BF16 = torch.bfloat16
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]


def e4m3_values():
    v = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return v  # 0x00..0x7E, increasing


def cases(gen):
    """(name, x bf16 on CPU, g or None, description)."""
    out = []

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    # Normal weights, several shapes: one row, K at its minimum (16), rows not a multiple of 128.
    out.append(("normal_64x256", randn(64, 256).to(BF16), None, "N(0,1) weights"))
    out.append(("normal_1x16", randn(1, 16).to(BF16), None, "one row, K = 16"))
    out.append(("normal_131x48", (randn(131, 48) * 0.02).to(BF16), None, "131 rows, K = 48, small weights"))
    # Heavy-tailed: log-normal magnitudes spanning ~2^-20..2^20, random signs.
    mag = torch.exp(randn(48, 256) * 4.0)
    sign = torch.where(torch.rand(48, 256, generator=gen) < 0.5, -1.0, 1.0)
    out.append(("heavy_tailed_48x256", (mag * sign).to(BF16), None, "log-normal magnitudes, sigma 4"))
    t = torch.distributions.StudentT(torch.tensor(2.0)).sample((32, 128))
    out.append(("student_t_32x128", t.to(BF16), None, "Student-t, 2 degrees of freedom"))

    # Exact E2M1 ties: g = 2^-k so d = s * g is exact, and x = +-b * d exactly for every decision point
    # b; each block holds 6 * d so its scale is s.
    rows = []
    ev = e4m3_values()
    for s_byte in [0x01, 0x05, 0x08, 0x20, 0x33, 0x38, 0x3D, 0x55, 0x70, 0x7E]:
        for k in [0, 7]:
            g = 2.0 ** -k
            d = float(ev[s_byte]) * g
            row = [6.0 * d] + [b * d for b in TIES] + [-b * d for b in TIES] + [-6.0 * d]
            rows.append((row, g))
    for g in sorted(set(g for _, g in rows)):
        xs = torch.tensor([r for r, gg in rows if gg == g], dtype=torch.float32)
        assert torch.equal(xs.to(BF16).float(), xs), "tie values must be exact in bf16"
        out.append((f"given_ties_g2m{int(-torch.log2(torch.tensor(g)).item())}", xs.to(BF16), g,
                    "every E2M1 decision point, both signs, exact in f32"))
    # Ties with the weight path's g (amax * RN(1/2688)): x / d lands on ties only where the
    # division is exact, which is the point: ModelOpt's quotient decides.
    xs = torch.tensor([[6.0] + TIES + [-b for b in TIES] + [-6.0]] * 4, dtype=torch.float32) * 0.5
    out.append(("ties_derived_g", xs.to(BF16), None, "decision-point values with a derived g"))

    # Block scales on E4M3 rounding boundaries: amax / (6 g) exactly at the midpoint of two E4M3
    # values (a tie), and one bf16 ulp either side. g = 2^-3.
    g = 0.125
    rows = []
    for lo in range(0x01, 0x7E, 3):
        mid = (float(ev[lo]) + float(ev[lo + 1])) / 2.0
        amax = torch.tensor(6.0 * mid * g, dtype=torch.float32)
        for nudge in (-1, 0, 1):
            a = amax.to(BF16).view(torch.int16) + nudge
            a = a.view(BF16).float().item()
            row = [a] + [(-1) ** i * a * (i / 16.0) for i in range(1, 16)]
            rows.append(row)
    out.append(("given_e4m3_boundaries", torch.tensor(rows).to(BF16), g,
                "block amax on E4M3 midpoints (ties) and one bf16 ulp either side"))

    # Zero, tiny and underflowing blocks inside a non-zero tensor (the weight path derives g from
    # the tensor's amax):
    x = (randn(8, 128) * 0.5).to(torch.float32)
    x[0, 0:16] = 0.0                       # all-zero block -> ModelOpt scale 1.0 (0x38)
    x[1, 16:32] = -0.0                     # all -0.0 -> codes 0
    x[2, 32:48] = randn(16) * 1e-4        # block scale below 2^-10 -> clamped to 2^-9
    x[3, 48:64] = randn(16) * 3e-3        # block scale between 2^-10 and 2^-9
    x[4, 0:16] = 0.0
    x[4, 3] = -0.0
    x[4, 7] = -1e-6                        # negative that rounds to zero -> code 8
    x[5, 64:80] = randn(16) * 1e-30       # far below: scale clamped, codes mostly 0 / 8
    x[6, 5] = -0.0
    x[6, 9] = -0.0
    out.append(("zero_tiny_8x128", x.to(BF16), None, "all-zero, -0.0, tiny and clamped blocks"))
    # A tensor whose amax is huge: small blocks' amax / (6 g) underflows f32 to 0 -> scale 1.0.
    x = (randn(4, 64) * 1e-20).to(torch.float32)
    x[0, 0] = 3.0e38
    x[1, 17] = -1.0e-3
    out.append(("underflow_4x64", x.to(BF16), None, "t underflows to 0 for small blocks (huge amax)"))
    # bf16 subnormals with a derived g (g itself subnormal in f32).
    x = torch.zeros(2, 32)
    x.view(-1)[:] = torch.tensor([float(i - 16) * 2.0 ** -133 for i in range(64)])
    out.append(("subnormal_2x32", x.to(BF16), None, "bf16 subnormal inputs, subnormal g"))
    # A tiny given g: d = s * g underflows to 0 for small blocks (x / 0 = Inf, 0 / 0 = NaN).
    x = torch.zeros(2, 32)
    x[0, 0] = 1e-38
    x[0, 1] = -1e-38
    x[1, 0:16] = 0.0
    x[1, 16] = 2.0 ** -130
    out.append(("given_tiny_g", x.to(BF16), 2.0 ** -140, "d underflows to 0: Inf and 0/0 quotients"))
    # Calibrated-activation style: SwiGLU-like values with a given non-power-of-two g.
    a = randn(40, 96)
    silu = a * torch.sigmoid(a) * randn(40, 96)
    out.append(("given_swiglu_40x96", silu.to(BF16), float(torch.tensor(5.3 / 2688.0, dtype=torch.float32)),
                "SwiGLU-like activations, given g"))
    return out


def main():
    path = sys.argv[1]
    qt, mo_version = modelopt_nvfp4.load()
    gen = torch.Generator().manual_seed(20261202)
    tensors = {}
    meta_cases = {}
    for name, x, g, desc in cases(gen):
        codes, scales, g_out = modelopt_nvfp4.quantize(qt, x.cuda(), g)
        tensors[f"{name}.x"] = x.contiguous()
        tensors[f"{name}.codes"] = codes
        tensors[f"{name}.scales"] = scales
        tensors[f"{name}.g"] = g_out
        meta_cases[name] = {"desc": desc, "g": "given" if g is not None else "derived", "g_value": g_out.item(),
                            "shape": list(x.shape)}
        print(f"{name:28s} {str(list(x.shape)):12s} g={g_out.item():.9e} ({meta_cases[name]['g']}) "
              f"scales {sorted(set(scales.view(-1).tolist()))[:6]}...")
    meta = {
        "generator": "tests/modelopt/generate_fixtures.py",
        "modelopt": mo_version,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "cases": json.dumps(meta_cases, sort_keys=True),
    }
    save_file(tensors, path, metadata=meta)
    print("wrote", path, "with", len(meta_cases), "cases;", {k: v for k, v in meta.items() if k != "cases"})


if __name__ == "__main__":
    main()
