"""Capacity calculator against hand-computed values (pdserve.decode.capacity, docs/capacity.md).

Every expected number is written as the arithmetic that produces it, so a reader can check it
against the presets in pdserve/model/config.py. GiB = 2**30; "usable" is
floor(gpu_memory_gib * GiB * memory_utilization) with decimal (exact) products.
"""
import argparse
import json

import msgspec
import pytest
import torch

from pdserve.decode.capacity import (CapacityInput, CapacityReport, add_cli, plan_capacity,
                                     weight_bytes)
from pdserve.model.config import preset, reduced_kimi_linear
from pdserve.model.model import HybridModel
from pdserve.model.parallel import TPGroup

GIB = 2 ** 30


# -- tiny at TP1 ----------------------------------------------------------------------------------
def test_tiny_tp1():
    # tiny: vocab 256, hidden 128, 4 layers (KDA 1, 2, 4; MLA 3), KDA 4 heads x 32, conv width 4,
    # MLA 4 heads, kv_lora 64, nope 32, rope 16, v 32, no q_lora; dense first layer (inter 256),
    # then 3 MoE layers: 8 experts of inter 64, 1 shared, sigmoid router. fp32 weights here.
    r = plan_capacity(CapacityInput(model="tiny", context_tokens=1000, output_tokens=24,
                                    gpu_memory_gib=0.25, memory_utilization=0.5,
                                    weight_dtype="float32"))
    kda_layer = (3 * 128 * 128        # q, k, v
                 + 3 * 128 * 4        # conv
                 + 32 * 128 + 128 * 32  # f_a, f_b
                 + 4 + 128            # A_log, dt_bias
                 + 4 * 128            # b
                 + 32 * 128 + 128 * 32  # g_a, g_b
                 + 32                 # o_norm
                 + 128 * 128)         # o_proj
    assert kda_layer == 84_132
    mla_layer = 4 * 48 * 128 + (80 * 128 + 64) + 4 * 64 * 64 + 128 * 128  # q, kv_a+norm, kv_b, o
    moe_layer = (8 * 128 + 8) + 3 * 64 * 128 + 8 * 3 * 64 * 128  # router+bias, shared, experts
    params = (2 * 256 * 128              # embedding + LM head
              + 128 + 4 * 2 * 128        # final norm + two norms per layer
              + 3 * kda_layer + mla_layer
              + 3 * 256 * 128            # dense MLP (layer 0)
              + 3 * moe_layer)
    assert params == 1_151_684
    assert r.weight_bytes == 4 * params == 4_606_736
    assert r.usable_bytes == GIB // 8 == 134_217_728
    assert r.state_bytes == 134_217_728 - 4_606_736 == 129_610_992
    # KDA slot: 3 layers x (4 heads x 32 x 32 fp32 + 3 taps x 3*4*32 channels bf16)
    assert r.kda_slot_bytes == 3 * (4 * 32 * 32 * 4 + 3 * 384 * 2) == 56_064
    # a page: 1 MLA layer x 64 tokens x (64 + 16) x bf16
    assert r.page_bytes == 64 * 80 * 2 == 10_240
    # 1000 + 24 = 1024 tokens = 16 pages
    assert (r.tokens_per_request, r.pages_per_request) == (1024, 16)
    assert r.request_bytes == 56_064 + 16 * 10_240 == 219_904
    assert r.max_requests == 129_610_992 // 219_904 == 589
    assert r.kv_capacity_tokens == 129_610_992 * 1024 // 219_904 == 603_543
    assert r.latent_pool_tokens == 129_610_992 // 10_240 * 64 == 810_048
    assert r.max_requests_shared is None


def test_weight_count_matches_the_built_model():
    # The per-rank bytes of the real module tree (on the meta device: no memory) equal the count.
    for config, tp in ((preset("tiny"), 1), (preset("tiny"), 2), (reduced_kimi_linear(), 2)):
        with torch.device("meta"):
            model = HybridModel(config, TPGroup(rank=0, size=tp), torch.bfloat16)
        built = sum(p.numel() * p.element_size() for p in model.parameters())
        assert sum(weight_bytes(config, tp).values()) == built


