"""Run an ASGI app under uvicorn in a background thread (servers for `pdserve serve`, tests and
benchmarks), with a startup deadline and a bounded shutdown."""
from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import uvicorn


@contextmanager
def serve_in_thread(app, host: str = "127.0.0.1", port: int = 0, startup_s: float = 30.0,
                    shutdown_s: float = 15.0, sock: socket.socket | None = None):
    """Yields the base URL; port 0 takes a free port; `sock`, when given, is a socket already
    bound to host:port (the caller bound it early and closes it). Raises RuntimeError when the
    server does not start in time or does not stop in time."""
    if sock is None:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            raise RuntimeError(f"cannot listen on {host}:{port}: {exc}") from None
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True,
                              name="pdserve-http")
    thread.start()
    deadline = time.monotonic() + startup_s
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        if not server.started:
            raise RuntimeError(f"the HTTP server did not start on {host}:{port} within {startup_s:.0f} s")
        shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        yield f"http://{shown}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(shutdown_s)
        sock.close()
        if thread.is_alive():
            raise RuntimeError(f"the HTTP server did not stop within {shutdown_s:.0f} s")
