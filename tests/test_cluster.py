"""The disaggregated cluster on real Ray with real NIXL: the openai client gets exactly the
monolithic generate loop's tokens; decode/prefill actor deaths are survived or reported; bad
input, cancellation and a mixed load leave nothing lost, hung or held."""
import asyncio
import threading
import time

import httpx
import msgspec
import pytest
import ray

from pdserve.cluster.config import ServeConfig, validate
from pdserve.cluster.serve import running_server
from pdserve.model.config import preset
from pdserve.model.generate import ReferenceEngine, build_model
from pdserve.model.sampling import SamplingParams

from ports import free_port

openai = pytest.importorskip("openai")

PROMPTS = ["Disaggregated prefill and decode ", "hi", "KDA + MLA hybrid state over NIXL, resharded"]


def config(prefill_instances=1, prefill_tp=1, decode_instances=1, decode_tp=1, **transfer):
    cfg = ServeConfig()
    cfg = msgspec.structs.replace(
        cfg,
        prefill=msgspec.structs.replace(cfg.prefill, instances=prefill_instances, tp=prefill_tp,
                                        num_slots=33),
        decode=msgspec.structs.replace(cfg.decode, instances=decode_instances, tp=decode_tp,
                                       num_slots=33, max_batch=32),
        transfer=msgspec.structs.replace(cfg.transfer, **transfer),
        api=msgspec.structs.replace(cfg.api, port=free_port(), request_timeout_s=60),
        # a killed instance stays dead here: these tests watch failover and "none left"
        # (tests/test_self_healing.py watches the rebuild)
        resources=msgspec.structs.replace(cfg.resources, cpus_per_rank=0.25, call_timeout_s=60,
                                          rebuild=False))
    return cfg, validate(cfg)


def monolithic(prompts, max_tokens, params=None):
    """The reference generate loop's tokens (greedy unless `params` says otherwise)."""
    eng = ReferenceEngine(build_model(preset("tiny"), seed=0))
    return [s.output for s in eng.generate([list(p.encode()) for p in prompts],
                                           params or SamplingParams(max_tokens=max_tokens))]


def completion_ids(client, prompt, max_tokens, stream):
    kw = dict(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    if not stream:
        return client.completions.create(**kw).choices[0].token_ids
    ids = []
    for chunk in client.completions.create(stream=True, **kw):
        ids += chunk.choices[0].token_ids or []
    return ids


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    yield
    if ray.is_initialized():
        ray.shutdown()


@pytest.mark.parametrize("topology", ["tp1-to-tp1", "tp2-to-tp1", "tp1-to-tp2"])
def test_openai_client_gets_the_monolithic_tokens(topology):
    p, d = (int(x[-1]) for x in topology.split("-to-"))
    cfg, model = config(prefill_tp=p, decode_tp=d, verify=True)
    want = monolithic(PROMPTS, 12)
    with running_server(cfg, model, progress=lambda m: None) as (url, router):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=60)
        for prompt, expected in zip(PROMPTS, want):
            assert completion_ids(client, prompt, 12, stream=False) == expected
            assert completion_ids(client, prompt, 12, stream=True) == expected
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=5, temperature=0)
        assert chat.choices[0].finish_reason in ("length", "stop")
        # decode stats reach the router with its next poll of the ranks
        end = time.monotonic() + 5.0
        while (st := router.stats())["transfer_bytes_kda_recurrent"] == 0 and time.monotonic() < end:
            time.sleep(0.05)
        assert st["transfer_bytes_kda_recurrent"] > 0 and st["transfer_failures"] == 0


