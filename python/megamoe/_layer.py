"""The public Python API: MoEConfig, MoELayer, Workspace, quantize_block_fp8.

The native extension (_megamoe) validates every tensor it is handed (shape, dtype,
device, contiguity) and raises ValueError / TypeError naming the argument; this module
adds what needs Python: torch / numpy / ml_dtypes conversions (zero-copy views), tensor
names, the nn.Module, the custom-op dispatch under torch.compile.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import re
import weakref
from typing import Any, Iterable, Iterator, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np

from . import _megamoe

try:
    import torch as _torch
except ImportError:  # the numpy / CPU backend works without torch
    _torch = None

try:
    import ml_dtypes as _ml_dtypes

    _NP_BF16 = np.dtype(_ml_dtypes.bfloat16)
    _NP_E4M3 = np.dtype(_ml_dtypes.float8_e4m3fn)
except ImportError:
    _ml_dtypes = None
    _NP_BF16 = None
    _NP_E4M3 = None

_Base = _torch.nn.Module if _torch is not None else object


def cuda_available() -> bool:
    """True when this build has the CUDA backend and a compute-capability 9.0 GPU is present."""
    return bool(_megamoe.cuda_available()[0])


# ---------------------------------------------------------------- config


@dataclasses.dataclass
class MoEConfig:
    """The shape and routing of one MoE layer (the C++ MoeShape, docs/numerics.md §1 and §6).

    hidden, inter: H and the routed experts' intermediate size I; experts: E; topk: K;
    shared_experts: S (the shared MLP has intermediate S*I); n_group / topk_group: grouped
    top-k (1 / 1: plain); score: "sigmoid" | "softmax" | "sqrtsoftplus"; norm_topk_prob:
    renormalize the chosen weights; routed_scaling: their factor; swiglu_limit: the SwiGLU
    clamp (0: none); router_dtype: "bf16" | "f32" (gate.weight's dtype); correction_bias:
    gate.e_score_correction_bias is present.
    """

    hidden: int
    inter: int
    experts: int
    topk: int
    shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    score: str = "sigmoid"
    norm_topk_prob: bool = True
    routed_scaling: float = 1.0
    swiglu_limit: float = 0.0
    router_dtype: str = "bf16"
    correction_bias: bool = True

    def _shape(self) -> "_megamoe._Shape":
        s = _megamoe._Shape()
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type == "int" and (isinstance(v, bool) or not isinstance(v, (int, np.integer))):
                raise TypeError(f"MoEConfig.{f.name}: expected an int, found {type(v).__name__} {v!r}")
            setattr(s, f.name, v)
        s.validate()
        return s

    @classmethod
    def _from_shape(cls, s: "_megamoe._Shape") -> "MoEConfig":
        return cls(**{f.name: getattr(s, f.name) for f in dataclasses.fields(cls)})

    def validate(self) -> None:
        """Raises ValueError naming the first field out of its bounds."""
        self._shape()

    @staticmethod
    def presets() -> "dict[str, MoEConfig]":
        """The model families' layer shapes by name ("glm-5.3-flash", "glm-5", "deepseek-v3",
        "glm-4.7-flash"): the C++ presets the command's --preset takes."""
        return {name: MoEConfig._from_shape(shape) for name, shape in _megamoe.presets()}

    @staticmethod
    def from_hf_config(cfg: Any) -> "MoEConfig":
        """The MoE shape of a Hugging Face config: a config.json dict, a path to one (or to
        its folder), or a transformers PretrainedConfig. Parsed by the C++ config reader
        (families deepseek_v3, glm_moe_dsa, glm4_moe_lite, glm5_next)."""
        return hf_config_info(cfg)[0]


def _config_json(cfg: Any) -> Tuple[str, str]:
    if isinstance(cfg, Mapping):
        return json.dumps(dict(cfg)), "config dict"
    if hasattr(cfg, "to_dict"):  # transformers.PretrainedConfig
        return json.dumps(cfg.to_dict(), default=str), type(cfg).__name__
    raise TypeError(
        f"cfg: expected a config.json dict, a path or a transformers PretrainedConfig, found {type(cfg).__name__}"
    )


