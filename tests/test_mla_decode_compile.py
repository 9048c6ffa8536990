"""CuTe DSL MLA decode kernels compile to sm_90a cubins on a CPU-only machine (CI).

`CUTE_DSL_ARCH=sm_90a` makes cute.compile target Hopper without a GPU. Each variant compiles
once per session (the module caches compiled objects); the whole file takes ~15 s on 2 cores.
"""
import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import pytest

cutlass = pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl (test extra) not installed")

from pdserve.kernels.mla_decode import cutedsl as mc  # noqa: E402

VARIANTS = [(False, 16, 64, None), (False, 32, 64, None), (True, 16, 64, None),
            (True, 32, 64, None), (False, 32, 128, None), (True, 32, 64, True)]


@pytest.mark.parametrize("kv_fp8,h_pad,page_tokens,fp8_f16", VARIANTS)
def test_main_kernel_compiles(kv_fp8, h_pad, page_tokens, fp8_f16):
    fn = mc.compile_main(kv_fp8, h_pad, page_tokens, fp8_f16)
    assert fn is not None
    assert mc.compile_main(kv_fp8, h_pad, page_tokens, fp8_f16) is fn   # cached in the session
    k = mc.kernel_config(kv_fp8, h_pad, page_tokens, fp8_f16)
    assert k.stages >= 2 and k.num_threads == 32 * 4 * (h_pad // 16)
    smem = k.h_pad * 576 * 2 + k.stages * 64 * (k.raw_row if kv_fp8 else 576 * 2)
    assert smem <= mc.SMEM_LIMIT


def test_combine_kernel_compiles():
    assert mc.compile_combine() is mc.compile_combine()


@pytest.mark.parametrize("B,L,H", [(1, 1, 12), (1, 8192, 32), (64, 131072, 32), (8, 1000, 12)])
def test_split_choice(B, L, H):
    s = mc.choose_num_splits(B, L, H)
    assert 1 <= s <= max(1, -(-L // mc.TILE_N))
    assert B * s <= 132 or s == 1                # one wave of CTAs
    if B == 1 and L >= 8192:
        assert s >= 64                           # small batch: spread a long context wide
