"""`pdserve serve` stops cleanly on SIGTERM (what `ray job stop`, systemd and Kubernetes send):
the "stopped" line, exit status 0, after ray.init() has installed its own handlers; requests in
flight get `api.drain_s` to finish and then an error event, new ones a 503."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from ports import free_port

ROOT = Path(__file__).resolve().parent.parent


def test_sigterm_stops_serve_cleanly(tmp_path):
    api = free_port()
    cfg = tmp_path / "serve.toml"
    cfg.write_text((ROOT / "cluster/configs/local-tiny.toml").read_text()
                   .replace("port = 8000", f"port = {api}"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "serve", "--config", str(cfg),
                             "--max-seconds", "300"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{api}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(1)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out[-3000:]
        assert "pdserve: stopped" in out, out[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def _start(tmp_path, extra_api=""):
    api = free_port()
    cfg = tmp_path / "serve.toml"
    cfg.write_text((ROOT / "cluster/configs/local-tiny.toml").read_text()
                   .replace("port = 8000", f"port = {api}\n{extra_api}"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "serve", "--config", str(cfg),
                             "--max-seconds", "400"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")),
                              daemon=True)
    reader.start()
    return proc, f"http://127.0.0.1:{api}", lines, reader


def _wait_for(what, cond, proc, lines, timeout):
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, "".join(lines)[-3000:]
        assert time.monotonic() < deadline, f"{what} within {timeout} s: " + "".join(lines)[-3000:]
        time.sleep(0.2)


def _up(url):
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _stream(url, max_tokens, out):
    """One streamed completion: its token ids, finish reason, error events and [DONE]."""
    body = {"model": "tiny", "prompt": "drain me", "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "return_token_ids": True, "ignore_eos": True}
    out.update(ids=[], errors=[], done=False, finish=None)
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out["done"] = True
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out["errors"].append(chunk["error"])
                continue
            out["ids"] += chunk["choices"][0].get("token_ids") or []
            out["finish"] = chunk["choices"][0]["finish_reason"] or out["finish"]


def _complete(url, max_tokens, out):
    body = {"model": "tiny", "prompt": "drain me too", "max_tokens": max_tokens,
            "temperature": 0, "return_token_ids": True, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    out.update(status=r.status_code, body=r.json())


def test_sigterm_mid_load_drains_then_ends_the_rest_with_an_error_event(tmp_path):
    proc, url, lines, reader = _start(tmp_path, "drain_s = 5.0")
    try:
        _wait_for("the server comes up", lambda: _up(url), proc, lines, 240)
        # short requests finish within the drain; long ones (the whole context, EOS ignored)
        # cannot, and end with an error event when it runs out
        jobs = [(_stream, 8), (_stream, 8), (_stream, 5000), (_stream, 5000),
                (_complete, 5000), (_complete, 8)]
        outs = [{} for _ in jobs]
        threads = [threading.Thread(target=f, args=(url, n, o), daemon=True)
                   for (f, n), o in zip(jobs, outs)]
        for t in threads:
            t.start()
        # SIGTERM once every stream has tokens out (the long ones are decoding)
        _wait_for("every stream has tokens", lambda: all(
            o.get("ids") for (f, _), o in zip(jobs, outs) if f is _stream), proc, lines, 120)
        proc.send_signal(signal.SIGTERM)
        _wait_for("the drain starts", lambda: any("shutting down" in x for x in lines), proc,
                  lines, 60)
        # during the drain: a new request is refused with 503, Retry-After and OpenAI's shape
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "late",
                                                      "max_tokens": 4}, timeout=30)
        assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1, r.text
        assert r.json()["error"]["type"] == "service_unavailable", r.text
        assert "shutting down" in r.json()["error"]["message"]
        health = httpx.get(f"{url}/health", timeout=30)
        assert health.status_code == 503 and health.json()["reason"] == "shutting down"
        proc.wait(timeout=180)
        reader.join(30)  # the reader has every line once stdout closes
        for t in threads:
            t.join(60)
            assert not t.is_alive()
        text = "".join(lines)
        assert proc.returncode == 0, text[-3000:]
        # no request lost silently: all of its tokens, or an error event then [DONE] (a 503
        # body when it was not streamed)
        ended = 0
        for (f, n), o in zip(jobs, outs):
            assert o["status"] == 200 or f is _complete, o
            if f is _stream:
                assert o["done"], o
                if o["errors"]:
                    ended += 1
                    assert o["errors"][0]["code"] == 503 and "api.drain_s" in \
                        o["errors"][0]["message"], o["errors"]
                    assert len(o["ids"]) < n
                else:
                    assert len(o["ids"]) == n and o["finish"] == "length", o
            elif o["status"] == 200:
                assert len(o["body"]["choices"][0]["token_ids"]) == n
            else:
                ended += 1
                assert o["status"] == 503 and "api.drain_s" in o["body"]["error"]["message"], o
        stopped = re.search(r"pdserve: stopped \((\d+) request\(s\) finished in the drain, "
                            r"(\d+) ended with an error event", text)
        assert stopped, text[-3000:]
        assert int(stopped[2]) == ended >= 1, text[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
