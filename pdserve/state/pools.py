"""State pools: paged MLA latent cache and KDA state slots (docs/design.md §3).

Each pool is ONE contiguous tensor per kind (all layers of a group together) so the transfer layer
registers a few large regions with NIXL; per-layer views index into it. Page 0 / slot 0 are never
handed out: kernels use them as padding. Allocation failures raise `PoolExhausted` and leave the
pool unchanged.
"""
from __future__ import annotations

import threading

import numpy as np
import torch

from pdserve.state import host_memory
from pdserve.state.block_table import Topology
from pdserve.state.layout import RankShapes, StateLayout, conv_from_sd, conv_to_sd, dtype_of


class PoolExhausted(RuntimeError):
    """Not enough free pages or slots; nothing was allocated."""


class _FreeList:
    """Ids 1..n-1; id 0 is reserved padding. Lowest ids first, so allocation is deterministic.
    Thread-safe: a decode rank admits (allocates) in one thread while it steps and releases
    (frees) in another."""

    def __init__(self, n: int, what: str):
        if n < 2:
            raise ValueError(f"a {what} pool needs at least 2 entries (0 is padding), got {n}")
        self.capacity = n - 1
        self.what = what
        self._free = list(range(n - 1, 0, -1))  # pop() from the end yields 1, 2, ...
        self._used: set[int] = set()
        self._lock = threading.Lock()

    def take(self, count: int) -> list[int]:
        with self._lock:
            if count > len(self._free):
                raise PoolExhausted(f"{self.what} pool exhausted: asked for {count}, "
                                    f"{len(self._free)} of {self.capacity} free")
            ids = [self._free.pop() for _ in range(count)]
            self._used.update(ids)
            return ids

    def take_run(self, count: int) -> list[int] | None:
        """The lowest run of `count` consecutive free ids, or None when fragmentation leaves
        none that long (nothing is taken then)."""
        with self._lock:
            return self._take_run(count)

    def _take_run(self, count: int) -> list[int] | None:
        ascending = np.asarray(self._free[::-1], dtype=np.int64)
        if count < 1 or count > len(ascending):
            return None
        # ids are sorted and distinct, so a window spanning count - 1 is a run
        hits = np.flatnonzero(ascending[count - 1:] - ascending[:len(ascending) - count + 1]
                              == count - 1)
        if not len(hits):
            return None
        first, end = len(ascending) - int(hits[0]) - count, len(ascending) - int(hits[0])
        ids = self._free[first:end][::-1]
        del self._free[first:end]
        self._used.update(ids)
        return ids

    def give(self, ids: list[int]) -> None:
        with self._lock:
            bad = [i for i in ids if i not in self._used]
            if bad:
                raise ValueError(f"{self.what} ids {bad} are not allocated (double free?)")
            for i in ids:
                self._used.discard(i)
                self._free.append(i)
            self._free.sort(reverse=True)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)


class _IdPool:
    """The allocation surface shared by both pools: ids out of a `_FreeList`."""

    _ids: _FreeList

    def allocate(self, count: int) -> list[int]:
        return self._ids.take(count)

    def free(self, ids: list[int]) -> None:
        self._ids.give(ids)

    @property
    def num_free(self) -> int:
        return self._ids.num_free

    @property
    def num_used(self) -> int:
        return self._ids.num_used

    @property
    def capacity(self) -> int:
        return self._ids.capacity


