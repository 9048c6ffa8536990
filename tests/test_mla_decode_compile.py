"""The CuTe DSL MLA decode kernels compile to sm_90a cubins on a CPU-only machine (CI), and the
launch plan makes the choices it documents.

`CUTE_DSL_ARCH=sm_90a` makes cute.compile target Hopper without a GPU. The attention kernel's
variants (bf16 / fp8 cache, 16 / 32 padded heads, page sizes, one / two consumers, the fp8 query
terms, the tile pool, latent halves, head groups, early_kv) are compiled and their PTX and cubin
checked: sm_90a instructions, wgmma shapes and counts, the fp8 operand descriptors, barriers,
registers at launch that fit the block, no spill stack. The variants are made by the launch plan
for the H200's properties given explicitly (H200 below): no GPU is asked.
"""
import dataclasses
import os
import re
from pathlib import Path

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest

cutlass = pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl (test extra) not installed")

from pdserve.kernels.kda_decode.cutedsl import cubin_resources  # noqa: E402
from pdserve.kernels.mla_decode import combine as mcomb  # noqa: E402
from pdserve.kernels.mla_decode import launch as ml  # noqa: E402
from pdserve.kernels.mla_decode import plan as mp  # noqa: E402
from pdserve.kernels.mla_decode.attention import MlaDecodeKernel  # noqa: E402
from pdserve.kernels.mla_decode.plan import Attention, Combine, Device, plan_call  # noqa: E402

# the device the CPU build targets: an H200's SM count and opt-in shared memory per block
H200 = Device(sm_count=132, smem_per_block=232448)


def variant(kv_fp8, h_pad, page_tokens=64, **choices) -> Attention:
    """The plan's attention variant with `h_pad` heads for a long-context call (B=8, L=32K: the
    fp8 cache gets two consumers and the tile pool there, the bf16 one neither latent halves nor
    head groups), with `choices` on top."""
    return plan_call(8, h_pad, 32768, kv_fp8, page_tokens, H200, **choices).attention


def kernel(kv_fp8, h_pad, page_tokens=64, **choices) -> MlaDecodeKernel:
    return MlaDecodeKernel(variant(kv_fp8, h_pad, page_tokens, **choices))


def compiled(v: Attention):
    """The process-cached compiled kernel of `v` (the launcher's)."""
    return ml.attention_kernel(v)[1]


def dump(v: Attention, tmp_path, name="k"):
    d = tmp_path / name
    d.mkdir(exist_ok=True)
    return ml.compile_attention(v, str(d))


def replaced(v: Attention, **fields) -> Attention:
    return dataclasses.replace(v, **fields)


# both head paddings and the smallest and largest page (each compile takes ~10 s on CI)
@pytest.mark.parametrize("h_pad,page_tokens", [(16, 64), (32, 256)])
def test_bf16_kernel_compiles(h_pad, page_tokens, tmp_path):
    v = variant(False, h_pad, page_tokens)
    assert (v.consumers, v.d_split, v.pool_div, v.bf16_partials) == (1, 1, 0, False)
    fn = dump(v, tmp_path)
    ptx, cubin = fn.artifacts.PTX, fn.artifacts.CUBIN
    assert ".target sm_90a" in ptx
    # S^T = K Q^T: 36 wgmma m64nNk16 (K = 576); O^T += V^T P^T: 8 blocks of 64 latent dims x 4
    # k-steps of 16 tokens; N = h_pad everywhere, no other wgmma shape
    shape = f"m64n{h_pad}k16"
    assert ptx.count(f"wgmma.mma_async.sync.aligned.{shape}.f32.bf16.bf16") == 36 + 8 * 4
    assert ptx.count("wgmma.mma_async.sync.aligned.") == 36 + 8 * 4
    # S has both operands K-major; PV has an MN-major (transposed) A = V^T
    assert ptx.count(", p, 1,  1, 0, 0;") == 36 and ptx.count(", p, 1,  1, 1, 0;") == 32
    assert ptx.count("cp.async.bulk.tensor.2d") == 9          # one TMA box per 64 columns
    assert ptx.count("setmaxnreg") == 2
    # the bf16 output rows: one bf16x2 word per 2 x 8 dims x head, paired across lanes by two
    # shuffles (_store_cols_bf16), no 2-byte stores (half-sector writes)
    assert ptx.count("cvt.rn.bf16x2.f32") == 512 * h_pad // 128 // 2
    assert ptx.count("shfl.sync.idx") >= 2 * ptx.count("cvt.rn.bf16x2.f32")
    assert "st.global.b16" not in ptx and "st.global.u16" not in ptx
    res = cubin_resources(cubin)
    assert res["stack"] == 0, "register spills"
    assert res["regs"] <= 65536 // 256, res                 # 256 threads must fit at launch
    k = MlaDecodeKernel(v)
    assert k.num_threads == 256 and k.h_pad == h_pad and k.stages == 2
    assert k.smem_bytes <= H200.smem_per_block
    # the variant is the cache key: equal variants share the compiled kernel, h_pad does not
    assert compiled(v) is compiled(variant(False, h_pad, page_tokens))
    assert compiled(v) is not compiled(variant(False, 48 - h_pad, page_tokens))


@pytest.mark.parametrize("h_pad", [16, 32])
def test_bf16_d_split_compiles(h_pad, tmp_path):
    """d_split 2 (bf16): each CTA runs S^T whole (36 wgmmas) and PV over its 256 latent dims
    (4 blocks x 4 k-steps), and writes 256 dims of each head's output row (half the packed
    bf16x2 stores); no spill, the same ring and smem as d_split 1."""
    v = variant(False, h_pad, d_split=2)
    fn = dump(v, tmp_path)
    ptx = fn.artifacts.PTX
    assert ptx.count(f"wgmma.mma_async.sync.aligned.m64n{h_pad}k16.f32.bf16.bf16") == 36 + 4 * 4
    assert ptx.count(", p, 1,  1, 1, 0;") == 16                 # PV: MN-major A = V^T
    assert ptx.count("cvt.rn.bf16x2.f32") == 256 * h_pad // 128 // 2
    assert cubin_resources(fn.artifacts.CUBIN)["stack"] == 0, "register spills"
    k, one = MlaDecodeKernel(v), kernel(False, h_pad)
    assert (k.d_split, k.d_out, one.d_split, one.d_out) == (2, 256, 1, 512)
    assert (k.stages, k.smem_bytes) == (one.stages, one.smem_bytes)
    assert compiled(v) is not compiled(variant(False, h_pad))


