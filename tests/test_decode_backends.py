"""Backend dispatch on the decode step: the fused KDA and MLA ops plug in per step through the
kernel registry; where a guard refuses (no Hopper GPU here) the model's own path runs, and the
registry's reference op computes the same step as the model path."""
import logging

import pytest
import torch

from pdserve.decode.rank import kda_step_for, mla_step_for
from pdserve.kernels import registry
from pdserve.kernels.kda_decode import kda_decode_reference
from pdserve.kernels.mla_decode import mla_decode_reference
from pdserve.model.batch import DecodeBatch, ForwardBatch
from pdserve.model.config import preset
from pdserve.model.generate import ReferenceEngine, build_model
from pdserve.model.sampling import Request, SamplingParams
from pdserve.state.layout import StateLayout

PROMPTS = [b"abc", b"hello world", b"y" * 70]     # the last one spans two 64-token pages


def _prefilled(model, layout=None, prompts=PROMPTS[:2]):
    eng = ReferenceEngine(model, layout)
    seqs = [eng.admit(Request(f"r{i}", list(p), SamplingParams(max_tokens=4)))
            for i, p in enumerate(prompts)]
    eng.prefill(seqs)
    return eng, seqs


def _decode_logits(model, kda_step=None, mla_step=None, layout=None, prompts=PROMPTS[:2]):
    eng, seqs = _prefilled(model, layout, prompts)
    batch = ForwardBatch.of([s.table for s in seqs], [1] * len(seqs))
    ids = torch.tensor([s.output[-1] for s in seqs])
    return model(ids, batch, eng.pools, logit_rows=batch.last_rows(), kda_step=kda_step,
                 mla_step=mla_step)


def _k3_mla_model():
    # the tiny preset with the MLA latent of Kimi Linear / K3 (512 c_kv + 64 k_pe), the width
    # the mla_decode op serves
    return build_model(preset("tiny", kv_lora_rank=512, qk_rope_head_dim=64), seed=1)


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


@pytest.mark.parametrize("latent_dtype", ["bfloat16", "float8_e4m3fn"])
def test_mla_reference_op_equals_the_model_path(latent_dtype):
    """The MLA layers' decode attention through the op (here its reference) over the paged
    cache: the op gets bf16 absorbed queries, the int32 block table, seq_lens = context + 1 and
    the fp8 scale, and the step's logits match the model's torch path."""
    model = _k3_mla_model()
    layout = StateLayout(latent_dtype=latent_dtype, conv_dtype="float32")
    calls = []

    def recording(*args, **opts):
        calls.append((args, opts))
        return mla_decode_reference(*args, **opts)

    native = _decode_logits(model, layout=layout, prompts=PROMPTS)
    fused = _decode_logits(model, mla_step=recording, layout=layout, prompts=PROMPTS)
    assert torch.allclose(native, fused, atol=3e-2 * native.abs().max(), rtol=0)
    assert (native.argmax(-1) == fused.argmax(-1)).all()
    n_mla = len(model.config.mla_layer_ids)
    assert n_mla >= 1 and len(calls) == n_mla              # every MLA layer, once
    # the prompt is cached; the step feeds its first output token, whose row is already stored
    # when the op runs
    lens = [len(p) + 1 for p in PROMPTS]
    for (q, kv, table, seq_lens, scale, kv_scale), opts in calls:
        assert q.dtype == torch.bfloat16 and q.shape == (3, 4, 576)
        assert kv.dtype == getattr(torch, latent_dtype) and kv.shape[-1] == 576
        assert table.dtype == torch.int32 and seq_lens.dtype == torch.int32
        assert seq_lens.tolist() == lens
        assert table.shape == (3, 2) and (table[:2, 1] == 0).all() and (table[2] > 0).all()
        assert scale == pytest.approx((32 + 64) ** -0.5)
        assert (kv_scale is not None) == (latent_dtype == "float8_e4m3fn")
        assert opts == {"max_seq_len": 2 * 64}              # from the page width: no host sync


def test_mla_step_padding_rows_leave_the_pool_untouched():
    """Padding rows of a fixed-size step reach the op as seq_len 1 on page 0 and store nothing:
    the pool is bit-identical there, and the live rows' logits equal the unpadded step's."""
    model = _k3_mla_model()
    eng, seqs = _prefilled(model)
    tables = [s.table for s in seqs]
    pool = eng.pools.latent.data.clone()
    seen = []

    def recording(*args, **opts):
        seen.append(args[3].clone())
        return mla_decode_reference(*args, **opts)

    batch = DecodeBatch.of(tables, eng.pools.latent.page_tokens, "cpu", rows=4)
    ids = torch.tensor([s.output[-1] for s in seqs] + [0, 0])
    padded = model(ids, batch, eng.pools, logit_rows=[0, 1], mla_step=recording)
    assert seen and all(s.tolist()[2:] == [1, 1] for s in seen)
    changed = (eng.pools.latent.data != pool).flatten(2).any(-1)    # [layers, pages]
    assert not changed[:, 0].any()                                  # page 0: untouched
    assert changed.any()                                            # the live rows' new tokens
    eng2, seqs2 = _prefilled(model)
    plain = model(ids[:2], ForwardBatch.of([s.table for s in seqs2], [1, 1]), eng2.pools,
                  logit_rows=[0, 1], mla_step=mla_decode_reference)
    assert torch.allclose(padded, plain, atol=1e-5 * plain.abs().max(), rtol=0)


