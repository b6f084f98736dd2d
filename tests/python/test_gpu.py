"""The CUDA layer from PyTorch (run on the GPU machine; skipped without a usable GPU):
byte-identical to `megamoe forward --backend cuda`, external routing bit for bit, CUDA
graph replay at fewer tokens, torch.compile(fullgraph=True), reload under a captured
graph, the functional op, shared workspace, the errors."""
import os

import numpy as np
import pytest
from conftest import f64, run

torch = pytest.importorskip("torch")
import megamoe  # noqa: E402

pytestmark = pytest.mark.skipif(not megamoe.cuda_available(), reason="no CUDA backend / no sm_90 GPU here")
LAYER = 3


@pytest.fixture(scope="module")
def gck(cli, tmp_path_factory):
    d = tmp_path_factory.mktemp("gck") / "ck"
    run([cli, "make-checkpoint", "--preset", "glm-5.3-flash", "--layers", "1", "--hidden", "512", "--inter", "256",
         "--experts", "16", "--topk", "4", "--out", str(d)])
    return str(d)


@pytest.fixture(scope="module")
def glayer(gck):
    return megamoe.MoELayer.from_checkpoint(gck, LAYER, device="cuda", max_tokens=128)


def gck_tensors(gck):
    """The MoE layer's checkpoint tensors of `gck` as CUDA tensors, by name."""
    p = f"model.language_model.layers.{LAYER}.mlp."
    ck = f64.Checkpoint(gck)
    out = {}
    for n in ck.weight_map:
        if n.startswith(p):
            dt, a = ck._file(os.path.join(gck, ck.weight_map[n])).raw(n)
            t = torch.from_numpy(np.array(a).view({1: np.uint8, 2: np.int16, 4: np.float32}[a.itemsize]))
            out[n] = (t.view(torch.bfloat16) if dt == "BF16" else t).cuda()
    return out


def rand_x(T, H=512):
    return torch.randn(T, H, device="cuda").to(torch.bfloat16)


def tb(t):
    torch.cuda.synchronize()
    return t.contiguous().view(torch.uint8).cpu().numpy().tobytes()


def test_matches_cli(cli, gck, glayer, tmp_path):
    x = rand_x(40)
    xin, yout = tmp_path / "x.safetensors", tmp_path / "y.safetensors"
    f64.write_safetensors(str(xin), [("x", "BF16", x.cpu().view(torch.int16).numpy().view(np.uint16))])
    run([cli, "forward", "--checkpoint", gck, "--layer", str(LAYER), "--input", str(xin), "--output", str(yout),
         "--backend", "cuda"])
    st = f64.SafeTensors(str(yout))
    y = torch.full_like(x, float("nan"))
    glayer(x, out=y)
    glayer.check()
    assert tb(y) == st.raw("y")[1].tobytes()
    assert np.array_equal(glayer.topk_ids.cpu().numpy(), st.raw("topk_ids")[1])
    assert glayer.topk_weights.cpu().numpy().tobytes() == st.raw("topk_weights")[1].tobytes()


def test_external_routing_bit_for_bit(glayer):
    x = rand_x(64)
    y = glayer(x)
    ids, w = glayer.topk_ids.clone(), glayer.topk_weights.clone()
    for i in (ids, ids.long()):
        y2 = glayer(x, i, w)
        glayer.check()
        assert tb(y2) == tb(y)
    with pytest.raises(ValueError, match=r"topk_ids: expected expert ids in \[0, 16\), found 16"):
        glayer(x, torch.full_like(ids, 16), w)
    glayer.check_routing = False  # the device record is the backstop
    try:
        glayer(x, torch.full_like(ids, 16), w)
        with pytest.raises(RuntimeError):
            glayer.check()
    finally:
        glayer.check_routing = True
    glayer(x)
    glayer.check()


def test_errors(glayer):
    x = rand_x(8)
    with pytest.raises(ValueError, match="x: expected a tensor on cuda:0.*found cpu"):
        glayer(x.cpu())
    with pytest.raises(TypeError, match="x: expected bfloat16"):
        glayer(x.float())
    with pytest.raises(ValueError, match="max_tokens"):
        glayer(rand_x(129))
    with pytest.raises(ValueError, match="topk_weights: expected a tensor on cuda:0"):
        glayer(x, torch.zeros(8, 4, dtype=torch.int32, device="cuda"), torch.ones(8, 4))


