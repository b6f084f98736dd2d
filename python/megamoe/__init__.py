"""megamoe: fused FP8 Mixture-of-Experts layers of DeepSeek-V3 / GLM-5-family models.

One fused Hopper (sm_90a) kernel per layer on CUDA, the kernel-faithful CPU reference as
the CPU backend. Tensors cross into the native library as DLPack views (no copies, no
libtorch link); CUDA work runs on the caller's stream (PyTorch: the current stream).

    import megamoe
    layer = megamoe.MoELayer.from_checkpoint("/path/to/hf_folder", layer=3, device="cuda")
    y = layer(x)                                   # x: BF16 [T, H] on the layer's device
    y = layer(x, topk_ids=ids, topk_weights=w)     # the caller's routing

See docs/python.md: the layer, external routing, CUDA graphs, torch.compile, the
functional op (megamoe.ops.fused_moe) and the errors.
"""
from __future__ import annotations

from . import _megamoe, ops
from ._layer import (
    MoEConfig,
    MoELayer,
    StackedWeights,
    Workspace,
    cuda_available,
    hf_config_info,
    quantize_block_fp8,
)

__version__: str = _megamoe.__version__

__all__ = [
    "MoEConfig",
    "MoELayer",
    "StackedWeights",
    "Workspace",
    "cuda_available",
    "hf_config_info",
    "quantize_block_fp8",
    "ops",
    "__version__",
]

try:  # the custom op and the functional entry point need torch
    import torch as _torch  # noqa: F401
except ImportError:  # pragma: no cover - exercised where torch is absent
    _torch = None
if _torch is not None:
    from . import torch_ops  # noqa: F401  (registers megamoe::moe_forward)
    from .hf import patch_moe  # transformers drop-in (imports transformers only when used)

    __all__ += ["torch_ops", "patch_moe"]


def __getattr__(name: str):
    if name in ("patch_moe", "torch_ops"):
        raise ImportError(
            f"megamoe.{name} needs torch, which is not installed in this Python "
            f"(pip install torch; patch_moe also needs transformers)",
            name=name,
        )
    raise AttributeError(f"module 'megamoe' has no attribute {name!r}")
