"""The fused KDA decode op's torch reference (pdserve.kernels.kda_decode) on CPU.

Oracles we did not write: fla-core's `naive_recurrent_kda` for the recurrence (its state is
key-major [K, V], ours value-major [V, K]) and `torch.nn.functional.conv1d` for the causal conv.
The rest (gate, norms) is written out here per request from the formulas in k3_decode.md §1.4.
Also: padding slots, the SD/DS conv layouts, strided row inputs, and the registry/guard.
"""
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import registry
from pdserve.kernels.kda_decode import (
    OP,
    cutedsl_guard,
    kda_decode_problem,
    kda_decode_reference,
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # fla warns that triton has no CPU backend
    from fla.ops.kda.naive import naive_recurrent_kda

W = 4


def make_case(B, H, D, n_slots, lower_bound, layout, seed, pad_rows=(), dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)
    HD = H * D
    rows = lambda: rnd(B, HD).to(dtype)
    case = dict(
        q=rows(), k=rows(), v=rows(), g_out=rows(), f=rows(),
        beta_raw=rnd(B, H).to(dtype),
        conv_weight=rnd(3 * HD, W) * 0.5,
        A_log=torch.empty(H).uniform_(0.0, math.log(16.0), generator=gen),
        dt_bias=0.5 * rnd(HD),
        norm_weight=1.0 + 0.1 * rnd(D),
        eps=1e-5, lower_bound=lower_bound,
        state_pool=rnd(n_slots, H, D, D) * 0.3,
        conv_pool=rnd(n_slots, W - 1, 3 * HD).to(dtype),
        conv_layout=layout,
    )
    if layout == "DS":
        case["conv_pool"] = case["conv_pool"].transpose(1, 2).contiguous()
    perm = torch.randperm(n_slots - 1, generator=gen)[:B] + 1      # distinct live slots
    for r in pad_rows:
        perm[r] = 0
    case["slot_idx"] = perm.to(torch.int32)
    return case


def run_ref(case):
    c = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in case.items()}
    out = kda_decode_reference(**c)
    return out, c["state_pool"], c["conv_pool"]


def oracle(case):
    """Per request and head, with fla's naive recurrence and conv1d. Returns out [B, HD] fp32,
    new states {slot: [H, V, K]}, new conv rows {slot: [W-1, 3HD] (SD)}."""
    q, k, v, g_out, f = (case[n].float() for n in ("q", "k", "v", "g_out", "f"))
    B, HD = q.shape
    H = case["A_log"].shape[0]
    D = HD // H
    lb = case["lower_bound"]
    conv = case["conv_pool"].float()
    if case["conv_layout"] == "DS":
        conv = conv.transpose(1, 2)
    out = torch.zeros(B, HD)
    states, convs = {}, {}
    for b in range(B):
        s = int(case["slot_idx"][b])
        if s == 0:
            continue
        x = torch.cat([q[b], k[b], v[b]])                                # [3HD]
        seq = torch.cat([conv[s], x[None]], 0).T[None]                   # [1, 3HD, W]
        y = F.silu(F.conv1d(seq, case["conv_weight"][:, None, :], groups=3 * HD))[0, :, -1]
        convs[s] = torch.cat([conv[s][1:], x[None]], 0)
        qc, kc, vc = y.view(3, H, D)
        qn = qc / torch.sqrt((qc * qc).sum(-1, keepdim=True) + 1e-6)
        kn = kc / torch.sqrt((kc * kc).sum(-1, keepdim=True) + 1e-6)
        A = case["A_log"].exp()[:, None]
        xf = f[b].view(H, D) + case["dt_bias"].view(H, D)
        g = -A * F.softplus(xf) if lb is None else lb * torch.sigmoid(A * xf)
        beta = torch.sigmoid(case["beta_raw"][b].float())
        S0 = case["state_pool"][s]                                        # [H, V, K]
        o, S = naive_recurrent_kda(qn[None, None], kn[None, None], vc[None, None], g[None, None],
                                   beta[None, None], scale=D ** -0.5,
                                   initial_state=S0.transpose(-1, -2)[None], output_final_state=True)
        o = o[0, 0]                                                       # [H, V]
        states[s] = S[0].transpose(-1, -2)
        rms = torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + case["eps"])
        out[b] = (o * rms * case["norm_weight"] * torch.sigmoid(g_out[b].view(H, D))).reshape(HD)
    return out, states, convs


