"""The prefix cache of the reference prefill engine: a request that hits cached blocks gets the
bits of an uncached prefill (first token, KDA recurrent and conv state, MLA latent rows, the
tokens decoded after), greedy and seeded, for hits of no, some and all full blocks; eviction
never frees an entry in use, and a cache full of pinned entries leaves new requests uncached
rather than refused; through `pdserve serve` on real Ray and NIXL, turn 2 of a conversation
hits on turn 1's prompt at concurrency 1."""
import asyncio
import re
from types import SimpleNamespace

import httpx
import msgspec
import pytest
import ray
import torch

from pdserve.bench import Workload, run_bench
from pdserve.cluster.router import pick_prefill
from pdserve.cluster.config import ConfigError, ServeConfig, load_serve_config, validate
from pdserve.cluster.serve import running_server
from pdserve.model.config import preset
from pdserve.model.generate import ReferenceEngine, build_model
from pdserve.model.sampling import Request, SamplingParams
from pdserve.prefill.engine import PrefillRank
from pdserve.prefill.prefix_cache import PrefixCacheConfig, PrefixIndex
from pdserve.prefill.scheduler import ChunkScheduler

from ports import free_port

DECODED = 3  # tokens after the first, decoded from each rank's own state


def tokens(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


A = tokens(200, 1)  # three full blocks of 64 and 8 tokens
R, R2 = tokens(70, 2), tokens(70, 3)
# (name, prompt, tokens the hit covers), in the order the cached rank sees them
CASES = [
    ("first", A, 0),
    ("again", A, 192),                        # every full block; the prompt ends mid-block
    ("some", A[:150] + tokens(30, 4), 128),   # two blocks in common, then different tokens
    ("none", tokens(100, 5), 0),
    ("block-end", A[:192], 128),              # the last block is prefilled again for its logits
    ("one-over", A[:193], 128),               # a one-token rest would take the decode forms
    ("short-rest", A[:130], 128),             # a rest of 2 rows (MLA pads its queries)
    ("continued", A + R, 192),                # the next turn: past the first prompt's blocks
    ("other", A + R2, 192),                   # the same prefix, another continuation
    ("turn-3", A + R + tokens(30, 6), 256),   # "continued"'s fourth block was cached too
]


def monolithic(text, max_tokens=4):
    """The reference generate loop's greedy tokens for `text` (byte-level `tiny`)."""
    eng = ReferenceEngine(build_model(preset("tiny"), seed=0))
    return eng.generate([list(text.encode())], SamplingParams(max_tokens=max_tokens))[0].output


def rank(cache, **kw):
    return PrefillRank("p", 0, 0, preset("tiny"), num_slots=32, prefix_cache=cache, **kw)


def prefill(r, rid, prompt, params):
    """Prefill one request to its result; (first token, state bits, decoded tokens after)."""
    new, results = [Request(rid, prompt, params)], []
    for _ in range(100):
        results += r.prefill(new, [r.info()])
        new = []
        if results:
            break
    [res] = results
    assert res.error is None, res.error
    seq, pools = r.seqs[rid], r.engine.pools
    t = seq.table
    state = (pools.latent.data[:, t.latent_pages[0]].flatten(1, 2)[:, :len(prompt)].clone(),
             pools.slots.recurrent[:, t.kda_slot].clone(), pools.slots.conv[:, t.kda_slot].clone())
    seq.params = msgspec.structs.replace(seq.params, max_tokens=1 + DECODED)
    seq.finish_reason = None
    for _ in range(DECODED):
        r.engine.decode([seq])
    return res.handle.first_token, state, seq.output[1:]


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=8),
                                    SamplingParams(max_tokens=8, temperature=0.9, top_k=40,
                                                   seed=11)], ids=["greedy", "seeded"])
@pytest.mark.parametrize("budget", [None, 64], ids=["whole", "chunked"])
def test_a_prefix_hit_gives_the_bits_of_an_uncached_prefill(params, budget):
    # the uncached rank cuts where the cached one does (a block per chunk), so this checks the
    # cache alone; that a chunked prefill gives a whole one's bits is test_chunked_prefill's
    cached = rank(PrefixCacheConfig(checkpoint_interval=1), chunk_tokens=budget)
    plain = rank(None, chunk_tokens=64)
    assert "prefix_hits" not in plain.stats()
    for name, prompt, hit in CASES:
        before = cached.stats()["prefix_tokens_saved"]
        got, want = prefill(cached, name, prompt, params), prefill(plain, name, prompt, params)
        assert cached.stats()["prefix_tokens_saved"] - before == hit, name
        assert got[0] == want[0], name
        for what, a, b in zip(("latent", "recurrent", "conv"), got[1], want[1]):
            assert torch.equal(a, b), f"{name}: {what} state differs"
        assert got[2] == want[2] and len(got[2]) == DECODED, name
        cached.cancel(name), plain.cancel(name)  # the decode side read it: freed
    st = cached.stats()
    assert st["prefix_hits"] == sum(1 for *_, h in CASES if h)
    assert st["prefix_misses"] == sum(1 for *_, h in CASES if not h)
    # A's three full blocks, then one each of "none", "continued" and "other"
    assert st["prefix_entries"] == 3 + 3
    assert st["held"] == 0 and st["pages_free"] + st["prefix_entries"] == st["pages_total"]
    assert st["slots_free"] + st["prefix_checkpoints"] == st["slots_total"]
    cached.close(), plain.close()


