#!/usr/bin/env python3
"""Summarizes the per-instruction warp-stall samples of scripts/device_ncu.sh (LABEL_src.csv.gz).

For each kernel in the file: the samples by stall reason, then the instructions with the most
samples (index in the kernel's SASS, samples, executions, the instruction, its top reasons), and
with --context N the N instructions before each of them (a stall is often charged to the
instruction after the one it waits for).
Usage: scripts/ncu_stalls.py FILE.csv[.gz] [--top 30] [--context 0] [--kernel SUBSTRING]
"""
import argparse
import csv
import gzip
import sys


def read_kernels(path):
    """[(kernel name, header, rows)] from ncu's `--page source --csv` output."""
    opener = gzip.open if path.endswith(".gz") else open
    kernels, name, header, rows = [], None, None, []
    with opener(path, "rt", newline="") as f:
        for rec in csv.reader(f):
            if not rec:
                continue
            if rec[0] == "Kernel Name":
                if header is not None:
                    kernels.append((name, header, rows))
                name, header, rows = rec[1] if len(rec) > 1 else "?", None, []
            elif rec[0] == "Address":
                header = rec
            elif header is not None:
                rows.append(rec)
    if header is not None:
        kernels.append((name, header, rows))
    return kernels


def to_int(s):
    try:
        return int(float(s))
    except ValueError:
        return 0


def summarize(name, header, rows, top, context):
    col = {h: i for i, h in enumerate(header)}
    samples_col = col.get("Warp Stall Sampling (All Samples)")
    if samples_col is None:
        print(f"{name}: no 'Warp Stall Sampling (All Samples)' column")
        return
    reasons = [h for h in header if h.startswith("stall_") and "(Not Issued)" not in h]
    samples = [to_int(r[samples_col]) for r in rows]
    total = sum(samples) or 1
    by_reason = {h: sum(to_int(r[col[h]]) for r in rows) for h in reasons}
    print(f"{name[:150]}")
    print(f"total samples {sum(samples)} instructions {len(rows)}")
    ranked = sorted(by_reason.items(), key=lambda kv: -kv[1])
    print("by reason: " + ", ".join(f"{h[6:]} {100.0 * v / total:.1f}%" for h, v in ranked if v > 0))
    execd = col.get("Instructions Executed")
    order = sorted(range(len(rows)), key=lambda i: -samples[i])[:top]
    for i in order:
        if context:
            for j in range(max(0, i - context), i):
                print(f"        {j:5d} {samples[j]:6d} {rows[j][1].strip()}")
        why = sorted(((to_int(rows[i][col[h]]), h[6:]) for h in reasons), reverse=True)[:3]
        ex = rows[i][execd] if execd is not None else "?"
        print(f"  {i:5d} {100.0 * samples[i] / total:5.2f}% exec={ex:>10} {rows[i][1].strip():60s} "
              + " ".join(f"{h}:{v}" for v, h in why if v > 0))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--context", type=int, default=0)
    ap.add_argument("--kernel", default="", help="only kernels whose name holds this")
    args = ap.parse_args()
    kernels = [k for k in read_kernels(args.file) if args.kernel in k[0]]
    if not kernels:
        sys.exit(f"{args.file}: no kernel{' matching ' + args.kernel if args.kernel else ''}")
    for name, header, rows in kernels:
        summarize(name, header, rows, args.top, args.context)


if __name__ == "__main__":
    main()
