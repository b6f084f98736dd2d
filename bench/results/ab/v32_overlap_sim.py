#!/usr/bin/env python3
"""The expert-parallel pull beside the tiles (v32, heuristics.h kEpPullOverlap) against the pull
before them, for one rank of the DeepSeek-V4-Flash shape over 8 GPUs (32 local experts, H 4096,
I 2048), as a timing model: 132 CTAs take their tiles in TileSchedule's order (GEMM1 round-robin,
then GEMM2, tile ids expert-major, output blocks major inside a chunk of 16 token blocks), a tile
costs its flops at the 8-way share's measured rate (v31: ~975 TFLOP/s over 132 SMs), a GEMM1
tile starts once its unit's rows are pulled, a GEMM2 tile once its unit's GEMM1 tiles are done.
The pull: 264 warps (2 a CTA) walking the ring's rows in order, a row each `row_us` (the slower
of a latency-bound warp, ~3 NVLink round trips, and its share of the link's bandwidth); before
the tiles, 12 warps a CTA do the same walk; a grid barrier (~2 us) precedes the tiles either way. Not a test: the model's
blind spots are the rate inside a tile and the link's behaviour under load.
Usage: python3 bench/results/ab/v32_overlap_sim.py"""

H, I, El, BN, GRID = 4096, 2048, 32, 128, 132
CHUNK = 16
RATE = 975e12 / GRID                    # flop/s a CTA (the share's measured rate, v31)
ROW_BYTES = H + H // 128 * 4 + 8


def tiles_of(units_per_expert):
    """Tile list in id order: (gemm, expert, unit index within expert)."""
    n1, n2 = I // 128, H // 128
    out = []
    for gemm, nb in ((1, n1), (2, n2)):
        for e in range(El):
            u = units_per_expert[e]
            for c0 in range(0, u, CHUNK):
                c1 = min(u, c0 + CHUNK)
                for _ in range(nb):
                    for b in range(c0, c1):
                        out.append((gemm, e, b))
    return out


def simulate(rows_per_expert, link_gbps, latency_us, overlap):
    units = [(r + BN - 1) // BN for r in rows_per_expert]
    unit_base = [sum(units[:e]) for e in range(El)]
    row_base = [sum((r + 7) // 8 * 8 for r in rows_per_expert[:e]) for e in range(El)]
    warps = GRID * (2 if overlap else 12)
    # a warp's time a row: latency-bound, or its share of the link
    row_us = max(latency_us, warps * ROW_BYTES / (link_gbps * 1e9) * 1e6)
    ready = []  # unit -> time its last row lands
    for e in range(El):
        for b in range(units[e]):
            last = row_base[e] + min(rows_per_expert[e], (b + 1) * BN) - 1
            ready.append((last // warps + 1) * row_us)
    pull_end = max(ready)
    start = 2.0 + (0.0 if overlap else pull_end)  # (the second grid barrier: after the pull, or at once)
    t = tiles_of(units)
    t1 = sum(1 for x in t if x[0] == 1)
    gemm1_cost = 2 * BN * 2 * 128 * H / RATE * 1e6   # 128 rows x 256 w13 rows (a 128-column tile) x H
    gemm2_cost = 2 * BN * 128 * I / RATE * 1e6
    clock = [start] * GRID
    done1 = {}
    lists = [list(range(c, t1, GRID)) + list(range(t1 + c, len(t), GRID)) for c in range(GRID)]
    # GEMM1 first on every CTA (they never wait for GEMM2), then GEMM2
    for c in range(GRID):
        for i in lists[c]:
            g, e, b = t[i]
            if g != 1:
                continue
            u = unit_base[e] + b
            s = max(clock[c], ready[u] if overlap else start)
            clock[c] = s + gemm1_cost
            done1[u] = max(done1.get(u, 0.0), clock[c])
    for c in range(GRID):
        for i in lists[c]:
            g, e, b = t[i]
            if g != 2:
                continue
            clock[c] = max(clock[c], done1[unit_base[e] + b]) + gemm2_cost
    return max(clock), pull_end, row_us


if __name__ == "__main__":
    print("rows/expert | link GB/s | warp row us | before: pull end, total us | beside: pull end, total us | gain")
    for rows in (48, 1536):
        for link, lat in ((350, 4.5), (250, 4.5), (450, 3.0)):
            rpe = [rows] * El
            tb, pb, rb = simulate(rpe, link, lat, False)
            to, po, ro = simulate(rpe, link, lat, True)
            print(f"{rows:11d} | {link:9d} | {rb:5.1f} / {ro:5.1f} | {pb:8.1f} {tb:9.1f} | {po:8.1f} {to:9.1f} | "
                  f"{(to - tb) / tb * 100:+.1f} %")
