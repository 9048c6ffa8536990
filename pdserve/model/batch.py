"""One forward step over several sequences: flattened token rows plus, per sequence, where its
rows are and which cached state it owns."""
from __future__ import annotations

from dataclasses import dataclass

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
        if len(self.table.latent_pages) != 1:
            raise NotImplementedError("the reference forward runs DCP=1; got "
                                      f"{len(self.table.latent_pages)} DCP page lists")
        return self.table.latent_pages[0]


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
