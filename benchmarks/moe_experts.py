"""The routed-experts op at Kimi-Linear-48B-A3B shapes (256 experts top-8 + 1 shared, hidden
2304, expert intermediate 1024, bf16) on one GPU: the CuTe DSL kernel against the torch
reference (torch's grouped GEMMs), each as a CUDA graph of `layers` calls over that many
weight sets (so the chosen experts' bytes come from DRAM, not L2), per batch and routing.

Routing "concentrated": every token on experts 0..k-1 (vLLM's dummy weights route so, and the
decode-step figures use it); "random": each token's own k experts. Bytes are the weights of
the experts some token chose (plus the shared one), read once per call; GB/s = bytes / time.

    python benchmarks/moe_experts.py [--batches 1 8 32 64] [--sweep] [--out DIR] [--commit SHA]

--sweep also times the kernel's tuning arguments (ring stages, CTAs per SM, PDL) at B = 1
and 32, concentrated routing.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import capture_graph, event_times_ms, write_result  # noqa: E402

H, I, E, K = 2304, 1024, 256, 8


def routing(B: int, kind: str, gen):
    """(pair_token, group_end) of the router's layout for `kind` (shared expert last)."""
    import torch
    from pdserve.kernels.moe_route import moe_route_reference
    logits = torch.randn(B, E, device="cuda", generator=gen)
    if kind == "concentrated":
        logits[:, :K] += 20.0
    S = K + 1
    i32 = dict(dtype=torch.int32, device="cuda")
    outs = (torch.empty(B * S, **i32), torch.empty(B * S, device="cuda"),
            torch.empty(B, S, **i32), torch.empty(E + 1, **i32))
    moe_route_reference(logits, None, K, 1, 1, "sigmoid", True, 1.0, 1, *outs)
    return outs[0], outs[3]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--routing", nargs="+", default=["concentrated", "random"],
                    choices=["concentrated", "random"])
    ap.add_argument("--layers", type=int, default=4, help="weight sets per graph (default 4)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default=None, help="result directory (default benchmarks/results)")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--sweep", action="store_true", help="also time the tuning arguments")
    args = ap.parse_args(argv)

    import torch
    if not torch.cuda.is_available():
        print("moe_experts: needs a CUDA GPU", file=sys.stderr)
        return 2
    from pdserve.kernels.moe_experts import moe_experts_cutedsl, moe_experts_reference
    from pdserve.kernels.moe_experts.cutedsl import launch
    gen = torch.Generator(device="cuda").manual_seed(0)
    bf = dict(dtype=torch.bfloat16, device="cuda")
    G = E + 1
    sets = [((torch.randn(G, 2 * I, H, **bf, generator=gen) * 0.02),
             (torch.randn(G, H, I, **bf, generator=gen) * 0.02)) for _ in range(args.layers)]
    expert_bytes = 3 * H * I * 2

    def time_us(impl, x, pair_token, group_end):
        def run_all():
            for w13, w2 in sets:
                impl(x, w13, w2, pair_token, group_end)
        g = capture_graph(run_all)
        return 1000 * statistics.median(event_times_ms(g.replay, args.reps, warmup=3)) / len(sets)

    rows, sweep = [], []
    for kind in args.routing:
        for B in args.batches:
            x = torch.randn(B, H, **bf, generator=gen)
            pair_token, group_end = routing(B, kind, gen)
            touched = int((torch.diff(group_end, prepend=group_end.new_zeros(1)) > 0).sum())
            nbytes = touched * expert_bytes
            row = {"batch": B, "routing": kind, "experts_touched": touched,
                   "bytes_per_call": nbytes}
            for name, impl in (("cutedsl", moe_experts_cutedsl),
                               ("reference", moe_experts_reference)):
                us = time_us(impl, x, pair_token, group_end)
                row[f"{name}_us"] = round(us, 2)
                row[f"{name}_gbps"] = round(nbytes / us / 1e3, 1)
            want = moe_experts_reference(x, *sets[0], pair_token, group_end).float()
            got = moe_experts_cutedsl(x, *sets[0], pair_token, group_end).float()
            row["max_rel_err"] = float((got - want).abs().max() / want.abs().max())
            row["speedup"] = round(row["reference_us"] / row["cutedsl_us"], 3)
            rows.append(row)
            print(f"{kind:12s} B={B:3d} experts {touched:3d}  cutedsl {row['cutedsl_us']:7.1f} us "
                  f"({row['cutedsl_gbps']:6.0f} GB/s)  reference {row['reference_us']:7.1f} us "
                  f"({row['reference_gbps']:6.0f} GB/s)  x{row['speedup']:.2f}  "
                  f"err {row['max_rel_err']:.1e}", flush=True)
    if args.sweep:
        for B in (1, 32):
            x = torch.randn(B, H, **bf, generator=gen)
            pair_token, group_end = routing(B, "concentrated", gen)
            for stages in (2, 4, 6):
                for ctas in (1, 2, 3):
                    for pdl in (True, False):
                        def impl(*a, stages=stages, ctas=ctas, pdl=pdl):
                            return launch(*a, stages=stages, ctas_per_sm=ctas, pdl=pdl)
                        us = round(time_us(impl, x, pair_token, group_end), 2)
                        sweep.append({"batch": B, "stages": stages, "ctas_per_sm": ctas,
                                      "pdl": pdl, "us": us})
                        print(f"sweep B={B:2d} stages {stages} ctas/SM {ctas} pdl {pdl:d}: "
                              f"{us:7.1f} us", flush=True)
    dev = torch.cuda.get_device_name(0).lower().replace("nvidia ", "").replace(" ", "_")
    path = write_result(f"moe_experts_{dev}", {"rows": rows, "sweep": sweep, "shapes": {
        "hidden": H, "inter": I, "experts": E, "top_k": K, "shared": 1}}, args.out, args.commit)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
