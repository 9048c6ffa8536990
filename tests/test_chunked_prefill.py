"""Chunked prefill on the reference prefill engine: chunks under a per-step token budget give
the unchunked prefill's bits (first token, KDA recurrent and conv state, MLA latent rows, the
greedy tokens after), and through the serve path on real Ray a short prompt that arrives while a
long one prefills gets its first token first, within a few steps."""
import threading
import time

import httpx
import msgspec
import pytest
import ray
import torch

from pdserve.cluster.config import ConfigError, ServeConfig, validate
from pdserve.cluster.serve import running_server
from pdserve.model.config import preset
from pdserve.model.generate import Sequence
from pdserve.model.sampling import Request, SamplingParams
from pdserve.prefill.engine import PrefillRank
from pdserve.prefill.scheduler import UNIT, ChunkScheduler, cost
from pdserve.state.block_table import BlockTable

from ports import free_port

# shorter than a chunk; one token; ends one past a unit (the one-token rule); not page-aligned
LENGTHS = [5, 1, 129, 300, 37]
DECODED = 3  # greedy tokens after the first, decoded from each engine's state


def prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in LENGTHS]


def run(budget, together):
    """Prefill every prompt on one rank (`together`: all submitted at once, sharing steps;
    else one after another); each request's first token, state bytes and greedy tokens after."""
    rank = PrefillRank("p", 0, 0, preset("tiny"), num_slots=8, chunk_tokens=budget)
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=8)) for i, p in enumerate(prompts())]
    done, steps = {}, 0
    for batch in ([reqs] if together else [[r] for r in reqs]):
        new = batch
        while new or len(rank.scheduler):
            for res in rank.prefill(new, [rank.info()]):
                assert res.error is None, res.error
                done[res.request_id] = res.handle.first_token
            new, steps = [], steps + 1
    pools, out = rank.engine.pools, {}
    for r in reqs:
        seq = rank.seqs[r.request_id]
        t, n = seq.table, len(r.prompt)
        latent = pools.latent.data[:, t.latent_pages[0]].flatten(1, 2)[:, :n].clone()
        state = (pools.slots.recurrent[:, t.kda_slot].clone(), pools.slots.conv[:, t.kda_slot].clone(),
                 latent)
        seq.params = msgspec.structs.replace(seq.params, max_tokens=1 + DECODED)
        seq.finish_reason = None
        for _ in range(DECODED):
            rank.engine.decode([seq])
        out[r.request_id] = (done[r.request_id], state, seq.output[1:])
    rank.close()
    return out, steps


@pytest.fixture(scope="module")
def whole():
    return run(None, together=False)[0]


@pytest.mark.parametrize("budget", [16, 48, 64, 112])
@pytest.mark.parametrize("together", [False, True], ids=["alone", "interleaved"])
def test_chunked_prefill_is_bit_exact_with_whole_prefill(whole, budget, together):
    got, steps = run(budget, together)
    assert steps > (1 if together else len(LENGTHS))  # the long prompts ran in several chunks
    for rid, (first, state, decoded) in whole.items():
        g_first, g_state, g_decoded = got[rid]
        assert g_first == first, rid
        for name, a, b in zip(("recurrent", "conv", "latent"), state, g_state):
            assert torch.equal(a, b), f"{rid}: {name} state differs at budget {budget}"
        assert g_decoded == decoded and len(decoded) == DECODED, rid


def seq(rid, n):
    return Sequence(rid, list(range(n)), SamplingParams(), BlockTable(latent_pages=[[1]], kda_slot=1))


def advance(plan):
    for s, chunk in plan:
        assert s.prompt[s.table.num_tokens:s.table.num_tokens + len(chunk)] == chunk
        s.table.num_tokens += len(chunk)


