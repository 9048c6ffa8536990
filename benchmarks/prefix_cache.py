"""Prefix cache benchmark: `pdserve bench --workload agentic` and `--workload multiturn` against
the CPU default (`cluster/configs/local-tiny.toml`: 1 prefill + 1 decode instance, tiny preset,
local Ray, state over NIXL), with the prefix cache on (the default) and off
(`[prefill.prefix_cache] enabled = false`).

Agentic: every request is one shared prefix of 90 % of a --prompt-tokens prompt + a random suffix
of its own. Multiturn: one conversation per request in flight, whose first turn is that prompt
and every next turn the previous prompt + its answer + --turn-tokens new tokens. Per concurrency
level: TTFT p50/p90, ITL p50, the prefix cache's hit rate and the prompt tokens prefilled (from
the server's /metrics, `pdserve.bench`), and TTFT p50 with the cache / without it. The first
request of every level is an unmeasured warm-up that primes the cache with the shared prefix,
so a level's hit rate is that of its requests after the first.

Both servers are up at once, each in a process of its own (the load generator does not share
their GIL), and take turns per level, the order reversed every level; both share the CPU
(2 cores here). The pools are sized (--num-pages, prefill and decode) for the longest
conversation at the widest level. Writes `results/prefix_cache_cpu.{json,png}`. Run benchmarks
one at a time:

    flock /tmp/pdserve-bench.lock python benchmarks/prefix_cache.py [--prompt-tokens 4096] \
        [--concurrency 1 8] [--requests 16] [--output-tokens 8] [--turn-tokens 256]
"""
from __future__ import annotations

import argparse
import socket
import sys
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, write_result  # noqa: E402

from pdserve.bench import DEFINITIONS, Workload, run_bench
from pdserve.cluster.config import DEFAULT_CONFIG, load_serve_config
from pdserve.prefill.child import Child, serve_child

NAME = "prefix_cache_cpu"
STARTUP_S = 240.0  # the cluster starts Ray and its actors
SHARED = 0.9       # the shared prefix's part of the prompt
TARGETS = {"hit_rate_min": 0.95, "ttft_p50_ratio_max": 0.2}  # issue 39, at concurrency 1 and 8
LEVEL_KEYS = ("concurrency", "requests", "ok", "errors", "ttft_p50_s", "ttft_p90_s",
              "itl_p50_s", "itl_p90_s", "prefix_hits", "prefix_misses", "prefix_tokens_saved",
              "prefix_hit_rate", "prefill_tokens_computed")


def _server_main(conn, cache: bool, num_pages: int) -> None:
    def build():
        import msgspec

        from pdserve.cluster.serve import running_server

        cfg, model = load_serve_config(DEFAULT_CONFIG)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        r = msgspec.structs.replace
        cfg = r(cfg, api=r(cfg.api, port=port),
                prefill=r(cfg.prefill, num_pages=num_pages,
                          prefix_cache=r(cfg.prefill.prefix_cache, enabled=cache)),
                decode=r(cfg.decode, num_pages=num_pages))
        cm = running_server(cfg, model, progress=lambda m: None)
        url, _ = cm.__enter__()
        return {"url": lambda: url, "close": lambda: cm.__exit__(None, None, None)}

    serve_child(conn, f"prefix-cache-{'on' if cache else 'off'}", build)


