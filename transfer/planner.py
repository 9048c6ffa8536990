"""Transfer planner: a pure function from (manifest, destination allocation) to byte-range reads.

The source instance (TP = p, DCP = 1) and destination instance (TP = d, DCP = c in {1, d}, token t
on DCP rank (t // interleave) % c) may differ in TP, page size and conv layout:

- MLA latent is replicated per source rank: each destination rank reads only its DCP token shard,
  from one source replica (rank r reads from source r % p, spreading load over replicas).
- KDA recurrent state [H_local, V, K] is sharded by head: destination heads [r*Hd, (r+1)*Hd)
  intersected with each source rank's heads give byte ranges, in both directions (p < d, p > d).
- KDA conv state is packed [q | k | v] per rank, so resharding it in place takes one small read
  per section (and per tap in the SD layout): 360 reads of 4 KB per request at kimi shapes,
  1 -> 2 or 2 -> 1, each a syscall on DRAM or a ~9 us CUDA-IPC copy on VRAM. So when p != d
  and the destination's staging slot is wide enough, each overlapping source slot is read whole
  (one read per layer) into the staging slot and arrival picks and reorders the channels; when
  only the layouts differ (SD vs DS) the per-section reads land in the staging slot and arrival
  converts (`conv_staging`).

All offsets are bytes within one layer's region of a rank (`Read.kind`, `Read.layer`). Every read
starts on a multiple of its kind's `unit` (the largest chunk that never straddles a page, a DCP
run or a head-range boundary on either side), so the backend can index prepared descriptor lists
of unit-sized entries; contiguous runs are coalesced.

A plan holds its reads as an integer table (one row per read, columns `COLUMNS`): with DCP the
latent alone is one read per page per layer (14,336 at 128K context, d = c = 2), and building that
many Python objects per request was most of the control time. `TransferPlan.reads` gives the same
rows as `Read`s for code that wants them (verification, plain copies, tests).
"""
from __future__ import annotations

from functools import cached_property
from math import gcd

import msgspec
import numpy as np

from pdserve.state.block_table import Topology
from pdserve.state.layout import DTYPE_FIELDS, RankShapes, StateLayout, dtype_of
from pdserve.state.manifest import StateManifest

from pdserve.transfer.errors import TopologyError

KINDS = ("mla_latent", "kda_recurrent", "kda_conv")


class Read(msgspec.Struct, frozen=True, array_like=True):
    src_rank: int
    dst_rank: int
    kind: str            # one of KINDS
    layer: int           # index within the kind's layer group
    src_offset: int      # bytes within the source rank's layer region
    dst_offset: int      # bytes within the destination rank's layer region (or conv staging)
    length: int
    staged: bool = False  # conv read into the staging slot (see `conv_staging`)


class DestAllocation(msgspec.Struct):
    """What the destination allocated, per destination rank."""

    topology: Topology
    layout: StateLayout
    latent_pages: list[list[int]]        # per rank: pages for that rank's DCP token shard
    slots: list[list[int]]               # per rank: [running slot, *checkpoint slots]
    staging_slots: list[list[int]] = []  # per rank, aligned with slots, when conv is staged


# Columns of a plan's table; KIND is the index into KINDS, STAGED is 0 or 1.
COLUMNS = SRC, DST, KIND, LAYER, SOFF, DOFF, LEN, STAGED = range(8)


def as_table(reads: list[Read]) -> np.ndarray:
    rows = [(r.src_rank, r.dst_rank, KINDS.index(r.kind), r.layer, r.src_offset, r.dst_offset,
             r.length, r.staged) for r in reads]
    return np.array(rows, dtype=np.int64).reshape(-1, len(COLUMNS))


class TransferPlan:
    def __init__(self, table: np.ndarray, units: dict[str, int], src_tp: int, dst_tp: int):
        self.table = table                   # [reads, COLUMNS] int64
        self.units = units                   # bytes per prepared descriptor, per kind
        self.src_tp, self.dst_tp = src_tp, dst_tp
        per_kind = np.bincount(table[:, KIND], weights=table[:, LEN], minlength=len(KINDS))
        self.bytes_by_kind = {k: int(per_kind[i]) for i, k in enumerate(KINDS)}

    @cached_property
    def reads(self) -> list[Read]:
        return [Read(s, d, KINDS[k], layer, so, do, n, bool(st))
                for s, d, k, layer, so, do, n, st in self.table.tolist()]

    def for_rank(self, dst_rank: int) -> list[Read]:
        return [r for r in self.reads if r.dst_rank == dst_rank]

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_kind.values())


