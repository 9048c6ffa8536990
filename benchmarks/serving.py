"""Serving benchmark: what disaggregation costs. `pdserve bench`'s load generator (`run_bench`)
against the default disaggregated cluster (`cluster/configs/local-tiny.toml`: 1 prefill + 1 decode
instance on local Ray, state over NIXL) and against its monolithic mode
(`local-tiny-monolithic.toml`: the same model and resources per rank, one instance whose rank
prefills and decodes, no transfer), both started as `pdserve serve` starts them. Tiny preset, a
small agentic workload (one shared prefix + a random suffix per request; 512 + 64 tokens instead
of an agent's thousands, for the CPU). Writes
`results/serving_{monolithic,disaggregated,overhead}_cpu.{json,png}`.

For reference only, the same sweep against the in-process engine (`LocalBackend` over a
`ReferenceEngine` in the server's own process: no Ray, no rank actor, torch threads as one rank's)
goes to `results/serving_inprocess_cpu.{json,png}` and the overhead file's `vs_inprocess` rows;
`--no-inprocess` skips it. The targets compare against the monolithic mode.

Head of line (`results/serving_hol_cpu.json`): on the monolithic and disaggregated servers, the
TTFT of short requests sent one at a time alone, then while one `--hol-tokens`-token prompt
prefills (issue 37's target: the p50 within 2x of alone); `--hol-tokens 0` skips it.

Each server runs in a process of its own and the load generator in this one, so neither server
shares the generator's GIL; all of them share the CPU (2 cores here): compare backends within one
machine and one run setup, not across machines. All servers are up at once and take turns in
blocks of `--requests` requests, `--rounds` blocks each per concurrency level, in ABBA order
with the same prompts: a shared machine's load drifts within minutes, and one server measured
after the other would be charged that drift (an idle server polls its ranks once a second). A
level's percentiles are the mean of its blocks'. Run benchmarks one at a time:

    flock /tmp/pdserve-bench.lock python benchmarks/serving.py [--concurrency 1 2 4] \
        [--requests 8] [--rounds 6] [--prefix-tokens 512] [--no-inprocess] [--hol-tokens 16000]
"""
from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import sys
import threading
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS  # noqa: E402

from pdserve.api.backend import LocalBackend
from pdserve.api.server import create_app
from pdserve.api.serving import serve_in_thread
from pdserve.api.tokenizer import ByteLevelTokenizer
from pdserve.bench import Workload, format_table, run_bench, save
from pdserve.cluster.config import DEFAULT_CONFIG, load_serve_config
from pdserve.model.generate import ReferenceEngine, build_model
from pdserve.prefill.child import Child, serve_child

CONFIGS = {"disaggregated": DEFAULT_CONFIG,
           "monolithic": DEFAULT_CONFIG.parent / "local-tiny-monolithic.toml"}
STARTUP_S = 180.0  # the cluster starts Ray and its actors
TARGETS_PCT = {"ttft_p50_s": 15.0, "itl_p50_s": 5.0}  # issue 5: overhead on the CPU default
HOL_TARGET = 2.0  # issue 37: short TTFT p50 with a long prompt prefilling / alone
HOL_SHORT_TOKENS = 19


def _server_main(conn, kind: str) -> None:
    """A server in a process of its own (so the load generator does not share its GIL)."""
    def build():
        import msgspec

        # the in-process engine is sized like a monolithic rank
        cfg, model = load_serve_config(CONFIGS.get(kind, CONFIGS["monolithic"]))
        if kind == "inprocess":
            res = cfg.resources
            torch.set_num_threads(res.torch_threads or max(1, int(res.cpus_per_rank + 0.999)))
            engine = ReferenceEngine(build_model(model, seed=cfg.model.seed),
                                     cfg.layout(cfg.decode.conv_layout), cfg.decode.num_pages,
                                     cfg.decode.num_slots)
            backend = LocalBackend(engine, cfg.decode.max_batch, cfg.api.max_queue, cfg.model.name)
            cm = serve_in_thread(create_app(backend, ByteLevelTokenizer(),
                                            request_timeout_s=cfg.api.request_timeout_s))
            url = cm.__enter__()
        else:
            from pdserve.cluster.serve import running_server

            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            cfg = msgspec.structs.replace(cfg, api=msgspec.structs.replace(cfg.api, port=port))
            cm = running_server(cfg, model, progress=lambda m: None)
            url, _ = cm.__enter__()
        return {"url": lambda: url, "close": lambda: cm.__exit__(None, None, None)}

    serve_child(conn, f"{kind}-server", build)


