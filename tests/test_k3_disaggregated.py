"""A reduced K3 served disaggregated (reference prefill -> NIXL -> decode runtime) gives the
monolithic generate loop's tokens: in-process ranks at TP 1 -> 1 (Ray rank actors with a gloo
TP group at 2 -> 1: test_disaggregated.test_resharded_tokens_equal_monolithic)."""
import pytest

from pdserve.model.config import reduced_kimi_k3

from test_disaggregated import PARAMS, PROMPTS, Pair, decode_to_end, monolithic

CONFIG = reduced_kimi_k3(num_layers=5)
K3_PROMPTS = [[t % CONFIG.vocab_size for t in p] for p in PROMPTS]


@pytest.fixture(scope="module")
def want():
    return monolithic(CONFIG, K3_PROMPTS, PARAMS)


def test_k3_disaggregated_tokens_equal_monolithic(want):
    pair = Pair(CONFIG, "-k3")
    try:
        seqs = [pair.decode.admit(h) for h in pair.handles(K3_PROMPTS, PARAMS)]
        pair.drain()
        assert not pair.prefill.seqs, "source state not freed after the transfer"
        assert decode_to_end(pair.decode, seqs) == want
        assert pair.rank.pools.empty and pair.prefill.engine.pools.empty
    finally:
        pair.close()
