"""Synthetic request state for transfer tests, written into pools through the pools' own API.

`GlobalState` holds one request's state for the whole model (TP = 1 view); `write_rank` lays it
into one rank's pools for a given topology exactly as a prefill run in that topology would leave
it. This is independent of the planner's byte arithmetic, so it is the oracle for transfers."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.state.block_table import BlockTable, Topology
from pdserve.state.layout import RankShapes, StateLayout, dtype_of
from pdserve.state.manifest import StateManifest
from pdserve.state.pools import StatePools
from pdserve.transfer.planner import DestAllocation


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


def scattered_pages(latent, count: int) -> list[int]:
    """Page ids that are neither 1, 2, ... nor ascending (a source's pages are arbitrary)."""
    latent.allocate(2)
    return latent.allocate(count)[::-1]


def source_side(shapes1, src_tp, layout, state, n, checkpoint, pages_of=scattered_pages):
    """p source ranks holding the request; returns (pools, manifest). `pages_of(latent pool,
    count)` allocates each rank's pages for the request."""
    topo, pools = Topology(tp=src_tp), []
    pages_needed = -(-n // layout.page_tokens)
    for s in range(src_tp):
        p = make_pools(shapes1.at_tp(src_tp), layout, fill=7.0)
        pages = pages_of(p.latent, pages_needed)
        slots = p.slots.allocate(2 if checkpoint else 1)
        table = BlockTable([pages], slots[0], [(layout.page_tokens, slots[1])] if checkpoint else [], n)
        write_rank(p, state, topo, s, table, slots)
        pools.append(p)
    m = StateManifest(request_id="req-7", fingerprint="test", num_tokens=n, topology=topo,
                      layout=layout, shapes=shapes1.at_tp(src_tp), latent_pages=table.latent_pages,
                      kda_slot=table.kda_slot, checkpoints=table.checkpoints)
    return pools, m


def dest_side(shapes1, topo, layout, n, n_slots, staging):
    pools_actual, pools_expected, pages, slots, stage = [], [], [], [], []
    for r in range(topo.tp):
        pair = [make_pools(shapes1.at_tp(topo.tp), layout, staging=staging) for _ in range(2)]
        local = topo.local_count(r if topo.dcp > 1 else 0, n)
        ids = []
        for p in pair:
            p.latent.allocate(1)
            p.slots.allocate(1)
            ids.append((p.latent.allocate(-(-local // layout.page_tokens)),
                        p.slots.allocate(n_slots), p.slots.allocate(n_slots) if staging else []))
        assert ids[0] == ids[1]
        pages.append(ids[0][0])
        slots.append(ids[0][1])
        stage.append(ids[0][2])
        pools_actual.append(pair[0])
        pools_expected.append(pair[1])
    alloc = DestAllocation(topo, layout, pages, slots, stage)
    return pools_actual, pools_expected, alloc
