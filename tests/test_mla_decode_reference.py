"""The MLA decode reference (the model's absorbed attention over the paged cache) vs direct
float64 formulas; the combine's formula (merge_partials) exact; guard and registry."""
import math

import pytest
import torch

from pdserve.kernels import registry
from pdserve.kernels.mla_decode import cutedsl_guard, mla_decode_reference
from pdserve.model.mla import absorbed_attention


def merge_partials(outs, lses):
    pytest.importorskip("cutlass", reason="the combine module needs nvidia-cutlass-dsl")
    from pdserve.kernels.mla_decode.combine import merge_partials as merge
    return merge(outs, lses)

SCALE = 192 ** -0.5


def make_case(B, H, lens, page_tokens=64, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    max_pages = max((l + page_tokens - 1) // page_tokens for l in lens)
    num_pages = 1 + sum((l + page_tokens - 1) // page_tokens for l in lens) + 3
    cache = torch.randn(num_pages, page_tokens, 576, generator=g)
    perm = torch.randperm(num_pages - 1, generator=g) + 1            # page 0 never handed out
    bt = torch.zeros(B, max_pages, dtype=torch.int32)
    k = 0
    for b, l in enumerate(lens):
        n = (l + page_tokens - 1) // page_tokens
        bt[b, :n] = perm[k:k + n].to(torch.int32)
        k += n
    q = torch.randn(B, H, 576, generator=g)
    return q.to(dtype), cache.to(dtype), bt, torch.tensor(lens, dtype=torch.int32)


def naive(q, cache, bt, lens, scale, kv_scale=1.0):
    B, H, _ = q.shape
    P = cache.shape[1]
    out = torch.zeros(B, H, 512, dtype=torch.float64)
    lse = torch.zeros(B, H, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            s, rows = [], []
            for t in range(int(lens[b])):
                row = cache[bt[b, t // P], t % P].double() * kv_scale
                rows.append(row)
                s.append(scale * float(q[b, h].double() @ row))
            m = max(s)
            den = sum(math.exp(x - m) for x in s)
            lse[b, h] = m + math.log(den)
            for x, row in zip(s, rows):
                out[b, h] += math.exp(x - m) / den * row[:512]
    return out, lse


@pytest.mark.parametrize("lens,page_tokens", [([1, 5, 64, 65], 64), ([130, 3], 32), ([17], 16)])
def test_reference_matches_naive(lens, page_tokens):
    """fp32 (absorbed_attention's precision) against float64 formulas."""
    q, cache, bt, sl = make_case(len(lens), 3, lens, page_tokens)
    out, lse = mla_decode_reference(q, cache, bt, sl, SCALE, out_dtype=torch.float64)
    ref_out, ref_lse = naive(q, cache, bt, sl, SCALE)
    assert out.dtype == torch.float64 and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=1e-5)


def test_reference_is_the_models_absorbed_attention():
    """Per request, the reference is absorbed_attention over that request's rows in token
    order: the op and the model's torch path share one formula (up to fp32 summation order:
    the op reads the table at its full width, the rows past a request masked)."""
    q, cache, bt, sl = make_case(2, 4, [130, 7])
    out, lse = mla_decode_reference(q, cache, bt, sl, SCALE, out_dtype=torch.float32)
    for b, n in enumerate(sl.tolist()):
        tok = torch.arange(n)
        rows = cache[bt[b, tok // 64].long(), tok % 64].float()
        o, l = absorbed_attention(q[b, None].float(), rows, 512, SCALE)
        torch.testing.assert_close(out[b], o[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse[b], l[0], rtol=1e-6, atol=1e-6)


def test_reference_fp8_scale():
    q, cache, bt, sl = make_case(2, 4, [70, 9])
    kv_scale = 0.37
    c8 = (cache.float() / kv_scale).to(torch.float8_e4m3fn)
    out, lse = mla_decode_reference(q, c8, bt, sl, SCALE, kv_scale, out_dtype=torch.float64)
    ref_out, ref_lse = naive(q, c8, bt, sl, SCALE, kv_scale)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-6, atol=1e-5)


def test_reference_single_query_rounds_q_over_fp8_only():
    """fp8_query="single" rounds the query to the kernel's one e4m3 term over an fp8 cache and
    changes nothing over a bf16 one; kernel choices are accepted and ignored."""
    from pdserve.kernels.mla_decode.query import quantize_query_e4m3
    q, cache, bt, sl = make_case(2, 4, [70, 9])
    c8 = (cache.float() / 0.37).to(torch.float8_e4m3fn)
    single = mla_decode_reference(q, c8, bt, sl, SCALE, 0.37, fp8_query="single",
                                  early_kv=True, consumers=2)
    want = mla_decode_reference(quantize_query_e4m3(q), c8, bt, sl, SCALE, 0.37,
                                out_dtype=q.dtype)
    split = mla_decode_reference(q, c8, bt, sl, SCALE, 0.37)
    assert torch.equal(single[0], want[0]) and torch.equal(single[1], want[1])
    assert (single[1] - split[1]).abs().max() > 1e-3
    plain = mla_decode_reference(q, cache, bt, sl, SCALE)
    same = mla_decode_reference(q, cache, bt, sl, SCALE, fp8_query="single")
    assert torch.equal(plain[0], same[0]) and torch.equal(plain[1], same[1])


def test_reference_ignores_pages_past_the_end():
    q, cache, bt, sl = make_case(1, 2, [70])
    out1, lse1 = mla_decode_reference(q, cache, bt, sl, SCALE)
    cache2 = cache.clone()
    cache2[bt[0, 1], 70 - 64:] = float("nan")                   # rows past the end of the page
    cache2[0] = float("nan")                                    # the padding page
    out2, lse2 = mla_decode_reference(q, cache2, bt, sl, SCALE)
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)


@pytest.mark.parametrize("cuts", [[0, 1, 140], [0, 33, 34, 100, 140], [0, 140]])
def test_merge_partials_is_exact(cuts):
    """Attention over token ranges, merged, equals attention over all tokens (fp64)."""
    B, H, L = 2, 5, 140
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, H, 576, generator=g, dtype=torch.float64)
    rows = torch.randn(B, L, 576, generator=g, dtype=torch.float64)
    s = torch.einsum("bhd,bld->bhl", q, rows) * SCALE
    full_lse = torch.logsumexp(s, -1)
    full = torch.einsum("bhl,bld->bhd", torch.softmax(s, -1), rows[..., :512])
    outs, lses = [], []
    for a, e in zip(cuts[:-1], cuts[1:]):
        ss = s[..., a:e]
        lses.append(torch.logsumexp(ss, -1))
        outs.append(torch.einsum("bhl,bld->bhd", torch.softmax(ss, -1), rows[:, a:e, :512]))
    # an empty part, carrying garbage, must not matter
    outs.append(torch.full_like(outs[0], float("nan")))
    lses.append(torch.full_like(lses[0], -float("inf")))
    out, lse = merge_partials(outs, lses)
    torch.testing.assert_close(out.double(), full, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse.double(), full_lse, rtol=1e-6, atol=1e-5)


def test_merge_partials_all_empty():
    out, lse = merge_partials(torch.zeros(2, 3, 8), torch.full((2, 3), -float("inf")))
    assert torch.equal(out, torch.zeros(3, 8)) and torch.isneginf(lse).all()


GOOD = dict(device="cuda", capability=(9, 0), batch=8, heads=12, head_dim=576, latent_dim=576,
            page_tokens=64, q_dtype="bfloat16", kv_dtype="bfloat16")


@pytest.mark.parametrize("change,needle", [
    ({}, None),
    ({"kv_dtype": "float8_e4m3fn", "heads": 32, "batch": 64, "page_tokens": 128}, None),
    ({"capability": (10, 0)}, "sm_90"),
    ({"capability": None}, "sm_90"),
    ({"device": "cpu"}, "CUDA"),
    ({"latent_dim": 512}, "576"),
    ({"heads": 64}, "heads"),
    ({"page_tokens": 16}, "page_tokens"),
    ({"kv_dtype": "float16"}, "dtype"),
    ({"q_dtype": "float32"}, "bfloat16"),
])
def test_guard(change, needle):
    reason = cutedsl_guard({**GOOD, **change})
    if needle is None:
        assert reason is None
    else:
        assert reason is not None and needle in reason


def test_registry_falls_back_to_reference_on_cpu():
    assert set(registry.backends("mla_decode")) >= {"reference", "cutedsl"}
    res = registry.resolve("mla_decode", "cutedsl", {**GOOD, "device": "cpu", "capability": None})
    assert res.backend == "reference" and res.fallback_reason
    q, cache, bt, sl = make_case(1, 2, [5])
    out, lse = res.impl(q, cache, bt, sl, SCALE)
    assert out.shape == (1, 2, 512) and lse.shape == (1, 2) and lse.dtype == torch.float32
