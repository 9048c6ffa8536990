"""Torch reference of the MLA decode op over the paged latent cache: the model's absorbed
attention (`pdserve.model.mla.absorbed_attention`) on each request's rows, gathered through its
block table (`gather_latent` for one request; the op gathers the whole table at once).

q = [W_UK^T q_nope (512) | q_pe (64)] per head; each cached row is [c_kv (512) | k_pe (64)]. With
an fp8 e4m3 cache the true row is stored * kv_scale. fp8_query="single" rounds the query as the
kernel does over an fp8 cache (query.quantize_query_e4m3); "split" leaves it as given.
"""
from __future__ import annotations

import torch

from pdserve.kernels.mla_decode.query import (check_fp8_query, quantize_query_e4m3,  # noqa: F401
                                              split_query_e4m3)
from pdserve.model.mla import absorbed_attention

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


def mla_decode_reference(
    q: torch.Tensor,                 # [B, H, 576]
    kv_cache: torch.Tensor,          # [num_pages, page_tokens, 576] bf16 or float8_e4m3fn
    block_table: torch.Tensor,       # [B, max_pages] int32
    seq_lens: torch.Tensor,          # [B] int32, each >= 1
    softmax_scale: float,
    kv_scale: float | None = None,   # per-tensor dequant scale of an fp8 cache
    *,
    out_dtype: torch.dtype | None = None,
    fp8_query: str = "split",
    **_kernel_choices,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out [B, H, 512] in out_dtype (default q.dtype), lse [B, H] fp32), computed in
    fp32 by absorbed_attention. Keyword arguments of the kernel (its tuning choices) are taken
    and ignored, so that both backends share one signature."""
    B, H, D = q.shape
    assert D == HEAD_DIM and kv_cache.shape[-1] == HEAD_DIM, (q.shape, kv_cache.shape)
    out_dtype = out_dtype or q.dtype
    if check_fp8_query(fp8_query) == "single" and kv_cache.element_size() == 1:
        q = quantize_query_e4m3(q)
    scale = 1.0 if kv_scale is None else float(kv_scale)
    # Every request's pages at the table's full width, the rows past its length masked: device
    # ops only, so the op also runs inside a captured CUDA graph.
    pages = block_table.long().to(kv_cache.device)                    # [B, max_pages]
    if kv_cache.element_size() == 1:      # gather fp8 as bytes (index kernels may lack fp8)
        rows = kv_cache.view(torch.uint8)[pages].view(kv_cache.dtype)
    else:
        rows = kv_cache[pages]
    rows = rows.reshape(B, -1, HEAD_DIM).float() * scale             # [B, L, 576]
    visible = (torch.arange(rows.shape[1], device=q.device)
               < seq_lens.to(q.device).long()[:, None])              # [B, L]
    rows = torch.where(visible[..., None], rows, 0.0)   # rows past the end may hold anything
    out, lse = absorbed_attention(q.float()[:, None], rows, LATENT_DIM, softmax_scale,
                                  visible[:, None, :])
    return out[:, 0].to(out_dtype), lse[:, 0]
