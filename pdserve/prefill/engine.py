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

With a prefix cache (`pdserve.prefill.prefix_cache`) a request whose prompt starts with cached
blocks shares their latent pages, starts from the KDA checkpoint after them and prefills only
the rest; a finished prefill leaves its full blocks and checkpoints in the cache.
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
from pdserve.state.manifest import build_manifest, model_fingerprint
from pdserve.state.pools import PoolExhausted
from pdserve.transfer.nixl_agent import AgentInfo, RankAgent
from pdserve.transfer.regions import RegionTable
from pdserve.transfer.source import SourceRank

from pdserve.prefill.handle import StateHandle
from pdserve.prefill.prefix_cache import Hit, PrefixCache, PrefixCacheConfig, PrefixChanges
from pdserve.prefill.scheduler import ChunkScheduler


class _Cached(msgspec.Struct):
    """A request's part in the prefix cache: its hit, its KDA checkpoints by position, and
    once it finished, the entries pinned for it and the pages and slots the cache owns."""

    hit: Hit
    checkpoints: dict[int, int] = {}
    keys: list[int] = []
    pages: set[int] = set()
    slots: set[int] = set()


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
    every call prefills its prompts whole. `prefix_cache`: None = no prefix cache."""

    def __init__(self, instance: str, rank: int, generation: int, config, tp: TPGroup | None = None,
                 layout: StateLayout | None = None, num_pages: int = 256, num_slots: int = 16,
                 seed: int = 0, checkpoint: str | None = None, lease_s: float = 30.0,
                 device: str = "cpu", dtype: str = "float32",
                 decode_topology: Topology | None = None, chunk_tokens: int | None = None,
                 prefix_cache: PrefixCacheConfig | None = PrefixCacheConfig()):
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
        self.cache = self._cache(prefix_cache)
        self.cached: dict[str, _Cached] = {}  # with a cache: every request admitted, by id

    def _cache(self, cfg: PrefixCacheConfig | None) -> PrefixCache | None:
        if cfg is None or not cfg.enabled:
            return None
        pools = self.engine.pools
        bound = cfg.max_bytes or int(cfg.max_share * sum(
            t.nbytes for t in (pools.latent.data, pools.slots.recurrent, pools.slots.conv)))
        return PrefixCache(pools, model_fingerprint(self.engine.config, self.engine.layout),
                           bound, cfg.checkpoint_interval)

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
            try:
                seq = self._admit(req)
            except Exception as exc:
                results.append(PrefillResult(
                    req.request_id, error=f"{type(exc).__name__}: {exc}", exc=exc))
                continue
            stops = (self.cache.stops(len(seq.prompt), seq.table.num_tokens,
                                      self.cached[seq.request_id].hit.shared)
                     if self.cache else [])
            self.scheduler.add(seq, stops)
            self.prefilling[seq.request_id] = req.params
        # without a step budget a call finishes its prompts, in as many steps as stops cut
        while plan := self.scheduler.plan():
            seqs = [s for s, _ in plan]
            logits = self.engine.step(seqs, [chunk for _, chunk in plan])
            for seq, row in zip(seqs, logits):
                if self.cache:
                    self._checkpoint(seq)
                if seq.table.num_tokens == len(seq.prompt):
                    self.scheduler.remove(seq.request_id)
                    sample_next([seq], row[None], self.engine.eos)
                    results.append(self._hold(seq, self.prefilling.pop(seq.request_id), agents))
            if self.scheduler.budget is not None:
                break
        return results

    def _admit(self, req: Request) -> Sequence:
        """Admit `req` for its prefill (one token's room after the prompt); with a cache, from
        its longest cached prefix (none for prompt logprobs: they need every prompt row)."""
        one_token = Request(req.request_id, req.prompt,
                            msgspec.structs.replace(req.params, max_tokens=1))
        if self.cache is None:
            return self.engine.admit(one_token)
        hit = self.cache.acquire(req.prompt) if req.params.prompt_logprobs is None else Hit()
        self.cache.make_room(self.engine.pools.latent.pages_for(len(req.prompt) + 1), 1)
        try:
            seq = self.engine.admit(one_token)
        except Exception:
            self.cache.release(hit.keys)
            raise
        if hit.tokens:  # the hit's pages for the fresh ones, its checkpoint as the start
            pools, pages = self.engine.pools, seq.table.latent_pages[0]
            pools.latent.free(pages[:len(hit.pages)])
            pages[:len(hit.pages)] = hit.pages
            pools.slots.copy(hit.slot, seq.table.kda_slot)
            seq.table.num_tokens = hit.tokens
        self.cached[seq.request_id] = _Cached(hit, {})
        return seq

    def _checkpoint(self, seq: Sequence) -> None:
        """Snapshot `seq`'s KDA state where a stop ended its chunk (skipped when no slot is
        free, even after evicting)."""
        pos = seq.table.num_tokens
        shared = self.cached[seq.request_id].hit.shared
        if (pos not in self.cache.stops(len(seq.prompt), pos - 1, shared)
                or not self.cache.make_room(0, 1)):
            return
        try:
            slot = self.engine.pools.slots.allocate(1)[0]
        except PoolExhausted:  # taken by an admission in another thread since
            return
        self.engine.pools.slots.copy(seq.table.kda_slot, slot)
        self.cached[seq.request_id].checkpoints[pos] = slot

    def _hold(self, seq: Sequence, own: SamplingParams, agents: list[AgentInfo]) -> PrefillResult:
        """The prefilled `seq`'s result; its state is held under lease for the decode side
        (`own`: the request's params, not the one-token ones it was prefilled with)."""
        self.seqs[seq.request_id] = seq
        if self.cache:  # its full blocks stay for the next request with its prefix
            c = self.cached[seq.request_id]
            c.keys, c.pages, c.slots = self.cache.insert(
                seq.prompt, seq.table.latent_pages[0], c.checkpoints, c.hit)
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

    def prefix_changes(self) -> PrefixChanges | None:
        """What this rank's prefix cache changed since the last call (None: no cache), for
        the router's index of where prefixes are cached."""
        return self.cache.changes() if self.cache else None

    def digests(self, request_id: str, runs) -> list[int]:
        return self.source.digests(request_id, runs)

    def renew(self, request_id: str, lease_s: float) -> float:
        return self.source.renew(request_id, lease_s)

    def cancel(self, request_id: str) -> bool:
        seq = self.scheduler.remove(request_id)
        if seq is not None:  # still prefilling: nothing is held for it yet
            del self.prefilling[request_id]
            self._free(seq)
            return True
        return self.source.cancel(request_id)

    def stats(self) -> dict:
        pools = self.engine.pools
        return {"held": len(self.seqs), "prefilling": len(self.scheduler), "pages_free": pools.latent.num_free,
                "slots_free": pools.slots.num_free, "pages_total": pools.latent.capacity,
                "slots_total": pools.slots.capacity} | (self.cache.stats() if self.cache else {})

    def close(self) -> None:
        self.source.agent.close()

    def _release(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self._free(seq)

    def _free(self, seq: Sequence) -> None:
        """Free what `seq` holds, but for what the prefix cache owns (unpinned instead)."""
        c = self.cached.pop(seq.request_id, None)
        if c is None:
            self.engine.release(seq)
            return
        pools, t = self.engine.pools, seq.table
        shared = c.pages | set(c.hit.pages)
        pools.latent.free([p for p in t.latent_pages[0] if p not in shared])
        pools.slots.free([t.kda_slot] + [s for s in c.checkpoints.values() if s not in c.slots])
        t.latent_pages, t.kda_slot = [[]], 0
        self.cache.release(c.keys or c.hit.keys)
