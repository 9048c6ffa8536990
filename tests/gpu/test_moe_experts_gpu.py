"""The routed-experts kernel (op "moe_experts", CuTe DSL) against its torch reference on a
Hopper GPU: random routings, every token on the same experts, all experts distinct, batches
that are not multiples of the token tile, the Kimi-Linear shapes and small ones. Unwritten
outputs show: the allocator's cached blocks of the outputs' sizes hold NaN before each call."""
import pytest
import torch

from pdserve.kernels.moe_experts import moe_experts_cutedsl, moe_experts_reference
from pdserve.kernels.moe_route import moe_route_reference

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs a Hopper (sm_90) GPU")


def _poison_free_blocks(*shapes):
    """NaN in the allocator's cached blocks of these shapes, which the kernel's outputs reuse."""
    blocks = [torch.full(s, float("nan"), dtype=torch.bfloat16, device="cuda")
              for _ in range(4) for s in shapes]
    del blocks


def _routing(B, E, k, kind, g):
    logits = torch.randn(B, E, device="cuda", generator=g)
    if kind == "same_experts":
        logits[:, 3:3 + k] += 8.0
    elif kind == "distinct":
        for t in range(B):
            logits[t, [(t * k + j) % E for j in range(k)]] += 8.0
    S = k + 1
    i32 = dict(dtype=torch.int32, device="cuda")
    outs = (torch.empty(B * S, **i32), torch.empty(B * S, device="cuda"),
            torch.empty(B, S, **i32), torch.empty(E + 1, **i32))
    moe_route_reference(logits, None, k, 1, 1, "sigmoid", True, 1.0, 1, *outs)
    return outs[0], outs[3]


@pytest.mark.parametrize("H,I,E,k", [(2304, 1024, 256, 8), (256, 128, 32, 4)])
@pytest.mark.parametrize("B", [1, 5, 8, 33, 64])
@pytest.mark.parametrize("kind", ["random", "same_experts", "distinct"])
def test_moe_experts_kernel(H, I, E, k, B, kind):
    g = torch.Generator(device="cuda").manual_seed(B * 977 + E + H)
    bf = dict(dtype=torch.bfloat16, device="cuda")
    x = torch.randn(B, H, device="cuda", generator=g).to(torch.bfloat16)
    w13 = (torch.randn(E + 1, 2 * I, H, device="cuda", generator=g) / H ** 0.5).to(**bf)
    w2 = (torch.randn(E + 1, H, I, device="cuda", generator=g) / I ** 0.5).to(**bf)
    pair_token, group_end = _routing(B, E, k, kind, g)
    want = moe_experts_reference(x, w13, w2, pair_token, group_end).float()
    P = pair_token.shape[0]
    _poison_free_blocks((P, H), (P, I))
    got = moe_experts_cutedsl(x, w13, w2, pair_token, group_end, True)
    again = moe_experts_cutedsl(x, w13, w2, pair_token, group_end, True)
    unhinted = moe_experts_cutedsl(x, w13, w2, pair_token, group_end, False)
    torch.cuda.synchronize()
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert torch.isfinite(got).all(), "unwritten (NaN) output rows"
    assert torch.equal(got, again), "not reproducible"
    assert torch.equal(got, unhinted), "the shared-expert prefetch hint changed the result"
    err = (got.float() - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= 2e-2 * scale, f"max error {err} against scale {scale}"
    # per row, the relative error of each pair's output
    rel = (got.float() - want).norm(dim=1) / want.norm(dim=1).clamp_min(1e-6)
    assert rel.max().item() < 1e-2, f"worst pair relative error {rel.max().item()}"
