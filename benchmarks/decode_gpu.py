"""Decode step on the H200 for a kimi-linear-48b-a3b layer stack (bf16 weights, fp32 KDA state,
bf16 conv state and latent), eager, in three variants: `reference` (the model's torch path),
`cutedsl_kda` (the fused CuTe DSL KDA decode op plugged in through the kernel registry, MLA in
torch) and `cutedsl` (also the CuTe DSL MLA decode attention over the paged latent cache: what
decode.backend = "cutedsl" runs). With --cuda-graphs each variant is also captured
(`pdserve.decode.graphs`, one graph for the batch size, the ops inside it) and its replayed step
latency reported; a step's time includes copying its inputs in. Every variant gets the same input
tokens every step; argmax agreement is reported against the eager reference (graphs: against
their own eager variant). --prompt sets the context the steps start from (the MLA kernel's
share grows with it).

    python benchmarks/decode_gpu.py [--layers 4] [--batches 1 8 32 64] [--steps 20]
                                    [--prompt 128] [--cuda-graphs] [--out DIR]
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

from pdserve.decode.graphs import DecodeGraphs
from pdserve.decode.rank import kda_step_for, mla_step_for
from pdserve.kernels import registry
from pdserve.model.batch import ForwardBatch
from pdserve.model.config import reduced_kimi_linear
from pdserve.model.generate import ReferenceEngine, build_model
from pdserve.model.sampling import Request, SamplingParams
from pdserve.state.layout import StateLayout

LAYOUT = StateLayout(latent_dtype="bfloat16", recurrent_dtype="float32", conv_dtype="bfloat16")
# variant -> (KDA backend, MLA backend)
VARIANTS = {"reference": ("reference", "reference"), "cutedsl_kda": ("cutedsl", "reference"),
            "cutedsl": ("cutedsl", "cutedsl")}


def run(model, variant, batch, prompt, steps, cuda_graphs=False):
    eng = ReferenceEngine(model, LAYOUT, num_pages=batch * (prompt // 64 + 4) + 1,
                          num_slots=batch + 1)
    seqs = [eng.admit(Request(f"r{i}", [(7 * i + j) % 1024 for j in range(prompt)],
                              SamplingParams(max_tokens=steps + 4, ignore_eos=True)))
            for i in range(batch)]
    eng.prefill(seqs)
    kda_backend, mla_backend = VARIANTS[variant]
    step, mla = kda_step_for(kda_backend), mla_step_for(mla_backend)
    graphs = (DecodeGraphs(model, eng.pools, prompt + steps + 3, buckets=(batch,), kda_step=step,
                           mla_step=mla)
              if cuda_graphs else None)
    times, tokens = [], []
    for k in range(steps + 2):
        tables = [s.table for s in seqs]
        # fixed inputs, the same for every variant, so their outputs compare step by step
        fed = [(31 * k + 7 * i) % 1024 for i in range(batch)]
        batch_ = ForwardBatch.of(tables, [1] * len(seqs))
        ids = torch.tensor(fed, device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if graphs is None:
            logits = model(ids, batch_, eng.pools, logit_rows=batch_.last_rows(), kda_step=step,
                           mla_step=mla)
        else:
            logits = graphs.run(tables, fed)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        for s in seqs:
            s.table.num_tokens += 1
        tokens.append(logits.argmax(-1).tolist())
    return statistics.median(times[2:]), tokens


def agree(a, b):
    return sum(x == y for r, c in zip(a, b) for x, y in zip(r, c)), sum(len(r) for r in a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--out", default=None)
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="also time each variant replayed from a CUDA graph")
    args = ap.parse_args()
    config = reduced_kimi_linear(args.layers, num_experts=8, top_k=2, vocab_size=1024)
    model = build_model(config, dtype=torch.bfloat16, seed=0).cuda()
    rows = []
    for b in args.batches:
        row, line = {"batch": b, "prompt": args.prompt}, f"batch {b:3d}:"
        eager = {v: run(model, v, b, args.prompt, args.steps) for v in VARIANTS}
        ref_t, ref_tok = eager["reference"]
        for v, (t, tok) in eager.items():
            same, total = agree(ref_tok, tok)
            row.update({f"{v}_step_ms": t * 1e3, f"{v}_speedup": ref_t / t,
                        f"{v}_argmax_equal": same, "argmax_total": total})
            line += f"  {v} {t * 1e3:7.2f} ms (x{ref_t / t:4.2f}, {same}/{total})"
        if args.cuda_graphs:
            line += "\n     graphs:"
            for v, (_, tok_eager) in eager.items():
                t, tok = run(model, v, b, args.prompt, args.steps, True)
                same, _ = agree(tok_eager, tok)
                row.update({f"{v}_graph_step_ms": t * 1e3, f"{v}_graph_speedup": ref_t / t,
                            f"{v}_graph_argmax_equal_eager": same})
                line += f"  {v} {t * 1e3:7.2f} ms (x{ref_t / t:4.2f}, {same}/{total})"
        rows.append(row)
        print(line, flush=True)
    fallbacks = registry.fallbacks()  # empty: the guard accepted every real decode step
    path = write_result("decode_gpu_h200", {"model": f"kimi-linear-48b-a3b reduced to {args.layers} "
                        "layers, 8 experts top-2, vocab 1024", "dtype": "bfloat16",
                        "cuda_graphs": args.cuda_graphs, "prompt": args.prompt,
                        "variants": {v: {"kda": k, "mla": m} for v, (k, m) in VARIANTS.items()},
                        "rows": rows, "fallbacks_logged": [list(k) for k in fallbacks]},
                        args.out)
    print(f"fallbacks: {fallbacks}\nwrote {path}")


if __name__ == "__main__":
    main()
