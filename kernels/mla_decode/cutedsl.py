"""CuTe DSL absorbed MLA decode attention over the paged latent cache (Hopper sm_90a): the host
side. The core for a call (choose_core), its split count and head groups (plan_call), the
swapab core's consumers and tile pool per call, the compile cache, the argument checks and the
launcher (`mla_decode_cutedsl`: the attention kernel, then, with several splits, the combine).
The kernels: mma.py (mma.sync), wgmma.py, swapab.py (the default) and combine.py, on the shared
pieces in common.py.

Not in here (torch for now): query absorption (W_UK^T q_nope), W_UV (512 -> 128 per head) and
the sigmoid output gate.

Status on the H200, session 23 (figures of record: benchmarks/results/
mla_decode_h200_auto_early_kv_session23.json, machine ...019329, the launcher's defaults, where
the five GPU test files passed, 559 tests): the fp8 query is now one e4m3 term by default
(fp8_query="single", vLLM's rounding; resolve_fp8_query). Fraction of the copy floor where
B x L >= 256K: bf16 0.88-1.02, fp8 H=12 0.80-1.02, fp8 H=32 0.763-0.929 (B=8 L=32K 0.763, B=64
L=8K 0.783): every cell meets 0.75. The two-term query (fp8_query="split",
_split_query_session23.json): fp8 H=32 0.704-0.792, four cells below 0.75. B = 1, L = 8K: bf16
7.3 / 10.0 us, fp8 8.3 / 9.5 (H = 12 / 32); bf16 H=32 sits on the 10 us line.

Earlier status (figures of record then: benchmarks/results/
mla_decode_h200_auto_early_kv_session19.json, machine ...032740, commit b33623d, lazy maxima with
the per-thread rise check in the fp8 two-consumer kernel (swapab.py), early_kv; 467 GPU tests
passed on that machine; what each session tried: docs/kernel_history.md): fraction of the copy
floor where B x L >= 256K: bf16 0.95-1.07 (H = 12), 0.89-1.07 (H = 32); fp8 0.78-1.02 (H = 12),
0.69-0.83 (H = 32: B=8 L=32K 0.69, B=64 L=8K 0.73 and B=64 L=128K 0.7499 are below 0.75; these
cells move by up to ~15 % between machines and page placements; the long ones run at the
H200's 700 W power cap, 1.4-1.5 GHz, kernel_history.md session 19). B = 1, L = 8K: bf16 7.3 /
9.9 us, fp8 8.8 / 10.0 (H = 12 / 32). Session 18's figures: _session18.json.
Session 22 (machine ...291686, tree cd863c2, 534 GPU tests; _session22.json): with the fp8
tile pool (swapab.py), fp8 H=32 where B x L >= 256K, split / single query: B=8 L=32K 0.704 /
0.767, B=8 L=128K 0.836 / 0.940, B=64 L=8K 0.748 / 0.776, B=64 L=32K 0.783 / 0.978, B=64
L=128K 0.754 / 0.892 -- the single query meets 0.75 in every cell there, the split one misses
at B=8 L=32K and B=64 L=8K. B = 1, L = 8K at H = 32 is 9.9-10.2 us on that machine (bf16 and
fp8), at the 10 us line.
Session 20 (machine ...045035, tree 2d3bb37, 489 GPU tests): the same grid for the split query
(_session20.json: fp8 H=32 0.68-0.81, a few % below the session-19 machine) and with
fp8_query="single" (the query as one e4m3 term, as vLLM's fp8 MLA path rounds it; half of S^T's
wgmmas; _single_query_session20.json): fp8 H=32 where B x L >= 256K 0.72-0.91, only B=8 L=32K
(0.716) below 0.75; B=1 L=8K 9.7 us. Its accuracy cost: docs/kernels.md, "fp8_query".
Session 14 made the fp8 two-consumer ring even (swapab.py: an odd one let a consumer read a
stage before its TMA landed) and the joint S^T the default at h_pad 16 (its figures:
_session14.json). The session-8 figures below are the earlier record.

Status on the H200 (2026-11-30, session 8, commit 8d739a4; CUDA-graph medians, >= 16 calls
per graph; benchmarks/results/mla_decode_h200_auto.json and _auto_early_kv.json):
  * `choose_core` takes the swapab core (swapab.py) for every call, bf16 and fp8.
  * bf16: 88-105 % (early_kv) / 86-105 % of the 4245 GB/s copy floor in every cell with
    B x L >= 256K tokens, at H = 12 and H = 32 (above 100 % because a pure read stream beats the
    copy's read + write mix).
  * fp8 where B x L >= 256K: H = 12 77-96 % / 76-93 %; H = 32 63-71 % / 61-74 % (H=32 B=8
    L=32K 56.9 us = 63 %, B=64 L=32K 433.4 = 66 %; another run of the same fp8 kernels this
    session: 62-76 %, results/mla_decode_h200_partials_session8.json).
  * B = 1, L = 8K with early_kv: bf16 8.3 us at H = 12, 10.7 at H = 32; fp8 9.3 / 10.3
    (without early_kv: bf16 10.1 / 11.9, fp8 9.7 / 10.6).
  * split partials: fp32, except the swapab core with an fp8 cache (bf16, see swapab.py).
  * `early_kv=True` (opt-in; all three cores): the main kernel issues its seq_lens,
    block-table and first KV-tile reads before griddepcontrol.wait, so the first tile's DRAM
    round trips overlap the previous kernel; Q and every write stay behind the wait. Contract:
    the kernel right before it in the stream writes none of those.
  * Every kernel is launched with PDL and triggers its dependents on entry; the combine uses one
    split group per (request, head) up to 8 splits, 4 up to 31, and from 32 spreads each head
    over several CTAs (`choose_combine`; its shapes there changed in session 13).

Cores: `MlaDecodeKernel` (mma.py, mma.sync; core="mma") and the warpgroup-MMA core
in wgmma.py (`MlaDecodeWgmmaKernel`, core="wgmma": 64-row wgmma with Q in smem, S and P in
registers, a warp-specialized TMA producer over a 2-stage ring). Both take the same arguments and
share the split choice, the combine and the host launcher. mma.sync pads the heads to 16 or 32
rows, wgmma to 64, so wgmma only paid off where H > 16 and the contexts are long. H200,
session 5 (all 53 wgmma GPU tests pass; benchmarks/results/mla_decode_h200_wgmma.json beside
mla_decode_h200.json), us:
    bf16 H=32:  B=1 L=8K 17.4 (mma 19.0), B=8 L=32K 97.7 (102.5), B=8 L=128K 324.9 (362.2),
                B=64 L=8K 182.0 (196.8), B=64 L=32K 640.0 (711.4); L=1K 13.6-41.6 (10.4-41.1)
    bf16 H=12:  mma faster in every cell (e.g. B=64 L=32K 603.6 vs 613.7, B=1 L=1K 9.1 vs 11.9)
    fp8  H=32:  wgmma faster from L=8K on (B=64 L=32K 818.8 vs 941.9); fp8 H=12: mma faster.
A third core, swapab.py (`MlaDecodeSwapAbKernel`, core="swapab"; bf16 and fp8), swaps A and B
so that the heads are the wgmma's N (16 / 32, from h_pad_for) and tokens / latent dims its M: no
padding to 64 rows; `choose_core` picks it for every call. Its fp8 path runs two consumer
warpgroups on alternate tiles where a split has more than 2 tiles (`choose_consumers`;
PDSERVE_MLA_SWAPAB_CONSUMERS=1|2 overrides; see swapab.py).
"""
from __future__ import annotations

