"""Interleaved A/B of MLA decode kernel variants selected by environment switches (H200).

Each round runs every variant in a fresh process (its own compile and cache allocation, so
page placement varies as between real runs), over the same cells, with mla_decode.bench_one
(early_kv). Prints the fraction of the copy floor per cell and variant, and writes every row
plus the environment to JSON.

    python benchmarks/mla_decode_ab.py --variants 'exact:PDSERVE_MLA_SWAPAB_LAZY=0;lazy:' \\
        --cells 8:32768:32:fp8,64:8192:32:fp8 [--rounds 2] [--json PATH]

A variant is NAME:KEY=VALUE+KEY=VALUE (empty: the defaults); a cell is B:L:H:fp8|bf16.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment

# the child gets the cells parse_cells made, as JSON [[B, L, H, dtype], ...]
CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
import mla_decode
for b, l, h, dt in json.loads(sys.argv[1]):
    row = mla_decode.bench_one(b, l, h, dt == "fp8", early_kv=True)
    print("ROW " + json.dumps(row), flush=True)
"""


def parse_variants(text):
    out = []
    for item in text.split(";"):
        name, sep, env = item.partition(":")
        if not name or not sep:
            raise SystemExit(f"variant {item!r}: expected NAME:KEY=VALUE+...")
        pairs = [kv.split("=", 1) for kv in env.split("+") if kv]
        if any(len(p) != 2 or not p[0] for p in pairs):
            raise SystemExit(f"variant {item!r}: each setting must be KEY=VALUE")
        out.append((name, dict(pairs)))
    return out


def parse_cells(text):
    """'B:L:H:fp8|bf16,...' -> [(B, L, H, dtype)], refusing anything else by name."""
    cells = []
    for cell in text.split(","):
        parts = cell.split(":")
        if (len(parts) != 4 or parts[3] not in ("fp8", "bf16")
                or not all(p.isdigit() for p in parts[:3])):
            raise SystemExit(f"cell {cell!r}: expected B:L:H:fp8|bf16")
        cells.append((int(parts[0]), int(parts[1]), int(parts[2]), parts[3]))
    return cells


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", required=True,
                    help="NAME:KEY=VALUE+...;NAME2:... (see module doc)")
    ap.add_argument("--cells", required=True, help="B:L:H:fp8|bf16,...")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=400, help="seconds per child process")
    ap.add_argument("--json", default="benchmarks/results/mla_decode_h200_ab.json")
    args = ap.parse_args(argv)
    variants = parse_variants(args.variants)
    cells = json.dumps(parse_cells(args.cells))
    here = os.path.dirname(os.path.abspath(__file__))
    rows = []
    for r in range(args.rounds):
        for name, env in variants:
            print(f"round {r} variant {name} {env}", flush=True)
            try:
                p = subprocess.run([sys.executable, "-c", CHILD, cells, here],
                                   env=dict(os.environ, **env), capture_output=True, text=True,
                                   timeout=args.timeout, check=False)
            except subprocess.TimeoutExpired:
                print(f"  {name}: timed out after {args.timeout} s", flush=True)
                continue
            if p.returncode:
                print(f"  {name}: failed (rc {p.returncode}):\n{p.stderr[-3000:]}", flush=True)
                continue
            for line in p.stdout.splitlines():
                if line.startswith("ROW "):
                    row = json.loads(line[4:])
                    row.update(variant=name, round=r, env=env)
                    rows.append(row)
    frac = collections.defaultdict(list)
    for row in rows:
        frac[(row["kv_dtype"], row["H"], row["B"], row["L"], row["variant"])].append(
            round(row["frac_of_copy_bw"], 3))
    print("\nfraction of the copy floor per cell and variant (rounds in order)")
    for key in sorted(frac):
        dt, h, b, l, name = key
        print(f"{dt:8s} H={h:2d} B={b:3d} L={l:6d}  {name:10s} {frac[key]}")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"environment": environment(), "variants": dict(variants), "cells": args.cells,
                   "rounds": args.rounds, "rows": rows}, f, indent=1)
    print(f"json: {args.json}")


if __name__ == "__main__":
    main()
