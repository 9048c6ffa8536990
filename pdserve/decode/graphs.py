"""CUDA graphs of the reference decode step, one per batch-size bucket (DESIGN.md §5).

The model's decode step (`pdserve.model.batch.DecodeBatch`) has static shapes and no host syncs,
so it is captured once per bucket over the rank's pools. A step of n requests replays the
smallest bucket >= n: the inputs are copied into that bucket's static buffers, the rows past n
being padding (token 0, slot 0, page 0, not live: they write no state), and the logits of the
n live rows are returned. The latent gather has a fixed width of `max_pages` pages, so a graph
serves sequences of up to `max_tokens` tokens (cached + the new one).

Captured as constants: the pools' tensors (never reallocated), the fp8 latent scale, the
`kda_step` / `mla_step` ops the registry resolved at capture time (the MLA op's split count
follows from the graph's fixed page width, so it needs no host sync). TP > 1 is not captured yet.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.model.batch import DecodeBatch
from pdserve.model.model import HybridModel
from pdserve.state.block_table import BlockTable
from pdserve.state.pools import StatePools

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor       # [bucket] static input token ids
    batch: DecodeBatch      # static input state addressing
    logits: torch.Tensor    # [bucket, vocab] static output


class DecodeGraphs:
    def __init__(self, model: HybridModel, pools: StatePools, max_tokens: int,
                 buckets: tuple[int, ...] = BUCKETS, kda_step=None, mla_step=None,
                 warmup: int = 2):
        self.device = pools.latent.data.device
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the pools on a CUDA device, not {self.device}")
        if model.tp.size > 1:
            raise NotImplementedError(f"CUDA graphs are captured for TP=1 only, got TP="
                                      f"{model.tp.size}")
        if not buckets or min(buckets) < 1:
            raise ValueError(f"buckets must be positive batch sizes, got {buckets}")
        self.model, self.pools = model, pools
        self.kda_step, self.mla_step = kda_step, mla_step
        self.page_tokens = pools.latent.page_tokens
        self.max_pages = pools.latent.pages_for(max_tokens)
        self.max_tokens = self.max_pages * self.page_tokens
        self.buckets = tuple(sorted(set(buckets)))
        self._mempool = torch.cuda.graph_pool_handle()
        # Largest first, so the smaller graphs reuse its memory. Sharing one pool is safe because
        # `run` copies the live logits out before any other graph replays.
        self._graphs = {b: self._capture(b, warmup) for b in reversed(self.buckets)}

    def _capture(self, rows: int, warmup: int) -> _Captured:
        ids = torch.zeros(rows, dtype=torch.long, device=self.device)
        batch = DecodeBatch.of([], self.page_tokens, self.device, rows, self.max_pages)

        def step():
            return self.model(ids, batch, self.pools, kda_step=self.kda_step,
                              mla_step=self.mla_step)

        # Warm up on a side stream (lazy library init must not happen under capture); every row
        # is padding, so the pools are not changed.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):
            logits = step()
        return _Captured(graph, ids, batch, logits)

    def refuse(self, tables: list[BlockTable]) -> str | None:
        """Why these requests cannot run as a captured step (one message per kind of reason),
        or None when they can."""
        if len(tables) > self.buckets[-1]:
            return f"batch larger than the largest graph ({self.buckets[-1]})"
        if any(t.num_tokens + 1 > self.max_tokens for t in tables):
            return f"sequence longer than the graphs' max_tokens ({self.max_tokens})"
        return None

    def run(self, tables: list[BlockTable], tokens: list[int]) -> torch.Tensor:
        """One decode step for `tables` fed `tokens`: fp32 logits [len(tables), vocab]. As with
        the eager step, the caller advances each `table.num_tokens` afterwards."""
        why = self.refuse(tables)
        if why is not None:
            raise ValueError(why)
        if len(tokens) != len(tables):
            raise ValueError(f"{len(tokens)} tokens for {len(tables)} sequences")
        n = len(tables)
        g = self._graphs[next(b for b in self.buckets if b >= n)]
        rows = g.ids.shape[0]
        g.batch.copy_(DecodeBatch.of(tables, self.page_tokens, "cpu", rows, self.max_pages))
        g.ids.copy_(torch.tensor(tokens + [0] * (rows - n), dtype=torch.long))
        g.graph.replay()
        return g.logits[:n].clone()
