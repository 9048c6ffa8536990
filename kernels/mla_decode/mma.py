"""The mma.sync core of the CuTe DSL MLA decode (core="mma", chosen only when asked for; the
host side, the other cores and the status: cutedsl.py).

One CTA per (KV split, request) computes, for all H local heads of that request at once (MQA:
the 576-wide latent row is shared by every head), an online-softmax attention over its share of
the request's tokens, in 64-token tiles that each lie inside one cache page:

  * gmem -> smem: cp.async 16-byte copies of the [64, 576] tile (bf16), or of the raw fp8 e4m3
    tile (per-tensor scale folded into the softmax scale and the output), whose MMA operands
    are then built in registers straight from the raw bytes (MlaDecodeKernel docstring); a 2-4
    deep ring of tiles. The fp8 variant at h_pad = 16 keeps two CTAs per SM.
  * S = Q K^T with mma.sync m16n8k16 (bf16 in, or fp16 for the fp8 cache; fp32 accumulate):
    the heads (padded to 16/32) are M, the 64 tokens N (four warps along N, 16 tokens each),
    the 576 dims K.
  * softmax: per-row max and sum combined across the four N warps through shared memory; the
    probabilities go to shared memory as bf16 (fp16 for the fp8 cache).
  * O += P V with the same tiled MMA: V = the first 512 dims of the same smem tile (c_kv), read
    transposed by ldmatrix (bf16; the fp8 path gathers it from the raw bytes); each of the four
    N warps owns 128 of the 512 output columns.

With one split the CTA writes the final bf16 output and the natural-log LSE. With several, it
writes an fp32 partial (normalized over its tokens) and its LSE, and combine.py merges
them exactly (the same formula as `reference.merge_partials`). A split with no tokens writes
LSE = -inf only, and the combine skips it.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32
from cutlass.cute.nvgpu import cpasync, warp

from pdserve.kernels.mla_decode.common import (
    D_QK, D_V, LN_2, SMEM_2CTA, SMEM_LIMIT, TILE_N, cvt_e4m3x2_f16x2, lds_u32, prmt,
    query_tensors, result_tensors, softmax_norm, split_tile_range, swizzled_atom,
    write_empty_split)


class MlaDecodeKernel:
    """One compiled variant: cache dtype (bf16 / fp8 e4m3), padded head count (16 / 32), page size.

    The bf16 cache: cp.async ring of [64, 576] bf16 tiles, ldmatrix for every MMA operand.

    The fp8 e4m3 cache ("direct" path, branch mla-fp8-direct; UNTESTED ON A GPU: it compiles
    for sm_90a without spills and its fragment layouts were checked against CuTe's partitions
    on the CPU, but tests/gpu/test_mla_decode_gpu.py has not run on it). The raw fp8 tile is the
    only copy of the KV data in shared memory; the MMA B operands are built in registers:
      * smem: per stage c_kv [64 tokens, 512 bytes] (16-byte units XOR-swizzled at 32-byte
        granularity by token bits 0-1, Swizzle<2,5,4>) and k_pe [64, 64] (row pairs swizzled,
        Swizzle<1,6,1>); no padding, no widened tile. h_pad = 16: 2 stages, Q + P + stats +
        ring = 94,720 bytes, two CTAs per SM (launched with minctasm 2 and a 100 % smem
        carveout). h_pad = 32: two CTAs would need <= 128 registers (ptxas spills), so one CTA
        with 4 stages, 189,440 bytes.
      * MMA operands are fp16 (Q rounded to fp16 once, P fp16): cvt.rn.f16x2.e4m3x2 widens two
        e4m3 bytes exactly in one instruction; bf16 operands would need 3 more per pair.
      * S = Q K^T: B[k][n] = K[token n][dim k]. A permutation of the 576 dims inside every
        64-dim chunk (applied to Q when it is staged into smem) lets one 16-byte ld.shared of
        the thread's token (dims 64 c + 16 tig ..) hold its B values for the chunk's four
        k-steps: per k-step one 32-bit word, its low half -> (b0, b1), high half -> (b2, b3).
      * O += P V: B[k][n] = V[token k][dim n]; the thread needs tokens 2 tig, 2 tig + 1,
        2 tig + 8, 2 tig + 9 of dim g. The PV MMA's N permutation (perm_o) gives thread g of
        warp w the output columns 128 w + 64 r1 + 8 g + r0 for N repeat r0 + 8 r1, so one 64-bit
        ld.shared per token covers 8 repeats; prmt pairs the bytes of two tokens (0x5140 /
        0x7362) and cvt widens each pair: per k-step and 8 repeats 4 loads, 8 prmt, 16 cvt.
      * Tokens inside each tile are read in a fixed permuted order (_tile_token: bits 0-2 of
        the token = (l1, l0 ^ l2, l0) of the logical column l) so that both fragment loads are
        bank-conflict free with the swizzles above (_fp8_addresses); S, the mask and P V use
        the same order, P stays in logical order.
      * Rows past the sequence end are zero-filled in smem by the loader (never the cache's
        bytes there, possibly NaN encodings 0x7F / 0xFF) and masked to -inf in S, so P V sees
        p = 0 times v = 0 there.
      * Per tile and thread: 18 ld.shared.v4 + 144 cvt + 72 mma for S, 32 ld.shared.v2 + 64
        prmt + 128 cvt + 64 mma for P V; no shared stores besides P and the row stats, and no
        barrier between the copy and the MMAs beyond the ring's one per tile.
    Registers (cubin, CPU compile): 178 (h_pad 16), 170 (h_pad 32); no spill stack.
    """

    partial_dtype = Float32           # split partials (swapab: bf16 for the fp8 cache)

    def __init__(self, kv_fp8: bool, h_pad: int, page_tokens: int, early_kv: bool = False):
        assert h_pad in (16, 32), h_pad
        assert page_tokens % TILE_N == 0, page_tokens
        self.kv_fp8 = kv_fp8
        # early_kv: seq_lens, the block table and the first KV tiles are read before
        # griddepcontrol.wait (while the previous kernel in the stream still runs); Q and every
        # write after it. Contract: that kernel must not write the cache, block table or seq_lens.
        self.early_kv = early_kv
        self.h_pad = h_pad
        self.mw = h_pad // 16                 # warps along M (16 heads each)
        self.nw = 4                           # warps along N
        self.num_threads = 32 * self.mw * self.nw
        self.page_tokens = page_tokens
        self.tiles_per_page = page_tokens // TILE_N
        self.kv_dtype = cutlass.Float8E4M3FN if kv_fp8 else BFloat16
        # MMA operand type. The fp8 cache goes straight from its raw tile into fp16 MMA operands
        # (one cvt.rn.f16x2.e4m3x2 per pair, exact; a bf16 operand would cost 3 more conversions
        # per pair): Q is then rounded to fp16, which needs |q| < 65504 (absorbed queries are
        # O(1..100)) and is finer than bf16. P is fp16 too (0 <= p <= 1).
        self.cdt = cutlass.Float16 if kv_fp8 else BFloat16
        if kv_fp8:
            # smem: Q + P + row stats, then the raw fp8 ring (c_kv [64, 512] + k_pe [64, 64]
            # per stage, swizzled, no padding). As many stages as keep two CTAs on an SM.
            # Two CTAs per SM for h_pad = 16 (128 threads, 2 stages: 94,720 bytes). h_pad = 32
            # would fit 2 stages in exactly SMEM_2CTA, but 256 threads x 2 CTAs need <= 128
            # registers: ptxas then spills (40-48 bytes of stack measured), so h_pad = 32 keeps
            # one CTA per SM and takes 4 stages instead (189,440 bytes).
            fixed = h_pad * D_QK * 2 + h_pad * TILE_N * 2 + 2 * h_pad * self.nw * 4
            per_stage = TILE_N * D_QK
            self.ctas_per_sm = 2 if h_pad == 16 else 1
            budget = SMEM_2CTA if self.ctas_per_sm == 2 else SMEM_LIMIT
            self.stages = max(2, min(4, (budget - fixed) // per_stage))
            self.smem_bytes = fixed + self.stages * per_stage
            assert self.smem_bytes <= budget, (fixed, per_stage, self.stages)
            return
        # smem budget: Q + P + row stats, then the KV ring
        fixed = h_pad * D_QK * 2 + h_pad * TILE_N * 2 + 2 * h_pad * 4 * 4 + 4 * 1024
        per_stage = TILE_N * D_QK * 2
        self.stages = max(2, min(4, (SMEM_LIMIT - fixed) // per_stage))
        assert fixed + self.stages * per_stage <= SMEM_LIMIT, (fixed, per_stage, self.stages)
        self.smem_bytes = fixed - 4 * 1024 + self.stages * per_stage
        self.ctas_per_sm = 1

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
        hp = self.h_pad
        cdt = self.cdt
        mQ, mBT = query_tensors(q_ptr, bt_ptr, batch, heads, max_pages)
        mKV = cute.make_tensor(kv_ptr, cute.make_layout(
            (num_pages, self.page_tokens, D_QK), stride=(self.page_tokens * D_QK, D_QK, 1)))
        mO, mLse, mOp, mLsep, mSeq = result_tensors(o_ptr, lse_ptr, op_ptr, lsep_ptr, seq_ptr,
                                                    batch, heads, num_splits)

        # ---- shared memory layouts ----
        sQ_layout = cute.tile_to_shape(swizzled_atom(64), (hp, D_QK), (0, 1))
        sKV_layout = cute.tile_to_shape(swizzled_atom(64), (TILE_N, D_QK), (0, 1))
        sKV_staged = cute.tile_to_shape(swizzled_atom(64), (TILE_N, D_QK, self.stages), (0, 1, 2))
        sP_layout = cute.tile_to_shape(swizzled_atom(64), (hp, TILE_N), (0, 1))
        sStat_layout = cute.make_layout((hp, self.nw), stride=(self.nw, 1))
        if cutlass.const_expr(self.kv_fp8):
            # raw fp8 ring, in bytes: c_kv rows of 512 (16-byte units XOR-swizzled at 32-byte
            # granularity by the token's low 2 bits) and k_pe rows of 64 (row pairs swizzled):
            # the fragment loads of the main loop (see _fp8_addresses) are bank-conflict free.
            # sRaw_staged = c_kv ring, sKV_layout = k_pe ring here.
            sRaw_staged = cute.make_composed_layout(cute.make_swizzle(2, 5, 4), 0, cute.make_layout(
                (TILE_N, D_V, self.stages), stride=(D_V, 1, TILE_N * D_V)))
            sKV_layout = cute.make_composed_layout(cute.make_swizzle(1, 6, 1), 0, cute.make_layout(
                (TILE_N, D_QK - D_V, self.stages), stride=(D_QK - D_V, 1, TILE_N * (D_QK - D_V))))

            @cute.struct
            class SharedStorage:
                sQ: cute.struct.Align[cute.struct.MemRange[cdt, cute.cosize(sQ_layout)], 1024]
                sKV: cute.struct.Align[
                    cute.struct.MemRange[cutlass.Float8E4M3FN, TILE_N * D_V * self.stages], 1024]
                sPE: cute.struct.Align[cute.struct.MemRange[
                    cutlass.Float8E4M3FN, TILE_N * (D_QK - D_V) * self.stages], 1024]
                sP: cute.struct.Align[cute.struct.MemRange[cdt, cute.cosize(sP_layout)], 1024]
                sMax: cute.struct.Align[cute.struct.MemRange[Float32, hp * self.nw], 16]
                sSum: cute.struct.Align[cute.struct.MemRange[Float32, hp * self.nw], 16]
        else:
            sRaw_staged = sKV_staged

            @cute.struct
            class SharedStorage:
                sQ: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sQ_layout)], 1024]
                sKV: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sKV_staged)], 1024]
                sP: cute.struct.Align[cute.struct.MemRange[cdt, cute.cosize(sP_layout)], 1024]
                sMax: cute.struct.Align[cute.struct.MemRange[Float32, hp * self.nw], 16]
                sSum: cute.struct.Align[cute.struct.MemRange[Float32, hp * self.nw], 16]

        # ---- gmem -> smem copies (16 bytes per thread per copy) ----
        nt = self.num_threads
        atom_g2s_bf16 = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), BFloat16,
            num_bits_per_copy=128)
        copy_bf16 = cute.make_tiled_copy_tv(
            atom_g2s_bf16, cute.make_layout((nt // 8, 8), stride=(8, 1)), cute.make_layout((1, 8)))
        if cutlass.const_expr(self.kv_fp8):
            atom_g2s_kv = cute.make_copy_atom(
                cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                cutlass.Float8E4M3FN, num_bits_per_copy=128)
            # c_kv: a warp per 512-byte row; k_pe (copy_cvt here): four threads per 64-byte row
            copy_kv = cute.make_tiled_copy_tv(
                atom_g2s_kv, cute.make_layout((nt // 32, 32), stride=(32, 1)),
                cute.make_layout((1, 16)))
            copy_cvt = cute.make_tiled_copy_tv(
                atom_g2s_kv, cute.make_layout((nt // 4, 4), stride=(4, 1)), cute.make_layout((1, 16)))
        else:
            copy_kv = copy_bf16
            copy_cvt = copy_bf16

        # ---- MMA: heads = M (mw warps), tokens / output columns = N (4 warps, 16 each) ----
        perm_n = cute.make_layout((8, self.nw, 2), stride=(1, 16, 8))
        tiled_mma = cute.make_tiled_mma(
            warp.MmaF16BF16Op(cdt, Float32, (16, 8, 16)),
            (self.mw, self.nw, 1),
            permutation_mnk=(hp, perm_n, 16),
        )
        if cutlass.const_expr(self.kv_fp8):
            # P V for the fp8 path: thread g of warp w, N repeat r = r0 + 8 r1 holds output
            # column 128 w + 64 r1 + 8 g + r0, so that 8 consecutive bytes of one V row (one
            # 64-bit shared load) are its B values for 8 repeats
            perm_o = cute.make_layout((8, self.nw, (8, 2)), stride=(8, 128, (1, 64)))
            tiled_mma_o = cute.make_tiled_mma(
                warp.MmaF16BF16Op(cdt, Float32, (16, 8, 16)),
                (self.mw, self.nw, 1),
                permutation_mnk=(hp, perm_o, 16),
            )
        else:
            tiled_mma_o = tiled_mma

        self.kernel(
            mQ, mKV, mBT, mSeq, mO, mLse, mOp, mLsep, num_splits, scale_log2, out_scale,
            sQ_layout, sKV_layout, sKV_staged, sRaw_staged, sP_layout, sStat_layout,
            copy_bf16, copy_kv, copy_cvt, tiled_mma, tiled_mma_o, SharedStorage,
        ).launch(grid=(num_splits, batch, 1), block=(nt, 1, 1), stream=stream, use_pdl=True,
                 **self._occupancy())

    def _occupancy(self) -> dict:
        # fp8: two CTAs per SM where the shared memory allows it (registers capped to match via
        # minctasm; an explicit carveout, in percent, keeps compilation free of device queries)
        if self.kv_fp8 and self.ctas_per_sm > 1:
            return {"min_blocks_per_mp": self.ctas_per_sm, "preferred_smem_carveout": 100}
        return {}

    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor, mKV: cute.Tensor, mBT: cute.Tensor, mSeq: cute.Tensor,
        mO: cute.Tensor, mLse: cute.Tensor, mOp: cute.Tensor, mLsep: cute.Tensor,
        num_splits: Int32, scale_log2: Float32, out_scale: Float32,
        sQ_layout: cute.ComposedLayout, sKV_layout,
        sKV_staged: cute.ComposedLayout, sRaw_staged, sP_layout: cute.ComposedLayout,
        sStat_layout: cute.Layout,
        copy_bf16: cute.TiledCopy, copy_kv: cute.TiledCopy, copy_cvt: cute.TiledCopy,
        tiled_mma: cute.TiledMma, tiled_mma_o: cute.TiledMma, SharedStorage: cutlass.Constexpr,
    ):
        hp = self.h_pad
        cdt = self.cdt
        stages = self.stages
        tidx, _, _ = cute.arch.thread_idx()
        split, b, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp_n = tidx // (32 * self.mw)
        heads = mQ.shape[1]

        seqlen, t_begin, t_end = split_tile_range(mSeq, b, split, num_splits, self.early_kv)
        if t_begin >= t_end:
            write_empty_split(mLsep, split, b, tidx, heads, self.early_kv)
        else:
            smem = cutlass.utils.SmemAllocator()
            storage = smem.allocate(SharedStorage)
            sQ = storage.sQ.get_tensor(sQ_layout)
            sP = storage.sP.get_tensor(sP_layout)
            sMax = storage.sMax.get_tensor(sStat_layout)
            sSum = storage.sSum.get_tensor(sStat_layout)
            if cutlass.const_expr(self.kv_fp8):
                sRaw = storage.sKV.get_tensor(sRaw_staged)         # c_kv ring [64, 512, stages]
                sPE = storage.sPE.get_tensor(sKV_layout)           # k_pe ring [64, 64, stages]
            else:
                sRaw = storage.sKV.get_tensor(sKV_staged)
                sKVc = sRaw[None, None, 0]

            # ---- Q -> smem and the first KV tiles, one cp.async group per ring stage ----
            thr_kv = copy_kv.get_slice(tidx)
            if cutlass.const_expr(self.kv_fp8):
                cKV = cute.make_identity_tensor((TILE_N, D_V))
                thr_pe = copy_cvt.get_slice(tidx)
                tPEcPE = thr_pe.partition_S(cute.make_identity_tensor((TILE_N, D_QK - D_V)))
            else:
                cKV = cute.make_identity_tensor((TILE_N, D_QK))
            tKVcKV = thr_kv.partition_S(cKV)
            # early_kv: tiles first, then wait, then Q, all in the first group (the group count
            # the main loop's wait_group expects is kept with empty groups); else Q, then one
            # group per tile
            if cutlass.const_expr(not self.early_kv):
                self._load_q(mQ, b, heads, sQ, copy_bf16, tidx)
            for s in cutlass.range_constexpr(stages - 1):
                if t_begin + s < t_end:
                    if cutlass.const_expr(self.kv_fp8):
                        self._load_tile_fp8(mKV, mBT, b, t_begin + s, seqlen, copy_kv, thr_kv,
                                            tKVcKV, sRaw[None, None, s], copy_cvt, thr_pe,
                                            tPEcPE, sPE[None, None, s])
                    else:
                        self._load_tile(mKV, mBT, b, t_begin + s, seqlen, copy_kv, thr_kv,
                                        tKVcKV, sRaw[None, None, s])
                if cutlass.const_expr(not self.early_kv):
                    cute.arch.cp_async_commit_group()
            if cutlass.const_expr(self.early_kv):
                cute.arch.griddepcontrol_wait()
                self._load_q(mQ, b, heads, sQ, copy_bf16, tidx)
                for s in cutlass.range_constexpr(stages - 1):
                    cute.arch.cp_async_commit_group()

            # ---- MMA partitions and smem -> register copies ----
            thr_mma = tiled_mma.get_slice(tidx)
            thr_mma_o = tiled_mma_o.get_slice(tidx)
            acc_O = cute.make_rmem_tensor(thr_mma_o.partition_shape_C((hp, D_V)), Float32)
            acc_O.fill(0.0)
            acc_S = cute.make_rmem_tensor(thr_mma.partition_shape_C((hp, TILE_N)), Float32)

            ldsm = warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4)
            ldsm_t = warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4)
            s2r_A = cute.make_tiled_copy_A(cute.make_copy_atom(ldsm, cdt), tiled_mma)
            thr_A = s2r_A.get_slice(tidx)

            tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
            tSsQ = thr_A.partition_S(sQ)
            tSrQ_v = thr_A.retile(tSrQ)
            tOrP = thr_mma.make_fragment_A(thr_mma.partition_A(sP))
            tOsP = thr_A.partition_S(sP)
            tOrP_v = thr_A.retile(tOrP)
            if cutlass.const_expr(self.kv_fp8):
                # B operands built in registers from the raw fp8 tile (32-bit views to fill)
                tSrK = cute.make_rmem_tensor(thr_mma.partition_shape_B((TILE_N, D_QK)), cdt)
                tSrK32 = cute.recast_tensor(tSrK, Int32)
                tOrV = cute.make_rmem_tensor(thr_mma_o.partition_shape_B((D_V, TILE_N)), cdt)
                tOrV32 = cute.recast_tensor(tOrV, Int32)
                k_addr, pe_addr, v_addr = self._fp8_addresses(
                    sRaw.iterator.toint(), sPE.iterator.toint(), lane, warp_n)
            else:
                s2r_B = cute.make_tiled_copy_B(cute.make_copy_atom(ldsm, cdt), tiled_mma)
                s2r_Bt = cute.make_tiled_copy_B(cute.make_copy_atom(ldsm_t, cdt), tiled_mma)
                thr_B = s2r_B.get_slice(tidx)
                thr_Bt = s2r_Bt.get_slice(tidx)
                tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sKVc))
                tSrK_v = thr_B.retile(tSrK)
                sVt0 = cute.composition(sKVc, cute.make_layout((D_V, TILE_N), stride=(TILE_N, 1)))
                tOrV = thr_mma.make_fragment_B(thr_mma.partition_B(sVt0))
                tOrV_v = thr_Bt.retile(tOrV)

            # P: fp32 accumulator -> bf16 -> smem
            r2s_P = cute.make_tiled_copy_C(
                cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cdt), tiled_mma)
            thr_P = r2s_P.get_slice(tidx)
            tPsP = thr_P.partition_D(sP)

            # row coordinates of this thread's accumulator rows
            cS = cute.make_identity_tensor((hp, TILE_N))
            tScS = thr_mma.partition_C(cS)
            tScS_mn = self._mn_view(tScS)
            acc_S_mn = self._mn_view(acc_S)
            acc_O_mn = self._mn_view(acc_O)
            n_rows = cute.size(acc_S_mn.shape[0])
            row_max = cute.make_rmem_tensor((n_rows,), Float32)
            row_sum = cute.make_rmem_tensor((n_rows,), Float32)
            row_max.fill(-Float32.inf)
            row_sum.fill(0.0)

            # ---- main loop over this split's tiles ----
            for t in cutlass.range(t_begin, t_end, unroll=1):
                it = t - t_begin
                stage = it % stages
                cute.arch.cp_async_wait_group(stages - 2)
                cute.arch.sync_threads()
                # refill the stage that tile t-1 used (everyone is past it now)
                t_next = t + stages - 1
                if t_next < t_end:
                    if cutlass.const_expr(self.kv_fp8):
                        nstage = (it + stages - 1) % stages
                        self._load_tile_fp8(mKV, mBT, b, t_next, seqlen, copy_kv, thr_kv, tKVcKV,
                                            sRaw[None, None, nstage], copy_cvt, thr_pe, tPEcPE,
                                            sPE[None, None, nstage])
                    else:
                        self._load_tile(mKV, mBT, b, t_next, seqlen, copy_kv, thr_kv, tKVcKV,
                                        sRaw[None, None, (it + stages - 1) % stages])
                cute.arch.cp_async_commit_group()

                # S = Q K^T
                acc_S.fill(0.0)
                n_k = cute.size(tSsQ.shape[2])
                if cutlass.const_expr(self.kv_fp8):
                    off_c = stage * (TILE_N * D_V)
                    off_pe = stage * (TILE_N * (D_QK - D_V))
                    cute.copy(s2r_A, tSsQ[None, None, 0], tSrQ_v[None, None, 0])
                    for c in cutlass.range_constexpr(D_QK // 64):
                        # 16 bytes (dims 64 c + 16 tig ..) of the thread's token per N repeat:
                        # the B values of four k-steps
                        kw = []
                        for r in cutlass.range_constexpr(2):
                            if cutlass.const_expr(c < D_V // 64):
                                addr = k_addr[r] + off_c
                                if cutlass.const_expr(c % 2 == 1):
                                    addr = addr ^ 64
                                addr = addr + 128 * (c // 2)
                            else:
                                addr = pe_addr[r] + off_pe
                            kw.append(lds_u32(addr, 4))
                        for s4 in cutlass.range_constexpr(4):
                            k = 4 * c + s4
                            for r in cutlass.range_constexpr(2):
                                tSrK32[0, r, k] = cvt_e4m3x2_f16x2(kw[r][s4], False)
                                tSrK32[1, r, k] = cvt_e4m3x2_f16x2(kw[r][s4], True)
                            if cutlass.const_expr(k + 1 < n_k):
                                cute.copy(s2r_A, tSsQ[None, None, k + 1], tSrQ_v[None, None, k + 1])
                            cute.gemm(tiled_mma, acc_S, tSrQ[None, None, k], tSrK[None, None, k],
                                      acc_S)
                else:
                    sK = sRaw[None, None, stage]
                    sVt = cute.composition(sK, cute.make_layout((D_V, TILE_N), stride=(TILE_N, 1)))
                    tSsK = thr_B.partition_S(sK)
                    tOsV = thr_Bt.partition_S(sVt)
                    cute.copy(s2r_A, tSsQ[None, None, 0], tSrQ_v[None, None, 0])
                    cute.copy(s2r_B, tSsK[None, None, 0], tSrK_v[None, None, 0])
                    for k in cutlass.range_constexpr(n_k):
                        if cutlass.const_expr(k + 1 < n_k):
                            cute.copy(s2r_A, tSsQ[None, None, k + 1], tSrQ_v[None, None, k + 1])
                            cute.copy(s2r_B, tSsK[None, None, k + 1], tSrK_v[None, None, k + 1])
                        cute.gemm(tiled_mma, acc_S, tSrQ[None, None, k], tSrK[None, None, k], acc_S)

                # mask tokens past the end (only the request's last tile has any)
                if (t + 1) * TILE_N > seqlen:
                    for c in cutlass.range_constexpr(cute.size(acc_S_mn.shape[1])):
                        if cutlass.const_expr(self.kv_fp8):
                            tok = self._tile_token(tScS_mn[0, c][1])
                        else:
                            tok = tScS_mn[0, c][1]
                        if t * TILE_N + tok >= seqlen:
                            for r in cutlass.range_constexpr(n_rows):
                                acc_S_mn[r, c] = -Float32.inf

                # tile row max, across the four N warps
                for r in cutlass.range_constexpr(n_rows):
                    mx = acc_S_mn[r, None].load().reduce(cute.ReductionOp.MAX, -Float32.inf, 0)
                    mx = self._quad_max(mx)
                    if lane % 4 == 0:
                        sMax[tScS_mn[r, 0][0], warp_n] = mx
                cute.arch.sync_threads()
                for r in cutlass.range_constexpr(n_rows):
                    row = tScS_mn[r, 0][0]
                    m_new = row_max[r]
                    for w in cutlass.range_constexpr(self.nw):
                        m_new = cute.arch.fmax(m_new, sMax[row, w])
                    factor = cute.math.exp2((row_max[r] - m_new) * scale_log2, fastmath=True)
                    p = cute.math.exp2(acc_S_mn[r, None].load() * scale_log2
                                       - m_new * scale_log2, fastmath=True)
                    row_sum[r] = row_sum[r] * factor + p.reduce(cute.ReductionOp.ADD, Float32.zero, 0)
                    acc_S_mn[r, None] = p
                    acc_O_mn[r, None] = acc_O_mn[r, None].load() * factor
                    row_max[r] = m_new
                rP = cute.make_fragment_like(acc_S, cdt)
                rP.store(acc_S.load().to(cdt))
                cute.copy(r2s_P, thr_P.retile(rP), tPsP)
                cute.arch.sync_threads()

                # O += P V
                n_kv = cute.size(tOsP.shape[2])
                if cutlass.const_expr(self.kv_fp8):
                    cute.copy(s2r_A, tOsP[None, None, 0], tOrP_v[None, None, 0])
                    for k in cutlass.range_constexpr(n_kv):
                        if cutlass.const_expr(k + 1 < n_kv):
                            cute.copy(s2r_A, tOsP[None, None, k + 1], tOrP_v[None, None, k + 1])
                        for j in cutlass.range_constexpr(2):
                            # tokens of B values (b0, b1, b2, b3): 8 bytes each = 8 N repeats
                            vw = []
                            for q in cutlass.range_constexpr(4):
                                addr = v_addr[q] + off_c
                                if cutlass.const_expr(j == 1):
                                    addr = addr ^ 64
                                vw.append(lds_u32(addr + k * (16 * D_V), 2))
                            for h in cutlass.range_constexpr(2):
                                for q in cutlass.range_constexpr(2):
                                    # pair (token 2 tig (+8), token 2 tig + 1 (+8)) per byte
                                    lo = prmt(vw[2 * q][h], vw[2 * q + 1][h], 0x5140)
                                    hi = prmt(vw[2 * q][h], vw[2 * q + 1][h], 0x7362)
                                    rep = 8 * j + 4 * h
                                    tOrV32[q, rep + 0, k] = cvt_e4m3x2_f16x2(lo, False)
                                    tOrV32[q, rep + 1, k] = cvt_e4m3x2_f16x2(lo, True)
                                    tOrV32[q, rep + 2, k] = cvt_e4m3x2_f16x2(hi, False)
                                    tOrV32[q, rep + 3, k] = cvt_e4m3x2_f16x2(hi, True)
                        cute.gemm(tiled_mma_o, acc_O, tOrP[None, None, k], tOrV[None, None, k],
                                  acc_O)
                else:
                    cute.copy(s2r_A, tOsP[None, None, 0], tOrP_v[None, None, 0])
                    cute.copy(s2r_Bt, tOsV[None, None, 0], tOrV_v[None, None, 0])
                    for k in cutlass.range_constexpr(n_kv):
                        if cutlass.const_expr(k + 1 < n_kv):
                            cute.copy(s2r_A, tOsP[None, None, k + 1], tOrP_v[None, None, k + 1])
                            cute.copy(s2r_Bt, tOsV[None, None, k + 1], tOrV_v[None, None, k + 1])
                        cute.gemm(tiled_mma, acc_O, tOrP[None, None, k], tOrV[None, None, k], acc_O)

            cute.arch.cp_async_wait_group(0)

            # ---- epilogue: total row sums across the N warps, normalize, LSE ----
            for r in cutlass.range_constexpr(n_rows):
                sm = self._quad_sum(row_sum[r])
                if lane % 4 == 0:
                    sSum[tScS_mn[r, 0][0], warp_n] = sm
            cute.arch.sync_threads()
            lse_r = cute.make_rmem_tensor((n_rows,), Float32)
            for r in cutlass.range_constexpr(n_rows):
                row = tScS_mn[r, 0][0]
                total = Float32(0.0)
                for w in cutlass.range_constexpr(self.nw):
                    total = total + sSum[row, w]
                inv, lg = softmax_norm(total, out_scale)
                acc_O_mn[r, None] = acc_O_mn[r, None].load() * inv
                lse_r[r] = (row_max[r] * scale_log2 + lg) * LN_2

            cO = cute.make_identity_tensor((hp, D_V))
            tOcO = thr_mma_o.partition_C(cO)
            if num_splits == 1:
                gO = cute.local_tile(mO[b, None, None], (hp, D_V), (0, 0))
                tOgO = thr_mma_o.partition_C(gO)
                rO = cute.make_fragment_like(acc_O, BFloat16)
                rO.store(acc_O.load().to(BFloat16))
                for i in cutlass.range_constexpr(cute.size(rO)):
                    if tOcO[i][0] < heads:
                        tOgO[i] = rO[i]
                if warp_n == 0 and lane % 4 == 0:
                    for r in cutlass.range_constexpr(n_rows):
                        row = tScS_mn[r, 0][0]
                        if row < heads:
                            mLse[b, row] = lse_r[r]
            else:
                gOp = cute.local_tile(mOp[split, b, None, None], (hp, D_V), (0, 0))
                tOgOp = thr_mma_o.partition_C(gOp)
                for i in cutlass.range_constexpr(cute.size(acc_O)):
                    if tOcO[i][0] < heads:
                        tOgOp[i] = acc_O[i]
                if warp_n == 0 and lane % 4 == 0:
                    for r in cutlass.range_constexpr(n_rows):
                        row = tScS_mn[r, 0][0]
                        if row < heads:
                            mLsep[split, b, row] = lse_r[r]

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def _load_q(self, mQ: cute.Tensor, b: Int32, heads: Int32, sQ: cute.Tensor,
                copy_bf16: cute.TiledCopy, tidx: Int32):
        """Request b's queries -> sQ (cp.async for bf16 MMAs, widened through registers for
        fp16 ones); rows >= H are zero."""
        cdt = self.cdt
        thr_bf16 = copy_bf16.get_slice(tidx)
        gQ = cute.local_tile(mQ[b, None, None], (self.h_pad, D_QK), (0, 0))
        if cutlass.const_expr(self.kv_fp8):
            # the K dims of every 64-dim chunk permuted (see _fp8_addresses): logical dim
            # 64 c + 16 s + kk holds dim 64 c + 16 ((kk % 8) // 2) + 4 s + kk % 2 + 2 (kk // 8)
            gQ = cute.make_tensor(gQ.iterator, cute.make_layout(
                (self.h_pad, (2, 2, 2, 2, 2, 2, D_QK // 64)),
                stride=(D_QK, (1, 16, 32, 2, 4, 8, 64))))
        cQ = cute.make_identity_tensor((self.h_pad, D_QK))
        tQgQ = thr_bf16.partition_S(gQ)
        tQsQ = thr_bf16.partition_D(sQ)
        tQcQ = thr_bf16.partition_S(cQ)
        for m in cutlass.range_constexpr(cute.size(tQsQ.shape[1])):
            if tQcQ[0, m, 0][0] < heads:
                if cutlass.const_expr(cdt == BFloat16):
                    cute.copy(copy_bf16, tQgQ[None, m, None], tQsQ[None, m, None])
                else:
                    rq = cute.make_fragment_like(tQgQ[None, m, None], BFloat16)
                    cute.autovec_copy(tQgQ[None, m, None], rq)
                    rh = cute.make_fragment_like(rq, cdt)
                    rh.store(rq.load().to(cdt))
                    cute.autovec_copy(rh, tQsQ[None, m, None])
            else:
                tQsQ[None, m, None].fill(0)

    @cute.jit
    def _load_tile(self, mKV: cute.Tensor, mBT: cute.Tensor, b: Int32, t: Int32, seqlen: Int32,
                   copy_kv: cute.TiledCopy, thr_kv, tKVcKV: cute.Tensor, sStage: cute.Tensor):
        """cp.async the 64-token tile t of request b (inside one page) into sStage."""
        page = mBT[b, t // self.tiles_per_page]
        # 64-bit page offset: a large pool holds more than 2^31 elements
        page_elems = self.page_tokens * D_QK
        off = cute.assume(cutlass.Int64(page) * page_elems, divby=page_elems)
        mPage = cute.make_tensor(mKV.iterator + off, cute.make_layout(
            (self.page_tokens, D_QK), stride=(D_QK, 1)))
        gKV = cute.local_tile(mPage, (TILE_N, D_QK), (t % self.tiles_per_page, 0))
        tKVg = thr_kv.partition_S(gKV)
        tKVs = thr_kv.partition_D(sStage)
        if (t + 1) * TILE_N <= seqlen:
            cute.copy(copy_kv, tKVg, tKVs)
        else:
            # last, partial tile: rows past the request's end are zero (never NaN)
            for n in cutlass.range_constexpr(cute.size(tKVs.shape[1])):
                if t * TILE_N + tKVcKV[0, n, 0][0] < seqlen:
                    cute.copy(copy_kv, tKVg[None, n, None], tKVs[None, n, None])
                else:
                    tKVs[None, n, None].fill(0)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def _load_tile_fp8(self, mKV: cute.Tensor, mBT: cute.Tensor, b: Int32, t: Int32,
                       seqlen: Int32, copy_c: cute.TiledCopy, thr_c, tCc: cute.Tensor,
                       sC: cute.Tensor, copy_pe: cute.TiledCopy, thr_pe, tPEc: cute.Tensor,
                       sPEs: cute.Tensor):
        """cp.async the raw fp8 tile t of request b into one stage: c_kv [64, 512] -> sC, k_pe
        [64, 64] -> sPEs. Rows past the request's end are written as zeros (never the cache's
        bytes there, which may be NaN encodings): P is 0 there and 0 * 0 stays 0 in P V."""
        page = mBT[b, t // self.tiles_per_page]
        page_elems = self.page_tokens * D_QK
        off = cute.assume(cutlass.Int64(page) * page_elems, divby=page_elems)
        mPage = cute.make_tensor(mKV.iterator + off, cute.make_layout(
            (self.page_tokens, D_QK), stride=(D_QK, 1)))
        tile = t % self.tiles_per_page
        gC = cute.local_tile(mPage, (TILE_N, D_V), (tile, 0))
        gPE = cute.local_tile(mPage, (TILE_N, D_QK - D_V), (tile, D_V // (D_QK - D_V)))
        tCg = thr_c.partition_S(gC)
        tCs = thr_c.partition_D(sC)
        tPg = thr_pe.partition_S(gPE)
        tPs = thr_pe.partition_D(sPEs)
        if (t + 1) * TILE_N <= seqlen:
            cute.copy(copy_c, tCg, tCs)
            cute.copy(copy_pe, tPg, tPs)
        else:
            for n in cutlass.range_constexpr(cute.size(tCs.shape[1])):
                if t * TILE_N + tCc[0, n, 0][0] < seqlen:
                    cute.copy(copy_c, tCg[None, n, None], tCs[None, n, None])
                else:
                    tCs[None, n, None].fill(0)
            for n in cutlass.range_constexpr(cute.size(tPs.shape[1])):
                if t * TILE_N + tPEc[0, n, 0][0] < seqlen:
                    cute.copy(copy_pe, tPg[None, n, None], tPs[None, n, None])
                else:
                    tPs[None, n, None].fill(0)

    @staticmethod
    def _tile_token(l):
        """Token (row of the raw tile) behind logical column l of S / k index of P V on the fp8
        path: bits (0, 1, 2) of the token are (l1, l0 ^ l2, l0); the rest of l unchanged."""
        return ((l >> 3) << 3) | ((l >> 1) & 1) | (((l ^ (l >> 2)) & 1) << 1) | ((l & 1) << 2)

    def _fp8_addresses(self, base_c: Int32, base_pe: Int32, lane: Int32, warp_n: Int32):
        """Per-thread shared byte addresses (stage 0, tile rows 0..15) of the fp8 fragment loads.

        c_kv byte (token, col) lies at token * 512 + (col ^ ((token % 4) * 32)) (Swizzle<2,5,4>),
        k_pe byte (token, col) at (token * 64) ^ (((token // 2) % 2) * 64) + col (Swizzle<1,6,1>).
        With lane = 4 g + tig:
          * K (S = Q K^T), N repeat r: the token behind column 16 warp_n + 8 r + g; one 16-byte
            load at dims 64 c + 16 tig of that token holds its B values of the four k-steps of
            the 64-dim chunk c (Q's dims are permuted to match). Returns k_addr[r] (chunk 0;
            chunk c < 8: XOR 64 if c is odd, then add 128 (c // 2)) and pe_addr[r] (chunk 8).
          * V (O += P V), k-step 0: the tokens behind k = 2 tig, 2 tig + 1, 2 tig + 8, 2 tig + 9
            (q = 0..3), 8 bytes at dims 128 warp_n + 8 g: v_addr[q] (dims + 64: XOR 64; k-step k
            adds k * 16 * 512). The ring is 1024-byte aligned, so XOR 64 flips column bit 6.
        Bank conflicts: a 16-byte load's quarter warp reads the same 64 bytes of two tokens that
        differ in bit 1 (-> opposite 64-byte halves); a 64-bit load's half warp reads 32 bytes
        of four tokens whose bits (0, 1) differ (-> four 32-byte slots). Both conflict free."""
        g = lane // 4
        tig = lane % 4
        k_addr = []
        pe_addr = []
        for r in range(2):
            tok = self._tile_token(16 * warp_n + 8 * r + g)
            sw = (tok % 4) * 32
            row = base_c + tok * D_V
            k_addr.append(row + ((16 * tig) ^ sw))
            pe_addr.append(base_pe + ((tok * (D_QK - D_V)) ^ (((tok // 2) % 2) * 64)) + 16 * tig)
        v_addr = []
        for kq in range(4):
            tok = self._tile_token(2 * tig + (kq % 2) + 8 * (kq // 2))
            sw = (tok % 4) * 32
            v_addr.append(base_c + tok * D_V + 128 * warp_n + ((8 * g) ^ sw))
        return k_addr, pe_addr, v_addr


    def _mn_view(self, acc):
        """((2,2), MMA_M, MMA_N) accumulator -> ((2, MMA_M), (2, MMA_N)) row/column view."""
        l = cute.make_layout(acc.layout.shape)
        mn = cute.make_layout(
            ((l.shape[0][1], l.shape[1]), (l.shape[0][0], l.shape[2])),
            stride=((l.stride[0][1], l.stride[1]), (l.stride[0][0], l.stride[2])),
        )
        return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))

    @staticmethod
    def _quad_max(v):
        v = cute.arch.fmax(v, cute.arch.shuffle_sync_bfly(v, offset=2, mask=-1, mask_and_clamp=31))
        return cute.arch.fmax(v, cute.arch.shuffle_sync_bfly(v, offset=1, mask=-1, mask_and_clamp=31))

    @staticmethod
    def _quad_sum(v):
        v = v + cute.arch.shuffle_sync_bfly(v, offset=2, mask=-1, mask_and_clamp=31)
        return v + cute.arch.shuffle_sync_bfly(v, offset=1, mask=-1, mask_and_clamp=31)
