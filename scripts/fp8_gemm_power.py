#!/usr/bin/env python3
"""A dense FP8 GEMM through PyTorch (cuBLASLt) at the card's power cap: TFLOP/s, the SM clock
and the board power while it repeats for a few seconds, and the energy a FLOP. What the tensor
cores reach on this card in the best shape, beside the fused layer's `megamoe bench --energy`
figures (docs/performance.md, the power cap). Runs on the device machine's torch venv:
  /opt/torch/.venv/bin/python scripts/fp8_gemm_power.py [--seconds S] [MxNxK ...]
Scaling: 1x128 activation and 128x128 weight block scales where this torch's _scaled_mm takes
them (cuBLASLt's VEC128 / BLK128x128, the layer's format), else one scale a tensor (no folds)."""
import argparse
import statistics
import subprocess
import time

import torch


def scales(m, n, k, blockwise):
    if not blockwise:
        one = torch.ones((), device="cuda", dtype=torch.float32)
        return one, one
    # 1x128 over A's rows (outer-dim major, as cuBLASLt wants), 128x128 over B = W^T.
    sa = torch.rand(k // 128, m, device="cuda", dtype=torch.float32).add_(0.5).t()
    sb = torch.rand(n // 128, k // 128, device="cuda", dtype=torch.float32).add_(0.5).t()
    return sa, sb


def gemm_fn(m, n, k):
    a = (torch.randn(m, k, device="cuda") * 0.5).to(torch.float8_e4m3fn)
    w = (torch.randn(n, k, device="cuda") * 0.5).to(torch.float8_e4m3fn)
    for blockwise in (True, False):
        sa, sb = scales(m, n, k, blockwise)
        try:
            torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
            torch.cuda.synchronize()
        except (RuntimeError, ValueError) as e:  # this torch / cuBLASLt lacks the block scales
            print(f"  ({'block' if blockwise else 'tensor'} scales refused: {str(e).splitlines()[0][:120]})")
            continue
        return (lambda: torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)), (
            "1x128 / 128x128 block scales" if blockwise else "one scale a tensor")
    raise SystemExit("no FP8 _scaled_mm form ran")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("shapes", nargs="*", default=["8192x8192x8192", "4096x4096x6144", "16384x4096x6144"])
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for shape in args.shapes:
        m, n, k = (int(v) for v in shape.split("x"))
        fn, form = gemm_fn(m, n, k)
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        # Enough calls for --seconds at the warm rate; then timed under nvidia-smi's sampling.
        t0 = time.time()
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        calls = max(20, int(args.seconds / ((time.time() - t0) / 20)))
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                "-lms", "100"], stdout=subprocess.PIPE, text=True)
        time.sleep(0.3)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        smi.terminate()
        out, _ = smi.communicate()
        us = start.elapsed_time(end) * 1e3 / calls
        tflops = 2.0 * m * n * k / us / 1e6
        loaded = [(float(c), float(p)) for c, p in (r.split(",") for r in out.splitlines() if r.count(",") == 1)
                  if float(p) > 250]
        clock = statistics.median(c for c, _ in loaded) if loaded else float("nan")
        watts = statistics.median(p for _, p in loaded) if loaded else float("nan")
        print(f"{shape} ({form}): {us:.1f} us, {tflops:.0f} TFLOP/s, SM clock median {clock:.0f} MHz, "
              f"power median {watts:.0f} W, {watts / (tflops * 1e12) * 1e12:.2f} pJ a FLOP ({len(loaded)} samples)")


if __name__ == "__main__":
    main()
