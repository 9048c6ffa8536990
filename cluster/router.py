"""The router: the API's `GenerationBackend` over Ray prefill and decode instances, or over
monolithic instances.

Per request (docs/design.md §2): pick a prefill instance (the one whose prefix cache holds the
longest prefix of the prompt, unless its queue is past a bound; else the least queued prompt
tokens), prefill there (first token + state handle), pick a decode instance (most free pages, then least running), pull
the state into it and stream its tokens. In monolithic mode (no prefill instances) the picked
instance prefills the request itself and streams every token, the same way. Failures are handled
here, decided on the exception's type (a rank's exception reaches the router as itself, out of
Ray's `RayTaskError`; a failed stream's last event carries it), never on its message:
- a prefill instance dies (`InstanceLost` naming it) -> the request is prefilled on another one;
- a transfer fails (`TransferError`: `TransferTimeout`, `PeerLost`, `IntegrityError`, ...) ->
  one retry (a fresh prefill of prompt + tokens streamed: the prefill's first token is streamed
  at once, before the transfer), then an error event;
- a decode instance dies mid-stream (`InstanceLost` naming it) -> the request is re-prefilled
  with prompt + tokens already streamed and resumes on another decode instance (same seed,
  shifted sampling position), so no streamed token is repeated; with no instance left the
  client gets an error event;
- no capacity (`PoolExhausted`) -> Overloaded (HTTP 429); no live instance left ->
  BackendUnavailable (503) while nothing has been streamed, else an error event;
- a bad request (`BadRequest`, a prefill rank's `ValueError`) -> raised as `BadRequest` (4xx),
  never retried; the request's own deadline (`DeadlineExceeded`) -> an error event, no retry.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Future
from contextlib import aclosing
from typing import AsyncIterator, Callable, Protocol

import msgspec

from pdserve.api.backend import BackendUnavailable
from pdserve.decode.batcher import BadRequest, DeadlineExceeded, Overloaded, TokenEvent
from pdserve.model.sampling import Request
from pdserve.prefill.server import PrefillServer
from pdserve.prefill.prefix_cache import PrefixIndex
from pdserve.state.pools import PoolExhausted
from pdserve.transfer.errors import TransferError

from pdserve.cluster.actors import Instance, InstanceLost, remote_cause

log = logging.getLogger("pdserve.router")

# Between polls of the ranks (prefill: free read or expired state; decode: stats for placement).
# Each poll is a call into the rank actors that queues between their decode steps, so polling
# every 50 ms showed up in the inter-token latency tail; 200 ms frees state soon enough.
POLL_S = 0.2
# With nothing in flight only liveness and lease expiry are left to watch: poll less, so an idle
# server costs its host's cores little (ten rank calls a second showed up as CPU load).
IDLE_POLL_S = 1.0
# A failed rebuild of a dead instance is tried again after this, doubling up to the maximum.
REBUILD_BACKOFF_S = 5.0
REBUILD_BACKOFF_MAX_S = 120.0
# How long one read of a decode instance's event stream waits for an event (it answers as soon
# as there is one); it bounds how late a stream notices that its instance went silent.
EVENTS_WAIT_S = 1.0


class _Ended(Exception):
    """`drain` ended the request."""


async def _next_or_end(events: AsyncIterator[TokenEvent], ended: asyncio.Future
                       ) -> TokenEvent | None:
    """The next event of `events` (None after the last), or `_Ended` when `ended` is set
    first: then the pending read is cancelled, which leaves the request wherever it waits
    (prefill, transfer, decode) and cancels it there, as when a client goes away."""
    step = asyncio.ensure_future(anext(events, None))
    try:
        await asyncio.wait((step, ended), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not step.done():
            step.cancel()
            await asyncio.wait((step,))  # let the request unwind before its stream is closed
    if step.cancelled():
        raise _Ended
    return step.result()


class PrefillQueue:
    """Feeds one prefill instance, whose prefill loop (`PrefillServer`) runs inside the instance
    (`Instance.server`: in its rank-0 or engine actor) or, for an instance without one
    (in-process ranks), in this process: `submit` hands the loop a request, and a reader thread
    reads the results of every request in flight there (one `results` call at a time, which
    waits for the next) and resolves each request's future. The loop schedules: a reference
    instance with a step budget prefills in chunks, back to back, and a request that arrives
    while a long prompt prefills joins its next step; an instance without one (or a vLLM
    engine) finishes each step's requests within it.

    `index`: which prefixes the instance's prefix cache holds, refreshed after every call that
    finished a request (before its result is handed on, so the next request is routed by it);
    None for an instance without one (a vLLM engine, a cache turned off)."""

    def __init__(self, inst: Instance, idle_threads: int = 0, decode_idle=lambda: False,
                 wait_s: float = EVENTS_WAIT_S):
        # idle_threads: torch threads for a prefill step while no decode instance has work
        # (ranks sharing one host's cores; 0 = the rank's own setting always)
        self.inst, self.wait_s = inst, wait_s
        self.idle_threads, self.decode_idle = idle_threads, decode_idle
        self.server = inst.server or PrefillServer(inst.name, inst.ranks, inst.agents,
                                                   getattr(inst.ranks, "timeout_s", 60.0))
        self.pending_tokens = 0
        self.index: PrefixIndex | None = None if inst.engine else PrefixIndex()
        self._futs: dict[str, tuple[Request, Future]] = {}  # in flight on the instance
        self._lock = threading.Lock()
        self._wake = threading.Event()  # a request was submitted: read results
        self._closed = False
        self._thread = threading.Thread(target=self._read_loop, daemon=True,
                                        name=f"prefill-{inst.name}")
        self._thread.start()

    def submit(self, request: Request, deadline_s: float | None = None) -> Future:
        """The future of `request`'s `PrefillResult`; the loop drops it `deadline_s` from now."""
        fut: Future = Future()
        # running from the start: a caller that stops waiting (cancelled, past its deadline)
        # cannot cancel it, so its result still arrives and its state can be freed
        fut.set_running_or_notify_cancel()
        with self._lock:
            self._futs[request.request_id] = (request, fut)
            self.pending_tokens += len(request.prompt)
        threads = self.idle_threads if self.idle_threads and self.decode_idle() else None
        try:
            self.server.submit(request, deadline_s, threads)
        except Exception as exc:
            self._lose(exc)
        self._wake.set()
        return fut

    def close(self) -> None:
        """Stop reading once the requests in flight are answered."""
        self._closed = True
        self._wake.set()

    def cached(self, prompt: list[int]) -> int:
        """Prompt tokens of `prompt` the instance's prefix cache would spare, by its index."""
        return 0 if self.index is None else self.index.match(prompt)

    def _sync_index(self) -> None:
        """Apply what the ranks' prefix caches changed (rank 0's: the ranks decide alike; each
        rank drains its own log)."""
        try:
            changes = self.inst.ranks.call("prefix_changes")[0]
        except InstanceLost:
            raise  # the instance is gone: its requests go elsewhere
        except Exception:  # the index only steers routing: without it, hits go, not requests
            log.exception("%s cannot say what its prefix cache holds: routing by load only",
                          self.inst.name)
            changes = None
        if changes is None:
            self.index = None
        else:
            self.index.apply(changes)

    def _read_loop(self) -> None:
        while True:
            if not self._futs:
                if self._closed:
                    break
                self._wake.wait(IDLE_POLL_S)
                self._wake.clear()
                continue
            try:
                results = self.server.results(self.wait_s)
                if results and self.index is not None:
                    self._sync_index()
            except Exception as exc:
                self._lose(exc)
                continue
            for res in results:
                with self._lock:
                    item = self._futs.pop(res.request_id, None)
                    if item is not None:
                        self.pending_tokens -= len(item[0].prompt)
                if item is not None:
                    item[1].set_result(res)
        if self.inst.server is None:  # the loop ran here
            self.server.shutdown()

    def _lose(self, exc: BaseException) -> None:
        """The loop or the instance failed: it is lost, and every request in flight hears it
        (as `InstanceLost`, so the router prefills them elsewhere)."""
        exc = remote_cause(exc)
        if not isinstance(exc, InstanceLost):
            exc = InstanceLost(f"instance {self.inst.name}: its prefill loop failed: "
                               f"{type(exc).__name__}: {exc}", self.inst.name)
        self.inst.alive = False
        with self._lock:
            failed, self._futs = self._futs, {}
            self.pending_tokens = 0
        for _, fut in failed.values():
            fut.set_exception(exc)