def hf_config_info(cfg: Any) -> Tuple[MoEConfig, list, list, str]:
    """(config, MoE layer indices, multi-token-prediction layer indices, family) of a
    Hugging Face config (a dict, a path to config.json or its folder, or a PretrainedConfig)."""
    if isinstance(cfg, (str, bytes)) or hasattr(cfg, "__fspath__"):
        shape, moe, mtp, family, _ = _megamoe.load_config(str(cfg))
    else:
        text, label = _config_json(cfg)
        shape, moe, mtp, family, _ = _megamoe.parse_config(text, label)
    return MoEConfig._from_shape(shape), list(moe), list(mtp), family


# ---------------------------------------------------------------- arrays


def _is_torch(t: Any) -> bool:
    return _torch is not None and isinstance(t, _torch.Tensor)


def _as_array(t: Any, arg: str) -> Any:
    """A DLPack-able zero-copy view of a torch tensor or numpy array whose dtype the
    extension reads: float8 as uint8 codes, ml_dtypes bfloat16 as uint16 bits."""
    if _is_torch(t):
        if t.requires_grad:
            t = t.detach()
        if t.dtype == _torch.float8_e4m3fn:
            return t.view(_torch.uint8)
        return t
    if isinstance(t, np.ndarray):
        if _NP_BF16 is not None and t.dtype == _NP_BF16:
            return t.view(np.uint16)
        if _NP_E4M3 is not None and t.dtype == _NP_E4M3:
            return t.view(np.uint8)
        return t
    if hasattr(t, "__dlpack__"):
        return t
    raise TypeError(f"{arg}: expected a torch.Tensor or a numpy.ndarray, found {type(t).__name__}")


def _parse_device(device: Any) -> Tuple[str, Optional[int]]:
    if device is None:
        return ("cuda" if cuda_available() else "cpu"), None
    if _torch is not None and isinstance(device, _torch.device):
        return device.type, device.index
    if isinstance(device, str):
        m = re.fullmatch(r"(cuda|cpu)(?::(\d+))?", device)
        if m:
            return m.group(1), (int(m.group(2)) if m.group(2) else None)
    raise ValueError(f"device: expected 'cuda', 'cuda:N' or 'cpu', found {device!r}")


@contextlib.contextmanager
def _on_device(kind: str, index: Optional[int]) -> Iterator[None]:
    if kind == "cuda" and index is not None:
        if _torch is None:
            raise ValueError(f"device: 'cuda:{index}' needs torch to select the GPU; pass 'cuda' (the current one)")
        with _torch.cuda.device(index):
            yield
    else:
        yield


_NAME_FULL = re.compile(r"^(?:.*\.)?layers\.(\d+)\.mlp\.(.+)$")


# ---------------------------------------------------------------- stacked weights


class StackedWeights(NamedTuple):
    """The ten weight tensors of one layer in the kernel layout (weights/layout.h; the C++
    MoeWeightsView and api::stacked_tensors, in their order): w13 E4M3 [E, 2I, H] (gate rows,
    then up rows), w13_scale f32 [E, 2*ceil(I/128), ceil(H/128)], w2 E4M3 [E, H, I], w2_scale
    f32 [E, ceil(H/128), ceil(I/128)], shared_* the same for the shared MLP without the E axis
    (None when the config has no shared expert), router bf16/f32 [E, H], bias f32 [E] (None
    without correction_bias)."""

    w13: Any
    w13_scale: Any
    w2: Any
    w2_scale: Any
    shared_w13: Any = None
    shared_w13_scale: Any = None
    shared_w2: Any = None
    shared_w2_scale: Any = None
    router: Any = None
    bias: Any = None


# ---------------------------------------------------------------- workspace