def _stream_in_thread(url, prompt, max_tokens, out, started):
    def run():
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=60)
        kw = dict(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                  extra_body={"return_token_ids": True, "ignore_eos": True})
        try:
            for chunk in client.completions.create(**kw):
                out["ids"] = out.get("ids", []) + (chunk.choices[0].token_ids or [])
                out["finish"] = chunk.choices[0].finish_reason or out.get("finish")
                started.set()
        except Exception as exc:
            out["error"] = exc
            started.set()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _kill_running(router, timeout=30.0):
    """Kill the decode instance running a request (the first token streams before decode admits,
    so wait for the admission); returns its slot."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        # the router's last poll of each live instance
        busy = [d for d in router.decode if d.inst.alive and d.stats.get("batched")]
        if busy:
            for a in busy[0].inst.ranks.actors:
                ray.kill(a)
            return busy[0]
        time.sleep(0.01)
    raise AssertionError(f"no decode instance started the request within {timeout} s")


def assert_kill_resumes(url, router, prompt, max_tokens, want):
    """Kill the instance streaming `prompt`: the stream resumes on another instance and its
    tokens equal the no-fault run's `want`."""
    out, started = {}, threading.Event()
    t = _stream_in_thread(url, prompt, max_tokens, out, started)
    assert started.wait(30)
    busy = _kill_running(router)
    t.join(60)
    assert not t.is_alive() and "error" not in out, out.get("error")
    assert out["ids"] == want, "resumed stream differs from the no-fault run"
    assert router.resumed >= 1 and not busy.inst.alive


def test_failover_decode_death_prefill_death_and_no_decode_left():
    cfg, model = config(prefill_instances=2, decode_instances=2)
    want = monolithic(PROMPTS[:1], 150)[0]
    with running_server(cfg, model, progress=lambda m: None) as (url, router):
        # 1. kill the decode instance streaming the request: it resumes on the other one
        assert_kill_resumes(url, router, PROMPTS[0], 150, want)

        # 2. kill a prefill instance: requests are prefilled on the other
        victim = router.prefill[0].inst
        for a in victim.ranks.actors:
            ray.kill(a)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=60)
        for _ in range(3):
            assert completion_ids(client, PROMPTS[1], 5, stream=False) == monolithic(PROMPTS[1:2], 5)[0]

        # 3. kill the last decode instance mid-stream: a clear error within the deadline
        out, started = {}, threading.Event()
        t0 = time.monotonic()
        t = _stream_in_thread(url, PROMPTS[2], 150, out, started)
        assert started.wait(30)
        _kill_running(router)
        t.join(60)
        assert not t.is_alive() and time.monotonic() - t0 < 60
        assert "error" in out or out.get("finish") == "error" or len(out.get("ids", [])) < 150
        health = httpx.get(f"{url}/health", timeout=10)
        assert health.status_code == 503 and "no live decode instance" in health.text


def test_the_decode_loop_runs_in_the_instance_not_the_router():
    """The router holds no batcher and runs no step: a TP 2 decode instance's rank 0 steps its
    batch and drives its peer through torch.distributed, so no Ray call reaches a rank per
    step (rank 1 takes none of the step calls at all), and the tokens leave rank 0 through its
    one event stream, a whole step's at a time: two streams decoding together cost fewer reads
    of it than they get tokens."""
    from pdserve.cluster.actors import RemoteServer
    from pdserve.decode.batcher import Batcher

    cfg, model = config(decode_tp=2)
    n = 60
    want = monolithic(PROMPTS[:2], n)
    with running_server(cfg, model, progress=lambda m: None) as (url, router):
        (slot,) = router.decode
        assert isinstance(slot.server, RemoteServer)
        assert not any(isinstance(v, Batcher) for d in router.decode for v in vars(d).values())
        calls = lambda: [ray.get(a.calls.remote(), timeout=30) for a in slot.inst.ranks.actors]
        stats = lambda: ray.get(slot.inst.ranks.actors[0].server.remote("stats"), timeout=30)
        before, steps0 = calls(), stats()["steps"]
        outs, threads = [], []
        for prompt in PROMPTS[:2]:
            outs.append({})
            threads.append(_stream_in_thread(url, prompt, n, outs[-1], threading.Event()))
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads)
        assert [o.get("ids") for o in outs] == want
        taken = [{m: k - b.get(m, 0) for m, k in a.items() if k > b.get(m, 0)}
                 for a, b in zip(calls(), before)]
        steps = stats()["steps"] - steps0
        assert steps >= n - 1, steps  # every decoded token is a step of rank 0's loop
        assert "decode" not in taken[0] and not {"decode", "prefill", "free"} & set(taken[1]), \
            taken
        # per request: submit on rank 0, admission on rank 1; per read of the stream: events
        assert set(taken[0]) <= {"submit", "events", "stats", "cancel"}, taken
        assert taken[0]["submit"] == 2 and taken[0]["events"] < 2 * (n - 1), taken


