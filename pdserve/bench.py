"""`pdserve bench`: a load generator for a running OpenAI-compatible server.

For each concurrency level it sends N streaming `/v1/completions` requests, never more than that
many in flight, and measures on the client side:

- TTFT: request sent -> first output token received.
- ITL (inter-token latency): the gap between consecutive streamed chunks that carry tokens.
- per-user tokens/s ("interactivity"): (output tokens - 1) / (last token time - first token time),
  the rate one user's stream flows once it has started (1 / TPOT). "P90 interactivity" is the
  rate that 90 % of requests meet or exceed, i.e. the 10th percentile of the per-user rates.
- throughput: the output tokens of the level's successful requests / the level's wall time.

Requests are greedy (`temperature: 0`) with `ignore_eos: true`, so each one produces exactly its
`max_tokens`; `return_token_ids` lets tokens be counted exactly (a server without it: one token
per non-empty chunk) and `stream_options.include_usage` has the server report the prompt's token
count. Prompts are random printable ASCII: for the byte-level `tiny` model one character is one
token; for other tokenizers the requested prompt lengths are approximate (the JSON records what
the server counted).

Workloads: `fixed` (--prompt-tokens in, --output-tokens out), `uniform` (lengths uniform in
[--prompt-tokens, --prompt-tokens-max] and [--output-tokens, --output-tokens-max]), `agentic`
(one --prefix-tokens prefix shared by every request + a random --suffix-tokens suffix each: agents
whose system prompt and tool context repeat across turns), `multiturn` (conversations, one per
request in flight, each turn one request: the first turn is the shared prefix + a suffix, every
next one the previous turn's prompt + its answer + a new --suffix-tokens suffix).

Where the server exports the prefix cache's metrics (`pdserve_prefix_cache_*` on /metrics), each
level also records the cache's hits, misses and tokens saved during it, its hit rate and the
prompt tokens prefilled (`pdserve_prompt_tokens_total` less the tokens saved); the unmeasured
first request has primed the cache with the shared prefix, so a level's hit rate is that of the
requests after the first.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import importlib.util
import json
import platform
import random
import re
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from importlib.metadata import version
from pathlib import Path

import httpx
import numpy as np

PRINTABLE = "".join(map(chr, range(32, 127)))
WORKLOADS = ("fixed", "uniform", "agentic", "multiturn")
PREFIXED = ("agentic", "multiturn")
DEFINITIONS = {
    "ttft_s": "request sent -> first output token received",
    "itl_s": "gap between consecutive streamed chunks carrying output tokens",
    "interactivity_tok_s": "per user: (output tokens - 1) / (last token time - first token "
                           "time); p90 = the rate 90% of requests meet or exceed (10th percentile)",
    "throughput_tok_s": "output tokens of successful requests / the level's wall time",
    "prefix_hit_rate": "prefix cache hits / lookups during the level (server's /metrics)",
    "prefill_tokens_computed": "prompt tokens the level's requests brought less those their "
                               "prefix cache hits spared (server's /metrics)",
}


class ServerUnavailable(RuntimeError):
    """The server cannot be reached or says it is unhealthy."""


@dataclass(frozen=True)
class Workload:
    kind: str = "fixed"
    prompt_tokens: int = 128             # fixed; uniform: the minimum
    output_tokens: int = 32              # every workload; uniform: the minimum
    prompt_tokens_max: int | None = None  # uniform; None = 2 x the minimum
    output_tokens_max: int | None = None
    prefix_tokens: int = 2048            # agentic, multiturn
    suffix_tokens: int = 256
    turn_tokens: int | None = None       # multiturn: new tokens per later turn (None: suffix)

    @property
    def new_tokens(self) -> int:
        return self.suffix_tokens if self.turn_tokens is None else self.turn_tokens

    def check(self) -> None:
        if self.kind not in WORKLOADS:
            raise ValueError(f"--workload must be one of {', '.join(WORKLOADS)}; got {self.kind!r}")
        for name in ("prompt_tokens", "output_tokens", "prefix_tokens", "suffix_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{_flag(name)} must be >= 1, got {getattr(self, name)}")
        if self.turn_tokens is not None and self.turn_tokens < 1:
            raise ValueError(f"--turn-tokens must be >= 1, got {self.turn_tokens}")
        for name, low in (("prompt_tokens_max", "prompt_tokens"),
                          ("output_tokens_max", "output_tokens")):
            value = getattr(self, name)
            if value is not None and value < getattr(self, low):
                raise ValueError(f"{_flag(name)}={value} must be >= {_flag(low)}="
                                 f"{getattr(self, low)}")

    def ranges(self, turns: int = 1) -> tuple[tuple[int, int], tuple[int, int]]:
        """(prompt, output) length ranges, inclusive (multiturn: over `turns` turns)."""
        if self.kind == "multiturn":
            n = self.prefix_tokens + self.suffix_tokens
            return ((n, n + (turns - 1) * (self.output_tokens + self.new_tokens)),
                    (self.output_tokens, self.output_tokens))
        if self.kind == "agentic":
            n = self.prefix_tokens + self.suffix_tokens
            return (n, n), (self.output_tokens, self.output_tokens)
        if self.kind == "uniform":
            return ((self.prompt_tokens, self.prompt_tokens_max or 2 * self.prompt_tokens),
                    (self.output_tokens, self.output_tokens_max or 2 * self.output_tokens))
        return (self.prompt_tokens,) * 2, (self.output_tokens,) * 2

    def describe(self) -> dict:
        (p_lo, p_hi), (o_lo, o_hi) = self.ranges()
        out = {"kind": self.kind, "prompt_tokens": [p_lo, p_hi], "output_tokens": [o_lo, o_hi]}
        if self.kind in PREFIXED:
            out |= {"prefix_tokens": self.prefix_tokens, "suffix_tokens": self.suffix_tokens}
        if self.kind == "multiturn":
            out["turn_tokens"] = self.new_tokens
        return out

    def sample(self, n: int, rng: random.Random) -> list[tuple[str, int]]:
        """n (prompt, max_tokens) pairs."""
        def text(k: int) -> str:
            return "".join(rng.choices(PRINTABLE, k=k))
        (p_lo, p_hi), (o_lo, o_hi) = self.ranges()
        if self.kind in PREFIXED:  # multiturn: each conversation's first turn
            prefix = text(self.prefix_tokens)
            return [(prefix + text(self.suffix_tokens), o_lo) for _ in range(n)]
        return [(text(rng.randint(p_lo, p_hi)), rng.randint(o_lo, o_hi)) for _ in range(n)]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass
class _Result:
    prompt_tokens: int                  # the server's count when it reports usage
    max_tokens: int
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    decode_s: float | None = None       # first -> last token
    itl_s: list[float] = field(default_factory=list)
    text: str = ""                      # the answer (multiturn: the next turn's context)
    error: str | None = None            # kind: http_<status>, error_event, timeout, ...
    detail: str | None = None

    def fail(self, kind: str, detail: str) -> _Result:
        self.error, self.detail = kind, detail
        return self

    def user_tok_s(self) -> float | None:
        if self.output_tokens < 2 or not self.decode_s:
            return None
        return (self.output_tokens - 1) / self.decode_s


async def _request(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int,
                   timeout: float) -> _Result:
    res = _Result(len(prompt), max_tokens)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    finished = False
    try:
        async with asyncio.timeout(timeout):  # the request's deadline, however slow the stream
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    return res.fail(f"http_{resp.status_code}", resp.text[:300])
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        break
                    event = json.loads(line[6:])
                    if "error" in event:
                        return res.fail("error_event", str(event["error"].get("message")))
                    if event.get("usage"):
                        res.prompt_tokens = event["usage"]["prompt_tokens"]
                    for choice in event["choices"]:
                        res.text += choice.get("text") or ""
                        n = len(choice["token_ids"]) if "token_ids" in choice \
                            else int(bool(choice.get("text")))
                        if n:
                            now = time.perf_counter()
                            if first is None:
                                first = now
                            else:
                                res.itl_s.append(now - last)
                            last = now
                            res.output_tokens += n
                        finished = finished or choice.get("finish_reason") is not None
    except (TimeoutError, httpx.TimeoutException):
        return res.fail("timeout", f"no complete answer within {timeout:.1f} s")
    except httpx.HTTPError as exc:
        return res.fail("transport", f"{type(exc).__name__}: {exc}")
    except (ValueError, KeyError, TypeError) as exc:
        return res.fail("bad_event", f"unparseable stream event: {exc!r}")
    res.e2e_s = time.perf_counter() - t0
    if first is not None:
        res.ttft_s, res.decode_s = first - t0, last - first
    if not finished:
        return res.fail("incomplete", "the stream ended without a finish_reason")
    if res.output_tokens != max_tokens:
        return res.fail("wrong_length", f"{res.output_tokens} output tokens, asked {max_tokens}")
    return res


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _summary(concurrency: int, results: list[_Result], wall_s: float) -> dict:
    ok = [r for r in results if r.error is None]
    ttft = [r.ttft_s for r in ok]
    itl = [g for r in ok for g in r.itl_s]
    user = [u for r in ok if (u := r.user_tok_s()) is not None]
    e2e = [r.e2e_s for r in ok]
    tokens = sum(r.output_tokens for r in ok)
    return {
        "concurrency": concurrency, "requests": len(results), "ok": len(ok),
        "errors": dict(Counter(r.error for r in results if r.error)),
        # the first message of each kind (reversed: earlier entries overwrite later ones)
        "error_examples": {r.error: r.detail for r in reversed(results) if r.error},
        "output_tokens": tokens, "wall_s": wall_s, "throughput_tok_s": tokens / wall_s,
        "ttft_p50_s": _pct(ttft, 50), "ttft_p90_s": _pct(ttft, 90),
        "itl_p50_s": _pct(itl, 50), "itl_p90_s": _pct(itl, 90),
        "e2e_p50_s": _pct(e2e, 50), "e2e_p90_s": _pct(e2e, 90),
        "interactivity_p50_tok_s": _pct(user, 50),
        "interactivity_p90_tok_s": _pct(user, 10),  # what 90 % of users meet or exceed
        "records": [{k: v for k, v in asdict(r).items() if k not in ("itl_s", "text")}
                    | {"user_tok_s": r.user_tok_s()} for r in results],
    }


async def _level(client, model, prompts, concurrency, timeout, run_deadline, bar,
                 turns: Workload | None = None, rng: random.Random | None = None) -> dict:
    """`turns`: a multiturn workload: worker w holds conversation w, whose next turn extends
    its last prompt and answer (`prompts[w]` is its first turn)."""
    loop = asyncio.get_running_loop()
    results: list[_Result] = [None] * len(prompts)
    todo = iter(range(len(prompts)))  # shared by the workers: each index is taken once
    before = await _cache_metrics(client)

    async def worker(w: int):
        history = None
        for i in todo:
            prompt, max_tokens = prompts[w if turns and history is None else i]
            if turns and history is not None:
                prompt = history + "".join(rng.choices(PRINTABLE, k=turns.new_tokens))
            left = run_deadline - loop.time()
            if left > 0:
                results[i] = await _request(client, model, prompt, max_tokens, min(timeout, left))
            else:
                results[i] = _Result(len(prompt), max_tokens).fail(
                    "run_deadline", "not sent: the run's --max-duration had passed")
            history = prompt + results[i].text
            bar.update()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    out = _summary(concurrency, results, time.perf_counter() - t0)
    after = await _cache_metrics(client)
    if after and before is not None:
        d = {k: after[k] - before.get(k, 0) for k in after}
        looked = d.get("prefix_cache_hits_total", 0) + d.get("prefix_cache_misses_total", 0)
        saved = d.get("prefix_cache_tokens_saved_total", 0)
        out |= {"prefix_hits": d.get("prefix_cache_hits_total", 0),
                "prefix_misses": d.get("prefix_cache_misses_total", 0),
                "prefix_tokens_saved": saved,
                "prefix_hit_rate": d.get("prefix_cache_hits_total", 0) / looked if looked
                else None,
                "prefill_tokens_computed": d.get("prompt_tokens_total", 0) - saved}
    return out


_METRIC = re.compile(r"^pdserve_(prompt_tokens_total|prefix_cache_\w+_total) (\S+)$", re.M)


async def _cache_metrics(client: httpx.AsyncClient) -> dict[str, float] | None:
    """The server's prompt-token and prefix-cache counters (None: no /metrics)."""
    try:
        r = await client.get("/metrics", timeout=10.0)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    return {m[1]: float(m[2]) for m in _METRIC.finditer(r.text)}


