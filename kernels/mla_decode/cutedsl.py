"""CuTe DSL absorbed MLA decode attention over the paged latent cache (Hopper sm_90a).

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
writes an fp32 partial (normalized over its tokens) and its LSE, and `_combine_kernel` merges
them exactly (the same formula as `reference.merge_partials`). A split with no tokens writes
LSE = -inf only, and the combine skips it.

Not in here (torch for now): query absorption (W_UK^T q_nope), W_UV (512 -> 128 per head) and
the sigmoid output gate.

Status on the H200 (figures of record: benchmarks/results/
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

Cores: this module's `MlaDecodeKernel` (mma.sync, above; core="mma") and the warpgroup-MMA core
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
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warp
from cutlass.cutlass_dsl import T, dsl_user_op

from pdserve.kernels.mla_decode.reference import check_fp8_query

D_QK = 576
D_V = 512
TILE_N = 64                       # tokens per tile; a tile never straddles a page
SMEM_LIMIT = 227 * 1024           # sm_90 opt-in dynamic smem per block
# two CTAs per SM: 228 KB per SM, 1 KB of it reserved per resident CTA
SMEM_2CTA = 228 * 1024 // 2 - 1024
LOG2_E = 1.4426950408889634
LN_2 = 0.6931471805599453


def _swizzled_atom(cols: int):
    bits = {64: 3, 32: 2, 16: 1}[cols]
    return cute.make_composed_layout(
        cute.make_swizzle(bits, 3, 3), 0, cute.make_layout((8, cols), stride=(cols, 1)))


def query_tensors(q_ptr, bt_ptr, batch, heads, max_pages):
    """mQ [B, H, 576] and the block table [B, max_pages] over the launch's pointers (both cores)."""
    mQ = cute.make_tensor(q_ptr, cute.make_layout(
        (batch, heads, D_QK), stride=(cute.assume(heads * D_QK, divby=64), D_QK, 1)))
    mBT = cute.make_tensor(bt_ptr, cute.make_layout((batch, max_pages), stride=(max_pages, 1)))
    return mQ, mBT


def result_tensors(o_ptr, lse_ptr, op_ptr, lsep_ptr, seq_ptr, batch, heads, num_splits):
    """(mO [B, H, 512], mLse [B, H], mOp [S, B, H, 512], mLsep [S, B, H], mSeq [B]): the final and
    the per-split outputs as the cores write them and the combine reads them (mSeq None when
    seq_ptr is: the combine reads no seq_lens)."""
    mO = cute.make_tensor(o_ptr, cute.make_layout(
        (batch, heads, D_V), stride=(cute.assume(heads * D_V, divby=64), D_V, 1)))
    mLse = cute.make_tensor(lse_ptr, cute.make_layout((batch, heads), stride=(heads, 1)))
    mOp = cute.make_tensor(op_ptr, cute.make_layout(
        (num_splits, batch, heads, D_V),
        stride=(cute.assume(batch * heads * D_V, divby=64),
                cute.assume(heads * D_V, divby=64), D_V, 1)))
    mLsep = cute.make_tensor(lsep_ptr, cute.make_layout(
        (num_splits, batch, heads), stride=(batch * heads, heads, 1)))
    mSeq = None if seq_ptr is None else cute.make_tensor(seq_ptr, cute.make_layout((batch,)))
    return mO, mLse, mOp, mLsep, mSeq


@cute.jit
def split_tile_range(mSeq: cute.Tensor, breq: Int32, split: Int32, num_splits: Int32,
                     early_kv: cutlass.Constexpr):
    """Entry of every main kernel (the three cores). PDL both ways: the combine may become
    resident now (it waits for our partials), and nothing is read or written before the previous
    kernel in the stream completed -- with early_kv the caller's wait comes later, after its
    seq_lens, block-table and KV-cache reads. Returns (seqlen, t_begin, t_end): this split's
    tiles of request `breq`."""
    cute.arch.griddepcontrol_launch_dependents()
    if cutlass.const_expr(not early_kv):
        cute.arch.griddepcontrol_wait()
    seqlen = mSeq[breq]
    n_tiles = (seqlen + (TILE_N - 1)) // TILE_N
    tiles_per_split = (n_tiles + num_splits - 1) // num_splits
    t_begin = split * tiles_per_split
    t_end = cutlass.min(t_begin + tiles_per_split, n_tiles)
    return seqlen, t_begin, t_end


@cute.jit
def write_empty_split(mLsep: cute.Tensor, split: Int32, b: Int32, tidx: Int32, heads: Int32,
                      early_kv: cutlass.Constexpr):
    """An empty split (short request) writes only its LSE, -inf: the combine gives it weight 0."""
    if cutlass.const_expr(early_kv):
        cute.arch.griddepcontrol_wait()
    if tidx < heads:
        mLsep[split, b, tidx] = -Float32.inf


