"""Torch reference of the MoE router for decode steps (op "moe_route", backend "reference").

Readable and capturable: device ops only (no host sync), so it also serves inside a CUDA graph
when the CuTe DSL kernel is refused. The selection itself is `pdserve.model.moe.route`, the
model's own router; this file adds the pair layout the grouped expert GEMMs read:

    pairs p = 0..P-1 (P = B * S, S = top_k + shared) ordered by (expert, token); the shared
    expert is group E, every token once, weight 1.0, in slot top_k.
    pair_token[p], pair_weight[p]: the pair's token and routing weight (fp32);
    token_pair[t, s]: the pair of token t's slot s (slots in top-k order);
    group_end[g]: the end of group g's pairs (cumulative), g = 0..E-1+shared;
    run_expert[r], run_start[r] (r < R = min(E, B * top_k) + shared, run_start has R + 1): the
    groups with pairs, compacted: the experts some token chose in ascending order, then the
    shared expert; the runs left over are empty (expert 0, start P).
"""
from __future__ import annotations

import torch

from pdserve.model.moe import route


def moe_route_reference(logits, bias, top_k: int, groups: int, topk_group: int, func: str,
                        renormalize: bool, scaling: float, shared: int, pair_token,
                        pair_weight, token_pair, group_end, run_expert, run_start):
    """Fill the six outputs in place (shapes in the module docstring); returns them."""
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
    ends = counts.cumsum(0)
    group_end.copy_(ends)
    # runs: group g with pairs goes to run (number of groups with pairs before g)
    R, P = run_expert.shape[0], B * S
    used = counts > 0
    slot = torch.where(used, used.cumsum(0) - 1, R)             # R: a dummy slot, dropped
    ids_all = torch.arange(E + shared, device=dev)
    expert = torch.zeros(R + 1, dtype=run_expert.dtype, device=dev).scatter_(
        0, slot, ids_all.to(run_expert.dtype))
    start = torch.full((R + 1,), P, dtype=run_start.dtype, device=dev).scatter_(
        0, slot, (ends - counts).to(run_start.dtype))
    run_expert.copy_(expert[:R])
    run_start.copy_(torch.cat([start[:R], start.new_full((1,), P)]))
    return pair_token, pair_weight, token_pair, group_end, run_expert, run_start
