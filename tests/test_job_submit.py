"""Deploying with `ray job submit`: a local Ray head, `pdserve serve` submitted as a job, queried
over HTTP, then stopped."""
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from ports import free_port

ROOT = Path(__file__).resolve().parent.parent


def run(cmd, timeout=120, env=None):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.skipif(shutil.which("ray") is None, reason="the ray CLI is not installed")
def test_ray_job_submit_serves_and_stops(tmp_path):
    gcs, dash, api = free_port(), free_port(), free_port()
    cfg = tmp_path / "job.toml"
    cfg.write_text((ROOT / "cluster/configs/local-tiny.toml").read_text()
                   .replace("port = 8000", f"port = {api}"))
    # a private local head for this test (no token authentication), started from a clean
    # environment: variables that earlier tests' in-process Ray sessions left in os.environ
    # must not leak into the head or the job's driver
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env["RAY_AUTH_MODE"] = "disabled"
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
        # pdserve is installed in this environment: no working_dir upload needed
        submit = run(["ray", "job", "submit", f"--address=http://127.0.0.1:{dash}", "--no-wait",
                      "--", sys.executable, "-m", "pdserve.cli", "serve",
                      "--config", str(cfg), "--max-seconds", "240"], 180, env)
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
        stop = run(["ray", "job", "stop", f"--address=http://127.0.0.1:{dash}", job_id], 120, env)
        assert stop.returncode == 0, stop.stdout + stop.stderr
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
