import msgspec
import pytest
import torch

from pdserve.model.config import preset
from pdserve.state.block_table import BlockTable, Topology
from pdserve.state.layout import RankShapes, StateLayout, conv_from_sd, conv_to_sd
from pdserve.state.manifest import RegionSizes, StateManifest, build_manifest, model_fingerprint
from pdserve.state.pools import PoolExhausted, StatePools


def _pools(layout=StateLayout(), pages=8, slots=4, tp=1):
    return StatePools(RankShapes.of(preset("tiny"), tp), layout, pages, slots)


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
