"""The capturable decode step (`DecodeBatch`: static shapes, state addressed by index tensors) on
CPU: it computes what the per-sequence path computes, padding rows change no state and leak
nothing into live rows, and a decode loop run at padded bucket sizes (what `DecodeGraphs` replays
on a GPU) gives the monolithic generate loop's tokens."""
import pytest
import torch

from pdserve.decode.graphs import BUCKETS, DecodeGraphs
from pdserve.decode.rank import DecodeRank
from pdserve.model.batch import DecodeBatch, ForwardBatch
from pdserve.model.config import preset, preset_dict, reduced_kimi_linear
from pdserve.model.generate import ReferenceEngine, build_model, sample_next
from pdserve.model.sampling import Request, SamplingParams
from pdserve.state.layout import StateLayout

LAYOUT = StateLayout(page_tokens=16, latent_dtype="float32", conv_dtype="float32")
DS_BF16 = StateLayout(page_tokens=16, latent_dtype="bfloat16", conv_dtype="bfloat16",
                      conv_layout="DS")
PROMPTS = [list(b"graphs"), list(b"x"), list(b"a prompt that crosses a page boundary")]
PARAMS = [SamplingParams(max_tokens=9, ignore_eos=True),
          SamplingParams(max_tokens=7, temperature=0.9, seed=4, ignore_eos=True),
          SamplingParams(max_tokens=8, temperature=0.7, top_p=0.8, top_k=40, seed=9,
                         ignore_eos=True)]


def tiny_k3_like():
    la = {**preset_dict("tiny")["linear_attn_config"], "gate_lower_bound": -5.0,
          "use_full_rank_gate": True}
    return preset("tiny", q_lora_rank=48, mla_use_output_gate=True, linear_attn_config=la)


CONFIGS = {"tiny": lambda: preset("tiny"), "tiny-k3-like": tiny_k3_like,
           "kimi-linear-reduced": lambda: reduced_kimi_linear(4, 4, 2, vocab_size=512)}


def prefilled(model, layout=LAYOUT, extra=()):
    eng = ReferenceEngine(model, layout, num_pages=48, num_slots=8)
    seqs = [eng.admit(Request(f"r{i}", p, SamplingParams(max_tokens=20)))
            for i, p in enumerate(PROMPTS + list(extra))]
    eng.prefill(seqs)
    return eng, seqs


def snapshot(pools):
    return {k: v.clone() for k, v in pools.regions().items()}


def restore(pools, snap):
    for k, v in pools.regions().items():
        v.copy_(snap[k])


def changed_slots(before, after):
    """KDA slot ids whose recurrent or conv state differs in any layer."""
    out = set()
    for k in ("kda_recurrent", "kda_conv"):
        d = (before[k] != after[k]).transpose(0, 1).reshape(before[k].shape[1], -1).any(1)
        out |= set(d.nonzero().flatten().tolist())
    return out


def changed_rows(before, after):
    """(page, row) of every latent token row that differs in any MLA layer."""
    d = (before["mla_latent"] != after["mla_latent"]).any(-1).any(0)
    return {tuple(x) for x in d.nonzero().tolist()}


