"""`pdserve bench` against a real uvicorn server over the monolithic `LocalBackend` (tiny preset):
the figures are consistent with each other and with what was asked, the files are written, and
bad flags / an unreachable server give exit codes 2 / 1 with a message."""
from __future__ import annotations

import argparse
import json
import socket
import time

import pytest

from pdserve.api.backend import LocalBackend
from pdserve.api.server import create_app
from pdserve.api.serving import serve_in_thread
from pdserve.api.tokenizer import ByteLevelTokenizer
from pdserve.bench import DEFINITIONS, Workload, add_cli, run_bench, save
from pdserve.model.config import preset
from pdserve.model.generate import ReferenceEngine, build_model

WAIT_S = 10.0
LEVELS, N, OUT = [1, 2], 4, 16


@pytest.fixture(scope="module")
def url():
    backend = LocalBackend(ReferenceEngine(build_model(preset("tiny"))), max_batch=8,
                           max_queue=64, model_name="tiny")
    with serve_in_thread(create_app(backend, ByteLevelTokenizer(), request_timeout_s=30)) as u:
        yield u


@pytest.mark.parametrize("workload", [
    Workload("fixed", prompt_tokens=24, output_tokens=OUT),
    Workload("agentic", output_tokens=OUT, prefix_tokens=48, suffix_tokens=8),
], ids=lambda w: w.kind)
def test_bench_figures(url, workload, tmp_path):
    result = run_bench(url, workload, LEVELS, N, timeout=30, max_duration=60, progress=False)
    assert result["config"]["model"] == "tiny"  # the first (only) model of /v1/models
    prompt_len = workload.ranges()[0][0]
    assert [lv["concurrency"] for lv in result["levels"]] == LEVELS
    for lv in result["levels"]:
        assert (lv["ok"], lv["errors"]) == (N, {})
        records = lv["records"]
        assert [(r["prompt_tokens"], r["output_tokens"]) for r in records] \
            == [(prompt_len, OUT)] * N
        for r in records:
            assert 0 < r["ttft_s"] <= r["e2e_s"]
            assert r["ttft_s"] + r["decode_s"] == pytest.approx(r["e2e_s"], abs=0.05)
            assert r["user_tok_s"] == pytest.approx((OUT - 1) / r["decode_s"])
        for key in ("ttft", "itl", "e2e"):
            assert 0 < lv[f"{key}_p50_s"] <= lv[f"{key}_p90_s"]
        # P90 interactivity is the rate 90 % of users reach: never above the median
        assert 0 < lv["interactivity_p90_tok_s"] <= lv["interactivity_p50_tok_s"]
        users = sorted(r["user_tok_s"] for r in records)
        assert users[0] <= lv["interactivity_p90_tok_s"] <= users[1]  # 10th pct of 4 values
        assert lv["output_tokens"] == N * OUT
        assert lv["throughput_tok_s"] == pytest.approx(N * OUT / lv["wall_s"], rel=1e-9)
        assert max(r["e2e_s"] for r in records) <= lv["wall_s"]

    json_path, png_path = save(result, tmp_path, "bench_test")
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(json_path.read_text())
    assert set(data) == {"environment", "config", "definitions", "levels"}
    assert data["definitions"] == DEFINITIONS
    assert {"date", "python", "httpx"} <= set(data["environment"])
    assert data["config"]["workload"]["kind"] == workload.kind
    assert {"ttft_p90_s", "itl_p90_s", "interactivity_p90_tok_s", "throughput_tok_s",
            "errors"} <= set(data["levels"][0])


def test_errors_are_counted_by_kind(url):
    # 200 tokens cannot stream within 0.3 s: the client's deadline ends the request
    t0 = time.monotonic()
    result = run_bench(url, Workload(prompt_tokens=8, output_tokens=200), [1], 2, timeout=0.3,
                       progress=False)
    assert time.monotonic() - t0 < WAIT_S
    lv = result["levels"][0]
    assert (lv["ok"], lv["errors"], lv["output_tokens"]) == (0, {"timeout": 2}, 0)
    assert lv["ttft_p50_s"] is None and lv["throughput_tok_s"] == 0

    # one running + one queued at most: the rest of 4 simultaneous requests get 429s
    busy = LocalBackend(ReferenceEngine(build_model(preset("tiny"))), max_batch=1, max_queue=1,
                        model_name="tiny")
    with serve_in_thread(create_app(busy, ByteLevelTokenizer(), request_timeout_s=30)) as busy_url:
        lv = run_bench(busy_url, Workload(prompt_tokens=8, output_tokens=OUT), [4], 4,
                       timeout=30, progress=False)["levels"][0]
    assert set(lv["errors"]) == {"http_429"} and lv["ok"] >= 1
    assert lv["ok"] + lv["errors"]["http_429"] == 4
    assert "queued" in lv["error_examples"]["http_429"]


def bench_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="pdserve")
    add_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *argv])
    return args.func(args)


def test_bench_cli_writes_files(url, tmp_path, capsys):
    rc = bench_cli("--url", url, "--workload", "uniform", "--prompt-tokens", "8",
                   "--prompt-tokens-max", "16", "--output-tokens", "4", "--output-tokens-max", "6",
                   "--concurrency", "2", "--requests", "3", "--out", str(tmp_path),
                   "--name", "cli")
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "TTFT p50/p90 ms" in out and "wrote" in out
    levels = json.loads((tmp_path / "cli.json").read_text())["levels"]
    assert all(4 <= r["output_tokens"] <= 6 and 8 <= r["prompt_tokens"] <= 16
               for r in levels[0]["records"])
    assert (tmp_path / "cli.png").exists()


def test_unreachable_server_exits_1(tmp_path, capsys):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()  # nothing listens there now
    t0 = time.monotonic()
    assert bench_cli("--url", closed, "--out", str(tmp_path)) == 1
    assert time.monotonic() - t0 < WAIT_S
    err = capsys.readouterr().err
    assert f"cannot reach the server at {closed}" in err and "--url" in err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv, flag", [
    (["--concurrency", "2", "0"], "--concurrency"),
    (["--requests", "0"], "--requests"),
    (["--output-tokens", "8", "--output-tokens-max", "4"], "--output-tokens-max"),
    (["--url", "127.0.0.1:8000"], "--url"),
])
def test_bad_flag_exits_2(argv, flag, capsys):
    assert bench_cli(*argv) == 2  # checked before the server is contacted
    assert flag in capsys.readouterr().err


def test_unknown_model_exits_2(url, capsys):
    assert bench_cli("--url", url, "--model", "nope", "--requests", "1") == 2
    assert "--model 'nope' is not served" in capsys.readouterr().err
