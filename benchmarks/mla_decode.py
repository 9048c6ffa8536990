"""Benchmark: CuTe DSL absorbed MLA decode over the paged latent cache (H200).

For B in {1, 8, 64} x L in {1K, 8K, 32K, 128K} x H in {12, 32}, bf16 and fp8 e4m3 caches:
microseconds per call (median of CUDA-graph replays; a graph holds K calls over disjoint page
sets of one pool so that small problems do not sit in the 60 MB L2, and at least MIN_CALLS calls,
so that the graph launch is not charged to one call) and achieved GB/s of latent
bytes read (B x L x 576 x bytes/elem / time) against the floor at 4245 GB/s copy bandwidth.
The core, split count and head groups are fixed before capture (cutedsl.plan_call from B, L, H
and the cache dtype) and recorded in each row.

    python benchmarks/mla_decode.py [--json PATH] [--quick] [--no-sweep | --sweep-only]
                                    [--early-kv]
                                    [--core auto|mma|wgmma|swapab] [--kv both|bf16|fp8]
                                    [--heads 12,32] [--batch 1,8,64]
                                    [--ctx 1024,8192,32768,131072]

PDSERVE_MLA_* environment switches (e.g. PDSERVE_MLA_SWAPAB_PV) go in front of the
command and are recorded in the JSON ("env"); PDSERVE_MLA_FP8_QUERY=split runs the fp8 cells
with the two-term query instead of the default single one (each fp8 row records fp8_query).

--core picks the attention core (default: cutedsl.CORE, "auto" = cutedsl.choose_core per cell);
the JSON defaults to benchmarks/results/mla_decode_h200.json for "mma", and
mla_decode_h200_<core>.json otherwise, with "_early_kv" appended under --early-kv. --early-kv
lets the kernel read the cache before the PDL wait (the benchmark's previous kernel writes none
of it). The swapab core's consumer warpgroups and tile-pool share are the launcher's for each
cell (cutedsl.call_variant; recorded in each row as consumers and pool_div), as is its
latent split (d_split); PDSERVE_MLA_SWAPAB_CONSUMERS=1|2, PDSERVE_MLA_SWAPAB_POOL=0|2|4|8 and
PDSERVE_MLA_SWAPAB_DSPLIT=1|2 override.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import capture_graph, environment, event_times_ms  # noqa: E402

COPY_BW = 4245e9          # measured device-to-device copy bandwidth on the H200 (bytes/s)
SCALE = 192 ** -0.5
PAGE = 64
ROTATE_BYTES = 256 << 20  # graph working set at least this large (L2 is 60 MB)
# calls per graph at least this many, so one graph launch (several us between the start event and
# the first kernel) is not charged to one call; calls past the disjoint sets reuse them, each
# call's pages being larger than L2 then
MIN_CALLS = 16


def bench_one(B, L, H, fp8, reps=15, splits=None, core=None, early_kv=False, head_groups=None):
    from pdserve.kernels.mla_decode.cutedsl import (call_variant, mla_decode_cutedsl, plan_call,
                                                    resolve_fp8_query)
    core, splits, head_groups = plan_call(B, H, L, fp8, core, early_kv, splits, head_groups)
    fp8_query = resolve_fp8_query(None, core, fp8)     # the launcher's (PDSERVE_MLA_FP8_QUERY)
    # the kernel these calls run: the swapab core's consumer warpgroups, tile pool share
    # (1 / pool_div of each split's tiles; 0: none) and latent split
    k, _ = call_variant(fp8, H // head_groups, PAGE, core, early_kv, head_groups, L, splits,
                        batch=B * head_groups)
    consumers, pool_div, d_split = ((k.consumers, k.pool_div, k.d_split) if core == "swapab"
                                    else (None, 0, 1))
    esize = 1 if fp8 else 2
    per_call = B * L * 576 * esize
    n_sets = max(1, min(64, -(-ROTATE_BYTES // per_call)))     # disjoint page sets
    K = max(MIN_CALLS, n_sets)                                   # calls per graph, rotating
    pages_per_req = -(-L // PAGE)
    num_pages = 1 + n_sets * B * pages_per_req
    kv_scale = 0.05 if fp8 else None
    cache = torch.empty(num_pages, PAGE, 576, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16,
                        device="cuda")
    for c in cache.split(2048):                                  # random, never zeros
        r = torch.randn(c.shape, device="cuda")
        c.copy_((r * 2 / kv_scale).clamp(-440, 440) if fp8 else r)
    perm = (torch.randperm(num_pages - 1, device="cuda") + 1).to(torch.int32)
    bts = perm.view(n_sets, B, pages_per_req).contiguous()
    seq = torch.full((B,), L, dtype=torch.int32, device="cuda")
    qs = [torch.randn(B, H, 576, device="cuda").to(torch.bfloat16) for _ in range(K)]
    outs = [torch.empty(B, H, 512, dtype=torch.bfloat16, device="cuda") for _ in range(K)]
    lses = [torch.empty(B, H, dtype=torch.float32, device="cuda") for _ in range(K)]

    def run_all():
        for k in range(K):
            mla_decode_cutedsl(qs[k], cache, bts[k % n_sets], seq, SCALE, kv_scale, num_splits=splits,
                               max_seq_len=L, out=outs[k], lse=lses[k], core=core,
                               head_groups=head_groups, early_kv=early_kv)

    g = capture_graph(run_all)
    g.replay()
    torch.cuda.synchronize()
    ok = bool(torch.isfinite(outs[0]).all() and torch.isfinite(lses[0]).all())
    times = [ms * 1e3 / K for ms in event_times_ms(g.replay, reps)]
    us = statistics.median(times)
    floor_us = per_call / COPY_BW * 1e6
    del g, cache
    torch.cuda.empty_cache()
    return dict(B=B, L=L, H=H, kv_dtype="fp8_e4m3" if fp8 else "bf16", core=core, early_kv=early_kv,
                num_splits=splits, head_groups=head_groups, consumers=consumers, pool_div=pool_div,
                d_split=d_split,
                fp8_query=fp8_query if fp8 else None,
                calls_per_graph=K, us=us, us_min=min(times), us_spread=max(times) - min(times),
                latent_bytes=per_call, gbps=per_call / us / 1e3, floor_us=floor_us,
                frac_of_copy_bw=floor_us / us, launches=1 if splits == 1 else 2, finite=ok,
                # MMA operand type of the fp8 cache: wgmma widens tiles to bf16, the others fp16
                fp8_mma=None if not fp8 else ("bf16" if core == "wgmma" else "f16"))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--core", default=None, choices=("auto", "mma", "wgmma", "swapab"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-sweep", action="store_true",
                    help="skip the split-count x head-group sweep")
    ap.add_argument("--sweep-only", action="store_true", help="run only that sweep, no grid")
    ap.add_argument("--early-kv", action="store_true",
                    help="read the cache before the PDL wait (the previous kernel writes none of it)")
    ap.add_argument("--kv", default="both", choices=("both", "bf16", "fp8"),
                    help="cache dtypes to run (A/B runs of an fp8-only switch: fp8)")
    ap.add_argument("--heads", default="12,32", help="comma-separated head counts (default 12,32)")
    ap.add_argument("--batch", default="1,8,64", help="comma-separated batch sizes (default 1,8,64)")
    ap.add_argument("--ctx", default="1024,8192,32768,131072",
                    help="comma-separated context lengths (default 1024,8192,32768,131072)")
    args = ap.parse_args(argv)
    from pdserve.kernels.mla_decode.cutedsl import CORE
    core = args.core or CORE
    if args.json is None:
        args.json = ("benchmarks/results/mla_decode_h200" + ("" if core == "mma" else f"_{core}")
                     + ("_early_kv" if args.early_kv else "") + ".json")
    Bs = tuple(int(b) for b in args.batch.split(","))
    Ls = tuple(int(n) for n in args.ctx.split(","))
    Hs = tuple(int(h) for h in args.heads.split(","))
    if args.quick:
        Bs, Ls = (1, 64), (8192, 131072)
    rows = []
    dtypes = () if args.sweep_only else {"both": (False, True), "bf16": (False,),
                                         "fp8": (True,)}[args.kv]
    for fp8 in dtypes:
        for H in Hs:
            for B in Bs:
                for L in Ls:
                    r = bench_one(B, L, H, fp8, core=core, early_kv=args.early_kv)
                    rows.append(r)
                    print(f"{r['kv_dtype']:9s} H={H:2d} B={B:2d} L={L:6d} splits={r['num_splits']:3d} "
                          f"{r['us']:9.1f} us  {r['gbps']:7.0f} GB/s  floor {r['floor_us']:8.1f} us "
                          f"({100 * r['frac_of_copy_bw']:5.1f}%)", flush=True)
    # split-count x head-group sweep at small batch, H=32 (to tune choose_num_splits and
    # choose_head_groups; the swapab core, the only one with head groups)
    sweep = []
    if args.sweep_only or not (args.quick or args.no_sweep):
        for B, L, fp8 in ((1, 8192, False), (1, 8192, True), (1, 32768, False), (8, 32768, False)):
            for sp in (16, 32, 64, 128):
                for hg in (1, 2):
                    if sp * 64 > L or B * sp * hg > 2 * 132 or (hg > 1 and core not in ("auto", "swapab")):
                        continue
                    r = bench_one(B, L, 32, fp8, reps=9, splits=sp, core=core,
                                  early_kv=args.early_kv, head_groups=hg)
                    sweep.append(r)
                    print(f"sweep {r['kv_dtype']:9s} H=32 B={B} L={L} splits={sp:3d} groups={hg} "
                          f"{r['us']:8.1f} us", flush=True)
    res = dict(
        op="mla_decode", backend="cutedsl", core=core, early_kv=args.early_kv,
        environment=environment(), copy_bw_gbps=COPY_BW / 1e9, page_tokens=PAGE, softmax_scale=SCALE,
        timing="median of CUDA-graph replays; K >= MIN_CALLS calls per graph rotating over up to 64 disjoint page sets (>= 256 MB working set)", min_calls=MIN_CALLS,
        targets=dict(frac_of_copy_bw_where_BxL_ge_256K=0.75, us_at_B1_L8K=10.0),
        env={k: v for k, v in sorted(os.environ.items()) if k.startswith("PDSERVE_MLA")},
        results=rows,
        sweep=sweep,
    )
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1)
    # short table last
    print(f"\nMLA decode (CuTe DSL, {core} core, H200): us per call / % of copy-bandwidth floor")
    for kd in ("bf16", "fp8_e4m3"):
        for H in Hs:
            print(f"{kd} H={H}: " + "  ".join(
                f"B{r['B']}L{r['L'] // 1024}K {r['us']:.1f}/{100 * r['frac_of_copy_bw']:.0f}%"
                for r in rows if r["kv_dtype"] == kd and r["H"] == H))
    print("json:", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
