"""Start-up checks of what a deployment needs from its machine, made before Ray or any actor
starts: the API's listening socket (bound first, so a port in use fails at once, not after
the cluster started) and the CPUs and GPUs its ranks ask for. Each failure is a `ConfigError`
naming the field to change (`pdserve serve` exits 2 with it), not a traceback minutes later.
"""
from __future__ import annotations

import errno
import os
import socket

from pdserve.model.config import ConfigError


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket bound to `host:port` (SO_REUSEADDR, as uvicorn binds), for the HTTP server."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as exc:
        raise ConfigError("api.host", f"{host!r} does not resolve: {exc.strerror}") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        hint = (" (another process listens there; pick another with --port or api.port)"
                if exc.errno == errno.EADDRINUSE else "")
        raise ConfigError("api.port", f"cannot listen on {host}:{port}: {exc.strerror}"
                          f"{hint}") from None
    return sock


def required(cfg) -> dict[str, float]:
    """Ray resources every rank of `cfg` together asks for (a vLLM prefill instance is one
    actor holding `prefill.tp` GPUs)."""
    res = cfg.resources
    gpus = cfg.num_ranks * res.gpus_per_rank
    if cfg.vllm:
        gpus = (cfg.decode.instances * cfg.decode.tp * res.gpus_per_rank
                + cfg.prefill.instances * cfg.prefill.tp)
    return {"CPU": cfg.num_ranks * res.cpus_per_rank, "GPU": gpus}


def local_resources(cfg) -> dict[str, float]:
    """What the embedded Ray cluster `serve._init_ray` starts will hold: CPUs enough for every
    rank (it oversubscribes the cores rather than refuse), and the GPUs this machine has."""
    import torch

    return {"CPU": max(required(cfg)["CPU"], os.cpu_count() or 1),
            "GPU": torch.cuda.device_count() if torch.cuda.is_available() else 0}


def check_resources(cfg, have: dict[str, float], where: str) -> None:
    """Refuse a config whose ranks ask for more CPUs or GPUs than `where` (words for `have`'s
    source) holds in all; placement would otherwise wait for them until its timeout."""
    for kind, field in (("GPU", "resources.gpus_per_rank"), ("CPU", "resources.cpus_per_rank")):
        need, got = required(cfg)[kind], have.get(kind, 0.0)
        if need > got + 1e-9:
            raise ConfigError(field, f"the config's {cfg.num_ranks} rank actor(s) need {need:g} "
                              f"{kind}s in all, {where} has {got:g}")
