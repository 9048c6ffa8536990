"""CUDA graphs of the decode step, one per batch-size bucket (docs/design.md §5).

The decode step (`pdserve.model.batch.DecodeBatch`: static shapes, no host syncs) is captured once
per bucket over the rank's pools: either the model's own forward (with the registry's fused KDA /
MLA ops) or the whole-layer fused step (`pdserve.decode.fused_step`). A step of n requests
replays the smallest bucket >= n. Its inputs travel as one packed int64 tensor (`DecodeBatch.pack`)
in one host-to-device copy; the graph's first kernels unpack it, the rows past n being padding
(token 0, slot 0, page 0, not live: they write no state). The graph ends with the greedy argmax,
so a greedy batch brings back only token ids. The page table has a fixed width of `max_pages`
pages, so a graph serves sequences of up to `max_tokens` tokens (cached + the new one).

Captured as constants: the pools' tensors (never reallocated), the fp8 latent scale, the ops the
registry resolved at capture time (the MLA op's split count follows from the graph's fixed page
width). TP > 1 is not captured yet.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from pdserve.model.batch import DecodeBatch
from pdserve.model.model import HybridModel
from pdserve.state.block_table import BlockTable
from pdserve.state.pools import StatePools

BUCKETS = (1, 2, 4, 8, 16, 32, 64)

Forward = Callable[[torch.Tensor, DecodeBatch], torch.Tensor]


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    packed: torch.Tensor    # [bucket, 6 + max_pages] static input (DecodeBatch.pack)
    staging: torch.Tensor   # pinned host copy of it
    logits: torch.Tensor    # [bucket, vocab] static output
    greedy: torch.Tensor    # [bucket] argmax of the logits
    copied: torch.cuda.Event  # recorded after staging's copy to `packed` was enqueued


class DecodeGraphs:
    def __init__(self, model: HybridModel, pools: StatePools, max_tokens: int,
                 buckets: tuple[int, ...] = BUCKETS, kda_step=None, mla_step=None,
                 forward: Forward | None = None, warmup: int = 2):
        """`forward(ids, batch) -> fp32 logits`: the step to capture (default: the model's
        forward with `kda_step` / `mla_step`)."""
        self.device = pools.latent.data.device
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the pools on a CUDA device, not {self.device}")
        if model.tp.size > 1:
            raise NotImplementedError(f"CUDA graphs are captured for TP=1 only, got TP="
                                      f"{model.tp.size}")
        if not buckets or min(buckets) < 1:
            raise ValueError(f"buckets must be positive batch sizes, got {buckets}")
        self.model, self.pools = model, pools
        self.forward = forward or (lambda ids, batch: model(ids, batch, pools, kda_step=kda_step,
                                                            mla_step=mla_step))
        self.page_tokens = pools.latent.page_tokens
        self.max_pages = pools.latent.pages_for(max_tokens)
        self.max_tokens = self.max_pages * self.page_tokens
        self.buckets = tuple(sorted(set(buckets)))
        self._mempool = torch.cuda.graph_pool_handle()
        # Largest first, so the smaller graphs reuse its memory. Sharing one pool is safe because
        # a step's outputs are read before any other graph replays.
        self._graphs = {b: self._capture(b, warmup) for b in reversed(self.buckets)}

    def _capture(self, rows: int, warmup: int) -> _Captured:
        packed = DecodeBatch.pack([], [], self.page_tokens, rows, self.max_pages).to(self.device)

        def step():
            ids, batch = DecodeBatch.from_packed(packed)
            logits = self.forward(ids, batch)
            return logits, logits.argmax(dim=-1)

        # Warm up on a side stream (lazy library init and kernel compilation must not happen
        # under capture); every row is padding, so the pools are not changed.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):
            logits, greedy = step()
        staging = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(self.device))
        return _Captured(graph, packed, staging, logits, greedy, copied)

    def refuse(self, tables: list[BlockTable]) -> str | None:
        """Why these requests cannot run as a captured step (one message per kind of reason),
        or None when they can."""
        if len(tables) > self.buckets[-1]:
            return f"batch larger than the largest graph ({self.buckets[-1]})"
        if any(t.num_tokens + 1 > self.max_tokens for t in tables):
            return f"sequence longer than the graphs' max_tokens ({self.max_tokens})"
        return None

    def run(self, tables: list[BlockTable], tokens: list[int]
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step for `tables` fed `tokens`: (fp32 logits [n, vocab], greedy token ids
        [n]) on the device, valid until the next `run`. As with the eager step, the caller
        advances each `table.num_tokens` afterwards."""
        why = self.refuse(tables)
        if why is not None:
            raise ValueError(why)
        n = len(tables)
        g = self._graphs[next(b for b in self.buckets if b >= n)]
        # the previous step's asynchronous copy out of the pinned staging buffer must be done
        # before it is overwritten (a caller that does not read results back runs ahead)
        g.copied.synchronize()
        g.staging.copy_(DecodeBatch.pack(tables, tokens, self.page_tokens, g.packed.shape[0],
                                         self.max_pages))
        g.packed.copy_(g.staging, non_blocking=True)
        g.copied.record(torch.cuda.current_stream(self.device))
        g.graph.replay()
        return g.logits[:n], g.greedy[:n]
