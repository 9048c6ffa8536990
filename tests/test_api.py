"""The OpenAI-compatible API over a real uvicorn server and the monolithic `LocalBackend` (tiny
preset): equivalence with the reference generate loop through the official `openai` client,
bad inputs, overload, disconnects, deadlines, metrics, and the tokenizers."""
from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from types import SimpleNamespace

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.api.backend import LocalBackend
from pdserve.api.metrics import ApiMetrics
from pdserve.api.server import create_app
from pdserve.api.serving import serve_in_thread
from pdserve.api.tokenizer import ByteLevelTokenizer, TextStream, load_tokenizer
from pdserve.model.config import preset
from pdserve.model.generate import ReferenceEngine, build_model
from pdserve.model.sampling import SamplingParams

MODEL = "tiny"
TOK = ByteLevelTokenizer()
WAIT_S = 10.0  # bound on every wait in this file


def wait_for(predicate, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@contextmanager
def serve(backend: LocalBackend, **app_kwargs):
    """A real uvicorn server on a free 127.0.0.1 port, in a background thread."""
    with serve_in_thread(create_app(backend, TOK, **app_kwargs), startup_s=WAIT_S,
                         shutdown_s=WAIT_S) as url:
        yield url


@pytest.fixture(scope="module")
def model():
    return build_model(preset(MODEL))


@pytest.fixture(scope="module")
def reference(model):
    engine = ReferenceEngine(model)

    def run(prompt: list[int], **params) -> list[int]:
        return engine.generate([prompt], SamplingParams(**params))[0].output
    return run


def local(model, **kwargs) -> SimpleNamespace:
    engine = ReferenceEngine(model)
    return SimpleNamespace(engine=engine, backend=LocalBackend(engine, model_name=MODEL, **kwargs))


@pytest.fixture(scope="module")
def main(model):
    srv = local(model, max_batch=8, max_queue=64)
    with serve(srv.backend) as url:
        srv.url = url
        yield srv


@pytest.fixture
def client(main):
    return openai.OpenAI(base_url=main.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def assert_idle(srv) -> None:
    wait_for(lambda: srv.backend.stats()["running"] == 0 and srv.backend.stats()["queued"] == 0
             and srv.engine.pools.empty, "the request to be cancelled and its state freed")


def metric_samples(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url + "/metrics", timeout=WAIT_S).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


# -- equivalence with the reference generate loop ---------------------------------------------
@pytest.mark.parametrize("prompt", ["Disaggregated prefill ", list(b"token ids")])
def test_completion_matches_reference(client, reference, prompt):
    ids = TOK.encode(prompt) if isinstance(prompt, str) else prompt
    want = reference(ids, max_tokens=12)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"return_token_ids": True})
    choice = out.choices[0]
    assert choice.token_ids == want
    assert choice.text == TOK.decode(want)
    assert choice.finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), 12)


def test_completion_stream_matches_reference(client, reference):
    want = reference(TOK.encode("Streaming "), max_tokens=10)
    chunks = list(client.completions.create(model=MODEL, prompt="Streaming ", max_tokens=10,
                                            temperature=0, stream=True,
                                            extra_body={"return_token_ids": True}))
    assert [t for c in chunks for t in c.choices[0].token_ids] == want
    assert "".join(c.choices[0].text for c in chunks) == TOK.decode(want)
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert len({c.id for c in chunks}) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_chat_matches_reference(client, reference, stream):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = TOK.encode("<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n")
    want = reference(prompt, max_tokens=8)
    out = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=8,
                                         temperature=0, stream=stream,
                                         stream_options={"include_usage": True} if stream else None,
                                         extra_body={"return_token_ids": True})
    if stream:
        chunks = list(out)
        assert chunks[0].choices[0].delta.role == "assistant"
        got = [t for c in chunks if c.choices for t in c.choices[0].token_ids]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
    else:
        got, text, usage = out.choices[0].token_ids, out.choices[0].message.content, out.usage
        assert out.choices[0].message.role == "assistant"
    assert got == want and text == TOK.decode(want)
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), 8)


def test_seeded_sampling_is_reproducible(client, reference):
    kw = dict(temperature=0.9, top_p=0.95, seed=1234)
    want = reference(TOK.encode("Seeded "), max_tokens=10, top_k=50, **kw)
    runs = [client.completions.create(model=MODEL, prompt="Seeded ", max_tokens=10, **kw,
                                      extra_body={"top_k": 50, "return_token_ids": True})
            for _ in range(2)]
    assert [r.choices[0].token_ids for r in runs] == [want, want]


