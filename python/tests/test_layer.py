"""The nvfp4_moe operator on a CUDA GPU (sm_90a): against the float64 reference, in both checkpoint
dialects, through the router, under torch.library.opcheck, torch.compile(fullgraph=True) and
CUDA-graph capture, and its argument errors. Skipped without a GPU.

    pip install --no-build-isolation --no-deps ./python && pytest python/tests
"""

from __future__ import annotations

import gc
import io
import os
import weakref

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import nvfp4_moe
from nvfp4_moe import reference
from nvfp4_moe.layer import Projection

#: The crate's tolerance for the layer against the f64 reference (BF16 intermediate): relative
#: Frobenius error overall and of every token.
TOL = 1e-2

SEED = int(os.environ.get("NVFP4MOE_TEST_SEED", "0x5eed"), 0)


def rng(offset: int = 0) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(SEED + offset)


def random_projection(g: torch.Generator, experts: int, n: int, k: int, dev: str = "cuda") -> Projection:
    """Random NVFP4 weights as `nvfp4-moe check` makes them: E2M1 codes, E4M3 scales in
    0.125..3.75 (exponent 4..8), decode scales in [1e-3, 1e-2) rounded to powers of two (so that
    compressed-tensors' 1/g is exact)."""
    codes = torch.randint(0, 256, (experts, n, k // 2), generator=g, dtype=torch.uint8)
    exp = torch.randint(4, 9, (experts, n, k // 16), generator=g, dtype=torch.uint8)
    man = torch.randint(0, 8, (experts, n, k // 16), generator=g, dtype=torch.uint8)
    scales = ((exp << 3) | man).view(torch.float8_e4m3fn)
    gs = torch.exp2(torch.randint(-9, -6, (experts,), generator=g).float())
    return Projection(codes.to(dev), scales.to(dev), gs.to(dev))


def rel_errors(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    d = got.double() - want
    overall = (d.norm() / want.norm()).item()
    per_token = (d.norm(dim=1) / want.norm(dim=1).clamp_min(1e-30)).max().item()
    return overall, per_token


def layer_and_inputs(experts=16, hidden=256, inter=128, tokens=24, top_k=4, **kwargs):
    g = rng(experts * 1000 + tokens)
    gate, up = random_projection(g, experts, inter, hidden), random_projection(g, experts, inter, hidden)
    down = random_projection(g, experts, hidden, inter)
    layer = nvfp4_moe.MoeLayer(gate, up, down, max_tokens=max(tokens, 64), top_k=top_k, **kwargs)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16).cuda()
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).int().cuda()
    w = torch.rand(tokens, top_k, generator=g).add(0.1).cuda()
    return layer, (gate, up, down), x, ids, w


@pytest.mark.parametrize("experts,hidden,inter,tokens,top_k", [(8, 256, 128, 1, 2), (16, 512, 256, 40, 4), (128, 2048, 768, 16, 8)])
def test_matches_the_float64_reference(experts, hidden, inter, tokens, top_k):
    layer, (gate, up, down), x, ids, w = layer_and_inputs(experts, hidden, inter, tokens, top_k)
    out = layer(x, topk_ids=ids, topk_weights=w)
    want = reference.moe_layer(x, gate, up, down, ids, w)
    overall, worst = rel_errors(out, want)
    assert overall <= TOL and worst <= TOL, f"errors {overall:.3e} / {worst:.3e} (seed {SEED:#x})"
    assert torch.equal(layer(x, topk_ids=ids, topk_weights=w), out), "not deterministic"


def test_both_dialects_give_the_same_bytes():
    g = rng(7)
    experts, hidden, inter = 4, 256, 128
    projs = {p: random_projection(g, experts, *shape) for p, shape in
             [("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))]}
    modelopt, compressed = {}, {}
    for p, proj in projs.items():
        for e in range(experts):
            name = f"model.layers.0.mlp.experts.{e}.{p}"
            modelopt[f"{name}.weight"] = proj.codes[e]
            modelopt[f"{name}.weight_scale"] = proj.scales[e]
            modelopt[f"{name}.weight_scale_2"] = proj.decode_scales[e]
            compressed[f"{name}.weight_packed"] = proj.codes[e]
            compressed[f"{name}.weight_scale"] = proj.scales[e]
            compressed[f"{name}.weight_global_scale"] = 1.0 / proj.decode_scales[e]
    args = dict(prefix="model.layers.0.mlp.experts", num_experts=experts, max_tokens=8, top_k=2)
    a = nvfp4_moe.MoeLayer.from_tensors(modelopt, **args)
    b = nvfp4_moe.MoeLayer.from_tensors(compressed, **args)
    x = torch.randn(8, hidden, generator=g).to(torch.bfloat16).cuda()
    ids = torch.tensor([[e % experts, (e + 1) % experts] for e in range(8)], dtype=torch.int32).cuda()
    w = torch.full((8, 2), 0.5).cuda()
    for buf in ("w13", "w13_scales", "w2", "w2_scales"):
        assert torch.equal(getattr(a, buf), getattr(b, buf)), buf
    assert torch.equal(a(x, topk_ids=ids, topk_weights=w), b(x, topk_ids=ids, topk_weights=w))
    # An expert shard reads only its experts' tensors (the others are not in the dict).
    only = {k: v for k, v in compressed.items() if ".experts.3." in k or ".experts.1." in k}
    c = nvfp4_moe.MoeLayer.from_tensors(only, **args, expert_ids=[3, 1])
    d = nvfp4_moe.MoeLayer(*(sub_projection(projs[p], [3, 1]) for p in ("gate_proj", "up_proj", "down_proj")),
                           max_tokens=8, top_k=2, expert_ids=[3, 1], global_experts=experts)
    assert c.expert_ids == [3, 1] and c.global_experts == experts
    assert torch.equal(c(x, topk_ids=ids, topk_weights=w), d(x, topk_ids=ids, topk_weights=w))


def test_router_path_equals_the_top_k_it_chooses():
    layer, _, x, _, _ = layer_and_inputs(tokens=12)
    logits = torch.randn(12, layer.experts, generator=rng(3)).cuda()
    probs = logits.softmax(-1)
    w, ids = probs.topk(layer.top_k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    out = layer(x, router_logits=logits, renormalize=True)
    want = layer(x, topk_ids=ids.int(), topk_weights=w.float())
    # The same experts; the weights differ in the last FP32 bits (the core's softmax against
    # torch's), which can move a BF16 rounding here and there.
    overall, _ = rel_errors(out, want.double())
    assert overall <= 1e-3, overall


def op_args(layer, x, ids, w) -> tuple:
    """The operator's arguments for the layer's buffers as they are now (no module, no cache)."""
    return (x, layer.w13, layer.w13_scales.view(torch.float32), layer.w2, layer.w2_scales.view(torch.float32), ids, w,
            None, ids.shape[1], True, layer.workspace, layer._buffers.get("expert_map"), layer._config, layer._g)


def test_opcheck():
    layer, _, x, ids, w = layer_and_inputs(tokens=8)
    torch.library.opcheck(torch.ops.nvfp4_moe.forward, op_args(layer, x, ids, w))


def test_compile_fullgraph_and_cuda_graph():
    layer, _, x, ids, w = layer_and_inputs(tokens=16)
    eager = layer(x, topk_ids=ids, topk_weights=w)
    compiled = torch.compile(layer, fullgraph=True)
    assert torch.equal(compiled(x, topk_ids=ids, topk_weights=w), eager)
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        layer(x, topk_ids=ids, topk_weights=w)  # warm-up on the side stream
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        out = layer(x, topk_ids=ids, topk_weights=w)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def uncached(layer, x, ids, w):
    return torch.ops.nvfp4_moe.forward(*op_args(layer, x, ids, w))


def test_replaced_buffers_are_what_the_forward_reads():
    # The eager forward caches the operator's view of the buffers: every replaced buffer (assignment,
    # register_buffer, a scale buffer's storage swapped, Module._apply) must be read, never a cached one.
    a, _, x, ids, w = layer_and_inputs(tokens=8)
    g = rng(99)
    b = nvfp4_moe.MoeLayer(*(random_projection(g, 16, n, k) for n, k in ((128, 256), (128, 256), (256, 128))),
                           max_tokens=64, top_k=4)
    before = a(x, topk_ids=ids, topk_weights=w)
    a13 = a.w13.clone()
    for name in ("w13", "w13_scales", "w2", "w2_scales"):
        t = getattr(b, name).clone()
        if name == "w2":
            a.register_buffer(name, t, persistent=False)  # (not through __setattr__)
        else:
            setattr(a, name, t)  # one at a time: each one's replacement must be seen
        got = a(x, topk_ids=ids, topk_weights=w)
        assert torch.equal(got, uncached(a, x, ids, w)), f"{name}: a replaced buffer was not read"
        assert not torch.equal(got, before), f"{name}: the output did not change"
        before = got
    assert torch.equal(before, b(x, topk_ids=ids, topk_weights=w))
    scales = a.w2_scales.clone()
    a.w2_scales.data = torch.zeros_like(scales)  # new storage in place: zero decode scales
    zero = a(x, topk_ids=ids, topk_weights=w)
    assert torch.equal(zero, uncached(a, x, ids, w)) and not torch.equal(zero, before)
    a._apply(lambda t: t.clone())  # what Module.to does when it moves or converts
    assert "_op_buffers" not in a.__dict__ and "_handle" not in a.__dict__
    a.w2_scales.copy_(scales)  # into the new tensor: a cache kept across _apply would still read zeros
    assert torch.equal(a(x, topk_ids=ids, topk_weights=w), before)
    # A buffer replaced past every module hook (torch.func.functional_call's way: _buffers[name] = t)
    # is read too, and the old one again once it is back.
    via_call = torch.func.functional_call(a, {"w13": a13}, (x,), {"topk_ids": ids, "topk_weights": w})
    assert torch.equal(a(x, topk_ids=ids, topk_weights=w), before)
    a._buffers["w13"] = a13
    got = a(x, topk_ids=ids, topk_weights=w)
    assert torch.equal(got, uncached(a, x, ids, w)) and torch.equal(got, via_call) and not torch.equal(got, before)


def test_eager_fast_path_and_out():
    # The eager forward with top-k ids takes the extension's entry point over the module's handle
    # (nvfp4_moe._C, built wherever the interpreter's headers are: the GPU machine's are): the same
    # bytes as the 14-argument operator, into a new tensor or the caller's `out`; the router path
    # and bad `out`s too.
    eager = nvfp4_moe._ops.eager
    assert eager is not None, "the package was built without nvfp4_moe._C (no Python headers at build time)"
    layer, _, x, ids, w = layer_and_inputs(tokens=24)
    want = uncached(layer, x, ids, w)
    assert torch.equal(layer(x, topk_ids=ids, topk_weights=w), want)
    assert "_handle" in layer.__dict__
    h = layer.__dict__["_handle"][0]  # (the cache: the handle, then the buffers it holds)
    assert torch.equal(eager.forward(h, x, ids, w, None), want)
    out = torch.full_like(want, float("nan"))
    assert layer(x, topk_ids=ids, topk_weights=w, out=out) is out
    assert torch.equal(out, want)
    out.fill_(float("nan"))
    assert eager.forward(h, x, ids, w, out) is out
    assert torch.equal(out, want)
    logits = torch.randn(x.shape[0], layer.experts, device="cuda")
    out.fill_(float("nan"))
    assert layer(x, router_logits=logits, out=out) is out
    assert torch.equal(out, layer(x, router_logits=logits))
    for bad, error in ((out.float(), TypeError), (out[:, :-1], ValueError), (out[:-1], ValueError),
                       (out.t().contiguous().t(), ValueError), (out.cpu(), ValueError)):
        with pytest.raises(error):
            layer(x, topk_ids=ids, topk_weights=w, out=bad)
        with pytest.raises(error):
            layer(x, router_logits=logits, out=bad)
    with pytest.raises(ValueError):  # (the router path checks it before running)
        layer(x, router_logits=logits, out=torch.zeros_like(out).requires_grad_())
    for kwargs in ({"topk_ids": ids, "topk_weights": w}, {"router_logits": logits}):
        with pytest.raises(ValueError, match="overlaps hidden"):  # out overlapping an input the forward reads
            layer(x, out=x, **kwargs)
    with pytest.raises(ValueError):  # all inputs on the CPU: the device is named, as for the 14-argument forward
        layer(x.cpu(), topk_ids=ids.cpu(), topk_weights=w.cpu())
    with pytest.raises(ValueError):
        eager.forward(h, x.clone().requires_grad_(), ids, w, None)
    with pytest.raises(ValueError):
        eager.forward(h, x, ids[:, :2].contiguous(), w, None)  # ids and weights disagree
    with pytest.raises(TypeError):
        eager.forward(h, x, ids.long(), w, None)
    with pytest.raises(TypeError):  # not a tensor, wrong argument count
        eager.forward(h, x.tolist(), ids, w, None)
    with pytest.raises(TypeError):
        eager.forward(h, x, ids, w)
    with pytest.raises(TypeError, match="handle"):  # not a layer handle
        eager.forward(x, x, ids, w, None)
    with pytest.raises(TypeError):  # out not a tensor; keywords (METH_FASTCALL takes none)
        eager.forward(h, x, ids, w, "out")
    with pytest.raises(TypeError):
        eager.forward(h, x, ids, w, out=None)
    with pytest.raises(ValueError, match="requires grad"):  # the eager path's own out check
        layer(x, topk_ids=ids, topk_weights=w, out=torch.zeros_like(out).requires_grad_())
    version = out._version  # written in place outside the dispatcher: its version moves as copy_'s would
    layer(x, topk_ids=ids, topk_weights=w, out=out)
    assert out._version > version
    with pytest.raises(ValueError):
        eager.layer(layer.w13.cpu(), layer.w13_scales, layer.w2, layer.w2_scales, layer.workspace, None,
                    layer._config, layer._g)
    with pytest.raises(TypeError):  # a handle holds the scales' int32 bits, the 14-argument forward float32
        eager.layer(layer.w13, layer.w13_scales.view(torch.float32), layer.w2, layer.w2_scales, layer.workspace, None,
                    layer._config, layer._g)
    args = list(op_args(layer, x, ids, w))
    args[2] = layer.w13_scales  # int32
    with pytest.raises(TypeError):
        torch.ops.nvfp4_moe.forward(*args)
    with pytest.raises(ValueError):  # another layer's config
        eager.layer(layer.w13, layer.w13_scales, layer.w2, layer.w2_scales, layer.workspace, None,
                    [layer._config[0] * 2, *layer._config[1:]], layer._g)
    with pytest.raises(TypeError):
        eager.layer(layer.w13, layer.w13_scales, layer.w2, layer.w2_scales, layer.workspace, None, ["a"], layer._g)
    assert torch.equal(layer(x, topk_ids=ids, topk_weights=w), want)  # still works
    # A handle holds its buffers until it is dropped (the capsule's destructor releases them).
    bufs = [t.clone() for t in (layer.w13, layer.w13_scales, layer.w2, layer.w2_scales, layer.workspace)]
    refs = [weakref.ref(t) for t in bufs]
    h2 = eager.layer(*bufs, None, layer._config, layer._g)
    del bufs
    gc.collect()
    assert all(r() is not None for r in refs)
    del h2
    gc.collect()
    assert all(r() is None for r in refs)
    del h
    layer.__dict__.pop("_handle")  # the module's handle dropped, then made again
    assert torch.equal(layer(x, topk_ids=ids, topk_weights=w), want)
    del layer.workspace  # a removed buffer is named, not read through the handle
    with pytest.raises(RuntimeError, match="workspace"):
        layer(x, topk_ids=ids, topk_weights=w)


def test_eager_path_is_not_taken_under_a_dispatch_mode():
    # The eager entry point bypasses the dispatcher: under a TorchDispatchMode (what make_fx and
    # FakeTensorMode are) the module must call the registered operator, which the mode then sees.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    layer, _, x, ids, w = layer_and_inputs(tokens=8)
    want = layer(x, topk_ids=ids, topk_weights=w)
    with Recorder() as rec:
        got = layer(x, topk_ids=ids, topk_weights=w)
    assert any("nvfp4_moe.forward" in op for op in rec.ops), rec.ops
    assert torch.equal(got, want)


def test_eager_path_is_not_taken_under_a_jit_trace():
    # A trace records operators only: the module must call the registered one while tracing.
    layer, _, x, ids, w = layer_and_inputs(tokens=8)
    want = layer(x, topk_ids=ids, topk_weights=w)
    traced = torch.jit.trace(lambda h, i, wt: layer(h, topk_ids=i, topk_weights=wt), (x, ids, w), check_trace=False)
    assert "nvfp4_moe::forward" in str(traced.graph), traced.graph
    assert torch.equal(traced(x, ids, w), want)


def test_save_and_load_after_a_forward():
    layer, _, x, ids, w = layer_and_inputs(tokens=8)
    want = layer(x, topk_ids=ids, topk_weights=w)
    f = io.BytesIO()
    torch.save(layer, f)  # (the cached float32 views of int32 buffers are not state)
    f.seek(0)
    again = torch.load(f, weights_only=False)
    assert torch.equal(again(x, topk_ids=ids, topk_weights=w), want)


def test_bad_inputs_raise():
    layer, _, x, ids, w = layer_and_inputs(tokens=4)
    with pytest.raises(TypeError):
        layer(x.float(), topk_ids=ids, topk_weights=w)
    with pytest.raises(ValueError):
        layer(x.cpu(), topk_ids=ids, topk_weights=w)
    with pytest.raises(ValueError):
        layer(x.clone().requires_grad_(), topk_ids=ids, topk_weights=w)
    with pytest.raises(ValueError):
        layer(x, topk_ids=ids)  # no weights
    with pytest.raises(ValueError):
        layer(x[:, :128].contiguous(), topk_ids=ids, topk_weights=w)  # wrong hidden size
    assert torch.isfinite(layer(x, topk_ids=ids, topk_weights=w).float()).all()  # still works


def test_check_reports_a_bad_expert_id():
    layer, _, x, ids, w = layer_and_inputs(tokens=4)
    bad = ids.clone()
    bad[2, 1] = layer.experts + 3
    layer(x, topk_ids=bad, topk_weights=w)
    with pytest.raises(ValueError, match=rf"topk_ids\[2, 1\] = {layer.experts + 3}"):
        layer.check(top_k=ids.shape[1])
    layer.check()  # cleared


def test_same_bytes_as_the_c_abi():
    from capi import CLayer

    for experts, hidden, inter, tokens, top_k in [(16, 512, 256, 1, 4), (128, 2048, 768, 16, 8), (8, 1024, 512, 64, 2)]:
        layer, (gate, up, down), x, ids, w = layer_and_inputs(experts, hidden, inter, tokens, top_k)
        c = CLayer(gate, up, down, max_tokens=max(tokens, 64), top_k=top_k)
        try:
            assert torch.equal(layer(x, topk_ids=ids, topk_weights=w), c(x, ids, w)), (experts, tokens)
        finally:
            c.close()


def test_c_abi_forward_captures_in_a_graph():
    """nvfp4moe_layer_forward inside torch.cuda.graph (global capture mode, where an unsafe call
    such as cudaStreamGetDevice invalidates the capture): the replay writes the eager bytes."""
    from capi import CLayer

    layer, (gate, up, down), x, ids, w = layer_and_inputs(tokens=16)
    c = CLayer(gate, up, down, max_tokens=64, top_k=ids.shape[1])
    try:
        eager = c(x, ids, w)
        out = torch.full_like(eager, float("nan"))  # poisoned: the replay must write every element
        f = c.args(x, ids, w, out)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            c.forward_args(f)  # warm-up on the side stream
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        out.fill_(float("nan"))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            c.forward_args(f)
        assert torch.isnan(out.float()).all()  # captured, not run
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        assert torch.equal(eager, layer(x, topk_ids=ids, topk_weights=w))
    finally:
        c.close()


def test_nvfp4_intermediate_and_options():
    """The NVFP4 intermediate (the crate's `check --intermediate nvfp4` tolerances: NVFP4's own
    error on SwiGLU data is ~9% RMS), batch invariance, renormalize=False, and .to(dtype) leaving
    the layer's buffers alone."""
    layer, (gate, up, down), x, ids, w = layer_and_inputs(tokens=32)
    want = reference.moe_layer(x, gate, up, down, ids, w)
    # The decode scale from the intermediate's amax (ModelOpt's input_scale recipe: amax / (6 * 448)).
    xd = x.double()
    act_amax = max(
        (torch.nn.functional.silu(xd @ reference.dequantize(gate, e).T) * (xd @ reference.dequantize(up, e).T))
        .abs().max().item()
        for e in ids.unique().tolist()
    )
    fp4 = nvfp4_moe.MoeLayer(gate, up, down, max_tokens=64, top_k=4, intermediate=act_amax / (6 * 448))
    overall, worst = rel_errors(fp4(x, topk_ids=ids, topk_weights=w), want)
    assert overall <= 0.15 and worst <= 0.25, (overall, worst)
    inv = nvfp4_moe.MoeLayer(gate, up, down, max_tokens=64, top_k=4, batch_invariant=True)
    full = inv(x, topk_ids=ids, topk_weights=w)
    assert torch.equal(inv(x[:1], topk_ids=ids[:1], topk_weights=w[:1]), full[:1]), "batch invariance"
    logits = torch.randn(32, layer.experts, generator=rng(5)).cuda()
    assert torch.isfinite(layer(x, router_logits=logits, renormalize=False).float()).all()
    before = layer(x, topk_ids=ids, topk_weights=w)
    layer.to(torch.bfloat16)
    assert torch.equal(layer(x, topk_ids=ids, topk_weights=w), before)


def sub_projection(p: Projection, ids) -> Projection:
    """The experts `ids` of a projection, in that order."""
    idx = torch.tensor(ids, device=p.codes.device)
    return Projection(p.codes[idx], p.scales[idx], p.decode_scales[idx])


def test_expert_shards_add_up_to_the_whole_layer():
    """Shards of 2 and 4 experts' partitions (contiguous and scattered) with float32 outputs add up
    to the whole layer's float32 output within 1e-5 (the crate's bound: only the order of that sum
    differs), through the caller's top-k and the router; a token routed to none of a shard's
    experts gets zeros; a shard of every expert in a shuffled order gives the whole layer's bytes."""
    experts, hidden, inter, top_k = 16, 512, 256, 4
    layer, (gate, up, down), x, ids, w = layer_and_inputs(experts, hidden, inter, 40, top_k,
                                                          output_dtype=torch.float32)
    want = layer(x, topk_ids=ids, topk_weights=w)
    assert want.dtype == torch.float32 and torch.isfinite(want).all()
    logits = torch.randn(40, experts, generator=rng(11)).cuda()
    want_router = layer(x, router_logits=logits)
    g = rng(12)
    for n in (2, 4):
        order = torch.randperm(experts, generator=g).tolist()
        for shards in ([list(range(s * experts // n, (s + 1) * experts // n)) for s in range(n)],
                       [order[:3], order[3:]] if n == 2 else [order[:1], order[1:6], order[6:7], order[7:]]):
            total, total_router = torch.zeros_like(want, dtype=torch.float64), torch.zeros_like(want, dtype=torch.float64)
            for ids_here in shards:
                shard = nvfp4_moe.MoeLayer(*(sub_projection(p, ids_here) for p in (gate, up, down)), max_tokens=64,
                                           top_k=top_k, output_dtype=torch.float32, expert_ids=ids_here,
                                           global_experts=experts)
                assert shard.global_experts == experts and shard.expert_ids == ids_here
                got = shard(x, topk_ids=ids, topk_weights=w)
                none_here = ~torch.isin(ids, torch.tensor(ids_here, device=ids.device, dtype=ids.dtype)).any(dim=1)
                assert (got[none_here] == 0).all(), (n, ids_here)
                total += got.double()
                total_router += shard(x, router_logits=logits).double()
                shard.check()
            for what, t, ref in (("top-k", total, want), ("router", total_router, want_router)):
                rel = ((t - ref.double()).norm() / ref.double().norm()).item()
                assert rel <= 1e-5, (what, n, shards, rel)
    whole_bf16 = nvfp4_moe.MoeLayer(gate, up, down, max_tokens=64, top_k=top_k)
    order = torch.randperm(experts, generator=g).tolist()
    permuted = nvfp4_moe.MoeLayer(*(sub_projection(p, order) for p in (gate, up, down)), max_tokens=64, top_k=top_k,
                                  expert_ids=order, global_experts=experts)
    assert torch.equal(permuted(x, topk_ids=ids, topk_weights=w), whole_bf16(x, topk_ids=ids, topk_weights=w))


def test_bad_shards_raise():
    _, (gate, up, down), x, ids, w = layer_and_inputs(experts=8)
    sub = [sub_projection(p, [5, 2]) for p in (gate, up, down)]
    for kwargs, says in [
        (dict(expert_ids=[5, 2]), "global_experts in 1..=1024"),
        (dict(global_experts=8), "only with expert_ids"),
        (dict(expert_ids=[5, 2, 1], global_experts=8), "lists 3 expert ids"),
        (dict(expert_ids=[5, 8], global_experts=8), r"expert_ids\[1\] = 8 is not in \[0, 8\)"),
        (dict(expert_ids=[5, 5], global_experts=8), r"repeats expert_ids\[0\]"),
        (dict(output_dtype=torch.float16), "output_dtype"),
    ]:
        with pytest.raises(ValueError, match=says):
            nvfp4_moe.MoeLayer(*sub, max_tokens=8, top_k=2, **kwargs)
    shard = nvfp4_moe.MoeLayer(*sub, max_tokens=64, top_k=4, expert_ids=[5, 2], global_experts=8)
    bad = ids.clone()
    bad[3, 2] = 8  # a global id out of range
    shard(x, topk_ids=bad, topk_weights=w)
    with pytest.raises(ValueError, match=r"topk_ids\[3, 2\] = 8 is not an expert id in \[0, 8\)"):
        shard.check()
    with pytest.raises(ValueError, match=r"router_logits must be \[T, E\] = \[24, 8\]"):
        shard(x, router_logits=torch.randn(24, 2).cuda())