async def _server_model(client: httpx.AsyncClient, url: str, model: str | None) -> tuple[str, int]:
    """Check /health, then pick the model: (name, its max context or 0 if unknown)."""
    try:
        health = await client.get("/health", timeout=3.0)
        models = (await client.get("/v1/models", timeout=10.0)).json()["data"]
    except httpx.HTTPError as exc:
        raise ServerUnavailable(f"cannot reach the server at {url} ({type(exc).__name__}: {exc}); "
                                f"is `pdserve serve` running? (set --url)") from None
    except (ValueError, KeyError) as exc:
        raise ServerUnavailable(f"{url}/v1/models did not answer a model list ({exc!r})") from None
    if health.status_code != 200:
        raise ServerUnavailable(f"the server at {url} is not healthy: GET /health answered "
                                f"{health.status_code} {health.text[:200]}")
    served = {m["id"]: m.get("max_model_len") or 0 for m in models}
    if model is None:
        if not served:
            raise ServerUnavailable(f"the server at {url} serves no model")
        model = next(iter(served))
    if model not in served:
        raise ValueError(f"--model {model!r} is not served at {url}; it serves {sorted(served)}")
    return model, served[model]


def _check(url: str, concurrency_levels, n: int, timeout: float, max_duration: float) -> None:
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--url must be an http:// or https:// URL, got {url!r}")
    if not concurrency_levels or min(concurrency_levels) < 1:
        raise ValueError(f"--concurrency needs levels >= 1, got {list(concurrency_levels)}")
    if n < 1:
        raise ValueError(f"--requests must be >= 1, got {n}")
    if timeout <= 0 or max_duration <= 0:
        raise ValueError(f"--timeout and --max-duration must be > 0, got {timeout}, {max_duration}")


