"""State transfer over real NIXL (UCX) for the kimi-linear-48b-a3b state shapes.

For 8K and 128K-token requests and the topologies p=d=1, 2->1, 1->2 and d=2 with DCP 2 (interleave
64: one page per DCP rank in turn), moves one request's full state (7 MLA layers of latent, 20 KDA
layers of recurrent + conv) and reports GB/s against a memcpy of the same bytes in the same run,
and the control overhead per request (plan + post + notify, the slowest destination rank's).
Each resharding case is measured with the p = d case alive beside it, the two taking turns in ABBA
order, and its slowdown is against that interleaved baseline (the VM's load drifts by tens of
percent within minutes).

As deployed, the source pool places each request's latent pages for the decode topology
(`LatentPool.decode_topology`: each DCP rank's pages contiguous), and every rank is its own process
with its own NIXL agent: destination ranks pull concurrently; the wall time runs from telling them
to start to the last one reporting done. On CPU, UCX moves DRAM between processes with CMA. Two
labelled extra rows read DCP 2 from token-ordered source pages (no placement, as before it
existed): "-unplaced" at interleave 64 and "-il1024" at interleave 1024.

    python benchmarks/transfer.py [--contexts 8192 131072] [--repeats 5] [--out DIR] [--device cuda]
"""
from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Column, Table, write_result  # noqa: E402

from pdserve.model.config import preset
from pdserve.state.block_table import BlockTable, Topology
from pdserve.state.layout import RankShapes, StateLayout
from pdserve.state.manifest import StateManifest, build_manifest
from pdserve.state.pools import StatePools
from pdserve.transfer.dest import DestRank, TransferConfig
from pdserve.transfer.nixl_agent import RankAgent
from pdserve.transfer.planner import DestAllocation, whole_slot_width
from pdserve.transfer.regions import RegionTable
from pdserve.transfer.source import SourceRank

MODEL = "kimi-linear-48b-a3b"
# (name, p, destination topology, source pages placed for it)
CASES = [("p1-d1", 1, Topology(1), True), ("p2-d1", 2, Topology(1), True),
         ("p1-d2", 1, Topology(2), True), ("p1-d2-dcp2", 1, Topology(2, 2, 64), True),
         # not issue-3 cases: DCP 2 from token-ordered source pages, i.e. without the placement
         # (one descriptor per page at interleave 64, per 16 pages at interleave 1024)
         ("p1-d2-dcp2-unplaced", 1, Topology(2, 2, 64), False),
         ("p1-d2-dcp2-il1024", 1, Topology(2, 2, 1024), False)]
REPLY_S = 120  # every wait on a rank process has a deadline
# A source rank handles its notifications and leases when polled, and the router polls prefill
# ranks every 0.2 s while requests are in flight (cluster/router.py POLL_S); a source process here
# does the same (a 2 ms loop cost each source process ~8 % of a core: load the deployment does not
# have, on a 2-core host shared with the destination ranks' copies).
SOURCE_POLL_S = 0.2


def dest_layout(p: int, d: int) -> StateLayout:
    """As `pdserve serve` lays out decode pools (ServeConfig.decode_layout): the conv staging
    slot is wide enough that conv moves as whole source slots whenever p != d."""
    return StateLayout(conv_staging_width=whole_slot_width(RankShapes.of(preset(MODEL)), p, d))


def _pools(tp: int, pages: int, device: str, layout: StateLayout = StateLayout(),
           decode_topology: Topology | None = None) -> StatePools:
    # 3 slots: padding, the request's and (destination, p != d) its conv staging slot
    return StatePools(RankShapes.of(preset(MODEL)).at_tp(tp), layout, pages, 3, device,
                      conv_staging=True, decode_topology=decode_topology)


def source_main(conn, instance: str, rank: int, p: int, n: int, pages: int, device: str,
                decode_topology: Topology | None):
    torch.set_num_threads(1)
    pools = _pools(p, pages, device, decode_topology=decode_topology)
    page_ids, slot = pools.latent.allocate(pages - 1), pools.slots.allocate(1)[0]
    for t in pools.regions().values():  # non-zero state (the zeroed-state check is always on)
        t.fill_(0.5)
    config = preset(MODEL)
    manifest = build_manifest("bench", config, RankShapes.of(config).at_tp(p), StateLayout(),
                              BlockTable([page_ids], slot, [], n), Topology(p))
    src = SourceRank(RankAgent(instance, rank, 0, RegionTable.of_pools(pools), device),
                     release=lambda rid: None)
    conn.send((src.agent.info(), manifest.encode()))
    while True:
        if conn.poll(SOURCE_POLL_S):
            cmd, *args = conn.recv()
            if cmd == "connect":
                src.agent.connect(args[0])
            elif cmd == "hold":
                src.hold("bench", 60)
            elif cmd == "stop":
                src.agent.close()
                conn.send("ok")
                return
            conn.send("ok")
        src.poll()