@pytest.mark.parametrize("layout", ["SD", "DS"])
@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("B,H,D,pad", [(1, 2, 16, ()), (5, 3, 16, (1, 3)), (3, 2, 128, (2,))])
def test_reference_matches_oracle(B, H, D, pad, lower_bound, layout):
    case = make_case(B, H, D, n_slots=B + 4, lower_bound=lower_bound, layout=layout,
                     seed=B * 31 + H + D, pad_rows=pad)
    out, S, conv = run_ref(case)
    o_ref, states, convs = oracle(case)
    assert out.dtype == torch.bfloat16 and out.shape == (B, H * D)
    torch.testing.assert_close(out.float(), o_ref, rtol=1e-2, atol=1e-2)
    for s, st in states.items():
        torch.testing.assert_close(S[s], st, rtol=1e-5, atol=1e-5)
    conv_sd = conv if layout == "SD" else conv.transpose(1, 2)
    for s, c in convs.items():
        assert torch.equal(conv_sd[s].float(), c), "conv state must roll exactly"
    live = set(states)
    for s in range(case["state_pool"].shape[0]):
        if s not in live:     # slot 0 and unused slots: bit-identical
            assert torch.equal(S[s], case["state_pool"][s])
            assert torch.equal(conv[s], case["conv_pool"][s])
    for r in pad:
        assert torch.count_nonzero(out[r]) == 0


def test_layouts_agree_and_strided_rows():
    a = make_case(4, 2, 128, 8, -3.0, "SD", seed=7)
    b = dict(a)
    b["conv_layout"] = "DS"
    b["conv_pool"] = a["conv_pool"].transpose(1, 2).contiguous()
    # rows as column slices of one packed projection output (row stride > H*D)
    packed = torch.cat([a[n] for n in ("q", "k", "v", "g_out", "f")], dim=1)
    HD = a["q"].shape[1]
    for i, n in enumerate(("q", "k", "v", "g_out", "f")):
        b[n] = packed[:, i * HD:(i + 1) * HD]
    oa, Sa, ca = run_ref(a)
    ob, Sb, cb = run_ref(b)
    assert torch.equal(oa, ob) and torch.equal(Sa, Sb)
    assert torch.equal(ca, cb.transpose(1, 2))


def test_all_padding_leaves_pools_untouched():
    case = make_case(3, 2, 16, 6, None, "SD", seed=3, pad_rows=(0, 1, 2))
    out, S, conv = run_ref(case)
    assert torch.count_nonzero(out) == 0
    assert torch.equal(S, case["state_pool"]) and torch.equal(conv, case["conv_pool"])


def test_registry_falls_back_to_reference_on_cpu():
    case = make_case(2, 12, 128, 4, -5.0, "SD", seed=1)
    res = registry.resolve(OP, "cutedsl", kda_decode_problem(**case))
    assert res.backend == "reference" and res.impl is kda_decode_reference
    assert "CUDA" in res.fallback_reason


def _hopper_problem(**over):
    """A supported problem as the guard sees it (built on CPU, device fields faked)."""
    case = make_case(2, 12, 128, 4, -5.0, "SD", seed=2)
    p = kda_decode_problem(**case)
    p.update(device_type="cuda", capability=(9, 0))
    p.update(over)
    return p


def test_guard_accepts_supported_and_names_the_reason_otherwise():
    assert cutedsl_guard(_hopper_problem()) is None
    assert cutedsl_guard(_hopper_problem(conv_layout="DS", conv_shape=(3 * 12 * 128, 3))) is None
    assert cutedsl_guard(_hopper_problem(lower_bound=None)) is None
    assert "sm_90" in cutedsl_guard(_hopper_problem(capability=(10, 0)))
    assert "heads" in cutedsl_guard(_hopper_problem(heads=16))
    assert "batch" in cutedsl_guard(_hopper_problem(batch=65))
    assert "bf16" in cutedsl_guard(_hopper_problem(input_dtype={torch.float16}))
    assert "fp32 state" in cutedsl_guard(_hopper_problem(state_dtype=torch.bfloat16))
    assert "SD/DS" in cutedsl_guard(_hopper_problem(conv_layout="XY"))
    assert "lower_bound" in cutedsl_guard(_hopper_problem(lower_bound=-6.0))
    assert "aligned" in cutedsl_guard(_hopper_problem(aligned16=False))
    # a real non-128 head dim
    small = make_case(2, 12, 64, 4, -5.0, "SD", seed=2)
    p = kda_decode_problem(**small)
    p.update(device_type="cuda", capability=(9, 0))
    assert "K = V = 128" in cutedsl_guard(p)
