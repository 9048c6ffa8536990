"""`pdserve serve` stops cleanly on SIGTERM (what `ray job stop`, systemd and Kubernetes send):
the "stopped" line, exit status 0, after ray.init() has installed its own handlers."""
import os
import signal
import subprocess
import sys
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
