"""megamoe's PyTorch custom ops (torch.library), registered when megamoe is imported
with torch installed:

    torch.ops.megamoe.moe_forward(handle, x, topk_ids, topk_weights, num_tokens) -> y
    torch.ops.megamoe.moe_forward_out(handle, x, out, topk_ids, topk_weights, num_tokens)

`handle` is an int naming a live MoELayer (MoELayer._handle), so the schema holds only
tensors and ints: torch.compile(fullgraph=True) traces a model that calls a layer
without a graph break (MoELayer.forward dispatches here while compiling), and the fake
implementations give the output's shape and dtype (y: x's). The ops enqueue on the
current stream, allocate nothing but y, and never synchronize, so a
torch.cuda.CUDAGraph capture records them; num_tokens (a device int32 tensor) lets a
graph captured at T rows replay on its first n.
"""

from typing import Optional

import torch

from ._layer import _count, _layer_for_handle


def _run(handle: int, x: torch.Tensor, out: torch.Tensor, topk_ids, topk_weights, num_tokens) -> None:
    layer = _layer_for_handle(handle)
    if layer._is_cuda:
        layer._forward_cuda(x, topk_ids, topk_weights, out, num_tokens)
    else:
        layer._forward_torch_cpu(x, topk_ids, topk_weights, out, None if num_tokens is None else int(num_tokens))


@torch.library.custom_op("megamoe::moe_forward", mutates_args=())
def moe_forward(
    handle: int,
    x: torch.Tensor,
    topk_ids: Optional[torch.Tensor],
    topk_weights: Optional[torch.Tensor],
    num_tokens: Optional[torch.Tensor],
) -> torch.Tensor:
    """y = layer(x) for the MoELayer `handle` (see the module docstring)."""
    y = torch.empty_like(x)
    _run(handle, x, y, topk_ids, topk_weights, num_tokens)
    return y


@moe_forward.register_fake
def _moe_forward_fake(handle, x, topk_ids, topk_weights, num_tokens):
    return torch.empty_like(x)


@torch.library.custom_op("megamoe::moe_forward_out", mutates_args=("out",))
def moe_forward_out(
    handle: int,
    x: torch.Tensor,
    out: torch.Tensor,
    topk_ids: Optional[torch.Tensor],
    topk_weights: Optional[torch.Tensor],
    num_tokens: Optional[torch.Tensor],
) -> None:
    """layer(x) written into `out` for the MoELayer `handle`."""
    _run(handle, x, out, topk_ids, topk_weights, num_tokens)


@moe_forward_out.register_fake
def _moe_forward_out_fake(handle, x, out, topk_ids, topk_weights, num_tokens):
    return None


def call(handle: int, x, topk_ids=None, topk_weights=None, num_tokens=None, out=None):
    """MoELayer.forward's path while torch.compile traces: the op, with a host count
    applied as a slice of x (a device count passes through)."""
    if num_tokens is not None and not isinstance(num_tokens, torch.Tensor):
        n = _count(num_tokens, x.shape[0])
        x = x[:n]
        if topk_ids is not None:
            topk_ids, topk_weights = topk_ids[:n], topk_weights[:n]
        if out is not None:
            torch.ops.megamoe.moe_forward_out(handle, x, out[:n], topk_ids, topk_weights, None)
            return out
        return torch.ops.megamoe.moe_forward(handle, x, topk_ids, topk_weights, None)
    if out is not None:
        torch.ops.megamoe.moe_forward_out(handle, x, out, topk_ids, topk_weights, num_tokens)
        return out
    return torch.ops.megamoe.moe_forward(handle, x, topk_ids, topk_weights, num_tokens)
