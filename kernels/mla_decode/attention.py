"""The split-KV attention kernel of the CuTe DSL MLA decode (Hopper sm_90a).

One CTA per (KV split, request): 64-token tiles of the paged latent cache (a tile never straddles
a page), bf16 output + natural-log LSE with one split, else split partials + LSE for the combine
(combine.py). bf16 or fp8 e4m3 cache; the compile-time variant (`plan.Attention`) is chosen by the
launch plan (plan.py) and checked here.

Why the heads are the MMA's N ("swap AB"): a decode query has H <= 32 heads per rank, far below
the 64 rows of a wgmma's M. With A and B swapped, S^T [64 tokens, N] = K Q^T and
O^T [512, N] += V^T P^T put the tokens / latent dims on M and the heads on N = h_pad (16 or 32):
nothing is padded to 64 rows and every MMA is useful work.

Roles: warpgroup 0, warp 0 is the TMA producer (setmaxnreg 24): one [64, 576] TMA per tile into
a ring (`pipeline.PipelineTmaAsync`). The consumer warpgroups (setmaxnreg 240):
  * Q [h_pad, 576] is loaded once into shared memory (rows >= H zero), K-major.
  * S^T = K Q^T with both operands in shared memory; the online softmax runs per column (head):
    a thread holds 2 token rows of h_pad / 4 columns, the column maxima are reduced over lanes
    and the 4 warps (smem + a 128-thread named barrier); the running sums stay per-thread
    partials, reduced once in the epilogue.
  * P^T goes to shared memory as PV's B operand; O^T += V^T P^T with V^T the first 512 columns
    of the same stage, rescaled by exp2(m_old - m_new) first. The stage is released once PV has
    read it.
  * the last, partial tile: its rows past the end are masked to -inf in S^T, and their V rows
    are zeroed before PV (the cache bytes there may be NaN).
  * epilogue: column sums across lanes and warps, normalize (common.softmax_norm), LSE; O^T is
    written transposed to out[b, h, :] or the partial [split, b, h, :].

fp8 e4m3 cache (`kv_fp8`; the same kernel, branched at trace time; the bf16 code is unchanged by
it). The per-tensor kv scale is folded into the softmax and output scales by the host.
  * the stage is the raw fp8 tile as TMA wrote it (`raw_layout`: 9 column blocks of
    [64 tokens, 64 bytes], 64-byte swizzle), which is already the K-major operand of the native
    e4m3 wgmma: S^T needs no conversion of K.
  * Q as e4m3: per CTA s = 2^floor(log2(448 / max|q|)) (>= 2^-100: an all-zero Q works),
    Q_hi = e4m3(s q) and, with q_terms 2, Q_lo = e4m3(s q - Q_hi) (`query.split_query_e4m3`
    mirrors it; the pair is ~1000x below bf16 rounding). S^T comes out in units of s; 1 / s is
    folded into the softmax scale. q_terms 1 (fp8_query="single") stores Q_hi alone and runs
    half of S^T's wgmmas.
  * promotion: the fp8 wgmma's accumulator keeps only ~13-14 mantissa bits, so S^T runs as 9
    chunks of 64 dims, each into a zeroed accumulator added to S^T in fp32 while the next chunk
    runs (`_fp8_qk`; tests/test_mla_decode_compile.py models the error).
  * qk_joint (two-term query at h_pad 16): B = [Q_hi ; Q_lo] as one [32, 576] operand, one wgmma
    of N = 32 per k-step, each K k-step read from shared memory once instead of twice
    (`_fp8_qk_joint`; at h_pad 32 its accumulators would spill).
  * PV in fp16: V^T is gathered from the raw bytes into registers (four 16-byte loads per
    16-token k-step, prmt pairs two tokens' bytes, cvt.rn.f16x2.e4m3x2 widens them exactly);
    O^T row m holds latent dim DIM_PERM(m), so a thread's 16 rows are 16 consecutive bytes of a
    token, and S^T row m goes to P^T position row_token_inv(m) (bank-conflict-free loads).
    pv_group M blocks per wgmma group, pv_in_flight groups in flight; with pv_prefetch each
    k-step's V words are loaded one k-step ahead. Tokens past the end are zeroed in registers
    on the last tile only (PV is traced twice, with and without the selects).
  * epilogue: a thread's 16 dims of a head are contiguous, so each head column is written with
    16-byte vector stores (`_store_cols_vec`).

Two consumer warpgroups (`consumers` = 2): consumer c takes the split's tiles t_begin + c,
t_begin + c + 2, ..., each with its own softmax state, O^T, P^T buffers and named barrier
(1 + c); barrier 3 (both, 256 threads) orders Q, the end of the tiles and the merge.
  * one ring in tile order; consumer c's pipeline state starts c stages in and moves two a
    tile. The ring is even, so that every stage has one owner: with an odd one consumer 1 can
    reach tile i + stages before tile i's TMA landed and pass its full-barrier wait at once
    (try_wait.parity of the next phase reads as the completed phase before it);
    tests/test_mla_ring_protocol.py checks the protocol over every order of events.
  * q_half (fp8): each consumer loads, scales and stores half of Q, the 8 warps' max |q|
    folded through smem in one order (the same s bit for bit everywhere).
  * merge (`_merge_consumers`): once both are past their last tile the ring is free; each hands
    the other the O^T columns and (max, sum) of the heads the other writes (xmerge: each writes
    half of the heads; without, consumer 0 merges and writes all), and merges exactly:
    m = max(m0, m1), O = O0 f0 + O1 f1, l = l0 f0 + l1 f1. A consumer with no tile (1-tile
    split) has m = -inf, l = 0 and gets weight 0, never NaN.
  * the two run free of each other (no ordering of their S^T phases).

Lazy column maxima (`lazy_max`, fp8 with two consumers): the exact online-softmax step needs
every head's maximum over the tile's 4 warps, an exchange and barrier that take a large part of
a consumer's chain. Instead each thread checks whether its own rows rise above the running
maximum by more than LAZY_MAX_SLACK (log2 units); P = 2^(S - m) is taken against the maxima as
they are and stored, and one barrier.red.or.pred (the P^T barrier) tells every thread whether
any rose. Only then (and on a consumer's first tile) does the exact step run and rewrite P^T.
The maxima only move in exact steps and the sums always match the P that PV used, so the result
is exact; P <= 2^8 keeps it far inside fp16 (tests/test_mla_lazy_maxima_model.py). P^T has two
buffers per consumer (alternating tiles), since no exchange barrier precedes the stores.

Tile pool (`pool_div` > 0, with more than one split): the last 1 / pool_div of each split's
tiles goes into a per-request pool that the request's CTAs draw from at run time through a
per-request counter, so faster CTAs take more and the slowest, which sets the call's time,
fewer (`_produce`; tests/test_mla_tile_pool_model.py models the draws and the reset). The
producer hands each tile's id to the consumers through smem (sTid) and ends each consumer's
loop with a mark (-1). Which CTA takes a pool tile varies, and with it the partials' rounding.

Head groups (`head_groups` G > 1): the host passes q, the outputs and the partials as B * G
requests of H / G heads (contiguous views); request b of that view reads row b // G of the
block table and seq_lens, and has its own pool counters.

Latent halves (`d_split` = 2; bf16, one consumer, no pool): grid z = 2 CTAs per (split,
request), each running the split's tiles whole (the same maxima, sums and LSE bit for bit) but
PV and the epilogue only over its 256 latent dims (4 whole 64-dim column blocks of the stage);
the LSEs come from dpart 0.

Early KV (`early_kv`): seq_lens, the block table and the first tiles' TMAs are issued before the
PDL wait; Q and every write stay behind it (common.split_tile_range).

Shared memory (`smem_bytes`): Q, the ring, P^T and the column statistics; the ring takes the
stages that fit in the device's `smem_limit` (at most MAX_STAGES / MAX_STAGES_FP8).
"""
from __future__ import annotations

from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float16, Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op

from pdserve.kernels.mla_decode.common import (D_QK, D_V, LN_2, TILE_N, copy_q_rows,
                                               cvt_e4m3x2_f16x2, lds_u32, prmt, query_tensors,
                                               result_tensors, softmax_norm, split_tile_range,
                                               tma_load_tile, tma_produce_tiles, tma_tile_views,
                                               wgmma_c_mn_view, write_empty_split)
from pdserve.kernels.mla_decode.plan import POOL_DIVS, Attention

PRODUCER_REGS = 24
CONSUMER_REGS = 240
BAR_CONSUMER = 1            # named barrier id of consumer warpgroup c: BAR_CONSUMER + c (0 = __syncthreads)
BAR_BOTH = 3                # two consumers: the 256-thread barrier of both (Q stored, tiles done, merge)
LAZY_MAX_SLACK = 8.0        # lazy maxima: P up to 2^8 before the running maximum moves
N_WARPS = 4                 # warps of the consumer warpgroup (16 token rows of S^T each)


