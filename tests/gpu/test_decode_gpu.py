"""On a Hopper GPU the decode step runs its KDA layers through the fused CuTe DSL op (the guard
accepts the real decode rows) and matches the model's reference path."""
import pytest
import torch

from pdserve.decode.rank import kda_step_for
from pdserve.kernels import registry
from pdserve.kernels.kda_decode import OP, kda_decode_problem
from pdserve.model.batch import ForwardBatch
from pdserve.model.config import preset, preset_dict
from pdserve.model.generate import ReferenceEngine, build_model
from pdserve.model.sampling import Request, SamplingParams
from pdserve.state.layout import StateLayout

pytestmark = pytest.mark.skipif(not torch.cuda.is_available()
                                or torch.cuda.get_device_capability() != (9, 0),
                                reason="needs a Hopper (sm_90) GPU")


def model_with(lower_bound):
    la = {**preset_dict("tiny")["linear_attn_config"], "num_heads": 12, "head_dim": 128,
          "gate_lower_bound": lower_bound}
    cfg = preset("tiny", hidden_size=256, linear_attn_config=la)
    return build_model(cfg, dtype=torch.bfloat16, seed=3).cuda()


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("conv_layout", ["SD", "DS"])
def test_cutedsl_decode_step_matches_reference_path(lower_bound, conv_layout):
    model = model_with(lower_bound)
    layout = StateLayout(latent_dtype="bfloat16", conv_dtype="bfloat16", conv_layout=conv_layout)
    outs, accepted = [], []
    step = kda_step_for("cutedsl")

    def spy(*args):
        accepted.append(registry.resolve(OP, "cutedsl", kda_decode_problem(*args)).backend)
        return step(*args)

    for kda_step in (None, spy):
        eng = ReferenceEngine(model, layout, num_pages=32, num_slots=8)
        seqs = [eng.admit(Request(f"r{i}", list(p), SamplingParams(max_tokens=8)))
                for i, p in enumerate([b"abc", b"hello world", b"x" * 70])]
        eng.prefill(seqs)
        logits = []
        for step_i in range(4):  # the same input tokens on both paths (no argmax feedback)
            batch = ForwardBatch.of([s.table for s in seqs], [1] * 3)
            ids = torch.tensor([(31 * step_i + 7 * i) % 256 for i in range(3)], device="cuda")
            out = model(ids, batch, eng.pools, logit_rows=batch.last_rows(), kda_step=kda_step)
            for s in seqs:
                s.table.num_tokens += 1
            logits.append(out)
        outs.append((torch.stack(logits), eng.pools.slots.recurrent.clone()))
    assert accepted and set(accepted) == {"cutedsl"}
    (ref, ref_state), (fast, fast_state) = outs
    assert torch.allclose(fast, ref, atol=3e-2 * ref.abs().max(), rtol=0)
    assert torch.allclose(fast_state, ref_state, atol=1e-2, rtol=1e-2)