async def _bench(url, workload, levels, n, model, timeout, max_duration, seed, progress) -> dict:
    from tqdm import tqdm

    # trust_env=False: talk to the given URL only, never through a proxy from the environment.
    async with httpx.AsyncClient(base_url=url, trust_env=False,
                                 timeout=httpx.Timeout(timeout, connect=5.0),
                                 limits=httpx.Limits(max_connections=max(levels))) as client:
        model, max_len = await _server_model(client, url, model)
        turns = -(-n // min(levels))  # multiturn: a level's longest conversation
        (_, p_hi), (_, o_hi) = workload.ranges(turns)
        if max_len and p_hi + o_hi > max_len:
            raise ValueError(f"the workload's longest request ({p_hi} prompt + {o_hi} output "
                             f"tokens) exceeds {model}'s context of {max_len}; lower the lengths")
        prompts = workload.sample(n, random.Random(seed))
        loop = asyncio.get_running_loop()
        run_deadline = loop.time() + max_duration
        # One unmeasured request first: the first step of a fresh server pays one-off costs.
        await _request(client, model, prompts[0][0], 2, min(timeout, max_duration))
        results = []
        with tqdm(total=n * len(levels), file=sys.stderr, unit="req", disable=not progress) as bar:
            for c in levels:
                bar.set_description(f"concurrency {c}")
                multi = workload if workload.kind == "multiturn" else None
                results.append(await _level(client, model, prompts, c, timeout, run_deadline,
                                            bar, multi, random.Random(seed + c)))
    config = {"url": url, "model": model, "workload": workload.describe(),
              "concurrency": list(levels), "requests_per_level": n, "timeout_s": timeout,
              "max_duration_s": max_duration, "seed": seed}
    return {"environment": _environment(), "config": config, "definitions": DEFINITIONS,
            "levels": results}


def run_bench(url: str, workload: Workload, concurrency_levels, n: int, *,
              model: str | None = None, timeout: float = 120.0, max_duration: float = 1800.0,
              seed: int = 0, progress: bool = True) -> dict:
    """Run the sweep; returns {environment, config, definitions, levels}. Raises ValueError for
    bad arguments (naming the flag) and ServerUnavailable when the server cannot be used."""
    url = url.rstrip("/")
    _check(url, concurrency_levels, n, timeout, max_duration)
    workload.check()
    return asyncio.run(_bench(url, workload, list(concurrency_levels), n, model, timeout,
                              max_duration, seed, progress))


def _environment() -> dict:
    # benchmarks/common.py (a source checkout) describes the machine like the other benchmarks.
    common = Path(__file__).resolve().parents[1] / "benchmarks" / "common.py"
    if common.exists():
        spec = importlib.util.spec_from_file_location("_pdserve_benchmarks_common", common)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        env = module.environment()
    else:
        env = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
               "python": platform.python_version(), "machine": platform.machine(),
               "pdserve": version("pdserve")}
    return env | {"httpx": version("httpx")}


