"""Per-region checksums (xxh3-64) over the byte ranges a plan moves.

In verify mode the destination sends its plan's source ranges to the source, which hashes them
in its own memory while the state is still under lease; the destination hashes the same reads
where they landed and compares. Working on the plan's runs makes the check exact for every
topology (resharding, re-paging, staging) without the source knowing the destination up front.
"""
from __future__ import annotations

import xxhash

from pdserve.transfer.errors import IntegrityError
from pdserve.transfer.planner import Read
from pdserve.transfer.regions import RegionTable

Run = tuple[str, int, int, int]  # (kind, layer, offset, length) in the source rank's regions


def source_runs(reads: list[Read]) -> list[Run]:
    return [(r.kind, r.layer, r.src_offset, r.length) for r in reads]


def digest_runs(regions: RegionTable, runs: list[Run]) -> list[int]:
    out = []
    for kind, layer, offset, length in runs:
        span = regions.span(kind, layer, offset, length)
        out.append(xxhash.xxh3_64_intdigest(span.cpu().numpy().data))
    return out


def verify(request_id: str, rank: int, regions: RegionTable, reads: list[Read],
           expected: list[int]) -> None:
    """Raise IntegrityError naming the first mismatching region."""
    got = digest_runs(regions, [(regions.region_of(r, "dst"), r.layer, r.dst_offset, r.length)
                                for r in reads])
    if len(expected) != len(got):
        raise IntegrityError(f"request {request_id}: {len(expected)} source digests for "
                             f"{len(got)} reads on destination rank {rank}")
    for r, want, have in zip(reads, expected, got):
        if want != have:
            raise IntegrityError(
                f"request {request_id}: {r.kind} layer {r.layer} bytes [{r.dst_offset}, "
                f"{r.dst_offset + r.length}) on destination rank {rank} (from source rank "
                f"{r.src_rank}) differ from the source (xxh3 {have:016x} != {want:016x})")