def test_checkpoints_every_interval_and_at_the_last_full_block():
    r = rank(PrefixCacheConfig(checkpoint_interval=2))
    c = r.cache
    every = [128, 256, 384, 512]
    assert c.stops(600, 0) == every + [576]  # 9 full blocks: every 2nd, and the 9th
    assert c.stops(600, 256) == [384, 512, 576]
    assert c.stops(577, 0) == every  # 576 would leave one token alone
    assert c.stops(576, 0) == every + [576]  # the prompt's end: the next turn's start
    prefill(r, "a", tokens(600, 7), SamplingParams(max_tokens=8))
    assert r.stats()["prefix_checkpoints"] == 5 and r.stats()["prefix_entries"] == 9
    r.close()


def test_where_a_prompt_leaves_a_cached_one_it_takes_a_checkpoint():
    """Agents' prompts share a prefix that ends in no checkpoint (here 15 blocks, under the
    16-block interval): the second sighting misses but checkpoints where it leaves the first
    prompt, so the third hits the whole shared prefix."""
    r, p = rank(PrefixCacheConfig()), SamplingParams(max_tokens=8)
    shared = tokens(990, 23)  # 15 full blocks, then each prompt's own 110 tokens
    assert r.cache.stops(1100, 0) == [1024, 1088]
    assert r.cache.stops(1100, 0, 960) == [960, 1024, 1088]
    got = []
    for i in range(4):
        [res] = r.prefill([Request(f"s{i}", shared + tokens(110, 50 + i), p)], [r.info()])
        assert res.error is None, res.error
        r.cancel(f"s{i}")
        got.append((r.stats()["prefix_tokens_saved"], r.stats()["prefix_checkpoints"]))
    # s1 misses and adds one at 960 to the cached block (and its own two); s2 and s3 hit 960
    assert got == [(0, 2), (0, 5), (960, 7), (1920, 9)]
    assert r.stats()["held"] == 0
    assert r.stats()["slots_free"] + 9 == r.stats()["slots_total"]
    r.close()


def test_stops_cut_the_chunks():
    r = rank(None)
    s = r.engine.admit(Request("s", [i % 256 for i in range(300)], SamplingParams(max_tokens=8)))
    for budget, want in ((None, [128, 64, 108]), (96, [96, 32, 64, 96, 12])):
        sched = ChunkScheduler(budget)
        s.table.num_tokens = 0
        sched.add(s, [128, 192])
        got = []
        while s.table.num_tokens < 300:
            [(_, chunk)] = sched.plan()
            got.append(len(chunk))
            s.table.num_tokens += len(chunk)
        assert got == want, budget
    r.close()


def test_a_hit_cancelled_mid_prefill_frees_its_own_state_only():
    r = rank(PrefixCacheConfig(checkpoint_interval=1), chunk_tokens=64)
    p = SamplingParams(max_tokens=8)
    prefill(r, "a", A, p)
    r.cancel("a")
    base = r.stats()
    assert base["prefix_entries"] == 3 and base["held"] == 0
    assert r.prefill([Request("b", A + R + R2, p)], [r.info()]) == []  # hit 192, then 64 more
    assert r.engine.pools.slots.num_free == base["slots_free"] - 2  # running slot + at 256
    assert r.cancel("b")
    st = r.stats()
    assert (st["prefix_hits"], st["prefix_tokens_saved"]) == (1, 192)
    assert {k: st[k] for k in ("pages_free", "slots_free", "prefix_entries")} == {
        k: base[k] for k in ("pages_free", "slots_free", "prefix_entries")}
    assert all(e.refs == 0 for e in r.cache._entries.values())
    r.close()


def entry_bytes(r):
    return r.cache.page_bytes + r.cache.slot_bytes


