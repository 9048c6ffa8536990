"""A decode instance's TP ranks driven by its own rank 0, with no Ray call per step.

Rank 0 runs the instance's `DecodeServer` (the batcher, docs/design.md §2) over a `Lockstep`
rank group: a step call (`decode`, `prefill`, `free`) runs on rank 0 and is broadcast first, as
`(method, args)`, to the other ranks over a gloo group of their own (CPU-side control on GPU too,
beside the model's NCCL or gloo group), and every other rank runs each one in the same order
(`follow`, a thread of the rank's actor). The step's collectives then pair up inside the model,
as in nano-vllm: rank 0 schedules, the others follow. Only rank 0's result is wanted.

Admission calls (`allocate`, `receive`, `admit`, ...) are per request, not per step, and run
beside the steps: on rank 0 in the batcher's admission thread, on the other ranks in their
actors' admission concurrency group (`Spread`, a Ray call per rank and request).

A TP group whose ranks left lockstep cannot step again: a step that fails on rank 0 with TP > 1
(a peer died, its collective broke) makes the instance lost (`InstanceLost`: the router resumes
its requests elsewhere), and a follower that cannot run a step, or whose rank 0 is gone, exits
its process, which fails rank 0's next collective at once instead of at the group's timeout.
"""
from __future__ import annotations

import datetime
import logging
import os
import threading

from pdserve.cluster.actors import InstanceLost

log = logging.getLogger("pdserve.decode")

# Followers wait for rank 0's next step without a deadline of their own (an idle instance is
# not an error); rank 0's death closes the connection, which ends the wait.
FOLLOW_TIMEOUT = datetime.timedelta(days=365)


def step_group(world: int):
    """The ranks' gloo group for step calls (every rank of the instance makes it, in order)."""
    import torch.distributed as dist

    return dist.new_group(list(range(world)), backend="gloo", timeout=FOLLOW_TIMEOUT)


class Spread:
    """Admission calls on every rank: rank 0 here, the others in their actors' admission
    group, in parallel. `peers`: `RayRanks` over ranks 1.. (admission group), or None."""

    def __init__(self, rank, peers):
        self.rank, self.peers = rank, peers
        self.size = 1 + (peers.size if peers is not None else 0)
        self.admission = self

    def call(self, method: str, *args) -> list:
        return self.call_each(method, [args] * self.size)

    def call_each(self, method: str, args: list[tuple]) -> list:
        refs = self.peers.submit_each(method, args[1:]) if self.peers is not None else []
        try:
            mine = getattr(self.rank, method)(*args[0])
        except BaseException:
            if refs:  # the others finish theirs first, so a clean-up call comes after them
                try:
                    self.peers.answers(refs, method)
                except Exception:
                    pass  # rank 0's error, raised, is the one that says what went wrong
            raise
        return [mine] + (self.peers.answers(refs, method) if refs else [])


class Lockstep:
    """The `RankGroup` a decode instance's rank 0 gives its `DecodeInstance` (module doc).
    `group`: the step group (None at TP 1)."""

    def __init__(self, name: str, rank, group, peers):
        self.name, self.rank, self.group = name, rank, group
        self.admission = Spread(rank, peers)
        self.size = self.admission.size
        self._lock = threading.Lock()  # one call at a time, so every rank sees the same order
        self._broken: str | None = None

    def call(self, method: str, *args) -> list:
        with self._lock:
            if self._broken is not None:
                raise InstanceLost(self._broken, self.name)
            try:
                if self.group is not None:
                    import torch.distributed as dist

                    dist.broadcast_object_list([(method, args)], src=0, group=self.group)
                out = getattr(self.rank, method)(*args)
            except Exception as exc:
                if self.group is None:  # one rank: a failed step fails its requests only
                    raise
                self._broken = (f"instance {self.name}: {method} failed on rank 0 at TP "
                                f"{self.size} ({type(exc).__name__}: {exc}); its ranks are out "
                                "of step")
                raise InstanceLost(self._broken, self.name) from exc
        return [out] + [None] * (self.size - 1)


def follow(rank, group, name: str) -> None:
    """Run rank 0's step calls on this rank (a TP peer), in order, until the process ends."""
    import torch.distributed as dist

    while True:
        box = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=group)
            method, args = box[0]
            getattr(rank, method)(*args)
        except Exception:
            log.exception("instance %s: rank %s left lockstep; exiting", name, rank.rank)
            logging.shutdown()
            os._exit(70)  # its TP group cannot step again: rank 0's collectives fail at once
