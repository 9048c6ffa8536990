"""Decode context parallelism (docs/design.md §3, §5 DCP): the LSE merge of partial attention is
exact; decode instances of TP 2 / DCP 2 and TP 4 / DCP 4 (Ray rank actors, gloo, state over
NIXL) give the DCP 1 tokens (the monolithic loop's), greedy and seeded, from prefill TP 1 and 2,
at interleave 1 and larger; `pdserve capacity --config` and `pdserve check` predict exactly what
a live instance admits at DCP 1, 2 and 4; settings DCP cannot run are refused naming the
numbers."""
import asyncio
import time
from concurrent.futures import ThreadPoolExecutor, wait

import pytest
import torch

from pdserve.decode.capacity import pool_capacity, probe_admission
from pdserve.model.config import preset, reduced_kimi_linear
from pdserve.model.mla import merge_partials
from pdserve.model.sampling import Request, SamplingParams
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


NUM_PAGES, NUM_SLOTS = 33, 10   # per decode rank: 32 usable pages, 9 slots


class DCPCluster:
    """Prefill instances of TP 1 and 2 and decode instances of the given topologies (pools of
    NUM_PAGES / NUM_SLOTS per rank) for one model, started side by side; the decode loops run in
    the decode instances' rank 0 (`serve_decode`, as `pdserve serve` starts them)."""

    def __init__(self, name, topologies):
        from pdserve.cluster.actors import SourceDigests, start_instance
        self.config = CONFIGS[name]()
        common = dict(config=self.config, layout=LAYOUT, seed=5)
        self.instances, self.prefill, self.slots, self.decode = [], {}, {}, {}
        start = lambda role, tag, tp, **kw: self._keep(start_instance(
            role, f"{role}-dcp-{name}-{tag}", 0, tp, {**common, **kw}, 0.25, 0, 120, threads=1))
        try:
            with ThreadPoolExecutor(4) as pool:
                decs = {t: pool.submit(start, "decode", f"tp{t.tp}-il{t.interleave}", t.tp,
                                       topology=t, num_pages=NUM_PAGES, num_slots=NUM_SLOTS,
                                       transfer=TransferConfig(verify=True))
                        for t in topologies}
                # pages laid out for the widest decode topology (the others read shorter runs)
                pres = {p: pool.submit(start, "prefill", f"p{p}", p, num_pages=48, num_slots=12,
                                       decode_topology=topologies[-1])
                        for p in (1, 2)}
                wait(list(decs.values()) + list(pres.values()))
            self.decode = {t: f.result() for t, f in decs.items()}
            self.prefill = {p: f.result() for p, f in pres.items()}
            for dec in self.decode.values():
                for pre in self.prefill.values():
                    pre.ranks.call("connect", dec.agents)
            digests = SourceDigests(list(self.prefill.values()))
            self.slots = {t: _served(dec, self.config, t, max_batch=NUM_SLOTS - 1,
                                     digests=digests) for t, dec in self.decode.items()}
        except BaseException:
            self.close()
            raise

    def _keep(self, inst):
        self.instances.append(inst)
        return inst

    def handles(self, p, tag, prompts, params):
        reqs = [Request(f"p{p}-{tag}-r{i}", pr, sp)
                for i, (pr, sp) in enumerate(zip(prompts, params))]
        results = self.prefill[p].ranks.call("prefill", reqs, self.prefill[p].agents)[0]
        assert all(r.error is None for r in results), results
        return [r.handle for r in results]

    def run(self, p, topo, prompts, params):
        """Decode `prompts` prefilled at TP p on the instance of `topo`: their tokens."""
        handles = self.handles(p, f"tp{topo.tp}-il{topo.interleave}", prompts, params)

        async def main():
            return await asyncio.gather(*[_collect(self.slots[topo], h) for h in handles])
        out = asyncio.run(main())
        self.settle(p, topo)
        return out

    def settle(self, p, topo, limit_s=20.0):
        """Wait until the decode instance's pools and the prefill's state are empty again."""
        dec, pre = self.decode[topo], self.prefill[p]
        deadline = time.monotonic() + limit_s
        while not all(st["running"] == 0 and st["pages_free"] == st["pages_total"]
                      for st in dec.ranks.call("stats")):
            assert time.monotonic() < deadline, "decode state not freed on every DCP rank"
            time.sleep(0.01)
        while any(st["held"] for st in pre.ranks.call("stats")):
            assert time.monotonic() < deadline, "source state not freed after the transfer"
            pre.ranks.call("poll")
            time.sleep(0.01)

    def close(self):
        for slot in self.slots.values():
            slot.close()
        for inst in self.instances:
            inst.kill()


def _served(dec, config, topology, max_batch=4, **engine):
    from pdserve.cluster.actors import serve_decode
    from pdserve.cluster.router import DecodeSlot
    engine = dict(layout=LAYOUT, eos={config.eos_token_id}, topology=topology, **engine)
    return DecodeSlot(dec, serve_decode(dec, engine, max_batch, 16))


