"""A decode instance: d ranks in lockstep, fed by transferred state (DESIGN.md §2 steps 3-4).

`DecodeInstance` is a step engine for `Batcher`: `admit` pulls a request's state from its prefill
instance into every rank (allocate -> plan -> READ -> verify -> notify), the first token comes
with the handle, `decode` runs one TP-sharded step for the batch and samples each request with
its own seeded generator, `release` frees the request on every rank at once.
"""
from __future__ import annotations

from typing import Callable, Protocol

from pdserve.model.generate import Sequence, sample_next
from pdserve.prefill.handle import StateHandle
from pdserve.state.block_table import BlockTable, Topology
from pdserve.state.layout import StateLayout
from pdserve.state.pools import PoolExhausted
from pdserve.transfer.errors import TransferError
from pdserve.transfer.integrity import source_runs
from pdserve.transfer.planner import DestAllocation, check_topology, plan_transfer

# (handle, source rank, runs) -> xxh3 digests computed by that source rank
DigestSource = Callable[[StateHandle, int, list], list[int]]


class RankGroup(Protocol):
    size: int

    def call(self, method: str, *args) -> list: ...             # same args on every rank

    def call_each(self, method: str, args: list[tuple]) -> list: ...  # per-rank args


class LocalRanks:
    """Ranks in this process. Only one: TP > 1 needs a process per rank (collectives)."""

    def __init__(self, ranks: list):
        if len(ranks) != 1:
            raise ValueError(f"LocalRanks runs one rank in-process, got {len(ranks)}; use a "
                             "process (Ray actor) per rank for TP > 1")
        self.ranks, self.size = ranks, 1

    def call(self, method: str, *args) -> list:
        return [getattr(r, method)(*args) for r in self.ranks]

    def call_each(self, method: str, args: list[tuple]) -> list:
        return [getattr(r, method)(*a) for r, a in zip(self.ranks, args, strict=True)]


class DecodeInstance:
    def __init__(self, name: str, ranks: RankGroup, layout: StateLayout, eos: set[int],
                 topology: Topology | None = None, digests: DigestSource | None = None):
        self.name, self.ranks, self.layout, self.eos = name, ranks, layout, eos
        self.topology = topology or Topology(tp=ranks.size)
        if self.topology.tp != ranks.size:
            raise ValueError(f"topology TP={self.topology.tp} but {ranks.size} ranks")
        if self.topology.dcp != 1:
            raise ValueError("decode with DCP > 1 is not supported by the reference runtime yet "
                             f"(got dcp={self.topology.dcp}); DCP transfers are")
        self.digests = digests
        self.transfers = 0

    # -- StepEngine -------------------------------------------------------------------------
    def admit(self, handle: StateHandle) -> Sequence:
        manifest = handle.manifest
        check_topology(manifest.shapes, manifest.topology, self.topology)
        seq = Sequence(handle.request_id, [], handle.params,
                       BlockTable([[]], 0, [], manifest.num_tokens), [handle.first_token],
                       handle.finished)
        if handle.finished:
            return seq
        self.ranks.call("connect", handle.agents)
        parts = self._allocate(handle)
        alloc = DestAllocation(self.topology, self.layout, [p[0] for p in parts],
                               [p[1] for p in parts], [p[2] for p in parts])
        try:
            digests = self._digests(handle, alloc) if self.digests else [None] * self.ranks.size
            self.ranks.call_each("receive", [(manifest, alloc, handle.instance, d, handle.request_id)
                                             for d in digests])
        except Exception as exc:
            self.ranks.call("abandon", manifest, alloc, handle.instance, handle.request_id)
            if isinstance(exc, TransferError):
                raise
            raise TransferError(f"request {handle.request_id}: {type(exc).__name__}: {exc}") from exc
        self.transfers += 1
        return seq

    def prefill(self, seqs: list[Sequence]) -> None:
        """Nothing to run: the first token arrived with the state."""

    def decode(self, seqs: list[Sequence]) -> list[int]:
        logits = self.ranks.call("step", [s.request_id for s in seqs],
                                 [s.output[-1] for s in seqs])[0]
        return sample_next(seqs, logits, self.eos)

    def release(self, seq: Sequence) -> None:
        self.ranks.call("free", seq.request_id)

    # -- helpers ----------------------------------------------------------------------------
    def _allocate(self, handle: StateHandle) -> list:
        """Allocate on every rank; if any rank is full, give back what the others took."""
        extra = handle.params.max_tokens
        parts = self.ranks.call("allocate", handle.manifest, self.topology, extra)
        if all(p is not None for p in parts):
            return parts
        self.ranks.call_each("unallocate", [(p,) for p in parts])
        raise PoolExhausted(f"decode instance {self.name}: no room for request "
                            f"{handle.request_id} ({handle.manifest.num_tokens} cached + {extra} "
                            "new tokens); running requests are unaffected")

    def _digests(self, handle: StateHandle, alloc: DestAllocation) -> list[dict[int, list[int]]]:
        plan = plan_transfer(handle.manifest, alloc)
        out = []
        for r in range(self.topology.tp):
            mine = plan.for_rank(r)
            out.append({s: self.digests(handle, s, source_runs([x for x in mine if x.src_rank == s]))
                        for s in sorted({x.src_rank for x in mine})})
        return out