NAMES = {"monolithic": "serving_monolithic_cpu", "disaggregated": "serving_disaggregated_cpu",
         "inprocess": "serving_inprocess_cpu"}
# percentiles of one level: with several rounds, the mean of the rounds' values
PERCENTILES = ("ttft_p50_s", "ttft_p90_s", "itl_p50_s", "itl_p90_s", "e2e_p50_s", "e2e_p90_s",
               "interactivity_p50_tok_s", "interactivity_p90_tok_s")


def merge(kind: str, blocks: dict[int, list[dict]]) -> dict:
    """One result from a kind's blocks (per concurrency level, each a one-level sweep): counts
    and wall time add up, each percentile is the mean of the blocks' (blocks alternate between
    the servers, so the machine's drifting load falls on every server alike), records
    concatenate, and every block's own summary is kept under `rounds`."""
    first = blocks[min(blocks)][0]
    result = dict(first)
    rounds = len(blocks[min(blocks)])
    result["config"] = dict(first["config"], backend=NAMES[kind], concurrency=list(blocks),
                            rounds=rounds, seeds=list(range(rounds)),
                            requests_per_level=rounds * first["config"]["requests_per_level"],
                            server=kind if kind == "inprocess" else str(
                                CONFIGS[kind].relative_to(DEFAULT_CONFIG.parents[2])))
    result["definitions"] = dict(first["definitions"], rounds=merge.__doc__.split(": ", 1)[1])
    levels = []
    for c, runs in blocks.items():
        lvs = [r["levels"][0] for r in runs]
        errors = Counter()
        for lv in lvs:
            errors.update(lv["errors"])
        tokens, wall = sum(lv["output_tokens"] for lv in lvs), sum(lv["wall_s"] for lv in lvs)
        level = {"concurrency": c, "requests": sum(lv["requests"] for lv in lvs),
                 "ok": sum(lv["ok"] for lv in lvs), "errors": dict(errors),
                 "error_examples": {k: v for lv in lvs for k, v in lv["error_examples"].items()},
                 "output_tokens": tokens, "wall_s": wall, "throughput_tok_s": tokens / wall}
        for key in PERCENTILES:
            values = [lv[key] for lv in lvs if lv[key] is not None]
            level[key] = sum(values) / len(values) if values else None
        level["rounds"] = [{k: v for k, v in lv.items() if k != "records"} for lv in lvs]
        level["records"] = [rec for lv in lvs for rec in lv["records"]]
        levels.append(level)
    result["levels"] = levels
    return result


