"""Tensor parallelism: the rank's view of its group, sharded parameters and the collectives.

A parameter is created with its FULL (checkpoint) shape and a shard dimension; the module holds only
this rank's slice. Loading and seeded init produce the full tensor and slice it, so every TP size
computes the same model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pdserve.state.block_table import Topology


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


@dataclass(frozen=True)
class DCPGroup:
    """This rank's place in its decode context-parallel group: the ranks that split each
    request's latent rows by token, token t on DCP rank (t // interleave) % dcp
    (`Topology`, docs/design.md §3). The group is the instance's TP group (DCP = TP), so the
    heads a rank holds are its TP shard and gathering them in rank order gives every head in
    order."""

    rank: int
    topology: Topology
    group: object | None = None  # the TP group's torch.distributed ProcessGroup

    @property
    def size(self) -> int:
        return self.topology.dcp

    def local_count(self, num_tokens: int) -> int:
        """How many of the first `num_tokens` positions this rank holds."""
        return self.topology.local_count(self.rank, num_tokens)

    def all_gather_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H_local, D] on every rank -> [B, size * H_local, D], ranks' heads in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)

    def scatter_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, size * H_local, D] on every rank -> [size, B, H_local, D]: every rank's values for
        this rank's heads, indexed by the rank they came from (one all-to-all)."""
        B, H, D = x.shape
        send = x.view(B, self.size, H // self.size, D).transpose(0, 1).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        return recv


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


# On the CPU, MKL's sgemm takes other kernels for a few rows (1-3 on one thread, also 5-7 and
# 9-11 with several), whose sums round differently from the many-row kernel. Products are
# therefore computed on at least this many rows there, so a row's result does not depend on how
# many rows share the call: a prompt prefilled in chunks, or beside other prompts, gets the same
# bits as prefilled alone in one piece (docs/design.md §6).
MIN_ROWS = 16


def matmul_rows(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """x [n, in] @ w_t [in, out], each row computed alike whatever n is (see MIN_ROWS)."""
    n = x.shape[0]
    if n >= MIN_ROWS or x.device.type != "cpu" or x.dim() != 2:
        return x @ w_t
    return (F.pad(x, (0, 0, 0, MIN_ROWS - n)) @ w_t)[:n]


# The CPU's element-wise kernels run an array's last (numel mod 2 vectors) elements by a scalar
# path whose exp / sigmoid round differently: an array of narrow rows ([T, heads], [T, experts])
# is mapped padded to a multiple of this many elements, so every element takes the vector path.
VECTOR_ELEMENTS = 64


def vector_map(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an element-wise `fn`, each element rounded alike wherever it sits in x."""
    if x.device.type != "cpu" or x.numel() % VECTOR_ELEMENTS == 0:
        return fn(x)
    flat = x.reshape(-1)
    return fn(F.pad(flat, (0, -flat.numel() % VECTOR_ELEMENTS)))[:flat.numel()].view(x.shape)


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
        y = matmul_rows(x.to(self.weight.dtype), self.weight.t())
        return self.tp.all_reduce(y) if self.row and self.reduce else y