def dest_main(conn, instance: str, rank: int, topo: Topology, layout: StateLayout, pages: int,
              device: str):
    torch.set_num_threads(1)
    pools = _pools(topo.tp, pages, device, layout)
    dst = DestRank(RankAgent(instance, rank, 0, RegionTable.of_pools(pools), device,
                              progress_thread=device != "cpu"), pools,  # as DecodeRank
                   TransferConfig(base_deadline_s=30))
    conn.send(dst.agent.info())
    while True:
        cmd, *args = conn.recv()
        if cmd == "connect":
            dst.agent.connect(args[0])
            conn.send("ok")
        elif cmd == "allocate":
            conn.send(dst.allocate(StateManifest.decode(args[0]), topo))
        elif cmd == "receive":
            manifest, alloc = StateManifest.decode(args[0]), args[1]
            stats = dst.receive(manifest, alloc, args[2])
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            # the request's state (receive already returned the staging slots), as decode does
            pools.latent.free(alloc.latent_pages[rank])
            pools.slots.free(alloc.slots[rank])
            conn.send(stats)
        elif cmd == "stop":
            dst.agent.close()
            conn.send("ok")
            return


def _ask(conn, *msg):
    conn.send(msg)
    return _reply(conn)


def _reply(conn):
    if not conn.poll(REPLY_S):
        raise TimeoutError(f"a rank process did not answer within {REPLY_S} s")
    return conn.recv()


