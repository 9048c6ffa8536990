"""The prefix cache of the reference prefill engine: a request that hits cached blocks gets the
bits of an uncached prefill (first token, KDA recurrent and conv state, MLA latent rows, the
tokens decoded after), greedy and seeded, for hits of no, some and all full blocks; eviction
never frees an entry in use, and a cache full of pinned entries leaves new requests uncached
rather than refused; through `pdserve serve` on real Ray and NIXL, turn 2 of a conversation
hits on turn 1's prompt at concurrency 1."""
import httpx
import msgspec
import pytest
import torch

from pdserve.cluster.config import ConfigError, ServeConfig, load_serve_config, validate
from pdserve.cluster.serve import running_server
from pdserve.model.config import preset
from pdserve.model.sampling import Request, SamplingParams
from pdserve.prefill.engine import PrefillRank
from pdserve.prefill.prefix_cache import PrefixCacheConfig
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
    ("continued", A + R, 192),                # the next turn: past the first prompt's blocks
    ("other", A + R2, 192),                   # the same prefix, another continuation
    ("turn-3", A + R + tokens(30, 6), 256),   # "continued"'s fourth block was cached too
]


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
        before = cached.stats()["prefix_cached_tokens"]
        got, want = prefill(cached, name, prompt, params), prefill(plain, name, prompt, params)
        assert cached.stats()["prefix_cached_tokens"] - before == hit, name
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
    assert (st["prefix_hits"], st["prefix_cached_tokens"]) == (1, 192)
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
    assert r.stats()["prefix_cached_tokens"] == 0
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


def test_the_prefix_cache_table_is_validated_and_named(tmp_path):
    cfg = ServeConfig()
    assert cfg.prefill.prefix_cache.enabled  # on by default
    for field, bad in (("max_bytes", -1), ("max_share", 0.0), ("max_share", 1.5),
                       ("checkpoint_interval", 0)):
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


def test_turn_two_of_a_conversation_hits_through_pdserve_serve(ray_session):
    """At concurrency 1 on a cold cache: turn 1 leaves a checkpoint at its prompt's last full
    block, so turn 2 (turn 1's prompt + its answer + a new question) prefills from there."""
    cfg = ServeConfig()
    cfg = msgspec.structs.replace(
        cfg, api=msgspec.structs.replace(cfg.api, port=free_port(), request_timeout_s=120),
        resources=msgspec.structs.replace(cfg.resources, cpus_per_rank=0.25, call_timeout_s=60))
    model = validate(cfg)
    turn1 = "You are a careful assistant. Tools: search(q), read(url). " * 3  # 180 bytes

    def complete(url, prompt):
        r = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    with running_server(cfg, model, progress=lambda m: None) as (url, router):
        def stats():
            [st] = router.prefill[0].inst.ranks.call("stats")
            return st
        answer = complete(url, turn1)
        st = stats()
        assert (st["prefix_hits"], st["prefix_misses"], st["prefix_entries"]) == (0, 1, 2)
        assert st["prefix_checkpoints"] == 1  # at 128, turn 1's last full block
        complete(url, turn1 + answer + " Now read the first result.")
        st = stats()
        assert (st["prefix_hits"], st["prefix_misses"]) == (1, 1)
        assert st["prefix_cached_tokens"] == 128
