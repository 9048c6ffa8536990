"""Torch reference of the fused KDA decode step (op "kda_decode", backend "reference").

It composes the model core's readable math (`pdserve.model.kda_ops`) into the exact batched,
pool-addressed, in-place op that the CuTe DSL kernel implements; there is no second copy of the
math here, only gathering, packing and scattering.

The op (one decode step, T = 1 per request; D = K = V = 128 for the kernel, any D here):

  inputs (per request b, already projected, pre-conv):
    q, k, v, g_out, f : [B, H*D] bf16 (rows may be strided, inner stride 1)
    beta_raw          : [B, H]   bf16
  parameters:
    conv_weight [3*H*D, W] fp32 (tap W-1 multiplies the current input), A_log [H] fp32,
    dt_bias [H*D] fp32, norm_weight [D] fp32, eps, lower_bound (float: K3 bounded decay;
    None: Kimi-Linear softplus decay)
  pools (per KDA layer, docs/design.md §3), updated in place:
    state_pool [num_slots, H, V, K] fp32 (value-major, key contiguous)
    conv_pool  bf16, channels packed [q | k | v] (3*H*D), taps oldest first:
               "SD" = [num_slots, W-1, 3*H*D], "DS" = [num_slots, 3*H*D, W-1]
  slot_idx [B] int32: the slot of each request. Slot 0 is padding: that request touches neither
    pool (slot 0 stays bit-identical) and its output row is written as zeros. Two live requests
    must not share a slot in one call.

  per live request and head:
    x~ = silu(conv([state taps; x]))  for x in q, k, v; the conv state rolls (drop oldest, append x)
    q = q~ / sqrt(sum q~^2 + 1e-6) * K^-1/2 ;  k = k~ / sqrt(sum k~^2 + 1e-6)
    beta = sigmoid(beta_raw) ;  g = kda_log_decay(f, A_log, dt_bias, lower_bound)
    S <- S * exp(g) (per key column) ; u = beta (v - S k) ; S <- S + u k^T ; o = S q
    out = o * rsqrt(mean(o^2) + eps) * norm_weight * sigmoid(g_out)   -> bf16 [B, H*D]
"""
from __future__ import annotations

import torch

from pdserve.model.kda_ops import (
    delta_rule_recurrent,
    gated_rmsnorm,
    kda_log_decay,
    l2_normalize,
    short_conv,
)

Tensor = torch.Tensor
L2_EPS = 1e-6


def kda_decode_reference(q: Tensor, k: Tensor, v: Tensor, g_out: Tensor, f: Tensor,
                         beta_raw: Tensor, conv_weight: Tensor, A_log: Tensor, dt_bias: Tensor,
                         norm_weight: Tensor, eps: float, lower_bound: float | None,
                         state_pool: Tensor, conv_pool: Tensor, slot_idx: Tensor,
                         conv_layout: str = "SD", out: Tensor | None = None) -> Tensor:
    """One fused KDA decode step over B requests; updates the pools in place, returns out."""
    B, HD = q.shape
    H = A_log.shape[0]
    D = HD // H
    Wm1 = conv_pool.shape[1] if conv_layout == "SD" else conv_pool.shape[2]
    if conv_layout not in ("SD", "DS"):
        raise ValueError(f"conv_layout must be 'SD' or 'DS', got {conv_layout!r}")
    if out is None:
        out = torch.empty(B, HD, dtype=torch.bfloat16, device=q.device)
    # Every row is computed and padding rows keep what they read (masks, not a gather of the
    # live rows): device ops only, so the op also runs inside a captured CUDA graph.
    slots = slot_idx.long()
    live = slots != 0                                                  # [B]

    # Short conv over the packed channels of all rows at once: requests become channel blocks,
    # so one `short_conv` call serves the whole batch.
    x = torch.cat([q, k, v], dim=1)                                    # [B, 3HD]
    cs_old = conv_pool[slots]
    cs = cs_old if conv_layout == "SD" else cs_old.transpose(1, 2)     # [B, W-1, 3HD]
    y, new_cs = short_conv(x.reshape(1, B * 3 * HD),
                           conv_weight.repeat(B, 1),
                           cs.transpose(0, 1).reshape(Wm1, B * 3 * HD))
    new_cs = new_cs.reshape(Wm1, B, 3 * HD).transpose(0, 1)            # [B, W-1, 3HD]
    new_cs = new_cs if conv_layout == "SD" else new_cs.transpose(1, 2)
    conv_pool[slots] = torch.where(live[:, None, None], new_cs.to(conv_pool.dtype), cs_old)

    y = y.reshape(B, 3, H, D)
    qn = l2_normalize(y[:, 0], L2_EPS) * D ** -0.5                     # [B, H, D]
    kn = l2_normalize(y[:, 1], L2_EPS)
    vv = y[:, 2]
    g = kda_log_decay(f.reshape(B, H, D), A_log, dt_bias.reshape(H, D), lower_bound)
    beta = torch.sigmoid(beta_raw.float())                             # [B, H]

    # Requests x heads as one head axis for the recurrence (T = 1).
    S_old = state_pool[slots]
    o, S = delta_rule_recurrent(qn.reshape(1, B * H, D), kn.reshape(1, B * H, D),
                                vv.reshape(1, B * H, D), g.reshape(1, B * H, D),
                                beta.reshape(1, B * H), S_old.reshape(B * H, D, D))
    state_pool[slots] = torch.where(live[:, None, None, None],
                                    S.reshape(B, H, D, D).to(state_pool.dtype), S_old)
    o = gated_rmsnorm(o.reshape(B, H, D), norm_weight, g_out.reshape(B, H, D), eps)
    out.copy_(torch.where(live[:, None], o.reshape(B, HD).to(out.dtype), 0))   # padding: zeros
    return out
