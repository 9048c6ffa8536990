"""Serving benchmark: `pdserve bench`'s load generator (`run_bench`) against an in-process server
on the tiny preset, with a small agentic workload (one shared prefix + a random suffix per
request; 512 + 64 tokens instead of an agent's thousands, for the CPU).

This runs the monolithic baseline (`LocalBackend`: prefill and decode in one engine) and writes
`results/serving_monolithic_cpu.{json,png}`. `run_server_and_bench` takes any backend factory, so
the disaggregated side runs the same workload through the same code.

The server runs in a thread of this process, so client and server share the CPU (2 cores here):
compare backends within one machine and one run setup, not across machines.

    python benchmarks/serving.py [--concurrency 1 2 4 8] [--requests 16] [--prefix-tokens 512]
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS  # noqa: E402

from pdserve.api.backend import GenerationBackend, LocalBackend
from pdserve.api.server import create_app
from pdserve.api.serving import serve_in_thread
from pdserve.api.tokenizer import ByteLevelTokenizer, Tokenizer
from pdserve.bench import Workload, format_table, run_bench, save
from pdserve.model.config import preset
from pdserve.model.generate import ReferenceEngine, build_model

MODEL = "tiny"
STARTUP_S = 30.0


def run_server_and_bench(backend_factory: Callable[[], GenerationBackend], name: str,
                         workload: Workload, concurrency_levels, n: int, *,
                         tokenizer: Tokenizer | None = None, timeout: float = 120.0,
                         out_dir: str | Path = RESULTS) -> dict:
    """Serve `backend_factory()` in-process, run the sweep against it, write `<name>.json/png`
    under out_dir, print the table; returns the result (with `config.backend` = name)."""
    app = create_app(backend_factory(), tokenizer or ByteLevelTokenizer(),
                     request_timeout_s=timeout)
    with serve_in_thread(app) as url:
        result = run_bench(url, workload, concurrency_levels, n, timeout=timeout)
    result["config"]["backend"] = name
    json_path, png_path = save(result, out_dir, name)
    print(f"{name}\n{format_table(result)}\nwrote {json_path} and {png_path}")
    return result


def monolithic() -> LocalBackend:
    engine = ReferenceEngine(build_model(preset(MODEL)))
    return LocalBackend(engine, max_batch=16, max_queue=256, model_name=MODEL)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--requests", type=int, default=16, help="per concurrency level")
    p.add_argument("--prefix-tokens", type=int, default=512)
    p.add_argument("--suffix-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    # The same thread budget as the tests and the other CPU benchmarks.
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    workload = Workload("agentic", output_tokens=args.output_tokens,
                        prefix_tokens=args.prefix_tokens, suffix_tokens=args.suffix_tokens)
    mono = run_server_and_bench(monolithic, "serving_monolithic_cpu", workload,
                                args.concurrency, args.requests, out_dir=args.out)
    disagg = disaggregated(workload, args.concurrency, args.requests, args.out)
    compare(mono, disagg, args.out)


def disaggregated(workload, levels, n, out_dir) -> dict:
    """The same sweep against the default cluster (1 prefill + 1 decode instance on local Ray,
    state over NIXL), started through `pdserve serve`'s own code path."""
    import msgspec

    from pdserve.cluster.config import load_serve_config
    from pdserve.cluster.serve import running_server

    cfg, model = load_serve_config()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg = msgspec.structs.replace(cfg, api=msgspec.structs.replace(cfg.api, port=port))
    with running_server(cfg, model, progress=lambda m: None) as (url, _):
        result = run_bench(url, workload, levels, n, timeout=120.0)
    result["config"]["backend"] = "serving_disaggregated_cpu"
    json_path, png_path = save(result, out_dir, "serving_disaggregated_cpu")
    print(f"serving_disaggregated_cpu\n{format_table(result)}\nwrote {json_path} and {png_path}")
    return result


def compare(mono: dict, disagg: dict, out_dir) -> None:
    """What disaggregation costs on TTFT and inter-token latency, per concurrency level."""
    import json

    from common import write_result

    rows = []
    for m, d in zip(mono["levels"], disagg["levels"]):
        row = {"concurrency": m["concurrency"]}
        for key in ("ttft_p50_s", "ttft_p90_s", "itl_p50_s", "itl_p90_s", "throughput_tok_s"):
            if key in m and key in d and m[key]:
                row[key + "_overhead_pct"] = 100.0 * (d[key] - m[key]) / m[key]
        rows.append(row)
    path = write_result("serving_overhead_cpu", {"rows": rows, "note": "positive = disaggregated "
                        "slower (or, for throughput, higher)"}, out_dir)
    print(json.dumps(rows, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