def run(prompt_tokens: int, levels: list[int], n: int, output_tokens: int, turn_tokens: int,
        num_pages: int, out_dir: str | Path) -> dict:
    prefix = int(prompt_tokens * SHARED)
    workloads = {
        "agentic": Workload("agentic", output_tokens=output_tokens, prefix_tokens=prefix,
                            suffix_tokens=prompt_tokens - prefix),
        "multiturn": Workload("multiturn", output_tokens=output_tokens, prefix_tokens=prefix,
                              suffix_tokens=prompt_tokens - prefix, turn_tokens=turn_tokens),
    }
    got: dict = {kind: {"on": [], "off": []} for kind in workloads}
    with ExitStack() as stack:
        urls = {}
        for mode in ("on", "off"):
            print(f"starting the server with the prefix cache {mode} ...", flush=True)
            child = stack.enter_context(Child(f"prefix-cache-{mode}", _server_main, mode == "on",
                                              num_pages, start_s=STARTUP_S, log=lambda m: None))
            urls[mode] = child.call("url")
        step = 0
        for kind, workload in workloads.items():
            for c in levels:
                for mode in ("on", "off") if step % 2 == 0 else ("off", "on"):
                    print(f"{kind}, concurrency {c}, cache {mode}", flush=True)
                    res = run_bench(urls[mode], workload, [c], n, timeout=600.0, seed=step,
                                    progress=False)
                    got[kind][mode].append(res["levels"][0] | {"config": res["config"]})
                step += 1
    figures = {"prompt_tokens": prompt_tokens, "shared_prefix_tokens": prefix,
               "output_tokens": output_tokens, "turn_tokens": turn_tokens,
               "requests_per_level": n, "num_pages": num_pages,
               "server": str(DEFAULT_CONFIG.relative_to(DEFAULT_CONFIG.parents[2])),
               "definitions": DEFINITIONS | {
                   "ttft_p50_ratio": "TTFT p50 with the prefix cache / without it",
                   "hit_rate": "prefix_hit_rate of the level with the cache on"},
               "targets": TARGETS, "workloads": {}}
    for kind in workloads:
        rows = []
        for on, off in zip(got[kind]["on"], got[kind]["off"]):
            ratio = (on["ttft_p50_s"] / off["ttft_p50_s"]
                     if on["ttft_p50_s"] and off["ttft_p50_s"] else None)
            rows.append({"concurrency": on["concurrency"], "ttft_p50_ratio": ratio,
                         "hit_rate": on.get("prefix_hit_rate"),
                         "met": bool(ratio is not None and ratio <= TARGETS["ttft_p50_ratio_max"]
                                     and (on.get("prefix_hit_rate") or 0)
                                     >= TARGETS["hit_rate_min"]),
                         "on": {k: on.get(k) for k in LEVEL_KEYS},
                         "off": {k: off.get(k) for k in LEVEL_KEYS},
                         "prompt_tokens_on": [r["prompt_tokens"] for r in on["records"]],
                         "ttft_on_s": [r["ttft_s"] for r in on["records"]],
                         "ttft_off_s": [r["ttft_s"] for r in off["records"]]})
        figures["workloads"][kind] = rows
    path = write_result(NAME, figures, out_dir)
    plot(figures, Path(out_dir) / f"{NAME}.png")
    return figures


def plot(figures: dict, path: Path) -> None:
    """TTFT p50 / p90 on vs off per workload and level, with the hit rate over each bar."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    kinds = list(figures["workloads"])
    fig = Figure(figsize=(6 * len(kinds), 4.2))
    FigureCanvasAgg(fig)
    for ax, kind in zip(fig.subplots(1, len(kinds)), kinds):
        rows = figures["workloads"][kind]
        x = range(len(rows))
        for i, (mode, q, off) in enumerate((("on", "p50", -0.3), ("on", "p90", -0.1),
                                            ("off", "p50", 0.1), ("off", "p90", 0.3))):
            vals = [(r[mode][f"ttft_{q}_s"] or 0) * 1e3 for r in rows]
            bars = ax.bar([j + off for j in x], vals, 0.2, label=f"cache {mode} {q}")
            if (mode, q) == ("on", "p50"):
                for b, r in zip(bars, rows):
                    hr = r["hit_rate"]
                    ax.annotate("" if hr is None else f"hit {hr:.0%}",
                                (b.get_x() + b.get_width() / 2, b.get_height()),
                                textcoords="offset points", xytext=(0, 3), ha="center",
                                fontsize=8)
        ax.set_xticks(list(x), [f"c={r['concurrency']}" for r in rows])
        ax.set(title=f"{kind}: TTFT", ylabel="ms")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"{path.stem}: tiny @ CPU default, {figures['prompt_tokens']}-token prompts, "
                 f"{figures['shared_prefix_tokens']} shared")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--requests", type=int, default=16, help="per level (default 16)")
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--turn-tokens", type=int, default=256,
                   help="multiturn: new tokens per turn after the first (default 256)")
    p.add_argument("--num-pages", type=int, default=1024,
                   help="latent pages of each prefill and decode rank (default 1024)")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    if args.requests < 1 or args.prompt_tokens < 64:
        p.error("--requests must be >= 1 and --prompt-tokens >= 64")
    fig = run(args.prompt_tokens, args.concurrency, args.requests, args.output_tokens,
              args.turn_tokens, args.num_pages, args.out)
    for kind, rows in fig["workloads"].items():
        for r in rows:
            print(f"{kind} c={r['concurrency']}: TTFT p50 on {r['on']['ttft_p50_s']:.3f} s, "
                  f"off {r['off']['ttft_p50_s']:.3f} s, ratio {r['ttft_p50_ratio']:.3f}, "
                  f"hit rate {r['hit_rate']}, prefill tokens on {r['on']['prefill_tokens_computed']}"
                  f" / off {r['off']['prefill_tokens_computed']}")
    print(f"wrote {Path(args.out) / NAME}.json and .png")


if __name__ == "__main__":
    main()
