"""Tensor parallelism: the rank's view of its group, sharded parameters and the collectives.

A parameter is created with its FULL (checkpoint) shape and a shard dimension; the module holds only
this rank's slice. Loading and seeded init produce the full tensor and slice it, so every TP size
computes the same model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class TPGroup:
    """This process's place in its TP group; size 1 needs no torch.distributed."""

    rank: int = 0
    size: int = 1
    group: object | None = None  # a torch.distributed ProcessGroup when size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate each rank's x along the last dim, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def split(self, n: int, what: str) -> int:
        if n % self.size:
            raise ValueError(f"{what}={n} is not divisible by TP={self.size}")
        return n // self.size

    @staticmethod
    def from_dist(group=None) -> "TPGroup":
        if not dist.is_initialized():
            return TPGroup()
        return TPGroup(dist.get_rank(group), dist.get_world_size(group), group)


def sharded(full_shape: tuple[int, ...], shard_dim: int | None, tp: TPGroup,
            dtype: torch.dtype, init: str) -> nn.Parameter:
    """An uninitialized parameter holding this rank's slice of a `full_shape` tensor."""
    shape = list(full_shape)
    if shard_dim is not None:
        shape[shard_dim] = tp.split(shape[shard_dim], f"dim {shard_dim} of {tuple(full_shape)}")
    p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    p.full_shape = tuple(full_shape)
    p.shard_dim = shard_dim
    p.init = init  # how `weights.init_full` fills the full tensor
    return p


def shard_of(full: torch.Tensor, shard_dim: int | None, tp: TPGroup) -> torch.Tensor:
    if shard_dim is None:
        return full
    return full.chunk(tp.size, dim=shard_dim)[tp.rank]


class Linear(nn.Module):
    """y = x W^T with W [out, in]. `mode`: "column" (out split), "row" (in split, partial sums
    reduced across the group) or "replicated"."""

    def __init__(self, d_in: int, d_out: int, tp: TPGroup, mode: str, dtype: torch.dtype,
                 reduce: bool = True):
        super().__init__()
        shard_dim = {"column": 0, "row": 1, "replicated": None}[mode]
        self.weight = sharded((d_out, d_in), shard_dim, tp, dtype, "linear")
        self.tp, self.row, self.reduce = tp, mode == "row", reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.to(self.weight.dtype) @ self.weight.t()
        return self.tp.all_reduce(y) if self.row and self.reduce else y
