"""Monolithic mode (`mode = "monolithic"`) on real Ray: instances whose ranks prefill and decode
themselves, served through the same router and HTTP API as the disaggregated cluster. The openai
client gets exactly the reference generate loop's tokens (greedy and seeded), at TP 1 and TP 2; a
rank killed mid-stream resumes on the other instance with the no-fault tokens; pools end empty."""
import time

import httpx
import msgspec
import pytest
import ray

from pdserve.cluster.config import ServeConfig, validate
from pdserve.cluster.serve import running_server
from pdserve.cluster.actors import RemoteServer
from pdserve.model.sampling import SamplingParams

from ports import free_port
from test_cluster import PROMPTS, assert_kill_resumes, completion_ids, monolithic

openai = pytest.importorskip("openai")

SEEDED = dict(temperature=0.9, top_p=0.95, seed=1234)


def config(instances=1, tp=1):
    cfg = ServeConfig(mode="monolithic")
    cfg = msgspec.structs.replace(
        cfg,
        decode=msgspec.structs.replace(cfg.decode, instances=instances, tp=tp, num_slots=33,
                                       max_batch=32),
        api=msgspec.structs.replace(cfg.api, port=free_port(), request_timeout_s=60),
        # a killed instance stays dead here (tests/test_self_healing.py watches the rebuild)
        resources=msgspec.structs.replace(cfg.resources, cpus_per_rank=0.25, call_timeout_s=60,
                                          rebuild=False))
    return cfg, validate(cfg)


def reference(prompt, max_tokens, **params):
    """The monolithic reference generate loop's tokens (`test_cluster.monolithic`)."""
    return monolithic([prompt], max_tokens, SamplingParams(max_tokens=max_tokens, **params))[0]


def seeded_ids(client, prompt, max_tokens):
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                    extra_body={"top_k": 50, "return_token_ids": True,
                                                "ignore_eos": True}, **SEEDED)
    return out.choices[0].token_ids


def assert_pools_empty(router, timeout=30.0):
    deadline = time.monotonic() + timeout
    while True:
        stats = [s for d in router.decode if d.inst.alive for s in d.inst.ranks.call("stats")]
        if router.in_flight == 0 and all(s["pages_free"] == s["pages_total"] and s["slots_free"]
                                         == s["slots_total"] and s["running"] == 0 for s in stats):
            return
        assert time.monotonic() < deadline, (stats, router.in_flight)
        time.sleep(0.1)


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    yield
    if ray.is_initialized():
        ray.shutdown()


def test_two_tp1_instances_give_the_reference_tokens_and_survive_a_death():
    cfg, model = config(instances=2)
    want_long = reference(PROMPTS[0], 150)
    with running_server(cfg, model, progress=lambda m: None) as (url, router):
        assert router.monolithic and not router.prefill and len(router.decode) == 2
        # each instance runs its own decode loop (in its rank-0 actor), not the router
        assert all(isinstance(d.server, RemoteServer) and d.inst.role == "monolithic"
                   for d in router.decode)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=60)
        for prompt in PROMPTS:
            want = reference(prompt, 12)
            assert completion_ids(client, prompt, 12, stream=False) == want
            assert completion_ids(client, prompt, 12, stream=True) == want
        assert seeded_ids(client, PROMPTS[1], 10) == reference(PROMPTS[1], 10, top_k=50, **SEEDED)
        assert_pools_empty(router)

        # kill the instance streaming a request: it resumes on the other, same tokens
        assert_kill_resumes(url, router, PROMPTS[0], 150, want_long)
        assert_pools_empty(router)

        # the last instance dies: /health names the monolithic pool
        for a in next(d for d in router.decode if d.inst.alive).inst.ranks.actors:
            ray.kill(a)
        deadline = time.monotonic() + 30
        while (health := httpx.get(f"{url}/health", timeout=10)).status_code != 503:
            assert time.monotonic() < deadline, health.text
            time.sleep(0.2)
        assert "no live monolithic instance" in health.text


def test_tp2_instance_gives_the_reference_tokens():
    cfg, model = config(tp=2)
    with running_server(cfg, model, progress=lambda m: None) as (url, router):
        assert router.decode[0].inst.ranks.size == 2
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=60)
        assert completion_ids(client, PROMPTS[2], 12, stream=True) == reference(PROMPTS[2], 12)
        assert seeded_ids(client, PROMPTS[0], 10) == reference(PROMPTS[0], 10, top_k=50, **SEEDED)
        assert_pools_empty(router)
