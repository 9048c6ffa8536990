"""The fp8 kernel's query roundings, in torch (the reference applies them; the CPU tests check
the kernel's numerics with them).

Over an fp8 cache the kernel multiplies e4m3 keys by an e4m3 query: per request (per CTA in the
kernel) s = 2^floor(log2(448 / max|q|)), Q_hi = e4m3(s q) and, for the two-term query,
Q_lo = e4m3(s q - Q_hi). fp8_query="single" uses Q_hi alone (as vLLM's fp8 MLA path rounds the
query); "split" uses both, ~1000x below bf16 rounding, which the reference treats as unrounded.
"""
from __future__ import annotations

import torch

from pdserve.kernels.mla_decode.plan import FP8_QUERY_MODES, check_fp8_query

__all__ = ["E4M3_MAX", "FP8_QUERY_MODES", "check_fp8_query", "quantize_query_e4m3",
           "split_query_e4m3"]

E4M3_MAX = 448.0


def split_query_e4m3(q: torch.Tensor):
    """The kernel's query split: q [..., H, 576] (any float dtype; the kernel reads bf16) ->
    (Q_hi, Q_lo as torch.float8_e4m3fn, s float32 [..., 1, 1]) with, per request,
    s = 2^floor(log2(fp32(448 / max(max|q|, 2^-100)))), Q_hi = e4m3(s q),
    Q_lo = e4m3(s q - Q_hi), both round-to-nearest-even (cvt.rn.satfinite; |s q| <= 448, so
    nothing saturates). q ~= (Q_hi + Q_lo) / s; the kernel scales S^T by 1 / s through the
    softmax scale. It computes s per CTA, i.e. per head group where a call spreads the heads
    over several CTAs, which changes only values in e4m3's subnormal range."""
    qf = q.float()
    amax = qf.abs().amax(dim=(-2, -1), keepdim=True).clamp_min(2.0 ** -100)
    _, e = torch.frexp(E4M3_MAX / amax)                          # div.rn.f32
    s = torch.ldexp(torch.ones_like(amax), e - 1)                # and.b32 0x7F800000
    y = qf * s                                                   # exact (power of two)
    hi = y.to(torch.float8_e4m3fn)
    lo = (y - hi.float()).to(torch.float8_e4m3fn)                # y - hi exact in fp32
    return hi, lo, s


def quantize_query_e4m3(q: torch.Tensor) -> torch.Tensor:
    """fp8_query="single": each request's query as the kernel's one e4m3 term, dequantized
    (float32): Q_hi / s of split_query_e4m3."""
    hi, _, s = split_query_e4m3(q)
    return hi.float() / s