import os

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from pdserve.kernels.mla_decode.combine import CombineKernel, choose_combine, compile_combine
from pdserve.kernels.mla_decode.common import (D_QK, D_V, LOG2_E, NUM_SMS_H200, TILE_N, env_choice,
                                               swapab_pool_div)
from pdserve.kernels.mla_decode.mma import MlaDecodeKernel
from pdserve.kernels.mla_decode.reference import check_fp8_query


# ================================================================================================
# Host side: compile cache, split choice, launch
# ================================================================================================
_COMPILED: dict = {}


def _fake_args_main(k: MlaDecodeKernel):
    from cutlass.cute.runtime import make_ptr
    from cutlass.runtime import make_fake_stream
    G = cute.AddressSpace.gmem
    P = lambda dt: make_ptr(dt, 0, G, assumed_align=16)
    counters = (P(Int32),) if hasattr(k, "pool") else ()     # swapab: the tile-pool counters
    return (P(BFloat16), P(k.kv_dtype), P(Int32), P(Int32), P(BFloat16), P(Float32),
            P(k.partial_dtype), P(Float32), *counters, Int32(1), Int32(k.h_pad), Int32(2),
            Int32(1), Int32(1), Float32(1.0), Float32(1.0), make_fake_stream())


# attention core: "mma" (MlaDecodeKernel, mma.sync), "wgmma" (wgmma.MlaDecodeWgmmaKernel) or
# "swapab" (swapab.MlaDecodeSwapAbKernel: heads as the wgmma N); "auto" lets
# choose_core pick per call
CORES = ("mma", "wgmma", "swapab")
CORE = os.environ.get("PDSERVE_MLA_CORE", "auto")
HEAD_GROUP_FP8_MAX_TOKENS = 64 * 1024   # choose_head_groups (H > 16): fp8 up to this B x L,
HEAD_GROUP_BF16_MAX_SEQ = 2048           # bf16 up to this context length


