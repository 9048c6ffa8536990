"""Real NIXL (UCX over DRAM) agents, one per rank, in one process: READs land exactly, verify mode
catches a corrupted byte, leases and notifications free the source, restarted peers are evicted."""
import threading
import time

import msgspec
import pytest
import torch

from pdserve.state.block_table import BlockTable, Topology
from pdserve.state.layout import StateLayout
from pdserve.transfer.dest import DestRank, TransferConfig
from pdserve.transfer.errors import (IntegrityError, LeaseExpired, PeerLost, TransferCancelled,
                                     TransferError)
from pdserve.transfer.nixl_agent import RankAgent
from pdserve.transfer.planner import conv_staging
from pdserve.transfer.regions import RegionTable
from pdserve.transfer.source import SourceRank

from state_fixtures import as_dtype, dest_side, make_state, source_side, write_rank
from test_transfer_plan import KIMI, TINY

pytest.importorskip("xxhash")


class Cluster:
    """p source ranks and d destination ranks, each with its own NIXL agent."""

    def __init__(self, shapes1, p, topo, src_layout, dst_layout=None, n=100, checkpoint=False,
                 config=TransferConfig(), gen=0, tag="", source=source_side):
        """`source`: builds the source ranks' pools and the manifest (`source_side`'s signature)."""
        dst_layout = dst_layout or src_layout
        self.state = as_dtype(make_state(shapes1, n, seed=3), src_layout)
        self.src_pools, self.manifest = source(shapes1, p, src_layout, self.state, n, checkpoint)
        staging = bool(conv_staging(self.manifest, topo, dst_layout))
        self.actual, self.expected, self.alloc = dest_side(shapes1, topo, dst_layout, n,
                                                           1 + checkpoint, staging)
        self.released = []
        self.src = [SourceRank(RankAgent(f"prefill{tag}", s, gen, RegionTable.of_pools(pl)),
                               release=self.released.append) for s, pl in enumerate(self.src_pools)]
        self.dst = [DestRank(RankAgent(f"decode{tag}", r, 0, RegionTable.of_pools(pl),
                                        progress_thread=False), pl, config)
                    for r, pl in enumerate(self.actual)]
        for d in self.dst:
            for s in self.src:
                d.agent.connect(s.agent.info())
                s.agent.connect(d.agent.info())
        for s in self.src:
            s.hold(self.manifest.request_id, lease_s=30)
        self.topo, self.n = topo, n

    def digests(self, src_rank, runs):
        return self.src[src_rank].digests(self.manifest.request_id, runs)

    def receive_all(self):
        return [d.receive(self.manifest, self.alloc, self.src[0].agent.instance, self.digests)
                for d in self.dst]

    def check_exact(self):
        for r, d in enumerate(self.dst):
            write_rank(self.expected[r], self.state, self.topo, r,
                       BlockTable([self.alloc.latent_pages[r]], self.alloc.slots[r][0], [], self.n),
                       self.alloc.slots[r])
            for kind, t in self.actual[r].regions().items():
                if kind != "kda_conv_staging":
                    assert torch.equal(t, self.expected[r].regions()[kind]), (kind, r)

    def close(self):
        for x in self.src + self.dst:
            x.agent.close()


CASES = [(TINY, 1, Topology(1)), (TINY, 2, Topology(1)), (TINY, 1, Topology(2)),
         (TINY, 2, Topology(4, 4, 16)), (KIMI, 4, Topology(2, 2, 64)), (KIMI, 1, Topology(8))]


@pytest.mark.parametrize("shapes,p,topo", CASES, ids=[f"p{c[1]}-d{c[2].tp}-c{c[2].dcp}" for c in CASES])
def test_nixl_reads_move_exact_bytes_and_free_the_source(shapes, p, topo):
    c = Cluster(shapes, p, topo, StateLayout(latent_dtype="float32"),
                config=TransferConfig(verify=True), tag=f"-{p}-{topo.tp}-{topo.dcp}")
    try:
        stats = c.receive_all()
        assert all(s["bytes"] > 0 and s["descriptors"] >= s["runs"] for s in stats)
        c.check_exact()
        events = [e for s in c.src for e in _poll_until(s, lambda ev: ev)]
        assert events == [("freed", "req-7")] * p  # every source rank freed after d "done"s
        assert c.released == ["req-7"] * p
        snap = c.dst[0].metrics.snapshot()
        assert snap.transfers == 1 and snap.bytes_by_kind["kda_recurrent"] > 0
    finally:
        c.close()