DCP1, DCP2, DCP4 = Topology(1), Topology(2, 2, 1), Topology(4, 4, 16)


@pytest.fixture(scope="module")
def tiny_cluster(ray_session):
    cluster = DCPCluster("tiny", [DCP1, DCP2, DCP4])
    yield cluster
    cluster.close()


@pytest.mark.parametrize("p,topo", [(1, DCP2), (2, DCP2), (1, DCP4), (2, DCP4)],
                         ids=["1to2-il1", "2to2-il1", "1to4-il16", "2to4-il16"])
def test_tiny_dcp_tokens_equal_dcp1(tiny_cluster, p, topo):
    """TP 2 / DCP 2 at interleave 1 and TP 4 / DCP 4 at 16, from prefill TP 1 and 2: the
    150-token prompt has rows on every rank, the 1-token one on rank 0 only until it decodes."""
    want = monolithic(tiny_cluster.config, DCP_PROMPTS, DCP_PARAMS)
    assert tiny_cluster.run(p, topo, DCP_PROMPTS, DCP_PARAMS) == want


@pytest.mark.parametrize("p", [1, 2])
def test_kimi_linear_reduced_dcp2_tokens_equal_dcp1(ray_session, p):
    """TP 2 / DCP 2 at interleave 16, where the 38-token prompt already spans both ranks (the
    150-token one would only add prefill time at 32 heads)."""
    cluster = kimi_cluster()
    prompts = [[t % 512 for t in pr] for pr in PROMPTS]
    want = monolithic(cluster.config, prompts, PARAMS)
    assert cluster.run(p, Topology(2, 2, 16), prompts, PARAMS) == want


_KIMI: list = []


def kimi_cluster():
    """One reduced kimi-linear cluster for the module, started on first use."""
    if not _KIMI:
        _KIMI.append(DCPCluster("kimi-linear-reduced", [Topology(2, 2, 16)]))
    return _KIMI[0]


@pytest.fixture(scope="module", autouse=True)
def _close_kimi():
    yield
    while _KIMI:
        _KIMI.pop().close()


# -- capacity: `pdserve capacity --config` / `pdserve check` against what the instance admits --

PROMPT, OUTPUT = 30, 994        # 1,024 tokens reserved per request: 16 pages of 64 at DCP 1


def predicted(topo: Topology) -> int:
    return pool_capacity(NUM_PAGES, NUM_SLOTS, NUM_SLOTS - 1, topo, LAYOUT.page_tokens, PROMPT,
                         OUTPUT).admitted


@pytest.mark.parametrize("topo", [DCP1, DCP2, DCP4], ids=["dcp1", "dcp2", "dcp4-il16"])
def test_live_admission_equals_the_capacity_prediction(tiny_cluster, topo):
    """predicted + 1 requests of 30 + 994 tokens at once: exactly the predicted count is
    admitted (2 x DCP: the pages bind, 16 / DCP per request of 32 per rank) and the next is
    refused with PoolExhausted (the router's 429)."""
    want = predicted(topo)
    assert want == 2 * topo.dcp
    params = SamplingParams(max_tokens=OUTPUT, ignore_eos=True)
    handles = tiny_cluster.handles(1, f"cap{topo.dcp}",
                                   [[(7 * i + t) % 256 for t in range(PROMPT)]
                                    for i in range(want + 1)], [params] * (want + 1))
    admitted, refused = probe_admission(tiny_cluster.slots[topo], handles)
    assert admitted == want
    assert len(refused) == 1 and "no room" in refused[0], refused
    for h in handles:  # the refused request's source state (the router cancels it so too)
        tiny_cluster.prefill[1].ranks.call("cancel", h.request_id)
    tiny_cluster.settle(1, topo)


def test_check_and_capacity_print_the_same_admission_figure(tmp_path, capsys):
    from pdserve.cli import main
    cfg = tmp_path / "dcp.toml"
    cfg.write_text(f'mode = "disaggregated"\n[model]\nname = "tiny"\n[state]\n'
                   f'latent_dtype = "float32"\nconv_dtype = "float32"\n'
                   f'[prefill]\nnum_pages = 40\n[decode]\ntp = 4\ndcp = 4\ninterleave = 16\n'
                   f'num_pages = {NUM_PAGES}\nnum_slots = {NUM_SLOTS}\n')
    args = ["--config", str(cfg), "--context-tokens", str(PROMPT), "--output-tokens", str(OUTPUT)]
    assert main(["capacity", *args]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"admits {predicted(DCP4)} concurrent request(s) of 1,024 tokens"), line
    assert main(["check", *args]) == 0
    # p = 1 -> d = 4 stages conv state: the admission in flight holds a second slot (9 - 1 = 8)
    assert line in capsys.readouterr().out.splitlines()


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