def test_a_tp_rank_killed_under_its_live_rank_0_resumes_every_request():
    """Kill rank 1 of the TP 2 decode instance running three streams (rank 0 lives on): its
    next step breaks the TP group, the instance is lost, and every one of its requests resumes
    on the other instance with the no-fault tokens; none hangs."""
    cfg, model = config(decode_instances=2, decode_tp=2)
    want = monolithic(PROMPTS, 120)
    with running_server(cfg, model, progress=lambda m: None) as (url, router):
        outs, threads = [], []
        for prompt in PROMPTS:
            out, started = {}, threading.Event()
            threads.append(_stream_in_thread(url, prompt, 120, out, started))
            outs.append(out)
            assert started.wait(30)
        end = time.monotonic() + 30
        while not (busy := [d for d in router.decode if d.inst.alive and d.stats.get("batched")]):
            assert time.monotonic() < end, "no decode instance started a request"
            time.sleep(0.01)
        ray.kill(busy[0].inst.ranks.actors[1])
        for t in threads:
            t.join(90)
        assert not any(t.is_alive() for t in threads), "a request hung after the rank died"
        assert [o.get("error") for o in outs] == [None] * 3
        assert [o["ids"] for o in outs] == want
        assert not busy[0].inst.alive and router.resumed >= 1
        assert sum(d.inst.alive for d in router.decode) == 1


def test_bad_input_cancellation_and_mixed_load_leave_nothing_behind():
    cfg, model = config()
    with running_server(cfg, model, progress=lambda m: None) as (url, router):
        async def one(client, i):
            kind = i % 5
            if kind == 0:   # bad input
                r = await client.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": -1})
                return ("bad", r.status_code)
            body = {"model": "tiny", "prompt": f"request {i} " * (1 + i % 7), "max_tokens": 4 + i % 9,
                    "temperature": 0.5 * (i % 3), "seed": i, "stream": True}
            async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    return ("status", r.status_code)
                lines = 0
                async for line in r.aiter_lines():
                    lines += line.startswith("data: ")
                    if kind == 1 and lines >= 2:   # client walks away mid-stream
                        return ("cancelled", 200)
                return ("done" if lines else "empty", r.status_code)

        async def main():
            limits = httpx.Limits(max_connections=64)
            async with httpx.AsyncClient(timeout=60, limits=limits) as client:
                return await asyncio.wait_for(asyncio.gather(*[one(client, i) for i in range(200)]), 180)
        results = asyncio.run(main())
        assert len(results) == 200
        assert all(code == 400 for kind, code in results if kind == "bad")
        assert all(kind in ("bad", "cancelled", "done") for kind, _ in results), \
            [r for r in results if r[0] not in ("bad", "cancelled", "done")][:5]
        # every pool returns to empty: decode ranks and prefill ranks (but for what their
        # prefix caches keep)
        deadline = time.monotonic() + 30
        while True:
            d = [x.inst.ranks.call("stats")[0] for x in router.decode]
            p = [x.inst.ranks.call("stats")[0] for x in router.prefill]
            empty = all(s["pages_free"] + s.get("prefix_entries", 0) == s["pages_total"]
                        and s["slots_free"] + s.get("prefix_checkpoints", 0) == s["slots_total"]
                        for s in d + p) and router.in_flight == 0
            if empty:
                break
            assert time.monotonic() < deadline, (d, p, router.in_flight)
            time.sleep(0.2)
