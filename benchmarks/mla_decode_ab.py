"""Interleaved A/B of MLA decode kernel variants, each a set of launch-plan choices (H200).

Each round runs every variant in a fresh process (its own compile and cache allocation, so
page placement varies as between real runs), over the same cells, with mla_decode.bench_one
(the plan's defaults with the variant's choices on top, every choice passed explicitly). Prints
the fraction of the copy floor per cell and variant, and writes every row plus the environment
to `mla_decode_ab_<device>.json` (or --out / --name).

    python benchmarks/mla_decode_ab.py --variants 'exact:lazy_max=0;lazy:' \\
        --cells 8:32768:32:fp8,64:8192:32:fp8 [--rounds 2] [--out DIR] [--name NAME]

A variant is NAME:KEY=VALUE+KEY=VALUE (empty: the plan's defaults) with plan_call's keywords
(mla_decode.parse_choice); a cell is B:L:H:fp8|bf16.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write_result  # noqa: E402
from mla_decode import parse_choice  # noqa: E402

# the child gets the cells parse_cells made, as JSON [[B, L, H, dtype], ...], and the variant's
# settings as JSON {KEY: VALUE text}
CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
import mla_decode
choices = dict(mla_decode.parse_choice(f"{k}={v}") for k, v in json.loads(sys.argv[3]).items())
for b, l, h, dt in json.loads(sys.argv[1]):
    row = mla_decode.bench_one(b, l, h, dt == "fp8", **choices)
    print("ROW " + json.dumps(row), flush=True)
print("DEVICE " + mla_decode.device_tag(), flush=True)
"""


def parse_variants(text):
    """'NAME:KEY=VALUE+...;...' -> [(name, {key: value text})]; each setting is checked with
    mla_decode.parse_choice (an unknown choice or a bad value is refused by name)."""
    out = []
    for item in text.split(";"):
        name, sep, settings = item.partition(":")
        if not name or not sep:
            raise SystemExit(f"variant {item!r}: expected NAME:KEY=VALUE+...")
        pairs = [kv.split("=", 1) for kv in settings.split("+") if kv]
        if any(len(p) != 2 or not p[0] for p in pairs):
            raise SystemExit(f"variant {item!r}: each setting must be KEY=VALUE")
        for key, value in pairs:
            parse_choice(f"{key}={value}")
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
    ap.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    ap.add_argument("--name", default=None, help="result file name (default mla_decode_ab_<device>)")
    args = ap.parse_args(argv)
    variants = parse_variants(args.variants)
    cells = json.dumps(parse_cells(args.cells))
    here = os.path.dirname(os.path.abspath(__file__))
    rows, device = [], "gpu"
    for r in range(args.rounds):
        for name, settings in variants:
            print(f"round {r} variant {name} {settings}", flush=True)
            try:
                p = subprocess.run([sys.executable, "-c", CHILD, cells, here,
                                    json.dumps(settings)], capture_output=True, text=True,
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
                    row.update(variant=name, round=r, settings=settings)
                    rows.append(row)
                elif line.startswith("DEVICE "):
                    device = line[7:].strip()
    frac = collections.defaultdict(list)
    for row in rows:
        frac[(row["kv_dtype"], row["H"], row["B"], row["L"], row["variant"])].append(
            round(row["frac_of_copy_bw"], 3))
    print("\nfraction of the copy floor per cell and variant (rounds in order)")
    for key in sorted(frac):
        dt, h, b, l, name = key
        print(f"{dt:8s} H={h:2d} B={b:3d} L={l:6d}  {name:10s} {frac[key]}")
    path = write_result(args.name or f"mla_decode_ab_{device}",
                        {"variants": dict(variants), "cells": args.cells, "rounds": args.rounds,
                         "rows": rows}, args.out)
    print(f"json: {path}")


if __name__ == "__main__":
    main()
