"""Processes for the multi-process transfer tests: a source rank and a destination rank, each
with its own NIXL agent, driven over a multiprocessing pipe (the stand-in for Ray calls)."""
from __future__ import annotations

import time
import traceback

import torch

from pdserve.state.block_table import Topology
from pdserve.state.layout import RankShapes, StateLayout
from pdserve.transfer.dest import DestRank, TransferConfig
from pdserve.transfer.nixl_agent import RankAgent
from pdserve.transfer.planner import DestAllocation
from pdserve.transfer.regions import RegionTable
from pdserve.transfer.source import SourceRank

from state_fixtures import as_dtype, make_pools, make_state, source_side


def source_main(conn, instance: str, generation: int, shapes: RankShapes, n: int, pages: int):
    torch.set_num_threads(1)
    layout = StateLayout()
    state = as_dtype(make_state(shapes, n, seed=11), layout)
    import state_fixtures
    orig = state_fixtures.make_pools
    state_fixtures.make_pools = lambda sh, lt, **kw: orig(sh, lt, pages=pages, slots=4, fill=7.0)
    (pools,), manifest = source_side(shapes, 1, layout, state, n, False)
    released = []
    src = SourceRank(RankAgent(instance, 0, generation, RegionTable.of_pools(pools)),
                     release=lambda rid: (released.append(rid), pools.latent.free(manifest.latent_pages[0]),
                                          pools.slots.free([manifest.kda_slot])))
    src.hold(manifest.request_id, lease_s=60)
    conn.send(("ready", src.agent.info(), manifest.encode()))
    while True:
        if conn.poll(0.005):
            cmd, *args = conn.recv()
            if cmd == "connect":
                src.agent.connect(args[0])
                conn.send(("ok",))
            elif cmd == "digests":
                conn.send(("digests", src.digests(*args)))
            elif cmd == "stop":
                src.agent.close()
                return
        for event in src.poll():
            conn.send(("event", event, pools.latent.num_used, pools.slots.num_used))


def dest_main(conn, shapes: RankShapes, n: int, pages: int, verify: bool):
    torch.set_num_threads(1)
    layout = StateLayout()
    pools = make_pools(shapes, layout, pages=pages, slots=4)
    dst = DestRank(RankAgent("decode", 0, 0, RegionTable.of_pools(pools), progress_thread=False),
                   pools,
                   TransferConfig(verify=verify, base_deadline_s=3.0, expected_gbps=1.0))
    conn.send(("ready", dst.agent.info()))
    while True:
        cmd, *args = conn.recv()
        if cmd == "stop":
            dst.agent.close()
            return
        if cmd == "connect":
            try:
                dst.agent.connect(args[0])
                conn.send(("ok",))
            except Exception as exc:
                conn.send(("error", type(exc).__name__, str(exc)))
        elif cmd == "receive":
            from pdserve.state.manifest import StateManifest
            manifest = StateManifest.decode(args[0])
            topo = Topology()
            pg, sl, _ = dst.allocate(manifest, topo)
            alloc = DestAllocation(topo, layout, [pg], [sl])
            before = (pools.latent.num_used - len(pg), pools.slots.num_used - 1)
            digests = None
            if verify:
                def digests(src_rank, runs):
                    conn.send(("need_digests", runs))
                    return conn.recv()[1]
            t0 = time.monotonic()
            try:
                stats = dst.receive(manifest, alloc, args[1], digests)
                ok = torch.equal(pools.slots.recurrent[:, sl[0]], _expected_recurrent(shapes, n))
                conn.send(("done", stats, ok, time.monotonic() - t0))
            except Exception as exc:
                conn.send(("error", type(exc).__name__, str(exc), time.monotonic() - t0,
                           (pools.latent.num_used, pools.slots.num_used) == before,
                           traceback.format_exc()))


def _expected_recurrent(shapes, n):
    return as_dtype(make_state(shapes, n, seed=11), StateLayout()).recurrent
