"""MoE router for decode steps (op "moe_route"): torch reference + CuTe DSL sm_90a kernel.

    impl(logits [B, E] fp32, bias [E] fp32 | None, top_k, groups, topk_group, func,
         renormalize, scaling, shared (0 | 1), pair_token [P] int32, pair_weight [P] fp32,
         token_pair [B, S] int32, group_end [E + shared] int32) -> the four outputs

P = B * S, S = top_k + shared. The layout (pairs by expert then token, the shared expert as
the last group) is what the grouped expert GEMMs and the combine in `add_rmsnorm` read; see
reference.py.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from .. import registry
from ..guards import cutedsl_refusal, sm90_refusal
from .reference import moe_route_reference

OP = "moe_route"
MAX_TOKENS = 64   # tokens per step the one-CTA kernel holds in shared memory


def moe_route_problem(logits, bias, top_k, groups, topk_group, func, renormalize, scaling,
                      shared, pair_token, pair_weight, token_pair, group_end) -> dict[str, Any]:
    dev = logits.device
    outs = (pair_token, pair_weight, token_pair, group_end)
    return {
        "device_type": dev.type,
        "capability": torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None,
        "batch": logits.shape[0], "experts": logits.shape[1], "top_k": top_k,
        "groups": groups, "func": func, "shared": shared,
        "dtypes": (logits.dtype, None if bias is None else bias.dtype, pair_token.dtype,
                   pair_weight.dtype, token_pair.dtype, group_end.dtype),
        "contiguous": logits.is_contiguous() and all(t.is_contiguous() for t in outs),
    }


def cutedsl_guard(p: Mapping[str, Any]) -> str | None:
    why = sm90_refusal(p["device_type"], p["capability"])
    if why:
        return why
    if not 1 <= p["batch"] <= MAX_TOKENS:
        return f"batch {p['batch']} not in 1..{MAX_TOKENS}"
    if p["experts"] % 32 or not 32 <= p["experts"] <= 512:
        return f"experts must be a multiple of 32 in 32..512, got {p['experts']}"
    if not 1 <= p["top_k"] <= 16:
        return f"top_k must be in 1..16, got {p['top_k']}"
    if p["groups"] != 1:
        return f"grouped top-k (num_expert_group={p['groups']}) is not in the kernel"
    if p["func"] != "sigmoid":
        return f"router function {p['func']!r}: the kernel has sigmoid only"
    if p["shared"] not in (0, 1):
        return f"shared must be 0 or 1, got {p['shared']}"
    want = (torch.float32, torch.float32, torch.int32, torch.float32, torch.int32, torch.int32)
    if tuple(d if d is not None else torch.float32 for d in p["dtypes"]) != want:
        return f"dtypes must be fp32 logits/bias/weights and int32 indices, got {p['dtypes']}"
    if not p["contiguous"]:
        return "logits and outputs must be contiguous"
    return cutedsl_refusal()


def moe_route_cutedsl(*args):
    from .cutedsl import launch
    return launch(*args)


registry.register(OP, registry.REFERENCE, moe_route_reference)
registry.register(OP, "cutedsl", moe_route_cutedsl, cutedsl_guard)

__all__ = ["OP", "moe_route_problem", "cutedsl_guard", "moe_route_cutedsl",
           "moe_route_reference"]