@cute.jit
def tma_tile_views(tma_atom: cute.CopyAtom, mKV_tma: cute.Tensor, sRing: cute.Tensor):
    """(tKs, tKg): the ring's stages and the pool's 64-row tiles as TMA partitions (the
    descriptor prefetched)."""
    cpasync.prefetch_descriptor(tma_atom)
    gKV = cute.local_tile(mKV_tma, (TILE_N, D_QK), (None, 0))
    return cpasync.tma_partition(
        tma_atom, 0, cute.make_layout(1),
        cute.group_modes(sRing, 0, 2), cute.group_modes(gKV, 0, 2))


@cute.jit
def tma_load_tile(tma_atom: cute.CopyAtom, tKs: cute.Tensor, tKg: cute.Tensor, mBT: cute.Tensor,
                  breq: Int32, t: Int32, tiles_per_page: cutlass.Constexpr, h):
    """Tile t of request `breq` (through its block table) into the stage of producer handle h."""
    page = mBT[breq, t // tiles_per_page]
    cute.copy(tma_atom, tKg[None, page * tiles_per_page + t % tiles_per_page],
              tKs[None, h.index], tma_bar_ptr=h.barrier)


@cute.jit
def tma_produce_tiles(tma_atom: cute.CopyAtom, mKV_tma: cute.Tensor, sRing: cute.Tensor,
                      mBT: cute.Tensor, breq: Int32, t_begin: Int32, t_end: Int32,
                      tiles_per_page: cutlass.Constexpr, producer):
    """The TMA producer warp of the wgmma core (wgmma.py): tiles [t_begin, t_end) of request
    `breq`, each a [64, 576] TMA into the next stage of the ring `sRing` ([64, 576, stages])
    once the pipeline `producer` has it free."""
    tKs, tKg = tma_tile_views(tma_atom, mKV_tma, sRing)
    for t in cutlass.range(t_begin, t_end, unroll=1):
        h = producer.acquire_and_advance()
        tma_load_tile(tma_atom, tKs, tKg, mBT, breq, t, tiles_per_page, h)


@cute.jit
def copy_q_rows(copy_q: cute.TiledCopy, tQg: cute.Tensor, tQs: cute.Tensor, tQc: cute.Tensor,
                heads: Int32):
    """cp.async of this thread's query rows into shared memory (the warpgroup cores' Q load):
    rows < heads from global, the padding rows >= heads zeroed."""
    for m in cutlass.range_constexpr(cute.size(tQs.shape[1])):
        if tQc[0, m, 0][0] < heads:
            cute.copy(copy_q, tQg[None, m, None], tQs[None, m, None])
        else:
            tQs[None, m, None].fill(0)


def wgmma_c_mn_view(t):
    """wgmma C fragment ((2, 2, V), MMA_M, MMA_N) -> ((2, MMA_M), (2, V, MMA_N)) rows / cols
    (the warpgroup cores: wgmma.py, swapab.py)."""
    l = cute.make_layout(t.layout.shape)
    v, vs = l.shape[0], l.stride[0]
    mn = cute.make_layout(((v[1], l.shape[1]), (v[0], v[2], l.shape[2])),
                          stride=((vs[1], l.stride[1]), (vs[0], vs[2], l.stride[2])))
    return cute.make_tensor(t.iterator, cute.composition(t.layout, mn))


@dsl_user_op
def _cvt_e4m3x2_f16x2(x, high: bool, *, loc=None, ip=None) -> Int32:
    """The two e4m3 bytes of the low (high=False) or high half of the 32-bit x -> f16x2 (exact;
    the lower byte into the lower half)."""
    half = "hi" if high else "lo"
    return Int32(llvm.inline_asm(
        T.i32(), [Int32(x).ir_value(loc=loc, ip=ip)],
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $1; cvt.rn.f16x2.e4m3x2 $0, " + half + "; }",
        "=r,r", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def _prmt(a, b, sel: int, *, loc=None, ip=None) -> Int32:
    """prmt.b32 with an immediate selector (bytes 0-3 from a, 4-7 from b)."""
    return Int32(llvm.inline_asm(
        T.i32(), [Int32(a).ir_value(loc=loc, ip=ip), Int32(b).ir_value(loc=loc, ip=ip)],
        f"prmt.b32 $0, $1, $2, {sel:#06x};", "=r,r,r", has_side_effects=False,
        is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


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
        sQ_layout = cute.tile_to_shape(_swizzled_atom(64), (hp, D_QK), (0, 1))
        sKV_layout = cute.tile_to_shape(_swizzled_atom(64), (TILE_N, D_QK), (0, 1))
        sKV_staged = cute.tile_to_shape(_swizzled_atom(64), (TILE_N, D_QK, self.stages), (0, 1, 2))
        sP_layout = cute.tile_to_shape(_swizzled_atom(64), (hp, TILE_N), (0, 1))
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
                            kw.append(self._lds_u32(addr, 4))
                        for s4 in cutlass.range_constexpr(4):
                            k = 4 * c + s4
                            for r in cutlass.range_constexpr(2):
                                tSrK32[0, r, k] = _cvt_e4m3x2_f16x2(kw[r][s4], False)
                                tSrK32[1, r, k] = _cvt_e4m3x2_f16x2(kw[r][s4], True)
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
                                vw.append(self._lds_u32(addr + k * (16 * D_V), 2))
                            for h in cutlass.range_constexpr(2):
                                for q in cutlass.range_constexpr(2):
                                    # pair (token 2 tig (+8), token 2 tig + 1 (+8)) per byte
                                    lo = _prmt(vw[2 * q][h], vw[2 * q + 1][h], 0x5140)
                                    hi = _prmt(vw[2 * q][h], vw[2 * q + 1][h], 0x7362)
                                    rep = 8 * j + 4 * h
                                    tOrV32[q, rep + 0, k] = _cvt_e4m3x2_f16x2(lo, False)
                                    tOrV32[q, rep + 1, k] = _cvt_e4m3x2_f16x2(lo, True)
                                    tOrV32[q, rep + 2, k] = _cvt_e4m3x2_f16x2(hi, False)
                                    tOrV32[q, rep + 3, k] = _cvt_e4m3x2_f16x2(hi, True)
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
                acc_O_mn[r, None] = acc_O_mn[r, None].load() * (out_scale / total)
                lse_r[r] = (row_max[r] * scale_log2 + cute.math.log2(total, fastmath=False)) * LN_2

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

    @staticmethod
    def _lds_u32(addr: Int32, n: int):
        """n (2 or 4) 32-bit words from shared byte address addr (aligned to 4 n): one vector
        ld.shared into an rmem fragment."""
        ptr = cute.make_ptr(Int32, addr, cute.AddressSpace.smem, assumed_align=4 * n)
        dst = cute.make_rmem_tensor((n,), Int32)
        cute.autovec_copy(cute.make_tensor(ptr, cute.make_layout((n,))), dst)
        return dst

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
            w_s = cute.math.exp2((sW[s] - m) * LOG2_E, fastmath=False)
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
            inv = Float32(1.0) / den
            gO = cute.local_tile(mO[b, h, None], (4,), (gcol,))
            gO.store((acc.load() * inv).to(BFloat16))
            if tidx == 0:
                if chunk == 0:
                    mLse[b, h] = m + cute.math.log2(den, fastmath=False) * LN_2


# ================================================================================================
# Host side: compile cache, split choice, launch
# ================================================================================================
_COMPILED: dict = {}
NUM_SMS_H200 = 132


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


def env_choice(name: str, choices: tuple[str, ...]) -> str:
    """The A/B switch `name` from the environment: "" when unset, else one of `choices`; any other
    value is refused with a ValueError naming the variable."""
    value = os.environ.get(name, "")
    if value and value not in choices:
        raise ValueError(f"{name}={value!r}: must be {' or '.join(choices)}")
    return value


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


def call_consumers(core: str, kv_fp8: bool, max_seq_len: int | None,
                   num_splits: int) -> int | None:
    """The swapab core's consumer warpgroups for one call (choose_consumers with the longest
    request's tiles per split; None for the other cores)."""
    if core != "swapab":
        return None
    tiles = None
    if max_seq_len is not None:
        n_tiles = -(-int(max_seq_len) // TILE_N)
        tiles = -(-n_tiles // int(num_splits))
    return choose_consumers(kv_fp8, tiles)


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
    n_tiles = -(-int(max_seq_len) // TILE_N)
    return -(-n_tiles // int(num_splits)) >= POOL_MIN_TILES


def _core(core: str | None) -> str:
    core = CORE if core is None else core
    if core == "auto":
        core = choose_core(32, None)      # no shape here: choose_core's answer for an unknown one
    assert core in CORES, f"unknown MLA decode core {core!r} (one of {CORES} or 'auto')"
    return core


def kernel_config(kv_fp8: bool, h_pad: int, page_tokens: int, core: str | None = None,
                  early_kv: bool = False, head_groups: int = 1, consumers: int | None = None,
                  q_terms: int = 2, deterministic: bool = False):
    """The kernel object (stages, threads, dtypes) behind compile_main's variant. The wgmma core
    always pads the heads to 64 and ignores h_pad; the swapab core uses h_pad (16 / 32, its
    wgmma N). head_groups > 1: swapab only (plan_call). consumers: swapab's consumer
    warpgroups (None: choose_consumers without a shape); the other cores ignore it. q_terms:
    swapab's fp8 query terms (2, or 1 for fp8_query="single"); the other cores take 2 only.
    deterministic: swapab without the run-time tile pool (the other cores have none)."""
    core = _core(core)
    assert head_groups == 1 or core == "swapab", (core, head_groups)
    assert q_terms == 2 or core == "swapab", (core, q_terms)
    if core == "swapab":
        from pdserve.kernels.mla_decode.swapab import MlaDecodeSwapAbKernel
        return MlaDecodeSwapAbKernel(bool(kv_fp8), int(page_tokens), int(h_pad), bool(early_kv),
                                     int(head_groups), consumers, int(q_terms),
                                     bool(deterministic))
    if core == "wgmma":
        from pdserve.kernels.mla_decode.wgmma import MlaDecodeWgmmaKernel
        return MlaDecodeWgmmaKernel(bool(kv_fp8), int(page_tokens), bool(early_kv))
    return MlaDecodeKernel(bool(kv_fp8), int(h_pad), int(page_tokens), bool(early_kv))


def compile_main(kv_fp8: bool, h_pad: int, page_tokens: int, core: str | None = None,
                 dump_dir: str | None = None, early_kv: bool = False, head_groups: int = 1,
                 consumers: int | None = None, q_terms: int = 2, deterministic: bool = False):
    """Compiled split-KV attention kernel for one variant (cached for the process). With
    `dump_dir` the PTX and cubin are kept there and exposed as `.artifacts.PTX` / `.CUBIN` (the
    cache is bypassed)."""
    if dump_dir is not None:
        k = kernel_config(kv_fp8, h_pad, page_tokens, core, early_kv, head_groups, consumers,
                          q_terms, deterministic)
        return cute.compile(k, *_fake_args_main(k),
                            options=f"--keep-ptx --keep-cubin --dump-dir={dump_dir}")
    return main_variant(kv_fp8, h_pad, page_tokens, core, early_kv, head_groups, consumers,
                        q_terms, deterministic)[1]


def main_variant(kv_fp8: bool, h_pad: int, page_tokens: int, core: str | None = None,
                 early_kv: bool = False, head_groups: int = 1, consumers: int | None = None,
                 q_terms: int = 2, deterministic: bool = False):
    """(kernel object, compiled kernel) of compile_main's variant, from the process cache: the
    launcher reads the object's properties (the partials' dtype) from the variant it runs."""
    core = _core(core)
    k = kernel_config(kv_fp8, h_pad, page_tokens, core, early_kv, head_groups, consumers,
                      q_terms, deterministic)
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
               k.pool_div)
    else:
        key = ("main", bool(kv_fp8), int(h_pad), int(page_tokens), bool(early_kv))
    if key not in _COMPILED:
        _COMPILED[key] = (k, cute.compile(k, *_fake_args_main(k)))
    return _COMPILED[key]


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
    each request's heads over that many CTAs per split. `fp8_query` (fp8 cache only; default
    PDSERVE_MLA_FP8_QUERY, else "split"): "split" = the query as two e4m3 terms (Q_hi + Q_lo,
    ~1000x below bf16 rounding), "single" = one e4m3 term as vLLM's fp8 MLA path quantizes it
    (half of S^T's MMAs; the reference with fp8_query="single" mirrors the rounding); swapab
    core only. `deterministic`: bit-identical results for equal inputs from run to run. The
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
    if fp8_query is None:
        fp8_query = os.environ.get("PDSERVE_MLA_FP8_QUERY") or "split"
    q_terms = 1 if check_fp8_query(fp8_query) == "single" and fp8 else 2
    if q_terms == 1 and core != "swapab":
        raise ValueError(f"fp8_query='single' needs the swapab core, got core {core!r}")
    kscale = 1.0 if kv_scale is None else float(kv_scale)
    dev = q.device
    if out is None:
        out = torch.empty(B, H, D_V, dtype=torch.bfloat16, device=dev)
    if lse is None:
        lse = torch.empty(B, H, dtype=torch.float32, device=dev)
    # the main kernel sees B * groups requests of H / groups heads: contiguous views of q, the
    # outputs and the partials; the combine sees [B, H]
    Bv, Hv = B * groups, H // groups
    kernel, main = main_variant(fp8, h_pad_for(Hv), page_tokens, core, early_kv, groups,
                                call_consumers(core, fp8, msl, num_splits), q_terms,
                                deterministic or not call_pool(msl, num_splits))
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
        comb = compile_combine(choose_combine(num_splits, Bv * num_splits, pdt is Float32), pdt)
        comb(P(pdt, o_part), P(Float32, lse_part), P(BFloat16, out), P(Float32, lse),
             Int32(B), Int32(H), Int32(num_splits), stream)
    return out, lse
