"""DCP-aware latent page placement on the prefill side (`LatentPool.decode_topology`): each decode
DCP rank's source pages form one contiguous run, real NIXL reads land exactly the bytes they land
without the placement, a fragmented pool falls back to its lowest free ids, and the reference
prefill engine computes the same state in placed pages."""
import functools

import pytest
import torch

from pdserve.model.config import preset
from pdserve.model.sampling import Request, SamplingParams
from pdserve.prefill.engine import PrefillRank
from pdserve.state.block_table import Topology
from pdserve.state.layout import StateLayout
from pdserve.transfer.dest import TransferConfig
from pdserve.transfer.planner import DST, KIND, KINDS, LAYER, plan_transfer

from state_fixtures import source_side
from test_transfer_nixl import Cluster
from test_transfer_plan import KIMI, TINY

pytest.importorskip("xxhash")


def placed_source(hint: Topology | None, fragment: bool = False):
    """`source_side` with source pools that place pages for `hint`. `fragment`: every
    odd page id is the only free one, so no run of two pages is free."""
    def pages_of(latent, count):
        latent.decode_topology = hint
        held = latent.allocate(latent.capacity if fragment else 2)
        if fragment:
            latent.free([i for i in held if i % 2])
        return latent.allocate(count)
    return functools.partial(source_side, pages_of=pages_of)


def rank_pages(pages: list[int], topo: Topology, page_tokens: int) -> list[list[int]]:
    """Each DCP rank's source pages, in its token order."""
    out = [[] for _ in range(topo.dcp)]
    for i, page in enumerate(pages):
        out[topo.dcp_rank_of(i * page_tokens)].append(page)
    return out


def latent_runs(plan) -> dict[int, int]:
    """Latent reads (coalesced runs) per destination rank in MLA layer 0; every layer has the
    same."""
    t = plan.table
    rows = t[(t[:, KIND] == KINDS.index("mla_latent")) & (t[:, LAYER] == 0)]
    ranks, counts = torch.unique(torch.from_numpy(rows[:, DST]), return_counts=True)
    return dict(zip(ranks.tolist(), counts.tolist()))


def transfer(shapes, p, topo, layout, n, source, tag):
    """One request over real NIXL (verify mode) from `source`'s pools; checked against the
    oracle. Returns (manifest, plan, what landed in each destination rank's regions)."""
    c = Cluster(shapes, p, topo, layout, n=n, config=TransferConfig(verify=True), tag=tag,
                source=source)
    try:
        plan = plan_transfer(c.manifest, c.alloc)
        c.receive_all()
        c.check_exact()
        landed = [{k: t.clone() for k, t in pools.regions().items() if k != "kda_conv_staging"}
                  for pools in c.actual]
        return c.manifest, plan, landed
    finally:
        c.close()


CASES = [(TINY, 2, Topology(4, 4, 32), 16, 300), (KIMI, 1, Topology(2, 2, 64), 64, 600),
         (KIMI, 2, Topology(2, 2, 128), 64, 600)]


@pytest.mark.parametrize("shapes,p,topo,pt,n", CASES,
                         ids=[f"{'tiny' if c[0] is TINY else 'kimi'}-p{c[1]}-c{c[2].dcp}-il{c[2].interleave}"
                              for c in CASES])
def test_placed_pages_are_one_run_per_dcp_rank_and_land_the_same_bytes(shapes, p, topo, pt, n):
    layout = StateLayout(latent_dtype="float32", page_tokens=pt)
    tag = f"-pl{p}{topo.tp}{topo.interleave}"
    m, plan, placed = transfer(shapes, p, topo, layout, n, placed_source(topo), tag)
    for share in rank_pages(m.latent_pages[0], topo, pt):
        assert share == list(range(share[0], share[0] + len(share)))  # contiguous source ids
    assert latent_runs(plan) == {r: 1 for r in range(topo.tp)}  # one read per rank and layer
    m0, plan0, plain = transfer(shapes, p, topo, layout, n, placed_source(None), tag + "u")
    assert sorted(m0.latent_pages[0]) == sorted(m.latent_pages[0])  # same ids, other order
    pages_per_run = topo.interleave // pt
    assert latent_runs(plan0) == {r: -(-len(s) // pages_per_run) for r, s in
                                  enumerate(rank_pages(m0.latent_pages[0], topo, pt))}
    for r in range(topo.tp):
        for kind, t in placed[r].items():
            assert torch.equal(t, plain[r][kind]), (kind, r)


def test_fragmented_pool_places_the_lowest_free_ids_rank_major():
    topo, layout, n = Topology(2, 2, 32), StateLayout(latent_dtype="float32", page_tokens=16), 150
    m, plan, _ = transfer(TINY, 1, topo, layout, n, placed_source(topo, fragment=True), "-frag")
    # 10 pages from free ids 1, 3, 5, ...: rank 0 (pages 0,1, 4,5, 8,9) takes the lowest six
    assert rank_pages(m.latent_pages[0], topo, 16) == [[1, 3, 5, 7, 9, 11], [13, 15, 17, 19]]
    assert latent_runs(plan) == {0: 6, 1: 4}  # runs break at every hole, bytes still exact


def test_prefill_rank_computes_the_same_state_in_placed_pages():
    config = preset("tiny")
    layout = StateLayout(latent_dtype="float32", conv_dtype="float32")
    prompt = [t % config.vocab_size for t in range(7, 7 + 300)]
    out = {}
    for hint in (None, Topology(2, 2, 64)):
        rank = PrefillRank(f"prefill-pl{hint is not None}", 0, 0, config, layout=layout, seed=5,
                           decode_topology=hint)
        try:
            [res] = rank.prefill([Request("r", prompt, SamplingParams(max_tokens=4))], [rank.info()])
            pages = res.handle.manifest.latent_pages[0]
            latent = rank.engine.pools.latent
            out[hint is not None] = (pages, res.handle.first_token,
                                     [latent.read(i, pages, len(prompt))
                                      for i in range(latent.data.shape[0])])
        finally:
            rank.close()
    (pages0, tok0, lat0), (pages1, tok1, lat1) = out[False], out[True]
    assert pages0 == [1, 2, 3, 4, 5] and pages1 == [1, 4, 2, 5, 3]  # 301 tokens: ranks 0,1,0,1,0
    assert tok0 == tok1
    assert all(torch.equal(a, b) for a, b in zip(lat0, lat1))
