"""The MLA layer's new cache rows on decode steps (op "latent_store"): torch reference + CuTe
DSL sm_90a kernel.

    impl(kv [B, R + P] bf16, weight [R], eps, data [pages, page_tokens, R + P],
         new_page [B] int64, new_row [B] int64, kv_scale=None) -> data

RMSNorm of c_kv, k_pe beside it, stored at each live row's (new_page, new_row); see
reference.py. The kernel serves bf16 caches; an fp8 cache runs the reference.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from .. import registry
from ..guards import cutedsl_refusal, sm90_refusal
from .reference import latent_store_reference

OP = "latent_store"


def latent_store_problem(kv, weight, eps, data, new_page, new_row, kv_scale=None
                         ) -> dict[str, Any]:
    dev = kv.device
    return {
        "device_type": dev.type,
        "capability": torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None,
        "rank": weight.shape[0], "width": kv.shape[1], "cache_width": data.shape[-1],
        "dtypes": (kv.dtype, weight.dtype, data.dtype, new_page.dtype, new_row.dtype),
        "layout_ok": kv.stride(1) == 1 and kv.stride(0) % 8 == 0 and kv.data_ptr() % 16 == 0
        and data.is_contiguous() and weight.is_contiguous() and new_page.is_contiguous()
        and new_row.is_contiguous(),
    }


def cutedsl_guard(p: Mapping[str, Any]) -> str | None:
    why = sm90_refusal(p["device_type"], p["capability"])
    if why:
        return why
    want = (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.int64, torch.int64)
    if p["dtypes"] != want:
        return f"needs bf16 rows, weight and cache and int64 indices, got {p['dtypes']}"
    if p["rank"] % 256 or p["width"] != p["cache_width"] or (p["width"] - p["rank"]) % 8:
        return f"latent {p['rank']} + {p['width'] - p['rank']} is not served"
    if not p["layout_ok"]:
        return "rows need inner stride 1 and 16-byte aligned rows; cache contiguous"
    return cutedsl_refusal()


def latent_store_cutedsl(*args, **kwargs):
    from .cutedsl import launch
    return launch(*args, **kwargs)


registry.register(OP, registry.REFERENCE, latent_store_reference)
registry.register(OP, "cutedsl", latent_store_cutedsl, cutedsl_guard)

__all__ = ["OP", "latent_store_problem", "cutedsl_guard", "latent_store_cutedsl",
           "latent_store_reference"]
