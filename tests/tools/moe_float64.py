#!/usr/bin/env python3
"""Independent float64 computation of one MoE layer straight from an HF-layout
block-FP8 checkpoint (docs/numerics.md §1, §2, §3, §6, §7), to check `megamoe forward`.

Only dependency: numpy. Nothing of megamoe is used: the safetensors parser, the
E4M3 decode table (built from the bit layout), the BF16 decode, the config
reading and the layer math are all written here from the spec.

Usage
  # a random BF16 input x [T, H]
  moe_float64.py --write-input X.safetensors --tokens 64 --hidden 256 --seed 1 [--std 1.0]
  #   or --checkpoint DIR instead of --hidden: H from its config, and a line
  #   `first_moe_layer=L` (the checkpoint's first MoE layer) for scripts
  # compare a `megamoe forward` output against float64
  moe_float64.py --checkpoint DIR --layer L --input X.safetensors --compare OUT.safetensors \
      [--max-rel-l2 0.08] [--max-rel-l2-emulated 0.02] [--inter-group 128]

The comparison checks, and exits 1 if any fails:
  - topk_ids: exactly equal to the float64 routing (same experts, same order:
    descending selection score, ties to the lower id); mismatches are listed
    with the float64 score gap that separates the two choices;
  - topk_weights: relative error <= --max-weight-err (float32 routing math);
  - y: relative L2 against the exact float64 layer (activations unquantized)
    <= --max-rel-l2;
  - --same-bytes OUT2 ...: the tensors of other outputs (e.g. --ranks 2, 4)
    equal --compare's byte for byte;
  - y: relative L2 against the same float64 layer with the activations
    quantized to E4M3 as docs/numerics.md §4 describes (x per 1x128, the SwiGLU output
    times the routing weight per 1x--inter-group) <= --max-rel-l2-emulated.
    This second figure shows that the first is what FP8 activations explain:
    what is left is BF16 output rounding and accumulation order.
One line of figures is printed (plus details on failure).
"""
import argparse
import json
import math
import os
import struct
import sys

import numpy as np

# ----------------------------------------------------------------- numbers


def e4m3_table():
    """256-entry float64 decode table of float8_e4m3fn from the bit layout:
    1 sign, 4 exponent bits (bias 7), 3 mantissa bits; S.1111.111 is NaN; no
    infinities; exponent 0 is subnormal (m/8 * 2^-6)."""
    t = np.empty(256, dtype=np.float64)
    for b in range(256):
        s = -1.0 if b & 0x80 else 1.0
        e = (b >> 3) & 0xF
        m = b & 0x7
        if e == 0xF and m == 0x7:
            t[b] = math.nan
        elif e == 0:
            t[b] = s * (m / 8.0) * 2.0 ** -6
        else:
            t[b] = s * (1.0 + m / 8.0) * 2.0 ** (e - 7)
    return t


E4M3 = e4m3_table()
E4M3_MAX = 448.0
# Non-negative finite codes sorted by value (0x00..0x7E are increasing).
_POS_CODES = np.arange(0x7F)
_POS_VALS = E4M3[_POS_CODES]
assert np.all(np.diff(_POS_VALS) > 0) and _POS_VALS[-1] == E4M3_MAX


def e4m3_round(v):
    """Round float64 values to the nearest E4M3 value (ties to the even
    mantissa, i.e. the even code), saturating to +-448. Returns float64."""
    v = np.asarray(v, dtype=np.float64)
    a = np.minimum(np.abs(v), E4M3_MAX)
    hi = np.searchsorted(_POS_VALS, a, side="left")  # first value >= a
    hi = np.clip(hi, 0, len(_POS_VALS) - 1)
    lo = np.clip(hi - 1, 0, len(_POS_VALS) - 1)
    vh, vl = _POS_VALS[hi], _POS_VALS[lo]
    dh, dl = vh - a, a - vl
    pick_hi = (dh < dl) | ((dh == dl) & (_POS_CODES[hi] % 2 == 0))
    r = np.where(pick_hi, vh, vl)
    r = np.where(a == vh, vh, r)
    return np.copysign(r, v)


def bf16_to_f64(u16):
    return (np.asarray(u16, dtype=np.uint32) << 16).view(np.float32).astype(np.float64)


