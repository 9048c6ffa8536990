"""The fused decode step's kernels against their torch references, and the whole fused step
(decode.backend = "cutedsl") against the model's own torch path, on a Hopper GPU.

- moe_route: random routings, every token on the same experts, all experts distinct, with and
  without the shared expert and the correction bias; the pair layout must be identical.
- add_rmsnorm: no delta, rows, MoE pairs, strided outputs.
- the grouped MoE (route + two grouped GEMMs + the combine) against the model's MoE.
- the whole step on tiny (MLA at the 576-wide latent) and a reduced kimi-linear-48b-a3b
  (routing made decisive) against the model's forward with the same KDA / MLA kernels over
  32 steps fed the same tokens: logits within bf16 tolerance at every step, greedy tokens equal except at bf16
  near-ties (at most two), seeded samples equal; against the model's torch path (fp32
  attention math) the first step's logits within a bf16 margin; its CUDA graph replay equal
  to the eager fused step.
"""
import pytest
import torch

from pdserve.decode.fused_step import FusedDecodeStep
from pdserve.decode.graphs import DecodeGraphs
from pdserve.decode.rank import kda_step_for, mla_step_for
from pdserve.kernels import registry
from pdserve.kernels.latent_store import latent_store_cutedsl, latent_store_reference
from pdserve.kernels.moe_route import moe_route_cutedsl, moe_route_reference
from pdserve.kernels.rmsnorm import add_rmsnorm_cutedsl, add_rmsnorm_reference
from pdserve.kernels.rmsnorm.reference import combine_pairs
from pdserve.model.batch import DecodeBatch
from pdserve.model.config import preset, reduced_kimi_linear
from pdserve.model.generate import ReferenceEngine, build_model
from pdserve.model.sampling import Request, SamplingParams, sample_batch
from pdserve.state.layout import StateLayout

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs a Hopper (sm_90) GPU")

LAYOUT = StateLayout(latent_dtype="bfloat16", recurrent_dtype="float32", conv_dtype="bfloat16")


def _route_outputs(B, E, k, shared):
    S = k + shared
    i32 = dict(dtype=torch.int32, device="cuda")
    return (torch.full((B * S,), -1, **i32), torch.full((B * S,), float("nan"), device="cuda"),
            torch.full((B, S), -1, **i32), torch.full((E + shared,), -1, **i32))


@pytest.mark.parametrize("E,k", [(256, 8), (32, 4)])
@pytest.mark.parametrize("B", [1, 7, 33, 64])
@pytest.mark.parametrize("shared,bias", [(1, True), (0, False)])
@pytest.mark.parametrize("kind", ["random", "same_experts", "distinct"])
def test_moe_route_kernel(E, k, B, shared, bias, kind):
    g = torch.Generator(device="cuda").manual_seed(B * 131 + E)
    logits = torch.randn(B, E, device="cuda", generator=g)
    b = 0.05 * torch.randn(E, device="cuda", generator=g) if bias else None
    if kind == "same_experts":
        logits[:, 3:3 + k] += 8.0                     # every token on experts 3..3+k-1
    elif kind == "distinct":
        for t in range(B):                            # token t on its own experts (mod E)
            logits[t, [(t * k + j) % E for j in range(k)]] += 8.0
    want = _route_outputs(B, E, k, shared)
    got = _route_outputs(B, E, k, shared)
    args = (logits, b, k, 1, 1, "sigmoid", True, 2.446, shared)
    moe_route_reference(*args, *want)
    moe_route_cutedsl(*args, *got)
    torch.cuda.synchronize()
    assert torch.equal(got[0], want[0]), "pair_token"
    assert torch.equal(got[2], want[2]), "token_pair"
    assert torch.equal(got[3], want[3]), "group_end"
    assert torch.allclose(got[1], want[1], rtol=1e-5, atol=1e-6), "pair_weight"


def test_latent_store_kernel():
    """New rows land at their (page, row), normalized; padding rows (page 0) and every other
    row of the cache stay bit-identical."""
    g = torch.Generator(device="cuda").manual_seed(7)
    B = 6
    kv_wide = torch.randn(B, 704, device="cuda", generator=g).to(torch.bfloat16)
    kv = kv_wide[:, 3 * 8:3 * 8 + 576]                      # a strided, aligned view
    w = (1 + 0.1 * torch.randn(512, device="cuda", generator=g)).to(torch.bfloat16)
    base = torch.randn(9, 64, 576, device="cuda", generator=g).to(torch.bfloat16)
    page = torch.tensor([3, 0, 5, 5, 1, 0], device="cuda")
    row = torch.tensor([0, 0, 7, 8, 63, 2], device="cuda")
    want, got = base.clone(), base.clone()
    latent_store_reference(kv, w, 1e-6, want, page, row)
    latent_store_cutedsl(kv, w, 1e-6, got, page, row)
    torch.cuda.synchronize()
    assert torch.equal(got[0], base[0]), "padding rows wrote page 0"
    untouched = torch.ones(9, 64, dtype=torch.bool, device="cuda")
    untouched[page, row] = False
    untouched[0] = True
    assert torch.equal(got[untouched], base[untouched])
    assert torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("D", [2304, 512, 128])
