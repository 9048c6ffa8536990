"""The decode projection kernel (op "decode_linear", CuTe DSL) compiles to sm_90a cubins on the
CPU (CUTE_DSL_ARCH=sm_90a) at the Kimi-Linear projection shapes for every token tile, with no
register spills, the swapped wgmma shape, the split-K arrival protocol and PDL in its PTX; its
guard and tuning defaults."""
import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")   # before cutlass is imported

import pytest
import torch

from pdserve.kernels import registry
from pdserve.kernels.decode_linear import (OP, LinearTuning, cutedsl_guard, decode_linear_problem,
                                           decode_linear_reference, resolved_splits, token_tile)
from pdserve.kernels.decode_linear import cutedsl as dl
from pdserve.kernels.kda_decode.cutedsl import cubin_resources
from test_kda_decode_compile import cubin_sm

H200_SMS = 132
# (N, K): KDA and MLA o_proj, the KDA in-projection (q, k, v, f_a, g_a, b), MLA's q + kv_a
SHAPES = {"o_proj": (2304, 4096), "kda_in": (12576, 2304), "mla_q_kv_a": (6720, 2304)}


def _compile(n, k, bm, bn, splits, stages=dl.DEFAULT_STAGES, pdl=True, tmp_path=None):
    fn = dl.compile_variant(n, k, bm, bn, splits, stages, pdl, dump_dir=str(tmp_path))
    assert cubin_sm(fn.artifacts.CUBIN) == 90
    assert cubin_resources(fn.artifacts.CUBIN)["stack"] == 0, "register spills"
    ptx = fn.artifacts.PTX
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert f"wgmma.mma_async.sync.aligned.m64n{bn}k16.f32.bf16.bf16" in ptx
    return ptx


@pytest.mark.parametrize("bn", [8, 16, 32, 64])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_default_variants_compile(shape, bn, tmp_path):
    n, k = SHAPES[shape]
    splits = dl.default_splits(n, k, dl.DEFAULT_BM, H200_SMS)
    ptx = _compile(n, k, dl.DEFAULT_BM, bn, splits, tmp_path=tmp_path)
    if splits > 1:
        # the arrival: release fence, then the acq_rel add on the m-tile's counter; the last
        # CTA copies the partials L2 -> shared (cp.async.cg) and resets the counter
        fence = ptx.index("fence.acq_rel.gpu")
        assert fence < ptx.index("atom.global.acq_rel.add.u32")
        assert "cp.async.cg.shared.global" in ptx
    else:
        assert "atom.global" not in ptx and "cp.async.cg" not in ptx
    # PDL: the first weight tiles are requested before waiting for the previous kernel
    assert ptx.index("cp.async.bulk.tensor") < ptx.index("griddepcontrol.wait")
    assert "griddepcontrol.launch_dependents" in ptx


@pytest.mark.parametrize("bm,bn,splits,stages", [(128, 64, 4, 4), (64, 8, 16, 2),
                                                 (128, 8, 8, 8), (128, 32, 2, 6),
                                                 (64, 64, 1, 8)])
def test_tuning_variants_compile(bm, bn, splits, stages, tmp_path):
    n, k = SHAPES["o_proj"]
    ptx = _compile(n, k, bm, bn, splits, stages, pdl=False, tmp_path=tmp_path)
    assert "griddepcontrol" not in ptx


def test_strided_x_variant_compiles(tmp_path):
    # the gates' block-diagonal GEMM reads x as a column slice of the in-projection's output
    fn = dl.compile_variant(8192, 256, 64, 8, 1, ldx=12576, dump_dir=str(tmp_path))
    assert cubin_sm(fn.artifacts.CUBIN) == 90
    assert cubin_resources(fn.artifacts.CUBIN)["stack"] == 0, "register spills"
    with pytest.raises(ValueError, match="ldx"):
        dl.DecodeLinearSm90(8192, 256, 64, 8, 1, ldx=12577)


