"""Planner correctness: for every supported topology pair, executing the plan (plain copies)
leaves each destination rank's pools exactly as a prefill in the destination topology would."""
import itertools

import msgspec
import pytest
import torch

from pdserve.model.config import preset
from pdserve.state.block_table import BlockTable, Topology
from pdserve.state.layout import RankShapes, StateLayout
from pdserve.transfer.arrival import finish_arrival
from pdserve.transfer.errors import IntegrityError, TopologyError
from pdserve.transfer.planner import DestAllocation, conv_staging, plan_transfer, whole_slot_width
from pdserve.transfer.regions import RegionTable, copy_reads

from state_fixtures import as_dtype, dest_side, make_state, source_side, write_rank

TINY = RankShapes.of(preset("tiny"))  # 4 KDA heads x 32, 4 MLA heads, 3 KDA + 1 MLA layers
# kimi-linear-48b-a3b head counts and widths (32 KDA heads x 128, 32 MLA heads, 576 latent),
# with 2 KDA + 1 MLA layers to keep the test small
KIMI = RankShapes(n_mla=1, n_kda=2, latent_width=576, kda_heads=32, head_dim=128, conv_taps=3,
                  tp=1, mla_heads=32)


def run_case(shapes1, p, d, c, interleave=1, src_layout=StateLayout(latent_dtype="float32"),
             dst_layout=None, n=150, checkpoint=False, damage=None, staging_width=1):
    dst_layout = msgspec.structs.replace(dst_layout or src_layout, conv_staging_width=staging_width)
    state = as_dtype(make_state(shapes1, n, seed=p * 100 + d * 10 + c), src_layout)
    if damage:
        damage(state)
    src_pools, manifest = source_side(shapes1, p, src_layout, state, n, checkpoint)
    topo = Topology(tp=d, dcp=c, interleave=interleave)
    staging = bool(conv_staging(manifest, topo, dst_layout))
    actual, expected, alloc = dest_side(shapes1, topo, dst_layout, n, 1 + checkpoint, staging)
    plan = plan_transfer(manifest, alloc)
    copy_reads(plan.reads, [RegionTable.of_pools(x) for x in src_pools],
               [RegionTable.of_pools(x) for x in actual])
    for r in range(d):
        finish_arrival(actual[r], manifest, alloc, plan, r)
        write_rank(expected[r], state, topo, r,
                   BlockTable([alloc.latent_pages[r]], alloc.slots[r][0], [], n), alloc.slots[r])
        for kind, t in actual[r].regions().items():
            if kind != "kda_conv_staging":
                assert torch.equal(t, expected[r].regions()[kind]), (kind, r)
    return plan, manifest


TOPOLOGIES = [(sh, p, d, c) for sh, heads in (("tiny", (1, 2, 4)), ("kimi", (1, 2, 4, 8)))
              for p, d in itertools.product(heads, heads) for c in sorted({1, d})]


