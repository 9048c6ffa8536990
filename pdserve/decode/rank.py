"""One TP rank of a decode instance: its model shard, its pools and its transfer endpoint.

The instance (`pdserve.decode.instance`) drives all ranks in lockstep; every method here is what
one rank does for one call, whether it lives in this process or in a Ray actor.
"""
from __future__ import annotations

import logging

import torch

from pdserve.decode.graphs import DecodeGraphs
from pdserve.kernels import registry
from pdserve.model.batch import ForwardBatch
from pdserve.model.generate import build_model
from pdserve.model.parallel import TPGroup
from pdserve.state.block_table import BlockTable, Topology
from pdserve.state.layout import RankShapes, StateLayout, dtype_of
from pdserve.state.manifest import StateManifest
from pdserve.state.pools import PoolExhausted, StatePools
from pdserve.transfer.dest import DestRank, TransferConfig
from pdserve.transfer.nixl_agent import AgentInfo, RankAgent
from pdserve.transfer.planner import DestAllocation
from pdserve.transfer.regions import RegionTable

log = logging.getLogger("pdserve.decode")


def kda_step_for(backend: str):
    """The fused KDA decode op for `backend`, or None for the model's own path. The registry's
    guard decides per step; a refused step runs the reference path (logged once per reason)."""
    if backend == registry.REFERENCE:
        return None
    from pdserve.kernels.kda_decode import OP, kda_decode_problem

    def step(*args):
        res = registry.resolve(OP, backend, kda_decode_problem(*args))
        return None if res.backend == registry.REFERENCE else res.impl(*args)

    return step


class DecodeRank:
    def __init__(self, instance: str, rank: int, config, tp: TPGroup | None = None,
                 layout: StateLayout | None = None, num_pages: int = 256, num_slots: int = 16,
                 seed: int = 0, checkpoint: str | None = None, backend: str = "reference",
                 transfer: TransferConfig = TransferConfig(), device: str = "cpu",
                 generation: int = 0, dtype: str = "float32", cuda_graphs: bool = False,
                 graph_max_tokens: int = 4096):
        """`cuda_graphs`: capture the decode step per batch-size bucket (CUDA, TP=1) for
        sequences of up to `graph_max_tokens` tokens; other steps run eagerly (logged once)."""
        tp = tp or TPGroup()
        self.rank, self.config = rank, config
        self.model = build_model(config, tp, dtype=dtype_of(dtype), seed=seed,
                            checkpoint=checkpoint).to(device)
        self.layout = layout or StateLayout(latent_dtype="float32", conv_dtype="float32")
        self.pools = StatePools(RankShapes.of(config, tp.size), self.layout, num_pages, num_slots,
                                device=device, conv_staging=True)
        self.kda_step = kda_step_for(backend)
        self.graphs = (DecodeGraphs(self.model, self.pools, graph_max_tokens,
                                    kda_step=self.kda_step) if cuda_graphs else None)
        self._eager_reasons: set[str] = set()
        self.dest = DestRank(RankAgent(instance, rank, generation,
                                       RegionTable.of_pools(self.pools), device),
                             self.pools, transfer)
        self.tables: dict[str, BlockTable] = {}
        self.device = device

    def info(self) -> AgentInfo:
        return self.dest.agent.info()

    def connect(self, infos: list[AgentInfo]) -> None:
        for info in infos:
            self.dest.agent.connect(info)

    def allocate(self, manifest: StateManifest, topology: Topology, extra_tokens: int):
        """(pages, slots, staging slots), or None when this rank's pools are full."""
        staging = manifest.layout.conv_layout != self.layout.conv_layout
        try:
            return self.dest.allocate(manifest, topology, extra_tokens, staging)
        except PoolExhausted:
            return None

    def unallocate(self, part) -> None:
        if part is not None:
            pages, slots, stage = part
            self.pools.latent.free(pages)
            self.pools.slots.free(slots + stage)

    def receive(self, manifest: StateManifest, alloc: DestAllocation, src_instance: str,
                digests: dict[int, list[int]] | None = None, request_id: str | None = None
                ) -> dict:
        """Pull a request's state; it is then known here as `request_id` (the decode side's
        id), which may differ from the source's own id in the manifest (vLLM numbers its
        requests itself)."""
        lookup = None if digests is None else (lambda s, runs: digests[s])
        stats = self.dest.receive(manifest, alloc, src_instance, lookup)
        self.tables[request_id or manifest.request_id] = BlockTable(
            [alloc.latent_pages[self.rank]], alloc.slots[self.rank][0], [], manifest.num_tokens)
        for s in alloc.slots[self.rank][1:]:  # checkpoints are not needed to decode
            self.pools.slots.free([s])
        return stats

    def step(self, request_ids: list[str], tokens: list[int]) -> torch.Tensor | None:
        """One decode step; returns the logits on rank 0 (every rank computes them)."""
        tables = [self.tables[r] for r in request_ids]
        why = None if self.graphs is None else self.graphs.refuse(tables)
        if self.graphs is not None and why is None:
            logits = self.graphs.run(tables, tokens)
        else:
            if why is not None and why not in self._eager_reasons:
                self._eager_reasons.add(why)
                log.warning("decode step runs without CUDA graphs: %s", why)
            batch = ForwardBatch.of(tables, [1] * len(tables))
            ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
            logits = self.model(ids, batch, self.pools, logit_rows=batch.last_rows(),
                                kda_step=self.kda_step)
        for t in tables:
            t.num_tokens += 1
        return logits.cpu() if self.rank == 0 else None

    def free(self, request_id: str) -> None:
        table = self.tables.pop(request_id, None)
        if table is not None:
            self.pools.latent.free(table.latent_pages[0])
            self.pools.slots.free([table.kda_slot])

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

    def stats(self) -> dict:
        snap = self.dest.metrics.snapshot()
        return {"running": len(self.tables), "pages_free": self.pools.latent.num_free,
                "slots_free": self.pools.slots.num_free, "pages_total": self.pools.latent.capacity,
                "slots_total": self.pools.slots.capacity,
                **{f"transfer_bytes_{k}": v for k, v in snap.bytes_by_kind.items()},
                **{f"transfer_seconds_{k}": v for k, v in snap.seconds_by_kind.items()},
                "transfer_failures": sum(snap.failures.values()), "transfers": snap.transfers}

    def close(self) -> None:
        self.dest.agent.close()
