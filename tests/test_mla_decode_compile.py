"""CuTe DSL MLA decode kernels compile to sm_90a cubins on a CPU-only machine (CI).

`CUTE_DSL_ARCH=sm_90a` makes cute.compile target Hopper without a GPU. Each variant compiles
once per session (the module caches compiled objects); the whole file takes ~25 s on 2 cores.
All three attention cores are compiled: "mma" (mma.sync), "wgmma" (warpgroup MMA with a TMA
producer warp) and "swapab" (warpgroup MMA with the heads as N; its fp8 path builds the A operands in registers); for the wgmma
cores the PTX and cubin are also checked (sm_90a instructions, wgmma shapes and counts, registers
at launch that fit the block, no spill stack), and so is the mma core's fp8 path, whose MMA
operands come straight from the raw fp8 tile (PTX instruction counts, no spill stack, registers
and shared memory for its CTAs per SM).
"""
import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest

cutlass = pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl (test extra) not installed")

from pdserve.kernels.kda_decode.cutedsl import cubin_resources  # noqa: E402
from pdserve.kernels.mla_decode import cutedsl as mc  # noqa: E402

VARIANTS = [(False, 16, 64), (False, 32, 64), (True, 16, 64), (True, 32, 64), (False, 32, 128)]


@pytest.mark.parametrize("kv_fp8,h_pad,page_tokens", VARIANTS)
def test_main_kernel_compiles(kv_fp8, h_pad, page_tokens):
    fn = mc.compile_main(kv_fp8, h_pad, page_tokens, core="mma")
    assert fn is not None
    assert mc.compile_main(kv_fp8, h_pad, page_tokens, core="mma") is fn   # cached
    k = mc.kernel_config(kv_fp8, h_pad, page_tokens, core="mma")
    assert k.stages >= 2 and k.num_threads == 32 * 4 * (h_pad // 16)
    smem = k.h_pad * 576 * 2 + k.stages * 64 * (576 if kv_fp8 else 576 * 2)
    assert smem <= k.smem_bytes <= mc.SMEM_LIMIT


# fp8 direct path (mma core): (h_pad, stages, smem bytes of Q + raw ring + P + stats, CTAs/SM)
FP8_DIRECT = {16: (2, 94720, 2), 32: (4, 189440, 1)}


@pytest.mark.parametrize("h_pad,page_tokens", [(16, 64), (32, 64), (16, 256), (32, 128)])
def test_fp8_direct_core(h_pad, page_tokens, tmp_path):
    """The fp8 cache feeds the MMAs from its raw tile: no widened 16-bit tile is stored to
    shared memory, every B operand comes from 16-byte (K) / 8-byte (V) shared loads, prmt and
    cvt.rn.f16x2.e4m3x2 (exact), and the fp16 MMAs run with no spill stack."""
    k = mc.kernel_config(True, h_pad, page_tokens, core="mma")
    stages, smem, ctas = FP8_DIRECT[h_pad]
    assert (k.stages, k.smem_bytes, k.ctas_per_sm) == (stages, smem, ctas)
    assert k.smem_bytes <= (mc.SMEM_2CTA if ctas == 2 else mc.SMEM_LIMIT)
    fn = mc.compile_main(True, h_pad, page_tokens, core="mma", dump_dir=str(tmp_path))
    ptx = fn.artifacts.PTX
    # per tile: S 36 k-steps x 2 N repeats, P V 4 k-steps x 16 repeats
    assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32") == 72 + 64
    assert ptx.count("cvt.rn.f16x2.e4m3x2") == 144 + 128
    assert ptx.count("prmt.b32") == 64
    assert ptx.count("ld.shared.v2.b32") == 32               # V: 4 tokens x 2 x 4 k-steps
    assert ptx.count("ld.shared.v4.b32") >= 18               # K: 9 chunks x 2 (+ row stats)
    assert ptx.count("ldmatrix.sync.aligned.m8n8.x4.shared.b16") == 36 + 4   # Q and P only
    for st in ("st.shared.b16", "st.shared.u16", "st.shared.v2.b16", "st.shared.v4.b16",
               "st.shared.v2.u16", "st.shared.v4.u16", "ld.local", "st.local"):
        assert st not in ptx, st
    res = cubin_resources(fn.artifacts.CUBIN)
    assert res["stack"] == 0, "register spills"
    assert res["regs"] * k.num_threads * k.ctas_per_sm <= 65536, res


@pytest.mark.parametrize("kv_fp8,page_tokens", [(False, 64), (True, 64), (False, 128), (True, 256)])
def test_wgmma_core_compiles(kv_fp8, page_tokens, tmp_path):
    fn = mc.compile_main(kv_fp8, 32, page_tokens, core="wgmma", dump_dir=str(tmp_path))
    ptx, cubin = fn.artifacts.PTX, fn.artifacts.CUBIN
    assert ".target sm_90a" in ptx
    # S: 36 wgmma m64n64k16 (K = 576); PV: 4 wgmma m64n256k16 with a register A, transposed B
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16") == 36
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16") == 4
    assert ptx.count("cp.async.bulk.tensor.2d") == 9          # one TMA box per 64 columns
    assert ptx.count("setmaxnreg") == 2
    res = cubin_resources(cubin)
    assert res["stack"] == 0, "register spills"
    assert res["regs"] <= 65536 // 384, res                 # 384 threads must fit at launch
    k = mc.kernel_config(kv_fp8, 32, page_tokens, core="wgmma")
    assert k.num_threads == 384 and k.stages >= 2 and k.smem_bytes <= mc.SMEM_LIMIT
    assert mc.compile_main(kv_fp8, 12, page_tokens, core="wgmma") is \
        mc.compile_main(kv_fp8, 32, page_tokens, core="wgmma")  # one variant for every H


@pytest.mark.parametrize("h_pad,page_tokens", [(16, 64), (32, 64), (16, 128), (32, 128),
                                               (16, 256), (32, 256)])
def test_swapab_core_compiles(h_pad, page_tokens, tmp_path):
    fn = mc.compile_main(False, h_pad, page_tokens, core="swapab", dump_dir=str(tmp_path))
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
    res = cubin_resources(cubin)
    assert res["stack"] == 0, "register spills"
    assert res["regs"] <= 65536 // 256, res                 # 256 threads must fit at launch
    k = mc.kernel_config(False, h_pad, page_tokens, core="swapab")
    assert k.num_threads == 256 and k.h_pad == h_pad and k.stages >= 2
    assert k.smem_bytes <= mc.SMEM_LIMIT
    # h_pad is part of the variant (cached per (h_pad, page size))
    assert mc.compile_main(False, h_pad, page_tokens, core="swapab") is \
        mc.compile_main(False, h_pad, page_tokens, core="swapab")
    assert mc.compile_main(False, h_pad, page_tokens, core="swapab") is not \
        mc.compile_main(False, 48 - h_pad, page_tokens, core="swapab")


def test_swapab_core_refuses_bad_h_pad():
    with pytest.raises(ValueError, match="h_pad"):
        mc.kernel_config(False, 64, 64, core="swapab")
    with pytest.raises(ValueError, match="h_pad"):
        mc.kernel_config(True, 64, 64, core="swapab")
    assert "swapab" in mc.CORES


# swapab fp8: (h_pad) -> (stages, smem bytes as kernel_config reports them)
SWAPAB_FP8 = {16: (5, 209664), 32: (5, 230912)}


@pytest.mark.parametrize("h_pad,page_tokens", [(16, 64), (32, 64), (16, 256), (32, 128)])
def test_swapab_fp8_core_compiles(h_pad, page_tokens, tmp_path):
    """swapab with the fp8 cache: raw fp8 TMA tiles, both wgmma A operands (K for S^T, V^T for
    O^T) widened in registers from the raw bytes (fp16 wgmma, A from registers), no spill."""
    k = mc.kernel_config(True, h_pad, page_tokens, core="swapab")
    assert (k.stages, k.smem_bytes) == SWAPAB_FP8[h_pad]
    assert k.smem_bytes <= mc.SMEM_LIMIT and k.tma_bytes == 64 * 576
    fn = mc.compile_main(True, h_pad, page_tokens, core="swapab", dump_dir=str(tmp_path))
    ptx, cubin = fn.artifacts.PTX, fn.artifacts.CUBIN
    assert ".target sm_90a" in ptx
    shape = f"m64n{h_pad}k16"
    assert ptx.count(f"wgmma.mma_async.sync.aligned.{shape}.f32.f16.f16") == 36 + 8 * 4
    assert ptx.count("wgmma.mma_async.sync.aligned.") == 36 + 8 * 4
    assert ptx.count("cp.async.bulk.tensor.2d") == 9          # one TMA box per 64 columns
    assert ptx.count("setmaxnreg") == 2
    # per tile and thread: K 9 chunks x 2 rows, V 4 k-steps x 4 tokens (16-byte loads);
    # 144 + 128 exact e4m3x2 -> f16x2 conversions, 64 prmt pairing two tokens' bytes
    assert ptx.count("ld.shared.v4.b32") == 18 + 16
    assert ptx.count("cvt.rn.f16x2.e4m3x2") == 144 + 128
    assert ptx.count("prmt.b32") == 64
    for st in ("ld.local", "st.local"):
        assert st not in ptx, st
    res = cubin_resources(cubin)
    assert res["stack"] == 0, "register spills"
    assert res["regs"] <= 65536 // 256, res
    print(f"swapab fp8 h_pad={h_pad} page={page_tokens}: {res}, smem {k.smem_bytes} B, "
          f"{k.stages} stages")
    # fp8 and bf16 are distinct cached variants
    assert mc.compile_main(True, h_pad, page_tokens, core="swapab") is not \
        mc.compile_main(False, h_pad, page_tokens, core="swapab")


def _swapab_fp8_fragment_check(out):
    """Runs inside a cute.jit trace (static layouts evaluate to ints): every A-fragment value the
    fp8 swapab kernel builds, followed from its shared address (the kernel's own address
    functions) through prmt / cvt, is the raw-tile byte the wgmma A layout asks for."""
    from cutlass import Float16, Float32
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.cute.nvgpu import warpgroup
    from pdserve.kernels.mla_decode import swapab as sw
    K = sw.MlaDecodeSwapAbKernel
    cute = cutlass.cute
    # 1. _raw_offset == the layout TMA writes (every byte of a stage)
    raw = K.raw_layout(1)
    for t in range(64):
        for d in range(576):
            assert cute.crd2idx((t, d, 0), raw) == K._raw_offset(t, d), (t, d)
    # row_token: a bijection of each group of 4 (and + 8 / + 16 keep the swizzle XOR)
    assert sorted(K.row_token(m) for m in range(64)) == list(range(64))
    for t in range(48):
        assert K._raw_offset(t + 8, 5) == K._raw_offset(t, 5) + 512
        assert K._raw_offset(t + 16, 70) == K._raw_offset(t, 70) + 1024
    q_perm = cute.make_layout(sw.Q_PERM, stride=sw.Q_PERM_STRIDE)
    d_perm = cute.make_layout(sw.DIM_PERM, stride=sw.DIM_PERM_STRIDE)
    km = cute.nvgpu.OperandMajorMode.K
    mma = sm90_utils.make_trivial_tiled_mma(Float16, Float16, km, km, Float32, (1, 1, 1), (64, 32),
                                            warpgroup.OperandSource.RMEM)
    tv = mma.tv_layout_A                      # (thread, value) -> m + 64 k of a 64 x 16 block
    # the block tiling of partition_A: k-steps along K (16), M blocks along M (64)
    thr = mma.get_slice(37)
    cK = thr.partition_A(cute.make_identity_tensor((64, 576)))
    cV = thr.partition_A(cute.make_identity_tensor((512, 64)))
    for v in range(8):
        i = cute.crd2idx((37, v), tv)
        assert cK[v + 8 * 5] == (i % 64, i // 64 + 16 * 5)
        assert cV[v + 8 * 3 + 8 * 8 * 2] == (i % 64 + 64 * 3, i // 64 + 16 * 2)
    n_k = n_v = 0
    for tid in range(128):
        lane, w = tid % 32, tid // 32
        k_off = K._fp8_k_addresses(lane, w)
        v_tok, v_off = K._fp8_v_addresses(lane, w)
        for v in range(8):
            i = cute.crd2idx((tid, v), tv)
            m, kk = i % 64, i // 64
            word, half = v // 2, v % 2
            # S^T: k-step s of chunk c, word r + 2 hi = cvt(hi) of word s of row r's 16-byte load
            r, hi = word % 2, word // 2
            for c in range(9):
                for s in range(4):
                    got = k_off + 64 * 64 * c + 512 * r + 4 * s + 2 * hi + half
                    want = K._raw_offset(K.row_token(m), cute.crd2idx(64 * c + 16 * s + kk, q_perm))
                    assert got == want, (tid, v, c, s)
                    n_k += 1
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
    # bank conflicts: each quarter warp's 16-byte loads hit 8 distinct 16-byte bank groups
    for w in range(4):
        for qw in range(4):
            lanes = range(8 * qw, 8 * qw + 8)
            assert len({(K._fp8_k_addresses(l, w) % 128) // 16 for l in lanes}) == 8
            for jp in range(2):
                assert len({(K._fp8_v_addresses(l, w)[1][jp] % 128) // 16 for l in lanes}) == 8
    out["checked"] = (n_k, n_v)


def test_swapab_fp8_fragment_layouts():
    """The fp8 swapab A fragments, from the kernel's address functions and the wgmma A layout of
    the library (not a hand-written table): K for S^T (with Q's dim permutation) and V^T for O^T
    (with the token / latent-dim permutations the kernel applies to S^T rows and O^T rows)."""
    out = {}

    @cutlass.cute.jit
    def run():
        _swapab_fp8_fragment_check(out)

    run()
    assert out["checked"] == (128 * 8 * 36, 128 * 8 * 32)


def test_combine_kernel_compiles():
    for shape in (mc.COMBINE_NARROW, mc.COMBINE_WIDE):
        assert mc.compile_combine(shape) is mc.compile_combine(shape)


@pytest.mark.parametrize("B,L,H", [(1, 1, 12), (1, 8192, 32), (64, 131072, 32), (8, 1000, 12)])
def test_split_choice(B, L, H):
    s = mc.choose_num_splits(B, L, H)
    assert 1 <= s <= max(1, -(-L // mc.TILE_N))
    assert B * s <= 132 or s == 1                # one wave of CTAs
    assert mc.choose_num_splits(B, L, H, ctas_per_sm=2) <= max(2 * s, 1)
    if B == 1 and L >= 8192:
        assert s >= 64                           # small batch: spread a long context wide


def test_choose_core_follows_the_h200_measurements():
    # bf16: swapab everywhere (cutedsl.choose_core)
    assert mc.choose_core(32, 8192) == "swapab"
    assert mc.choose_core(12, 1024, batch=64) == "swapab"
    assert mc.choose_core(12, None) == "swapab"        # unknown length (captured, num_splits only)
    # fp8: mma (2 CTAs/SM) at H <= 16 and swapab at H > 16 for large B x L, wgmma for small
    assert mc.choose_core(12, 32768, batch=64, kv_fp8=True) == "mma"
    assert mc.choose_core(12, 8192, kv_fp8=True) == "wgmma"
    assert mc.choose_core(32, 8192, batch=8, kv_fp8=True) == "wgmma"
    assert mc.choose_core(32, 32768, batch=8, kv_fp8=True) == "swapab"
    assert mc.choose_core(32, None, kv_fp8=True) == "wgmma"


def test_plan_call_fills_two_ctas_per_sm_for_the_fp8_mma_variant():
    assert mc.plan_call(64, 12, 32768, True, "auto", False) == ("mma", 4)
    assert mc.plan_call(64, 12, 32768, False, "auto", False) == ("swapab", 2)
    assert mc.plan_call(64, 32, 32768, True, "mma", False) == ("mma", 2)    # h_pad 32: 1 CTA/SM
    assert mc.plan_call(1, 12, 8192, True, "wgmma", False, num_splits=7) == ("wgmma", 7)


@pytest.mark.parametrize("core,kv_fp8", [("mma", False), ("mma", True), ("wgmma", False),
                                         ("wgmma", True), ("swapab", False),
                                         ("swapab", True)])
def test_early_kv_moves_the_pdl_wait_behind_the_cache_loads(tmp_path, core, kv_fp8):
    # default: one griddepcontrol.wait at the kernel's entry, ahead of every global access;
    # early_kv: none at entry, one in the empty-split branch and one after the KV loads are
    # issued (before Q is read) -- two in the PTX
    waits = {}
    for early in (False, True):
        dump = tmp_path / f"{core}-{kv_fp8}-{early}"
        dump.mkdir()
        mc.compile_main(kv_fp8, 16, 64, core=core, early_kv=early, dump_dir=str(dump))
        ptx = "".join(p.read_text() for p in dump.glob("*.ptx"))
        waits[early] = ptx.count("griddepcontrol.wait")
        assert ptx.count("griddepcontrol.launch_dependents") == 1
    assert waits == {False: 1, True: 2}, waits
