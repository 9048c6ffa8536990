"""Backend dispatch on the decode step: the fused KDA op plugs in per step through the kernel
registry; where its guard refuses (no Hopper GPU here) the model's own path runs, and the
registry's reference op computes the same step as the model path."""
import logging

import torch

from pdserve.decode.rank import kda_step_for
from pdserve.kernels import registry
from pdserve.kernels.kda_decode import kda_decode_reference
from pdserve.model.batch import ForwardBatch
from pdserve.model.config import preset
from pdserve.model.generate import ReferenceEngine, build_model
from pdserve.model.sampling import Request, SamplingParams


def _decode_logits(model, kda_step):
    eng = ReferenceEngine(model)
    seqs = [eng.admit(Request(f"r{i}", list(p), SamplingParams(max_tokens=4)))
            for i, p in enumerate([b"abc", b"hello world"])]
    eng.prefill(seqs)
    batch = ForwardBatch.of([s.table for s in seqs], [1, 1])
    ids = torch.tensor([s.output[-1] for s in seqs])
    return model(ids, batch, eng.pools, logit_rows=batch.last_rows(), kda_step=kda_step)


def test_reference_op_equals_the_model_path():
    model = build_model(preset("tiny"), seed=1)
    native = _decode_logits(model, None)
    fused = _decode_logits(model, kda_decode_reference)  # bf16 output rows, as the kernel's
    assert torch.allclose(native, fused, atol=5e-2 * native.abs().max(), rtol=0)
    assert (native.argmax(-1) == fused.argmax(-1)).all()


def test_cutedsl_request_falls_back_with_one_log_line(caplog):
    model = build_model(preset("tiny"), seed=1)
    step = kda_step_for("cutedsl")
    with caplog.at_level(logging.WARNING, logger="pdserve.kernels"):
        got = _decode_logits(model, step)
        again = _decode_logits(model, step)
    assert torch.equal(got, _decode_logits(model, None)) and torch.equal(got, again)
    lines = [r.getMessage() for r in caplog.records if "falling back" in r.getMessage()]
    assert len(lines) <= 1 and all("kda_decode" in m for m in lines)
    assert kda_step_for(registry.REFERENCE) is None
