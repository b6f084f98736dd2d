#!/usr/bin/env python3
"""Draws a `megamoe bench --json` file: the layer's time against tokens, log-log, one panel per
preset, expert count (a whole layer, or one rank's share of an expert-parallel layer) and routing
(uniform, zipf:S), with the read floor (the weight bytes of the experts hit over the streaming
read of the same run), the tensor-core floor (the FLOPs at the in-run dense FP8 GEMM's rate of
the regime drawn) and the cuBLASLt baseline of the same run. Files with both timing regimes
draw one of them (--regime, default sustained).

Usage: scripts/plot_bench.py bench/results/h100.json [-o docs/img/bench_h100.png] [--regime burst]
Needs matplotlib (pip install matplotlib)."""
import argparse
import collections
import json
import sys


def load_cases(path):
    with open(path) as f:
        doc = json.load(f)
    cases = doc.get("cases")
    if not isinstance(cases, list) or not cases:
        sys.exit(f"{path}: expected a `megamoe bench --json` file with a non-empty 'cases' list")
    need = ("preset", "local_experts", "tokens", "us", "hbm_floor_us", "tc_floor_us")
    for i, c in enumerate(cases):
        missing = [k for k in need if k not in c]
        if missing:
            sys.exit(f"{path}: case {i} lacks {', '.join(missing)} (expected every case to have {need})")
    return doc, cases


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", help="a `megamoe bench --json` file")
    ap.add_argument("-o", "--out", help="PNG to write (default: the JSON's name with .png)")
    ap.add_argument("--regime", default="sustained", help="sustained | burst (files that record both)")
    args = ap.parse_args()
    doc, cases = load_cases(args.json)
    has_regimes = any("regime" in c for c in cases)  # files that record the timing regimes
    if has_regimes:
        cases = [c for c in cases if c.get("regime") == args.regime]
        if not cases:
            sys.exit(f"{args.json}: no case of regime {args.regime!r}")
    out = args.out or args.json.rsplit(".", 1)[0] + ".png"

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator

    # One panel per (preset, local experts, routing): whole layers on the top rows, shares below.
    groups = collections.OrderedDict()
    for c in sorted(cases, key=lambda c: (c["preset"], -c["local_experts"], c.get("routing", ""), c["tokens"])):
        groups.setdefault((c["preset"], c["local_experts"], c.get("routing", "")), []).append(c)
    presets = list(dict.fromkeys(k[0] for k in groups))
    rows = max(sum(1 for k in groups if k[0] == p) for p in presets)
    fig, axes = plt.subplots(rows, len(presets), figsize=(4.6 * len(presets), 3.9 * rows), squeeze=False)
    for col, preset in enumerate(presets):
        keys = [k for k in groups if k[0] == preset]
        for row in range(rows):
            ax = axes[row][col]
            if row >= len(keys):
                ax.axis("off")
                continue
            cs = groups[keys[row]]
            t = [c["tokens"] for c in cs]
            us = [c["us"] for c in cs]
            ax.fill_between(t, [c.get("us_p10", c["us"]) for c in cs], [c.get("us_p90", c["us"]) for c in cs],
                            color="C0", alpha=0.2, lw=0)
            ax.plot(t, us, "o-", color="C0", lw=2, ms=4, label="megamoe (median, p10-p90)")
            base = [(c["tokens"], c["baseline_us"]) for c in cs if c.get("baseline_us")]
            if base:
                ax.plot(*zip(*base), "s--", color="C3", lw=1.3, ms=3.5, label="cuBLASLt baseline")
            ax.plot(t, [c["hbm_floor_us"] for c in cs], ":", color="k", lw=1.5, label="read floor")
            ax.plot(t, [c["tc_floor_us"] for c in cs], "-.", color="C2", lw=1.5, label="tensor-core floor")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            top = max(max(us), max((b for _, b in base), default=0))
            ax.set_ylim(bottom=max(min(us) / 3, 1e-1), top=top * 2.5)
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_major_locator(LogLocator(base=10))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.grid(True, which="major", alpha=0.35)
            ax.grid(True, which="minor", alpha=0.1)
            share = cs[0].get("ep_share", 1)
            what = f"{keys[row][1]} experts" + (f" (1/{share} of an EP layer)" if share and share > 1 else "")
            if keys[row][2]:
                what += f", {keys[row][2]} routing"
            ax.set_title(f"{preset}, {what}", fontsize=10)
            ax.set_xlabel("tokens")
            if col == 0:
                ax.set_ylabel("µs per layer")
            for c in cs:  # the ratio to the floor above each point
                fl = max(c["hbm_floor_us"], c["tc_floor_us"])
                ax.annotate(f"{c['us'] / fl:.2f}x", (c["tokens"], c["us"]), textcoords="offset points",
                            xytext=(0, -13), ha="center", fontsize=7.5, color="C0",
                            bbox=dict(boxstyle="round,pad=0.1", fc="white", ec="none", alpha=0.8))
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9, frameon=False)
    regime = f"{args.regime} regime; " if has_regimes else ""
    fig.suptitle(f"megamoe bench on {doc.get('device', '?')} ({regime}commit {doc.get('commit', '?')}, "
                 f"{str(doc.get('date', '?'))[:10]}; streaming read {doc.get('read_bw_TBps', 0):.2f} TB/s; "
                 f"labels: time / max(floors))", fontsize=11)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