def test_a_cache_full_of_pinned_entries_leaves_new_requests_uncached():
    r, plain = rank(PrefixCacheConfig(checkpoint_interval=1)), rank(None)
    r.cache.max_bytes = 3 * entry_bytes(r)  # three blocks with their checkpoints
    x, y, z = tokens(200, 8), tokens(200, 9), tokens(200, 10)
    p = SamplingParams(max_tokens=8)
    prefill(r, "x", x, p)  # held: its three blocks fill the cache, pinned
    xs = {e.page for e in r.cache._entries.values()}
    x_rows = r.engine.pools.latent.data[:, sorted(xs)].clone()
    assert r.stats()["prefix_entries"] == 3 and r.stats()["prefix_bytes"] == 3 * entry_bytes(r)
    assert prefill(r, "y", y, p)[0] == prefill(plain, "y", y, p)[0]  # prefilled, not cached
    assert r.stats()["prefix_entries"] == 3 and r.stats()["prefix_evictions"] == 0
    assert {e.page for e in r.cache._entries.values()} == xs
    assert torch.equal(r.engine.pools.latent.data[:, sorted(xs)], x_rows)
    r.cancel("y")
    prefill(r, "y2", y, p)  # y was never cached: a miss
    assert r.stats()["prefix_tokens_saved"] == 0
    r.cancel("y2")
    r.cancel("x")  # unpinned now: the next request's blocks evict them
    prefill(r, "z", z, p)
    assert r.stats()["prefix_evictions"] == 3 and r.stats()["prefix_entries"] == 3
    assert not xs & {e.page for e in r.cache._entries.values()}
    r.close(), plain.close()


def test_pool_pressure_evicts_unpinned_entries_only():
    """Pages for 2 prompts of 200 tokens (4 pages each) and one more page: a third request
    evicts the released one's entries as far as it needs to be admitted, never the held
    one's."""
    r = rank(PrefixCacheConfig(checkpoint_interval=1, max_share=1.0), num_pages=10)
    p = SamplingParams(max_tokens=8)
    prefill(r, "held", tokens(200, 11), p)
    held = {k: (e.page, e.slot) for k, e in r.cache._entries.items()}
    rows = r.engine.pools.latent.data[:, [pg for pg, _ in held.values()]].clone()
    prefill(r, "done", tokens(200, 12), p)
    r.cancel("done")
    assert r.stats()["pages_free"] == 9 - 4 - 3  # done's partial page went back, its blocks stayed
    prefill(r, "new", tokens(200, 13), p)  # 4 pages: two of done's blocks evicted
    assert r.stats()["prefix_evictions"] == 2
    for k, (pg, slot) in held.items():
        assert r.cache._entries[k].page == pg and r.cache._entries[k].slot == slot
    assert torch.equal(r.engine.pools.latent.data[:, [pg for pg, _ in held.values()]], rows)
    # full of what "held" and "new" use: a fourth prompt is refused as the pools say, not
    # admitted over entries in use
    res = r.prefill([Request("more", tokens(200, 14), p)], [r.info()])
    assert res[0].error and "PoolExhausted" in res[0].error
    assert r.stats()["prefix_evictions"] == 3  # done's last block went trying
    for k, (pg, slot) in held.items():
        assert r.cache._entries[k].page == pg and r.cache._entries[k].slot == slot
    assert r.cache.acquire(tokens(200, 11)).tokens == 192  # the held entries still hit
    r.close()


def would_hit(cache, prompt):
    hit = cache.acquire(prompt)
    cache.release(hit.keys)
    return hit.tokens


def test_the_routers_index_gives_the_hit_the_cache_would_give():
    """`PrefixIndex` fed with `prefix_changes()` after each prefill finds what the cache's own
    lookup finds, through inserts and evictions, and after a log that overflowed."""
    r = rank(PrefixCacheConfig(checkpoint_interval=2))
    r.cache.max_bytes = 5 * entry_bytes(r)  # new prompts' blocks evict older ones
    index = PrefixIndex()
    first = r.prefix_changes()
    assert first.full and first.entries == {}  # the first answer: the whole (empty) cache
    index.apply(first)
    probes = [A, A[:193], A[:130], A + R, A + R2, A + R + R2, tokens(64, 22)]

    def run(rid, prompt):
        [res] = r.prefill([Request(rid, prompt, SamplingParams(max_tokens=8))], [r.info()])
        assert res.error is None, res.error
        r.cancel(rid)

    def check(ch):
        index.apply(ch)
        assert index.stats == r.cache.stats()
        assert index.entries == {k: bool(e.slot) for k, e in r.cache._entries.items()}
        return [index.match(q) for q in probes]

    for i, prompt in enumerate([A, A + R, tokens(300, 20), A + R2, A + R + R2]):
        run(f"q{i}", prompt)
        ch = r.prefix_changes()
        assert not ch.full
        assert check(ch) == [would_hit(r.cache, q) for q in probes], i
    assert r.stats()["prefix_evictions"] > 0 and any(check(r.prefix_changes()))
    r.cache.LOG_SLACK = 0  # a reader that does not ask: past its bound the log becomes "all"
    for i in range(4):
        run(f"x{i}", tokens(300, 30 + i))
    ch = r.prefix_changes()
    assert ch.full and len(ch.entries) == r.stats()["prefix_entries"]
    assert check(ch) == [would_hit(r.cache, q) for q in probes]
    r.close()


