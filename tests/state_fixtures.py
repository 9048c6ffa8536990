"""Synthetic request state for transfer tests, written into pools through the pools' own API.

`GlobalState` holds one request's state for the whole model (TP = 1 view); `write_rank` lays it
into one rank's pools for a given topology exactly as a prefill run in that topology would leave
it. This is independent of the planner's byte arithmetic, so it is the oracle for transfers."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.state.block_table import BlockTable, Topology
from pdserve.state.layout import RankShapes, StateLayout, dtype_of
from pdserve.state.pools import StatePools


@dataclass
class GlobalState:
    latent: torch.Tensor     # [n_mla, N, width]
    recurrent: torch.Tensor  # [n_kda, H, V, K]
    conv: torch.Tensor       # [n_kda, taps, 3, H, D]  (SD order, per section)


def make_state(shapes1: RankShapes, n: int, seed: int) -> GlobalState:
    g = torch.Generator().manual_seed(seed)
    H, D = shapes1.kda_heads_total, shapes1.head_dim
    return GlobalState(
        latent=torch.randn(shapes1.n_mla, n, shapes1.latent_width, generator=g),
        recurrent=torch.randn(shapes1.n_kda, H, D, D, generator=g),
        conv=torch.randn(shapes1.n_kda, shapes1.conv_taps, 3, H, D, generator=g))


def make_pools(shapes: RankShapes, layout: StateLayout, pages=64, slots=8, staging=False,
               fill: float | None = None) -> StatePools:
    pools = StatePools(shapes, layout, pages, slots, conv_staging=staging)
    if fill is not None:  # poison: anything not written by the transfer keeps this value
        for t in pools.regions().values():
            t.fill_(fill)
    return pools


def write_rank(pools: StatePools, state: GlobalState, topo: Topology, rank: int,
               table: BlockTable, slots: list[int]) -> None:
    """Write `state` into `slots` (same state in each) and the rank's pages, as rank `rank`."""
    sh = pools.shapes
    dcp_rank = rank if topo.dcp > 1 else 0
    tokens = topo.tokens_on(dcp_rank, state.latent.shape[1])
    for layer in range(sh.n_mla):
        if tokens:
            pools.latent.write(layer, table.latent_pages[0], 0, state.latent[layer, tokens])
    heads = slice(rank * sh.kda_heads, (rank + 1) * sh.kda_heads)
    for layer in range(sh.n_kda):
        conv = state.conv[layer][:, :, heads].reshape(sh.conv_taps, sh.conv_channels)
        for slot in slots:
            pools.slots.write(layer, slot, state.recurrent[layer, heads], conv)


def as_dtype(state: GlobalState, layout: StateLayout) -> GlobalState:
    """Round the state to the pools' dtypes so written values compare exactly."""
    r = lambda t, name: t.to(dtype_of(name)).float()
    return GlobalState(r(state.latent, layout.latent_dtype), r(state.recurrent, layout.recurrent_dtype),
                       r(state.conv, layout.conv_dtype))
