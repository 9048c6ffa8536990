"""One TP rank of a decode instance: its model shard, its pools, the decode step, and the way a
request's state arrives in those pools, fixed per rank: pulled from a prefill instance through
the rank's transfer endpoint (disaggregated mode), or prefilled here by a `ReferenceEngine` over
the same pools (`local_prefill`, monolithic mode: no transfer endpoint).

The instance (`pdserve.decode.instance`) drives all ranks in lockstep; every method here is what
one rank does for one call, whether it lives in this process or in a Ray actor. The rank samples
(`decode` returns token ids, not logits), so a step's round trip carries a few integers whatever
the vocabulary size; a step some of whose requests ask for log-probabilities returns a `Sampled`
with them instead. For penalties the rank keeps each penalized request's output tokens: every
token a step is fed is the request's previous output token.
"""
from __future__ import annotations

import logging

import torch

from pdserve.decode.graphs import DecodeGraphs
from pdserve.kernels import registry
from pdserve.model.batch import DecodeBatch, ForwardBatch
from pdserve.model.dcp import DCPDecodeBatch
from pdserve.model.generate import ReferenceEngine, Sequence, build_model
from pdserve.model.parallel import DCPGroup, TPGroup
from pdserve.model.sampling import Request, Sampled, SamplingParams, sample_rows
from pdserve.state.block_table import BlockTable, Topology
from pdserve.state.layout import RankShapes, StateLayout, dtype_of
from pdserve.state.manifest import StateManifest
from pdserve.state.pools import PoolExhausted, StatePools
from pdserve.transfer.dest import DestRank, TransferConfig
from pdserve.transfer.nixl_agent import AgentInfo, RankAgent
from pdserve.transfer.planner import DestAllocation
from pdserve.transfer.regions import RegionTable

log = logging.getLogger("pdserve.decode")


def fused_step_for(op: str, problem, backend: str):
    """The fused decode op `op` of `backend`, or None for the model's own path. The registry's
    guard decides per call on `problem(*args)`; a refused call returns None and the layer runs
    its reference path (the registry logs each reason once)."""
    if backend == registry.REFERENCE:
        return None

    def step(*args, **opts):
        res = registry.resolve(op, backend, problem(*args))
        return None if res.backend == registry.REFERENCE else res.impl(*args, **opts)

    return step


def kda_step_for(backend: str):
    """The fused KDA decode step (`pdserve.kernels.kda_decode`) for `backend`, or None."""
    from pdserve.kernels.kda_decode import OP, kda_decode_problem
    return fused_step_for(OP, kda_decode_problem, backend)


def mla_step_for(backend: str, fp8_query: str | None = None, deterministic: bool = False):
    """The MLA decode attention over the paged cache (`pdserve.kernels.mla_decode`) for
    `backend`, or None. Every other choice is the kernel's launch plan default (the plan the
    benchmark's figures measure, kernels/mla_decode/plan.py). `fp8_query`: the kernel's query
    with an fp8 latent pool ("single" | "split"; None: the plan's default, "single");
    `deterministic`: bit-identical results from run to run (no tile pool)."""
    from pdserve.kernels.mla_decode import OP, problem_from_tensors
    from pdserve.kernels.mla_decode.plan import check_fp8_query
    step = fused_step_for(OP, problem_from_tensors, backend)
    fixed = {}                          # only what the caller chose
    if fp8_query is not None:
        fixed["fp8_query"] = check_fp8_query(fp8_query)
    if deterministic:
        fixed["deterministic"] = True
    if step is None or not fixed:
        return step
    return lambda *args, **opts: step(*args, **fixed, **opts)


def _fused_step(model, pools: StatePools, backend: str):
    """The whole-step fused path (`pdserve.decode.fused_step`) for a non-reference backend,
    or None (the model's own forward, with the fused KDA / MLA ops) where it does not apply
    (TP > 1, not bf16, a feature it lacks: logged once)."""
    if backend == registry.REFERENCE:
        return None
    from pdserve.decode.fused_step import FusedDecodeStep
    from pdserve.model.model import NotSupportedYet
    try:
        return FusedDecodeStep(model, pools, backend)
    except NotSupportedYet as exc:
        log.warning("decode backend %s: whole-step fused path off: %s", backend, exc)
        return None