def test_conv_layout_conversion_and_checkpoints_over_nixl():
    c = Cluster(TINY, 2, Topology(1), StateLayout(conv_layout="SD"),
                dst_layout=StateLayout(conv_layout="DS"), checkpoint=True, tag="-conv")
    try:
        c.receive_all()
        c.check_exact()
        # staging slots were returned; the pre-test slot, running and checkpoint slots remain
        assert c.actual[0].slots.num_used == 3
    finally:
        c.close()


def test_one_corrupted_byte_is_an_integrity_error_and_frees_the_destination():
    c = Cluster(TINY, 1, Topology(1), StateLayout(), config=TransferConfig(verify=True), tag="-corrupt")
    try:
        pools = c.actual[0]
        used = (pools.latent.num_used, pools.slots.num_used)

        def corrupt_then_digest(src_rank, runs):
            reg = c.dst[0].agent.regions
            kind, layer, off, length = runs[len(runs) // 2]
            read = [r for r in c.alloc_reads() if (r.kind, r.layer, r.src_offset) == (kind, layer, off)][0]
            span = reg.span(reg.region_of(read, "dst"), layer, read.dst_offset + length // 2, 1)
            span ^= 0x10  # flip one bit of one byte where it landed
            return c.digests(src_rank, runs)

        from pdserve.transfer.planner import plan_transfer
        c.alloc_reads = lambda: plan_transfer(c.manifest, c.alloc).reads
        with pytest.raises(IntegrityError, match="differ from the source"):
            c.dst[0].receive(c.manifest, c.alloc, "prefill-corrupt", corrupt_then_digest)
        assert (pools.latent.num_used, pools.slots.num_used) == (used[0] - len(c.alloc.latent_pages[0]),
                                                                 used[1] - 1)
        assert c.dst[0].metrics.snapshot().failures == {"IntegrityError": 1}
        assert c.released == []  # the source keeps its state for a retry
    finally:
        c.close()


def test_lease_expiry_frees_the_source_and_digests_refuse_afterwards():
    now = [0.0]
    c = Cluster(TINY, 1, Topology(1), StateLayout(), tag="-lease")
    try:
        src = c.src[0]
        src.clock = lambda: now[0]
        src.hold("req-7", lease_s=5)
        now[0] = 3.0
        src.renew("req-7", lease_s=5)       # now expires at 8
        now[0] = 7.9
        assert src.poll() == []
        now[0] = 8.1
        assert src.poll() == [("expired", "req-7")]
        assert c.released == ["req-7"] and src.metrics.snapshot().lease_expiries == 1
        with pytest.raises(LeaseExpired, match="no live lease"):
            src.digests("req-7", [])
    finally:
        c.close()


def test_done_and_cancel_before_the_hold_free_the_state_when_it_is_held():
    """vLLM's worker learns of a finished request one engine step late: a real READ + "done"
    (over NIXL) or a cancel may come first, and must free the state once it is held."""
    c = Cluster(TINY, 1, Topology(1), StateLayout(), tag="-early")
    try:
        src, rid = c.src[0], c.manifest.request_id
        src.leases.clear()                      # as if the hold had not reached this rank yet
        c.receive_all()                         # the decode side reads and says "done"
        deadline = time.monotonic() + 5
        while rid not in src._early and time.monotonic() < deadline:
            assert src.poll() == []             # nothing held: nothing freed yet
            time.sleep(0.005)
        assert c.released == []
        src.hold(rid, lease_s=30)               # the hold arrives: freed at once
        assert c.released == [rid] and rid not in src.leases
        assert src.poll() == [("freed", rid)]
        src.cancel("later-0")                   # cancelled before its hold
        src.hold("later-0", lease_s=30)
        assert c.released == [rid, "later-0"] and src.poll() == [("cancelled", "later-0")]
        src.hold("later-1", lease_s=30)         # an ordinary hold is unaffected
        assert "later-1" in src.leases
    finally:
        c.close()


def test_restarted_source_evicts_the_stale_agent_and_new_transfers_work():
    c = Cluster(TINY, 1, Topology(1), StateLayout(latent_dtype="float32"), tag="-restart")
    try:
        old_info = c.src[0].agent.info()
        c.src[0].agent.close()
        # the restarted process registers fresh pools under the same instance name, generation 1
        reborn = Cluster(TINY, 1, Topology(1), StateLayout(latent_dtype="float32"), gen=1, tag="-restart")
        try:
            d = c.dst[0]
            d.agent.connect(reborn.src[0].agent.info())        # evicts generation 0
            assert d.agent.peer("prefill-restart", 0).generation == 1
            with pytest.raises(PeerLost, match="is stale"):
                d.agent.connect(old_info)
            reborn.src[0].agent.connect(d.agent.info())
            reborn.src[0].hold("req-7", 30)
            reborn.dst = [d]
            reborn.actual, reborn.alloc = c.actual, c.alloc
            reborn.expected = c.expected
            reborn.receive_all()
            reborn.check_exact()
        finally:
            reborn.close()
    finally:
        for x in c.dst:
            x.agent.close()


def test_cancel_before_completion_frees_both_sides():
    c = Cluster(KIMI, 1, Topology(1), StateLayout(), n=3000, tag="-cancel")
    try:
        ev = threading.Event()
        ev.set()
        pools = c.actual[0]
        with pytest.raises(TransferCancelled):
            c.dst[0].receive(c.manifest, c.alloc, "prefill-cancel", cancel=ev)
        assert pools.slots.num_used == 1 and pools.latent.num_used == 1  # only the pre-test junk
        c.dst[0].agent.notify("prefill-cancel", 0, b"cancel|req-7")
        assert _poll_until(c.src[0], lambda ev: ev) == [("cancelled", "req-7")]
        assert c.released == ["req-7"]
    finally:
        c.close()


def _poll_until(src, cond, timeout=5.0):
    import time
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        ev = src.poll()
        if cond(ev):
            return ev
        time.sleep(0.01)
    return []


def test_regions_too_large_to_prepare_use_per_request_lists(monkeypatch):
    """Past MAX_PREPARED entries (vLLM's whole cache in small units) a request's reads get their
    own descriptor list; the bytes land exactly as with prepared lists (here 2 -> 1 resharding)."""
    from pdserve.transfer import nixl_agent
    monkeypatch.setattr(nixl_agent, "MAX_PREPARED", 0)
    c = Cluster(TINY, 2, Topology(1), StateLayout(), tag="-perreq")
    try:
        stats = c.receive_all()
        assert stats[0]["descriptors"] == stats[0]["runs"]  # one entry per coalesced read
        assert not c.dst[0].agent._local_dlists          # nothing was prepared
        c.check_exact()
    finally:
        c.close()


def test_nixl_merges_index_runs_contiguous_on_both_sides():
    """RankAgent indexes unit-sized prepared entries and relies on NIXL to merge runs that are
    contiguous on both sides into one descriptor (one process_vm_readv on DRAM); a strided run
    stays one descriptor per entry. Real NIXL, telemetry on."""
    import numpy as np
    from pdserve.transfer.nixl_agent import load_nixl

    api = load_nixl()
    agent = api.nixl_agent("merge-check", api.nixl_agent_config(backends=["UCX"],
                                                                 capture_telemetry=True))
    unit, n = 4096, 64
    src = torch.arange(2 * n * unit, dtype=torch.int32).to(torch.uint8)
    dst = torch.zeros(n * unit, dtype=torch.uint8)
    reg = agent.register_memory([(src.data_ptr(), src.numel(), 0, ""),
                                 (dst.data_ptr(), dst.numel(), 0, "")], "DRAM")
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT",
                                  [(dst.data_ptr() + i * unit, unit, 0) for i in range(n)], "DRAM")
    remote = agent.prep_xfer_dlist("merge-check",
                                   [(src.data_ptr() + i * unit, unit, 0) for i in range(2 * n)],
                                   "DRAM")
    try:
        for step, expect_descs in ((1, 1), (2, n)):
            dst.zero_()
            idx = np.arange(n, dtype=np.int32)
            handle = agent.make_prepped_xfer("READ", local, idx, remote, idx * step)
            agent.transfer(handle)
            deadline = time.monotonic() + 10
            while agent.check_xfer_state(handle) == "PROC":
                assert time.monotonic() < deadline
                time.sleep(0.001)
            assert agent.get_xfer_telemetry(handle).descCount == expect_descs
            agent.release_xfer_handle(handle)
            want = src.view(2 * n, unit)[::step][:n].reshape(-1)
            assert torch.equal(dst, want)
    finally:
        agent.release_dlist_handle(local)
        agent.release_dlist_handle(remote)
        agent.deregister_memory(reg)


def test_split_runs_count_as_the_descriptors_nixl_posts():
    """post_reads takes a plan's table; rows that continue each other on both sides reach UCX
    as one descriptor (counted as NIXL merges them), and the bytes land exactly."""
    import numpy as np
    from pdserve.transfer.planner import COLUMNS, DOFF, KINDS, LAYER, LEN, SOFF, KIND, plan_transfer

    c = Cluster(TINY, 1, Topology(1), StateLayout(), tag="-split")
    try:
        d = c.dst[0]
        units = plan_transfer(c.manifest, c.alloc, ranks=[0]).units
        u = units["mla_latent"]
        # (src offset, dst offset) in units: two rows continuing each other, then one apart
        table = np.zeros((3, len(COLUMNS)), dtype=np.int64)
        table[:, KIND], table[:, LAYER], table[:, LEN] = KINDS.index("mla_latent"), 0, u
        table[:, SOFF] = np.array([4, 5, 9]) * u
        table[:, DOFF] = np.array([2, 3, 7]) * u
        posted, _, descriptors = d.agent.post_reads("prefill-split", table, units)
        d.agent.wait(posted, time.monotonic() + 10)
        assert descriptors == 2
        for so, do in ((4, 2), (5, 3), (9, 7)):
            got = d.agent.regions.span("mla_latent", 0, do * u, u)
            want = c.src[0].agent.regions.span("mla_latent", 0, so * u, u)
            assert torch.equal(got, want) and want.any()
    finally:
        c.close()


def test_registrations_merge_layers_of_one_kind_but_never_two_kinds():
    """Two pools can be adjacent in virtual memory yet be separate allocations; CUDA IPC maps
    only the allocation holding a registration's first byte, so a span across kinds broke every
    VRAM read on the H200 (cuMemcpyDtoDAsync: invalid argument)."""
    from pdserve.transfer.nixl_agent import _merge
    spans = {"mla_latent": [(1000, 100), (1100, 100)], "kda_recurrent": [(1200, 50), (1250, 50)],
             "kda_conv": [(5000, 10)]}
    assert _merge(spans) == [(1000, 200), (1200, 100), (5000, 10)]


def test_an_allocation_laid_out_for_another_pool_is_refused_and_freed():
    """The plan's offsets (pages, staging slot width, conv layout) are the allocation's: a
    destination whose pool is laid out otherwise refuses it instead of writing past its pool."""
    c = Cluster(TINY, 1, Topology(2), StateLayout(), tag="-layout")
    try:
        pools = c.actual[0]
        used = (pools.latent.num_used, pools.slots.num_used)
        wide = msgspec.structs.replace(c.alloc, layout=StateLayout(conv_staging_width=2))
        with pytest.raises(TransferError, match="not this rank's pool layout"):
            c.dst[0].receive(c.manifest, wide, "prefill-layout")
        assert (pools.latent.num_used, pools.slots.num_used) == (used[0] - len(c.alloc.latent_pages[0]),
                                                                 used[1] - 1)
    finally:
        c.close()
