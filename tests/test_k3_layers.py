"""K3's layers (AttnRes, SiTU, latent MoE) against float64 re-derivations written from the
equations of shared/research/k3_decode.md §1.3, and its config validation."""
import math
from types import SimpleNamespace

import pytest
import torch

from pdserve.model.activation import situ_mul
from pdserve.model.attn_res import AttnResStream
from pdserve.model.config import ConfigError, preset, preset_dict, parse_config, reduced_kimi_k3
from pdserve.model.generate import build_model
from pdserve.model.latent_moe import LatentMoE

EPS = 1e-6


def test_situ_matches_the_scalar_formula():
    g = torch.tensor([-300.0, -7.0, -1.0, -0.1, 0.0, 0.3, 2.0, 4.0, 9.0, 300.0])
    u = torch.tensor([-1e4, -30.0, -2.0, 0.5, 1.0, -0.2, 3.0, 25.0, 60.0, 1e4])
    got = situ_mul(g, u, 4.0, 25.0)
    for gi, ui, yi in zip(g.tolist(), u.tolist(), got.tolist()):
        want = 4.0 * math.tanh(gi / 4.0) / (1.0 + math.exp(-gi)) * 25.0 * math.tanh(ui / 25.0)
        assert yi == pytest.approx(want, rel=1e-5, abs=1e-6)
    # the caps: the linear factor at +-beta, the up value at +-linear_beta
    assert got[-1].item() == pytest.approx(4.0 * 25.0, rel=1e-6)
    assert got[0].item() == pytest.approx(0.0, abs=1e-6)


def _mix64(sources, w_n, w_q):
    logits = [float((x * w_n * w_q).sum() / torch.sqrt((x * x).mean() + EPS)) for x in sources]
    top = max(logits)
    p = [math.exp(v - top) for v in logits]
    return sum(pi / sum(p) * x for pi, x in zip(p, sources))


def _rms64(x, w):
    return x / torch.sqrt((x * x).mean() + EPS) * w


