"""The decode runtime keeps the fused KDA op's PDL contract (kernels/kda_decode): what the op reads
before its `griddepcontrol.wait` (slot ids, pools, parameters) is never produced by a kernel right
before it. On the CPU this checks the host side of that: the packed conv weight is built once per
weight load and reused by every step, and the int32 slot ids arrive with the batch instead of
being cast per layer."""
import torch
from pdserve.kernels import registry
from pdserve.kernels.kda_decode import (
    OP,
    kda_decode_cutedsl_runtime,
    kda_decode_reference,
)

from pdserve.model.batch import DecodeBatch
from pdserve.model.config import preset
from pdserve.model.generate import ReferenceEngine, build_model
from pdserve.model.kda import KDAAttention
from pdserve.model.sampling import Request, SamplingParams


def _recording_step(calls):
    def step(*args):
        calls.append({"conv_w": args[6], "slot_idx": args[14]})
        return kda_decode_reference(*args)
    return step


def _engine():
    model = build_model(preset("tiny"), seed=1)
    eng = ReferenceEngine(model)
    seqs = [eng.admit(Request(f"r{i}", list(p), SamplingParams(max_tokens=4)))
            for i, p in enumerate([b"abc", b"hello world"])]
    eng.prefill(seqs)
    return model, eng, [s.table for s in seqs], [s.output[-1] for s in seqs]


def _step(model, eng, tables, tokens, kda_step):
    batch = DecodeBatch.of(tables, eng.pools.latent.page_tokens, "cpu", rows=4)
    model(torch.tensor(tokens + [0] * (4 - len(tokens))), batch, eng.pools, kda_step=kda_step)
    for t in tables:
        t.num_tokens += 1
    return batch


def test_conv_weight_and_slot_ids_are_prepared_once():
    model, eng, tables, tokens = _engine()
    kda_layers = [m for m in model.modules() if isinstance(m, KDAAttention)]
    assert kda_layers
    steps = []
    for _ in range(3):
        calls = []
        batch = _step(model, eng, tables, tokens, _recording_step(calls))
        assert len(calls) == len(kda_layers)
        steps.append((batch, calls))
    for batch, calls in steps:
        # int32 slot ids made with the batch (padding rows: slot 0), one tensor for every layer
        assert batch.kda_slots.dtype == torch.int32
        assert torch.equal(batch.kda_slots.long(), batch.slots)
        assert all(c["slot_idx"] is batch.kda_slots for c in calls)
    for i, layer in enumerate(kda_layers):
        ws = [c.weight[:, 0] for c in (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d)]
        first = steps[0][1][i]["conv_w"]
        assert first.is_contiguous() and torch.equal(first, torch.cat(ws))
        # the very same tensor (object and storage) on every later step: no per-call rebuild
        for _, calls in steps[1:]:
            assert calls[i]["conv_w"] is first
            assert calls[i]["conv_w"].data_ptr() == first.data_ptr()
        assert layer.conv_weight() is first


def test_conv_weight_cache_follows_weight_changes():
    model = _engine()[0]
    layer = next(m for m in model.modules() if isinstance(m, KDAAttention))
    before = layer.conv_weight()
    ptr = before.data_ptr()
    assert layer.conv_weight() is before
    with torch.no_grad():                        # e.g. a checkpoint loaded in place
        layer.k_conv1d.weight.mul_(2.0)
    after = layer.conv_weight()
    ws = [c.weight[:, 0] for c in (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d)]
    assert torch.equal(after, torch.cat(ws))
    assert after.data_ptr() == ptr               # refreshed in place: captured graphs see it
    layer.v_conv1d.weight = torch.nn.Parameter(layer.v_conv1d.weight.detach().clone() + 1.0)
    ws = [c.weight[:, 0] for c in (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d)]
    assert torch.equal(layer.conv_weight(), torch.cat(ws))
    assert "_conv_w" not in dict(layer.state_dict()) and not any(
        "_conv_w" in k for k in model.state_dict())


def test_conv_weight_cache_follows_a_checkpoint_loaded_after_a_step(tmp_path):
    """pdserve's own loaders write parameters in place; the cache must see that (a `.data`
    copy would not bump the version it keys on)."""
    from pdserve.model.weights import export_checkpoint, load_checkpoint
    model = _engine()[0]
    layer = next(m for m in model.modules() if isinstance(m, KDAAttention))
    before = layer.conv_weight().clone()
    load_checkpoint(model, str(export_checkpoint(tmp_path, preset("tiny"), seed=2,
                                                 dtype=torch.float32)))
    ws = [c.weight[:, 0] for c in (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d)]
    assert not torch.equal(torch.cat(ws), before)
    assert torch.equal(layer.conv_weight(), torch.cat(ws))


def test_registry_cutedsl_entry_launches_with_pdl(monkeypatch):
    """The runtime's backend entry launches with PDL (the contract above is what makes it safe);
    an explicit pdl=False turns it off, and the other keywords pass through. (The kernel itself
    needs a Hopper GPU: tests/gpu.)"""
    import pdserve.kernels.kda_decode as kd
    assert registry._entries[(OP, "cutedsl")].impl is kda_decode_cutedsl_runtime
    seen = []
    monkeypatch.setattr(kd, "kda_decode_cutedsl",
                        lambda *a, **kw: seen.append((len(a), kw)))
    kda_decode_cutedsl_runtime(*range(16))
    kda_decode_cutedsl_runtime(*range(16), pdl=False)
    kda_decode_cutedsl_runtime(*range(16), cluster=2)
    assert seen == [(16, {"pdl": True}), (16, {"pdl": False}), (16, {"pdl": True, "cluster": 2})]
