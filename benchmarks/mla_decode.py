"""Benchmark: CuTe DSL absorbed MLA decode over the paged latent cache (H200).

For B in {1, 8, 64} x L in {1K, 8K, 32K, 128K} x H in {12, 32}, bf16 and fp8 e4m3 caches:
microseconds per call (median of CUDA-graph replays; a graph holds K calls over disjoint page
sets of one pool so that small problems do not sit in the 60 MB L2, and at least MIN_CALLS calls,
so that the graph launch is not charged to one call) and achieved GB/s of latent bytes read
(B x L x 576 x bytes/elem / time) against the floor at 4245 GB/s copy bandwidth.

Each cell runs the launch plan for its shape (kernels/mla_decode/plan.py: the plan the decode
runtime runs), made for this device's properties, with every choice of that plan passed to the
kernel explicitly and recorded in the cell's row. --choice KEY=VALUE (repeatable; plan_call's
keywords, e.g. consumers=1, pool_div=0, fp8_query=split, early_kv=0, combine=4,8) changes a
choice for every cell, for A/B runs.

    python benchmarks/mla_decode.py                     # the grid of record + split sweep
    python benchmarks/mla_decode.py --no-sweep [--kv both|bf16|fp8] [--heads 12,32]
        [--batch 1,8,64] [--ctx 1024,8192,32768,131072] [--choice KEY=VALUE ...] [--out DIR]

Writes `mla_decode_<device>.json` (e.g. mla_decode_h200.json) to benchmarks/results/ (or --out;
--name overrides the file name) through common.write_result.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import capture_graph, event_times_ms, write_result  # noqa: E402

COPY_BW = 4245e9          # measured device-to-device copy bandwidth on the H200 (bytes/s)
SCALE = 192 ** -0.5
PAGE = 64
ROTATE_BYTES = 256 << 20  # graph working set at least this large (L2 is 60 MB)
# calls per graph at least this many, so one graph launch (several us between the start event and
# the first kernel) is not charged to one call; calls past the disjoint sets reuse them, each
# call's pages being larger than L2 then
MIN_CALLS = 16
BOOL_CHOICES = ("early_kv", "deterministic", "lazy_max", "q_half", "xmerge", "qk_joint",
                "pv_prefetch", "bf16_partials")


def device_tag() -> str:
    """'h200' for an NVIDIA H200: the result file's device part."""
    m = re.search(r"\b([A-Z]+\d+[A-Z]?)\b", torch.cuda.get_device_name(0))
    return m.group(1).lower() if m else "gpu"


def parse_choice(text: str) -> tuple[str, object]:
    """'KEY=VALUE' -> (key, value) typed as plan_call takes it; an unknown key or a malformed
    value is refused (SystemExit naming it) before any GPU work."""
    from pdserve.kernels.mla_decode.plan import CHOICES
    key, sep, value = text.partition("=")
    if not sep or key not in CHOICES:
        raise SystemExit(f"choice {text!r}: expected KEY=VALUE with KEY one of {', '.join(CHOICES)}")
    try:
        if key in BOOL_CHOICES:
            if value not in ("0", "1", "true", "false"):
                raise ValueError(value)
            return key, value in ("1", "true")
        if key == "fp8_query":
            if value not in ("single", "split"):
                raise ValueError(value)
            return key, value
        if key == "combine":
            chunks, groups = (int(x) for x in value.split(","))
            return key, (chunks, groups)
        return key, int(value)
    except ValueError:
        raise SystemExit(f"choice {text!r}: bad value for {key}") from None


