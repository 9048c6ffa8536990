"""The decode projection op (y = x @ W^T, bf16, B <= 64) at the Kimi-Linear-48B-A3B decode
shapes on one GPU: the CuTe DSL split-K kernel against cuBLAS (torch.mm, the reference), each
as a CUDA graph of calls over enough weight copies that W comes from DRAM, not L2.

Shapes [N, K] (pdserve/decode/fused_step.py, the kimi-linear preset): o_proj [2304, 4096] (KDA
and MLA alike: 32 heads x 128), the KDA in-projection [12576, 2304] (q, k, v 3 x 4096; f_a, g_a
2 x 128; b 32), MLA's q + kv_a [6720, 2304] (32 x 192 + 512 + 64). GB/s = weight bytes / time.

    python benchmarks/decode_linear.py [--batches 1 8 32 64] [--sweep [--sweep-batches 1 64]]
                                       [--out DIR] [--commit SHA]

--sweep also times the tuning arguments (bm, splits, stages, pdl) per shape at the
--sweep-batches (default 1 and 64).
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import capture_graph, event_times_ms, write_result  # noqa: E402

SHAPES = {"o_proj": (2304, 4096), "kda_in_proj": (12576, 2304), "mla_q_kv_a": (6720, 2304)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default=None, help="result directory (default benchmarks/results)")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--sweep", action="store_true", help="also time the tuning arguments")
    ap.add_argument("--sweep-batches", type=int, nargs="+", default=[1, 64],
                    help="batches the sweep times (default 1 64)")
    args = ap.parse_args(argv)

    import torch
    if not torch.cuda.is_available():
        print("decode_linear: needs a CUDA GPU", file=sys.stderr)
        return 2
    from pdserve.kernels.decode_linear import decode_linear_reference
    from pdserve.kernels.decode_linear.cutedsl import (DEFAULT_BM, DEFAULT_STAGES,
                                                       default_splits, launch, sm_count)
    dev = torch.device("cuda", 0)
    sms = sm_count(dev)
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    bf = dict(dtype=torch.bfloat16, device="cuda")

    def time_us(impl, x, ws):
        def run_all():
            for w in ws:
                impl(x, w)
        g = capture_graph(run_all)
        return 1000 * statistics.median(event_times_ms(g.replay, args.reps, warmup=3)) / len(ws)

    rows, sweep = [], []
    for name in args.shapes:
        N, K = SHAPES[name]
        nbytes = N * K * 2
        copies = max(2, math.ceil(3 * l2 / nbytes))      # rotate through 3x the L2
        ws = [torch.randn(N, K, **bf, generator=gen) / K ** 0.5 for _ in range(copies)]
        for B in args.batches:
            x = torch.randn(B, K, **bf, generator=gen)
            bm, stages = DEFAULT_BM, DEFAULT_STAGES
            splits = default_splits(N, K, bm, sms)
            row = {"shape": name, "n": N, "k": K, "batch": B, "weight_bytes": nbytes,
                   "copies": copies, "bm": bm, "splits": splits, "stages": stages,
                   "grid": math.ceil(N / bm) * splits}
            for impl_name, impl in (("cutedsl", launch), ("cublas", decode_linear_reference)):
                us = time_us(impl, x, ws)
                row[f"{impl_name}_us"] = round(us, 2)
                row[f"{impl_name}_gbps"] = round(nbytes / us / 1e3, 1)
            ref = x.double() @ ws[0].double().t()
            got = launch(x, ws[0]).double()
            row["max_rel_err"] = float((got - ref).abs().max() / ref.abs().max())
            row["speedup"] = round(row["cublas_us"] / row["cutedsl_us"], 3)
            rows.append(row)
            print(f"{name:12s} [{N:5d}, {K:4d}] B={B:2d} bm {bm:3d} splits {splits:2d}  "
                  f"cutedsl {row['cutedsl_us']:6.2f} us ({row['cutedsl_gbps']:6.0f} GB/s)  "
                  f"cublas {row['cublas_us']:6.2f} us ({row['cublas_gbps']:6.0f} GB/s)  "
                  f"x{row['speedup']:.2f}  err {row['max_rel_err']:.1e}", flush=True)
            if args.sweep and B in args.sweep_batches:
                kt = K // 64
                for bm_ in (64, 128):
                    m_tiles = math.ceil(N / bm_)
                    for sp in (d for d in range(1, kt + 1)
                               if kt % d == 0 and sms // 2 <= m_tiles * d <= 3 * sms):
                        for stages in (4, 6, 8):
                            for pdl in (True, False):
                                def impl(a, w, bm_=bm_, sp=sp, stages=stages, pdl=pdl):
                                    return launch(a, w, bm=bm_, splits=sp, stages=stages,
                                                  pdl=pdl)
                                us = round(time_us(impl, x, ws), 2)
                                sweep.append({"shape": name, "batch": B, "bm": bm_,
                                              "splits": sp, "stages": stages, "pdl": pdl,
                                              "us": us})
                best = min((s for s in sweep if s["shape"] == name and s["batch"] == B),
                           key=lambda s: s["us"])
                print(f"  sweep best: bm {best['bm']} splits {best['splits']} stages "
                      f"{best['stages']} pdl {best['pdl']:d}: {best['us']:.2f} us", flush=True)
        del ws
    print(f"\n{'shape':12s} {'B':>3s} {'cutedsl us':>10s} {'GB/s':>6s} {'cublas us':>10s} "
          f"{'GB/s':>6s} {'speedup':>7s}")
    for r in rows:
        print(f"{r['shape']:12s} {r['batch']:3d} {r['cutedsl_us']:10.2f} {r['cutedsl_gbps']:6.0f} "
              f"{r['cublas_us']:10.2f} {r['cublas_gbps']:6.0f} {r['speedup']:7.2f}")
    name = torch.cuda.get_device_name(0).lower().replace("nvidia ", "").replace(" ", "_")
    path = write_result(f"decode_linear_{name}", {"rows": rows, "sweep": sweep,
                                                   "shapes": SHAPES, "l2_bytes": l2},
                        args.out, args.commit)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
