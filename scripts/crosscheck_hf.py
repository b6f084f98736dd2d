#!/usr/bin/env python3
"""Cross-check `megamoe forward` against the Hugging Face transformers MoE blocks.

HOW TO RUN (torch, transformers and numpy; no network needed; the CPU backend needs
no GPU: the device machine has torch 2.11 and transformers 5.17, without deepseek_v4,
which is then skipped; transformers 5.25 has all six)
    cmake -S . -B build -G Ninja && cmake --build build -j      # or any existing build
    python3 scripts/crosscheck_hf.py --cli build/megamoe --workdir /tmp/x
  options: --tokens 64  --backends cpu,cuda (default: cpu, plus cuda when torch sees
  a GPU)  --families glm5_next,glm_moe_dsa,deepseek_v3,glm4_moe_lite,deepseek_v4,deepseek_v2
  --max-rel-l2 0.08
  Exit status: 0 all found families agree; 1 a mismatch; 2 set-up problem (torch or
  transformers missing, no family found, the CLI failed to write a checkpoint).

WHAT IT DOES, per family (model_type -> megamoe preset)
  glm5_next -> glm-5.3-flash, glm_moe_dsa -> glm-5, deepseek_v3 -> deepseek-v3
  (E=32, grouped 8/4), glm4_moe_lite -> glm-4.7-flash; and two blocks without a
  megamoe family (VARIANTS), each on a deepseek-v3 checkpoint whose config.json is
  edited to that block's routing, the block built from those values: deepseek_v4
  (sqrtsoftplus scores, no groups, the SwiGLU clamp at 10) and deepseek_v2 (softmax
  scores, plain top-k, no bias, no renormalization) -- the scores that are not sigmoid:
  1. `megamoe make-checkpoint` writes a small HF-layout block-FP8 checkpoint
     (H=256, I=384: multiples of 128 for the CUDA backend, and I != H, 2I != H so that no
     expert weight can be mistaken for its transpose; E=16 or 32, K=4), and a random BF16
     input x.
  2. The transformers MoE block (e.g. DeepseekV3MoE; class names discovered
     defensively, see FAMILIES) is built from the checkpoint's own config.json
     through AutoConfig (falling back to a config built from its values), with
     config._experts_implementation = "eager", in float64 (float32 if float64
     fails). Its parameters are set from the checkpoint: every block-FP8 weight
     dequantized (fp8 * 128x128 scale_inv) by tests/tools/moe_float64.py
     (numpy, independent of megamoe's C++), router weight and correction bias
     as stored. Every parameter and buffer of the block must be set.
  3. The block runs on x; its routing (top-k ids and weights) is captured from
     the router's output / the experts' input.
  4. `megamoe forward --backend cpu` (and cuda) runs the same layer; compared:
     ids (as sets per token: HF's topk is unsorted) exactly, routing weights
     (relative), y relative L2 vs HF (<= --max-rel-l2; FP8 activations explain
     a few 1e-2), and, as a check of the checker, HF vs the numpy float64
     reference of tests/tools/moe_float64.py (must agree to ~1e-6: HF's router
     is fp32) and the CLI vs moe_float64's FP8-activation emulation.
  A table is printed; any mismatch exits 1.
  5. Configs (the four families with a preset): transformers' own default config of the
     model (AutoConfig.for_model, serialized with every key, a block-FP8
     quantization_config added) goes through `megamoe inspect --json` beside an empty
     model.safetensors; the shape, routing and the MoE layer list it parses must be the
     config's attributes, the layer list derived here from mlp_layer_types or
     first_k_dense_replace / moe_layer_freq.

WHAT IT DOES NOT COVER
  Softmax or sqrtsoftplus with expert groups (the HF blocks that use them have none),
  the correction bias switch (HF always adds it; our presets use noaux_tc), real
  checkpoints (only synthetic weights), multi-rank CUDA (EP) runs.
"""
import argparse
import importlib
import inspect
import json
import os
import shutil
import subprocess
import sys
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "tools"))
import moe_float64 as f64  # noqa: E402  (numpy-only reference and safetensors reader)

