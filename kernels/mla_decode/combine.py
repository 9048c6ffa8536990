"""The split-KV combine of the CuTe DSL MLA decode: each (request, head)'s split partials merged
exactly by their LSEs (the formula of reference.merge_partials), with the shape (column chunks,
split groups) chosen per call."""
from __future__ import annotations

import os

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from pdserve.kernels.mla_decode.common import (D_V, LN_2, LOG2_E, NUM_SMS_H200, result_tensors,
                                               softmax_norm)

_COMPILED: dict = {}


class CombineKernel:
    """out[b, h] = sum_s w_s O_s / sum_s w_s, w_s = exp(lse_s - max lse); lse = max + ln sum w.

    One CTA per (head, request, column chunk): `groups` groups of D_V / 4 / `chunks` threads, each
    thread 4 output columns of its chunk. Every split has written its LSE (-inf if empty), only
    the non-empty ones their partials: a thread loads its first UNROLL partials together with
    the LSEs (one dependent round trip after the PDL wait; seq_lens is not read), and a split
    whose weight is 0 contributes nothing through a select. LSEs and weights are reduced
    block-wide through shared memory (every chunk's CTA does it for itself). Group g accumulates
    splits g, g + groups, ..., and the groups' partial sums are added in a fixed order.

    The combine is latency-bound at small batch (B = 1 has only H CTAs per chunk): with one group
    and 4 loads in flight, 128 splits took ~32 dependent DRAM round trips (~20 us on the H200);
    with 4 groups, ~4. Many splits (`choose_combine`) spread each head over 2-8 column chunks
    of 8-32 groups, one round trip of loads per thread.

    Every kernel here is launched with programmatic dependent launch (PDL) and triggers its
    dependents on entry, then waits (griddepcontrol.wait) before its first global access: the
    next grid becomes resident while the current one runs (the launch latency is hidden), and
    no read or write moves ahead of the kernel before it, so callers need no extra contract."""

    unroll = 8
    max_splits = 1024

    def __init__(self, chunks: int = 1, groups: int = 4, partial_dtype=Float32):
        assert (D_V // 4) % chunks == 0 and groups >= 1, (chunks, groups)
        self.partial_dtype = partial_dtype    # the main kernel's (Float32 or BFloat16)
        self.chunks = chunks
        self.groups = groups
        self.cols = D_V // 4 // chunks                # threads per group (4 columns each)
        self.num_threads = self.cols * groups
        assert self.num_threads % 32 == 0 and self.num_threads <= 1024, self.num_threads

    @cute.jit
    def __call__(self, op_ptr: cute.Pointer, lsep_ptr: cute.Pointer, o_ptr: cute.Pointer,
                 lse_ptr: cute.Pointer, batch: Int32, heads: Int32, num_splits: Int32, stream):
        mO, mLse, mOp, mLsep, _ = result_tensors(o_ptr, lse_ptr, op_ptr, lsep_ptr, None,
                                                 batch, heads, num_splits)
        nwarps = self.num_threads // 32
        chunk_cols = 4 * self.cols

        @cute.struct
        class SharedStorage:
            sW: cute.struct.Align[cute.struct.MemRange[Float32, self.max_splits], 16]
            sRed: cute.struct.Align[cute.struct.MemRange[Float32, 2 * nwarps], 16]
            sAcc: cute.struct.Align[cute.struct.MemRange[Float32, (self.groups - 1) * chunk_cols
                                                         if self.groups > 1 else 4], 16]

        self.kernel(mOp, mLsep, mO, mLse, num_splits, SharedStorage).launch(
            grid=(heads, batch, self.chunks), block=(self.num_threads, 1, 1), stream=stream,
            use_pdl=True)

    @cute.kernel
    def kernel(self, mOp: cute.Tensor, mLsep: cute.Tensor, mO: cute.Tensor, mLse: cute.Tensor,
               num_splits: Int32, SharedStorage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        h, b, chunk = cute.arch.block_idx()
        lane = tidx % 32
        wid = tidx // 32
        nwarps = self.num_threads // 32
        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sW = storage.sW.get_tensor(cute.make_layout((self.max_splits,)))
        sRed = storage.sRed.get_tensor(cute.make_layout((2 * nwarps,)))
        sAcc = storage.sAcc.get_tensor(cute.make_layout((max(1, self.groups - 1), 4 * self.cols),
                                                        stride=(4 * self.cols, 1)))

        # the next kernel in the stream may launch now; everything read here is read after the
        # main kernel completed
        cute.arch.griddepcontrol_launch_dependents()
        cute.arch.griddepcontrol_wait()
        # Every split wrote its LSE (-inf when it had no tokens) and only the others a partial.
        # One round trip: this thread's first UNROLL partials (speculatively, also of empty
        # splits) are loaded together with the LSEs; a split of weight 0 then adds nothing
        # (a select, never 0 times its possibly unwritten bytes).
        col = tidx % self.cols                  # 4-column tile within the chunk
        gcol = chunk * self.cols + col          # 4-column tile within the 512 columns
        grp = tidx // self.cols
        pre = cute.make_rmem_tensor(cute.make_layout((4, self.unroll), stride=(1, 4)),
                                    self.partial_dtype)
        for i in cutlass.range_constexpr(self.unroll):
            if grp + i * self.groups < num_splits:
                cute.autovec_copy(
                    cute.local_tile(mOp[grp + i * self.groups, b, h, None], (4,), (gcol,)),
                    pre[None, i])

        # block max of the LSEs
        m = -Float32.inf
        for s in cutlass.range(tidx, num_splits, self.num_threads, unroll=1):
            l = mLsep[s, b, h]
            sW[s] = l
            m = cute.arch.fmax(m, l)
        for off in cutlass.range_constexpr(5):
            m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=16 >> off))
        if lane == 0:
            sRed[wid] = m
        cute.arch.sync_threads()
        m = sRed[0]
        for w in cutlass.range_constexpr(1, nwarps):
            m = cute.arch.fmax(m, sRed[w])
        # weights (0 for the empty splits) and their block sum
        den = Float32(0.0)
        for s in cutlass.range(tidx, num_splits, self.num_threads, unroll=1):
            w_s = cute.math.exp2((sW[s] - m) * LOG2_E, fastmath=True)
            sW[s] = w_s
            den = den + w_s
        for off in cutlass.range_constexpr(5):
            den = den + cute.arch.shuffle_sync_bfly(den, offset=16 >> off)
        if lane == 0:
            sRed[nwarps + wid] = den
        cute.arch.sync_threads()
        den = sRed[nwarps]
        for w in cutlass.range_constexpr(1, nwarps):
            den = den + sRed[nwarps + w]

        acc = cute.make_rmem_tensor((4,), Float32)
        acc.fill(0.0)
        for i in cutlass.range_constexpr(self.unroll):
            if grp + i * self.groups < num_splits:
                w_s = sW[grp + i * self.groups]
                if w_s > Float32(0.0):
                    acc.store(acc.load() + pre[None, i].load().to(Float32) * w_s)
        for s in cutlass.range(grp + self.unroll * self.groups, num_splits, self.groups,
                               unroll=1):
            w_s = sW[s]
            if w_s > Float32(0.0):
                part = cute.local_tile(mOp[s, b, h, None], (4,), (gcol,))
                acc.store(acc.load() + part.load().to(Float32) * w_s)
        if grp > 0:
            cute.local_tile(sAcc[grp - 1, None], (4,), (col,)).store(acc.load())
        cute.arch.sync_threads()
        if grp == 0:
            for g in cutlass.range_constexpr(self.groups - 1):
                acc.store(acc.load() + cute.local_tile(sAcc[g, None], (4,), (col,)).load())
            inv, lg = softmax_norm(den, Float32(1.0))
            gO = cute.local_tile(mO[b, h, None], (4,), (gcol,))
            gO.store((acc.load() * inv).to(BFloat16))
            if tidx == 0:
                if chunk == 0:
                    mLse[b, h] = m + lg * LN_2


