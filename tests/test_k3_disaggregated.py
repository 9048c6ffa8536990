"""A reduced K3 served disaggregated (reference prefill -> NIXL -> decode runtime) gives the
monolithic generate loop's tokens: in-process ranks at TP 1 -> 1, Ray rank actors with a gloo
TP group at 2 -> 1."""
import asyncio
import time

import pytest

from pdserve.model.config import reduced_kimi_k3
from pdserve.model.sampling import Request
from pdserve.transfer.dest import TransferConfig

from test_disaggregated import (LAYOUT, PARAMS, PROMPTS, Pair, _collect, decode_to_end,
                                monolithic, served)

CONFIG = reduced_kimi_k3(num_layers=5)
K3_PROMPTS = [[t % CONFIG.vocab_size for t in p] for p in PROMPTS]


@pytest.fixture(scope="module")
def want():
    return monolithic(CONFIG, K3_PROMPTS, PARAMS)


def test_k3_disaggregated_tokens_equal_monolithic(want):
    pair = Pair(CONFIG, "-k3")
    try:
        seqs = [pair.decode.admit(h) for h in pair.handles(K3_PROMPTS, PARAMS)]
        pair.drain()
        assert not pair.prefill.seqs, "source state not freed after the transfer"
        assert decode_to_end(pair.decode, seqs) == want
        assert pair.rank.pools.empty and pair.prefill.engine.pools.empty
    finally:
        pair.close()


def test_k3_tp2_prefill_to_tp1_decode_equals_monolithic(ray_session, want):
    from pdserve.cluster.actors import SourceDigests, start_instance
    common = dict(config=CONFIG, layout=LAYOUT, seed=5, num_pages=32, num_slots=8)
    start = lambda role, tp, **kw: start_instance(role, f"{role}-k3-2to1", 0, tp,  # noqa: E731
                                                  {**common, **kw}, 0.5, 0, 120, threads=1)
    pre = start("prefill", 2)
    dec = slot = None
    try:
        dec = start("decode", 1, transfer=TransferConfig(verify=True))
        pre.ranks.call("connect", dec.agents)
        slot = served(dec, CONFIG, digests=SourceDigests([pre]))
        reqs = [Request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(K3_PROMPTS, PARAMS))]
        results = pre.ranks.call("prefill", reqs, pre.agents)[0]
        assert all(r.error is None for r in results), results

        async def main():
            return await asyncio.gather(*[_collect(slot, r.handle) for r in results])
        assert asyncio.run(main()) == want
        deadline = time.monotonic() + 10
        while any(st["held"] for st in pre.ranks.call("stats")):
            assert time.monotonic() < deadline, "source state not freed after the transfer"
            pre.ranks.call("poll")
            time.sleep(0.01)
    finally:
        if slot is not None:
            slot.close()
        for inst in (pre, dec):
            if inst is not None:
                inst.kill()
