"""Residual add + RMSNorm (op "add_rmsnorm"): torch reference + CuTe DSL sm_90a kernel.

    impl(residual [B, D], delta, weight [D], eps, out [B, D], residual_out=None,
         token_pair=None, pair_weight=None) -> out

delta: None, rows [B, D], or a grouped MoE's pair rows [P, D] combined per token through
token_pair [B, S] / pair_weight [P] (see reference.py). bf16 rows; inner stride 1.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from .. import registry
from ..guards import cutedsl_refusal, sm90_refusal
from .reference import add_rmsnorm_reference

OP = "add_rmsnorm"


def add_rmsnorm_problem(residual, delta, weight, eps, out, residual_out=None, token_pair=None,
                        pair_weight=None) -> dict[str, Any]:
    rows = [t for t in (residual, delta, out, residual_out) if t is not None]
    dev = residual.device
    return {
        "device_type": dev.type,
        "capability": torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None,
        "dim": residual.shape[-1],
        "dtypes": {t.dtype for t in rows + [weight]},
        "inner_contiguous": all(t.stride(-1) == 1 for t in rows) and weight.is_contiguous(),
        "aligned16": all(t.data_ptr() % 16 == 0 and (t.stride(0) * 2) % 16 == 0 for t in rows),
        "pairs_ok": token_pair is None or (token_pair.dtype == torch.int32
                                           and token_pair.is_contiguous()
                                           and pair_weight.dtype == torch.float32),
    }


def cutedsl_guard(p: Mapping[str, Any]) -> str | None:
    why = sm90_refusal(p["device_type"], p["capability"])
    if why:
        return why
    if p["dim"] % 8 or p["dim"] > 8192:
        return f"dim must be a multiple of 8 up to 8192, got {p['dim']}"
    if p["dtypes"] != {torch.bfloat16}:
        return f"rows and weight must be bf16, got {p['dtypes']}"
    if not (p["inner_contiguous"] and p["aligned16"]):
        return "rows need inner stride 1 and 16-byte aligned rows"
    if not p["pairs_ok"]:
        return "token_pair must be contiguous int32 and pair_weight fp32"
    return cutedsl_refusal()


def add_rmsnorm_cutedsl(*args, **kwargs):
    from .cutedsl import launch
    return launch(*args, **kwargs)


registry.register(OP, registry.REFERENCE, add_rmsnorm_reference)
registry.register(OP, "cutedsl", add_rmsnorm_cutedsl, cutedsl_guard)

__all__ = ["OP", "add_rmsnorm_problem", "cutedsl_guard", "add_rmsnorm_cutedsl",
           "add_rmsnorm_reference"]
