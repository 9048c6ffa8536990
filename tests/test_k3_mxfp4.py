"""MXFP4 expert weights: the E2M1 code table, E8M0 exponents and nibble order against values
written from the OCP MX spec here; quantize -> save in the checkpoint layout -> load ->
dequantize is exact; a dequantized expert's output against float64 from the raw codes."""
import json
import math

import pytest
import torch
from safetensors import safe_open

from pdserve.model import mxfp4
from pdserve.model.config import reduced_kimi_k3
from pdserve.model.generate import build_model
from pdserve.model.model import HybridModel
from pdserve.model.parallel import TPGroup
from pdserve.model.weights import (export_checkpoint, full_state, load_checkpoint,
                                   mxfp4_experts, save_checkpoint)


def e2m1(code: int) -> float:
    """E2M1 from its bits: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0."""
    sign, exp, man = code >> 3, (code >> 1) & 3, code & 1
    mag = man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1 + man / 2)
    return -mag if sign else mag


def test_code_table_and_nibble_order():
    # byte j holds codes (2j) low and (2j+1) high: bytes 0x10, 0x32, ... cover codes 0..15
    packed = torch.tensor([[(2 * j + 1) << 4 | (2 * j) for j in range(8)] + [0] * 8],
                          dtype=torch.uint8)
    got = mxfp4.dequantize(packed, torch.tensor([[127]], dtype=torch.uint8))[0]
    assert got[:16].tolist() == [e2m1(c) for c in range(16)]
    assert got[:8].tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert torch.signbit(got[8]) and got[8] == 0.0                       # code 8 is -0
    one = mxfp4.dequantize(torch.tensor([[0x2F] + [0] * 15], dtype=torch.uint8),
                           torch.tensor([[127]], dtype=torch.uint8))[0]
    assert one[:2].tolist() == [-6.0, 1.0]                               # low nibble first


def test_e8m0_exponents():
    s = [0, 1, 100, 126, 127, 128, 200, 254]
    got = mxfp4.e8m0_to_float(torch.tensor(s, dtype=torch.uint8)).tolist()
    assert got == [math.ldexp(1.0, v - 127) for v in s]
    assert math.isnan(mxfp4.e8m0_to_float(torch.tensor([255], dtype=torch.uint8)).item())
    # one scale per 32 values along the row
    packed = torch.full((1, 32), 0x22, dtype=torch.uint8)                # every value 1.0
    w = mxfp4.dequantize(packed, torch.tensor([[120, 130]], dtype=torch.uint8))
    assert w[0, :32].eq(2.0 ** -7).all() and w[0, 32:].eq(8.0).all()


def test_quantize_rounds_to_nearest_even_and_saturates():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.75, -5.0, 0.2, -0.3])
    group = torch.cat([x, torch.full((20,), 4.0)])[None]                  # amax 7 -> scale 2^0
    packed, scales = mxfp4.quantize(group)
    assert scales.tolist() == [[127]]
    got = mxfp4.dequantize(packed, scales)[0, :12].tolist()
    assert got == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -1.0, -4.0, 0.0, -0.5]


def test_quantize_of_mxfp4_values_is_exact():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (5, 128), generator=g, dtype=torch.uint8)
    codes[:, ::32] = 7                         # each group holds a +-6 (its amax sets the scale)
    codes[1, 32:64] = 0                        # an all-zero group
    scales = torch.randint(100, 150, (5, 4), generator=g, dtype=torch.uint8)
    packed = mxfp4.pack_codes(codes)
    w = mxfp4.dequantize(packed, scales)
    p2, s2 = mxfp4.quantize(w)
    assert torch.equal(mxfp4.dequantize(p2, s2), w)
    assert torch.equal(p2, packed)
    keep = torch.ones_like(s2, dtype=torch.bool)
    keep[1, 1] = False                          # a zero group's scale is free
    assert torch.equal(s2[keep], scales[keep])
    assert torch.equal(mxfp4.unpack_codes(packed), codes)


