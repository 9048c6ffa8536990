import json

import pytest

from pdserve.model.config import (ConfigError, PRESETS, load_config, parse_config, preset,
                                  preset_dict, reduced_kimi_linear)


def test_presets_match_the_published_shapes():
    kl = preset("kimi-linear-48b-a3b")
    assert kl.hidden_size == 2304 and kl.num_hidden_layers == 27
    assert [i + 1 for i in kl.mla_layer_ids] == [4, 8, 12, 16, 20, 24, 27]
    assert len(kl.kda_layer_ids) == 20
    la = kl.linear_attn_config
    assert (la.num_heads, la.head_dim, la.short_conv_kernel_size) == (32, 128, 4)
    assert la.gate_lower_bound is None and not la.use_full_rank_gate
    assert (kl.num_attention_heads, kl.q_lora_rank, kl.kv_lora_rank) == (32, None, 512)
    assert (kl.qk_nope_head_dim, kl.qk_rope_head_dim, kl.v_head_dim) == (128, 64, 128)
    assert (kl.num_experts, kl.num_experts_per_token, kl.num_shared_experts) == (256, 8, 1)
    assert (kl.moe_intermediate_size, kl.intermediate_size, kl.first_k_dense_replace) == (1024, 9216, 1)
    assert kl.routed_scaling_factor == 2.446 and kl.vocab_size == 163840
    assert kl.latent_width == 576

    k3 = preset("kimi-k3")
    assert k3.num_hidden_layers == 93 and k3.hidden_size == 7168
    assert [i + 1 for i in k3.mla_layer_ids] == list(range(4, 93, 4)) + [93]
    assert len(k3.mla_layer_ids) == 24 and len(k3.kda_layer_ids) == 69
    assert k3.linear_attn_config.num_heads == 96 and k3.linear_attn_config.gate_lower_bound == -5.0
    assert k3.linear_attn_config.use_full_rank_gate and k3.mla_use_output_gate
    assert (k3.q_lora_rank, k3.num_experts, k3.num_experts_per_token) == (1536, 896, 16)
    assert (k3.routed_expert_hidden_size, k3.moe_intermediate_size, k3.num_shared_experts) == (3584, 3072, 2)
    assert (k3.hidden_act, k3.activation_situ_beta, k3.activation_situ_linear_beta) == ("situ", 4.0, 25.0)
    assert k3.attn_res_block_size == 12 and k3.intermediate_size == 33792


def test_tiny_is_a_small_hybrid_moe():
    t = preset("tiny")
    assert t.vocab_size == 256 and 4 <= t.num_hidden_layers <= 6
    assert t.kda_layer_ids and t.mla_layer_ids
    assert not t.is_moe_layer(0) and all(t.is_moe_layer(i) for i in range(1, t.num_hidden_layers))


def test_k3_nests_under_text_config_and_round_trips(tmp_path):
    d = preset_dict("kimi-k3")
    assert d["model_type"] == "kimi_k3" and "text_config" in d
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert load_config(tmp_path) == preset("kimi-k3")
    for name in PRESETS:
        cfg = preset(name)
        assert parse_config(cfg.to_hf_dict()) == cfg


def test_reduced_kimi_linear_keeps_head_shapes():
    r = reduced_kimi_linear(num_layers=4, num_experts=4, top_k=2)
    full = preset("kimi-linear-48b-a3b")
    assert r.linear_attn_config.num_heads == full.linear_attn_config.num_heads
    assert r.kv_lora_rank == full.kv_lora_rank and r.hidden_size == full.hidden_size
    assert r.mla_layer_ids == [3] and r.kda_layer_ids == [0, 1, 2]


def _tiny_with(**changes):
    d = preset_dict("tiny")
    for key, value in changes.items():
        if key.startswith("la."):
            d["linear_attn_config"] = {**d["linear_attn_config"], key[3:]: value}
        else:
            d[key] = value
    return d


BAD = [
    ("hidden_size", _tiny_with(hidden_size=0), 1),
    ("hidden_size", _tiny_with(hidden_size="big"), 1),
    ("hidden_act", _tiny_with(hidden_act="gelu"), 1),
    ("activation_situ_beta", _tiny_with(hidden_act="situ"), 1),
    ("linear_attn_config.num_heads", _tiny_with(), 3),
    ("num_attention_heads", _tiny_with(num_attention_heads=6, **{"la.num_heads": 8}), 4),
    ("linear_attn_config.kda_layers", _tiny_with(**{"la.kda_layers": [1, 2]}), 1),
    ("linear_attn_config.kda_layers", _tiny_with(**{"la.kda_layers": [1, 2, 3, 4]}), 1),
    ("linear_attn_config.full_attn_layers", _tiny_with(**{"la.full_attn_layers": [3, 9]}), 1),
    ("linear_attn_config.kda_layers", _tiny_with(**{"la.kda_layers": [1, 1, 2, 4]}), 1),
    ("linear_attn_config.gate_lower_bound", _tiny_with(**{"la.gate_lower_bound": -7.0}), 1),
    ("linear_attn_config.short_conv_kernel_size", _tiny_with(**{"la.short_conv_kernel_size": 1}), 1),
    ("linear_attn_config.num_heads", _tiny_with(**{"la.num_heads": "four"}), 1),
    ("num_experts_per_token", _tiny_with(num_experts_per_token=9), 1),
    ("moe_router_activation_func", _tiny_with(moe_router_activation_func="relu"), 1),
    ("num_expert_group", _tiny_with(num_expert_group=3), 1),
    ("topk_group", _tiny_with(num_expert_group=4, topk_group=5), 1),
    ("mla_use_nope", _tiny_with(mla_use_nope=False), 1),
    ("kv_lora_rank", {k: v for k, v in preset_dict("tiny").items() if k != "kv_lora_rank"}, 1),
    ("model_type", _tiny_with(model_type="llama"), 1),
    ("rms_norm_eps", _tiny_with(rms_norm_eps=0.0), 1),
]


@pytest.mark.parametrize("field,data,tp", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_invalid_config_names_the_field(field, data, tp):
    with pytest.raises(ConfigError) as err:
        parse_config(data, tp=tp)
    assert err.value.field == field
    assert str(err.value).startswith(field + ":")


def test_nested_k3_errors_carry_the_text_config_prefix():
    d = preset_dict("kimi-k3")
    d["text_config"]["num_attention_heads"] = 95
    with pytest.raises(ConfigError) as err:
        parse_config(d, tp=8)
    assert err.value.field == "text_config.num_attention_heads"
    assert "95" in str(err.value) and "TP=8" in str(err.value)


def test_bad_json_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid JSON"):
        parse_config("{nope")
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "absent")
    with pytest.raises(ConfigError, match="unknown preset"):
        preset("kimi-k9")
