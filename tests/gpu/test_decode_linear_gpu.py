"""The decode projection kernel (op "decode_linear", CuTe DSL) on a Hopper GPU: against a
float64 reference at the Kimi-Linear projection shapes and a small one with a partial weight
tile, batches 1..64 that are and are not token-tile sizes, random and adversarial values,
tuning variants; bit-equal across runs and across CUDA-graph replays (the arrival
counters reset themselves).

Tolerance. The kernel's products of bf16 values are exact in fp32, it sums K of them in fp32
and rounds once to bf16, so |y - ref| <= 2^-8 |ref| (bf16 rounding, 8-bit significand) plus the
fp32 summation error, at most ~K 2^-24 sum_k |x_k w_k| (doubled, for the tensor cores' adder
tree, which need not round each addition to nearest). Integer inputs make every partial sum
exact, so there the result must be the bf16 rounding of the exact sum, bit for bit."""
import pytest
import torch

from pdserve.kernels import registry
from pdserve.kernels.decode_linear import (OP, LinearTuning, decode_linear_cutedsl,
                                           decode_linear_problem, decode_linear_reference)
from pdserve.kernels.decode_linear.cutedsl import launch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs a Hopper (sm_90) GPU")

# (N, K): KDA / MLA o_proj, the KDA in-projection, MLA's q + kv_a, a partial 200-row tile
SHAPES = [(2304, 4096), (12576, 2304), (6720, 2304), (200, 256)]
BATCHES = [1, 3, 8, 17, 32, 64]


def _poison_free_blocks(B, N):
    """NaN in the allocator's cached blocks of y's size, which the kernel's output reuses."""
    blocks = [torch.full((B, N), float("nan"), dtype=torch.bfloat16, device="cuda")
              for _ in range(4)]
    del blocks


def _check_close(y, x, w, share: float | None = 0.95):
    ref = x.double() @ w.double().t()
    bound = (x.double().abs() @ w.double().abs().t()) * (2 * x.shape[1] * 2.0 ** -24)
    err = (y.double() - ref).abs()
    assert torch.isfinite(y).all(), "unwritten (NaN) outputs"
    worst = (err - 2.0 ** -8 * ref.abs() - bound).max().item()
    assert worst <= 0, f"error above the bf16 + fp32-summation bound by {worst}"
    if share is not None:
        # for values of one scale the fp32 error is far below half a bf16 step: nearly every
        # output is bf16(ref), which a misplaced or missing partial would not be
        same = (y == ref.to(torch.bfloat16)).double().mean().item()
        assert same >= share, f"only {same:.3f} of the outputs are bf16 of the exact sum"


