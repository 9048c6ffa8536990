"""Reference model on CPU: prefill tokens/s and decode step time for `tiny` (a baseline, no target).

    python benchmarks/model_cpu.py [--repeats 5] [--out DIR]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

from pdserve.model.config import preset
from pdserve.model.generate import ReferenceEngine, build_model
from pdserve.model.sampling import Request, SamplingParams


def measure(model, prompt_len: int, batch: int, decode_steps: int, repeats: int) -> dict:
    prompts = [[(7 * i + j) % 256 for j in range(prompt_len)] for i in range(batch)]
    prefill, decode = [], []
    for _ in range(repeats):
        eng = ReferenceEngine(model, num_pages=batch * (prompt_len // 64 + 4), num_slots=batch + 1)
        seqs = [eng.admit(Request(f"r{i}", p, SamplingParams(max_tokens=decode_steps + 1)))
                for i, p in enumerate(prompts)]
        t0 = time.perf_counter()
        eng.prefill(seqs)
        prefill.append(time.perf_counter() - t0)
        for _ in range(decode_steps):
            t0 = time.perf_counter()
            eng.decode(seqs)
            decode.append(time.perf_counter() - t0)
        for s in seqs:
            eng.release(s)
    p = statistics.median(prefill)
    return {"prompt_len": prompt_len, "batch": batch, "prefill_s_median": p,
            "prefill_tokens_per_s": prompt_len * batch / p,
            "decode_step_ms_median": statistics.median(decode) * 1e3,
            "decode_tokens_per_s": batch / statistics.median(decode)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None, help="directory for the JSON (default benchmarks/results)")
    args = ap.parse_args()
    model = build_model(preset("tiny"), seed=0)
    rows = []
    for prompt_len, batch in [(128, 1), (512, 1), (128, 8), (512, 8)]:
        rows.append(measure(model, prompt_len, batch, decode_steps=16, repeats=args.repeats))
        r = rows[-1]
        print(f"prompt {prompt_len:4d} batch {batch:2d}: prefill {r['prefill_tokens_per_s']:9.0f} tok/s"
              f" | decode step {r['decode_step_ms_median']:6.2f} ms ({r['decode_tokens_per_s']:7.1f} tok/s)")
    path = write_result("model_cpu", {"model": "tiny", "dtype": "float32", "rows": rows}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
