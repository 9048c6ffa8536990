"""`pdserve serve` with a whole-instance prefill engine (the `vllm` engine's path), on CPU.

vLLM cannot run here, so the engine is a reference prefill instance of TP 1 given `VllmPrefill`'s
surface (`WholeReference`: ONE object is the instance, `info` lists its ranks' agents, `digests`
takes the source rank). Everything around it is the code `pdserve serve` runs for vLLM: the
engine actor and its placement (`start_engine_instance`), `Instance.digests` for an engine,
`assemble` (connect, decode slots, router), the router's failover when the engine actor dies,
and the in-process assembly the H200 test uses (`assemble_local`, `EngineRanks`, no Ray).
tests/gpu/test_vllm_serve.py runs the same in-process assembly with a real `VllmPrefill`.
"""
import asyncio
import subprocess
import sys
import threading
import time

import msgspec
import pytest
import ray

from pdserve.api.backend import BackendUnavailable
from pdserve.cluster.actors import start_engine_instance, start_instance
from pdserve.cluster.config import ServeConfig, validate
from pdserve.cluster.serve import assemble, assemble_local, decode_kwargs
from pdserve.model.config import preset
from pdserve.model.generate import ReferenceEngine, build_model
from pdserve.model.sampling import Request, SamplingParams
from pdserve.state.block_table import Topology

# Ray workers cannot import this test module: ship WholeReference by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

PROMPTS = ["Disaggregated prefill and decode ", "hi", "KDA + MLA hybrid state over NIXL, resharded"]
TOKENS = 10


class WholeReference:
    """A reference prefill instance (TP 1) as one whole-instance engine, `VllmPrefill`'s
    surface: what the engine-instance path runs on CPU in place of vLLM."""

    def __init__(self, instance: str, generation: int, kwargs: dict):
        from pdserve.prefill.engine import PrefillRank

        self.rank = PrefillRank(instance, 0, generation, **kwargs)
        self.prefills = 0

    def info(self):
        return [self.rank.info()]

    def connect(self, infos):
        self.rank.connect(infos)

    def prefill(self, requests, agents=None, threads=None):
        self.prefills += 1
        return self.rank.prefill(requests, agents, threads)

    def poll(self):
        return self.rank.poll()

    def cancel(self, request_id):
        return self.rank.cancel(request_id)

    def renew(self, request_id, lease_s):
        return self.rank.renew(request_id, lease_s)

    def digests(self, request_id, runs, rank=0):
        assert rank == 0, f"one rank, asked for rank {rank}"
        return self.rank.digests(request_id, runs)

    def stats(self):
        return {**self.rank.stats(), "prefills": self.prefills}

    def close(self):
        self.rank.close()


def config(prefill_instances=1):
    cfg = ServeConfig()
    cfg = msgspec.structs.replace(
        cfg, prefill=msgspec.structs.replace(cfg.prefill, instances=prefill_instances, num_slots=17),
        decode=msgspec.structs.replace(cfg.decode, num_slots=17, max_batch=16),
        transfer=msgspec.structs.replace(cfg.transfer, verify=True),  # digests via the engine
        resources=msgspec.structs.replace(cfg.resources, cpus_per_rank=0.25, call_timeout_s=60))
    return cfg, validate(cfg)


def common(cfg, model):
    return dict(config=model, seed=cfg.model.seed, checkpoint=None, device="cpu",
                dtype=cfg.model.dtype)


def prefill_kwargs(cfg, model):
    return dict(common(cfg, model), layout=cfg.layout(cfg.prefill.conv_layout),
                num_pages=cfg.prefill.num_pages, num_slots=cfg.prefill.num_slots,
                lease_s=cfg.transfer.lease_s, decode_topology=Topology(cfg.decode.tp))


def monolithic(prompts, max_tokens):
    eng = ReferenceEngine(build_model(preset("tiny"), seed=0))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return [s.output for s in eng.generate([list(p.encode()) for p in prompts], params)]


