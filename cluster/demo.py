"""`pdserve demo`: start the cluster (by default the trained `demo` model, `DEMO_CONFIG`),
stream a few concurrent requests, show each prompt and its continuation as text (the first
request's as it streams) and a summary of TTFT, inter-token latency and throughput, then exit."""
from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

from pdserve.cluster.serve import running_server
from pdserve.model.train_demo import PROMPTS

DEMO_CONFIG = Path(__file__).resolve().parent / "configs" / "local-demo.toml"
INDENT = "    "
# Greedy, with a presence penalty: the small demo model, greedy alone, loops on a phrase
# ("the same as the same as ...")
PRESENCE_PENALTY = 0.8


def shown(i: int, prompt: str, text: str) -> str:
    """Request i as it reads: the prompt, then its continuation on a "... " line (the
    continuation's own line breaks indented under it)."""
    return f"[{i}] {prompt}\n...{text}".replace("\n", "\n" + INDENT)


async def _one(client, url, model, i, prompt, max_tokens, timeout, echo):
    """Stream request i; `echo` writes its text to stdout as it arrives."""
    t0 = time.perf_counter()
    stamps, text = [], []
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "presence_penalty": PRESENCE_PENALTY, "stream": True, "ignore_eos": True,
            "return_token_ids": True}
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            raise RuntimeError(f"request {i}: HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"request {i}: {chunk['error']}")
            choice = chunk["choices"][0]
            piece = choice.get("text", "")
            stamps += [time.perf_counter() - t0] * len(choice.get("token_ids") or [])
            text.append(piece)
            if echo:
                sys.stdout.write(piece.replace("\n", "\n" + INDENT))
                sys.stdout.flush()
    return stamps, "".join(text)


async def _run(url, model, n, max_tokens, timeout):
    async with httpx.AsyncClient() as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*[_one(client, url, model, i, PROMPTS[i % len(PROMPTS)],
                                              max_tokens, timeout, echo=i == 0)
                                         for i in range(n)])
        return results, time.perf_counter() - t0


def run_demo(cfg, model, n: int, max_tokens: int, address=None) -> int:
    if n < 1 or max_tokens < 1:
        raise ValueError("--requests and --max-tokens must be >= 1")
    with running_server(cfg, model, address, progress=lambda m: print(m, flush=True)) as (url, router):
        print(f"cluster up; server at {url}/v1 — {n} concurrent streaming requests of "
              f"{max_tokens} tokens, greedy with presence_penalty {PRESENCE_PENALTY}; "
              "request 0 streams here:\n", flush=True)
        print(shown(0, PROMPTS[0], ""), end="", flush=True)
        results, wall = asyncio.run(_run(url, cfg.model.name, n, max_tokens, cfg.api.request_timeout_s))
        print("\n")
        for i, (_, text) in enumerate(results[1:], start=1):
            print(shown(i, PROMPTS[i % len(PROMPTS)], text) + "\n")
        ttft = [s[0] for s, _ in results if s]
        itl = [b - a for s, _ in results for a, b in zip(s, s[1:]) if b > a]
        tokens = sum(len(s) for s, _ in results)
        print(f"summary: {n} requests, {tokens} tokens in {wall:.2f} s "
              f"({tokens / wall:.1f} tokens/s)")
        print(f"  TTFT  p50 {statistics.median(ttft) * 1e3:.1f} ms, max {max(ttft) * 1e3:.1f} ms")
        if itl:
            q = statistics.quantiles(itl, n=10) if len(itl) > 1 else [itl[0]] * 9
            print(f"  inter-token latency p50 {statistics.median(itl) * 1e3:.1f} ms, "
                  f"p90 {q[8] * 1e3:.1f} ms")
        if cfg.monolithic:
            print("  transfers: none (monolithic mode: each instance prefills and decodes)")
        else:
            st = router.stats()
            print(f"  transfers: {int(st.get('transfers', 0))}, bytes by kind: " + ", ".join(
                f"{k[len('transfer_bytes_'):]} {int(v)}" for k, v in st.items()
                if k.startswith("transfer_bytes_")))
    return 0
