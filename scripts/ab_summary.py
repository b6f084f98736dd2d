#!/usr/bin/env python3
"""Summarizes scripts/device_ab.sh logs: per case (preset, local experts, tokens) the first label's
mean time, every round's value, and each other label's mean as a percent against it.

Usage: scripts/ab_summary.py LOG [LOG ...] [--base LABEL]
"""
import argparse
import collections
import re

LINE = re.compile(r"(\S+) \| (\S+)\s+E=\s*(\d+) T=\s*(\d+):\s+([\d.]+) us")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--base", help="the label the others are compared with (default: the first seen)")
    args = ap.parse_args()
    for path in args.logs:
        times = collections.defaultdict(list)  # (preset, E, T, label) -> us of each round
        labels = []
        with open(path) as f:
            for line in f:
                m = LINE.match(line)
                if not m:
                    continue
                label, preset, e, t, us = m.groups()
                if label not in labels:
                    labels.append(label)
                times[(preset, int(e), int(t), label)].append(float(us))
        if not labels:
            print(f"{path}: no bench lines")
            continue
        base = args.base or labels[0]
        others = [l for l in labels if l != base]
        print(f"{path}: base {base}; " + ", ".join(others))
        for case in sorted({k[:3] for k in times}):
            ref = times.get(case + (base,))
            if not ref:
                continue
            mean = sum(ref) / len(ref)
            cols = []
            for l in others:
                v = times.get(case + (l,))
                if v:
                    cols.append(f"{l} {100.0 * (sum(v) / len(v) / mean - 1):+.1f}% "
                                f"[{', '.join(f'{x:.1f}' for x in v)}]")
            print(f"  {case[0]:14s} E={case[1]:3d} T={case[2]:5d}: {mean:9.1f} us "
                  f"[{', '.join(f'{x:.1f}' for x in ref)}]  " + "  ".join(cols))


if __name__ == "__main__":
    main()
