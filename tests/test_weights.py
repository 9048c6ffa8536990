import pytest
import torch
from safetensors.torch import load_file

from pdserve.model.config import load_config, preset
from pdserve.model.generate import build_model
from pdserve.model.model import HybridModel
from pdserve.model.parallel import TPGroup
from pdserve.model.weights import WEIGHTS_FILE, full_state, load_checkpoint, save_checkpoint


def test_seeded_init_is_deterministic_per_seed():
    a, b, c = (build_model(preset("tiny"), seed=s) for s in (4, 4, 5))
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), n
        assert not torch.equal(pa, pc), n


def test_parameter_names_are_hf_names():
    names = set(dict(build_model(preset("tiny")).named_parameters()))
    for expected in ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                     "model.layers.0.self_attn.q_conv1d.weight", "model.layers.0.self_attn.A_log",
                     "model.layers.0.self_attn.dt_bias", "model.layers.0.self_attn.f_b_proj.weight",
                     "model.layers.0.self_attn.g_a_proj.weight", "model.layers.0.self_attn.o_norm.weight",
                     "model.layers.0.mlp.gate_proj.weight",
                     "model.layers.2.self_attn.kv_a_proj_with_mqa.weight",
                     "model.layers.2.self_attn.kv_a_layernorm.weight",
                     "model.layers.2.self_attn.kv_b_proj.weight",
                     "model.layers.1.block_sparse_moe.gate.e_score_correction_bias",
                     "model.layers.1.block_sparse_moe.experts.7.w2.weight",
                     "model.layers.1.block_sparse_moe.shared_experts.down_proj.weight"]:
        assert expected in names, expected


def test_checkpoint_round_trip_and_tp_slicing(tmp_path):
    cfg = preset("tiny")
    src = build_model(cfg, seed=9)
    save_checkpoint(tmp_path, cfg, full_state(src, seed=9))
    assert load_config(tmp_path) == cfg
    tensors = load_file(str(tmp_path / WEIGHTS_FILE))
    assert tensors["model.layers.0.self_attn.A_log"].shape == (1, 1, 4, 1)
    assert tensors["model.layers.0.self_attn.q_conv1d.weight"].shape == (128, 1, 4)
    loaded = build_model(cfg, checkpoint=str(tmp_path))
    for (n, a), b in zip(src.named_parameters(), loaded.parameters()):
        assert torch.equal(a, b), n
    # rank 1 of TP=2 holds the second half of column-split weights, all of replicated ones
    half = HybridModel(cfg, TPGroup(rank=1, size=2))
    load_checkpoint(half, tmp_path)
    q = dict(half.named_parameters())["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(q, tensors["model.layers.0.self_attn.q_proj.weight"][64:])
    o = dict(half.named_parameters())["model.layers.0.self_attn.o_proj.weight"]
    assert torch.equal(o, tensors["model.layers.0.self_attn.o_proj.weight"][:, 64:])
    a_log = dict(half.named_parameters())["model.layers.0.self_attn.A_log"]
    assert torch.equal(a_log, tensors["model.layers.0.self_attn.A_log"][:, :, 2:])


def test_bad_checkpoints_name_the_tensor(tmp_path):
    cfg = preset("tiny")
    tensors = full_state(build_model(cfg), seed=0)
    bad = dict(tensors)
    del bad["model.norm.weight"]
    save_checkpoint(tmp_path / "missing", cfg, bad)
    with pytest.raises(KeyError, match="lacks 1 tensors.*model.norm.weight"):
        build_model(cfg, checkpoint=str(tmp_path / "missing"))
    bad = dict(tensors, **{"model.norm.weight": torch.ones(7)})
    save_checkpoint(tmp_path / "shape", cfg, bad)
    with pytest.raises(ValueError, match=r"model.norm.weight: checkpoint shape \(7,\)"):
        build_model(cfg, checkpoint=str(tmp_path / "shape"))
    with pytest.raises(FileNotFoundError):
        build_model(cfg, checkpoint=str(tmp_path))


def test_export_checkpoint_without_a_model_equals_the_seeded_model(tmp_path):
    """`export_checkpoint` (meta-device model, what the vLLM runs load) writes exactly the seeded
    weights a model built in memory has, in the asked dtype (parameters kept in fp32 whatever the
    model dtype, e.g. A_log, stay fp32)."""
    import torch

    from pdserve.model.config import preset
    from pdserve.model.generate import build_model
    from pdserve.model.weights import export_checkpoint

    config = preset("tiny")
    out = export_checkpoint(tmp_path / "hf", config, seed=4, dtype=torch.bfloat16)
    loaded = build_model(config, checkpoint=str(out))
    seeded = build_model(config, seed=4)
    written = load_file(str(out / WEIGHTS_FILE))
    for (name, a), (_, b) in zip(loaded.named_parameters(), seeded.named_parameters()):
        assert written[name].dtype in (torch.bfloat16, torch.float32), name
        assert torch.equal(a.float(), b.to(written[name].dtype).float()), name
    assert any(t.dtype == torch.bfloat16 for t in written.values())