def _ttft(url: str, prompt: str, max_tokens: int = 2) -> float:
    """Seconds from sending a streamed completion to its first token."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                return time.perf_counter() - t0
    raise RuntimeError(f"{url}: a stream without a token")


def head_of_line(url: str, long_tokens: int, n: int, seed: int = 0) -> dict:
    """The TTFT of `n` short requests sent one after another alone, then of those sent one
    after another (0.2 s apart) while one `long_tokens`-token prompt prefills."""
    rng = random.Random(seed)

    def text(k: int) -> str:
        return "".join(chr(rng.randrange(32, 127)) for _ in range(k))

    alone = [_ttft(url, text(HOL_SHORT_TOKENS)) for _ in range(n)]
    long: dict = {}
    first = threading.Thread(target=lambda: long.update(ttft_s=_ttft(url, text(long_tokens))))
    first.start()
    time.sleep(0.5)  # the long prompt is under way
    during = []
    while first.is_alive() and len(during) < n:
        during.append(_ttft(url, text(HOL_SHORT_TOKENS)))
        time.sleep(0.2)
    first.join()
    p50 = {"alone": statistics.median(alone), "during": statistics.median(during)}
    return {"long_prompt_tokens": long_tokens, "short_prompt_tokens": HOL_SHORT_TOKENS,
            "short_ttft_alone_s": alone, "short_ttft_during_s": during,
            "long_ttft_s": long.get("ttft_s"), "short_ttft_p50_alone_s": p50["alone"],
            "short_ttft_p50_during_s": p50["during"],
            "ratio_p50": p50["during"] / p50["alone"]}


def sweep(kinds: list[str], workload: Workload, concurrency_levels, n: int, rounds: int,
          out_dir: str | Path, hol_tokens: int = 0) -> dict[str, dict]:
    """Every server up at once, each in its own process; per concurrency level, `rounds` blocks
    of `n` requests per server, alternating ABBA (block r reverses block r-1's order) and
    sending every server the same prompts (seed r). Writes `<name>.json/png` per kind, and with
    `hol_tokens` the head-of-line figures (`head_of_line`) of the monolithic and disaggregated
    servers, one after the other."""
    from common import write_result

    blocks = {k: {c: [] for c in concurrency_levels} for k in kinds}
    with ExitStack() as stack:
        urls = {}
        for kind in kinds:
            print(f"starting the {kind} server ...", flush=True)
            server = stack.enter_context(Child(NAMES[kind], _server_main, kind,
                                               start_s=STARTUP_S, log=lambda m: None))
            urls[kind] = server.call("url")
        for c in concurrency_levels:
            for r in range(rounds):
                print(f"concurrency {c}: block {r + 1}/{rounds}", flush=True)
                for kind in kinds if r % 2 == 0 else kinds[::-1]:
                    blocks[kind][c].append(run_bench(urls[kind], workload, [c], n, timeout=120.0,
                                                     seed=r, progress=False))
        if hol_tokens:
            hol = {}
            for kind in ("monolithic", "disaggregated"):
                print(f"head of line: {kind}", flush=True)
                hol[kind] = head_of_line(urls[kind], hol_tokens, n)
            figures = {"target_ratio_p50": HOL_TARGET, "servers": hol,
                       "met": all(h["ratio_p50"] <= HOL_TARGET for h in hol.values()),
                       "definition": head_of_line.__doc__.strip()}
            print(json.dumps({k: round(h["ratio_p50"], 2) for k, h in hol.items()}))
            print(f"wrote {write_result('serving_hol_cpu', figures, out_dir)}")
    results = {}
    for kind in kinds:
        results[kind] = merge(kind, blocks[kind])
        json_path, png_path = save(results[kind], out_dir, NAMES[kind])
        print(f"{NAMES[kind]}\n{format_table(results[kind])}\nwrote {json_path} and {png_path}")
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--requests", type=int, default=8, help="per block (default 8)")
    p.add_argument("--rounds", type=int, default=6,
                   help="blocks per server and concurrency level, interleaved ABBA (default 6)")
    p.add_argument("--prefix-tokens", type=int, default=512)
    p.add_argument("--suffix-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--no-inprocess", action="store_true",
                   help="skip the in-process reference engine (not part of the targets)")
    p.add_argument("--hol-tokens", type=int, default=16000,
                   help="the long prompt of the head-of-line measurement (0 = skip it)")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    if args.rounds < 1 or args.requests < 1:
        p.error("--rounds and --requests must be >= 1")
    workload = Workload("agentic", output_tokens=args.output_tokens,
                        prefix_tokens=args.prefix_tokens, suffix_tokens=args.suffix_tokens)
    kinds = ["monolithic", "disaggregated"] + ([] if args.no_inprocess else ["inprocess"])
    res = sweep(kinds, workload, args.concurrency, args.requests, args.rounds, args.out,
                args.hol_tokens)
    compare(res["monolithic"], res["disaggregated"], res.get("inprocess"), args.out)


def _pct(base: dict, other: dict, keys) -> dict:
    return {f"{key}_overhead_pct": 100.0 * (other[key] - base[key]) / base[key]
            for key in keys if base.get(key) and other.get(key) is not None}


def _overhead(base: dict, other: dict) -> list[dict]:
    """Per level: how much slower `other` is than `base` (%), overall and round by round (the
    rounds' spread shows the machine's noise)."""
    rows = []
    for b, o in zip(base["levels"], other["levels"], strict=True):
        row = {"concurrency": b["concurrency"],
               **_pct(b, o, ("ttft_p50_s", "ttft_p90_s", "itl_p50_s", "itl_p90_s",
                             "throughput_tok_s"))}
        row["rounds"] = [_pct(rb, ro, ("ttft_p50_s", "itl_p50_s"))
                         for rb, ro in zip(b["rounds"], o["rounds"], strict=True)]
        rows.append(row)
    return rows


def compare(mono: dict, disagg: dict, inproc: dict | None, out_dir) -> None:
    """What disaggregation costs on TTFT and inter-token latency, per concurrency level, against
    the monolithic mode (the targets) and, for reference, the in-process engine."""
    from common import write_result

    rows = _overhead(mono, disagg)
    targets = {key: {"target_pct": limit,
                     "met": all(r.get(f"{key}_overhead_pct", 0.0) <= limit for r in rows)}
               for key, limit in TARGETS_PCT.items()}
    figures = {"baseline": "monolithic mode (cluster/configs/local-tiny-monolithic.toml)",
               "rows": rows, "targets": targets,
               "note": "positive = disaggregated slower (or, for throughput, higher); the "
                       "monolithic baseline has one rank, the disaggregated default two (a "
                       "prefill and a decode rank) with the same resources each"}
    if inproc is not None:
        figures["vs_inprocess"] = {
            "baseline": "in-process ReferenceEngine (LocalBackend; no Ray), reference only",
            "disaggregated": _overhead(inproc, disagg), "monolithic": _overhead(inproc, mono)}
    path = write_result("serving_overhead_cpu", figures, out_dir)
    png = plot_overhead(rows, Path(out_dir) / "serving_overhead_cpu.png")
    print(json.dumps({"rows": rows, "targets": targets}, indent=1))
    print(f"wrote {path} and {png}")


def plot_overhead(rows: list[dict], path: Path) -> Path:
    """TTFT and ITL overhead (P50 and P90) per concurrency level, with the P50 targets."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2))
    FigureCanvasAgg(fig)
    conc = [str(r["concurrency"]) for r in rows]
    for ax, metric, title in zip(fig.subplots(1, 2), ("ttft", "itl"),
                                 ("time to first token", "inter-token latency")):
        for i, q in enumerate(("p50", "p90")):
            vals = [r.get(f"{metric}_{q}_s_overhead_pct", float("nan")) for r in rows]
            ax.bar([j + (i - 0.5) * 0.38 for j in range(len(rows))], vals, 0.38,
                   label=f"{q.upper()} overhead")
        ax.axhline(TARGETS_PCT[f"{metric}_p50_s"], color="red", ls="--",
                   label=f"P50 target (<= {TARGETS_PCT[f'{metric}_p50_s']:g} %)")
        ax.axhline(0, color="black", lw=0.8)
        ax.set(title=f"{title}: disaggregated vs monolithic", xlabel="concurrency",
               ylabel="% (positive = disaggregated slower)", xticks=range(len(rows)))
        ax.set_xticklabels(conc)
        ax.legend()
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


if __name__ == "__main__":
    main()