def test_stop_string_trims_and_ends_the_request(client, reference, main):
    want = TOK.decode(reference(TOK.encode("Stop "), max_tokens=16))
    # a stop string taken from the greedy output: the text must end right before it
    at = next(i for i in range(2, len(want)) if want[i].isascii() and want[i].isprintable())
    stop = want[at]
    for stream in (False, True):
        out = client.completions.create(model=MODEL, prompt="Stop ", max_tokens=16,
                                        temperature=0, stop=[stop], stream=stream)
        chunks = list(out) if stream else [out]
        assert "".join(c.choices[0].text for c in chunks) == want[:want.index(stop)]
        assert chunks[-1].choices[0].finish_reason == "stop"
    assert_idle(main)


def test_text_stream_holds_back_split_characters_and_stop_prefixes():
    ids = TOK.encode("a€bXYc")  # € is 3 bytes
    stream = TextStream(TOK, stops=["XYZ", "Yc"])
    out = [stream.push(t) for t in ids]
    # "X" and "XY" might start a stop string; "Yc" is one: the text ends before it
    assert out == ["a", "", "", "€", "b", "", "", "X"]
    assert stream.stopped and stream.flush() == ""


# -- bad input ----------------------------------------------------------------------------------
BAD = [
    ("completions", b"{not json", "not valid JSON"),
    ("completions", b"[1, 2]", "request body"),
    ("completions", {"prompt": "x"}, "model is required"),
    ("completions", {"model": "gpt-9", "prompt": "x"}, "model 'gpt-9' is not served"),
    ("completions", {"model": MODEL}, "prompt is required"),
    ("completions", {"model": MODEL, "prompt": 5}, "prompt must be a string, a list of token"),
    ("completions", {"model": MODEL, "prompt": ["a", 5]}, "prompt must be a string, a list of"),
    ("completions", {"model": MODEL, "prompt": []}, "prompt must be a string, a list of token"),
    ("completions", {"model": MODEL, "prompt": ["a", ""]}, "prompt[1] must not be empty"),
    ("completions", {"model": MODEL, "prompt": ""}, "prompt must not be empty"),
    ("completions", {"model": MODEL, "prompt": [1, 300]}, "prompt token ids [300]"),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens must be >= 1"),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": -5}, "max_tokens must be >= 1"),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": "ten"}, "max_tokens: Expected"),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": 10**9},
     "max_tokens=1000000000 plus the prompt's 1 tokens exceeds the model's maximum context of"),
    ("completions", {"model": MODEL, "prompt": "x" * 20000},
     "prompt has 20000 characters; the model's maximum context of 16320 tokens holds at most 16320"),
    ("completions", {"model": MODEL, "prompt": ["x", "y" * 20000]},
     "prompt[1] has 20000 characters"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x" * 20000}]},
     "messages has 20000 characters"),
    ("completions", {"model": MODEL, "prompt": [120] * 20000},
     "the prompt has 20000 tokens; the model's maximum context is"),
    ("completions", {"model": MODEL, "prompt": "x", "temperature": -1},
     "temperature must be in 0..2, got -1"),
    ("completions", {"model": MODEL, "prompt": "x", "top_p": 0}, "top_p must be in (0, 1]"),
    ("completions", {"model": MODEL, "prompt": "x", "top_k": -2}, "top_k must be >= 0"),
    ("completions", {"model": MODEL, "prompt": "x", "seed": "s"}, "seed: Expected"),
    ("completions", {"model": MODEL, "prompt": "x", "n": 0}, "n must be in 1..64, got 0"),
    ("completions", {"model": MODEL, "prompt": ["x"] * 9, "n": 8}, "9 prompts x n=8 choices"),
    ("completions", {"model": MODEL, "prompt": "x", "best_of": 3}, "best_of=3 (other than n)"),
    ("completions", {"model": MODEL, "prompt": "x", "logprobs": 21}, "logprobs must be in 0..20"),
    ("completions", {"model": MODEL, "prompt": "x", "presence_penalty": 2.5},
     "presence_penalty must be in -2..2"),
    ("completions", {"model": MODEL, "prompt": "x", "frequency_penalty": -3},
     "frequency_penalty must be in -2..2"),
    ("completions", {"model": MODEL, "prompt": "x", "logit_bias": {"1": 5}},
     "logit_bias is not supported by this server"),
    ("completions", {"model": MODEL, "prompt": "x", "suffix": "y"},
     "suffix is not supported by this server"),
    ("completions", {"model": MODEL, "prompt": "x", "response_format": {"type": "json_object"}},
     "response_format of type 'json_object' is not supported by this server"),
    ("completions", {"model": MODEL, "prompt": "x", "stream": "yes"}, "stream: Expected"),
    ("completions", {"model": MODEL, "prompt": "x", "stop": [1]}, "stop[0]: Expected"),
    ("completions", {"model": MODEL, "prompt": "x", "stop": ""}, "stop[0] must be a non-empty"),
    ("completions", {"model": MODEL, "prompt": "x", "stop": ["a"] * 100000},
     "stop has 100000 strings; at most 16"),
    ("completions", {"model": MODEL, "prompt": "x", "stop": ["y" * 300]},
     "stop[0] has 300 characters; at most 256"),
    ("completions", {"model": MODEL, "prompt": "x", "frobnicate": 1}, "frobnicate: unknown"),
    ("completions", {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}},
     "stream_options is only allowed with stream=true"),
    ("chat/completions", {"model": MODEL}, "messages is required"),
    ("chat/completions", {"model": MODEL, "messages": []}, "messages must contain at least one"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a"},
                                                       {"role": "wizard", "content": "b"}]},
     "messages[1].role must be one of"),
    ("chat/completions", {"model": MODEL, "messages": [{"content": "a"}]},
     "messages[0].role is required"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
     "messages[0].content must be a string or a list of text parts"),
    ("chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0] must be"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a"}],
                          "max_completion_tokens": 0}, "max_completion_tokens must be >= 1"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a"}],
                          "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tool_choice is not supported by this server unless it is 'none'"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a"}],
                          "tool_choice": "auto"}, "tool_choice is not supported by this server"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a"}],
                          "functions": [{"name": "f"}]}, "functions is not supported"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a"}],
                          "response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format of type 'json_schema' is not supported by this server"),
    ("chat/completions", {"model": MODEL, "messages": [
        {"role": "assistant", "content": "a", "tool_calls": [{"id": "c1"}]}]},
     "messages[0].tool_calls[0].type is required"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a"}],
                          "top_logprobs": 3}, "top_logprobs needs logprobs=true"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a"}],
                          "logprobs": True, "top_logprobs": 21}, "top_logprobs must be in 0..20"),
]


