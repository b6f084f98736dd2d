#!/usr/bin/env python3
"""Tensor work of the 128-token tiles against the useful work, under uniform top-K routing.

An expert's n rows run as n // 128 full tiles and, for a remainder r, one more tile: a split
wide tile of 64 rows (one m64 chain a warpgroup) when r <= 64, else a full 128-row tile (the
kernel's rule at prefill, fused_moe.cu's `split`). The column `g16` is what a remainder
padded to 16 rows instead of 64 would cost (a swap-AB tile for the small remainders: not built).
Usage: python3 bench/results/ab/v28_padding.py   (seeded; a few seconds)
"""
import numpy as np

rng = np.random.default_rng(1)


def padded(counts, g):
    pad = 0
    for n in counts:
        full, r = divmod(int(n), 128)
        pad += full * 128 + (0 if r == 0 else (g * -(-r // g) if r <= 64 else 128))
    return pad


for name, E, K in (("glm-5 / deepseek-v3", 256, 8), ("glm-5.3-flash", 288, 8)):
    for T in (1024, 2048, 4096, 8192, 16384):
        r64, r16, small = [], [], []
        for _ in range(3):
            ids = np.argsort(rng.random((T, E)), axis=1)[:, :K]  # K distinct experts a token
            counts = list(np.bincount(ids.ravel(), minlength=E)) + [T]  # + the shared expert
            useful = sum(counts)
            r64.append(padded(counts, 64) / useful)
            r16.append(padded(counts, 16) / useful)
            small.append(sum(1 for n in counts if 0 < n % 128 <= 64))
        print(f"{name:20s} T={T:6d}: tensor rows / useful rows {np.mean(r64):.3f} "
              f"(g16 {np.mean(r16):.3f}); remainder tiles of <= 64 rows {np.mean(small):.0f}")
