"""Self-healing on real Ray and NIXL: a rank killed with SIGKILL takes its instance down, the
router tears it down and starts its next generation while the rest serve; `/health` says
"degraded" (200) with live / configured counts meanwhile, 503 only while a kind has no live
instance; `/metrics` counts the rebuilds."""
import json
import os
import re
import signal
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

PROMPT = "Disaggregated prefill and decode "


def config(decode_instances=1):
    cfg = ServeConfig()
    cfg = msgspec.structs.replace(
        cfg,
        prefill=msgspec.structs.replace(cfg.prefill, instances=1, num_slots=33),
        decode=msgspec.structs.replace(cfg.decode, instances=decode_instances, num_slots=33,
                                       max_batch=32),
        api=msgspec.structs.replace(cfg.api, port=free_port(), request_timeout_s=60),
        resources=msgspec.structs.replace(cfg.resources, cpus_per_rank=0.25, call_timeout_s=60))
    assert cfg.resources.rebuild  # the default
    return cfg, validate(cfg)


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    yield
    if ray.is_initialized():
        ray.shutdown()


def reference(prompt, max_tokens):
    eng = ReferenceEngine(build_model(preset("tiny"), seed=0))
    return eng.generate([list(prompt.encode())], SamplingParams(max_tokens=max_tokens))[0].output


def completion(url, prompt, max_tokens):
    r = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "return_token_ids": True, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def stream_in_thread(url, prompt, max_tokens, out):
    """A streamed completion in a thread: its token ids, error events and [DONE] in `out`."""
    def run():
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "return_token_ids": True, "ignore_eos": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=90) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    out["done"] = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        out.setdefault("errors", []).append(chunk["error"])
                    else:
                        out["ids"] = out.get("ids", []) + chunk["choices"][0]["token_ids"]
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def health(url):
    r = httpx.get(f"{url}/health", timeout=30)
    return r.status_code, r.json()


def wait_health(url, until, timeout=240.0, seen=None):
    """Poll /health until `until(code, body)` and return both; every (status code, status,
    capacity) seen goes to `seen`."""
    deadline = time.monotonic() + timeout
    while True:
        code, body = health(url)
        if seen is not None:
            seen.append((code, body["status"], body["capacity"]))
        if until(code, body):
            return code, body
        assert time.monotonic() < deadline, (code, body)
        time.sleep(0.1)


def restarts(url, kind):
    text = httpx.get(f"{url}/metrics", timeout=30).text
    m = re.search(rf'^pdserve_instance_restarts_total{{kind="{kind}"}} (\S+)$', text, re.M)
    assert m, text
    return float(m[1])


def test_a_killed_decode_rank_then_prefill_rank_come_back_by_themselves():
    """The default topology (one instance of each kind): kill -9 of the decode rank under a
    stream ends that stream with an error event (no decode instance is left to resume on), the
    instance is rebuilt and the same server serves the reference tokens again; then the same
    for the prefill rank."""
    cfg, model = config()
    want = reference(PROMPT, 8)
    with running_server(cfg, model, progress=lambda m: None) as (url, router):
        assert health(url)[1]["capacity"] == {
            "prefill": {"live": 1, "configured": 1, "restarts": 0},
            "decode": {"live": 1, "configured": 1, "restarts": 0}}
        assert restarts(url, "decode") == restarts(url, "prefill") == 0
        old = router.decode[0].inst
        out = {}
        t = stream_in_thread(url, PROMPT, 4000, out)
        deadline = time.monotonic() + 60
        while len(out.get("ids", [])) < 3:  # decode is streaming it
            assert time.monotonic() < deadline and t.is_alive(), out
            time.sleep(0.05)
        os.kill(old.pids[0], signal.SIGKILL)
        t.join(90)
        assert not t.is_alive() and out["status"] == 200 and out.get("done"), out
        # no token lost silently: an error event ends it (or it resumed and got all of them)
        assert out.get("errors") or len(out["ids"]) == 4000, out
        seen = []
        _, body = wait_health(url, lambda c, b: c == 200 and b["status"] == "ok"
                              and b["capacity"]["decode"]["restarts"] == 1, seen=seen)
        assert body["capacity"]["decode"] == {"live": 1, "configured": 1, "restarts": 1}
        new = router.decode[0].inst
        assert new.generation == old.generation + 1 and new.pids != old.pids
        assert not old.alive and new.alive
        assert completion(url, PROMPT, 8) == want
        assert restarts(url, "decode") == 1 and restarts(url, "prefill") == 0

        old = router.prefill[0].inst
        os.kill(old.pids[0], signal.SIGKILL)
        wait_health(url, lambda c, b: c == 200 and b["status"] == "ok"
                    and b["capacity"]["prefill"]["restarts"] == 1)
        new = router.prefill[0].inst
        assert new.generation == old.generation + 1 and new.pids != old.pids
        assert completion(url, PROMPT, 8) == want  # prefilled on the new generation
        assert restarts(url, "prefill") == 1 and restarts(url, "decode") == 1
        # while the only instance of a kind was down, /health was 503, never "degraded"
        assert all(code == 503 for code, status, _ in seen if status != "ok"), seen


def test_health_is_degraded_while_one_of_two_decode_instances_is_rebuilt():
    cfg, model = config(decode_instances=2)
    want = reference(PROMPT, 8)
    with running_server(cfg, model, progress=lambda m: None) as (url, router):
        victim = router.decode[1].inst
        os.kill(victim.pids[0], signal.SIGKILL)
        code, body = wait_health(url, lambda c, b: b["status"] != "ok")
        assert code == 200 and body["status"] == "degraded", body
        assert body["capacity"]["decode"]["live"] == 1
        assert body["capacity"]["decode"]["configured"] == 2
        assert body["capacity"]["prefill"] == {"live": 1, "configured": 1, "restarts": 0}
        # the live instance serves meanwhile
        assert completion(url, PROMPT, 8) == want
        _, body = wait_health(url, lambda c, b: c == 200 and b["status"] == "ok")
        assert body["capacity"]["decode"] == {"live": 2, "configured": 2, "restarts": 1}
        assert router.decode[1].inst.generation == 1 and restarts(url, "decode") == 1
        assert completion(url, PROMPT, 8) == want