# model_type, megamoe preset, module, candidate MoE class names, candidate config
# class names, experts, x std (glm5_next: large enough to hit the SwiGLU clamp).
FAMILIES = [
    ("glm5_next", "glm-5.3-flash", "glm5_next", ["Glm5NextTextMoE", "Glm5NextMoE"],
     ["Glm5NextTextConfig", "Glm5NextConfig"], 16, 4.0),
    ("glm_moe_dsa", "glm-5", "glm_moe_dsa", ["GlmMoeDsaMoE"], ["GlmMoeDsaConfig"], 16, 1.0),
    ("deepseek_v3", "deepseek-v3", "deepseek_v3", ["DeepseekV3MoE"], ["DeepseekV3Config"], 32, 1.0),
    ("glm4_moe_lite", "glm-4.7-flash", "glm4_moe_lite", ["Glm4MoeLiteMoE"], ["Glm4MoeLiteConfig"], 16, 1.0),
    ("deepseek_v4", "deepseek-v3", "deepseek_v4", ["DeepseekV4SparseMoeBlock"], ["DeepseekV4Config"], 32, 4.0),
    ("deepseek_v2", "deepseek-v3", "deepseek_v2", ["DeepseekV2Moe"], ["DeepseekV2Config"], 32, 1.0),
]
# Blocks without a megamoe family of their own: the preset's checkpoint with these
# config.json keys set, and the HF config built from the values (AutoConfig would read the
# checkpoint's own model_type). DeepSeek-V4's router and experts hard-code what the edits
# say: sqrtsoftplus scores, no expert groups, renormalized weights, the clamp always on; the
# block is built for a layer of plain top-k routing (not its first layers' hash routing).
# DeepSeek-V2's router: softmax scores (float32), plain top-k, no correction bias, no
# renormalization, then the scaling factor.
VARIANTS = {
    "deepseek_v4": dict(edits={"scoring_func": "sqrtsoftplus", "n_group": 1, "topk_group": 1,
                               "norm_topk_prob": True, "swiglu_limit": 10.0},
                        hf={"mlp_layer_types": ["moe"], "num_hidden_layers": 1}),
    "deepseek_v2": dict(edits={"scoring_func": "softmax", "topk_method": "greedy", "n_group": 1, "topk_group": 1,
                               "norm_topk_prob": False},
                        hf={"topk_method": "greedy"}),
}
H, I, K = 256, 384, 4


def run(cmd):
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout}")
    return r.stdout


def find_class(mod, names, suffixes, exclude=()):
    for n in names:
        if hasattr(mod, n):
            return getattr(mod, n)
    # Defensive discovery: a class whose name ends with one of the suffixes.
    for n in sorted(dir(mod)):
        if any(n.endswith(s) for s in suffixes) and not any(e in n for e in exclude):
            return getattr(mod, n)
    return None


def edit_config(ckdir, edits):
    """Set `edits` in the checkpoint's config.json (its text config for multimodal models)."""
    path = os.path.join(ckdir, "config.json")
    with open(path) as f:
        root = json.load(f)
    root.get("text_config", root).update(edits)
    with open(path, "w") as f:
        json.dump(root, f, indent=2)


def hf_config(torch, tfm, cfg_cls, ckdir, lc, notes, variant=None):
    """The HF config: AutoConfig on the checkpoint itself when possible (its
    text config for multimodal models), else one built from the values (always
    for a VARIANTS block, with its own keys added)."""
    want = dict(hidden_size=lc.hidden, moe_intermediate_size=lc.inter, n_routed_experts=lc.experts,
                num_experts_per_tok=lc.topk, n_shared_experts=lc.shared, n_group=lc.n_group,
                topk_group=lc.topk_group, norm_topk_prob=bool(lc.norm),
                routed_scaling_factor=float(lc.scaling), hidden_act="silu")
    if lc.swiglu_limit:
        want["swiglu_limit"] = float(lc.swiglu_limit)
    cfg = None
    if variant is not None:  # another family's checkpoint: AutoConfig would read that family
        want.update(variant["hf"])
    else:
        try:
            ac = tfm.AutoConfig.from_pretrained(ckdir, local_files_only=True)
            cfg = ac.get_text_config() if hasattr(ac, "get_text_config") else ac
            bad = []
            for k, v in want.items():
                if k == "hidden_act":
                    continue
                got = getattr(cfg, k, None)
                if got is None or (float(got) != float(v) if isinstance(v, (int, float)) else got != v):
                    bad.append(f"{k}={got!r} (want {v!r})")
            if bad:
                notes.append("AutoConfig read the checkpoint differently: " + ", ".join(bad))
                return None, "autoconfig-mismatch"
            src = f"AutoConfig({type(cfg).__name__})"
        except Exception as e:  # noqa: BLE001
            notes.append(f"AutoConfig failed ({type(e).__name__}: {str(e).splitlines()[0][:120]}); "
                         "built from values")
            cfg = None
    if cfg is None:
        try:
            cfg = cfg_cls(**want)
        except Exception:  # noqa: BLE001
            cfg = cfg_cls()
            for k, v in want.items():
                try:
                    setattr(cfg, k, v)
                except Exception as e:  # noqa: BLE001
                    notes.append(f"config: cannot set {k}: {e}")
        src = f"{cfg_cls.__name__}(values)"
    if not lc.swiglu_limit and getattr(cfg, "swiglu_limit", None):
        notes.append(f"HF config has swiglu_limit={cfg.swiglu_limit} but the checkpoint has none")
    try:
        cfg._experts_implementation = "eager"
    except Exception as e:  # noqa: BLE001
        notes.append(f"cannot set _experts_implementation: {e}")
    return cfg, src


