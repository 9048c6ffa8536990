"""CuTe DSL KDA decode kernel vs the torch reference on a Hopper GPU (run on the H200).

Fresh random inputs every run (the seed is printed), outputs NaN-poisoned before the kernel so an
unwritten element fails, norm-wise relative errors: fp32 state <= 1e-5, bf16 output <= 1e-2;
the rolled conv state must equal the reference exactly; slot 0 and every slot no live request
uses must stay bit-identical. Skips cleanly without CUDA.
"""
import math
import os

import pytest
import torch

from pdserve.model.kda_ops import kda_log_decay

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from pdserve.kernels import registry  # noqa: E402
from pdserve.kernels.kda_decode import (  # noqa: E402
    OP,
    SUPPORTED_HEADS,
    kda_decode_cutedsl,
    kda_decode_problem,
    kda_decode_reference,
)

D, W = 128, 4
STATE_TOL = 1e-5
OUT_TOL = 1e-2
SEED = int.from_bytes(os.urandom(4), "little")


@pytest.fixture(scope="module", autouse=True)
def _fp32_matmuls():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False     # the reference must be true fp32
    print(f"kda_decode gpu test seed {SEED}")
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def make_case(B, H, layout, lower_bound, n_pad=0, strided=False, salt=0, f_scale=1.0,
              a_max=16.0, beta_shift=0.0, state_scale=0.3):
    gen = torch.Generator(device="cuda").manual_seed(SEED + salt)
    dev = "cuda"
    rnd = lambda *s: torch.randn(*s, generator=gen, device=dev)
    HD = H * D
    n_slots = B + 5
    if strided:   # rows as column slices of one packed projection output
        packed = rnd(B, 5 * HD + 8).to(torch.bfloat16)
        q, k, v, g_out, f = (packed[:, i * HD:(i + 1) * HD] for i in range(5))
    else:
        q, k, v, g_out, f = (rnd(B, HD).to(torch.bfloat16) for _ in range(5))
    if f_scale != 1.0:
        f = (f.float() * f_scale).to(torch.bfloat16)
    conv_pool = rnd(n_slots, W - 1, 3 * HD).to(torch.bfloat16)
    if layout == "DS":
        conv_pool = conv_pool.transpose(1, 2).contiguous()
    slots = torch.randperm(n_slots - 1, generator=gen, device=dev)[:B] + 1
    if n_pad:
        slots[torch.randperm(B, generator=gen, device=dev)[:n_pad]] = 0
    return dict(
        q=q, k=k, v=v, g_out=g_out, f=f,
        beta_raw=(rnd(B, H) + beta_shift).to(torch.bfloat16),
        conv_weight=rnd(3 * HD, W) * 0.5,
        A_log=torch.rand(H, generator=gen, device=dev) * math.log(a_max),
        dt_bias=0.5 * rnd(HD),
        norm_weight=1.0 + 0.1 * rnd(D),
        eps=1e-5, lower_bound=lower_bound,
        state_pool=rnd(n_slots, H, D, D) * state_scale,
        conv_pool=conv_pool,
        slot_idx=slots.to(torch.int32),
        conv_layout=layout,
    )