class LatentPool(_IdPool):
    """MLA latent cache: `[n_mla, num_pages, page_tokens, latent_width]`.

    A page id indexes the same page in every MLA layer: a request owns a list of page ids and its
    token t (local to a DCP rank) lives in page `pages[t // page_tokens]`, row `t % page_tokens`.

    `decode_topology` (prefill side; None = plain lowest-ids-first allocation): the DCP layout
    of the decode instances that will read this pool's requests. Each decode DCP rank reads every
    c-th interleave run of a request's pages, so with token-ordered ids each of its reads is one
    interleave long (one page at interleave = page_tokens: one UCX operation per page). Instead a
    request's pages are laid out DCP-rank-major over ascending ids (page i -> the k-th id of its
    rank's share, shares in rank order), from the lowest free run of that many ids when there
    is one, else from the lowest free ids (runs then break only at the holes): every decode rank
    then reads one contiguous source range. Only when the interleave is a whole number of pages.
    """

    def __init__(self, shapes: RankShapes, layout: StateLayout, num_pages: int,
                 device: torch.device | str = "cpu", decode_topology: Topology | None = None):
        self.page_tokens = layout.page_tokens
        self.width = shapes.latent_width
        self.data = host_memory.zeros((shapes.n_mla, num_pages, layout.page_tokens,
                                       shapes.latent_width), dtype_of(layout.latent_dtype), device)
        self.scale = 1.0  # per-tensor dequant scale, used when the dtype is fp8
        self._ids = _FreeList(num_pages, "latent page")
        self.decode_topology = decode_topology

    def allocate(self, count: int) -> list[int]:
        """`count` page ids in token order (DCP-rank-major under `decode_topology`)."""
        topo = self.decode_topology
        if topo is None or topo.dcp == 1 or topo.interleave % self.page_tokens:
            return super().allocate(count)
        ids = self._ids.take_run(count) or self._ids.take(count)
        # the decode DCP rank of each of the request's pages (a page lies in one interleave run)
        ranks = np.arange(count) * self.page_tokens // topo.interleave % topo.dcp
        placed = np.empty(count, dtype=np.int64)
        placed[np.argsort(ranks, kind="stable")] = ids
        return placed.tolist()

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_tokens)

    # access (layer = index among MLA layers)
    def _rows(self, pages: list[int], start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, start + count)
        if count and int(pos[-1]) // self.page_tokens >= len(pages):
            raise IndexError(f"token {int(pos[-1])} is beyond the {len(pages)} pages owned")
        page_ids = torch.tensor(pages, dtype=torch.long)[pos // self.page_tokens]
        return page_ids.to(self.data.device), (pos % self.page_tokens).to(self.data.device)

    @property
    def is_fp8(self) -> bool:
        return self.data.dtype == torch.float8_e4m3fn

    def quantize(self, rows: torch.Tensor) -> torch.Tensor:
        """Latent rows -> the pool's dtype (fp8: divided by the per-tensor scale first)."""
        return (rows.float() / self.scale if self.is_fp8 else rows).to(self.data.dtype)

    def dequantize(self, rows: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
        """Stored rows -> `dtype` values (fp8: times the per-tensor scale)."""
        rows = rows.to(dtype)
        return rows * self.scale if self.is_fp8 else rows

    def write(self, layer: int, pages: list[int], start: int, rows: torch.Tensor) -> None:
        """Store `rows` [count, width] as tokens start..start+count-1."""
        p, r = self._rows(pages, start, rows.shape[0])
        self.data[layer, p, r] = self.quantize(rows)

    def read(self, layer: int, pages: list[int], count: int, dtype=torch.float32) -> torch.Tensor:
        """Tokens 0..count-1 as [count, width] in `dtype` (dequantized)."""
        p, r = self._rows(pages, 0, count)
        return self.dequantize(self.data[layer, p, r], dtype)


class SlotPool(_IdPool):
    """KDA state slots: recurrent `[n_kda, num_slots, H_local, V, K]` and conv state
    `[n_kda, num_slots, taps, 3*H_local*D]` (SD) or `[n_kda, num_slots, 3*H_local*D, taps]` (DS),
    channels packed `[q | k | v]` per rank. A slot id indexes the same slot in every KDA layer."""

    def __init__(self, shapes: RankShapes, layout: StateLayout, num_slots: int,
                 device: torch.device | str = "cpu", conv_staging: bool = False):
        self.layout = layout.conv_layout
        n, h, d, taps, c = (shapes.n_kda, shapes.kda_heads, shapes.head_dim, shapes.conv_taps,
                            shapes.conv_channels)
        self.recurrent = host_memory.zeros((n, num_slots, h, d, d),
                                           dtype_of(layout.recurrent_dtype), device)
        self.conv_taps, self.conv_channels = taps, c
        conv_shape = (n, num_slots, taps, c) if self.layout == "SD" else (n, num_slots, c, taps)
        self.conv = host_memory.zeros(conv_shape, dtype_of(layout.conv_dtype), device)
        # Conv state as a transfer's source laid it out (the other layout, or whole slots of
        # source ranks): reads land here (in a slot taken from the same free list) and `unstage`
        # reorders and converts it into `conv`. Flat per slot: layout.conv_staging_width times
        # this rank's conv state.
        self.conv_staging = (host_memory.zeros((n, num_slots, layout.conv_staging_width * c * taps),
                                               self.conv.dtype, device) if conv_staging else None)
        self._ids = _FreeList(num_slots, "KDA slot")

    def allocate(self, count: int = 1) -> list[int]:
        ids = super().allocate(count)
        self.reset(ids)  # a fresh sequence starts from zero state
        return ids

    def reset(self, slots: list[int]) -> None:
        idx = torch.tensor(slots, dtype=torch.long, device=self.recurrent.device)
        self.recurrent[:, idx] = 0
        self.conv[:, idx] = 0

    def copy(self, src: int, dst: int) -> None:
        """Snapshot slot `src` into `dst` in every layer (prefix-cache checkpoints)."""
        self.recurrent[:, dst] = self.recurrent[:, src]
        self.conv[:, dst] = self.conv[:, src]

    def unstage(self, staging_slot: int, slot: int, src_layout: str, part_channels: int,
                picks: list[tuple[int, int]]) -> None:
        """Move the conv state in `staging_slot` into `slot` (every layer). The staging slot
        holds len(picks) consecutive parts in `src_layout`, each packed [q | k | v] with
        `part_channels` channels; from part j, channels [lo_j, lo_j + n_j) of each section go,
        in part order, into that section of `slot`."""
        if self.conv_staging is None:
            raise RuntimeError("this SlotPool was built without conv_staging")
        n, taps = self.conv.shape[0], self.conv_taps
        shape = (taps, part_channels) if src_layout == "SD" else (part_channels, taps)
        used = len(picks) * part_channels * taps
        staged = conv_to_sd(self.conv_staging[:, staging_slot, :used].reshape(n, len(picks), *shape),
                            src_layout).unflatten(-1, (3, -1))   # [n, parts, taps, 3, section]
        dst = conv_to_sd(self.conv[:, slot], self.layout).unflatten(-1, (3, -1))
        at = 0
        for j, (lo, count) in enumerate(picks):
            dst[..., at:at + count].copy_(staged[:, j, ..., lo:lo + count])
            at += count
        if at != dst.shape[-1]:
            raise ValueError(f"staged parts give {at} channels per section, the slot has "
                             f"{dst.shape[-1]}")

    # access (layer = index among KDA layers)
    def read(self, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(recurrent [H, V, K] fp32, conv [taps, C] fp32 in SD order) — copies."""
        return (self.recurrent[layer, slot].float().clone(),
                conv_to_sd(self.conv[layer, slot], self.layout).float().clone())

    def write(self, layer: int, slot: int, recurrent: torch.Tensor, conv_sd: torch.Tensor) -> None:
        self.recurrent[layer, slot] = recurrent.to(self.recurrent.dtype)
        self.conv[layer, slot] = conv_from_sd(conv_sd, self.layout).to(self.conv.dtype)


class StatePools:
    """All cached state of one rank: the latent pool and the slot pool."""

    def __init__(self, shapes: RankShapes, layout: StateLayout, num_pages: int, num_slots: int,
                 device: torch.device | str = "cpu", conv_staging: bool = False,
                 decode_topology: Topology | None = None):
        self.shapes = shapes
        self.layout = layout
        self.latent = LatentPool(shapes, layout, num_pages, device, decode_topology)
        self.slots = SlotPool(shapes, layout, num_slots, device, conv_staging)

    def regions(self) -> dict[str, torch.Tensor]:
        """The contiguous tensors that hold all state, layer-major (what transfer registers)."""
        out = {"mla_latent": self.latent.data, "kda_recurrent": self.slots.recurrent,
               "kda_conv": self.slots.conv}
        if self.slots.conv_staging is not None:
            out["kda_conv_staging"] = self.slots.conv_staging
        return out

    @property
    def empty(self) -> bool:
        return self.latent.num_used == 0 and self.slots.num_used == 0
