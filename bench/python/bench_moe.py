"""bench/python/bench_moe.py: megamoe beside the MoE implementations importable here, on the
same block-FP8 weights, inputs and routing, in one process (run from a source checkout, the
package installed; not part of the package).

    python bench/python/bench_moe.py --preset glm-5 --tokens 1 8 64 256 1024 4096 \\
        --routing uniform zipf:1.2 --json out.json --plot out.png
    python bench/python/bench_moe.py --device cpu --tokens 4          # the CPU backend, tiny shapes

Implementations (each guarded: one that is absent or fails is reported, never silently
dropped): megamoe (its own layer, external routing; on CUDA also replayed from a CUDA
graph), "torch" (always: a plain PyTorch block-FP8 MoE, tokens sorted by expert and one
torch._scaled_mm per expert with 1x128 / 128x128 block scales where this torch and device
take them, else the weights dequantized to BF16 and one matmul per expert), DeepGEMM's
grouped contiguous FP8 GEMMs (glue in PyTorch; "deepgemm-gemms" times its two GEMMs
alone), vLLM's fused_experts (block FP8) and FlashInfer's cutlass_fused_moe (DeepSeek FP8
block scales) where importable. Every implementation runs the routed experts on the same ids
and weights plus the shared expert, and its output is checked against a float32 reference
that quantizes the activations as docs/numerics.md §4 says (relative L2 in the table) and,
for the peers, against megamoe's output; a peer further than PEER_MAX_REL_L2 from the
reference is reported as an error, not timed.

Timing: CUDA events around each call, an L2 flush (a write of twice the L2) before each,
medians and p10/p90 over --iters calls after --warmup; the CPU backend: wall clock. Floors:
the read floor (the weight bytes of the experts the routing hits, over a streaming read
bandwidth measured here) and the tensor-core floor (the FLOPs over a dense FP8 GEMM rate
measured here; on the CPU a float32 matmul rate).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import inspect
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

import megamoe
from megamoe._layer import _quantize_blocks

_FP8 = torch.float8_e4m3fn

#: The layer shapes the bench takes: the C++ presets (MoEConfig.presets(), the command's
#: --preset) and "tiny", a bench-only shape for the CPU backend. (The bench's routing is
#: external: n_group and the router only shape the config.)
PRESETS: Dict[str, Dict[str, Any]] = {
    **{name: dataclasses.asdict(cfg) for name, cfg in megamoe.MoEConfig.presets().items()},
    "tiny": dict(hidden=256, inter=256, experts=8, topk=2, shared_experts=1, routed_scaling=2.5),
}


class Unavailable(Exception):
    """An implementation that cannot run here (not installed, or refuses the shape)."""


def _import_peer(device, load):
    """A peer library's entry points, `load()` (CUDA peers only); Unavailable with the reason
    where the device is not CUDA or the import fails."""
    if device.type != "cuda":
        raise Unavailable("CUDA only")
    try:
        return load()
    except Exception as e:  # noqa: BLE001
        raise Unavailable(f"not importable ({type(e).__name__}: {str(e).splitlines()[0][:100]})") from None


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------- weights, inputs, routing


class Weights:
    """Random block-FP8 weights of one layer (the checkpoint's layout): codes ~ N(0, 64)
    clamped to E4M3's range, scales uniform in [0.5, 1.5] * 3e-4 (real weights of std
    ~0.02), generated expert by expert on the device."""

    def __init__(self, cfg: megamoe.MoEConfig, device: torch.device, seed: int):
        g = torch.Generator(device=device).manual_seed(seed)
        E, H, I, S = cfg.experts, cfg.hidden, cfg.inter, cfg.shared_experts
        self.cfg = cfg

        def codes(*shape):
            out = torch.empty(*shape, dtype=_FP8, device=device)
            for i in range(shape[0]):
                r = torch.randn(*shape[1:], generator=g, device=device) * 64
                out[i] = r.clamp_(-448, 448).to(_FP8)
            return out

        def scales(*shape):
            return (torch.rand(*shape, generator=g, device=device) + 0.5) * 3e-4

        self.w13 = codes(E, 2 * I, H)
        self.w13_scale = scales(E, 2 * _ceil(I, 128), _ceil(H, 128))
        self.w2 = codes(E, H, I)
        self.w2_scale = scales(E, _ceil(H, 128), _ceil(I, 128))
        self.router = torch.randn(E, H, generator=g, device=device) / math.sqrt(H)
        self.bias = torch.randn(E, generator=g, device=device) * 0.01
        self.shared = None
        if S:
            Is = S * I
            self.shared = dict(
                w13=codes(1, 2 * Is, H)[0], w13_scale=scales(2 * _ceil(Is, 128), _ceil(H, 128)),
                w2=codes(1, H, Is)[0], w2_scale=scales(_ceil(H, 128), _ceil(Is, 128)),
            )

    def expert(self, e: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(w13, w13_scale, w2, w2_scale, I) of routed expert e, or the shared expert for e = -1."""
        if e < 0:
            s = self.shared
            return s["w13"], s["w13_scale"], s["w2"], s["w2_scale"], s["w2"].shape[1]
        return self.w13[e], self.w13_scale[e], self.w2[e], self.w2_scale[e], self.cfg.inter


