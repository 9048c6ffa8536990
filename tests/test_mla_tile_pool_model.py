"""The MLA decode kernel's tile pool (pool_div = N, kernels/mla_decode/attention.py
`_produce`) as a model run over random event orders (CPU, no CuTe DSL needed).

With more than one split, each split of a request keeps the first tps - tail of its tps tiles
(tail = tps // N, N = 2, 4 or 8) and the tails of the request's active splits form a pool that the CTAs draw
from, one index at a time, through a per-request counter, after their own tiles. A CTA that
draws past the pool counts itself done in a second counter; the last active CTA to do so resets
both. The model checks, for many request lengths and split counts and random interleavings of
the CTAs' atomics, across calls that reuse the counters: every tile of the request is taken by
exactly one CTA, each CTA's first tile is its own (so consumer 0 always has one), and the
counters are back at zero after every call."""
from __future__ import annotations

import random

import pytest

TILE_N = 64


def plan(n_tiles: int, num_splits: int, pool_div: int = 4):
    """(tps, tail, active, pool_len) as _produce computes them (pool_div 0: no pool)."""
    tps = -(-n_tiles // num_splits)
    tail = tps // pool_div if pool_div and num_splits > 1 else 0
    active = -(-n_tiles // tps)
    pool_len = 0
    if tail > 0:
        last_tail = (active - 1) * tps + tps - tail
        pool_len = (active - 1) * tail + max(min(n_tiles - last_tail, tail), 0)
    return tps, tail, active, pool_len


def pool_tile(k: int, tps: int, tail: int) -> int:
    return (k // tail) * tps + (tps - tail) + k % tail


def run_call(n_tiles: int, num_splits: int, pool_div: int, counters: list[int],
             rng: random.Random):
    """One call's CTAs in a random order of atomics; returns each CTA's tiles in ring order."""
    tps, tail, active, pool_len = plan(n_tiles, num_splits, pool_div)
    taken = {}
    for s in range(num_splits):
        t_begin, t_end = s * tps, min(s * tps + tps, n_tiles)
        if t_begin >= t_end:
            continue                    # an empty split writes its LSE and draws nothing
        taken[s] = list(range(t_begin, min(t_begin + tps - tail, t_end)))
    drawing = [s for s in taken if pool_len > 0]
    while drawing:
        s = rng.choice(drawing)         # whichever CTA's producer runs its next draw first
        k = counters[0]
        counters[0] += 1
        if k < pool_len:
            taken[s].append(pool_tile(k, tps, tail))
            continue
        drawing.remove(s)
        done = counters[1]
        counters[1] += 1
        if done == active - 1:
            counters[0] = counters[1] = 0
    return taken


CASES = [(n, s) for n in (1, 2, 3, 4, 5, 7, 8, 9, 31, 32, 33, 63, 100, 128, 129, 511, 512, 513,
                          1000, 2048, 2049)
         for s in (1, 2, 3, 16, 33, 64, 132)]


@pytest.mark.parametrize("pool_div", [2, 4, 8])
@pytest.mark.parametrize("n_tiles,num_splits", CASES)
def test_every_tile_once_and_counters_reset(n_tiles, num_splits, pool_div):
    rng = random.Random(n_tiles * 1009 + num_splits * 7 + pool_div)
    counters = [0, 0]
    for _ in range(4):                  # calls reusing the counters
        taken = run_call(n_tiles, num_splits, pool_div, counters, rng)
        tiles = sorted(t for ts in taken.values() for t in ts)
        assert tiles == list(range(n_tiles))
        assert counters == [0, 0]
        tps = -(-n_tiles // num_splits)
        for s, ts in taken.items():
            assert ts and ts[0] == s * tps  # the CTA's first tile is its own: consumer 0 has one


def test_pool_shapes():
    """The pool is the tails of the active splits: B=8 L=32K at 16 splits (32 tiles a split)
    pools 8 of each split's tiles; a short last split adds only its tiles; no pool without
    splits or below 4 tiles a split."""
    assert plan(512, 16) == (32, 8, 16, 128)
    assert plan(513, 16) == (33, 8, 16, 120)        # last split: tiles 495..512, all static
    assert plan(128, 2) == (64, 16, 2, 32)
    assert plan(512, 1)[1] == 0 and plan(24, 8)[1] == 0
    assert plan(512, 16, pool_div=0)[3] == 0
    assert plan(512, 16, pool_div=2) == (32, 16, 16, 256)   # half of every split pooled
    assert plan(128, 2, pool_div=8) == (64, 8, 2, 16)