def test_d_split_refusals_and_choice():
    """d_split 2 needs the bf16 cache, one consumer and no tile pool (the two CTAs must run the
    same tiles); the plan takes it where the doubled launch fills at most half of the device's
    SMs (the cells measured on the H200)."""
    for kw in (dict(kv_fp8=True), dict(consumers=2), dict(d_split=3), dict(pool_div=4)):
        args = dict(kv_fp8=False, h_pad=32, d_split=2)
        args.update(kw)
        with pytest.raises(ValueError, match="d_split"):
            kernel(**args)
    # the rule: 2 x requests x splits <= half of the SMs
    assert mp.choose_d_split(False, 1, 0, 1, 33, 132) == 2
    assert mp.choose_d_split(False, 1, 0, 1, 34, 132) == 1
    assert mp.choose_d_split(False, 1, 0, 1, 33, 130) == 1            # the device's SMs
    assert mp.choose_d_split(True, 1, 0, 1, 8, 132) == 1              # fp8
    assert mp.choose_d_split(False, 2, 0, 1, 8, 132) == 1             # two consumers
    assert mp.choose_d_split(False, 1, 4, 1, 8, 132) == 1             # tile pool
    want = {(1, 1024, 32): 2, (1, 2048, 32): 2, (1, 4096, 32): 2, (2, 1024, 32): 2,
            (1, 8192, 32): 1, (2, 2048, 32): 1, (4, 1024, 32): 1, (8, 8192, 32): 1,
            (1, 1024, 12): 2, (1, 4096, 12): 2, (4, 1024, 12): 2, (1, 8192, 12): 1,
            (4, 2048, 12): 1}
    for (B, L, H), d in want.items():
        for fp8 in (False, True):
            v = plan_call(B, H, L, fp8, 64, H200).attention
            assert v.d_split == (1 if fp8 else d), (B, L, H, fp8)
    assert plan_call(1, 32, 8192, False, 64, H200, d_split=2).attention.d_split == 2


def test_refuses_bad_h_pad_and_page_size():
    for fp8 in (False, True):
        with pytest.raises(ValueError, match="h_pad=64"):
            MlaDecodeKernel(replaced(variant(fp8, 32), h_pad=64))
    with pytest.raises(ValueError, match="page_tokens=96"):
        MlaDecodeKernel(replaced(variant(False, 32), page_tokens=96))


# fp8, two consumer warpgroups (the default for long splits): (h_pad) -> (stages, smem bytes);
# one consumer: FP8_ONE (two consumers: an even ring, tests/test_mla_ring_protocol.py; two P^T
# buffers each for the lazy maxima)
FP8_TWO = {16: (4, 179712), 32: (4, 207872)}
FP8_ONE = {16: (5, 209664), 32: (5, 230912)}

# the wgmma shared-memory descriptor bits (above the start address) of every fp8 S^T operand, as
# the library encodes them for raw_layout / q8_layout: 64-byte swizzle (bits 62-63 = 2), stride
# byte offset 512 (bits 32-45, 16-byte units: 8 rows x 64 bytes), leading byte offset 16 (unused
# by swizzled K-major layouts), base offset 0 -- the parameters _wgmma_sw64_kmajor models
SW64_DESC = 0x8000002000010000


def _signed64(v):
    return v - (1 << 64) if v >= 1 << 63 else v


