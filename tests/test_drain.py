"""`Router.drain` (what `pdserve serve` runs on SIGTERM/SIGINT) under the 200-request mixed
load, on real Ray and NIXL: once it starts new requests get 503; every admitted request ends
with all of its tokens or an error event (a 503 body when not streamed), none silently; and
every pool, decode and prefill, is empty afterwards."""
import asyncio
import json
import threading
import time

import httpx
import msgspec
import pytest
import ray

from pdserve.cluster.config import ServeConfig, validate
from pdserve.cluster.serve import running_server

from ports import free_port


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    yield
    if ray.is_initialized():
        ray.shutdown()


def config():
    cfg = ServeConfig()
    cfg = msgspec.structs.replace(
        cfg,
        prefill=msgspec.structs.replace(cfg.prefill, num_slots=33),
        decode=msgspec.structs.replace(cfg.decode, num_slots=33, max_batch=32),
        api=msgspec.structs.replace(cfg.api, port=free_port(), request_timeout_s=120),
        resources=msgspec.structs.replace(cfg.resources, cpus_per_rank=0.25, call_timeout_s=60))
    return cfg, validate(cfg)


async def one(client, url, i):
    """(outcome, detail) of request i: "tokens" (all of them), "ended" (an error event, or a
    503 body), "refused" (503 before admission, the drain had started); anything else is a
    request lost."""
    # every 10th cannot finish in the drain (20 of them fit the decode pool together)
    max_tokens = 500 if i % 10 == 0 else 4 + i % 9
    body = {"model": "tiny", "prompt": f"request {i} " * (1 + i % 7), "max_tokens": max_tokens,
            "temperature": 0.5 * (i % 3), "seed": i, "ignore_eos": True,
            "return_token_ids": True, "stream": i % 3 != 0}
    if not body["stream"]:
        r = await client.post(f"{url}/v1/completions", json=body)
        if r.status_code == 200:
            n = len(r.json()["choices"][0]["token_ids"])
            return ("tokens" if n == max_tokens else "short", n)
        if r.status_code == 503:
            msg = r.json()["error"]["message"]
            return ("ended" if "api.drain_s" in msg else "refused", msg)
        return ("status", r.status_code)
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            return ("refused" if r.status_code == 503 else "status", r.status_code)
        ids, errors, done = [], [], False
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    errors.append(chunk["error"])
                else:
                    ids += chunk["choices"][0].get("token_ids") or []
        if not done:
            return ("no [DONE]", ids)
        if errors:
            ok = errors[0]["code"] == 503 and "api.drain_s" in errors[0]["message"]
            return ("ended" if ok else "error", errors)
        return ("tokens" if len(ids) == max_tokens else "short", len(ids))


def test_drain_under_mixed_load_loses_nothing_and_empties_every_pool():
    cfg, model = config()
    with running_server(cfg, model, progress=lambda m: None) as (url, router):
        drained = {}

        def drain_when_busy():
            deadline = time.monotonic() + 120
            while router.in_flight < 20 and time.monotonic() < deadline:
                time.sleep(0.05)
            drained["result"] = router.drain(1.0)

        async def main():
            limits = httpx.Limits(max_connections=64)
            async with httpx.AsyncClient(timeout=180, limits=limits) as client:
                return await asyncio.wait_for(
                    asyncio.gather(*[one(client, url, i) for i in range(200)]), 300)
        drainer = threading.Thread(target=drain_when_busy, daemon=True)
        drainer.start()
        results = asyncio.run(main())
        drainer.join(60)
        assert not drainer.is_alive()
        kinds = [k for k, _ in results]
        assert set(kinds) <= {"tokens", "ended", "refused"}, \
            [r for r in results if r[0] not in ("tokens", "ended", "refused")][:5]
        finished, ended = drained["result"]
        assert kinds.count("ended") == ended >= 1 and kinds.count("refused") >= 1, \
            (drained, {k: kinds.count(k) for k in set(kinds)})
        assert router.in_flight == 0
        # every pool returns to empty: decode ranks and prefill ranks (where the prefix
        # cache's entries may keep their pages and checkpoint slots)
        # a state the drain's cancel did not reach is freed by its lease (prefill's lease_s,
        # 30 s), so the pools are given the lease and a margin
        deadline = time.monotonic() + 45
        while True:
            d = [x.inst.ranks.call("stats")[0] for x in router.decode]
            p = [x.inst.ranks.call("stats")[0] for x in router.prefill]
            if all(s["pages_free"] + s.get("prefix_entries", 0) == s["pages_total"]
                   and s["slots_free"] + s.get("prefix_checkpoints", 0) == s["slots_total"]
                   and not s.get("held") for s in d + p):
                break
            assert time.monotonic() < deadline, (d, p)
            time.sleep(0.2)
