#!/usr/bin/env python3
"""Issue 6 on paper: one rank of an 8-way DeepSeek-V4-Flash layer (H 4096, I 2048, 256 experts,
top-6, routed only) at 8, 256 and 8192 tokens a rank, against 0.8x of DeepGEMM's SM90 MegaMoE
(ANCHORS / issue 6: 225, 293, 3269 us). Inputs are measured figures from bench/results/h200.json
(v31, the GLM-5.3-Flash 8-way share: 36 local experts, every SM, no NVLink) and two assumed
NVLink figures stated below. Prints the per-rank bytes, FLOPs and NVLink traffic and the estimate.
Usage: python3 bench/results/ab/v32_ep_model.py"""
import json, math, os

H, I, E, K, R = 4096, 2048, 256, 6, 8
El = E // R
READ_TBPS = 4.54           # streaming read on this H200 (h200.json, v31)
NVLINK_GBPS = 350.0        # assumed: NVLink 4 on an HGX H200, ~450 GB/s a direction, ~80 % reached
expert_bytes = 3 * H * I + 3 * (H // 128) * (I // 128) * 4  # FP8 w13 + w2 and their block scales
flop_row = 2 * 3 * H * I                                    # w13 (2I x H) and w2 (H x I), 2 flop a MAC
row_bytes = H + (H // 128) * 4 + 8                          # an FP8 token row, its scales, the send entry

here = os.path.dirname(os.path.abspath(__file__))
cases = json.load(open(os.path.join(here, "..", "h200.json")))["cases"]
share = {c["tokens"]: c for c in cases if c["preset"] == "glm-5.3-flash" and c["local_experts"] == 36}

def share_ratio(t):
    """The measured 8-way share's time over its floor at t tokens a rank (GLM-5.3-Flash shape)."""
    c = share[t]
    return c["us"] / c["floor_us"]

def share_tflops(t):
    return share[t]["tflops"]

print(f"V4-Flash, R = {R}: {El} experts a rank, {expert_bytes / 1e6:.1f} MB an expert")
print("T/rank | experts hit | weight MB | floor us | TFLOP | pull MB (remote) | combine MB (remote) | estimate us | target us")
for T, target in ((8, 0.8 * 225), (256, 0.8 * 293), (8192, 0.8 * 3269)):
    slots = T * R * K                         # every rank's tokens' slots
    p_hit = 1 - (1 - 1 / E) ** slots          # uniform routing
    hit = El * p_hit
    rows = slots / R                          # rows this rank's experts receive
    wbytes = hit * expert_bytes
    floor_us = wbytes / (READ_TBPS * 1e12) * 1e6
    tflop = rows * flop_row / 1e12
    remote = (R - 1) / R
    pull = rows * row_bytes * remote
    comb = rows * H * 2 * remote
    if T <= 256:
        # weight-bound: the share's measured time over its floor at the same tokens a rank
        est = floor_us * share_ratio(T)
        how = f"floor x {share_ratio(T):.2f} (share, measured)"
    else:
        # tensor-bound: the share's rate between 4096 and 16384 tokens a rank
        rate = min(share_tflops(4096), share_tflops(16384))
        est = tflop / rate * 1e6
        how = f"{tflop:.2f} TFLOP at {rate:.0f} TFLOP/s (share, measured)"
    pull_us = pull / (NVLINK_GBPS * 1e9) * 1e6
    print(f"{T:6d} | {hit:5.1f} of {El} | {wbytes / 1e6:8.0f} | {floor_us:8.1f} | {tflop:6.3f} | "
          f"{pull / 1e6:7.1f} ({pull_us:5.1f} us) | {comb / 1e6:7.1f} | "
          f"{est:7.0f} + {pull_us:5.0f} pull = {est + pull_us:6.0f} | {target:6.0f}   [{how}]")
