"""A decode instance: d ranks in lockstep as a `Batcher` step engine (docs/design.md §2 steps 3-5).

A request's state arrives in the ranks' pools one of two ways, fixed per instance by the
deployment's mode; everything after it (the decode step for the batch, each request sampled on
the ranks with its own seeded generator, release on every rank at once) is the same:
- by transfer (disaggregated): `admit(StateHandle)` pulls the state from its prefill instance into
  every rank (allocate -> plan -> READ -> verify -> notify); the first token comes with the handle;
- by local prefill (`local_prefill`, monolithic): `admit(Request)` reserves the request's state on
  every rank and `prefill` runs its prompt there, which gives the first token. It is the baseline
  that measures what disaggregation costs.

The batcher admits in its own thread while the batch steps, so `admit` makes its rank calls
through `ranks.admission`: calls that run beside the ranks' steps, not queued behind them (a Ray
rank actor's admission concurrency group).

`admit` refuses with a type the router decides on: `PoolExhausted` (full), a `TransferError`
(`PeerLost`, `TransferTimeout`, `IntegrityError`, ...) when the state did not arrive, or
`BadRequest` when a rank refuses to prefill the request itself (a `ValueError` there).
"""
from __future__ import annotations

import threading
from typing import Callable, Protocol

from pdserve.decode.batcher import BadRequest
from pdserve.model.generate import Sequence
from pdserve.model.sampling import Request, Sampled
from pdserve.prefill.handle import StateHandle
from pdserve.state.block_table import BlockTable, Topology
from pdserve.state.layout import StateLayout
from pdserve.state.pools import PoolExhausted
from pdserve.transfer.errors import TransferError
from pdserve.transfer.integrity import source_runs
from pdserve.transfer.planner import DestAllocation, check_topology, plan_transfer

# (handle, source rank, runs) -> xxh3 digests computed by that source rank
DigestSource = Callable[[StateHandle, int, list], list[int]]


def _sampled(tokens: list[int] | Sampled) -> Sampled:
    """A rank's draws: bare token ids unless a request asked for log-probabilities."""
    return tokens if isinstance(tokens, Sampled) else Sampled(tokens)


class RankGroup(Protocol):
    size: int
    admission: "RankGroup"  # the same ranks, called beside their steps

    def call(self, method: str, *args) -> list: ...             # same args on every rank

    def call_each(self, method: str, args: list[tuple]) -> list: ...  # per-rank args


class LocalRanks:
    """Ranks in this process. Only one: TP > 1 needs a process per rank (collectives)."""

    def __init__(self, ranks: list):
        if len(ranks) != 1:
            raise ValueError(f"LocalRanks runs one rank in-process, got {len(ranks)}; use a "
                             "process (Ray actor) per rank for TP > 1")
        self.ranks, self.size = ranks, 1
        # in-process calls from another thread already run beside the steps
        self.admission = self

    def call(self, method: str, *args) -> list:
        return [getattr(r, method)(*args) for r in self.ranks]

    def call_each(self, method: str, args: list[tuple]) -> list:
        return [getattr(r, method)(*a) for r, a in zip(self.ranks, args, strict=True)]