@pytest.mark.parametrize("kind", ["none", "rows", "pairs"])
def test_add_rmsnorm_kernel(D, kind):
    g = torch.Generator(device="cuda").manual_seed(D)
    B, S = 13, 9
    bf = dict(dtype=torch.bfloat16, device="cuda")
    res = torch.randn(B, D, generator=g, device="cuda").to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(D, generator=g, device="cuda")).to(torch.bfloat16)
    delta, extra = None, {}
    if kind == "rows":
        delta = torch.randn(B, D, generator=g, device="cuda").to(torch.bfloat16)
    elif kind == "pairs":
        delta = torch.randn(B * S, D, generator=g, device="cuda").to(torch.bfloat16)
        extra = dict(token_pair=torch.randperm(B * S, device="cuda", generator=g).view(B, S)
                     .int().contiguous(), pair_weight=torch.rand(B * S, device="cuda", generator=g))
    outs = []
    for impl in (add_rmsnorm_reference, add_rmsnorm_cutedsl):
        wide = torch.full((B, D + 64), float("nan"), **bf)        # strided output rows
        r_out = torch.full((B, D), float("nan"), **bf)
        impl(res, delta, w, 1e-6, wide[:, :D], None if kind == "none" else r_out, **extra)
        outs.append((wide, r_out))
    torch.cuda.synchronize()
    (w_ref, r_ref), (w_got, r_got) = outs
    assert torch.isnan(w_got[:, D:]).all(), "wrote past the row"
    assert torch.allclose(w_got[:, :D].float(), w_ref[:, :D].float(), rtol=2e-2, atol=2e-2)
    if kind != "none":
        assert torch.allclose(r_got.float(), r_ref.float(), rtol=1e-2, atol=1e-2)


def _engine(config, seed=5, prompts=None, num_pages=64, decisive_routing=False):
    """A prefilled engine. `decisive_routing`: the router's correction bias x100, so each
    layer's expert choice is far from a tie: two bf16 decompositions of the same step then
    route alike (a near-tie flips an expert and the logits with it, which says nothing about
    either side); the routing itself is tested on its own above."""
    model = build_model(config, dtype=torch.bfloat16, seed=seed).cuda()
    if decisive_routing:
        with torch.no_grad():
            for layer in model.model.layers:
                if hasattr(layer, "block_sparse_moe"):
                    layer.block_sparse_moe.gate.e_score_correction_bias.mul_(100.0)
    eng = ReferenceEngine(model, LAYOUT, num_pages=num_pages, num_slots=12)
    prompts = prompts or [list(range(1, 20)), list(range(30, 120)), [5] * 7]
    seqs = [eng.admit(Request(f"r{i}", p, SamplingParams(max_tokens=40, ignore_eos=True)))
            for i, p in enumerate(prompts)]
    eng.prefill(seqs)
    return model, eng, seqs


CONFIGS = {"tiny": lambda: preset("tiny", kv_lora_rank=512, qk_rope_head_dim=64,
                                  num_experts=32, num_experts_per_token=4),
           "kimi-linear-reduced": lambda: reduced_kimi_linear(4, num_experts=32, top_k=8,
                                                               vocab_size=4096)}


def _state(pools):
    return (pools.latent.data, pools.slots.recurrent, pools.slots.conv)


def _greedy(step, eng, seqs, steps, rows, feed=None):
    """Run `steps` decode steps; each step is fed the previous step's argmax, or `feed[i]`
    (teacher forcing: both sides of a comparison see the same inputs). Returns (argmax per
    step, fp32 logits per step); the tables are left where they started."""
    tables = [s.table for s in seqs]
    start = [t.num_tokens for t in tables]
    tokens, logits_seen, out = [s.output[-1] for s in seqs], [], []
    for i in range(steps):
        if feed is not None:
            tokens = feed[i]
        batch = DecodeBatch.of(tables, eng.pools.latent.page_tokens, "cuda", rows=rows)
        logits = step(torch.tensor(tokens + [0] * (rows - len(tokens)), device="cuda"), batch)
        logits = logits[:len(tables)].float().clone()     # a graph's output is overwritten
        logits_seen.append(logits)
        tokens = logits.argmax(-1).tolist()
        out.append(tokens)
        for t in tables:
            t.num_tokens += 1
    for t, n in zip(tables, start):
        t.num_tokens = n
    return out, logits_seen


