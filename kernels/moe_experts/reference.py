"""Torch reference of the routed experts for decode steps (op "moe_experts", backend
"reference").

Readable and capturable (device ops only): the pairs (token, expert) as `moe_route` lays them
out (by expert, group g's pairs ending at group_end[g]), the token rows gathered in pair order,
and two grouped GEMMs over the stacked expert weights, which read only the groups some pair
chose:
    act[p]  = silu(x[t] W1_g^T) * (x[t] W3_g^T)     (bf16 products, as the model's MLP rounds)
    rows[p] = act[p] W2_g^T                          (unweighted; the combine applies weights)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_experts_reference(x, w13, w2, pair_token, group_end, shared=False):
    """rows [P, hidden] (x's dtype) for x [B, hidden], w13 [G, 2I, hidden] (gate rows then up
    rows), w2 [G, hidden, I], pair_token [P] int32, group_end [G] int32 (`shared`, a fetch
    hint of the kernel, changes nothing here)."""
    inter = w2.shape[2]
    gu = torch._grouped_mm(x.index_select(0, pair_token), w13.transpose(1, 2), offs=group_end)
    act = F.silu(gu[:, :inter]) * gu[:, inter:]
    return torch._grouped_mm(act, w2.transpose(1, 2), offs=group_end)