def pick_prefill(queues: list[PrefillQueue], hits: list[int], bound: int) -> PrefillQueue:
    """The queue whose instance caches the longest prefix (`hits`: prompt tokens each would
    spare; the least loaded of equals), unless more than `bound` prompt tokens are queued
    there: then, as with no hit anywhere, the least loaded one."""
    least = min(queues, key=lambda q: q.pending_tokens)
    best = max(range(len(queues)), key=lambda i: (hits[i], -queues[i].pending_tokens))
    if hits[best] and queues[best].pending_tokens <= bound:
        return queues[best]
    return least


# running totals of the prefill instances' prefix caches (summed, kept across rebuilds) and
# what they hold now (summed over live instances)
PREFIX_COUNTERS = ("prefix_hits", "prefix_misses", "prefix_tokens_saved", "prefix_evictions")
PREFIX_GAUGES = ("prefix_entries", "prefix_checkpoints", "prefix_cached_tokens", "prefix_bytes")


class DecodeSlot:
    """A decode (or monolithic) instance as the router sees it: its server, which runs the
    instance's decode loop (`DecodeServer`, in the instance's rank-0 actor through
    `RemoteServer`, or in this process), and one reader of the server's event stream that hands
    each event to its request's stream. The router submits, cancels and reads; it runs no step.
    `stats`: the server's, refreshed by the router's poll."""

    def __init__(self, inst: Instance, server, wait_s: float = EVENTS_WAIT_S):
        self.inst, self.server, self.wait_s = inst, server, wait_s
        self.stats: dict = {}
        self._sinks: dict[str, Callable[[TokenEvent], None]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()  # a request arrived: read the stream
        self._closed = False
        self._lost: InstanceLost | None = None  # the stream broke: the instance is gone
        self._reader = threading.Thread(target=self._read_loop, daemon=True,
                                        name=f"events-{inst.name}")
        self._reader.start()

    @property
    def requests(self) -> int:
        """Requests this router has in flight here (queued, admitted or running)."""
        return len(self._sinks)

    async def stream(self, work, request_id: str,
                     deadline_s: float | None) -> AsyncIterator[TokenEvent]:
        """Submit `work` (a `StateHandle`, or a `Request` for a monolithic instance) and yield
        its events; leaving early cancels it. A lost instance ends it with an error event
        carrying `InstanceLost`."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        with self._lock:
            self._sinks[request_id] = lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev)
        self._wake.set()
        submitted = finished = False
        try:
            lost = self._lost
            if lost is None:
                try:
                    await asyncio.to_thread(self.server.submit, work, request_id, deadline_s)
                    submitted = True
                except InstanceLost as exc:
                    lost = exc
            if lost is not None:
                finished = True
                yield TokenEvent(request_id, None, 0, "error", str(lost), lost)
                return
            while not finished:
                ev = await events.get()
                finished = ev.finish_reason is not None  # a caller may stop at the last event
                yield ev
        finally:
            with self._lock:
                self._sinks.pop(request_id, None)
            if submitted and not finished:
                self.server.cancel(request_id)

    def close(self) -> None:
        self._closed = True
        self._wake.set()

    def _read_loop(self) -> None:
        """Read the server's events while requests are in flight; hand each to its stream.
        A stream that breaks (the rank-0 actor died or went silent) ends every request here
        with `InstanceLost`, which the router resumes elsewhere."""
        while not self._closed:
            if not self._sinks:
                self._wake.wait(IDLE_POLL_S)
                self._wake.clear()
                continue
            try:
                batch = self.server.events(self.wait_s)
            except Exception as exc:
                exc = remote_cause(exc)
                self._lost = exc if isinstance(exc, InstanceLost) else InstanceLost(
                    f"instance {self.inst.name}: its event stream failed: "
                    f"{type(exc).__name__}: {exc}", self.inst.name)
                self.inst.alive = False
                with self._lock:
                    for rid in list(self._sinks):
                        self._deliver(TokenEvent(rid, None, 0, "error", str(self._lost),
                                                 self._lost))
                return
            with self._lock:
                for ev in batch:
                    self._deliver(ev)

    def _deliver(self, ev: TokenEvent) -> None:
        sink = self._sinks.get(ev.request_id)
        if sink is None:  # a stream that was left (cancelled): its last events drop
            return
        try:
            sink(ev)
        except RuntimeError:  # its event loop closed: the stream is gone
            self._sinks.pop(ev.request_id, None)


class Rebuild(Protocol):
    """Starts the next generation of an instance whose rank died, wired into the deployment
    (`cluster.serve.Builder`)."""

    def rebuild_prefill(self, old: Instance, prefill: list[Instance],
                        decode: list[DecodeSlot]) -> Instance: ...

    def rebuild_decode(self, old: Instance, prefill: list[Instance]) -> DecodeSlot: ...


class Router:
    """`prefill` empty: `decode` holds monolithic instances (their ranks prefill locally),
    which take the `Request` itself and prefill it. With `rebuild`, an instance found dead is
    torn down and replaced by its next generation while the others serve (`_heal_loop`).
    `route_max_queued_tokens`: the queue past which a prefill instance that caches a request's
    prefix no longer gets it for that (`pick_prefill`)."""

    def __init__(self, model_name: str, max_context: int, prefill: list[Instance],
                 decode: list[DecodeSlot], max_queue: int = 256, prefill_idle_threads: int = 0,
                 rebuild: Rebuild | None = None, route_max_queued_tokens: int = 8192):
        self.model_name, self.max_context = model_name, max_context
        self.monolithic = not prefill
        self.kind = "monolithic" if self.monolithic else "decode"  # for messages
        self.idle_threads = prefill_idle_threads
        self.route_max_queued_tokens = route_max_queued_tokens
        self.prefill = [self._queue(p) for p in prefill]
        self._prefix_retired: dict[str, int] = {}  # counters of prefill instances rebuilt
        self.decode = decode
        self.configured = {"prefill": len(prefill), self.kind: len(decode)}
        self.max_queue = max_queue
        self.in_flight = 0
        self.resumed = self.retries = 0
        self.restarts = {"prefill": 0, self.kind: 0}  # instances rebuilt, by kind
        self.rebuild = rebuild
        self._heal = threading.Event()  # an instance was found dead: rebuild it now
        self._retry_at: dict[str, tuple[float, int]] = {}  # name -> (next try, failures)
        self._swap = threading.Lock()  # a rebuilt instance goes in, or `closing` comes first
        self._closed = self._draining = False
        self.drain_ended = 0  # requests `drain` ended
        self._idle = threading.Event()  # nothing in flight
        self._idle.set()
        self._ends: set = set()  # (loop, future) per request in flight, for `drain`
        self._wake = threading.Event()  # a request arrived: leave the idle poll interval now
        self._poller = threading.Thread(target=self._poll_loop, daemon=True, name="router-poll")
        self._poller.start()
        if rebuild is not None:
            threading.Thread(target=self._heal_loop, daemon=True, name="router-heal").start()

    @property
    def instances(self) -> list[Instance]:
        """Every instance of the deployment now (rebuilt ones in place of the dead)."""
        return [p.inst for p in self.prefill] + [d.inst for d in self.decode]

    def closing(self) -> None:
        """Rebuild nothing from now on (the deployment is being torn down): after this,
        `instances` is every instance there will be."""
        with self._swap:
            self._closed = True
        self._heal.set()

    # -- GenerationBackend ------------------------------------------------------------------
    async def generate(self, request: Request, deadline_s: float | None) -> AsyncIterator[TokenEvent]:
        if self._closed or self._draining:
            raise BackendUnavailable("the server is shutting down")
        if self.in_flight >= self.max_queue:
            raise Overloaded(f"{self.in_flight} requests in flight (max {self.max_queue})", 1.0)
        why = self.health()
        if why is not None:
            raise BackendUnavailable(why)
        self.in_flight += 1
        self._idle.clear()
        self._wake.set()
        # set by `drain` once the drain time ran out: the request ends with an error event
        ended = (asyncio.get_running_loop(), asyncio.get_running_loop().create_future())
        self._ends.add(ended)
        try:
            tokens = 0
            async with aclosing(self._generate(request, deadline_s)) as events:
                while (ev := await _next_or_end(events, ended[1])) is not None:
                    yield ev
                    tokens += ev.token is not None
                    if ev.finish_reason is not None:
                        return
        except _Ended:
            self.drain_ended += 1
            msg = "the server shut down before this request finished (api.drain_s ran out)"
            yield TokenEvent(request.request_id, None, tokens, "error", msg,
                             BackendUnavailable(msg))
        finally:
            self._ends.discard(ended)
            self.in_flight -= 1
            if not self.in_flight:
                self._idle.set()

    async def _generate(self, request: Request,
                        deadline_s: float | None) -> AsyncIterator[TokenEvent]:
        end = None if deadline_s is None else time.monotonic() + deadline_s
        rid = request.request_id
        # one seed for every attempt: a resumed request continues the same random stream
        request = Request(rid, request.prompt, request.params.with_seed())
        emitted: list[int] = []
        transfer_retry = True
        current = request
        while True:
            handle, skip = None, 0
            if not self.monolithic:
                handle = await self._prefill(current, end)
            slot = self._pick_decode()
            if slot is None:
                if handle is not None:
                    self._cancel_source(handle)
                raise BackendUnavailable(f"no live {self.kind} instance")
            failed = None
            # The first token is the prefill's: stream it now, not after the transfer and
            # decode admission (TTFT is the prefill's latency), and drop the decode stream's
            # copy of it.
            if handle is not None and handle.finished is None:
                emitted.append(handle.first_token)
                try:
                    yield TokenEvent(rid, handle.first_token, len(emitted) - 1, None,
                                     logprob=handle.first_logprob,
                                     prompt_logprobs=handle.prompt_logprobs)
                except BaseException:  # left (cancelled, drained) before decode took the state
                    self._cancel_source(handle)
                    raise
                skip = 1
            decoded = 0
            left = None if end is None else max(end - time.monotonic(), 0.01)
            # a decode instance takes the state handle, a monolithic one the request
            work = current if handle is None else handle
            async with aclosing(slot.stream(work, current.request_id, left)) as events:
                async for ev in events:
                    if ev.token is not None:
                        decoded += 1
                        if decoded <= skip:
                            if ev.finish_reason is not None:  # it also ended the request
                                yield TokenEvent(rid, None, len(emitted), ev.finish_reason)
                            continue
                        emitted.append(ev.token)
                        yield msgspec.structs.replace(ev, request_id=rid,
                                                      index=len(emitted) - 1)
                    elif ev.finish_reason == "error":
                        failed = ev
                    else:
                        yield TokenEvent(rid, None, len(emitted), ev.finish_reason)
            if failed is None:
                return
            # what failed, and can we go on elsewhere? (decided on the type)
            err, why = remote_cause(failed.exc) if failed.exc else None, failed.error or "error"
            lost = self._mark_lost(err)
            if lost is not None:
                # an instance died (the decode instance, or the prefill instance holding the
                # state): prefill again and resume on a live one
                log.warning("%s instance %s lost: %s", lost.role, lost.name, why)
            elif isinstance(err, PoolExhausted):
                if handle is not None:
                    self._cancel_source(handle)
                if emitted:  # the first token is out: a 429 can no longer be sent
                    yield TokenEvent(rid, None, len(emitted), "error",
                                     f"{self.kind} instances are full: {why}", err)
                    return
                raise Overloaded(f"{self.kind} instances are full: {why}", 1.0) from err
            elif isinstance(err, BadRequest):
                if handle is not None:
                    self._cancel_source(handle)
                if emitted:
                    yield TokenEvent(rid, None, len(emitted), "error", why, err)
                    return
                raise err
            elif (decoded or not transfer_retry or isinstance(err, DeadlineExceeded)
                  or self.monolithic):
                # failed mid-stream, or the retry is spent, or no time is left, or nothing
                # was transferred to retry (monolithic): no silent second attempt
                yield TokenEvent(rid, None, len(emitted), "error", why, err)
                return
            else:  # a transfer failure (TransferError), or one of no known type: once more
                transfer_retry = False
                self.retries += 1
                log.warning("request %s: retrying after %s", rid, why)
            if not any(d.inst.alive for d in self.decode):
                if not emitted:  # nothing is out yet: the client can still get a 503
                    raise BackendUnavailable(f"no live {self.kind} instance left ({why})")
                yield TokenEvent(rid, None, len(emitted), "error",
                                 f"no live {self.kind} instance left ({why})", err)
                return
            if emitted and not any(p.inst.alive for p in self.prefill) and not self.monolithic:
                # tokens are out: an error event, not a 503 the client can no longer get
                yield TokenEvent(rid, None, len(emitted), "error",
                                 f"no live prefill instance left ({why})", err)
                return
            current = self._resume(request, emitted)
            if current is None:  # everything had been streamed already
                yield TokenEvent(rid, None, len(emitted), "length")
                return
            self.resumed += bool(emitted)

    def stats(self) -> dict[str, float]:
        out = {"in_flight": self.in_flight, "resumed": self.resumed, "retries": self.retries,
               "prefill_alive": sum(p.inst.alive for p in self.prefill),
               "decode_alive": sum(d.inst.alive for d in self.decode),
               "prefill_configured": len(self.prefill), "decode_configured": len(self.decode),
               **{f"restarts_{kind}": n for kind, n in self.restarts.items()},
               "prefill_queued_tokens": sum(p.pending_tokens for p in self.prefill),
               "decode_queued": sum(d.stats.get("queued", 0) for d in self.decode),
               "decode_running": sum(d.stats.get("batched", 0) for d in self.decode)}
        for d in self.decode:
            for k, v in d.stats.items():
                if k.startswith("transfer"):
                    out[k] = out.get(k, 0) + v
        return out | self._prefix_stats()

    def _prefix_stats(self) -> dict[str, float]:
        """The prefill instances' prefix caches together (none without a cache); a rebuilt
        instance's counters stay in the totals, its entries are gone with it."""
        caches = [(p.inst.alive, p.index.stats) for p in self.prefill
                  if p.index is not None and p.index.stats]
        if not caches and not self._prefix_retired:
            return {}
        out = {k: self._prefix_retired.get(k, 0) + sum(st.get(k, 0) for _, st in caches)
               for k in PREFIX_COUNTERS}
        out |= {k: sum(st.get(k, 0) for alive, st in caches if alive) for k in PREFIX_GAUGES}
        looked = out["prefix_hits"] + out["prefix_misses"]
        return out | {"prefix_hit_rate": out["prefix_hits"] / looked if looked else 0.0}

    def capacity(self) -> dict[str, dict[str, int]]:
        """Live and configured instances per kind, and how many were rebuilt."""
        live = {"prefill": self.prefill, self.kind: self.decode}
        return {kind: {"live": sum(x.inst.alive for x in items),
                       "configured": self.configured[kind], "restarts": self.restarts[kind]}
                for kind, items in live.items() if self.configured[kind]}

    def health(self) -> str | None:
        if self._closed or self._draining:
            return "shutting down"
        if not self.monolithic and not any(p.inst.alive for p in self.prefill):
            return "no live prefill instance"
        if not any(d.inst.alive for d in self.decode):
            return f"no live {self.kind} instance"
        return None

    def drain(self, drain_s: float, end_wait_s: float = 10.0) -> tuple[int, int]:
        """Stop taking requests (they get 503), give those in flight up to `drain_s` to
        finish, then end the rest with an error event (their state freed as for a cancelled
        request), waiting up to `end_wait_s` for them to go. Callable from any thread;
        returns (requests that finished in the drain, requests ended)."""
        self._draining = True
        waiting = self.in_flight
        self._idle.wait(drain_s)
        ends = list(self._ends)
        for loop, fut in ends:
            try:
                loop.call_soon_threadsafe(lambda f=fut: f.done() or f.set_result(None))
            except RuntimeError:  # its event loop is closed: nothing of it runs
                pass
        self._idle.wait(end_wait_s)
        return max(waiting - self.drain_ended, 0), self.drain_ended

    async def close(self) -> None:
        self._closed = True
        self._wake.set()
        for p in self.prefill:
            p.close()
        for d in self.decode:
            d.close()
            if d.inst.alive:
                try:
                    await asyncio.to_thread(d.server.shutdown)
                except InstanceLost:
                    pass  # gone already: nothing of it runs

    # -- helpers ----------------------------------------------------------------------------
    async def _prefill(self, request: Request, end: float | None, full_wait_s: float = 30.0):
        """Prefill on the live instance `pick_prefill` chooses; another one if it dies. A full instance
        (state held until decode reads it) is backpressure: wait and retry, then 429."""
        tried = set()
        give_up = time.monotonic() + full_wait_s
        full = None  # the last PoolExhausted seen: a deadline met while waiting for room is a 429
        while True:
            live = [p for p in self.prefill if p.inst.alive and p.inst.name not in tried]
            if not live:
                raise BackendUnavailable("no live prefill instance")
            q = pick_prefill(live, [p.cached(request.prompt) for p in live],
                             self.route_max_queued_tokens)
            tried.add(q.inst.name)
            timeout = None if end is None else max(end - time.monotonic(), 0.01)
            fut = q.submit(request, timeout)
            try:
                res = await asyncio.wait_for(asyncio.wrap_future(fut), timeout)
            except InstanceLost as exc:
                log.warning("prefill instance %s lost (%s); retrying elsewhere", q.inst.name, exc)
                continue
            except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
                # nobody will read the state it prefills: free it when it is there, not at
                # the end of its lease
                fut.add_done_callback(self._free_unread)
                if isinstance(exc, asyncio.CancelledError):
                    raise
                if full is not None:
                    raise full  # its __cause__: the PoolExhausted it reports
                raise BackendUnavailable("prefill did not finish within the request deadline") from None
            if res.error is None:
                return res.handle
            err = remote_cause(res.exc) if res.exc is not None else None
            if isinstance(err, PoolExhausted):
                full = Overloaded(f"prefill instance {q.inst.name} is full: {res.error}", 1.0)
                full.__cause__ = err
                if time.monotonic() > min(give_up, end or give_up):
                    raise full
                tried.discard(q.inst.name)
                await asyncio.sleep(0.05)
                continue
            if isinstance(err, ValueError) and not isinstance(err, TransferError):
                # the prefill rank's word for a request it cannot take (empty prompt, ids
                # outside the vocabulary): the request's fault, the same on every instance
                status = err.status if isinstance(err, BadRequest) else 400
                raise BadRequest(f"prefill instance {q.inst.name}: {res.error}", status) from err
            # an error of no known type (a vLLM export failure, TP ranks out of step): ours
            raise RuntimeError(f"prefill instance {q.inst.name}: {res.error}") from err

    def _queue(self, inst: Instance) -> PrefillQueue:
        return PrefillQueue(inst, idle_threads=self.idle_threads, decode_idle=self._decode_idle)

    def _heal_loop(self) -> None:
        """Rebuild every instance found dead (by a call that failed, or the poller), one at a
        time; a rebuild that fails is tried again later, waiting longer each time."""
        while not self._closed:
            for kind, items in (("prefill", self.prefill), (self.kind, self.decode)):
                for i, item in enumerate(items):
                    if not item.inst.alive and not self._closed:
                        self._rebuild(kind, items, i)
            self._heal.wait(IDLE_POLL_S)
            self._heal.clear()

    def _rebuild(self, kind: str, items: list, i: int) -> None:
        old = items[i].inst
        retry_at, failures = self._retry_at.get(old.name, (0.0, 0))
        if time.monotonic() < retry_at:
            return
        log.warning("%s instance %s (generation %d) is dead: rebuilding it", kind, old.name,
                    old.generation)
        old.kill()  # whatever is left of it: live ranks, its placement group
        prefill = [p.inst for p in self.prefill]
        try:
            if kind == "prefill":
                new = self.rebuild.rebuild_prefill(old, prefill, list(self.decode))
            else:
                new = self.rebuild.rebuild_decode(old, prefill)
        except Exception:
            wait = min(REBUILD_BACKOFF_S * 2 ** failures, REBUILD_BACKOFF_MAX_S)
            log.exception("rebuilding %s failed; trying again in %.0f s", old.name, wait)
            self._retry_at[old.name] = (time.monotonic() + wait, failures + 1)
            return
        self._retry_at.pop(old.name, None)
        with self._swap:
            closed = self._closed
            if not closed:
                old_item, items[i] = items[i], self._queue(new) if kind == "prefill" else new
        if closed:  # torn down meanwhile: what was built goes too
            (new if kind == "prefill" else new.inst).kill()
            return
        old_item.close()
        if kind == "prefill" and old_item.index is not None:  # its cache is lost, not its counts
            for k in PREFIX_COUNTERS:
                self._prefix_retired[k] = (self._prefix_retired.get(k, 0)
                                           + old_item.index.stats.get(k, 0))
        self.restarts[kind] += 1
        log.warning("%s instance %s is back (generation %d)", kind, old.name,
                    old.generation + 1)

    def _mark_lost(self, err: BaseException | None) -> Instance | None:
        """The instance an `InstanceLost` names, now marked dead (the poller may have seen it
        first); None for any other error (a `PeerLost` from a transfer is a transfer failure:
        the retry decides)."""
        if not isinstance(err, InstanceLost):
            return None
        for inst in self.instances:
            if inst.name == err.instance:
                inst.alive = False
                self._heal.set()
                return inst
        return None

    def _decode_idle(self) -> bool:
        return all(d.requests == 0 for d in self.decode)

    def _pick_decode(self) -> DecodeSlot | None:
        live = [d for d in self.decode if d.inst.alive]
        if not live:
            return None
        return max(live, key=lambda d: (d.stats.get("pages_free", 0), -d.requests))

    def _resume(self, request: Request, emitted: list[int]) -> Request | None:
        left = request.params.max_tokens - len(emitted)
        if left <= 0:
            return None
        params = msgspec.structs.replace(
            request.params, max_tokens=left,
            position_offset=request.params.position_offset + len(emitted))
        return Request(f"{request.request_id}-{len(emitted)}", request.prompt + emitted, params)

    def _free_unread(self, fut: Future) -> None:
        """A prefill its request left: cancel its state at the source (the queue's thread)."""
        if fut.exception() is None and fut.result().handle is not None:
            self._cancel_source(fut.result().handle)

    def _cancel_source(self, handle) -> None:
        for p in self.prefill:
            if p.inst.name == handle.instance and p.inst.alive:
                try:
                    p.inst.ranks.call("cancel", handle.request_id)
                except Exception:
                    pass  # the lease frees it

    def _poll_loop(self) -> None:
        """Let prefill ranks free read or expired state, and refresh decode stats."""
        while not self._closed:
            for p in self.prefill:
                if p.inst.alive:
                    try:
                        p.inst.ranks.call("poll")
                    except InstanceLost:
                        p.inst.alive = False
                        self._heal.set()
                    except Exception:
                        log.exception("poll of %s failed", p.inst.name)
            for d in self.decode:
                if d.inst.alive:
                    try:
                        d.stats = d.server.stats()
                    except InstanceLost:
                        d.inst.alive = False
                        self._heal.set()
                    except Exception:
                        log.exception("stats of %s failed", d.inst.name)
            self._wake.wait(POLL_S if self.in_flight else IDLE_POLL_S)
            self._wake.clear()