def _with_kernels(model, pools):
    """The model's own forward with the registry's fused KDA / MLA decode ops: the same
    attention kernels as the fused step, so the two differ only in the layer glue."""
    kda, mla = kda_step_for("cutedsl"), mla_step_for("cutedsl")
    return lambda ids, b: model(ids, b, pools, kda_step=kda, mla_step=mla)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_step_against_the_model(name):
    model, eng, seqs = _engine(CONFIGS[name](), decisive_routing=True)
    saved = [t.clone() for t in _state(eng.pools)]

    def restore():
        for t, s in zip(_state(eng.pools), saved):
            t.copy_(s)
    torch_path, torch_logits = _greedy(lambda ids, b: model(ids, b, eng.pools), eng, seqs, 1, 4)
    restore()
    want, want_logits = _greedy(_with_kernels(model, eng.pools), eng, seqs, 32, 4)
    feed = [[s.output[-1] for s in seqs]] + want[:-1]       # the oracle's own inputs
    restore()
    fused = FusedDecodeStep(model, eng.pools, "cutedsl")
    got, got_logits = _greedy(fused, eng, seqs, 32, 4, feed=feed)
    scale = want_logits[0].abs().max().item()
    errs = [(g - w).abs().max().item() for g, w in zip(got_logits, want_logits)]
    assert max(errs) <= 3e-2 * scale, (errs, scale)
    # greedy tokens equal at every step, except where the oracle's two best logits are closer
    # than the bound on the difference (a bf16 near-tie either side may take)
    for i, (g, w) in enumerate(zip(got, want)):
        top2 = want_logits[i].topk(2, dim=-1).values
        tie = (top2[:, 0] - top2[:, 1]) <= 2 * errs[i]
        assert all(a == b or t for a, b, t in zip(g, w, tie.tolist())), (i, g, w, errs[i])
    assert sum(a != b for g, w in zip(got, want) for a, b in zip(g, w)) <= 2
    # against the torch path (fp32 attention math): the first step's logits, a bf16 margin
    med = (got_logits[0] - torch_logits[0]).abs().median().item()
    assert med <= 1e-2 * scale, (med, scale)
    # seeded sampling over the same logits draws the same tokens
    params = [SamplingParams(temperature=0.8, top_k=50, seed=11 + i) for i in range(len(seqs))]
    pos = [3, 4, 5]
    assert sample_batch(got_logits[0], params, pos) == sample_batch(want_logits[0], params, pos)
    # the fused step ran its CuTe DSL ops: no fallback was logged for these
    refused = {op for op, backend, _ in registry.fallbacks() if backend == "cutedsl"}
    assert not refused & {"moe_route", "add_rmsnorm", "mla_decode", "latent_store"}, \
        registry.fallbacks()
    # its CUDA graph replays the eager fused step
    restore()
    graphs = DecodeGraphs(model, eng.pools, 512, buckets=(4,), forward=fused)
    replay, replay_logits = _greedy(lambda ids, b: graphs.run(
        [s.table for s in seqs], ids[:len(seqs)].tolist())[0], eng, seqs, 8, 4, feed=feed)
    for r, g in zip(replay_logits, got_logits):
        assert torch.allclose(r, g, rtol=0, atol=1e-2 * scale)


def test_grouped_moe_against_the_model_moe():
    config = reduced_kimi_linear(2, num_experts=32, top_k=8, vocab_size=512)
    model = build_model(config, dtype=torch.bfloat16, seed=2).cuda()
    pools = ReferenceEngine(model, LAYOUT, num_pages=4, num_slots=2).pools
    moe = model.model.layers[1].block_sparse_moe
    fused = FusedDecodeStep(model, pools, "cutedsl")
    ffn = fused.layers[1][3]
    g = torch.Generator(device="cuda").manual_seed(0)
    for B in (1, 3, 16, 64):
        h = torch.randn(B, config.hidden_size, device="cuda", generator=g).to(torch.bfloat16)
        want = moe(h, dense=False).float()
        rows, tp, pw = ffn(h)
        got = combine_pairs(rows, tp, pw).to(torch.bfloat16).float()
        assert torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().max())