class DecodeInstance:
    """`layout`: the ranks' pools (what a transfer allocates into); `topology`: the ranks' TP /
    DCP; `digests`: the source's digests of what is read (verify mode). `local_prefill`: the
    ranks prefill each request themselves (ranks built with `local_prefill`), which takes the
    `Request`; `idle_threads`: torch threads for such a prefill made while this instance holds no
    other request (its decode would otherwise share the cores; 0 = the ranks' own setting)."""

    def __init__(self, name: str, ranks: RankGroup, layout: StateLayout | None, eos: set[int],
                 topology: Topology | None = None, digests: DigestSource | None = None,
                 local_prefill: bool = False, idle_threads: int = 0):
        self.name, self.ranks, self.eos = name, ranks, eos
        self.layout = layout
        self.topology = topology or Topology(tp=ranks.size)
        if self.topology.tp != ranks.size:
            raise ValueError(f"topology TP={self.topology.tp} but {ranks.size} ranks")
        if self.topology.dcp > 1 and local_prefill:
            raise ValueError(f"DCP={self.topology.dcp} needs state by transfer: ranks that "
                             "prefill each request themselves (monolithic mode) hold the whole "
                             "latent")
        self.digests = digests
        self.local_prefill, self.idle_threads = local_prefill, idle_threads
        self.transfers = 0
        self.held = 0  # admitted and not yet released
        self._held_lock = threading.Lock()  # admit and release run in different threads
        self.loads = ranks.admission  # every call of `admit`: none waits behind a step
        # (source instance, rank) -> the agent generation every rank of this instance knows
        self._peers: dict[tuple[str, int], int] = {}

    # -- StepEngine -------------------------------------------------------------------------
    def admit(self, work: StateHandle | Request) -> Sequence:
        seq = self._reserve(work) if self.local_prefill else self._receive(work)
        with self._held_lock:
            self.held += 1
        return seq

    def prefill(self, seqs: list[Sequence]) -> None:
        """The first step of newly admitted requests: their prompts, where the state was not
        transferred (a transferred request arrived with its first token)."""
        if not self.local_prefill:
            return
        alone = self.idle_threads and self.held == len(seqs)
        out = _sampled(self.ranks.call("prefill", [s.request_id for s in seqs],
                                       self.idle_threads if alone else None)[0])
        for i, (s, t) in enumerate(zip(seqs, out.tokens, strict=True)):
            if out.prompt_logprobs is not None:
                s.prompt_logprobs = out.prompt_logprobs[i]
            s.append(t, self.eos, out.logprobs[i] if out.logprobs else None)

    def decode(self, seqs: list[Sequence]) -> list[int]:
        """One token for each of `seqs` (returned in their order). The step's rows go to the
        ranks in KDA slot order (rank 0's ids, `table.kda_slot`): the fused KDA kernel's CTAs,
        one per row and head in row order, then walk each layer's state pool in address order
        (H200, H=12 B=64: 27.5-27.8 us per layer against 27.8-28.2 with the same slots
        shuffled; docs/kernels.md, "What was tried"). Every rank gets the same order,
        so rows line up across ranks whatever ids the other ranks hold."""
        order = sorted(range(len(seqs)), key=lambda i: seqs[i].table.kda_slot)
        rows = [seqs[i] for i in order]
        # The ranks sample (token ids come back, not logits): a step's round trip is a few
        # integers each way, and this thread does no per-row torch work.
        got = _sampled(self.ranks.call("decode", [s.request_id for s in rows],
                                       [s.output[-1] for s in rows],
                                       [len(s.output) for s in rows])[0])
        out = [0] * len(seqs)
        for j, (i, t) in enumerate(zip(order, got.tokens, strict=True)):
            seqs[i].append(t, self.eos, got.logprobs[j] if got.logprobs else None)
            out[i] = t
        return out

    def release(self, seq: Sequence) -> None:
        with self._held_lock:
            self.held -= 1
        self.ranks.call("free", seq.request_id)

    # -- admission by local prefill ---------------------------------------------------------
    def _reserve(self, request: Request) -> Sequence:
        # One seed for every rank (each samples the same rows) and for the request's lifetime.
        request = Request(request.request_id, request.prompt, request.params.with_seed())
        try:
            slot = self.loads.call("admit", request)[0]   # rank 0's running slot: row order
        except Exception as exc:
            if self.ranks.size > 1:  # a rank that did admit (one died, say) gives it back
                try:
                    self.loads.call("free", request.request_id)
                except Exception:
                    pass  # the admission error, re-raised, says what went wrong
            if isinstance(exc, ValueError) and not isinstance(exc, BadRequest):
                # the rank's contract: a ValueError is this request's fault (empty prompt, ids
                # outside the vocabulary), not the instance's
                raise BadRequest(f"{self.name}: {exc}") from exc
            raise
        return Sequence(request.request_id, list(request.prompt), request.params,
                        BlockTable([[]], slot, [], 0))

    # -- admission by transfer --------------------------------------------------------------
    def _receive(self, handle: StateHandle) -> Sequence:
        manifest = handle.manifest
        check_topology(manifest.shapes, manifest.topology, self.topology)
        seq = Sequence(handle.request_id, [], handle.params,
                       BlockTable([[]], 0, [], manifest.num_tokens), [handle.first_token],
                       handle.finished, [handle.first_logprob] if handle.params.logprobs
                       is not None else [], handle.prompt_logprobs)
        if handle.finished:
            return seq
        self._connect(handle.agents)
        parts = self._allocate(handle)
        seq.table.kda_slot = parts[0][1][0]   # rank 0's running slot: the step's row order
        alloc = DestAllocation(self.topology, self.layout, [p[0] for p in parts],
                               [p[1] for p in parts], [p[2] for p in parts])
        try:
            digests = self._digests(handle, alloc) if self.digests else [None] * self.ranks.size
            self.loads.call_each("receive", [(manifest, alloc, handle.instance, d,
                                              handle.request_id, handle.params) for d in digests])
        except Exception as exc:
            self.loads.call("abandon", manifest, alloc, handle.instance, handle.request_id)
            if isinstance(exc, TransferError):
                raise
            raise TransferError(f"request {handle.request_id}: {type(exc).__name__}: {exc}") from exc
        self.transfers += 1
        return seq

    def _connect(self, agents: list) -> None:
        """Make the ranks know the source agents. A known generation is skipped (a round trip
        per request that stalled the running batch); a new or older one goes to the ranks,
        which evict the old agent or refuse the stale one."""
        if all(self._peers.get((a.instance, a.rank)) == a.generation for a in agents):
            return
        self.loads.call("connect", agents)
        self._peers.update({(a.instance, a.rank): a.generation for a in agents})

    def _allocate(self, handle: StateHandle) -> list:
        """Allocate on every rank; if any rank is full, give back what the others took."""
        extra = handle.params.max_tokens
        parts = self.loads.call("allocate", handle.manifest, self.topology, extra)
        if all(p is not None for p in parts):
            return parts
        self.loads.call_each("unallocate", [(p,) for p in parts])
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