def bench_one(B, L, H, fp8, reps=15, **choices):
    """One cell: the plan for (B, L, H, cache) with `choices` on top, every resulting choice
    passed to the kernel; a row with the timing and the whole plan."""
    from pdserve.kernels.mla_decode.launch import mla_decode_cutedsl
    from pdserve.kernels.mla_decode.plan import Device, plan_call
    plan = plan_call(B, H, L, fp8, PAGE, Device.of("cuda"), **choices)
    explicit = plan.choices()                 # what the kernel is asked for, in full
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
            mla_decode_cutedsl(qs[k], cache, bts[k % n_sets], seq, SCALE, kv_scale,
                               max_seq_len=L, out=outs[k], lse=lses[k], **explicit)

    g = capture_graph(run_all)
    g.replay()
    torch.cuda.synchronize()
    ok = bool(torch.isfinite(outs[0]).all() and torch.isfinite(lses[0]).all())
    times = [ms * 1e3 / K for ms in event_times_ms(g.replay, reps)]
    us = statistics.median(times)
    floor_us = per_call / COPY_BW * 1e6
    del g, cache
    torch.cuda.empty_cache()
    return dict(B=B, L=L, H=H, kv_dtype="fp8_e4m3" if fp8 else "bf16", plan=plan.record(),
                calls_per_graph=K, us=us, us_min=min(times), us_spread=max(times) - min(times),
                latent_bytes=per_call, gbps=per_call / us / 1e3, floor_us=floor_us,
                frac_of_copy_bw=floor_us / us, launches=1 if plan.num_splits == 1 else 2,
                finite=ok)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    ap.add_argument("--name", default=None, help="result file name (default mla_decode_<device>)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--commit", default=None, help="the tree's commit where it has no .git")
    ap.add_argument("--no-sweep", action="store_true",
                    help="skip the split-count x head-group sweep")
    ap.add_argument("--sweep-only", action="store_true", help="run only that sweep, no grid")
    ap.add_argument("--choice", action="append", default=[],
                    help="KEY=VALUE: a plan choice for every cell (plan_call's keywords)")
    ap.add_argument("--kv", default="both", choices=("both", "bf16", "fp8"),
                    help="cache dtypes to run (A/B runs of an fp8-only choice: fp8)")
    ap.add_argument("--heads", default="12,32", help="comma-separated head counts (default 12,32)")
    ap.add_argument("--batch", default="1,8,64", help="comma-separated batch sizes (default 1,8,64)")
    ap.add_argument("--ctx", default="1024,8192,32768,131072",
                    help="comma-separated context lengths (default 1024,8192,32768,131072)")
    args = ap.parse_args(argv)
    choices = dict(parse_choice(c) for c in args.choice)        # refused before GPU work
    Bs = tuple(int(b) for b in args.batch.split(","))
    Ls = tuple(int(n) for n in args.ctx.split(","))
    Hs = tuple(int(h) for h in args.heads.split(","))
    if args.quick:
        Bs, Ls = (1, 64), (8192, 131072)
    from pdserve.kernels.mla_decode.plan import Device
    dev = Device.of("cuda")
    rows = []
    dtypes = () if args.sweep_only else {"both": (False, True), "bf16": (False,),
                                         "fp8": (True,)}[args.kv]
    for fp8 in dtypes:
        for H in Hs:
            for B in Bs:
                for L in Ls:
                    r = bench_one(B, L, H, fp8, **choices)
                    rows.append(r)
                    print(f"{r['kv_dtype']:9s} H={H:2d} B={B:2d} L={L:6d} "
                          f"splits={r['plan']['num_splits']:3d} {r['us']:9.1f} us  "
                          f"{r['gbps']:7.0f} GB/s  floor {r['floor_us']:8.1f} us "
                          f"({100 * r['frac_of_copy_bw']:5.1f}%)", flush=True)
    # split-count x head-group sweep at small batch, H=32 (to tune choose_num_splits and
    # choose_head_groups)
    sweep = []
    if args.sweep_only or not (args.quick or args.no_sweep):
        for B, L, fp8 in ((1, 8192, False), (1, 8192, True), (1, 32768, False), (8, 32768, False)):
            for sp in (16, 32, 64, 128):
                for hg in (1, 2):
                    if sp * 64 > L or B * sp * hg > 2 * dev.sm_count:
                        continue
                    r = bench_one(B, L, 32, fp8, reps=9, **{**choices, "num_splits": sp,
                                                            "head_groups": hg})
                    sweep.append(r)
                    print(f"sweep {r['kv_dtype']:9s} H=32 B={B} L={L} splits={sp:3d} groups={hg} "
                          f"{r['us']:8.1f} us", flush=True)
    path = write_result(args.name or f"mla_decode_{device_tag()}", dict(
        op="mla_decode", backend="cutedsl", choices=choices,
        device_properties=dict(sm_count=dev.sm_count, smem_per_block=dev.smem_per_block),
        copy_bw_gbps=COPY_BW / 1e9, page_tokens=PAGE, softmax_scale=SCALE,
        timing="median of CUDA-graph replays; K >= MIN_CALLS calls per graph rotating over up "
               "to 64 disjoint page sets (>= 256 MB working set)", min_calls=MIN_CALLS,
        targets=dict(frac_of_copy_bw_where_BxL_ge_256K=0.75, us_at_B1_L8K=10.0),
        results=rows, sweep=sweep), args.out, commit=args.commit)
    # short table last
    print("\nMLA decode (CuTe DSL, the launch plan's defaults"
          + (f" with {choices}" if choices else "") + "): us per call / % of copy-bandwidth floor")
    for kd in ("bf16", "fp8_e4m3"):
        for H in Hs:
            print(f"{kd} H={H}: " + "  ".join(
                f"B{r['B']}L{r['L'] // 1024}K {r['us']:.1f}/{100 * r['frac_of_copy_bw']:.0f}%"
                for r in rows if r["kv_dtype"] == kd and r["H"] == H))
    print("json:", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
