"""Torch reference of the MLA latent store (op "latent_store", backend "reference").

A decode step's new cache row per live request: c_kv = rms_norm(kv[:, :R], weight) beside the
untouched k_pe = kv[:, R:], quantized to the pool's dtype and stored at (new_page, new_row) of
the layer's paged cache. Padding rows (new_page 0: the page the pool never hands out) store
nothing.
"""
from __future__ import annotations

import torch

from pdserve.model.norms import rms_norm


def latent_store_reference(kv, weight, eps: float, data, new_page, new_row,
                           kv_scale: float | None = None):
    """kv [B, R + P] (bf16 rows, any row stride), weight [R], data [pages, page_tokens, R + P]."""
    R = weight.shape[0]
    rows = torch.cat([rms_norm(kv[:, :R], weight, eps), kv[:, R:]], dim=-1)
    if kv_scale is not None:
        rows = rows.float() / kv_scale
    live = new_page != 0
    data.index_put_((new_page, new_row),
                    torch.where(live[:, None], rows.to(data.dtype), data[new_page, new_row]))
    return data
