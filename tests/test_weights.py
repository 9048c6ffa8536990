import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from pdserve.model.config import load_config, preset
from pdserve.model.generate import build_model
from pdserve.model.model import HybridModel
from pdserve.model.parallel import TPGroup
from pdserve.model.checkpoint import INDEX_FILE, CheckpointError
from pdserve.model.weights import (WEIGHTS_FILE, check_checkpoint, full_state, load_checkpoint,
                                   save_checkpoint)


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


def _sharded(directory, cfg, tensors, shard_bytes=200_000):
    """A checkpoint in the layout Kimi ships: shards + model.safetensors.index.json."""
    save_checkpoint(directory, cfg, tensors, max_shard_bytes=shard_bytes)
    return json.loads((directory / INDEX_FILE).read_text())["weight_map"]


def test_sharded_checkpoint_through_the_index_each_rank_reading_its_slices(tmp_path):
    cfg = preset("tiny")
    src = build_model(cfg, seed=9)
    tensors = {k: v.to(torch.bfloat16) if v.dtype == torch.float32 and v.dim() == 2 else v
               for k, v in full_state(src, seed=9).items()}  # bf16 linears, as released
    weight_map = _sharded(tmp_path, cfg, tensors)
    files = sorted(set(weight_map.values()))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert all((tmp_path / f).exists() for f in files) and not (tmp_path / WEIGHTS_FILE).exists()
    (tmp_path / "stray.safetensors").write_bytes(b"not one")  # not in the index: never opened
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    for tp in (TPGroup(), TPGroup(rank=0, size=2), TPGroup(rank=1, size=2)):
        model = HybridModel(cfg, tp, torch.bfloat16)
        ckpt = load_checkpoint(model, tmp_path)
        for name, p in model.named_parameters():
            want = tensors[name].chunk(tp.size, p.shard_dim)[tp.rank] if p.shard_dim is not None \
                else tensors[name]
            assert torch.equal(p, want.to(p.dtype)), name
        # what was read is exactly the rank's slices: half of every sharded weight at TP=2
        assert ckpt.bytes_read == sum(p.numel() * tensors[n].element_size()
                                      for n, p in model.named_parameters())
        assert ckpt.bytes_read == total if tp.size == 1 else ckpt.bytes_read < 0.6 * total


@pytest.fixture()
def sharded_dir(tmp_path):
    cfg = preset("tiny")
    tensors = full_state(build_model(cfg), seed=0)
    return cfg, tensors, tmp_path / "ok", _sharded(tmp_path / "ok", cfg, tensors)


NORM = "model.norm.weight"


def _bad(tmp_path, cfg, tensors, name, **changes):
    d = tmp_path / name
    tensors = {k: v for k, v in {**tensors, **changes}.items() if v is not None}
    return d, _sharded(d, cfg, tensors)


def test_bad_checkpoints_fail_before_any_weight_is_read_naming_tensor_and_file(
        tmp_path, sharded_dir):
    cfg, tensors, ok, weight_map = sharded_dir
    norm_file = weight_map[NORM]
    cases = []
    d = tmp_path / "missing-shard"
    shutil.copytree(ok, d)
    (d / norm_file).unlink()
    cases.append((d, rf"{INDEX_FILE} names shard {norm_file}, which is missing"))
    d, m = _bad(tmp_path, cfg, tensors, "shape", **{NORM: torch.ones(7)})
    cases.append((d, rf"{NORM} in {m[NORM]}: shape \(7,\), the model's is \(128,\)"))
    d, m = _bad(tmp_path, cfg, tensors, "dtype", **{NORM: torch.ones(128, dtype=torch.int32)})
    cases.append((d, rf"{NORM} in {m[NORM]}: dtype I32, expected a float"))
    d, m = _bad(tmp_path, cfg, tensors, "missing", **{NORM: None})
    cases.append((d, rf"lacks {NORM} \(shape \(128,\)\)"))
    d, m = _bad(tmp_path, cfg, tensors, "extra", **{"model.extra.weight": torch.ones(3)})
    cases.append((d, rf"1 tensors the model does not use, e.g. model.extra.weight in "
                     rf"{m['model.extra.weight']}"))
    d = tmp_path / "index-lies"
    shutil.copytree(ok, d)
    index = json.loads((d / INDEX_FILE).read_text())
    other = next(f for f in index["weight_map"].values() if f != norm_file)
    index["weight_map"][NORM] = other
    (d / INDEX_FILE).write_text(json.dumps(index))
    cases.append((d, rf"puts {NORM} in {other}, which lacks it"))
    d = tmp_path / "fp8"
    shutil.copytree(ok, d)
    conf = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**conf, "quantization_config": {
        "quant_method": "fp8", "weight_block_size": [128, 128]}}))
    cases.append((d, r"quantization_config: quant_method 'fp8' is not supported"))
    d = tmp_path / "no-weights"
    d.mkdir()
    cases.append((d, rf"no {INDEX_FILE} and no \*.safetensors files"))
    for d, message in cases:
        model = HybridModel(cfg)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(7.0)
        with pytest.raises(CheckpointError, match=message):
            load_checkpoint(model, d)
        with pytest.raises(CheckpointError, match=message):
            check_checkpoint(cfg, d)  # what serve checks before any rank starts
        assert all(bool((p == 7.0).all()) for p in model.parameters()), d  # nothing was read


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


def test_mtp_drafter_tensors_are_passed_over_only_where_the_config_has_them(tmp_path):
    cfg = preset("tiny", num_nextn_predict_layers=1)
    tensors = full_state(build_model(cfg), seed=0)
    drafter = {"model.layers.4.mlp.gate_proj.weight": torch.ones(2, 2)}  # layer 4 = the drafter
    _sharded(tmp_path / "mtp", cfg, {**tensors, **drafter})
    load_checkpoint(HybridModel(cfg), tmp_path / "mtp")
    _sharded(tmp_path / "no-mtp", preset("tiny"), {**tensors, **drafter})
    with pytest.raises(CheckpointError, match="e.g. model.layers.4.mlp.gate_proj.weight in"):
        load_checkpoint(HybridModel(preset("tiny")), tmp_path / "no-mtp")
