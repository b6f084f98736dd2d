"""Drop-in for the MoE blocks of Hugging Face transformers models.

    import megamoe
    model = AutoModelForCausalLM.from_pretrained(path, device_map="cuda")
    n = megamoe.patch_moe(model)          # every MoE block now runs one fused megamoe layer

The families: glm5_next (GLM-5.3-Flash), glm_moe_dsa (GLM-5), deepseek_v3, glm4_moe_lite
(GLM-4.7-Flash). Their MoE blocks share one design, which is what this module reads:
`block.gate` is the router (weight [E, H], e_score_correction_bias [E], top_k, n_group,
topk_group, norm_topk_prob, routed_scaling_factor, sigmoid scores), `block.experts` holds
the routed experts (fused 3-D `gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I], with
`*_scale_inv` block scales when transformers loaded an FP8 checkpoint (FP8Experts), or a
ModuleList of MLPs), `block.shared_experts` is an MLP (nn.Linear or FP8Linear with
`weight_scale_inv`), and forward(hidden_states [..., H]) returns one tensor of that shape.

Block-FP8 weights go in as they are (codes and 128x128 scales, bit for bit); BF16 / F32
weights are quantized to block FP8 (megamoe.quantize_block_fp8: amax / 448 per 128x128
block), said once per patch_moe call. transformers is imported only when a model is patched.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Dict, List, Optional, Set, Tuple

import torch

from ._layer import MoEConfig, MoELayer, Workspace, quantize_block_fp8

#: model_type of the families patch_moe knows, and their MoE block class names.
FAMILIES: Dict[str, Tuple[str, ...]] = {
    "glm5_next": ("Glm5NextTextMoE", "Glm5NextMoE"),
    "glm_moe_dsa": ("GlmMoeDsaMoE",),
    "deepseek_v3": ("DeepseekV3MoE",),
    "glm4_moe_lite": ("Glm4MoeLiteMoE",),
}
_BLOCK_CLASSES = {name: mt for mt, names in FAMILIES.items() for name in names}

_FP8 = torch.float8_e4m3fn


def _ceil128(n: int) -> int:
    return -(-n // 128)


def _text_config(model: Any) -> Any:
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "get_text_config"):
        return cfg.get_text_config()
    return cfg


def _model_type(model: Any) -> Optional[str]:
    cfg = getattr(model, "config", None)
    return getattr(cfg, "model_type", None)


def find_moe_blocks(model: torch.nn.Module) -> List[Tuple[str, torch.nn.Module, str]]:
    """(qualified name, block, family) of every MoE block of a supported family in `model`,
    found by class name (the families' own MoE classes)."""
    out = []
    for name, mod in model.named_modules():
        fam = _BLOCK_CLASSES.get(type(mod).__name__)
        if fam is not None:
            out.append((name, mod, fam))
    return out


# ---------------------------------------------------------------- reading a block


@dataclasses.dataclass
class _Weights:
    """One projection's block-FP8 codes and float32 scales, or its float weights."""

    w: torch.Tensor
    scale: Optional[torch.Tensor]  # None: float weights (quantized on the way in)


def _scale_f32(s: torch.Tensor, what: str) -> torch.Tensor:
    # transformers keeps UE8M0 scales (scale_fmt "ue8m0") as float8_e8m0fnu: 2^(b-127),
    # exact in float32.
    if s.dtype == torch.float32:
        return s
    if s.dtype in (torch.bfloat16, torch.float16) or str(s.dtype) == "torch.float8_e8m0fnu":
        return s.float()
    raise TypeError(f"{what}: expected float32 (or UE8M0) block scales, found {s.dtype}")


def _proj(weight: torch.Tensor, scale: Optional[torch.Tensor], what: str) -> _Weights:
    w = weight.detach()
    if w.device.type == "meta":
        raise ValueError(f"{what}: expected materialized weights, found a tensor on the meta device")
    if w.dtype == _FP8:
        if scale is None:
            raise ValueError(f"{what}: FP8 weights need their weight_scale_inv, found none")
        s = _scale_f32(scale.detach(), what + "_scale_inv")
        if s.dim() < 2:
            raise ValueError(
                f"{what}_scale_inv: expected 128x128 block scales [..., ceil(rows/128), ceil(cols/128)], "
                f"found a per-tensor scale of shape {list(s.shape)}"
            )
        want = [*w.shape[:-2], _ceil128(w.shape[-2]), _ceil128(w.shape[-1])]
        if list(s.shape) != want:
            raise ValueError(
                f"{what}_scale_inv: expected 128x128 block scales {want} for weights {list(w.shape)}, "
                f"found {list(s.shape)}"
            )
        return _Weights(w, s)
    if w.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{what}: expected float8_e4m3fn, bfloat16, float16 or float32 weights, found {w.dtype}")
    return _Weights(w, None)


def _linear(mod: torch.nn.Module, what: str) -> _Weights:
    return _proj(mod.weight, getattr(mod, "weight_scale_inv", None), what)


def _stack(parts: List[_Weights], what: str) -> _Weights:
    if any(p.scale is None for p in parts) != all(p.scale is None for p in parts):
        raise ValueError(f"{what}: expected all experts FP8 or all float, found a mix")
    w = torch.stack([p.w for p in parts])
    s = None if parts[0].scale is None else torch.stack([p.scale for p in parts])
    return _Weights(w, s)


def _cat_rows(a: _Weights, b: _Weights, what: str) -> _Weights:
    """[gate ; up] along the rows; with scales, gate's block rows then up's (so I % 128 == 0
    keeps every block inside one half, else a block would straddle them)."""
    if (a.scale is None) != (b.scale is None):
        raise ValueError(f"{what}: gate and up projections differ in format (FP8 vs float)")
    w = torch.cat([a.w, b.w], dim=-2)
    if a.scale is None:
        return _Weights(w, None)
    return _Weights(w, torch.cat([a.scale, b.scale], dim=-2))


def _experts(experts: torch.nn.Module, E: int, H: int) -> Tuple[_Weights, _Weights, int]:
    """(w13 [E, 2I, H], w2 [E, H, I], I) of the routed experts."""
    if hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj"):
        if not getattr(experts, "has_gate", True):
            raise ValueError("block.experts: expected gated (SwiGLU) experts, found has_gate=False")
        if getattr(experts, "has_bias", False) or getattr(experts, "gate_up_proj_bias", None) is not None:
            raise ValueError("block.experts: expected experts without biases, found gate_up_proj_bias")
        w13 = _proj(experts.gate_up_proj, getattr(experts, "gate_up_proj_scale_inv", None), "experts.gate_up_proj")
        w2 = _proj(experts.down_proj, getattr(experts, "down_proj_scale_inv", None), "experts.down_proj")
        if getattr(experts, "is_transposed", False):
            if w13.scale is not None:
                raise ValueError("experts.gate_up_proj: transposed FP8 expert weights are not supported")
            w13 = _Weights(w13.w.transpose(-2, -1), None)
            w2 = _Weights(w2.w.transpose(-2, -1), None)
        if w13.w.dim() != 3 or w13.w.shape[0] != E or w13.w.shape[2] != H or w13.w.shape[1] % 2:
            raise ValueError(f"experts.gate_up_proj: expected [E={E}, 2I, H={H}], found {list(w13.w.shape)}")
        I = w13.w.shape[1] // 2
        if not getattr(experts, "is_concatenated", True):  # [gate0, up0, gate1, up1, ...] rows
            if w13.scale is not None:
                raise ValueError("experts.gate_up_proj: interleaved FP8 gate/up rows are not supported")
            w13 = _Weights(torch.cat([w13.w[:, 0::2], w13.w[:, 1::2]], dim=1), None)
        if w13.scale is not None and I % 128:
            raise ValueError(
                f"experts.gate_up_proj_scale_inv: FP8 fused gate/up with I = {I} (not a multiple of 128) puts "
                "gate and up rows in one scale block; megamoe needs them in separate blocks"
            )
        if list(w2.w.shape) != [E, H, I]:
            raise ValueError(f"experts.down_proj: expected [E={E}, H={H}, I={I}], found {list(w2.w.shape)}")
        return w13, w2, I
    if isinstance(experts, (torch.nn.ModuleList, list, tuple)):
        if len(experts) != E:
            raise ValueError(f"block.experts: expected {E} experts (the router's), found {len(experts)}")
        gates, ups, downs = [], [], []
        for e, mlp in enumerate(experts):
            gates.append(_linear(mlp.gate_proj, f"experts.{e}.gate_proj"))
            ups.append(_linear(mlp.up_proj, f"experts.{e}.up_proj"))
            downs.append(_linear(mlp.down_proj, f"experts.{e}.down_proj"))
        g, u, d = _stack(gates, "experts.*.gate_proj"), _stack(ups, "experts.*.up_proj"), _stack(downs, "experts.*.down_proj")
        I = g.w.shape[1]
        return _cat_rows(g, u, "experts"), d, I
    raise TypeError(
        f"block.experts: expected fused gate_up_proj/down_proj parameters or a ModuleList of MLPs, "
        f"found {type(experts).__name__}"
    )


def _swiglu_limit(block: torch.nn.Module, cfg: Any) -> float:
    for owner, attr in ((block.experts, "swiglu_limit"), (block.experts, "limit"), (cfg, "swiglu_limit")):
        v = getattr(owner, attr, None)
        if v is not None:
            return float(v)
    return 0.0


def _block_layer_args(block: torch.nn.Module, cfg: Any) -> Tuple[MoEConfig, Dict[str, Any], Set[str]]:
    """(MoEConfig, from_stacked tensors, the dtype names of the weights quantized here (empty
    where all were block FP8)) of one transformers MoE block."""
    gate = getattr(block, "gate", None)
    if gate is None or getattr(gate, "weight", None) is None:
        raise ValueError(f"{type(block).__name__}: expected a router at block.gate with a weight [E, H]")
    router = gate.weight.detach()
    if router.dim() != 2:
        raise ValueError(f"gate.weight: expected [E, H], found {list(router.shape)}")
    E, H = router.shape
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.hidden_act: expected 'silu' (SwiGLU experts), found {act!r}")
    bias = getattr(gate, "e_score_correction_bias", None)
    if bias is None:
        bias = getattr(block, "e_score_correction_bias", None)

    w13, w2, I = _experts(block.experts, E, H)
    shared = getattr(block, "shared_experts", None)
    S, sh13, sh2 = 0, None, None
    if shared is not None:
        sg, su, sd = (_linear(getattr(shared, n), f"shared_experts.{n}") for n in ("gate_proj", "up_proj", "down_proj"))
        Is = sg.w.shape[0]
        if Is % I:
            raise ValueError(
                f"shared_experts.gate_proj: expected an intermediate size that is a multiple of the experts' I = {I}, "
                f"found {Is}"
            )
        S = Is // I
        sh13, sh2 = _cat_rows(sg, su, "shared_experts"), sd

    quantized: Set[str] = set()

    def fp8(p: _Weights) -> Tuple[torch.Tensor, torch.Tensor]:
        if p.scale is not None:
            return p.w.contiguous(), p.scale.contiguous()
        quantized.add(str(p.w.dtype).replace("torch.", ""))
        if p.w.dim() == 3:  # expert by expert: the quantizer's float32 copy stays one expert's size
            parts = [quantize_block_fp8(w) for w in p.w]
            return torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts])
        return quantize_block_fp8(p.w)

    # Quantize gate and up separately so that no 128-row block straddles them (I % 128 != 0).
    def fp8_w13(p: _Weights, inter: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if p.scale is not None:
            return fp8(p)
        qg, sg_ = fp8(_Weights(p.w[..., :inter, :], None))
        qu, su_ = fp8(_Weights(p.w[..., inter:, :], None))
        return torch.cat([qg, qu], dim=-2).contiguous(), torch.cat([sg_, su_], dim=-2).contiguous()

    q13, s13 = fp8_w13(w13, I)
    q2, s2 = fp8(w2)
    tensors: Dict[str, Any] = dict(w13=q13, w13_scale=s13, w2=q2, w2_scale=s2)
    if sh13 is not None:
        tensors["shared_w13"], tensors["shared_w13_scale"] = fp8_w13(sh13, S * I)
        tensors["shared_w2"], tensors["shared_w2_scale"] = fp8(sh2)

    # The router as the block holds it; an F32 weight whose values are all BF16 (a BF16
    # checkpoint that transformers keeps in float32) goes in as BF16: the same logits.
    if router.dtype == torch.float32 and torch.equal(router.to(torch.bfloat16).float(), router):
        router = router.to(torch.bfloat16)
    elif router.dtype not in (torch.float32, torch.bfloat16):
        router = router.float()
    tensors["router"] = router.contiguous()
    if bias is not None:
        tensors["bias"] = bias.detach().float().contiguous()

    n_group = int(getattr(gate, "num_group", None) or getattr(gate, "n_group", None) or getattr(cfg, "n_group", 1) or 1)
    topk_group = int(getattr(gate, "topk_group", None) or getattr(cfg, "topk_group", 1) or 1)
    topk = int(getattr(gate, "top_k", None) or getattr(cfg, "num_experts_per_tok"))
    config = MoEConfig(
        hidden=int(H),
        inter=int(I),
        experts=int(E),
        topk=topk,
        shared_experts=int(S),
        n_group=n_group,
        topk_group=topk_group,
        score="sigmoid",  # the four families' routers: router_logits.sigmoid()
        norm_topk_prob=bool(getattr(gate, "norm_topk_prob", getattr(cfg, "norm_topk_prob", True))),
        routed_scaling=float(getattr(gate, "routed_scaling_factor", getattr(cfg, "routed_scaling_factor", 1.0))),
        swiglu_limit=_swiglu_limit(block, cfg),
        router_dtype="bf16" if router.dtype == torch.bfloat16 else "f32",
        correction_bias=bias is not None,
    )
    return config, tensors, quantized


# ---------------------------------------------------------------- the replacement


class MegaMoEBlock(torch.nn.Module):
    """A transformers MoE block's replacement: forward(hidden_states [..., H]) -> a tensor of
    the same shape and dtype (the families' blocks return just that), computed by one
    megamoe layer (its router, routed experts and shared expert). The layer takes BF16:
    other input dtypes are cast to BF16 and the result back. Inputs of more than
    max_tokens rows run in slices of max_tokens."""

    def __init__(self, layer: MoELayer, source: str, family: str):
        super().__init__()
        self.layer = layer
        self.source = source
        self.family = family
        self.hidden = layer.config.hidden

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args or kwargs:
            raise TypeError(
                f"{self.source} (megamoe): expected forward(hidden_states) only, found "
                f"{len(args)} more positional and keyword arguments {sorted(kwargs)}"
            )
        shape, dtype = hidden_states.shape, hidden_states.dtype
        if shape[-1] != self.hidden:
            raise ValueError(f"hidden_states: expected [..., {self.hidden}], found {list(shape)}")
        x = hidden_states.reshape(-1, self.hidden)
        if x.dtype != torch.bfloat16:
            x = x.to(torch.bfloat16)
        x = x.contiguous()
        T, cap = x.shape[0], self.layer.max_tokens
        if T <= cap:
            y = self.layer(x)
        else:
            y = torch.empty_like(x)
            for t0 in range(0, T, cap):
                self.layer(x[t0 : t0 + cap], out=y[t0 : t0 + cap])
        return y.to(dtype).reshape(shape)

    def extra_repr(self) -> str:
        return f"source={self.source}, family={self.family}, layer=({self.layer.extra_repr()})"


def _set_submodule(model: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if isinstance(parent, torch.nn.ModuleList) and child.isdigit():
        parent[int(child)] = new
    else:
        setattr(parent, child, new)


def patch_moe(
    model: torch.nn.Module,
    *,
    device: Any = None,
    max_tokens: int = 4096,
    share_workspace: bool = True,
) -> int:
    """Replaces every MoE block of a loaded transformers model of the families glm5_next,
    glm_moe_dsa, deepseek_v3 and glm4_moe_lite with a megamoe layer built from the block's
    own weights; returns how many were replaced.

    device: "cuda", "cpu" (the kernel-faithful CPU backend) or None: where the block's
    weights are. max_tokens: the most tokens one layer call takes (longer inputs run in
    slices). share_workspace: all layers of the model share one scratch workspace (they run
    one after another on one stream). Block-FP8 weights (as transformers loads FP8
    checkpoints) are used as they are; BF16/F32 weights are quantized to block FP8 (a
    warning says so, once). The blocks' own parameters are released; the patched model is
    for inference.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module (a transformers model), found {type(model).__name__}")
    mt = _model_type(model)
    blocks = find_moe_blocks(model)
    if not blocks:
        kinds = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.endswith(("MoE", "Moe"))})
        if mt is not None and mt not in FAMILIES:
            raise ValueError(
                f"model: expected a model of the families {sorted(FAMILIES)}, found model_type {mt!r}"
                + (f" (its MoE blocks: {kinds})" if kinds else "")
            )
        return 0
    cfg = _text_config(model)
    built = []
    quantized_dtypes: Set[str] = set()
    for name, block, fam in blocks:
        block_cfg = getattr(block, "config", None) or cfg
        try:
            config, tensors, quantized = _block_layer_args(block, block_cfg)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{name} ({type(block).__name__}): {e}") from e
        quantized_dtypes |= quantized
        dev = device if device is not None else tensors["w13"].device
        built.append((name, block, fam, config, tensors, dev))

    if quantized_dtypes:
        warnings.warn(
            f"megamoe.patch_moe: the MoE weights are {'/'.join(sorted(quantized_dtypes))}; quantized to block FP8 "
            "(128x128 blocks, scale = amax / 448) for megamoe",
            stacklevel=2,
        )
    workspaces: Dict[str, Workspace] = {}
    if share_workspace:
        by_dev: Dict[str, List[MoEConfig]] = {}
        for _, _, _, config, _, dev in built:
            by_dev.setdefault(str(dev), []).append(config)
        workspaces = {d: Workspace(cs, max_tokens, d) for d, cs in by_dev.items()}
    for name, block, fam, config, tensors, dev in built:
        layer = MoELayer.from_stacked(
            config, **tensors, device=dev, max_tokens=max_tokens, workspace=workspaces.get(str(dev))
        )
        _set_submodule(model, name, MegaMoEBlock(layer, type(block).__name__, fam))
    return len(built)
