"""State transfer over real NIXL (UCX, DRAM) for the kimi-linear-48b-a3b state shapes.

For 8K and 128K-token requests and the topologies p=d=1, 2->1, 1->2 and d=2 with DCP 2, moves one
request's full state (7 MLA layers of latent, 20 KDA layers of recurrent + conv) and reports GB/s
against a plain memcpy of the same bytes in the same run, and the control overhead per request
(plan + post + notify). All agents live in this process (one per rank), as on one host.

    python benchmarks/transfer.py [--contexts 8192 131072] [--repeats 5] [--out DIR]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

from pdserve.model.config import preset
from pdserve.state.block_table import BlockTable, Topology
from pdserve.state.layout import RankShapes, StateLayout
from pdserve.state.manifest import build_manifest
from pdserve.state.pools import StatePools
from pdserve.transfer.dest import DestRank, TransferConfig
from pdserve.transfer.nixl_agent import RankAgent
from pdserve.transfer.planner import DestAllocation
from pdserve.transfer.regions import RegionTable
from pdserve.transfer.source import SourceRank

CASES = [("p1-d1", 1, Topology(1)), ("p2-d1", 2, Topology(1)), ("p1-d2", 1, Topology(2)),
         ("p1-d2-dcp2", 1, Topology(2, 2, 64))]


def run_case(config, layout, name, p, topo, n, repeats, device="cpu"):
    shapes1 = RankShapes.of(config)
    pages = -(-n // layout.page_tokens) + 2
    src_pools = [StatePools(shapes1.at_tp(p), layout, pages, 3, device) for _ in range(p)]
    page_ids = src_pools[0].latent.allocate(pages - 1)
    for pools in src_pools[1:]:
        pools.latent.allocate(pages - 1)
    slot = [pools.slots.allocate(1)[0] for pools in src_pools][0]
    for pools in src_pools:  # non-zero state (the zeroed-state check is always on)
        for t in pools.regions().values():
            t.fill_(0.5)
    table = BlockTable([page_ids], slot, [], n)
    manifest = build_manifest("bench", config, shapes1.at_tp(p), layout, table, Topology(p))
    src = [SourceRank(RankAgent(f"p-{name}-{n}", s, 0, RegionTable.of_pools(pl), device),
                      release=lambda r: None) for s, pl in enumerate(src_pools)]
    dst_pools = [StatePools(shapes1.at_tp(topo.tp), layout, pages, 3, device)
                 for _ in range(topo.tp)]
    dst = [DestRank(RankAgent(f"d-{name}-{n}", r, 0, RegionTable.of_pools(pl), device), pl,
                    TransferConfig(base_deadline_s=30)) for r, pl in enumerate(dst_pools)]
    for d in dst:
        for s in src:
            d.agent.connect(s.agent.info())
            s.agent.connect(d.agent.info())
    rows = []
    try:
        for i in range(repeats + 1):  # the first run prepares descriptor lists and connections
            for s in src:
                s.hold("bench", 60)
            parts = [d.allocate(manifest, topo) for d in dst]
            alloc = DestAllocation(topo, layout, [x[0] for x in parts], [x[1] for x in parts])
            _sync(device)
            t0 = time.perf_counter()
            stats = [d.receive(manifest, alloc, src[0].agent.instance) for d in dst]
            _sync(device)
            wall = time.perf_counter() - t0
            for d in dst:
                d.free(alloc)
            for s in src:
                s.poll()
            if i:
                rows.append((wall, sum(x["bytes"] for x in stats),
                             max(x["control_s"] for x in stats),
                             sum(x["descriptors"] for x in stats), sum(x["runs"] for x in stats)))
    finally:
        for x in src + dst:
            x.agent.close()
    nbytes = rows[0][1]
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.ones(nbytes, dtype=torch.uint8, device=device)
    copies = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        a.copy_(b)
        _sync(device)
        copies.append(time.perf_counter() - t0)
    wall = statistics.median(r[0] for r in rows)
    memcpy = statistics.median(copies)
    return {"case": name, "context": n, "p": p, "d": topo.tp, "dcp": topo.dcp,
            "bytes": nbytes, "seconds_median": wall, "gbps": nbytes / wall / 1e9,
            "memcpy_gbps": nbytes / memcpy / 1e9, "fraction_of_memcpy": memcpy / wall,
            "control_ms_median": statistics.median(r[2] for r in rows) * 1e3,
            "descriptors": rows[0][3], "runs": rows[0][4]}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 131072])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cpu", help="cpu (DRAM) or cuda (VRAM through UCX)")
    args = ap.parse_args()
    config = preset("kimi-linear-48b-a3b")
    layout = StateLayout()  # bf16 latent and conv, fp32 recurrent, 64-token pages
    results = []
    print(f"{'case':12s} {'context':>8s} {'MB':>8s} {'GB/s':>7s} {'memcpy':>7s} {'frac':>5s} "
          f"{'ctrl ms':>8s} {'descs':>6s}")
    for n in args.contexts:
        for name, p, topo in CASES:
            r = run_case(config, layout, name, p, topo, n, args.repeats, args.device)
            results.append(r)
            print(f"{name:12s} {n:8d} {r['bytes'] / 1e6:8.1f} {r['gbps']:7.2f} "
                  f"{r['memcpy_gbps']:7.2f} {r['fraction_of_memcpy']:5.2f} "
                  f"{r['control_ms_median']:8.2f} {r['descriptors']:6d}")
    where = "DRAM" if args.device == "cpu" else "VRAM"
    name = "transfer_cpu" if args.device == "cpu" else "transfer_h200"
    path = write_result(name, {"model": "kimi-linear-48b-a3b", "layout": "bf16 latent/conv, "
                        "fp32 recurrent, 64-token pages", "transport": f"NIXL UCX, {where}, one process",
                        "memcpy": "torch copy_ of the same bytes on the same device",
                        "rows": results}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
