"""Swap-AB warpgroup-MMA core of the CuTe DSL MLA decode kernel (Hopper sm_90a), core="swapab".

Same contract as the other cores (`MlaDecodeKernel` in cutedsl.py, `MlaDecodeWgmmaKernel` in
wgmma.py: same arguments, one CTA per (KV split, request), 64-token tiles inside one page, bf16
output + natural-log LSE, or fp32 split partials + LSE for `CombineKernel`); bf16 or fp8 e4m3
cache (the fp8 path is described after the bf16 one).
Selected with `core="swapab"` (compile_main / mla_decode_cutedsl) or PDSERVE_MLA_CORE=swapab;
never picked by `choose_core`.

Why: the wgmma core pads the H <= 32 heads to the 64 rows of a wgmma and both of its consumer
warpgroups compute all of S, so per tile it issues ~13.6 MFLOP of which ~4.5 are useful. Here
A and B are swapped so that the heads are the MMA's N dimension (N = h_pad = 16 or 32, nothing
padded to 64) and the tokens / latent dims are M:

  * warpgroup 0, warp 0 = TMA producer, as in wgmma.py: per tile one TMA (128-byte swizzle) of the
    [64, 576] tile into a 2-stage ring (`pipeline.PipelineTmaAsync`), setmaxnreg 24.
  * warpgroup 1 = the single consumer (setmaxnreg 240):
      - Q [h_pad, 576] loaded once into smem (cp.async; rows >= H zero), K-major, 128-byte swizzle.
      - S^T [64 tokens, N] = K Q^T: 36 wgmma m64nNk16, A = the K tile in smem (K-major, the bytes
        TMA wrote), B = Q in smem (K-major). fp32, N / 2 registers per thread.
      - online softmax per head = per column of S^T: a thread holds 2 token rows of each of its
        N / 4 columns; the column max is reduced over its 2 rows, the 8 lanes sharing the column
        (xor 4, 8, 16) and the 4 warps through a (double-buffered) smem array and a 128-thread
        named barrier. The running sums stay per-thread partials (the rescale factor of a
        column is the same in every thread) and are reduced once, in the epilogue.
      - P^T (bf16) -> smem [N heads, 64 tokens] (K-major B operand, 128-byte swizzle atoms),
        fence.proxy.async + named barrier.
      - O^T [512, N] += V^T [512, 64] P^T [64, N]: 8 (M blocks) x 4 (k-steps) wgmma m64nNk16,
        A = V^T = the first 512 columns of the same K tile viewed MN-major (the same smem view
        wgmma.py uses for its MN-major V operand), B = P^T. O^T's columns are rescaled by
        exp(m_old - m_new) before. O^T: 8 x N / 2 = 4N fp32 registers per thread (128 at
        N = 32, 64 at N = 16).
      - the stage is released (one arrive per warp) after PV retired. Everything is serial
        within the tile (S^T, softmax, PV, wait); the 2-stage TMA ring overlaps the loads.
      - named barriers per tile (128 threads, id 1): the column maxima, P^T visible to the
        async proxy, and on the last tile the zeroed V rows.
  * last, partial tile: V rows past the end are zeroed in smem before the MMAs (NaN never reaches
    PV) and their scores masked to -inf.
  * epilogue: column sums across lanes and warps (smem), normalize, LSE (natural log); O^T is
    written transposed to out[b, h, d] (bf16) or the fp32 partial [split, b, h, d] (+ LSE), each
    thread from the (d, h) coordinates of its accumulator elements (8 consecutive d per head and
    warp store: full 32-byte sectors for fp32).

Registers (cubin, CPU build): 240 at launch for 256 threads (the setmaxnreg ceiling), no spill
stack, for N = 16 and 32. smem (kernel_config.smem_bytes, with 4 KB slack): 194,048 B at N = 32,
172,800 B at N = 16 (2 x 72 KB ring + Q 36 / 18 KB + P^T 4 / 2 KB + stats 1.5 / 0.75 KB); a
third stage does not fit next to Q.

MMA work per tile: 64 x N x 576 + 512 x N x 64 MACs (4.5 MFLOP at N = 32, none of it redundant)
instead of the wgmma core's 13.6.

fp8 e4m3 cache (kv_fp8=True; the same kernel, branches on kv_fp8 at trace time; the bf16 PTX is
unchanged by it). The per-tensor kv scale is folded into scale_log2 / out_scale by the host.
  * producer unchanged: one TMA of the raw [64, 576] fp8 tile (36,864 B) per stage, smem layout
    `raw_layout` = 9 column blocks of [64 tokens, 64 bytes], 64-byte swizzle (the 16-byte unit
    (d % 64) // 16 XOR (t // 2) % 4); 5 stages (half-size stages).
  * Q rounded to fp16 once into smem (K-major, 128-byte swizzle), its dims permuted inside every
    64-dim chunk as in the mma core's fp8 path (Q_PERM), so that the 4 bytes of a thread's
    K A-fragment of one k-step are contiguous: one 16-byte ld.shared per row and 64-dim chunk
    gives the A values of 4 k-steps.
  * S^T = K Q^T: fp16 wgmma m64nNk16 with A from registers (OperandSource.RMEM): per chunk two
    16-byte loads, 16 cvt.rn.f16x2.e4m3x2 (exact), 4 wgmmas in one commit group. Thread 4 g + tig
    of warp w holds S^T rows m = 16 w + g (+ 8) (the wgmma A / m16n8k16 layout, read from the
    library's tv_layout_A); row m is token row_token(m) (bits 0-1 of m permuted) so that both
    fragment loads are bank-conflict free (S^T rows, the mask, P^T and PV all use that order;
    the softmax is order-free).
  * P^T fp16 in smem, as the bf16 path (row m of S^T -> k position m).
  * O^T += V^T P^T: fp16 wgmma, A = V^T from registers. O^T row m = 64 mb + 16 w + 8 r8 + g holds
    latent dim 128 w + 16 g + 2 mb + r8 (DIM_PERM; the epilogue writes through that layout), so
    a thread's 16 rows are 16 consecutive bytes of one token: per 16-token k-step four 16-byte
    loads (tokens row_token(2 tig + jp + 8 jh)), prmt 0x5140 / 0x7362 pairs the bytes of the two
    tokens of a k pair, one cvt per pair (as the mma core's fp8 PV gather); groups of
    `pv_group` M blocks per commit. Tokens past the end are zeroed in registers (select on the
    loaded words: the cache bytes there may be NaN encodings, and p = 0 * NaN would be NaN);
    their scores are masked to -inf as on the bf16 path. K rows past the end need no zeroing
    (their S^T rows are overwritten by the mask).
  * per tile and thread: 34 ld.shared.v4, 272 cvt, 64 prmt, 68 wgmma; the stage is released
    (sync_warp + one arrive per warp) as soon as the last V words have been converted, before
    the last PV wgmma group retires.
  * overlap inside the tile: at h_pad 16 the next chunk's / group's A fragments are loaded and
    converted while the previous wgmma group runs (2 groups in flight, wait_group 1); at h_pad 32
    (O^T = 128 registers) S runs serially per chunk and PV keeps 2 groups of 2 blocks in flight:
    the only setting found that compiles without a spill stack.
  * registers (cubin, CPU build): 240 at launch, no spill stack, h_pad 16 and 32. smem
    (kernel_config.smem_bytes, 4 KB slack): 230,912 B at h_pad 32, 209,664 B at h_pad 16
    (5 x 36 KB ring + Q 36 / 18 KB + P^T 4 / 2 KB + stats).
  * fragment addressing is checked on the CPU (tests/test_mla_decode_compile.py,
    test_swapab_fp8_fragment_layouts) against the library's wgmma A layout and the TMA layout.
  Status of the fp8 path: compiles on CPU; UNTESTED ON A GPU.

Status: compiles to sm_90a on CPU (tests/test_mla_decode_compile.py: wgmma counts, registers and
no spill stack read from the cubin); NOT yet run on a GPU (bf16 or fp8). Next steps once it is correct: overlap
S of tile t+1 with the softmax / PV of tile t (or two consumer warpgroups ping-ponging tiles), a
smem-staged vectorized epilogue, stmatrix for P^T.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float16, Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup

from pdserve.kernels.mla_decode.cutedsl import (D_QK, D_V, LN_2, SMEM_LIMIT, TILE_N, MlaDecodeKernel,
                                                _cvt_e4m3x2_f16x2, _prmt, query_tensors,
                                                result_tensors)

PRODUCER_REGS = 24
CONSUMER_REGS = 240
BAR_CONSUMER = 1            # named barrier id of the consumer warpgroup (0 = __syncthreads)
N_WARPS = 4                 # warps of the consumer warpgroup (16 token rows of S^T each)
MAX_STAGES = 4              # bf16 ring (2 fit next to Q)
MAX_STAGES_FP8 = 5          # fp8 ring: half-size stages, 5 fit at h_pad 16 and 32
FP8_BLOCK = TILE_N * 64     # bytes of one [64 tokens, 64 dims] column block of the raw fp8 tile
# fp8 PV: latent dim behind O^T row m = (g, r8, w, mb) (m = g + 8 r8 + 16 w + 64 mb):
# 16 g + r8 + 128 w + 2 mb, so that one thread's 16 A rows are 16 consecutive bytes of a token
DIM_PERM = (8, 2, 4, 8)
DIM_PERM_STRIDE = (16, 1, 128, 2)
# fp8 S^T: the K (dim) order of Q in smem / of the K A-fragments, as a layout logical -> dim
# (the mma core's fp8 permutation, MlaDecodeKernel._load_q): logical 64 c + 16 s + kk holds dim
# 64 c + 16 ((kk % 8) // 2) + 4 s + kk % 2 + 2 (kk // 8)
Q_PERM = (2, 2, 2, 2, 2, 2, D_QK // 64)
Q_PERM_STRIDE = (1, 16, 32, 2, 4, 8, 64)


class MlaDecodeSwapAbKernel:
    """One compiled variant: cache dtype (bf16 / fp8 e4m3), padded head count (16 / 32 = the wgmma
    N) and page size (a multiple of 64)."""

    def __init__(self, kv_fp8: bool, page_tokens: int, h_pad: int, early_kv: bool = False):
        if h_pad not in (16, 32):
            raise ValueError(f"core 'swapab': h_pad must be 16 or 32, got {h_pad}")
        if page_tokens % TILE_N != 0:
            raise ValueError(f"page_tokens must be a multiple of {TILE_N}, got {page_tokens}")
        self.kv_fp8 = bool(kv_fp8)
        self.early_kv = early_kv      # as MlaDecodeKernel's: the producer's TMAs before the wait
        self.ctas_per_sm = 1
        self.page_tokens = page_tokens
        self.tiles_per_page = page_tokens // TILE_N
        # cache element type; MMA operand type (fp8: Q rounded to fp16, P fp16, K / V widened
        # from the raw bytes in registers with cvt.rn.f16x2.e4m3x2, exact)
        self.kv_dtype = cutlass.Float8E4M3FN if self.kv_fp8 else BFloat16
        self.cdt = Float16 if self.kv_fp8 else BFloat16
        self.h_pad = h_pad
        self.num_threads = 256
        per_stage = TILE_N * D_QK * (1 if self.kv_fp8 else 2)
        fixed = (h_pad * D_QK * 2                      # Q
                 + h_pad * TILE_N * 2                  # P^T
                 + (2 + 1) * N_WARPS * h_pad * 4       # column maxima (2 buffers) + sums
                 + 4 * 1024)                           # mbarriers / alignment
        max_stages = MAX_STAGES_FP8 if self.kv_fp8 else MAX_STAGES
        self.stages = min(max_stages, (SMEM_LIMIT - fixed) // per_stage)
        assert self.stages >= 2, self.stages
        self.smem_bytes = fixed + self.stages * per_stage
        self.tma_bytes = per_stage
        # fp8: wgmma groups allowed in flight while the next A fragments are built (S: groups of
        # the 4 k-steps of a 64-dim chunk; PV: groups of pv_group M blocks of one k-step). At
        # h_pad 32 (O^T = 128 registers) only this choice compiles without a spill stack (ptxas,
        # CPU build): S serial per chunk, PV 2 groups of 2 blocks in flight.
        self.qk_in_flight = 2 if h_pad == 16 else 1
        self.pv_in_flight = 2
        self.pv_group = 4 if h_pad == 16 else 2
        self.consumer_regs = CONSUMER_REGS

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        q_ptr: cute.Pointer,       # [B, H, 576] bf16
        kv_ptr: cute.Pointer,      # [num_pages, page_tokens, 576] bf16 | fp8 e4m3
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
        mQ, mBT = query_tensors(q_ptr, bt_ptr, batch, heads, max_pages)
        # the pool as rows: a tile is the 64-row block page * tiles_per_page + t % tiles_per_page
        mKV = cute.make_tensor(kv_ptr, cute.make_layout(
            (num_pages * self.page_tokens, D_QK), stride=(D_QK, 1)))
        mO, mLse, mOp, mLsep, mSeq = result_tensors(o_ptr, lse_ptr, op_ptr, lsep_ptr, seq_ptr,
                                                    batch, heads, num_splits)

        K_MAJOR = cute.nvgpu.OperandMajorMode.K
        MN_MAJOR = cute.nvgpu.OperandMajorMode.MN
        cdt = self.cdt
        if cutlass.const_expr(self.kv_fp8):
            # fp8: both A operands (K for S^T, V^T for O^T) are built in registers from the raw
            # fp8 bytes (fp16 values); B = Q / P^T in smem (fp16, K-major)
            RMEM = warpgroup.OperandSource.RMEM
            qk_mma = sm90_utils.make_trivial_tiled_mma(
                cdt, cdt, K_MAJOR, K_MAJOR, Float32, (1, 1, 1), (TILE_N, hp), RMEM)
            pv_mma = sm90_utils.make_trivial_tiled_mma(
                cdt, cdt, K_MAJOR, K_MAJOR, Float32, (1, 1, 1), (64, hp), RMEM)
        else:
            # S^T [64 tokens, hp] = K [64, 576] . Q^T: A = K (K-major), B = Q [hp, 576] (K-major)
            qk_mma = sm90_utils.make_trivial_tiled_mma(
                BFloat16, BFloat16, K_MAJOR, K_MAJOR, Float32, (1, 1, 1), (TILE_N, hp))
            # O^T [512, hp] += V^T [512, 64] . P^T: A = V^T (MN-major: dims contiguous), B = P^T
            # [hp, 64] (K-major); M = 512 is 8 blocks of the 64-row atom
            pv_mma = sm90_utils.make_trivial_tiled_mma(
                BFloat16, BFloat16, MN_MAJOR, K_MAJOR, Float32, (1, 1, 1), (64, hp))

        atom_k = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, cdt)
        atom_mn = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.MN_SW128, cdt)
        sQ_layout = cute.tile_to_shape(atom_k, (hp, D_QK), (0, 1))
        if cutlass.const_expr(self.kv_fp8):
            # the raw fp8 ring as TMA writes it: 9 column blocks of [64 tokens, 64 bytes], each
            # 8-row x 64-byte atoms with the 64-byte swizzle (16-byte unit ^= (token >> 1) % 4)
            sK_layout = self.raw_layout(self.stages)
        else:
            sK_layout = cute.tile_to_shape(atom_k, (TILE_N, D_QK, self.stages), (0, 1, 2))
        # V^T = the first 512 columns of one K stage, as the MN-major A operand [512, 64]: the
        # same bytes (8-token x 64-column swizzle atoms; token blocks first, then columns), the
        # view wgmma.py uses for its MN-major B operand (bf16 only)
        sV_layout = cute.tile_to_shape(atom_mn, (D_V, TILE_N), (1, 0))
        # P^T [hp heads, 64 tokens], K-major: one 128-byte swizzle atom row per head
        sP_layout = cute.tile_to_shape(atom_k, (hp, TILE_N), (0, 1))
        tma_atom, mKV_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mKV, cute.slice_(sK_layout, (None, None, 0)),
            (TILE_N, D_QK))

        stages = self.stages
        kvt = self.kv_dtype

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            sMax: cute.struct.Align[cute.struct.MemRange[Float32, 2 * N_WARPS * hp], 16]
            sSum: cute.struct.Align[cute.struct.MemRange[Float32, N_WARPS * hp], 16]
            sQ: cute.struct.Align[cute.struct.MemRange[cdt, cute.cosize(sQ_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[cdt, cute.cosize(sP_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[kvt, cute.cosize(sK_layout)], 1024]

        # Q: gmem -> smem with cp.async, 16 bytes a copy, the 128 consumer threads
        copy_q = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                BFloat16, num_bits_per_copy=128),
            cute.make_layout((128 // 8, 8), stride=(8, 1)), cute.make_layout((1, 8)))

        self.kernel(
            qk_mma, pv_mma, tma_atom, mKV_tma, mQ, mBT, mSeq, mO, mLse, mOp, mLsep,
            num_splits, scale_log2, out_scale, sQ_layout, sK_layout, sV_layout, sP_layout,
            copy_q, SharedStorage,
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
        sV_layout: cute.ComposedLayout, sP_layout: cute.ComposedLayout,
        copy_q: cute.TiledCopy, SharedStorage: cutlass.Constexpr,
    ):
        hp = self.h_pad
        tidx, _, _ = cute.arch.thread_idx()
        split, b, _ = cute.arch.block_idx()
        wg = cute.arch.make_warp_uniform(tidx // 128)
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        heads = mQ.shape[1]
        tpp = self.tiles_per_page

        # PDL both ways: the combine may become resident now (it waits for our partials), and
        # nothing here is read or written before the previous kernel in the stream completed
        # (with early_kv the producer reads seq_lens, the block table and the cache before it)
        cute.arch.griddepcontrol_launch_dependents()
        if cutlass.const_expr(not self.early_kv):
            cute.arch.griddepcontrol_wait()
        seqlen = mSeq[b]
        n_tiles = (seqlen + (TILE_N - 1)) // TILE_N
        tiles_per_split = (n_tiles + num_splits - 1) // num_splits
        t_begin = split * tiles_per_split
        t_end = cutlass.min(t_begin + tiles_per_split, n_tiles)

        if t_begin >= t_end:
            # an empty split (short request): only its LSE, which the combine skips
            if cutlass.const_expr(self.early_kv):
                cute.arch.griddepcontrol_wait()
            if tidx < heads:
                mLsep[split, b, tidx] = -Float32.inf
        else:
            smem = cutlass.utils.SmemAllocator()
            storage = smem.allocate(SharedStorage)
            sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
            sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
            sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)
            sMax = storage.sMax.get_tensor(cute.make_layout(
                (2, N_WARPS, hp), stride=(N_WARPS * hp, hp, 1)))
            sSum = storage.sSum.get_tensor(cute.make_layout((N_WARPS, hp), stride=(hp, 1)))

            producer, consumer = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar.data_ptr(),
                num_stages=self.stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, N_WARPS),
                tx_count=self.tma_bytes,
            ).make_participants()           # inits the mbarriers, fences and syncs the CTA

            if wg == 0:
                # ---------------- producer (as in wgmma.py) ----------------
                cute.arch.setmaxregister_decrease(PRODUCER_REGS)
                if warp == 0:
                    cpasync.prefetch_descriptor(tma_atom)
                    gKV = cute.local_tile(mKV_tma, (TILE_N, D_QK), (None, 0))
                    tKs, tKg = cpasync.tma_partition(
                        tma_atom, 0, cute.make_layout(1),
                        cute.group_modes(sK, 0, 2), cute.group_modes(gKV, 0, 2))
                    for t in cutlass.range(t_begin, t_end, unroll=1):
                        h = producer.acquire_and_advance()
                        page = mBT[b, t // tpp]
                        cute.copy(tma_atom, tKg[None, page * tpp + t % tpp],
                                  tKs[None, h.index], tma_bar_ptr=h.barrier)
            else:
                # ---------------- consumer ----------------
                cute.arch.setmaxregister_increase(self.consumer_regs)
                wtid = tidx - 128             # 0..127
                cwarp = wtid // 32            # 0..3: token rows [16 cwarp, +16) of S^T
                lane = wtid % 32

                # Q -> smem (rows >= H zero)
                if cutlass.const_expr(self.early_kv):
                    cute.arch.griddepcontrol_wait()
                thr_q = copy_q.get_slice(wtid)
                gQ = cute.local_tile(mQ[b, None, None], (hp, D_QK), (0, 0))
                tQg = thr_q.partition_S(gQ)
                tQs = thr_q.partition_D(sQ)
                tQc = thr_q.partition_S(cute.make_identity_tensor((hp, D_QK)))
                if cutlass.const_expr(self.kv_fp8):
                    # fp8: Q rounded to fp16 through registers, its 576 dims permuted inside every
                    # 64-dim chunk exactly as the mma core's fp8 path does (MlaDecodeKernel._load_q):
                    # logical dim 64 c + 16 s + kk holds dim 64 c + 16 ((kk % 8) // 2) + 4 s
                    # + kk % 2 + 2 (kk // 8), so that the K A-fragment of k-step s is the 4 bytes
                    # 64 c + 16 tig + 4 s .. + 3 of the thread's token (see _fp8_k_addresses)
                    gQp = cute.make_tensor(gQ.iterator, cute.make_layout(
                        (hp, Q_PERM), stride=(D_QK, Q_PERM_STRIDE)))
                    tQgp = thr_q.partition_S(gQp)
                    for m in cutlass.range_constexpr(cute.size(tQs.shape[1])):
                        if tQc[0, m, 0][0] < heads:
                            rq = cute.make_fragment_like(tQgp[None, m, None], BFloat16)
                            cute.autovec_copy(tQgp[None, m, None], rq)
                            rh = cute.make_fragment_like(rq, Float16)
                            rh.store(rq.load().to(Float16))
                            cute.autovec_copy(rh, tQs[None, m, None])
                        else:
                            tQs[None, m, None].fill(0)
                else:
                    for m in cutlass.range_constexpr(cute.size(tQs.shape[1])):
                        if tQc[0, m, 0][0] < heads:
                            cute.copy(copy_q, tQg[None, m, None], tQs[None, m, None])
                        else:
                            tQs[None, m, None].fill(0)
                    cute.arch.cp_async_commit_group()
                    cute.arch.cp_async_wait_group(0)
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=BAR_CONSUMER, number_of_threads=128)

                thr_qk = qk_mma.get_slice(wtid)
                thr_pv = pv_mma.get_slice(wtid)
                if cutlass.const_expr(not self.kv_fp8):
                    tSrK = thr_qk.make_fragment_A(thr_qk.partition_A(sK))   # (MMA, 1, 36, st)
                tSrQ = thr_qk.make_fragment_B(thr_qk.partition_B(sQ))       # (MMA, 1, 36)
                tOrP = thr_pv.make_fragment_B(thr_pv.partition_B(sP))       # (MMA, 1, 4)
                acc_S = thr_qk.make_fragment_C(thr_qk.partition_shape_C((TILE_N, hp)))
                acc_O = thr_pv.make_fragment_C(thr_pv.partition_shape_C((D_V, hp)))
                acc_O.fill(0.0)

                # (token, head) of each S^T element; P^T seen as [tokens, heads] and partitioned
                # like S^T, so that element i of the S^T fragment goes to tSsP[i]
                tScS = thr_qk.partition_C(cute.make_identity_tensor((TILE_N, hp)))
                sPt = cute.make_tensor(sP.iterator, cute.select(sP_layout.outer, mode=[1, 0]))
                tSsP = thr_qk.partition_C(sPt)
                rP = cute.make_fragment_like(acc_S, self.cdt)
                tScS_mn = self._mn_view(tScS)
                acc_S_mn = self._mn_view(acc_S)
                acc_O_mn = self._mn_view(acc_O)
                n_rows = cute.size(acc_S_mn.shape[0])       # 2 token rows
                n_cols = cute.size(acc_S_mn.shape[1])       # hp / 4 heads
                n_orows = cute.size(acc_O_mn.shape[0])      # 16 latent dims
                col_max = cute.make_rmem_tensor((n_cols,), Float32)
                col_sum = cute.make_rmem_tensor((n_cols,), Float32)    # this thread's rows only
                col_max.fill(-Float32.inf)
                col_sum.fill(0.0)
                n_k = cute.size(tSrQ.shape[2])
                if cutlass.const_expr(self.kv_fp8):
                    # per-thread shared byte addresses of the raw fp8 fragment loads (stage 0)
                    raw_base = sK.iterator.toint()
                    k_addr = raw_base + self._fp8_k_addresses(lane, cwarp)
                    v_tok, v_off = self._fp8_v_addresses(lane, cwarp)
                    v_addr = [raw_base + a for a in v_off]
                    # O^T in 4-block (256-row) groups: the PV wgmma groups of one k-step
                    lO = acc_O.layout
                    gb = self.pv_group
                    acc_O_grp = cute.make_tensor(acc_O.iterator, cute.make_layout(
                        (lO.shape[0], (gb, 8 // gb), lO.shape[2]),
                        stride=(lO.stride[0], (lO.stride[1], gb * lO.stride[1]), lO.stride[2])))

                for t in cutlass.range(t_begin, t_end, unroll=1):
                    h = consumer.wait_and_advance()
                    kstage = h.index
                    buf = (t - t_begin) % 2
                    last = (t + 1) * TILE_N > seqlen
                    if cutlass.const_expr(self.kv_fp8):
                        # S^T = K Q^T, A = K widened in registers (_fp8_qk); V rows past the end
                        # are zeroed in registers in PV
                        soff = kstage * (TILE_N * D_QK)
                        self._fp8_qk(qk_mma, thr_qk, acc_S, tSrQ, k_addr, soff)
                    else:
                        if last:
                            # zero the V rows past the end (4 of the 512 columns per thread)
                            sKz = sK[None, None, kstage]
                            for r in cutlass.range(seqlen - t * TILE_N, TILE_N, unroll=1):
                                for j in cutlass.range_constexpr(4):
                                    sKz[r, 4 * wtid + j] = BFloat16(0.0)
                            cute.arch.fence_proxy("async.shared", space="cta")
                            cute.arch.barrier(barrier_id=BAR_CONSUMER, number_of_threads=128)

                        # S^T = K Q^T
                        warpgroup.fence()
                        for k in cutlass.range_constexpr(n_k):
                            qk_mma.set(warpgroup.Field.ACCUMULATE, k != 0)
                            cute.gemm(qk_mma, acc_S, tSrK[None, None, k, kstage],
                                      tSrQ[None, None, k], acc_S)
                        warpgroup.commit_group()
                        warpgroup.wait_group(0)

                    if last:
                        for r in cutlass.range_constexpr(n_rows):
                            row = tScS_mn[r, 0][0]
                            if cutlass.const_expr(self.kv_fp8):
                                row = self.row_token(row)     # fp8: row m holds token row_token(m)
                            if t * TILE_N + row >= seqlen:
                                for c in cutlass.range_constexpr(n_cols):
                                    acc_S_mn[r, c] = -Float32.inf

                    # column (= head) maxima: this thread's 2 rows, the 8 lanes of the column,
                    # then the 4 warps through smem
                    for c in cutlass.range_constexpr(n_cols):
                        mx = acc_S_mn[None, c].load().reduce(cute.ReductionOp.MAX, -Float32.inf, 0)
                        mx = self._col_max(mx)
                        if lane < 4:
                            sMax[buf, cwarp, tScS_mn[0, c][1]] = mx
                    cute.arch.barrier(barrier_id=BAR_CONSUMER, number_of_threads=128)

                    for c in cutlass.range_constexpr(n_cols):
                        col = tScS_mn[0, c][1]
                        m_new = col_max[c]
                        for w in cutlass.range_constexpr(N_WARPS):
                            m_new = cute.arch.fmax(m_new, sMax[buf, w, col])
                        factor = cute.math.exp2((col_max[c] - m_new) * scale_log2, fastmath=True)
                        p = cute.math.exp2(acc_S_mn[None, c].load() * scale_log2
                                           - m_new * scale_log2, fastmath=True)
                        col_sum[c] = col_sum[c] * factor + p.reduce(cute.ReductionOp.ADD,
                                                                    Float32.zero, 0)
                        acc_S_mn[None, c] = p
                        acc_O_mn[None, c] = acc_O_mn[None, c].load() * factor
                        col_max[c] = m_new

                    # P^T -> smem (the previous tile's PV retired before the barrier above)
                    rP.store(acc_S.load().to(self.cdt))
                    for i in cutlass.range_constexpr(cute.size(rP)):
                        tSsP[i] = rP[i]
                    cute.arch.fence_proxy("async.shared", space="cta")
                    cute.arch.barrier(barrier_id=BAR_CONSUMER, number_of_threads=128)

                    # O^T += V^T P^T
                    if cutlass.const_expr(self.kv_fp8):
                        # A = V^T gathered and widened in registers; the stage is released
                        # after its last fragment load, before the last wgmma group retires
                        self._fp8_pv(pv_mma, thr_pv, acc_O_grp, tOrP, v_addr, v_tok, soff,
                                     seqlen - t * TILE_N, h)
                    else:
                        sV = cute.make_tensor(sK[None, None, kstage].iterator, sV_layout.outer)
                        tOrV = thr_pv.make_fragment_A(thr_pv.partition_A(sV))    # (MMA, 8, 4)
                        warpgroup.fence()
                        pv_mma.set(warpgroup.Field.ACCUMULATE, True)
                        cute.gemm(pv_mma, acc_O, tOrV, tOrP, acc_O)
                        warpgroup.commit_group()
                        warpgroup.wait_group(0)
                        h.release()

                # ---- epilogue: column sums across lanes and warps, normalize, LSE ----
                for c in cutlass.range_constexpr(n_cols):
                    s = self._col_sum(col_sum[c])
                    if lane < 4:
                        sSum[cwarp, tScS_mn[0, c][1]] = s
                cute.arch.barrier(barrier_id=BAR_CONSUMER, number_of_threads=128)
                lse_c = cute.make_rmem_tensor((n_cols,), Float32)
                for c in cutlass.range_constexpr(n_cols):
                    col = tScS_mn[0, c][1]
                    total = sSum[0, col]
                    for w in cutlass.range_constexpr(1, N_WARPS):
                        total = total + sSum[w, col]
                    acc_O_mn[None, c] = acc_O_mn[None, c].load() * (out_scale / total)
                    lse_c[c] = (col_max[c] * scale_log2
                                + cute.math.log2(total, fastmath=False)) * LN_2

                # O^T [d, h] -> out[b, h, d]: the output rows seen transposed
                tOcO = thr_pv.partition_C(cute.make_identity_tensor((D_V, hp)))
                if cutlass.const_expr(self.kv_fp8):
                    # fp8: O^T row m = 64 mb + 16 w + 8 r8 + g holds latent dim
                    # 128 w + 16 g + 2 mb + r8 (DIM_PERM, _fp8_v_addresses)
                    t_layout = cute.make_layout((DIM_PERM, hp), stride=(DIM_PERM_STRIDE, D_V))
                else:
                    t_layout = cute.make_layout((D_V, hp), stride=(1, D_V))
                if num_splits == 1:
                    gOt = cute.make_tensor(mO[b, None, None].iterator, t_layout)
                    tOgO = thr_pv.partition_C(gOt)
                    rO = cute.make_fragment_like(acc_O, BFloat16)
                    rO.store(acc_O.load().to(BFloat16))
                    for i in cutlass.range_constexpr(cute.size(rO)):
                        if tOcO[i][1] < heads:
                            tOgO[i] = rO[i]
                    if cwarp == 0 and lane < 4:
                        for c in cutlass.range_constexpr(n_cols):
                            col = tScS_mn[0, c][1]
                            if col < heads:
                                mLse[b, col] = lse_c[c]
                else:
                    gOpt = cute.make_tensor(mOp[split, b, None, None].iterator, t_layout)
                    tOgOp = thr_pv.partition_C(gOpt)
                    for i in cutlass.range_constexpr(cute.size(acc_O)):
                        if tOcO[i][1] < heads:
                            tOgOp[i] = acc_O[i]
                    if cwarp == 0 and lane < 4:
                        for c in cutlass.range_constexpr(n_cols):
                            col = tScS_mn[0, c][1]
                            if col < heads:
                                mLsep[split, b, col] = lse_c[c]

    # ------------------------------------------------------------------------------------------
    # fp8 path: register A operands from the raw fp8 tile
    @staticmethod
    def raw_layout(stages: int):
        """smem layout of the raw fp8 ring [64 tokens, 576 dims, stages] as TMA writes it (and as
        _raw_offset addresses it): 8-token x 64-byte atoms with the 64-byte swizzle, the 8 atoms
        of a 64-dim column block stacked along the tokens, then the 9 column blocks."""
        atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW64,
                                               cutlass.Float8E4M3FN)
        return cute.tile_to_shape(atom, (TILE_N, D_QK, stages), (0, 1, 2))

    @staticmethod
    def _raw_offset(t, d):
        """Byte offset of (token t, dim d) in stage 0 of raw_layout (Python ints or Int32):
        64-dim block d // 64, row t of 64 bytes, 16-byte unit (d % 64) // 16 XOR (t // 2) % 4.
        Tokens + 16 add 1024 bytes, dims + 64 add FP8_BLOCK (the XOR only reads bits 1-2 of t)."""
        return (d // 64) * FP8_BLOCK + t * 64 + ((d % 64) ^ (((t // 2) % 4) * 16))

    @staticmethod
    def row_token(m):
        """fp8 path: the token (row of the raw tile) behind S^T row m = P^T / PV k index m (Python
        int or Int32): bits (0, 1) of the token are (m0 ^ m1, m0), the rest of m unchanged (a
        bijection on every aligned group of 4). Chosen so that both fragment loads below are
        bank-conflict free; S^T, its mask, P^T and PV all use it, the softmax is order-free."""
        return (m - m % 4) + ((m % 2) ^ ((m // 2) % 2)) + 2 * (m % 2)

    @staticmethod
    def _fp8_k_addresses(lane, cwarp):
        """S^T's A = K [64 tokens, 576]: warp w, lane 4 g + tig holds rows m = 16 w + g and
        16 w + g + 8 (tokens row_token(m), the second = the first + 8, at + 512 bytes); with Q's dims permuted (Q_PERM) its k-step s of
        64-dim chunk c is the 4 bytes 64 c + 16 tig + 4 s .. + 3 of each row (bytes 0, 1 ->
        k = 2 tig, 2 tig + 1; bytes 2, 3 -> k = 2 tig + 8, 2 tig + 9). One 16-byte load per row
        and chunk: returns the byte offset of row 16 w + g, chunk 0 (row + 8: + 512, chunk c:
        + c * FP8_BLOCK). A quarter warp reads rows
        m, m + 1 (m even): tokens of opposite parity (opposite 64-byte halves of a 128-byte bank
        line), 4 distinct units each: conflict free."""
        g = lane // 4
        tig = lane % 4
        return MlaDecodeSwapAbKernel._raw_offset(
            MlaDecodeSwapAbKernel.row_token(16 * cwarp + g), 16 * tig)

    @staticmethod
    def _fp8_v_addresses(lane, cwarp):
        """O^T's A = V^T [512 dims, 64 tokens]: warp w, lane 4 g + tig holds rows m = 64 mb + 16 w
        + g + 8 r8 = dim 128 w + 16 g + 2 mb + r8 (DIM_PERM), i.e. 16 consecutive bytes of a
        token, and k = 2 tig + jp + 8 jh (+ 16 per k-step) = token row_token(k). Returns the
        tokens and byte offsets of the loads jp = 0, 1 at jh = 0 of k-step 0 (jh = 1: tokens + 8,
        offsets + 512; k-step ks: tokens + 16 ks, offsets + 1024 ks: the XOR only reads token
        bits 1-2). A quarter warp (g = 2 i, 2 i + 1; tig 0..3; jp, jh fixed) reads 4
        tokens with distinct (bit 0, bit 2) = (jp ^ tig0, tig1), 16-byte unit g % 4 ^ (bit 1
        + 2 bit 2): 8 distinct 16-byte bank groups, conflict free."""
        g = lane // 4
        tig = lane % 4
        toks = [MlaDecodeSwapAbKernel.row_token(2 * tig + jp) for jp in range(2)]
        offs = [MlaDecodeSwapAbKernel._raw_offset(tok, 128 * cwarp + 16 * g) for tok in toks]
        return toks, offs

    def _fp8_qk(self, qk_mma, thr_qk, acc_S, tSrQ, k_addr, soff):
        """S^T = K Q^T with A = K widened in registers: per 64-dim chunk two 16-byte loads, 16
        cvt.rn.f16x2.e4m3x2 into the A fragments of 4 k-steps, one wgmma group of 4; the chunk's
        conversion overlaps the previous chunk's wgmmas (at most 2 groups in flight)."""
        for c in range(D_QK // 64):
            kw = [MlaDecodeKernel._lds_u32(k_addr + soff + (FP8_BLOCK * c + 512 * r), 4)
                  for r in range(2)]
            rA = thr_qk.make_fragment_A(thr_qk.partition_shape_A((TILE_N, 64)))  # (8, 1, 4)
            rA32 = cute.recast_tensor(rA, Int32)
            for s4 in range(4):
                for hi in range(2):
                    for r in range(2):
                        # word r + 2 hi of the k-step: rows g (r 0) / g + 8 (r 1), k = 2 tig + 8 hi
                        rA32[4 * s4 + 2 * hi + r] = _cvt_e4m3x2_f16x2(kw[r][s4], hi == 1)
            warpgroup.fence()
            for s4 in range(4):
                k = 4 * c + s4
                qk_mma.set(warpgroup.Field.ACCUMULATE, k != 0)
                cute.gemm(qk_mma, acc_S, rA[None, None, s4], tSrQ[None, None, k], acc_S)
            warpgroup.commit_group()
            warpgroup.wait_group(self.qk_in_flight - 1)
        warpgroup.wait_group(0)

    def _fp8_pv(self, pv_mma, thr_pv, acc_O_grp, tOrP, v_addr, v_tok, soff, n_valid, h):
        """O^T += V^T P^T with A = V^T gathered and widened in registers: per 16-token k-step
        four 16-byte loads (tokens past the end -> 0: their bytes may be NaN encodings and
        p = 0 there), prmt pairs the bytes of tokens (k, k + 1) and one cvt widens each pair;
        two wgmma groups of 4 M blocks (16 A registers each) per k-step, at most 2 in flight.
        The stage is released once every load of the tile has been consumed."""
        pv_mma.set(warpgroup.Field.ACCUMULATE, True)
        lim = [n_valid - v_tok[jp] for jp in range(2)]
        vbase = [v_addr[jp] + soff for jp in range(2)]
        for ks in range(TILE_N // 16):
            vw = []
            for j in range(4):
                jp, jh = j % 2, j // 2
                w = MlaDecodeKernel._lds_u32(vbase[jp] + (1024 * ks + 512 * jh), 4)
                ok = lim[jp] > 16 * ks + 8 * jh       # token v_tok[jp] + 16 ks + 8 jh < n_valid
                vw.append([Int32(cutlass.select_(ok, w[i], Int32(0))) for i in range(4)])
            gb = self.pv_group
            for half in range(8 // gb):
                rA = thr_pv.make_fragment_A(thr_pv.partition_shape_A((64 * gb, 16)))  # (8, gb, 1)
                rA32 = cute.recast_tensor(rA, Int32)
                for mbl in range(gb):
                    mb = gb * half + mbl
                    # bytes 2 mb, 2 mb + 1 of both tokens: word mb // 2, bytes 0-1 or 2-3
                    sel = 0x5140 if mb % 2 == 0 else 0x7362
                    for jh in range(2):
                        pr = _prmt(vw[2 * jh][mb // 2], vw[2 * jh + 1][mb // 2], sel)
                        # word r8 + 2 jh: rows g (r8 0) / g + 8 (r8 1), k = 2 tig + 8 jh (+1)
                        rA32[4 * mbl + 2 * jh] = _cvt_e4m3x2_f16x2(pr, False)
                        rA32[4 * mbl + 2 * jh + 1] = _cvt_e4m3x2_f16x2(pr, True)
                if ks == TILE_N // 16 - 1 and half == 8 // gb - 1:
                    # every load of the stage has been consumed by this warp's lanes
                    cute.arch.sync_warp()
                    h.release()
                warpgroup.fence()
                acc = acc_O_grp[None, (None, half), None]
                cute.gemm(pv_mma, acc, rA[None, None, 0], tOrP[None, None, ks], acc)
                warpgroup.commit_group()
                warpgroup.wait_group(self.pv_in_flight - 1)
        warpgroup.wait_group(0)

    # ------------------------------------------------------------------------------------------
    @staticmethod
    def _mn_view(t):
        """wgmma C fragment ((2, 2, V), MMA_M, MMA_N) -> ((2, MMA_M), (2, V, MMA_N)) rows / cols.
        Here rows are tokens (S^T) or latent dims (O^T), columns heads."""
        l = cute.make_layout(t.layout.shape)
        v, vs = l.shape[0], l.stride[0]
        mn = cute.make_layout(((v[1], l.shape[1]), (v[0], v[2], l.shape[2])),
                              stride=((vs[1], l.stride[1]), (vs[0], vs[2], l.stride[2])))
        return cute.make_tensor(t.iterator, cute.composition(t.layout, mn))

    @staticmethod
    def _col_max(v):
        """max over the 8 lanes holding the same columns (lane % 4 equal) of a warp."""
        for off in (4, 8, 16):
            v = cute.arch.fmax(v, cute.arch.shuffle_sync_bfly(v, offset=off, mask=-1,
                                                              mask_and_clamp=31))
        return v

    @staticmethod
    def _col_sum(v):
        for off in (4, 8, 16):
            v = v + cute.arch.shuffle_sync_bfly(v, offset=off, mask=-1, mask_and_clamp=31)
        return v
