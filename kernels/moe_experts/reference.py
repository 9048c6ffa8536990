"""Torch reference of the routed-experts op (op "moe_experts", backend "reference").

Readable math, any device; it loops over the runs on the host (so it syncs and cannot be
captured in a CUDA graph: it is the oracle, not the decode path, whose capturable fallback is
the grouped GEMM form in `pdserve.decode.fused_step`). Per pair p of run r, e = run_expert[r],
t = pair_token[p] (the layout of `pdserve.kernels.moe_route`):

    act[p] = bf16(silu(W1_e x_t) * (W3_e x_t))       (fp32 accumulation, one rounding)
    rows[p] = bf16(W2_e act[p])

The routing weights are applied where the pairs are combined (`add_rmsnorm`'s pairs delta).
"""
from __future__ import annotations

import torch.nn.functional as F


def moe_experts_reference(x, w13, w2, pair_token, run_expert, run_start, act, rows):
    """Fill `act` [P, I] and `rows` [P, hidden] (bf16) in place; return `rows`."""
    inter = w2.shape[2]
    starts = run_start.tolist()
    for r, e in enumerate(run_expert.tolist()):
        lo, hi = starts[r], starts[r + 1]
        if lo == hi:
            continue
        h = x[pair_token[lo:hi].long()].float() @ w13[e].float().t()   # [n, 2I]: gate | up
        act[lo:hi] = (F.silu(h[:, :inter]) * h[:, inter:]).to(act.dtype)
        rows[lo:hi] = (act[lo:hi].float() @ w2[e].float().t()).to(rows.dtype)
    return rows
