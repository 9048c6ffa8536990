"""The OpenAI surface clients use, through the official `openai` client against a real uvicorn
server over the monolithic `LocalBackend` (tiny preset): `n` with seeds, prompt lists,
logprobs and echo (checked against log_softmax of the reference model's own logits),
presence / frequency penalties (checked against a loop that penalizes those logits itself),
`stream_options`, accepted no-op fields, and streaming equal to non-streaming throughout."""
from __future__ import annotations

import math
from contextlib import contextmanager

import openai
import pytest
import torch

from pdserve.api.backend import LocalBackend
from pdserve.api.server import create_app
from pdserve.api.serving import serve_in_thread
from pdserve.api.tokenizer import ByteLevelTokenizer
from pdserve.model.batch import ForwardBatch
from pdserve.model.config import preset
from pdserve.model.generate import ReferenceEngine, build_model
from pdserve.model.sampling import Request, SamplingParams

MODEL = "tiny"
TOK = ByteLevelTokenizer()
WAIT_S = 30.0


@contextmanager
def serve(engine: ReferenceEngine):
    backend = LocalBackend(engine, model_name=MODEL, max_batch=8, max_queue=64)
    with serve_in_thread(create_app(backend, TOK), startup_s=WAIT_S, shutdown_s=WAIT_S) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                            timeout=WAIT_S)


@pytest.fixture(scope="module")
def model():
    return build_model(preset(MODEL))


@pytest.fixture(scope="module")
def client(model):
    with serve(ReferenceEngine(model)) as c:
        yield c


