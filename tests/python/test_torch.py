"""The layer from PyTorch on the CPU backend: torch tensors through DLPack (no copies),
the custom op megamoe::moe_forward and torch.compile(fullgraph=True) through it."""
import numpy as np
import pytest
from conftest import LAYER, bits

torch = pytest.importorskip("torch")
import megamoe  # noqa: E402


@pytest.fixture(scope="module")
def layer(ckpt):
    return megamoe.MoELayer.from_checkpoint(ckpt, LAYER, device="cpu", max_tokens=64)


def tbits(t):
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def test_module_and_numpy_agree(layer, x16):
    assert isinstance(layer, torch.nn.Module)
    xt = torch.from_numpy(x16.view(np.uint16).astype(np.int16)).view(torch.bfloat16)
    y_np = layer(x16)
    y = layer(xt)
    assert y.dtype == torch.bfloat16 and y.shape == xt.shape
    assert tbits(y) == bits(y_np)
    assert isinstance(layer.topk_ids, torch.Tensor) and layer.topk_ids.dtype == torch.int32
    # external routing from torch tensors, int64 ids
    y2 = layer(xt, layer.topk_ids.long(), layer.topk_weights.clone())
    assert tbits(y2) == tbits(y)


def test_custom_op_and_compile(layer, x16):
    xt = torch.from_numpy(x16.view(np.uint16).astype(np.int16)).view(torch.bfloat16)
    y = layer(xt)
    y_op = torch.ops.megamoe.moe_forward(layer._handle, xt, None, None, None)
    assert tbits(y_op) == tbits(y)
    torch.library.opcheck(torch.ops.megamoe.moe_forward.default, (layer._handle, xt, None, None, None),
                          test_utils=("test_schema", "test_faketensor"))

    class Block(torch.nn.Module):
        def __init__(self, moe):
            super().__init__()
            self.moe = moe

        def forward(self, x):
            return self.moe(x * 1.0) + 0.0

    m = torch.compile(Block(layer), fullgraph=True, backend="aot_eager")
    assert tbits(m(xt)) == tbits(y)
    ids, w = layer.topk_ids.clone(), layer.topk_weights.clone()

    class Ext(torch.nn.Module):
        def __init__(self, moe):
            super().__init__()
            self.moe = moe

        def forward(self, x, i, w, out):
            return self.moe(x, i, w, out=out)

    out = torch.empty_like(xt)
    e = torch.compile(Ext(layer), fullgraph=True, backend="aot_eager")
    e(xt, ids, w, out)
    assert tbits(out) == tbits(y)


def test_torch_errors(layer, x16):
    xt = torch.from_numpy(x16.view(np.uint16).astype(np.int16)).view(torch.bfloat16)
    with pytest.raises(TypeError, match="x: expected bfloat16 or float32"):
        layer(xt.half())
    with pytest.raises(ValueError, match=r"x: expected shape \[T, 256\]"):
        layer(xt[:, :100])
    with pytest.raises(ValueError, match="topk_ids: expected expert ids in \\[0, 16\\)"):
        layer(xt, torch.full((24, 4), 16, dtype=torch.int32), torch.ones(24, 4))


def test_quantize_torch_matches_numpy():
    w = torch.randn(3, 300, 200) * 0.05
    q, s = megamoe.quantize_block_fp8(w)
    qn, sn = megamoe.quantize_block_fp8(w.numpy())
    assert q.dtype == torch.float8_e4m3fn
    assert np.array_equal(s.numpy(), sn)
    assert np.array_equal(q.view(torch.uint8).numpy(), qn)


def test_fused_moe_finds_its_layer_through_new_views():
    """An engine that passes a new tensor object over the same memory on each call
    (param.data, a slice, a uint8 view) reuses the cached layer (no setup per call); the
    layer goes when the memory does, not with the first call's object."""
    import weakref

    cfg = megamoe.MoEConfig(hidden=256, inter=128, experts=16, topk=4)
    g = torch.Generator().manual_seed(5)
    w13, s13 = megamoe.quantize_block_fp8(torch.randn(16, 256, 256, generator=g) * 0.05)
    w2, s2 = megamoe.quantize_block_fp8(torch.randn(16, 256, 128, generator=g) * 0.05)
    p13 = torch.nn.Parameter(w13, requires_grad=False)
    del w13
    x = torch.randn(4, 256, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(4)]).to(torch.int32)
    w = torch.rand(4, 4, generator=g)
    megamoe.ops.clear_cache()

    def call(t13):
        y = megamoe.ops.fused_moe(x, ids, w, t13, s13, w2, s2, config=cfg)
        return y, next(reversed(megamoe.ops._cache.values()))

    y, layer = call(p13.data)
    first = weakref.ref(layer)
    del layer
    for view in (lambda: p13.data, lambda: p13[:], lambda: p13.data.view(torch.uint8), lambda: p13):
        for _ in range(2):
            y2, layer = call(view())
            assert layer is first() and tbits(y2) == tbits(y)
            del layer
    assert len(megamoe.ops._cache) == 1
    del p13
    assert first() is None and not megamoe.ops._cache
