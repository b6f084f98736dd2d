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