class _SplitOrder:
    """Tile t of a consumer that takes its split's tiles t_begin + c, + nc, ... in order: the
    tile body's questions about its place, built where the body asks them."""

    def __init__(self, t, t_begin, nc: int):
        self.t, self.t_begin, self.nc = t, t_begin, nc

    def buf(self):
        """This consumer's tile count % 2."""
        if self.nc == 1:
            return (self.t - self.t_begin) % 2
        return ((self.t - self.t_begin) // 2) % 2

    def not_first(self):
        """Not this consumer's first tile (the lazy maxima's exact first step)."""
        return self.t >= self.t_begin + self.nc


class _DrawOrder:
    """Ring position i of a consumer whose tiles come from sTid (the pool): the same questions,
    by position."""

    def __init__(self, i, nc: int):
        self.i, self.nc = i, nc

    def buf(self):
        return (self.i // self.nc) % 2

    def not_first(self):
        return self.i >= self.nc


class _Refusal:
    """need(ok, field, why): ValueError naming the variant's field when not ok."""

    def __init__(self, variant):
        self.variant = variant

    def __call__(self, ok: bool, field: str, why: str) -> None:
        if not ok:
            raise ValueError(f"MLA decode kernel: {field}={getattr(self.variant, field)!r} "
                             f"{why} ({self.variant})")


MAX_STAGES = 4              # bf16 ring (2 fit next to Q)
MAX_STAGES_FP8 = 5          # fp8 ring: half-size stages, 5 fit at h_pad 16 and 32
FP8_BLOCK = TILE_N * 64     # bytes of one [64 tokens, 64 dims] column block of the raw fp8 tile
# fp8 PV: latent dim behind O^T row m = (g, r8, w, mb) (m = g + 8 r8 + 16 w + 64 mb):
# 16 g + r8 + 128 w + 2 mb, so that one thread's 16 A rows are 16 consecutive bytes of a token
DIM_PERM = (8, 2, 4, 8)
DIM_PERM_STRIDE = (16, 1, 128, 2)
# fp8 S^T: 9 chunks of 64 dims, each 4 wgmma m64nNk32 (k-steps 2 c, 2 c + 1 of Q_hi, then of
# Q_lo) into a zeroed accumulator that is added to S^T in fp32 (see _fp8_qk)
QK_CHUNKS = D_QK // 64


@dsl_user_op
def _barrier_or(bar_id, n: int, pred, *, loc=None, ip=None) -> Int32:
    """barrier.red.or.pred over the n threads of named barrier bar_id: 1 when pred != 0 in any
    of them (a bar.sync that also ORs a predicate)."""
    return Int32(llvm.inline_asm(
        T.i32(), [Int32(bar_id).ir_value(loc=loc, ip=ip), Int32(pred).ir_value(loc=loc, ip=ip)],
        "{ .reg .pred pi, po; setp.ne.u32 pi, $2, 0; "
        f"barrier.red.or.pred po, $1, {n}, pi; selp.u32 $0, 1, 0, po; }}",
        "=r,r,r", has_side_effects=True, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def _pow2_scale(amax, *, loc=None, ip=None) -> Float32:
    """s = 2^floor(log2(448 / max(amax, 2^-100))) (fp32 bits: the exponent of 448 / amax)."""
    return Float32(llvm.inline_asm(
        T.f32(), [Float32(amax).ir_value(loc=loc, ip=ip)],
        "{ .reg .f32 t; .reg .b32 b; max.f32 t, $1, 0f0D800000; div.rn.f32 t, 0f43E00000, t; "
        "mov.b32 b, t; and.b32 b, b, 0x7F800000; mov.b32 $0, b; }",
        "=f,f", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def _pow2_inv(s, *, loc=None, ip=None) -> Float32:
    """1 / s for a power of two s = 2^e, |e| <= 126 (exact: biased exponent 254 - E)."""
    return Float32(llvm.inline_asm(
        T.f32(), [Float32(s).ir_value(loc=loc, ip=ip)],
        "{ .reg .b32 b; mov.b32 b, $1; sub.s32 b, 0x7F000000, b; mov.b32 $0, b; }",
        "=f,f", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def _pack_bf16x2(lo, hi, *, loc=None, ip=None) -> Int32:
    """fp32 lo, hi -> one bf16x2 word (round to nearest even; lo in the low half)."""
    return Int32(llvm.inline_asm(
        T.i32(), [Float32(lo).ir_value(loc=loc, ip=ip), Float32(hi).ir_value(loc=loc, ip=ip)],
        "cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def _split_e4m3x2(y0, y1, *, loc=None, ip=None) -> Int32:
    """Two fp32 values -> bits 0-15: e4m3x2 (hi0, hi1) = RN(y0), RN(y1) (saturating), bits 16-31:
    e4m3x2 (lo0, lo1) = RN(y0 - hi0), RN(y1 - hi1); value 0 in the lower byte of each pair
    (cvt.rn.satfinite.e4m3x2.f32 d, a, b puts b in the lower byte). hi back to fp32 through the
    exact cvt.rn.f16x2.e4m3x2; y - hi is exact in fp32 (reference.split_query_e4m3 mirrors this)."""
    return Int32(llvm.inline_asm(
        T.i32(), [Float32(y0).ir_value(loc=loc, ip=ip), Float32(y1).ir_value(loc=loc, ip=ip)],
        "{ .reg .b16 h, l, a, b; .reg .b32 hf; .reg .f32 fa, fb; "
        "cvt.rn.satfinite.e4m3x2.f32 h, $2, $1; cvt.rn.f16x2.e4m3x2 hf, h; mov.b32 {a, b}, hf; "
        "cvt.f32.f16 fa, a; cvt.f32.f16 fb, b; sub.f32 fa, $1, fa; sub.f32 fb, $2, fb; "
        "cvt.rn.satfinite.e4m3x2.f32 l, fb, fa; mov.b32 $0, {h, l}; }",
        "=r,f,f", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


class MlaDecodeKernel:
    """One compiled variant of the attention kernel (`variant`: plan.Attention, every field
    explicit). Refuses combinations the kernel cannot run with a ValueError naming the field;
    derives the ring depth and shared-memory layout from the variant."""

    def __init__(self, variant: Attention):
        v = variant
        self.variant = v
        need = _Refusal(v)
        need(v.h_pad in (16, 32), "h_pad", "must be 16 or 32")
        need(v.page_tokens > 0 and v.page_tokens % TILE_N == 0, "page_tokens",
             f"must be a multiple of {TILE_N}")
        need(v.head_groups >= 1, "head_groups", "must be >= 1")
        need(v.consumers in (1, 2), "consumers", "must be 1 or 2")
        need(v.q_terms in (1, 2) and (v.q_terms == 2 or v.kv_fp8), "q_terms",
             "must be 2, or 1 with an fp8 cache")
        need(v.pool_div in POOL_DIVS, "pool_div", f"must be one of {POOL_DIVS}")
        need(v.d_split in (1, 2) and (v.d_split == 1 or (not v.kv_fp8 and v.consumers == 1
                                                         and not v.pool_div)),
             "d_split", "must be 1, or 2 with a bf16 cache, one consumer and no tile pool")
        pair_fp8 = v.kv_fp8 and v.consumers == 2
        need(pair_fp8 or not v.lazy_max, "lazy_max", "needs an fp8 cache and two consumers")
        need(pair_fp8 or not v.q_half, "q_half", "needs an fp8 cache and two consumers")
        need(v.consumers == 2 or not v.xmerge, "xmerge", "needs two consumers")
        need(not v.qk_joint or (v.kv_fp8 and v.h_pad == 16 and v.q_terms == 2), "qk_joint",
             "needs an fp8 cache, h_pad 16 and the two-term query")
        if v.kv_fp8:
            need(v.pv_group in (1, 2, 4, 8), "pv_group", "must be 1, 2, 4 or 8")
            need(1 <= v.pv_in_flight <= 8, "pv_in_flight", "must be 1..8")
        else:
            need((v.pv_group, v.pv_in_flight, v.pv_prefetch) == (0, 0, False), "pv_group",
                 "pv_group / pv_in_flight / pv_prefetch are for an fp8 cache (0, 0, False "
                 "with bf16)")

        self.kv_fp8 = v.kv_fp8
        self.early_kv = v.early_kv
        self.head_groups = v.head_groups
        self.page_tokens = v.page_tokens
        self.tiles_per_page = v.page_tokens // TILE_N
        self.h_pad = v.h_pad
        # cache element type; PV operand type (fp8: P fp16, V widened exactly from the raw
        # bytes); S^T's Q operand type (fp8: e4m3 terms)
        self.kv_dtype = cutlass.Float8E4M3FN if self.kv_fp8 else BFloat16
        self.cdt = Float16 if self.kv_fp8 else BFloat16
        self.qdt = cutlass.Float8E4M3FN if self.kv_fp8 else BFloat16
        self.consumers = consumers = v.consumers
        self.num_threads = 128 * (1 + consumers)
        self.lazy_max = v.lazy_max
        self.p_bufs = 2 if self.lazy_max else 1       # P^T buffers per consumer
        self.q_half = v.q_half
        self.xmerge = v.xmerge
        self.q_terms = v.q_terms
        self.qk_joint = v.qk_joint
        # fp8 S^T: every 64-dim chunk into a zeroed accumulator added to S^T in fp32 (see
        # "promotion" in the module docstring)
        self.qk_promote = True
        self.pv_group, self.pv_in_flight, self.pv_prefetch = (v.pv_group, v.pv_in_flight,
                                                              v.pv_prefetch)
        self.pool_div = v.pool_div
        self.pool = self.pool_div > 0
        self.d_split = v.d_split
        self.d_out = D_V // v.d_split                  # O^T rows (latent dims) of one CTA
        self.partial_dtype = BFloat16 if v.bf16_partials else Float32
        self.consumer_regs = CONSUMER_REGS

        per_stage = TILE_N * D_QK * (1 if self.kv_fp8 else 2)
        fixed = (v.h_pad * D_QK * 2                    # Q
                 + consumers * (self.p_bufs * v.h_pad * TILE_N * 2     # P^T
                                + (2 + 1) * N_WARPS * v.h_pad * 4)  # column maxima (2) + sums
                 + 4 * 1024)                           # mbarriers / alignment
        max_stages = MAX_STAGES_FP8 if self.kv_fp8 else MAX_STAGES
        self.stages = min(max_stages, (v.smem_limit - fixed) // per_stage)
        if consumers == 2:
            self.stages -= self.stages % 2             # an even ring (module docstring)
        if self.stages < 2:
            raise ValueError(f"smem_limit={v.smem_limit}: room for {self.stages} ring stages, "
                             "needs 2")
        self.smem_bytes = fixed + self.stages * per_stage
        self.tma_bytes = per_stage
        # two consumers: what the epilogue hands over through the ring (O^T fragments and
        # per-head (max, sum))
        self.merge_bytes = ((128 * 4 * v.h_pad + 2 * v.h_pad * (1 + self.xmerge)) * 4
                            if consumers == 2 else 0)
        assert self.merge_bytes <= self.stages * per_stage

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
        op_ptr: cute.Pointer,      # [S, B, H, 512] partials, partial_dtype (num_splits > 1)
        lsep_ptr: cute.Pointer,    # [S, B, H] fp32 partial LSEs (num_splits > 1)
        cnt_ptr: cute.Pointer,     # [B, 2] int32 tile-pool counters (pool; launch.pool_counters)
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
            # fp8: S^T = K Q^T with the native e4m3 wgmma m64nNk32: A = the raw fp8 K tile of the
            # stage (smem, K-major, as TMA wrote it), B = Q_hi / Q_lo (smem, e4m3, K-major).
            # O^T: A = V^T built in registers from the raw fp8 bytes (fp16), B = P^T (fp16 smem)
            RMEM = warpgroup.OperandSource.RMEM
            qk_mma = self.fp8_qk_mma(hp)
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
        if cutlass.const_expr(self.kv_fp8):
            # Q_hi, Q_lo [hp, 576, 2] e4m3, K-major: the same 8-row x 64-byte, 64-byte swizzle
            # atoms as the K tile (576 bytes are not a multiple of the 128-byte swizzle)
            sQ_layout = self.q8_layout(hp, self.qk_joint)
        else:
            sQ_layout = cute.tile_to_shape(atom_k, (hp, D_QK), (0, 1))
        if cutlass.const_expr(self.kv_fp8):
            # the raw fp8 ring as TMA writes it: 9 column blocks of [64 tokens, 64 bytes], each
            # 8-row x 64-byte atoms with the 64-byte swizzle (16-byte unit ^= (token >> 1) % 4)
            sK_layout = self.raw_layout(self.stages)
        else:
            sK_layout = cute.tile_to_shape(atom_k, (TILE_N, D_QK, self.stages), (0, 1, 2))
        # V^T = the first 512 columns of one K stage, as the MN-major A operand [512, 64]: the
        # same bytes (8-token x 64-column swizzle atoms; token blocks first, then columns), the
        # MN-major view of the K-major tile (bf16 only; d_split 2: 256 of them)
        sV_layout = cute.tile_to_shape(atom_mn, (self.d_out, TILE_N), (1, 0))
        # P^T [hp heads, 64 tokens], K-major: one 128-byte swizzle atom row per head
        sP_layout = cute.tile_to_shape(atom_k, (hp, TILE_N), (0, 1))
        tma_atom, mKV_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mKV, cute.slice_(sK_layout, (None, None, 0)),
            (TILE_N, D_QK))

        stages = self.stages
        kvt = self.kv_dtype
        qdt = self.qdt
        nc = self.consumers           # sMax / sSum / sP: one copy per consumer

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            sMax: cute.struct.Align[cute.struct.MemRange[Float32, nc * 2 * N_WARPS * hp], 16]
            sSum: cute.struct.Align[cute.struct.MemRange[Float32, nc * N_WARPS * hp], 16]
            sQ: cute.struct.Align[cute.struct.MemRange[qdt, cute.cosize(sQ_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[
                cdt, nc * self.p_bufs * cute.cosize(sP_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[kvt, cute.cosize(sK_layout)], 1024]
            # (last, so that the fields before keep their offsets without the pool)
            sTid: cute.struct.Align[cute.struct.MemRange[Int32, 2 * stages], 16]

        # Q: gmem -> smem with cp.async, 16 bytes a copy, the 128 consumer threads
        copy_q = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                BFloat16, num_bits_per_copy=128),
            cute.make_layout((128 // 8, 8), stride=(8, 1)), cute.make_layout((1, 8)))

        # per request: the pool's draw counter and the count of its CTAs done drawing
        mCnt = cute.make_tensor(cnt_ptr, cute.make_layout((batch, 2), stride=(2, 1)))
        self.kernel(
            qk_mma, pv_mma, tma_atom, mKV_tma, mQ, mBT, mSeq, mO, mLse, mOp, mLsep, mCnt,
            num_splits, scale_log2, out_scale, sQ_layout, sK_layout, sV_layout, sP_layout,
            copy_q, SharedStorage,
        ).launch(grid=(num_splits, batch, self.d_split), block=(self.num_threads, 1, 1),
                 stream=stream, min_blocks_per_mp=1, use_pdl=True)

    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, tma_atom: cute.CopyAtom,
        mKV_tma: cute.Tensor, mQ: cute.Tensor, mBT: cute.Tensor, mSeq: cute.Tensor,
        mO: cute.Tensor, mLse: cute.Tensor, mOp: cute.Tensor, mLsep: cute.Tensor,
        mCnt: cute.Tensor, num_splits: Int32, scale_log2: Float32, out_scale: Float32,
        sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout, sP_layout: cute.ComposedLayout,
        copy_q: cute.TiledCopy, SharedStorage: cutlass.Constexpr,
    ):
        hp = self.h_pad
        tidx, _, _ = cute.arch.thread_idx()
        split, b, dpart = cute.arch.block_idx()   # dpart: this CTA's latent dims (d_split)
        breq = b                              # this view request's row of seq_lens / block table
        if cutlass.const_expr(self.head_groups > 1):
            breq = b // self.head_groups
        wg = cute.arch.make_warp_uniform(tidx // 128)
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        heads = mQ.shape[1]

        seqlen, t_begin, t_end = split_tile_range(mSeq, breq, split, num_splits, self.early_kv)
        if t_begin >= t_end:
            write_empty_split(mLsep, split, b, tidx, heads, self.early_kv)
        else:
            smem = cutlass.utils.SmemAllocator()
            storage = smem.allocate(SharedStorage)
            sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
            sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
            # the tile id of each ring position, position i in slot i % (2 stages); -1 ends a
            # consumer's loop (`_produce`)
            sTid = storage.sTid.get_tensor(cute.make_layout((2 * self.stages,)))
            nc = self.consumers
            if cutlass.const_expr(nc == 1):
                cons = 0                      # the consumer's index
                sP_all = None                 # (two consumers: both consumers' P^T buffers)
                sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)
                sMax = storage.sMax.get_tensor(cute.make_layout(
                    (2, N_WARPS, hp), stride=(N_WARPS * hp, hp, 1)))
                sSum = storage.sSum.get_tensor(cute.make_layout((N_WARPS, hp), stride=(hp, 1)))
            else:
                # consumer cons = wg - 1 (the producer warpgroup never touches these)
                cons = wg - 1
                sP_all_layout = cute.tile_to_shape(
                    warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128,
                                                    self.cdt),
                    (hp, TILE_N, nc * self.p_bufs), (0, 1, 2))
                sP_all = storage.sP.get_tensor(sP_all_layout.outer, swizzle=sP_all_layout.inner)
                sP = sP_all[None, None, self.p_bufs * cons]
                sMax = storage.sMax.get_tensor(cute.make_layout(
                    (nc, 2, N_WARPS, hp),
                    stride=(2 * N_WARPS * hp, N_WARPS * hp, hp, 1)))[cons, None, None, None]
                sSum = storage.sSum.get_tensor(cute.make_layout(
                    (nc, N_WARPS, hp), stride=(N_WARPS * hp, hp, 1)))[cons, None, None]

            producer, consumer = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar.data_ptr(),
                num_stages=self.stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, N_WARPS),
                tx_count=self.tma_bytes,
            ).make_participants()           # inits the mbarriers, fences and syncs the CTA

            if wg == 0:
                # ---------------- producer ----------------
                cute.arch.setmaxregister_decrease(PRODUCER_REGS)
                if warp == 0:
                    if cutlass.const_expr(self.pool):
                        self._produce(tma_atom, mKV_tma, sK, sTid, mBT, mCnt, breq, b, seqlen,
                                      num_splits, t_begin, t_end, producer)
                    else:
                        tma_produce_tiles(tma_atom, mKV_tma, sK, mBT, breq, t_begin, t_end,
                                          self.tiles_per_page, producer)
            else:
                # ---------------- consumer ----------------
                cute.arch.setmaxregister_increase(self.consumer_regs)
                if cutlass.const_expr(nc == 1):
                    bar = BAR_CONSUMER        # its 128-thread named barrier
                    wtid = tidx - 128         # 0..127
                else:
                    # two consumers (ping-pong): warpgroup 1 + cons takes the split's tiles
                    # t_begin + cons + 2 i, with its own P^T, column maxima / sums and barrier
                    # (sP, sMax, sSum: this consumer's copies, made above)
                    bar = BAR_CONSUMER + cons
                    wtid = tidx - 128 * wg
                cwarp = wtid // 32            # 0..3: token rows [16 cwarp, +16) of S^T
                lane = wtid % 32

                # Q -> smem (rows >= H zero)
                if cutlass.const_expr(self.early_kv):
                    cute.arch.griddepcontrol_wait()
                thr_q = copy_q.get_slice(wtid)
                gQ = cute.local_tile(mQ[b, None, None], (hp, D_QK), (0, 0))
                tQg = thr_q.partition_S(gQ)
                if cutlass.const_expr(not self.kv_fp8):
                    tQs = thr_q.partition_D(sQ)
                tQc = thr_q.partition_S(cute.make_identity_tensor((hp, D_QK)))
                if cutlass.const_expr(self.kv_fp8):
                    # fp8: Q = (Q_hi + Q_lo) / s, both terms e4m3 in smem (_store_q_fp8), with
                    # s = 2^floor(log2(448 / max|q|)) over the request's H x 576 values (>= 2^-100:
                    # all-zero Q is fine); S^T is computed in units of s, 1 / s (exact) folded
                    # into the softmax scale. Max over the 128 threads: butterfly shuffles, then
                    # sMax[0, warp, 0] (its first use in the tile loop is behind 2 barriers)
                    # (q_half: each of two consumers loads, splits and stores its half of the
                    # copy's vectors, zeros standing in for the other half)
                    rq = cute.make_rmem_tensor(tQg.shape, BFloat16)
                    for m in cutlass.range_constexpr(cute.size(tQg.shape[1])):
                        for k in cutlass.range_constexpr(cute.size(tQg.shape[2])):
                            rq[None, m, k].fill(0)
                            if tQc[0, m, 0][0] < heads:
                                if self._loads_q(m, k, rq, cons):
                                    cute.autovec_copy(tQg[None, m, k], rq[None, m, k])
                    amax = abs(rq.load().to(Float32)).reduce(cute.ReductionOp.MAX,
                                                              Float32(0.0), 0)
                    for off in (1, 2, 4, 8, 16):
                        amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(
                            amax, offset=off, mask=-1, mask_and_clamp=31))
                    # (two consumers, not q_half: both compute amax and s from the same Q with
                    # the same operations, so both get the same s bit for bit; consumer 0 alone
                    # stores Q_hi / Q_lo. q_half: the 8 warps' maxima through smem, every
                    # thread folding them in the same order)
                    if cutlass.const_expr(self.q_half):
                        sAmax = storage.sMax.get_tensor(cute.make_layout((nc, N_WARPS)))
                        if lane == 0:
                            sAmax[cons, cwarp] = amax
                        cute.arch.barrier(barrier_id=BAR_BOTH, number_of_threads=256)
                        for w in cutlass.range_constexpr(nc * N_WARPS):
                            amax = cute.arch.fmax(amax, sAmax[w % nc, w // nc])
                    else:
                        if lane == 0:
                            sMax[0, cwarp, 0] = amax
                        cute.arch.barrier(barrier_id=bar, number_of_threads=128)
                        for w in cutlass.range_constexpr(N_WARPS):
                            amax = cute.arch.fmax(amax, sMax[0, w, 0])
                    q_scale = _pow2_scale(amax)
                    q_base = sQ.iterator.toint()
                    if cutlass.const_expr(nc == 1):
                        self._store_q_fp8(rq, tQc, q_scale, q_base)
                    else:
                        if cons == 0:
                            self._store_q_fp8(rq, tQc, q_scale, q_base, 0 if self.q_half else None)
                        else:
                            if cutlass.const_expr(self.q_half):
                                self._store_q_fp8(rq, tQc, q_scale, q_base, 1)
                    scale_s = scale_log2 * _pow2_inv(q_scale)
                else:
                    scale_s = scale_log2
                    if cutlass.const_expr(nc == 1):
                        copy_q_rows(copy_q, tQg, tQs, tQc, heads)
                    else:
                        if cons == 0:             # consumer 0 alone stores Q
                            copy_q_rows(copy_q, tQg, tQs, tQc, heads)
                    cute.arch.cp_async_commit_group()
                    cute.arch.cp_async_wait_group(0)
                cute.arch.fence_proxy("async.shared", space="cta")
                if cutlass.const_expr(nc == 1):
                    cute.arch.barrier(barrier_id=BAR_CONSUMER, number_of_threads=128)
                else:
                    # Q stored (consumer 0) before either consumer's first S^T wgmma
                    cute.arch.barrier(barrier_id=BAR_BOTH, number_of_threads=256)

                thr_qk = qk_mma.get_slice(wtid)
                thr_pv = pv_mma.get_slice(wtid)
                # bf16: (MMA, 1, 36, st) / (MMA, 1, 36); fp8 (k32): (MMA, 1, 18, st) /
                # (MMA, 1, 18, 2) (Q_hi, Q_lo)
                qkj_mma = None
                fold = None
                if cutlass.const_expr(self.qk_joint):
                    # fp8 joint S^T: B = [Q_hi ; Q_lo] (sQ is the [2 hp, 576] operand), one
                    # wgmma m64n(2 hp)k32 per k-step; (MMA, 1, 18, st) / (MMA, 1, 18)
                    qkj_mma = self.fp8_qk_mma(2 * hp)
                    thr_qkj = qkj_mma.get_slice(wtid)
                    tSrK = thr_qkj.make_fragment_A(thr_qkj.partition_A(sK))
                    tSrQ = thr_qkj.make_fragment_B(thr_qkj.partition_B(sQ))
                else:
                    tSrK = thr_qk.make_fragment_A(thr_qk.partition_A(sK))
                    tSrQ = thr_qk.make_fragment_B(thr_qk.partition_B(sQ))
                acc_S = thr_qk.make_fragment_C(thr_qk.partition_shape_C((TILE_N, hp)))
                acc_O = thr_pv.make_fragment_C(thr_pv.partition_shape_C((self.d_out, hp)))
                acc_O.fill(0.0)

                # (token, head) of each S^T element
                tScS = thr_qk.partition_C(cute.make_identity_tensor((TILE_N, hp)))

                # (lazy maxima: P^T buffer 0 of this consumer; the tile loop picks its buffer)
                tOrP, tSsP = self._p_views(sP, sP_layout, qk_mma, thr_qk, thr_pv, cwarp, lane)
                rP = cute.make_fragment_like(acc_S, self.cdt)
                rS = cute.make_fragment_like(acc_S)          # lazy maxima: P in fp32
                rS_mn = wgmma_c_mn_view(rS)
                tScS_mn = wgmma_c_mn_view(tScS)
                acc_S_mn = wgmma_c_mn_view(acc_S)
                acc_O_mn = wgmma_c_mn_view(acc_O)
                n_rows = cute.size(acc_S_mn.shape[0])       # 2 token rows
                n_cols = cute.size(acc_S_mn.shape[1])       # hp / 4 heads
                col_max = cute.make_rmem_tensor((n_cols,), Float32)
                col_sum = cute.make_rmem_tensor((n_cols,), Float32)    # this thread's rows only
                col_max.fill(-Float32.inf)
                col_sum.fill(0.0)
                # column maxima of this thread's rows, of its warp's after _publish_max
                w_max = cute.make_rmem_tensor((n_cols,), Float32)
                n_k = cute.size(tSrQ.shape[2])
                if cutlass.const_expr(self.kv_fp8):
                    # per-thread shared byte addresses of the raw fp8 V fragment loads (stage 0)
                    raw_base = sK.iterator.toint()
                    v_tok, v_off = self._fp8_v_addresses(lane, cwarp)
                    v_addr = [raw_base + a for a in v_off]
                    # O^T in 4-block (256-row) groups: the PV wgmma groups of one k-step
                    lO = acc_O.layout
                    gb = self.pv_group
                    acc_O_grp = cute.make_tensor(acc_O.iterator, cute.make_layout(
                        (lO.shape[0], (gb, 8 // gb), lO.shape[2]),
                        stride=(lO.stride[0], (lO.stride[1], gb * lO.stride[1]), lO.stride[2])))
                    # S^T chunk accumulators (qk_promote)
                    if cutlass.const_expr(self.qk_joint):
                        # 64 x 2 hp each: [K Q_hi^T, K Q_lo^T] of one 64-dim chunk
                        acc_T = [thr_qkj.make_fragment_C(
                            thr_qkj.partition_shape_C((TILE_N, 2 * hp))) for _ in range(2)]
                        fold = self._joint_fold_map(qk_mma, qkj_mma, hp)
                    else:
                        acc_T = [thr_qk.make_fragment_C(thr_qk.partition_shape_C((TILE_N, hp)))
                                 for _ in range(2 if self.qk_promote else 0)]

                if cutlass.const_expr(nc == 2):
                    # one ring in tile order (tile t_begin + i in stage i % stages, phase
                    # (i // stages) % 2); consumer c waits on i = c, c + 2, ...: its state starts
                    # c stages in and moves 2 a tile (the other consumer's stage in between)
                    consumer.advance(cons)
                ctx = SimpleNamespace(
                    seqlen=seqlen, cons=cons, dpart=dpart, sK=sK, sV_layout=sV_layout, wtid=wtid,
                    bar=bar, cwarp=cwarp, lane=lane, qk_mma=qk_mma, qkj_mma=qkj_mma, pv_mma=pv_mma,
                    thr_qk=thr_qk, thr_pv=thr_pv, tSrK=tSrK, tSrQ=tSrQ, acc_S=acc_S, acc_O=acc_O,
                    acc_S_mn=acc_S_mn, acc_O_mn=acc_O_mn, rS=rS, rS_mn=rS_mn, rP=rP,
                    tScS_mn=tScS_mn, tOrP=tOrP, tSsP=tSsP, sMax=sMax, sP_all=sP_all,
                    sP_layout=sP_layout, col_max=col_max, col_sum=col_sum, w_max=w_max,
                    scale_s=scale_s, n_k=n_k, n_rows=n_rows, n_cols=n_cols)
                if cutlass.const_expr(self.kv_fp8):
                    ctx.v_addr, ctx.v_tok, ctx.acc_O_grp = v_addr, v_tok, acc_O_grp
                    ctx.acc_T, ctx.fold = acc_T, fold
                if cutlass.const_expr(not self.pool):
                    for t in cutlass.range(t_begin + cons, t_end, nc, unroll=1):
                        if cutlass.const_expr(nc == 1):
                            h = consumer.wait_and_advance()
                        else:
                            h = consumer.wait()
                            consumer.advance(2)
                        # (the MMA atoms' accumulate fields are set inside: rebound here so
                        # that the loop carries them)
                        qk_mma, qkj_mma, pv_mma, thr_qk, thr_pv = self._tile(
                            ctx, h, t, _SplitOrder(t, t_begin, nc))
                else:
                    # ring position i (consumer c: c, c + nc, ...), its tile t from sTid; -1 ends
                    i = Int32(cons)
                    h = consumer.wait()
                    t = sTid[i % (2 * self.stages)]
                    while t >= 0:
                        consumer.advance(nc)
                        qk_mma, qkj_mma, pv_mma, thr_qk, thr_pv = self._tile(
                            ctx, h, t, _DrawOrder(i, nc))
                        i = i + nc
                        h = consumer.wait()
                        t = sTid[i % (2 * self.stages)]

                # ---- epilogue: column sums across lanes and warps, normalize, LSE ----
                for c in cutlass.range_constexpr(n_cols):
                    s = self._col_sum(col_sum[c])
                    if lane < 4:
                        sSum[cwarp, tScS_mn[0, c][1]] = s
                cute.arch.barrier(barrier_id=bar, number_of_threads=128)
                lse_c = cute.make_rmem_tensor((n_cols,), Float32)
                if cutlass.const_expr(nc == 1):
                    for c in cutlass.range_constexpr(n_cols):
                        col = tScS_mn[0, c][1]
                        total = sSum[0, col]
                        for w in cutlass.range_constexpr(1, N_WARPS):
                            total = total + sSum[w, col]
                        inv, lg = softmax_norm(total, out_scale)
                        acc_O_mn[None, c] = acc_O_mn[None, c].load() * inv
                        lse_c[c] = (col_max[c] * scale_s + lg) * LN_2
                else:
                    self._merge_consumers(cons, sK.iterator.toint(), acc_O_mn, col_max, tScS_mn,
                                          sSum, lse_c, wtid, cwarp, lane, scale_s, out_scale)
                    col = Int32(0)            # (assigned in the dynamic ifs below)

                # O^T [d, h] -> out[b, h, d]: the output rows seen transposed
                tOcO = thr_pv.partition_C(cute.make_identity_tensor((self.d_out, hp)))
                if cutlass.const_expr(self.kv_fp8):
                    # fp8: O^T row m = 64 mb + 16 w + 8 r8 + g holds latent dim
                    # 128 w + 16 g + 2 mb + r8 (DIM_PERM, _fp8_v_addresses)
                    t_layout = cute.make_layout((DIM_PERM, hp), stride=(DIM_PERM_STRIDE, D_V))
                else:
                    t_layout = cute.make_layout((self.d_out, hp), stride=(1, D_V))
                # fp8, bf16 partials: one bf16 copy of O^T serves the output and the partial
                # (the bf16 cache's stores round fp32 O^T themselves: _store_cols_bf16)
                part = acc_O
                if cutlass.const_expr(self.kv_fp8 and self.partial_dtype is BFloat16):
                    part = self._bf16_copy(acc_O)
                # d_split: the first latent dim this CTA writes; the LSEs come from dpart 0
                # alone (_store_o_lse writes them from warp 0: dpart 1 passes warps 4-7)
                d0, owarp = 0, cwarp
                if cutlass.const_expr(self.d_split > 1):
                    d0, owarp = dpart * self.d_out, cwarp + dpart * N_WARPS
                if num_splits == 1:
                    gOt = cute.make_tensor(mO[b, None, None].iterator + d0, t_layout)
                    rO = part
                    if cutlass.const_expr(self.kv_fp8 and self.partial_dtype is not BFloat16):
                        rO = self._bf16_copy(acc_O)
                    self._store_o_lse(rO, thr_pv.partition_C(gOt), tOcO, heads, mLse[b, None],
                                      lse_c, tScS_mn, owarp, lane, cons)
                else:
                    gOpt = cute.make_tensor(mOp[split, b, None, None].iterator + d0, t_layout)
                    self._store_o_lse(part, thr_pv.partition_C(gOpt), tOcO, heads,
                                      mLsep[split, b, None], lse_c, tScS_mn, owarp, lane, cons)

    @cute.jit
    def _tile(self, ctx, h, t, pos):
        """One tile of a consumer: S^T, the online softmax, PV; the stage handle h released.
        ctx holds the consumer's state (made once before its loop), pos the tile's place in the
        consumer's order (_SplitOrder / _DrawOrder). Returns the MMA atoms, whose accumulate
        fields it sets, and their thread slices, for the caller's loop to carry."""
        seqlen, cons, sK, sV_layout, wtid, bar = (ctx.seqlen, ctx.cons, ctx.sK, ctx.sV_layout,
                                                  ctx.wtid, ctx.bar)
        cwarp, lane, qk_mma, qkj_mma, pv_mma = ctx.cwarp, ctx.lane, ctx.qk_mma, ctx.qkj_mma, \
            ctx.pv_mma
        thr_qk, thr_pv, tSrK, tSrQ = ctx.thr_qk, ctx.thr_pv, ctx.tSrK, ctx.tSrQ
        acc_S, acc_O, acc_S_mn, acc_O_mn = ctx.acc_S, ctx.acc_O, ctx.acc_S_mn, ctx.acc_O_mn
        rS, rS_mn, rP, tScS_mn, tOrP, tSsP = (ctx.rS, ctx.rS_mn, ctx.rP, ctx.tScS_mn, ctx.tOrP,
                                             ctx.tSsP)
        sMax, sP_all, sP_layout = ctx.sMax, ctx.sP_all, ctx.sP_layout
        col_max, col_sum, w_max, scale_s = ctx.col_max, ctx.col_sum, ctx.w_max, ctx.scale_s
        n_k, n_rows, n_cols = ctx.n_k, ctx.n_rows, ctx.n_cols
        if cutlass.const_expr(self.kv_fp8):
            v_addr, v_tok, acc_O_grp = ctx.v_addr, ctx.v_tok, ctx.acc_O_grp
            acc_T, fold = ctx.acc_T, ctx.fold
        buf = pos.buf()                   # this consumer's tile count % 2
        kstage = h.index
        last = (t + 1) * TILE_N > seqlen
        if cutlass.const_expr(self.kv_fp8):
            # S^T = K (Q_hi + Q_lo)^T, fp8 wgmma with A = the stage in smem
            # (_fp8_qk; retired when it returns); V rows past the end are zeroed in
            # registers in PV, K rows past the end only reach masked S^T rows
            soff = kstage * (TILE_N * D_QK)
            if cutlass.const_expr(self.qk_joint):
                self._fp8_qk_joint(qkj_mma, acc_S, acc_T, tSrK, tSrQ, kstage, fold)
            else:
                self._fp8_qk(qk_mma, acc_S, acc_T, tSrK, tSrQ, kstage)
            vw_first = None
            if cutlass.const_expr(self.pv_prefetch and not self.lazy_max):
                # PV's first V words, loaded now: their latency hides behind the
                # softmax (lazy maxima: after it, see below)
                vw_first = self._fp8_v_words([a + soff for a in v_addr], 0)
        else:
            if last:
                # zero the V rows past the end (4 of the 512 columns per thread)
                sKz = sK[None, None, kstage]
                for r in cutlass.range(seqlen - t * TILE_N, TILE_N, unroll=1):
                    for j in cutlass.range_constexpr(4):
                        sKz[r, 4 * wtid + j] = BFloat16(0.0)
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=bar, number_of_threads=128)

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
                if t * TILE_N + row >= seqlen:
                    for c in cutlass.range_constexpr(n_cols):
                        acc_S_mn[r, c] = -Float32.inf

        # column (= head) maxima of this thread's 2 rows; exact step: of the warp's
        # rows (the 8 lanes of the column), published to the other warps
        for c in cutlass.range_constexpr(n_cols):
            w_max[c] = acc_S_mn[None, c].load().reduce(cute.ReductionOp.MAX,
                                                       -Float32.inf, 0)
            if cutlass.const_expr(not self.lazy_max):
                self._publish_max(w_max, sMax, buf, cwarp, lane, tScS_mn, c)
        if cutlass.const_expr(self.lazy_max):
            # this tile's P^T buffer (two per consumer, alternating)
            tOrP, tSsP = self._p_views(sP_all[None, None, 2 * cons + buf], sP_layout,
                                      qk_mma, thr_qk, thr_pv, cwarp, lane)
            # P against the running maxima as they are; exact unless a thread saw a
            # column rise above its maximum by more than LAZY_MAX_SLACK (log2 units),
            # which every warp learns from the barrier's OR (so no shuffles here);
            # the consumer's first tile (no maxima yet) always goes the exact way
            redo = Int32(1)
            if pos.not_first():
                rise = Int32(0)
                for c in cutlass.range_constexpr(n_cols):
                    rise = rise | Int32((w_max[c] - col_max[c]) * scale_s
                                        > LAZY_MAX_SLACK)
                psum = cute.make_rmem_tensor((n_cols,), Float32)
                for c in cutlass.range_constexpr(n_cols):
                    p = cute.math.exp2(acc_S_mn[None, c].load() * scale_s
                                       - col_max[c] * scale_s, fastmath=True)
                    psum[c] = p.reduce(cute.ReductionOp.ADD, Float32.zero, 0)
                    rS_mn[None, c] = p
                self._store_pt(rP, rS, tSsP)
                redo = _barrier_or(bar, 128, rise)
                if redo == 0:
                    for c in cutlass.range_constexpr(n_cols):
                        col_sum[c] = col_sum[c] + psum[c]
            if redo != 0:
                for c in cutlass.range_constexpr(n_cols):
                    self._publish_max(w_max, sMax, buf, cwarp, lane, tScS_mn, c)
                self._softmax_exact(col_max, col_sum, acc_S, acc_S_mn, acc_O_mn, rP,
                                    tSsP, sMax, buf, tScS_mn, bar, scale_s)
        else:
            self._softmax_exact(col_max, col_sum, acc_S, acc_S_mn, acc_O_mn, rP, tSsP,
                                sMax, buf, tScS_mn, bar, scale_s)

        # O^T += V^T P^T
        if cutlass.const_expr(self.kv_fp8):
            if cutlass.const_expr(self.pv_prefetch and self.lazy_max):
                # loaded here: 16 registers held across the lazy softmax spill
                vw_first = self._fp8_v_words([a + soff for a in v_addr], 0)
            # A = V^T gathered and widened in registers; the stage is released
            # after its last fragment load, before the last wgmma group retires
            # the V words are zeroed past the end only on the last tile, the only
            # one that has such tokens (a select per word and k-step otherwise)
            # (set here, not in the branches: the traced atom must not change
            # inside one)
            pv_mma.set(warpgroup.Field.ACCUMULATE, True)
            if last:
                self._fp8_pv(pv_mma, thr_pv, acc_O_grp, tOrP, v_addr, v_tok, soff,
                             seqlen - t * TILE_N, h, vw_first, True)
            else:
                self._fp8_pv(pv_mma, thr_pv, acc_O_grp, tOrP, v_addr, v_tok, soff,
                             TILE_N, h, vw_first, False)
        else:
            # (d_split: this CTA's latent dims, whole 64-dim column blocks of the tile further)
            sV_base = sK[None, None, kstage].iterator
            if cutlass.const_expr(self.d_split > 1):
                sV_base = sV_base + ctx.dpart * self.d_out * TILE_N
            sV = cute.make_tensor(sV_base, sV_layout.outer)
            tOrV = thr_pv.make_fragment_A(thr_pv.partition_A(sV))    # (MMA, 8 / d_split, 4)
            warpgroup.fence()
            pv_mma.set(warpgroup.Field.ACCUMULATE, True)
            cute.gemm(pv_mma, acc_O, tOrV, tOrP, acc_O)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            h.release()
        return qk_mma, qkj_mma, pv_mma, thr_qk, thr_pv

    @cute.jit
    def _produce(self, tma_atom, mKV_tma, sK, sTid, mBT, mCnt, breq, b, seqlen, num_splits,
                 t_begin, t_end, producer):
        """The TMA producer warp with the pool (without it: tma_produce_tiles): the split's tiles,
        each id into sTid before its TMA, then one end mark (-1; the stage's transaction
        completed without data) per consumer.

        With more than one split, the last 1/pool_div (`tail`) of each split's tps
        tiles is not its own. The tails of the request's active splits (those with a tile) form
        its pool, pool index p = tile tps - tail + p % tail of split p // tail, the last split's
        only as far as the request goes. A CTA draws pool indices one at a time through the
        request's counter mCnt[b, 0] (relaxed atomic add) after its own tiles, until one is past
        the pool; then it counts itself done in mCnt[b, 1] (acq_rel), and the last active
        CTA to do so resets both counters: every draw of the call is behind it, and the next
        call's draws come after its PDL wait, when this grid has completed. The counters are
        the launch's request b's: with head groups each group has its own pool (every group
        reads every tile of request breq)."""
        tKs, tKg = tma_tile_views(tma_atom, mKV_tma, sK)
        slots = 2 * self.stages
        lane = cute.arch.lane_idx()
        n_tiles = (seqlen + (TILE_N - 1)) // TILE_N
        tps = (n_tiles + num_splits - 1) // num_splits
        tail = Int32(0)
        if num_splits > 1:
            tail = tps // self.pool_div
        active = (n_tiles + tps - 1) // tps
        pool_len = Int32(0)
        if tail > 0:
            last_tail = (active - 1) * tps + tps - tail     # the last active split's tail start
            pool_len = (active - 1) * tail + cutlass.max(
                cutlass.min(n_tiles - last_tail, tail), 0)
        # each tile's id goes into its slot from every lane (so the lane that arrives on the full
        # barrier has written it; the consumers read it after their wait), before the stage is
        # free: the slot's previous position, pos - 2 stages, was read before its stage was
        # released for pos - stages, which the producer has acquired already
        pos = Int32(0)
        for t in cutlass.range(t_begin, cutlass.min(t_begin + tps - tail, t_end), unroll=1):
            sTid[pos % slots] = t
            h = producer.acquire_and_advance()
            tma_load_tile(tma_atom, tKs, tKg, mBT, breq, t, self.tiles_per_page, h)
            pos = pos + 1
        if cutlass.const_expr(self.early_kv):
            if pool_len > 0:
                cute.arch.griddepcontrol_wait()   # the counters as the last call left them
        k = self._draw(mCnt, b, lane, pool_len)
        while k < pool_len:
            t = (k // tail) * tps + (tps - tail) + k % tail
            sTid[pos % slots] = t
            h = producer.acquire_and_advance()
            tma_load_tile(tma_atom, tKs, tKg, mBT, breq, t, self.tiles_per_page, h)
            pos = pos + 1
            k = self._draw(mCnt, b, lane, pool_len)
        if pool_len > 0:
            if lane == 0:
                done = cute.arch.atomic_add(mCnt.iterator + (2 * b + 1), Int32(1),
                                            sem="acq_rel", scope="gpu")
                if done == active - 1:
                    mCnt[b, 0] = 0
                    mCnt[b, 1] = 0
        for _ in cutlass.range_constexpr(self.consumers):
            sTid[pos % slots] = Int32(-1)
            h = producer.acquire_and_advance()
            with cute.arch.elect_one():
                cute.arch.inline_ptx("mbarrier.complete_tx.shared::cta.b64 [{$r0}], {$r1};",
                                     read_only_args=[h.barrier.toint(), Int32(self.tma_bytes)])
            pos = pos + 1

    @cute.jit
    def _draw(self, mCnt, b, lane, pool_len) -> Int32:
        """The request's next pool index (lane 0's relaxed atomic add on mCnt[b, 0], shared
        with the warp); pool_len, with no atomic, when there is no pool."""
        k = pool_len
        if pool_len > 0:
            if lane == 0:
                k = cute.arch.atomic_add(mCnt.iterator + 2 * b, Int32(1), sem="relaxed",
                                         scope="gpu")
            k = cute.arch.shuffle_sync(k, 0)
        return k

    def _p_views(self, sPb, sP_layout, qk_mma, thr_qk, thr_pv, cwarp, lane):
        """PV's B fragment of the P^T buffer sPb, and sPb seen as [tokens, heads] partitioned
        like S^T, so that element i of the S^T fragment goes to tSsP[i]."""
        tOrP = thr_pv.make_fragment_B(thr_pv.partition_B(sPb))     # (MMA, 1, 4)
        sPt = cute.make_tensor(sPb.iterator, cute.select(sP_layout.outer, mode=[1, 0]))
        if cutlass.const_expr(self.kv_fp8):
            # fp8: S^T row m is token m, PV's k position m is token row_token(m): this thread's
            # S^T element (m, n) goes to P^T position row_token_inv(m), which is element i of the
            # C partition of the thread whose rows are row_token_inv of ours (row_token only
            # permutes bits 0-1 of m = bits 0-1 of g = lane // 4)
            tSsP = qk_mma.get_slice(
                32 * cwarp + 4 * self.row_token_inv(lane // 4) + lane % 4).partition_C(sPt)
        else:
            tSsP = thr_qk.partition_C(sPt)
        return tOrP, tSsP

    @cute.jit
    def _publish_max(self, w_max, sMax, buf, cwarp, lane, tScS_mn, c: cutlass.Constexpr):
        """w_max[c] (this thread's rows) -> the warp's maximum of column c (_col_max), stored to
        sMax[buf, warp, head] (one lane per column)."""
        w_max[c] = self._col_max(w_max[c])
        if lane < 4:
            sMax[buf, cwarp, tScS_mn[0, c][1]] = w_max[c]

    @cute.jit
    def _softmax_exact(self, col_max, col_sum, acc_S, acc_S_mn, acc_O_mn, rP, tSsP, sMax, buf,
                       tScS_mn, bar, scale_s):
        """The online softmax step of one tile once every warp has published its column maxima
        (_publish_max): the 4 warps' maxima through smem, the running maxima, sums and O^T
        rescaled, P = S^T exponentiated in place and stored to P^T (visible to the async proxy
        and the warpgroup on return). The caller's previous PV has retired in every warp of the
        consumer."""
        n_cols = cute.size(col_max)
        cute.arch.barrier(barrier_id=bar, number_of_threads=128)
        for c in cutlass.range_constexpr(n_cols):
            col = tScS_mn[0, c][1]
            m_new = col_max[c]
            for w in cutlass.range_constexpr(N_WARPS):
                m_new = cute.arch.fmax(m_new, sMax[buf, w, col])
            factor = cute.math.exp2((col_max[c] - m_new) * scale_s, fastmath=True)
            p = cute.math.exp2(acc_S_mn[None, c].load() * scale_s - m_new * scale_s,
                               fastmath=True)
            col_sum[c] = col_sum[c] * factor + p.reduce(cute.ReductionOp.ADD, Float32.zero, 0)
            acc_S_mn[None, c] = p
            acc_O_mn[None, c] = acc_O_mn[None, c].load() * factor
            col_max[c] = m_new
        self._store_pt(rP, acc_S, tSsP)
        cute.arch.barrier(barrier_id=bar, number_of_threads=128)

    @cute.jit
    def _store_pt(self, rP, p, tSsP):
        """P (fp32 fragment) -> P^T in smem, fenced for the async proxy (the caller's barrier
        makes it visible to the warpgroup's PV wgmma)."""
        rP.store(p.load().to(self.cdt))
        for i in cutlass.range_constexpr(cute.size(rP)):
            tSsP[i] = rP[i]
        cute.arch.fence_proxy("async.shared", space="cta")

    @staticmethod
    def _bf16_copy(acc):
        """A bf16 register copy of the fp32 accumulator fragment `acc`."""
        r = cute.make_fragment_like(acc, BFloat16)
        r.store(acc.load().to(BFloat16))
        return r

    @cute.jit
    def _store_o_lse(self, src, dst, tOcO, heads, lse_row, lse_c, tScS_mn, cwarp, lane, cons):
        """The epilogue's writes of consumer `cons`'s columns of the fragment (_pair_cols): O^T
        (src: fp8 cache, the bf16 output or the partial already in partial_dtype; bf16 cache,
        the fp32 fragment, which the bf16 rows' stores round themselves) through its C
        partition dst, heads < `heads` only (fp8: 16-byte vectors, _store_cols_vec; bf16 rows:
        _store_cols_bf16), and the per-head LSE into lse_row (lanes 0-3 of warp cwarp 0 hold
        every column; a CTA that writes no LSEs passes cwarp >= N_WARPS)."""
        args = (src, dst, tOcO, heads, lse_row, lse_c, tScS_mn, cwarp, lane)
        n_cols = cute.size(lse_c)
        if cutlass.const_expr(self.consumers == 1):
            self._store_cols(*args, *self._pair_cols(0, n_cols))
        else:
            if cons == 0:
                self._store_cols(*args, *self._pair_cols(0, n_cols))
            else:
                self._store_cols(*args, *self._pair_cols(1, n_cols))    # (none without xmerge)

    def _pair_cols(self, cons: int, n_cols: int) -> tuple[int, int]:
        """The fragment columns [c0, c1) consumer `cons` merges and writes: with xmerge the first
        / second half, else all for consumer 0 (the only one with one consumer) and none for
        consumer 1."""
        if self.xmerge:
            return (0, n_cols // 2) if cons == 0 else (n_cols // 2, n_cols)
        return (0, n_cols) if cons == 0 else (n_cols, n_cols)

    @cute.jit
    def _store_cols(self, src, dst, tOcO, heads, lse_row, lse_c, tScS_mn, cwarp, lane,
                    c0: cutlass.Constexpr, c1: cutlass.Constexpr):
        """_store_o_lse for the fragment columns [c0, c1)."""
        if cutlass.const_expr(self.kv_fp8):
            self._store_cols_vec(src, dst, tOcO, heads, c0, c1)
        else:
            src_mn = wgmma_c_mn_view(src)
            dst_mn = wgmma_c_mn_view(dst)
            c_mn = wgmma_c_mn_view(tOcO)
            if cutlass.const_expr(dst.element_type is BFloat16):
                self._store_cols_bf16(src_mn, dst_mn, c_mn, heads, lane, c0, c1)
            else:
                for c in cutlass.range_constexpr(c0, c1):
                    if c_mn[0, c][1] < heads:             # a column is one head
                        for r in cutlass.range_constexpr(cute.size(src_mn.shape[0])):
                            dst_mn[r, c] = src_mn[r, c]
        if cwarp == 0 and lane < 4:
            for c in cutlass.range_constexpr(c0, c1):
                col = tScS_mn[0, c][1]
                if col < heads:
                    lse_row[col] = lse_c[c]

    @cute.jit
    def _store_cols_bf16(self, src_mn, dst_mn, c_mn, heads, lane, c0: cutlass.Constexpr,
                         c1: cutlass.Constexpr):
        """bf16 cache, bf16 rows (the output; the partials with bf16_partials),
        fragment columns [c0, c1): src_mn = fp32 O^T [rows, heads] (row r8 + 2 mb = latent dim
        64 mb + 16 w + 8 r8 + g, lane = 4 g + q). Scalar bf16 stores wrote half of a 32-byte
        sector each (a warp's 8 lanes of one head cover 8 consecutive dims). So each thread
        packs its dims g and g + 8 of a head into one bf16x2 word, and lane g of the 8 with its
        q fetches (two shuffles) the words of lanes 2g and 2g + 1 (mod 8) and keeps their low
        halves (g < 4) or high halves: dims 2g and 2g + 1 of the 16-dim block, one 4-byte
        store; the 8 lanes write 32 contiguous bytes (one sector where rows are 32-byte
        aligned, as torch allocates them)."""
        g = lane // 4
        q = lane % 4
        src_a = 4 * ((2 * g) % 8) + q
        src_b = 4 * ((2 * g + 1) % 8) + q
        for c in cutlass.range_constexpr(c0, c1):
            for mb in cutlass.range_constexpr(cute.size(src_mn.shape[0]) // 2):
                p = _pack_bf16x2(src_mn[2 * mb, c], src_mn[2 * mb + 1, c])
                a = cute.arch.shuffle_sync(p, src_a)
                b = cute.arch.shuffle_sync(p, src_b)
                w = prmt(a, b, 0x5410)
                if g >= 4:
                    w = prmt(a, b, 0x7632)
                if c_mn[0, c][1] < heads:             # a column is one head
                    # dims from 64 mb + 16 w: the fragment's dim of row 2 mb is that + g
                    elem = dst_mn.iterator + cute.crd2idx((2 * mb, c), dst_mn.layout)
                    ptr = cute.make_ptr(Int32, elem.toint() + 2 * g, cute.AddressSpace.gmem,
                                        assumed_align=4)
                    cute.make_tensor(ptr, cute.make_layout(1))[0] = w

    @cute.jit
    def _store_cols_vec(self, src, dst, tOcO, heads, c0: cutlass.Constexpr,
                        c1: cutlass.Constexpr):
        """fp8 epilogue, fragment columns [c0, c1): src = the O^T fragment (fp32 acc_O or
        its bf16 copy), dst = its C partition of the output / partial rows (t_layout with
        DIM_PERM), tOcO its (row, head) coordinates. In the [rows, heads] view each column of a
        thread is 16 elements of one head whose addresses are contiguous (O^T row
        64 mb + 16 w + 8 r8 + g = dim 128 w + 16 g + 2 mb + r8 and the view's row index is
        r8 + 2 mb: checked on the static layout at trace time) and start at dim 128 w + 16 g,
        a multiple of 16 elements: 64 bytes (fp32) / 32 bytes (bf16) into a row whose start is
        16-byte aligned (launch.check_inputs asserts 16-byte aligned tensors; rows are 2,048 /
        1,024 bytes). So each column is written with 16-byte vector stores (4 x st.global.v4.f32
        / 2 x st.global.v4.b32) instead of 16 scalar stores, predicated per head as before."""
        src_mn = wgmma_c_mn_view(src)
        dst_mn = wgmma_c_mn_view(dst)
        c_mn = wgmma_c_mn_view(tOcO)
        n_orows = cute.size(src_mn.shape[0])
        assert n_orows == 16, n_orows
        dt = src.element_type
        for c in cutlass.range_constexpr(c0, c1):
            col = dst_mn[None, c]
            # the 16 rows of a column: unit stride in memory (static layout check)
            assert cute.coalesce(col.layout) == cute.make_layout(16), col.layout
            if c_mn[0, c][1] < heads:
                vals = cute.make_rmem_tensor((16,), dt)
                vals.store(src_mn[None, c].load())
                ptr = cute.make_ptr(dt, col.iterator.toint(), cute.AddressSpace.gmem,
                                    assumed_align=16)
                cute.autovec_copy(vals, cute.make_tensor(ptr, cute.make_layout(16)))

    @cute.jit
    def _merge_consumers(self, cons, ring_addr, acc_O_mn, col_max, tScS_mn, sSum, lse_c, wtid,
                         cwarp, lane, scale_s, out_scale):
        """Two consumers, epilogue (both warpgroups call it, each with its own state; its
        sSum rows hold its per-warp column sums). Each consumer hands the O^T fragments and
        per-head (max, sum) of the columns the other writes (_pair_cols) to it through the ring
        and merges the other's into the columns it writes, exactly: m = max(m0, m1),
        f_c = 2^((m_c - m) scale_s), O = O0 f0 + O1 f1, l = l0 f0 + l1 f1, then normalizes
        (out_scale / l) and sets lse_c = (m scale_s + log2 l) ln 2. Without xmerge only consumer
        1 hands over (all columns) and only consumer 0 merges. A consumer that had no tile
        (consumer 1 in a split of 1 tile) has m = -inf, l = 0, O = 0: its factor is 0 (selected
        where it is the other's; exp2(-inf) = 0 where it is its own), never NaN. Consumer 0
        always had a tile (t_begin < t_end) whose token 0 is valid: its m is finite."""
        hp = self.h_pad
        n_orows = cute.size(acc_O_mn.shape[0])      # 16 latent dims
        n_cols = cute.size(acc_O_mn.shape[1])       # hp / 4 heads
        tot = cute.make_rmem_tensor((n_cols,), Float32)
        for c in cutlass.range_constexpr(n_cols):
            col = tScS_mn[0, c][1]
            total = sSum[0, col]
            for w in cutlass.range_constexpr(1, N_WARPS):
                total = total + sSum[w, col]
            tot[c] = total
        # both consumers past their last tile: every TMA of the split has landed (each full
        # barrier was waited on) and every wgmma reading the ring has retired, so the ring is
        # free. Region k holds what consumer k hands over: O^T column c0 + j at float
        # (r + 16 j) 128 + wtid (conflict free), then (max, sum) per head
        cute.arch.barrier(barrier_id=BAR_BOTH, number_of_threads=256)
        span = n_cols // 2 if self.xmerge else n_cols
        region = 128 * n_orows * span + 2 * hp
        mptr = cute.make_ptr(Float32, ring_addr, cute.AddressSpace.smem, assumed_align=16)
        sO = cute.make_tensor(mptr, cute.make_layout(
            (n_orows, span, 128, 2), stride=(128, 128 * n_orows, 1, region)))
        sL = cute.make_tensor(mptr + 128 * n_orows * span,
                              cute.make_layout((2, hp, 2), stride=(hp, 1, region)))
        args = (acc_O_mn, col_max, tot, tScS_mn, sO, sL, wtid)
        if cutlass.const_expr(self.xmerge):
            if cons == 0:
                self._hand_over(*args, cwarp, lane, *self._pair_cols(1, n_cols), 0)
            else:
                self._hand_over(*args, cwarp, lane, *self._pair_cols(0, n_cols), 1)
            cute.arch.barrier(barrier_id=BAR_BOTH, number_of_threads=256)
            if cons == 0:
                self._merge_cols(*args, lse_c, scale_s, out_scale, *self._pair_cols(0, n_cols),
                                 1)
            else:
                self._merge_cols(*args, lse_c, scale_s, out_scale, *self._pair_cols(1, n_cols),
                                 0)
        else:
            if cons == 1:
                self._hand_over(*args, cwarp, lane, 0, n_cols, 0)
                cute.arch.barrier_arrive(barrier_id=BAR_BOTH, number_of_threads=256)
            else:
                cute.arch.barrier(barrier_id=BAR_BOTH, number_of_threads=256)
                self._merge_cols(*args, lse_c, scale_s, out_scale, 0, n_cols, 0)

    @cute.jit
    def _hand_over(self, acc_O_mn, col_max, tot, tScS_mn, sO, sL, wtid, cwarp, lane,
                   c0: cutlass.Constexpr, c1: cutlass.Constexpr, k: cutlass.Constexpr):
        """_merge_consumers: this consumer's O^T columns [c0, c1) and their heads' (max, sum)
        into region k."""
        for c in cutlass.range_constexpr(c0, c1):
            for r in cutlass.range_constexpr(cute.size(acc_O_mn.shape[0])):
                sO[r, c - c0, wtid, k] = acc_O_mn[r, c]
        if cwarp == 0 and lane < 4:
            for c in cutlass.range_constexpr(c0, c1):
                hcol = tScS_mn[0, c][1]
                sL[0, hcol, k] = col_max[c]
                sL[1, hcol, k] = tot[c]

    @cute.jit
    def _merge_cols(self, acc_O_mn, col_max, tot, tScS_mn, sO, sL, wtid, lse_c, scale_s,
                    out_scale, c0: cutlass.Constexpr, c1: cutlass.Constexpr,
                    k: cutlass.Constexpr):
        """_merge_consumers: the other consumer's columns [c0, c1) from region k merged into
        this consumer's, normalized, with their LSEs."""
        for c in cutlass.range_constexpr(c0, c1):
            mcol = tScS_mn[0, c][1]
            m1 = sL[0, mcol, k]
            l1 = sL[1, mcol, k]
            m = cute.arch.fmax(col_max[c], m1)
            f0 = cute.math.exp2((col_max[c] - m) * scale_s, fastmath=True)
            f1 = cutlass.select_(l1 > Float32(0.0),
                                 cute.math.exp2((m1 - m) * scale_s, fastmath=True),
                                 Float32(0.0))
            lsum = tot[c] * f0 + l1 * f1
            for r in cutlass.range_constexpr(cute.size(acc_O_mn.shape[0])):
                acc_O_mn[r, c] = acc_O_mn[r, c] * f0 + sO[r, c - c0, wtid, k] * f1
            inv, lg = softmax_norm(lsum, out_scale)
            acc_O_mn[None, c] = acc_O_mn[None, c].load() * inv
            lse_c[c] = (m * scale_s + lg) * LN_2

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
    def row_token_inv(t):
        """The S^T row m with row_token(m) = t: bits (0, 1) of m are (t1, t0 ^ t1)."""
        return (t - t % 4) + (t // 2) % 2 + 2 * ((t % 2) ^ ((t // 2) % 2))

    @staticmethod
    def q8_layout(hp: int, joint: bool = False):
        """smem layout of Q_hi, Q_lo [hp, 576, 2] (e4m3, K-major): 8-row x 64-byte atoms with the
        64-byte swizzle, stacked along the heads, then the 9 column blocks, then the two terms.
        joint (qk_joint): one operand [2 hp, 576], rows 0..hp-1 = Q_hi, hp..2 hp-1 = Q_lo: the
        same atoms stacked along the 2 hp rows, then the 9 column blocks (same bytes)."""
        atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW64,
                                               cutlass.Float8E4M3FN)
        if joint:
            return cute.tile_to_shape(atom, (2 * hp, D_QK), (0, 1))
        return cute.tile_to_shape(atom, (hp, D_QK, 2), (0, 1, 2))

    @staticmethod
    def _q8_offset(hp: int, h, d, joint: bool = False):
        """Byte offset of (head h, dim d, Q_hi) in q8_layout(hp, joint); Q_lo is _q8_lo(hp,
        joint) bytes further. d % 8 == 0 keeps 8 bytes contiguous. joint: row h of the
        [2 hp, 576] operand, 64-dim block d // 64 of 2 hp rows x 64 bytes."""
        rows = 2 * hp if joint else hp
        return (d // 64) * (rows * 64) + h * 64 + ((d % 64) ^ (((h // 2) % 4) * 16))

    @staticmethod
    def _q8_lo(hp: int, joint: bool = False):
        """Byte distance of Q_lo from Q_hi (same head and dim) in q8_layout(hp, joint): the second
        term (hp * 576), or joint hp rows further (hp * 64; hp is a multiple of 16, so the
        swizzle phase (row // 2) % 4 is the same)."""
        return hp * 64 if joint else hp * D_QK

    def _loads_q(self, m: int, k: int, rq, cons):
        """Whether consumer `cons` loads Q vector (m, k): every consumer does, except with
        q_half, where its owner alone does (a run-time test: cons is)."""
        return self._q_owner(m, k, rq) == cons if self.q_half else True

    def _q_owner(self, m: int, k: int, rq) -> int:
        """The consumer that loads and stores Q vector (m, k) of the copy partition: 0 for all
        but q_half's second half of the (m, k) list (h_pad 32: m = 1, the heads 16-31)."""
        if not self.q_half:
            return 0
        nk = cute.size(rq.shape[2])
        return int(2 * (m * nk + k) >= cute.size(rq.shape[1]) * nk)

    def _store_q_fp8(self, rq, tQc, s, q_base, owner: int | None = None):
        """fp8 path: this thread's Q vectors rq (bf16, copy_q partition, coordinates tQc; those of
        consumer `owner` (_q_owner) if given) -> Q_hi = e4m3(s q), Q_lo = e4m3(s q - Q_hi) in smem
        (q8_layout at byte address q_base): per vector of 8 dims 4 _split_e4m3x2, 4 prmt, two
        8-byte st.shared (s is a power of two, so s q is exact, and so is s q - Q_hi)."""
        hp = self.h_pad
        for m in range(cute.size(rq.shape[1])):
            for c in range(cute.size(rq.shape[2])):
                if owner is not None and self._q_owner(m, c, rq) != owner:
                    continue
                ry = cute.make_rmem_tensor((8,), Float32)
                ry.store(rq[None, m, c].load().to(Float32) * s)
                pr = [_split_e4m3x2(ry[2 * j], ry[2 * j + 1]) for j in range(4)]
                hi = cute.make_rmem_tensor((2,), Int32)
                lo = cute.make_rmem_tensor((2,), Int32)
                for w in range(2):
                    hi[w] = prmt(pr[2 * w], pr[2 * w + 1], 0x5410)
                    lo[w] = prmt(pr[2 * w], pr[2 * w + 1], 0x7632)
                crd = tQc[0, m, c]
                off = q_base + self._q8_offset(hp, crd[0], crd[1], self.qk_joint)
                terms = ((off, hi), (off + self._q8_lo(hp, self.qk_joint), lo))
                for dst, src in terms[:self.q_terms]:
                    ptr = cute.make_ptr(Int32, dst, cute.AddressSpace.smem, assumed_align=8)
                    cute.autovec_copy(src, cute.make_tensor(ptr, cute.make_layout((2,))))

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
        toks = [MlaDecodeKernel.row_token(2 * tig + jp) for jp in range(2)]
        offs = [MlaDecodeKernel._raw_offset(tok, 128 * cwarp + 16 * g) for tok in toks]
        return toks, offs

    def _fp8_qk(self, qk_mma, acc_S, acc_T, tSrK, tSrQ, kstage):
        """S^T = K (Q_hi + Q_lo)^T with the e4m3 wgmma m64nNk32, both operands in smem (A = the
        stage's raw K tile, B = Q_hi / Q_lo): 9 chunks of 64 dims, 4 wgmmas each (k-steps 2 c,
        2 c + 1 with Q_hi, then with Q_lo; q_terms 1: the 2 with Q_hi). qk_promote: chunk 0 into
        acc_S, chunk c >= 1 into the zeroed acc_T[(c - 1) % 2], added to acc_S in fp32 once
        retired (chunk c in flight while chunk c - 1 is added). Every wgmma has retired (the
        stage may be released) on return."""
        for c in range(QK_CHUNKS):
            if self.qk_promote:
                dst = acc_S if c == 0 else acc_T[(c - 1) % 2]
            else:
                dst = acc_S
            warpgroup.fence()
            for j in range(2 * self.q_terms):
                k, half = 2 * c + j % 2, j // 2
                qk_mma.set(warpgroup.Field.ACCUMULATE,
                           j != 0 if self.qk_promote else (c, j) != (0, 0))
                cute.gemm(qk_mma, dst, tSrK[None, None, k, kstage], tSrQ[None, None, k, half],
                          dst)
            warpgroup.commit_group()
            if self.qk_promote and c >= 2:
                warpgroup.wait_group(1)           # chunk c - 1 retired
                acc_S.store(acc_S.load() + acc_T[(c - 2) % 2].load())
        warpgroup.wait_group(0)
        if self.qk_promote:
            acc_S.store(acc_S.load() + acc_T[(QK_CHUNKS - 2) % 2].load())

    @staticmethod
    def fp8_qk_mma(n: int):
        """The fp8 S^T MMA: e4m3 x e4m3 -> fp32, both K-major, 64 x n tiles (n = h_pad, or
        2 h_pad for qk_joint's [Q_hi ; Q_lo] operand)."""
        e4m3 = cutlass.Float8E4M3FN
        return sm90_utils.make_trivial_tiled_mma(
            e4m3, e4m3, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32,
            (1, 1, 1), (TILE_N, n))

    @staticmethod
    def _joint_fold_map(qk_mma, qkj_mma, hp):
        """qk_joint, at trace time: for element i of the S^T C fragment (qk_mma, 64 x hp) the
        elements (hi, lo) of the joint C fragment (qkj_mma, 64 x 2 hp) at the same token and head
        n (K Q_hi^T) and n + hp (K Q_lo^T). Checked for all 128 threads, not assumed: both in the
        same thread, at the same fragment indices in every thread (thread-independent moves)."""
        cS = cute.make_identity_tensor((TILE_N, hp))
        cJ = cute.make_identity_tensor((TILE_N, 2 * hp))
        fold = None
        for tid in range(128):
            s_c = qk_mma.get_slice(tid).partition_C(cS)
            j_c = qkj_mma.get_slice(tid).partition_C(cJ)
            assert cute.size(j_c) == 2 * cute.size(s_c), (cute.size(j_c), cute.size(s_c))
            where = {(int(j_c[i][0]), int(j_c[i][1])): i for i in range(cute.size(j_c))}
            f = []
            for i in range(cute.size(s_c)):
                m, n = int(s_c[i][0]), int(s_c[i][1])
                assert (m, n) in where and (m, n + hp) in where, (tid, i, m, n)
                f.append((where[(m, n)], where[(m, n + hp)]))
            assert fold is None or f == fold, (tid, f, fold)
            fold = f
        assert sorted(sum(map(list, fold), [])) == list(range(2 * len(fold))), fold
        return fold

    def _fp8_qk_joint(self, qkj_mma, acc_S, acc_T, tSrK, tSrQ, kstage, fold):
        """qk_joint: S^T = K (Q_hi + Q_lo)^T as 18 e4m3 wgmma m64n(2 hp)k32 with B = [Q_hi ; Q_lo]:
        9 chunks of 64 dims (k-steps 2 c, 2 c + 1) into the zeroed 64 x 2 hp accumulator
        acc_T[c % 2]; once chunk c has retired (while chunk c + 1 runs) S^T[:, n] (+)=
        T[:, n] + T[:, n + hp] in fp32 (fold: _joint_fold_map; chunk 0 assigns). The same
        64-dim promotion as _fp8_qk. Every wgmma has retired on return."""
        def add(c):
            T = acc_T[c % 2]
            for i in range(len(fold)):
                hi, lo = fold[i]
                v = T[hi] + T[lo]
                acc_S[i] = v if c == 0 else acc_S[i] + v

        for c in range(QK_CHUNKS):
            dst = acc_T[c % 2]
            warpgroup.fence()
            for j in range(2):
                qkj_mma.set(warpgroup.Field.ACCUMULATE, j != 0)
                cute.gemm(qkj_mma, dst, tSrK[None, None, 2 * c + j, kstage],
                          tSrQ[None, None, 2 * c + j], dst)
            warpgroup.commit_group()
            if c >= 1:
                warpgroup.wait_group(1)           # chunk c - 1 retired
                add(c - 1)
        warpgroup.wait_group(0)
        add(QK_CHUNKS - 1)

    @staticmethod
    def _fp8_v_words(vbase, ks):
        """The raw V words of k-step ks: four 16-byte loads (j = jp + 2 jh), see _fp8_pv."""
        return [lds_u32(vbase[j % 2] + (1024 * ks + 512 * (j // 2)), 4)
                for j in range(4)]

    def _fp8_pv(self, pv_mma, thr_pv, acc_O_grp, tOrP, v_addr, v_tok, soff, n_valid, h,
                vw_first, masked):
        """O^T += V^T P^T with A = V^T gathered and widened in registers: per 16-token k-step
        four 16-byte loads (tokens past the end -> 0: their bytes may be NaN encodings and
        p = 0 there), prmt pairs the bytes of tokens (k, k + 1) and one cvt widens each pair;
        8 / pv_group wgmma groups of pv_group M blocks (4 pv_group A registers each) per k-step,
        at most pv_in_flight in flight. With pv_prefetch the caller passes k-step 0's words
        (vw_first, loaded before the softmax) and k-step ks + 1's loads are issued before k-step
        ks's wgmmas, so no load latency sits between two wgmma groups; without, each k-step's
        words are loaded after the previous k-step's wgmmas were issued.
        The stage is released once every load of the tile has been consumed. The caller sets
        pv_mma to accumulate."""
        lim = [n_valid - v_tok[jp] for jp in range(2)]
        vbase = [v_addr[jp] + soff for jp in range(2)]
        raw = vw_first if self.pv_prefetch else self._fp8_v_words(vbase, 0)
        for ks in range(TILE_N // 16):
            vw = raw
            if masked:
                vw = []
                for j in range(4):
                    jp, jh = j % 2, j // 2
                    ok = lim[jp] > 16 * ks + 8 * jh   # token v_tok[jp] + 16 ks + 8 jh < n_valid
                    vw.append([Int32(cutlass.select_(ok, raw[j][i], Int32(0)))
                               for i in range(4)])
            if ks + 1 < TILE_N // 16 and self.pv_prefetch:
                raw = self._fp8_v_words(vbase, ks + 1)
            gb = self.pv_group
            for half in range(8 // gb):
                rA = thr_pv.make_fragment_A(thr_pv.partition_shape_A((64 * gb, 16)))  # (8, gb, 1)
                rA32 = cute.recast_tensor(rA, Int32)
                for mbl in range(gb):
                    mb = gb * half + mbl
                    # bytes 2 mb, 2 mb + 1 of both tokens: word mb // 2, bytes 0-1 or 2-3
                    sel = 0x5140 if mb % 2 == 0 else 0x7362
                    for jh in range(2):
                        pr = prmt(vw[2 * jh][mb // 2], vw[2 * jh + 1][mb // 2], sel)
                        # word r8 + 2 jh: rows g (r8 0) / g + 8 (r8 1), k = 2 tig + 8 jh (+1)
                        rA32[4 * mbl + 2 * jh] = cvt_e4m3x2_f16x2(pr, False)
                        rA32[4 * mbl + 2 * jh + 1] = cvt_e4m3x2_f16x2(pr, True)
                if ks == TILE_N // 16 - 1 and half == 8 // gb - 1:
                    # every load of the stage has been consumed by this warp's lanes
                    cute.arch.sync_warp()
                    h.release()
                warpgroup.fence()
                acc = acc_O_grp[None, (None, half), None]
                cute.gemm(pv_mma, acc, rA[None, None, 0], tOrP[None, None, ks], acc)
                warpgroup.commit_group()
                warpgroup.wait_group(self.pv_in_flight - 1)
            if ks + 1 < TILE_N // 16 and not self.pv_prefetch:
                raw = self._fp8_v_words(vbase, ks + 1)
        warpgroup.wait_group(0)

    # ------------------------------------------------------------------------------------------
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
