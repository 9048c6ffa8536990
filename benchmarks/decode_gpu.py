"""Decode step on the H200 for a kimi-linear-48b-a3b layer stack (bf16 weights, fp32 KDA state,
bf16 conv state and latent), reference backend vs the `cutedsl` backend (the fused CuTe DSL KDA
decode op plugged in through the kernel registry), eager (no CUDA graphs: the reference step
builds index tensors on the host every step). Both backends get the same input tokens every
step; the argmax agreement of their logits is reported.

    python benchmarks/decode_gpu.py [--layers 4] [--batches 1 8 32 64] [--steps 20] [--out DIR]
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

from pdserve.decode.rank import kda_step_for
from pdserve.kernels import registry
from pdserve.model.batch import ForwardBatch
from pdserve.model.config import reduced_kimi_linear
from pdserve.model.generate import ReferenceEngine, build_model
from pdserve.model.sampling import Request, SamplingParams
from pdserve.state.layout import StateLayout

LAYOUT = StateLayout(latent_dtype="bfloat16", recurrent_dtype="float32", conv_dtype="bfloat16")


def run(model, backend, batch, prompt, steps):
    eng = ReferenceEngine(model, LAYOUT, num_pages=batch * (prompt // 64 + 4) + 1,
                          num_slots=batch + 1)
    seqs = [eng.admit(Request(f"r{i}", [(7 * i + j) % 1024 for j in range(prompt)],
                              SamplingParams(max_tokens=steps + 4, ignore_eos=True)))
            for i in range(batch)]
    eng.prefill(seqs)
    step = kda_step_for(backend)
    times, tokens = [], []
    for k in range(steps + 2):
        batch_ = ForwardBatch.of([s.table for s in seqs], [1] * len(seqs))
        # fixed inputs, the same for both backends, so their outputs compare step by step
        ids = torch.tensor([(31 * k + 7 * i) % 1024 for i in range(batch)], device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = model(ids, batch_, eng.pools, logit_rows=batch_.last_rows(), kda_step=step)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        for s in seqs:
            s.table.num_tokens += 1
        tokens.append(logits.argmax(-1).tolist())
    return statistics.median(times[2:]), tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    config = reduced_kimi_linear(args.layers, num_experts=8, top_k=2, vocab_size=1024)
    model = build_model(config, dtype=torch.bfloat16, seed=0).cuda()
    rows = []
    for b in args.batches:
        ref_t, ref_tok = run(model, "reference", b, args.prompt, args.steps)
        fast_t, fast_tok = run(model, "cutedsl", b, args.prompt, args.steps)
        same = sum(x == y for a, c in zip(ref_tok, fast_tok) for x, y in zip(a, c))
        total = sum(len(a) for a in ref_tok)
        rows.append({"batch": b, "reference_step_ms": ref_t * 1e3, "cutedsl_step_ms": fast_t * 1e3,
                     "speedup": ref_t / fast_t, "argmax_equal": same, "argmax_total": total})
        print(f"batch {b:3d}: reference {ref_t * 1e3:7.2f} ms  cutedsl {fast_t * 1e3:7.2f} ms  "
              f"x{ref_t / fast_t:4.2f}  same argmax {same}/{total}")
    fallbacks = registry.fallbacks()  # empty: the guard accepted every real decode step
    path = write_result("decode_gpu_h200", {"model": f"kimi-linear-48b-a3b reduced to {args.layers} "
                        "layers, 8 experts top-2, vocab 1024", "dtype": "bfloat16",
                        "cuda_graphs": False, "rows": rows, "fallbacks_logged": [list(k) for k in fallbacks]},
                        args.out)
    print(f"fallbacks: {fallbacks}\nwrote {path}")


if __name__ == "__main__":
    main()