def test_graph_replay_fewer_tokens(glayer):
    T = 96
    x = rand_x(T)
    eager = {n: tb(glayer(x[:n])) for n in (T, 33, 1)}
    y = torch.empty_like(x)
    count = torch.tensor([T], dtype=torch.int32, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        glayer(x, out=y, num_tokens=count)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        glayer(x, out=y, num_tokens=count)
    for n in (T, 33, 1, T):
        y.fill_(float("nan"))
        count.fill_(n)
        g.replay()
        assert tb(y[:n]) == eager[n]
    glayer.check()


def test_reload_under_graph(gck, x_T=64):
    lay = megamoe.MoELayer.from_checkpoint(gck, LAYER, device="cuda", max_tokens=x_T)
    x = rand_x(x_T)
    y = torch.empty_like(x)
    lay(x, out=y)
    ref = tb(y)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        lay(x, out=y)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        lay(x, out=y)
    addr, before = lay.weights_address, lay.weight_bytes()
    lay.zero_experts()
    with lay.reloading(mode="layerwise"):
        for n, t in gck_tensors(gck).items():
            lay.load_weights(n, t)  # device tensors, as a trainer pushes them
    assert lay.weights_address == addr and lay.weight_bytes() == before
    y.fill_(float("nan"))
    g.replay()
    assert tb(y) == ref
    lay.check()


def test_compile_fullgraph(glayer):
    # The ops around the layer are exact in BF16 (a doubling, one rounded add), so inductor's
    # code for them gives aten's bits and any difference would be the layer's.
    class Block(torch.nn.Module):
        def __init__(self, moe):
            super().__init__()
            self.moe = moe

        def forward(self, x):
            return self.moe(x * 2.0) + x

    x = rand_x(48)
    eager = tb(Block(glayer)(x))
    compiled = torch.compile(Block(glayer), fullgraph=True)
    assert tb(compiled(x)) == eager
    glayer(x)
    ids, w = glayer.topk_ids.clone(), glayer.topk_weights.clone()
    y = tb(glayer(x))
    ext = torch.compile(lambda x, i, w: glayer(x, i, w), fullgraph=True)
    assert tb(ext(x, ids, w)) == y
    out = torch.empty_like(x)
    ext_out = torch.compile(lambda x, i, w, o: glayer(x, i, w, out=o), fullgraph=True)
    ext_out(x, ids, w, out)
    assert tb(out) == y
    graphs = torch.compile(Block(glayer), fullgraph=True, mode="reduce-overhead")
    for _ in range(3):  # warm-up, record, replay
        yg = graphs(x)
    assert tb(yg) == eager
    glayer.check()


def test_functional_op_and_workspace(gck, glayer):
    cfg = megamoe.MoEConfig(hidden=512, inter=256, experts=16, topk=4, shared_experts=1)
    gen = torch.Generator(device="cuda").manual_seed(3)
    w13, s13 = megamoe.quantize_block_fp8(torch.randn(16, 512, 512, device="cuda", generator=gen) * 0.05)
    w2, s2 = megamoe.quantize_block_fp8(torch.randn(16, 512, 256, device="cuda", generator=gen) * 0.05)
    sw13, ss13 = megamoe.quantize_block_fp8(torch.randn(512, 512, device="cuda", generator=gen) * 0.05)
    sw2, ss2 = megamoe.quantize_block_fp8(torch.randn(512, 256, device="cuda", generator=gen) * 0.05)
    router = (torch.randn(16, 512, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
    bias = torch.randn(16, device="cuda", generator=gen) * 0.01
    kw = dict(shared_w13=sw13, shared_w13_scale=ss13, shared_w2=sw2, shared_w2_scale=ss2)
    owned = megamoe.MoELayer.from_stacked(cfg, w13=w13, w13_scale=s13, w2=w2, w2_scale=s2, router=router, bias=bias,
                                          **kw, device="cuda", max_tokens=64)
    borrowed = megamoe.MoELayer.from_stacked(cfg, w13=w13, w13_scale=s13, w2=w2, w2_scale=s2, router=router,
                                             bias=bias, **kw, device="cuda", max_tokens=64, borrow=True)
    x = rand_x(64)
    y = owned(x)
    assert tb(borrowed(x)) == tb(y)
    ids, w = owned.topk_ids.clone(), owned.topk_weights.clone()
    y_f = megamoe.ops.fused_moe(x, ids, w, w13, s13, w2, s2, config=cfg, **kw)
    assert tb(y_f) == tb(y)
    n = len(megamoe.ops._cache)
    megamoe.ops.fused_moe(x, ids, w, w13, s13, w2, s2, config=cfg, **kw)
    assert len(megamoe.ops._cache) == n  # cached: no setup the second time
    ws = megamoe.Workspace([cfg, glayer.config], max_tokens=64)
    a = megamoe.MoELayer.from_stacked(cfg, w13=w13, w13_scale=s13, w2=w2, w2_scale=s2, router=router, bias=bias,
                                      **kw, device="cuda", max_tokens=64, workspace=ws)
    b = megamoe.MoELayer.from_checkpoint(gck, LAYER, device="cuda", max_tokens=64, workspace=ws)
    xb = rand_x(64)
    yb = glayer(xb)
    assert tb(a(x)) == tb(y) and tb(b(xb)) == tb(yb)
    a.check()


def test_overhead_runs(glayer):
    from bench_host_overhead import measure

    r = measure(glayer, 1, iters=50)
    print(r)
    assert r["device_us"] > 0 and r["host_layer_us"] > 0


def test_constructors_identical_cuda(gck, glayer):
    tensors = gck_tensors(gck)
    by_name = megamoe.MoELayer.from_tensors(glayer.config, tensors, device="cuda", max_tokens=128)
    assert by_name.weight_bytes() == glayer.weight_bytes()
    x = rand_x(50)
    y = glayer(x)
    assert tb(by_name(x)) == tb(y)
    # a host count: the first n rows, the rest untouched
    out = torch.full_like(x, float("nan"))
    glayer(x, out=out, num_tokens=20)
    assert tb(out[:20]) == tb(glayer(x[:20]))
    assert torch.isnan(out[20:].float()).all()
    props = glayer.properties
    assert props["backend"] == "cuda" and props["workspace_bytes"] > 0 and "tile_config" in props


def test_empty_batch_cuda(glayer):
    x = rand_x(0)
    y = glayer(x)
    glayer.check()
    assert y.shape == (0, 512) and y.dtype == torch.bfloat16
    ids = torch.zeros(0, 4, dtype=torch.int32, device="cuda")
    assert glayer(x, ids, torch.zeros(0, 4, device="cuda")).shape == (0, 512)
    glayer.check()


def test_nonfinite_token_changes_only_its_row_cuda(glayer):
    x = rand_x(48)
    clean = glayer(x)
    x[3, 7] = float("nan")
    x[20, 0] = float("inf")
    x[41, 9] = float("-inf")
    dirty = glayer(x)
    glayer.check()
    for t in range(48):
        same = tb(dirty[t]) == tb(clean[t])
        assert same != (t in (3, 20, 41)), f"token {t}"


def test_refused_load_writes_nothing_cuda(gck):
    lay = megamoe.MoELayer.from_checkpoint(gck, LAYER, device="cuda", max_tokens=64)
    tensors = gck_tensors(gck)
    p = f"model.language_model.layers.{LAYER}.mlp.experts.2.gate_proj."
    w, s = tensors[p + "weight"], tensors[p + "weight_scale_inv"]
    before, x = lay.weight_bytes(), rand_x(16)
    y = lay(x)
    bad = s.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="weight_scale_inv"):
        lay.load_weights({p + "weight": w ^ 1, p + "weight_scale_inv": bad})
    assert lay.weight_bytes() == before
    assert tb(lay(x)) == tb(y)


def test_fused_moe_reloads_keep_device_memory_flat():
    """1,000 reloads into new tensors through the functional op: the cache stays bounded
    and device memory (the driver's count: megamoe's workspaces are its own allocations)
    returns to where it was."""
    import gc

    cfg = megamoe.MoEConfig(hidden=512, inter=256, experts=16, topk=4, shared_experts=1)
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = rand_x(8)
    ids = torch.randint(0, 16, (8, 4), device="cuda", dtype=torch.int32, generator=gen)
    wts = torch.rand(8, 4, device="cuda", generator=gen)

    def fresh():
        w13, s13 = megamoe.quantize_block_fp8(torch.randn(16, 512, 512, device="cuda", generator=gen) * 0.05)
        w2, s2 = megamoe.quantize_block_fp8(torch.randn(16, 512, 256, device="cuda", generator=gen) * 0.05)
        sw13, ss13 = megamoe.quantize_block_fp8(torch.randn(512, 512, device="cuda", generator=gen) * 0.05)
        sw2, ss2 = megamoe.quantize_block_fp8(torch.randn(512, 256, device="cuda", generator=gen) * 0.05)
        return (w13, s13, w2, s2), dict(shared_w13=sw13, shared_w13_scale=ss13, shared_w2=sw2, shared_w2_scale=ss2)

    megamoe.ops.clear_cache()
    args, kw = fresh()
    megamoe.ops.fused_moe(x, ids, wts, *args, config=cfg, **kw)  # warm-up: the zero router, allocator pools
    del args, kw
    gc.collect()
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    sizes = []
    for _ in range(1000):
        args, kw = fresh()
        megamoe.ops.fused_moe(x, ids, wts, *args, config=cfg, **kw)
        del args, kw
        sizes.append(len(megamoe.ops._cache))
    gc.collect()
    torch.cuda.synchronize()
    free1 = torch.cuda.mem_get_info()[0]
    assert max(sizes) <= 1
    # (the torch allocator may keep a few more blocks cached; a leaked workspace per reload
    # would be 1,000 of them)
    assert free0 - free1 < 64 << 20, (free0 - free1) >> 20