class Workspace:
    """Scratch memory several layers share (MoeLayerOptions::workspace): sized for the
    largest of `config_or_configs` at `max_tokens`. Layers that share it must run one
    after another on one stream; their routing outputs are then the last forward's.
    device None: "cuda" when cuda_available(), else "cpu" (MoELayer's default too)."""

    def __init__(self, config_or_configs: Union[MoEConfig, Sequence[MoEConfig]], max_tokens: int, device: Any = None):
        configs = [config_or_configs] if isinstance(config_or_configs, MoEConfig) else list(config_or_configs)
        for c in configs:
            if not isinstance(c, MoEConfig):
                raise TypeError(f"config_or_configs: expected MoEConfig values, found {type(c).__name__}")
        kind, index = _parse_device(device)
        with _on_device(kind, index):
            self._impl = _megamoe._Workspace([c._shape() for c in configs], int(max_tokens), kind)
        self.device = kind
        self.max_tokens = int(max_tokens)

    @property
    def bytes(self) -> int:
        """Device bytes of the buffer (0 on the CPU backend, which needs none)."""
        return self._impl.bytes


# ---------------------------------------------------------------- the layer

_registry: "weakref.WeakValueDictionary[int, MoELayer]" = weakref.WeakValueDictionary()
_next_handle = itertools.count(1)


def _layer_for_handle(handle: int) -> "MoELayer":
    layer = _registry.get(handle)
    if layer is None:
        raise RuntimeError(f"megamoe: no live MoELayer with handle {handle} (the layer was deleted)")
    return layer


