"""The protocol between the HTTP layer and whatever generates tokens, and its monolithic form.

The HTTP layer knows nothing of Ray, pools or transfer: it hands a tokenized `Request` to a
`GenerationBackend` and iterates `TokenEvent`s. Closing that iterator early (client gone, stop
string reached, deadline) must cancel the request and free its state. Refusals are exceptions
whose type is the answer: `Overloaded` (429), `BackendUnavailable` (503), `BadRequest` (4xx); a
failed request's last event carries its exception (`TokenEvent.exc`).
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from typing import AsyncIterator, Protocol

from pdserve.decode.batcher import BadRequest, Batcher, DeadlineExceeded, Overloaded, TokenEvent
from pdserve.model.generate import ReferenceEngine
from pdserve.model.sampling import Request
from pdserve.state.pools import PoolExhausted

log = logging.getLogger("pdserve.api")

__all__ = ["BackendUnavailable", "BadRequest", "DeadlineExceeded", "GenerationBackend",
           "LocalBackend", "Overloaded", "TokenEvent"]


class BackendUnavailable(RuntimeError):
    """Nothing can serve requests right now (e.g. no live decode instance); HTTP 503."""

    def __init__(self, message: str, retry_after: float = 5.0):
        super().__init__(message)
        self.retry_after = retry_after


class GenerationBackend(Protocol):
    model_name: str   # the name clients pass as `model`
    max_context: int  # most prompt + output tokens one request may use

    def generate(self, request: Request, deadline_s: float | None) -> AsyncIterator[TokenEvent]:
        """An async generator of the request's events; the last has a finish_reason.

        Raises `Overloaded` (HTTP 429), `BackendUnavailable` (HTTP 503) or `BadRequest` (its
        status, 4xx) before yielding anything when it cannot take the request. Closing it early
        cancels the request."""
        ...

    def stats(self) -> dict[str, float]:
        """Gauges and running totals, e.g. `queued`, `running`, `transfer_bytes_<kind>`,
        `transfer_seconds_<kind>`, `transfer_failures`; read at every /health and /metrics."""
        ...

    def health(self) -> str | None:
        """None while it can serve; otherwise why not (GET /health answers 503 with it)."""
        ...

    def capacity(self) -> dict[str, dict[str, int]]:
        """Per kind of instance: {"live": n, "configured": n, "restarts": n}; GET /health says
        "degraded" while one runs below its count. Empty for a backend of no instances."""
        ...

    async def close(self) -> None: ...


class _Admission:
    """The step engine as the Batcher sees it, its refusals typed: `PoolExhausted` as it is, and
    a `ValueError` (the engine's word for a request it cannot take) as `BadRequest`."""

    def __init__(self, engine: ReferenceEngine):
        self.engine = engine
        self.prefill, self.decode, self.release = engine.prefill, engine.decode, engine.release

    def admit(self, request: Request):
        try:
            return self.engine.admit(request)
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc


class LocalBackend:
    """Monolithic serving in this process: one `ReferenceEngine` prefills and decodes, a
    `Batcher` batches (no Ray). The cluster's own baseline is its config's `mode = "monolithic"`
    (the same batcher over Ray rank actors); the serving benchmark reports this one for
    reference."""

    def __init__(self, engine: ReferenceEngine, max_batch: int = 64, max_queue: int = 256,
                 model_name: str | None = None):
        self.engine = engine
        self.model_name = model_name or engine.config.model_type
        latent = engine.pools.latent
        self.max_context = latent.capacity * latent.page_tokens
        # Each running request holds a KDA slot; a batch larger than the slots would turn
        # queued requests into refusals instead of letting them wait.
        slots = engine.pools.slots.capacity
        if max_batch > slots:
            log.info("max_batch %d capped to the engine's %d KDA slots", max_batch, slots)
        self.batcher = Batcher(_Admission(engine), min(max_batch, slots), max_queue)
        self._closed = False

    async def generate(self, request: Request,
                       deadline_s: float | None) -> AsyncIterator[TokenEvent]:
        if self._closed:
            raise BackendUnavailable("the backend is shut down")
        started = False
        async with aclosing(self.batcher.stream(request, request.request_id, deadline_s)) as events:
            async for ev in events:
                if not started and ev.finish_reason == "error":
                    # refused at admission: a full pool is "come back later", not a failure
                    if isinstance(ev.exc, PoolExhausted):
                        raise Overloaded(str(ev.exc), retry_after=1.0) from ev.exc
                    if isinstance(ev.exc, BadRequest):
                        raise ev.exc
                started = True
                yield ev

    def stats(self) -> dict[str, float]:
        pools = self.engine.pools
        return {
            "queued": self.batcher.queued,
            "running": self.batcher.running,
            "max_batch": self.batcher.max_batch,
            "max_queue": self.batcher.max_queue,
            "latent_pages_free": pools.latent.num_free,
            "kda_slots_free": pools.slots.num_free,
            "decode_steps": self.batcher.steps,
        }

    def health(self) -> str | None:
        return "the backend is shut down" if self._closed else None

    def capacity(self) -> dict[str, dict[str, int]]:
        return {}

    async def close(self) -> None:
        self._closed = True
        await asyncio.to_thread(self.batcher.shutdown)