def test_plans_cut_on_units_run_finishing_prompts_alone_and_never_starve_the_oldest():
    sched = ChunkScheduler(64)
    long, short = seq("long", 5000), seq("short", 19)
    sched.add(long)
    advance(plan := sched.plan())
    assert [(s.request_id, len(c)) for s, c in plan] == [("long", 64)]
    sched.add(short)
    plan = sched.plan()  # the short one fits: it runs alone, whole
    assert [(s.request_id, len(c)) for s, c in plan] == [("short", 19)]
    advance(plan)
    sched.remove("short")
    for i in range(3):  # a short prompt in every step: the oldest still moves every other step
        sched.add(s := seq(f"s{i}", 40))
        plan = sched.plan()
        assert {p.request_id: len(c) for p, c in plan} == (
            {"long": UNIT, f"s{i}": 40} if i % 2 == 0 else {f"s{i}": 40})
        advance(plan)
        sched.remove(s.request_id)
    sizes = []
    while len(sched):
        plan = sched.plan()
        for s, c in plan:
            end = s.table.num_tokens + len(c)
            assert end == len(s.prompt) or (end % UNIT == 0 and len(s.prompt) - end > 1)
            assert cost(s.table.num_tokens, len(c)) <= 64 or len(c) <= UNIT + 1
            sizes.append(len(c))
        advance(plan)
        if long.table.num_tokens == len(long.prompt):
            sched.remove("long")
    assert sizes[0] == 64 and sizes[-2] == 16  # near 5K of context a token costs over 2
    odd = ChunkScheduler(16)  # 17 tokens on a 16 budget: one over rather than one left alone
    odd.add(s := seq("odd", 17))
    assert [len(c) for _, c in odd.plan()] == [17]
    deep = ChunkScheduler(16)  # a unit costs more than the budget this deep: it still moves
    deep.add(s := seq("deep", 5000))
    s.table.num_tokens = 4096
    assert [len(c) for _, c in deep.plan()] == [UNIT]


def test_chunk_tokens_is_validated_and_named():
    cfg = ServeConfig()
    for bad in (10, -16, 100):
        with pytest.raises(ConfigError, match=r"prefill\.chunk_tokens.*multiple of 16"):
            validate(msgspec.structs.replace(
                cfg, prefill=msgspec.structs.replace(cfg.prefill, chunk_tokens=bad)))
    validate(msgspec.structs.replace(cfg, prefill=msgspec.structs.replace(cfg.prefill,
                                                                          chunk_tokens=0)))


@pytest.fixture(scope="module")
def ray_session():
    yield
    if ray.is_initialized():
        ray.shutdown()


def test_a_short_prompt_is_not_held_behind_a_long_prefill(ray_session):
    """A 3000-token prompt prefills in dozens of steps of a 64-token budget, back to back in the
    prefill instance's own loop (the router makes no call per step); a 20-token prompt sent once
    it is under way gets its first token before it, within 2 steps of being sent."""
    cfg = ServeConfig()
    cfg = msgspec.structs.replace(
        cfg, prefill=msgspec.structs.replace(cfg.prefill, chunk_tokens=64),
        api=msgspec.structs.replace(cfg.api, port=free_port(), request_timeout_s=120),
        resources=msgspec.structs.replace(cfg.resources, cpus_per_rank=0.25, call_timeout_s=60))
    model = validate(cfg)
    firsts: list[str] = []  # requests in the order their first tokens came

    def stream(url, name, prompt):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "stream": True,
                "temperature": 0}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]" and name not in firsts:
                    firsts.append(name)

    steps: dict[str, tuple[int, int]] = {}  # request -> prefill steps run at submit, at result

    with running_server(cfg, model, progress=lambda m: None) as (url, router):
        queue = router.prefill[0]
        rank0 = queue.inst.ranks.actors[0]
        made = lambda: queue.server.stats()["steps"]  # noqa: E731
        submit = queue.submit

        def counted(request, deadline_s=None):  # the step counts around each prefill
            at, fut = made(), submit(request, deadline_s)
            fut.add_done_callback(lambda _: steps.__setitem__(
                "long" if len(request.prompt) > 100 else "short", (at, made())))
            return fut
        queue.submit = counted
        long = threading.Thread(target=stream, args=(url, "long", "x" * 3000))
        long.start()
        end = time.monotonic() + 60
        while made() < 2:  # the long prompt is under way
            assert time.monotonic() < end and long.is_alive(), "the long prefill never started"
            time.sleep(0.01)
        sent = made()
        stream(url, "short", "a nineteen-token ask")
        long.join(120)
        assert not long.is_alive()
        taken = ray.get(rank0.calls.remote(), timeout=30)
    assert firsts == ["short", "long"], firsts
    (at, done), (_, long_done) = steps["short"], steps["long"]
    # submitted while a step ran: that step, then its own
    assert at >= sent and done - at <= 2, steps
    assert long_done >= 3000 // 64 and long_done - done > 20, steps  # most chunks came after
    # two requests, two submissions; no prefill call per step crossed Ray
    assert taken.get("submit") == 2 and "prefill" not in taken, taken