class MoELayer(_Base):
    """One MoE layer (router, K routed experts, the shared expert) in block FP8.

    A torch.nn.Module when torch is installed (its weights live in megamoe's own memory,
    not in parameters); a plain class usable from numpy on the CPU backend otherwise.
    Build it with from_checkpoint, from_tensors or from_stacked; call it on x (BF16
    [T, H] on the layer's device; numpy: float32 or ml_dtypes.bfloat16).
    """

    #: Eager CUDA calls with external routing check the ids' range on the host (one
    #: device sync); False skips it (the device records it and check() raises).
    check_routing: bool = True

    def __init__(self, _impl: "_megamoe._Layer", _keep: Tuple[Any, ...] = (), _layer_number: Optional[int] = None):
        if _Base is not object:
            super().__init__()
        self._impl = _impl
        self._keep = _keep  # borrowed tensors stay alive with the layer
        self._layer_number = _layer_number
        self._is_cuda = bool(_impl.cuda)
        self._device_index = int(_impl.device_ordinal)
        self._handle = next(_next_handle)
        self._torch_routing = False
        self._experts = int(_impl.shape.experts)
        self._hidden = int(_impl.shape.hidden)
        self._topk = int(_impl.shape.topk)
        _registry[self._handle] = self

    # ---- constructors

    @classmethod
    def from_checkpoint(
        cls,
        path: Any,
        layer: int,
        device: Any = None,
        max_tokens: int = 4096,
        workspace: Optional[Workspace] = None,
    ) -> "MoELayer":
        """MoE layer `layer` of a Hugging Face block-FP8 checkpoint folder (config.json and
        safetensors shards), streamed into the layer's memory (device memory for "cuda").
        device None: "cuda" when cuda_available(), else "cpu"."""
        kind, index = _parse_device(device)
        with _on_device(kind, index):
            impl = _megamoe._Layer.from_checkpoint(
                str(path), int(layer), kind, int(max_tokens), workspace._impl if workspace is not None else None
            )
        return cls(impl, _layer_number=int(layer))

    @classmethod
    def from_tensors(
        cls,
        config: MoEConfig,
        tensors: Union[Mapping[str, Any], Iterable[Tuple[str, Any]]],
        device: Any = None,
        max_tokens: int = 4096,
        workspace: Optional[Workspace] = None,
    ) -> "MoELayer":
        """A layer from tensors in the checkpoint's own names and layouts, relative to the
        layer ("mlp.experts.3.gate_proj.weight", "...weight_scale_inv", "mlp.gate.weight",
        "mlp.gate.e_score_correction_bias", "mlp.shared_experts.*"; full names such as
        "model.layers.7.mlp..." too). The tensors are copied into the layer's memory; no
        files are written. The router dtype is gate.weight's."""
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config: expected a MoEConfig, found {type(config).__name__}")
        pairs = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
        layer_number = None
        for name, t in pairs:
            m = _NAME_FULL.match(str(name))
            if m:
                layer_number = int(m.group(1))
            if str(name).endswith("gate.weight"):
                dt = _dtype_name(t)
                if dt in ("bfloat16", "float32"):
                    config = dataclasses.replace(config, router_dtype="bf16" if dt == "bfloat16" else "f32")
        kind, index = _parse_device(device)
        with _on_device(kind, index):
            impl = _megamoe._Layer.empty(
                config._shape(), layer_number or 0, kind, int(max_tokens),
                workspace._impl if workspace is not None else None,
            )
        self = cls(impl, _layer_number=layer_number)
        self.load_weights(pairs, mode="layerwise")
        return self

    @classmethod
    def from_stacked(
        cls,
        config: MoEConfig,
        *,
        w13: Any,
        w13_scale: Any,
        w2: Any,
        w2_scale: Any,
        router: Any,
        bias: Any = None,
        shared_w13: Any = None,
        shared_w13_scale: Any = None,
        shared_w2: Any = None,
        shared_w2_scale: Any = None,
        device: Any = None,
        max_tokens: int = 4096,
        workspace: Optional[Workspace] = None,
        borrow: bool = False,
    ) -> "MoELayer":
        """A layer from tensors in the kernel layout (weights/layout.h):
        w13 E4M3 [E, 2I, H] (gate rows, then up rows), w13_scale f32 [E, 2*ceil(I/128),
        ceil(H/128)], w2 E4M3 [E, H, I], w2_scale f32 [E, ceil(H/128), ceil(I/128)],
        router bf16/f32 [E, H], bias f32 [E]; shared_* the same for the shared MLP without
        the E axis. E4M3 as torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn or uint8 codes.
        borrow=False copies them into the layer's memory; borrow=True reads the caller's
        tensors in place (they must be on the layer's device, contiguous, 16-byte
        aligned; the layer keeps them alive; new weights are written into them)."""
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config: expected a MoEConfig, found {type(config).__name__}")
        weights = StackedWeights(
            w13=w13, w13_scale=w13_scale, w2=w2, w2_scale=w2_scale, shared_w13=shared_w13,
            shared_w13_scale=shared_w13_scale, shared_w2=shared_w2, shared_w2_scale=shared_w2_scale,
            router=router, bias=bias,
        )
        return cls._from_stacked_weights(config, weights, device, max_tokens, workspace, borrow)

    @classmethod
    def _from_stacked_weights(cls, config, weights: StackedWeights, device, max_tokens, workspace, borrow):
        arrays = [None if v is None else _as_array(v, k) for k, v in zip(StackedWeights._fields, weights)]
        kind, index = _parse_device(device)
        with _on_device(kind, index):
            impl = _megamoe._Layer.stacked(
                config._shape(), kind, int(max_tokens), workspace._impl if workspace is not None else None,
                bool(borrow), "layerwise", arrays,
            )
        keep = tuple(v for v in arrays if v is not None) if borrow else ()
        return cls(impl, _keep=keep)

    # ---- properties

    @property
    def config(self) -> MoEConfig:
        """The layer's MoEConfig (router_dtype as its weights have it)."""
        return MoEConfig._from_shape(self._impl.shape)

    @property
    def device(self) -> Any:
        """torch.device (or "cpu" / "cuda:N" without torch) the layer runs on."""
        name = f"cuda:{self._device_index}" if self._is_cuda else "cpu"
        return _torch.device(name) if _torch is not None else name

    @property
    def max_tokens(self) -> int:
        """The most tokens one forward takes (the workspace's capacity)."""
        return int(self._impl.max_tokens)

    @property
    def properties(self) -> dict:
        """Backend, weight and workspace bytes, tile configuration, borrowed or owned."""
        return dict(self._impl.properties())

    @property
    def layer_index(self) -> Optional[int]:
        """The decoder layer the tensor names refer to (the checkpoint's; for a layer from
        tensors, the one full names carried, else None)."""
        return self._layer_number

    @property
    def weights_address(self) -> int:
        """Address of the layer's weights (device or host); stable across reloads."""
        return int(self._impl.weights_address())

    @property
    def topk_ids(self) -> Any:
        """Expert ids [T, K] (int32) of the last forward: a numpy array (CPU; a torch
        tensor when that forward took torch tensors) or a view of the layer's device
        buffer (CUDA, valid until the next forward). T is the token count (CUDA: the bound)
        of the last call made from Python: a graph replay does not pass through Python, so
        after one the first n rows (n: the count it read) are the replay's routing."""
        return self._routing(True)

    @property
    def topk_weights(self) -> Any:
        """Routing weights [T, K] (float32) of the last forward (see topk_ids)."""
        return self._routing(False)

    def _routing(self, ids: bool) -> Any:
        r = self._impl.topk(ids)
        if r is not None and not self._is_cuda and self._torch_routing:
            return _torch.from_numpy(r)
        return r

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"hidden={c.hidden}, inter={c.inter}, experts={c.experts}, topk={c.topk}, "
            f"shared_experts={c.shared_experts}, device={self.device}, max_tokens={self.max_tokens}"
        )

    # ---- forward

    def forward(
        self,
        x: Any,
        topk_ids: Any = None,
        topk_weights: Any = None,
        *,
        out: Any = None,
        num_tokens: Any = None,
    ) -> Any:
        """y = MoE(x) for x BF16 [T, H] on the layer's device (numpy on the CPU backend:
        float32 or ml_dtypes.bfloat16; y has x's dtype).

        topk_ids / topk_weights: external routing ([T, K] int32/int64 ids in [0, E),
        float32 weights used as given) instead of the layer's router. out: a [T, H] tensor
        to write y into. num_tokens: CUDA, a device int32 tensor holding the token count
        (a CUDA graph captured at T rows replays on its first n); CPU, an int.
        On CUDA the work is enqueued on the current stream; under torch.compile the call
        is the custom op megamoe::moe_forward."""
        if _torch is not None and isinstance(x, _torch.Tensor):
            if _torch.compiler.is_compiling():
                return _torch_ops.call(self._handle, x, topk_ids, topk_weights, num_tokens, out)
            if self._is_cuda:
                return self._forward_cuda(x, topk_ids, topk_weights, out, num_tokens)
            return self._forward_torch_cpu(x, topk_ids, topk_weights, out, num_tokens)
        return self._forward_numpy(x, topk_ids, topk_weights, out, num_tokens)

    if _Base is object:
        __call__ = forward

    def _forward_cuda(self, x, topk_ids, topk_weights, out, num_tokens):
        # The eager fast path: checks on the tensors' attributes (no sync, no DLPack
        # import), raw pointers into the extension, the current stream.
        dev = self._device_index
        if not self._good(x, _torch.bfloat16):
            self._bad("x", x, "bfloat16", (x.shape[0] if x.dim() == 2 else "T", self._hidden))
        T = x.shape[0]
        if out is None:
            out = _torch.empty_like(x)
        elif not self._good(out, _torch.bfloat16) or out.shape[0] != T:
            self._bad("out", out, "bfloat16", (T, self._hidden))
        nt = 0
        if num_tokens is not None:
            if isinstance(num_tokens, _torch.Tensor):
                if (num_tokens.dtype != _torch.int32 or num_tokens.numel() != 1 or not num_tokens.is_cuda
                        or num_tokens.get_device() != dev):
                    raise TypeError(
                        f"num_tokens: expected one int32 on cuda:{dev}, found {_describe(num_tokens)}"
                    )
                nt = num_tokens.data_ptr()
            else:  # a host count: the first n rows (rows past n are not written)
                n = _count(num_tokens, T)
                y = out[:n]
                if topk_ids is not None:
                    topk_ids, topk_weights = topk_ids[:n], topk_weights[:n]
                self._forward_cuda(x[:n], topk_ids, topk_weights, y, None)
                return out
        ids = w = 0
        id_bytes = 4
        if topk_ids is not None or topk_weights is not None:
            self._check_routing_cuda(topk_ids, topk_weights, T)
            ids, w, id_bytes = topk_ids.data_ptr(), topk_weights.data_ptr(), topk_ids.element_size()
        stream = _torch.cuda.current_stream(dev).cuda_stream
        self._impl.forward_raw(x.data_ptr(), out.data_ptr(), T, ids, id_bytes, w, nt, stream)
        return out

    def _good(self, t, dtype) -> bool:
        return (
            t.dtype == dtype and t.dim() == 2 and t.shape[1] == self._hidden and t.is_cuda
            and t.get_device() == self._device_index and t.is_contiguous() and t.data_ptr() % 16 == 0
        )

    def _bad(self, arg, t, dtype, shape):
        if not isinstance(t, _torch.Tensor):
            raise TypeError(f"{arg}: expected a torch.Tensor, found {type(t).__name__}")
        if not t.is_cuda or t.get_device() != self._device_index:
            raise ValueError(
                f"{arg}: expected a tensor on cuda:{self._device_index} (the layer's device; never copied), "
                f"found {t.device}"
            )
        if t.dtype != getattr(_torch, dtype):
            raise TypeError(f"{arg}: expected {dtype}, found {_describe(t)}")
        if t.dim() != 2 or t.shape[1] != shape[1] or (isinstance(shape[0], int) and t.shape[0] != shape[0]):
            raise ValueError(f"{arg}: expected shape [{shape[0]}, {shape[1]}], found {_describe(t)}")
        if not t.is_contiguous():
            raise ValueError(f"{arg}: expected a contiguous (row-major) tensor, found strides {t.stride()}")
        raise ValueError(f"{arg}: expected a 16-byte aligned tensor, found address {t.data_ptr():#x}")

    def _check_routing_cuda(self, topk_ids, topk_weights, T):
        if topk_ids is None or topk_weights is None:
            raise ValueError(
                "topk_ids / topk_weights: external routing needs both, found only "
                + ("topk_ids" if topk_ids is not None else "topk_weights")
            )
        K, dev = self._topk, self._device_index
        for arg, t, dtypes in (("topk_ids", topk_ids, (_torch.int32, _torch.int64)),
                               ("topk_weights", topk_weights, (_torch.float32,))):
            if not isinstance(t, _torch.Tensor):
                raise TypeError(f"{arg}: expected a torch.Tensor on cuda:{dev}, found {type(t).__name__}")
            if not t.is_cuda or t.get_device() != dev:
                raise ValueError(f"{arg}: expected a tensor on cuda:{dev} (the layer's device; never copied), "
                                 f"found {t.device}")
            if t.dtype not in dtypes:
                want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
                raise TypeError(f"{arg}: expected {want}, found {_describe(t)}")
            if t.dim() != 2 or t.shape[0] != T or t.shape[1] != K:
                raise ValueError(f"{arg}: expected shape [{T}, {K}], found {_describe(t)}")
            if not t.is_contiguous():
                raise ValueError(f"{arg}: expected a contiguous (row-major) tensor, found strides {t.stride()}")
        if self.check_routing and T and not _torch.cuda.is_current_stream_capturing():
            lo, hi = _torch.aminmax(topk_ids)
            lo, hi = int(lo), int(hi)
            if lo < 0 or hi >= self._experts:
                bad = lo if lo < 0 else hi
                raise ValueError(f"topk_ids: expected expert ids in [0, {self._experts}), found {bad}")

    def _forward_torch_cpu(self, x, topk_ids, topk_weights, out, num_tokens):
        if x.requires_grad:
            x = x.detach()
        y = _torch.empty_like(x) if out is None else out
        ids = _as_array(topk_ids, "topk_ids") if topk_ids is not None else None
        wts = _as_array(topk_weights, "topk_weights") if topk_weights is not None else None
        n = -1 if num_tokens is None else _count(num_tokens, x.shape[0])
        self._impl.forward(x, y, ids, wts, n)
        self._torch_routing = True
        return y

    def _forward_numpy(self, x, topk_ids, topk_weights, out, num_tokens):
        if not isinstance(x, np.ndarray):
            raise TypeError(f"x: expected a torch.Tensor or a numpy.ndarray, found {type(x).__name__}")
        if self._is_cuda:
            raise ValueError(
                f"x: expected a torch tensor on {self.device} (a CUDA layer; never copied), found a numpy array"
            )
        if x.dtype != np.float32 and (_NP_BF16 is None or x.dtype != _NP_BF16):
            raise TypeError(f"x: expected float32 or ml_dtypes.bfloat16, found {x.dtype} {list(x.shape)}")
        y = np.empty_like(x) if out is None else out
        if not isinstance(y, np.ndarray):
            raise TypeError(f"out: expected a numpy.ndarray, found {type(y).__name__}")
        ids = _as_array(topk_ids, "topk_ids") if topk_ids is not None else None
        wts = _as_array(topk_weights, "topk_weights") if topk_weights is not None else None
        n = -1 if num_tokens is None else _count(num_tokens, x.shape[0])
        self._impl.forward(_as_array(x, "x"), _as_array(y, "out"), ids, wts, n)
        self._torch_routing = False
        return y

    def check(self) -> None:
        """Waits for the layer's queued work (CUDA) and raises RuntimeError if a forward
        read a device token count outside its range or an external expert id outside
        [0, E) (CudaMoeLayer::check's message); the record is cleared. CPU: nothing to do."""
        self._impl.check()

    # ---- weights

    def _relative(self, name: str) -> str:
        m = _NAME_FULL.match(name)
        if m:
            n = int(m.group(1))
            if self._layer_number is None:
                self._layer_number = n
            elif n != self._layer_number:
                raise ValueError(
                    f"name: {name!r} is a tensor of layer {n}, this layer is layer {self._layer_number}"
                )
            return m.group(2)
        if name.startswith("mlp."):
            return name[4:]
        if name.startswith(("experts.", "shared_experts.", "gate.")):
            return name
        raise ValueError(
            f"name: expected a tensor of the layer's MoE block ('mlp.experts.3.gate_proj.weight', "
            f"'mlp.gate.weight', 'model.layers.7.mlp...'), found {name!r}"
        )

    def load_weights(
        self,
        weights: Union[str, Mapping[str, Any], Iterable[Tuple[str, Any]]],
        tensor: Any = None,
        *,
        mode: str = "direct",
    ) -> list:
        """Writes tensors into the layer's weights in place, by checkpoint name: a name and
        a tensor, or a mapping / iterable of (name, tensor) pairs (host or device tensors,
        in the checkpoint's dtype and shape). Addresses stay, so captured CUDA graphs keep
        working. mode "direct": written into the live weights; "layerwise": the layer is
        not usable until every one of its tensors has arrived. A weight and its
        weight_scale_inv may arrive in separate calls inside `with layer.reloading():`;
        a call outside one is one load session and must bring both. Every tensor of a
        call is checked (name, dtype, shape, the scales' values) before any is written:
        a call that raises leaves the weights as they were. Returns the names written.
        Waits for the device's queued work first (CUDA)."""
        if isinstance(weights, str):
            if tensor is None:
                raise ValueError(f"tensor: expected a tensor for name {weights!r}, found None")
            pairs: Iterable = [(weights, tensor)]
        elif tensor is not None:
            raise TypeError(f"weights: expected a name (str) when tensor is given, found {type(weights).__name__}")
        else:
            pairs = weights.items() if isinstance(weights, Mapping) else weights
        opened = not self._impl.in_session()
        if opened:
            self._impl.begin(mode)
        names = []
        try:
            batch = []
            for name, t in pairs:
                name = str(name)
                batch.append((self._relative(name), _as_array(t, f"tensor '{name}'")))
                names.append(name)
            # (validated as a whole before a byte is written: a refused call changes nothing)
            self._impl.update(batch)
        except BaseException:
            if opened:
                with contextlib.suppress(Exception):
                    self._impl.finish()
            raise
        if opened:
            self._impl.finish()
        return names

    @contextlib.contextmanager
    def reloading(self, mode: str = "direct") -> Iterator["MoELayer"]:
        """One load session over several load_weights calls (a weight and its scale may
        arrive in different calls); on exit the session closes and raises ValueError
        listing every incomplete pair or, for "layerwise", every missing tensor."""
        self._impl.begin(mode)
        try:
            yield self
        except BaseException:
            with contextlib.suppress(Exception):
                self._impl.finish()
            raise
        self._impl.finish()

    def zero_experts(self) -> None:
        """Zeroes every expert weight and scale in place and marks the layer not ready
        (the router stays): what a trainer does before pushing new weights."""
        self._impl.zero_experts()

    def weight_bytes(self) -> bytes:
        """A host copy of the layer's weights in the kernel layout (for tests)."""
        return self._impl.weight_bytes()