def set_tensor(torch, module, name, value, used):
    """Copy a float64 numpy array into the parameter/buffer `name`, accepting
    the transposed layout of a 3-D fused expert weight."""
    obj = module
    parts = name.split(".")
    for p in parts[:-1]:
        obj = obj[int(p)] if p.isdigit() else getattr(obj, p)
    t = getattr(obj, parts[-1])
    v = torch.from_numpy(np.ascontiguousarray(value))
    if tuple(t.shape) != tuple(v.shape):
        if v.dim() == 3 and tuple(t.shape) == (v.shape[0], v.shape[2], v.shape[1]):
            v = v.transpose(1, 2)
        elif v.dim() == 2 and tuple(t.shape) == (v.shape[1], v.shape[0]):
            raise ValueError(f"{name}: shape {tuple(t.shape)} is the transpose of {tuple(v.shape)}; refusing to guess")
        else:
            raise ValueError(f"{name}: module shape {tuple(t.shape)}, checkpoint gives {tuple(v.shape)}")
    with torch.no_grad():
        t.copy_(v.to(t.dtype))
    used.add(name)


def load_weights(torch, moe, layer, lc):
    used = set()
    set_tensor(torch, moe, "gate.weight", layer.router, used)
    bias = layer.bias if layer.bias is not None else np.zeros(lc.experts)
    if hasattr(moe.gate, "e_score_correction_bias"):
        set_tensor(torch, moe, "gate.e_score_correction_bias", bias, used)
    elif hasattr(moe, "e_score_correction_bias"):
        set_tensor(torch, moe, "e_score_correction_bias", bias, used)
    ex = moe.experts
    if hasattr(ex, "gate_up_proj"):
        gu = np.stack([np.concatenate([g, u], axis=0) for g, u, _ in layer.experts])  # [E, 2I, H]
        dn = np.stack([d for _, _, d in layer.experts])  # [E, H, I]
        set_tensor(torch, moe, "experts.gate_up_proj", gu, used)
        set_tensor(torch, moe, "experts.down_proj", dn, used)
    else:  # older layout: a ModuleList of MLPs
        for e, (g, u, d) in enumerate(layer.experts):
            for n, w in (("gate_proj", g), ("up_proj", u), ("down_proj", d)):
                set_tensor(torch, moe, f"experts.{e}.{n}.weight", w, used)
    if layer.shared is not None:
        for n, w in zip(("gate_proj", "up_proj", "down_proj"), layer.shared):
            set_tensor(torch, moe, f"shared_experts.{n}.weight", w, used)
    names = set(dict(moe.named_parameters())) | {n for n, _ in moe.named_buffers()}
    missing = sorted(names - used)
    if missing:
        raise ValueError(f"parameters/buffers of the HF block not set from the checkpoint: {missing}")