def new_row(table, page_tokens):
    return table.latent_pages[0][table.num_tokens // page_tokens], table.num_tokens % page_tokens


@pytest.mark.parametrize("name,layout", [("tiny", LAYOUT), ("tiny", DS_BF16),
                                         ("tiny-k3-like", LAYOUT), ("kimi-linear-reduced", LAYOUT)])
def test_decode_step_equals_the_per_sequence_path(name, layout):
    """Same logits and the same state written as the per-sequence loop that prefill / mixed
    steps still run; tokens identical. Not bit-identical: the matmuls' row counts (5 rows
    there, 3 here) and the padded-width softmax change fp32 summation order (~1e-6 relative);
    with bf16 state storage such a 1-ulp fp32 difference can flip a stored element's bf16
    rounding (2^-8 relative), which reaches the logits at ~1e-4."""
    model = build_model(CONFIGS[name](), seed=3)
    # a 2-token sequence in the step makes it mixed, which runs the per-sequence path
    eng, seqs = prefilled(model, layout, extra=[[5, 6]])
    live, filler = seqs[:3], seqs[3]
    tables, tokens = [s.table for s in live], [s.output[-1] for s in live]
    start = snapshot(eng.pools)
    mixed = ForwardBatch.of(tables + [filler.table], [1, 1, 1, 2])
    want = model(torch.tensor(tokens + [5, 6]), mixed, eng.pools, logit_rows=[0, 1, 2])
    per_seq = snapshot(eng.pools)
    restore(eng.pools, start)
    got = model(torch.tensor(tokens), ForwardBatch.of(tables, [1, 1, 1]), eng.pools)
    tensorized = snapshot(eng.pools)

    fp32 = layout.latent_dtype == layout.conv_dtype == "float32"
    tol, state_tol = (1e-5, 1e-5) if fp32 else (1e-3, 2 ** -7)
    assert torch.allclose(got, want, atol=tol * want.abs().max(), rtol=0)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    slots = [t.kda_slot for t in tables]
    assert changed_slots(start, tensorized) == set(slots)
    assert changed_rows(start, tensorized) == {new_row(t, 16) for t in tables}
    for k, v in tensorized.items():
        if k == "mla_latent":
            idx = tuple(zip(*[new_row(t, 16) for t in tables]))
            a, b = v[:, idx[0], idx[1]].float(), per_seq[k][:, idx[0], idx[1]].float()
        else:
            a, b = v[:, slots].float(), per_seq[k][:, slots].float()
        assert torch.allclose(a, b, atol=state_tol * b.abs().max(), rtol=state_tol), k


@pytest.mark.parametrize("name", ["tiny", "kimi-linear-reduced"])
def test_padded_step_leaves_padding_and_other_requests_untouched(name):
    model = build_model(CONFIGS[name](), seed=3)
    eng, seqs = prefilled(model)
    # garbage in the padding slot and page: padding rows must neither change it nor leak it
    g = torch.Generator().manual_seed(0)
    for t in (eng.pools.latent.data, eng.pools.slots.recurrent, eng.pools.slots.conv):
        t[:, 0] = 100 * torch.randn(t[:, 0].shape, generator=g)
    live = [seqs[0], seqs[2]]               # seqs[1] is running but not in this step
    tables, tokens = [s.table for s in live], [s.output[-1] for s in live]
    start = snapshot(eng.pools)
    want = model(torch.tensor(tokens), DecodeBatch.of(tables, 16, "cpu"), eng.pools)
    unpadded = snapshot(eng.pools)
    restore(eng.pools, start)
    batch = DecodeBatch.of(tables, 16, "cpu", rows=8, max_pages=6)
    got = model(torch.tensor(tokens + [0] * 6), batch, eng.pools)[:2]
    padded = snapshot(eng.pools)

    assert torch.allclose(got, want, atol=1e-5 * want.abs().max(), rtol=0)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # only the live requests' slots and new latent rows changed: not slot / page 0, not seqs[1]
    assert changed_slots(start, padded) == {t.kda_slot for t in tables}
    assert changed_rows(start, padded) == {new_row(t, 16) for t in tables}
    for k in padded:
        assert torch.allclose(padded[k], unpadded[k], atol=1e-5 * unpadded[k].abs().max(),
                              rtol=1e-5), k


@pytest.mark.parametrize("name", ["tiny", "kimi-linear-reduced"])
def test_decode_loop_at_bucket_sizes_gives_the_generate_tokens(name):
    """Each step padded to the next bucket with a fixed gather width, as a replayed graph runs
    it; requests finish at different steps, so the live count and bucket shrink on the way."""
    model = build_model(CONFIGS[name](), seed=5)
    prompts = [[t % model.config.vocab_size for t in p] for p in PROMPTS]
    want = [s.output for s in ReferenceEngine(model, LAYOUT).generate(prompts, PARAMS)]
    eng = ReferenceEngine(model, LAYOUT)
    seqs = [eng.admit(Request(f"r{i}", p, sp)) for i, (p, sp) in enumerate(zip(prompts, PARAMS))]
    eng.prefill(seqs)
    while running := [s for s in seqs if not s.finished]:
        rows = next(b for b in BUCKETS if b >= len(running))
        batch = DecodeBatch.of([s.table for s in running], 16, "cpu", rows=rows, max_pages=4)
        ids = torch.tensor([s.output[-1] for s in running] + [0] * (rows - len(running)))
        sample_next(running, model(ids, batch, eng.pools)[:len(running)], eng.eos)
        for s in running:
            s.table.num_tokens += 1
    assert [s.output for s in seqs] == want


def test_decode_batch_and_graphs_refuse_clearly():
    model = build_model(preset("tiny"), seed=1)
    eng, seqs = prefilled(model)
    long = seqs[2].table                    # 37 cached tokens: the new one needs 3 pages
    with pytest.raises(ValueError, match="does not fit max_pages=2"):
        DecodeBatch.of([long], 16, "cpu", rows=4, max_pages=2)
    with pytest.raises(ValueError, match="do not fit a batch of 1 rows"):
        DecodeBatch.of([s.table for s in seqs], 16, "cpu", rows=1)
    with pytest.raises(ValueError, match="need the pools on a CUDA device"):
        DecodeGraphs(model, eng.pools, max_tokens=64)
    with pytest.raises(ValueError, match="need the pools on a CUDA device"):
        DecodeRank("d-graphs", 0, preset("tiny"), cuda_graphs=True)
