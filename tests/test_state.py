import msgspec
import pytest
import torch

from pdserve.model.config import preset
from pdserve.state.block_table import BlockTable, Topology
from pdserve.state.layout import RankShapes, StateLayout, conv_from_sd, conv_to_sd
from pdserve.state.manifest import RegionSizes, StateManifest, build_manifest, model_fingerprint
from pdserve.state.pools import PoolExhausted, StatePools


def _pools(layout=StateLayout(), pages=8, slots=4, tp=1, decode_topology=None):
    return StatePools(RankShapes.of(preset("tiny"), tp), layout, pages, slots,
                      decode_topology=decode_topology)


def test_shapes_of_tiny_and_tp_sharding():
    s1, s2 = RankShapes.of(preset("tiny"), 1), RankShapes.of(preset("tiny"), 2)
    assert (s1.n_kda, s1.n_mla, s1.latent_width) == (3, 1, 80)
    assert s1.kda_heads == 2 * s2.kda_heads and s1.conv_channels == 2 * s2.conv_channels
    assert s1.conv_taps == 3


@pytest.mark.parametrize("layout", ["SD", "DS"])
def test_slot_pool_layouts_hold_the_same_state(layout):
    pools = _pools(StateLayout(conv_layout=layout, conv_dtype="float32"))
    sh = pools.shapes
    expect = (sh.n_kda, 4, sh.conv_taps, sh.conv_channels) if layout == "SD" else \
             (sh.n_kda, 4, sh.conv_channels, sh.conv_taps)
    assert tuple(pools.slots.conv.shape) == expect
    slot = pools.slots.allocate(1)[0]
    rec = torch.randn(sh.kda_heads, sh.head_dim, sh.head_dim)
    conv = torch.randn(sh.conv_taps, sh.conv_channels)
    pools.slots.write(1, slot, rec, conv)
    r, c = pools.slots.read(1, slot)
    assert torch.equal(r, rec) and torch.equal(c, conv)
    # the raw storage really is in the declared layout
    raw = pools.slots.conv[1, slot]
    assert torch.equal(raw, conv if layout == "SD" else conv.t())
    assert torch.equal(conv_to_sd(conv_from_sd(conv, layout), layout), conv)


def test_slot_zero_and_page_zero_are_never_handed_out_and_exhaustion_is_clean():
    pools = _pools(pages=4, slots=3)
    assert pools.latent.allocate(3) == [1, 2, 3]
    with pytest.raises(PoolExhausted, match="latent page pool exhausted"):
        pools.latent.allocate(1)
    assert pools.slots.allocate(2) == [1, 2]
    with pytest.raises(PoolExhausted, match="asked for 1, 0 of 2 free"):
        pools.slots.allocate(1)
    pools.latent.free([2])
    with pytest.raises(ValueError, match="double free"):
        pools.latent.free([2])
    assert pools.latent.allocate(1) == [2]


def test_allocated_slot_starts_from_zero_state():
    pools = _pools(StateLayout(conv_dtype="float32"))
    s = pools.slots.allocate(1)[0]
    pools.slots.recurrent[:, s] = 5.0
    pools.slots.conv[:, s] = 5.0
    pools.slots.free([s])
    assert pools.slots.allocate(1) == [s]
    assert pools.slots.recurrent[:, s].abs().sum() == 0 and pools.slots.conv[:, s].abs().sum() == 0


def test_latent_rows_span_pages_in_order():
    pools = _pools(StateLayout(page_tokens=4, latent_dtype="float32"))
    pages = pools.latent.allocate(3)[::-1]  # non-contiguous, reversed ids
    rows = torch.randn(10, pools.latent.width)
    pools.latent.write(0, pages, 0, rows[:7])
    pools.latent.write(0, pages, 7, rows[7:])
    assert torch.equal(pools.latent.read(0, pages, 10), rows)
    assert torch.equal(pools.latent.data[0, pages[1], 2], rows[6])
    with pytest.raises(IndexError, match="beyond the 3 pages"):
        pools.latent.write(0, pages, 12, rows[:1])


