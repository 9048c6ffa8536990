"""Fused KDA decode step (op "kda_decode"): torch reference + CuTe DSL sm_90a kernel.

Both backends share one signature (see `reference.kda_decode_reference` for the contract):

    impl(q, k, v, g_out, f, beta_raw, conv_weight, A_log, dt_bias, norm_weight, eps,
         lower_bound, state_pool, conv_pool, slot_idx, conv_layout="SD", out=None) -> out

and update `state_pool` / `conv_pool` in place. The decode runtime picks one with

    problem = kda_decode_problem(<the same arguments>)
    impl = registry.resolve(OP, "cutedsl", problem).impl

which falls back to the reference (logging why, once) whenever `cutedsl_guard` refuses.

The registry's "cutedsl" entry (`kda_decode_cutedsl_runtime`) launches the kernel with
programmatic dependent launch (PDL; pdl=False turns it off): whoever calls it through the
registry takes on the PDL contract of `kda_decode_cutedsl`, i.e. the kernel immediately before it in
the stream must not write slot_idx, the pools or the parameters. The decode runtime keeps it in
`pdserve.model.kda.KDAAttention.forward` (cached packed conv weight, int32 slot ids built with the
batch). Direct calls of `kda_decode_cutedsl` launch without PDL unless asked.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from .. import registry
from .reference import kda_decode_reference

OP = "kda_decode"
SUPPORTED_HEADS = (6, 12, 24, 32, 48, 96)
HEAD_DIM = 128
CONV_WIDTH = 4
MAX_BATCH = 64


def kda_decode_problem(q, k, v, g_out, f, beta_raw, conv_weight, A_log, dt_bias, norm_weight,
                       eps, lower_bound, state_pool, conv_pool, slot_idx, conv_layout="SD",
                       out=None) -> dict[str, Any]:
    """The guard's view of one call: shapes, dtypes, layouts, device, strides, alignment."""
    H = A_log.shape[0]
    B, HD = q.shape
    dev = q.device
    cap = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None
    rows = (q, k, v, g_out, f, beta_raw) + ((out,) if out is not None else ())
    params = (conv_weight, A_log, dt_bias, norm_weight)
    everything = rows + params + (state_pool, conv_pool, slot_idx)
    return {
        "device_type": dev.type,
        "capability": cap,
        "same_device": all(t.device == dev for t in everything),
        "heads": H,
        "batch": B,
        "head_dim": HD // H if H else 0,
        "state_shape": tuple(state_pool.shape[1:]),
        "conv_shape": tuple(conv_pool.shape[1:]),
        "conv_weight_shape": tuple(conv_weight.shape),
        "conv_layout": conv_layout,
        "input_dtype": {t.dtype for t in rows},
        "param_dtype": {t.dtype for t in params},
        "state_dtype": state_pool.dtype,
        "conv_dtype": conv_pool.dtype,
        "slot_dtype": slot_idx.dtype,
        "lower_bound": lower_bound,
        "row_shapes_ok": all(t.shape[0] == B for t in rows) and beta_raw.shape == (B, H)
        and all(t.shape == (B, HD) for t in (k, v, g_out, f) + ((out,) if out is not None else ()))
        and slot_idx.shape == (B,),
        "inner_contiguous": all(t.stride(-1) == 1 for t in rows),
        "params_contiguous": all(t.is_contiguous() for t in params + (slot_idx,)),
        "pools_contiguous": state_pool.is_contiguous() and conv_pool.is_contiguous(),
        "aligned16": state_pool.data_ptr() % 16 == 0 and conv_weight.data_ptr() % 16 == 0,
    }