def _attn_res_reference(emb, attn_out, mlp_out, weights, B):
    """Every sublayer input and the final mixture of ONE token, from the definitions: block 0 is
    the embedding, block k the sum of both sublayer outputs of layers [(k-1)B, kB); the prefix
    is the sum since the last block write, or the embedding before any write; a write happens at
    each layer i % B == 0, after that layer's pre-attention mixture."""
    L = len(attn_out)
    out = lambda j: attn_out[j] + mlp_out[j]  # noqa: E731
    block = lambda k: emb if k == 0 else sum(out(j) for j in range((k - 1) * B, k * B))  # noqa
    inputs = []
    for i in range(L):
        n = -(-i // B)                                    # writes before layer i
        prefix = emb if n == 0 else sum((out(j) for j in range((n - 1) * B, i)),
                                        torch.zeros_like(emb))
        w = weights[i]
        h = _mix64([block(k) for k in range(n)] + [prefix], w["an"], w["aq"])
        inputs.append(_rms64(h, w["in"]))
        m = i // B + 1                                    # writes up to layer i
        prefix = sum((out(j) for j in range((m - 1) * B, i)), torch.zeros_like(emb)) + attn_out[i]
        h = _mix64([block(k) for k in range(m)] + [prefix], w["mn"], w["mq"])
        inputs.append(_rms64(h, w["post"]))
    m = -(-L // B)
    prefix = sum(out(j) for j in range((m - 1) * B, L))
    final = _mix64([block(k) for k in range(m)] + [prefix], weights[L]["n"], weights[L]["q"])
    return inputs, final


@pytest.mark.parametrize("L,B", [(7, 3), (6, 3), (5, 1), (4, 12)])
def test_attn_res_stream_matches_the_block_definition(L, B):
    g = torch.Generator().manual_seed(L * 10 + B)
    T, H = 3, 24
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    near1 = lambda: 1 + 0.2 * rnd(H)  # noqa: E731
    emb, attn_out, mlp_out = rnd(T, H), rnd(L, T, H), rnd(L, T, H)
    weights = [dict(an=near1(), aq=rnd(H), mn=near1(), mq=rnd(H), **{"in": near1()},
                    post=near1()) for _ in range(L)] + [dict(n=near1(), q=rnd(H))]
    norm = lambda w: SimpleNamespace(weight=w.float())  # noqa: E731
    rms = lambda w: (lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w.float())  # noqa
    stream = AttnResStream(emb.float(), B, EPS)
    got = []
    for i in range(L):
        w = weights[i]
        layer = SimpleNamespace(index=i, self_attention_res_norm=norm(w["an"]),
                                self_attention_res_proj=norm(w["aq"][None]),
                                mlp_res_norm=norm(w["mn"]), mlp_res_proj=norm(w["mq"][None]),
                                input_layernorm=rms(w["in"]), post_attention_layernorm=rms(w["post"]))
        got.append(stream.attention_input(layer))
        stream.add(attn_out[i].float())
        got.append(stream.mlp_input(layer))
        stream.add(mlp_out[i].float())
    inner = SimpleNamespace(output_attn_res_norm=norm(weights[L]["n"]),
                            output_attn_res_proj=norm(weights[L]["q"][None]))
    final = stream.output(inner, [2, 0])
    for t in range(T):
        want, want_final = _attn_res_reference(emb[t], attn_out[:, t], mlp_out[:, t], weights, B)
        for k, (a, b) in enumerate(zip(got, want)):
            assert torch.allclose(a[t].double(), b, atol=1e-5, rtol=1e-5), (t, k)
        if t in (2, 0):
            assert torch.allclose(final[[2, 0].index(t)].double(), want_final, atol=1e-5, rtol=1e-5)
    assert len(stream.blocks) == -(-L // B)


def _latent_moe_reference(moe, x, cfg):
    """One token through the latent MoE in float64, written out from §1.3."""
    d = lambda t: t.detach().double()  # noqa: E731
    beta, lam = cfg.activation_situ_beta, cfg.activation_situ_linear_beta
    situ = lambda g, u: beta * torch.tanh(g / beta) * torch.sigmoid(g) * lam * torch.tanh(u / lam)  # noqa
    x = x.double()
    s = torch.sigmoid(d(moe.gate.weight) @ x)
    key = s + d(moe.gate.e_score_correction_bias)
    top = sorted(range(cfg.num_experts), key=lambda e: -key[e].item())[:cfg.num_experts_per_token]
    w = s[top] / (s[top].sum() + 1e-20) * cfg.routed_scaling_factor
    z = d(moe.routed_expert_down_proj.weight) @ x
    r = torch.zeros_like(z)
    for we, e in zip(w, top):
        ex = moe.experts[e]
        r += we * (d(ex.w2.weight) @ situ(d(ex.w1.weight) @ z, d(ex.w3.weight) @ z))
    r = _rms64(r, d(moe.routed_expert_norm.weight))
    se = moe.shared_experts
    shared = d(se.down_proj.weight) @ situ(d(se.gate_proj.weight) @ x, d(se.up_proj.weight) @ x)
    return d(moe.routed_expert_up_proj.weight) @ r + shared


def test_latent_moe_matches_a_float64_loop():
    cfg = reduced_kimi_k3(num_layers=2, hidden_size=64, num_experts=12, top_k=3, head_dim=8)
    model = build_model(cfg, seed=4)
    moe = model.model.layers[1].block_sparse_moe
    assert isinstance(moe, LatentMoE) and moe.experts[0].w1.weight.shape == (16, 32)
    assert moe.shared_experts.gate_proj.weight.shape == (2 * 16, 64)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(5))
    for dense in (False, True):
        got = moe(x, dense=dense)
        for t in range(9):
            want = _latent_moe_reference(moe, x[t], cfg)
            assert torch.allclose(got[t].double(), want, atol=1e-5 * want.abs().max(), rtol=0)
    assert not torch.allclose(got[0], got[1])


# -- config -----------------------------------------------------------------------------------
def _k3(**text):
    d = preset_dict("kimi-k3")
    d["text_config"].update(text)
    return d


@pytest.mark.parametrize("change,field", [
    (dict(attn_res_block_size=0), "attn_res_block_size"),
    (dict(attn_res_block_size=11), "attn_res_block_size"),       # ceil(93/11) = 9 blocks > 8
    (dict(routed_expert_hidden_size=0), "routed_expert_hidden_size"),
    (dict(routed_expert_hidden_size=3584, num_experts=None), "routed_expert_hidden_size"),
    (dict(routed_expert_hidden_size=None), "latent_moe_use_norm"),
    (dict(activation_situ_beta=None), "activation_situ_beta"),
    (dict(activation_situ_linear_beta=None), "activation_situ_linear_beta"),
    (dict(activation_situ_beta=-4.0), "activation_situ_beta"),
    (dict(activation_situ_linear_beta=0.0), "activation_situ_linear_beta"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(num_nextn_predict_layers=-1), "num_nextn_predict_layers"),
    (dict(routed_scaling_factor=0.0), "routed_scaling_factor"),
    (dict(num_experts_per_token=897), "num_experts_per_token"),
    (dict(moe_intermediate_size=0), "moe_intermediate_size"),
    (dict(num_shared_experts=-1), "num_shared_experts"),
    (dict(moe_router_activation_func="relu"), "moe_router_activation_func"),
    (dict(num_expert_group=5), "num_expert_group"),
    (dict(mla_use_nope=False), "mla_use_nope"),
    (dict(q_lora_rank="x"), "q_lora_rank"),
    (dict(q_lora_rank=0), "q_lora_rank"),
    (dict(num_attention_heads=0), "num_attention_heads"),
    (dict(kv_lora_rank=-1), "kv_lora_rank"),
    (dict(topk_group=2), "topk_group"),
    (dict(first_k_dense_replace=-1), "first_k_dense_replace"),
    (dict(moe_layer_freq=0), "moe_layer_freq"),
    (dict(linear_attn_config={**preset_dict("kimi-k3")["text_config"]["linear_attn_config"],
                              "num_heads": 0}), "linear_attn_config.num_heads"),
    (dict(linear_attn_config={**preset_dict("kimi-k3")["text_config"]["linear_attn_config"],
                              "kda_layers": [1, 2]}), "linear_attn_config.kda_layers"),
    (dict(linear_attn_config={**preset_dict("kimi-k3")["text_config"]["linear_attn_config"],
                              "gate_lower_bound": -6.0}), "linear_attn_config.gate_lower_bound"),
])
def test_bad_k3_configs_are_refused_naming_the_field(change, field):
    with pytest.raises(ConfigError) as err:
        parse_config(_k3(**change))
    assert err.value.field == f"text_config.{field}", err.value


def test_k3_tp_divisibility_names_the_field():
    with pytest.raises(ConfigError) as err:
        parse_config(preset_dict("kimi-k3"), tp=7)
    assert err.value.field.startswith("text_config.")
    preset("kimi-k3", tp=8)
    preset("kimi-k3", tp=16)
