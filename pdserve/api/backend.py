"""The protocol between the HTTP layer and whatever generates tokens, and its monolithic form.

The HTTP layer knows nothing of Ray, pools or transfer: it hands a tokenized `Request` to a
`GenerationBackend` and iterates `TokenEvent`s. Closing that iterator early (client gone, stop
string reached, deadline) must cancel the request and free its state.
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from typing import AsyncIterator, Protocol

from pdserve.decode.batcher import Batcher, Overloaded, TokenEvent
from pdserve.model.generate import ReferenceEngine
from pdserve.model.sampling import Request
from pdserve.state.pools import PoolExhausted

log = logging.getLogger("pdserve.api")

__all__ = ["BackendUnavailable", "GenerationBackend", "LocalBackend", "Overloaded", "TokenEvent"]


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

        Raises `Overloaded` (HTTP 429) or `BackendUnavailable` (HTTP 503) before yielding anything
        when it cannot take the request. Closing it early cancels the request."""
        ...

    def stats(self) -> dict[str, float]:
        """Gauges and running totals, e.g. `queued`, `running`, `transfer_bytes_<kind>`,
        `transfer_seconds_<kind>`, `transfer_failures`; read at every /health and /metrics."""
        ...

    def health(self) -> str | None:
        """None while it can serve; otherwise why not (GET /health answers 503 with it)."""
        ...

    async def close(self) -> None: ...


class _AdmissionLog:
    """The step engine as the Batcher sees it, remembering which admissions failed for lack of
    room: the Batcher turns every admit failure into an error event, but a full pool means
    "come back later" (429), not a failed request."""

    def __init__(self, engine: ReferenceEngine):
        self.engine = engine
        self.refused: dict[str, PoolExhausted] = {}
        self.prefill, self.decode, self.release = engine.prefill, engine.decode, engine.release

    def admit(self, request: Request):
        try:
            return self.engine.admit(request)
        except PoolExhausted as exc:
            self.refused[request.request_id] = exc
            raise


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
        self._admission = _AdmissionLog(engine)
        self.batcher = Batcher(self._admission, min(max_batch, slots), max_queue)
        self._closed = False

    async def generate(self, request: Request,
                       deadline_s: float | None) -> AsyncIterator[TokenEvent]:
        if self._closed:
            raise BackendUnavailable("the backend is shut down")
        rid = request.request_id
        try:
            async with aclosing(self.batcher.stream(request, rid, deadline_s)) as events:
                async for ev in events:
                    if ev.token is None and ev.finish_reason == "error":
                        refused = self._admission.refused.pop(rid, None)
                        if refused is not None:
                            raise Overloaded(str(refused), retry_after=1.0)
                    yield ev
        finally:
            self._admission.refused.pop(rid, None)

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

    async def close(self) -> None:
        self._closed = True
        await asyncio.to_thread(self.batcher.shutdown)
