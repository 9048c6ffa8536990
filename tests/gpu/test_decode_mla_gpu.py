"""On a Hopper GPU the decode step runs its MLA layers' attention through the CuTe DSL op
(`mla_step_for("cutedsl")`: the guard accepts a bf16 / fp8 latent pool with K3's 512 + 64 latent)
and matches the model's torch path.

Per call (teacher-forced): the kernel (the launch plan's defaults, early_kv among them, as the
runtime runs it) on the model's real absorbed queries and pages against the reference op on the
same arguments (per-request relative error < 1.5e-2, as
tests/gpu/test_mla_decode_gpu.py). End to end over 4 steps: logits within 3e-2 of their max of the
torch path's, eagerly and replayed from the decode step's CUDA graphs.
"""
import pytest
import torch

from pdserve.decode.graphs import DecodeGraphs
from pdserve.decode.rank import mla_step_for
from pdserve.kernels import registry
from pdserve.kernels.mla_decode import OP, mla_decode_reference, problem_from_tensors
from pdserve.model.batch import ForwardBatch
from pdserve.model.config import preset
from pdserve.model.generate import ReferenceEngine, build_model
from pdserve.model.sampling import Request, SamplingParams
from pdserve.state.layout import StateLayout

pytestmark = pytest.mark.skipif(not torch.cuda.is_available()
                                or torch.cuda.get_device_capability() != (9, 0),
                                reason="needs a Hopper (sm_90) GPU")

PROMPTS = [b"abc", b"hello world", b"x" * 130]       # the last one spans three 64-token pages


def _model():
    cfg = preset("tiny", hidden_size=256, num_attention_heads=16, kv_lora_rank=512,
                 qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64)
    return build_model(cfg, dtype=torch.bfloat16, seed=5).cuda()


def _run(model, layout, mla_step, graphs: bool):
    eng = ReferenceEngine(model, layout, num_pages=32, num_slots=8)
    seqs = [eng.admit(Request(f"r{i}", list(p), SamplingParams(max_tokens=8)))
            for i, p in enumerate(PROMPTS)]
    eng.prefill(seqs)
    tables = [s.table for s in seqs]
    dg = DecodeGraphs(model, eng.pools, 512, buckets=(4,), mla_step=mla_step) if graphs else None
    logits = []
    for step_i in range(4):              # the same input tokens on every path
        ids = [(31 * step_i + 7 * i) % 256 for i in range(len(seqs))]
        if dg is not None:
            assert dg.refuse(tables) is None
            out, _ = dg.run(tables, ids)
        else:
            batch = ForwardBatch.of(tables, [1] * len(seqs))
            out = model(torch.tensor(ids, device="cuda"), batch, eng.pools,
                        logit_rows=batch.last_rows(), mla_step=mla_step)
        for t in tables:
            t.num_tokens += 1
        logits.append(out.float().clone())  # a graph output is valid until the next run
    return torch.stack(logits)


@pytest.mark.parametrize("latent_dtype,fp8_query", [("bfloat16", "split"),
                                                    ("float8_e4m3fn", "split"),
                                                    ("float8_e4m3fn", "single"),
                                                    ("float8_e4m3fn", None)])
def test_cutedsl_mla_decode_matches_the_torch_path(latent_dtype, fp8_query):
    """fp8_query="single" (decode.mla_fp8_query; None: unset, the kernel's default "single"):
    each call against the reference that rounds the query the same way; end to end against the
    torch path with the same tolerance."""
    model = _model()
    layout = StateLayout(latent_dtype=latent_dtype, conv_dtype="bfloat16")
    step = mla_step_for("cutedsl", fp8_query)
    errs, backends = [], []

    def spy(*args, **opts):
        backends.append(registry.resolve(OP, "cutedsl", problem_from_tensors(*args)).backend)
        out = step(*args, **opts)
        torch.cuda.synchronize()
        ref, _ = mla_decode_reference(*args, out_dtype=torch.float64,
                                      fp8_query=fp8_query or "single")
        errs.append(((out[0].double() - ref).flatten(1).norm(dim=1)
                     / ref.flatten(1).norm(dim=1)).max().item())
        return out

    ref = _run(model, layout, None, graphs=False)
    fast = _run(model, layout, spy, graphs=False)
    assert backends and set(backends) == {"cutedsl"}
    assert len(errs) == 4 * len(model.config.mla_layer_ids)
    assert max(errs) < 1.5e-2, errs
    assert torch.allclose(fast, ref, atol=3e-2 * ref.abs().max(), rtol=0)
    # the captured step (the op resolved at capture, split count from the graph's page width)
    graphed = _run(model, layout, step, graphs=True)
    assert torch.allclose(graphed, ref, atol=3e-2 * ref.abs().max(), rtol=0)
