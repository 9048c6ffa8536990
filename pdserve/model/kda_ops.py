"""Readable fp32 reference math for KDA (Kimi Delta Attention).

These functions are the numerical ground truth for our kernels (see
shared/research/k3_decode.md §1.4). They favour clarity over speed: every op
runs in fp32 on whatever device the inputs live on, one head-batched einsum at
a time. Shapes use T tokens, H heads, K key dim, V value dim, C channels.

The recurrent state uses our cache layout S[h, v, k] (value-major, key
contiguous); per token

    S <- S * exp(g)[None, :]        (each key column decays)
    u  = beta * (v - S k)
    S <- S + u k^T
    o  = S q
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def kda_log_decay(f: Tensor, A_log: Tensor, dt_bias: Tensor,
                  lower_bound: float | None = None) -> Tensor:
    """Per-channel log decay g (the decay itself is a = exp(g)).

    f: [..., H, D] forget pre-activation (f_b_proj output); A_log: [H];
    dt_bias: [H, D]. Returns fp32 g with f's shape, g <= 0.

    Kimi Linear (lower_bound None): g = -exp(A_log) * softplus(f + dt_bias).
    K3 bounded (lower_bound lb in [-5, 0)): g = lb * sigmoid(exp(A_log) * (f + dt_bias)),
    so g lies in (lb, 0) and a >= exp(lb).
    """
    A = A_log.float().exp()[:, None]          # [H, 1], broadcast over D
    x = f.float() + dt_bias.float()
    if lower_bound is None:
        return -A * F.softplus(x)
    if not -5.0 <= lower_bound < 0.0:
        raise ValueError(f"lower_bound must be in [-5, 0), got {lower_bound}")
    return lower_bound * torch.sigmoid(A * x)


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum(x^2, last dim) + eps) in fp32; x: [..., D]."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def short_conv(x: Tensor, weight: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """Causal depthwise conv (width W, no bias) followed by SiLU.

    x: [..., T, C]; weight: [C, W] with tap W-1 on the current input and tap 0 on
    the oldest; state: [..., W-1, C], the previous W-1 inputs, oldest first (zeros
    for a fresh sequence); leading dims batch independent sequences.
    Returns y: [..., T, C] fp32 = silu(conv(x)), and new_state: [..., W-1, C] in
    state's dtype = the last W-1 rows of [state; x] (also right when T < W-1).
    """
    C, W = weight.shape
    assert x.shape[-1] == C and tuple(state.shape[-2:]) == (W - 1, C), (x.shape, weight.shape, state.shape)
    xs = torch.cat([state.float(), x.float()], dim=-2)    # [..., W-1+T, C]
    # windows[..., t, c, w] = xs[..., t + w, c]: tap w sees input t + w - (W-1).
    windows = xs.unfold(-2, W, 1)                          # [..., T, C, W]
    y = F.silu((windows * weight.float()).sum(-1))
    new_state = xs[..., xs.shape[-2] - (W - 1):, :].to(state.dtype)
    return y, new_state


def delta_rule_recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                         state: Tensor) -> tuple[Tensor, Tensor]:
    """Token-by-token gated delta rule (the definition; decode does T=1).

    q, k: [T, H, K] (L2-normalized; q already scaled by K^-0.5); v: [T, H, V];
    g: [T, H, K] log decay; beta: [T, H] (post-sigmoid); state: [H, V, K].
    Returns o: [T, H, V] fp32 and a new fp32 state [H, V, K] (input untouched).
    """
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    S = state.float().clone()
    o = v.new_zeros(v.shape)
    for t in range(q.shape[0]):
        S = S * g[t].exp()[:, None, :]                     # decay key columns
        Sk = torch.einsum("hvk,hk->hv", S, k[t])
        u = beta[t][:, None] * (v[t] - Sk)                 # [H, V]
        S = S + u[:, :, None] * k[t][:, None, :]           # rank-1 update u k^T
        o[t] = torch.einsum("hvk,hk->hv", S, q[t])
    return o, S


def _segment_log_decay(g: Tensor) -> Tensor:
    """D[h, i, j, :] = sum_{j < t <= i} g[h, t, :] for i >= j, -inf for i < j.

    g: [H, C, K] -> [H, C, C, K]. Summing each segment directly (instead of
    subtracting two cumulative sums) avoids cancellation when the cumsum is
    large (it reaches -320 and beyond); the -inf above the diagonal makes
    exp() give exactly 0 there instead of overflowing. Every finite entry is <= 0.
    """
    C = g.shape[1]
    idx = torch.arange(C, device=g.device)
    after_j = idx[:, None] > idx[None, :]                  # [t, j]: t > j
    terms = torch.where(after_j[None, :, :, None], g[:, :, None, :], 0.0)
    seg = terms.cumsum(dim=1)                               # over t -> index i
    causal = idx[:, None] >= idx[None, :]                   # [i, j]: i >= j
    return seg.masked_fill(~causal[None, :, :, None], float("-inf"))


def _chunk_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                S: Tensor) -> tuple[Tensor, Tensor]:
    """One chunk of the WY/UT form. Head-major fp32 inputs: q, k, g [H, C, K],
    v [H, C, V], beta [H, C], S [H, V, K] (state before the chunk).

    With G_i = sum_{t<=i} g_t, unrolling the recurrence inside the chunk gives
        S_i = S diag(e^{G_i}) + sum_{j<=i} u_j (k_j * e^{G_i - G_j})^T
    and the corrections u solve the unit lower-triangular system
        u_i + beta_i sum_{j<i} (k_i . k_j e^{G_i-G_j}) u_j = beta_i (v_i - S (k_i * e^{G_i})).
    """
    H, C, _ = q.shape
    seg = _segment_log_decay(g)                             # [H, C, C, K]
    decay = seg.exp()                                       # 0 above the diagonal
    G = seg[:, :, 0, :] + g[:, :1, :]                       # cumulative from chunk start, <= 0
    decay_to_end = decay[:, -1]                             # [H, C, K] = e^{G_last - G_j}

    # Pairwise decayed inner products (i >= j nonzero only).
    Akk = (k[:, :, None, :] * k[:, None, :, :] * decay).sum(-1)    # [H, C, C]
    Aqk = (q[:, :, None, :] * k[:, None, :, :] * decay).sum(-1)    # [H, C, C]

    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    L = eye + beta[:, :, None] * Akk.tril(-1)
    kG = k * G.exp()
    rhs = beta[:, :, None] * (v - torch.einsum("hck,hvk->hcv", kG, S))
    u = torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True)   # [H, C, V]

    o = torch.einsum("hck,hvk->hcv", q * G.exp(), S) + Aqk @ u
    S_new = S * G[:, -1].exp()[:, None, :] + torch.einsum("hcv,hck->hvk", u, k * decay_to_end)
    return o, S_new


# `delta_rule_chunked`'s chunk: a prompt prefilled in pieces that start on multiples of it runs
# the same chunks, and so gets the same bits, as prefilled whole (pdserve/prefill/scheduler.py)
CHUNK_TOKENS = 16


def delta_rule_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                       state: Tensor, chunk_size: int = CHUNK_TOKENS) -> tuple[Tensor, Tensor]:
    """Chunk-parallel form of `delta_rule_recurrent` (same shapes and result).

    Processes chunks of `chunk_size` tokens (the last one may be partial;
    T=0 returns an empty o and a copy of the state). Only exponentiates
    non-positive log decays, so it is safe for arbitrarily strong gates.
    Memory and the pairwise-decay work are O(H * chunk_size^2 * K) per chunk, i.e. linear in
    chunk_size per token: 16 ran 5.7x faster than 64 on the CPU at kimi-linear head shapes
    (576 tokens, 8 heads, K = V = 128: 118 vs 676 ms) with the same error against the float64
    recurrence (3.3e-7).
    """
    T, H, _ = q.shape
    V = v.shape[-1]
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    S = state.float().clone()
    o = torch.zeros(T, H, V, dtype=torch.float32, device=v.device)
    for s in range(0, T, chunk_size):
        e = min(s + chunk_size, T)
        hm = lambda t: t[s:e].transpose(0, 1)               # [C, H, ...] -> [H, C, ...]
        o_c, S = _chunk_step(hm(q), hm(k), hm(v), hm(g), hm(beta), S)
        o[s:e] = o_c.transpose(0, 1)
    return o, S


def gated_rmsnorm(o: Tensor, weight: Tensor, gate: Tensor, eps: float) -> Tensor:
    """o * rsqrt(mean(o^2) + eps) * weight * sigmoid(gate), per head over the
    last dim D. o, gate: [..., D]; weight: [D]. Returns fp32."""
    o = o.float()
    rms = torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps)
    return o * rms * weight.float() * torch.sigmoid(gate.float())