class CaseRun:
    """One topology case's rank processes (one per source and destination rank, each with its own
    NIXL agent), connected and warmed up (the first transfer prepares descriptor lists and
    connections); `once()` moves the request's state one more time."""

    def __init__(self, name: str, p: int, topo: Topology, placed: bool, n: int, device: str):
        self.name, self.p, self.topo, self.placed, self.n = name, p, topo, placed, n
        self.dst_layout = dest_layout(p, topo.tp)
        ctx = mp.get_context("spawn")
        pages = -(-n // StateLayout().page_tokens) + 2
        self.procs, self.src_conns, self.dst_conns = [], [], []
        for s in range(p):
            a, b = ctx.Pipe()
            self.procs.append(ctx.Process(target=source_main, args=(
                b, f"p-{name}", s, p, n, pages, device, topo if placed else None)))
            self.src_conns.append(a)
        for r in range(topo.tp):
            a, b = ctx.Pipe()
            self.procs.append(ctx.Process(target=dest_main,
                                          args=(b, f"d-{name}", r, topo, self.dst_layout, pages,
                                                device)))
            self.dst_conns.append(a)

    def __enter__(self):
        for x in self.procs:
            x.start()
        try:
            src_infos = [_reply(c) for c in self.src_conns]
            self.manifest = src_infos[0][1]
            dst_infos = [_reply(c) for c in self.dst_conns]
            for c in self.dst_conns:
                for info, _ in src_infos:
                    _ask(c, "connect", info)
            for c in self.src_conns:
                for info in dst_infos:
                    _ask(c, "connect", info)
            self.once()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def once(self) -> tuple:
        """(wall s, bytes, control s, descriptors, runs, plan s, post s, control CPU s) of one
        transfer."""
        for c in self.src_conns:
            _ask(c, "hold")
        parts = [_ask(c, "allocate", self.manifest) for c in self.dst_conns]
        alloc = DestAllocation(self.topo, self.dst_layout, *map(list, zip(*parts)))
        t0 = time.perf_counter()
        for c in self.dst_conns:
            c.send(("receive", self.manifest, alloc, f"p-{self.name}"))
        stats = [_reply(c) for c in self.dst_conns]
        wall = time.perf_counter() - t0
        return (wall, sum(x["bytes"] for x in stats), max(x["control_s"] for x in stats),
                sum(x["descriptors"] for x in stats), sum(x["runs"] for x in stats),
                max(x["plan_s"] for x in stats), max(x["prep_s"] for x in stats),
                max(x["control_cpu_s"] for x in stats))

    def __exit__(self, *exc):
        for c in self.src_conns + self.dst_conns:
            try:
                _ask(c, "stop")
            except (OSError, EOFError, TimeoutError):
                pass
        for x in self.procs:
            x.join(10)
            if x.is_alive():
                x.kill()

    def summary(self, rows: list[tuple]) -> dict:
        med = lambda i: statistics.median(r[i] for r in rows)
        return {"case": self.name, "context": self.n, "p": self.p, "d": self.topo.tp,
                "dcp": self.topo.dcp, "interleave": self.topo.interleave, "placed": self.placed,
                "bytes": rows[0][1], "seconds_median": med(0),
                "control_ms_median": med(2) * 1e3, "plan_ms_median": med(5) * 1e3,
                "post_ms_median": med(6) * 1e3, "control_cpu_ms_median": med(7) * 1e3,
                "descriptors": rows[0][3], "runs": rows[0][4]}


def run_paired(case, base, n: int, repeats: int, device: str) -> tuple[dict, dict]:
    """`case` and the p = d baseline `base` alive at once, their transfers alternating in ABBA
    order: a shared machine's load drifts within minutes, and whichever case ran second would
    be charged that drift. Returns (case summary, baseline summary of the same run)."""
    with CaseRun(*case, n, device) as x, CaseRun(*base, n, device) as y:
        rows = {x: [], y: []}
        for i in range(repeats):
            for run in ((x, y) if i % 4 in (0, 3) else (y, x)):
                rows[run].append(run.once())
        return x.summary(rows[x]), y.summary(rows[y])


def copy_seconds(nbytes: int, repeats: int, device: str, plain: bool) -> float:
    """Median seconds to copy `nbytes`: with `plain`, libc memcpy on one thread (DRAM only);
    else torch's copy_ (all of torch's threads on CPU, a device copy on GPU)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.ones(nbytes, dtype=torch.uint8, device=device)
    libc = ctypes.CDLL(None)
    libc.memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        if plain:
            libc.memcpy(a.data_ptr(), b.data_ptr(), nbytes)
        else:
            a.copy_(b)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


TABLE = Table([Column("case", width=20, left=True), Column("context", width=8),
               Column("MB", lambda r: r["bytes"] / 1e6, ".1f", 8),
               Column("GB/s", "gbps", ".2f", 7), Column("memcpy", "memcpy_gbps", ".2f", 7),
               Column("frac", "fraction_of_memcpy", ".2f", 5),
               Column("par.copy", "parallel_copy_gbps", ".2f", 8),
               Column("vs p=d", "slowdown_vs_p1_d1", "+.0%", 6),
               Column("ctrl ms", "control_ms_median", ".2f", 8),
               Column("cpu ms", "control_cpu_ms_median", ".2f", 7),
               Column("descs", "descriptors", width=6)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 131072])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cpu", help="cpu (DRAM) or cuda (VRAM through UCX)")
    args = ap.parse_args()
    results = []
    print(TABLE.header(), flush=True)
    for n in args.contexts:
        for case in CASES:
            if case is CASES[0]:
                with CaseRun(*case, n, args.device) as run:
                    r = run.summary([run.once() for _ in range(args.repeats)])
                base_gbps = None
            else:
                r, base = run_paired(case, CASES[0], n, args.repeats, args.device)
                base_gbps = base["bytes"] / base["seconds_median"] / 1e9
            cpu = args.device == "cpu"
            memcpy = copy_seconds(r["bytes"], args.repeats, args.device, plain=cpu)
            parallel = copy_seconds(r["bytes"], args.repeats, args.device, plain=False)
            r.update(gbps=r["bytes"] / r["seconds_median"] / 1e9,
                     memcpy_gbps=r["bytes"] / memcpy / 1e9,
                     fraction_of_memcpy=memcpy / r["seconds_median"],
                     parallel_copy_gbps=r["bytes"] / parallel / 1e9)
            r["p1_d1_gbps_paired"] = base_gbps or r["gbps"]
            r["slowdown_vs_p1_d1"] = r["p1_d1_gbps_paired"] / r["gbps"] - 1
            results.append(r)
            print(TABLE.row(r), flush=True)
    where = "DRAM" if args.device == "cpu" else "VRAM"
    name = "transfer_cpu" if args.device == "cpu" else "transfer_h200"
    path = write_result(name, {
        "model": MODEL, "layout": "bf16 latent/conv, fp32 recurrent, 64-token pages; destination conv "
                  "staging d/p wide (whole source conv slots when p != d, as pdserve serve)",
        "transport": f"NIXL UCX, {where}, one process per rank",
        "memcpy": "CPU: libc memcpy of the same bytes on one thread (the fraction's denominator; "
                  "UCX moves DRAM with one thread per destination rank); GPU: a device copy",
        "parallel_copy": "torch copy_ of the same bytes with all torch threads",
        "slowdown_vs_p1_d1": "p1_d1_gbps_paired / this case's GB/s - 1, where p1_d1_gbps_paired is "
                             "p=d=1 at the same context measured in the same run, its transfers "
                             "alternating with this case's in ABBA order (both cases' processes up)",
        "placed": "source latent pages placed for the decode topology (LatentPool.decode_topology: "
                  "each DCP rank's pages contiguous, as deployed); false = token-ordered pages",
        "control": "plan + post + notify of the slowest destination rank (plan_ms, post_ms: their "
                   "parts); post = index arrays and NIXL handles, not the data movement",
        "control_cpu": "the same steps in the destination rank thread's CPU time (time.thread_time), "
                       "the slowest rank's: wall control minus the turns other processes took "
                       "meanwhile (2 cores: the other destination rank copies at the same time)",
        "descriptors": "descriptors the UCX backend gets, all destination ranks (NIXL merges index "
                       "runs contiguous on both sides); on DRAM each is one process_vm_readv",
        "rows": results}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