def f64_to_bf16_bits(v):
    """Round to nearest even BF16 (finite inputs)."""
    f = np.asarray(v, dtype=np.float32)
    u = f.view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


# ------------------------------------------------------------- safetensors

_DT = {
    "F64": (np.dtype("<f8"), 8), "F32": (np.dtype("<f4"), 4), "F16": (np.dtype("<f2"), 2),
    "BF16": (np.dtype("<u2"), 2), "I64": (np.dtype("<i8"), 8), "I32": (np.dtype("<i4"), 4),
    "I16": (np.dtype("<i2"), 2), "I8": (np.dtype("i1"), 1), "U8": (np.dtype("u1"), 1),
    "F8_E4M3": (np.dtype("u1"), 1), "F8_E8M0": (np.dtype("u1"), 1), "BOOL": (np.dtype("u1"), 1),
}


class SafeTensors:
    """A safetensors file read with numpy; every header field is checked."""

    def __init__(self, path):
        self.path = path
        with open(path, "rb") as f:
            blob = f.read()
        if len(blob) < 8:
            raise ValueError(f"{path}: shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", blob[:8])
        if n > len(blob) - 8 or n > 100 << 20:
            raise ValueError(f"{path}: header length {n} out of bounds")
        hdr = json.loads(blob[8:8 + n].decode("utf-8"))
        if not isinstance(hdr, dict):
            raise ValueError(f"{path}: header is not a JSON object")
        self.meta = hdr.pop("__metadata__", {}) or {}
        self.data = memoryview(blob)[8 + n:]
        self.info = {}
        spans = []
        for name, d in hdr.items():
            dt, sh, off = d["dtype"], d["shape"], d["data_offsets"]
            if dt not in _DT:
                raise ValueError(f"{path}: {name}: unsupported dtype {dt}")
            b, e = int(off[0]), int(off[1])
            nel = 1
            for s in sh:
                if int(s) < 0:
                    raise ValueError(f"{path}: {name}: negative dim")
                nel *= int(s)
            if not (0 <= b <= e <= len(self.data)) or e - b != nel * _DT[dt][1]:
                raise ValueError(f"{path}: {name}: offsets {off} do not fit {dt} {sh}")
            spans.append((b, e, name))
            self.info[name] = (dt, [int(s) for s in sh], b, e)
        spans.sort()
        for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
            if b1 < e0:
                raise ValueError(f"{path}: tensors {n0} and {n1} overlap")

    def raw(self, name):
        dt, sh, b, e = self.info[name]
        return dt, np.frombuffer(self.data[b:e], dtype=_DT[dt][0]).reshape(sh)

    def f64(self, name):
        dt, a = self.raw(name)
        if dt == "BF16":
            return bf16_to_f64(a)
        if dt == "F8_E4M3":
            return E4M3[a]
        if dt == "F8_E8M0":
            return np.where(a == 255, np.nan, np.ldexp(1.0, a.astype(np.int64) - 127))
        return a.astype(np.float64)