def _fmt(value: float | None, scale: float = 1.0) -> str:
    return "-" if value is None else f"{value * scale:.1f}"


def format_table(result: dict) -> str:
    head = (f"{'conc':>4} {'ok':>7} {'TTFT p50/p90 ms':>17} {'ITL p50/p90 ms':>15} "
            f"{'tok/s/user p50/p90':>19} {'tok/s':>8}  errors")
    rows = [head]
    for lv in result["levels"]:
        rows.append(
            f"{lv['concurrency']:>4} {lv['ok']:>3}/{lv['requests']:<3} "
            f"{_fmt(lv['ttft_p50_s'], 1e3):>8}/{_fmt(lv['ttft_p90_s'], 1e3):<8} "
            f"{_fmt(lv['itl_p50_s'], 1e3):>7}/{_fmt(lv['itl_p90_s'], 1e3):<7} "
            f"{_fmt(lv['interactivity_p50_tok_s']):>9}/{_fmt(lv['interactivity_p90_tok_s']):<9} "
            f"{lv['throughput_tok_s']:>8.1f}  "
            + (", ".join(f"{k}: {v}" for k, v in lv["errors"].items()) or "-"))
    return "\n".join(rows)


def plot(result: dict, path: Path) -> None:
    """TTFT and ITL vs concurrency, and throughput vs P90 interactivity, as one PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    levels = result["levels"]
    conc = [lv["concurrency"] for lv in levels]

    def series(key: str, scale: float = 1.0) -> list[float]:
        return [np.nan if lv[key] is None else lv[key] * scale for lv in levels]

    fig = Figure(figsize=(15, 4.2))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    for ax, key, title in ((axes[0], "ttft", "time to first token"),
                           (axes[1], "itl", "inter-token latency")):
        ax.plot(conc, series(f"{key}_p50_s", 1e3), "o-", label="P50")
        ax.plot(conc, series(f"{key}_p90_s", 1e3), "s--", label="P90")
        ax.set_xscale("log", base=2)
        ax.minorticks_off()  # label only the measured levels
        ax.set(title=title, xlabel="concurrency", ylabel="ms", xticks=conc)
        ax.set_xticklabels([str(c) for c in conc])
        ax.legend()
        ax.grid(alpha=0.3)
    ax = axes[2]
    x, y = series("interactivity_p90_tok_s"), series("throughput_tok_s")
    ax.plot(x, y, "o-")
    for c, xi, yi in zip(conc, x, y):
        ax.annotate(f"c={c}", (xi, yi), textcoords="offset points", xytext=(4, 4))
    ax.set(title="throughput vs interactivity", xlabel="P90 interactivity (tok/s/user)",
           ylabel="output throughput (tok/s)")
    ax.grid(alpha=0.3)
    cfg = result["config"]
    fig.suptitle(f"{path.stem}: {cfg['model']} @ {cfg['url']}: {cfg['workload']['kind']} workload, "
                 f"{cfg['requests_per_level']} requests per level")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def save(result: dict, out_dir: str | Path, name: str) -> tuple[Path, Path]:
    """Write `<name>.json` and `<name>.png` under out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = out / f"{name}.json", out / f"{name}.png"
    json_path.write_text(json.dumps(result, indent=2))
    plot(result, png_path)
    return json_path, png_path


