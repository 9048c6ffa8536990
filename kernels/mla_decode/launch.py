"""The host side of the CuTe DSL MLA decode: the compile cache (keyed by the plan's variants),
the argument checks, the tile-pool counters and the launcher `mla_decode_cutedsl` (the attention
kernel, then, with several splits, the combine).

Not in here (torch, in the decode runtime): query absorption (W_UK^T q_nope), W_UV
(512 -> 128 per head) and the sigmoid output gate.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from pdserve.kernels.mla_decode.attention import MlaDecodeKernel
from pdserve.kernels.mla_decode.combine import compile_combine
from pdserve.kernels.mla_decode.common import D_QK, D_V, LOG2_E, TILE_N
from pdserve.kernels.mla_decode.plan import MAX_SPLITS, Attention, Device, Plan, plan_call

_COMPILED: dict = {}


def _fake_args(k: MlaDecodeKernel):
    from cutlass.cute.runtime import make_ptr
    from cutlass.runtime import make_fake_stream
    G = cute.AddressSpace.gmem
    P = lambda dt: make_ptr(dt, 0, G, assumed_align=16)
    return (P(BFloat16), P(k.kv_dtype), P(Int32), P(Int32), P(BFloat16), P(Float32),
            P(k.partial_dtype), P(Float32), P(Int32), Int32(1), Int32(k.h_pad), Int32(2),
            Int32(1), Int32(1), Float32(1.0), Float32(1.0), make_fake_stream())


def attention_kernel(variant: Attention):
    """(kernel object, compiled kernel) of the attention `variant`, cached for the process: the
    variant holds every choice, so equal variants share one compiled kernel and any other
    choice gets its own."""
    if variant not in _COMPILED:
        k = MlaDecodeKernel(variant)
        _COMPILED[variant] = (k, cute.compile(k, *_fake_args(k)))
    return _COMPILED[variant]


def compile_attention(variant: Attention, dump_dir: str):
    """The attention `variant` compiled with its PTX and cubin kept in `dump_dir` and exposed as
    `.artifacts.PTX` / `.CUBIN` (bypasses the cache; for the CPU compile tests)."""
    k = MlaDecodeKernel(variant)
    return cute.compile(k, *_fake_args(k),
                        options=f"--keep-ptx --keep-cubin --dump-dir={dump_dir}")


_POOL_COUNTERS: dict = {}


def pool_counters(device, stream_handle: int, requests: int):
    """The tile pool's counters for calls on this (device, stream): int32 [2] per request (draw
    count, CTAs done), at least `requests` of them. Zeroed once; each call's last CTA of a
    request resets its pair (attention._produce), so calls on one stream share them and
    concurrent streams get their own. A larger request count gets a new buffer; the old one
    stays allocated, because a captured CUDA graph keeps using it. (Two graphs captured on one
    stream must not be replayed concurrently on different streams.)"""
    import torch
    key = (str(device), int(stream_handle))
    bufs = _POOL_COUNTERS.setdefault(key, [])
    if not bufs or bufs[-1].numel() < 2 * requests:
        bufs.append(torch.zeros(2 * max(4096, int(requests)), dtype=torch.int32, device=device))
    return bufs[-1]


def check_inputs(q, kv_cache, block_table, seq_lens, out=None, lse=None,
                 num_splits: int | None = None) -> None:
    """ValueError naming the first argument mla_decode_cutedsl cannot take (shapes, dtypes,
    contiguity, 16-byte alignment, split count); runs before anything touches the GPU."""
    import torch

    def need(ok, msg):
        if not ok:
            raise ValueError(f"mla_decode_cutedsl: {msg}")

    need(q.dim() == 3 and q.shape[2] == D_QK,
         f"q must be [B, H, {D_QK}], got shape {tuple(q.shape)}")
    need(q.dtype == torch.bfloat16, f"q must be bfloat16, got {q.dtype}")
    B, H, _ = q.shape
    need(B >= 1 and 1 <= H <= 32, f"q: need B >= 1 and 1 <= H <= 32 heads, got B={B}, H={H}")
    need(kv_cache.dim() == 3 and kv_cache.shape[2] == D_QK,
         f"kv_cache must be [pages, page_tokens, {D_QK}], got shape {tuple(kv_cache.shape)}")
    need(kv_cache.dtype in (torch.bfloat16, torch.float8_e4m3fn),
         f"kv_cache must be bfloat16 or float8_e4m3fn, got {kv_cache.dtype}")
    need(kv_cache.shape[1] % TILE_N == 0,
         f"kv_cache page_tokens must be a multiple of {TILE_N}, got {kv_cache.shape[1]}")
    need(block_table.dim() == 2 and block_table.shape[0] == B,
         f"block_table must be [B={B}, max_pages], got shape {tuple(block_table.shape)}")
    need(block_table.dtype == torch.int32, f"block_table must be int32, got {block_table.dtype}")
    need(tuple(seq_lens.shape) == (B,), f"seq_lens must be [B={B}], got {tuple(seq_lens.shape)}")
    need(seq_lens.dtype == torch.int32, f"seq_lens must be int32, got {seq_lens.dtype}")
    if out is not None:
        need(tuple(out.shape) == (B, H, D_V) and out.dtype == torch.bfloat16,
             f"out must be bfloat16 [{B}, {H}, {D_V}], got {out.dtype} {tuple(out.shape)}")
    if lse is not None:
        need(tuple(lse.shape) == (B, H) and lse.dtype == torch.float32,
             f"lse must be float32 [{B}, {H}], got {lse.dtype} {tuple(lse.shape)}")
    named = {"q": q, "kv_cache": kv_cache, "block_table": block_table, "seq_lens": seq_lens,
             "out": out, "lse": lse}
    for name, t in named.items():              # the kernels take every pointer as 16-aligned
        if t is not None:
            need(t.is_contiguous(), f"{name} must be contiguous")
            need(t.data_ptr() % 16 == 0,
                 f"{name} must start 16-byte aligned (got address {t.data_ptr():#x})")
    if num_splits is not None:
        need(1 <= int(num_splits) <= MAX_SPLITS,
             f"num_splits must be 1..{MAX_SPLITS}, got {num_splits}")


def plan_for(q, kv_cache, seq_lens, *, max_seq_len: int | None = None,
             num_splits: int | None = None, device: Device | None = None, **choices) -> Plan:
    """The plan mla_decode_cutedsl runs for these arguments (plan.plan_call with the tensors'
    shapes and the device's properties; without max_seq_len or num_splits, seq_lens.max(), a
    host sync)."""
    import torch
    msl = int(max_seq_len) if max_seq_len is not None else None
    if num_splits is None and msl is None:
        msl = int(seq_lens.max().item())
    B, H, _ = q.shape
    return plan_call(B, H, msl, kv_cache.dtype == torch.float8_e4m3fn, kv_cache.shape[1],
                     device or Device.of(q.device), num_splits=num_splits, **choices)


def mla_decode_cutedsl(q, kv_cache, block_table, seq_lens, softmax_scale: float, kv_scale=None,
                       *, num_splits: int | None = None, max_seq_len: int | None = None,
                       out=None, lse=None, **choices):
    """CuTe DSL MLA decode. q [B, H, 576] bf16; kv_cache [P, page, 576] bf16 | fp8 e4m3;
    block_table [B, max_pages] int32; seq_lens [B] int32 (>= 1). Returns (out [B, H, 512] bf16,
    lse [B, H] fp32).

    `choices`: plan.plan_call's keywords (early_kv, fp8_query, deterministic, head_groups,
    consumers, ...; unknown ones are a TypeError); each left out takes the plan's default.
    With the default early_kv the kernel reads seq_lens, the block table and the cache before
    the kernel right before it in the stream has finished: that kernel must write none of them
    (early_kv=False otherwise). For CUDA-graph capture pass num_splits or max_seq_len
    (otherwise the split count comes from seq_lens.max(), a host sync); pass max_seq_len with
    num_splits too, since the consumer and pool choices need the split size."""
    import torch
    import cuda.bindings.driver as cuda_drv
    from cutlass.cute.runtime import make_ptr

    check_inputs(q, kv_cache, block_table, seq_lens, out, lse, num_splits)
    plan = plan_for(q, kv_cache, seq_lens, max_seq_len=max_seq_len, num_splits=num_splits,
                    **choices)
    B, H, _ = q.shape
    num_pages = kv_cache.shape[0]
    splits, groups = plan.num_splits, plan.head_groups
    kscale = 1.0 if kv_scale is None else float(kv_scale)
    dev = q.device
    if out is None:
        out = torch.empty(B, H, D_V, dtype=torch.bfloat16, device=dev)
    if lse is None:
        lse = torch.empty(B, H, dtype=torch.float32, device=dev)
    # the attention kernel sees B * groups requests of H / groups heads: contiguous views of q,
    # the outputs and the partials; the combine sees [B, H]
    Bv, Hv = B * groups, H // groups
    kernel, main = attention_kernel(plan.attention)
    pdt = kernel.partial_dtype
    if splits > 1:
        o_part = torch.empty(splits, B, H, D_V, device=dev,
                             dtype=torch.bfloat16 if pdt is BFloat16 else torch.float32)
        lse_part = torch.empty(splits, B, H, dtype=torch.float32, device=dev)
    else:
        o_part, lse_part = lse, lse          # never touched with one split

    G = cute.AddressSpace.gmem
    P = lambda dt, t: make_ptr(dt, t.data_ptr(), G, assumed_align=16)
    stream_handle = torch.cuda.current_stream(dev).cuda_stream
    stream = cuda_drv.CUstream(stream_handle)
    kv_dt = cutlass.Float8E4M3FN if plan.attention.kv_fp8 else BFloat16
    main(P(BFloat16, q), P(kv_dt, kv_cache), P(Int32, block_table), P(Int32, seq_lens),
         P(BFloat16, out), P(Float32, lse), P(pdt, o_part), P(Float32, lse_part),
         P(Int32, pool_counters(dev, stream_handle, Bv)),
         Int32(Bv), Int32(Hv), Int32(num_pages), Int32(block_table.shape[1]), Int32(splits),
         Float32(softmax_scale * kscale * LOG2_E), Float32(kscale), stream)
    if splits > 1:
        _, comb = compile_combine(plan.combine)
        comb(P(pdt, o_part), P(Float32, lse_part), P(BFloat16, out), P(Float32, lse),
             Int32(B), Int32(H), Int32(splits), stream)
    return out, lse
