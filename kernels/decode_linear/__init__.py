"""Skinny projection for decode steps (op "decode_linear"): torch reference + CuTe DSL sm_90a
kernel.

    impl(x [B, K] bf16, w [N, K] bf16, tuning=None) -> y [B, N] bf16,   y = x @ W^T,
    fp32 accumulation; x's rows may be strided (a column slice of a wider tensor)

At decode batch sizes (B <= 64) the op streams W; the kernel splits K over the grid so every
SM streams, and the last CTA of each weight-row tile sums the split partials in a fixed order
(cutedsl.py): results are reproducible run to run and across CUDA-graph replays.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import msgspec
import torch

from .. import registry
from ..guards import cutedsl_refusal, sm90_refusal
from .reference import decode_linear_reference

OP = "decode_linear"
MAX_TOKENS = 64   # tokens per step: the batch fits one MMA N tile


def token_tile(batch: int) -> int:
    """The MMA N tile for a step of `batch` tokens: the batch rounded up to 8, 16, 32 or 64."""
    return next(n for n in (8, 16, 32, 64) if batch <= n)


class LinearTuning(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The kernel's tuning for one projection (each field is part of the compiled variant's key;
    the reference ignores them).

    bm: weight rows per CTA (64 or 128). splits: K chunks (None: ~1 CTA per SM; a value that
    does not divide K / 64 is lowered to their greatest common divisor). stages: ring
    depth."""
    bm: int = 64
    splits: int | None = None
    stages: int = 6


DEFAULT_TUNING = LinearTuning()


def resolved_splits(k: int, tuning: LinearTuning | None) -> int | None:
    """The K split a call of reduction length `k` runs with (None: the kernel's default)."""
    splits = (tuning or DEFAULT_TUNING).splits
    return math.gcd(splits, max(k // 64, 1)) if splits else None


def decode_linear_problem(x, w, tuning: LinearTuning | None = None) -> dict[str, Any]:
    """The guard's view of a call under `tuning` (None: the defaults)."""
    splits = resolved_splits(x.shape[1], tuning)
    dev = x.device
    return {
        "device_type": dev.type,
        "capability": torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None,
        "batch": x.shape[0], "k": x.shape[1], "n": w.shape[0], "w_k": w.shape[1],
        "splits": splits or 1, "dtypes": (x.dtype, w.dtype),
        "contiguous": x.stride(-1) == 1 and w.is_contiguous(),
        "aligned": (x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0
                    and (x.stride(0) * x.element_size()) % 16 == 0),
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
        return "x needs inner stride 1 and w must be contiguous"
    if not p["aligned"]:
        return "x and w must start on 16-byte boundaries and x's rows be 16-byte strided (TMA)"
    return cutedsl_refusal()


def decode_linear_cutedsl(x, w, tuning: LinearTuning | None = None):
    from .cutedsl import launch
    t = tuning or DEFAULT_TUNING
    return launch(x, w, bm=t.bm, splits=resolved_splits(x.shape[1], t), stages=t.stages)


registry.register(OP, registry.REFERENCE, decode_linear_reference)
registry.register(OP, "cutedsl", decode_linear_cutedsl, cutedsl_guard)

__all__ = ["OP", "MAX_TOKENS", "token_tile", "LinearTuning", "DEFAULT_TUNING",
           "resolved_splits", "decode_linear_problem", "cutedsl_guard",
           "decode_linear_cutedsl", "decode_linear_reference"]