def check_topology(src: RankShapes, src_topo: Topology, dst_topo: Topology) -> None:
    """Raise TopologyError (naming p, d, c and the head counts) unless the pair is supported."""
    p, d, c = src_topo.tp, dst_topo.tp, dst_topo.dcp
    heads = f"KDA heads={src.kda_heads_total}, MLA heads={src.mla_heads}"
    where = f"source TP p={p} -> destination TP d={d}, DCP c={c} ({heads})"
    if src_topo.dcp != 1:
        raise TopologyError(f"{where}: source DCP={src_topo.dcp} is not supported (prefill "
                            "instances hold the whole latent per rank)")
    if src.tp != p:
        raise TopologyError(f"{where}: manifest shapes are for TP={src.tp}, topology says p={p}")
    for name, n in (("KDA", src.kda_heads_total), ("MLA", src.mla_heads)):
        for side, t in (("p", p), ("d", d)):
            if n % t:
                raise TopologyError(f"{where}: {name} heads {n} are not divisible by {side}={t}")
    if c not in (1, d):
        raise TopologyError(f"{where}: DCP c must be 1 or d={d}")


def conv_staging(manifest: StateManifest, dst_topo: Topology, dst_layout: StateLayout) -> str:
    """How conv state reaches the destination ranks:
    "whole": p != d and every destination rank's overlapping source slots fit its staging slot
        (`StateLayout.conv_staging_width`): each is read whole, arrival picks the channels;
    "sections": per-section reads into the staging slot (only the layouts differ: arrival
        converts); "" : per-section reads straight into the slot."""
    p, d = manifest.topology.tp, dst_topo.tp
    if p != d and dst_layout.conv_staging_width >= whole_slot_width(manifest.shapes, p, d):
        return "whole"
    return "sections" if manifest.layout.conv_layout != dst_layout.conv_layout else ""


