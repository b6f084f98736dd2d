"""The functional entry point, in the shape inference engines call fused-MoE kernels:

    y = megamoe.ops.fused_moe(
        x,                      # BF16 [T, H]
        topk_ids,               # int32/int64 [T, K], expert ids in [0, E)  (None: megamoe routes)
        topk_weights,           # float32 [T, K], used as given
        w13, w13_scale,         # E4M3 [E, 2I, H] (gate rows, then up rows), f32 [E, 2*ceil(I/128), ceil(H/128)]
        w2, w2_scale,           # E4M3 [E, H, I], f32 [E, ceil(H/128), ceil(I/128)]
        config=cfg,             # megamoe.MoEConfig (H, I, E, K, routing)
        router=None, bias=None, # only when topk_ids is None: gate.weight [E, H], correction bias [E]
        shared_w13=None, shared_w13_scale=None, shared_w2=None, shared_w2_scale=None,
        out=None,               # BF16 [T, H] to write into
    )

The weights are read in place (MoELayer.from_stacked(..., borrow=True)): the first call
with a set of weight tensors builds a borrowed layer, later calls with the same tensors
(same data pointers, shapes, config) reuse it, so a call costs no setup. A layer holds
its workspace for max(4096, T) tokens, rounded up to a power of two. With external
routing the router is not read: a zero router is made once per (E, H, device).

The cache does not keep the weight tensors alive: when the memory of one of a layer's
tensors is freed (an engine that reloads into new tensors drops the old ones), its layer and
workspace go with it. What is watched is the memory's owner (a torch tensor's storage, a
numpy array's base), not the tensor object passed, so a new view of the same memory on each
call (`param.data`, `w13[layer]`, `.view(torch.uint8)`) finds its layer again. At most
MAX_CACHED layers are kept besides (the least recently used goes first).
"""
from __future__ import annotations

import collections
import weakref
from typing import Any, Dict, Tuple

from ._layer import MoEConfig, MoELayer, StackedWeights, _is_torch

MAX_CACHED = 64
_cache: "collections.OrderedDict[Tuple, MoELayer]" = collections.OrderedDict()
_zero_routers: Dict[Tuple, Any] = {}


_finalizers: Dict[Tuple, list] = {}  # per cached key, the finalizers watching its tensors


def _drop(key: Tuple) -> None:
    del _cache[key]
    for f in _finalizers.pop(key, ()):
        f.detach()


def _evict(key: Tuple, layer_ref: "weakref.ref[MoELayer]") -> None:
    # (a tensor of the layer was freed; the key may since name a newer layer at the same
    # addresses, which stays)
    layer = _cache.get(key)
    if layer is not None and layer is layer_ref():
        _drop(key)


def _owner(t: Any) -> Any:
    """What lives exactly as long as t's memory: a torch tensor's storage (its Python object
    is kept while any tensor uses the storage), the numpy array that owns the data; t itself
    where neither can be watched (a temporary view then costs a new layer per call)."""
    if _is_torch(t):
        try:
            s = t.untyped_storage()
            weakref.ref(s)
        except (RuntimeError, TypeError, NotImplementedError):  # (no storage, or not weakly referenceable)
            return t
        return s if s is t.untyped_storage() else t  # (older torch: a new wrapper per call)
    base = t
    while isinstance(getattr(base, "base", None), type(t)):
        base = base.base
    return base


def _remember(key: Tuple, layer: MoELayer, tensors) -> None:
    _cache[key] = layer
    ref = weakref.ref(layer)
    _finalizers[key] = [weakref.finalize(_owner(t), _evict, key, ref) for t in tensors if t is not None]
    while len(_cache) > MAX_CACHED:
        _drop(next(iter(_cache)))


def _ptr(t: Any) -> int:
    if t is None:
        return 0
    if _is_torch(t):
        return t.data_ptr()
    return t.__array_interface__["data"][0]


def _device_of(t: Any) -> str:
    if _is_torch(t):
        return str(t.device) if t.is_cuda else "cpu"
    return "cpu"


def _zeros(shape, like: Any) -> Any:
    """float32 zeros beside `like` (a torch tensor's device, or numpy)."""
    if _is_torch(like):
        import torch

        return torch.zeros(shape, dtype=torch.float32, device=like.device)
    import numpy as np

    return np.zeros(shape, dtype=np.float32)


def fused_moe(
    x: Any,
    topk_ids: Any,
    topk_weights: Any,
    w13: Any,
    w13_scale: Any,
    w2: Any,
    w2_scale: Any,
    *,
    config: MoEConfig,
    router: Any = None,
    bias: Any = None,
    shared_w13: Any = None,
    shared_w13_scale: Any = None,
    shared_w2: Any = None,
    shared_w2_scale: Any = None,
    out: Any = None,
) -> Any:
    """y = the MoE layer of these stacked block-FP8 weights on x (see the module doc)."""
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config: expected a MoEConfig, found {type(config).__name__}")
    if topk_ids is None and router is None:
        raise ValueError("router: expected gate.weight [E, H] when topk_ids is None (megamoe routes), found None")
    T = int(x.shape[0])
    cap = 4096
    while cap < T:
        cap *= 2
    device = _device_of(x)
    if router is None:
        # External routing does not read the router; the layer still needs one to exist.
        rkey = (config.experts, config.hidden, device)
        router = _zero_routers.get(rkey)
        if router is None:
            router = _zeros((config.experts, config.hidden), x)
            _zero_routers[rkey] = router
        if config.correction_bias and bias is None:
            bkey = (config.experts, device, "bias")
            bias = _zero_routers.get(bkey)
            if bias is None:
                bias = _zeros((config.experts,), x)
                _zero_routers[bkey] = bias
    weights = StackedWeights(w13=w13, w13_scale=w13_scale, w2=w2, w2_scale=w2_scale, shared_w13=shared_w13,
                             shared_w13_scale=shared_w13_scale, shared_w2=shared_w2,
                             shared_w2_scale=shared_w2_scale, router=router, bias=bias)
    key = (
        tuple(_ptr(t) for t in weights),
        tuple(tuple(t.shape) if t is not None else None for t in weights),
        tuple(vars(config).values()),  # (the fields are scalars: dataclasses.astuple deep-copies, ~14 us)
        device,
        cap,
    )
    layer = _cache.get(key)
    if layer is None:
        layer = MoELayer._from_stacked_weights(config, weights, device, cap, None, True)
        # The caller owns the tensors and the call reads them now: the cached layer holds
        # none of them, so freeing one frees the layer (_remember's finalizers).
        layer._keep = ()
        _remember(key, layer, weights)
    else:
        _cache.move_to_end(key)
    return layer(x, topk_ids, topk_weights, out=out)


def clear_cache() -> None:
    """Drops the cached borrowed layers (and the references they hold to the weights)."""
    for key in list(_cache):
        _drop(key)
    _zero_routers.clear()
