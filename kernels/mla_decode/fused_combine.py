"""The split-KV combine inside the attention kernel (swapab core): no second launch.

With num_splits > 1 the separate `CombineKernel` costs a kernel boundary plus its own dependent
round trips: on the H200 (2026-11-29, B=1 L=8K, early_kv) the combine added 2.4-3.9 us to a
5.2-10.4 us attention kernel. Here every split CTA of a view request b, once its fp32 partial
and LSE are written, arrives on a per-request counter and waits until all num_splits have
arrived; then each merges a 1 / num_splits slice of the request's H x 512 outputs (exactly
`reference.merge_partials`: w_s = e^(lse_s - max), out = sum w_s O_s / sum w_s,
lse = max + ln sum w_s) and writes it as the final bf16 output and LSE.

Waiting on other CTAs is only safe when every CTA of the grid can be resident at once: the host
(`mla_decode_cutedsl`) fuses only when B x num_splits CTAs fit one wave of the device's SMs
(`choose_num_splits` always picks such a grid) and falls back to CombineKernel otherwise. The
previous kernel in the stream holds SMs only until it ends (it never waits on us), and PDL
dependents launch only after all our CTAs have started (each triggers at entry), so the grid
always becomes fully resident. A wait that still exceeds WAIT_NS (2 s, %globaltimer) traps:
the call fails with a CUDA error instead of hanging.

Counter protocol (one int32 per view request, 0 between calls, no memset per call):
  * all consumer threads' partial / LSE stores -> named barrier -> one thread: fence.acq_rel.gpu,
    atom.add 1 (arrive), spin with ld.acquire.gpu until the count reaches num_splits, then a
    second atom.add 1; the CTA whose second add returns 2 num_splits - 1 is the last one past the
    wait and stores 0. A CTA still spinning has not added its second 1, so the reset never comes
    before anyone's wait ends; the next call (the next kernel in the stream) touches the counter
    only after its griddepcontrol.wait, i.e. after this grid completed.
  * after the barrier that follows the wait, every thread issues fence.acq_rel.gpu before reading
    the other CTAs' partials.
The counters are one array per device (`split_counters`; per stream would miss the stream a
CUDA graph is captured on, which has never run a call eagerly): two streams must not run fused
calls at the same time (the decode runtime runs one stream per device; others pass
fused_combine=False).

Slice of CTA `split`: U = H x 128 float4 units (head h, 4 columns), per = ceil(U / num_splits),
units [split per, (split + 1) per). Its nh heads' LSEs (nh num_splits <= H + 2 num_splits
values) are loaded in one round trip into shared memory; one warp per head turns them into
weights (max, exp, sum by shuffles); then G lanes per unit (G = the largest power of two <= 32
with nu G <= threads) each sum every G-th split with 8 loads in flight, and the G lanes add
their sums by shuffles. A split without tokens has LSE -inf, weight 0, and its (unwritten)
partial is never multiplied: a select drops it.
"""
from __future__ import annotations

import threading

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from pdserve.kernels.mla_decode.cutedsl import D_V, LN_2, LOG2_E

WAIT_NS = 2_000_000_000        # a split wait longer than this traps (a bug or a non-resident grid)
MAX_SPLITS = 256               # the host fuses only up to this many splits (scratch size below)
MAX_HEADS = 32                 # h_pad <= 32
UNITS_PER_HEAD = D_V // 4      # float4 units of one head's 512 outputs
# shared-memory scratch (floats): the LSE / weight pairs of a slice's heads, then per head
# (1 / sum w, lse)
PAIRS = MAX_HEADS + 2 * MAX_SPLITS
SLICE_HEADS = MAX_HEADS + 2
SCRATCH_BYTES = (PAIRS + 2 * SLICE_HEADS) * 4


