"""Torch reference of the residual add + RMSNorm (op "add_rmsnorm", backend "reference").

    r = bf16(residual + d)       d = delta, rounded to the residual's dtype
    out = rms_norm(r, weight)    (pdserve.model.norms.rms_norm: fp32 math, one rounding)

`delta` is None (r = residual), rows [B, D], or, with `token_pair`, the rows of a grouped MoE:
d[t] = sum over slots s of pair_weight[p] * delta[p] with p = token_pair[t, s] (fp32, slot
order) — the weighted combine of a token's experts folded into the next norm. Writes `out`
and, when given, `residual_out` (either may be a strided view; residual_out may be residual).
"""
from __future__ import annotations

import torch

from pdserve.model.norms import rms_norm


def combine_pairs(rows: torch.Tensor, token_pair: torch.Tensor,
                  pair_weight: torch.Tensor) -> torch.Tensor:
    """fp32 [B, D]: each token's pair rows weighted and summed in slot order."""
    w = pair_weight[token_pair].float()                     # [B, S]
    terms = rows[token_pair].float() * w[..., None]         # [B, S, D]
    acc = terms[:, 0]
    for s in range(1, terms.shape[1]):
        acc = acc + terms[:, s]
    return acc


def add_rmsnorm_reference(residual, delta, weight, eps: float, out, residual_out=None,
                          token_pair=None, pair_weight=None):
    r = residual
    if delta is not None:
        d = delta if token_pair is None else combine_pairs(delta, token_pair, pair_weight)
        r = residual + d.to(residual.dtype)
    if residual_out is not None:
        residual_out.copy_(r)
    out.copy_(rms_norm(r, weight, eps))
    return out