def write_safetensors(path, tensors, meta=None):
    """tensors: list of (name, dtype string, ndarray with the raw bytes)."""
    hdr, off, parts = {}, 0, []
    if meta:
        hdr["__metadata__"] = meta
    for name, dt, a in tensors:
        b = np.ascontiguousarray(a).tobytes()
        hdr[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        off += len(b)
        parts.append(b)
    h = json.dumps(hdr, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(parts))


class Checkpoint:
    def __init__(self, d):
        self.dir = d
        idx = os.path.join(d, "model.safetensors.index.json")
        self.files = {}
        if os.path.exists(idx):
            with open(idx) as f:
                self.weight_map = json.load(f)["weight_map"]
        else:
            single = os.path.join(d, "model.safetensors")
            self.weight_map = {n: "model.safetensors" for n in self._file(single).info}

    def _file(self, path):
        if path not in self.files:
            self.files[path] = SafeTensors(path)
        return self.files[path]

    def has(self, name):
        return name in self.weight_map

    def get(self, name):
        if name not in self.weight_map:
            raise KeyError(f"{self.dir}: tensor {name} not in the checkpoint")
        st = self._file(os.path.join(self.dir, self.weight_map[name]))
        return st.f64(name), st.info[name][0]


# ------------------------------------------------------------------ config


def first(d, keys, default=None):
    for k in keys:
        if k in d and d[k] is not None:
            return d[k]
    return default


class LayerConfig:
    def __init__(self, path, layer):
        with open(os.path.join(path, "config.json")) as f:
            root = json.load(f)
        self.model_type = root.get("model_type", "?")
        c = root
        tc = root.get("text_config")
        if isinstance(tc, dict) and ("hidden_size" in tc or "mlp_layer_types" in tc):
            c = tc  # glm5_next: the language model's keys sit under text_config
        self.hidden = int(first(c, ["hidden_size"]))
        self.inter = int(first(c, ["moe_intermediate_size"]))
        self.experts = int(first(c, ["n_routed_experts", "num_experts", "num_local_experts"]))
        self.topk = int(first(c, ["num_experts_per_tok", "num_experts_per_token", "moe_topk"]))
        self.shared = int(first(c, ["n_shared_experts", "num_shared_experts"], 0))
        self.n_group = int(first(c, ["n_group", "num_expert_group"], 1))
        self.topk_group = int(first(c, ["topk_group", "num_topk_group"], 1))
        self.norm = bool(first(c, ["norm_topk_prob", "moe_renormalize"], True))
        self.scaling = float(first(c, ["routed_scaling_factor"], 1.0))
        sf = str(first(c, ["scoring_func"], "sigmoid")).lower().replace("_", "")
        if sf not in ("sigmoid", "softmax", "sqrtsoftplus"):
            raise ValueError(f"unknown scoring_func {sf}")
        self.score = sf
        lim = first(c, ["swiglu_limit"], None)
        self.swiglu_limit = float(lim) if lim else 0.0
        # The correction bias is used when the checkpoint has it, unless the
        # config names a top-k method other than noaux_tc.
        tm = first(c, ["topk_method"], None)
        self.use_bias = tm is None or tm == "noaux_tc"
        self.num_layers = int(first(c, ["num_hidden_layers"], 0))
        types = c.get("mlp_layer_types")
        if types is not None:
            self.moe_layers = [i for i, t in enumerate(types) if t == "sparse"]
        else:
            k = int(first(c, ["first_k_dense_replace"], 0))
            freq = int(first(c, ["moe_layer_freq"], 1))
            self.moe_layers = [i for i in range(k, self.num_layers) if i % freq == 0]
        self.layer = layer

    def summary(self):
        return (f"{self.model_type}: H={self.hidden} I={self.inter} E={self.experts} K={self.topk} "
                f"S={self.shared} groups={self.n_group}/{self.topk_group} score={self.score} "
                f"norm={self.norm} scale={self.scaling:g} clamp={self.swiglu_limit:g} "
                f"bias={'yes' if self.use_bias else 'no'}")


# ----------------------------------------------------------------- weights


def dequant(ck, name):
    """Block-FP8 weight -> float64: real[r][c] = fp8(q[r][c]) * s[r/128][c/128]."""
    w, dt = ck.get(name + ".weight")
    if dt not in ("F8_E4M3",):
        return w  # unquantized (e.g. modules_to_not_convert)
    s, _ = ck.get(name + ".weight_scale_inv")
    R, C = w.shape
    br, bc = -(-R // 128), -(-C // 128)
    if s.shape != (br, bc):
        raise ValueError(f"{name}: scale shape {s.shape}, expected {(br, bc)}")
    full = np.repeat(np.repeat(s, 128, axis=0), 128, axis=1)[:R, :C]
    if not np.all(np.isfinite(w)):
        raise ValueError(f"{name}: NaN codes")
    return w * full


class Layer:
    def __init__(self, ck, cfg, L):
        pref = None
        for p in (f"model.language_model.layers.{L}.mlp.", f"model.layers.{L}.mlp.",
                  f"language_model.model.layers.{L}.mlp."):
            if ck.has(p + "gate.weight"):
                pref = p
                break
        if pref is None:
            raise ValueError(f"layer {L}: no router tensor (not an MoE layer?)")
        self.prefix = pref
        self.router, self.router_dtype = ck.get(pref + "gate.weight")
        bname = pref + "gate.e_score_correction_bias"
        self.bias = ck.get(bname)[0] if ck.has(bname) and cfg.use_bias else None
        E, H = self.router.shape
        if E != cfg.experts or H != cfg.hidden:
            raise ValueError(f"router shape {self.router.shape} vs config E={cfg.experts} H={cfg.hidden}")
        self.experts = []
        for e in range(E):
            b = f"{pref}experts.{e}."
            self.experts.append(tuple(dequant(ck, b + n) for n in ("gate_proj", "up_proj", "down_proj")))
        b = pref + "shared_experts."
        self.shared = (tuple(dequant(ck, b + n) for n in ("gate_proj", "up_proj", "down_proj"))
                       if ck.has(b + "gate_proj.weight") else None)


# ----------------------------------------------------------------- compute


def route(cfg, layer, x, grouped=True):
    """docs/numerics.md §6 in float64. Returns ids [T,K] (descending selection score, ties
    to the lower id), weights [T,K], the selection scores c [T,E] and the
    allowed mask [T,E] (for tie diagnostics)."""
    z = x @ layer.router.T
    if cfg.score == "sigmoid":
        sc = 1.0 / (1.0 + np.exp(-z))
    elif cfg.score == "softmax":
        e = np.exp(z - z.max(axis=1, keepdims=True))
        sc = e / e.sum(axis=1, keepdims=True)
    else:
        sc = np.sqrt(np.logaddexp(0.0, z))
    c = sc + layer.bias[None, :] if layer.bias is not None else sc.copy()
    T, E = c.shape
    K, G = cfg.topk, cfg.n_group
    allowed = np.ones((T, E), dtype=bool)
    if G > 1 and grouped:
        per = E // G
        cg = c.reshape(T, G, per)
        top2 = -np.sort(-cg, axis=2)[:, :, :2].sum(axis=2)  # [T, G]
        gorder = np.argsort(-top2, axis=1, kind="stable")[:, :cfg.topk_group]
        gmask = np.zeros((T, G), dtype=bool)
        np.put_along_axis(gmask, gorder, True, axis=1)
        allowed = np.repeat(gmask, per, axis=1)
    cm = np.where(allowed, c, -np.inf)
    ids = np.argsort(-cm, axis=1, kind="stable")[:, :K]
    w = np.take_along_axis(sc, ids, axis=1)
    if cfg.norm:
        w = w / (w.sum(axis=1, keepdims=True) + 1e-20)
    w = w * cfg.scaling
    return ids.astype(np.int64), w, cm


def act_quant(a, group):
    """docs/numerics.md §4 per token, per `group` columns: s = max(amax, 1e-4)/448 (float32),
    q = e4m3(a * (1/s)); returns the dequantized values q*s in float64."""
    T, N = a.shape
    out = np.empty_like(a)
    for g0 in range(0, N, group):
        blk = a[:, g0:g0 + group].astype(np.float32)
        amax = np.max(np.abs(blk), axis=1, keepdims=True)
        s = (np.maximum(amax, np.float32(1e-4)) / np.float32(448.0)).astype(np.float32)
        inv = (np.float32(1.0) / s).astype(np.float32)
        q = e4m3_round((blk * inv).astype(np.float32).astype(np.float64))
        out[:, g0:g0 + group] = q * s.astype(np.float64)
    return out


def mlp(x, w, limit, rw=None, inter_group=0):
    """SwiGLU expert in float64; rw = per-row routing weight, applied to the
    SwiGLU output (before the second GEMM). inter_group > 0 quantizes that
    output like the kernel does (emulation mode)."""
    wg, wu, wd = w
    g = x @ wg.T
    u = x @ wu.T
    if limit:
        g = np.minimum(g, limit)
        u = np.clip(u, -limit, limit)
    a = g / (1.0 + np.exp(-g)) * u
    if rw is not None:
        a = a * rw[:, None]
    if inter_group:
        a = act_quant(a, inter_group)
    return a @ wd.T


def moe(cfg, layer, x, ids, w, limit, emulate=False, inter_group=128):
    xin = act_quant(x, 128) if emulate else x
    ig = inter_group if emulate else 0
    T, H = x.shape
    y = np.zeros((T, H))
    for e in range(cfg.experts):
        rows, slots = np.nonzero(ids == e)
        if len(rows):
            y[rows] += mlp(xin[rows], layer.experts[e], limit, w[rows, slots], ig)
    if layer.shared is not None:
        y += mlp(xin, layer.shared, limit, None, ig)
    return y


def rel_l2(a, b):
    d = np.linalg.norm(a - b)
    n = np.linalg.norm(b)
    return d / n if n > 0 else (0.0 if d == 0 else math.inf)


# --------------------------------------------------------------------- CLI


def write_input(a):
    if a.checkpoint:
        cfg = LayerConfig(a.checkpoint, 0)
        if a.hidden and a.hidden != cfg.hidden:
            raise ValueError(f"--hidden {a.hidden} but the checkpoint has H={cfg.hidden}")
        a.hidden = cfg.hidden
        # machine-readable, for scripts: the first MoE layer of the checkpoint
        print(f"first_moe_layer={cfg.moe_layers[0] if cfg.moe_layers else -1}")
    rng = np.random.default_rng(a.seed)
    x = rng.standard_normal((a.tokens, a.hidden)) * a.std
    write_safetensors(a.write_input, [("x", "BF16", f64_to_bf16_bits(x))], {"format": "pt"})
    print(f"wrote {a.write_input}: x BF16 [{a.tokens}, {a.hidden}] std {a.std:g} seed {a.seed}")
    return 0


def compare(a):
    cfg = LayerConfig(a.checkpoint, a.layer)
    if cfg.layer not in cfg.moe_layers:
        print(f"warning: config lists MoE layers {cfg.moe_layers}; layer {a.layer} is not one", file=sys.stderr)
    ck = Checkpoint(a.checkpoint)
    layer = Layer(ck, cfg, a.layer)
    xin = SafeTensors(a.input)
    dt, xr = xin.raw("x")
    if dt != "BF16" or xr.ndim != 2 or xr.shape[1] != cfg.hidden:
        raise ValueError(f"{a.input}: x must be BF16 [T, {cfg.hidden}], found {dt} {list(xr.shape)}")
    x = bf16_to_f64(xr)
    out = SafeTensors(a.compare)
    T, K = x.shape[0], cfg.topk
    for n, want in (("y", ("BF16", [T, cfg.hidden])), ("topk_ids", ("I32", [T, K])),
                    ("topk_weights", ("F32", [T, K]))):
        if n not in out.info or (out.info[n][0], out.info[n][1]) != want:
            got = (out.info[n][0], out.info[n][1]) if n in out.info else "missing"
            raise ValueError(f"{a.compare}: {n} must be {want[0]} {want[1]}, found {got}")
    y_cli = out.f64("y")
    ids_cli = out.raw("topk_ids")[1].astype(np.int64)
    w_cli = out.f64("topk_weights")

    ids, w, cm = route(cfg, layer, x)
    limit = cfg.swiglu_limit
    y = moe(cfg, layer, x, ids, w, limit)
    y_emu = moe(cfg, layer, x, ids, w, limit, emulate=True, inter_group=a.inter_group)

    fails = []
    nsame = 0
    for other in a.same_bytes or []:
        o = SafeTensors(other)
        diff = []
        for n in ("y", "topk_ids", "topk_weights"):
            if n not in o.info:
                diff.append(f"{n} missing")
                continue
            (d0, r0), (d1, r1) = out.raw(n), o.raw(n)
            if d0 != d1 or r0.shape != r1.shape or r0.tobytes() != r1.tobytes():
                cnt = int(np.sum(r0 != r1)) if r0.shape == r1.shape else -1
                diff.append(f"{n} ({cnt} elements)")
        nsame += not diff
        if diff:
            fails.append(f"{other} differs from {a.compare}: {', '.join(diff)}")
    bad = np.nonzero(np.any(ids != ids_cli, axis=1))[0]
    set_bad = [t for t in bad if set(ids[t]) != set(ids_cli[t])]
    for t in bad[:10]:
        # the float64 score gap between what we chose and what the CLI chose
        gaps = [cm[t, i] - cm[t, j] for i, j in zip(ids[t], ids_cli[t])
                if i != j and 0 <= j < cfg.experts]
        print(f"  token {t}: float64 ids {ids[t].tolist()} cli {ids_cli[t].tolist()} "
              f"score gaps {[f'{g:.3g}' for g in gaps]}", file=sys.stderr)
    if len(bad):
        fails.append(f"{len(bad)} tokens with different ids ({len(set_bad)} different sets)")
    same = ~np.any(ids != ids_cli, axis=1)
    werr = float(np.max(np.abs(w_cli[same] - w[same]) / np.maximum(np.abs(w[same]), 1e-30))) if same.any() else 0.0
    if not werr <= a.max_weight_err:
        fails.append(f"weights rel err {werr:.3g} > {a.max_weight_err:g}")
    if not np.all(np.isfinite(y_cli)):
        fails.append("y has non-finite values")
    r = rel_l2(y_cli, y)
    r_emu = rel_l2(y_cli, y_emu)
    if not r <= a.max_rel_l2:
        fails.append(f"y rel L2 {r:.4g} > {a.max_rel_l2:g}")
    if not r_emu <= a.max_rel_l2_emulated:
        fails.append(f"y rel L2 vs FP8-activation emulation {r_emu:.4g} > {a.max_rel_l2_emulated:g}")

    # Sensitivity figures: how far the float64 answer moves without the clamp,
    # and the size of the FP8-activation effect itself.
    extra = ""
    if limit:
        gmax = 0.0
        clamped = 0
        total = 0
        for e in range(cfg.experts):
            rows = np.nonzero(np.any(ids == e, axis=1))[0]
            if len(rows):
                g = x[rows] @ layer.experts[e][0].T
                u = x[rows] @ layer.experts[e][1].T
                clamped += int(np.sum(g > limit) + np.sum(np.abs(u) > limit))
                total += 2 * g.size
                gmax = max(gmax, float(np.max(np.abs(g))))
        y_nc = moe(cfg, layer, x, ids, w, 0.0)
        extra = f" clamp: {clamped}/{total} routed gate/up values clamped, no-clamp moves y by rel {rel_l2(y_nc, y):.3g};"
    if cfg.n_group > 1:
        ids_ng = route(cfg, layer, x, grouped=False)[0]
        extra += f" grouping changes the ids of {int(np.sum(np.any(ids_ng != ids, axis=1)))}/{T} tokens;"
    if layer.bias is not None:
        bias, layer.bias = layer.bias, None
        ids_nb = route(cfg, layer, x)[0]
        layer.bias = bias
        extra += f" bias changes the ids of {int(np.sum(np.any(ids_nb != ids, axis=1)))}/{T} tokens;"
    bytes_note = f"{nsame}/{len(a.same_bytes)} other outputs byte-identical; " if a.same_bytes else ""
    print(f"layer {a.layer} {cfg.summary()} T={T}: {bytes_note}ids {T - len(bad)}/{T} tokens identical; "
          f"weights max rel err {werr:.2e}; y rel L2 vs float64 {r:.4f} (max {a.max_rel_l2:g}), "
          f"vs FP8-act emulation {r_emu:.4f} (max {a.max_rel_l2_emulated:g}), "
          f"FP8 acts alone {rel_l2(y_emu, y):.4f};{extra} {'OK' if not fails else 'FAILED: ' + '; '.join(fails)}")
    return 1 if fails else 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write-input", metavar="X.safetensors")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--hidden", type=int)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--std", type=float, default=1.0, help="standard deviation of x")
    p.add_argument("--checkpoint")
    p.add_argument("--layer", type=int)
    p.add_argument("--input")
    p.add_argument("--compare", metavar="OUT.safetensors")
    p.add_argument("--same-bytes", nargs="*", metavar="OUT2.safetensors",
                   help="other forward outputs whose tensors must equal --compare's byte for byte")
    p.add_argument("--max-rel-l2", type=float, default=0.08)
    p.add_argument("--max-rel-l2-emulated", type=float, default=0.02,
                   help="bound vs the float64 layer with E4M3-quantized activations")
    p.add_argument("--max-weight-err", type=float, default=1e-4, help="routing weights, relative")
    p.add_argument("--inter-group", type=int, default=128,
                   help="columns per scale of the SwiGLU output quantization (emulation only; the "
                   "kernel's num::kInterGroup)")
    a = p.parse_args(argv)
    if a.write_input:
        if not (a.hidden or a.checkpoint) or a.tokens < 0:
            p.error("--write-input needs --hidden (or --checkpoint) and --tokens >= 0")
        try:
            return write_input(a)
        except (ValueError, KeyError, OSError) as e:
            print(f"moe_float64: error: {e}", file=sys.stderr)
            return 1
    if not (a.checkpoint and a.layer is not None and a.input and a.compare):
        p.error("need --checkpoint, --layer, --input and --compare (or --write-input)")
    try:
        return compare(a)
    except (ValueError, KeyError, OSError) as e:
        print(f"moe_float64: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
