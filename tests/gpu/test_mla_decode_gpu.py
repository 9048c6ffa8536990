"""CuTe DSL MLA decode vs the torch reference on the GPU (H200, sm_90a).

Fresh random inputs each run; outputs and LSE are NaN-poisoned before the kernel, and the
padding page and every cache row past a request's end are NaN too, so unwritten outputs or
reads past the end show up as NaN. Every case runs the launch plan's defaults (what the decode
runtime and the benchmark run: early_kv, the fp8 single query, the tile pool where planned);
the other variants are asked for with explicit choices (plan.plan_call's keywords), and each
check asserts the plan ran what was asked. The reference (reference.py: the model's absorbed
attention in fp32) rounds the query as the call did.
"""
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SCALE = 192 ** -0.5
PAGE = 64


def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def make_case(lens, H, fp8, page_tokens=PAGE, seed=None, keys="random"):
    """keys: "random"; "rising" / "falling" (each request's keys scaled from 0.02 to 1.5 of
    random along its tokens, or back: the running maxima rise through the sequence / never
    after its start); "step" (keys at 0.05 of random before 3/4 of each request, random from
    there: every head's maximum jumps by ~10 nats deep inside the sequence); "flat" (every
    token of a request has the same first 64 latent dims and q, scaled by 0.01, is zero past
    them: all of a head's scores are equal, so its LSE is that score + ln L and a tile counted
    twice or missed moves it by ln(1 +- tile / L))."""
    dev = "cuda"
    g = torch.Generator(device=dev)
    g.manual_seed(int(torch.randint(0, 2**31, (1,))) if seed is None else seed)
    B = len(lens)
    n_pages = [(l + page_tokens - 1) // page_tokens for l in lens]
    num_pages = 1 + sum(n_pages) + 2
    max_pages = max(n_pages) + 1
    cache = torch.randn(num_pages, page_tokens, 576, device=dev, generator=g)
    perm = torch.randperm(num_pages - 1, device=dev, generator=g) + 1    # page 0 = padding
    bt = torch.zeros(B, max_pages, dtype=torch.int32, device=dev)
    k = 0
    for b, n in enumerate(n_pages):
        bt[b, :n] = perm[k:k + n].to(torch.int32)
        k += n
    q = torch.randn(B, H, 576, device=dev, generator=g).to(torch.bfloat16)
    if keys == "flat":
        q[..., 64:] = 0
        q *= 0.01           # scores ~0.01: their rounding, whatever the MMA path, ~1e-6
        for b, l in enumerate(lens):
            tok = torch.arange(l, device=dev)
            rows = bt[b, tok // page_tokens].long(), tok % page_tokens
            cache[rows[0], rows[1], :64] = cache[bt[b, 0], 0, :64]
    elif keys != "random":
        for b, l in enumerate(lens):
            tok = torch.arange(l, device=dev)
            page, row = bt[b, tok // page_tokens].long(), tok % page_tokens
            if keys == "step":
                cache[page[:3 * l // 4], row[:3 * l // 4]] *= 0.05
            else:
                ramp = torch.linspace(0.02, 1.5, l, device=dev)
                cache[page, row] *= (ramp if keys == "rising" else ramp.flip(0))[:, None]
    kv_scale = None
    if fp8:
        kv_scale = 0.05
        cache = (cache * 2.0 / kv_scale).clamp(-440, 440).to(torch.float8_e4m3fn)
    else:
        cache = cache.to(torch.bfloat16)
    raw = cache.view(torch.uint8)                       # NaN bytes: 0x7F (e4m3fn), 0x7FC0 (bf16)
    nan = torch.tensor([0x7F] if fp8 else [0xC0, 0x7F], dtype=torch.uint8, device=dev)
    for b, (l, n) in enumerate(zip(lens, n_pages)):
        tail = l - (n - 1) * page_tokens
        raw[bt[b, n - 1], tail:] = nan.repeat(raw.shape[-1] // nan.numel())  # past the end
    raw[0] = nan.repeat(raw.shape[-1] // nan.numel())                      # padding page
    seq = torch.tensor(lens, dtype=torch.int32, device=dev)
    return q, cache, bt, seq, kv_scale


def check(lens, H, fp8, page_tokens=PAGE, keys="random", **kw):
    """One call with the choices `kw` against the reference; returns the call's plan."""
    from pdserve.kernels.mla_decode import mla_decode_reference
    from pdserve.kernels.mla_decode.launch import mla_decode_cutedsl, plan_for
    q, cache, bt, seq, kv_scale = make_case(lens, H, fp8, page_tokens, keys=keys)
    B = len(lens)
    out = torch.full((B, H, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((B, H), float("nan"), dtype=torch.float32, device="cuda")
    o, l = mla_decode_cutedsl(q, cache, bt, seq, SCALE, kv_scale, out=out, lse=lse, **kw)
    torch.cuda.synchronize()
    assert o is out and l is lse
    plan = plan_for(q, cache, seq, **kw)
    ref_o, ref_l = mla_decode_reference(q, cache, bt, seq, SCALE, kv_scale,
                                        out_dtype=torch.float64, fp8_query=plan.fp8_query)
    assert not torch.isnan(out).any(), f"NaN in output ({torch.isnan(out).sum()} elements)"
    assert not torch.isnan(lse).any(), "NaN in lse"
    err = (out.double() - ref_o).flatten(1).norm(dim=1) / ref_o.flatten(1).norm(dim=1)
    assert err.max() < 1.5e-2, f"max per-request relative error {err.max():.3g} (b={err.argmax()})"
    lerr = (lse.double() - ref_l.double()).abs().max()
    # the fp8 path computes S on the e4m3 wgmma, whose accumulator keeps ~13 mantissa bits
    # between its fp32 promotions every 64 dims (attention.py): logits of |s| ~ 15 then carry
    # errors of a few 1e-3, the bf16 path stays < 5e-3
    ltol = 1e-2 if fp8 else 5e-3
    assert lerr < ltol, f"lse max abs error {lerr:.3g} (tolerance {ltol}, plan {plan})"
    for name, want in kw.items():           # the call ran what was asked (None: the default)
        if want is None:
            continue
        if name in ("num_splits", "head_groups"):
            assert getattr(plan, name) == want, (name, plan)
        elif name in ("consumers", "pool_div", "d_split", "lazy_max", "q_half", "xmerge",
                      "qk_joint", "early_kv"):
            assert getattr(plan.attention, name) == want, (name, plan)
    return plan


LENS = {
    "B1_short": [1], "B1_63": [63], "B1_64": [64], "B1_65": [65], "B1_1000": [1000],
    "B1_8K+17": [8192 + 17], "B1_128K": [131072], "B1_128K-1": [131071],
    "B8_mixed": [1, 2, 63, 64, 65, 129, 4097, 40000],
    "B64_mixed": None,   # filled below
}


def _b64_lens():
    g = torch.Generator().manual_seed(7)
    lens = torch.randint(1, 20000, (64,), generator=g).tolist()
    lens[0], lens[1], lens[2], lens[3] = 1, 64, 131072 - 5, 32768
    return lens


@pytest.mark.skipif(not _sm90(), reason="needs sm_90")
def test_plan_reads_the_device():
    """The plan's device properties come from the GPU; its defaults are the runtime's (early_kv;
    over an fp8 cache the single query)."""
    from pdserve.kernels.mla_decode.plan import Device, plan_call
    props = torch.cuda.get_device_properties(0)
    dev = Device.of("cuda")
    assert dev.sm_count == props.multi_processor_count
    assert dev.smem_per_block == 227 * 1024                 # sm_90's opt-in maximum
    p = plan_call(1, 32, 8192, True, PAGE, dev)
    assert p.attention.early_kv and p.fp8_query == "single"


@pytest.mark.skipif(not _sm90(), reason="needs sm_90")
@pytest.mark.parametrize("early_kv", [True, False], ids=["early_kv", "plain"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("H", [12, 32])
@pytest.mark.parametrize("case", list(LENS))
def test_matches_reference(case, H, fp8, early_kv):
    """The plan's defaults (fp8: the single query), with and without early_kv."""
    lens = LENS[case] or _b64_lens()
    check(lens, H, fp8, early_kv=early_kv)


@pytest.mark.skipif(not _sm90(), reason="needs sm_90")
@pytest.mark.parametrize("H", [12, 32])
@pytest.mark.parametrize("case", list(LENS))
def test_fp8_split_query(case, H):
    """fp8_query="split" (the query as Q_hi + Q_lo), every length case."""
    check(LENS[case] or _b64_lens(), H, True, fp8_query="split")


@pytest.mark.skipif(not _sm90(), reason="needs sm_90")
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("H", [12, 32])
@pytest.mark.parametrize("page_tokens", [128, 256])
def test_larger_pages(page_tokens, H, fp8):
    """Several tiles per page (page row = page * tiles_per_page + t % tiles_per_page), both head
    paddings (N = 16 / 32), both caches."""
    check([1, 127, 129, 3000, 20000 + 33], H, fp8, page_tokens=page_tokens)


@pytest.mark.skipif(not _sm90(), reason="needs sm_90")
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("H", [32, 24, 20])
@pytest.mark.parametrize("lens,num_splits", [([1], None), ([8192 + 17], None), ([8192 + 17], 3),
                                             ([1, 2, 63, 64, 65, 129, 4097, 40000], None),
                                             ([100, 70000], 300)])
def test_head_groups(lens, num_splits, H, fp8):
    """Each request's heads over 2 CTAs per split (the launch sees B * 2 requests of H / 2 heads
    reading block-table / seq_lens row b // 2): the reference, for every head."""
    check(lens, H, fp8, head_groups=2, num_splits=num_splits, max_seq_len=max(lens))


@pytest.mark.skipif(not _sm90(), reason="needs sm_90")
@pytest.mark.parametrize("H", [32, 12, 20])
@pytest.mark.parametrize("lens,num_splits", [([1], None), ([63], None), ([8192 + 17], None),
                                             ([8192 + 17], 1), ([8192 + 17], 3),
                                             ([1, 64, 65, 129, 3000, 20000 + 33], None),
                                             ([1, 64, 65, 129, 3000, 20000 + 33], 64)])
@pytest.mark.parametrize("d_split", [2, 1])
def test_bf16_d_split(d_split, lens, num_splits, H):
    """bf16 with O's latent dims divided between 2 CTAs per (split, request), each running the
    split's tiles and writing its 256 dims (d_split 1: the whole row): one split (the output
    rows), forced and planned splits with empty ones, partial last tiles, head groups (H=32 /
    20 at short contexts), H=12's h_pad 16; the launch ran the asked variant (check)."""
    check(lens, H, False, num_splits=num_splits, max_seq_len=max(lens), d_split=d_split)


@pytest.mark.skipif(not _sm90(), reason="needs sm_90")
@pytest.mark.parametrize("H", [32, 12, 20])
@pytest.mark.parametrize("lens,num_splits", [
    ([1], None), ([8192 + 17], None), ([131072], None), ([8192 + 17], 3), ([100, 70000], 300),
    ([1, 2, 63, 64, 65, 129, 4097, 40000], None), ("B64", None)])
def test_fp8_single_query(lens, num_splits, H):
    """fp8_query="single": the query as one e4m3 term, against the reference that rounds it the
    same way (quantize_query_e4m3). The split and single roundings differ by far more than the
    tolerance (~5e-2 relative output error on these inputs), so this fails if either side
    does not round. One and two consumers, head groups (H = 20, 32 short), split counts."""
    lens = _b64_lens() if lens == "B64" else lens
    plan = check(lens, H, True, fp8_query="single", num_splits=num_splits,
                 max_seq_len=max(lens))
    assert plan.attention.q_terms == 1


@pytest.mark.skipif(not _sm90(), reason="needs sm_90")
def test_fp8_query_refusals():
    from pdserve.kernels.mla_decode.launch import mla_decode_cutedsl
    q, cache, bt, seq, kv_scale = make_case([100], 12, True)
    with pytest.raises(ValueError, match="fp8_query must be"):
        mla_decode_cutedsl(q, cache, bt, seq, SCALE, kv_scale, fp8_query="half")
    with pytest.raises(TypeError, match="core"):
        mla_decode_cutedsl(q, cache, bt, seq, SCALE, kv_scale, core="mma")
    # a bf16 cache has no fp8 query: "single" changes nothing there
    qb, cb, btb, sb, _ = make_case([100], 12, False)
    a = mla_decode_cutedsl(qb, cb, btb, sb, SCALE, fp8_query="single")
    b = mla_decode_cutedsl(qb, cb, btb, sb, SCALE)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.skipif(not _sm90(), reason="needs sm_90")
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("num_splits", [1, 3, 64, 300])
def test_forced_splits(num_splits, fp8):
    """Both epilogues (direct and partial + combine), many empty splits."""
    lens = [1, 65, 3000, 9000, 128, 77, 5, 20000]
    check(lens, 32, fp8, num_splits=num_splits, max_seq_len=max(lens))


@pytest.mark.skipif(not _sm90(), reason="needs sm_90")
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("shape", [(1, 1), (1, 4), (2, 8), (4, 8), (4, 16), (8, 32), (16, 16)])
@pytest.mark.parametrize("num_splits", [3, 64, 300])
def test_combine_shapes(num_splits, shape, fp8):
    """Each combine shape (column chunks, split groups) -- those the plan picks and others --
    asked for explicitly, against the reference: splits beyond a thread's first UNROLL loads,
    empty splits, fp32 (bf16 cache) and bf16 (fp8 cache) partials."""
    lens = [1, 65, 3000, 9000, 128, 77, 5, 20000]
    plan = check(lens, 32, fp8, num_splits=num_splits, max_seq_len=max(lens), combine=shape)
    assert (plan.combine.chunks, plan.combine.groups) == shape


# consumer warpgroups that are not the plan's default for long splits (fp8: 2, bf16: 1)
CONSUMER_VARIANTS = {"fp8-1": (True, 1), "bf16-2": (False, 2), "fp8-2": (True, 2)}


@pytest.mark.skipif(not _sm90(), reason="needs sm_90")
@pytest.mark.parametrize("H", [12, 32])
@pytest.mark.parametrize("num_splits", [None, 1, 3, 64])
@pytest.mark.parametrize("variant", list(CONSUMER_VARIANTS))
def test_consumer_variants(variant, num_splits, H):
    """One / two consumer warpgroups (tiles alternate between the two, merged in the
    epilogue): splits of 1 tile (consumer 1 empty), 2, odd and even tile counts, both
    epilogues."""
    fp8, consumers = CONSUMER_VARIANTS[variant]
    lens = [1, 64, 65, 128, 129, 192, 3000, 20000 + 33]
    check(lens, H, fp8, num_splits=num_splits, max_seq_len=max(lens), consumers=consumers)


# lengths for the fp8 epilogue / PV test: splits of 1 tile (consumer 1 empty), 2, 3 (odd), 4 (even)
# tiles at num_splits None / 1, many tiles per split, partial last tiles; with 3 or 64 forced
# splits also single-tile and empty splits
CANDIDATE_LENS = [1, 64, 65, 128, 129, 192, 256, 3000, 20000 + 33]


def _lens_kw(lens, num_splits):
    return dict(num_splits=num_splits, max_seq_len=max(lens))


@pytest.mark.skipif(not _sm90(), reason="needs sm_90")
@pytest.mark.parametrize("H", [12, 32])
@pytest.mark.parametrize("num_splits", [None, 1, 3, 64])
@pytest.mark.parametrize("consumers", [2, 1])
def test_fp8_epilogue_and_pv(consumers, num_splits, H):
    """fp8: the 16-byte vector epilogue (bf16 output at 1 split, bf16 partials otherwise) and
    the V-prefetching PV, with two and one consumer warpgroups. The outputs are NaN-poisoned
    by check(), so a missed store shows up."""
    check(CANDIDATE_LENS, H, True, consumers=consumers, head_groups=1,
          **_lens_kw(CANDIDATE_LENS, num_splits))
    check([8192 + 17], H, True, consumers=consumers, head_groups=1, early_kv=True,
          **_lens_kw([8192 + 17], num_splits))
    if H == 32:                     # H = 24 (h_pad 32, heads 24..31 padded: stores predicated)
        check([1, 65, 3000], 24, True, consumers=consumers, head_groups=1,
              **_lens_kw([1, 65, 3000], num_splits))


@pytest.mark.skipif(not _sm90(), reason="needs sm_90")
@pytest.mark.parametrize("H", [12, 32])
@pytest.mark.parametrize("num_splits", [None, 1, 3, 64])
@pytest.mark.parametrize("q_half,xmerge", [(True, True), (False, True), (True, False)])
def test_fp8_pair_halves(q_half, xmerge, num_splits, H):
    """fp8 two consumers: Q loaded, scaled and stored in halves, one per consumer (q_half, the
    default), or whole by both and stored by consumer 0; the heads merged and written in halves
    (xmerge, the default: consumer 1 empty in one-tile splits) or all by consumer 0; H = 12 /
    10 (h_pad 16: halves of 5 and 4 Q vectors), 32 / 24 (heads 24..31 zero) and two groups of
    16, both query modes; one-tile, empty and long splits; NaN-poisoned outputs."""
    kw = dict(consumers=2, q_half=q_half, xmerge=xmerge)
    check(CANDIDATE_LENS, H, True, head_groups=1, **kw, **_lens_kw(CANDIDATE_LENS, num_splits))
    check([8192 + 17], H, True, head_groups=1, fp8_query="split", **kw,
          **_lens_kw([8192 + 17], num_splits))
    if H == 32:
        check([1, 65, 3000], 24, True, head_groups=1, **kw, **_lens_kw([1, 65, 3000], num_splits))
        check([129, 8192 + 17], 32, True, head_groups=2, **kw,
              **_lens_kw([129, 8192 + 17], num_splits))
    else:
        check([1, 65, 3000], 10, True, head_groups=1, **kw, **_lens_kw([1, 65, 3000], num_splits))


@pytest.mark.skipif(not _sm90(), reason="needs sm_90")
@pytest.mark.parametrize("joint", [True, False])
@pytest.mark.parametrize("num_splits", [None, 1, 3, 64])
@pytest.mark.parametrize("consumers", [2, 1])
def test_fp8_qk_joint(consumers, num_splits, joint):
    """fp8 S^T at h_pad 16 with and without the joint [Q_hi ; Q_lo] operand (one e4m3 wgmma
    m64n32k32 per k-step, chunks folded into S^T): H = 12, H = 10 (rows 10..15 zero) and
    H = 32 as two head groups of 16, one / two consumers, partial tiles, forced splits (the
    split query: the single one has no Q_lo to join)."""
    kw = dict(consumers=consumers, qk_joint=joint, fp8_query="split")
    check(CANDIDATE_LENS, 12, True, head_groups=1, **kw, **_lens_kw(CANDIDATE_LENS, num_splits))
    check([1, 65, 3000], 10, True, head_groups=1, **kw, **_lens_kw([1, 65, 3000], num_splits))
    check([129, 8192 + 17], 32, True, head_groups=2, **kw,
          **_lens_kw([129, 8192 + 17], num_splits))


@pytest.mark.skipif(not _sm90(), reason="needs sm_90")
@pytest.mark.parametrize("keys", ["rising", "falling", "step", "random"])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("lazy", [True, False])
def test_fp8_lazy_maxima(lazy, num_splits, keys):
    """fp8 two consumers, lazy column maxima (the default) and exact ones, on keys whose
    running maxima rise through the sequence, fall (never after the first tiles), jump by ~10
    nats deep inside it (the exact step then rescales O^T by ~2^-14), or are random; long
    splits, partial last tiles, H = 32 / 24 / 12."""
    lens = [3000, 20000 + 33, 64 * 37, 129]
    kw = dict(consumers=2, lazy_max=lazy, head_groups=1, keys=keys)
    check(lens, 32, True, **kw, **_lens_kw(lens, num_splits))
    check(lens[:2], 24, True, **kw, **_lens_kw(lens[:2], num_splits))
    check(lens[:2], 12, True, **kw, **_lens_kw(lens[:2], num_splits), early_kv=False)


@pytest.mark.skipif(not _sm90(), reason="needs sm_90")
@pytest.mark.parametrize("early_kv", [True, False], ids=["early_kv", "plain"])
def test_cuda_graph_replay_matches_eager(early_kv):
    from functools import partial
    from pdserve.kernels.mla_decode.launch import mla_decode_cutedsl
    run = partial(mla_decode_cutedsl, early_kv=early_kv, num_splits=16)
    q, cache, bt, seq, kv_scale = make_case([100, 5000, 70000, 1], 32, False)
    o1, l1 = run(q, cache, bt, seq, SCALE)
    out = torch.empty_like(o1)
    lse = torch.empty_like(l1)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run(q, cache, bt, seq, SCALE, out=out, lse=lse)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run(q, cache, bt, seq, SCALE, out=out, lse=lse)
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, o1) and torch.equal(lse, l1)


@pytest.mark.skipif(not _sm90(), reason="needs sm_90")
def test_registry_resolves_cutedsl_on_h200():
    from pdserve.kernels import registry
    from pdserve.kernels.mla_decode import problem_from_tensors
    q, cache, bt, seq, _ = make_case([10], 12, False)
    res = registry.resolve("mla_decode", "cutedsl", problem_from_tensors(q, cache))
    assert res.backend == "cutedsl", res.fallback_reason


@pytest.mark.skipif(not _sm90(), reason="needs sm_90")
@pytest.mark.parametrize("fp8", [False, True])
def test_early_kv_back_to_back_calls(fp8):
    """early_kv reads the cache before the PDL wait. A CUDA graph of several calls back to back
    (each the previous one's PDL dependent, the previous combine still running while the next
    attention kernel loads its tiles) gives the same bits as eager (deterministic: without the
    fp8 tile pool, whose draws vary the rounding; test_tile_pool replays the pool back to back
    against the reference)."""
    from functools import partial
    from pdserve.kernels.mla_decode.launch import mla_decode_cutedsl
    for lens in ([1], [65], [8192 + 17], [1, 2, 63, 64, 65, 129, 4097, 40000]):
        check(lens, 32, fp8, early_kv=True)
    run = partial(mla_decode_cutedsl, early_kv=True, num_splits=16, deterministic=True)
    cases = [make_case(lens, 12, fp8) for lens in ([100, 5000], [70000, 1], [8192, 8192])]
    want = [run(q, c, bt, seq, SCALE, kv) for q, c, bt, seq, kv in cases]
    outs = [(torch.empty_like(o), torch.empty_like(l)) for o, l in want]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for (q, c, bt, seq, kv), (o, l) in zip(cases, outs):
            run(q, c, bt, seq, SCALE, kv, out=o, lse=l)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for (q, c, bt, seq, kv), (o, l) in zip(cases, outs):
            run(q, c, bt, seq, SCALE, kv, out=o, lse=l)
    for o, l in outs:
        o.fill_(float("nan"))
        l.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    for (o, l), (wo, wl) in zip(outs, want):
        assert torch.equal(o, wo) and torch.equal(l, wl)


@pytest.mark.skipif(not _sm90(), reason="needs sm_90")
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
@pytest.mark.parametrize("num_splits", [None, 3, 64])
@pytest.mark.parametrize("pool_div", [2, 4, 8])
def test_tile_pool(pool_div, num_splits, fp8):
    """pool_div=N: each split's last 1/N of tiles drawn at run time by the request's CTAs.
    Every tile must be taken once (outputs against the reference) over mixed lengths (short
    and empty splits, a short last split), H = 32 / 12, early_kv, two head groups (a pool
    each); then a CUDA graph of three calls replayed three times, each replay against the
    reference (the pool is not bit-deterministic), and the counters back at zero after each
    (each call's last CTA resets them)."""
    from pdserve.kernels.mla_decode import mla_decode_reference
    from pdserve.kernels.mla_decode.launch import mla_decode_cutedsl, plan_for, pool_counters
    lens = [1, 65, 256, 3000, 9000 + 17, 20000 + 33, 64 * 37, 129]
    kw = dict(pool_div=pool_div, consumers=2 if fp8 else 1, **_lens_kw(lens, num_splits))
    for H in (32, 12):
        check(lens, H, fp8, head_groups=1, **kw)
    lens2 = [8192 + 17, 40000, 5]
    check(lens2, 32, fp8, head_groups=1, early_kv=True, pool_div=pool_div,
          **_lens_kw(lens2, num_splits))
    # two head groups: each group's CTAs draw from their own pool (every group needs every tile)
    lens3 = [129, 8192 + 17, 3000]
    check(lens3, 32, fp8, head_groups=2, pool_div=pool_div, **_lens_kw(lens3, num_splits))
    cases = [make_case(lens, 32, fp8) for lens in ([100, 5000], [70000, 1, 33000], [8192] * 4)]
    msls = [int(seq.max()) for _, _, _, seq, _ in cases]   # host syncs stay out of capture
    choices = dict(early_kv=True, head_groups=1, num_splits=num_splits, pool_div=pool_div)
    plans = [plan_for(q, c, seq, max_seq_len=msl, **choices)
             for (q, c, _, seq, _), msl in zip(cases, msls)]
    refs = [mla_decode_reference(q, c, bt, seq, SCALE, kv, out_dtype=torch.float64,
                                 fp8_query=p.fp8_query)
            for (q, c, bt, seq, kv), p in zip(cases, plans)]
    outs = [(torch.empty(q.shape[0], 32, 512, dtype=torch.bfloat16, device="cuda"),
             torch.empty(q.shape[0], 32, dtype=torch.float32, device="cuda"))
            for q, *_ in cases]

    def run_all():
        for (q, c, bt, seq, kv), (o, l), msl in zip(cases, outs, msls):
            mla_decode_cutedsl(q, c, bt, seq, SCALE, kv, max_seq_len=msl, out=o, lse=l,
                               **choices)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run_all()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        run_all()
    counters = pool_counters(torch.device("cuda", torch.cuda.current_device()), s.cuda_stream, 4)
    for _ in range(3):
        for o, l in outs:
            o.fill_(float("nan"))
            l.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert int(torch.count_nonzero(counters)) == 0
        for (o, l), (ro, rl) in zip(outs, refs):
            err = (o.double() - ro).flatten(1).norm(dim=1) / ro.flatten(1).norm(dim=1)
            assert err.max() < 1.5e-2, err
            assert (l.double() - rl).abs().max() < 1e-2


@pytest.mark.skipif(not _sm90(), reason="needs sm_90")
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
@pytest.mark.parametrize("num_splits", [None, 3, 64])
@pytest.mark.parametrize("pool_div", [0, 4])
def test_every_tile_counted_once(pool_div, num_splits, fp8):
    """Flat scores (make_case keys="flat"): each head's LSE is its score + ln L, so a tile
    taken twice or missed moves it by ln(1 +- tile / L) >= 4.8e-4 at these lengths (each last
    tile holds >= 34 tokens), while the split combine's rounding stays ~1e-6. Against the same
    call in one split without the pool (l = L summed exactly, no combine), with the pool on
    every split's quarter (pool_div 4) or off (0), at several split counts; outputs against the
    reference."""
    from pdserve.kernels.mla_decode import mla_decode_reference
    from pdserve.kernels.mla_decode.launch import mla_decode_cutedsl, plan_for
    lens = [64 * 37, 3000, 20020, 9017, 131072, 70050]
    for H in (32, 12):
        q, cache, bt, seq, kv = make_case(lens, H, fp8, keys="flat")

        def run(**kw):
            return mla_decode_cutedsl(q, cache, bt, seq, SCALE, kv, max_seq_len=max(lens),
                                      head_groups=1, **kw)

        one_o, one_l = run(num_splits=1, deterministic=True)
        o, lse = run(num_splits=num_splits, pool_div=pool_div)
        torch.cuda.synchronize()
        dl = (lse - one_l).abs().max()
        assert dl < 1e-4, f"LSE moved by {dl:.3g} from the one-split call (H={H})"
        plan = plan_for(q, cache, seq, max_seq_len=max(lens), head_groups=1)
        ref_o, _ = mla_decode_reference(q, cache, bt, seq, SCALE, kv, fp8_query=plan.fp8_query,
                                        out_dtype=torch.float64)
        err = (o.double() - ref_o).flatten(1).norm(dim=1) / ref_o.flatten(1).norm(dim=1)
        assert err.max() < 1.5e-2, err


@pytest.mark.skipif(not _sm90(), reason="needs sm_90")
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "pool"])
@pytest.mark.parametrize("early_kv", [False, True])
def test_fp8_two_consumer_ring_repeats(early_kv, deterministic):
    """The shape that exposed an odd two-consumer ring's race (B=64 L=128K H=12 fp8, 2 splits
    of 1024 tiles, two consumers, joint S^T with the split query; with 5 stages a few of
    thousands of calls came out wrong, or the launch failed): 3000 calls back to back under
    full DRAM load, the first close to the reference on a few requests. deterministic: each
    output and LSE equal bit for bit to the first call's. With the tile pool (planned here)
    which CTA takes a pool tile varies, so each call must stay within rounding of the first:
    that catches a race's garbage, not one lost or doubled tile of 2048 (~5e-4 of the LSE at
    most), which test_tile_pool catches against the reference on requests of a few tiles."""
    from pdserve.kernels.mla_decode import mla_decode_reference
    from pdserve.kernels.mla_decode.launch import mla_decode_cutedsl
    from pdserve.kernels.mla_decode.plan import Device, plan_call
    B, L, H = 64, 131072, 12
    for query in ("split", "single"):
        plan = plan_call(B, H, L, True, PAGE, Device.of("cuda"), early_kv=early_kv,
                         deterministic=deterministic, fp8_query=query)
        assert plan.attention.consumers == 2 and plan.attention.pool_div == (0 if deterministic else 4)
    g = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31, (1,))))
    npages = 1 + B * (L // PAGE)
    cache = torch.empty(npages, PAGE, 576, dtype=torch.float8_e4m3fn, device="cuda")
    for c in cache.split(4096):
        c.copy_((torch.randn(c.shape, device="cuda", generator=g) * 40).clamp(-440, 440))
    bt = (torch.randperm(npages - 1, device="cuda", generator=g) + 1).to(torch.int32)
    bt = bt.view(B, L // PAGE)
    seq = torch.full((B,), L, dtype=torch.int32, device="cuda")
    q = torch.randn(B, H, 576, device="cuda", generator=g).to(torch.bfloat16)
    out = torch.empty(B, H, 512, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(B, H, dtype=torch.float32, device="cuda")
    for query in ("split", "single"):
        def call():
            mla_decode_cutedsl(q, cache, bt, seq, SCALE, 0.05, max_seq_len=L, out=out, lse=lse,
                               early_kv=early_kv, deterministic=deterministic, fp8_query=query)

        call()
        first_o, first_l = out.clone(), lse.clone()
        sub = [0, 37]
        ref_o, ref_l = mla_decode_reference(q[sub], cache, bt[sub], seq[sub], SCALE, 0.05,
                                            out_dtype=torch.float32, fp8_query=query)
        err = (first_o[sub].float() - ref_o).flatten(1).norm(dim=1) / ref_o.flatten(1).norm(dim=1)
        assert err.max() < 1.5e-2, err
        bad = torch.zeros((), dtype=torch.int64, device="cuda")
        o_tol = 0.0 if deterministic else 2e-2 * float(first_o.float().abs().max())
        l_tol = 0.0 if deterministic else 1e-3
        for _ in range(1500):
            call()
            bad += (((out.float() - first_o.float()).abs().max() > o_tol)
                    | ((lse - first_l).abs().max() > l_tol)).to(torch.int64)
        torch.cuda.synchronize()
        assert int(bad) == 0, f"{int(bad)} of 1500 calls ({query} query) differ from the first"
    del cache
    torch.cuda.empty_cache()
