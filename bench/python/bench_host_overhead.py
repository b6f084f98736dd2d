"""Host overhead of one eager call of a CUDA MoELayer (what the direct call adds on top of
the kernels; the torch op's figure beside it). Run from a source checkout, the package
installed; not part of the package.

    python bench/python/bench_host_overhead.py [--tokens 1 64] [--iters 300] [--json out.json]

Per token count, on random block-FP8 weights of a small layer:
  device_us     the forward's device time: N forwards captured in one CUDA graph and
                replayed (no host work at all), per forward;
  host_*_us     the host time to enqueue one call (N calls back to back without a sync,
                wall time / N) through: the extension directly (`raw`), MoELayer.__call__
                (`layer`: nn.Module, the DLPack views, the stream lookup), the custom op
                torch.ops.megamoe.moe_forward (`op`: the torch.library dispatcher);
  eager_*_us    wall time per call with the queue kept full, minus device_us: what
                eager calls cost on top of the kernels (0 when the host outruns the GPU).
"""
from __future__ import annotations

import argparse
import json
import time

from megamoe import MoEConfig, MoELayer, quantize_block_fp8


def random_layer(cfg: MoEConfig, max_tokens: int, device: str = "cuda") -> MoELayer:
    """A layer of random block-FP8 weights (quantized from N(0, 0.05) on the device)."""
    import torch

    g = torch.Generator(device=device).manual_seed(1)
    E, H, I, Is = cfg.experts, cfg.hidden, cfg.inter, cfg.inter * cfg.shared_experts

    def q(*shape):
        return quantize_block_fp8(torch.randn(*shape, generator=g, device=device) * 0.05)

    w13, s13 = q(E, 2 * I, H)
    w2, s2 = q(E, H, I)
    kw = dict(
        w13=w13, w13_scale=s13, w2=w2, w2_scale=s2,
        router=(torch.randn(E, H, generator=g, device=device) * 0.05).to(torch.bfloat16),
        bias=torch.randn(E, generator=g, device=device) * 0.01 if cfg.correction_bias else None,
    )
    if cfg.shared_experts:
        kw["shared_w13"], kw["shared_w13_scale"] = q(2 * Is, H)
        kw["shared_w2"], kw["shared_w2_scale"] = q(H, Is)
    return MoELayer.from_stacked(cfg, **kw, device=device, max_tokens=max_tokens)


def measure(layer: MoELayer, tokens: int, iters: int = 300) -> dict:
    """The figures of the module doc for one layer at `tokens` tokens."""
    import torch

    H = layer.config.hidden
    x = torch.randn(tokens, H, device=layer.device).to(torch.bfloat16)
    y = torch.empty_like(x)
    stream = torch.cuda.current_stream()
    raw = layer._impl.forward_raw
    dev = layer._device_index
    get_stream = torch._C._cuda_getCurrentRawStream
    handle = layer._handle

    calls = {
        "raw": lambda: raw(x.data_ptr(), y.data_ptr(), tokens, 0, 4, 0, 0, get_stream(dev)),
        "layer": lambda: layer(x, out=y),
        "op": lambda: torch.ops.megamoe.moe_forward(handle, x, None, None, None),
    }
    for f in calls.values():  # warm up every path
        for _ in range(3):
            f()
    torch.cuda.synchronize()

    # device time: a graph of `n` forwards
    n = 20
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(stream)
    with torch.cuda.stream(side):
        layer(x, out=y)
    stream.wait_stream(side)
    with torch.cuda.graph(graph):
        for _ in range(n):
            layer(x, out=y)
    graph.replay()
    torch.cuda.synchronize()
    reps = max(3, iters // n)
    t0 = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize()
    device_us = (time.perf_counter() - t0) / (reps * n) * 1e6

    out = {"tokens": tokens, "device_us": device_us}
    for name, f in calls.items():
        # enqueue-only host time: short bursts so the launch queue never fills
        best = float("inf")
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(50):
                f()
            best = min(best, (time.perf_counter() - t0) / 50 * 1e6)
        torch.cuda.synchronize()
        out[f"host_{name}_us"] = best
        t0 = time.perf_counter()
        for _ in range(iters):
            f()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / iters * 1e6
        out[f"eager_{name}_us"] = max(0.0, wall - device_us)
    layer.check()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python bench/python/bench_host_overhead.py",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    cfg = MoEConfig(hidden=a.hidden, inter=a.inter, experts=a.experts, topk=a.topk, shared_experts=1)
    layer = random_layer(cfg, max(a.tokens))
    rows = [measure(layer, t, a.iters) for t in a.tokens]
    keys = ["tokens", "device_us", "host_raw_us", "host_layer_us", "host_op_us",
            "eager_raw_us", "eager_layer_us", "eager_op_us"]
    print(" ".join(f"{k:>14}" for k in keys))
    for r in rows:
        print(" ".join(f"{r[k]:>14.2f}" if isinstance(r[k], float) else f"{r[k]:>14}" for k in keys))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": cfg.__dict__, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