def test_bad_mxfp4_tensors_are_refused():
    with pytest.raises(ValueError, match="one scale per 32"):
        mxfp4.dequantize(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        mxfp4.dequantize(torch.zeros(2, 16), torch.zeros(2, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4.quantize(torch.zeros(2, 48))


CFG = dict(num_layers=2, hidden_size=128, num_experts=4, top_k=2, head_dim=16)


def test_checkpoint_round_trip_is_exact(tmp_path):
    cfg = reduced_kimi_k3(**CFG)
    export_checkpoint(tmp_path, cfg, seed=3, dtype=torch.float32, mxfp4_routed=True)
    conf = json.loads((tmp_path / "config.json").read_text())
    assert conf["quantization_config"]["format"] == "mxfp4-pack-quantized"
    base = "model.layers.1.block_sparse_moe.experts.2."
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as st:
        keys = set(st.keys())
        w1p, w1s = st.get_tensor(base + "w1.weight_packed"), st.get_tensor(base + "w1.weight_scale")
        w2p = st.get_tensor(base + "w2.weight_packed")
    assert base + "w1.weight" not in keys and "model.layers.1.block_sparse_moe.shared_experts.gate_proj.weight" in keys
    # w1 [inter 32, latent 64]: 32 bytes and 2 scales per row; w2 [latent 64, inter 32]
    assert (w1p.dtype, w1p.shape, w1s.shape, w2p.shape) == (torch.uint8, (32, 32), (32, 2), (64, 16))

    seeded = full_state(_meta(cfg), 3)
    for tp in (TPGroup(), TPGroup(rank=1, size=2)):
        model = HybridModel(cfg, tp)
        load_checkpoint(model, tmp_path)
        params = dict(model.named_parameters())
        for name in (base + "w1.weight", base + "w2.weight", base + "w3.weight"):
            want = mxfp4.dequantize(*mxfp4.quantize(seeded[name]))
            full = want if tp.size == 1 else want.chunk(2, dim=0 if "w2" not in name else 1)[1]
            assert torch.equal(params[name], full), name
            assert not torch.equal(want, seeded[name])                  # it was quantized
        name = "model.layers.1.block_sparse_moe.routed_expert_up_proj.weight"
        assert torch.equal(params[name], seeded[name])                  # the rest is unchanged


def _meta(cfg):
    with torch.device("meta"):
        return HybridModel(cfg)


def test_dequantized_expert_matches_float64_from_the_codes(tmp_path):
    """Random codes and scales saved as a checkpoint's MXFP4 expert; the loaded expert's SiTU MLP
    output against float64 computed from the codes and scales by the spec formula."""
    cfg = reduced_kimi_k3(**CFG)
    tensors = full_state(_meta(cfg), 1)
    g = torch.Generator().manual_seed(2)
    base = "model.layers.1.block_sparse_moe.experts.1."
    raw = {}
    for w, (out, inp) in {"w1": (32, 64), "w3": (32, 64), "w2": (64, 32)}.items():
        codes = torch.randint(0, 16, (out, inp), generator=g, dtype=torch.uint8)
        scales = torch.randint(122, 128, (out, inp // 32), generator=g, dtype=torch.uint8)
        raw[w] = (codes, scales)
        del tensors[base + w + ".weight"]
        tensors[base + w + ".weight_packed"] = mxfp4.pack_codes(codes)
        tensors[base + w + ".weight_scale"] = scales
    save_checkpoint(tmp_path, cfg, tensors)
    expert = build_model(cfg, checkpoint=str(tmp_path)).model.layers[1].block_sparse_moe.experts[1]

    def w64(name):
        codes, scales = raw[name]
        table = torch.tensor([e2m1(c) for c in range(16)], dtype=torch.float64)
        exps = scales.double().repeat_interleave(32, dim=1) - 127
        return table[codes.long()] * torch.pow(2.0, exps)

    x = torch.randn(5, 64, generator=g, dtype=torch.float64)
    gate, up = x @ w64("w1").t(), x @ w64("w3").t()
    act = 4 * torch.tanh(gate / 4) * torch.sigmoid(gate) * 25 * torch.tanh(up / 25)
    want = act @ w64("w2").t()
    got = expert(x.float()).double()
    assert torch.allclose(got, want, atol=1e-5 * want.abs().max(), rtol=0)


def test_mxfp4_experts_leaves_other_tensors():
    t = {"a.block_sparse_moe.experts.3.w2.weight": torch.randn(4, 64),
         "a.block_sparse_moe.shared_experts.down_proj.weight": torch.randn(4, 64),
         "a.block_sparse_moe.routed_expert_up_proj.weight": torch.randn(4, 64)}
    q = mxfp4_experts(t)
    assert sorted(q) == sorted(["a.block_sparse_moe.experts.3.w2.weight_packed",
                                "a.block_sparse_moe.experts.3.w2.weight_scale",
                                "a.block_sparse_moe.shared_experts.down_proj.weight",
                                "a.block_sparse_moe.routed_expert_up_proj.weight"])
