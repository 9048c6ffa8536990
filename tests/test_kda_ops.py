"""KDA reference math vs fla-core's naive KDA (an oracle we did not write) and
direct float64 formulas.

fla conventions: inputs [B, T, H, K]; it multiplies q by `scale` itself; its
state is key-major [B, H, K, V] while ours is value-major [H, V, K].
"""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from pdserve.model.kda_ops import (
    delta_rule_chunked,
    delta_rule_recurrent,
    gated_rmsnorm,
    kda_log_decay,
    l2_normalize,
    short_conv,
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # fla warns that triton has no CPU backend
    from fla.ops.kda.naive import naive_chunk_kda, naive_recurrent_kda

# fp32 vs fp32 with different summation orders. Observed max abs errors on
# O(0.1-4) outputs/states: ~1e-7 typically, up to ~4e-6 on the final state in
# the weak-decay regime (measured up to T=256, K=128), where rounding
# accumulates longest.
# 1e-5 keeps headroom; real math errors (layout, scale, decay) show up at >1e-2.
TOL = dict(rtol=1e-5, atol=1e-5)
DECAY_FORMS = [None, -5.0]


def make_inputs(T, H, K, V, lower_bound, seed, regime="typical"):
    """Random KDA inputs in our layout; q is L2-normalized but NOT yet scaled.

    regime: "typical" (Kimi Linear init), "weak" (a ~ 0.999: the initial state
    and old tokens stay visible for hundreds of steps), "strong" (the gate's
    most decaying end: per-chunk log decay far below fp32's exp range) or
    "mixed" (alternating strong/weak blocks)."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)
    q = l2_normalize(rnd(T, H, K))
    k = l2_normalize(rnd(T, H, K))
    v = rnd(T, H, V)
    f = rnd(T, H, K)
    # Kimi Linear init: A ~ U(1, 16), A_log = log(A).
    A_log = torch.empty(H).uniform_(0.0, math.log(16.0), generator=gen)
    dt_bias = 0.5 * rnd(H, K)
    if regime == "strong":
        f = f + 4.0
        A_log = A_log + 1.0
    elif regime == "weak":
        f = f - 8.0
        A_log = torch.zeros(H)
    elif regime == "mixed":  # blocks of 8 strong then 8 weak tokens: a large
        # cumulative decay followed by tiny steps (cancellation-prone in a chunk)
        A_log = torch.zeros(H)
        strong_tok = (torch.arange(T) % 16 < 8)[:, None, None]
        f = torch.where(strong_tok, f + 6.0, f - 8.0)
    g = kda_log_decay(f, A_log, dt_bias, lower_bound)
    beta = torch.sigmoid(rnd(T, H))
    state = rnd(H, V, K)
    return q, k, v, g, beta, state


def to_fla(*xs):
    return [x[None] for x in xs]  # add the batch dim


@pytest.mark.parametrize("regime", ["typical", "weak"])
@pytest.mark.parametrize("lower_bound", DECAY_FORMS)
@pytest.mark.parametrize("T,H,K", [(1, 1, 16), (5, 3, 16), (64, 3, 32), (130, 1, 32), (3, 2, 128)])
def test_recurrent_matches_fla(T, H, K, lower_bound, regime):
    q, k, v, g, beta, state = make_inputs(T, H, K, K, lower_bound, seed=T * 7 + H + K, regime=regime)
    scale = K ** -0.5
    o, S = delta_rule_recurrent(q * scale, k, v, g, beta, state)
    o_ref, S_ref = naive_recurrent_kda(*to_fla(q, k, v, g, beta), scale=scale,
                                       initial_state=state.transpose(-1, -2)[None],
                                       output_final_state=True)
    torch.testing.assert_close(o, o_ref[0], **TOL)
    torch.testing.assert_close(S, S_ref[0].transpose(-1, -2), **TOL)
    assert not torch.equal(S, state)


@pytest.mark.parametrize("regime", ["typical", "weak"])
@pytest.mark.parametrize("lower_bound", DECAY_FORMS)
@pytest.mark.parametrize("T,H,K,chunk", [(64, 3, 16, 64), (128, 1, 32, 64), (32, 2, 128, 16)])
def test_chunked_matches_fla(T, H, K, chunk, lower_bound, regime):
    q, k, v, g, beta, state = make_inputs(T, H, K, K, lower_bound, seed=T + H * 3 + K, regime=regime)
    scale = K ** -0.5
    o, S = delta_rule_chunked(q * scale, k, v, g, beta, state, chunk_size=chunk)
    o_ref, S_ref = naive_chunk_kda(*to_fla(q, k, v, g, beta), scale=scale,
                                   initial_state=state.transpose(-1, -2)[None],
                                   output_final_state=True, chunk_size=chunk)
    torch.testing.assert_close(o, o_ref[0], **TOL)
    torch.testing.assert_close(S, S_ref[0].transpose(-1, -2), **TOL)


@pytest.mark.parametrize("regime", ["typical", "weak", "strong", "mixed"])
@pytest.mark.parametrize("lower_bound", DECAY_FORMS)
@pytest.mark.parametrize("T,H,K,chunk", [(1, 1, 16, 64), (5, 3, 16, 4), (130, 3, 32, 64),
                                         (70, 1, 16, 16), (9, 2, 128, 8)])
def test_chunked_matches_recurrent(T, H, K, chunk, lower_bound, regime):
    q, k, v, g, beta, state = make_inputs(T, H, K, K, lower_bound, seed=T + chunk, regime=regime)
    q = q * K ** -0.5
    if regime == "strong":  # the regime the chunked form must survive: per-chunk log decay far below -88
        G_chunk = g[: min(chunk, T)].sum(0)
        assert G_chunk.min() < (-100 if lower_bound is None else -4.5 * min(chunk, T) + 1)
    state_in = state.clone()
    o_c, S_c = delta_rule_chunked(q, k, v, g, beta, state, chunk_size=chunk)
    o_r, S_r = delta_rule_recurrent(q, k, v, g, beta, state)
    assert torch.equal(state, state_in)  # inputs untouched
    assert torch.isfinite(o_c).all() and torch.isfinite(S_c).all()
    torch.testing.assert_close(o_c, o_r, **TOL)
    torch.testing.assert_close(S_c, S_r, **TOL)


def test_chunked_empty_sequence():
    q, k, v, g, beta, state = make_inputs(0, 2, 16, 16, None, seed=0)
    o, S = delta_rule_chunked(q, k, v, g, beta, state)
    assert o.shape == (0, 2, 16)
    torch.testing.assert_close(S, state, rtol=0, atol=0)
    assert S.data_ptr() != state.data_ptr()


def test_chunked_is_chunk_size_invariant():
    q, k, v, g, beta, state = make_inputs(50, 2, 16, 16, -5.0, seed=1)
    outs = [delta_rule_chunked(q, k, v, g, beta, state, chunk_size=c) for c in (1, 7, 64)]
    for o, S in outs[1:]:
        torch.testing.assert_close(o, outs[0][0], **TOL)
        torch.testing.assert_close(S, outs[0][1], **TOL)


def conv_inputs(T, C, W, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(T, C, generator=gen), torch.randn(C, W, generator=gen)


@pytest.mark.parametrize("W", [2, 4])
def test_short_conv_matches_conv1d_and_streaming(W):
    T, C = 11, 6
    x, w = conv_inputs(T, C, W, seed=W)
    zero = torch.zeros(W - 1, C)
    y, st = short_conv(x, w, zero)
    # Independent: conv1d with left zero padding (conv1d is cross-correlation,
    # so tap W-1 lines up with the current input).
    ref = F.silu(F.conv1d(F.pad(x.T[None], (W - 1, 0)), w[:, None, :], groups=C))[0].T
    torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(st, x[-(W - 1):], rtol=0, atol=0)
    # Streaming: a short prefill (T < W-1 when W=4 and n=1 or 2) then single tokens.
    for n in (1, 2, 5):
        ys, s = [], zero
        y0, s = short_conv(x[:n], w, s)
        ys.append(y0)
        for t in range(n, T):
            yt, s = short_conv(x[t:t + 1], w, s)
            ys.append(yt)
        torch.testing.assert_close(torch.cat(ys), y, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(s, st, rtol=0, atol=0)


def test_short_conv_state_shorter_than_window_and_dtype():
    W, C = 4, 3
    x, w = conv_inputs(2, C, W, seed=5)
    state = torch.arange(3 * C, dtype=torch.bfloat16).reshape(3, C)
    y, st = short_conv(x, w, state)
    assert st.dtype == torch.bfloat16 and y.dtype == torch.float32
    expect = torch.cat([state[2:].float(), x]).to(torch.bfloat16)
    torch.testing.assert_close(st, expect, rtol=0, atol=0)
    full = torch.cat([state.float(), x]).double()
    ref = F.silu(torch.stack([(full[t:t + W].T * w.double()).sum(-1) for t in range(2)]))
    torch.testing.assert_close(y.double(), ref, rtol=1e-6, atol=1e-6)


def test_l2_normalize_and_gated_rmsnorm_vs_float64():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 3, 32, generator=gen) * 3
    x64 = x.double()
    ref = x64 / torch.sqrt((x64 ** 2).sum(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(l2_normalize(x).double(), ref, rtol=1e-6, atol=1e-7)
    tiny = torch.full((1, 8), 1e-5)  # eps dominates: must not blow up to unit norm
    assert l2_normalize(tiny).norm() < 0.05

    w = torch.randn(32, generator=gen)
    gate = torch.randn(4, 3, 32, generator=gen)
    eps = 1e-5
    out = gated_rmsnorm(x, w, gate, eps)
    ref = (x64 / torch.sqrt((x64 ** 2).mean(-1, keepdim=True) + eps) * w.double()
           / (1 + torch.exp(-gate.double())))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("lower_bound", DECAY_FORMS)
def test_kda_log_decay_vs_float64(lower_bound):
    gen = torch.Generator().manual_seed(4)
    H, D = 3, 16
    f = torch.randn(7, H, D, generator=gen) * 2
    A_log = 0.3 * torch.randn(H, generator=gen)
    dt_bias = torch.randn(H, D, generator=gen)
    g = kda_log_decay(f.to(torch.bfloat16), A_log, dt_bias, lower_bound)
    assert g.dtype == torch.float32 and g.shape == f.shape
    x = f.to(torch.bfloat16).double() + dt_bias.double()
    A = torch.exp(A_log.double())[:, None]
    if lower_bound is None:
        ref = -A * torch.log1p(torch.exp(x))
        assert (g <= 0).all()
    else:
        ref = lower_bound / (1 + torch.exp(-A * x))
        assert ((g > lower_bound) & (g < 0)).all()
    torch.testing.assert_close(g.double(), ref, rtol=1e-6, atol=1e-6)


def test_kda_log_decay_rejects_bad_bound():
    z = torch.zeros(1, 1, 2)
    with pytest.raises(ValueError):
        kda_log_decay(z, torch.zeros(1), torch.zeros(1, 2), lower_bound=0.5)
