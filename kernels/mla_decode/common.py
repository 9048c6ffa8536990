"""Shared pieces of the CuTe DSL MLA decode kernels (attention.py, combine.py): the sizes, the
launch's tensor views, a split's tile range, the TMA producer, raw fp8 byte conversions,
shared-memory word loads and the softmax normalization."""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import T, dsl_user_op

from pdserve.kernels.mla_decode.plan import TILE_N

D_QK = 576
D_V = 512
LOG2_E = 1.4426950408889634
LN_2 = 0.6931471805599453


def query_tensors(q_ptr, bt_ptr, batch, heads, max_pages):
    """mQ [B, H, 576] and the block table [B, max_pages] over the launch's pointers."""
    mQ = cute.make_tensor(q_ptr, cute.make_layout(
        (batch, heads, D_QK), stride=(cute.assume(heads * D_QK, divby=64), D_QK, 1)))
    mBT = cute.make_tensor(bt_ptr, cute.make_layout((batch, max_pages), stride=(max_pages, 1)))
    return mQ, mBT


def result_tensors(o_ptr, lse_ptr, op_ptr, lsep_ptr, seq_ptr, batch, heads, num_splits):
    """(mO [B, H, 512], mLse [B, H], mOp [S, B, H, 512], mLsep [S, B, H], mSeq [B]): the final and
    the per-split outputs as the attention kernel writes them and the combine reads them (mSeq None when
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
    """Entry of the attention kernel. PDL both ways: the combine may become
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
    """The TMA producer warp without the tile pool: tiles [t_begin, t_end) of request
    `breq`, each a [64, 576] TMA into the next stage of the ring `sRing` ([64, 576, stages])
    once the pipeline `producer` has it free."""
    tKs, tKg = tma_tile_views(tma_atom, mKV_tma, sRing)
    for t in cutlass.range(t_begin, t_end, unroll=1):
        h = producer.acquire_and_advance()
        tma_load_tile(tma_atom, tKs, tKg, mBT, breq, t, tiles_per_page, h)


@cute.jit
def copy_q_rows(copy_q: cute.TiledCopy, tQg: cute.Tensor, tQs: cute.Tensor, tQc: cute.Tensor,
                heads: Int32):
    """cp.async of this thread's query rows into shared memory (the bf16 Q load):
    rows < heads from global, the padding rows >= heads zeroed."""
    for m in cutlass.range_constexpr(cute.size(tQs.shape[1])):
        if tQc[0, m, 0][0] < heads:
            cute.copy(copy_q, tQg[None, m, None], tQs[None, m, None])
        else:
            tQs[None, m, None].fill(0)


def wgmma_c_mn_view(t):
    """wgmma C fragment ((2, 2, V), MMA_M, MMA_N) -> ((2, MMA_M), (2, V, MMA_N)) rows / cols."""
    l = cute.make_layout(t.layout.shape)
    v, vs = l.shape[0], l.stride[0]
    if len(v) == 2:                   # N = 8: a single column pair per row (V = 1)
        v, vs = (*v, 1), (*vs, 0)
    mn = cute.make_layout(((v[1], l.shape[1]), (v[0], v[2], l.shape[2])),
                          stride=((vs[1], l.stride[1]), (vs[0], vs[2], l.stride[2])))
    return cute.make_tensor(t.iterator, cute.composition(t.layout, mn))


@dsl_user_op
def cvt_e4m3x2_f16x2(x, high: bool, *, loc=None, ip=None) -> Int32:
    """The two e4m3 bytes of the low (high=False) or high half of the 32-bit x -> f16x2 (exact;
    the lower byte into the lower half)."""
    half = "hi" if high else "lo"
    return Int32(llvm.inline_asm(
        T.i32(), [Int32(x).ir_value(loc=loc, ip=ip)],
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $1; cvt.rn.f16x2.e4m3x2 $0, " + half + "; }",
        "=r,r", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def prmt(a, b, sel: int, *, loc=None, ip=None) -> Int32:
    """prmt.b32 with an immediate selector (bytes 0-3 from a, 4-7 from b)."""
    return Int32(llvm.inline_asm(
        T.i32(), [Int32(a).ir_value(loc=loc, ip=ip), Int32(b).ir_value(loc=loc, ip=ip)],
        f"prmt.b32 $0, $1, $2, {sel:#06x};", "=r,r,r", has_side_effects=False,
        is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


def lds_u32(addr: Int32, n: int):
    """n (2 or 4) 32-bit words from shared byte address addr (aligned to 4 n): one vector
    ld.shared into an rmem fragment."""
    ptr = cute.make_ptr(Int32, addr, cute.AddressSpace.smem, assumed_align=4 * n)
    dst = cute.make_rmem_tensor((n,), Int32)
    cute.autovec_copy(cute.make_tensor(ptr, cute.make_layout((n,))), dst)
    return dst


def softmax_norm(total: Float32, out_scale) -> tuple[Float32, Float32]:
    """(out_scale / total, log2 total) for a softmax sum total >= 1 (it holds the maximum's own
    term), from the MUFU approximations rcp.approx (~1 ulp) and lg2.approx (~2^-22 absolute):
    the IEEE division and the accurate log2 cost ~25 dependent instructions a column, which the
    epilogue's single warp a scheduler cannot hide. Far below the bf16 output's and the fp32
    partials' rounding."""
    return out_scale * cute.arch.rcp_approx(total), cute.math.log2(total, fastmath=True)