def dequant(w: torch.Tensor, s: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """fp8 codes [N, K] * their 128x128 scales -> [N, K] (docs/numerics.md §2)."""
    n, k = w.shape
    full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    return (w.float() * full).to(dtype)


def quant_1x128(a: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per row, per 128 columns: s = max(amax, 1e-4) / 448, q = e4m3(a * (1/s)) (docs/numerics.md §4).
    Returns (q [M, K] E4M3, s [M, ceil(K/128)] float32)."""
    return _quantize_blocks(a, 1, amax_floor=1e-4)


def fake_quant_1x128(a: torch.Tensor) -> torch.Tensor:
    q, s = quant_1x128(a)
    return dequant_rows(q, s)


def dequant_rows(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return q.float() * s.repeat_interleave(128, 1)[:, : q.shape[1]]


def make_routing(spec: str, T: int, cfg: megamoe.MoEConfig, device: torch.device, seed: int):
    """(ids int32 [T, K], weights float32 [T, K]): K distinct experts a token.
    uniform: every expert alike; zipf:S: expert popularity 1/rank^S over a random order
    (a hot set, as real traffic has); replay:FILE: ids from a .npy / .npz / .pt file
    ([N, K], rows reused cyclically; a .pt or .npz may hold 'topk_ids' and 'topk_weights').
    Weights (unless replayed): positive, renormalized, times routed_scaling."""
    E, K = cfg.experts, cfg.topk
    g = torch.Generator(device="cpu").manual_seed(seed)
    w = None
    if spec == "uniform":
        ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :K]
    elif spec.startswith("zipf:"):
        try:
            s = float(spec[5:])
        except ValueError:
            raise ValueError(f"--routing: expected zipf:S with a number S, found {spec!r}") from None
        if not s >= 0:
            raise ValueError(f"--routing: expected zipf:S with S >= 0, found {spec!r}")
        p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** s
        p = p[torch.randperm(E, generator=g)]
        ids = torch.multinomial(p.expand(T, E).float(), K, replacement=False, generator=g)
    elif spec.startswith("replay:"):
        ids, w = _load_replay(spec[7:], K, E)
        reps = _ceil(T, ids.shape[0])
        ids = ids.repeat(reps, 1)[:T]
        if w is not None:
            w = w.repeat(reps, 1)[:T]
    else:
        raise ValueError(f"--routing: expected uniform, zipf:S or replay:FILE, found {spec!r}")
    if w is None:
        w = torch.rand(T, K, generator=g) + 0.5
        w = w / w.sum(1, keepdim=True) * cfg.routed_scaling
    return ids.to(torch.int32).to(device), w.float().to(device)


def _load_replay(path: str, K: int, E: int):
    if not os.path.isfile(path):
        raise ValueError(f"--routing replay: no file {path!r}")
    w = None
    if path.endswith(".pt"):
        obj = torch.load(path, map_location="cpu", weights_only=True)
        if isinstance(obj, dict):
            if "topk_ids" not in obj:
                raise ValueError(f"--routing replay: {path} holds a dict without 'topk_ids' (keys {sorted(obj)})")
            ids, w = obj["topk_ids"], obj.get("topk_weights")
        else:
            ids = obj
        ids = torch.as_tensor(ids)
    elif path.endswith((".npy", ".npz")):
        import numpy as np

        obj = np.load(path)
        if path.endswith(".npz"):
            if "topk_ids" not in obj:
                raise ValueError(f"--routing replay: {path} has no 'topk_ids' array (has {sorted(obj.files)})")
            w = torch.from_numpy(obj["topk_weights"]) if "topk_weights" in obj else None
            obj = obj["topk_ids"]
        ids = torch.from_numpy(np.ascontiguousarray(obj))
    else:
        raise ValueError(f"--routing replay: expected a .npy, .npz or .pt file, found {path!r}")
    if ids.dim() != 2 or ids.shape[1] != K or ids.shape[0] == 0 or ids.is_floating_point():
        raise ValueError(
            f"--routing replay: expected integer ids [N >= 1, K = {K}], found {ids.dtype} {list(ids.shape)} in {path}"
        )
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= E:
        raise ValueError(f"--routing replay: expected ids in [0, {E}), found {lo if lo < 0 else hi} in {path}")
    if w is not None and tuple(w.shape) != tuple(ids.shape):
        raise ValueError(f"--routing replay: topk_weights {list(w.shape)} differs from topk_ids {list(ids.shape)}")
    return ids.long(), (None if w is None else w.float())


# ---------------------------------------------------------------- the float32 reference


def _swiglu(h: torch.Tensor, I: int, limit: float, wt: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up times the routing weight, float32, from h = [gate | up] [M, 2I]; with the
    clamp (limit > 0): gate <= limit, |up| <= limit."""
    g, u = h[:, :I], h[:, I:]
    if limit:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return torch.nn.functional.silu(g) * u * wt[:, None]


def reference(W: Weights, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y in float32: dequantized weights, activations quantized as docs/numerics.md §4 (x and the
    SwiGLU output, per token per 128 columns), SwiGLU with the clamp, times the routing
    weight before the second quantization, plus the shared expert."""
    cfg = W.cfg
    L = cfg.swiglu_limit
    xf = fake_quant_1x128(x)
    y = torch.zeros(x.shape[0], cfg.hidden, dtype=torch.float32, device=x.device)

    def mlp(e, rows, wt):
        w13, s13, w2, s2, I = W.expert(e)
        a = _swiglu(xf[rows] @ dequant(w13, s13).t(), I, L, wt)
        return (fake_quant_1x128(a) @ dequant(w2, s2).t()).bfloat16().float()

    flat = ids.reshape(-1).long()
    tok = torch.arange(x.shape[0], device=x.device).repeat_interleave(ids.shape[1])
    for e in torch.unique(flat).tolist():
        sel = flat == e
        y.index_add_(0, tok[sel], mlp(e, tok[sel], w.reshape(-1)[sel]))
    if W.shared is not None:
        y += mlp(-1, torch.arange(x.shape[0], device=x.device), torch.ones(x.shape[0], device=x.device))
    return y


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    if not bool(torch.isfinite(a).all()):
        return float("nan")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ---------------------------------------------------------------- implementations


#: A peer's layer output further than this (relative L2) from the float32 reference, or from
#: megamoe's output where the reference is skipped, is wrong: its time is not reported. The
#: FP8 paths that quantize as the reference does land near 1.5e-2; a wrong layout near 1.
PEER_MAX_REL_L2 = 0.05


class Impl:
    name = "?"
    how = ""
    #: None: no bound (megamoe and torch are checked by the tests); a peer sets PEER_MAX_REL_L2.
    max_rel_l2: Optional[float] = None
    #: Parts of the layer timed on their own after a call ({part: what it runs}); reported as
    #: "<name>-<part>" rows beside the whole layer. part(p) runs one on the last call's operands.
    parts: Dict[str, str] = {}

    def setup(self, W: Weights, device: torch.device, max_tokens: int) -> None:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def part(self, p: str) -> None:
        raise NotImplementedError


class MegaMoE(Impl):
    name = "megamoe"

    def setup(self, W, device, max_tokens):
        t = dict(w13=W.w13, w13_scale=W.w13_scale, w2=W.w2, w2_scale=W.w2_scale, router=W.router, bias=W.bias)
        if W.shared is not None:
            t.update({"shared_" + k: v for k, v in W.shared.items()})
        borrow = device.type == "cuda"  # the bench's own tensors, read in place: no second copy
        self.layer = megamoe.MoELayer.from_stacked(W.cfg, **t, device=str(device), max_tokens=max_tokens,
                                                   borrow=borrow)
        # No host-side id check (one device sync a call): the bench's ids are in range, and
        # check() after the timing would raise on a device-recorded violation.
        self.layer.check_routing = False
        self.how = f"megamoe {megamoe.__version__}, fused layer, external routing ({device.type} backend)"

    def __call__(self, x, ids, w):
        return self.layer(x, topk_ids=ids, topk_weights=w)


def _scaled_mm_block(a_q, a_s, w_q, w_s):
    """a_q [M, K] E4M3 with 1x128 scales a_s [M, K/128]; w_q [N, K] E4M3 with 128x128 scales
    w_s [N/128, K/128] -> bf16 [M, N] (cuBLASLt's VEC128 x BLK128x128 scaling). M is padded
    to a multiple of 16 (zero rows, unit scales), which cuBLASLt's FP8 layouts want."""
    m = a_q.shape[0]
    if m % 16:
        pad = 16 - m % 16
        a_q = torch.cat([a_q, torch.zeros(pad, a_q.shape[1], dtype=a_q.dtype, device=a_q.device)])
        a_s = torch.cat([a_s, torch.ones(pad, a_s.shape[1], dtype=a_s.dtype, device=a_s.device)])
    out = torch._scaled_mm(a_q, w_q.t(), scale_a=a_s.t().contiguous().t(), scale_b=w_s.t(),
                           out_dtype=torch.bfloat16)
    return out[:m]


class TorchMoE(Impl):
    """A plain PyTorch block-FP8 MoE: tokens sorted by expert (one host sync for the
    counts), per expert GEMM1 -> SwiGLU (float32) x routing weight -> GEMM2, combined in
    float32. Block-scaled torch._scaled_mm where it runs and agrees with the dequantized
    product, else BF16 weights (dequantized once) and BF16 activations."""

    name = "torch"

    def setup(self, W, device, max_tokens):
        self.W = W
        self.cfg = W.cfg
        self.mode = "bf16"
        why = "CPU" if device.type != "cuda" else ""
        if device.type == "cuda":
            try:
                self._probe(W)
                self.mode = "fp8"
            except Exception as e:  # noqa: BLE001  (this torch / cuBLASLt lacks the block scales)
                why = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        if self.mode == "bf16":
            self.bf16 = [tuple(dequant(*p, dtype=torch.bfloat16) for p in ((W.w13[e], W.w13_scale[e]),
                                                                              (W.w2[e], W.w2_scale[e])))
                         for e in range(self.cfg.experts)]
            if W.shared is not None:
                s = W.shared
                self.bf16_shared = (dequant(s["w13"], s["w13_scale"], torch.bfloat16),
                                    dequant(s["w2"], s["w2_scale"], torch.bfloat16))
            self.how = (f"torch {torch.__version__}: weights dequantized to BF16, one matmul per expert, BF16 "
                        f"activations (block-scaled _scaled_mm not used: {why})")
        else:
            self.how = (f"torch {torch.__version__}: one torch._scaled_mm per expert, 1x128 activation / 128x128 "
                        "weight block scales (cuBLASLt), SwiGLU in float32")

    def _probe(self, W):
        w13, s13, _, _, _ = W.expert(0)
        for m in (1, 3, 17, 128):
            a = torch.randn(m, W.cfg.hidden, device=w13.device)
            q, s = quant_1x128(a)
            got = _scaled_mm_block(q, s, w13, s13).float()
            want = dequant_rows(q, s) @ dequant(w13, s13).t()
            err = rel_l2(got, want)
            if not err < 1e-2:
                raise RuntimeError(f"block-scaled _scaled_mm disagrees with the dequantized product: rel L2 {err:.3g}")

    def _mlp(self, e, xq, xs, x_rows, wt):
        if self.mode == "fp8":
            w13, s13, w2, s2, I = self.W.expert(e)
            h = _scaled_mm_block(xq, xs, w13, s13).float()
        else:
            w13b, w2b = self.bf16[e] if e >= 0 else self.bf16_shared
            I = w2b.shape[1]
            h = (x_rows @ w13b.t()).float()
        a = _swiglu(h, I, self.cfg.swiglu_limit, wt)
        if self.mode == "fp8":
            aq, as_ = quant_1x128(a)
            return _scaled_mm_block(aq, as_, w2, s2)
        return a.bfloat16() @ w2b.t()

    def __call__(self, x, ids, w):
        T, K = ids.shape
        flat = ids.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.cfg.experts).tolist()  # the host sync
        tok = order // K
        ws = w.reshape(-1)[order]
        if self.mode == "fp8":
            q, s = quant_1x128(x)
            xq, xs, xr = q[tok], s[tok], None
        else:
            xq = xs = None
            xr = x[tok]
        ys = torch.empty(T * K, self.cfg.hidden, dtype=torch.bfloat16, device=x.device)
        off = 0
        for e, c in enumerate(counts):
            if c:
                sl = slice(off, off + c)
                ys[sl] = self._mlp(e, None if xq is None else xq[sl], None if xs is None else xs[sl],
                                   None if xr is None else xr[sl], ws[sl])
                off += c
        y = torch.zeros(T, self.cfg.hidden, dtype=torch.float32, device=x.device).index_add_(0, tok, ys.float())
        if self.W.shared is not None:
            ones = torch.ones(T, device=x.device)
            if self.mode == "fp8":
                y += self._mlp(-1, q, s, None, ones).float()
            else:
                y += self._mlp(-1, None, None, x, ones).float()
        return y.bfloat16()


class _FusedPeer(Impl):
    """A peer's fused MoE call over the stacked block-FP8 weights (load() gives the module and
    the entry point); the shared expert is a second call with one expert. Subclasses: load(),
    no_clamp (the refusal where the layer has a SwiGLU clamp), _setup (self.how) and _call."""

    no_clamp = ""
    max_rel_l2 = PEER_MAX_REL_L2

    @staticmethod
    def load() -> Tuple[Any, Callable]:
        raise NotImplementedError

    def setup(self, W, device, max_tokens):
        mod, self.fn = _import_peer(device, self.load)
        if W.cfg.swiglu_limit:
            raise Unavailable(self.no_clamp)
        self.W = W
        self.routed = (W.w13, W.w13_scale, W.w2, W.w2_scale)
        self.sh = None
        if W.shared is not None:
            s = W.shared
            self.sh = (s["w13"][None], s["w13_scale"][None], s["w2"][None], s["w2_scale"][None])
        self._setup(mod)

    def _setup(self, mod) -> None:
        raise NotImplementedError

    def _call(self, x, ids, w, shared: bool) -> torch.Tensor:
        """The routed experts (self.routed), or with shared the shared expert (self.sh)."""
        raise NotImplementedError

    def __call__(self, x, ids, w):
        y = self._call(x, ids, w, False)
        if self.sh is not None:
            T = x.shape[0]
            ones = torch.ones(T, 1, dtype=torch.float32, device=x.device)
            zeros = torch.zeros(T, 1, dtype=ids.dtype, device=x.device)
            y = y + self._call(x, zeros, ones, True)
        return y


class VllmFusedExperts(_FusedPeer):
    """vLLM's Triton fused MoE (fused_experts, block-FP8 w8a8)."""

    name = "vllm"
    no_clamp = "fused_experts has no SwiGLU clamp (swiglu_limit)"

    @staticmethod
    def load():
        import vllm
        from vllm.model_executor.layers.fused_moe import fused_experts

        return vllm, fused_experts

    def _setup(self, vllm):
        params = inspect.signature(self.fn).parameters
        if "quant_config" in params:
            from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config

            def kw(s13, s2):
                return dict(quant_config=fp8_w8a8_moe_quant_config(w1_scale=s13, w2_scale=s2, block_shape=[128, 128]))
        else:
            def kw(s13, s2):
                return dict(use_fp8_w8a8=True, w1_scale=s13, w2_scale=s2, block_shape=[128, 128])
        self.kw = kw(self.routed[1], self.routed[3])
        self.kw_sh = kw(self.sh[1], self.sh[3]) if self.sh else None
        self.how = f"vLLM {vllm.__version__} fused_experts (Triton), block FP8 w8a8"

    def _call(self, x, ids, w, shared):
        w13, _, w2, _ = self.sh if shared else self.routed
        return self.fn(x, w13, w2, w, ids, **(self.kw_sh if shared else self.kw))


class DeepGemmGrouped(Impl):
    """A layer on DeepGEMM's grouped contiguous FP8 GEMM (m_grouped_fp8_gemm_nt_contiguous;
    on SM90 its kernel sm90_fp8_gemm_1d2d: 1x128 activation scales, 128x128 weight scales,
    BF16 out), both GEMMs of the routed experts and of the shared expert in one launch each:
    the shared expert is group E, every token routed to it with weight 1.

    DeepGEMM: GEMM1 and GEMM2. PyTorch glue: the sort of the (token, expert) pairs by expert
    and the padding of each expert's rows to DeepGEMM's M alignment (one host sync: the
    contiguous layout takes M from the host), the 1x128 quantizations of x and of the SwiGLU
    output (float32, docs/numerics.md §4) with their scales made MN-major and TMA-aligned as
    the kernel reads them, SwiGLU with the clamp times the routing weight (float32), and the
    combine (index_add in float32 of each expert's BF16 output, as the reference sums).
    The part "gemms" times the two GEMM launches alone on the last call's operands: what any
    DeepGEMM-based layer spends at least."""

    name = "deepgemm"
    max_rel_l2 = PEER_MAX_REL_L2
    parts = {"gemms": "DeepGEMM's two grouped GEMM launches alone (operands of the layer call above)"}

    def setup(self, W, device, max_tokens):
        dg = _import_peer(device, lambda: __import__("deep_gemm"))
        version = getattr(dg, "__version__", "?")
        need = ("m_grouped_fp8_gemm_nt_contiguous", "get_mk_alignment_for_contiguous_layout",
                "get_mn_major_tma_aligned_tensor")
        missing = [n for n in need if not hasattr(dg, n)]
        if missing:
            raise Unavailable(f"deep_gemm {version} lacks {', '.join(missing)} (the bench calls the 2.x API)")
        cfg = W.cfg
        if W.shared is not None and W.shared["w2"].shape[1] != cfg.inter:
            raise Unavailable("the shared expert is wider than a routed one: it cannot be a group of the same GEMM")
        self.gemm = dg.m_grouped_fp8_gemm_nt_contiguous
        self.align = int(dg.get_mk_alignment_for_contiguous_layout())
        self.mn_major = dg.get_mn_major_tma_aligned_tensor
        self.W = W
        # DeepGEMM takes one [G, N, K] tensor a GEMM: the shared expert joins as group E (a copy).
        routed = (W.w13, W.w13_scale, W.w2, W.w2_scale)
        if W.shared is None:
            self.w13, self.s13, self.w2, self.s2 = routed
        else:
            E = cfg.experts
            stacked = []
            for t, key in zip(routed, ("w13", "w13_scale", "w2", "w2_scale")):
                out = torch.empty((E + 1,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
                out[:E].copy_(t)
                out[E].copy_(W.shared[key])
                stacked.append(out)
            self.w13, self.s13, self.w2, self.s2 = stacked
        self.last = None
        self.how = (f"DeepGEMM {version} m_grouped_fp8_gemm_nt_contiguous for GEMM1 and GEMM2 (routed + shared "
                    f"experts, rows padded to {self.align}); sort, quantization, SwiGLU and combine in PyTorch")

    def __call__(self, x, ids, w):
        cfg = self.W.cfg
        T, K = ids.shape
        H, I, dev = cfg.hidden, cfg.inter, x.device
        groups = self.w13.shape[0]
        e = ids.reshape(-1).long()
        tok = torch.arange(T, device=dev).repeat_interleave(K)
        wt = w.reshape(-1).float()
        if groups > cfg.experts:  # the shared expert: group E, weight 1
            e = torch.cat([e, torch.full((T,), cfg.experts, dtype=torch.long, device=dev)])
            tok = torch.cat([tok, torch.arange(T, device=dev)])
            wt = torch.cat([wt, torch.ones(T, device=dev)])
        order = torch.argsort(e, stable=True)
        e, tok, wt = e[order], tok[order], wt[order]
        counts = torch.bincount(e, minlength=groups)
        padded = (counts + self.align - 1) // self.align * self.align
        M = int(padded.sum())  # the host sync
        first = torch.cumsum(padded, 0) - padded  # each group's first padded row
        dst = first[e] + torch.arange(e.numel(), device=dev) - (torch.cumsum(counts, 0) - counts)[e]
        m_idx = torch.full((M,), -1, dtype=torch.int32, device=dev)  # -1: a padding row, skipped
        m_idx[dst] = e.int()

        q, s = quant_1x128(x)
        aq = torch.zeros(M, H, dtype=torch.uint8, device=dev)  # FP8 rows moved as bytes
        aq[dst] = q.view(torch.uint8)[tok]
        as_ = torch.ones(M, s.shape[1], dtype=torch.float32, device=dev)
        as_[dst] = s[tok]
        a1 = (aq.view(_FP8), self.mn_major(as_))
        h = torch.empty(M, 2 * I, dtype=torch.bfloat16, device=dev)
        self.gemm(a1, (self.w13, self.s13), h, m_idx)

        wrow = torch.zeros(M, device=dev)
        wrow[dst] = wt
        bq, bs = quant_1x128(_swiglu(h.float(), I, cfg.swiglu_limit, wrow))
        a2 = (bq, self.mn_major(bs))
        o = torch.empty(M, H, dtype=torch.bfloat16, device=dev)
        self.gemm(a2, (self.w2, self.s2), o, m_idx)
        self.last = (a1, h, a2, o, m_idx)
        y = torch.zeros(T, H, dtype=torch.float32, device=dev).index_add_(0, tok, o[dst].float())
        return y.bfloat16()

    def part(self, p):
        a1, h, a2, o, m_idx = self.last
        self.gemm(a1, (self.w13, self.s13), h, m_idx)
        self.gemm(a2, (self.w2, self.s2), o, m_idx)


class FlashInferCutlass(_FusedPeer):
    """FlashInfer's cutlass_fused_moe with DeepSeek FP8 block scales (SM90 only). fc1 goes in
    as [gate ; up]; this path has not run anywhere: another order shows as a wrong output
    (an error, not a time). Its SM90 module is JIT-compiled from about 250 CUTLASS
    translation units on first use, and the package imports apache-tvm-ffi and
    nvidia-cutlass-dsl."""

    name = "flashinfer"
    no_clamp = "the SwiGLU clamp is not wired here"

    @staticmethod
    def load():
        import flashinfer
        from flashinfer.fused_moe import cutlass_fused_moe

        return flashinfer, cutlass_fused_moe

    def _setup(self, flashinfer):
        self.how = f"FlashInfer {getattr(flashinfer, '__version__', '?')} cutlass_fused_moe, DeepSeek FP8 block scales"

    def _call(self, x, ids, w, shared):
        w13, s13, w2, s2 = self.sh if shared else self.routed
        out = self.fn(x, ids.int(), w.float(), w13, w2, torch.bfloat16, quant_scales=[s13, s2],
                      use_deepseek_fp8_block_scale=True)
        return out[0] if isinstance(out, (list, tuple)) else out


IMPLS: Dict[str, Callable[[], Impl]] = {
    "megamoe": MegaMoE,
    "torch": TorchMoE,
    "deepgemm": DeepGemmGrouped,
    "vllm": VllmFusedExperts,
    "flashinfer": FlashInferCutlass,
}


# ---------------------------------------------------------------- timing and floors


class Timer:
    def __init__(self, device: torch.device, warmup: int, iters: int):
        self.device, self.warmup, self.iters = device, warmup, iters
        self.flush_buf = None
        if device.type == "cuda":
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20) or (50 << 20)
            self.flush_buf = torch.empty(2 * l2, dtype=torch.uint8, device=device)

    def __call__(self, fn: Callable[[], Any]) -> Dict[str, float]:
        for _ in range(self.warmup):
            fn()
        ts: List[float] = []
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(self.iters)]
            for s, e in ev:
                self.flush_buf.zero_()  # writes twice the L2: the weights are read from memory
                s.record()
                fn()
                e.record()
            torch.cuda.synchronize(self.device)
            ts = [s.elapsed_time(e) * 1e3 for s, e in ev]
        else:
            for _ in range(self.iters):
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) * 1e6)
        ts.sort()
        q = lambda f: ts[min(len(ts) - 1, int(f * (len(ts) - 1) + 0.5))]  # noqa: E731
        return dict(median_us=statistics.median(ts), p10_us=q(0.1), p90_us=q(0.9), samples=len(ts))


def measure_floors(device: torch.device, timer: Timer) -> Dict[str, Any]:
    """Streaming read bandwidth (a reduction over a buffer far larger than the L2) and the
    dense tensor rate (an FP8 GEMM on CUDA, a float32 matmul on the CPU), measured here."""
    if device.type == "cuda":
        n = 2 << 30
        buf = torch.ones(n // 4, dtype=torch.float32, device=device)
        bw = n / (timer(lambda: buf.sum())["median_us"] * 1e-6)
        del buf
        m = n_ = k = 8192
        a = (torch.randn(m, k, device=device) * 0.5).to(_FP8)
        b = (torch.randn(n_, k, device=device) * 0.5).to(_FP8)
        form = "1x128 / 128x128 block scales"
        sa = torch.rand(m, k // 128, device=device) + 0.5
        sb = torch.rand(n_ // 128, k // 128, device=device) + 0.5
        try:
            _scaled_mm_block(a, sa, b, sb)
            fn = lambda: _scaled_mm_block(a, sa, b, sb)  # noqa: E731
        except Exception:  # noqa: BLE001
            one = torch.ones((), device=device)
            form = "one scale a tensor"
            fn = lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
        rate = 2.0 * m * n_ * k / (timer(fn)["median_us"] * 1e-6)
        return dict(read_bytes_per_s=bw, read_how="torch.sum over 2 GiB after an L2 flush",
                    tc_flops_per_s=rate, tc_how=f"torch._scaled_mm FP8 8192^3, {form}")
    n = 256 << 20
    buf = torch.ones(n // 4, dtype=torch.float32)
    bw = n / (timer(lambda: buf.sum())["median_us"] * 1e-6)
    a = torch.randn(1024, 1024)
    rate = 2.0 * 1024**3 / (timer(lambda: a @ a)["median_us"] * 1e-6)
    return dict(read_bytes_per_s=bw, read_how="torch.sum over 256 MiB (CPU)", tc_flops_per_s=rate,
                tc_how="float32 matmul 1024^3 (CPU)")


def expert_bytes(H: int, I: int) -> float:
    """E4M3 weights plus float32 block scales of one SwiGLU expert of intermediate I."""
    return 3.0 * H * I + (2 * _ceil(I, 128) * _ceil(H, 128) + _ceil(H, 128) * _ceil(I, 128)) * 4


# ---------------------------------------------------------------- the run


def _git_commit() -> Optional[str]:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        r = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if r.returncode == 0:
            sha = r.stdout.strip()
            dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def _card(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} threads)"


def run(args: argparse.Namespace, log=print) -> Dict[str, Any]:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device (use --device cpu)")
    preset = args.preset or ("glm-5" if device.type == "cuda" else "tiny")
    if preset not in PRESETS:
        raise SystemExit(f"--preset: expected one of {sorted(PRESETS)}, found {preset!r}")
    shape = dict(PRESETS[preset])
    for k in ("hidden", "inter", "experts", "topk", "shared_experts"):
        v = getattr(args, k)
        if v is not None:
            shape[k] = v
    cfg = megamoe.MoEConfig(**{**shape, "router_dtype": "f32"})
    cfg.validate()
    tokens = args.tokens or ([1, 8, 64, 256, 1024, 4096] if device.type == "cuda" else [4])
    if any(t < 1 for t in tokens):
        raise SystemExit(f"--tokens: expected counts >= 1, found {tokens}")
    iters = args.iters or (20 if device.type == "cuda" else 3)
    warmup = args.warmup if args.warmup is not None else (3 if device.type == "cuda" else 1)
    timer = Timer(device, warmup, iters)

    log(f"device: {_card(device)}; torch {torch.__version__}; megamoe {megamoe.__version__}")
    log(f"shape ({preset}): H={cfg.hidden} I={cfg.inter} E={cfg.experts} K={cfg.topk} shared={cfg.shared_experts} "
        f"clamp={cfg.swiglu_limit}")
    t0 = time.time()
    W = Weights(cfg, device, args.seed)
    log(f"weights: {time.time() - t0:.1f} s")
    floors = measure_floors(device, timer)
    log(f"floors: read {floors['read_bytes_per_s'] / 1e12:.3f} TB/s ({floors['read_how']}), "
        f"tensor {floors['tc_flops_per_s'] / 1e12:.1f} TFLOP/s ({floors['tc_how']})")

    impls: Dict[str, Dict[str, Any]] = {}
    live: Dict[str, Impl] = {}
    for name in args.impl:
        impl = IMPLS[name]()
        try:
            impl.setup(W, device, max(tokens))
            live[name] = impl
            impls[name] = dict(available=True, how=impl.how)
            for part, how in impl.parts.items():
                impls[f"{name}-{part}"] = dict(available=True, how=how)
        except Unavailable as e:
            impls[name] = dict(available=False, reason=str(e))
        except Exception as e:  # noqa: BLE001  (a peer that fails to set up is reported, not fatal)
            impls[name] = dict(available=False, reason=f"setup failed: {type(e).__name__}: {str(e)[:200]}")
        log(f"  {name}: " + (impls[name].get("how") or "skipped: " + impls[name]["reason"]))
    if "megamoe" in live and device.type == "cuda" and args.graph:
        impls["megamoe-graph"] = dict(available=True, how="megamoe, the same call replayed from a CUDA graph")

    E, H, I, K, S = cfg.experts, cfg.hidden, cfg.inter, cfg.topk, cfg.shared_experts
    flops_tok = 6.0 * H * I * K + 6.0 * H * I * S
    results = []
    for routing in args.routing:
        for T in tokens:
            x = (torch.randn(T, H, generator=torch.Generator().manual_seed(args.seed + T)) * 1.0).to(
                torch.bfloat16).to(device)
            ids, w = make_routing(routing, T, cfg, device, args.seed + 7 * T)
            hit = int(torch.unique(ids).numel())
            nbytes = hit * expert_bytes(H, I) + (expert_bytes(H, S * I) if S else 0.0)
            flops = T * flops_tok
            read_us = nbytes / floors["read_bytes_per_s"] * 1e6
            tc_us = flops / floors["tc_flops_per_s"] * 1e6
            ref = reference(W, x, ids, w) if args.check else None
            row: Dict[str, Any] = dict(routing=routing, tokens=T, experts_hit=hit, weight_bytes=nbytes, flops=flops,
                                       read_floor_us=read_us, tc_floor_us=tc_us, floor_us=max(read_us, tc_us),
                                       impls={})
            y_megamoe = None
            for name, impl in list(live.items()):
                r: Dict[str, Any] = {}
                row["impls"][name] = r
                try:
                    y = impl(x, ids, w)
                    if ref is not None:
                        r["rel_l2_vs_ref"] = rel_l2(y, ref)
                    if name == "megamoe":
                        y_megamoe = y.clone()  # the timed calls below reuse the layer's output
                    elif y_megamoe is not None:
                        r["rel_l2_vs_megamoe"] = rel_l2(y, y_megamoe)
                    _check_peer(impl, r)
                    r.update(timer(lambda: impl(x, ids, w)))
                    if name == "megamoe" and device.type == "cuda":
                        impl.layer.check()  # a device-recorded id violation raises here
                    for part in impl.parts:  # after the checked call, on its operands
                        row["impls"][f"{name}-{part}"] = timer(lambda: impl.part(part))
                except Exception as e:  # noqa: BLE001  (one failing case is reported; the others run)
                    r["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                if name == "megamoe" and device.type == "cuda" and args.graph and "error" not in r:
                    g = row["impls"]["megamoe-graph"] = {}
                    try:
                        g.update(_time_graph(impl, x, ids, w, timer, ref))
                    except Exception as e:  # noqa: BLE001
                        g["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            for r in row["impls"].values():
                if "median_us" in r:
                    r["tflops"] = flops / (r["median_us"] * 1e-6) / 1e12
                    r["tbps"] = nbytes / (r["median_us"] * 1e-6) / 1e12
                    r["x_floor"] = r["median_us"] / row["floor_us"]
            results.append(row)
            log(_row_text(row))
    out = dict(
        commit=args.commit or _git_commit(),
        megamoe_version=megamoe.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=" ".join([os.path.basename(sys.executable), "bench/python/bench_moe.py"] + list(args.argv)),
        card=_card(device),
        device=device.type,
        torch=torch.__version__,
        preset=preset,
        shape=dict(hidden=H, inter=I, experts=E, topk=K, shared_experts=S, swiglu_limit=cfg.swiglu_limit),
        timing=dict(warmup=warmup, iters=iters, l2_flush=device.type == "cuda",
                    clock="CUDA events" if device.type == "cuda" else "wall clock"),
        floors=floors,
        implementations=impls,
        results=results,
    )
    return out


def _check_peer(impl: Impl, r: Dict[str, Any]) -> None:
    """Raises where a peer's output is off the reference (or megamoe's output where the
    reference is skipped) by more than its bound: a wrong output gets no time. A peer with
    neither to compare against is timed and marked unchecked."""
    if impl.max_rel_l2 is None:
        return
    rel = r.get("rel_l2_vs_ref", r.get("rel_l2_vs_megamoe"))
    if rel is None:
        r["unchecked"] = True
    elif not rel <= impl.max_rel_l2:  # NaN fails too
        raise RuntimeError(f"wrong output: rel L2 {rel:.3g} > {impl.max_rel_l2} (not timed)")


def _time_graph(impl: MegaMoE, x, ids, w, timer: Timer, ref) -> Dict[str, Any]:
    """The megamoe call captured once in a CUDA graph and replayed (no host work a call)."""
    r: Dict[str, Any] = {}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        impl(x, ids, w)  # warm outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = impl(x, ids, w)
    g.replay()
    torch.cuda.synchronize()
    if ref is not None:
        r["rel_l2_vs_ref"] = rel_l2(y, ref)
    r.update(timer(g.replay))
    return r


def _fmt_us(v: float) -> str:
    return f"{v:.1f}" if v < 1000 else f"{v:.0f}"


def _row_text(row: Dict[str, Any]) -> str:
    parts = [f"{row['routing']:>10} T={row['tokens']:<5} hit {row['experts_hit']:>3}  floor {_fmt_us(row['floor_us'])} us"
             f" (read {_fmt_us(row['read_floor_us'])}, tc {_fmt_us(row['tc_floor_us'])})"]
    for name, r in row["impls"].items():
        if "median_us" in r:
            rel, rel_m = r.get("rel_l2_vs_ref"), r.get("rel_l2_vs_megamoe")
            parts.append(f"{name} {_fmt_us(r['median_us'])} us ({r['x_floor']:.2f}x"
                         + (f", rel {rel:.3f}" if rel is not None else "")
                         + (f", vs megamoe {rel_m:.3f}" if rel_m is not None else "") + ")")
        else:
            parts.append(f"{name} ERROR {r.get('error', '?')}")
    return " | ".join(parts)


def table(out: Dict[str, Any]) -> str:
    """The results as a fixed-width table: median us (ratio to the floor) per implementation."""
    names = []
    for row in out["results"]:
        for n in row["impls"]:
            if n not in names:
                names.append(n)
    hdr = ["routing", "tokens", "hit", "read floor", "tc floor"] + [f"{n} us (x floor)" for n in names] + \
          [f"{n} rel L2" for n in names]
    rows = [hdr]
    for row in out["results"]:
        cells = [row["routing"], str(row["tokens"]), str(row["experts_hit"]), _fmt_us(row["read_floor_us"]),
                 _fmt_us(row["tc_floor_us"])]
        rels = []
        for n in names:
            r = row["impls"].get(n, {})
            if "median_us" in r:
                cells.append(f"{_fmt_us(r['median_us'])} ({r['x_floor']:.2f}x)")
            else:
                cells.append("error" if "error" in r else "-")
            rel = r.get("rel_l2_vs_ref")
            rels.append("-" if rel is None else f"{rel:.4f}")
        rows.append(cells + rels)
    widths = [max(len(r[i]) for r in rows) for i in range(len(hdr))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)


def plot(out: Dict[str, Any], path: str) -> None:
    """Time against tokens per implementation (log-log), one panel per routing, with the
    read floor, the tensor-core floor and their maximum: a roofline of the layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    routings = list(dict.fromkeys(r["routing"] for r in out["results"]))
    fig, axes = plt.subplots(1, len(routings), figsize=(6.5 * len(routings), 5), squeeze=False)
    for ax, routing in zip(axes[0], routings):
        rows = [r for r in out["results"] if r["routing"] == routing]
        T = [r["tokens"] for r in rows]
        ax.plot(T, [r["read_floor_us"] for r in rows], "--", color="0.45", label="read floor (weights hit / BW)")
        ax.plot(T, [r["tc_floor_us"] for r in rows], ":", color="0.45", label="tensor-core floor (FLOPs / rate)")
        ax.plot(T, [r["floor_us"] for r in rows], "-", color="0.8", lw=6, alpha=0.6, zorder=0, label="floor")
        names = list(dict.fromkeys(n for r in rows for n in r["impls"]))
        for n in names:
            pts = [(r["tokens"], r["impls"][n]) for r in rows if "median_us" in r["impls"].get(n, {})]
            if not pts:
                continue
            xs = [t for t, _ in pts]
            ys = [v["median_us"] for _, v in pts]
            lo = [v["median_us"] - v["p10_us"] for _, v in pts]
            hi = [v["p90_us"] - v["median_us"] for _, v in pts]
            ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", ms=4, capsize=2, label=n)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_ylabel("time (us, median; bars p10-p90)")
        ax.set_title(f"{out['preset']}, routing {routing}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"MoE layer on {out['card']} ({out['date']}, {(out['commit'] or 'no commit')[:12]})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python bench/python/bench_moe.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cuda or cpu (the CPU backend; default: cuda when torch sees one)")
    ap.add_argument("--preset", default=None,
                    help=f"layer shape: {', '.join(PRESETS)} (default glm-5 on cuda, tiny on cpu)")
    for k in ("hidden", "inter", "experts", "topk", "shared-experts"):
        ap.add_argument(f"--{k}", type=int, default=None, help="overrides the preset's value")
    ap.add_argument("--tokens", type=int, nargs="+", default=None,
                    help="token counts (default 1 8 64 256 1024 4096 on cuda, 4 on cpu)")
    ap.add_argument("--routing", nargs="+", default=["uniform"],
                    help="uniform | zipf:S (a Zipf-like hot set, e.g. zipf:1.2) | replay:FILE (.npy/.npz/.pt ids)")
    ap.add_argument("--impl", nargs="+", default=list(IMPLS), choices=list(IMPLS),
                    help="implementations to run (default: all; absent ones are reported)")
    ap.add_argument("--iters", type=int, default=None, help="timed calls (default 20 cuda, 3 cpu)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 3 cuda, 1 cpu)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-graph", dest="graph", action="store_false",
                    help="skip the CUDA-graph replay of megamoe")
    ap.add_argument("--no-check", dest="check", action="store_false",
                    help="skip the float32 reference (the rel L2 column)")
    ap.add_argument("--commit", default=None,
                    help="commit id recorded in the JSON (default: git rev-parse HEAD of this file's checkout)")
    ap.add_argument("--json", default=None, help="write the results here (commit, date, command, card, floors)")
    ap.add_argument("--plot", default=None, help="write the roofline PNG here (matplotlib)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    args.argv = argv
    if args.device not in ("cuda", "cpu") and not args.device.startswith("cuda:"):
        ap.error(f"--device: expected cuda, cuda:N or cpu, found {args.device!r}")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    out = run(args)
    print()
    print(table(out))
    bad = [f"{n} at T={r['tokens']} ({r['routing']}): {v['error']}" for r in out["results"]
           for n, v in r["impls"].items() if "error" in v]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        plot(out, args.plot)
        print(f"wrote {args.plot}")
    for b in bad:
        print(f"error: {b}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