def run_hf(torch, moe, x, dtype):
    """Run the block; return y [T,H] and the routing (ids, weights) it used."""
    cap = {}

    def gate_hook(_m, _inp, out):
        cap["gate"] = out

    def experts_pre(_m, args, kwargs):
        cap["experts"] = (args, kwargs)

    hooks = [moe.gate.register_forward_hook(gate_hook)]
    try:
        hooks.append(moe.experts.register_forward_pre_hook(experts_pre, with_kwargs=True))
    except TypeError:
        hooks.append(moe.experts.register_forward_pre_hook(lambda m, a: experts_pre(m, a, {})))
    try:
        with torch.no_grad():
            y = moe(torch.from_numpy(x).to(dtype)[None])
    finally:
        for h in hooks:
            h.remove()
    if isinstance(y, tuple):
        y = y[0]
    y = y.reshape(-1, x.shape[1]).double().numpy()
    T = x.shape[0]

    def pick(tensors):
        """The top-k ids (the integer [T, K] tensor) and weights (a float tensor
        of the same shape) among a module's inputs or outputs."""
        ts = [t for t in tensors if torch.is_tensor(t) and t.dim() == 2 and t.shape[0] == T]
        ids = next((t for t in ts if not t.is_floating_point()), None)
        if ids is None:
            return None, None
        w = next((t for t in ts if t.is_floating_point() and t.shape == ids.shape), None)
        return ids, w

    ids = w = None
    if "experts" in cap:
        args, kwargs = cap["experts"]
        ids, w = pick(list(args) + [kwargs.get("top_k_index"), kwargs.get("top_k_weights")])
    if ids is None and isinstance(cap.get("gate"), (tuple, list)):
        ids, w = pick(cap["gate"])
    if ids is None and hasattr(moe, "route_tokens_to_experts") and torch.is_tensor(cap.get("gate")):
        with torch.no_grad():
            ids, w = pick(moe.route_tokens_to_experts(cap["gate"]))
    if ids is None or w is None:
        raise RuntimeError("could not capture the HF block's top-k ids/weights")
    return y, ids.long().numpy(), w.double().numpy()


def check_hf_config(tfm, cli, workdir, mt, preset):
    """Problems found parsing transformers' default config of model_type mt (step 5)."""
    cfg = tfm.AutoConfig.for_model(mt)
    d = json.loads(cfg.to_json_string(use_diff=False))
    d["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": [128, 128]}
    ck = os.path.join(workdir, mt + "_hfconfig")
    shutil.rmtree(ck, ignore_errors=True)
    os.makedirs(ck)
    with open(os.path.join(ck, "config.json"), "w") as f:
        json.dump(d, f, indent=2)
    with open(os.path.join(ck, "model.safetensors"), "wb") as f:  # no tensors
        f.write((8).to_bytes(8, "little") + b"{}      ")
    got = json.loads(run([cli, "inspect", "--json", ck]))["model"]
    tc = getattr(cfg, "text_config", None) or cfg
    attr = lambda *names: next(getattr(tc, n) for n in names if getattr(tc, n, None) is not None)  # noqa: E731
    n = attr("num_hidden_layers")
    if getattr(tc, "mlp_layer_types", None) is not None:
        moe = [i for i, t in enumerate(tc.mlp_layer_types) if t == "sparse"]
    else:
        first, freq = attr("first_k_dense_replace"), getattr(tc, "moe_layer_freq", None) or 1
        moe = [i for i in range(first, n) if i % freq == 0]
    want = {"family": preset, "hidden": attr("hidden_size"), "inter": attr("moe_intermediate_size"),
            "experts": attr("n_routed_experts", "num_experts"),
            "topk": attr("num_experts_per_tok", "num_experts_per_token"),
            "shared_experts": attr("n_shared_experts"), "num_layers": n, "moe_layers": moe,
            # multi-token-prediction layers after the main ones, where the config has them
            "mtp_layers": list(range(n, n + (getattr(tc, "num_nextn_predict_layers", None) or 0)))}
    problems = [f"{k}: megamoe {got[k]} vs HF {v}" for k, v in want.items() if got[k] != v]
    r = got["routing"]
    if abs(r["routed_scaling"] - attr("routed_scaling_factor")) > 1e-6:
        problems.append(f"routed_scaling: megamoe {r['routed_scaling']} vs HF {attr('routed_scaling_factor')}")
    for k, hk in (("n_group", "n_group"), ("topk_group", "topk_group"), ("norm_topk_prob", "norm_topk_prob")):
        if getattr(tc, hk, None) is not None and r[k] != getattr(tc, hk):
            problems.append(f"{k}: megamoe {r[k]} vs HF {getattr(tc, hk)}")
    mtp = f", MTP {want['mtp_layers']}" if want["mtp_layers"] else ""
    return problems, f"{n} layers, {len(moe)} MoE{mtp}, H {want['hidden']} E {want['experts']} K {want['topk']}"


