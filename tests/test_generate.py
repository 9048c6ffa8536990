import pytest
import torch

from pdserve.model.config import preset
from pdserve.model.generate import ReferenceEngine, build_model
from pdserve.model.sampling import SamplingParams, sample
from pdserve.state.pools import PoolExhausted

PROMPTS = [list(b"The quick brown fox"), list(b"hi"), list(b"disaggregated serving of hybrid models")]


@pytest.fixture(scope="module")
def model():
    return build_model(preset("tiny"), seed=0)


def test_batched_generation_equals_each_request_alone(model):
    """Bit for bit, logprobs included: a decode step's rounding does not depend on how many
    requests share it."""
    params = [SamplingParams(max_tokens=12, logprobs=2), SamplingParams(max_tokens=5, logprobs=0),
              SamplingParams(max_tokens=9, temperature=0.9, top_k=50, seed=3, logprobs=1)]
    together = ReferenceEngine(model).generate(PROMPTS, params)
    for p, sp, seq in zip(PROMPTS, params, together):
        alone = ReferenceEngine(model).generate([p], [sp])[0]
        assert alone.output == seq.output and alone.logprobs == seq.logprobs
        assert len(seq.output) == sp.max_tokens and seq.finish_reason == "length"


def test_seeded_sampling_is_reproducible_and_seed_dependent(model):
    eng = ReferenceEngine(model)
    runs = [eng.generate(PROMPTS[:1], SamplingParams(max_tokens=16, temperature=1.0, seed=s))[0].output
            for s in (1, 1, 2)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_stop_tokens_end_generation_and_state_is_freed(model):
    eng = ReferenceEngine(model)
    free_pages, free_slots = eng.pools.latent.num_free, eng.pools.slots.num_free
    greedy = eng.generate(PROMPTS[:1], SamplingParams(max_tokens=10))[0].output
    stop = greedy[3]
    seq = eng.generate(PROMPTS[:1], SamplingParams(max_tokens=10, stop_token_ids=[stop]))[0]
    assert seq.output == greedy[:greedy.index(stop) + 1] and seq.finish_reason == "stop"
    assert (eng.pools.latent.num_free, eng.pools.slots.num_free) == (free_pages, free_slots)


def test_sampler_filters():
    logits = torch.tensor([0.0, 5.0, 4.9, -3.0])
    assert sample(logits, SamplingParams(), 0) == 1
    for pos in range(20):  # top_k=2 never draws the two worst tokens
        assert sample(logits, SamplingParams(temperature=5.0, top_k=2, seed=1), pos) in (1, 2)
        assert sample(logits, SamplingParams(temperature=5.0, top_p=0.01, seed=1), pos) == 1
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        SamplingParams(max_tokens=0)


def test_exhaustion_and_bad_input_are_refused_without_leaks(model):
    eng = ReferenceEngine(model, num_pages=4, num_slots=2)
    with pytest.raises(PoolExhausted, match="needs 5 latent pages"):
        eng.generate([[1] * 200], SamplingParams(max_tokens=60))
    with pytest.raises(ValueError, match="outside the vocabulary of 256"):
        eng.generate([[1, 999]], SamplingParams())
    with pytest.raises(ValueError, match="empty prompt"):
        eng.generate([[]], SamplingParams())
    assert eng.pools.empty
    assert eng.generate([[1, 2]], SamplingParams(max_tokens=3))[0].output
