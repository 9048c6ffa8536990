"""Decode context parallelism (docs/design.md §3, §5 DCP): the LSE merge of partial attention is
exact, and a decode instance of TP 2 / DCP 2 (Ray rank actors, gloo, state over NIXL) gives the
DCP 1 tokens (the monolithic loop's), greedy and seeded, from prefill TP 1 and 2, at interleave 1
and larger; settings DCP cannot run are refused naming the numbers."""
import asyncio
import time
from concurrent.futures import ThreadPoolExecutor, wait

import pytest
import torch

from pdserve.model.config import preset, reduced_kimi_linear
from pdserve.model.mla import merge_partials
from pdserve.model.sampling import Request
from pdserve.state.block_table import Topology
from pdserve.transfer.dest import TransferConfig

from test_disaggregated import LAYOUT, PARAMS, PROMPTS, _collect, monolithic

# lengths 21, 1, 38 and 150: not multiples of the page (64), the interleaves or the KDA chunk
DCP_PROMPTS = PROMPTS + [list(b"a longer prompt that crosses two pages of sixty-four tokens, "
                              b"so that every DCP rank holds rows of it at an interleave of 64 "
                              b"as well as at 1 and 16 ...")]
DCP_PARAMS = PARAMS + [PARAMS[1]]


def _attend(q, rows, scale):
    """Full softmax attention in float64: q [H, D], rows [L, D] -> (out [H, D], lse [H])."""
    scores = q @ rows.T * scale
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse[:, None]) @ rows, lse


@pytest.mark.parametrize("c,interleave", [(2, 1), (4, 3), (8, 16)])
def test_lse_merge_of_shards_equals_full_attention_in_float64(c, interleave):
    """Shards as DCP splits a sequence (token t on rank (t // interleave) % c), one of them
    empty at c = 8 (40 tokens, interleave 16), merge to the attention over every row."""
    g = torch.Generator().manual_seed(c)
    L, H, D = 40, 4, 24
    q = torch.randn(H, D, generator=g, dtype=torch.float64)
    rows = torch.randn(L, D, generator=g, dtype=torch.float64) * 3
    want, want_lse = _attend(q, rows, D ** -0.5)
    topo = Topology(tp=c, dcp=c, interleave=interleave)
    outs, lses = [], []
    for r in range(c):
        mine = rows[topo.tokens_on(r, L)]
        if len(mine):
            out, lse = _attend(q, mine, D ** -0.5)
        else:  # what a rank with no rows of the sequence returns
            out, lse = torch.full((H, D), float("nan"), dtype=torch.float64), \
                torch.full((H,), float("-inf"), dtype=torch.float64)
        outs.append(out)
        lses.append(lse)
    got = merge_partials(torch.stack(outs), torch.stack(lses))
    assert got.dtype == torch.float64
    assert torch.allclose(got, want, rtol=0, atol=1e-12), (got - want).abs().max()
    assert torch.isfinite(got).all()
    if c == 8:
        assert not topo.tokens_on(7, L), "the case is meant to hold an empty shard"
    # the merged LSE would be logsumexp of the partials': the weights are consistent
    assert torch.allclose(torch.logsumexp(torch.stack(lses), 0), want_lse, atol=1e-12)


def test_merge_order_is_fixed_by_rank_not_by_arrival():
    g = torch.Generator().manual_seed(3)
    out = torch.randn(4, 5, 2, 8, generator=g)
    lse = torch.randn(4, 5, 2, generator=g)
    a = merge_partials(out, lse)
    assert torch.equal(a, merge_partials(out.clone(), lse.clone()))
    # a permutation is the same attention (to rounding): the order is part of the bits
    perm = torch.tensor([2, 0, 3, 1])
    assert torch.allclose(merge_partials(out[perm], lse[perm]), a, atol=1e-6)


CONFIGS = {"tiny": lambda: preset("tiny"),
           "kimi-linear-reduced": lambda: reduced_kimi_linear(2, 4, 2, vocab_size=512)}


