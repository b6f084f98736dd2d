#!/usr/bin/env python3
"""The decode tile schedule (include/megamoe/kernels/tile_schedule.h) under a bytes-only cost
model: every CTA streams at the same rate, a tile costs its weight stages, a GEMM2 tile starts
no earlier than the last GEMM1 tile of its expert, pool tiles go to the CTA free first.
Prints the makespan against the mean (1.000 = perfectly balanced) and the CTAs' dependency
stalls, for v26's GEMM1 tiles (64 intermediate columns, 48 stages on GLM-5) and v27's (128
columns, 96 stages), to see whether v27's decode loss (~1 % at 8-256 tokens) is the schedule.
The lists are TileSchedule::init / next as of v28, written again here (a model, not a test:
tests/cpu/test_tile_schedule.cpp checks the C++ itself).
Usage: python3 bench/results/ab/v28_schedule_sim.py
"""
import heapq


def simulate(experts, n1, cost1, n2=48, cost2=16, grid=132, pool=4 * 132):
    t1, tiles2 = experts * n1, experts * n2
    t2 = tiles2 - pool
    r1 = t1 % grid
    light = grid - r1 if r1 else 0
    extra = (cost1 + cost2 // 2) // cost2 if r1 else 0
    p1 = min(extra * light, t2)
    lists = []
    for c in range(grid):  # TileSchedule::next, phase by phase
        own = list(range(c, t1, grid))
        own += [t1 + (c - r1) + m * light for m in range(extra) if c >= r1 and (c - r1) + m * light < p1]
        own += [t1 + j for j in range(p1 + c, t2, grid)]
        lists.append(own)
    gemm1_done = [0.0] * experts
    clock = [0.0] * grid
    for c in range(grid):  # GEMM1 tiles come first in every list and never wait
        for tile in lists[c]:
            if tile < t1:
                clock[c] += cost1
                gemm1_done[tile // n1] = max(gemm1_done[tile // n1], clock[c])
    stall = 0.0
    for c in range(grid):
        for tile in lists[c]:
            if tile >= t1:
                ready = gemm1_done[(tile - t1) // n2]
                stall += max(0.0, ready - clock[c])
                clock[c] = max(clock[c], ready) + cost2
    free = [(clock[c], c) for c in range(grid)]
    heapq.heapify(free)
    for tile in range(t1 + t2, t1 + tiles2):  # the pool, claimed in id order
        t, c = heapq.heappop(free)
        heapq.heappush(free, (max(t, gemm1_done[(tile - t1) // n2]) + cost2, c))
    mean = (t1 * cost1 + tiles2 * cost2) / grid
    return max(t for t, _ in free) / mean, stall / grid / mean


for experts, label in ((60, "T=8 (59 hit + shared)"), (124, "T=64 (123 + shared)"), (257, "T=256 (all + shared)")):
    for per_cta in (4, 8):
        v26 = simulate(experts, 32, 48, pool=per_cta * 132)
        v27 = simulate(experts, 16, 96, pool=per_cta * 132)
        print(f"{label:22s} pool {per_cta}/CTA: makespan / mean v26 {v26[0]:.3f} (stalls {v26[1]:.3f}), "
              f"v27 {v27[0]:.3f} (stalls {v27[1]:.3f})")
