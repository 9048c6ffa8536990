"""Destination side of a transfer, one rank: allocate, plan, READ, verify, convert, notify.

On any failure the rank's allocation is freed before the typed error reaches the caller; the
source keeps its state (the caller may retry, or cancel to free it at once)."""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import msgspec

from pdserve.state.manifest import StateManifest
from pdserve.state.pools import StatePools

from pdserve.transfer.arrival import finish_arrival
from pdserve.transfer.errors import TransferError
from pdserve.transfer.integrity import Run, source_runs, verify
from pdserve.transfer.metrics import TransferMetrics
from pdserve.transfer.nixl_agent import RankAgent
from pdserve.transfer.planner import DestAllocation, conv_staging, plan_transfer
from pdserve.transfer.source import cancel_message, done_message

log = logging.getLogger(__name__)

Digests = Callable[[int, list[Run]], list[int]]  # (source rank, runs) -> xxh3 digests


class TransferConfig(msgspec.Struct, frozen=True):
    base_deadline_s: float = 3.0     # connection set-up and control round trips
    expected_gbps: float = 1.0       # slowest bandwidth we accept before calling it a hang
    verify: bool = False             # per-region checksums
    lease_s: float = 30.0            # source state lifetime without a reader

    def deadline_s(self, nbytes: int) -> float:
        return self.base_deadline_s + nbytes / (self.expected_gbps * 1e9)


class DestRank:
    def __init__(self, agent: RankAgent, pools: StatePools, config: TransferConfig = TransferConfig(),
                 metrics: TransferMetrics | None = None):
        self.agent, self.pools, self.config = agent, pools, config
        self.rank = agent.rank
        self.metrics = metrics or TransferMetrics()

    def allocate(self, manifest: StateManifest, topology, extra_tokens: int = 0
                 ) -> tuple[list[int], list[int], list[int]]:
        """(pages, slots, staging slots) on this rank for the request plus `extra_tokens`.
        Staging slots are taken whenever the plan stages conv state (`conv_staging`)."""
        n = topology.local_count(self.rank if topology.dcp > 1 else 0,
                                 manifest.num_tokens + extra_tokens)
        n_slots = 1 + len(manifest.checkpoints)
        staging = bool(conv_staging(manifest, topology, self.pools.layout))
        need = self.pools.latent.pages_for(max(n, 1))
        pages = self.pools.latent.allocate(need)
        try:
            slots = self.pools.slots.allocate(n_slots)
            try:
                stage = self.pools.slots.allocate(n_slots) if staging else []
            except Exception:
                self.pools.slots.free(slots)
                raise
        except Exception:
            self.pools.latent.free(pages)
            raise
        return pages, slots, stage

    def free(self, alloc: DestAllocation, keep_state: bool = False) -> None:
        """Free this rank's share of `alloc` (only the staging slots when `keep_state`)."""
        r = self.rank
        if r < len(alloc.staging_slots) and alloc.staging_slots[r]:
            self.pools.slots.free(alloc.staging_slots[r])
        if not keep_state:
            self.pools.latent.free(alloc.latent_pages[r])
            self.pools.slots.free(alloc.slots[r])

    def receive(self, manifest: StateManifest, alloc: DestAllocation, src_instance: str,
                digests: Digests | None = None, cancel: threading.Event | None = None) -> dict:
        """Pull this rank's share of the request. Returns per-transfer figures."""
        t0, c0 = time.monotonic(), time.thread_time()
        try:
            if alloc.layout != self.pools.layout:
                # the plan's offsets (pages, staging slot width, conv layout) must be this pool's
                raise TransferError(f"request {manifest.request_id}: destination rank "
                                    f"{self.rank}: the allocation's layout {alloc.layout} is "
                                    f"not this rank's pool layout {self.pools.layout}")
            plan = plan_transfer(manifest, alloc, ranks=[self.rank])
            t_plan, c_plan = time.monotonic() - t0, time.thread_time() - c0
            deadline = t0 + self.config.deadline_s(plan.total_bytes)
            posted, (t_prep, c_prep), descriptors = self.agent.post_reads(src_instance, plan.table,
                                                                plan.units)
            seconds = self.agent.wait(posted, deadline, cancel)
            t1 = time.monotonic()
            if self.config.verify:
                if digests is None:
                    raise TransferError("verify mode needs a digest source")
                for s in sorted({r.src_rank for r in plan.reads}):
                    mine = [r for r in plan.reads if r.src_rank == s]
                    verify(manifest.request_id, self.rank, self.agent.regions, mine,
                           digests(s, source_runs(mine)))
            t_verify = time.monotonic() - t1
            finish_arrival(self.pools, manifest, alloc, plan, self.rank)
            t2, c2 = time.monotonic(), time.thread_time()
            t_arrival = t2 - t1 - t_verify
            for s in range(manifest.topology.tp):
                try:
                    self.agent.notify(src_instance, s, done_message(manifest.request_id,
                                                                    self.rank, alloc.topology.tp))
                except TransferError as exc:
                    # the state is here and checked; a source lost since frees by its lease
                    log.warning("request %s: telling %s rank %d it was read failed: %s",
                                manifest.request_id, src_instance, s, exc)
            t_notify, c_notify = time.monotonic() - t2, time.thread_time() - c2
        except TransferError as exc:
            self.metrics.failure(exc)
            self.free(alloc)
            raise
        except Exception as exc:
            self.metrics.failure(exc)
            self.free(alloc)
            raise TransferError(f"request {manifest.request_id}: {type(exc).__name__}: {exc}") from exc
        self.free(alloc, keep_state=True)
        self.metrics.transfer(plan.bytes_by_kind, seconds, descriptors, len(plan.table),
                              t_plan + t_prep + t_notify, t_verify)
        return {"bytes": plan.total_bytes, "runs": len(plan.table),
                "descriptors": descriptors, "seconds": time.monotonic() - t0,
                "control_s": t_plan + t_prep + t_notify, "plan_s": t_plan, "prep_s": t_prep,
                # the same steps in this thread's CPU time: the control cost without the turns
                # other processes took meanwhile (on a small host: the other ranks' copies)
                "control_cpu_s": c_plan + c_prep + c_notify,
                "verify_s": t_verify, "arrival_s": t_arrival, "notify_s": t_notify,
                "seconds_by_kind": seconds}

    def cancel(self, manifest: StateManifest, alloc: DestAllocation, src_instance: str) -> None:
        """Abandon a request: free this rank's allocation and tell the source to free its state."""
        self.free(alloc)
        for s in range(manifest.topology.tp):
            try:
                self.agent.notify(src_instance, s, cancel_message(manifest.request_id))
            except TransferError:
                pass  # a lost source frees by lease expiry
