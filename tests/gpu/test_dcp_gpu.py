"""DCP with the CuTe DSL MLA decode kernel (H200, sm_90a), in one process: each DCP rank's
partial attention over its shard of the latent (token t on rank (t // interleave) % c), with the
LSE the kernel returns, merged by `merge_partials`, equals the single-rank result.

- kernel level: the kernel over each rank's pages (local token order, a rank holding none of a
  request runs one padding row and gets LSE -inf, as `MLAAttention._partial` does) against the
  kernel over the whole cache and the fp32 reference;
- model level: `MLAAttention._partial` with the runtime's `mla_step_for("cutedsl")` on per-rank
  `LatentPool`s and `DCPDecodeBatch`es (what a DCP decode rank runs, less the collectives),
  each against the torch partial of the same bf16 query, merged and through W_UV,
  against `MLAAttention._fused_decode` over the DCP 1 pool.
"""
import pytest
import torch

from pdserve.model.mla import merge_partials
from pdserve.state.block_table import Topology

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SCALE = 192 ** -0.5
PAGE = 64
LENS = [1, 77, 300, 1000, 64]   # one token, partial pages, several pages, one page exactly


def _close(got, want, rel=2e-2):
    err = (got.float() - want.float()).abs().max().item()
    assert err <= rel * want.float().abs().max().item() + 1e-3, err


