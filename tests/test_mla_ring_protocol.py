"""The MLA decode attention kernel's TMA ring with one or two consumer warpgroups, as a model checked over every
order of events (CPU, no CuTe DSL needed for the model itself).

The kernel (kernels/mla_decode/attention.py): tile i of a split goes to stage i % S, and its
full barrier completes one phase when the tile's TMA lands; consumer c takes tiles c, c + C, ...
and waits with mbarrier try_wait.parity((i // S) % 2), which passes once the barrier's current
phase parity differs from that value -- so it also passes, at once, while the barrier is still in
the phase *before* the awaited one (PTX: the parity names the current or the immediately
preceding phase). The producer issues the tiles in order and refills stage s with tile i + S only
after tile i's release.

The model explores every interleaving of TMA landings (in any order) and consumer waits, and
reports whether some consumer can pass a wait before its tile landed ("stale"). An odd ring with
two consumers can (the other consumer's tile i is still in flight when consumer 1 reaches tile
i + S); the kernel therefore keeps its ring even with two consumers, which this test checks for
every compiled variant's configuration."""
from __future__ import annotations

import functools

import pytest


def stale_wait_possible(stages: int, consumers: int, tiles: int | None = None) -> bool:
    """True if some order of events lets a consumer pass its full-barrier wait before its tile
    has landed (the model in the module docstring)."""
    n = tiles if tiles is not None else 3 * stages + consumers + 1

    @functools.lru_cache(maxsize=None)
    def search(landed: frozenset, released: frozenset, nxt: tuple) -> bool:
        # the producer issues in tile order, each tile once its stage's previous tile is released
        issued = []
        for i in range(n):
            if i >= stages and (i - stages) not in released:
                break
            issued.append(i)
        for c, j in enumerate(nxt):
            if j >= n:
                continue
            s = j % stages
            # phases completed on stage s's full barrier = its tiles landed so far
            phase = sum(1 for i in landed if i % stages == s)
            if phase % 2 != (j // stages) % 2:            # try_wait.parity passes
                if j not in landed:
                    return True
                step = list(nxt)
                step[c] = j + consumers
                if search(landed, released | {j}, tuple(step)):
                    return True
        for i in issued:
            if i not in landed and search(landed | {i}, released, nxt):
                return True
        return False

    return search(frozenset(), frozenset(), tuple(range(consumers)))


def test_model_finds_the_odd_ring_race():
    # the configuration the fp8 h_pad 16 kernel had with two consumers before the fix
    assert stale_wait_possible(5, 2)
    assert stale_wait_possible(3, 2)


@pytest.mark.parametrize("stages", [2, 3, 4, 5, 6])
def test_model_safe_rings(stages):
    assert not stale_wait_possible(stages, 1)
    if stages % 2 == 0:
        assert not stale_wait_possible(stages, 2)


def test_every_kernel_variant_uses_a_safe_ring():
    pytest.importorskip("cutlass")
    from pdserve.kernels.mla_decode.attention import MlaDecodeKernel
    from pdserve.kernels.mla_decode.plan import Device, plan_call
    h200 = Device(sm_count=132, smem_per_block=232448)
    seen = set()
    for kv_fp8 in (False, True):
        for h_pad in (16, 32):
            for consumers in (1, 2):
                for page in (64, 128, 256):
                    plan = plan_call(8, h_pad, 32768, kv_fp8, page, h200, consumers=consumers)
                    k = MlaDecodeKernel(plan.attention)
                    seen.add((k.stages, k.consumers))
                    assert not stale_wait_possible(k.stages, k.consumers), (
                        kv_fp8, h_pad, consumers, page, k.stages)
    assert (4, 2) in seen and (5, 1) in seen, seen
