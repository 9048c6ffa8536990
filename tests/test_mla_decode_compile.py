"""CuTe DSL MLA decode kernels compile to sm_90a cubins on a CPU-only machine (CI).

`CUTE_DSL_ARCH=sm_90a` makes cute.compile target Hopper without a GPU. Each variant compiles
once per session (the module caches compiled objects); the whole file takes ~25 s on 2 cores.
All three attention cores are compiled: "mma" (mma.sync), "wgmma" (warpgroup MMA with a TMA
producer warp) and "swapab" (warpgroup MMA with the heads as N, bf16 cache only); for the wgmma
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

VARIANTS = [(False, 16, 64, None), (False, 32, 64, None), (True, 16, 64, None),
            (True, 32, 64, None), (False, 32, 128, None), (True, 32, 64, True)]


@pytest.mark.parametrize("kv_fp8,h_pad,page_tokens,fp8_f16", VARIANTS)
def test_main_kernel_compiles(kv_fp8, h_pad, page_tokens, fp8_f16):
    fn = mc.compile_main(kv_fp8, h_pad, page_tokens, fp8_f16, core="mma")
    assert fn is not None
    assert mc.compile_main(kv_fp8, h_pad, page_tokens, fp8_f16, core="mma") is fn   # cached
    k = mc.kernel_config(kv_fp8, h_pad, page_tokens, fp8_f16, core="mma")
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


def test_swapab_core_refuses_fp8():
    with pytest.raises(ValueError, match="bf16 KV cache only"):
        mc.kernel_config(True, 32, 64, core="swapab")
    with pytest.raises(ValueError, match="bf16 KV cache only"):
        mc.compile_main(True, 32, 64, core="swapab")
    with pytest.raises(ValueError, match="h_pad"):
        mc.kernel_config(False, 64, 64, core="swapab")
    assert "swapab" in mc.CORES


def test_swapab_launcher_refuses_fp8_cache():
    torch = pytest.importorskip("torch")
    q = torch.zeros(1, 12, 576, dtype=torch.bfloat16)
    cache = torch.zeros(2, 64, 576, dtype=torch.float8_e4m3fn)
    bt = torch.zeros(1, 1, dtype=torch.int32)
    seq = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="'swapab' supports a bf16 KV cache only"):
        mc.mla_decode_cutedsl(q, cache, bt, seq, 0.1, 1.0, core="swapab")


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
    # fp8: mma (2 CTAs/SM at H <= 16) for large B x L, wgmma for small
    assert mc.choose_core(12, 32768, batch=64, kv_fp8=True) == "mma"
    assert mc.choose_core(12, 8192, kv_fp8=True) == "wgmma"
    assert mc.choose_core(32, 32768, batch=8, kv_fp8=True) == "wgmma"
    assert mc.choose_core(32, 32768, batch=64, kv_fp8=True) == "mma"
    assert mc.choose_core(32, None, kv_fp8=True) == "wgmma"


def test_plan_call_fills_two_ctas_per_sm_for_the_fp8_mma_variant():
    assert mc.plan_call(64, 12, 32768, True, "auto", False) == ("mma", 4)
    assert mc.plan_call(64, 12, 32768, False, "auto", False) == ("swapab", 2)
    assert mc.plan_call(64, 32, 32768, True, "mma", False) == ("mma", 2)    # h_pad 32: 1 CTA/SM
    assert mc.plan_call(1, 12, 8192, True, "wgmma", False, num_splits=7) == ("wgmma", 7)


@pytest.mark.parametrize("core,kv_fp8", [("mma", False), ("mma", True), ("wgmma", False),
                                         ("wgmma", True), ("swapab", False)])
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