def cutedsl_guard(p: Mapping[str, Any]) -> str | None:
    """None when the CuTe DSL kernel supports the problem, else the reason it does not."""
    if p["device_type"] != "cuda":
        return f"needs a CUDA device, got {p['device_type']}"
    if p["capability"] != (9, 0):
        return f"needs sm_90 (Hopper), got capability {p['capability']}"
    if not p["same_device"]:
        return "tensors live on different devices"
    H, B, Dh = p["heads"], p["batch"], p["head_dim"]
    if H not in SUPPORTED_HEADS:
        return f"local heads {H} not in {SUPPORTED_HEADS}"
    if not 1 <= B <= MAX_BATCH:
        return f"batch {B} not in 1..{MAX_BATCH}"
    if Dh != HEAD_DIM or p["state_shape"] != (H, HEAD_DIM, HEAD_DIM):
        return f"needs K = V = {HEAD_DIM} and state [slots, H, V, K], got head_dim {Dh}, state {p['state_shape']}"
    C = 3 * H * HEAD_DIM
    if p["conv_layout"] not in ("SD", "DS"):
        return f"conv layout {p['conv_layout']!r} not SD/DS"
    want = (CONV_WIDTH - 1, C) if p["conv_layout"] == "SD" else (C, CONV_WIDTH - 1)
    if p["conv_shape"] != want or p["conv_weight_shape"] != (C, CONV_WIDTH):
        return f"conv width must be {CONV_WIDTH}: conv state {p['conv_shape']} (want {want}), weight {p['conv_weight_shape']}"
    if p["input_dtype"] != {torch.bfloat16}:
        return f"inputs/outputs must be bf16, got {p['input_dtype']}"
    if p["param_dtype"] != {torch.float32}:
        return f"conv weight, A_log, dt_bias, norm weight must be fp32, got {p['param_dtype']}"
    if p["state_dtype"] != torch.float32 or p["conv_dtype"] != torch.bfloat16:
        return f"needs fp32 state and bf16 conv state, got {p['state_dtype']} / {p['conv_dtype']}"
    if p["slot_dtype"] != torch.int32:
        return f"slot indices must be int32, got {p['slot_dtype']}"
    lb = p["lower_bound"]
    if lb is not None and not -5.0 <= lb < 0.0:
        return f"lower_bound must be None or in [-5, 0), got {lb}"
    if not p["row_shapes_ok"]:
        return "row inputs must be [B, H*D] (beta_raw [B, H], slot_idx [B])"
    if not (p["inner_contiguous"] and p["params_contiguous"] and p["pools_contiguous"]):
        return "rows need inner stride 1; parameters, slot_idx and pools must be contiguous"
    if not p["aligned16"]:
        return "state pool and conv weight must be 16-byte aligned"
    try:
        import cutlass  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the environment
        return f"CuTe DSL unavailable: {type(exc).__name__}: {exc}"
    return None


def kda_decode_cutedsl(q, k, v, g_out, f, beta_raw, conv_weight, A_log, dt_bias, norm_weight,
                       eps, lower_bound, state_pool, conv_pool, slot_idx, conv_layout="SD",
                       out=None, cluster: int | None = None, pdl: bool = False,
                       first_wave: int | None = None):
    """The CuTe DSL kernel (call through the registry, or validate with `cutedsl_guard`).

    cluster: CTAs per (request, head), 1/2/4/8 (default: `cutedsl.choose_cluster`).
    pdl: launch with programmatic dependent launch. The kernel then reads slot_idx, the pools
    and the parameters *before* `griddepcontrol.wait`, i.e. possibly while the previous kernel in
    the stream still runs: that kernel must not write them (it may write the q/k/v/g_out/f/beta
    rows, which are read after the wait). Kernels further back are complete by then, because the
    kernel triggers its dependents only after its own wait.
    first_wave: with PDL on grids that load part of the state after the wait, how many CTAs (in
    launch order) still load all of it before (default: `cutedsl.choose_first_wave`, one per
    SM). Timing only: every value gives the same results bit for bit."""
    from . import cutedsl
    if out is None:
        out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    return cutedsl.launch(q, k, v, g_out, f, beta_raw, conv_weight, A_log, dt_bias,
                          norm_weight, float(eps), lower_bound, state_pool, conv_pool,
                          slot_idx, conv_layout, out, cluster=cluster, pdl=pdl,
                          first_wave=first_wave)


def kda_decode_cutedsl_runtime(*args, pdl: bool = True, **kwargs):
    """`kda_decode_cutedsl` as the decode runtime launches it: with PDL by default, so its slot,
    pool and parameter loads overlap the tail of the kernel before it. The caller must keep the
    PDL contract (see `kda_decode_cutedsl`)."""
    return kda_decode_cutedsl(*args, pdl=pdl, **kwargs)


registry.register(OP, registry.REFERENCE, kda_decode_reference)
registry.register(OP, "cutedsl", kda_decode_cutedsl_runtime, cutedsl_guard)

__all__ = ["OP", "SUPPORTED_HEADS", "kda_decode_problem", "cutedsl_guard", "kda_decode_cutedsl",
           "kda_decode_cutedsl_runtime", "kda_decode_reference"]
