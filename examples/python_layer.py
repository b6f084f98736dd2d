#!/usr/bin/env python3
"""How an inference engine uses megamoe from Python, start to end, on one MoE layer:

  1. load: a Hugging Face block-FP8 checkpoint folder (MoELayer.from_checkpoint), or the
     tensors an engine already holds, in the checkpoint's names (MoELayer.from_tensors);
  2. forward on the layer's own router, and on the engine's routing (external routing);
  3. CUDA: one graph captured at the largest token count, replayed at fewer tokens (the
     count lives in device memory), then layer.check();
  4. reload in place (a trainer's new weights): addresses stay, the captured graph keeps
     working, the same weights give the same bytes.

    python examples/python_layer.py [CHECKPOINT_DIR [LAYER]] [--device cpu|cuda] [--tokens T]

Without a checkpoint the layer is made of random weights quantized to block FP8 here.
Runs on the CPU backend (numpy or torch) and on the GPU (torch). Exits 1 if a check fails.
"""
import argparse
import sys

import numpy as np

import megamoe

try:
    import torch
except ImportError:
    torch = None


def random_tensors(cfg, seed=0):
    """A layer's checkpoint tensors (relative names), block-FP8 like a real checkpoint."""
    rng = np.random.default_rng(seed)
    t = {}

    def quantized(name, rows, cols):
        q, s = megamoe.quantize_block_fp8((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32))
        t[name + ".weight"], t[name + ".weight_scale_inv"] = q, s

    for e in range(cfg.experts):
        quantized(f"mlp.experts.{e}.gate_proj", cfg.inter, cfg.hidden)
        quantized(f"mlp.experts.{e}.up_proj", cfg.inter, cfg.hidden)
        quantized(f"mlp.experts.{e}.down_proj", cfg.hidden, cfg.inter)
    if cfg.shared_experts:
        si = cfg.inter * cfg.shared_experts
        quantized("mlp.shared_experts.gate_proj", si, cfg.hidden)
        quantized("mlp.shared_experts.up_proj", si, cfg.hidden)
        quantized("mlp.shared_experts.down_proj", cfg.hidden, si)
    t["mlp.gate.weight"] = (rng.standard_normal((cfg.experts, cfg.hidden)) * 0.05).astype(np.float32)
    t["mlp.gate.e_score_correction_bias"] = (rng.standard_normal(cfg.experts) * 0.01).astype(np.float32)
    return t


def read_safetensors(path):
    """(name, numpy array) of a safetensors file: F8_E4M3 as uint8 codes, BF16 as uint16
    bits (both read by load_weights as the checkpoint's dtypes)."""
    import json
    import struct

    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    kinds = {"F8_E4M3": np.uint8, "BF16": np.uint16, "F32": np.float32, "F16": np.float16, "I64": np.int64}
    for name, d in header.items():
        if d["dtype"] in kinds:
            b, e = d["data_offsets"]
            yield name, np.frombuffer(raw, kinds[d["dtype"]], (e - b) // np.dtype(kinds[d["dtype"]]).itemsize,
                                      8 + n + b).reshape(d["shape"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", nargs="?")
    ap.add_argument("layer", nargs="?", type=int)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if megamoe.cuda_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=32)
    a = ap.parse_args()
    T = a.tokens
    if a.device == "cuda" and torch is None:
        sys.exit("--device cuda needs torch")
    ok = True

    def expect(cond, what):
        nonlocal ok
        print(f"  {what:<66} {'ok' if cond else 'FAILED'}")
        ok &= bool(cond)

    # 1. load
    tensors = None
    if a.checkpoint:
        cfg, moe_layers, _, family = megamoe.hf_config_info(a.checkpoint)
        index = a.layer if a.layer is not None else moe_layers[0]
        layer = megamoe.MoELayer.from_checkpoint(a.checkpoint, index, device=a.device, max_tokens=T)
        print(f"{a.checkpoint}: {family}, MoE layer {index}")
    else:
        cfg = megamoe.MoEConfig(hidden=512, inter=256, experts=16, topk=4, shared_experts=1,
                                routed_scaling=2.5, router_dtype="f32")
        tensors = random_tensors(cfg)
        layer = megamoe.MoELayer.from_tensors(cfg, tensors, device=a.device, max_tokens=T)
        print("random block-FP8 layer")
    c = layer.config
    print(f"H={c.hidden} I={c.inter} E={c.experts} top-{c.topk} shared={c.shared_experts} on {layer.device}")

    # 2. forward: the layer's router, then the engine's routing
    rng = np.random.default_rng(1)
    x_np = rng.standard_normal((T, c.hidden)).astype(np.float32)
    if torch is not None:
        x = torch.from_numpy(x_np).to(torch.bfloat16).to(layer.device)
        same = lambda p, q: torch.equal(p.view(torch.int16), q.view(torch.int16))  # noqa: E731
        sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    else:
        x = x_np  # numpy: float32 (or ml_dtypes.bfloat16) on the CPU backend
        same = lambda p, q: np.array_equal(p.view(np.uint32), q.view(np.uint32))  # noqa: E731
        sync = lambda: None  # noqa: E731
    y = layer(x)
    ids, weights = layer.topk_ids, layer.topk_weights
    ids = ids.clone() if torch is not None and isinstance(ids, torch.Tensor) else np.array(ids)
    weights = weights.clone() if torch is not None and isinstance(weights, torch.Tensor) else np.array(weights)
    print(f"  token 0 goes to experts {list(map(int, ids[0]))}")
    expect(same(layer(x, ids, weights), y), "external routing with the layer's own ids: the same bytes")

    # 3. CUDA graph: captured at T tokens, replayed at T/2 (the count read on the device)
    if a.device == "cuda":
        out = torch.empty_like(x)
        count = torch.tensor([T], dtype=torch.int32, device=layer.device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            layer(x, out=out, num_tokens=count)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            layer(x, out=out, num_tokens=count)
        half = T // 2
        y_half = layer(x[:half])
        count.fill_(half)
        graph.replay()
        sync()
        expect(same(out[:half], y_half), "graph captured at T, replayed at T/2: the eager bytes")
        layer.check()

    # 4. reload in place: a trainer's new weights (here: the same again, after zeroing)
    addr = layer.weights_address
    layer.zero_experts()
    if tensors is None:
        import json
        import os

        index_file = os.path.join(a.checkpoint, "model.safetensors.index.json")
        files = sorted(set(json.load(open(index_file))["weight_map"].values())) if os.path.exists(index_file) \
            else ["model.safetensors"]
        prefix_hint = f"layers.{layer.layer_index}.mlp."
        with layer.reloading(mode="layerwise"):
            for f in files:
                for n, t in read_safetensors(os.path.join(a.checkpoint, f)):
                    if prefix_hint in n and any(k in n for k in (".experts.", ".shared_experts.", ".gate.")):
                        layer.load_weights(n, t)
    else:
        with layer.reloading(mode="layerwise"):  # weight and scale may come in separate calls
            for n in reversed(list(tensors)):
                layer.load_weights(n, tensors[n])
    expect(layer.weights_address == addr, "reload in place: the weights' address is unchanged")
    if a.device == "cuda":
        out.fill_(float("nan"))
        count.fill_(T)
        graph.replay()
        sync()
        expect(same(out, y), "the captured graph after the reload: the same bytes")
        layer.check()
    else:
        expect(same(layer(x), y), "the forward after the reload: the same bytes")
    print("python_layer:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
