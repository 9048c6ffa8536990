"""K3's state (96 KDA heads, 96 MLA heads, at reduced widths) through the pools, the transfer
planner at p -> d dividing the heads, and TP = 2 against TP = 1 on the reference engine."""

import pytest
import torch

from pdserve.model.config import reduced_kimi_k3
from pdserve.model.generate import ReferenceEngine, build_model
from pdserve.model.parallel import TPGroup
from pdserve.model.sampling import Request, SamplingParams
from pdserve.state.layout import RankShapes, StateLayout

from test_tp import tp_results
from test_transfer_plan import run_case

K3 = RankShapes.of(reduced_kimi_k3(num_layers=5))
LAYOUT = StateLayout(page_tokens=16, latent_dtype="float32", conv_dtype="float32")
PROMPTS = [list(range(3, 20)), [9, 8, 7]]
FORCED = [11, 200, 3]


def test_reduced_k3_rank_shapes():
    assert (K3.kda_heads, K3.mla_heads, K3.n_kda, K3.n_mla) == (96, 96, 3, 2)


@pytest.mark.parametrize("p,d,c", [(1, 1, 1), (1, 2, 1), (2, 1, 1), (2, 2, 2), (4, 8, 8),
                                   (8, 4, 1), (3, 6, 1), (6, 3, 3), (1, 12, 12), (12, 4, 1)])
def test_k3_state_moves_exact_bytes(p, d, c):
    """Executing the plan leaves every destination rank's pools exactly as a prefill in the
    destination topology would (the planner check of test_transfer_plan, on K3's heads)."""
    run_case(K3, p, d, c, interleave=16 if c > 1 else 1, staging_width=max(1, d // p), n=70)


def _run(tp: TPGroup):
    torch.set_num_threads(1)
    model = build_model(reduced_kimi_k3(num_layers=5), tp, seed=11)
    eng = ReferenceEngine(model, LAYOUT, num_pages=32, num_slots=4)
    seqs = [eng.admit(Request(f"r{i}", p, SamplingParams(max_tokens=4)))
            for i, p in enumerate(PROMPTS)]
    rows = [eng.step(seqs, PROMPTS)]
    for t in FORCED:
        rows.append(eng.step(seqs, [[t], [t]]))
    return torch.stack(rows), eng.pools.slots.recurrent.shape


def test_k3_tp2_equals_tp1():
    ref, ref_shape = _run(TPGroup())
    results = tp_results(_run)
    scale = ref.abs().max()
    for logits, shape in results:
        assert torch.allclose(logits, ref, atol=1e-5 * scale, rtol=0), (logits - ref).abs().max()
        assert shape[2] == ref_shape[2] // 2 == 48   # each rank holds half the 96 KDA heads
