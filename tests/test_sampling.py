"""Batched, device-independent sampling (`pdserve.model.sampling.sample_batch`): the draw of a
row depends only on its logits, seed and position (not on the batch around it), follows the
softmax of logits / temperature, and top-k / top-p restrict it to the right tokens."""
import pytest
import torch

from pdserve.model.sampling import SamplingParams, sample, sample_batch

N = 6000


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    assert sample_batch(logits, [SamplingParams()] * 5, [0] * 5) == logits.argmax(-1).tolist()


def test_a_row_draws_the_same_token_in_any_batch():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 300, generator=g)
    params = [SamplingParams(temperature=0.8, seed=s, top_k=(0, 20)[s % 2],
                             top_p=(1.0, 0.9)[s % 3 == 0]) for s in range(8)]
    pos = list(range(10, 18))
    together = sample_batch(logits, params, pos)
    alone = [sample(logits[i], params[i], pos[i]) for i in range(8)]
    assert together == alone
    order = [5, 2, 7, 0, 1, 3, 6, 4]
    shuffled = sample_batch(logits[order], [params[i] for i in order], [pos[i] for i in order])
    assert shuffled == [together[i] for i in order]
    # another position or seed draws anew (some of 8 rows differ)
    assert sample_batch(logits, params, [p + 1 for p in pos]) != together


def test_position_offset_continues_the_stream():
    logits = torch.randn(40, generator=torch.Generator().manual_seed(2))
    a = SamplingParams(temperature=1.0, seed=9)
    b = SamplingParams(temperature=1.0, seed=9, position_offset=3)
    assert [sample(logits, a, p + 3) for p in range(10)] == [sample(logits, b, p)
                                                            for p in range(10)]


def counts(logits, params):
    toks = sample_batch(logits.expand(N, -1).contiguous(), [params] * N, list(range(N)))
    return torch.bincount(torch.tensor(toks), minlength=logits.numel()).double() / N


def test_draws_follow_the_tempered_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    want = torch.softmax(logits.double() / 0.7, -1)
    got = counts(logits, SamplingParams(temperature=0.7, seed=3))
    assert torch.allclose(got, want, atol=0.02), (got, want)


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.tensor([0.3, 2.0, -1.0, 1.5, 0.0, 1.0])
    got = counts(logits, SamplingParams(temperature=1.0, seed=4, top_k=2))
    want = torch.zeros(6, dtype=torch.float64)
    want[[1, 3]] = torch.softmax(logits[[1, 3]].double(), -1)
    assert torch.allclose(got, want, atol=0.02), got
    # top_p: mass of the sorted prefix before each token: keep 1 (0.39) and 3 (+0.24 = 0.63)
    p = torch.softmax(logits.double(), -1)
    got = counts(logits, SamplingParams(temperature=1.0, seed=4, top_p=0.6))
    kept = [1, 3]
    assert set(torch.nonzero(got).flatten().tolist()) == set(kept)
    assert torch.allclose(got[kept], p[kept] / p[kept].sum(), atol=0.02)
    # a tiny top_p keeps only the best token
    assert counts(logits, SamplingParams(temperature=1.0, seed=4, top_p=1e-6))[1] == 1.0


def test_unseeded_sampling_is_refused():
    with pytest.raises(ValueError, match="needs a seed"):
        sample_batch(torch.zeros(1, 4), [SamplingParams(temperature=1.0)], [0])
    with pytest.raises(ValueError, match="1 logits rows for 2 params"):
        sample_batch(torch.zeros(1, 4), [SamplingParams()] * 2, [0, 1])