def test_fp8_latent_is_scaled():
    pools = _pools(StateLayout(latent_dtype="float8_e4m3fn"))
    pools.latent.scale = 0.5
    pages = pools.latent.allocate(1)
    rows = torch.tensor([[1.0, -2.0, 3.0] + [0.0] * (pools.latent.width - 3)])
    pools.latent.write(0, pages, 0, rows)
    assert pools.latent.data[0, pages[0], 0, :3].float().tolist() == [2.0, -4.0, 6.0]
    assert torch.equal(pools.latent.read(0, pages, 1), rows)


def test_dcp_token_placement():
    topo = Topology(tp=4, dcp=4, interleave=2)
    assert [topo.dcp_rank_of(t) for t in range(10)] == [0, 0, 1, 1, 2, 2, 3, 3, 0, 0]
    for n in (0, 1, 7, 8, 9, 17):
        counts = [topo.local_count(r, n) for r in range(4)]
        assert counts == [len(topo.tokens_on(r, n)) for r in range(4)] and sum(counts) == n
    with pytest.raises(ValueError, match="dcp must be 1 or tp=4"):
        Topology(tp=4, dcp=2)


def test_latent_pages_are_placed_dcp_rank_major_for_the_decode_topology():
    layout = StateLayout(page_tokens=16)
    # interleave 32 = two pages per DCP run: pages 0,1 -> rank 0, 2,3 -> rank 1, 4,5 -> rank 0...
    pools = _pools(layout, pages=32, decode_topology=Topology(2, 2, 32))
    assert pools.latent.allocate(7) == [1, 2, 5, 6, 3, 4, 7]  # rank 0: ids 1-4, rank 1: 5-7
    # the lowest free run that is long enough, above holes (2, 5) too short for it
    pools.latent.free([2, 5])
    assert pools.latent.allocate(3) == [8, 9, 10]
    assert pools.latent.allocate(5) == [11, 12, 14, 15, 13]
    assert pools.latent.allocate(1) == [2]
    # with 4 dcp ranks of one page each, page i goes to rank i % 4
    four = _pools(layout, pages=32, decode_topology=Topology(4, 4, 16))
    assert four.latent.allocate(6) == [1, 3, 5, 6, 2, 4]  # shares: ids 1-2, 3-4, 5, 6


def test_latent_placement_falls_back_to_plain_allocation():
    layout = StateLayout(page_tokens=16)
    for topo in (None, Topology(2), Topology(2, 2, 8), Topology(2, 2, 24)):
        # no hint, no DCP, an interleave that is not a whole number of pages: lowest ids first
        assert _pools(layout, pages=16, decode_topology=topo).latent.allocate(5) == [1, 2, 3, 4, 5]
    pools = _pools(layout, pages=12, decode_topology=Topology(2, 2, 16))
    held = pools.latent.allocate(11)
    pools.latent.free([i for i in held if i % 2])  # free: 1, 3, ..., 11, no two adjacent
    # fragmented: the lowest free ids, still DCP-rank-major (runs break only at the holes)
    assert pools.latent.allocate(5) == [1, 7, 3, 9, 5]
    with pytest.raises(PoolExhausted, match="asked for 2, 1 of 11 free"):
        pools.latent.allocate(2)
    assert pools.latent.num_free == 1 and pools.latent.allocate(1) == [11]


def test_manifest_round_trips_and_fingerprint_tracks_layout():
    cfg = preset("tiny")
    shapes, layout = RankShapes.of(cfg), StateLayout()
    table = BlockTable(latent_pages=[[3, 1]], kda_slot=2, checkpoints=[(64, 5)], num_tokens=70)
    m = build_manifest("r1", cfg, shapes, layout, table, Topology())
    back = StateManifest.decode(m.encode())
    assert back == m and back.block_table() == table
    assert msgspec.json.decode(msgspec.json.encode(m), type=StateManifest) == m
    assert m.sizes == RegionSizes(latent_page=64 * 80 * 2, recurrent_slot=4 * 32 * 32 * 4,
                                  conv_slot=3 * 3 * 128 * 2)
    assert model_fingerprint(cfg, layout) == m.fingerprint
    # layouts the planner converts are not part of the fingerprint; dtypes and the model are
    assert model_fingerprint(cfg, StateLayout(conv_layout="DS", page_tokens=16)) == m.fingerprint
    assert model_fingerprint(cfg, StateLayout(latent_dtype="float8_e4m3fn")) != m.fingerprint
    assert model_fingerprint(preset("tiny", rms_norm_eps=1e-5), layout) != m.fingerprint