def _wgmma_sw64_kmajor(start, r, kk):
    """Byte address the wgmma reads for row r (M or N), K byte kk (< 32) of an 8-bit K-major
    operand whose descriptor has start address `start` (bytes, relative to a 1024-byte aligned
    base) and SW64_DESC's fields (PTX ISA, matrix descriptor: 8-row core matrices, SBO = 512 bytes
    between them, rows 64 bytes apart; 64-byte swizzle = address bits 4-5 XOR bits 7-8)."""
    a = start + (r // 8) * 512 + (r % 8) * 64 + kk
    return a ^ (((a >> 7) & 3) << 4)


def _fp8_s_operand_starts(hp, joint=False):
    """Start byte offsets of the S^T wgmma operands per k-step k (0..17), as the kernel's PTX has
    them (checked in test_fp8_kernel_compiles): A (the stage's K tile) (k // 2) * 4096 +
    (k % 2) * 32; B term t (Q_hi 0, Q_lo 1) t * hp * 576 + (k // 2) * hp * 64 + (k % 2) * 32;
    joint (qk_joint): one B operand [Q_hi ; Q_lo] of 2 hp rows, (k // 2) * 2 hp * 64 +
    (k % 2) * 32."""
    a = [(k // 2) * 4096 + (k % 2) * 32 for k in range(18)]
    if joint:
        return a, [[(k // 2) * 2 * hp * 64 + (k % 2) * 32 for k in range(18)]]
    b = [[t * hp * 576 + (k // 2) * hp * 64 + (k % 2) * 32 for k in range(18)] for t in range(2)]
    return a, b


def _fp8_qk_wgmma(h_pad, joint, q_terms=2):
    """(PTX instruction, count per tile) of the fp8 S^T: 18 x q_terms m64n(h_pad)k32, or
    (joint) 18 of N = 2 h_pad."""
    n = 2 * h_pad if joint else h_pad
    return f"wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3", 18 if joint else 18 * q_terms


@pytest.mark.parametrize("h_pad", [16, 32])
def test_fp8_single_query(h_pad, tmp_path):
    """fp8_query="single" (the default; q_terms 1): S^T from Q_hi alone, 18 e4m3 wgmma
    m64n(h_pad)k32 per tile in the same 9 promotion chunks (no joint form), Q_lo never stored
    (half of the split query's 8-byte Q stores), no spill; q_terms 1 needs an fp8 cache."""
    v = variant(True, h_pad)
    assert (v.q_terms, v.qk_joint) == (1, False)
    split = dump(variant(True, h_pad, fp8_query="split"), tmp_path, "s")
    fn = dump(v, tmp_path, "q")
    ptx = fn.artifacts.PTX
    assert ptx.count(f"wgmma.mma_async.sync.aligned.m64n{h_pad}k32.f32.e4m3.e4m3") == 18
    assert ptx.count("wgmma.mma_async.sync.aligned.") == 18 + 2 * 8 * 4
    assert ptx.count("wgmma.commit_group.sync.aligned") == 9 + 2 * 4 * (8 // v.pv_group)
    q_st = lambda p: p.count("st.shared.v2.b32")
    per_term = (q_st(split.artifacts.PTX) - q_st(ptx))
    assert per_term > 0 and q_st(split.artifacts.PTX) - 2 * per_term >= 0
    assert cubin_resources(fn.artifacts.CUBIN)["stack"] == 0
    with pytest.raises(ValueError, match="q_terms=1"):
        MlaDecodeKernel(replaced(variant(False, h_pad), q_terms=1))
    with pytest.raises(ValueError, match="q_terms=3"):
        MlaDecodeKernel(replaced(v, q_terms=3))
    with pytest.raises(ValueError, match="fp8_query must be"):
        variant(True, h_pad, fp8_query="half")
    # a bf16 cache never rounds its query: the plan says "split" whatever was asked
    assert plan_call(1, 12, 100, False, 64, H200, fp8_query="single").fp8_query == "split"
    assert plan_call(1, 12, 100, True, 64, H200).fp8_query == "single"


def _named_barriers(ptx):
    """(op, 'id, threads') of every bar.sync / bar.arrive, register ids as %r."""
    return [(op, re.sub(r"%r\d+", "%r", arg))
            for op, arg in re.findall(r"\bbar\.(sync|arrive)\s+([^;]*);", ptx)]


# the two fp8 consumers' barriers (test_fp8_kernel_compiles says which is which)
PAIR_BARRIERS = [("sync", "0")] + [("sync", "%r, 128")] * 3 + [("sync", "3, 256")] * 4

@pytest.mark.parametrize("h_pad,page_tokens", [(16, 256), (32, 64)])
def test_fp8_kernel_compiles(h_pad, page_tokens, tmp_path):
    """The fp8 cache with the two-term query: S^T = K (Q_hi + Q_lo)^T with the native e4m3
    wgmma m64nNk32 (A = the raw fp8 stage in smem, B = Q_hi / Q_lo in smem, no K conversion);
    O^T with the fp16 wgmma, A = V^T widened in registers from the raw bytes; no spill."""
    v = variant(True, h_pad, page_tokens, fp8_query="split")
    k = MlaDecodeKernel(v)
    assert k.consumers == 2 and k.num_threads == 384
    assert k.qk_joint == (h_pad == 16)               # the joint S^T: the default at h_pad 16
    assert (k.stages, k.smem_bytes) == FP8_TWO[h_pad]
    assert k.smem_bytes <= H200.smem_per_block and k.tma_bytes == 64 * 576
    # the merge (each consumer's O^T fragments of the heads the other writes + their max / sum)
    # fits in the ring
    assert k.xmerge and k.merge_bytes == (128 * 4 * h_pad + 2 * 2 * h_pad) * 4 <= \
        k.stages * k.tma_bytes
    fn = dump(v, tmp_path)
    ptx, cubin = fn.artifacts.PTX, fn.artifacts.CUBIN
    assert ".target sm_90a" in ptx
    # per tile: S^T 18 k-steps x (Q_hi, Q_lo) e4m3 wgmma k32 (joint: 18 of N = 2 h_pad); O^T 8 M
    # blocks x 4 k-steps fp16, written twice (the last tile's copy zeroes V words past the end,
    # the other does not)
    qk_op, n_qk = _fp8_qk_wgmma(h_pad, k.qk_joint)
    assert ptx.count(qk_op) == n_qk
    assert ptx.count(f"wgmma.mma_async.sync.aligned.m64n{h_pad}k16.f32.f16.f16") == 2 * 8 * 4
    assert ptx.count("wgmma.mma_async.sync.aligned.") == n_qk + 2 * 8 * 4
    # S^T in 9 chunks of 4 (qk_promote), O^T in groups of pv_group blocks: one fence / commit each
    assert ptx.count("wgmma.fence.sync.aligned") == 9 + 2 * 4 * (8 // k.pv_group)
    assert ptx.count("wgmma.commit_group.sync.aligned") == 9 + 2 * 4 * (8 // k.pv_group)
    # one TMA box per 64 columns, in the loop over the split's own tiles and in the tile
    # pool's (the default at this shape)
    assert k.pool_div == 4 and ptx.count("cp.async.bulk.tensor.2d") == 9 * 2
    # one decrease (producer, 24) and one increase (both consumers, 240): 128 x 24 + 256 x 240
    assert ptx.count("setmaxnreg") == 2
    assert "setmaxnreg.dec.sync.aligned.u32 \t24;" in ptx
    assert "setmaxnreg.inc.sync.aligned.u32 \t240;" in ptx
    # named barriers: consumer c's own (id 1 + c = its warpgroup index, 128 threads: column
    # maxima, P^T, column sums); id 3 for both (256): Q's maximum (q_half: each consumer loads
    # half of Q), Q stored, all tiles consumed, merge data handed over (xmerge: both ways);
    # id 0 only for the mbarrier init sync
    assert k.q_half
    assert sorted(_named_barriers(ptx)) == sorted(PAIR_BARRIERS), _named_barriers(ptx)
    # lazy maxima (the default with two fp8 consumers): one barrier.red.or per tile, the exact
    # step's two 128-thread barriers behind it
    assert k.lazy_max and ptx.count("barrier.red.or.pred") == 1
    # the S^T operand descriptors: SW64_DESC's fields; B starts (_fp8_s_operand_starts) as
    # 64-bit constants DESC + start / 16; A starts as 32-bit adds to the stage's start field
    assert str(_signed64(SW64_DESC)) in ptx
    a_st, b_st = _fp8_s_operand_starts(h_pad, k.qk_joint)
    for t in range(len(b_st)):
        for kk in range(18):
            if (t, kk) != (0, 0):
                assert str(_signed64(SW64_DESC + b_st[t][kk] // 16)) in ptx, (t, kk)
    for kk in range(1, 18):
        assert (f", {a_st[kk] // 16};" in ptx) or (f"or.b32 \t" in ptx and a_st[kk] == 32), kk
    assert "mad.lo.s32" in ptx and f", {64 * 576 // 16}, " in ptx    # stage stride 36,864 B
    # per tile and thread: V 4 k-steps x 4 tokens 16-byte loads, 128 exact e4m3x2 -> f16x2, 64
    # prmt, in both PV copies (k-step 0's loads are shared: issued before the softmax); once per
    # CTA: Q split, 9 h_pad / 4 pairs (each one asm: 2 cvt.rn.satfinite.e4m3x2.f32 + 1
    # cvt.rn.f16x2.e4m3x2; q_half: consumer 0's and 1's, half each), 2 prmt per 2 pairs, two
    # 8-byte st.shared per 8 dims, the 8 warps' max |q| read as 2 x 16 bytes
    n_pairs = 9 * h_pad // 4
    assert ptx.count("ld.shared.v4.b32") == 4 + 2 * 12 + 2
    assert ptx.count("cvt.rn.f16x2.e4m3x2") == 2 * 128 + n_pairs
    assert ptx.count("cvt.rn.satfinite.e4m3x2.f32 h,") == n_pairs
    assert ptx.count("prmt.b32") == 2 * 64 + n_pairs
    # (+ the merge: consumer 1's per-head (max, sum) as pairs of adjacent heads; the exact
    # softmax step's warp column maxima are stored one by one after their shuffles)
    assert ptx.count("st.shared.v2.b32") == n_pairs // 2 + h_pad // 4
    for st in ("ld.local", "st.local"):
        assert st not in ptx, st
    res = cubin_resources(cubin)
    assert res["stack"] == 0, "register spills"
    assert res["regs"] <= 65536 // 384, res                 # 384 threads must fit at launch
    # fp8 and bf16 are distinct cached variants
    assert compiled(variant(True, h_pad, page_tokens)) is not \
        compiled(variant(False, h_pad, page_tokens))


@pytest.mark.parametrize("kv_fp8,consumers", [(True, 1), (False, 2)])
def test_consumer_counts(kv_fp8, consumers, tmp_path):
    """The consumer warpgroups are an explicit choice: fp8 with one consumer (256 threads, 5
    stages) and bf16 with two compile with no spill."""
    v = variant(kv_fp8, 32, consumers=consumers)
    k = MlaDecodeKernel(v)
    assert k.consumers == consumers and k.num_threads == 128 * (1 + consumers)
    assert k.smem_bytes <= H200.smem_per_block
    if kv_fp8:
        assert (k.stages, k.smem_bytes) == FP8_ONE[32]
        assert not (k.lazy_max or k.q_half or k.xmerge)      # defaults for one consumer
    fn = dump(v, tmp_path)
    res = cubin_resources(fn.artifacts.CUBIN)
    assert res["stack"] == 0, "register spills"
    assert res["regs"] * k.num_threads <= 65536, res
    assert fn.artifacts.PTX.count("setmaxnreg") == 2


def test_every_choice_is_part_of_the_cache_key():
    """The compile cache is keyed by the attention variant, whose fields are the plan's
    choices (each a keyword of plan_call) and the properties the kernel is built for: lazy and
    exact maxima are two compiled kernels, and asking for the defaults explicitly gives the
    default's compiled kernel back."""
    derived = {"kv_fp8", "h_pad", "page_tokens", "q_terms", "smem_limit"}
    for f in dataclasses.fields(Attention):
        assert f.name in derived or f.name in mp.CHOICES, f.name
    lazy = variant(True, 32)
    exact = variant(True, 32, lazy_max=False)
    assert lazy.lazy_max and not exact.lazy_max
    assert (MlaDecodeKernel(lazy).p_bufs, MlaDecodeKernel(exact).p_bufs) == (2, 1)
    assert compiled(exact) is not compiled(lazy)
    p = plan_call(8, 32, 32768, True, 64, H200)
    assert plan_call(8, 32, 32768, True, 64, H200, **p.choices()) == p
    assert compiled(variant(True, 32, **p.choices())) is compiled(lazy)


def test_no_environment_switches():
    """Nothing in the kernel packages reads the environment: every choice is an argument."""
    root = Path(mp.__file__).resolve().parents[1]
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        assert not re.search(r"os\.environ|getenv", text), path


@pytest.mark.parametrize("h_pad,consumers", [(32, 2), (16, 2), (32, 1)])
def test_fp8_epilogue_and_pv(h_pad, consumers, tmp_path):
    """fp8: the epilogue writes each head's 16 consecutive latent dims per thread with 16-byte
    stores (per column 2 st.global.v4 for the bf16 split partial and 2 for the bf16 output, no
    scalar output stores; the kernel's trace asserts the 16 addresses are contiguous); the
    split partials are bf16 and so is the combine's input; PV loads each k-step's V words one
    k-step ahead (the first before the softmax) in groups of (4, 2 in flight) at h_pad 16 and
    (2, 3 in flight) at 32 (one consumer at 32: per k-step, (2, 2)); no spill."""
    v = variant(True, h_pad, consumers=consumers)
    k = MlaDecodeKernel(v)
    assert k.consumers == consumers
    single_32 = consumers == 1 and h_pad == 32       # no prefetch there (it would spill)
    assert (k.pv_group, k.pv_in_flight, k.pv_prefetch) == (
        (4, 2, True) if h_pad == 16 else (2, 2, False) if single_32 else (2, 3, True))
    fn = dump(v, tmp_path)
    ptx = fn.artifacts.PTX
    stores = re.findall(r"\b(st\.global[.\w]*)", ptx)
    n_cols = h_pad // 4
    assert k.partial_dtype is cutlass.BFloat16
    assert stores.count("st.global.v4.b32") == n_cols * (2 + 2), stores
    assert "st.global.v4.f32" not in stores                # no fp32 partial left
    assert "st.global.b16" not in stores                 # no scalar bf16 output stores left
    # what is left scalar: the LSE (final / partial) and the empty split's LSE
    assert stores.count("st.global.b32") <= 2 * n_cols + 1, stores
    qk_op, n_qk = _fp8_qk_wgmma(h_pad, k.qk_joint, k.q_terms)
    assert ptx.count(qk_op) == n_qk
    assert ptx.count(f"wgmma.mma_async.sync.aligned.m64n{h_pad}k16.f32.f16.f16") == 2 * 8 * 4
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);", ptx)
    assert waits.count(str(k.pv_in_flight - 1)) >= 4 * 8 // k.pv_group - 1, waits
    for st in ("ld.local", "st.local"):
        assert st not in ptx, st
    res = cubin_resources(fn.artifacts.CUBIN)
    assert res["stack"] == 0, "register spills"
    assert res["regs"] * k.num_threads <= 65536, res
    # the PV grouping is a choice of its own; the kernel refuses what it cannot run, and the
    # bf16 cache has none
    assert variant(True, h_pad, consumers=consumers, pv_in_flight=2).pv_in_flight == 2
    for bad in (dict(pv_group=3), dict(pv_in_flight=9), dict(pv_in_flight=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            kernel(True, h_pad, consumers=consumers, **bad)
    with pytest.raises(ValueError, match="fp8 cache only"):
        variant(False, h_pad, pv_group=2)


def test_two_consumer_merge_model():
    """CPU mirror (torch) of the two-consumer split: consumer c runs the online softmax (base 2,
    scale s) over the tiles t_begin + c + 2 i, _merge_consumers' formula merges the two; equal to
    the softmax over all tiles, for 1 (consumer 1 empty: m1 = -inf, l1 = 0), 2, odd and even tile
    counts, with no NaN."""
    import math
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    s = 0.09 * math.log2(math.e)
    for n_tok in (1, 5, 64, 65, 128, 130, 200, 257, 640):
        x = torch.randn(n_tok, 3, generator=g, dtype=torch.float64) * 8       # scores [tok, h]
        v = torch.randn(n_tok, 4, generator=g, dtype=torch.float64)           # values [tok, d]
        n_tiles = -(-n_tok // 64)
        st = []
        for c in range(2):
            m = torch.full((3,), -math.inf, dtype=torch.float64)
            l = torch.zeros(3, dtype=torch.float64)
            o = torch.zeros(3, 4, dtype=torch.float64)
            for t in range(c, n_tiles, 2):
                xs = x[64 * t:64 * t + 64]
                m_new = torch.maximum(m, xs.max(0).values)
                f = torch.exp2((m - m_new) * s)
                p = torch.exp2(xs * s - m_new * s)
                l = l * f + p.sum(0)
                o = o * f[:, None] + p.t() @ v[64 * t:64 * t + 64]
                m = m_new
            st.append((m, l, o))
        (m0, l0, o0), (m1, l1, o1) = st
        m = torch.maximum(m0, m1)
        f0 = torch.exp2((m0 - m) * s)
        f1 = torch.where(l1 > 0, torch.exp2((m1 - m) * s), torch.zeros_like(l1))
        lsum = l0 * f0 + l1 * f1
        out = (o0 * f0[:, None] + o1 * f1[:, None]) / lsum[:, None]
        lse = (m * s + torch.log2(lsum)) * math.log(2)
        ref = torch.softmax(x * 0.09, 0)
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        assert torch.allclose(out, ref.t() @ v, atol=1e-12), n_tok
        assert torch.allclose(lse, torch.logsumexp(x * 0.09, 0), atol=1e-12), n_tok


def _fp8_fragment_check(out):
    """Runs inside a cute.jit trace (static layouts evaluate to ints): the fp8 kernel's operands.
    S^T: the wgmma hardware addressing (_wgmma_sw64_kmajor, with the kernel's descriptor fields
    and start offsets) reads K[token r][dim 32 k + kk] from the raw TMA layout and Q[head n][dim]
    from the kernel's Q layout, which the Q stores (_q8_offset, copy_q vectors) fill; P^T goes
    where PV expects it (row_token_inv); V^T A fragments as before (addresses -> prmt / cvt ->
    the library's wgmma A layout)."""
    from cutlass import BFloat16, Float16, Float32
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.cute.nvgpu import cpasync, warpgroup
    from pdserve.kernels.mla_decode import attention as sw
    K = sw.MlaDecodeKernel
    cute = cutlass.cute
    # 1. _raw_offset == the layout TMA writes (every byte of a stage); _q8_offset == q8_layout
    raw = K.raw_layout(1)
    for t in range(64):
        for d in range(576):
            assert cute.crd2idx((t, d, 0), raw) == K._raw_offset(t, d), (t, d)
    for hp in (16, 32):
        ql = K.q8_layout(hp)
        assert cute.cosize(ql) == 2 * hp * 576
        for h in range(hp):
            for d in range(576):
                for t in range(2):
                    assert cute.crd2idx((h, d, t), ql) == t * hp * 576 + K._q8_offset(hp, h, d)
    # the joint operand (qk_joint, h_pad 16): row h = Q_hi of head h, row hp + h = its Q_lo
    for hp in (16, 32):
        ql = K.q8_layout(hp, True)
        assert cute.cosize(ql) == 2 * hp * 576
        for h in range(hp):
            for d in range(576):
                for t in range(2):
                    assert cute.crd2idx((t * hp + h, d), ql) == \
                        K._q8_offset(hp, h, d, True) + t * K._q8_lo(hp, True)
    # 2. S^T operands as the wgmma reads them: A (the K tile), B (Q_hi, Q_lo; joint: both rows)
    n_s = 0
    for hp in (16, 32):
        _, (bj,) = _fp8_s_operand_starts(hp, True)
        for k in range(18):
            for kk in range(32):
                for n in range(2 * hp):
                    assert _wgmma_sw64_kmajor(bj[k], n, kk) == \
                        K._q8_offset(hp, n % hp, 32 * k + kk, True) + \
                        (n // hp) * K._q8_lo(hp, True), (hp, n, k, kk)
                    n_s += 1
    for hp in (16, 32):
        a_st, b_st = _fp8_s_operand_starts(hp)
        for k in range(18):
            for kk in range(32):
                if hp == 16:
                    for r in range(64):
                        assert _wgmma_sw64_kmajor(a_st[k], r, kk) == \
                            K._raw_offset(r, 32 * k + kk), (r, k, kk)
                        n_s += 1
                for t in range(2):
                    for n in range(hp):
                        assert _wgmma_sw64_kmajor(b_st[t][k], n, kk) == \
                            t * hp * 576 + K._q8_offset(hp, n, 32 * k + kk), (hp, t, n, k, kk)
                        n_s += 1
        # the Q stores: copy_q's 8-dim vectors (value v = dim + v) cover [hp, 576] once, and
        # _q8_offset keeps each vector's 8 bytes contiguous (one 8-byte st.shared)
        copy_q = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                BFloat16, num_bits_per_copy=128),
            cute.make_layout((128 // 8, 8), stride=(8, 1)), cute.make_layout((1, 8)))
        seen = set()
        for tid in range(128):
            tQc = copy_q.get_slice(tid).partition_S(cute.make_identity_tensor((hp, 576)))
            for m in range(cute.size(tQc.shape[1])):
                for c in range(cute.size(tQc.shape[2])):
                    h, d0 = tQc[0, m, c]
                    assert d0 % 8 == 0
                    for v in range(8):
                        assert tuple(tQc[v, m, c]) == (h, d0 + v)
                        assert K._q8_offset(hp, h, d0 + v) == K._q8_offset(hp, h, d0) + v
                        seen.add((h, d0 + v))
        assert len(seen) == hp * 576
    # 3. row_token is a bijection of each group of 4, row_token_inv its inverse; P^T: the thread
    # whose rows are row_token_inv of ours holds, at element i, (row_token_inv(m), n) for our
    # element i = (m, n)
    assert sorted(K.row_token(m) for m in range(64)) == list(range(64))
    for m in range(64):
        assert K.row_token_inv(K.row_token(m)) == m and K.row_token(K.row_token_inv(m)) == m
    e4m3 = cutlass.Float8E4M3FN
    km = cute.nvgpu.OperandMajorMode.K
    qk = sm90_utils.make_trivial_tiled_mma(e4m3, e4m3, km, km, Float32, (1, 1, 1), (64, 32))
    cS = cute.make_identity_tensor((64, 32))
    for tid in range(128):
        lane, w = tid % 32, tid // 32
        mine = qk.get_slice(tid).partition_C(cS)
        perm = qk.get_slice(32 * w + 4 * K.row_token_inv(lane // 4) + lane % 4).partition_C(cS)
        for i in range(cute.size(mine)):
            m, n = mine[i]
            assert tuple(perm[i]) == (K.row_token_inv(m), n), (tid, i)
    for t in range(48):
        assert K._raw_offset(t + 8, 5) == K._raw_offset(t, 5) + 512
        assert K._raw_offset(t + 16, 70) == K._raw_offset(t, 70) + 1024
    # 4. O^T's A = V^T from registers (unchanged)
    d_perm = cute.make_layout(sw.DIM_PERM, stride=sw.DIM_PERM_STRIDE)
    mma = sm90_utils.make_trivial_tiled_mma(Float16, Float16, km, km, Float32, (1, 1, 1), (64, 32),
                                            warpgroup.OperandSource.RMEM)
    tv = mma.tv_layout_A                      # (thread, value) -> m + 64 k of a 64 x 16 block
    thr = mma.get_slice(37)
    cV = thr.partition_A(cute.make_identity_tensor((512, 64)))
    for v in range(8):
        i = cute.crd2idx((37, v), tv)
        assert cV[v + 8 * 3 + 8 * 8 * 2] == (i % 64 + 64 * 3, i // 64 + 16 * 2)
    n_v = 0
    for tid in range(128):
        lane, w = tid % 32, tid // 32
        v_tok, v_off = K._fp8_v_addresses(lane, w)
        for v in range(8):
            i = cute.crd2idx((tid, v), tv)
            m, kk = i % 64, i // 64
            word, half = v // 2, v % 2
            # O^T: M block mb, k-step ks, word r8 + 2 jh = cvt(r8) of prmt(token jp = 0, jp = 1)
            # bytes 2 mb, 2 mb + 1 (word mb // 2 of the 16-byte loads); value half = jp
            r8, jh = word % 2, word // 2
            jp = half
            for mb in range(8):
                for ks in range(4):
                    tok = v_tok[jp] + 8 * jh + 16 * ks
                    got = v_off[jp] + 512 * jh + 1024 * ks + 4 * (mb // 2) + 2 * (mb % 2) + r8
                    assert tok == K.row_token(16 * ks + kk)
                    want = K._raw_offset(K.row_token(16 * ks + kk), cute.crd2idx(m + 64 * mb, d_perm))
                    assert got == want, (tid, v, mb, ks)
                    n_v += 1
    # bank conflicts: each quarter warp's 16-byte V loads hit 8 distinct 16-byte bank groups
    for w in range(4):
        for qw in range(4):
            lanes = range(8 * qw, 8 * qw + 8)
            for jp in range(2):
                assert len({(K._fp8_v_addresses(l, w)[1][jp] % 128) // 16 for l in lanes}) == 8
    out["checked"] = (n_s, n_v)


def test_fp8_fragment_layouts():
    """The fp8 kernel's operands: S^T's smem operands (raw TMA tile, Q_hi / Q_lo) through a model
    of the wgmma descriptor addressing with the descriptor fields and start offsets the compiled
    PTX has (test_fp8_kernel_compiles), the Q stores, P^T's token order, and the V^T A
    fragments against the library's wgmma A layout (not a hand-written table)."""
    out = {}

    @cutlass.cute.jit
    def run():
        _fp8_fragment_check(out)

    run()
    # S^T: A rows, B rows of both terms at h_pad 16 and 32, and the joint B rows at both
    assert out["checked"] == (18 * 32 * (64 + 2 * (2 * 16 + 2 * 32)), 128 * 8 * 32)


def _s_error(K, q, S):
    """|S - K q^T| relative to mean |K q^T| (float64 reference): (max, rms)."""
    ref = K.double() @ q.double().T
    e = (S - ref).abs() / ref.abs().mean()
    return e.max().item(), e.pow(2).mean().sqrt().item()


def _fp22_chain(K, Qt, groups, mbits=13):
    """Model of the fp8 wgmma accumulator (reported to keep ~13 mantissa bits: per k32
    instruction the accumulator and the 32 products are aligned to the largest exponent and
    truncated to mbits below it): K [T, D] (fp32 values), Qt [D, N], `groups` = lists of k32
    step indices accumulated into one zeroed accumulator each; the groups' sums added in fp32."""
    import torch
    tot = torch.zeros(K.shape[0], Qt.shape[1], dtype=torch.float32)
    for g in groups:
        acc = torch.zeros(K.shape[0], Qt.shape[1], dtype=torch.float64)
        for k0 in g:
            p = K[:, 32 * k0:32 * k0 + 32, None].double() * Qt[None, 32 * k0:32 * k0 + 32].double()
            terms = torch.cat([acc[:, None], p], 1)
            e = torch.floor(torch.log2(terms.abs().amax(1, keepdim=True).clamp_min(1e-300)))
            ulp = torch.exp2(e - mbits)
            acc = (torch.trunc(terms / ulp) * ulp).sum(1).float().double()
        tot = tot + acc.float()
    return tot.double()


def test_fp8_q_split_numerics():
    """S^T = K (Q_hi + Q_lo)^T / s (split_query_e4m3, the kernel's split) against float64:
    never worse than rounding an fp32 q to bf16 (what the bf16 kernel's Q amounts to), and
    for the bf16 q the kernel actually reads, far below it. Also with a model of the fp8 wgmma's
    reduced-precision accumulator (_fp22_chain): the kernel's 9 chunks (qk_promote) keep the
    error at the split's level; one chain of 36 would not."""
    torch = pytest.importorskip("torch")
    from pdserve.kernels.mla_decode.query import split_query_e4m3
    g = torch.Generator().manual_seed(0)
    Kc = (torch.randn(64, 576, generator=g) * 2).to(torch.float8_e4m3fn).float()
    results = {}
    for H in (12, 32):
        for sig in (1.0, 30.0):
            q = torch.randn(H, 576, generator=g) * sig
            hi, lo, s = split_query_e4m3(q)
            assert float(s) == 2.0 ** round(float(torch.log2(s)))
            assert (q.float() * s).abs().max() <= 448
            S_split = Kc.double() @ (hi.double() + lo.double()).T / float(s)
            S_bf16 = Kc.double() @ q.bfloat16().double().T
            e_split, e_bf16 = _s_error(Kc, q, S_split), _s_error(Kc, q, S_bf16)
            assert e_split[0] <= e_bf16[0] and e_split[1] <= e_bf16[1], (H, sig, e_split, e_bf16)
            # the kernel's input is bf16: the split alone costs far less than that rounding did
            qb = q.bfloat16().float()
            hib, lob, sb = split_query_e4m3(qb)
            e_in = _s_error(Kc, qb, Kc.double() @ (hib.double() + lob.double()).T / float(sb))
            assert e_in[0] <= e_bf16[0] / 100, (H, sig, e_in, e_bf16)
            # fp8 accumulator model: the kernel's chunks (k-steps 2c, 2c+1 of Q_hi then Q_lo)
            Kk = torch.cat([Kc, Kc], 1)
            Qk = torch.cat([hi.float().T, lo.float().T], 0)      # k-step 18 t + k
            chunks = [[2 * c, 2 * c + 1, 18 + 2 * c, 19 + 2 * c] for c in range(9)]
            e_chunk = _s_error(Kc, q, _fp22_chain(Kk, Qk, chunks) / float(s))
            e_chain = _s_error(Kc, q, _fp22_chain(Kk, Qk, [sum(chunks, [])]) / float(s))
            assert e_chunk[0] <= e_bf16[0] and e_chunk[1] <= e_bf16[1], (H, sig, e_chunk, e_bf16)
            # ... and against the exact bf16 q the bf16 kernel multiplies with
            Qkb = torch.cat([hib.float().T, lob.float().T], 0)
            e_chunk_in = _s_error(Kc, qb, _fp22_chain(Kk, Qkb, chunks) / float(sb))
            assert e_chunk_in[0] <= e_bf16[0] and e_chunk_in[1] <= e_bf16[1]
            results[(H, sig)] = dict(split=e_split, bf16=e_bf16, bf16_input=e_in,
                                     fp22_chunks=e_chunk, fp22_one_chain=e_chain,
                                     fp22_chunks_bf16_input=e_chunk_in)
    # all-zero Q (and rows >= H) must give zeros, not NaN
    hi, lo, s = split_query_e4m3(torch.zeros(4, 576))
    assert torch.isfinite(s) and (hi.float() == 0).all() and (lo.float() == 0).all()
    for key, r in results.items():
        print(key, {k: tuple(f"{x:.2e}" for x in v) for k, v in r.items()})



def test_combine_kernel_compiles():
    """Each combine shape the plan picks compiles once per partials' type (the variant is the
    cache key); the plan's partials are bf16 for the fp8 cache and fp32 for bf16; the shape
    rule follows the splits, then the attention grid's share of the device's SMs, then the
    partials' type."""
    for shape in ((1, 1), (1, 4), (8, 32), (4, 8), (2, 8)):
        fp32 = mcomb.compile_combine(Combine(*shape, False))
        assert fp32 is mcomb.compile_combine(Combine(*shape, False))
        bf = mcomb.compile_combine(Combine(*shape, True))
        assert bf[0].partial_dtype is cutlass.BFloat16 and fp32[0].partial_dtype is cutlass.Float32
        assert bf is mcomb.compile_combine(Combine(*shape, True)) and bf is not fp32
    assert [plan_call(1, 32, 8192, fp8, 64, H200).attention.bf16_partials
            for fp8 in (False, True)] == [False, True]
    few, narrow, wide, beside, beside_bf16 = (1, 1), (1, 4), (8, 32), (4, 8), (2, 8)
    # one group while every split is among a thread's first UNROLL partial loads
    assert [mp.choose_combine(n, 132, False, 132) for n in (2, 8, 9, 31, 32, 300)] == [
        few, few, narrow, narrow, wide, wide]
    # many splits: the attention grid's CTAs decide (>= 3/4 of the SMs: full), then the
    # partials' type; few splits ignore both
    assert [mp.choose_combine(64, ctas, bf16, 132) for ctas, bf16 in
            ((128, False), (99, True), (98, False), (64, False), (64, True))] == [
        wide, wide, beside, beside, beside_bf16]
    assert mp.choose_combine(64, 99, True, 264) == beside_bf16         # the device's SMs
    assert mp.choose_combine(8, 8, True, 132) == few
    assert mp.choose_combine(31, 31, False, 132) == narrow
    # what the plan asks for a call: B=1 L=8K bf16 H=12, 64 splits of 2 tiles beside 64 CTAs
    p = plan_call(1, 12, 8192, False, 64, H200)
    assert (p.num_splits, p.attention.d_split, p.combine) == (64, 1, Combine(4, 8, False))


def test_combine_shape_is_a_choice():
    """An explicit combine shape reaches the plan for every split count; a shape the kernel
    cannot take is refused by name, and one split has no combine."""
    for n in (2, 16, 300):
        assert plan_call(1, 32, 1 << 20, True, 64, H200, num_splits=n,
                         combine=(2, 4)).combine == Combine(2, 4, True)
    for bad in ((3, 4), (1, 16), (0, 1)):
        with pytest.raises(ValueError, match="combine shape"):
            mcomb.CombineKernel(*bad)
    with pytest.raises(ValueError, match="one split"):
        plan_call(1, 32, 64, True, 64, H200, num_splits=1, combine=(2, 4))


def test_pair_choices():
    """Two fp8 consumers split Q's load, scaling and store (q_half) and the merge and writes of
    the heads (xmerge) between them by default; either off is its own compiled kernel; one
    consumer does neither and refuses them, bf16 has no q_half."""
    v = variant(True, 32)
    assert v.q_half and v.xmerge
    seen = {compiled(v)}
    for attr in ("q_half", "xmerge"):
        v0 = variant(True, 32, **{attr: False})
        assert not getattr(v0, attr) and compiled(v0) not in seen
        seen.add(compiled(v0))
    assert compiled(variant(True, 32)) is compiled(v)
    k1 = kernel(True, 32, consumers=1)
    assert not k1.q_half and not k1.xmerge and k1.merge_bytes == 0
    for attr in ("q_half", "xmerge", "lazy_max"):
        with pytest.raises(ValueError, match=attr):
            kernel(True, 32, consumers=1, **{attr: True})
    kb = kernel(False, 32, consumers=2)
    assert not kb.q_half and kb.xmerge
    with pytest.raises(ValueError, match="q_half"):
        kernel(False, 32, consumers=2, q_half=True)


@pytest.mark.parametrize("B,L,H", [(1, 1, 12), (1, 8192, 32), (64, 131072, 32), (8, 1000, 12)])
def test_split_choice(B, L, H):
    s = mp.choose_num_splits(B, L, 132)
    assert 1 <= s <= max(1, -(-L // mp.TILE_N))
    assert B * s <= 132 or s == 1                # one wave of CTAs
    half = mp.choose_num_splits(B, L, 66)                # a device with half the SMs
    assert half <= s and (B * half <= 66 or half == 1)
    if B == 1 and L >= 8192:
        assert s >= 64                           # small batch: spread a long context wide


def test_device_properties_drive_the_plan():
    """The plan is made for the device it is given: the split count fills its SMs, and the
    ring takes the stages that fit its shared memory (a smaller budget, fewer stages, the same
    choices otherwise)."""
    small = Device(sm_count=66, smem_per_block=200 * 1024)
    a, b = plan_call(1, 32, 32768, False, 64, H200), plan_call(1, 32, 32768, False, 64, small)
    assert (a.num_splits, b.num_splits) == (132, 66)
    assert b.attention.smem_limit == 200 * 1024
    k_a = MlaDecodeKernel(variant(True, 32))
    k_b = MlaDecodeKernel(plan_call(8, 32, 32768, True, 64, small).attention)
    assert (k_a.stages, k_b.stages) == (4, 2)
    with pytest.raises(ValueError, match="smem_limit"):
        MlaDecodeKernel(replaced(variant(False, 32), smem_limit=150 * 1024))


def test_consumers_one_for_short_fp8_splits():
    """fp8 splits of at most 2 tiles get one consumer warpgroup, longer ones (or an unknown
    length) two; bf16 one."""
    want = {(1, 1024): 1, (1, 8192): 1, (8, 1024): 1, (1, 32768): 2, (8, 8192): 2,
            (64, 1024): 2, (64, 131072): 2}
    for (B, L), n in want.items():
        for H in (12, 32):
            p = plan_call(B, H, L, True, 64, H200)
            assert p.attention.consumers == n, (B, L, H, p.num_splits)
            assert plan_call(B, H, L, False, 64, H200).attention.consumers == 1
    assert mp.choose_consumers(True, None) == 2                          # length unknown
    assert mp.choose_consumers(True, mp.split_tiles(8192 + 1, 64)) == 2   # 3 tiles, longest
    assert plan_call(1, 32, None, True, 64, H200, num_splits=64).attention.consumers == 2
    assert compiled(variant(True, 16, consumers=1)) is not compiled(variant(True, 16))


def test_pool_only_for_long_splits():
    """The tile pool (fp8) is planned where the longest request's splits have at least 32
    tiles and there is more than one split: at the planned shapes B=8 L=32K / 128K and
    B=64 L >= 8K, not B=1 or B=8 L=8K (where it measured slower), not with one split or an
    unknown length, never when deterministic (and asking for both is refused)."""
    want = {(1, 8192): 0, (1, 32768): 0, (1, 131072): 0, (8, 8192): 0, (8, 32768): 4,
            (8, 131072): 4, (64, 1024): 0, (64, 8192): 4, (64, 131072): 4}
    for (B, L), pool in want.items():
        assert plan_call(B, 32, L, True, 64, H200).attention.pool_div == pool, (B, L)
        assert plan_call(B, 32, L, True, 64, H200, deterministic=True).attention.pool_div == 0
        assert plan_call(B, 32, L, False, 64, H200).attention.pool_div == 0
    assert mp.choose_pool_div(True, 64 * 64, 2, False) == 4
    assert mp.choose_pool_div(True, 62 * 64, 2, False) == 0
    assert mp.choose_pool_div(True, 4096 * 64, 1, False) == 0       # one split: no pool
    assert mp.choose_pool_div(True, None, 2, False) == 0
    with pytest.raises(ValueError, match="not deterministic"):
        plan_call(8, 32, 32768, True, 64, H200, deterministic=True, pool_div=4)
    for bad in (3, 16):
        with pytest.raises(ValueError, match=f"pool_div={bad}"):
            kernel(True, 32, pool_div=bad)


def test_plan_head_groups():
    """Short H = 32 problems spread their heads over 2 CTAs per split; the splits then fill the
    SMs for B * 2 requests."""
    def got(B, H, L, fp8, **kw):
        p = plan_call(B, H, L, fp8, 64, H200, **kw)
        return p.num_splits, p.head_groups
    assert got(1, 32, 8192, True) == (64, 2)
    assert got(8, 32, 8192, True) == (8, 2)
    assert got(8, 32, 32768, True) == (16, 1)
    assert got(64, 32, 1024, False) == (1, 2)
    assert got(1, 32, 8192, False) == (64, 1)
    assert got(1, 12, 1024, False)[1] == 1
    assert got(1, 32, 8192, False, head_groups=1)[1] == 1
    with pytest.raises(ValueError, match="divide H=31"):
        got(1, 31, 8192, False, head_groups=2)
    one = compiled(variant(False, 16))
    two = compiled(variant(False, 16, head_groups=2))
    assert one is not two and compiled(variant(False, 16, head_groups=2)) is two


@pytest.mark.parametrize("kv_fp8", [False, True])
def test_early_kv_moves_the_pdl_wait_behind_the_cache_loads(tmp_path, kv_fp8):
    """early_kv (the plan's default): no wait at entry, one in the empty-split branch and one
    after the KV loads are issued (before Q is read) -- two in the PTX; the fp8 tile pool's
    producer waits once more before its first draw (the counters as the previous call left
    them). early_kv=False: one wait at entry, ahead of every global access."""
    assert variant(kv_fp8, 16).early_kv
    waits, pool = {}, 0
    for early in (False, True):
        v = variant(kv_fp8, 16, early_kv=early)
        pool = int(v.pool_div > 0)
        ptx = dump(v, tmp_path, f"e{int(early)}").artifacts.PTX
        waits[early] = ptx.count("griddepcontrol.wait")
        assert ptx.count("griddepcontrol.launch_dependents") == 1
    assert pool == int(kv_fp8)
    assert waits == {False: 1, True: 2 + pool}, waits


def test_check_inputs_names_the_problem():
    """mla_decode_cutedsl's argument checks run before any GPU work (CPU tensors here): a good
    call passes, each malformed argument raises a ValueError that names it."""
    import torch
    B, H, P = 2, 12, 64

    def args(**kw):
        a = dict(q=torch.zeros(B, H, 576, dtype=torch.bfloat16),
                 kv_cache=torch.zeros(5, P, 576, dtype=torch.bfloat16),
                 block_table=torch.zeros(B, 3, dtype=torch.int32),
                 seq_lens=torch.ones(B, dtype=torch.int32), out=None, lse=None, num_splits=None)
        a.update(kw)
        return a

    ml.check_inputs(**args())
    ml.check_inputs(**args(kv_cache=torch.zeros(5, 128, 576).to(torch.float8_e4m3fn),
                           out=torch.zeros(B, H, 512, dtype=torch.bfloat16),
                           lse=torch.zeros(B, H), num_splits=7))
    bad = {
        "q must be \\[B, H, 576\\]": args(q=torch.zeros(B, H, 512, dtype=torch.bfloat16)),
        "q must be bfloat16": args(q=torch.zeros(B, H, 576)),
        "1 <= H <= 32": args(q=torch.zeros(B, 33, 576, dtype=torch.bfloat16)),
        "kv_cache must be bfloat16 or float8": args(kv_cache=torch.zeros(5, P, 576)),
        "page_tokens must be a multiple of 64": args(
            kv_cache=torch.zeros(5, 32, 576, dtype=torch.bfloat16)),
        "block_table must be \\[B=2": args(block_table=torch.zeros(3, 3, dtype=torch.int32)),
        "block_table must be int32": args(block_table=torch.zeros(B, 3, dtype=torch.int64)),
        "seq_lens must be int32": args(seq_lens=torch.ones(B, dtype=torch.int64)),
        "seq_lens must be \\[B=2\\]": args(seq_lens=torch.ones(B + 1, dtype=torch.int32)),
        "out must be bfloat16": args(out=torch.zeros(B, H, 512)),
        "lse must be float32": args(lse=torch.zeros(B, H + 1)),
        "q must be contiguous": args(
            q=torch.zeros(H, B, 576, dtype=torch.bfloat16).transpose(0, 1)),
        "seq_lens must start 16-byte aligned": args(
            seq_lens=torch.ones(B + 1, dtype=torch.int32)[1:]),
        "num_splits must be 1..1024": args(num_splits=0),
    }
    for msg, a in bad.items():
        with pytest.raises(ValueError, match=msg):
            ml.check_inputs(**a)


def test_unknown_choice_is_refused():
    """A misspelt choice is a TypeError, never silently ignored (it would run another
    variant than asked)."""
    with pytest.raises(TypeError, match="consumer"):
        plan_call(1, 32, 8192, True, 64, H200, consumer=2)


def test_fp8_qk_joint(tmp_path):
    """The joint S^T is the default at h_pad 16 for the two-term query only; qk_joint=False
    restores the two-term form there (36 wgmma of N = 16, no spill); the kernel refuses it at
    h_pad 32 (its chunk accumulators would spill) and with the single query (no Q_lo)."""
    assert variant(True, 16, fp8_query="split").qk_joint
    assert not variant(True, 16).qk_joint                       # single query
    assert not variant(True, 32, fp8_query="split").qk_joint
    assert not variant(False, 16).qk_joint
    fn = dump(variant(True, 16, fp8_query="split", qk_joint=False), tmp_path)
    qk_op, n_qk = _fp8_qk_wgmma(16, False)
    assert fn.artifacts.PTX.count(qk_op) == n_qk
    assert cubin_resources(fn.artifacts.CUBIN)["stack"] == 0
    for kw in (dict(h_pad=32, fp8_query="split"), dict(h_pad=16)):
        with pytest.raises(ValueError, match="qk_joint"):
            kernel(True, qk_joint=True, **kw)


def test_tile_pool_compiles(tmp_path):
    """pool_div 4: the producer draws pool tiles with a relaxed atomic add (two call sites: the
    first draw and the loop's), counts itself done with one acq_rel add, and ends each
    consumer's loop with a transaction completed without data (one per consumer); without the
    pool (deterministic, or pool_div=0: the same variant) none of it; no spill at fp8."""
    pooled = variant(True, 32)
    det = plan_call(8, 32, 32768, True, 64, H200, deterministic=True).attention
    assert pooled.pool_div == 4 and det.pool_div == 0
    assert variant(True, 32, pool_div=0) == det
    assert compiled(variant(True, 32, pool_div=0)) is compiled(det) is not compiled(pooled)
    k = MlaDecodeKernel(pooled)
    ptx = dump(pooled, tmp_path, "pool").artifacts.PTX
    assert re.findall(r"atom\.[\w.]+", ptx) == ["atom.global.add.u32"] * 2 + [
        "atom.global.acq_rel.add.u32"]
    assert ptx.count("mbarrier.complete_tx.shared::cta.b64") == 2
    assert re.search(rf"mbarrier\.complete_tx\.shared::cta\.b64 \[%r\d+\], {k.tma_bytes};", ptx)
    assert cubin_resources(dump(pooled, tmp_path, "pool2").artifacts.CUBIN)["stack"] == 0
    det_ptx = dump(det, tmp_path, "det").artifacts.PTX
    assert "atom.global" not in det_ptx and "mbarrier.complete_tx" not in det_ptx
