"""Planner correctness: for every supported topology pair, executing the plan (plain copies)
leaves each destination rank's pools exactly as a prefill in the destination topology would."""
import itertools

import pytest
import torch

from pdserve.model.config import preset
from pdserve.state.block_table import BlockTable, Topology
from pdserve.state.layout import RankShapes, StateLayout
from pdserve.transfer.arrival import finish_arrival
from pdserve.transfer.errors import IntegrityError, TopologyError
from pdserve.transfer.planner import DestAllocation, plan_transfer
from pdserve.transfer.regions import RegionTable, copy_reads

from state_fixtures import as_dtype, dest_side, make_state, source_side, write_rank

TINY = RankShapes.of(preset("tiny"))  # 4 KDA heads x 32, 4 MLA heads, 3 KDA + 1 MLA layers
# kimi-linear-48b-a3b head counts and widths (32 KDA heads x 128, 32 MLA heads, 576 latent),
# with 2 KDA + 1 MLA layers to keep the test small
KIMI = RankShapes(n_mla=1, n_kda=2, latent_width=576, kda_heads=32, head_dim=128, conv_taps=3,
                  tp=1, mla_heads=32)


def run_case(shapes1, p, d, c, interleave=1, src_layout=StateLayout(latent_dtype="float32"),
             dst_layout=None, n=150, checkpoint=False, damage=None):
    dst_layout = dst_layout or src_layout
    state = as_dtype(make_state(shapes1, n, seed=p * 100 + d * 10 + c), src_layout)
    if damage:
        damage(state)
    src_pools, manifest = source_side(shapes1, p, src_layout, state, n, checkpoint)
    topo = Topology(tp=d, dcp=c, interleave=interleave)
    staging = src_layout.conv_layout != dst_layout.conv_layout
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


@pytest.mark.parametrize("shapes,p,d,c", TOPOLOGIES, ids=[f"{s}-p{p}-d{d}-c{c}" for s, p, d, c in TOPOLOGIES])
def test_every_topology_moves_exact_bytes(shapes, p, d, c):
    plan, m = run_case(TINY if shapes == "tiny" else KIMI, p, d, c, interleave=16 if c > 1 else 1)
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