def choose_core(heads: int, max_seq_len: int | None, batch: int = 1,
                kv_fp8: bool = False) -> str:
    """The faster core on the H200 for this call (2026-11-29, CUDA-graph medians in us): swapab,
    for every call.
      * bf16: faster than the mma and wgmma cores in all 24 cells of the benchmark grid, with and
        without early_kv (e.g. H=32 B=64 L=32K 566.7 vs wgmma 748.6; H=12 B=1 L=8K 10.5 vs mma
        11.2, with early_kv 8.8 vs 9.8; mla_decode_h200_swapab*.json, session 6).
      * fp8 (two consumer warpgroups, vectorized epilogue, V-prefetching PV, session 7): at
        B x L >= 256K faster than mma and wgmma in every cell (H=32 B=64 L=32K 413.4 vs mma
        656.3 and wgmma 800.5 already in session 6); below, where wgmma was the choice until
        session 7, too, except two cells within 5 % (early_kv; both from
        mla_decode_h200_session7_ab.json: swapab from its A/B runs, wgmma from
        "run4_first_auto"): H=12 B=8 L=8K 20.3 vs 32.1, B=64 L=1K 19.8 vs 34.9, B=1 L=8K 11.2
        vs 11.6; H=32 B=1 L=128K 42.0 vs 61.6, B=64 L=1K 25.2 vs 41.0, B=8 L=8K
        28.5 vs 34.5; wgmma ahead: H=32 B=1 L=8K 13.0 vs 13.5, B=8 L=1K 12.1 vs 12.7.
    The arguments stay for callers that pass them (a rule by shape may come back)."""
    return "swapab"


def choose_consumers(kv_fp8: bool, tiles_per_split: int | None = None) -> int:
    """Consumer warpgroups of the swapab core: PDSERVE_MLA_SWAPAB_CONSUMERS=1|2 if set (A/B
    runs); bf16 1; fp8 1 where each split has at most 2 tiles (there the pair's merge and second
    Q split apparently cost more than running the two tiles side by side saves), else 2 (also
    when the split size is unknown). H200, 2026-11-29 (session 8), early_kv, us, one / two consumers
    (benchmarks/results/mla_decode_h200_consumers_session8.json): <= 2 tiles: H=12 B=1 L=8K
    10.0 / 10.9, B=1 L=1K 8.5 / 8.8, B=8 L=1K 9.4 / 9.9; H=32 B=1 L=8K 12.7 / 13.2, B=8 L=1K
    13.2 / 13.7; more: H=12 B=1 L=32K (4 tiles) 17.0 / 16.8, B=8 L=8K (8) 21.1 / 20.1,
    B=64 L=1K (8) 19.9 / 19.1; H=32 B=1 L=32K 21.7 / 20.7, B=8 L=8K 33.4 / 30.2; over every
    cell with more than 2 tiles per split one consumer is 1-25 % slower (H=32 B=8 L=128K
    240.4 / 192.4)."""
    env = env_choice("PDSERVE_MLA_SWAPAB_CONSUMERS", ("1", "2"))
    if env:
        return int(env)
    if not kv_fp8:
        return 1
    return 1 if tiles_per_split is not None and tiles_per_split <= 2 else 2


