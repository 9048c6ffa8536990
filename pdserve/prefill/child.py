"""An engine in a spawned process of its own, driven over a pipe.

Why: a vLLM `LLM` keeps its GPU memory until its process exits and forks processes of its own,
so each one lives in a child. The child builds a dict of handlers; the parent sends
(command, args) and gets ("ok", result) or ("error", stage, traceback). Every wait has a deadline,
and a failure names the child and the stage that failed."""
from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from typing import Callable


class ChildFailed(RuntimeError):
    """The child died, missed a deadline, or raised (its traceback is in the message)."""


def serve_child(conn, name: str, build: Callable[[], dict], env: dict | None = None) -> None:
    """The child's main loop: `build()` returns {command: callable}; "stop" runs its optional
    "close" handler and ends the loop. A failed build ends the child."""
    for k, v in (env or {}).items():
        os.environ.setdefault(k, v)
    try:
        handlers = build()
        conn.send(("ready", None))
    except BaseException:
        conn.send(("error", f"{name}: start-up", traceback.format_exc()))
        return
    while True:
        cmd, args = conn.recv()
        if cmd == "stop":
            try:
                handlers.get("close", lambda: None)()
            except Exception:
                traceback.print_exc()
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", handlers[cmd](*args)))
        except BaseException:
            conn.send(("error", f"{name}: {cmd}", traceback.format_exc()))


class Child:
    """A spawned child running `target(conn, *args)` (which calls `serve_child`)."""

    def __init__(self, name: str, target, *args, start_s: float = 600.0, log=print):
        ctx = mp.get_context("spawn")
        self.name, self.log = name, log
        self.conn, child_end = ctx.Pipe()
        # not a daemon: vLLM starts processes of its own
        self.proc = ctx.Process(target=target, args=(child_end, *args), name=name)
        log(f"[{name}] starting")
        t0 = time.monotonic()
        self.proc.start()
        child_end.close()
        try:
            self._reply("start-up", start_s)
        except BaseException:
            self.close(ask=False)  # it failed or hangs: nothing to ask
            raise
        log(f"[{name}] ready in {time.monotonic() - t0:.1f} s")

    def call(self, cmd: str, *args, timeout: float = 300.0):
        self.conn.send((cmd, args))
        return self._reply(cmd, timeout)

    def _reply(self, what: str, timeout: float):
        end = time.monotonic() + timeout
        while not self.conn.poll(min(1.0, timeout)):
            if not self.proc.is_alive():
                raise ChildFailed(f"[{self.name}] died during {what!r} (exit code "
                                  f"{self.proc.exitcode})")
            if time.monotonic() > end:
                # a late reply would answer the next call: the child cannot be used again
                self.close(ask=False)
                raise ChildFailed(f"[{self.name}] no reply to {what!r} within {timeout:g} s "
                                  "(child stopped)")
        try:
            kind, *rest = self.conn.recv()
        except EOFError:  # the child closed its end: it died
            self.proc.join(5)
            raise ChildFailed(f"[{self.name}] died during {what!r} (exit code "
                              f"{self.proc.exitcode})") from None
        if kind == "error":
            raise ChildFailed(f"[{self.name}] failed at stage {rest[0]!r}:\n{rest[1]}")
        return rest[0]

    def close(self, timeout: float = 120.0, ask: bool = True) -> None:
        """Ask the child to stop, then terminate / kill it if it does not."""
        if ask and self.proc.is_alive():
            try:
                self.conn.send(("stop", ()))
                self._reply("stop", timeout)
            except Exception as exc:
                self.log(f"[{self.name}] did not stop cleanly: {exc}")
        self.proc.join(timeout if ask else 5)
        for stop in (self.proc.terminate, self.proc.kill):
            if self.proc.is_alive():
                stop()
                self.proc.join(15)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
