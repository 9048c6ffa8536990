"""Routed experts over (token, expert) pairs (op "moe_experts"): torch reference + CuTe DSL
sm_90a kernel for small decode batches.

    impl(x [B, hidden] bf16, w13 [G, 2I, hidden] bf16 (gate rows, then up rows),
         w2 [G, hidden, I] bf16, pair_token [P] int32, run_expert [R] int32,
         run_start [R + 1] int32, act [P, I] bf16, rows [P, hidden] bf16) -> rows

with the pair and run layout of `pdserve.kernels.moe_route`. The kernel streams each chosen
expert's weights once through registers and multiplies them with the run's tokens on CUDA
cores: a weight stream, fit for runs of a few tokens (small batches); larger batches go to the
grouped GEMMs (tensor cores) in `pdserve.decode.fused_step`.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from .. import registry
from .reference import moe_experts_reference

OP = "moe_experts"


def moe_experts_problem(x, w13, w2, pair_token, run_expert, run_start, act, rows
                        ) -> dict[str, Any]:
    dev = x.device
    return {
        "device_type": dev.type,
        "capability": torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None,
        "hidden": x.shape[1], "inter": w2.shape[2],
        "dtypes": {t.dtype for t in (x, w13, w2, act, rows)},
        "index_dtypes": {t.dtype for t in (pair_token, run_expert, run_start)},
        "contiguous": all(t.is_contiguous() for t in (w13, w2, pair_token, run_expert,
                                                      run_start, act, rows))
        and x.stride(1) == 1 and x.stride(0) % 8 == 0,
        "shapes_ok": w13.shape[1] == 2 * w2.shape[2] and w13.shape[2] == x.shape[1]
        and w2.shape[1] == x.shape[1],
    }


def cutedsl_guard(p: Mapping[str, Any]) -> str | None:
    if p["device_type"] != "cuda":
        return f"needs a CUDA device, got {p['device_type']}"
    if p["capability"] != (9, 0):
        return f"needs sm_90 (Hopper), got capability {p['capability']}"
    if p["hidden"] % 8 or p["inter"] % 8:
        return f"hidden and intermediate sizes must be multiples of 8, got {p['hidden']}, {p['inter']}"
    if p["dtypes"] != {torch.bfloat16} or p["index_dtypes"] != {torch.int32}:
        return "activations and weights must be bf16, indices int32"
    if not (p["contiguous"] and p["shapes_ok"]):
        return "weights, indices and outputs must be contiguous and of matching shapes"
    try:
        import cutlass  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the environment
        return f"CuTe DSL unavailable: {type(exc).__name__}: {exc}"
    return None


def moe_experts_cutedsl(*args, **kwargs):
    from .cutedsl import launch
    return launch(*args, **kwargs)


registry.register(OP, registry.REFERENCE, moe_experts_reference)
registry.register(OP, "cutedsl", moe_experts_cutedsl, cutedsl_guard)

__all__ = ["OP", "moe_experts_problem", "cutedsl_guard", "moe_experts_cutedsl",
           "moe_experts_reference"]
