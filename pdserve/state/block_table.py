"""Per-request block tables: latent pages per DCP rank, the running KDA slot, and the sparse KDA
checkpoint slots used for prefix reuse (docs/design.md §3)."""
from __future__ import annotations

import msgspec


class Topology(msgspec.Struct, frozen=True):
    """One instance's layout: TP ranks, DCP ranks (1 or tp) and the DCP token interleave."""

    tp: int = 1
    dcp: int = 1
    interleave: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        if self.dcp not in (1, self.tp):
            raise ValueError(f"dcp must be 1 or tp={self.tp}, got {self.dcp}")
        if self.interleave < 1:
            raise ValueError(f"interleave must be >= 1, got {self.interleave}")

    def dcp_rank_of(self, token: int) -> int:
        """DCP rank holding token `token`: (t // interleave) % dcp."""
        return (token // self.interleave) % self.dcp

    def tokens_on(self, dcp_rank: int, num_tokens: int) -> list[int]:
        """Global positions held by `dcp_rank`, in local order."""
        return [t for t in range(num_tokens) if self.dcp_rank_of(t) == dcp_rank]

    def local_count(self, dcp_rank: int, num_tokens: int) -> int:
        """How many of the first `num_tokens` tokens live on `dcp_rank` (closed form)."""
        block = self.interleave * self.dcp
        full, rest = divmod(num_tokens, block)
        extra = min(max(rest - dcp_rank * self.interleave, 0), self.interleave)
        return full * self.interleave + extra


class BlockTable(msgspec.Struct):
    """What a request owns in the pools of one instance."""

    latent_pages: list[list[int]]            # per DCP rank, page ids in token order
    kda_slot: int                             # running KDA state slot (every TP rank, same id)
    checkpoints: list[tuple[int, int]] = []  # sparse (token_pos, slot_id), page-aligned positions
    num_tokens: int = 0                       # tokens whose state is cached

    @property
    def all_slots(self) -> list[int]:
        return [self.kda_slot] + [s for _, s in self.checkpoints]