@pytest.mark.parametrize("endpoint,body,message", BAD, ids=[m for _, _, m in BAD])
def test_bad_input_is_400_naming_the_field(main, endpoint, body, message):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{main.url}/v1/{endpoint}", content=raw, timeout=WAIT_S,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_server_keeps_serving_after_bad_input(client, main):
    with pytest.raises(openai.BadRequestError, match="max_tokens must be >= 1"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    out = client.completions.create(model=MODEL, prompt="still here", max_tokens=3)
    assert out.usage.completion_tokens == 3
    assert_idle(main)


# -- overload, disconnects, deadlines ----------------------------------------------------------
def first_line(response: httpx.Response) -> str:
    """The first SSE line; the stream closes (the client disconnects) with the iterator."""
    return next(line for line in response.iter_lines() if line)


def test_overload_is_429_with_retry_after(model):
    srv = local(model, max_batch=1, max_queue=1)
    long = {"model": MODEL, "prompt": "slow", "max_tokens": 4000, "stream": True,
            "ignore_eos": True}
    with serve(srv.backend) as url, httpx.Client(base_url=url, timeout=WAIT_S) as http, \
            ThreadPoolExecutor(1) as pool:
        with http.stream("POST", "/v1/completions", json=long) as running:
            events = running.iter_lines()  # kept: dropping a started iterator closes the stream
            assert running.status_code == 200 and next(events).startswith("data: ")

            def queued_request():  # waits in the queue behind `running`, then reads one event
                with httpx.stream("POST", url + "/v1/completions", json=long,
                                  timeout=WAIT_S) as r:
                    return r.status_code, first_line(r)
            queued = pool.submit(queued_request)
            wait_for(lambda: srv.backend.stats()["queued"] == 1, "the second request to queue")
            r = http.post("/v1/completions", json=long)
            assert r.status_code == 429 and r.headers["Retry-After"] == "1"
            assert "queued" in r.json()["error"]["message"]
            oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            with pytest.raises(openai.RateLimitError):
                oai.completions.create(model=MODEL, prompt="x", max_tokens=2)
        # `running` disconnected: the queued request runs now
        status, line = queued.result(timeout=WAIT_S)
        assert status == 200 and line.startswith("data: ")
        assert_idle(srv)


def test_stream_disconnect_cancels_and_frees_state(client, main):
    before = metric_samples(main.url)
    stream = client.completions.create(model=MODEL, prompt="cancel me", max_tokens=4000,
                                       stream=True, extra_body={"ignore_eos": True})
    for _, _ in zip(range(3), stream):
        pass
    assert main.backend.stats()["running"] == 1
    stream.close()
    assert_idle(main)
    after = metric_samples(main.url)
    key = ("pdserve_requests_total", (("outcome", "cancelled"),))
    wait_for(lambda: metric_samples(main.url)[key] == before[key] + 1, "the cancelled count")
    assert after[("pdserve_backend_running", ())] == 0


def test_non_streaming_disconnect_cancels(main):
    body = {"model": MODEL, "prompt": "cancel me too", "max_tokens": 4000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(main.url + "/v1/completions", json=body, timeout=0.5)
    assert_idle(main)


def test_every_request_ends_by_its_deadline(model):
    srv = local(model)
    body = {"model": MODEL, "prompt": "too slow", "max_tokens": 8000, "ignore_eos": True}
    with serve(srv.backend, request_timeout_s=0.5) as url:
        t0 = time.monotonic()
        r = httpx.post(url + "/v1/completions", json=body, timeout=WAIT_S)
        assert r.status_code == 504 and "deadline" in r.json()["error"]["message"]
        oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.APIError, match="deadline"):
            for _ in oai.completions.create(model=MODEL, prompt="too slow", max_tokens=8000,
                                            stream=True, extra_body={"ignore_eos": True}):
                pass
        assert time.monotonic() - t0 < 4.0
        assert_idle(srv)


def test_mixed_concurrent_load_loses_nothing(model):
    """Bad, cancelled, streaming and plain requests at once: each ends as it should, the
    outcome counters add up, and every pool is empty afterwards."""
    srv = local(model, max_batch=8, max_queue=64)

    async def one(http: httpx.AsyncClient, i: int) -> str:
        body = {"model": MODEL, "prompt": f"request {i}", "max_tokens": 1 + i % 30,
                "temperature": 0}
        if i % 4 == 0:
            return str((await http.post("/v1/completions", json=body | {"max_tokens": -1}))
                       .status_code)
        if i % 4 == 1:  # read a few events, then go away
            async with http.stream("POST", "/v1/completions", json=body | {
                    "stream": True, "max_tokens": 500, "ignore_eos": True}) as r:
                lines = r.aiter_lines()
                for _ in range(3):
                    await anext(lines)
            return "gone"
        r = await http.post("/v1/completions", json=body | {"stream": i % 4 == 2})
        done = r.text.endswith("data: [DONE]\n\n") if i % 4 == 2 else \
            r.json()["usage"]["completion_tokens"] == 1 + i % 30
        return f"{r.status_code} {done}"

    async def load(url: str) -> list[str]:
        # 60 requests queue behind 8 slots: on a loaded 2-core machine a request can wait
        # several seconds before its first token, so each gets 3 x WAIT_S (a hang guard)
        async with httpx.AsyncClient(base_url=url, timeout=3 * WAIT_S) as http:
            return await asyncio.wait_for(asyncio.gather(*(one(http, i) for i in range(60))),
                                          timeout=6 * WAIT_S)

    with serve(srv.backend) as url:
        results = asyncio.run(load(url))
        assert sorted(set(results)) == ["200 True", "400", "gone"], results
        assert_idle(srv)
        key = "pdserve_requests_total"
        wait_for(lambda: metric_samples(url)[(key, (("outcome", "cancelled"),))] == 15,
                 "the cancellations to be counted")
        m = metric_samples(url)
        assert [m[(key, (("outcome", o),))] for o in ("ok", "invalid", "error", "rejected")] == \
            [30, 15, 0, 0]


# -- metrics, health, models -------------------------------------------------------------------
def test_metrics_count_requests_tokens_and_ttft(model):
    srv = local(model)
    with serve(srv.backend) as url:
        oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        for stream in (False, False, True):
            out = oai.completions.create(model=MODEL, prompt="count", max_tokens=5,
                                         temperature=0, stream=stream)
            if stream:
                list(out)
        with pytest.raises(openai.BadRequestError):
            oai.completions.create(model=MODEL, prompt="count", max_tokens=-1)
        m = metric_samples(url)
    assert m[("pdserve_requests_total", (("outcome", "ok"),))] == 3
    assert m[("pdserve_requests_total", (("outcome", "invalid"),))] == 1
    for outcome in ("error", "cancelled", "rejected"):
        assert m[("pdserve_requests_total", (("outcome", outcome),))] == 0
    assert m[("pdserve_time_to_first_token_seconds_count", ())] == 3
    assert m[("pdserve_inter_token_latency_seconds_count", ())] == 3 * 4
    assert m[("pdserve_generated_tokens_total", ())] == 15
    assert m[("pdserve_prompt_tokens_total", ())] == 3 * len("count")
    assert m[("pdserve_backend_queued", ())] == 0
    assert m[("pdserve_backend_max_queue", ())] == 256


def test_transfer_stats_become_counters_by_state_kind():
    # The stats a disaggregated backend reports (the router is not part of this test).
    stats = {"transfer_bytes_mla": 4096.0, "transfer_bytes_kda_recurrent": 8192.0,
             "transfer_seconds_mla": 0.5, "transfer_failures": 2.0, "decode_queued": 3.0}
    m = ApiMetrics(SimpleNamespace(stats=lambda: stats))
    samples = {(s.name, tuple(s.labels.items())): s.value
               for fam in text_string_to_metric_families(m.render().decode())
               for s in fam.samples}
    assert samples[("pdserve_transfer_bytes_total", (("kind", "mla"),))] == 4096
    assert samples[("pdserve_transfer_bytes_total", (("kind", "kda_recurrent"),))] == 8192
    assert samples[("pdserve_transfer_seconds_total", (("kind", "mla"),))] == 0.5
    assert samples[("pdserve_transfer_failures_total", ())] == 2
    assert samples[("pdserve_backend_decode_queued", ())] == 3


def test_health_and_models(main):
    h = httpx.get(main.url + "/health", timeout=WAIT_S)
    assert h.status_code == 200 and h.json()["status"] == "ok"
    assert h.json()["stats"]["running"] == 0
    models = openai.OpenAI(base_url=main.url + "/v1", api_key="unused").models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_health_is_503_when_the_backend_is_down(model):
    srv = local(model)
    with serve(srv.backend) as url:
        asyncio.run(srv.backend.close())
        h = httpx.get(url + "/health", timeout=WAIT_S)
        assert h.status_code == 503 and h.json()["reason"] == "the backend is shut down"
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x"},
                       timeout=WAIT_S)
        assert r.status_code == 503 and "Retry-After" in r.headers