def test_routing_prefers_the_longest_cached_prefix_within_the_queue_bound():
    q = [SimpleNamespace(pending_tokens=n) for n in (300, 0, 100, 50)]
    assert pick_prefill(q, [0, 0, 0, 0], 1000) is q[1]  # no hit: the least loaded
    assert pick_prefill(q, [128, 0, 256, 0], 1000) is q[2]  # the longest hit
    assert pick_prefill(q, [256, 0, 256, 0], 1000) is q[2]  # of equals, the least loaded
    assert pick_prefill(q, [128, 0, 256, 0], 100) is q[2]  # at the bound: still
    assert pick_prefill(q, [128, 0, 256, 0], 99) is q[1]  # past it: the least loaded
    assert pick_prefill(q, [0, 64, 0, 0], 0) is q[1]


def test_the_prefix_cache_table_is_validated_and_named(tmp_path):
    cfg = ServeConfig()
    assert cfg.prefill.prefix_cache.enabled  # on by default
    for field, bad in (("max_bytes", -1), ("max_share", 0.0), ("max_share", 1.5),
                       ("checkpoint_interval", 0), ("route_max_queued_tokens", -1)):
        pc = msgspec.structs.replace(cfg.prefill.prefix_cache, **{field: bad})
        with pytest.raises(ConfigError, match=rf"prefill\.prefix_cache\.{field}"):
            validate(msgspec.structs.replace(
                cfg, prefill=msgspec.structs.replace(cfg.prefill, prefix_cache=pc)))
    path = tmp_path / "serve.toml"
    path.write_text("[prefill.prefix_cache]\nmax_bytes = 1048576\ncheckpoint_interval = 4\n")
    got, _ = load_serve_config(path)
    assert got.prefill.prefix_cache == PrefixCacheConfig(max_bytes=2**20, checkpoint_interval=4)
    path.write_text("[prefill.prefix_cache]\nbytes = 1\n")
    with pytest.raises(ConfigError, match=r"prefill\.prefix_cache"):
        load_serve_config(path)


@pytest.fixture(scope="module")
def served(ray_session):
    """`pdserve serve` on real Ray and NIXL: two prefill instances (a dead one stays dead:
    the last test kills one), one decode instance."""
    cfg = ServeConfig()
    cfg = msgspec.structs.replace(
        cfg, prefill=msgspec.structs.replace(cfg.prefill, instances=2),
        api=msgspec.structs.replace(cfg.api, port=free_port(), request_timeout_s=120),
        resources=msgspec.structs.replace(cfg.resources, cpus_per_rank=0.25, call_timeout_s=60,
                                          rebuild=False))
    with running_server(cfg, validate(cfg), progress=lambda m: None) as (url, router):
        yield url, router


def complete(url, prompt, max_tokens=6):
    """(text, token ids) of a greedy completion."""
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"], choice["token_ids"]


def prefix_stats(router):
    """Each live prefill instance's cache counters, by instance name."""
    return {p.inst.name: p.inst.ranks.call("stats")[0] for p in router.prefill if p.inst.alive}


def test_turn_two_of_a_conversation_hits_through_pdserve_serve(served):
    """At concurrency 1 on a cold cache: turn 1 leaves a checkpoint at its prompt's last full
    block, so turn 2 (turn 1's prompt + its answer + a new question) prefills from there, on
    the instance that holds it."""
    url, router = served
    turn1 = "You are a careful assistant. Tools: search(q), read(url). " * 3  # 180 bytes
    answer, _ = complete(url, turn1)
    [(name, st)] = [(n, st) for n, st in prefix_stats(router).items() if st["prefix_misses"]]
    assert (st["prefix_hits"], st["prefix_misses"], st["prefix_entries"]) == (0, 1, 2)
    assert st["prefix_checkpoints"] == 1  # at 128, turn 1's last full block
    complete(url, turn1 + answer + " Now read the first result.")
    st = prefix_stats(router)[name]
    assert (st["prefix_hits"], st["prefix_misses"]) == (1, 1)
    assert st["prefix_tokens_saved"] == 128


