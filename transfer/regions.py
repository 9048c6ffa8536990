"""Region tables: where each (kind, layer) region of a rank lives in memory.

A region is one layer's state tensor of one kind, viewed as bytes. Our own pools keep all layers
of a kind in one tensor (layer-major), vLLM keeps one tensor per layer; both become a
`RegionTable`, so the planner's (kind, layer, offset) reads resolve the same way everywhere.
"""
from __future__ import annotations

import torch

from pdserve.state.pools import StatePools

from pdserve.transfer.planner import Read


class RegionTable:
    def __init__(self, layers: dict[str, list[torch.Tensor]]):
        for kind, tensors in layers.items():
            for i, t in enumerate(tensors):
                if not t.is_contiguous():
                    raise ValueError(f"region {kind}/{i} is not contiguous")
        self.layers = layers

    @staticmethod
    def of_pools(pools: StatePools) -> "RegionTable":
        return RegionTable({kind: list(t.unbind(0)) for kind, t in pools.regions().items()})

    def region_of(self, read: Read, side: str) -> str:
        return "kda_conv_staging" if side == "dst" and read.staged else read.kind

    def view(self, kind: str, layer: int) -> torch.Tensor:
        """Layer `layer` of `kind` as a flat uint8 tensor (shares memory)."""
        try:
            t = self.layers[kind][layer]
        except (KeyError, IndexError):
            raise KeyError(f"no region {kind}/{layer} (have {sorted(self.layers)})") from None
        return t.view(-1).view(torch.uint8)

    def span(self, kind: str, layer: int, offset: int, length: int) -> torch.Tensor:
        v = self.view(kind, layer)
        if offset < 0 or offset + length > v.numel():
            raise IndexError(f"{kind}/{layer}: bytes [{offset}, {offset + length}) outside the "
                             f"region of {v.numel()} bytes")
        return v[offset:offset + length]

    def addresses(self) -> dict[str, list[tuple[int, int]]]:
        """(address, bytes) of every layer region, by kind."""
        return {kind: [(t.data_ptr(), t.numel() * t.element_size()) for t in ts]
                for kind, ts in self.layers.items()}


def copy_reads(reads: list[Read], sources: list[RegionTable], dests: list[RegionTable]) -> None:
    """Execute reads with plain memory copies (same process). The reference for the NIXL path."""
    for r in reads:
        dst = dests[r.dst_rank].span(dests[r.dst_rank].region_of(r, "dst"), r.layer,
                                     r.dst_offset, r.length)
        dst.copy_(sources[r.src_rank].span(r.kind, r.layer, r.src_offset, r.length))