# -- tokenizers ---------------------------------------------------------------------------------
def test_byte_tokenizer_for_the_byte_vocabulary():
    tok = load_tokenizer(MODEL, 256)
    assert tok.chat_prompt([{"role": "user", "content": "hé"}]) == list("<|user|>\nhé\n<|assistant|>\n".encode())
    with pytest.raises(ValueError, match="no tokenizer.json"):
        load_tokenizer("kimi-linear-48b-a3b", 163840)


def test_hf_tokenizer_from_model_directory(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "<|im_end|>": 3, "hello": 4, "world": 5, "!": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>", "<|im_end|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}"
                "{% endif %}{{ bos_token }}{% for m in messages %}{{ m['content'] }} <|im_end|> "
                "{% endfor %}{% if add_generation_prompt %}world{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": template}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    hf = load_tokenizer(str(tmp_path), vocab_size=16)
    assert hf.encode("hello world !") == [4, 5, 6]
    assert hf.decode([4, 3, 5]) == "hello world"
    assert hf.chat_prompt([{"role": "user", "content": "hello"}]) == [1, 4, 3, 5]
    with pytest.raises(ValueError, match="chat template refused them: user first"):
        hf.chat_prompt([{"role": "system", "content": "hello"}])
    assert hf.stop_token_ids == [2, 3] and hf.vocab_size == 16
    with pytest.raises(ValueError, match="vocab_size is only 4"):
        load_tokenizer(str(tmp_path), vocab_size=4)
