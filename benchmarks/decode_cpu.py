"""Decode step latency and tokens/s against batch size on CPU for `tiny`, through the decode
runtime's own path (DecodeRank.step: the TP-sharded model with the reference backend), with
state that arrived over NIXL from a reference prefill rank. The "stock-like" baseline for the
kernel issues; no target.

    python benchmarks/decode_cpu.py [--batches 1 2 4 8 16 32] [--steps 20] [--out DIR]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

from pdserve.decode.instance import DecodeInstance, LocalRanks
from pdserve.decode.rank import DecodeRank
from pdserve.model.config import preset
from pdserve.model.sampling import Request, SamplingParams
from pdserve.prefill.engine import PrefillRank
from pdserve.state.layout import StateLayout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    config, layout = preset("tiny"), StateLayout(latent_dtype="float32", conv_dtype="float32")
    top = max(args.batches)
    prefill = PrefillRank("bench-prefill", 0, 0, config, layout=layout, num_slots=top + 1,
                          num_pages=top * 4 + 1)
    rank = DecodeRank("bench-decode", 0, config, layout=layout, num_slots=top + 1,
                      num_pages=top * 4 + 1)
    decode = DecodeInstance("bench-decode", LocalRanks([rank]), layout, set())
    rows = []
    try:
        for b in args.batches:
            reqs = [Request(f"b{b}-{i}", [(i * 7 + j) % 256 for j in range(args.prompt)],
                            SamplingParams(max_tokens=args.steps + 2, ignore_eos=True))
                    for i in range(b)]
            handles = [r.handle for r in prefill.prefill(reqs, [prefill.info()])]
            seqs = [decode.admit(h) for h in handles]
            prefill.poll()
            decode.decode(seqs)  # warm-up
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                decode.decode(seqs)
                times.append(time.perf_counter() - t0)
            for s in seqs:
                decode.release(s)
            step = statistics.median(times)
            rows.append({"batch": b, "step_ms_median": step * 1e3, "tokens_per_s": b / step,
                         "step_ms_p90": sorted(times)[int(0.9 * (len(times) - 1))] * 1e3})
            print(f"batch {b:3d}: step {step * 1e3:7.2f} ms  {b / step:8.1f} tokens/s")
    finally:
        rank.close()
        prefill.close()
    path = write_result("decode_cpu", {"model": "tiny", "backend": "reference", "dtype": "float32",
                                       "prompt_tokens": args.prompt, "rows": rows}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