async def _generate(router, rid, prompt, max_tokens):
    out = []
    req = Request(rid, list(prompt.encode()), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    async for ev in router.generate(req, 60.0):
        assert ev.finish_reason != "error", ev.error
        if ev.token is not None:
            out.append(ev.token)
    return out


def generate_all(router, prompts, max_tokens, tag):
    """Every prompt at once through the router (one event loop): token ids per prompt."""
    async def main():
        return await asyncio.gather(*[_generate(router, f"{tag}-{i}", p, max_tokens)
                                      for i, p in enumerate(prompts)])
    return asyncio.run(main())


def test_engine_actors_serve_the_monolithic_tokens_and_fail_over(ray_session):
    cfg, model = config(prefill_instances=2)
    want = monolithic(PROMPTS, TOKENS)
    res = cfg.resources
    insts = []
    router = None
    try:
        for i in range(2):
            insts.append(start_engine_instance(
                f"prefill-{i}", 0, WholeReference, (prefill_kwargs(cfg, model),), res.cpus_per_rank,
                0, res.call_timeout_s, 120, {"PDSERVE_ENGINE_TEST": "1"}))
        assert all(p.engine and len(p.agents) == 1 and p.ranks.size == 1 for p in insts)
        decode = start_instance("decode", "decode-0", 0, 1,
                                dict(common(cfg, model), **decode_kwargs(cfg)),
                                res.cpus_per_rank, 0, res.call_timeout_s, 1)
        insts.append(decode)
        router = assemble(cfg, model, insts[:2], [decode])
        assert generate_all(router, PROMPTS, TOKENS, "a") == want

        # the engine actor of prefill-0 dies: requests go to prefill-1, tokens unchanged
        ray.kill(insts[0].ranks.actors[0])
        assert generate_all(router, PROMPTS[:2], TOKENS, "b") == want[:2]
        assert not insts[0].alive and insts[1].alive
        assert insts[1].ranks.call("stats")[0]["prefills"] >= 1
        # the transfers were verified (digests from the engine actor) and nothing failed
        stats = decode.ranks.call("stats")[0]
        assert stats.get("transfer_failures", 0) == 0

        # no prefill instance left: a clear 503, not a hang
        ray.kill(insts[1].ranks.actors[0])
        with pytest.raises(BackendUnavailable, match="no live prefill instance"):
            generate_all(router, PROMPTS[:1], TOKENS, "c")
    finally:
        if router is not None:
            asyncio.run(router.close())
        for inst in insts:
            inst.kill()


def test_an_engine_actor_that_cannot_be_created_frees_its_placement_group(ray_session):
    """Arguments that do not pickle make actor creation raise: the caller gets that error and
    the instance's placement group (its CPUs/GPUs) is given back, not leaked."""
    from ray.util import placement_group_table

    before = {k for k, v in placement_group_table().items() if v["state"] != "REMOVED"}
    with pytest.raises(TypeError):
        start_engine_instance("prefill-unpicklable", 0, WholeReference, (threading.Lock(),),
                              1, 0, 30.0, 30.0)
    deadline = time.monotonic() + 10  # removal is asynchronous
    while (live := {k for k, v in placement_group_table().items()
                    if v["state"] != "REMOVED"}) != before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert live == before, placement_group_table()


def test_an_in_process_engine_call_waits_for_a_running_one_only_until_the_deadline():
    """`EngineRanks` runs one call at a time (vLLM is not thread-safe); a call that cannot start
    within the deadline fails as a lost instance instead of queueing forever."""
    from pdserve.cluster.actors import EngineRanks, InstanceLost

    release = threading.Event()

    class Slow:
        def stats(self):
            release.wait(30)
            return "done"

    ranks = EngineRanks("prefill-slow", Slow(), timeout_s=0.3)
    first = threading.Thread(target=ranks.call, args=("stats",))
    first.start()
    time.sleep(0.1)
    try:
        with pytest.raises(InstanceLost, match="could not start within 0.3 s"):
            ranks.call("stats")
    finally:
        release.set()
        first.join(10)
    assert ranks.call("stats") == ["done"]


def test_in_process_assembly_without_ray_serves_the_monolithic_tokens():
    """What tests/gpu/test_vllm_serve.py runs on the H200 (no Ray there), with the reference
    engine: `assemble_local` over an in-process engine (calls serialised by `EngineRanks`) and a
    decode rank, requests in flight together."""
    from pdserve.decode.rank import DecodeRank

    cfg, model = config()
    want = monolithic(PROMPTS, TOKENS)
    engine = WholeReference("prefill-0", 0, prefill_kwargs(cfg, model))
    rank = DecodeRank("decode-0", 0, **common(cfg, model), **decode_kwargs(cfg))
    router = assemble_local(cfg, model, [engine], [rank])
    try:
        assert generate_all(router, PROMPTS, TOKENS, "local") == want
        assert engine.prefills >= 1
    finally:
        asyncio.run(router.close())
        for inst in router.instances:
            inst.kill()


def test_the_serving_modules_import_without_ray():
    """The H200 has no Ray: the router, the actors module and serve's assembly must import
    without it (Ray is imported where an actor is started)."""
    code = ("import sys; sys.modules['ray'] = None\n"  # any `import ray` now fails
            "import pdserve.cluster.serve, pdserve.cluster.router, pdserve.cluster.actors\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def test_logprobs_are_a_400_naming_the_field_on_the_vllm_engine():
    """vLLM prefills the prompt and samples the first token without logprobs, so a deployment
    with prefill.engine = "vllm" refuses them (chat, completions, echo) with a 400 that names
    `logprobs`, decided from the config; echo alone and the reference engine still serve."""
    import openai

    from pdserve.api.backend import LocalBackend
    from pdserve.api.server import create_app
    from pdserve.api.serving import serve_in_thread
    from pdserve.api.tokenizer import ByteLevelTokenizer
    from pdserve.cluster.serve import app_options

    ref = ServeConfig()
    vllm_cfg = msgspec.structs.replace(ref, prefill=msgspec.structs.replace(ref.prefill,
                                                                            engine="vllm"))
    assert vllm_cfg.vllm and not ref.vllm
    model = build_model(preset("tiny"), seed=0)
    chat = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                logprobs=True, top_logprobs=2)
    for cfg in (vllm_cfg, ref):
        backend = LocalBackend(ReferenceEngine(model), model_name="tiny", max_batch=4,
                               max_queue=8)
        app = create_app(backend, ByteLevelTokenizer(), **app_options(cfg))
        with serve_in_thread(app, startup_s=30, shutdown_s=30) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                   timeout=30)
            echo = client.completions.create(model="tiny", prompt="abc", max_tokens=2,
                                             echo=True)
            assert echo.choices[0].text.startswith("abc")
            if cfg is ref:  # the same requests are served where logprobs exist
                got = client.chat.completions.create(**chat).choices[0].logprobs.content
                assert len(got) == 3 and all(len(e.top_logprobs) == 2 for e in got)
                continue
            for call, kw in ((client.chat.completions.create, chat),
                             (client.completions.create,
                              dict(model="tiny", prompt="abc", max_tokens=1, logprobs=0)),
                             (client.completions.create,
                              dict(model="tiny", prompt="abc", max_tokens=0, echo=True,
                                   logprobs=1))):
                with pytest.raises(openai.BadRequestError) as err:
                    call(**kw)
                assert err.value.param == "logprobs", err.value
                assert 'prefill.engine = "vllm"' in err.value.message
