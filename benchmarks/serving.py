"""Serving benchmark: `pdserve bench`'s load generator (`run_bench`) against the monolithic
baseline (`LocalBackend`: prefill and decode in one reference engine) and against the default
disaggregated cluster (what `pdserve serve` starts: 1 prefill + 1 decode instance on local Ray),
tiny preset, a small agentic workload (one shared prefix + a random suffix per request; 512 + 64
tokens instead of an agent's thousands, for the CPU). Writes
`results/serving_{monolithic,disaggregated,overhead}_cpu.{json,png}`.

Each server runs in a process of its own and the load generator in this one, so neither server
shares the generator's GIL; all of them share the CPU (2 cores here): compare backends within one
machine and one run setup, not across machines.

    python benchmarks/serving.py [--concurrency 1 2 4 8] [--requests 16] [--prefix-tokens 512]
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS  # noqa: E402

from pdserve.api.backend import LocalBackend
from pdserve.api.server import create_app
from pdserve.api.serving import serve_in_thread
from pdserve.api.tokenizer import ByteLevelTokenizer
from pdserve.bench import Workload, format_table, run_bench, save
from pdserve.model.config import preset
from pdserve.model.generate import ReferenceEngine, build_model
from pdserve.prefill.child import Child, serve_child

MODEL = "tiny"
STARTUP_S = 180.0  # the cluster starts Ray and its actors


def _server_main(conn, kind: str) -> None:
    """A server in a process of its own (so the load generator does not share its GIL)."""
    def build():
        torch.set_num_threads(min(2, os.cpu_count() or 1))  # the tests' thread budget
        if kind == "monolithic":
            engine = ReferenceEngine(build_model(preset(MODEL)))
            backend = LocalBackend(engine, max_batch=16, max_queue=256, model_name=MODEL)
            cm = serve_in_thread(create_app(backend, ByteLevelTokenizer(), request_timeout_s=120.0))
            url = cm.__enter__()
        else:
            import msgspec

            from pdserve.cluster.config import load_serve_config
            from pdserve.cluster.serve import running_server

            cfg, model = load_serve_config()  # the default: what `pdserve serve` starts
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            cfg = msgspec.structs.replace(cfg, api=msgspec.structs.replace(cfg.api, port=port))
            cm = running_server(cfg, model, progress=lambda m: None)
            url, _ = cm.__enter__()
        return {"url": lambda: url, "close": lambda: cm.__exit__(None, None, None)}

    serve_child(conn, f"{kind}-server", build)


def run_server_and_bench(kind: str, name: str, workload: Workload, concurrency_levels, n: int,
                         out_dir: str | Path = RESULTS) -> dict:
    """Start the `kind` server ("monolithic": one reference engine; "disaggregated": the default
    cluster, 1 prefill + 1 decode instance on local Ray) in its own process, run the sweep
    against it from this one, write `<name>.json/png` under out_dir, print the table."""
    with Child(name, _server_main, kind, start_s=STARTUP_S, log=lambda m: None) as server:
        result = run_bench(server.call("url"), workload, concurrency_levels, n, timeout=120.0)
    result["config"]["backend"] = name
    json_path, png_path = save(result, out_dir, name)
    print(f"{name}\n{format_table(result)}\nwrote {json_path} and {png_path}")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--requests", type=int, default=16, help="per concurrency level")
    p.add_argument("--prefix-tokens", type=int, default=512)
    p.add_argument("--suffix-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    workload = Workload("agentic", output_tokens=args.output_tokens,
                        prefix_tokens=args.prefix_tokens, suffix_tokens=args.suffix_tokens)
    mono = run_server_and_bench("monolithic", "serving_monolithic_cpu", workload,
                                args.concurrency, args.requests, args.out)
    disagg = run_server_and_bench("disaggregated", "serving_disaggregated_cpu", workload,
                                  args.concurrency, args.requests, args.out)
    compare(mono, disagg, args.out)


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
