"""Warpgroup-MMA (wgmma) core of the CuTe DSL MLA decode kernel (Hopper sm_90a), core="wgmma".

Same contract as the mma.sync core in mma.py (`MlaDecodeKernel`: same arguments, one CTA per
(KV split, request), 64-token tiles inside one page, bf16 output + natural-log LSE, or fp32
split partials + LSE for `CombineKernel`); selected with `core="wgmma"` (compile_main /
mla_decode_cutedsl) or PDSERVE_MLA_CORE=wgmma.

Design (384 threads = three warpgroups, warp-specialized):

  * warpgroup 0, warp 0 = producer: for each of the split's tiles, looks up the page in the block
    table and issues one TMA (cp.async.bulk.tensor, 128-byte swizzle; 64-byte for fp8) of the
    [64, 576] tile into a `stages`-deep smem ring, completion on the stage's full mbarrier
    (`pipeline.PipelineTmaAsync`). It runs ahead of the consumers by up to `stages` tiles and
    gives its registers away (setmaxnreg 24; consumers 240).
  * warpgroups 1 and 2 = consumers; each owns 256 of the 512 output columns:
      - Q [64, 576] (heads padded to 64 with zero rows, which are never written out) is loaded
        once into smem (cp.async, then fence.proxy.async).
      - S = Q K^T: 36 wgmma m64n64k16 (A = Q and B = K both from smem, K-major), fp32 in
        registers (32 per thread). Both consumer warpgroups compute the same S (redundant: the
        tensor cores have room; 64x64x576 per tile and warpgroup), so no S/P exchange and no
        barrier between the two warpgroups on the bf16 path.
      - online softmax in registers: a row lives in one quad of lanes (two shuffles), no smem.
      - O[:, 256 w : 256 w + 256] += P V_w: 4 wgmma m64n256k16 with P as the register A operand
        (the S accumulator converted to bf16 in place: the C and A fragments of wgmma line up),
        V_w = columns [256 w, 256 w + 256) of the same smem tile read MN-major (the K tile's
        128-byte swizzle atoms are exactly the MN-major atoms of V), so every tile is loaded once.
        O takes 128 fp32 registers per thread.
      - a consumer warpgroup releases the stage (one arrive per warp) after its PV wgmma retired.
  * last, partial tile of a request: rows past the end (NaN in the tests' poisoned pool) are zeroed
    in smem before PV (each warpgroup its own V columns; bf16), or while widening (fp8), and their
    scores are masked to -inf.
  * fp8 e4m3 cache: TMA brings the raw fp8 tile (half the bytes) into the ring; the 256 consumer
    threads widen it into one bf16 tile (per-tensor scale folded into the softmax scale and the
    output, as in the mma.sync core), with a 256-thread named barrier before (previous tile's
    wgmma done) and after (widened tile visible to the async proxy). fp8 wgmma (quantized Q and a
    transposed V: fp8 wgmma needs K-major B) is not done.

smem: bf16 Q 72 KB + 2 x 72 KB ring (= 216 KB); fp8 Q 72 KB + widened tile 72 KB + 2 x 36 KB raw.

Expected on the H200 (estimate, not measured): per tile and SM the tensor cores do 2 x 1152
cycles of S (the two consumer warpgroups each compute it) + 1024 of PV, ~1.7 us at 1.8 GHz,
against ~2.3 us to stream a bf16 tile at the per-SM share of 4245 GB/s, and the TMA ring keeps
the next tile in flight during the chain: bf16 should approach the copy floor at every H (the
mma.sync core needs ~2.7 us per tile at H=32); fp8 (1.15 us of bytes per tile) stays bound by the
chain + widening, ~50-65 % of its floor instead of 26-38 %.

Next steps once it runs: split S between the two warpgroups (32 tokens each, P and row maxima
through smem) or ping-pong them over tiles (FlashMLA) to drop the redundant S; fp8 wgmma (fp8 Q,
V transposed in smem); vectorized (stmatrix / TMA store) epilogue; 3 bf16 stages (Q needs only
H rows: alias the padding rows of the 64-row Q descriptor); the fused split combine.

Status: compiles to sm_90a on CPU (tests/test_mla_decode_compile.py, registers read from the cubin);
NOT yet run on a GPU. The mma.sync core stays the default until tests/gpu/test_mla_decode_gpu.py
passes with core="wgmma" and benchmarks/mla_decode.py --core wgmma is faster.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup

from pdserve.kernels.mla_decode.common import (D_QK, D_V, LN_2, SMEM_LIMIT, TILE_N, copy_q_rows,
                                               query_tensors, result_tensors, softmax_norm,
                                               split_tile_range,
                                               tma_produce_tiles, wgmma_c_mn_view,
                                               write_empty_split)

M = 64                      # wgmma rows: the request's heads, padded to 64 with zero queries
N_WG = 2                    # consumer warpgroups, each owning WG_COLS output columns
WG_COLS = D_V // N_WG       # 256 = the widest wgmma N
PRODUCER_REGS = 24
CONSUMER_REGS = 240
BAR_CONSUMERS = 1           # named barrier ids (0 = __syncthreads)
BAR_WG0 = 2                 # + consumer warpgroup index


class MlaDecodeWgmmaKernel:
    """One compiled variant: cache dtype (bf16 / fp8 e4m3) and page size (a multiple of 64)."""

    partial_dtype = Float32           # split partials (swapab: bf16 for the fp8 cache)

    def __init__(self, kv_fp8: bool, page_tokens: int, early_kv: bool = False):
        assert page_tokens % TILE_N == 0, page_tokens
        self.kv_fp8 = kv_fp8
        self.early_kv = early_kv      # as MlaDecodeKernel's: the producer's TMAs before the wait
        self.ctas_per_sm = 1
        self.page_tokens = page_tokens
        self.tiles_per_page = page_tokens // TILE_N
        self.kv_dtype = cutlass.Float8E4M3FN if kv_fp8 else BFloat16
        self.num_threads = 128 * (1 + N_WG)
        self.h_pad = M
        tile_bf16 = TILE_N * D_QK * 2
        fixed = M * D_QK * 2 + 1024                    # Q + mbarriers / alignment
        if kv_fp8:
            fixed += tile_bf16                         # the widened tile
            per_stage = TILE_N * D_QK
        else:
            per_stage = tile_bf16
        self.stages = min(4, (SMEM_LIMIT - fixed) // per_stage)
        assert self.stages >= 2, self.stages
        self.smem_bytes = fixed + self.stages * per_stage
        self.tma_bytes = per_stage

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        q_ptr: cute.Pointer,       # [B, H, 576] bf16
        kv_ptr: cute.Pointer,      # [num_pages, page_tokens, 576] bf16 | fp8
        bt_ptr: cute.Pointer,      # [B, max_pages] int32
        seq_ptr: cute.Pointer,     # [B] int32
        o_ptr: cute.Pointer,       # [B, H, 512] bf16 (final, used when num_splits == 1)
        lse_ptr: cute.Pointer,     # [B, H] fp32 (final, used when num_splits == 1)
        op_ptr: cute.Pointer,      # [S, B, H, 512] fp32 partials (num_splits > 1)
        lsep_ptr: cute.Pointer,    # [S, B, H] fp32 partial LSEs (num_splits > 1)
        batch: Int32,
        heads: Int32,
        num_pages: Int32,
        max_pages: Int32,
        num_splits: Int32,
        scale_log2: Float32,       # softmax_scale * kv_scale * log2(e)
        out_scale: Float32,        # kv_scale (1 for bf16)
        stream,
    ):
        mQ, mBT = query_tensors(q_ptr, bt_ptr, batch, heads, max_pages)
        # the pool as rows: a tile is the 64-row block page * tiles_per_page + t % tiles_per_page
        mKV = cute.make_tensor(kv_ptr, cute.make_layout(
            (num_pages * self.page_tokens, D_QK), stride=(D_QK, 1)))
        mO, mLse, mOp, mLsep, mSeq = result_tensors(o_ptr, lse_ptr, op_ptr, lsep_ptr, seq_ptr,
                                                    batch, heads, num_splits)

        K_MAJOR = cute.nvgpu.OperandMajorMode.K
        MN_MAJOR = cute.nvgpu.OperandMajorMode.MN
        qk_mma = sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, K_MAJOR, K_MAJOR, Float32, (1, 1, 1), (M, TILE_N))
        pv_mma = sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, K_MAJOR, MN_MAJOR, Float32, (1, 1, 1), (M, WG_COLS),
            warpgroup.OperandSource.RMEM)

        atom_k = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, BFloat16)
        atom_mn = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.MN_SW128, BFloat16)
        sQ_layout = cute.tile_to_shape(atom_k, (M, D_QK), (0, 1))
        kv_stages = 1 if self.kv_fp8 else self.stages
        sK_layout = cute.tile_to_shape(atom_k, (TILE_N, D_QK, kv_stages), (0, 1, 2))
        # V = the first 512 columns of one K stage, as the MN-major B operand [512, 64]: the
        # same bytes (8-token x 64-column swizzle atoms; tokens blocks first, then columns)
        sV_layout = cute.tile_to_shape(atom_mn, (D_V, TILE_N), (1, 0))
        if cutlass.const_expr(self.kv_fp8):
            atom_raw = warpgroup.make_smem_layout_atom(
                warpgroup.SmemLayoutAtomKind.K_SW64, cutlass.Float8E4M3FN)
            sRaw_layout = cute.tile_to_shape(atom_raw, (TILE_N, D_QK, self.stages), (0, 1, 2))
            tma_smem = cute.slice_(sRaw_layout, (None, None, 0))
        else:
            sRaw_layout = sK_layout
            tma_smem = cute.slice_(sK_layout, (None, None, 0))
        tma_atom, mKV_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mKV, tma_smem, (TILE_N, D_QK))

        stages = self.stages
        if cutlass.const_expr(self.kv_fp8):
            @cute.struct
            class SharedStorage:
                mbar: cute.struct.MemRange[cutlass.Int64, 2 * stages]
                sQ: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sQ_layout)], 1024]
                sK: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sK_layout)], 1024]
                sRaw: cute.struct.Align[
                    cute.struct.MemRange[cutlass.Float8E4M3FN, cute.cosize(sRaw_layout)], 1024]
        else:
            @cute.struct
            class SharedStorage:
                mbar: cute.struct.MemRange[cutlass.Int64, 2 * stages]
                sQ: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sQ_layout)], 1024]
                sK: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sK_layout)], 1024]

        # Q: gmem -> smem with cp.async, 16 bytes a copy, the 256 consumer threads
        nc = 128 * N_WG
        copy_q = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                BFloat16, num_bits_per_copy=128),
            cute.make_layout((nc // 8, 8), stride=(8, 1)), cute.make_layout((1, 8)))
        # fp8 widening: each consumer thread 16 consecutive elements of one row per step
        copy_cvt = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), BFloat16, num_bits_per_copy=128),
            cute.make_layout((nc // 4, 4), stride=(4, 1)), cute.make_layout((1, 16)))

        self.kernel(
            qk_mma, pv_mma, tma_atom, mKV_tma, mQ, mBT, mSeq, mO, mLse, mOp, mLsep,
            num_splits, scale_log2, out_scale, sQ_layout, sK_layout, sV_layout, sRaw_layout,
            copy_q, copy_cvt, SharedStorage,
        ).launch(grid=(num_splits, batch, 1), block=(self.num_threads, 1, 1), stream=stream,
                 min_blocks_per_mp=1, use_pdl=True)

    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, tma_atom: cute.CopyAtom,
        mKV_tma: cute.Tensor, mQ: cute.Tensor, mBT: cute.Tensor, mSeq: cute.Tensor,
        mO: cute.Tensor, mLse: cute.Tensor, mOp: cute.Tensor, mLsep: cute.Tensor,
        num_splits: Int32, scale_log2: Float32, out_scale: Float32,
        sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout, sRaw_layout: cute.ComposedLayout,
        copy_q: cute.TiledCopy, copy_cvt: cute.TiledCopy, SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        split, b, _ = cute.arch.block_idx()
        wg = cute.arch.make_warp_uniform(tidx // 128)
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        heads = mQ.shape[1]

        seqlen, t_begin, t_end = split_tile_range(mSeq, b, split, num_splits, self.early_kv)
        if t_begin >= t_end:
            write_empty_split(mLsep, split, b, tidx, heads, self.early_kv)
        else:
            smem = cutlass.utils.SmemAllocator()
            storage = smem.allocate(SharedStorage)
            sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
            sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
            if cutlass.const_expr(self.kv_fp8):
                sLoad = storage.sRaw.get_tensor(sRaw_layout.outer, swizzle=sRaw_layout.inner)
            else:
                sLoad = sK

            producer, consumer = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar.data_ptr(),
                num_stages=self.stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4 * N_WG),
                tx_count=self.tma_bytes,
            ).make_participants()           # inits the mbarriers, fences and syncs the CTA

            if wg == 0:
                # ---------------- producer ----------------
                cute.arch.setmaxregister_decrease(PRODUCER_REGS)
                if warp == 0:
                    tma_produce_tiles(tma_atom, mKV_tma, sLoad, mBT, b, t_begin, t_end,
                                      self.tiles_per_page, producer)
            else:
                # ---------------- consumers ----------------
                cute.arch.setmaxregister_increase(CONSUMER_REGS)
                cw = wg - 1                   # this warpgroup's output columns: [256 cw, +256)
                ctid = tidx - 128             # 0..255 over both consumer warpgroups
                wtid = tidx % 128

                # Q -> smem (rows >= H zero)
                if cutlass.const_expr(self.early_kv):
                    cute.arch.griddepcontrol_wait()
                thr_q = copy_q.get_slice(ctid)
                gQ = cute.local_tile(mQ[b, None, None], (M, D_QK), (0, 0))
                tQg = thr_q.partition_S(gQ)
                tQs = thr_q.partition_D(sQ)
                tQc = thr_q.partition_S(cute.make_identity_tensor((M, D_QK)))
                copy_q_rows(copy_q, tQg, tQs, tQc, heads)
                cute.arch.cp_async_commit_group()
                cute.arch.cp_async_wait_group(0)
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=BAR_CONSUMERS, number_of_threads=128 * N_WG)

                thr_qk = qk_mma.get_slice(wtid)
                thr_pv = pv_mma.get_slice(wtid)
                tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ))       # (MMA, 1, 36)
                tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK))       # (MMA, 1, 36, st)
                acc_S = thr_qk.make_fragment_C(thr_qk.partition_shape_C((M, TILE_N)))
                acc_O = thr_pv.make_fragment_C(thr_pv.partition_shape_C((M, WG_COLS)))
                acc_O.fill(0.0)
                # P: the S accumulator as the bf16 register A operand of PV (k-blocks of 16
                # tokens = pairs of the accumulator's 8-column blocks)
                rP = cute.make_rmem_tensor(self._acc_as_a_layout(acc_S), BFloat16)
                rP_acc = cute.make_tensor(rP.iterator, cute.make_layout(acc_S.layout.shape))

                tScS = thr_qk.partition_C(cute.make_identity_tensor((M, TILE_N)))
                tScS_mn = wgmma_c_mn_view(tScS)
                acc_S_mn = wgmma_c_mn_view(acc_S)
                acc_O_mn = wgmma_c_mn_view(acc_O)
                n_rows = cute.size(acc_S_mn.shape[0])
                row_max = cute.make_rmem_tensor((n_rows,), Float32)
                row_sum = cute.make_rmem_tensor((n_rows,), Float32)
                row_max.fill(-Float32.inf)
                row_sum.fill(0.0)
                n_k = cute.size(tSrQ.shape[2])

                if cutlass.const_expr(self.kv_fp8):
                    thr_c = copy_cvt.get_slice(ctid)
                    tCs = thr_c.partition_D(sK[None, None, 0])
                    tCc = thr_c.partition_S(cute.make_identity_tensor((TILE_N, D_QK)))
                    c_row = tCc[0, 0, 0][0]

                for t in cutlass.range(t_begin, t_end, unroll=1):
                    h = consumer.wait_and_advance()
                    last = (t + 1) * TILE_N > seqlen
                    kstage = 0
                    if cutlass.const_expr(self.kv_fp8):
                        # both warpgroups are past the previous tile's wgmma on the widened tile
                        cute.arch.barrier(barrier_id=BAR_CONSUMERS, number_of_threads=128 * N_WG)
                        tRs = thr_c.partition_S(sLoad[None, None, h.index])
                        for k in cutlass.range_constexpr(cute.size(tRs.shape[2])):
                            r8 = cute.make_rmem_tensor(cute.size(tRs[None, 0, k]),
                                                       cutlass.Float8E4M3FN)
                            cute.autovec_copy(tRs[None, 0, k], r8)
                            rb = cute.make_rmem_tensor(cute.size(tRs[None, 0, k]), BFloat16)
                            rb.store(r8.load().to(BFloat16))
                            if t * TILE_N + c_row >= seqlen:
                                rb.fill(0.0)        # rows past the end (never NaN into PV)
                            cute.autovec_copy(rb, tCs[None, 0, k])
                        cute.arch.fence_proxy("async.shared", space="cta")
                        cute.arch.barrier(barrier_id=BAR_CONSUMERS, number_of_threads=128 * N_WG)
                        h.release()
                    else:
                        kstage = h.index
                        if last:
                            # zero the rows past the end in this warpgroup's V columns
                            sKz = sK[None, None, kstage]
                            for r in cutlass.range(seqlen - t * TILE_N, TILE_N, unroll=1):
                                sKz[r, cw * WG_COLS + 2 * wtid] = BFloat16(0.0)
                                sKz[r, cw * WG_COLS + 2 * wtid + 1] = BFloat16(0.0)
                            cute.arch.fence_proxy("async.shared", space="cta")
                            cute.arch.barrier(barrier_id=BAR_WG0 + cw, number_of_threads=128)

                    # S = Q K^T
                    warpgroup.fence()
                    for k in cutlass.range_constexpr(n_k):
                        qk_mma.set(warpgroup.Field.ACCUMULATE, k != 0)
                        cute.gemm(qk_mma, acc_S, tSrQ[None, None, k], tSrK[None, None, k, kstage],
                                  acc_S)
                    warpgroup.commit_group()
                    warpgroup.wait_group(0)

                    if last:
                        for c in cutlass.range_constexpr(cute.size(acc_S_mn.shape[1])):
                            if t * TILE_N + tScS_mn[0, c][1] >= seqlen:
                                for r in cutlass.range_constexpr(n_rows):
                                    acc_S_mn[r, c] = -Float32.inf

                    # online softmax: a row lives in one quad of lanes
                    for r in cutlass.range_constexpr(n_rows):
                        mx = acc_S_mn[r, None].load().reduce(cute.ReductionOp.MAX, -Float32.inf, 0)
                        m_new = cute.arch.fmax(row_max[r], self._quad_max(mx))
                        factor = cute.math.exp2((row_max[r] - m_new) * scale_log2, fastmath=True)
                        p = cute.math.exp2(acc_S_mn[r, None].load() * scale_log2
                                           - m_new * scale_log2, fastmath=True)
                        row_sum[r] = row_sum[r] * factor + p.reduce(cute.ReductionOp.ADD,
                                                                    Float32.zero, 0)
                        acc_S_mn[r, None] = p
                        acc_O_mn[r, None] = acc_O_mn[r, None].load() * factor
                        row_max[r] = m_new
                    rP_acc.store(acc_S.load().to(BFloat16))

                    # O[:, cw cols] += P V
                    sV = cute.make_tensor(sK[None, None, kstage].iterator, sV_layout.outer)
                    sVw = cute.local_tile(sV, (WG_COLS, TILE_N), (cw, 0))
                    tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sVw))     # (MMA, 1, 4)
                    warpgroup.fence()
                    pv_mma.set(warpgroup.Field.ACCUMULATE, True)
                    cute.gemm(pv_mma, acc_O, rP, tOrV, acc_O)
                    warpgroup.commit_group()
                    warpgroup.wait_group(0)
                    if cutlass.const_expr(not self.kv_fp8):
                        h.release()

                # ---- epilogue: row sums across the quad, normalize, LSE ----
                lse_r = cute.make_rmem_tensor((n_rows,), Float32)
                for r in cutlass.range_constexpr(n_rows):
                    total = self._quad_sum(row_sum[r])
                    inv, lg = softmax_norm(total, out_scale)
                    acc_O_mn[r, None] = acc_O_mn[r, None].load() * inv
                    lse_r[r] = (row_max[r] * scale_log2 + lg) * LN_2

                tOcO = thr_pv.partition_C(cute.make_identity_tensor((M, WG_COLS)))
                if num_splits == 1:
                    gO = cute.local_tile(mO[b, None, None], (M, WG_COLS), (0, cw))
                    tOgO = thr_pv.partition_C(gO)
                    rO = cute.make_fragment_like(acc_O, BFloat16)
                    rO.store(acc_O.load().to(BFloat16))
                    for i in cutlass.range_constexpr(cute.size(rO)):
                        if tOcO[i][0] < heads:
                            tOgO[i] = rO[i]
                    if cw == 0 and wtid % 4 == 0:
                        for r in cutlass.range_constexpr(n_rows):
                            row = tScS_mn[r, 0][0]
                            if row < heads:
                                mLse[b, row] = lse_r[r]
                else:
                    gOp = cute.local_tile(mOp[split, b, None, None], (M, WG_COLS), (0, cw))
                    tOgOp = thr_pv.partition_C(gOp)
                    for i in cutlass.range_constexpr(cute.size(acc_O)):
                        if tOcO[i][0] < heads:
                            tOgOp[i] = acc_O[i]
                    if cw == 0 and wtid % 4 == 0:
                        for r in cutlass.range_constexpr(n_rows):
                            row = tScS_mn[r, 0][0]
                            if row < heads:
                                mLsep[split, b, row] = lse_r[r]

    # ------------------------------------------------------------------------------------------
    @staticmethod
    def _acc_as_a_layout(acc):
        """wgmma C fragment ((2, 2, N/8), 1, 1) of S [64, N] -> the register A fragment
        ((2, 2, 2), 1, N/16) of P [64, N] over the same registers: per 16-column k-block, A holds
        (col, col + 1) x (row, row + 8) x (k, k + 8), i.e. two consecutive C column blocks."""
        v = acc.layout.shape[0]
        assert v[0] == 2 and v[1] == 2 and v[2] % 2 == 0, acc.layout
        return cute.make_layout(((2, 2, 2), 1, v[2] // 2), stride=((1, 2, 4), 0, 8))

    @staticmethod
    def _quad_max(v):
        v = cute.arch.fmax(v, cute.arch.shuffle_sync_bfly(v, offset=2, mask=-1, mask_and_clamp=31))
        return cute.arch.fmax(v, cute.arch.shuffle_sync_bfly(v, offset=1, mask=-1, mask_and_clamp=31))

    @staticmethod
    def _quad_sum(v):
        v = v + cute.arch.shuffle_sync_bfly(v, offset=2, mask=-1, mask_and_clamp=31)
        return v + cute.arch.shuffle_sync_bfly(v, offset=1, mask=-1, mask_and_clamp=31)
