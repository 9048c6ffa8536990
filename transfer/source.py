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

    def hold(self, request_id: str, lease_s: float) -> float:
        """Put a request's state under a lease; returns the deadline (clock seconds)."""
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        self.leases[request_id] = Lease(self.clock() + lease_s)
        return self.leases[request_id].deadline

    def renew(self, request_id: str, lease_s: float) -> float:
        lease = self._lease(request_id)
        lease.deadline = max(lease.deadline, self.clock() + lease_s)
        return lease.deadline

    def digests(self, request_id: str, runs: list[Run]) -> list[int]:
        self._lease(request_id)  # hashing freed memory would "verify" garbage
        return digest_runs(self.agent.regions, runs)

    def cancel(self, request_id: str) -> bool:
        if self.leases.pop(request_id, None) is None:
            return False
        self.release(request_id)
        self.metrics.source_freed()
        return True

    def poll(self) -> list[tuple[str, str]]:
        """Handle notifications and expired leases; returns (event, request_id) pairs."""
        events = []
        for messages in self.agent.notifications().values():
            for msg in messages:
                kind, _, rest = msg.decode(errors="replace").partition("|")
                if kind == "done":
                    request_id, dst_rank, dst_tp = rest.rsplit("|", 2)
                    lease = self.leases.get(request_id)
                    if lease is None:
                        continue  # already freed (cancelled or expired): nothing to do
                    lease.done_ranks.add(int(dst_rank))
                    if len(lease.done_ranks) >= int(dst_tp):
                        self.leases.pop(request_id)
                        self.release(request_id)
                        self.metrics.source_freed()
                        events.append(("freed", request_id))
                elif kind == "cancel" and self.cancel(rest):
                    events.append(("cancelled", rest))
        now = self.clock()
        for request_id in [r for r, lease in self.leases.items() if lease.deadline <= now]:
            self.leases.pop(request_id)
            self.release(request_id)
            self.metrics.lease_expired()
            events.append(("expired", request_id))
        return events

    def _lease(self, request_id: str) -> Lease:
        try:
            return self.leases[request_id]
        except KeyError:
            raise LeaseExpired(f"request {request_id}: no live lease on {self.agent.name} "
                               "(expired, cancelled or already read)") from None