def _shard_tables(lens, topo: Topology, r: int, pages_of, page_tokens=PAGE):
    """Rank r's block table [B, max_pages] int32 and local lengths over its own page ids
    (`pages_of(b, n)` hands out n fresh page ids for request b)."""
    local = [topo.local_count(r, n) for n in lens]
    n_pages = [max(-(-n // page_tokens), 1) for n in local]
    bt = torch.zeros(len(lens), max(n_pages), dtype=torch.int32)
    for b, n in enumerate(n_pages):
        bt[b, :n] = torch.tensor(pages_of(b, n), dtype=torch.int32)
    return bt, local


@pytest.mark.parametrize("c,interleave", [(2, 1), (4, 1), (2, 64), (4, 128)])
def test_kernel_partials_over_dcp_shards_merge_to_the_single_rank_result(c, interleave):
    from pdserve.kernels import registry
    from pdserve.kernels.mla_decode import OP, mla_decode_reference, problem_from_tensors
    dev, H = "cuda", 16
    g = torch.Generator(device=dev).manual_seed(c * 1000 + interleave)
    topo = Topology(c, c, interleave)
    B = len(LENS)
    rows = [torch.randn(n, 576, device=dev, generator=g).to(torch.bfloat16) for n in LENS]
    q = torch.randn(B, H, 576, device=dev, generator=g).to(torch.bfloat16)

    def cache_for(per_request_rows):
        """A cache holding each request's rows in order from page 1 (page 0 padding, NaN)."""
        n_pages = [max(-(-len(x) // PAGE), 1) for x in per_request_rows]
        cache = torch.full((1 + sum(n_pages), PAGE, 576), float("nan"), device=dev,
                           dtype=torch.bfloat16)
        bt = torch.zeros(B, max(n_pages), dtype=torch.int32, device=dev)
        k = 1
        for b, (x, n) in enumerate(zip(per_request_rows, n_pages)):
            bt[b, :n] = torch.arange(k, k + n, dtype=torch.int32)
            flat = cache[k:k + n].view(-1, 576)
            flat[:len(x)] = x
            flat[len(x):] = 0  # unwritten rows of a page are zero in a pool
            k += n
        return cache, bt

    impl = registry.resolve(OP, "cutedsl", problem_from_tensors(q, rows[0][None, None])).impl
    cache, bt = cache_for(rows)
    lens = torch.tensor(LENS, dtype=torch.int32, device=dev)
    want, want_lse = impl(q, cache, bt, lens, SCALE)
    ref, ref_lse = mla_decode_reference(q, cache, bt, lens, SCALE)
    outs, lses = [], []
    for r in range(c):
        mine = [x[torch.tensor(topo.tokens_on(r, len(x)), dtype=torch.long, device=dev)]
                for x in rows]
        cache_r, bt_r = cache_for(mine)
        local = torch.tensor([len(x) for x in mine], device=dev)
        out, lse = impl(q, cache_r, bt_r, local.clamp(min=1).to(torch.int32), SCALE)
        outs.append(out.float())
        lses.append(torch.where((local == 0)[:, None], float("-inf"), lse))
    got = merge_partials(torch.stack(outs), torch.stack(lses))
    assert torch.isfinite(got).all()
    _close(got, want)
    _close(got, ref)
    merged_lse = torch.logsumexp(torch.stack(lses), dim=0)
    assert torch.allclose(merged_lse, want_lse, atol=2e-3), (merged_lse - want_lse).abs().max()
    assert torch.allclose(merged_lse, ref_lse, atol=2e-3)


@pytest.mark.parametrize("c,interleave", [(2, 1), (4, 64)])
def test_mla_partials_with_the_runtime_kernel_merge_to_the_dcp1_decode(c, interleave):
    from pdserve.decode.rank import mla_step_for
    from pdserve.model.batch import DecodeBatch
    from pdserve.model.config import reduced_kimi_linear
    from pdserve.model.dcp import DCPDecodeBatch
    from pdserve.model.generate import build_model
    from pdserve.model.parallel import DCPGroup
    from pdserve.state.block_table import BlockTable
    from pdserve.state.layout import RankShapes, StateLayout
    from pdserve.state.pools import StatePools

    dev = "cuda"
    config = reduced_kimi_linear(2, 4, 2, vocab_size=512)   # kv_lora 512 + rope 64, 32 heads
    model = build_model(config, dtype=torch.bfloat16, seed=3).to(dev)
    layer = config.mla_layer_ids[0]
    attn = model.model.layers[layer].self_attn
    step = mla_step_for("cutedsl")
    layout = StateLayout(page_tokens=PAGE, latent_dtype="bfloat16")
    shapes = RankShapes.of(config)
    topo = Topology(c, c, interleave)
    g = torch.Generator(device=dev).manual_seed(c)
    B = len(LENS)
    rows = [torch.randn(n, 576, device=dev, generator=g) for n in LENS]
    q = torch.randn(B, attn.heads, attn.nope + attn.rope, device=dev, generator=g)

    def filled(per_request_rows):
        pools = StatePools(shapes, layout, 1 + sum(-(-max(len(x), 1) // PAGE) + 1
                                                   for x in per_request_rows), 4, device=dev)
        tables = []
        for b, x in enumerate(per_request_rows):
            pages = pools.latent.allocate(max(-(-len(x) // PAGE), 1))
            if len(x):
                pools.latent.write(0, pages, 0, x)
            tables.append(BlockTable([pages], b + 1, [], 0))
        return pools, tables

    pools1, tables1 = filled(rows)
    for t, n in zip(tables1, LENS):
        t.num_tokens = n - 1   # the step's new token is the last row, already stored
    want = attn._fused_decode(q, pools1.latent, 0, DecodeBatch.of(tables1, PAGE, dev), step)
    assert want is not None, "the cutedsl kernel declined the DCP 1 step"
    w_uk, w_uv = attn.w_uk_uv()
    q_abs = attn._absorb(q, w_uk)
    # The kernel takes a bf16 query (`_partial` rounds q_abs for it), so the torch partial
    # it is checked against gets the same rounded query. Against the fp32 query the LSEs
    # differ by that rounding, not by the kernel: on a one-token shard the LSE is that
    # token's score, moved by up to ~5e-3 here. The merge is unaffected, since each rank's
    # (out, lse) pair is of the same rounded query, as is the DCP 1 decode's.
    q_kernel = q_abs.to(torch.bfloat16).float()
    parts = []
    for r in range(c):
        mine = [x[torch.tensor(topo.tokens_on(r, len(x)), dtype=torch.long, device=dev)]
                for x in rows]
        pools_r, tables_r = filled(mine)
        for t, n in zip(tables_r, LENS):
            t.num_tokens = n - 1
        batch = DCPDecodeBatch.of(tables_r, DCPGroup(r, topo), PAGE, dev)
        assert batch.local_len.tolist() == [len(x) for x in mine]
        lat, lse = attn._partial(q_abs, pools_r.latent, 0, batch, step)
        ref_lat, ref_lse = attn._partial(q_kernel, pools_r.latent, 0, batch, None)  # torch
        live = batch.local_len > 0
        _close(lat[live], ref_lat[live])
        # the kernel-level test's LSE tolerance: fp32 sums of the same bf16 products
        assert torch.allclose(lse[live], ref_lse[live], atol=2e-3), \
            (lse[live] - ref_lse[live]).abs().max()
        parts.append((lat, lse))
    merged = merge_partials(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    got = torch.einsum("bhr,hvr->bhv", merged, w_uv)
    _close(got, want)
