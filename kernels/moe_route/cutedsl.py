"""CuTe DSL MoE router for decode steps on Hopper (sm_90a): one CTA, one launch.

Replaces the ~20 small torch kernels of the reference with one: at decode batch sizes
(B <= 64 tokens, E <= 512 experts) the whole routing fits one CTA.
  1. one warp per token (tokens strided over the warps): each lane holds E/32 scores
     (expert lane + 32 j), sigmoid(logit) and its biased choice value; top_k rounds of a warp
     argmax (ties: the lower expert id) pick the experts. Lane 0 renormalizes and scales the
     unbiased scores, keeps ids and weights in shared memory and sets token t's bit in each
     chosen expert's 64-bit token mask (shared-memory atomics).
  2. thread e counts its expert's pairs (popcounts) and one block scan (warp shuffles, then
     the warps' totals) gives every expert its first pair and group_end.
  3. back per token: the lane of slot r finds its pair as its expert's start plus the tokens
     below t in that expert's mask, and writes the pair and token_pair.
The shared expert (group E) gets token t's pair at B*k + t. The layout is deterministic. Compile-time: E, top_k, shared, renormalize, scaling, bias;
B is run-time.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from ..compile import CompileCache, fake_ptrs, gmem_ptr
from . import MAX_TOKENS

WARP = 32
NEG = -3.0e38
THREADS = 1024
MAX_EXPERTS = 512     # 2 x E/32 scores per lane within the 64 registers of a 1024-thread CTA


class MoeRouteSm90:
    def __init__(self, experts: int, top_k: int, shared: int, renormalize: bool,
                 scaling: float, with_bias: bool):
        if experts % WARP or not WARP <= experts <= MAX_EXPERTS:
            raise ValueError(f"experts must be a multiple of {WARP} in [{WARP}, {MAX_EXPERTS}], "
                             f"got {experts}")
        if not 1 <= top_k <= 16:
            raise ValueError(f"top_k must be in 1..16, got {top_k}")
        self.E, self.K, self.shared = experts, top_k, shared
        self.renormalize, self.scaling, self.with_bias = renormalize, float(scaling), with_bias
        self.EPL = experts // WARP
        self.WARPS = THREADS // WARP
        self.EW = experts // WARP          # warps holding an expert in the scan
        self.S = top_k + shared

    @cute.jit
    def __call__(self, logits: cute.Pointer, bias: cute.Pointer, pair_token: cute.Pointer,
                 pair_weight: cute.Pointer, token_pair: cute.Pointer, group_end: cute.Pointer,
                 B: Int32, stream):
        self.kernel(logits, bias, pair_token, pair_weight, token_pair, group_end, B).launch(
            grid=[1, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, logits: cute.Pointer, bias: cute.Pointer, pair_token: cute.Pointer,
               pair_weight: cute.Pointer, token_pair: cute.Pointer, group_end: cute.Pointer,
               B: Int32):
        E, K, S, EPL = self.E, self.K, self.S, self.EPL
        tidx, _, _ = cute.arch.thread_idx()
        lane = tidx % WARP
        warp = tidx // WARP
        smem = cutlass.memory.SmemAllocator()
        sIds = smem.allocate_tensor(Int32, cute.make_layout(MAX_TOKENS * K), 16)
        sW = smem.allocate_tensor(Float32, cute.make_layout(MAX_TOKENS * K), 16)
        sMask = smem.allocate_tensor(Int32, cute.make_layout(2 * E), 16)
        sStart = smem.allocate_tensor(Int32, cute.make_layout(E), 16)
        sWarp = smem.allocate_tensor(Int32, cute.make_layout(WARP), 16)
        mLogits = cute.make_tensor(logits, cute.make_layout((MAX_TOKENS, E), stride=(E, 1)))
        mBias = cute.make_tensor(bias, cute.make_layout(E))
        mPairToken = cute.make_tensor(pair_token, cute.make_layout(MAX_TOKENS * S))
        mPairWeight = cute.make_tensor(pair_weight, cute.make_layout(MAX_TOKENS * S))
        mTokenPair = cute.make_tensor(token_pair, cute.make_layout(MAX_TOKENS * S))
        mGroupEnd = cute.make_tensor(group_end, cute.make_layout(E + 1))
        n = B * K
        # moe_experts (launched with PDL) may start now: its set-up and its L2 prefetch of
        # the shared expert overlap this kernel; it waits for our outputs (griddepcontrol.wait)
        cute.arch.griddepcontrol_launch_dependents()

        for i in range(tidx, 2 * E, THREADS):
            sMask[i] = Int32(0)
        cute.arch.sync_threads()

        # 1. top-k per token, one warp per token
        rS = cute.make_rmem_tensor(cute.make_layout(EPL), Float32)
        rC = cute.make_rmem_tensor(cute.make_layout(EPL), Float32)
        for t in range(warp, B, self.WARPS):
            for j in cutlass.range_constexpr(EPL):
                x = mLogits[t, lane + WARP * j]
                s = 1.0 / (1.0 + cute.math.exp(-x))
                rS[j] = s
                c = s
                if cutlass.const_expr(self.with_bias):
                    c = s + mBias[lane + WARP * j]
                rC[j] = c
            total = Float32(0.0)
            for r in cutlass.range_constexpr(K):
                bv = Float32(NEG)
                bs = Float32(0.0)
                bi = Int32(E)
                for j in cutlass.range_constexpr(EPL):
                    if rC[j] > bv:          # ascending j: on ties the lower id stays
                        bv = rC[j]
                        bs = rS[j]
                        bi = lane + WARP * j
                for off in cutlass.range_constexpr(5):
                    ov = cute.arch.shuffle_sync_bfly(bv, offset=1 << (4 - off))
                    os_ = cute.arch.shuffle_sync_bfly(bs, offset=1 << (4 - off))
                    oi = cute.arch.shuffle_sync_bfly(bi, offset=1 << (4 - off))
                    if (ov > bv) | ((ov == bv) & (oi < bi)):
                        bv = ov
                        bs = os_
                        bi = oi
                for j in cutlass.range_constexpr(EPL):
                    if lane + WARP * j == bi:
                        rC[j] = Float32(NEG)
                total = total + bs
                if lane == r:
                    sIds[t * K + r] = bi
                    sW[t * K + r] = bs
                    cute.arch.atomic_or(sMask.iterator + (2 * bi + t // WARP),
                                        Int32(1) << (t % WARP))
            cute.arch.sync_warp()           # lane r's sW store, seen by the warp
            if lane < K:
                w = sW[t * K + lane]
                if cutlass.const_expr(self.renormalize):
                    w = w / (total + 1e-20)
                sW[t * K + lane] = w * self.scaling
        cute.arch.sync_threads()

        # 2. counts -> starts: one block scan
        cnt = Int32(0)
        if tidx < E:
            cnt = cute.arch.popc(sMask[2 * tidx]) + cute.arch.popc(sMask[2 * tidx + 1])
        incl = cnt
        for off in cutlass.range_constexpr(5):
            up = cute.arch.shuffle_sync_up(incl, offset=1 << off)
            if lane >= (1 << off):
                incl = incl + up
        if lane == WARP - 1:
            sWarp[warp] = incl
        cute.arch.sync_threads()
        before = Int32(0)
        for w in cutlass.range_constexpr(self.EW):
            if w < warp:
                before = before + sWarp[w]
        incl = incl + before
        if tidx < E:
            sStart[tidx] = incl - cnt
            mGroupEnd[tidx] = incl
        if cutlass.const_expr(self.shared > 0):
            if tidx == 0:
                mGroupEnd[E] = n + B
        cute.arch.sync_threads()

        # 3. each token's pairs: its expert's start + the tokens below it in the mask
        for t in range(warp, B, self.WARPS):
            if lane < K:
                e = sIds[t * K + lane]
                m0 = sMask[2 * e]
                m1 = sMask[2 * e + 1]
                below = Int32(0)
                if t < WARP:
                    below = cute.arch.popc(m0 & ((Int32(1) << t) - 1))
                else:
                    below = cute.arch.popc(m0) + cute.arch.popc(m1 & ((Int32(1) << (t - WARP)) - 1))
                p = sStart[e] + below
                mPairToken[p] = t
                mPairWeight[p] = sW[t * K + lane]
                mTokenPair[t * S + lane] = p
            if cutlass.const_expr(self.shared > 0):
                if lane == K:
                    mPairToken[n + t] = t
                    mPairWeight[n + t] = Float32(1.0)
                    mTokenPair[t * S + K] = n + t


_cache = CompileCache()


_SPECS = ((Float32, 4), (Float32, 4), (Int32, 4), (Float32, 4), (Int32, 4), (Int32, 4))


def compile_variant(experts: int, top_k: int, shared: int, renormalize: bool, scaling: float,
                    with_bias: bool, dump_dir: str | None = None):
    """Compile (or fetch) one variant; works without a GPU under CUTE_DSL_ARCH=sm_90a. With
    `dump_dir` the PTX and cubin are kept there (`.artifacts`), bypassing the cache."""
    import cuda.bindings.driver as cuda
    key = (experts, top_k, shared, renormalize, float(scaling), with_bias)

    def build(**opts):
        return cute.compile(MoeRouteSm90(*key), *fake_ptrs(_SPECS), Int32(1), cuda.CUstream(0),
                            **opts)
    return _cache.get(key, build, dump_dir)


def launch(logits, bias, top_k, groups, topk_group, func, renormalize, scaling, shared,
           pair_token, pair_weight, token_pair, group_end):
    """The kernel on the current torch stream (arguments validated by the guard)."""
    import cuda.bindings.driver as cuda
    import torch
    B, E = logits.shape
    fn = compile_variant(E, top_k, shared, renormalize, scaling, bias is not None)
    tensors = (logits, bias if bias is not None else logits, pair_token, pair_weight,
               token_pair, group_end)
    ptrs = [gmem_ptr(dt, t.data_ptr(), al) for t, (dt, al) in zip(tensors, _SPECS)]
    fn(*ptrs, Int32(B), cuda.CUstream(torch.cuda.current_stream(logits.device).cuda_stream))
    return pair_token, pair_weight, token_pair, group_end
