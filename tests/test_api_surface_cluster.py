"""The OpenAI fields that change what comes back (logprobs, echo, penalties, n with a seed)
give the same answers from the disaggregated cluster (real Ray and NIXL, prefill and decode
instances of their own) as from the monolithic backend over the same weights, streaming and
not: the equivalence contract (docs/design.md) carried through the new fields."""
from __future__ import annotations

import pytest
import ray

from pdserve.cluster.serve import running_server
from pdserve.model.config import preset
from pdserve.model.generate import ReferenceEngine, build_model

from test_api_surface import completion_stream, serve
from test_cluster import config

openai = pytest.importorskip("openai")

CASES = [
    dict(prompt="KDA state over NIXL", max_tokens=6, temperature=0, logprobs=3),
    dict(prompt="echo me", max_tokens=3, temperature=0, logprobs=2, echo=True),
    dict(prompt="penalties ", max_tokens=10, temperature=0, presence_penalty=0.7,
         frequency_penalty=0.4, logprobs=1),
    dict(prompt="two samples ", max_tokens=6, temperature=0.9, seed=11, n=2, logprobs=1),
]


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    yield
    if ray.is_initialized():
        ray.shutdown()


def answers(client, case):
    """(text, tokens, token logprobs, top logprobs) per choice, non-streamed then streamed."""
    kw = dict(model="tiny", extra_body={"ignore_eos": True}, **case)
    full = client.completions.create(**kw)
    plain = [(c.text, c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.top_logprobs)
             for c in sorted(full.choices, key=lambda c: c.index)]
    _, by_index = completion_stream(client, **kw)
    streamed = [(d["text"], d["tokens"], d["token_logprobs"], d["top_logprobs"])
                for _, d in sorted(by_index.items())]
    return plain, streamed


# The contract (docs/design.md §2) is the same tokens bit for bit; the reference decode step is
# also batch-invariant (every product runs on at least MIN_ROWS rows), so which of a request's n
# choices share a step (admission timing) moves no logprob bit either.
def assert_same(got, want, case):
    """Choices equal: text, tokens, logprobs and alternatives, exactly."""
    assert len(got) == len(want), case
    for g, w in zip(got, want):
        assert g[0] == w[0] and g[1] == w[1], case                      # text and tokens
        assert g[2] == w[2], case                                        # chosen logprobs
        assert g[3] == w[3], case                                        # top logprobs


def test_new_fields_are_equal_disaggregated_and_monolithic():
    cfg, model = config()
    with serve(ReferenceEngine(build_model(preset("tiny"), seed=0))) as local:
        want = [answers(local, case) for case in CASES]
    with running_server(cfg, model, progress=lambda m: None) as (url, _router):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=60, max_retries=0)
        got = [answers(client, case) for case in CASES]
    for case, (w_plain, w_stream), (g_plain, g_stream) in zip(CASES, want, got):
        assert len(g_plain) == case.get("n", 1), case
        assert_same(w_stream, w_plain, case)  # the monolithic side agrees with itself
        assert_same(g_plain, w_plain, case)
        assert_same(g_stream, g_plain, case)