def clone(case):
    return {k: (v.clone() if torch.is_tensor(v) else v) for k, v in case.items()}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def check(case, steps=1, cluster=None, pdl=False, first_wave=None):
    ref, got = clone(case), clone(case)
    HD = case["q"].shape[1]
    B = case["q"].shape[0]
    for step in range(steps):
        out_ref = torch.full((B, HD), float("nan"), dtype=torch.bfloat16, device="cuda")
        out = torch.full((B, HD), float("nan"), dtype=torch.bfloat16, device="cuda")
        kda_decode_reference(**ref, out=out_ref)
        kda_decode_cutedsl(**got, out=out, cluster=cluster, pdl=pdl, first_wave=first_wave)
        torch.cuda.synchronize()
        assert not out.isnan().any(), "kernel left output elements unwritten"
        live = case["slot_idx"] != 0
        if live.any():
            assert rel(out[live], out_ref[live]) <= OUT_TOL, f"step {step} output rel err {rel(out[live], out_ref[live])}"
        assert torch.count_nonzero(out[~live]) == 0, "padding rows must be zeros"
        s = case["slot_idx"][live].long()
        if s.numel():
            e = rel(got["state_pool"][s], ref["state_pool"][s])
            assert e <= STATE_TOL, f"step {step} state rel err {e}"
            assert torch.equal(got["conv_pool"][s], ref["conv_pool"][s]), "conv state must roll exactly"
    untouched = torch.ones(case["state_pool"].shape[0], dtype=torch.bool, device="cuda")
    untouched[case["slot_idx"].long()] = False
    untouched[0] = True
    assert torch.equal(got["state_pool"][untouched], case["state_pool"][untouched]), "padding/unused state touched"
    assert torch.equal(got["conv_pool"][untouched], case["conv_pool"][untouched]), "padding/unused conv touched"
    return got, out


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bounded", "softplus"])
@pytest.mark.parametrize("layout", ["SD", "DS"])
@pytest.mark.parametrize("H", SUPPORTED_HEADS)
@pytest.mark.parametrize("B", [1, 3, 16, 64])
def test_matches_reference(B, H, layout, lower_bound):
    check(make_case(B, H, layout, lower_bound, n_pad=B // 3, salt=B * 1000 + H))


@pytest.mark.parametrize("cluster", [1, 2, 4, 8])
@pytest.mark.parametrize("layout", ["SD", "DS"])
def test_every_cluster_variant_over_steps(cluster, layout):
    check(make_case(5, 12, layout, -3.0, n_pad=1, salt=cluster), steps=3, cluster=cluster)


@pytest.mark.parametrize("cluster", [1, 2, 4, 8])
def test_pdl_variant(cluster):
    check(make_case(6, 12, "SD", -5.0, n_pad=2, salt=20 + cluster), steps=2, cluster=cluster, pdl=True)
    check(make_case(3, 96, "DS", None, n_pad=1, salt=30 + cluster), cluster=cluster, pdl=True)


@pytest.mark.parametrize("B,H", [(64, 12), (16, 32)])
def test_pdl_first_wave_loads_give_identical_results(B, H):
    """Grids of >= 128 CTAs load some row passes before the PDL wait (choose_early_rows) and the
    rest after it, except the first `first_wave` CTAs, which load every pass before it. Each
    split (none, some, the default one per SM, every CTA) must match the reference and give the
    same bits."""
    case = make_case(B, H, "SD", -5.0, n_pad=3, salt=50 + B)
    results = {fw: check(case, steps=2, pdl=True, first_wave=fw)
               for fw in (0, 37, None, B * H)}
    st0, out0 = results[0]
    for fw, (st, out) in results.items():
        assert torch.equal(st["state_pool"], st0["state_pool"]), f"first_wave={fw}: state differs"
        assert torch.equal(out, out0), f"first_wave={fw}: output differs"


def test_pdl_back_to_back_on_disjoint_slots():
    """PDL calls queued without a sync, alternating two disjoint slot sets (the contract: the
    immediately preceding kernel never writes what a call reads early), as in a CUDA graph."""
    case = make_case(8, 12, "SD", -5.0, salt=40)
    B = 4
    sets = [case["slot_idx"][:B].contiguous(), case["slot_idx"][B:].contiguous()]
    rows = {n: case[n][:B] for n in ("q", "k", "v", "g_out", "f", "beta_raw")}
    ref, got = clone(case), clone(case)
    HD = case["q"].shape[1]
    refs, outs = [], []
    for step in range(6):
        o_ref = torch.empty(B, HD, dtype=torch.bfloat16, device="cuda")
        kda_decode_reference(**{**ref, **rows, "slot_idx": sets[step % 2]}, out=o_ref)
        refs.append(o_ref)
        outs.append(torch.full_like(o_ref, float("nan")))
    torch.cuda.synchronize()
    for step in range(6):     # nothing but these launches between them in the stream
        kda_decode_cutedsl(**{**got, **rows, "slot_idx": sets[step % 2]}, out=outs[step], pdl=True)
    outs = list(zip(outs, refs))
    torch.cuda.synchronize()
    for o, o_ref in outs:
        assert not o.isnan().any() and rel(o, o_ref) <= OUT_TOL
    live = case["slot_idx"].long()
    assert rel(got["state_pool"][live], ref["state_pool"][live]) <= STATE_TOL
    assert torch.equal(got["conv_pool"][live], ref["conv_pool"][live])


# Forget-gate regimes beyond the ones above: f = f_b_proj(f_a_proj(x)) of a real (or random) model
# is several units and exp(A_log) reaches 16 and more, so the bounded gate's sigmoid argument
# A (f + dt_bias) runs to +-50 .. +-1e4 (exp overflows to inf, the sigmoid saturates to exactly 0
# or 1) and the softplus form to its linear branch (x > 20) with decays that underflow to 0.
SATURATED = [(4.0, 16.0), (32.0, 16.0), (2.0, 1024.0)]     # (f scale, max exp(A_log))


@pytest.mark.parametrize("lower_bound", [-5.0, -0.5, None], ids=["bounded5", "bounded05", "softplus"])
@pytest.mark.parametrize("f_scale,a_max", SATURATED, ids=["f4", "f32", "A1024"])
def test_saturated_forget_gates(f_scale, a_max, lower_bound):
    salt = 50 + int(f_scale) + int(a_max)
    # the usual checks over steps, with model-sized states (|S| up to ~10)
    check(make_case(16, 12, "SD", lower_bound, n_pad=3, salt=salt, f_scale=f_scale, a_max=a_max,
                    state_scale=3.0), steps=3)
    check(make_case(3, 12, "DS", lower_bound, salt=salt + 1, f_scale=f_scale, a_max=a_max),
          steps=2, cluster=4)
    # beta ~ 0 (sigmoid(-60)): S' = S * exp(g) up to ~1e-26, so the state's elementwise
    # relative error is the decay's own error, channel by channel
    case = make_case(8, 12, "SD", lower_bound, salt=salt + 2, f_scale=f_scale, a_max=a_max,
                     beta_shift=-60.0)
    ref, got = clone(case), clone(case)
    kda_decode_reference(**ref)
    kda_decode_cutedsl(**got)
    torch.cuda.synchronize()
    s = case["slot_idx"].long()
    a, b = got["state_pool"][s], ref["state_pool"][s]
    assert torch.isfinite(a).all(), "non-finite state"
    # exp(g) carries g's few-ulp error times |g|: allow 1e-6 (4 + |g|) relative
    g = kda_log_decay(case["f"].view(8, 12, D), case["A_log"], case["dt_bias"].view(12, D),
                      lower_bound)[:, :, None, :]
    tol = 1e-6 * (4.0 + g.abs())
    err = (a - b).abs() / b.abs().clamp_min(1e-20)
    worst = (err / tol).max().item()
    assert worst <= 1.0, f"decay error {worst:.2f} x its tolerance (max rel err {err.max().item()})"


def test_strided_rows_and_all_padding():
    check(make_case(7, 24, "SD", None, strided=True, salt=7))
    check(make_case(4, 12, "DS", -5.0, n_pad=4, salt=8))


def test_registry_picks_cutedsl_on_hopper():
    case = make_case(2, 12, "SD", -5.0)
    res = registry.resolve(OP, "cutedsl", kda_decode_problem(**case))
    if torch.cuda.get_device_capability() == (9, 0):
        assert res.backend == "cutedsl", res.fallback_reason
    else:
        assert res.backend == "reference"


def test_runtime_pdl_step_in_a_cuda_graph_matches_eager():
    """The decode runtime's fused step (registry "cutedsl" entry: PDL launch right after the gate
    projection, cached conv weight, int32 slots from the batch) replayed from a CUDA graph gives
    the eager fused step's logits and state, from the same starting state."""
    import inspect

    from pdserve.kernels.kda_decode import kda_decode_cutedsl_runtime
    from pdserve.decode.graphs import DecodeGraphs
    from pdserve.decode.rank import kda_step_for
    from pdserve.model.config import preset, preset_dict
    from pdserve.model.generate import ReferenceEngine, build_model
    from pdserve.model.sampling import Request, SamplingParams
    from pdserve.state.layout import StateLayout

    assert inspect.signature(kda_decode_cutedsl_runtime).parameters["pdl"].default is True
    la = {**preset_dict("tiny")["linear_attn_config"], "num_heads": 12, "head_dim": 128,
          "gate_lower_bound": -5.0}
    model = build_model(preset("tiny", hidden_size=256, linear_attn_config=la),
                        dtype=torch.bfloat16, seed=3).cuda()
    layout = StateLayout(latent_dtype="bfloat16", conv_dtype="bfloat16")
    eng = ReferenceEngine(model, layout, num_pages=32, num_slots=8)
    seqs = [eng.admit(Request(f"r{i}", list(p), SamplingParams(max_tokens=8)))
            for i, p in enumerate([b"abc", b"hello world", b"x" * 40])]
    eng.prefill(seqs)
    tables, tokens = [s.table for s in seqs], [5, 77, 200]
    step = kda_step_for("cutedsl")
    start = {k: v.clone() for k, v in eng.pools.regions().items()}
    graphs = DecodeGraphs(model, eng.pools, max_tokens=64, buckets=(4,), kda_step=step)
    got, _ = graphs.run(tables, tokens)
    got_state = eng.pools.slots.recurrent.clone()
    for k, v in eng.pools.regions().items():
        v.copy_(start[k])
    from pdserve.model.batch import ForwardBatch
    batch = ForwardBatch.of(tables, [1] * 3)
    want = model(torch.tensor(tokens, device="cuda"), batch, eng.pools,
                 logit_rows=batch.last_rows(), kda_step=step)
    assert all(f[1] != "cutedsl" for f in registry.fallbacks()), registry.fallbacks()
    assert rel(got, want) <= 1e-2
    s = [t.kda_slot for t in tables]
    assert rel(got_state[:, s], eng.pools.slots.recurrent[:, s]) <= STATE_TOL
