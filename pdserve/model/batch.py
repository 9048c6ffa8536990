"""One forward step over several sequences: flattened token rows plus, per sequence, where its
rows are and which cached state it owns.

`ForwardBatch` is the general (prefill / mixed) form, walked sequence by sequence on the host.
`DecodeBatch` is a decode-only step (one new token per sequence) as device tensors of fixed shape,
so the step runs with no host syncs: the form a CUDA graph captures (`pdserve.decode.graphs`)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pdserve.state.block_table import BlockTable


@dataclass
class SeqStep:
    start: int          # first row of this sequence in the flattened batch
    length: int         # new tokens in this step (1 for a decode step)
    table: BlockTable   # its pages and slot; table.num_tokens = tokens cached before the step

    @property
    def context(self) -> int:
        return self.table.num_tokens

    @property
    def rows(self) -> slice:
        return slice(self.start, self.start + self.length)

    @property
    def pages(self) -> list[int]:
        return _pages(self.table)


def _pages(table: BlockTable) -> list[int]:
    if len(table.latent_pages) != 1:
        raise NotImplementedError("the reference forward runs DCP=1; got "
                                  f"{len(table.latent_pages)} DCP page lists")
    return table.latent_pages[0]


@dataclass
class ForwardBatch:
    seqs: list[SeqStep]

    @staticmethod
    def of(tables: list[BlockTable], lengths: list[int]) -> "ForwardBatch":
        seqs, start = [], 0
        for table, n in zip(tables, lengths, strict=True):
            if n < 1:
                raise ValueError(f"every sequence needs >= 1 new token, got {n}")
            seqs.append(SeqStep(start, n, table))
            start += n
        return ForwardBatch(seqs)

    @property
    def num_rows(self) -> int:
        return sum(s.length for s in self.seqs)

    def last_rows(self) -> list[int]:
        return [s.start + s.length - 1 for s in self.seqs]

    @property
    def is_decode(self) -> bool:
        return all(s.length == 1 for s in self.seqs)


@dataclass
class DecodeBatch:
    """Row b feeds one token to a sequence whose `context[b]` tokens are cached (so the new token
    sits at position context[b]) in KDA slot `slots[b]` and latent pages `pages[b]` (token order,
    padded with page 0). Rows with `live` False are padding: they point at slot 0 / page 0, which
    the pools never hand out, and the layers write no state for them. `kda_slots` holds the same
    slot ids as int32, built with the batch: the fused KDA op reads it before its PDL wait, so it
    must not be converted by a kernel right before that op (see `KDAAttention.forward`).
    `mla_pages` / `mla_seq_lens` are the fused MLA op's int32 block table and lengths (the new
    token included), also built once per step rather than converted in every MLA layer;
    `new_page` / `new_row` say where each row's new latent goes (page 0, row 0 for padding),
    worked out on the host with the batch."""
    slots: torch.Tensor         # [B] int64
    pages: torch.Tensor         # [B, max_pages] int64
    context: torch.Tensor       # [B] int64
    live: torch.Tensor          # [B] bool
    kda_slots: torch.Tensor     # [B] int32, = slots
    mla_pages: torch.Tensor     # [B, max_pages] int32, = pages
    mla_seq_lens: torch.Tensor  # [B] int32, = context + 1
    new_page: torch.Tensor      # [B] int64, the page of position context
    new_row: torch.Tensor       # [B] int64, its row in that page

    @property
    def num_rows(self) -> int:
        return self.slots.shape[0]

    @staticmethod
    def of(tables: list[BlockTable], page_tokens: int, device: torch.device | str,
           rows: int | None = None, max_pages: int | None = None) -> DecodeBatch:
        """The step for `tables`, padded to `rows` rows and `max_pages` pages (default: just
        enough for these tables, which is what an eager step uses)."""
        rows = len(tables) if rows is None else rows
        if len(tables) > rows:
            raise ValueError(f"{len(tables)} sequences do not fit a batch of {rows} rows")
        need = [t.num_tokens // page_tokens + 1 for t in tables]  # pages up to the new token
        for t, n in zip(tables, need):
            if n > len(_pages(t)):
                raise IndexError(f"token {t.num_tokens} is beyond the {len(_pages(t))} pages owned")
        width = max(need, default=1) if max_pages is None else max_pages
        if max(need, default=0) > width:
            raise ValueError(f"a sequence with {max(need)} pages does not fit max_pages={width}")
        pages = torch.zeros(rows, width, dtype=torch.long)
        for i, (t, n) in enumerate(zip(tables, need)):
            pages[i, :n] = torch.tensor(_pages(t)[:n])
        pad = rows - len(tables)
        slots = torch.tensor([t.kda_slot for t in tables] + [0] * pad, dtype=torch.long)
        context = torch.tensor([t.num_tokens for t in tables] + [0] * pad, dtype=torch.long)
        live = torch.arange(rows) < len(tables)
        new_page = pages.gather(1, (context // page_tokens)[:, None])[:, 0]
        return DecodeBatch(slots.to(device), pages.to(device), context.to(device),
                           live.to(device), slots.to(torch.int32).to(device),
                           pages.to(torch.int32).to(device),
                           (context + 1).to(torch.int32).to(device), new_page.to(device),
                           (context % page_tokens).to(device))

    @staticmethod
    def pack(tables: list[BlockTable], tokens: list[int], page_tokens: int, rows: int,
             max_pages: int) -> torch.Tensor:
        """A step's inputs as one int64 CPU tensor [rows, 6 + max_pages] (token, slot, context,
        live, new page, new row, pages...), so they reach the device in one copy; `from_packed`
        unpacks it there. Rows past len(tables) are padding (token 0, slot 0, page 0, not
        live)."""
        if len(tables) > rows:
            raise ValueError(f"{len(tables)} sequences do not fit a batch of {rows} rows")
        if len(tokens) != len(tables):
            raise ValueError(f"{len(tokens)} tokens for {len(tables)} sequences")
        packed = np.zeros((rows, 6 + max_pages), dtype=np.int64)
        for i, (t, tok) in enumerate(zip(tables, tokens)):
            n = t.num_tokens // page_tokens + 1            # pages up to the new token
            pages = _pages(t)
            if n > len(pages):
                raise IndexError(f"token {t.num_tokens} is beyond the {len(pages)} pages owned")
            if n > max_pages:
                raise ValueError(f"a sequence with {n} pages does not fit max_pages={max_pages}")
            packed[i, :6] = (tok, t.kda_slot, t.num_tokens, 1, pages[n - 1],
                             t.num_tokens % page_tokens)
            packed[i, 6:6 + n] = pages[:n]
        return torch.from_numpy(packed)

    @staticmethod
    def from_packed(packed: torch.Tensor) -> tuple[torch.Tensor, DecodeBatch]:
        """(token ids, batch) from `pack`'s tensor, by device ops only (a captured graph's
        first kernels: the int32 views are built here, well before the ops that read them)."""
        slots, context = packed[:, 1], packed[:, 2]
        pages = packed[:, 6:]
        return packed[:, 0], DecodeBatch(
            slots, pages, context, packed[:, 3] != 0, slots.to(torch.int32),
            pages.to(torch.int32), (context + 1).to(torch.int32), packed[:, 4].contiguous(),
            packed[:, 5].contiguous())
