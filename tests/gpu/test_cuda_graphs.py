"""CUDA graphs of the reference decode step (`pdserve.decode.graphs`) give the eager step's tokens:
tiny and a reduced kimi-linear-48b-a3b, several batch sizes (padded to their buckets), greedy and
seeded sampling, requests finishing at different steps so the bucket changes mid-run; the padding
slot and page stay bit-identical.

fp32 weights and state with TF32 off: the graph runs each step at its bucket size and a fixed
gather width, the eager step at the live size, so the two differ only by fp32 summation order.
"""
import pytest
import torch

from pdserve.decode.graphs import DecodeGraphs
from pdserve.model.config import preset, reduced_kimi_linear
from pdserve.model.generate import ReferenceEngine, build_model, sample_next
from pdserve.model.sampling import Request, SamplingParams
from pdserve.state.layout import StateLayout

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LAYOUT = StateLayout(page_tokens=16, latent_dtype="float32", conv_dtype="float32")
CONFIGS = {"tiny": lambda: preset("tiny"),
           "kimi-linear-reduced": lambda: reduced_kimi_linear(4, 8, 2, vocab_size=1024)}
STEPS = 12


@pytest.fixture(autouse=True)
def _fp32_matmuls():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request):
    return build_model(CONFIGS[request.param](), seed=0).cuda()


def requests(n, vocab):
    """Prompts of 3..40 tokens (some cross a 16-token page), alternately greedy and seeded;
    max_tokens spread so requests leave the batch at different steps."""
    return [Request(f"r{i}", [(7 * i + 3 * j) % vocab for j in range(3 + (11 * i) % 38)],
                    SamplingParams(max_tokens=STEPS - i % 5, ignore_eos=True,
                                   temperature=0.0 if i % 2 == 0 else 0.8, seed=i))
            for i in range(n)]


def prefilled(model, reqs):
    eng = ReferenceEngine(model, LAYOUT, num_pages=4 * len(reqs) + 1, num_slots=len(reqs) + 1)
    seqs = [eng.admit(r) for r in reqs]
    eng.prefill(seqs)
    return eng, seqs


@pytest.mark.parametrize("batch", [1, 3, 8, 13])
def test_graph_replay_gives_the_eager_tokens(model, batch):
    reqs = requests(batch, model.config.vocab_size)
    eager, want = prefilled(model, reqs)
    while running := [s for s in want if not s.finished]:
        eager.decode(running)

    eng, seqs = prefilled(model, reqs)
    graphs = DecodeGraphs(model, eng.pools, max_tokens=64, buckets=(1, 2, 4, 8, 16))
    pools = eng.pools
    padding = [pools.latent.data[:, 0].clone(), pools.slots.recurrent[:, 0].clone(),
               pools.slots.conv[:, 0].clone()]
    while running := [s for s in seqs if not s.finished]:
        logits, _ = graphs.run([s.table for s in running], [s.output[-1] for s in running])
        sample_next(running, logits, eng.eos)
        for s in running:
            s.table.num_tokens += 1
    assert [s.output for s in seqs] == [s.output for s in want]
    assert all(torch.equal(a, b) for a, b in zip(
        padding, [pools.latent.data[:, 0], pools.slots.recurrent[:, 0], pools.slots.conv[:, 0]]))


def test_one_replayed_step_matches_the_eager_logits(model):
    """The same step both ways from the same state: logits within fp32 rounding."""
    reqs = requests(5, model.config.vocab_size)
    eng, seqs = prefilled(model, reqs)
    tables, tokens = [s.table for s in seqs], [s.output[-1] for s in seqs]
    start = {k: v.clone() for k, v in eng.pools.regions().items()}
    graphs = DecodeGraphs(model, eng.pools, max_tokens=64, buckets=(8,))
    got, _ = graphs.run(tables, tokens)
    for k, v in eng.pools.regions().items():
        v.copy_(start[k])
    want = eng.step(seqs, [[t] for t in tokens])
    assert torch.allclose(got, want, atol=1e-4 * want.abs().max(), rtol=0)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
