"""The split-KV combine of the CuTe DSL MLA decode: each (request, head)'s split partials merged
exactly by their LSEs (`merge_partials` is the formula in torch). Its shape (column chunks, split
groups) is the launch plan's choice (plan.choose_combine)."""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from pdserve.kernels.mla_decode.common import D_V, LN_2, LOG2_E, result_tensors, softmax_norm
from pdserve.kernels.mla_decode.plan import COMBINE_UNROLL, MAX_SPLITS, Combine

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
    and 4 loads in flight, 128 splits take ~32 dependent DRAM round trips; with 4 groups, ~4.
    Many splits (plan.choose_combine) spread each head over 2-8 column chunks of 8-32 groups,
    one round trip of loads per thread.

    Every kernel here is launched with programmatic dependent launch (PDL) and triggers its
    dependents on entry, then waits (griddepcontrol.wait) before its first global access: the
    next grid becomes resident while the current one runs (the launch latency is hidden), and
    no read or write moves ahead of the kernel before it, so callers need no extra contract."""

    unroll = COMBINE_UNROLL
    max_splits = MAX_SPLITS

    def __init__(self, chunks: int = 1, groups: int = 4, partial_dtype=Float32):
        cols = D_V // 4 // chunks if chunks > 0 and (D_V // 4) % chunks == 0 else 0
        if not cols or groups < 1 or (cols * groups) % 32 or cols * groups > 1024:
            raise ValueError(f"combine shape ({chunks}, {groups}): chunks must divide "
                             f"{D_V // 4} and {D_V // 4} / chunks x groups threads be a "
                             "multiple of 32, at most 1024")
        self.partial_dtype = partial_dtype    # the attention kernel's (Float32 or BFloat16)
        self.chunks = chunks
        self.groups = groups
        self.cols = cols                              # threads per group (4 columns each)
        self.num_threads = cols * groups

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


def compile_combine(variant: Combine):
    """(kernel object, compiled kernel) of the combine `variant`, cached for the process."""
    if variant not in _COMPILED:
        from cutlass.cute.runtime import make_ptr
        from cutlass.runtime import make_fake_stream
        G = cute.AddressSpace.gmem
        P = lambda dt: make_ptr(dt, 0, G, assumed_align=16)
        k = CombineKernel(variant.chunks, variant.groups,
                          BFloat16 if variant.bf16_partials else Float32)
        pdt = k.partial_dtype
        _COMPILED[variant] = (k, cute.compile(k, P(pdt), P(Float32), P(BFloat16), P(Float32),
                                              Int32(1), Int32(1), Int32(2),
                                              make_fake_stream()))
    return _COMPILED[variant]


def merge_partials(outs, lses):
    """The combine's formula in torch: the exact LSE merge of partial attention results over
    disjoint token sets.

    outs: [S, ..., D] (or a sequence of S tensors [..., D]), each normalized over its own
    tokens; lses: [S, ...] natural-log softmax denominators (-inf for an empty part).
    Returns (out [..., D] fp32, lse [...] fp32). A position whose parts are all empty gets
    out 0 and lse -inf.
    """
    import torch
    if not torch.is_tensor(outs):
        outs = torch.stack(list(outs))
    if not torch.is_tensor(lses):
        lses = torch.stack(list(lses))
    outs = outs.float()
    lses = lses.float()
    m = lses.amax(dim=0)                                      # [...]
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lses - m_safe)                              # [S, ...]; 0 for empty parts
    denom = w.sum(dim=0)                                      # [...]
    # empty parts may carry garbage (even NaN) in outs: never let it through
    contrib = torch.where(w[..., None] > 0, outs, torch.zeros_like(outs)) * w[..., None]
    out = contrib.sum(dim=0) / torch.where(denom > 0, denom, torch.ones_like(denom))[..., None]
    lse = torch.where(denom > 0, m_safe + torch.log(denom), torch.full_like(m, -float("inf")))
    return out, lse