@dsl_user_op
def _wait_count(addr, target, *, loc=None, ip=None) -> Int32:
    """Spin (ld.acquire.gpu, nanosleep 32 ns between polls) until the int32 at global address
    `addr` is >= target; trap after WAIT_NS. Returns the value seen."""
    return Int32(llvm.inline_asm(
        T.i32(), [cutlass.Int64(addr).ir_value(loc=loc, ip=ip),
                  Int32(target).ir_value(loc=loc, ip=ip)],
        "{ .reg .pred p; .reg .b32 v; .reg .b64 t0, t1; mov.u64 t0, %globaltimer; "
        "SPLIT_WAIT_${:uid}: ld.acquire.gpu.global.b32 v, [$1]; setp.ge.s32 p, v, $2; "
        "@p bra SPLIT_DONE_${:uid}; nanosleep.u32 32; mov.u64 t1, %globaltimer; "
        f"sub.u64 t1, t1, t0; setp.gt.u64 p, t1, {WAIT_NS}; @p trap; bra SPLIT_WAIT_${{:uid}}; "
        "SPLIT_DONE_${:uid}: mov.b32 $0, v; }",
        "=r,l,r", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@cute.jit
def merge_splits_in_kernel(mOp: cute.Tensor, mLsep: cute.Tensor, mO: cute.Tensor,
                           mLse: cute.Tensor, cnt_ptr: cute.Pointer, num_splits: Int32,
                           split: Int32, b: Int32, heads: Int32, ctid: Int32, scratch_addr,
                           nthr: cutlass.Constexpr, bar_id: cutlass.Constexpr):
    """Called by the nthr threads (ctid 0..nthr-1) that wrote this CTA's partial and LSE (or,
    for a split without tokens, its LSE -inf), after those stores; bar_id is their named
    barrier. scratch_addr: SCRATCH_BYTES of shared memory that nothing else uses now."""
    nw = nthr // 32
    lane = ctid % 32
    warp = ctid // 32
    sptr = cute.make_ptr(Float32, scratch_addr, cute.AddressSpace.smem, assumed_align=16)
    sW = cute.make_tensor(sptr, cute.make_layout((PAIRS,)))
    sH = cute.make_tensor(sptr + PAIRS, cute.make_layout((2, SLICE_HEADS), stride=(SLICE_HEADS, 1)))

    # ---- arrive, wait for every split of request b ----
    cute.arch.barrier(barrier_id=bar_id, number_of_threads=nthr)
    if ctid == 0:
        cnt = cnt_ptr + b
        cute.arch.fence_acq_rel_gpu()
        cute.arch.atomic_add(cnt, Int32(1), sem="relaxed", scope="gpu")
        _wait_count(cnt.toint(), num_splits)
        past = cute.arch.atomic_add(cnt, Int32(1), sem="relaxed", scope="gpu")
        if past == 2 * num_splits - 1:
            cute.make_tensor(cnt, cute.make_layout((1,)))[0] = Int32(0)
    cute.arch.barrier(barrier_id=bar_id, number_of_threads=nthr)
    cute.arch.fence_acq_rel_gpu()

    # ---- this CTA's slice of the H x 128 units ----
    n_units = heads * UNITS_PER_HEAD
    per = (n_units + num_splits - 1) // num_splits
    u0 = split * per
    u1 = cutlass.min(n_units, u0 + per)
    if u0 < u1:
        h0 = u0 // UNITS_PER_HEAD
        nh = (u1 - 1) // UNITS_PER_HEAD - h0 + 1
        # LSEs of the slice's heads, all splits: one round trip
        for p in cutlass.range(ctid, nh * num_splits, nthr, unroll=4):
            sW[p] = mLsep[p % num_splits, b, h0 + p // num_splits]
        cute.arch.barrier(barrier_id=bar_id, number_of_threads=nthr)
        # one warp per head: max, weights (in place), their sum
        for hl in cutlass.range(warp, nh, nw, unroll=1):
            base = hl * num_splits
            m = -Float32.inf
            for s in cutlass.range(lane, num_splits, 32, unroll=1):
                m = cute.arch.fmax(m, sW[base + s])
            for off in cutlass.range_constexpr(5):
                m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=16 >> off))
            den = Float32(0.0)
            for s in cutlass.range(lane, num_splits, 32, unroll=1):
                w = cute.math.exp2((sW[base + s] - m) * LOG2_E, fastmath=False)
                sW[base + s] = w
                den = den + w
            for off in cutlass.range_constexpr(5):
                den = den + cute.arch.shuffle_sync_bfly(den, offset=16 >> off)
            if lane == 0:
                sH[0, hl] = Float32(1.0) / den
                sH[1, hl] = m + cute.math.log2(den, fastmath=False) * LN_2
        cute.arch.barrier(barrier_id=bar_id, number_of_threads=nthr)

        # G consecutive lanes per unit, each every G-th split
        nu = u1 - u0
        G = Int32(1)
        for cand in cutlass.range_constexpr(1, 6):
            G = cutlass.select_(nu * (1 << cand) <= nthr, Int32(1 << cand), G)
        g = ctid % G
        ustep = nthr // G
        for it in cutlass.range(0, (nu + ustep - 1) // ustep, unroll=1):
            u = u0 + it * ustep + ctid // G
            uu = cutlass.min(u, u1 - 1)       # lanes past the slice compute a copy, store nothing
            h = uu // UNITS_PER_HEAD
            c4 = uu % UNITS_PER_HEAD
            base = (h - h0) * num_splits
            acc = cute.make_rmem_tensor((4,), Float32)
            acc.fill(0.0)
            for s in cutlass.range(g, num_splits, G, unroll=8):
                w = sW[base + s]
                v = cute.make_rmem_tensor((4,), Float32)
                cute.autovec_copy(cute.local_tile(mOp[s, b, h, None], (4,), (c4,)), v)
                for i in cutlass.range_constexpr(4):
                    acc[i] = acc[i] + cutlass.select_(w > Float32(0.0), v[i] * w, Float32(0.0))
            for off in cutlass.range_constexpr(5):
                if (16 >> off) < G:
                    for i in cutlass.range_constexpr(4):
                        acc[i] = acc[i] + cute.arch.shuffle_sync_bfly(acc[i], offset=16 >> off)
            if g == 0:
                if u < u1:
                    inv = sH[0, h - h0]
                    cute.local_tile(mO[b, h, None], (4,), (c4,)).store(
                        (acc.load() * inv).to(BFloat16))
                    if c4 == 0:
                        mLse[b, h] = sH[1, h - h0]


# ---------------------------------------------------------------------------------------------
# Host side: the per-stream counter arrays
# ---------------------------------------------------------------------------------------------
COUNTERS = 1024               # entries per device: fused calls have B x num_splits <= one wave,
_COUNTERS: dict = {}          # so B <= #SMs / 2
_LOCK = threading.Lock()


def split_counters(device, n: int):
    """The zeroed int32 counter array of this device (COUNTERS entries), allocated on first use
    outside CUDA-graph capture; None while capturing before that (the caller then uses the
    separate combine: an allocation made during capture would belong to the graph's pool)."""
    import torch
    if n > COUNTERS:
        raise ValueError(f"fused combine: {n} requests > {COUNTERS} split counters")
    key = torch.device(device).index
    with _LOCK:
        buf = _COUNTERS.get(key)
        if buf is None and not torch.cuda.is_current_stream_capturing():
            buf = _COUNTERS[key] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
        return buf