class DCPCluster:
    """Prefill instances of TP 1 and 2 and one decode instance of TP 2 / DCP 2 per interleave,
    for one model; the decode loops run in the decode instances' rank 0."""

    def __init__(self, name, interleaves):
        from pdserve.cluster.actors import SourceDigests, start_instance
        self.config = CONFIGS[name]()
        common = dict(config=self.config, layout=LAYOUT, seed=5, num_pages=48, num_slots=8)
        self.instances, self.prefill, self.slots = [], {}, {}
        start = lambda role, tag, tp, **kw: self._keep(start_instance(
            role, f"{role}-dcp-{name}-{tag}", 0, tp, {**common, **kw}, 0.25, 0, 120, threads=1))
        try:
            with ThreadPoolExecutor(4) as pool:  # the instances start side by side
                decs = {il: pool.submit(start, "decode", f"il{il}", 2, topology=Topology(2, 2, il),
                                        transfer=TransferConfig(verify=True))
                        for il in interleaves}
                # pages laid out for the last decode topology (the other reads shorter runs)
                pres = {p: pool.submit(start, "prefill", f"p{p}", p,
                                       decode_topology=Topology(2, 2, interleaves[-1]))
                        for p in (1, 2)}
                wait(list(decs.values()) + list(pres.values()))
            self.slots = {il: (f.result(), Topology(2, 2, il)) for il, f in decs.items()}
            self.prefill = {p: f.result() for p, f in pres.items()}
            for dec, topo in list(self.slots.values()):
                for pre in self.prefill.values():
                    pre.ranks.call("connect", dec.agents)
            digests = SourceDigests(list(self.prefill.values()))
            self.decode = {il: dec for il, (dec, _) in self.slots.items()}
            self.slots = {il: _served(dec, self.config, topo, digests=digests)
                          for il, (dec, topo) in self.slots.items()}
        except BaseException:
            self.close()
            raise

    def _keep(self, inst):
        self.instances.append(inst)
        return inst

    def run(self, p, interleave, prompts, params):
        pre, slot = self.prefill[p], self.slots[interleave]
        reqs = [Request(f"p{p}-il{interleave}-r{i}", pr, sp)
                for i, (pr, sp) in enumerate(zip(prompts, params))]
        results = pre.ranks.call("prefill", reqs, pre.agents)[0]
        assert all(r.error is None for r in results), results

        async def main():
            return await asyncio.gather(*[_collect(slot, r.handle) for r in results])
        out = asyncio.run(main())
        dec = self.decode[interleave]
        deadline = time.monotonic() + 20
        while not all(st["running"] == 0 and st["pages_free"] == st["pages_total"]
                      for st in dec.ranks.call("stats")):
            assert time.monotonic() < deadline, "decode state not freed on every DCP rank"
            time.sleep(0.01)
        while any(st["held"] for st in pre.ranks.call("stats")):
            assert time.monotonic() < deadline, "source state not freed after the transfer"
            pre.ranks.call("poll")
            time.sleep(0.01)
        return out

    def close(self):
        for slot in self.slots.values():
            if hasattr(slot, "close"):
                slot.close()
        for inst in self.instances:
            inst.kill()


def _served(dec, config, topology, max_batch=4, **engine):
    from pdserve.cluster.actors import serve_decode
    from pdserve.cluster.router import DecodeSlot
    engine = dict(layout=LAYOUT, eos={config.eos_token_id}, topology=topology, **engine)
    return DecodeSlot(dec, serve_decode(dec, engine, max_batch, 16))


@pytest.fixture(scope="module")
def tiny_cluster(ray_session):
    cluster = DCPCluster("tiny", [1, 64])
    yield cluster
    cluster.close()


@pytest.mark.parametrize("p,interleave", [(1, 1), (2, 1), (1, 64), (2, 64)])
def test_tiny_dcp2_tokens_equal_dcp1(tiny_cluster, p, interleave):
    want = monolithic(tiny_cluster.config, DCP_PROMPTS, DCP_PARAMS)
    assert tiny_cluster.run(p, interleave, DCP_PROMPTS, DCP_PARAMS) == want


@pytest.mark.parametrize("p", [1, 2])
def test_kimi_linear_reduced_dcp2_tokens_equal_dcp1(ray_session, p):
    """At interleave 16 the 38-token prompt already spans both ranks (the 150-token one
    would only add prefill time at 32 heads)."""
    cluster = kimi_cluster()
    prompts = [[t % 512 for t in pr] for pr in PROMPTS]
    want = monolithic(cluster.config, prompts, PARAMS)
    assert cluster.run(p, 16, prompts, PARAMS) == want


_KIMI: list = []


def kimi_cluster():
    """One reduced kimi-linear cluster (interleave 16) for the module, started on first use."""
    if not _KIMI:
        _KIMI.append(DCPCluster("kimi-linear-reduced", [16]))
    return _KIMI[0]


@pytest.fixture(scope="module", autouse=True)
def _close_kimi():
    yield
    while _KIMI:
        _KIMI.pop().close()


def test_impossible_dcp_settings_are_refused_naming_the_numbers():
    from pdserve.decode.instance import DecodeInstance, LocalRanks
    from pdserve.decode.rank import _dcp_group
    from pdserve.model.parallel import TPGroup
    with pytest.raises(ValueError, match="dcp must be 1 or tp=4, got 2"):
        Topology(4, 2)
    with pytest.raises(ValueError, match="dcp must be 1 or tp=2, got 3"):
        Topology(2, 3)
    with pytest.raises(ValueError, match="topology TP=2 but 1 ranks"):
        DecodeInstance("d", LocalRanks([object()]), LAYOUT, set(), Topology(2, 2))
    with pytest.raises(ValueError, match="DCP=2 needs state by transfer"):
        DecodeInstance("d", type("G", (), {"size": 2, "admission": None})(), LAYOUT, set(),
                       Topology(2, 2), local_prefill=True)
    with pytest.raises(ValueError, match="topology TP=2 on a rank of a TP group of 1"):
        _dcp_group(0, TPGroup(), Topology(2, 2), False, False)
    with pytest.raises(ValueError, match="DCP=2: CUDA graph capture runs DCP 1 only"):
        _dcp_group(0, TPGroup(0, 2), Topology(2, 2), False, True)
