"""A CPU model of the MLA decode kernel's lazy column maxima (attention.py, "Lazy column maxima").

One head's scores in log2 units, 64-token tiles of 4 warps x 16 token rows. The running maximum
moves only in an exact step: the first tile, or a tile where some warp's maximum exceeds it by
more than LAZY_MAX_SLACK (the kernel checks each thread's rows and ORs the result over the
warpgroup: the same decision). Otherwise P = 2^(s - m) is taken against the maximum as it is. P goes
to fp16 as PV reads it; the sums, O and the rescale stay fp32. One consumer only: the kernel's
two consumers each run this on their own tiles and are merged exactly afterwards.

Checked against a float64 softmax: the output and the LSE stay exact, and P stays within 2^slack,
inside fp16. The numbers of exact steps are checked too. A model without the rise check overflows
fp16 on a step in the scores. The GPU tests (test_fp8_lazy_maxima) run the kernel itself;
this runs in CI.
"""
import math

import pytest
import torch
from pdserve.kernels.mla_decode.attention import LAZY_MAX_SLACK

TILE, WARP_ROWS = 64, 16


def lazy_attention(s, v, slack):
    """(out [D], lse in log2 units, exact steps, largest fp16 P) for scores s [L] (log2 units)
    and values v [L, D]; slack = None: never lazy (an exact step on every tile)."""
    m = -math.inf
    l = torch.zeros((), dtype=torch.float32)
    o = torch.zeros(v.shape[1], dtype=torch.float32)
    exact_steps, p_max = 0, 0.0
    for t0 in range(0, s.numel(), TILE):
        st, vt = s[t0:t0 + TILE], v[t0:t0 + TILE]
        w_max = [float(st[w:w + WARP_ROWS].max()) for w in range(0, st.numel(), WARP_ROWS)]
        rise = slack is None or any(wm - m > slack for wm in w_max)
        if t0 == 0 or rise:
            m_new = max([m] + w_max)
            factor = 2.0 ** (m - m_new) if m != -math.inf else 0.0
            o, l, m = o * factor, l * factor, m_new
            exact_steps += 1
        p = torch.exp2(st - m)                       # fp32, as the kernel's ex2
        p16 = p.to(torch.float16)
        l = l + p.sum()
        o = o + p16.to(torch.float32) @ vt
        p_max = max(p_max, float(p16.max()))
    return o / l, m + math.log2(float(l)), exact_steps, p_max


def scores(kind, L, gen):
    """Scores in log2 units, ~5 units of spread as random fp8 cache data gives at H=32."""
    s = torch.randn(L, generator=gen, dtype=torch.float32) * 5.0
    if kind == "rising":
        s = s * torch.linspace(0.02, 1.5, L)
    elif kind == "falling":
        s = s * torch.linspace(1.5, 0.02, L)
    elif kind == "step":
        s[:3 * L // 4] *= 0.05
    return s


def reference(s, v):
    s64 = s.double()
    p = torch.exp2(s64 - s64.max())
    return (p @ v.double()) / p.sum(), float(s64.max() + torch.log2(p.sum()))


@pytest.mark.parametrize("kind", ["random", "rising", "falling", "step"])
def test_lazy_maxima_stay_exact_and_inside_fp16(kind):
    gen = torch.Generator().manual_seed(18)
    L = 20000 + 33
    s = scores(kind, L, gen)
    v = torch.randn(L, 64, generator=gen)
    ref_o, ref_lse = reference(s, v)
    o, lse, steps, p_max = lazy_attention(s, v, LAZY_MAX_SLACK)
    o_exact, lse_exact, steps_exact, _ = lazy_attention(s, v, None)
    err = float((o.double() - ref_o).norm() / ref_o.norm())
    err_exact = float((o_exact.double() - ref_o).norm() / ref_o.norm())
    # the same accuracy as an exact step on every tile (fp16 P, fp32 sums): only the fp16
    # rounding of P differs
    assert err < 2e-3 and err_exact < 2e-3, (err, err_exact)
    assert abs(lse - ref_lse) < 1e-4 and abs(lse_exact - ref_lse) < 1e-4, (lse, lse_exact, ref_lse)
    # P never above 2^slack (by construction: no warp's maximum is more than slack above m),
    # and 2^slack below the fp16 maximum, 65504
    assert p_max <= 2.0 ** LAZY_MAX_SLACK < 65504
    tiles = -(-L // TILE)
    assert steps_exact == tiles
    if kind in ("random", "falling"):
        assert steps <= 3, steps              # the first tiles set a maximum that holds
    else:
        assert steps >= 2, steps              # the rise / the step moved it


def test_without_the_rise_check_a_step_overflows_fp16():
    """The check is what keeps P inside fp16: with the maximum kept from the first tile, the
    step in the scores (~20 log2 units above the maximum before it) overflows."""
    gen = torch.Generator().manual_seed(7)
    L = 20000
    s = scores("step", L, gen)
    v = torch.randn(L, 64, generator=gen)
    o, _, steps, p_max = lazy_attention(s, v, math.inf)
    assert steps == 1
    assert math.isinf(p_max) or not torch.isfinite(o).all()