def split_tiles(max_seq_len: int | None, num_splits: int) -> int | None:
    """Tiles in each split of the longest request (None when its length is unknown)."""
    if max_seq_len is None:
        return None
    n_tiles = -(-int(max_seq_len) // TILE_N)
    return -(-n_tiles // int(num_splits))


def call_consumers(core: str, kv_fp8: bool, max_seq_len: int | None,
                   num_splits: int) -> int | None:
    """The swapab core's consumer warpgroups for one call (choose_consumers with the longest
    request's tiles per split; None for the other cores)."""
    if core != "swapab":
        return None
    return choose_consumers(kv_fp8, split_tiles(max_seq_len, num_splits))


# the swapab fp8 tile pool pays where a split has this many tiles (call_pool)
POOL_MIN_TILES = 32


def call_pool(max_seq_len: int | None, num_splits: int) -> bool:
    """Whether a swapab call may use the tile pool (the fp8 default; the kernel object decides
    whether it has one). With PDSERVE_MLA_SWAPAB_POOL set, yes: the switch says (A/B runs).
    Else where there is more than one split and the longest request's splits have at least
    POOL_MIN_TILES tiles (not when the length is unknown). Session 22, fp8 H=32, interleaved
    A/Bs: the pool gained 1.5-4 % at 32 to 1024 tiles a split (B=8 L=32K, B=64 L=8K and 128K)
    and cost 1-3 % at 2 to 16 (B=1 L=8K and 32K, B=8 L=8K), where its id-driven tile loop
    costs more than evening out the end of the loop gains."""
    if os.environ.get("PDSERVE_MLA_SWAPAB_POOL"):
        return True
    if max_seq_len is None or num_splits < 2:
        return False
    return split_tiles(max_seq_len, num_splits) >= POOL_MIN_TILES


def _core(core: str | None) -> str:
    core = CORE if core is None else core
    if core == "auto":
        core = choose_core(32, None)      # no shape here: choose_core's answer for an unknown one
    assert core in CORES, f"unknown MLA decode core {core!r} (one of {CORES} or 'auto')"
    return core


def kernel_config(kv_fp8: bool, h_pad: int, page_tokens: int, core: str | None = None,
                  early_kv: bool = False, head_groups: int = 1, consumers: int | None = None,
                  q_terms: int = 2, deterministic: bool = False, d_split: int = 1):
    """The kernel object (stages, threads, dtypes) behind compile_main's variant. The wgmma core
    always pads the heads to 64 and ignores h_pad; the swapab core uses h_pad (16 / 32, its
    wgmma N). head_groups > 1: swapab only (plan_call). consumers: swapab's consumer
    warpgroups (None: choose_consumers without a shape); the other cores ignore it. q_terms:
    swapab's fp8 query terms (2, or 1 for fp8_query="single"); the other cores take 2 only.
    deterministic: swapab without the run-time tile pool (the other cores have none). d_split:
    swapab's CTAs per (split, request) that divide the latent dims of O (call_d_split)."""
    core = _core(core)
    assert head_groups == 1 or core == "swapab", (core, head_groups)
    assert d_split == 1 or core == "swapab", (core, d_split)
    assert q_terms == 2 or core == "swapab", (core, q_terms)
    if core == "swapab":
        from pdserve.kernels.mla_decode.swapab import MlaDecodeSwapAbKernel
        return MlaDecodeSwapAbKernel(bool(kv_fp8), int(page_tokens), int(h_pad), bool(early_kv),
                                     int(head_groups), consumers, int(q_terms),
                                     bool(deterministic), int(d_split))
    if core == "wgmma":
        from pdserve.kernels.mla_decode.wgmma import MlaDecodeWgmmaKernel
        return MlaDecodeWgmmaKernel(bool(kv_fp8), int(page_tokens), bool(early_kv))
    return MlaDecodeKernel(bool(kv_fp8), int(h_pad), int(page_tokens), bool(early_kv))


def compile_main(kv_fp8: bool, h_pad: int, page_tokens: int, core: str | None = None,
                 dump_dir: str | None = None, early_kv: bool = False, head_groups: int = 1,
                 consumers: int | None = None, q_terms: int = 2, deterministic: bool = False,
                 d_split: int = 1):
    """Compiled split-KV attention kernel for one variant (cached for the process). With
    `dump_dir` the PTX and cubin are kept there and exposed as `.artifacts.PTX` / `.CUBIN` (the
    cache is bypassed)."""
    if dump_dir is not None:
        k = kernel_config(kv_fp8, h_pad, page_tokens, core, early_kv, head_groups, consumers,
                          q_terms, deterministic, d_split)
        return cute.compile(k, *_fake_args_main(k),
                            options=f"--keep-ptx --keep-cubin --dump-dir={dump_dir}")
    return main_variant(kv_fp8, h_pad, page_tokens, core, early_kv, head_groups, consumers,
                        q_terms, deterministic, d_split)[1]


def main_variant(kv_fp8: bool, h_pad: int, page_tokens: int, core: str | None = None,
                 early_kv: bool = False, head_groups: int = 1, consumers: int | None = None,
                 q_terms: int = 2, deterministic: bool = False, d_split: int = 1):
    """(kernel object, compiled kernel) of compile_main's variant, from the process cache: the
    launcher reads the object's properties (the partials' dtype) from the variant it runs."""
    core = _core(core)
    k = kernel_config(kv_fp8, h_pad, page_tokens, core, early_kv, head_groups, consumers,
                      q_terms, deterministic, d_split)
    if core == "wgmma":
        key = ("main", core, bool(kv_fp8), int(page_tokens), bool(early_kv))
    elif core == "swapab":
        # (consumers: 1 or 2 consumer warpgroups, choose_consumers or the caller's; the fp8
        # PV grouping: PDSERVE_MLA_SWAPAB_PV; qk_joint: PDSERVE_MLA_SWAPAB_QK_JOINT; lazy_max:
        # PDSERVE_MLA_SWAPAB_LAZY; q_half: PDSERVE_MLA_SWAPAB_QHALF; xmerge:
        # PDSERVE_MLA_SWAPAB_XMERGE; pool_div: PDSERVE_MLA_SWAPAB_POOL, or the fp8 default, 0 if
        # deterministic)
        key = ("main", core, bool(kv_fp8), int(h_pad), int(page_tokens), bool(early_kv),
               int(head_groups), k.consumers, k.pv_group, k.pv_in_flight,
               k.partial_dtype.__name__, k.qk_joint, k.lazy_max, k.q_terms, k.q_half, k.xmerge,
               k.pool_div, k.d_split)
    else:
        key = ("main", bool(kv_fp8), int(h_pad), int(page_tokens), bool(early_kv))
    if key not in _COMPILED:
        _COMPILED[key] = (k, cute.compile(k, *_fake_args_main(k)))
    return _COMPILED[key]


def call_variant(kv_fp8: bool, heads: int, page_tokens: int, core: str, early_kv: bool,
                 head_groups: int, max_seq_len: int | None, num_splits: int, q_terms: int = 2,
                 deterministic: bool = False, batch: int | None = None):
    """main_variant for one planned call (plan_call's core, splits and head groups; `heads` per
    head group; `batch` = the B * head_groups requests the launch sees, None if unknown): the
    swapab core's consumers (call_consumers), tile pool (call_pool) and latent split
    (call_d_split) for this shape."""
    consumers = call_consumers(core, kv_fp8, max_seq_len, num_splits)
    det = deterministic or not call_pool(max_seq_len, num_splits)
    pool = core == "swapab" and swapab_pool_div(kv_fp8, det) > 0    # bf16: none by default
    return main_variant(kv_fp8, h_pad_for(heads), page_tokens, core, early_kv, head_groups,
                        consumers, q_terms, det,
                        call_d_split(core, kv_fp8, consumers, pool, batch, num_splits))


# call_d_split: latent halves where the doubled launch fills at most this many SMs
D_SPLIT_MAX_CTAS = NUM_SMS_H200 // 2


def call_d_split(core: str, kv_fp8: bool, consumers: int | None, pool: bool,
                 batch: int | None, num_splits: int) -> int:
    """CTAs per (split, request) that divide O's 512 latent dims among them (swapab, bf16 cache,
    one consumer, no tile pool; 1 otherwise): PDSERVE_MLA_SWAPAB_DSPLIT=1|2 if set (A/B runs),
    else 2 where the launch's `batch` x `num_splits` CTAs, doubled, take at most half of the
    SMs (D_SPLIT_MAX_CTAS), else 1. Each half runs the split's whole S^T and softmax and half
    of PV, so a CTA's chain is shorter by a quarter of its MMAs; the second CTA loads the same
    tiles again. H200, session 25 (results/mla_decode_h200_d_split_session25.json, three
    interleaved rounds, us d_split 1 / 2; CTAs before doubling; machine ...4050433): H=32 B=1
    L=1K (16) 6.72 / 5.98, L=2K (32) 7.55 / 6.43, L=4K (32) 8.91 / 7.98, B=2 L=1K (32) 7.07 /
    6.15; H=12 B=1 L=1K (8) 6.45 / 5.80, L=4K (32) 6.76 / 6.05, B=4 L=1K (32) 6.85 / 6.10; it
    loses from 64 CTAs on: H=32 B=2 L=2K 7.88 / 8.33, B=4 L=1K 7.55 / 8.2, and on ...4029851
    B=1 L=8K 10.17-10.28 / 10.99-11.16, H=12 7.40-7.44 / 9.36-9.56."""
    if core != "swapab" or kv_fp8 or consumers != 1 or pool:
        return 1
    env = env_choice("PDSERVE_MLA_SWAPAB_DSPLIT", ("1", "2"))
    if env:
        return int(env)
    return 2 if batch is not None and 2 * batch * num_splits <= D_SPLIT_MAX_CTAS else 1




_POOL_COUNTERS: dict = {}


def pool_counters(device, stream_handle: int, requests: int):
    """The swapab core's tile-pool counters for calls on this (device, stream): int32 [2] per
    request (draw count, CTAs done), at least `requests` of them. Zeroed once; each call's
    last CTA of a request resets its pair (swapab._produce), so calls on one stream share them
    and concurrent streams get their own. A larger request count gets a new buffer; the old
    one stays allocated, because a captured CUDA graph keeps using it. (Two graphs captured on
    one stream must not be replayed concurrently on different streams.)"""
    import torch
    key = (str(device), int(stream_handle))
    bufs = _POOL_COUNTERS.setdefault(key, [])
    if not bufs or bufs[-1].numel() < 2 * requests:
        bufs.append(torch.zeros(2 * max(4096, int(requests)), dtype=torch.int32, device=device))
    return bufs[-1]


def h_pad_for(heads: int) -> int:
    return 16 if heads <= 16 else 32


def choose_num_splits(batch: int, max_seq_len: int, heads: int, ctas_per_sm: int = 1,
                      num_sms: int = NUM_SMS_H200) -> int:
    """KV splits per request: one wave of CTAs (`ctas_per_sm` resident per SM: 2 for the mma
    core's fp8 variant at H <= 16, else 1), at least two tiles per split. From the H200 sweeps
    (benchmarks/results/mla_decode_h200.json, H=32 bf16 with the 4-group combine: B=1 L=8K 64
    splits 16.4 us (128: 18.9, 32: 19.2); B=1 L=32K 128: 27.7 (64: 32.3); B=8 L=32K 16 best;
    2026-11-29, fp8 H=12 mma, 2 CTAs/SM: B=64 L=32K 4 splits 340.0 us (2: 451.3), B=8 L=128K 32
    splits 182.5 us (16: 323.2)). `heads` is unused so far."""
    tiles = max(1, -(-int(max_seq_len) // TILE_N))
    wave = num_sms * max(1, int(ctas_per_sm))
    return max(1, min(wave // max(1, batch), -(-tiles // 2), CombineKernel.max_splits))


def choose_head_groups(core: str, batch: int, heads: int, max_seq_len: int | None,
                       kv_fp8: bool) -> int:
    """CTAs per (split, request) that share its heads (swapab only): 2 for H > 16 where the H200
    measured it faster (2026-11-29, H=32, early_kv, us, benchmarks/results/
    mla_decode_h200_head_groups.json): fp8 up to B x L = 64K (B=1 L=8K 23.1 vs 29.4, B=1 L=32K
    32.9 vs 43.8, B=8 L=8K 43.4 vs 50.6; B=8 L=32K 111.3 vs 92.9 and B=1 L=128K 67.1 vs 65.6
    lose), bf16 up to L = 2K (B=1 L=1K 7.4 vs 9.0, B=64 L=1K 28.7 vs 37.5; B=1 L=8K 11.5 vs 11.4,
    B=8 L=8K 32.4 vs 30.5). Longer contexts lose because the split count per head group halves."""
    if core != "swapab" or heads <= 16 or heads % 2 or max_seq_len is None:
        return 1
    if kv_fp8:
        return 2 if batch * int(max_seq_len) <= HEAD_GROUP_FP8_MAX_TOKENS else 1
    return 2 if int(max_seq_len) <= HEAD_GROUP_BF16_MAX_SEQ else 1


def plan_call(batch: int, heads: int, max_seq_len: int | None, kv_fp8: bool, core: str | None,
              early_kv: bool, num_splits: int | None = None,
              head_groups: int | None = None) -> tuple[str, int, int]:
    """(core, num_splits, head_groups) for one call: `core` None / "auto" asks choose_core
    (unless PDSERVE_MLA_CORE names one), head_groups None asks choose_head_groups, num_splits None
    asks choose_num_splits for the B * head_groups requests of H / head_groups heads the launch
    sees, with that core's CTAs per SM. max_seq_len is required when num_splits is None."""
    if core is None:
        core = CORE
    if core == "auto":
        core = choose_core(heads, max_seq_len, batch, kv_fp8)
    core = _core(core)
    if head_groups is None:
        head_groups = choose_head_groups(core, batch, heads, max_seq_len, kv_fp8)
    if head_groups < 1 or heads % head_groups or (head_groups > 1 and core != "swapab"):
        raise ValueError(f"head_groups={head_groups} needs the swapab core and to divide "
                         f"H={heads} (core {core!r})")
    if num_splits is None:
        hv = heads // head_groups
        per_sm = kernel_config(kv_fp8, h_pad_for(hv), TILE_N, core, early_kv,
                               head_groups).ctas_per_sm
        num_splits = choose_num_splits(batch * head_groups, max_seq_len, hv, per_sm)
    return core, num_splits, head_groups


def resolve_fp8_query(fp8_query: str | None, core: str, kv_fp8: bool) -> str:
    """The query rounding a call runs (the reference's `fp8_query` that matches it): the
    caller's, else PDSERVE_MLA_FP8_QUERY, else "single" for the swapab core over an fp8 cache
    (vLLM's fp8 MLA rounding) and "split" otherwise. "single" asked of the mma / wgmma cores is
    refused (ValueError); with a bf16 cache the query is never rounded ("split")."""
    asked = fp8_query if fp8_query is not None else os.environ.get("PDSERVE_MLA_FP8_QUERY")
    if asked is None or asked == "":
        return "single" if kv_fp8 and core == "swapab" else "split"
    if check_fp8_query(asked) == "split" or not kv_fp8:
        return "split"
    if core != "swapab":
        raise ValueError(f"fp8_query='single' needs the swapab core, got core {core!r}")
    return "single"


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
        need(1 <= int(num_splits) <= CombineKernel.max_splits,
             f"num_splits must be 1..{CombineKernel.max_splits}, got {num_splits}")


def mla_decode_cutedsl(
    q, kv_cache, block_table, seq_lens, softmax_scale: float, kv_scale=None, *,
    num_splits: int | None = None, max_seq_len: int | None = None, out=None, lse=None,
    core: str | None = None, early_kv: bool = False, head_groups: int | None = None,
    fp8_query: str | None = None, deterministic: bool = False, **_ignored,
):
    """CuTe DSL MLA decode. q [B, H, 576] bf16; kv_cache [P, page, 576] bf16 | fp8 e4m3;
    block_table [B, max_pages] int32; seq_lens [B] int32 (>= 1). Returns (out [B, H, 512] bf16,
    lse [B, H] fp32). For CUDA-graph capture pass num_splits (or max_seq_len): otherwise the
    split count is derived from seq_lens.max(), a host sync. `core` picks the attention core
    ("mma" / "wgmma" / "swapab"); default CORE, from PDSERVE_MLA_CORE, whose
    default "auto" asks choose_core with max_seq_len or, when num_splits is not given either,
    seq_lens.max()). `early_kv` lets the kernel read seq_lens, the block
    table and the cache before the previous kernel in the stream has finished (PDL): only when
    that kernel writes none of them. `head_groups` (swapab; default choose_head_groups) splits
    each request's heads over that many CTAs per split. `fp8_query` (fp8 cache only;
    resolve_fp8_query: default PDSERVE_MLA_FP8_QUERY, else "single" on the swapab core):
    "single" = the query as one e4m3 term, as vLLM's fp8 MLA path quantizes it (the reference
    with fp8_query="single" mirrors the rounding; swapab core only), "split" = two e4m3 terms
    (Q_hi + Q_lo, ~1000x below bf16 rounding; twice S^T's MMAs). `deterministic`:
    bit-identical results for equal inputs from run to run. The
    swapab core's tile pool (fp8 default where a split has at least POOL_MIN_TILES tiles,
    call_pool) hands a request's last tiles to whichever of its CTAs is free first, so the
    split partials' rounding varies between runs; deterministic turns it off (session 22:
    1.5-4 % slower at fp8 H=32 there)."""
    import torch
    import cuda.bindings.driver as cuda_drv
    from cutlass.cute.runtime import make_ptr

    check_inputs(q, kv_cache, block_table, seq_lens, out, lse, num_splits)
    B, H, _ = q.shape
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    num_pages, page_tokens, _ = kv_cache.shape
    msl = int(max_seq_len) if max_seq_len is not None else None
    if num_splits is None and msl is None:
        msl = int(seq_lens.max().item())
    core, num_splits, groups = plan_call(B, H, msl, fp8, core, early_kv, num_splits, head_groups)
    q_terms = 1 if resolve_fp8_query(fp8_query, core, fp8) == "single" else 2
    kscale = 1.0 if kv_scale is None else float(kv_scale)
    dev = q.device
    if out is None:
        out = torch.empty(B, H, D_V, dtype=torch.bfloat16, device=dev)
    if lse is None:
        lse = torch.empty(B, H, dtype=torch.float32, device=dev)
    # the main kernel sees B * groups requests of H / groups heads: contiguous views of q, the
    # outputs and the partials; the combine sees [B, H]
    Bv, Hv = B * groups, H // groups
    kernel, main = call_variant(fp8, Hv, page_tokens, core, early_kv, groups, msl, num_splits,
                                q_terms, deterministic, Bv)
    pdt = kernel.partial_dtype            # split partials: bf16 (swapab, fp8 cache) or fp32
    if num_splits > 1:
        o_part = torch.empty(num_splits, B, H, D_V, device=dev,
                             dtype=torch.bfloat16 if pdt is BFloat16 else torch.float32)
        lse_part = torch.empty(num_splits, B, H, dtype=torch.float32, device=dev)
    else:
        o_part, lse_part = lse, lse          # never touched with one split

    G = cute.AddressSpace.gmem
    P = lambda dt, t: make_ptr(dt, t.data_ptr(), G, assumed_align=16)
    stream_handle = torch.cuda.current_stream(dev).cuda_stream
    stream = cuda_drv.CUstream(stream_handle)
    kv_dt = cutlass.Float8E4M3FN if fp8 else BFloat16
    counters = ((P(Int32, pool_counters(dev, stream_handle, Bv)),) if core == "swapab" else ())
    main(P(BFloat16, q), P(kv_dt, kv_cache), P(Int32, block_table), P(Int32, seq_lens),
         P(BFloat16, out), P(Float32, lse), P(pdt, o_part), P(Float32, lse_part), *counters,
         Int32(Bv), Int32(Hv), Int32(num_pages), Int32(block_table.shape[1]), Int32(num_splits),
         Float32(softmax_scale * kscale * LOG2_E), Float32(kscale), stream)
    if num_splits > 1:
        main_ctas = Bv * num_splits * getattr(kernel, "d_split", 1)
        comb = compile_combine(choose_combine(num_splits, main_ctas, pdt is Float32), pdt)
        comb(P(pdt, o_part), P(Float32, lse_part), P(BFloat16, out), P(Float32, lse),
             Int32(B), Int32(H), Int32(num_splits), stream)
    return out, lse