def cmd_bench(args) -> int:
    workload = Workload(args.workload, args.prompt_tokens, args.output_tokens,
                        args.prompt_tokens_max, args.output_tokens_max, args.prefix_tokens,
                        args.suffix_tokens, args.turn_tokens)
    try:
        result = run_bench(args.url, workload, args.concurrency, args.requests, model=args.model,
                           timeout=args.timeout, max_duration=args.max_duration, seed=args.seed)
    except ValueError as exc:
        print(f"pdserve bench: error: {exc}", file=sys.stderr)
        return 2
    except ServerUnavailable as exc:
        print(f"pdserve bench: {exc}", file=sys.stderr)
        return 1
    print(format_table(result))
    json_path, png_path = save(result, args.out, args.name or f"bench_{args.workload}")
    print(f"wrote {json_path} and {png_path}")
    return 0


def add_cli(subparsers) -> argparse.ArgumentParser:
    """Register `bench` on an argparse subparsers object; the handler is `args.func`."""
    d = Workload()
    p = subparsers.add_parser("bench", help="load-test a running server: concurrency sweep; "
                                            "TTFT, inter-token latency, tokens/s per user, "
                                            "throughput; JSON + PNG")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server (default %(default)s)")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--workload", choices=WORKLOADS, default=d.kind)
    p.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens,
                   help="prompt length (fixed), minimum (uniform) (default %(default)s)")
    p.add_argument("--prompt-tokens-max", type=int, default=None,
                   help="uniform: maximum prompt length (default 2 x --prompt-tokens)")
    p.add_argument("--output-tokens", type=int, default=d.output_tokens,
                   help="output length (fixed, agentic, multiturn), minimum (uniform) "
                        "(default %(default)s)")
    p.add_argument("--output-tokens-max", type=int, default=None,
                   help="uniform: maximum output length (default 2 x --output-tokens)")
    p.add_argument("--prefix-tokens", type=int, default=d.prefix_tokens,
                   help="agentic, multiturn: shared prefix length (default %(default)s)")
    p.add_argument("--suffix-tokens", type=int, default=d.suffix_tokens,
                   help="agentic: per-request suffix length; multiturn: the first turn's "
                        "suffix and each next turn's new text (default %(default)s)")
    p.add_argument("--turn-tokens", type=int, default=None,
                   help="multiturn: new tokens of each turn after the first (default: "
                        "--suffix-tokens)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8],
                   help="requests in flight, one level per value (default 1 2 4 8)")
    p.add_argument("--requests", type=int, default=32,
                   help="requests per concurrency level (default %(default)s)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="deadline of each request in seconds (default %(default)s)")
    p.add_argument("--max-duration", type=float, default=1800.0,
                   help="deadline of the whole run in seconds; requests not sent by then count "
                        "as run_deadline errors (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="prompt sampling seed (default 0)")
    p.add_argument("--out", default="benchmarks/results",
                   help="directory for the JSON and PNG (default %(default)s)")
    p.add_argument("--name", default=None, help="file name stem (default bench_<workload>)")
    p.set_defaults(func=cmd_bench)
    return p
