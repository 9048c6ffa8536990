"""Kimi K3 decode capacity for the seeds' 120K agent workload, DCP 1 vs DCP = TP (no device).

114,000-token shared prefix + 6,000-token suffix, 400 output tokens; FP8 latent, FP32 recurrent
state, BF16 conv state and weights, MXFP4 routed experts (4.25 bits). See docs/capacity.md.

    python benchmarks/capacity.py [--out DIR]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

from pdserve.decode.capacity import CapacityInput, format_table, plan_capacity

AGENT = dict(model="kimi-k3", context_tokens=120_000, prefix_tokens=114_000, output_tokens=400,
             latent_dtype="float8_e4m3fn", expert_bits=4.25)
# (label, GPU memory in GiB, TP). GB300: 288 GB nominal = 268 GiB. H200: 139 GiB as the device
# machine shows it (141 GB nominal). TP16 on H200 spans two nodes (TP over the network).
SETUPS = [("GB300 TP8", 268.0, 8), ("H200 TP8", 139.0, 8), ("H200 TP16 (2 nodes)", 139.0, 16)]
SEEDS = {"dcp1_tokens": 1_930_000, "dcp8_tokens": 19_750_000}  # seed 000, GB300, vLLM


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="result directory (default benchmarks/results)")
    args = ap.parse_args()
    figures: dict = {"workload": AGENT, "seeds": SEEDS, "setups": {}}
    for label, gib, tp in SETUPS:
        try:
            reports = [plan_capacity(CapacityInput(**AGENT, gpu_memory_gib=gib, tp=tp, dcp=dcp))
                       for dcp in (1, tp)]
        except ValueError as exc:  # K3 does not fit an H200 at TP8
            print(f"\n{label}, {gib:g} GiB x 0.9: does not fit: {exc}")
            figures["setups"][label] = {"fits": False, "error": str(exc)}
            continue
        r1, rc = reports
        print(f"\n{label}, {gib:g} GiB x 0.9 per GPU")
        print(format_table(reports, ["dcp=1", f"dcp={tp}"]))
        gain = rc.kv_capacity_tokens / r1.kv_capacity_tokens
        print(f"DCP gain in KV capacity: {gain:.2f}x (latent alone {tp}x; seeds "
              f"{SEEDS['dcp8_tokens'] / SEEDS['dcp1_tokens']:.2f}x)")
        figures["setups"][label] = {
            "fits": True, "dcp_gain": gain,
            "reports": {f"dcp{r.input.dcp}": msgspec.to_builtins(r) for r in reports}}
    print(f"\nwrote {write_result('capacity', figures, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
