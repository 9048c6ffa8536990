"""A decode step on one rank of a decode context-parallel (DCP) group (docs/design.md §3, §5).

Under DCP = c a request's latent rows are split by token over the c ranks (token t on rank
(t // interleave) % c) and each rank's block table holds only its own pages, in local order;
the KDA state is not split by DCP (each rank keeps its TP share). `DCPDecodeBatch` is the
`DecodeBatch` of one such rank: the pages, the new row's place and the attention lengths are
rank-local, and the new token's latent row is stored only on the rank that owns its position.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.model.batch import DecodeBatch
from pdserve.model.parallel import DCPGroup
from pdserve.state.block_table import BlockTable


@dataclass
class DCPDecodeBatch(DecodeBatch):
    """`pages` / `mla_pages`: this rank's pages of each row, local token order (page 0 padding);
    `context`: the global position of each row's new token; `new_page` / `new_row`: where that
    token's latent goes on this rank (page 0, row 0 where another rank owns it); `store`: this
    rank owns it; `local_len`: this rank's rows the new token attends to (0 for a request
    shorter than the interleave, say; its partial then carries no weight); `mla_seq_lens`:
    `local_len` at least 1, for kernels that take no empty sequence."""
    store: torch.Tensor         # [B] bool
    local_len: torch.Tensor     # [B] int64
    dcp: DCPGroup

    @staticmethod
    def of(tables: list[BlockTable], dcp: DCPGroup, page_tokens: int,
           device: torch.device | str) -> "DCPDecodeBatch":
        ctx = [t.num_tokens for t in tables]
        before = [dcp.local_count(c) for c in ctx]
        owner = [dcp.topology.dcp_rank_of(c) == dcp.rank for c in ctx]
        local = [b + o for b, o in zip(before, owner)]
        need = [max(-(-n // page_tokens), 1) for n in local]
        for t, n in zip(tables, need):
            if len(t.latent_pages) != 1 or n > len(t.latent_pages[0]):
                raise IndexError(f"DCP rank {dcp.rank}: a row needs {n} pages; its table holds "
                                 f"{[len(p) for p in t.latent_pages]}")
        pages = torch.zeros(len(tables), max(need, default=1), dtype=torch.long)
        for i, (t, n) in enumerate(zip(tables, need)):
            pages[i, :n] = torch.tensor(t.latent_pages[0][:n])
        new_page = torch.tensor([t.latent_pages[0][b // page_tokens] if o else 0
                                 for t, b, o in zip(tables, before, owner)], dtype=torch.long)
        new_row = torch.tensor([b % page_tokens if o else 0 for b, o in zip(before, owner)],
                               dtype=torch.long)
        slots = torch.tensor([t.kda_slot for t in tables], dtype=torch.long)
        local_len = torch.tensor(local, dtype=torch.long)
        to = lambda x: x.to(device)
        return DCPDecodeBatch(
            to(slots), to(pages), to(torch.tensor(ctx, dtype=torch.long)),
            to(torch.ones(len(tables), dtype=torch.bool)), to(slots.to(torch.int32)),
            to(pages.to(torch.int32)), to(local_len.clamp(min=1).to(torch.int32)),
            to(new_page), to(new_row), to(torch.tensor(owner, dtype=torch.bool)), to(local_len),
            dcp)
