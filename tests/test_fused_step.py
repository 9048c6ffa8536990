"""The fused decode step (pdserve.decode.fused_step) and its new ops' torch references, on the
CPU: every op's reference checked on its contract, and the whole fused step (reference ops)
against the model's own decode path over several steps of state."""
import pytest
import torch

from pdserve.decode.fused_step import FusedDecodeStep
from pdserve.kernels.moe_route import moe_route_reference
from pdserve.kernels.rmsnorm import add_rmsnorm_reference
from pdserve.model.batch import DecodeBatch
from pdserve.model.config import preset, reduced_kimi_linear
from pdserve.model.generate import ReferenceEngine, build_model
from pdserve.model.model import NotSupportedYet
from pdserve.model.moe import route
from pdserve.model.norms import rms_norm
from pdserve.model.sampling import Request, SamplingParams
from pdserve.state.layout import StateLayout


def _route(B, E, k, shared, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, E, generator=g)
    b = 0.1 * torch.randn(E, generator=g) if bias else None
    S = k + shared
    outs = (torch.empty(B * S, dtype=torch.int32), torch.empty(B * S),
            torch.empty(B, S, dtype=torch.int32), torch.empty(E + shared, dtype=torch.int32))
    moe_route_reference(logits, b, k, 1, 1, "sigmoid", True, 2.5, shared, *outs)
    return logits, b, outs


@pytest.mark.parametrize("B,E,k,shared", [(1, 8, 2, 1), (5, 32, 4, 1), (16, 256, 8, 0)])
def test_route_layout(B, E, k, shared):
    logits, bias, (pt, pw, tp, ge) = _route(B, E, k, shared)
    weights, ids = route(logits, bias, k, 1, 1, "sigmoid", True, 2.5)
    S = k + shared
    if shared:
        ids = torch.cat([ids, torch.full((B, 1), E)], 1)
        weights = torch.cat([weights, torch.ones(B, 1)], 1)
    # each token's slot s points at a pair of that token, expert and weight
    for t in range(B):
        for s in range(S):
            p = tp[t, s].item()
            assert pt[p].item() == t and pw[p].item() == pytest.approx(weights[t, s].item())
            g = int((ge <= p).sum())                       # the group holding pair p
            assert g == ids[t, s].item()
    # pairs ordered by (expert, token); groups' ends count them
    gid = torch.bucketize(torch.arange(B * S), ge.long(), right=True)
    key = gid * B + pt.long()
    assert (key[1:] > key[:-1]).all()
    assert ge[-1].item() == B * S
    assert sorted(tp.flatten().tolist()) == list(range(B * S))


def test_add_rmsnorm_pairs_combine():
    g = torch.Generator().manual_seed(1)
    B, D, S = 3, 64, 3
    res = torch.randn(B, D, generator=g).bfloat16()
    rows = torch.randn(B * S, D, generator=g).bfloat16()
    tp = torch.randperm(B * S, generator=g).view(B, S).int()
    pw = torch.rand(B * S, generator=g)
    w = (1 + 0.1 * torch.randn(D, generator=g)).bfloat16()
    out, r_out = torch.empty_like(res), torch.empty_like(res)
    add_rmsnorm_reference(res, rows, w, 1e-6, out, r_out, tp, pw)
    d = sum(rows[tp[:, s].long()].float() * pw[tp[:, s].long()][:, None] for s in range(S))
    r = res + d.bfloat16()
    assert torch.equal(r_out, r)
    assert torch.equal(out, rms_norm(r, w, 1e-6))
    add_rmsnorm_reference(res, None, w, 1e-6, out)
    assert torch.equal(out, rms_norm(res, w, 1e-6))


def _prefilled(config, prompts, seed=3):
    torch.manual_seed(0)
    model = build_model(config, dtype=torch.bfloat16, seed=seed)
    layout = StateLayout(latent_dtype="bfloat16", conv_dtype="bfloat16")
    eng = ReferenceEngine(model, layout, num_pages=64, num_slots=8)
    seqs = [eng.admit(Request(f"r{i}", p, SamplingParams(max_tokens=16)))
            for i, p in enumerate(prompts)]
    eng.prefill(seqs)
    return model, eng, seqs


def _run_steps(step, eng, seqs, steps):
    tables = [s.table for s in seqs]
    tokens = [s.output[-1] for s in seqs]
    start = [t.num_tokens for t in tables]
    got = []
    for _ in range(steps):
        batch = DecodeBatch.of(tables, eng.pools.latent.page_tokens, "cpu", rows=len(tables) + 1)
        ids = torch.tensor(tokens + [0])
        logits = step(ids, batch)[:len(tables)]
        got.append(logits)
        tokens = logits.argmax(-1).tolist()
        for t in tables:
            t.num_tokens += 1
    for t, n in zip(tables, start):
        t.num_tokens = n
    return got


@pytest.mark.parametrize("config", [preset("tiny", kv_lora_rank=512, qk_rope_head_dim=64),
                                    reduced_kimi_linear(4, num_experts=16, top_k=4,
                                                        vocab_size=512)],
                         ids=["tiny", "reduced-kimi-linear"])
def test_fused_step_equals_the_model(config):
    prompts = [list(range(1, 20)), list(range(40, 110))]   # the second spans two pages
    model, eng, seqs = _prefilled(config, prompts)
    pools = eng.pools
    saved = [t.clone() for t in (pools.latent.data, pools.slots.recurrent, pools.slots.conv)]
    want = _run_steps(lambda ids, b: model(ids, b, pools), eng, seqs, 6)
    for t, s in zip((pools.latent.data, pools.slots.recurrent, pools.slots.conv), saved):
        t.copy_(s)
    fused = FusedDecodeStep(model, pools, "reference")     # re-lays out the model's weights
    got = _run_steps(fused, eng, seqs, 6)
    for t, s in zip((pools.latent.data, pools.slots.recurrent, pools.slots.conv), saved):
        t.copy_(s)
    # the re-laid-out parameters are views holding the same values: the model is unchanged
    again = _run_steps(lambda ids, b: model(ids, b, pools), eng, seqs, 1)
    for w, g in zip(want, got):
        assert torch.allclose(g, w, rtol=0, atol=3e-2 * w.abs().max()), (g - w).abs().max()
        assert torch.equal(g.argmax(-1), w.argmax(-1))
    assert torch.equal(again[0], want[0])


@pytest.mark.parametrize("overrides,field", [
    (dict(hidden_act="situ", activation_situ_beta=4.0, activation_situ_linear_beta=25.0),
     "hidden_act"),
    (dict(attn_res_block_size=2), "attn_res_block_size")])
def test_k3_features_are_refused_by_name(overrides, field):
    """A Kimi-Linear-shaped model with one of K3's features the fused layer lacks is refused,
    naming the field, rather than run without it."""
    config = preset("tiny", kv_lora_rank=512, qk_rope_head_dim=64, **overrides)
    model = build_model(config, dtype=torch.bfloat16, seed=0)
    eng = ReferenceEngine(model, StateLayout(latent_dtype="bfloat16"), num_pages=4, num_slots=2)
    with pytest.raises(NotSupportedYet, match=field):
        FusedDecodeStep(model, eng.pools, "reference")