def whole_slot_width(shapes: RankShapes, p: int, d: int) -> int:
    """The `StateLayout.conv_staging_width` a destination of TP d needs to take whole conv slots
    from a source of TP p: the most source slots one destination rank overlaps, in multiples
    of its own conv channels (d / p when p divides d, 1 when d divides p)."""
    src, dst = shapes.at_tp(p), shapes.at_tp(d)
    widest = max(len(list(_head_overlaps(src, dst, r))) for r in range(d))
    return max(1, -(-widest * src.conv_channels // dst.conv_channels))


def staged_parts(manifest: StateManifest, dst_topo: Topology, dst_layout: StateLayout,
                 r: int) -> tuple[int, list[tuple[int, int]]]:
    """What destination rank r's staging slot holds, for `SlotPool.unstage`: (channels per
    part, [(first channel, count) taken from each section of part j])."""
    src, dst = manifest.shapes, manifest.shapes.at_tp(dst_topo.tp)
    if conv_staging(manifest, dst_topo, dst_layout) == "whole":
        return src.conv_channels, [((a - s * src.kda_heads) * src.head_dim, (b - a) * src.head_dim)
                                   for s, a, b in _head_overlaps(src, dst, r)]
    return dst.conv_channels, [(0, dst.conv_section)]


def plan_transfer(manifest: StateManifest, dst: DestAllocation,
                  ranks: list[int] | None = None) -> TransferPlan:
    """The reads that move `manifest`'s request into `dst` (all destination ranks, or `ranks`)."""
    src_topo, dst_topo, src = manifest.topology, dst.topology, manifest.shapes
    check_topology(src, src_topo, dst_topo)
    for field in DTYPE_FIELDS:
        if getattr(manifest.layout, field) != getattr(dst.layout, field):
            raise TopologyError(f"{field}: source {getattr(manifest.layout, field)} != "
                                f"destination {getattr(dst.layout, field)} (no conversion in flight)")
    p, d = src_topo.tp, dst_topo.tp
    dshape = src.at_tp(d)
    ranks = list(range(d)) if ranks is None else ranks
    n_slots = 1 + len(manifest.checkpoints)
    for r in ranks:
        if len(dst.slots[r]) != n_slots:
            raise ValueError(f"destination rank {r}: {len(dst.slots[r])} slots allocated, the "
                             f"manifest moves {n_slots} (running + checkpoints)")
    staging = conv_staging(manifest, dst_topo, dst.layout)
    if staging and any(r >= len(dst.staging_slots) or len(dst.staging_slots[r]) != n_slots
                     for r in ranks):
        raise ValueError(f"conv state is staged (layouts {manifest.layout.conv_layout} -> "
                         f"{dst.layout.conv_layout}, p={p} -> d={d}): every destination rank "
                         "needs one staging slot per moved slot")

    units = _units(manifest, dst, dshape)
    latent: list[np.ndarray] = []
    reads: list[Read] = []
    for r in ranks:
        latent.append(_latent_table(manifest, dst, r, units["mla_latent"]))
        src_slots = [manifest.kda_slot] + [s for _, s in manifest.checkpoints]
        for i, (ss, ds) in enumerate(zip(src_slots, dst.slots[r])):
            conv_dst = dst.staging_slots[r][i] if staging else ds
            # one source slot in every layer, or (vLLM) the running slot per layer
            per_layer = manifest.kda_layer_slots or [ss] * src.n_kda
            reads += _stamp_layers(
                per_layer, lambda s: _recurrent_reads(manifest, src, dshape, r, s, ds)
                + _conv_reads(manifest, src, dshape, r, s, conv_dst, staging,
                              dst.layout.conv_staging_width))
    # KDA runs coalesce across slots (running + checkpoints) of one layer
    table = np.concatenate(latent + [as_table(coalesce(reads))])
    return TransferPlan(table, units, p, d)


def _units(m: StateManifest, dst: DestAllocation, dshape: RankShapes) -> dict[str, int]:
    lt = m.layout
    g_heads = gcd(m.shapes.kda_heads, dshape.kda_heads)
    rows = gcd(lt.page_tokens, dst.layout.page_tokens)
    if dst.topology.dcp > 1:
        rows = gcd(rows, dst.topology.interleave)
    conv_isz, D = dtype_of(lt.conv_dtype).itemsize, m.shapes.head_dim
    conv_unit = g_heads * D * conv_isz * (m.shapes.conv_taps if lt.conv_layout == "DS" else 1)
    # A strided source (vLLM's padded pages) needs units that also divide its strides, so every
    # page/slot start stays on the unit grid; dense strides leave the units unchanged.
    st, row = m.source_strides(), m.shapes.latent_width * dtype_of(lt.latent_dtype).itemsize
    if st.latent_page % row:
        raise TopologyError(f"source latent page stride {st.latent_page} B is not a whole number "
                            f"of {row}-byte latent rows")
    rows = gcd(rows, st.latent_page // row)
    return {"mla_latent": rows * row,
            "kda_recurrent": gcd(g_heads * D * D * dtype_of(lt.recurrent_dtype).itemsize,
                                 st.recurrent_slot),
            "kda_conv": gcd(conv_unit, st.conv_slot)}


def _latent_table(m: StateManifest, dst: DestAllocation, r: int, unit: int) -> np.ndarray:
    """Rank r's latent reads as table rows: its units in token order (numpy: at 128K context
    with DCP these are thousands of one-page runs), runs coalesced while both sides stay
    contiguous, repeated for every MLA layer."""
    src_rank = r % m.topology.tp
    row = m.shapes.latent_width * dtype_of(m.layout.latent_dtype).itemsize
    ps, pd, g = m.layout.page_tokens, dst.layout.page_tokens, unit // row
    topo, dst_pages = dst.topology, dst.latent_pages[r]
    page_stride = m.source_strides().latent_page
    need = -(-topo.local_count(r if topo.dcp > 1 else 0, m.num_tokens) // pd)
    if len(dst_pages) < need:
        raise ValueError(f"destination rank {r}: {len(dst_pages)} latent pages allocated, "
                         f"{need} needed for its tokens")
    n, il = m.num_tokens, topo.interleave
    if topo.dcp > 1:
        # unit starts in rank r's local positions, and the global tokens they hold (g divides
        # the interleave, so a unit never straddles two DCP runs)
        lp = np.arange(0, topo.local_count(r, n), g, dtype=np.int64)
        t0 = lp // il * il * topo.dcp + r * il + lp % il
    else:
        lp = t0 = np.arange(0, n, g, dtype=np.int64)
    # whole units even at the tail: the rows past N are zeroed on arrival (backend)
    so = np.asarray(m.latent_pages[0], dtype=np.int64)[t0 // ps] * page_stride + t0 % ps * row
    do = (np.asarray(dst_pages, dtype=np.int64)[lp // pd] * pd + lp % pd) * row
    breaks = np.ones(len(so), dtype=bool)  # a unit that does not continue the previous one
    breaks[1:] = (so[1:] != so[:-1] + unit) | (do[1:] != do[:-1] + unit)
    starts = np.flatnonzero(breaks)
    lengths = np.diff(np.r_[starts, len(so)]) * unit
    runs = np.zeros((len(starts), len(COLUMNS)), dtype=np.int64)
    runs[:, SRC], runs[:, DST], runs[:, KIND] = src_rank, r, KINDS.index("mla_latent")
    runs[:, SOFF], runs[:, DOFF], runs[:, LEN] = so[starts], do[starts], lengths
    table = np.tile(runs, (m.shapes.n_mla, 1))
    table[:, LAYER] = np.repeat(np.arange(m.shapes.n_mla), len(runs))
    return table


def _head_overlaps(src: RankShapes, dst: RankShapes, r: int):
    """(source rank, first head, end head) in global head numbers for destination rank r."""
    lo, hi = r * dst.kda_heads, (r + 1) * dst.kda_heads
    for s in range(src.tp):
        a, b = max(lo, s * src.kda_heads), min(hi, (s + 1) * src.kda_heads)
        if a < b:
            yield s, a, b


def _recurrent_reads(m, src: RankShapes, dst: RankShapes, r: int, src_slot: int,
                     dst_slot: int) -> list[Read]:
    """Layer-0 reads of one slot (`_stamp_layers` repeats them per layer)."""
    head = src.head_dim ** 2 * dtype_of(m.layout.recurrent_dtype).itemsize
    stride = m.source_strides().recurrent_slot
    out = []
    for s, a, b in _head_overlaps(src, dst, r):
        so = src_slot * stride + (a - s * src.kda_heads) * head
        do = dst_slot * dst.kda_heads * head + (a - r * dst.kda_heads) * head
        out.append(Read(s, r, "kda_recurrent", 0, so, do, (b - a) * head))
    return out


def _conv_reads(m, src: RankShapes, dst: RankShapes, r: int, src_slot: int, dst_slot: int,
                staging: str, width: int) -> list[Read]:
    """Layer-0 conv reads in the SOURCE layout (into the staging slot when `staging`, see
    `conv_staging`)."""
    isz, D, taps = dtype_of(m.layout.conv_dtype).itemsize, src.head_dim, src.conv_taps
    cs, cd = src.conv_channels, dst.conv_channels
    stride = m.source_strides().conv_slot
    base = dst_slot * cd * taps * isz * (width if staging else 1)
    overlaps = list(_head_overlaps(src, dst, r))
    if staging == "whole":  # whole source slots, in source-rank order
        return [Read(s, r, "kda_conv", 0, src_slot * stride, base + j * cs * taps * isz,
                     cs * taps * isz, True) for j, (s, _, _) in enumerate(overlaps)]
    out = []
    for s, a, b in overlaps:
        for sec in range(3):
            ch_s = sec * src.conv_section + (a - s * src.kda_heads) * D
            ch_d = sec * dst.conv_section + (a - r * dst.kda_heads) * D
            n = (b - a) * D
            if m.layout.conv_layout == "DS":  # (channels, taps): one run per section
                spans = [(ch_s * taps, ch_d * taps, n * taps)]
            else:                             # (taps, channels): one run per tap
                spans = [(t * cs + ch_s, t * cd + ch_d, n) for t in range(taps)]
            out += [Read(s, r, "kda_conv", 0, src_slot * stride + so * isz, base + do * isz,
                         length * isz, bool(staging)) for so, do, length in spans]
    return out


def _stamp_layers(slots: list[int], reads_of) -> list[Read]:
    """Layer l's reads are `reads_of(slots[l])` stamped with layer l. Offsets depend only on the
    slot, so runs are coalesced once per distinct slot (once in all, for our pools)."""
    runs: dict[int, list[Read]] = {}
    out = []
    for layer, slot in enumerate(slots):
        if slot not in runs:
            runs[slot] = coalesce(reads_of(slot))
        out += [msgspec.structs.replace(x, layer=layer) for x in runs[slot]]
    return out


def coalesce(reads: list[Read]) -> list[Read]:
    """Merge reads that continue each other on both sides."""
    key = lambda x: (x.src_rank, x.dst_rank, x.kind, x.layer, x.staged, x.src_offset)
    out: list[Read] = []
    for x in sorted(reads, key=key):
        last = out[-1] if out else None
        if (last and key(last)[:5] == key(x)[:5] and last.src_offset + last.length == x.src_offset
                and last.dst_offset + last.length == x.dst_offset):
            out[-1] = msgspec.structs.replace(last, length=last.length + x.length)
        else:
            out.append(x)
    return out
