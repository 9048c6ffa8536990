"""DCP benchmark (CPU, tiny preset): what decode context parallelism buys and costs at a long
context. For DCP = TP = 1, 2, 4 one prefill instance (TP 1) and one decode instance (TP = DCP
= c, interleave 1) run on local Ray with state over NIXL, the same pools per rank
(`--num-pages`). Per DCP it measures:

- admitted concurrency: `predicted + 1` requests of `--context-tokens` + `--output-tokens` are
  submitted at once; the count admitted before one is refused (PoolExhausted), against
  `pdserve.decode.capacity.pool_capacity`'s prediction; and the tokens the instance then holds;
- ITL (inter-token latency, the mean gap between a request's decode tokens) at concurrency 1
  and at DCP 1's admitted concurrency, each request at the long context.

Timings on a shared 2-core CPU are indicative only (every DCP rank is a process on the same two
cores, so DCP here adds collectives without adding compute). Writes
`results/dcp_cpu.{json,png}`. Run benchmarks one at a time:

    flock /tmp/pdserve-bench.lock python benchmarks/dcp.py [--dcp 1 2 4] [--context-tokens 1024]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, write_result  # noqa: E402

LAYOUT_KW = dict(latent_dtype="float32", conv_dtype="float32")


def _prefill(pre, reqs):
    results = pre.ranks.call("prefill", reqs, pre.agents)[0]
    bad = [r.error for r in results if r.error is not None]
    if bad:
        raise RuntimeError(f"prefill failed: {bad[:2]}")
    return [r.handle for r in results]


def _release(pre, dec, handles, limit_s=60.0):
    for h in handles:
        pre.ranks.call("cancel", h.request_id)
    end = time.monotonic() + limit_s
    while not all(st["running"] == 0 and st["pages_free"] == st["pages_total"]
                  for st in dec.ranks.call("stats")):
        if time.monotonic() > end:
            raise RuntimeError("decode state not freed")
        time.sleep(0.05)


def itl(slot, handles, limit_s=300.0) -> float:
    """Mean gap (s) between consecutive decode tokens of `handles`, run together to the end."""
    async def one(h):
        stamps = []
        async for ev in slot.stream(h, h.request_id, deadline_s=limit_s):
            if ev.error is not None:
                raise RuntimeError(ev.error)
            if ev.token is not None:
                stamps.append(time.perf_counter())
        return [b - a for a, b in zip(stamps[1:], stamps[2:])]  # from the 1st decode step

    async def main():
        return await asyncio.gather(*[one(h) for h in handles])
    gaps = [g for per in asyncio.run(main()) for g in per]
    return statistics.fmean(gaps)


def run(dcps, context, output, itl_output, num_pages, num_slots) -> list[dict]:
    import ray

    from pdserve.cluster.actors import start_instance, serve_decode
    from pdserve.cluster.router import DecodeSlot
    from pdserve.decode.capacity import pool_capacity, probe_admission
    from pdserve.model.config import preset
    from pdserve.model.sampling import Request, SamplingParams
    from pdserve.state.block_table import Topology
    from pdserve.state.layout import StateLayout

    layout = StateLayout(**LAYOUT_KW)
    config = preset("tiny")
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    rows, base_conc = [], None
    try:
        most = max(pool_capacity(num_pages, num_slots, num_slots - 1, Topology(c, c, 1),
                                 layout.page_tokens, context, output).admitted for c in dcps)
        pre = start_instance("prefill", "prefill-bench-dcp", 0, 1,
                             dict(config=config, layout=layout, seed=0, num_slots=most + 2,
                                  num_pages=(most + 1) * (context // layout.page_tokens + 1) + 1),
                             1.0, 0, 300, threads=1)
        for c in dcps:
            topo = Topology(c, c, 1)
            dec = start_instance("decode", f"decode-bench-dcp{c}", 0, c,
                                 dict(config=config, layout=layout, seed=0, num_pages=num_pages,
                                      num_slots=num_slots, topology=topo), 1.0, 0, 300,
                                 threads=1)
            pre.ranks.call("connect", dec.agents)
            slot = DecodeSlot(dec, serve_decode(dec, dict(layout=layout,
                                                          eos={config.eos_token_id},
                                                          topology=topo),
                                                num_slots - 1, 256))
            try:
                cap = pool_capacity(num_pages, num_slots, num_slots - 1, topo,
                                    layout.page_tokens, context, output)
                prompt = lambda i: [(31 * i + t) % 256 for t in range(context)]
                long = SamplingParams(max_tokens=output, ignore_eos=True)
                hs = _prefill(pre, [Request(f"d{c}-cap{i}", prompt(i), long)
                                    for i in range(cap.admitted + 1)])
                got, _ = probe_admission(slot, hs, limit_s=300.0)
                _release(pre, dec, hs)
                base_conc = base_conc or got
                short = SamplingParams(max_tokens=itl_output, ignore_eos=True)
                itls = {}
                for conc in sorted({1, base_conc}):
                    hs = _prefill(pre, [Request(f"d{c}-itl{conc}-{i}", prompt(i), short)
                                        for i in range(conc)])
                    itls[conc] = itl(slot, hs)
                    _release(pre, dec, hs)
                rows.append({
                    "dcp": c, "tp": c, "context_tokens": context, "output_tokens": output,
                    "num_pages_per_rank": num_pages, "num_slots_per_rank": num_slots,
                    "predicted_admitted": cap.admitted, "measured_admitted": got,
                    "pages_per_request": cap.pages_per_request,
                    "tokens_held": got * cap.tokens_per_request,
                    "itl_s": {str(k): v for k, v in itls.items()}})
                print(rows[-1], flush=True)
            finally:
                slot.close()
                dec.kill()
        pre.kill()
    finally:
        ray.shutdown()
    base = rows[0]["measured_admitted"]
    for r in rows:
        r["admitted_vs_dcp1"] = r["measured_admitted"] / base
    return rows


def plot(rows: list[dict], path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2)
    x = range(len(rows))
    labels = [f"DCP {r['dcp']}" for r in rows]
    ax1.bar([i - 0.2 for i in x], [r["predicted_admitted"] for r in rows], 0.4, label="predicted")
    ax1.bar([i + 0.2 for i in x], [r["measured_admitted"] for r in rows], 0.4, label="measured")
    ax1.set(title=f"admitted concurrency, {rows[0]['context_tokens']} + "
                  f"{rows[0]['output_tokens']} tokens, {rows[0]['num_pages_per_rank'] - 1} "
                  "pages / rank", ylabel="requests", xticks=list(x))
    ax1.set_xticklabels(labels)
    ax1.legend()
    concs = sorted({k for r in rows for k in r["itl_s"]}, key=int)
    for j, k in enumerate(concs):
        ax2.bar([i + (j - (len(concs) - 1) / 2) * 0.38 for i in x],
                [r["itl_s"].get(k, float("nan")) * 1e3 for r in rows], 0.38,
                label=f"concurrency {k}")
    ax2.set(title="ITL (CPU, 2 shared cores: indicative)", ylabel="ms", xticks=list(x))
    ax2.set_xticklabels(labels)
    ax2.legend()
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dcp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--context-tokens", type=int, default=1024)
    p.add_argument("--output-tokens", type=int, default=1024,
                   help="reserved per request in the admission probe; long, so no admitted request ends before every one is decided (default 1024)")
    p.add_argument("--itl-output-tokens", type=int, default=24)
    p.add_argument("--num-pages", type=int, default=129, help="per rank, page 0 included")
    p.add_argument("--num-slots", type=int, default=33, help="per rank, slot 0 included")
    p.add_argument("--out", default=str(RESULTS))
    a = p.parse_args()
    rows = run(a.dcp, a.context_tokens, a.output_tokens, a.itl_output_tokens, a.num_pages,
               a.num_slots)
    path = write_result("dcp_cpu", {"rows": rows}, a.out)
    png = plot(rows, Path(a.out) / "dcp_cpu.png")
    print(f"wrote {path} and {png}")


if __name__ == "__main__":
    main()
