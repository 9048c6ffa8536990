"""Start-up validation: a bad port, a port in use or resources the machine lacks end
`pdserve serve` with exit 2 and a message naming the field, before Ray or any actor starts."""
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from pdserve.cluster.config import load_serve_config
from pdserve.cluster.preflight import check_resources, listen_socket, required
from pdserve.model.config import ConfigError
from ports import free_port

ROOT = Path(__file__).resolve().parent.parent


def _serve(*args: str, config: Path | None = None) -> subprocess.CompletedProcess:
    """`pdserve serve` in a fresh process (no RAY_ variables: it may only start its own Ray)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--max-seconds", "1", *args]
    if config is not None:
        cmd += ["--config", str(config)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _refused(run: subprocess.CompletedProcess, message: str) -> None:
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert message in run.stderr, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    assert "starting " not in run.stdout, run.stdout   # no instance was started


def test_port_out_of_range_exits_2():
    _refused(_serve("--port", "99999"), "--port (api.port): must be in 1..65535, got 99999")


def test_port_in_use_exits_2_before_the_cluster_starts():
    port = free_port()
    with socket.create_server(("127.0.0.1", port)):
        _refused(_serve("--port", str(port)),
                 f"api.port: cannot listen on 127.0.0.1:{port}: Address already in use")


def test_more_gpus_than_the_machine_has_exits_2(tmp_path):
    cfg = tmp_path / "serve.toml"
    text = (ROOT / "cluster/configs/local-tiny.toml").read_text()
    assert "gpus_per_rank = 0\n" in text
    cfg.write_text(text.replace("gpus_per_rank = 0\n", "gpus_per_rank = 64\n")
                   .replace("port = 8000", f"port = {free_port()}"))
    _refused(_serve(config=cfg), "resources.gpus_per_rank: the config's 2 rank actor(s) need "
                                 "128 GPUs in all, this machine has")


def test_resources_checked_against_what_the_cluster_holds():
    cfg, _ = load_serve_config(ROOT / "cluster/configs/tiny-tp2.toml")  # 3 ranks x 0.5 CPU
    assert required(cfg) == {"CPU": 1.5, "GPU": 0}
    check_resources(cfg, {"CPU": 1.5}, "the Ray cluster")
    with pytest.raises(ConfigError, match=r"^resources.cpus_per_rank: the config's 3 rank "
                                          r"actor\(s\) need 1.5 CPUs in all, the Ray cluster "
                                          r"has 1$"):
        check_resources(cfg, {"CPU": 1.0, "GPU": 8}, "the Ray cluster")
    gpu = msgspec.structs.replace(cfg, resources=msgspec.structs.replace(cfg.resources,
                                                                         gpus_per_rank=1))
    with pytest.raises(ConfigError, match="^resources.gpus_per_rank: .* need 3 GPUs in all"):
        check_resources(gpu, {"CPU": 8, "GPU": 2}, "the Ray cluster")


def test_listen_socket_names_the_host_that_does_not_resolve():
    with pytest.raises(ConfigError, match="^api.host: 'no-such-host.invalid' does not resolve"):
        listen_socket("no-such-host.invalid", free_port())
