"""Source side of a transfer: state held under a lease until every destination rank says it is
done, the source is told to cancel, or the lease expires. Nothing here blocks: `poll()` is
called by the owner's loop and returns what happened."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from pdserve.transfer.errors import LeaseExpired
from pdserve.transfer.integrity import Run, digest_runs
from pdserve.transfer.metrics import TransferMetrics
from pdserve.transfer.nixl_agent import RankAgent


@dataclass
class Lease:
    deadline: float
    done_ranks: set[int] = field(default_factory=set)


EARLY_S = 60.0  # how long a notification about a request not (yet) held is kept


@dataclass
class _Early:
    """What was heard about a request before it was held. With vLLM the hold reaches the worker
    one engine step after the request finished; the decode side may read it and say "done" (or
    the owner cancel it) in between, and dropping that would keep the blocks for a whole lease."""
    until: float
    done_ranks: set[int] = field(default_factory=set)
    dst_tp: int = 0
    cancelled: bool = False


def done_message(request_id: str, dst_rank: int, dst_tp: int) -> bytes:
    return f"done|{request_id}|{dst_rank}|{dst_tp}".encode()


def cancel_message(request_id: str) -> bytes:
    return f"cancel|{request_id}".encode()


class SourceRank:
    def __init__(self, agent: RankAgent, release: Callable[[str], None],
                 metrics: TransferMetrics | None = None, clock=time.monotonic):
        self.agent, self.release, self.clock = agent, release, clock
        self.metrics = metrics or TransferMetrics()
        self.leases: dict[str, Lease] = {}
        self._early: dict[str, _Early] = {}
        self._events: list[tuple[str, str]] = []   # settled by `hold`, reported by `poll`

    def hold(self, request_id: str, lease_s: float) -> float:
        """Put a request's state under a lease; returns the deadline (clock seconds). If every
        destination rank already said "done", or the request was cancelled, it is freed at once
        (and reported by the next `poll`)."""
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        lease = self.leases[request_id] = Lease(self.clock() + lease_s)
        early = self._early.pop(request_id, None)
        if early is not None:
            lease.done_ranks |= early.done_ranks
            if early.cancelled or (early.dst_tp and len(lease.done_ranks) >= early.dst_tp):
                self.leases.pop(request_id)
                self.release(request_id)
                self.metrics.source_freed()
                self._events.append(("cancelled" if early.cancelled else "freed", request_id))
        return lease.deadline

    def renew(self, request_id: str, lease_s: float) -> float:
        lease = self._lease(request_id)
        lease.deadline = max(lease.deadline, self.clock() + lease_s)
        return lease.deadline

    def digests(self, request_id: str, runs: list[Run]) -> list[int]:
        self._lease(request_id)  # hashing freed memory would "verify" garbage
        return digest_runs(self.agent.regions, runs)

    def cancel(self, request_id: str) -> bool:
        """Free a held request now; one not held yet is freed when it is held."""
        if self.leases.pop(request_id, None) is None:
            self._heard(request_id).cancelled = True
            return False
        self.release(request_id)
        self.metrics.source_freed()
        return True

    def poll(self) -> list[tuple[str, str]]:
        """Handle notifications and expired leases; returns (event, request_id) pairs."""
        events, self._events = self._events, []
        for messages in self.agent.notifications().values():
            for msg in messages:
                kind, _, rest = msg.decode(errors="replace").partition("|")
                if kind == "done":
                    request_id, dst_rank, dst_tp = rest.rsplit("|", 2)
                    lease = self.leases.get(request_id)
                    if lease is None:  # freed already, or not held yet: keep it for a while
                        early = self._heard(request_id)
                        early.done_ranks.add(int(dst_rank))
                        early.dst_tp = int(dst_tp)
                        continue
                    lease.done_ranks.add(int(dst_rank))
                    if len(lease.done_ranks) >= int(dst_tp):
                        self.leases.pop(request_id)
                        self.release(request_id)
                        self.metrics.source_freed()
                        events.append(("freed", request_id))
                elif kind == "cancel" and self.cancel(rest):
                    events.append(("cancelled", rest))
        now = self.clock()
        for request_id in [r for r, e in self._early.items() if e.until <= now]:
            del self._early[request_id]
        for request_id in [r for r, lease in self.leases.items() if lease.deadline <= now]:
            self.leases.pop(request_id)
            self.release(request_id)
            self.metrics.lease_expired()
            events.append(("expired", request_id))
        return events

    def _heard(self, request_id: str) -> _Early:
        return self._early.setdefault(request_id, _Early(self.clock() + EARLY_S))

    def _lease(self, request_id: str) -> Lease:
        try:
            return self.leases[request_id]
        except KeyError:
            raise LeaseExpired(f"request {request_id}: no live lease on {self.agent.name} "
                               "(expired, cancelled or already read)") from None
