"""What a destination rank does once its reads have landed, whatever moved the bytes:
zero latent rows past the request's tokens (reads move whole units), reorder and convert staged
conv state into the pool's layout, and refuse a zeroed KDA state (the classic silent failure)."""
from __future__ import annotations

from pdserve.state.manifest import StateManifest
from pdserve.state.pools import StatePools

from pdserve.transfer.errors import IntegrityError
from pdserve.transfer.planner import DestAllocation, TransferPlan, conv_staging, staged_parts


def finish_arrival(pools: StatePools, manifest: StateManifest, alloc: DestAllocation,
                   plan: TransferPlan, rank: int) -> None:
    topo = alloc.topology
    local = topo.local_count(rank if topo.dcp > 1 else 0, manifest.num_tokens)
    row_bytes = pools.latent.width * pools.latent.data.element_size()
    unit_rows = plan.units["mla_latent"] // row_bytes
    end = -(-local // unit_rows) * unit_rows
    pages, pt = alloc.latent_pages[rank], pools.latent.page_tokens
    for pos in range(local, end):
        pools.latent.data[:, pages[pos // pt], pos % pt] = 0
    if conv_staging(manifest, topo, alloc.layout):
        part_channels, picks = staged_parts(manifest, topo, alloc.layout, rank)
        for staging, slot in zip(alloc.staging_slots[rank], alloc.slots[rank]):
            pools.slots.unstage(staging, slot, manifest.layout.conv_layout, part_channels, picks)
    if manifest.num_tokens > 0 and manifest.shapes.n_kda:
        zeroed = zeroed_layers(pools.slots.recurrent[:, alloc.slots[rank][0]])
        if zeroed:
            raise IntegrityError(f"request {manifest.request_id}: destination rank {rank} holds a "
                                 f"zeroed KDA recurrent state in KDA layers {zeroed} after "
                                 f"{manifest.num_tokens} tokens")


def zeroed_layers(state, probe: int = 4096) -> list[int]:
    """KDA layers whose state [layers, ...] is all zero. A live state is nonzero almost
    everywhere, so each layer's first `probe` elements settle it; only layers whose probe is all
    zero are scanned in full (a full scan of every layer costs a few ms at 48B shapes)."""
    flat = state.reshape(state.shape[0], -1)
    suspect = (~flat[:, :probe].any(dim=1)).nonzero().flatten().tolist()
    return [i for i in suspect if not flat[i].any()]