# -- kimi-linear-48b-a3b at TP1 / TP2 ----------------------------------------------------------
# vocab 163840, hidden 2304, 27 layers: 7 MLA (4, 8, ..., 24, 27), 20 KDA (32 heads x 128, W 4,
# low-rank gate); MLA 32 heads, kv_lora 512, nope 128, rope 64, v 128; 1 dense layer (inter 9216),
# 26 MoE layers (256 experts, inter 1024, 1 shared). bf16 weights; fp32 conv, A_log, dt_bias,
# o_norm and router bias.
def kimi_linear_weights(tp: int) -> dict[str, int]:
    kda = 20 * (2 * (3 * 4096 * 2304 + 4096 * 128 + 32 * 2304 + 4096 * 128 + 2304 * 4096) // tp
                + 4 * (3 * 4096 * 4 + 32 + 4096) // tp   # conv, A_log, dt_bias (fp32, split)
                + 2 * 2 * 128 * 2304                    # f_a, g_a (replicated)
                + 4 * 128)                              # o_norm (fp32)
    mla = 7 * (2 * (32 * 192 * 2304 + 32 * 256 * 512 + 2304 * 4096) // tp  # q, kv_b, o
               + 2 * (576 * 2304 + 512))                                   # kv_a + norm
    return {"embed+lm_head": 2 * 2 * 163840 * 2304 // tp, "norms": 2 * (2304 + 27 * 2 * 2304),
            "kda": kda, "mla": mla, "dense_mlp": 2 * 3 * 9216 * 2304 // tp,
            "moe_router": 26 * (2 * 256 * 2304 + 4 * 256),      # router + bias (replicated)
            "moe_shared": 26 * 2 * 3 * 1024 * 2304 // tp,
            "moe_experts": 26 * 2 * 256 * 3 * 1024 * 2304 // tp}


def test_kimi_linear_weights():
    for tp in (1, 2):
        expected = kimi_linear_weights(tp)
        assert weight_bytes(preset("kimi-linear-48b-a3b"), tp) == expected
    assert sum(kimi_linear_weights(1).values()) == 98_247_513_088  # 49.1 B parameters
    assert sum(kimi_linear_weights(2).values()) == 49_160_326_912


H200_USABLE = 134_325_102_182  # floor(139 GiB x 0.9) = floor(125.1 x 2**30)


@pytest.mark.parametrize("tp, dcp, slot, pages, max_requests", [
    # slot: 20 KDA layers x (32/tp heads x 128 x 128 x 4 B + 3 taps x 3 x 4096/tp ch x 2 B)
    # pages: 32768 tokens / dcp per rank / 64 per page
    (1, 1, 20 * (32 * 128 * 128 * 4 + 3 * 4096 * 3 * 2), 512, 117),
    (2, 1, 20 * (16 * 128 * 128 * 4 + 3 * 2048 * 3 * 2), 512, 297),
    (2, 2, 20 * (16 * 128 * 128 * 4 + 3 * 2048 * 3 * 2), 256, 553),
])
def test_kimi_linear_h200(tp, dcp, slot, pages, max_requests):
    r = plan_capacity(CapacityInput(model="kimi-linear-48b-a3b", context_tokens=32768, tp=tp,
                                    dcp=dcp))
    assert r.usable_bytes == H200_USABLE
    assert r.state_bytes == H200_USABLE - sum(kimi_linear_weights(tp).values())
    assert r.kda_slot_bytes == slot
    assert slot in (43_417_600, 21_708_800)
    assert r.page_bytes == 7 * 64 * 576 * 2 == 516_096  # bf16 latent, replicated over TP
    assert r.pages_per_request == pages
    assert r.request_bytes == slot + pages * 516_096
    assert r.max_requests == r.state_bytes // r.request_bytes == max_requests
    assert r.kv_capacity_tokens == r.state_bytes * 32768 // r.request_bytes


# -- kimi-k3 TP8, 120K agent workload: DCP 1 vs 8 -------------------------------------------
# K3 does not fit an H200 at TP8 (191 GiB of weights per rank even with MXFP4 experts), so the DCP
# effect is shown on a GB300-class GPU: 288 GB = 268 GiB, x 0.9 = 241.2 GiB usable.
AGENT = dict(model="kimi-k3", context_tokens=120_000, prefix_tokens=114_000, output_tokens=400,
             tp=8, latent_dtype="float8_e4m3fn", expert_bits=4.25, gpu_memory_gib=268)
K3_USABLE = 258_986_527_948  # floor(268 x 0.9 x 2**30) = floor(241.2 x 2**30)


def k3_tp8_weights() -> dict[str, int]:
    # 93 layers: 24 MLA (4, 8, ..., 92, 93), 69 KDA (96 heads x 128, full-rank gate); hidden 7168;
    # layer 0 dense (inter 33792), 92 latent-MoE layers (896 experts 3584 -> 3072 -> 3584, 2 shared
    # of 3072 on the hidden state, latent down/up 7168 <-> 3584 + norm replicated). AttnRes adds
    # 2 vectors per sublayer (2 per layer) + the final pair. Split pieces are divided by TP = 8.
    kda_split = 3 * 12288 * 7168 + 12288 * 128 + 96 * 7168 + 12288 * 7168 + 7168 * 12288
    kda = 69 * (2 * kda_split // 8 + 4 * (3 * 12288 * 4 + 96 + 12288) // 8
                + 2 * 128 * 7168 + 4 * 128)              # f_a replicated, o_norm fp32
    mla_split = 96 * 192 * 1536 + 96 * 256 * 512 + 96 * 128 * 7168 + 7168 * 96 * 128
    mla = 24 * (2 * mla_split // 8                         # q_b, kv_b, gate, o
                + 2 * (1536 * 7168 + 1536 + 576 * 7168 + 512))  # q_a, kv_a + norms
    return {"embed+lm_head": 2 * 2 * 163840 * 7168 // 8,
            "norms": 2 * (7168 + 93 * 2 * 7168 + 93 * 4 * 7168 + 2 * 7168),
            "kda": kda, "mla": mla, "dense_mlp": 2 * 3 * 33792 * 7168 // 8,
            "moe_router": 92 * (2 * 896 * 7168 + 4 * 896),
            "moe_shared": 92 * 2 * 3 * 6144 * 7168 // 8,
            # MXFP4: 4.25 bits = 17/32 bytes per weight
            "moe_experts": 92 * (896 * 3 * 3072 * 3584 // 8) * 17 // 32,
            "latent_moe": 92 * 2 * (2 * 3584 * 7168 + 3584)}


def test_k3_weights():
    expected = k3_tp8_weights()
    assert weight_bytes(preset("kimi-k3"), 8, expert_bits=4.25) == expected
    assert expected["kda"] // 69 == 112_581_168  # 112.6 MB/layer, k3_decode.md §4
    assert expected["mla"] // 24 == 84_545_536   # 84.5 MB/layer
    assert sum(expected.values()) == 205_056_581_360  # 190.97 GiB per rank


def test_k3_agent_dcp1_vs_dcp8():
    r1 = plan_capacity(CapacityInput(**AGENT, dcp=1))
    r8 = plan_capacity(CapacityInput(**AGENT, dcp=8))
    state = K3_USABLE - 205_056_581_360
    assert r1.state_bytes == r8.state_bytes == state == 53_929_946_588  # DCP moves no weights
    # KDA slot: 69 layers x (12 heads x 128 x 128 x 4 B + 3 taps x 3 x 1536 ch x 2 B) per rank
    slot = 69 * (786_432 + 27_648)
    assert r1.kda_slot_bytes == r8.kda_slot_bytes == slot == 56_171_520
    page = 24 * 64 * 576 * 1  # 24 MLA layers x 64 tokens x 576 fp8 bytes
    assert r1.page_bytes == page == 884_736
    # 120,000 + 400 tokens; DCP1: ceil(120400 / 64) pages; DCP8: ceil(ceil(120400 / 8) / 64)
    assert (r1.pages_per_request, r8.pages_per_request) == (1882, 236)
    req1, req8 = slot + 1882 * page, slot + 236 * page
    assert (r1.request_bytes, r8.request_bytes) == (req1, req8) == (1_721_244_672, 264_969_216)
    assert (r1.max_requests, r8.max_requests) == (state // req1, state // req8) == (31, 203)
    assert r1.kv_capacity_tokens == state * 120_400 // req1 == 3_772_366
    assert r8.kv_capacity_tokens == state * 120_400 // req8 == 24_505_358
    # The DCP gain is req1 / req8 = 6.50x, not 8x: the KDA slot (replicated over DCP) stays.
    assert r8.kv_capacity_tokens / r1.kv_capacity_tokens == pytest.approx(req1 / req8, rel=1e-6)
    assert req1 / req8 == pytest.approx(6.496, abs=1e-3)
    # Without KDA state the latent pool alone grows exactly 8x.
    assert r1.latent_pool_tokens == state // page * 64 == 3_901_120
    assert r8.latent_pool_tokens == 8 * r1.latent_pool_tokens

    # Shared 114K prefix: pages holding only prefix tokens on every rank, stored once, plus one
    # KDA checkpoint slot; each request keeps its own slot and its suffix/output pages.
    assert (r1.shared_pages, r8.shared_pages) == (114_000 // 64, 114_000 // 512) == (1781, 222)
    assert r1.shared_bytes == 1781 * page + slot
    priv1, priv8 = slot + (1882 - 1781) * page, slot + (236 - 222) * page
    assert (r1.private_request_bytes, r8.private_request_bytes) == (priv1, priv8)
    assert r1.max_requests_shared == (state - 1781 * page - slot) // priv1 == 359
    assert r8.max_requests_shared == (state - 222 * page - slot) // priv8 == 782
    assert r8.kv_capacity_tokens_shared == (state - 222 * page - slot) * 120_400 // priv8


# -- bad input ------------------------------------------------------------------------------
@pytest.mark.parametrize("changes, field", [
    (dict(dcp=4), "dcp"),
    (dict(tp=5), "tp"),                      # 96 heads are not divisible by 5
    (dict(context_tokens=0), "context_tokens"),
    (dict(gpu_memory_gib=139), "gpu_memory_gib"),  # K3 on an H200 at TP8: weights do not fit
    (dict(latent_dtype="int8"), "latent_dtype"),
    (dict(prefix_tokens=130_000), "prefix_tokens"),
    (dict(memory_utilization=1.5), "memory_utilization"),
    (dict(expert_bits=0), "expert_bits"),
    (dict(model="no-such-model"), "model"),
])
def test_bad_input_names_the_field(changes, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        plan_capacity(CapacityInput(**{**AGENT, **changes}))


def test_tp_error_names_the_config_field():
    with pytest.raises(ValueError, match="tp: .*num_heads: 96 is not divisible by TP=5"):
        plan_capacity(CapacityInput(**{**AGENT, "tp": 5, "dcp": 1}))


# -- CLI ----------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve")
    add_cli(parser.add_subparsers(dest="command", required=True))
    return parser


def test_cli_json_and_table(capsys):
    argv = ["capacity", "--model", "kimi-k3", "--tp", "8", "--dcp", "8", "--gpu-memory-gib", "268",
            "--context-tokens", "120000", "--prefix-tokens", "114000", "--output-tokens", "400",
            "--latent-dtype", "float8_e4m3fn", "--expert-bits", "4.25"]
    args = _parser().parse_args(argv + ["--json"])
    assert args.func(args) == 0
    report = msgspec.json.decode(capsys.readouterr().out, type=CapacityReport)
    assert report == plan_capacity(CapacityInput(**AGENT, dcp=8))
    args = _parser().parse_args(argv)
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "max concurrent requests" in out and "24,505,358" in out
    json.dumps(msgspec.to_builtins(report))  # plain JSON for benchmark files


def test_cli_bad_flag_raises():
    args = _parser().parse_args(["capacity", "--model", "tiny", "--context-tokens", "-1"])
    with pytest.raises(ValueError, match="^context_tokens: "):
        args.func(args)
