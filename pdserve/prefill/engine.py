"""The prefill interface and the `reference` engine.

A prefill instance is TP = p `PrefillRank`s driven in lockstep by its owner (a Ray actor per rank
in a cluster, plain calls with p = 1). Each rank prefills its prompts on its shard, samples the
first token (every rank gets the same full-vocabulary logits), and leaves the state in its pools
under a lease; `StateHandle`s describe it for the decode side. The shape follows vLLM's connector
hooks: `prefill` ~ request_finished (delay the free, describe the blocks), `poll` ~ the
notification/lease handling of get_finished, `cancel` ~ abort.

With a per-step token budget (`chunk_tokens`) a `prefill` call is one step of chunked prefill
(`pdserve.prefill.scheduler`): it takes new prompts, runs the next chunks of every prompt in
progress, and returns the prompts it finished; the owner calls again while any are in progress.
"""
from __future__ import annotations

import time

import msgspec
import torch

from pdserve.model.generate import ReferenceEngine, Sequence, build_model, sample_next
from pdserve.model.parallel import TPGroup
from pdserve.model.sampling import Request, SamplingParams
from pdserve.state.block_table import Topology
from pdserve.state.layout import StateLayout, dtype_of
from pdserve.state.manifest import build_manifest
from pdserve.transfer.nixl_agent import AgentInfo, RankAgent
from pdserve.transfer.regions import RegionTable
from pdserve.transfer.source import SourceRank

from pdserve.prefill.handle import StateHandle
from pdserve.prefill.scheduler import ChunkScheduler


class PrefillResult(msgspec.Struct, frozen=True):
    request_id: str
    handle: StateHandle | None = None
    error: str | None = None
    # the refusal itself (PoolExhausted, ValueError for a bad request), pickled across Ray with
    # the result so the router decides on its type; None where only a message is known
    exc: BaseException | None = None


class PrefillRank:
    """One TP rank of a `reference` prefill instance.

    `decode_topology`: the decode instances' topology (a deployment setting), so each request's
    latent pages are placed for their DCP ranks' reads (`LatentPool`); None = plain allocation.
    `chunk_tokens`: prompt tokens per `prefill` call (the chunked prefill's step budget); None =
    every call prefills its prompts whole."""

    def __init__(self, instance: str, rank: int, generation: int, config, tp: TPGroup | None = None,
                 layout: StateLayout | None = None, num_pages: int = 256, num_slots: int = 16,
                 seed: int = 0, checkpoint: str | None = None, lease_s: float = 30.0,
                 device: str = "cpu", dtype: str = "float32",
                 decode_topology: Topology | None = None, chunk_tokens: int | None = None):
        self.instance, self.rank, self.generation, self.lease_s = instance, rank, generation, lease_s
        tp = tp or TPGroup()
        model = build_model(config, tp, dtype=dtype_of(dtype), seed=seed,
                            checkpoint=checkpoint)
        self.engine = ReferenceEngine(model.to(device), layout, num_pages, num_slots)
        self.engine.pools.latent.decode_topology = decode_topology
        self.topology = Topology(tp=tp.size)
        self.source = SourceRank(RankAgent(instance, rank, generation,
                                           RegionTable.of_pools(self.engine.pools), device),
                                 release=self._release)
        self.scheduler = ChunkScheduler(chunk_tokens)
        self.prefilling: dict[str, SamplingParams] = {}  # in progress: the request's own params
        self.seqs: dict[str, Sequence] = {}  # prefilled, state held under lease

    def info(self) -> AgentInfo:
        return self.source.agent.info()

    def connect(self, infos: list[AgentInfo]) -> None:
        for info in infos:
            self.source.agent.connect(info)

    def prefill(self, requests: list[Request], agents: list[AgentInfo],
                threads: int | None = None) -> list[PrefillResult]:
        """Take `requests` and run one prefill step: the results of the requests this call
        finished or refused (refusals first, then in arrival order); `agents` are this
        instance's rank agents (for handles). Without a step budget every request finishes in
        the call that brought it; with one, a request still in progress comes back from a later
        call (`prefill([])` runs the next step). `threads`: torch threads for this call only
        (the owner knows when the host's other ranks idle)."""
        if not threads:
            return self._prefill(requests, agents)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return self._prefill(requests, agents)
        finally:
            torch.set_num_threads(before)

    def _prefill(self, requests: list[Request], agents: list[AgentInfo]) -> list[PrefillResult]:
        results = []
        for req in requests:
            one_token = msgspec.structs.replace(req.params, max_tokens=1)
            try:
                seq = self.engine.admit(Request(req.request_id, req.prompt, one_token))
            except Exception as exc:
                results.append(PrefillResult(
                    req.request_id, error=f"{type(exc).__name__}: {exc}", exc=exc))
                continue
            self.scheduler.add(seq)
            self.prefilling[seq.request_id] = req.params
        plan = self.scheduler.plan()
        if not plan:
            return results
        seqs = [s for s, _ in plan]
        logits = self.engine.step(seqs, [chunk for _, chunk in plan])
        for seq, row in zip(seqs, logits):
            if seq.table.num_tokens == len(seq.prompt):
                self.scheduler.remove(seq.request_id)
                sample_next([seq], row[None], self.engine.eos)
                results.append(self._hold(seq, self.prefilling.pop(seq.request_id), agents))
        return results

    def _hold(self, seq: Sequence, own: SamplingParams, agents: list[AgentInfo]) -> PrefillResult:
        """The prefilled `seq`'s result; its state is held under lease for the decode side
        (`own`: the request's params, not the one-token ones it was prefilled with)."""
        self.seqs[seq.request_id] = seq
        deadline = self.source.hold(seq.request_id, self.lease_s)
        manifest = build_manifest(seq.request_id, self.engine.config, self.engine.shapes,
                                  self.engine.layout, seq.table, self.topology)
        first = seq.output[0]
        stopped = "stop" if seq.finish_reason == "stop" else (
            "length" if own.max_tokens <= 1 else None)
        params = msgspec.structs.replace(own, seed=seq.params.seed)
        result = PrefillResult(seq.request_id, StateHandle(
            seq.request_id, self.instance, self.generation, agents, manifest, first, params,
            len(seq.prompt), time.time() + (deadline - time.monotonic()), stopped,
            seq.logprobs[0] if seq.logprobs else None, seq.prompt_logprobs))
        if stopped:  # nothing to transfer: the request ended with its first token
            self.source.cancel(seq.request_id)
        return result

    def poll(self) -> list[tuple[str, str]]:
        """Free state that every destination rank has read, or whose lease expired."""
        return self.source.poll()

    def digests(self, request_id: str, runs) -> list[int]:
        return self.source.digests(request_id, runs)

    def renew(self, request_id: str, lease_s: float) -> float:
        return self.source.renew(request_id, lease_s)

    def cancel(self, request_id: str) -> bool:
        seq = self.scheduler.remove(request_id)
        if seq is not None:  # still prefilling: nothing is held for it yet
            del self.prefilling[request_id]
            self.engine.release(seq)
            return True
        return self.source.cancel(request_id)

    def stats(self) -> dict:
        pools = self.engine.pools
        return {"held": len(self.seqs), "prefilling": len(self.scheduler), "pages_free": pools.latent.num_free,
                "slots_free": pools.slots.num_free, "pages_total": pools.latent.capacity,
                "slots_total": pools.slots.capacity}

    def close(self) -> None:
        self.source.agent.close()

    def _release(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.engine.release(seq)