def full_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax (float64) of the reference model's logits at every position of `ids`, from
    one prefill of the whole sequence in pools of its own."""
    engine = ReferenceEngine(model, num_pages=8, num_slots=2)
    seq = engine.admit(Request("score", ids, SamplingParams(max_tokens=1)))
    try:
        batch = ForwardBatch.of([seq.table], [len(ids)])
        logits = engine.model(torch.tensor(ids), batch, engine.pools)
    finally:
        engine.release(seq)
    return torch.log_softmax(logits.double(), dim=-1)


def penalized_greedy(model, prompt: list[int], n: int, presence: float, frequency: float
                     ) -> list[int]:
    """Greedy decoding with OpenAI's penalties over the output so far, done here: a full
    forward per token and the penalty subtracted from the logits by hand."""
    out: list[int] = []
    for _ in range(n):
        logits = full_logprobs(model, prompt + out)[-1]  # log_softmax: same argmax as logits
        engine_logits = logits.clone()
        for t in set(out):
            engine_logits[t] -= frequency * out.count(t) + presence
        out.append(int(engine_logits.argmax()))
    return out


def spelled(token: int) -> str:
    """How the completions logprobs name a byte token: its character, or OpenAI's "bytes:\\xNN"
    for a byte that is part of a multi-byte character."""
    return chr(token) if token < 128 else f"bytes:\\x{token:02x}"


def completion_stream(client, **kw):
    chunks = list(client.completions.create(stream=True, **kw))
    by_index: dict[int, dict] = {}
    for c in chunks:
        for ch in c.choices:
            d = by_index.setdefault(ch.index, {"text": "", "tokens": [], "token_logprobs": [],
                                               "top_logprobs": [], "text_offset": [],
                                               "finish": None})
            d["text"] += ch.text
            if ch.logprobs is not None:
                for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    d[k] += getattr(ch.logprobs, k)
            d["finish"] = ch.finish_reason or d["finish"]
    return chunks, by_index


# -- logprobs ---------------------------------------------------------------------------------
def test_completion_logprobs_are_the_models(client, model):
    prompt = TOK.encode("Log probabilities ")
    out = client.completions.create(model=MODEL, prompt="Log probabilities ", max_tokens=6,
                                    temperature=0, logprobs=3,
                                    extra_body={"return_token_ids": True})
    choice = out.choices[0]
    ids = choice.token_ids
    lp = full_logprobs(model, prompt + ids)
    for i, tok in enumerate(ids):
        row = lp[len(prompt) + i - 1]
        assert math.isclose(choice.logprobs.token_logprobs[i], row[tok].item(), abs_tol=1e-4)
        best = row.topk(3)
        top = choice.logprobs.top_logprobs[i]
        assert list(top)[:3] == [spelled(t) for t in best.indices.tolist()]
        for t, v in zip(best.indices.tolist(), best.values.tolist()):
            assert math.isclose(top[spelled(t)], v, abs_tol=1e-4)
        assert tok == best.indices[0].item()  # greedy: the chosen token is the best one
    assert choice.logprobs.tokens == [spelled(t) for t in ids]
    offsets = [len(TOK.decode(ids[:i])) for i in range(len(ids))]
    assert choice.logprobs.text_offset == [sum(len(TOK.decode([t])) for t in ids[:i])
                                           for i in range(len(ids))]
    assert offsets[0] == 0
    # streamed: the same values, chunk by chunk
    _, streamed = completion_stream(client, model=MODEL, prompt="Log probabilities ",
                                    max_tokens=6, temperature=0, logprobs=3)
    got = streamed[0]
    assert got["text"] == choice.text
    assert got["token_logprobs"] == choice.logprobs.token_logprobs
    assert got["top_logprobs"] == choice.logprobs.top_logprobs
    assert got["text_offset"] == choice.logprobs.text_offset


def test_echo_returns_the_prompts_logprobs_as_lm_eval_reads_them(client, model):
    text = "The cat sat"
    prompt = TOK.encode(text)
    body = dict(model=MODEL, prompt=text, max_tokens=1, temperature=0, logprobs=1, echo=True,
                seed=1234)
    out = client.completions.create(**body)
    lp = out.choices[0].logprobs
    want = full_logprobs(model, prompt)
    assert out.choices[0].text.startswith(text)
    assert len(lp.token_logprobs) == len(prompt) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for q in range(1, len(prompt)):
        assert math.isclose(lp.token_logprobs[q], want[q - 1, prompt[q]].item(), abs_tol=1e-4)
        best = int(want[q - 1].argmax())
        assert math.isclose(max(lp.top_logprobs[q].values()), want[q - 1, best].item(),
                            abs_tol=1e-4)
    assert lp.tokens[:len(prompt)] == list(text)
    # what lm-eval's loglikelihood computes from it: sum over the continuation, and greediness
    ctxlen = 4
    total = sum(lp.token_logprobs[ctxlen:-1])
    assert math.isclose(total, sum(want[q - 1, prompt[q]].item()
                                   for q in range(ctxlen, len(prompt))), abs_tol=1e-3)
    _, streamed = completion_stream(client, **body)
    assert streamed[0]["token_logprobs"] == lp.token_logprobs
    assert streamed[0]["text"] == out.choices[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs(client, model, stream):
    messages = [{"role": "user", "content": "Hi"}]
    prompt = TOK.encode("<|user|>\nHi\n<|assistant|>\n")
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                         temperature=0, logprobs=True, top_logprobs=2,
                                         stream=stream, extra_body={"return_token_ids": True})
    if stream:
        chunks = [c for c in out if c.choices]
        entries = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        ids = [t for c in chunks for t in c.choices[0].token_ids]
    else:
        entries, ids = out.choices[0].logprobs.content, out.choices[0].token_ids
    assert len(entries) == len(ids) == 5
    lp = full_logprobs(model, prompt + ids)
    for i, (e, tok) in enumerate(zip(entries, ids)):
        row = lp[len(prompt) + i - 1]
        assert e.token == spelled(tok) and e.bytes == [tok]
        assert math.isclose(e.logprob, row[tok].item(), abs_tol=1e-4)
        assert [t.bytes[0] for t in e.top_logprobs] == row.topk(2).indices.tolist()


# -- penalties --------------------------------------------------------------------------------
@pytest.mark.parametrize("presence,frequency", [(0.0, 2.0), (1.5, 0.5), (-1.0, 0.0)])
def test_penalties_match_penalized_logits(client, model, presence, frequency):
    text = "aaaa"
    want = penalized_greedy(model, TOK.encode(text), 12, presence, frequency)
    plain = penalized_greedy(model, TOK.encode(text), 12, 0.0, 0.0)
    assert want != plain  # the penalty changes the tokens, so the test can tell
    body = dict(model=MODEL, prompt=text, max_tokens=12, temperature=0,
                presence_penalty=presence, frequency_penalty=frequency,
                extra_body={"return_token_ids": True})
    out = client.completions.create(**body)
    assert out.choices[0].token_ids == want
    chunks = list(client.completions.create(stream=True, **body))
    assert [t for c in chunks for t in c.choices[0].token_ids] == want


# -- n, prompt lists, seeds -------------------------------------------------------------------
def test_n_samples_with_a_seed(client):
    body = dict(model=MODEL, prompt="Seeded ", max_tokens=8, temperature=1.0, seed=7)
    out = client.completions.create(n=3, **body)
    texts = [c.text for c in sorted(out.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(out.choices, key=lambda c: c.index)] == [0, 1, 2]
    assert len(set(texts)) == 3  # each sample draws its own noise
    assert client.completions.create(n=1, **body).choices[0].text == texts[0]
    assert [c.text for c in sorted(client.completions.create(n=3, **body).choices,
                                   key=lambda c: c.index)] == texts
    _, streamed = completion_stream(client, n=3, **body)
    assert [streamed[i]["text"] for i in range(3)] == texts
    assert out.usage.completion_tokens == 24 and out.usage.prompt_tokens == len("Seeded ")


def test_prompt_list_gives_a_choice_per_prompt_and_sample(client):
    prompts = ["first ", "second prompt ", [104, 105]]
    out = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=5,
                                    temperature=0)
    choices = sorted(out.choices, key=lambda c: c.index)
    assert [c.index for c in choices] == list(range(6))
    for i, p in enumerate(prompts):
        alone = client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0)
        assert choices[2 * i].text == choices[2 * i + 1].text == alone.choices[0].text
    assert out.usage.prompt_tokens == sum(len(TOK.encode(p)) if isinstance(p, str) else len(p)
                                          for p in prompts)
    assert out.usage.completion_tokens == 30
    _, streamed = completion_stream(client, model=MODEL, prompt=prompts, n=2, max_tokens=5,
                                    temperature=0)
    assert [streamed[i]["text"] for i in range(6)] == [c.text for c in choices]


# -- stream_options, no-op fields, default length ---------------------------------------------
def test_continuous_usage_stats(client):
    chunks = list(client.completions.create(
        model=MODEL, prompt="usage ", max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    with_choices = [c for c in chunks if c.choices]
    counts = [c.usage.completion_tokens for c in with_choices]
    assert all(c.usage.prompt_tokens == len("usage ") for c in with_choices)
    assert counts == sorted(counts) and counts[-1] == 6
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_fields_that_change_nothing_are_accepted(client):
    base = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                          max_tokens=6, temperature=0)
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x", "name": "alice"}], max_tokens=6,
        temperature=0, user="u-1", response_format={"type": "text"}, metadata={"k": "v"},
        store=False, parallel_tool_calls=False, tool_choice="none", logit_bias={})
    assert out.choices[0].message.content == base.choices[0].message.content


def test_chat_without_max_tokens_runs_to_the_context_end(model):
    engine = ReferenceEngine(model, num_pages=2, num_slots=4)  # a context of one 64-token page
    with serve(engine) as c:
        out = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "go"}],
                                        temperature=0)
        prompt = len("<|user|>\ngo\n<|assistant|>\n")
        assert out.choices[0].finish_reason == "length"
        assert out.usage.completion_tokens == 64 - prompt > 16
        done = c.completions.create(model=MODEL, prompt="go", temperature=0)
        assert done.usage.completion_tokens == 16  # a completion keeps OpenAI's default
