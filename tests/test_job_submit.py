"""Deploying with `ray job submit`: a local Ray head, `pdserve serve` submitted as a job, queried
over HTTP, then stopped with `ray job stop` (SIGTERM) while requests stream: the server drains
them, says so in one line and leaves, and each request gets its tokens or an error event."""
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from ports import free_port
from test_serve_signals import _stream

ROOT = Path(__file__).resolve().parent.parent


def run(cmd, timeout=120, env=None):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.skipif(shutil.which("ray") is None, reason="the ray CLI is not installed")
def test_ray_job_submit_serves_and_ray_job_stop_drains(tmp_path):
    gcs, dash, api = free_port(), free_port(), free_port()
    cfg = tmp_path / "job.toml"
    cfg.write_text((ROOT / "cluster/configs/local-tiny.toml").read_text()
                   .replace("port = 8000", f"port = {api}\ndrain_s = 3.0"))
    # a private local head for this test (no token authentication), started from a clean
    # environment: variables that earlier tests' in-process Ray sessions left in os.environ
    # must not leak into the head or the job's driver
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env["RAY_AUTH_MODE"] = "disabled"
    # `ray job stop` SIGKILLs a job still running this long after its SIGTERM (3 s by default,
    # read by the head's job supervisor): room for the drain and the shutdown
    env["RAY_JOB_STOP_WAIT_TIME_S"] = "120"
    # --block keeps the head's processes under this one process group, so the test stops the
    # cluster it started and no other (`ray stop` would stop every Ray cluster on the machine);
    # a temp dir of its own keeps its address file (ray_current_cluster) out of /tmp/ray, where
    # a later ray.init() on the machine would find it pointing at a stopped head
    temp = tempfile.mkdtemp(prefix="rayjob", dir="/tmp")    # short: Ray's socket paths
    head = subprocess.Popen(["ray", "start", "--head", "--block", f"--port={gcs}",
                             f"--dashboard-port={dash}", "--include-dashboard=true",
                             f"--temp-dir={temp}", "--num-cpus=4", "--disable-usage-stats"],
                            env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    job_id = None
    try:
        deadline = time.monotonic() + 180
        while True:
            assert head.poll() is None, "ray start exited: " + head.stdout.read()[-3000:]
            # ready when the job API answers (the dashboard serves before its job agent does)
            if run(["ray", "job", "list", f"--address=http://127.0.0.1:{dash}"], 60,
                   env).returncode == 0:
                break
            assert time.monotonic() < deadline, "the Ray head's job API did not come up"
            time.sleep(1)
        # pdserve is installed in this environment: no working_dir upload needed; the job API
        # may answer before its agent takes jobs ("No available agent"): try again until then
        while True:
            submit = run(["ray", "job", "submit", f"--address=http://127.0.0.1:{dash}",
                          "--no-wait", "--", sys.executable, "-m", "pdserve.cli", "serve",
                          "--config", str(cfg), "--max-seconds", "240"], 180, env)
            if submit.returncode == 0 or "No available agent" not in submit.stderr + \
                    submit.stdout or time.monotonic() > deadline:
                break
            time.sleep(2)
        assert submit.returncode == 0, submit.stdout + submit.stderr
        job_id = re.search(r"raysubmit_\w+", submit.stdout + submit.stderr).group(0)
        deadline = time.monotonic() + 240
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{api}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            status = run(["ray", "job", "status", f"--address=http://127.0.0.1:{dash}", job_id], 60, env)
            assert "FAILED" not in status.stdout, run(
                ["ray", "job", "logs", f"--address=http://127.0.0.1:{dash}", job_id], 60, env).stdout[-3000:]
            assert time.monotonic() < deadline, "the job's server did not come up: " + run(
                ["ray", "job", "logs", f"--address=http://127.0.0.1:{dash}", job_id], 60, env).stdout[-3000:]
            time.sleep(2)
        r = httpx.post(f"http://127.0.0.1:{api}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "hello", "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 5
        # in flight when the job is stopped: a short stream that finishes within the drain and
        # one that cannot (EOS ignored), both decoding
        outs = [{}, {}]
        streams = [threading.Thread(target=_stream, args=(f"http://127.0.0.1:{api}", n, o),
                                    daemon=True) for n, o in zip((8, 3000), outs)]
        for t in streams:
            t.start()
        deadline = time.monotonic() + 120
        while not all(o.get("ids") for o in outs):
            assert time.monotonic() < deadline and all(t.is_alive() or o.get("done")
                                                       for t, o in zip(streams, outs)), outs
            time.sleep(0.1)
        stop = run(["ray", "job", "stop", f"--address=http://127.0.0.1:{dash}", job_id], 180, env)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        for t in streams:
            t.join(60)
            assert not t.is_alive()
        short, long = outs
        assert short["done"] and len(short["ids"]) == 8 and not short["errors"], short
        assert long["done"] and 0 < len(long["ids"]) < 3000, long
        assert long["errors"] and long["errors"][0]["code"] == 503 and \
            "api.drain_s" in long["errors"][0]["message"], long["errors"]
        logs = run(["ray", "job", "logs", f"--address=http://127.0.0.1:{dash}", job_id], 60,
                   env).stdout
        # the clean path ran to its end, once: not SIGKILLed mid-drain, no traceback
        assert len(re.findall(r"pdserve: stopped \(\d+ request\(s\) finished in the drain, "
                              r"1 ended with an error event", logs)) == 1, logs[-3000:]
        assert "Traceback" not in logs, logs[-3000:]
        job_id = None
    finally:
        if job_id:
            run(["ray", "job", "stop", f"--address=http://127.0.0.1:{dash}", job_id], 60, env)
        _stop_group(head)
        shutil.rmtree(temp, ignore_errors=True)


def _stop_group(proc: subprocess.Popen, grace_s: float = 60.0) -> None:
    """SIGTERM the process group `proc` leads (the head's processes), SIGKILL what is left
    after `grace_s`."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