@pytest.mark.parametrize("wide", [False, True], ids=["staging1", "staging-d/p"])
@pytest.mark.parametrize("shapes,p,d,c", TOPOLOGIES, ids=[f"{s}-p{p}-d{d}-c{c}" for s, p, d, c in TOPOLOGIES])
def test_every_topology_moves_exact_bytes(shapes, p, d, c, wide):
    """With a d/p wide conv staging slot (as `pdserve serve` sets it) conv moves as whole
    source slots whenever p != d; with the default width only when p > d."""
    plan, m = run_case(TINY if shapes == "tiny" else KIMI, p, d, c, interleave=16 if c > 1 else 1,
                       staging_width=max(1, d // p) if wide else 1)
    conv = [r for r in plan.reads if r.kind == "kda_conv"]
    assert all(r.staged == (p > d or (wide and p < d)) for r in conv)
    # MLA is read once per destination rank, spread over source replicas
    srcs = {(r.dst_rank, r.src_rank) for r in plan.reads if r.kind == "mla_latent"}
    assert srcs == {(r, r % p) for r in range(d)}


@pytest.mark.parametrize("src_conv,dst_conv", [("SD", "DS"), ("DS", "SD"), ("DS", "DS")])
@pytest.mark.parametrize("p,d", [(1, 2), (4, 1), (2, 2)])
def test_conv_layouts_are_converted_on_arrival(src_conv, dst_conv, p, d):
    src = StateLayout(latent_dtype="float32", conv_layout=src_conv)
    dst = StateLayout(latent_dtype="float32", conv_layout=dst_conv)
    run_case(TINY, p, d, 1, src_layout=src, dst_layout=dst, checkpoint=True)


@pytest.mark.parametrize("src_pt,dst_pt,interleave", [(16, 64, 1), (64, 16, 8), (32, 32, 64), (16, 16, 1)])
def test_page_sizes_and_interleaves(src_pt, dst_pt, interleave):
    src = StateLayout(page_tokens=src_pt)
    dst = StateLayout(page_tokens=dst_pt)
    run_case(TINY, 2, 4, 4, interleave=interleave, src_layout=src, dst_layout=dst, n=133)
    run_case(TINY, 2, 1, 1, src_layout=src, dst_layout=dst, n=1)


@pytest.mark.parametrize("src_conv,dst_conv", [("SD", "SD"), ("DS", "SD"), ("SD", "DS")])
def test_p_above_d_reads_whole_source_conv_slots_into_staging(src_conv, dst_conv):
    plan, m = run_case(KIMI, 4, 2, 1, checkpoint=True,
                       src_layout=StateLayout(latent_dtype="float32", conv_layout=src_conv),
                       dst_layout=StateLayout(latent_dtype="float32", conv_layout=dst_conv))
    conv = [r for r in plan.reads if r.kind == "kda_conv"]
    # per destination rank, KDA layer and moved slot (running + checkpoint): one read of each
    # of its two source ranks' whole slot (instead of one per tap or section)
    assert len(conv) == 2 * KIMI.n_kda * 2 * 2
    assert all(r.staged and r.length == m.sizes.conv_slot for r in conv)
    assert {(r.dst_rank, r.src_rank) for r in conv} == {(0, 0), (0, 1), (1, 2), (1, 3)}


@pytest.mark.parametrize("src_conv,dst_conv", [("SD", "SD"), ("DS", "SD"), ("SD", "DS")])
def test_p_below_d_reads_whole_source_conv_slots_into_wide_staging(src_conv, dst_conv):
    plan, m = run_case(KIMI, 1, 4, 4, interleave=64, checkpoint=True, staging_width=4,
                       src_layout=StateLayout(latent_dtype="float32", conv_layout=src_conv),
                       dst_layout=StateLayout(latent_dtype="float32", conv_layout=dst_conv))
    conv = [r for r in plan.reads if r.kind == "kda_conv"]
    # per destination rank and KDA layer: one read of the source's whole running and checkpoint
    # slots (adjacent on both sides: one run), instead of one per section (and tap, SD)
    assert len(conv) == 4 * KIMI.n_kda
    assert all(r.staged and r.length == 2 * m.sizes.conv_slot and r.src_rank == 0 for r in conv)
    narrow, _ = run_case(KIMI, 1, 4, 4, interleave=64, checkpoint=True, staging_width=2)
    assert sum(r.kind == "kda_conv" for r in narrow.reads) > len(conv)


def test_whole_slot_width_is_the_widest_overlap_in_destination_conv_channels():
    assert [whole_slot_width(KIMI, p, d) for p, d in ((1, 2), (1, 4), (2, 8), (2, 1), (8, 2))] == \
        [2, 4, 4, 1, 1]
    six = msgspec.structs.replace(KIMI, kda_heads=6)  # TPs that do not divide each other
    # d=3 rank 1 (heads 2-3) overlaps both p=2 sources (3 heads each): 2 x 9 / 6 channels -> 3
    assert whole_slot_width(six, 2, 3) == 3
    # d=2 rank 0 (heads 0-2) overlaps two p=3 sources (2 heads each): 2 x 6 / 9 -> 2
    assert whole_slot_width(six, 3, 2) == 2


@pytest.mark.parametrize("p,d", [(2, 3), (3, 2), (3, 6)])
def test_tps_that_do_not_divide_each_other_take_whole_slots_when_wide_enough(p, d):
    six = msgspec.structs.replace(TINY, kda_heads=6, mla_heads=6)
    plan, _ = run_case(six, p, d, 1, staging_width=whole_slot_width(six, p, d), checkpoint=True)
    assert all(r.staged for r in plan.reads if r.kind == "kda_conv")


def test_checkpoints_move_with_the_running_slot_and_runs_coalesce():
    plan, m = run_case(TINY, 2, 2, 1, checkpoint=True)
    # p = d: the running and checkpoint slots are adjacent ids on both sides, so each rank's
    # (layer) recurrent reads coalesce into one run of two slots
    rec = [r for r in plan.reads if r.kind == "kda_recurrent"]
    assert len(rec) == 2 * TINY.n_kda and all(r.length == 2 * 2 * 32 * 32 * 4 for r in rec)
    assert plan.bytes_by_kind["kda_recurrent"] == 2 * TINY.n_kda * 4 * 32 * 32 * 4  # 2 slots


def test_impossible_topologies_are_rejected_with_the_numbers():
    state = make_state(TINY, 10, 0)
    _, m = source_side(TINY, 2, StateLayout(), state, 10, False)
    alloc = DestAllocation(Topology(tp=3), StateLayout(), [[1]] * 3, [[1]] * 3)
    with pytest.raises(TopologyError, match=r"p=2 -> destination TP d=3, DCP c=1 \(KDA heads=4, MLA heads=4\).*not divisible by d=3"):
        plan_transfer(m, alloc)
    alloc = DestAllocation(Topology(tp=8), StateLayout(), [[1]] * 8, [[1]] * 8)
    with pytest.raises(TopologyError, match="KDA heads 4 are not divisible by d=8"):
        plan_transfer(m, alloc)
    alloc = DestAllocation(Topology(tp=2), StateLayout(latent_dtype="float8_e4m3fn"), [[1]] * 2, [[1]] * 2)
    with pytest.raises(TopologyError, match="latent_dtype"):
        plan_transfer(m, alloc)


def test_zeroed_kda_state_is_refused():
    def lose_layer_1(state):  # layer 1 lost its state upstream
        state.recurrent[1] = 0
    with pytest.raises(IntegrityError, match=r"zeroed KDA recurrent state in KDA layers \[1\] after 20 tokens"):
        run_case(TINY, 1, 1, 1, n=20, damage=lose_layer_1)


def test_zeroed_layers_scans_in_full_when_the_probe_is_zero():
    from pdserve.transfer.arrival import zeroed_layers
    state = torch.zeros(3, 4, 128, 128)
    state[0, 3, 127, 127] = 1e-30  # zero probe, nonzero later: live
    state[2] = torch.randn(4, 128, 128)
    assert zeroed_layers(state) == [1]
    assert zeroed_layers(state, probe=10**9) == [1]


# -- strided sources (vLLM's hybrid allocator pads KDA pages and shares buffers) ------------------
def strided_tables(pools, pads: dict[str, int], shift: int):
    """The state of `pools` re-laid like vLLM's cache: every page/slot followed by `pads[kind]`
    bytes of garbage, and KDA layer l's slots moved up by l * shift. Returns the region table."""
    g = torch.Generator().manual_seed(7)
    layers = {}
    for kind, t in pools.regions().items():
        if kind == "kda_conv_staging":
            continue
        unit = t[0, 0].numel() * t.element_size()
        stride = unit + pads[kind]
        views = []
        for layer in range(t.shape[0]):
            moved = layer * shift if kind != "mla_latent" else 0
            n = t.shape[1] + moved
            buf = torch.randint(0, 256, (n * stride,), dtype=torch.uint8, generator=g)
            for i in range(t.shape[1]):
                at = (i + moved) * stride
                buf[at:at + unit] = t[layer, i].contiguous().view(-1).view(torch.uint8)
            views.append(buf[:(n - 1) * stride + unit])  # region ends with the last slot's bytes
        layers[kind] = views
    return RegionTable(layers)


@pytest.mark.parametrize("p,d,c", [(1, 1, 1), (1, 2, 2), (2, 1, 1), (4, 2, 1)])
@pytest.mark.parametrize("conv", ["SD", "DS"])
def test_strided_source_with_per_layer_slots_moves_the_same_bytes(p, d, c, conv):
    import msgspec

    from pdserve.state.manifest import SourceStrides

    layout = StateLayout(latent_dtype="float32", conv_layout=conv, page_tokens=16)
    n, shift = 77, 2
    state = as_dtype(make_state(TINY, n, seed=5), layout)
    src_pools, dense = source_side(TINY, p, layout, state, n, False)
    sizes = dense.sizes
    # pads that are not multiples of the dense units: the planner must shrink its units
    pads = {"mla_latent": 3 * TINY.latent_width * 4, "kda_recurrent": 1536, "kda_conv": 192}
    strided = msgspec.structs.replace(
        dense, strides=SourceStrides(sizes.latent_page + pads["mla_latent"],
                                     sizes.recurrent_slot + pads["kda_recurrent"],
                                     sizes.conv_slot + pads["kda_conv"]),
        kda_layer_slots=[dense.kda_slot + layer * shift for layer in range(TINY.n_kda)])
    topo = Topology(tp=d, dcp=c, interleave=8 if c > 1 else 1)
    staging = bool(conv_staging(dense, topo, layout))
    actual, expected, alloc = dest_side(TINY, topo, layout, n, 1, staging)
    reference, _, _ = dest_side(TINY, topo, layout, n, 1, staging)
    plan = plan_transfer(strided, alloc)
    assert plan.units["kda_recurrent"] < plan_transfer(dense, alloc).units["kda_recurrent"]
    copy_reads(plan.reads, [strided_tables(x, pads, shift) for x in src_pools],
               [RegionTable.of_pools(x) for x in actual])
    # the dense source through the unchanged planner is the reference
    copy_reads(plan_transfer(dense, alloc).reads, [RegionTable.of_pools(x) for x in src_pools],
               [RegionTable.of_pools(x) for x in reference])
    for r in range(d):
        finish_arrival(actual[r], strided, alloc, plan, r)
        finish_arrival(reference[r], dense, alloc, plan_transfer(dense, alloc), r)
        write_rank(expected[r], state, topo, r,
                   BlockTable([alloc.latent_pages[r]], alloc.slots[r][0], [], n), alloc.slots[r])
        for kind, t in actual[r].regions().items():
            if kind != "kda_conv_staging":
                assert torch.equal(t, expected[r].regions()[kind]), (kind, r)
                assert torch.equal(t, reference[r].regions()[kind]), (kind, r)


def test_latent_stride_must_hold_whole_rows():
    import msgspec

    from pdserve.state.manifest import SourceStrides

    layout = StateLayout(latent_dtype="float32")
    state = as_dtype(make_state(TINY, 10, seed=1), layout)
    _, dense = source_side(TINY, 1, layout, state, 10, False)
    bad = msgspec.structs.replace(dense, strides=SourceStrides(dense.sizes.latent_page + 2, 1, 1))
    _, _, alloc = dest_side(TINY, Topology(), layout, 10, 1, False)
    with pytest.raises(TopologyError, match="whole number"):
        plan_transfer(bad, alloc)


def test_manifest_with_strides_round_trips_and_dense_default_is_unchanged():
    import msgspec

    from pdserve.state.manifest import SourceStrides, StateManifest

    layout = StateLayout(latent_dtype="float32")
    state = as_dtype(make_state(TINY, 10, seed=1), layout)
    _, dense = source_side(TINY, 1, layout, state, 10, False)
    assert dense.strides is None and dense.kda_layer_slots is None
    s = dense.sizes
    assert dense.source_strides() == SourceStrides(s.latent_page, s.recurrent_slot, s.conv_slot)
    m = msgspec.structs.replace(dense, strides=SourceStrides(9 * 4, 5, 6), kda_layer_slots=[1, 2, 3])
    assert StateManifest.decode(m.encode()) == m
    with pytest.raises(ValueError, match="3 KDA layers"):
        msgspec.structs.replace(dense, kda_layer_slots=[1])


def test_plan_table_and_reads_agree_and_dcp_pages_are_one_read_each():
    """The vectorized latent plan: with interleave = page size each DCP rank's pages are every
    other source page (one read each, per MLA layer); `reads` are the table's rows."""
    from pdserve.transfer.planner import as_table

    plan, manifest = run_case(KIMI, 1, 2, 2, interleave=64, n=64 * 7 + 5)
    latent = [r for r in plan.reads if r.kind == "mla_latent"]
    assert len(latent) == 8 * KIMI.n_mla  # 8 pages in all: 4 per rank, none coalesce
    for r in (0, 1):
        mine = sorted(x.src_offset for x in latent if x.dst_rank == r)
        pages = [manifest.latent_pages[0][t // 64] for t in range(64 * r, 64 * 8, 128)]
        stride = manifest.source_strides().latent_page
        assert mine == sorted(p * stride for p in pages)
    assert (as_table(plan.reads) == plan.table).all()
    assert plan.bytes_by_kind["mla_latent"] == sum(r.length for r in latent)