# combine shapes (column chunks, groups): few splits read little per (request, head); many splits
# (B = 1 long contexts) spread each head over several CTAs of many groups, shaped by whether the
# attention grid left SMs free (choose_combine)
COMBINE_FEW = (1, 1)
COMBINE_NARROW = (1, 4)
COMBINE_WIDE = (8, 32)                    # many splits, attention grid filling the GPU
COMBINE_WIDE_BESIDE = (4, 8)              # many splits, fp32 partials, SMs left free
COMBINE_WIDE_BESIDE_BF16 = (2, 8)         # the same with bf16 partials
COMBINE_WIDE_MIN_SPLITS = 32


def choose_combine(num_splits: int, main_ctas: int | None = None,
                   fp32_partials: bool = True) -> tuple[int, int]:
    """(column chunks, split groups) of the combine for `num_splits` splits after an attention
    grid of `main_ctas` CTAs (None: taken as filling the GPU).
      * <= UNROLL splits: one group, every split among a thread's first loads (H200, session 7,
        B=64 L=8K with 2 splits: fp8 H=12 89.3 -> 83.2 us, H=32 123.1 -> 109.7, bf16 H=32
        159.8 -> 149.0 against 4 groups, of which 2 idle); up to 31: 4 groups.
      * >= 32 splits (B <= 4 with long contexts, e.g. B = 1 from L = 4K): the shape that was
        fastest on the H200 in session 13's sweep of 13 shapes (results/
        mla_decode_h200_combine_shapes_session13.json, B=1, early_kv, swapab core, two to
        three machine starts; the combine adds 2.6-4.5 us to a 5-43 us attention kernel
        there; calls on the other cores follow the same rule, unmeasured). Where the attention
        grid fills the GPU (>= 3/4 of the SMs; the cells had 128 or 132 CTAs) 8 chunks of 32
        groups: fp8 H=32 L=8K 10.3 -> 10.1 us, L=32K 19.4 -> 17.5, L=128K 36.5 -> 35.5, bf16
        H=32 L=32K 19.7 -> 18.9 (L=128K unchanged) against the previous 4 x 16. Where it
        leaves SMs free (the cells had 64 CTAs; 65-127 were not measured), on which the
        combine's CTAs can become resident early: 4 chunks of 8 groups for fp32 partials (bf16
        H=32 L=8K 10.9 -> 10.0, H=12 8.1 -> 7.3), 2 x 8 for bf16 partials (fp8 H=12 L=8K
        9.2 -> 8.9).
      * PDSERVE_MLA_COMBINE="chunks,groups" forces a shape for every call (A/B runs). Session 21
        (B=8 L=32K, 16 splits, 4 groups; results/mla_decode_h200_session21.json): 2 x 4 was
        +0.5 % at fp8 H=32 (single query), 1 x 2 and 2 x 2 +1.4 % at bf16 H=32, none better
        at fp8 H=12: within the noise of one machine, the rule kept."""
    env = os.environ.get("PDSERVE_MLA_COMBINE", "")      # A/B runs: "chunks,groups"
    if env:
        try:
            chunks, groups = (int(x) for x in env.split(","))
            CombineKernel(chunks, groups)
        except (TypeError, ValueError, AssertionError):
            raise ValueError(f"PDSERVE_MLA_COMBINE={env!r}: 'chunks,groups' with chunks "
                             "dividing 128 and 128 / chunks x groups threads a multiple of 32, "
                             "at most 1024") from None
        return chunks, groups
    if num_splits < COMBINE_WIDE_MIN_SPLITS:
        return COMBINE_FEW if num_splits <= CombineKernel.unroll else COMBINE_NARROW
    if main_ctas is None or 4 * int(main_ctas) >= 3 * NUM_SMS_H200:
        return COMBINE_WIDE
    return COMBINE_WIDE_BESIDE if fp32_partials else COMBINE_WIDE_BESIDE_BF16


def compile_combine(shape: tuple[int, int] = COMBINE_NARROW, partial_dtype=Float32):
    """Compiled LSE combine kernel for (column chunks, groups) and the partials' element type
    (cached for the process)."""
    key = ("combine",) + tuple(shape) + (partial_dtype.__name__,)
    if key not in _COMPILED:
        from cutlass.cute.runtime import make_ptr
        from cutlass.runtime import make_fake_stream
        G = cute.AddressSpace.gmem
        P = lambda dt: make_ptr(dt, 0, G, assumed_align=16)
        k = CombineKernel(*shape, partial_dtype=partial_dtype)
        _COMPILED[key] = (k, cute.compile(k, P(partial_dtype), P(Float32), P(BFloat16), P(Float32),
                                          Int32(1), Int32(1), Int32(2), make_fake_stream()))
    return _COMPILED[key][1]