def test_bench_multiturn_counts_the_hits_and_the_tokens_prefilled(served):
    """`pdserve bench --workload multiturn` at concurrency 1: each turn extends the last one's
    prompt and answer and hits its checkpoint; the level's cache figures come from /metrics."""
    url, _ = served
    workload = Workload("multiturn", output_tokens=4, prefix_tokens=150, suffix_tokens=20)
    [lv] = run_bench(url, workload, [1], 3, timeout=60, max_duration=120, progress=False)["levels"]
    assert (lv["ok"], lv["errors"]) == (3, {})
    lengths = [r["prompt_tokens"] for r in lv["records"]]
    assert lengths[0] == 170 and lengths[0] < lengths[1] < lengths[2]
    # the warm-up (turn 1 unmeasured) checkpointed at 128: every measured turn hits
    assert (lv["prefix_hits"], lv["prefix_misses"], lv["prefix_hit_rate"]) == (3, 0, 1.0)
    assert lv["prefix_tokens_saved"] >= 3 * 128
    assert lv["prefill_tokens_computed"] == sum(lengths) - lv["prefix_tokens_saved"]


def metrics(url):
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {m[1]: float(m[2]) for m in re.finditer(
        r"^pdserve_prefix_cache_(\w+) (\S+)$", text, re.M)}


def test_requests_go_where_their_prefix_is_cached_and_survive_its_loss(served):
    """Two prompts prefilled at once land on the two instances; their follow-ups go where
    their prefix is cached, not to the first idle instance; /metrics counts the hits. The
    instance holding one prefix dies: its requests are prefilled on the other (the same
    tokens), which then caches that prefix too; the counters keep the dead one's."""
    url, router = served
    before = metrics(url)
    a, b = "Tool schema: " + "x" * 187, "System prompt: " + "y" * 185  # 200 bytes: 3 blocks
    want = {p: monolithic(p) for p in (a, b, a + " go on", b + " go on", a + " again")}
    counts = {n: (st["prefix_hits"], st["prefix_misses"]) for n, st in prefix_stats(router).items()}

    async def both():  # picked one after the other, before either finished: one per instance
        async def one(rid, prompt):
            req = Request(rid, list(prompt.encode()), SamplingParams(max_tokens=4))
            return [e.token async for e in router.generate(req, 60) if e.token is not None]
        return await asyncio.gather(one("a", a), one("b", b))
    assert asyncio.run(both()) == [want[a][:4], want[b][:4]]
    home = {}
    for name, st in prefix_stats(router).items():
        assert st["prefix_misses"] == counts[name][1] + 1
        home[name] = st
    p0, p1 = router.prefill[0].inst.name, router.prefill[1].inst.name
    # the second instance holds b: b's follow-up goes there though the first is idle too
    for prompt in (b + " go on", a + " go on"):
        assert complete(url, prompt, 4)[1] == want[prompt][:4]
    st = prefix_stats(router)
    assert [st[n]["prefix_hits"] - home[n]["prefix_hits"] for n in (p0, p1)] == [1, 1]
    got = metrics(url)
    assert got["hits_total"] - before.get("hits_total", 0) == 2
    assert got["misses_total"] - before.get("misses_total", 0) == 2
    assert got["tokens_saved_total"] - before.get("tokens_saved_total", 0) == 2 * 192
    assert got["cached_tokens"] == 64 * sum(s["prefix_entries"] for s in st.values())
    assert got["hit_rate"] == got["hits_total"] / (got["hits_total"] + got["misses_total"])
    # the instance that holds a dies: a's requests are prefilled on the other, b's still hit
    held = st[p0]["prefix_entries"]
    for actor in router.prefill[0].inst.ranks.actors:
        ray.kill(actor)
    for prompt in (a + " again", b + " go on", a + " again"):
        assert complete(url, prompt, 4)[1] == want[prompt][:4]
    assert not router.prefill[0].inst.alive
    st1 = prefix_stats(router)[p1]
    assert st1["prefix_hits"] - st[p1]["prefix_hits"] == 2  # b's, then a's second
    assert st1["prefix_misses"] - st[p1]["prefix_misses"] == 1  # a's first: p0's cache is gone
    after = metrics(url)
    assert after["hits_total"] - got["hits_total"] == 2  # p0's earlier hits still counted
    assert after["misses_total"] - got["misses_total"] == 1
    assert after["entries"] == st1["prefix_entries"] and held  # p0's entries went with it
