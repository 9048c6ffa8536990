"""A decode instance's serving loop, where the instance's rank 0 runs it (docs/design.md §2).

`DecodeServer` owns the instance's `Batcher` over its `DecodeInstance` step engine: admission,
the steps, sampling, stop conditions. Callers (the router) `submit` requests and `cancel` them;
every request's events leave through one channel, `events`, which hands over everything emitted
since its last call: one answer per step for the whole batch at most, and fewer when the caller
is slower than the steps (its next call takes what accumulated). On Ray the server lives in the
instance's rank-0 actor and `events` is one actor call; in-process (no Ray) it is called
directly. Either way no call crosses a process per step.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

from pdserve.decode.batcher import Batcher, TokenEvent


class DecodeServer:
    """`rank_stats`: the local rank's own figures (pools, transfers), merged into `stats`."""

    def __init__(self, engine, max_batch: int, max_queue: int,
                 rank_stats: Callable[[], dict] = dict):
        self.engine, self.rank_stats = engine, rank_stats
        self._out: list[TokenEvent] = []
        self._ready = threading.Condition()
        self.batcher = Batcher(engine, max_batch=max_batch, max_queue=max_queue)

    def submit(self, work: Any, request_id: str, deadline_s: float | None = None) -> None:
        """Queue a request (a `StateHandle`, or a `Request` to prefill locally); raises
        `Overloaded` when the queue is full. Its events come out of `events`."""
        self.batcher.submit(work, request_id, self._put, deadline_s)

    def cancel(self, request_id: str) -> bool:
        return self.batcher.cancel(request_id)

    def events(self, wait_s: float) -> list[TokenEvent]:
        """Every event emitted since the last call, in order; waits up to `wait_s` for one."""
        with self._ready:
            if not self._out:
                self._ready.wait(wait_s)
            out, self._out = self._out, []
        return out

    def stats(self) -> dict:
        return {**self.rank_stats(), "queued": self.batcher.queued,
                "batched": self.batcher.running, "steps": self.batcher.steps}

    def sources(self, digests) -> None:
        """Where the digests of what is read come from from now on (`transfer.verify`; a
        prefill instance was rebuilt)."""
        self.engine.digests = digests

    def shutdown(self, timeout: float = 10.0) -> None:
        self.batcher.shutdown(timeout)

    def _put(self, ev: TokenEvent) -> None:  # the batcher's threads
        with self._ready:
            self._out.append(ev)
            self._ready.notify()
