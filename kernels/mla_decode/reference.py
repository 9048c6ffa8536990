"""Torch reference for absorbed MLA decode attention over the paged latent cache.

Math (k3_decode.md §1.5): the query is already absorbed into the 576-wide latent space,
q = [W_UK^T q_nope (512) | q_pe (64)]; every cached token row is [c_kv (512) | k_pe (64)].

    score_t = softmax_scale * (q . row_t)            over all 576 dims, t < seq_len
    p       = softmax(score)                          over the request's tokens
    out     = sum_t p_t * c_kv_t                      [B, H, 512]
    lse     = ln sum_t exp(score_t)                   [B, H], fp32, scale included

With an fp8 e4m3 cache the stored rows are row_t / kv_scale (one per-tensor float), so the
true row is stored * kv_scale: the scores use scale * kv_scale and the output is multiplied
by kv_scale. W_UV (512 -> 128 per head) and the sigmoid output gate are NOT part of this op:
they stay in torch (decode runtime) for now.

`merge_partials` is the exact LSE combine of partial (out, lse) pairs computed over disjoint
token sets (split-KV inside one GPU, or decode context parallelism across ranks).
"""
from __future__ import annotations

import torch

LATENT_DIM = 512   # kv_lora_rank (c_kv, also the value width)
ROPE_DIM = 64      # qk_rope_head_dim (k_pe; NoPE in Kimi, just 64 more key dims)
HEAD_DIM = LATENT_DIM + ROPE_DIM  # 576


def gather_latent(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
                  b: int) -> torch.Tensor:
    """Rows [seq_len, 576] of request b, in token order, in the cache's dtype."""
    page_tokens = kv_cache.shape[1]
    n_pages = (seq_len + page_tokens - 1) // page_tokens
    pages = block_table[b, :n_pages].long().to(kv_cache.device)
    if kv_cache.element_size() == 1:      # gather fp8 as bytes (index kernels may lack fp8)
        rows = kv_cache.view(torch.uint8)[pages].view(kv_cache.dtype)
    else:
        rows = kv_cache[pages]
    return rows.reshape(n_pages * page_tokens, kv_cache.shape[2])[:seq_len]


E4M3_MAX = 448.0
FP8_QUERY_MODES = ("split", "single")


def check_fp8_query(fp8_query: str) -> str:
    if fp8_query not in FP8_QUERY_MODES:
        raise ValueError(f"fp8_query must be {' or '.join(map(repr, FP8_QUERY_MODES))}, "
                         f"got {fp8_query!r}")
    return fp8_query


def split_query_e4m3(q: torch.Tensor):
    """The fp8 kernel's query split (swapab.py), in torch: q [..., H, 576] (any float dtype; the
    kernel reads bf16) -> (Q_hi, Q_lo as torch.float8_e4m3fn, s float32 [..., 1, 1]) with, per
    request, s = 2^floor(log2(fp32(448 / max(max|q|, 2^-100)))), Q_hi = e4m3(s q),
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


def mla_decode_reference(
    q: torch.Tensor,                 # [B, H, 576] (bf16 / fp16 / fp32 / fp64)
    kv_cache: torch.Tensor,          # [num_pages, page_tokens, 576] bf16 or float8_e4m3fn
    block_table: torch.Tensor,       # [B, max_pages] int32
    seq_lens: torch.Tensor,          # [B] int32, each >= 1
    softmax_scale: float,
    kv_scale: float | None = None,   # per-tensor dequant scale of an fp8 cache
    *,
    compute_dtype: torch.dtype = torch.float32,
    out_dtype: torch.dtype | None = None,
    fp8_query: str = "split",
    **_ignored,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out [B, H, 512] in out_dtype (default q.dtype), lse [B, H] fp32).
    fp8_query="single" with an fp8 cache: the query rounded as the kernel's single e4m3 term
    (quantize_query_e4m3) first; "split" (default): q as given (the kernel's two-term split is
    ~1000x below bf16 rounding)."""
    B, H, D = q.shape
    assert D == HEAD_DIM and kv_cache.shape[-1] == HEAD_DIM, (q.shape, kv_cache.shape)
    out_dtype = out_dtype or q.dtype
    if check_fp8_query(fp8_query) == "single" and kv_cache.element_size() == 1:
        q = quantize_query_e4m3(q)
    scale = 1.0 if kv_scale is None else float(kv_scale)
    lens = [int(x) for x in seq_lens.tolist()]
    out = torch.empty(B, H, LATENT_DIM, dtype=compute_dtype, device=q.device)
    lse = torch.empty(B, H, dtype=compute_dtype, device=q.device)
    for b in range(B):
        assert lens[b] >= 1, "every request has at least one token"
        rows = gather_latent(kv_cache, block_table, lens[b], b).to(compute_dtype) * scale
        qb = q[b].to(compute_dtype)                          # [H, 576]
        s = (qb @ rows.T) * softmax_scale                    # [H, L]
        lse[b] = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse[b][:, None])
        out[b] = p @ rows[:, :LATENT_DIM]
    return out.to(out_dtype), lse.float()


def merge_partials(outs, lses) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact LSE combine of partial attention results over disjoint token sets.

    outs: [S, ..., D] (or a sequence of S tensors [..., D]), each normalized over its own
    tokens; lses: [S, ...] natural-log softmax denominators (-inf for an empty part).
    Returns (out [..., D] fp32, lse [...] fp32). A position whose parts are all empty gets
    out 0 and lse -inf.
    """
    if not torch.is_tensor(outs):
        outs = torch.stack(list(outs))
    if not torch.is_tensor(lses):
        lses = torch.stack(list(lses))
    outs = outs.float()
    lses = lses.float()
    m = lses.amax(dim=0)                                      # [...]
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lses - m_safe)                              # [S, ...]; 0 for empty parts
    denom = w.sum(dim=0)                                      # [...]
    # empty parts may carry garbage (even NaN) in outs: never let it through
    contrib = torch.where(w[..., None] > 0, outs, torch.zeros_like(outs)) * w[..., None]
    out = contrib.sum(dim=0) / torch.where(denom > 0, denom, torch.ones_like(denom))[..., None]
    lse = torch.where(denom > 0, m_safe + torch.log(denom), torch.full_like(m, -float("inf")))
    return out, lse