def sorted_routing(ids, w):
    o = np.argsort(ids, axis=1, kind="stable")
    return np.take_along_axis(ids, o, 1), np.take_along_axis(w, o, 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cli", required=True, help="path to the megamoe binary")
    ap.add_argument("--workdir", required=True, help="scratch directory (created; emptied per family)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--backends", default=None, help="comma list: cpu,cuda (default cpu + cuda if available)")
    ap.add_argument("--families", default=",".join(f[0] for f in FAMILIES))
    ap.add_argument("--max-rel-l2", type=float, default=0.08)
    ap.add_argument("--max-hf-vs-f64", type=float, default=1e-4,
                    help="HF float64 block vs the numpy float64 reference (router is fp32 in HF)")
    ap.add_argument("--max-weight-err", type=float, default=1e-4)
    a = ap.parse_args()

    try:
        import torch
        import transformers as tfm
    except ImportError as e:
        print(f"crosscheck_hf: needs torch and transformers: {e}", file=sys.stderr)
        return 2
    print(f"torch {torch.__version__}, transformers {tfm.__version__}, numpy {np.__version__}")
    cuda = torch.cuda.is_available()
    backends = a.backends.split(",") if a.backends else (["cpu", "cuda"] if cuda else ["cpu"])
    os.makedirs(a.workdir, exist_ok=True)
    torch.manual_seed(0)

    rows, found, failed = [], [], False
    for mt, preset, modname, moe_names, cfg_names, E, std in FAMILIES:
        if mt not in a.families.split(","):
            continue
        notes = []
        try:
            mod = importlib.import_module(f"transformers.models.{modname}.modeling_{modname}")
            cmod = importlib.import_module(f"transformers.models.{modname}.configuration_{modname}")
        except Exception as e:  # noqa: BLE001
            print(f"{mt}: not in this transformers ({type(e).__name__}: {e})")
            continue
        moe_cls = find_class(mod, moe_names, ("MoE", "Moe"), exclude=("Naive", "Experts", "PreTrained"))
        cfg_cls = find_class(cmod, cfg_names, ("TextConfig", "Config"), exclude=("Vision",))
        if moe_cls is None or cfg_cls is None:
            print(f"{mt}: module found but no MoE block / config class (have: "
                  f"{[n for n in dir(mod) if 'mo' in n.lower()]})")
            continue
        found.append(f"{mt}:{moe_cls.__name__}")
        d = os.path.join(a.workdir, mt)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        ck = os.path.join(d, "ckpt")
        try:
            run([a.cli, "make-checkpoint", "--preset", preset, "--layers", "1", "--out", ck, "--hidden", str(H),
                 "--inter", str(I), "--experts", str(E), "--topk", str(K)])
        except RuntimeError as e:
            print(f"{mt}: {e}", file=sys.stderr)
            return 2
        variant = VARIANTS.get(mt)
        if variant is not None:
            edit_config(ck, variant["edits"])
        lc = f64.LayerConfig(ck, 0)
        L = lc.moe_layers[0]
        lc.layer = L
        xfile = os.path.join(d, "x.safetensors")
        f64.main(["--write-input", xfile, "--tokens", str(a.tokens), "--hidden", str(H), "--seed", "11",
                  "--std", str(std)])
        x = f64.bf16_to_f64(f64.SafeTensors(xfile).raw("x")[1])
        layer = f64.Layer(f64.Checkpoint(ck), lc, L)

        # numpy float64 reference and its FP8-activation emulation
        ids_ref, w_ref, _ = f64.route(lc, layer, x)
        y_ref = f64.moe(lc, layer, x, ids_ref, w_ref, lc.swiglu_limit)
        y_emu = f64.moe(lc, layer, x, ids_ref, w_ref, lc.swiglu_limit, emulate=True)

        try:
            cfg, src = hf_config(torch, tfm, cfg_cls, ck, lc, notes, variant)
            if cfg is None:
                raise ValueError("; ".join(notes))
            y_hf = None
            for dtype in (torch.float64, torch.float32):
                try:
                    # (DeepseekV4SparseMoeBlock also takes its layer index)
                    takes_layer = "layer_idx" in inspect.signature(moe_cls.__init__).parameters
                    moe = (moe_cls(cfg, layer_idx=0) if takes_layer else moe_cls(cfg)).to(dtype).eval()
                    load_weights(torch, moe, layer, lc)
                    y_hf, ids_hf, w_hf = run_hf(torch, moe, x, dtype)
                    break
                except Exception as e:  # noqa: BLE001
                    if dtype == torch.float32:
                        raise
                    notes.append(f"float64 failed ({type(e).__name__}: {e}); float32")
            hf_dtype = "f64" if dtype == torch.float64 else "f32"
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            rows.append((mt, moe_cls.__name__, "-", "HF block failed", "", "", "", "", "", "FAIL"))
            print(f"{mt}: {e}", file=sys.stderr)
            failed = True
            continue

        ids_hf_s, w_hf_s = sorted_routing(ids_hf, w_hf)
        ids_ref_s, _ = sorted_routing(ids_ref, w_ref)
        ref_ids_bad = int(np.sum(np.any(ids_hf_s != ids_ref_s, axis=1)))
        hf_vs_f64 = f64.rel_l2(y_hf, y_ref)
        fam_fail = bool(ref_ids_bad) or not hf_vs_f64 <= (a.max_hf_vs_f64 if hf_dtype == "f64" else 1e-3)
        if fam_fail:
            notes.append(f"HF disagrees with the numpy reference: ids {ref_ids_bad} tokens, y rel {hf_vs_f64:.3g}")

        outs = {}
        for be in backends:
            out = os.path.join(d, f"y_{be}.safetensors")
            try:
                run([a.cli, "forward", "--checkpoint", ck, "--layer", str(L), "--input", xfile, "--output", out,
                     "--backend", be])
            except RuntimeError as e:
                rows.append((mt, moe_cls.__name__, be, "forward failed", "", "", "", "", "", "FAIL"))
                print(str(e), file=sys.stderr)
                failed = True
                continue
            o = f64.SafeTensors(out)
            y = o.f64("y")
            ids = o.raw("topk_ids")[1].astype(np.int64)
            w = o.f64("topk_weights")
            outs[be] = y
            ids_s, w_s = sorted_routing(ids, w)
            bad = np.any(ids_s != ids_hf_s, axis=1)
            nbad = int(bad.sum())
            ok = ~bad
            werr = float(np.max(np.abs(w_s[ok] - w_hf_s[ok]) / np.maximum(np.abs(w_hf_s[ok]), 1e-30))) if ok.any() else 0.0
            r = f64.rel_l2(y, y_hf)
            r_emu = f64.rel_l2(y, y_emu)
            ok_all = (nbad == 0 and werr <= a.max_weight_err and r <= a.max_rel_l2 and not fam_fail
                      and np.all(np.isfinite(y)))
            extra = ""
            if be != "cpu" and "cpu" in outs:
                extra = f" vs-cpu {f64.rel_l2(y, outs['cpu']):.2e}"
            rows.append((mt, moe_cls.__name__ + f" [{src}, {hf_dtype}]", be, f"{nbad}/{a.tokens}", f"{werr:.1e}",
                         f"{r:.4f}", f"{r_emu:.4f}", f"{hf_vs_f64:.1e}", extra.strip(), "ok" if ok_all else "FAIL"))
            failed |= not ok_all
        for n in notes:
            print(f"  {mt}: note: {n}")

    # Step 5: transformers' own default configs through our parser.
    for mt, preset, *_ in FAMILIES:
        if mt in VARIANTS or mt not in a.families.split(","):
            continue
        try:
            problems, what = check_hf_config(tfm, a.cli, a.workdir, mt, preset)
        except Exception as e:  # noqa: BLE001  (no such model_type in this transformers, or the CLI failed)
            print(f"config {mt}: not checked ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
            if isinstance(e, RuntimeError):
                failed = True
            continue
        print(f"config {mt}: transformers' default config -> megamoe inspect: {what}: "
              + ("agree" if not problems else "DIFFER: " + "; ".join(problems)))
        failed |= bool(problems)

    hdr = ("family", "HF block [config, dtype]", "backend", "ids differ", "w err", "relL2 vs HF",
           "vs FP8-emul", "HF vs f64", "other", "status")
    widths = [max(len(str(r[i])) for r in rows + [hdr]) for i in range(len(hdr))]
    print()
    for r in [hdr] + rows:
        print("  ".join(str(c).ljust(wd) for c, wd in zip(r, widths)))
    print(f"\nfound in transformers {tfm.__version__}: {', '.join(found) or 'none'}")
    if not found:
        return 2
    print("crosscheck_hf: " + ("FAILED" if failed else "all OK"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
