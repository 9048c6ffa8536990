"""Absorbed MLA decode attention over the paged latent cache (op "mla_decode").

Backends: "reference" (torch, any device: the model's absorbed attention over the gathered
rows) and "cutedsl" (Hopper sm_90a: the CuTe DSL split-KV attention kernel + LSE combine).
Signature of both:

    impl(q [B, H, 576], kv_cache [num_pages, page_tokens, 576], block_table [B, max_pages] int32,
         seq_lens [B] int32, softmax_scale, kv_scale=None, **choices) -> (out [B, H, 512], lse [B, H])

The package, by concept:
    reference.py  the torch reference (paged gather + pdserve.model.mla.absorbed_attention)
    query.py      the fp8 kernel's query roundings in torch (the reference mirrors them)
    plan.py       the launch plan: every tuning choice, its default, the device's properties
    attention.py  the attention kernel (heads as the wgmma N; bf16 and fp8 caches)
    combine.py    the split-KV LSE combine kernel (and its formula in torch)
    common.py     sizes and device pieces both kernels share
    launch.py     compile cache, argument checks, the launcher `mla_decode_cutedsl`

The registry's "cutedsl" entry is `mla_decode_cutedsl` with the plan's defaults (plan.py), the
ones the benchmark's figures measure; `choices` (e.g. fp8_query, deterministic) override them.

Query absorption (W_UK^T q_nope), W_UV (512 -> 128 per head) and the sigmoid output gate are not
part of this op: they stay in torch in the decode runtime (`MLAAttention._fused_decode`, which the
runtime's `mla_step_for(backend)` feeds; a refused call runs the model's torch path).
"""
from __future__ import annotations

from typing import Any, Mapping

from pdserve.kernels import registry
from pdserve.kernels.mla_decode.reference import (
    HEAD_DIM, LATENT_DIM, ROPE_DIM, mla_decode_reference)

OP = "mla_decode"
SUPPORTED_HEADS = tuple(range(1, 33))        # padded to 16 or 32 inside the kernel
MAX_BATCH = 1024
SUPPORTED_KV_DTYPES = ("bfloat16", "float8_e4m3fn")


def _name(dt: Any) -> str:
    return str(dt).replace("torch.", "")


def problem_from_tensors(q, kv_cache, block_table=None, seq_lens=None, *_op_args,
                         **_choices) -> dict:
    """The guard's view of a call (takes the op's arguments; only the tensors' shapes, dtypes
    and device matter)."""
    import torch
    cap = torch.cuda.get_device_capability(q.device) if q.is_cuda else None
    return {
        "device": q.device.type, "capability": cap, "batch": q.shape[0], "heads": q.shape[1],
        "head_dim": q.shape[2], "latent_dim": kv_cache.shape[-1], "page_tokens": kv_cache.shape[1],
        "q_dtype": _name(q.dtype), "kv_dtype": _name(kv_cache.dtype),
    }


def cutedsl_guard(problem: Mapping[str, Any]) -> str | None:
    """None when the CuTe DSL kernel serves `problem`, else the reason it does not."""
    if problem.get("device", "cuda") != "cuda":
        return f"needs a CUDA device, got {problem.get('device')}"
    cap = problem.get("capability")
    if cap is None or tuple(cap)[:2] != (9, 0):
        return f"needs sm_90 (Hopper), got capability {cap}"
    for k, want in (("head_dim", HEAD_DIM), ("latent_dim", HEAD_DIM)):
        if problem.get(k, want) != want:
            return f"{k} must be {want} (512 c_kv + 64 k_pe), got {problem.get(k)}"
    if problem.get("kv_lora_rank", LATENT_DIM) != LATENT_DIM or problem.get("rope_dim", ROPE_DIM) != ROPE_DIM:
        return "latent width must be 512 + 64"
    h = problem.get("heads")
    if h not in SUPPORTED_HEADS:
        return f"heads per rank must be 1..32, got {h}"
    b = problem.get("batch")
    if b is None or not (1 <= b <= MAX_BATCH):
        return f"batch must be 1..{MAX_BATCH}, got {b}"
    pt = problem.get("page_tokens")
    if pt is None or pt <= 0 or pt % 64 != 0:
        return f"page_tokens must be a multiple of 64, got {pt}"
    if _name(problem.get("q_dtype", "bfloat16")) != "bfloat16":
        return f"q must be bfloat16, got {problem.get('q_dtype')}"
    kd = _name(problem.get("kv_dtype"))
    if kd not in SUPPORTED_KV_DTYPES:
        return f"kv cache dtype must be bf16 or fp8 e4m3, got {kd}"
    return None


def _cutedsl_impl(*args, **choices):
    from pdserve.kernels.mla_decode.launch import mla_decode_cutedsl
    return mla_decode_cutedsl(*args, **choices)


registry.register(OP, "reference", mla_decode_reference)
registry.register(OP, "cutedsl", _cutedsl_impl, cutedsl_guard)

__all__ = ["OP", "cutedsl_guard", "mla_decode_reference", "problem_from_tensors"]