def test_tuning_splits_fall_back_to_a_divisor_of_k():
    assert resolved_splits(4096, LinearTuning(splits=4)) == 4
    assert resolved_splits(256, LinearTuning(splits=8)) == 4     # K / 64 = 4
    assert resolved_splits(4096, LinearTuning()) is None
    x = torch.zeros(4, 512, dtype=torch.bfloat16)[:, :256]        # strided rows
    w = torch.zeros(64, 256, dtype=torch.bfloat16)
    p = decode_linear_problem(x, w, LinearTuning(splits=8))
    assert p["splits"] == 4 and p["contiguous"] and p["aligned"]


def test_defaults_fill_the_gpu():
    assert [token_tile(b) for b in (1, 8, 9, 17, 33, 64)] == [8, 8, 16, 32, 64, 64]
    # o_proj: 36 m-tiles x 4 splits = 144 CTAs, ~1 per SM; splits divide K / 64 = 64
    assert dl.default_splits(2304, 4096, 64, H200_SMS) == 4
    assert dl.default_splits(2304, 4096, 128, H200_SMS) == 8
    assert dl.default_splits(2304, 4096, 128, H200_SMS, ctas_per_sm=2) == 16
    # the in-projections: 197 (partial last) and 105 m-tiles fill the GPU unsplit
    assert dl.default_splits(12576, 2304, 64, H200_SMS) == 1
    assert dl.default_splits(6720, 2304, 64, H200_SMS) == 1
    for (n, k) in SHAPES.values():
        for bm in dl.BMS:
            assert (k // 64) % dl.default_splits(n, k, bm, H200_SMS) == 0


def test_bad_variants_are_refused_with_their_names():
    with pytest.raises(ValueError, match="bm"):
        dl.DecodeLinearSm90(2304, 4096, 96, 8, 16)
    with pytest.raises(ValueError, match="bn"):
        dl.DecodeLinearSm90(2304, 4096, 128, 12, 16)
    with pytest.raises(ValueError, match="k must be"):
        dl.DecodeLinearSm90(2304, 4096, 128, 8, 48)
    with pytest.raises(ValueError, match="stages"):
        dl.DecodeLinearSm90(2304, 4096, 128, 8, 16, stages=1)


def _problem(**over):
    p = {"device_type": "cuda", "capability": (9, 0), "batch": 8, "k": 4096, "n": 2304,
         "w_k": 4096, "splits": 16, "dtypes": (torch.bfloat16, torch.bfloat16),
         "contiguous": True, "aligned": True}
    return {**p, **over}


@pytest.mark.parametrize("over,why", [
    ({"capability": (8, 0)}, "sm_90"),
    ({"device_type": "cpu"}, "CUDA device"),
    ({"dtypes": (torch.float16, torch.bfloat16)}, "dtypes"),
    ({"batch": 65}, "batch 65"),
    ({"batch": 0}, "batch 0"),
    ({"w_k": 2304}, "columns"),
    ({"splits": 3}, "multiple of 64 \\* splits"),
    ({"contiguous": False}, "inner stride 1"),
    ({"aligned": False}, "16-byte"),
])
def test_guard_names_why_it_refuses(over, why):
    assert cutedsl_guard(_problem()) is None
    reason = cutedsl_guard(_problem(**over))
    assert reason is not None and __import__("re").search(why, reason), reason


def test_cpu_resolves_to_the_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 256, generator=g).to(torch.bfloat16)
    w = torch.randn(200, 256, generator=g).to(torch.bfloat16)
    res = registry.resolve(OP, "cutedsl", decode_linear_problem(x, w))
    assert res.backend == registry.REFERENCE and "CUDA device" in res.fallback_reason
    y = res.impl(x, w)
    want = (x.double() @ w.double().t())
    assert y.shape == (3, 200) and y.dtype == torch.bfloat16
    assert torch.allclose(y.double(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
    assert torch.equal(y, decode_linear_reference(x, w))