def _dcp_group(rank: int, tp: TPGroup, topology: Topology, local_prefill: bool,
               cuda_graphs: bool) -> DCPGroup | None:
    """The rank's DCP group (None at DCP 1); ValueError names what a DCP rank cannot do."""
    if topology.tp != tp.size:
        raise ValueError(f"topology TP={topology.tp} on a rank of a TP group of {tp.size}")
    if topology.dcp == 1:
        return None
    if local_prefill:
        raise ValueError(f"DCP={topology.dcp} needs state by transfer: a rank that prefills "
                         "itself (monolithic mode) holds the whole latent")
    if cuda_graphs:
        raise ValueError(f"DCP={topology.dcp}: CUDA graph capture runs DCP 1 only")
    return DCPGroup(rank, topology, tp.group)


class DecodeRank:
    def __init__(self, instance: str, rank: int, config, tp: TPGroup | None = None,
                 layout: StateLayout | None = None, num_pages: int = 256, num_slots: int = 16,
                 seed: int = 0, checkpoint: str | None = None, backend: str = "reference",
                 transfer: TransferConfig = TransferConfig(), device: str = "cpu",
                 generation: int = 0, dtype: str = "float32", cuda_graphs: bool = False,
                 graph_max_tokens: int = 4096, mla_fp8_query: str | None = None,
                 mla_deterministic: bool = False, local_prefill: bool = False,
                 topology: Topology | None = None):
        """`cuda_graphs`: capture the decode step per batch-size bucket (CUDA, TP=1) for
        sequences of up to `graph_max_tokens` tokens; other steps run eagerly (logged once).
        `mla_fp8_query`, `mla_deterministic`: the MLA kernel's query over an fp8 latent pool
        and its run-to-run determinism (mla_step_for). `local_prefill`: requests arrive by
        `admit` + `prefill` here instead of `allocate` + `receive`; `transfer` and
        `generation` (which versions the transfer endpoint) are then unused. `topology`: the
        instance's TP / DCP / interleave (default TP = tp.size, DCP 1); with DCP > 1 this rank
        holds every request's DCP shard of the latent and attends over it with its group."""
        tp = tp or TPGroup()
        self.topology = topology or Topology(tp=tp.size)
        self.dcp = _dcp_group(rank, tp, self.topology, local_prefill, cuda_graphs)
        self.rank, self.config = rank, config
        self.model = build_model(config, tp, dtype=dtype_of(dtype), seed=seed,
                            checkpoint=checkpoint).to(device)
        self.layout = layout or StateLayout(latent_dtype="float32", conv_dtype="float32")
        # conv staging takes a prefill rank's conv slots as they arrive; a local prefill
        # writes its own slots in place
        self.pools = StatePools(RankShapes.of(config, tp.size), self.layout, num_pages, num_slots,
                                device=device, conv_staging=not local_prefill)
        self.kda_step = kda_step_for(backend)
        self.mla_step = mla_step_for(backend, mla_fp8_query, mla_deterministic)
        self.fused = _fused_step(self.model, self.pools, backend)
        self.graphs = (DecodeGraphs(self.model, self.pools, graph_max_tokens,
                                    kda_step=self.kda_step, mla_step=self.mla_step,
                                    forward=self._fused_forward if self.fused else None)
                       if cuda_graphs else None)
        self._eager_reasons: set[str] = set()
        self.dest = self.prefiller = None  # how state arrives: exactly one of them is set
        if local_prefill:
            self.prefiller = ReferenceEngine(self.model, pools=self.pools)
        else:
            self.dest = DestRank(RankAgent(instance, rank, generation,
                                           RegionTable.of_pools(self.pools), device,
                                           # measured on DRAM (see RankAgent); VRAM keeps the
                                           # thread until the notify READ is checked on the H200
                                           progress_thread=str(device).startswith("cuda")),
                                 self.pools, transfer)
        self.tables: dict[str, BlockTable] = {}
        self.params: dict[str, SamplingParams] = {}
        self.history: dict[str, list[int]] = {}    # penalized requests' output tokens so far
        self.to_prefill: dict[str, Sequence] = {}  # admitted here, prompt not run yet
        self.device = device

    # -- state by transfer ------------------------------------------------------------------
    def info(self) -> AgentInfo:
        return self.dest.agent.info()

    def connect(self, infos: list[AgentInfo]) -> None:
        for info in infos:
            self.dest.agent.connect(info)

    def allocate(self, manifest: StateManifest, topology: Topology, extra_tokens: int):
        """(pages, slots, staging slots), or None when this rank's pools are full."""
        if (topology.tp, topology.dcp) != (self.topology.tp, self.topology.dcp) or (
                topology.dcp > 1 and topology.interleave != self.topology.interleave):
            # (at DCP 1 the interleave places nothing)
            raise ValueError(f"rank {self.rank}: allocation for {topology} on a rank built for "
                             f"{self.topology}")
        try:
            return self.dest.allocate(manifest, topology, extra_tokens)
        except PoolExhausted:
            return None

    def unallocate(self, part) -> None:
        if part is not None:
            pages, slots, stage = part
            self.pools.latent.free(pages)
            self.pools.slots.free(slots + stage)

    def receive(self, manifest: StateManifest, alloc: DestAllocation, src_instance: str,
                digests: dict[int, list[int]] | None = None, request_id: str | None = None,
                params: SamplingParams | None = None) -> dict:
        """Pull a request's state; it is then known here as `request_id` (the decode side's
        id), which may differ from the source's own id in the manifest (vLLM numbers its
        requests itself). `params`: how `decode` samples it (seeded); a caller that only runs
        `step` (logits) may leave it out."""
        lookup = None if digests is None else (lambda s, runs: digests[s])
        stats = self.dest.receive(manifest, alloc, src_instance, lookup)
        key = request_id or manifest.request_id
        self.tables[key] = BlockTable(
            [alloc.latent_pages[self.rank]], alloc.slots[self.rank][0], [], manifest.num_tokens)
        if params is not None:
            self.params[key] = params
            if params.penalized:  # a resumed request's earlier tokens are not known here
                self.history[key] = []
        for s in alloc.slots[self.rank][1:]:  # checkpoints are not needed to decode
            self.pools.slots.free([s])
        return stats

    def abandon(self, manifest: StateManifest, alloc: DestAllocation, src_instance: str,
                request_id: str | None = None) -> None:
        """A transfer that failed on another rank: free this rank's share, tell the source."""
        key = request_id or manifest.request_id
        if key in self.tables:
            self.free(key)
        else:
            try:
                self.dest.free(alloc)
            except ValueError:
                pass  # already freed by this rank's own failed receive
        for s in range(manifest.topology.tp):
            try:
                self.dest.agent.notify(src_instance, s, f"cancel|{manifest.request_id}".encode())
            except Exception:
                pass  # a lost source frees by lease expiry

    # -- state by local prefill -------------------------------------------------------------
    def admit(self, request: Request) -> int:
        """Reserve the request's pages (prompt + max_tokens) and slot; returns the running KDA
        slot. Raises PoolExhausted (full) or ValueError (the request's fault).
        `request.params` must carry a seed (every rank must draw the same one)."""
        if request.params.seed is None:
            raise ValueError(f"request {request.request_id}: unseeded parameters reached rank "
                             f"{self.rank}; the instance seeds them once for all ranks")
        seq = self.prefiller.admit(request)
        self.to_prefill[seq.request_id] = seq
        self.tables[seq.request_id], self.params[seq.request_id] = seq.table, seq.params
        if seq.params.penalized:
            self.history[seq.request_id] = seq.history
        return seq.table.kda_slot

    def prefill(self, request_ids: list[str], threads: int | None = None
                ) -> list[int] | Sampled | None:
        """Run the admitted prompts into this rank's pools; each one's first token (rank 0),
        as a `Sampled` with the log-probabilities where a request asks for them.
        `threads`: torch threads for this call only (the owner knows when nothing else runs)."""
        seqs = [self.to_prefill.pop(r) for r in request_ids]
        before = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        try:
            first = self.prefiller.prefill(seqs)
        finally:
            torch.set_num_threads(before)
        if self.rank != 0:
            return None
        if all(s.params.logprobs is None and s.params.prompt_logprobs is None for s in seqs):
            return first
        return Sampled(first, [s.logprobs[0] if s.logprobs else None for s in seqs],
                       [s.prompt_logprobs for s in seqs])

    # -- decode -----------------------------------------------------------------------------
    def _fused_forward(self, ids: torch.Tensor, batch: DecodeBatch) -> torch.Tensor:
        return self.fused(ids, batch)

    def _forward(self, request_ids: list[str], tokens: list[int]
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decode step: (fp32 logits [n, vocab] on the device, greedy ids or None)."""
        tables = [self.tables[r] for r in request_ids]
        why = None if self.graphs is None else self.graphs.refuse(tables)
        if self.graphs is not None and why is None:
            logits, greedy = self.graphs.run(tables, tokens)
        else:
            if why is not None and why not in self._eager_reasons:
                self._eager_reasons.add(why)
                log.warning("decode step runs without CUDA graphs: %s", why)
            ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
            if self.dcp is not None:
                batch = DCPDecodeBatch.of(tables, self.dcp, self.pools.latent.page_tokens,
                                          self.device)
                logits = self.model(ids, batch, self.pools, kda_step=self.kda_step,
                                    mla_step=self.mla_step)
            elif self.fused is not None:
                batch = DecodeBatch.of(tables, self.pools.latent.page_tokens, self.device)
                logits = self.fused(ids, batch)
            else:
                batch = ForwardBatch.of(tables, [1] * len(tables))
                logits = self.model(ids, batch, self.pools, logit_rows=batch.last_rows(),
                                    kda_step=self.kda_step, mla_step=self.mla_step)
            greedy = None
        for t in tables:
            t.num_tokens += 1
        return logits, greedy

    def step(self, request_ids: list[str], tokens: list[int]) -> torch.Tensor | None:
        """One decode step; returns the logits on rank 0 (every rank computes them)."""
        logits, _ = self._forward(request_ids, tokens)
        return logits.cpu() if self.rank == 0 else None

    def decode(self, request_ids: list[str], tokens: list[int], positions: list[int]
               ) -> list[int] | Sampled | None:
        """One decode step, sampled here on the logits' device: the token at output position
        `positions[i]` for each request (rank 0; the others return None). Only token ids leave
        the device, and log-probabilities for the requests that ask for them (a `Sampled`)."""
        missing = [r for r in request_ids if r not in self.params]
        if missing:
            raise ValueError(f"requests {missing[:3]} were received without sampling params; "
                             "`decode` samples with them (pass params to `receive`)")
        for r, t in zip(request_ids, tokens):
            if r in self.history:  # the step's input is the previous output token
                self.history[r].append(t)
        logits, greedy = self._forward(request_ids, tokens)
        if self.rank != 0:
            return None
        params = [self.params[r] for r in request_ids]
        if greedy is not None and all(p.plain for p in params):
            return greedy.tolist()
        out = sample_rows(logits, params, positions,
                          [self.history.get(r, []) for r in request_ids])
        return out.tokens if out.logprobs is None else out

    def free(self, request_id: str) -> None:
        self.params.pop(request_id, None)
        self.history.pop(request_id, None)
        self.to_prefill.pop(request_id, None)
        table = self.tables.pop(request_id, None)
        if table is not None:
            self.pools.latent.free(table.latent_pages[0])
            self.pools.slots.free([table.kda_slot])

    def stats(self) -> dict:
        out = {"running": len(self.tables), "pages_free": self.pools.latent.num_free,
               "slots_free": self.pools.slots.num_free, "pages_total": self.pools.latent.capacity,
               "slots_total": self.pools.slots.capacity}
        if self.dest is None:
            return out
        snap = self.dest.metrics.snapshot()
        return {**out, **{f"transfer_bytes_{k}": v for k, v in snap.bytes_by_kind.items()},
                **{f"transfer_seconds_{k}": v for k, v in snap.seconds_by_kind.items()},
                "transfer_failures": sum(snap.failures.values()), "transfers": snap.transfers}

    def close(self) -> None:
        if self.dest is not None:
            self.dest.agent.close()