def _dtype_name(t: Any) -> str:
    if _is_torch(t):
        return str(t.dtype).replace("torch.", "")
    d = getattr(t, "dtype", None)
    return str(d) if d is not None else type(t).__name__


def _describe(t: Any) -> str:
    return f"{str(t.dtype).replace('torch.', '')} {list(t.shape)} on {t.device}"


def _count(n: Any, rows: int) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"num_tokens: expected an int (or, CUDA, a device int32 tensor), found {type(n).__name__}")
    if not 0 <= int(n) <= rows:
        raise ValueError(f"num_tokens: expected a count in [0, {rows}] (x's rows), found {int(n)}")
    return int(n)


# ---------------------------------------------------------------- quantization


def quantize_block_fp8(w: Any) -> Tuple[Any, Any]:
    """BF16 / float32 weights [..., N, K] -> (E4M3 codes [..., N, K], float32 block scales
    [..., ceil(N/128), ceil(K/128)]) as a checkpoint's weight / weight_scale_inv: per
    128x128 block, scale = amax / 448 (1 for an all-zero block) and code = e4m3(w / scale),
    round to nearest even, saturating. numpy in -> numpy out (uint8 codes); torch in ->
    torch out (float8_e4m3fn) on w's device."""
    if _is_torch(w):
        return _quantize_block_fp8_torch(w)
    if not isinstance(w, np.ndarray):
        raise TypeError(f"w: expected a torch.Tensor or a numpy.ndarray, found {type(w).__name__}")
    if w.dtype != np.float32 and (_NP_BF16 is None or w.dtype != _NP_BF16):
        raise TypeError(f"w: expected float32 or ml_dtypes.bfloat16, found {w.dtype}")
    return _megamoe.quantize_block_fp8(np.ascontiguousarray(w, dtype=np.float32))


