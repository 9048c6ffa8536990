"""Layer-level checks against direct float64 computations."""
import torch

from pdserve.model.config import preset
from pdserve.model.generate import build_model
from pdserve.model.mla import absorbed_attention
from pdserve.model.moe import route


def test_route_matches_a_direct_computation():
    g = torch.Generator().manual_seed(0)
    logits, bias = torch.randn(5, 16, generator=g), torch.randn(16, generator=g)
    w, ids = route(logits, bias, top_k=3, groups=4, topk_group=2, func="sigmoid",
                   renormalize=True, scaling=2.5)
    s = torch.sigmoid(logits.double())
    for t in range(5):
        choice = s[t] + bias.double()
        groups = choice.view(4, 4)
        gscore = groups.topk(2, dim=-1).values.sum(-1)
        best = set(gscore.topk(2).indices.tolist())
        allowed = [e for e in range(16) if e // 4 in best]
        top = sorted(allowed, key=lambda e: -choice[e])[:3]
        assert sorted(ids[t].tolist()) == sorted(top)
        ws = s[t, ids[t]]
        assert torch.allclose(w[t].double(), 2.5 * ws / ws.sum(), atol=1e-6)


def test_absorbed_equals_naive_mla():
    model = build_model(preset("tiny"), seed=3)
    mla = model.model.layers[2].self_attn
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 128, generator=g)
    rows = mla.latent(x).float()
    q = mla.query(x).float()
    naive = mla._naive(q[-1:], rows, context=5)
    absorbed = mla._absorbed(q[-1:], rows, context=5)
    assert torch.allclose(naive, absorbed, atol=1e-5)
    # the LSE is exact: recompute in float64
    w_uk, _ = mla.w_uk_uv()
    q_abs = torch.cat([torch.einsum("thn,hnr->thr", q[..., :32], w_uk), q[..., 32:]], -1)
    _, lse = absorbed_attention(q_abs, rows, 64, mla.scale)
    ref = torch.logsumexp(torch.einsum("thc,lc->thl", q_abs.double(), rows.double()) * mla.scale, -1)
    assert torch.allclose(lse.double(), ref, atol=1e-5)


def test_dense_moe_equals_sparse_moe():
    """The static-shape MoE (GPU decode steps, CUDA graphs) and the sparse one (everything else)
    compute the same sums: unchosen experts add exact zeros, chosen ones add in expert order;
    only the expert matmuls' row counts differ (fp32 rounding, ~1e-6 of values ~3)."""
    torch.manual_seed(0)
    model = build_model(preset("tiny"), seed=3)
    moe = next(layer.block_sparse_moe for layer in model.model.layers
               if hasattr(layer, "block_sparse_moe"))
    x = torch.randn(7, preset("tiny").hidden_size)
    dense, sparse = moe(x, dense=True), moe(x, dense=False)
    assert torch.allclose(dense, sparse, rtol=0, atol=1e-5), (dense - sparse).abs().max()
    assert not torch.equal(moe(x[:1], dense=False), moe(x[1:2], dense=False))  # it routes