def test_mla_cutedsl_request_falls_back_with_one_log_line(caplog):
    model = _k3_mla_model()
    step = mla_step_for("cutedsl")
    with caplog.at_level(logging.WARNING, logger="pdserve.kernels"):
        got = _decode_logits(model, mla_step=step)
        again = _decode_logits(model, mla_step=step)
    assert torch.equal(got, _decode_logits(model)) and torch.equal(got, again)
    lines = [r.getMessage() for r in caplog.records if "falling back" in r.getMessage()]
    assert len(lines) <= 1 and all("mla_decode" in m for m in lines)
    assert mla_step_for(registry.REFERENCE) is None


@pytest.mark.parametrize("latent_dtype", ["bfloat16", "float8_e4m3fn"])
def test_mla_fused_decode_matches_the_torch_layer(latent_dtype):
    """One MLA layer's decode attention, op path against the torch path on the same stored rows
    (norm-wise per request: only the bf16 rounding of the absorbed query and the latent output
    separates them)."""
    from pdserve.model.mla import MLAAttention, _gather_rows
    model = _k3_mla_model()
    eng, seqs = _prefilled(model, StateLayout(latent_dtype=latent_dtype, conv_dtype="float32"),
                           PROMPTS)
    pool = eng.pools.latent
    batch = DecodeBatch.of([s.table for s in seqs], pool.page_tokens, "cpu")
    attn = next(m for m in model.modules() if isinstance(m, MLAAttention))
    torch.manual_seed(0)
    q = torch.randn(len(seqs), attn.heads, attn.nope + attn.rope)
    fused = attn._fused_decode(q, pool, 0, batch, mla_decode_reference)
    ref = attn._absorbed(q[:, None], _gather_rows(pool, 0, batch), batch.context)[:, 0]
    for b in range(len(seqs)):
        err = ((fused[b] - ref[b]).norm() / ref[b].norm()).item()
        assert err < 4e-3, (b, err)


def test_mla_step_passes_the_fp8_query_mode(monkeypatch):
    """decode.mla_fp8_query reaches the op: a step built with "single" calls the resolved
    implementation with fp8_query="single" (here the reference op, standing in for an accepted
    cutedsl call), which rounds the query to one e4m3 term over an fp8 pool; "split" reaches it
    as fp8_query="split" (the query unrounded). An unknown mode is refused when the step is
    built."""
    from pdserve.kernels.mla_decode.reference import quantize_query_e4m3
    monkeypatch.setattr(registry, "resolve", lambda op, backend, problem: registry.Resolution(
        mla_decode_reference, backend, None))
    torch.manual_seed(0)
    q = torch.randn(2, 4, 576).to(torch.bfloat16)
    cache = (torch.randn(3, 64, 576) * 40).to(torch.float8_e4m3fn)
    bt = torch.tensor([[1, 2], [2, 0]], dtype=torch.int32)
    seq = torch.tensor([100, 30], dtype=torch.int32)
    args = (q, cache, bt, seq, 192 ** -0.5, 0.05)
    single = mla_step_for("cutedsl", "single")(*args)
    split = mla_step_for("cutedsl", "split")(*args)
    want = mla_decode_reference(quantize_query_e4m3(q), *args[1:])
    assert torch.equal(single[1], want[1]) and torch.equal(single[0], want[0].to(q.dtype))
    assert torch.equal(split[1], mla_decode_reference(*args)[1])
    assert (single[1] - split[1]).abs().max() > 1e-3      # the rounding shows in the LSE
    with pytest.raises(ValueError, match="fp8_query"):
        mla_step_for("cutedsl", "half")


def test_mla_step_passes_determinism(monkeypatch):
    """decode.mla_deterministic reaches the op: the resolved implementation is called with
    deterministic=True only when asked, and with fp8_query only when one was chosen (the default
    call keeps the kernel's defaults); the reference backend has no step either way."""
    seen = []
    monkeypatch.setattr(registry, "resolve", lambda op, backend, problem: registry.Resolution(
        lambda *args, **opts: seen.append(opts), backend, None))
    q = torch.zeros(1, 4, 576, dtype=torch.bfloat16)
    args = (q, torch.zeros(2, 64, 576, dtype=torch.bfloat16), None, None, 1.0)
    mla_step_for("cutedsl")(*args, out=1)
    mla_step_for("cutedsl", deterministic=True)(*args, out=2)
    mla_step_for("cutedsl", "single", True)(*args)
    mla_step_for("cutedsl", "split")(*args)
    assert seen == [{"out": 1}, {"deterministic": True, "out": 2},
                    {"fp8_query": "single", "deterministic": True}, {"fp8_query": "split"}]
    assert mla_step_for("reference", deterministic=True) is None


def test_quantize_query_e4m3_scales_each_request():
    """The single-term query takes its power-of-two scale per request (as the kernel per CTA):
    a batch of requests 1e-3, 1 and 50 times randn rounds each like that request alone, with the
    relative error of e4m3's 3 mantissa bits in each, and the split's two terms together
    recover the bf16 query to ~2^-8 of it."""
    from pdserve.kernels.mla_decode.reference import quantize_query_e4m3, split_query_e4m3
    torch.manual_seed(1)
    scale = torch.tensor([1e-3, 1.0, 50.0])[:, None, None]
    q = (torch.randn(3, 32, 576) * scale).to(torch.bfloat16)
    got = quantize_query_e4m3(q)
    for b in range(3):
        assert torch.equal(got[b], quantize_query_e4m3(q[b]))
        rel = ((got[b] - q[b].float()).norm() / q[b].float().norm()).item()
        assert 2 ** -7 < rel < 2 ** -4, (b, rel)
        hi, lo, s = split_query_e4m3(q[b])
        rel2 = (((hi.float() + lo.float()) / s - q[b].float()).norm() / q[b].float().norm()).item()
        assert rel2 < 2 ** -8, (b, rel2)