def _inputs(B, N, K, kind, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    if kind == "random":
        x = torch.randn(B, K, device="cuda", generator=g)
        w = torch.randn(N, K, device="cuda", generator=g) / K ** 0.5
    elif kind == "integers":      # exact sums: the output is bf16(exact), bit for bit
        x = torch.randint(-3, 4, (B, K), device="cuda", generator=g).float()
        w = torch.randint(-3, 4, (N, K), device="cuda", generator=g).float()
    else:                         # "cancelling": large terms that cancel, wide exponents
        x = torch.randn(B, K, device="cuda", generator=g) * 2.0 ** torch.randint(
            -8, 9, (B, K), device="cuda", generator=g)
        w = torch.randn(N, K, device="cuda", generator=g)
        w[:, K // 2:] = -w[:, :K // 2]
        x[:, K // 2:] = x[:, :K // 2] * (1 + 2.0 ** -7)
    return x.to(torch.bfloat16), w.to(torch.bfloat16)


@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("B", BATCHES)
def test_decode_linear_matches_float64(N, K, B):
    x, w = _inputs(B, N, K, "random", seed=B * 131 + N)
    _poison_free_blocks(B, N)
    got = decode_linear_cutedsl(x, w)
    again = decode_linear_cutedsl(x, w)
    torch.cuda.synchronize()
    assert got.shape == (B, N) and got.dtype == torch.bfloat16
    _check_close(got, x, w)
    assert torch.equal(got, again), "not reproducible"


@pytest.mark.parametrize("kind", ["integers", "cancelling"])
@pytest.mark.parametrize("N,K", [(2304, 4096), (200, 256)])
@pytest.mark.parametrize("B", [1, 17, 64])
def test_adversarial_values(kind, N, K, B):
    x, w = _inputs(B, N, K, kind, seed=B + K)
    got = decode_linear_cutedsl(x, w)
    torch.cuda.synchronize()
    ref = x.double() @ w.double().t()
    if kind == "integers":
        assert torch.equal(got, ref.to(torch.bfloat16))
    else:
        _check_close(got, x, w, share=None)     # results near 0: fp32 error ~ a bf16 step


@pytest.mark.parametrize("bm,splits,stages,pdl", [(128, 1, 2, False), (64, 2, 3, True),
                                                  (128, 8, 4, True), (64, 64, 8, False),
                                                  (128, 16, 6, False)])
@pytest.mark.parametrize("B", [1, 33])
def test_tuning_variants(bm, splits, stages, pdl, B):
    x, w = _inputs(B, 2304, 4096, "random", seed=splits + B)
    got = launch(x, w, bm=bm, splits=splits, stages=stages, pdl=pdl)
    again = launch(x, w, bm=bm, splits=splits, stages=stages, pdl=pdl)
    torch.cuda.synchronize()
    _check_close(got, x, w)
    assert torch.equal(got, again)


@pytest.mark.parametrize("B", [1, 3, 33])
def test_strided_x(B):
    """x as a column slice of a wider tensor (the gates' GEMM on the in-projection's output):
    the same bits as the dense copy of x, under the default and an explicit tuning."""
    wide, w = _inputs(B, 8192, 12576, "random", seed=B)
    x = wide[:, 12288:12544]                              # 256 columns, row stride 12576
    w = w[:, :256].contiguous()
    for t in (None, LinearTuning(bm=128, splits=8, stages=2)):   # splits 8 -> gcd 4
        got = decode_linear_cutedsl(x, w, t)
        dense = decode_linear_cutedsl(x.contiguous(), w, t)
        torch.cuda.synchronize()
        _check_close(got, x, w)
        assert torch.equal(got, dense)


@pytest.mark.parametrize("B", [1, 8, 64])
def test_graph_replays_are_bit_equal(B):
    """Two projections (PDL between them) in one graph, replayed with new inputs each time:
    every replay equals the eager call on the same inputs, bit for bit (the counters are
    back at 0 after every launch, or the last split of an m-tile would not be found)."""
    xo, wo = _inputs(B, 2304, 4096, "random", seed=B)
    _, wi = _inputs(B, 12576, 2304, "random", seed=B + 1)
    static_x = xo.clone()

    def step():
        h = decode_linear_cutedsl(static_x, wo)          # o_proj
        return h, decode_linear_cutedsl(h, wi)           # the next layer's in-projection

    step()                                               # compile + scratch outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out_h, out_y = step()
    gen = torch.Generator(device="cuda").manual_seed(99)
    for _ in range(3):
        static_x.copy_(torch.randn(B, 4096, device="cuda", generator=gen).to(torch.bfloat16))
        g.replay()
        torch.cuda.synchronize()
        want_h, want_y = step()
        torch.cuda.synchronize()
        assert torch.equal(out_h, want_h) and torch.equal(out_y, want_y)
        _check_close(out_h, static_x, wo)


def test_registry_serves_the_kernel_and_refuses_bad_calls():
    x, w = _inputs(4, 2304, 4096, "random", seed=5)
    res = registry.resolve(OP, "cutedsl", decode_linear_problem(x, w))
    assert res.backend == "cutedsl" and res.fallback_reason is None
    ref = decode_linear_reference(x, w)
    _check_close(ref, x, w)                              # the reference meets the same bound
    odd = torch.empty(4 * 4096 + 1, dtype=torch.bfloat16, device="cuda")[1:].view(4, 4096)
    res = registry.resolve(OP, "cutedsl", decode_linear_problem(odd, w))
    assert res.backend == registry.REFERENCE and "16-byte" in res.fallback_reason
    big = torch.zeros(65, 4096, dtype=torch.bfloat16, device="cuda")
    res = registry.resolve(OP, "cutedsl", decode_linear_problem(big, w))
    assert "batch 65" in res.fallback_reason


@pytest.mark.parametrize("B", [1, 17, 64])
def test_chained_launches_of_one_variant(B):
    """Layers of one shape share a variant's workspace and counters: back-to-back launches on
    different weights (PDL between them), eager and in one graph, each get their own result."""
    x, _ = _inputs(B, 2304, 4096, "random", seed=7 * B)
    ws = [_inputs(1, 2304, 4096, "random", seed=s)[1] for s in range(4)]

    def run():
        return [decode_linear_cutedsl(x, w) for w in ws]

    eager = run()
    torch.cuda.synchronize()
    for y, w in zip(eager, ws):
        _check_close(y, x, w)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = run()
    for _ in range(2):
        g.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(o, e) for o, e in zip(outs, eager))