def _quantize_block_fp8_torch(w):
    if w.dtype not in (_torch.bfloat16, _torch.float32, _torch.float16):
        raise TypeError(f"w: expected bfloat16 or float32, found {w.dtype}")
    if w.dim() < 2:
        raise ValueError(f"w: expected [..., N, K], found {list(w.shape)}")
    return _quantize_blocks(w, 128)


def _quantize_blocks(w, block_rows: int, amax_floor: Optional[float] = None):
    """The block-FP8 rule in torch: [..., N, K] -> (E4M3 [..., N, K], float32 scales
    [..., ceil(N/block_rows), ceil(K/128)]), per block_rows x 128 block.
    Weights (block_rows 128, amax_floor None; docs/numerics.md §2): scale = amax / 448 (1 for
    an all-zero block), code = e4m3(w / scale); a non-finite value raises.
    Activations (block_rows 1, amax_floor 1e-4; docs/numerics.md §4): scale = max(amax,
    1e-4) / 448, code = e4m3(a * (1 / scale)), as the kernel computes it."""
    w = w.detach().float()
    *batch, n, k = w.shape
    nb, kb = -(-n // block_rows), -(-k // 128)
    p = _torch.zeros(*batch, nb * block_rows, kb * 128, dtype=_torch.float32, device=w.device)
    p[..., :n, :k] = w
    blocks = p.reshape(*batch, nb, block_rows, kb, 128)
    amax = blocks.abs().amax(dim=(-3, -1))
    if amax_floor is None:
        if not bool(_torch.isfinite(amax).all()):
            raise ValueError("w: expected finite values, found a NaN or an infinity")
        scale = _torch.where(amax > 0, amax / 448.0, _torch.ones_like(amax))
        q = blocks / scale[..., :, None, :, None]
    else:
        scale = amax.clamp_min(amax_floor) / 448.0
        q = blocks * (1.0 / scale)[..., :, None, :, None]
    q = q.clamp_(-448.0, 448.0).reshape(*batch, nb * block_rows, kb * 128)[..., :n, :k].contiguous()
    return q.to(_torch.float8_e4m3fn), scale.contiguous()


if _torch is not None:
    # The custom ops (megamoe::moe_forward) that forward() dispatches to under torch.compile;
    # imported last, as they use this module's names.
    from . import torch_ops as _torch_ops
