"""The fused decode step's CuTe DSL kernels (add_rmsnorm, moe_route, moe_experts, latent_store) compile to
sm_90a cubins on the CPU (CUTE_DSL_ARCH=sm_90a), at the Kimi-Linear shapes and the tiny ones
the tests use, with no register spills."""
import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")   # before cutlass is imported

import pytest

from pdserve.kernels.kda_decode.cutedsl import cubin_resources
from pdserve.kernels.latent_store import cutedsl as store
from pdserve.kernels.moe_experts import cutedsl as experts
from pdserve.kernels.moe_route import cutedsl as route
from pdserve.kernels.rmsnorm import cutedsl as norm
from test_kda_decode_compile import cubin_sm


def _check(fn):
    assert cubin_sm(fn.artifacts.CUBIN) == 90
    assert cubin_resources(fn.artifacts.CUBIN)["stack"] == 0, "register spills"


@pytest.mark.parametrize("dim,delta,slots,write", [(2304, "none", 0, False),
                                                   (2304, "rows", 0, True),
                                                   (2304, "pairs", 9, True),
                                                   (512, "none", 0, False),
                                                   (7168, "pairs", 17, True)])
def test_add_rmsnorm_compiles(dim, delta, slots, write, tmp_path):
    fn = norm.compile_variant(dim, delta, slots, write, dump_dir=str(tmp_path))
    _check(fn)
    ptx = fn.artifacts.PTX
    assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")   # PDL: wait first


@pytest.mark.parametrize("experts_,top_k,shared,bias", [(256, 8, 1, True), (32, 4, 1, False),
                                                        (512, 16, 1, True)])
def test_moe_route_compiles(experts_, top_k, shared, bias, tmp_path):
    _check(route.compile_variant(experts_, top_k, shared, True, 2.446, bias,
                                 dump_dir=str(tmp_path)))


@pytest.mark.parametrize("stage", ["gate_up", "down"])
@pytest.mark.parametrize("hidden,inter,groups,bn", [(2304, 1024, 257, 8), (2304, 1024, 257, 64),
                                                    (256, 128, 33, 16), (3584, 3072, 897, 32)])
def test_moe_experts_compiles(stage, hidden, inter, groups, bn, tmp_path):
    fn = experts.compile_variant(stage, hidden, inter, groups, bn, shared=True,
                                 dump_dir=str(tmp_path))
    _check(fn)
    ptx = fn.artifacts.PTX
    assert f"wgmma.mma_async.sync.aligned.m64n{bn}k16.f32.bf16.bf16" in ptx
    # PDL: weights to L2 before the wait (gate_up: the shared expert; down: first tiles)
    assert "griddepcontrol.launch_dependents" in ptx
    assert ptx.index("cp.async.bulk.prefetch.tensor") < ptx.index("griddepcontrol.wait")


def test_moe_experts_slots_and_tiles():
    assert [experts.token_tile(b) for b in (1, 8, 9, 33, 64)] == [8, 8, 16, 64, 64]
    assert experts.run_slots(9, 16, 132, 2) == 9          # B = 1: one CTA row per run
    assert experts.run_slots(257, 16, 132, 2) == 17       # many runs: ~2 CTAs per SM
    assert experts.run_slots(257, 18, 132, 2) == 15


def test_latent_store_compiles(tmp_path):
    _check(store.compile_variant(512, 64, dump_dir=str(tmp_path)))


def test_bad_shapes_are_refused_with_their_names():
    with pytest.raises(ValueError, match="experts"):
        route.MoeRouteSm90(100, 8, 1, True, 1.0, True)
    with pytest.raises(ValueError, match="dim"):
        norm.AddRmsNormSm90(100, "none", 0, False)
    with pytest.raises(ValueError, match="hidden"):
        experts.MoeExpertsSm90("down", 100, 1024, 257, 8)
    with pytest.raises(ValueError, match="bn"):
        experts.MoeExpertsSm90("down", 2304, 1024, 257, 12)
    with pytest.raises(ValueError, match="delta"):
        norm.AddRmsNormSm90(128, "sum", 0, False)
