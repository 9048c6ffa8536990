"""Skinny projection for decode steps (op "decode_linear"): torch reference + CuTe DSL sm_90a
kernel.

    impl(x [B, K] bf16, w [N, K] bf16) -> y [B, N] bf16,   y = x @ W^T, fp32 accumulation

At decode batch sizes (B <= 64) the op streams W; the kernel splits K over the grid so every
SM streams, and the last CTA of each weight-row tile sums the split partials in a fixed order
(cutedsl.py): results are reproducible run to run and across CUDA-graph replays.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from .. import registry
from ..guards import cutedsl_refusal, sm90_refusal
from .reference import decode_linear_reference

OP = "decode_linear"
MAX_TOKENS = 64   # tokens per step: the batch fits one MMA N tile


def token_tile(batch: int) -> int:
    """The MMA N tile for a step of `batch` tokens: the batch rounded up to 8, 16, 32 or 64."""
    return next(n for n in (8, 16, 32, 64) if batch <= n)


def decode_linear_problem(x, w, splits: int | None = None) -> dict[str, Any]:
    """The guard's view of a call; `splits`: the K split the kernel will run with (None: its
    default, a divisor of K / 64)."""
    dev = x.device
    return {
        "device_type": dev.type,
        "capability": torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None,
        "batch": x.shape[0], "k": x.shape[1], "n": w.shape[0], "w_k": w.shape[1],
        "splits": splits or 1, "dtypes": (x.dtype, w.dtype),
        "contiguous": x.is_contiguous() and w.is_contiguous(),
        "aligned": x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0,
    }


def cutedsl_guard(p: Mapping[str, Any]) -> str | None:
    why = sm90_refusal(p["device_type"], p["capability"])
    if why:
        return why
    if p["dtypes"] != (torch.bfloat16, torch.bfloat16):
        return f"dtypes must be bf16 x and w, got {p['dtypes']}"
    if not 1 <= p["batch"] <= MAX_TOKENS:
        return f"batch {p['batch']} not in 1..{MAX_TOKENS}"
    if p["k"] != p["w_k"]:
        return f"x has {p['k']} columns but w has {p['w_k']}"
    # the last weight-row tile may be partial (TMA zero-fills, the store masks): any N works
    if p["n"] < 1:
        return f"n must be positive, got {p['n']}"
    if p["k"] % (64 * p["splits"]):
        return f"k {p['k']} is not a multiple of 64 * splits = {64 * p['splits']}"
    if not p["contiguous"]:
        return "x and w must be contiguous"
    if not p["aligned"]:
        return "x and w must start on 16-byte boundaries (TMA)"
    return cutedsl_refusal()


def decode_linear_cutedsl(x, w):
    from .cutedsl import launch
    return launch(x, w)


registry.register(OP, registry.REFERENCE, decode_linear_reference)
registry.register(OP, "cutedsl", decode_linear_cutedsl, cutedsl_guard)

__all__ = ["OP", "MAX_TOKENS", "token_tile", "decode_linear_problem", "cutedsl_guard",
           "decode_linear_cutedsl", "decode_linear_reference"]
