"""Continuous batching over any step engine, with per-request async token streams.

Two threads share the engine. The admission thread takes queued requests one at a time, while
fewer than `max_batch` are held, and runs `engine.admit` (allocate, and for a decode instance the
whole state transfer) beside the steps. The step thread never waits for it: between steps it takes
whatever finished admission, runs the first step of those (`engine.prefill`: a local prefill, or
nothing when the first token arrived with transferred state), then one decode step for every
running request, and releases finished or cancelled ones at once. So a running stream never waits
for another request's transfer (the vLLM KV connector's shape: start the load, pick up finished
loads between steps). The engine must therefore take `admit` concurrently with `decode`,
`prefill` and `release` of other requests.

Tokens reach each caller's asyncio queue through `call_soon_threadsafe`. A request that cannot be
admitted (pools full, transfer failed, bad input) ends with an error event; running requests are
never touched by another's failure. A request cancelled, or past its deadline, while its admission
runs is released when the admission returns, so whatever it took is freed on both sides.

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

from pdserve.model.sampling import TokenLogprob

log = logging.getLogger("pdserve.decode")


class TokenEvent(msgspec.Struct, frozen=True):
    request_id: str
    token: int | None = None         # None on the final event of a failed request
    index: int = 0                   # output position of `token`
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    error: str | None = None         # what failed, for people
    exc: BaseException | None = None  # the failure itself, for code (in-process, never encoded)
    logprob: TokenLogprob | None = None  # `token`'s, when the request asks for logprobs
    # on a request's first token event, when it asks for them: its prompt's (entry 0 None)
    prompt_logprobs: list[TokenLogprob | None] | None = None


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
    taken: bool = False             # taken for admission: holds a place in the batch until done

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
        self._lock = threading.Lock()
        self._admittable = threading.Condition(self._lock)  # admission thread: queue or room
        self._joinable = threading.Condition(self._lock)    # step thread: an admission finished
        self._queue: deque[_Job] = deque()     # waiting for admission
        self._admitted: deque[_Job] = deque()  # admitted, joining at the next step
        self._held = 0                         # taken for admission and not finished
        self._running: dict[str, _Job] = {}    # filled by the step thread only
        self._jobs: dict[str, _Job] = {}
        self._stop = False
        self.steps = 0
        self._thread = threading.Thread(target=self._loop, name="pdserve-batcher", daemon=True)
        self._admitter = threading.Thread(target=self._admit_loop, name="pdserve-admission",
                                          daemon=True)
        self._thread.start()
        self._admitter.start()

    # -- caller side (any thread / asyncio loop) --------------------------------------------
    def submit(self, request: Any, request_id: str, emit, deadline_s: float | None = None) -> None:
        """Queue a request; `emit(TokenEvent)` is called from the batcher's threads."""
        with self._lock:
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
            self._admittable.notify()

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
        with self._lock:
            job = self._jobs.get(request_id)
            if job is None:
                return False
            job.cancelled = True
            return True

    @property
    def queued(self) -> int:
        """Requests not running yet: waiting for admission, or being admitted."""
        return len(self._queue) + self._held - len(self._running)

    @property
    def running(self) -> int:
        return len(self._running)

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stop = True
            self._admittable.notify_all()
            self._joinable.notify_all()
        self._thread.join(timeout)
        self._admitter.join(timeout)

    # -- both threads (a job belongs to the admission thread until it is handed over) --------
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
        self._drop(job)
        job.emit(TokenEvent(job.request_id, None, job.sent, reason, error, exc))

    def _drop(self, job: _Job) -> None:
        """Forget a finished job; its place in the batch goes back to admission."""
        self._running.pop(job.request_id, None)
        with self._lock:
            self._jobs.pop(job.request_id, None)
            if job.taken:
                self._held -= 1
                self._admittable.notify()

    def _expired(self, job: _Job, now: float) -> bool:
        if job.deadline is None or now <= job.deadline:
            return False
        self._finish(job, "error", "deadline exceeded", DeadlineExceeded(
            f"request {job.request_id}: deadline exceeded"))
        return True

    # -- admission thread -------------------------------------------------------------------
    def _admit_loop(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not (self._queue and self._held < self.max_batch):
                    self._admittable.wait()
                if self._stop:
                    return
                job = self._queue.popleft()
                job.taken = True
                self._held += 1
            if job.cancelled:
                self._finish(job, "cancelled")
                continue
            if self._expired(job, time.monotonic()):
                continue
            try:
                job.seq = self.engine.admit(job.request)
            except Exception as exc:
                self._finish(job, "error", f"{type(exc).__name__}: {exc}", exc)
                continue
            with self._lock:
                if not self._stop:
                    self._admitted.append(job)
                    self._joinable.notify()
                    continue
            self._finish(job, "error", "server shutting down")

    # -- step thread ------------------------------------------------------------------------
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
                self._drop(job)
        logprobs = job.seq.logprobs
        while job.sent < len(out):
            last = job.sent == len(out) - 1
            job.emit(TokenEvent(
                job.request_id, out[job.sent], job.sent, reason if last else None,
                logprob=logprobs[job.sent] if job.sent < len(logprobs) else None,
                prompt_logprobs=job.seq.prompt_logprobs if job.sent == 0 else None))
            job.sent += 1

    def _loop(self) -> None:
        while True:
            with self._lock:
                if self._stop:
                    break
                if not self._running and not self._admitted:
                    self._joinable.wait(self.idle_wait_s)
                    continue
                joining = list(self._admitted)
                self._admitted.clear()
            now = time.monotonic()
            for job in list(self._running.values()) + joining:
                if job.cancelled:
                    self._finish(job, "cancelled")
                else:
                    self._expired(job, now)
            new = [j for j in joining if not j.done]
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
        with self._lock:  # the admission thread hands nothing over once _stop is set
            left = list(self._admitted) + list(self._queue)
            self._admitted.clear()
            self._queue.clear()
        for job in list(self._running.values()) + left:
            self._finish(job, "error", "server shutting down")
