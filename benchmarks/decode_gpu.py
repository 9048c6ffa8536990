"""Decode step on the H200 for a kimi-linear-48b-a3b layer stack (bf16 weights, fp32 KDA state,
bf16 conv state and latent), reference backend vs the `cutedsl` backend (the fused CuTe DSL KDA
decode op plugged in through the kernel registry), eager. With --cuda-graphs the reference
step is also captured (`pdserve.decode.graphs`, one graph for the batch size) and its replayed
step latency reported next to the eager one, and likewise the cutedsl step (its KDA op captured
inside the graph); a step's time includes copying its inputs in. Every variant gets the same
input tokens every step; the argmax agreement of each graph with its eager backend is reported.

    python benchmarks/decode_gpu.py [--layers 4] [--batches 1 8 32 64] [--steps 20]
                                    [--cuda-graphs] [--out DIR]
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
from pdserve.decode.rank import kda_step_for
from pdserve.kernels import registry
from pdserve.model.batch import ForwardBatch
from pdserve.model.config import reduced_kimi_linear
from pdserve.model.generate import ReferenceEngine, build_model
from pdserve.model.sampling import Request, SamplingParams
from pdserve.state.layout import StateLayout

LAYOUT = StateLayout(latent_dtype="bfloat16", recurrent_dtype="float32", conv_dtype="bfloat16")


def run(model, backend, batch, prompt, steps, cuda_graphs=False):
    eng = ReferenceEngine(model, LAYOUT, num_pages=batch * (prompt // 64 + 4) + 1,
                          num_slots=batch + 1)
    seqs = [eng.admit(Request(f"r{i}", [(7 * i + j) % 1024 for j in range(prompt)],
                              SamplingParams(max_tokens=steps + 4, ignore_eos=True)))
            for i in range(batch)]
    eng.prefill(seqs)
    step = kda_step_for(backend)
    graphs = (DecodeGraphs(model, eng.pools, prompt + steps + 3, buckets=(batch,), kda_step=step)
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
            logits = model(ids, batch_, eng.pools, logit_rows=batch_.last_rows(), kda_step=step)
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
                    help="also time the reference step replayed from a CUDA graph")
    args = ap.parse_args()
    config = reduced_kimi_linear(args.layers, num_experts=8, top_k=2, vocab_size=1024)
    model = build_model(config, dtype=torch.bfloat16, seed=0).cuda()
    rows = []
    for b in args.batches:
        ref_t, ref_tok = run(model, "reference", b, args.prompt, args.steps)
        fast_t, fast_tok = run(model, "cutedsl", b, args.prompt, args.steps)
        same, total = agree(ref_tok, fast_tok)
        row = {"batch": b, "reference_step_ms": ref_t * 1e3, "cutedsl_step_ms": fast_t * 1e3,
               "speedup": ref_t / fast_t, "argmax_equal": same, "argmax_total": total}
        line = (f"batch {b:3d}: reference {ref_t * 1e3:7.2f} ms  cutedsl {fast_t * 1e3:7.2f} ms  "
                f"x{ref_t / fast_t:4.2f}  same argmax {same}/{total}")
        if args.cuda_graphs:
            graph_t, graph_tok = run(model, "reference", b, args.prompt, args.steps, True)
            fast_graph_t, fast_graph_tok = run(model, "cutedsl", b, args.prompt, args.steps, True)
            g_same, _ = agree(ref_tok, graph_tok)
            fg_same, _ = agree(fast_tok, fast_graph_tok)
            row.update({"reference_graph_step_ms": graph_t * 1e3,
                        "graph_speedup": ref_t / graph_t, "graph_argmax_equal": g_same,
                        "cutedsl_graph_step_ms": fast_graph_t * 1e3,
                        "cutedsl_graph_argmax_equal_cutedsl": fg_same})
            line += (f"\n           graphs: reference {graph_t * 1e3:7.2f} ms (x{ref_t / graph_t:4.2f}, "
                     f"same argmax {g_same}/{total})  cutedsl {fast_graph_t * 1e3:7.2f} ms "
                     f"(same argmax as eager cutedsl {fg_same}/{total})")
        rows.append(row)
        print(line)
    fallbacks = registry.fallbacks()  # empty: the guard accepted every real decode step
    path = write_result("decode_gpu_h200", {"model": f"kimi-linear-48b-a3b reduced to {args.layers} "
                        "layers, 8 experts top-2, vocab 1024", "dtype": "bfloat16",
                        "cuda_graphs": args.cuda_graphs, "rows": rows, "fallbacks_logged": [list(k) for k in fallbacks]},
                        args.out)
    print(f"fallbacks: {fallbacks}\nwrote {path}")


if __name__ == "__main__":
    main()
