"""Every variant of the CuTe DSL KDA decode kernel compiles to an sm_90a cubin, on CPU.

Runs in CI without a GPU: CUTE_DSL_ARCH=sm_90a makes `cute.compile` target Hopper. These tests
are never skipped: CI installs nvidia-cutlass-dsl (the `test` extra), so a missing package fails.

The compiled variants are (cluster size C, conv layout, decay form, PDL on/off); H, B and the pool
sizes are run-time arguments, so every supported H is served by the same 32 cubins. Each variant
is compiled once per session (module cache) and then checked for every H the guard admits. The
cubins' spill stack is read too: the state must stay in registers.
"""
import os

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")   # before cutlass is imported

import struct

import pytest

from pdserve.kernels.kda_decode import SUPPORTED_HEADS
from pdserve.kernels.kda_decode import cutedsl

EM_CUDA = 190
EF_CUDA_SM_MASK = 0xFF   # low byte of e_flags holds the SM version in NVIDIA cubins (sm_90 -> 90)


@pytest.fixture(scope="session")
def dump_root(tmp_path_factory):
    return tmp_path_factory.mktemp("kda_decode_cubins")


_built: dict = {}


def build(cluster, layout, bounded, dump_root, pdl=False, early_rows=None):
    key = (cluster, layout, bounded, pdl, early_rows)
    if key not in _built:
        d = dump_root / (f"c{cluster}_{layout}_{'lb' if bounded else 'sp'}{'_pdl' if pdl else ''}"
                         f"{f'_e{early_rows}' if early_rows else ''}")
        d.mkdir()
        _built[key] = cutedsl.compile_variant(cluster, layout, bounded, pdl, dump_dir=str(d),
                                              early_rows=early_rows)
    return _built[key]


def cubin_sm(cubin: bytes) -> int:
    assert cubin[:4] == b"\x7fELF", "not an ELF cubin"
    assert cubin[4] == 2, "expected a 64-bit ELF"
    (machine,) = struct.unpack_from("<H", cubin, 18)
    assert machine == EM_CUDA, f"ELF machine {machine} is not CUDA"
    (flags,) = struct.unpack_from("<I", cubin, 48)
    return flags & EF_CUDA_SM_MASK


def test_arch_is_sm90a():
    assert os.environ["CUTE_DSL_ARCH"] == "sm_90a"


@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
@pytest.mark.parametrize("bounded", [True, False], ids=["bounded", "softplus"])
@pytest.mark.parametrize("layout", ["SD", "DS"])
@pytest.mark.parametrize("cluster", cutedsl.CLUSTER_SIZES)
def test_variant_compiles_to_sm90a_cubin(cluster, layout, bounded, pdl, dump_root):
    fn = build(cluster, layout, bounded, dump_root, pdl)
    art = fn.artifacts
    assert ".target sm_90a" in art.PTX
    assert cubin_sm(art.CUBIN) == 90
    ptx = art.PTX
    # 16-byte state traffic: 2 loads + 2 stores per state row a thread owns, plus the conv weights
    rows_per_thread = cutedsl.D // cluster // cutedsl.ROWS_PER_PASS
    assert ptx.count("ld.global.v4") >= 2 * rows_per_thread
    assert ptx.count("st.global.v4") == 2 * rows_per_thread
    assert cutedsl.cubin_resources(art.CUBIN)["stack"] == 0, "register spills"
    if cluster > 1:
        assert "barrier.cluster.arrive" in ptx and "st.shared::cluster" in ptx
    else:
        assert "barrier.cluster" not in ptx
    assert ("griddepcontrol.wait" in ptx) == pdl
    assert ("griddepcontrol.launch_dependents" in ptx) == pdl
    if pdl:
        # the working CTAs' wait (the last one; the first is the padding branch's): by default
        # every state row pass and the two conv weight rows are loaded before it
        pre, post = ptx.rsplit("griddepcontrol.wait", 1)
        assert pre.count("ld.global.v4") == 2 * rows_per_thread + 2
        assert post.count("ld.global.v4") == 0


@pytest.mark.parametrize("cluster", cutedsl.CLUSTER_SIZES)
def test_pdl_early_rows_split_the_state_loads_around_the_wait(cluster, dump_root):
    """early_rows = 3 (choose_early_rows for large grids): row passes [0, 3) and the conv
    weights before the wait; the other row passes after it, and also before it for the
    grid's first `first_wave` CTAs (a run-time branch on the linear CTA index); no spill."""
    fn = build(cluster, "SD", True, dump_root, True, 3)
    rows_per_thread = cutedsl.D // cluster // cutedsl.ROWS_PER_PASS
    early = min(3, rows_per_thread)
    late = rows_per_thread - early
    pre, post = fn.artifacts.PTX.rsplit("griddepcontrol.wait", 1)
    assert pre.count("ld.global.v4") == 2 * (early + late) + 2
    assert post.count("ld.global.v4") == 2 * late
    assert cutedsl.cubin_resources(fn.artifacts.CUBIN)["stack"] == 0, "register spills"


@pytest.mark.parametrize("bad", [-1, 9, 2.0, "2"])
def test_bad_early_rows_is_refused_with_its_name(bad):
    with pytest.raises(ValueError, match="early_rows"):
        cutedsl.KdaDecodeSm90(1, "SD", True, pdl=True, early_rows=bad)


@pytest.mark.parametrize("bad", [-1, 2 ** 31, 1.5, "8"])
def test_bad_first_wave_is_refused_with_its_name(bad):
    """Checked before anything touches a GPU (so this runs on the CPU)."""
    with pytest.raises(ValueError, match="first_wave"):
        cutedsl.launch(*([None] * 17), first_wave=bad)


def test_choose_early_rows_splits_only_grids_of_128_ctas_or_more():
    assert cutedsl.choose_early_rows(64, 12, 1) == 3
    assert cutedsl.choose_early_rows(4, 32, 1) == 3          # 128 CTAs
    assert cutedsl.choose_early_rows(8, 12, 1) is None       # 96 CTAs: every load early
    assert cutedsl.choose_early_rows(1, 12, 4) is None


@pytest.mark.parametrize("heads", SUPPORTED_HEADS)
@pytest.mark.parametrize("layout", ["SD", "DS"])
@pytest.mark.parametrize("bounded", [True, False], ids=["bounded", "softplus"])
def test_every_supported_head_count_has_a_compiled_variant(heads, layout, bounded, dump_root):
    """H is a run-time argument: for each supported H and batch the cluster the launcher picks
    is one of the compiled variants (compiled above, or compiled here if run alone)."""
    for pdl in (False, True):
        for batch in (1, 2, 4, 8, 16, 32, 64):
            c = cutedsl.choose_cluster(batch, heads, pdl)
            assert c in cutedsl.CLUSTER_SIZES
            # grid (C, H, B) and cluster (C, 1, 1) stay within the launch limits
            assert heads <= 65535 and batch <= 65535 and c <= 8
            early = cutedsl.choose_early_rows(batch, heads, c) if pdl else None
            fn = build(c, layout, bounded, dump_root, pdl, early)
            assert cubin_sm(fn.artifacts.CUBIN) == 90


def test_in_process_cache_reuses_compiled_objects():
    a = cutedsl.compile_variant(8, "SD", True)
    b = cutedsl.compile_variant(8, "SD", True)
    assert a is b
