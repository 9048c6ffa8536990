"""Routed experts for decode steps (op "moe_experts"): torch reference + CuTe DSL sm_90a kernel.

    impl(x [B, hidden] bf16, w13 [G, 2I, hidden] bf16, w2 [G, hidden, I] bf16,
         pair_token [P] int32, group_end [G] int32, shared=False) -> rows [P, hidden] bf16

The pairs come from `moe_route` (by expert, then token; the shared expert is the last group);
rows[p] is pair p's expert output before its routing weight, which the combine in
`add_rmsnorm` applies. Only the groups some pair chose are read (reference.py). `shared` says
the last group is a shared expert (every token's pair): a hint that lets the kernel fetch its
weights before the routing is known; results do not depend on it.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from .. import registry
from ..guards import cutedsl_refusal, sm90_refusal
from .reference import moe_experts_reference

OP = "moe_experts"
MAX_TOKENS = 64   # tokens per step: every run of pairs fits one MMA N tile


def moe_experts_problem(x, w13, w2, pair_token, group_end, shared=False) -> dict[str, Any]:
    dev = x.device
    return {
        "device_type": dev.type,
        "capability": torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None,
        "batch": x.shape[0], "hidden": x.shape[1], "inter": w2.shape[2],
        "groups": w13.shape[0], "pairs": pair_token.shape[0],
        "shapes_agree": (w13.shape[1:] == (2 * w2.shape[2], x.shape[1])
                         and w2.shape[:2] == (w13.shape[0], x.shape[1])
                         and group_end.shape == (w13.shape[0],)),
        "dtypes": (x.dtype, w13.dtype, w2.dtype, pair_token.dtype, group_end.dtype),
        "contiguous": all(t.is_contiguous() for t in (x, w13, w2, pair_token, group_end)),
    }


def cutedsl_guard(p: Mapping[str, Any]) -> str | None:
    why = sm90_refusal(p["device_type"], p["capability"])
    if why:
        return why
    if not 1 <= p["batch"] <= MAX_TOKENS:
        return f"batch {p['batch']} not in 1..{MAX_TOKENS}"
    if p["hidden"] % 128 or p["inter"] % 64:
        return (f"hidden must be a multiple of 128 and inter of 64, got hidden {p['hidden']}, "
                f"inter {p['inter']}")
    if not p["shapes_agree"]:
        return "x, w13, w2 and group_end shapes disagree"
    want = (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.int32, torch.int32)
    if p["dtypes"] != want:
        return f"dtypes must be bf16 x/w13/w2 and int32 indices, got {p['dtypes']}"
    if not p["contiguous"]:
        return "x, weights and indices must be contiguous"
    return cutedsl_refusal()


def moe_experts_cutedsl(x, w13, w2, pair_token, group_end, shared=False):
    from .cutedsl import launch
    return launch(x, w13, w2, pair_token, group_end, shared)


registry.register(OP, registry.REFERENCE, moe_experts_reference)
registry.register(OP, "cutedsl", moe_experts_cutedsl, cutedsl_guard)

__all__ = ["OP", "MAX_TOKENS", "moe_experts_problem", "cutedsl_guard", "moe_experts_cutedsl",
           "moe_experts_reference"]
