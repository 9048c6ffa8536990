"""Continuous batching over any step engine, with per-request async token streams.

One step thread owns the engine: every iteration it admits queued requests (up to `max_batch`
running), runs the first step of the new ones (`engine.prefill`: a local prefill, or nothing when
the first token arrived with transferred state), then one decode step for every running request,
and releases finished or cancelled ones at once. Tokens reach each caller's asyncio queue through
`call_soon_threadsafe`. A request that cannot be admitted (pools full, transfer failed, bad
input) ends with an error event; running requests are never touched by another's failure.

An error event carries the exception itself (`TokenEvent.exc`) beside its message, so whoever
reads the stream (the router, the HTTP layer) decides on its type, never on its text. The
exceptions here are the ones every layer above shares: `Overloaded` (HTTP 429), `BadRequest`
(4xx: the request itself cannot be served) and `DeadlineExceeded` (the request's deadline).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Protocol

import msgspec

log = logging.getLogger("pdserve.decode")


class TokenEvent(msgspec.Struct, frozen=True):
    request_id: str
    token: int | None = None         # None on the final event of a failed request
    index: int = 0                   # output position of `token`
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    error: str | None = None         # what failed, for people
    exc: BaseException | None = None  # the failure itself, for code (in-process, never encoded)


class Overloaded(RuntimeError):
    """The queue is full; retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class BadRequest(ValueError):
    """The request itself cannot be served (an empty prompt, ids outside the vocabulary, ...):
    a 4xx; another attempt elsewhere would fail the same way."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class DeadlineExceeded(TimeoutError):
    """The request's own deadline passed (HTTP 504); there is no time left to try again."""


class StepEngine(Protocol):
    # -> a Sequence; raises on refusal: PoolExhausted when full, BadRequest for a bad request
    def admit(self, request: Any) -> Any: ...
    def prefill(self, seqs: list) -> Any: ...          # first token for each new sequence
    def decode(self, seqs: list) -> Any: ...           # one more token for each
    def release(self, seq) -> None: ...


@dataclass
class _Job:
    request: Any
    request_id: str
    sink: Any                       # callable(TokenEvent), thread-safe
    deadline: float | None
    seq: Any = None
    sent: int = 0
    cancelled: bool = False
    done: bool = field(default=False)

    def emit(self, ev: TokenEvent) -> None:
        """Deliver an event; a consumer that is gone (closed loop) cancels the request."""
        try:
            self.sink(ev)
        except Exception:
            self.cancelled = True


class Batcher:
    def __init__(self, engine: StepEngine, max_batch: int = 64, max_queue: int = 256,
                 idle_wait_s: float = 0.05):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.engine, self.max_batch, self.max_queue = engine, max_batch, max_queue
        self.idle_wait_s = idle_wait_s
        self._queue: deque[_Job] = deque()
        self._running: dict[str, _Job] = {}
        self._jobs: dict[str, _Job] = {}
        self._cv = threading.Condition()
        self._stop = False
        self.steps = 0
        self._thread = threading.Thread(target=self._loop, name="pdserve-batcher", daemon=True)
        self._thread.start()

    # -- caller side (any thread / asyncio loop) --------------------------------------------
    def submit(self, request: Any, request_id: str, emit, deadline_s: float | None = None) -> None:
        """Queue a request; `emit(TokenEvent)` is called from the step thread."""
        with self._cv:
            if self._stop:
                raise RuntimeError("batcher is shut down")
            if request_id in self._jobs:
                raise ValueError(f"request id {request_id!r} is already in flight")
            if len(self._queue) >= self.max_queue:
                raise Overloaded(f"{len(self._queue)} requests queued (max {self.max_queue})",
                                 retry_after=1.0)
            job = _Job(request, request_id, emit,
                       None if deadline_s is None else time.monotonic() + deadline_s)
            self._jobs[request_id] = job
            self._queue.append(job)
            self._cv.notify()

    async def stream(self, request: Any, request_id: str,
                     deadline_s: float | None = None) -> AsyncIterator[TokenEvent]:
        """Submit and iterate the request's events; leaving the iteration early cancels it."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.submit(request, request_id, lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev),
                    deadline_s)
        finished = False
        try:
            while True:
                ev = await queue.get()
                yield ev
                if ev.finish_reason is not None:
                    finished = True
                    return
        finally:
            if not finished:
                self.cancel(request_id)

    def cancel(self, request_id: str) -> bool:
        with self._cv:
            job = self._jobs.get(request_id)
            if job is None:
                return False
            job.cancelled = True
            self._cv.notify()
            return True

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return len(self._running)

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout)

    # -- step thread ------------------------------------------------------------------------
    def _finish(self, job: _Job, reason: str, error: str | None = None,
                exc: BaseException | None = None) -> None:
        if job.done:
            return
        job.done = True
        if job.seq is not None:
            try:
                self.engine.release(job.seq)
            except Exception:  # never let a release failure take the loop down
                log.exception("releasing %s failed", job.request_id)
        self._running.pop(job.request_id, None)
        with self._cv:
            self._jobs.pop(job.request_id, None)
        job.emit(TokenEvent(job.request_id, None, job.sent, reason, error, exc))

    def _flush(self, job: _Job) -> None:
        """Emit tokens produced since the last flush; the last one carries the finish reason.
        A finished request's state is released before its final event, so a caller that sees
        the end also sees the capacity back."""
        out, reason = job.seq.output, job.seq.finish_reason
        if reason is not None:
            job.done = True
            try:
                self.engine.release(job.seq)
            finally:
                self._running.pop(job.request_id, None)
                with self._cv:
                    self._jobs.pop(job.request_id, None)
        while job.sent < len(out):
            last = job.sent == len(out) - 1
            job.emit(TokenEvent(job.request_id, out[job.sent], job.sent, reason if last else None))
            job.sent += 1

    def _admit(self) -> list[_Job]:
        new = []
        while len(self._running) + len(new) < self.max_batch:
            with self._cv:
                if not self._queue:
                    break
                job = self._queue.popleft()
            if job.cancelled:
                self._finish(job, "cancelled")
                continue
            try:
                job.seq = self.engine.admit(job.request)
            except Exception as exc:
                self._finish(job, "error", f"{type(exc).__name__}: {exc}", exc)
                continue
            new.append(job)
        return new

    def _loop(self) -> None:
        while True:
            with self._cv:
                if self._stop:
                    break
                if not self._queue and not self._running:
                    self._cv.wait(self.idle_wait_s)
                    continue
            now = time.monotonic()
            for job in list(self._running.values()):
                if job.cancelled:
                    self._finish(job, "cancelled")
                elif job.deadline is not None and now > job.deadline:
                    self._finish(job, "error", "deadline exceeded", DeadlineExceeded(
                        f"request {job.request_id}: deadline exceeded"))
            new = self._admit()
            try:
                if new:
                    self.engine.prefill([j.seq for j in new])
                    for j in new:
                        self._running[j.request_id] = j
                        self._flush(j)
                active = [j for j in self._running.values() if not j.done and j not in new]
                if active:
                    self.engine.decode([j.seq for j in active])
                    self.steps += 1
                    for j in active:
                        self._flush(j)
            except Exception as exc:  # a failed step fails the requests in it, not the loop
                log.exception("step failed")
                for j in list(self._running.values()) + new:
                    self._finish(j, "error", f"step failed: {type(exc).__name__}: {exc}", exc)
        for job in list(self._running.values()) + list(self._queue):
            self._finish(job, "error", "server shutting down")
