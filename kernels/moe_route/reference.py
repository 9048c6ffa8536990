"""Torch reference of the MoE router for decode steps (op "moe_route", backend "reference").

Readable and capturable: device ops only (no host sync), so it also serves inside a CUDA graph
when the CuTe DSL kernel is refused. The selection itself is `pdserve.model.moe.route`, the
model's own router; this file adds the pair layout the grouped expert GEMMs read:

    pairs p = 0..P-1 (P = B * S, S = top_k + shared) ordered by (expert, token); the shared
    expert is group E, every token once, weight 1.0, in slot top_k.
    pair_token[p], pair_weight[p]: the pair's token and routing weight (fp32);
    token_pair[t, s]: the pair of token t's slot s (slots in top-k order);
    group_end[g]: the end of group g's pairs (cumulative), g = 0..E-1+shared.
"""
from __future__ import annotations

import torch

from pdserve.model.moe import route


def moe_route_reference(logits, bias, top_k: int, groups: int, topk_group: int, func: str,
                        renormalize: bool, scaling: float, shared: int, pair_token,
                        pair_weight, token_pair, group_end):
    """Fill the four outputs in place (shapes in the module docstring); returns them."""
    B, E = logits.shape
    weights, ids = route(logits, bias, top_k, groups, topk_group, func, renormalize, scaling)
    dev = logits.device
    if shared:
        ids = torch.cat([ids, torch.full((B, 1), E, dtype=ids.dtype, device=dev)], 1)
        weights = torch.cat([weights, torch.ones(B, 1, dtype=weights.dtype, device=dev)], 1)
    S = ids.shape[1]
    key = (ids * B + torch.arange(B, device=dev)[:, None]).flatten()   # unique per pair
    order = key.argsort()                                              # pair -> t * S + s
    pair_token.copy_(order // S)
    pair_weight.copy_(weights.flatten()[order])
    token_pair.view(-1).scatter_(0, order, torch.arange(B * S, dtype=token_pair.dtype,
                                                        device=dev))
    counts = torch.zeros(E + shared, dtype=torch.int64, device=dev).scatter_add_(
        0, ids.flatten(), torch.ones(B * S, dtype=torch.int64, device=dev))
    group_end.copy_(counts.cumsum(0))
    return pair_token, pair_weight, token_pair, group_end
