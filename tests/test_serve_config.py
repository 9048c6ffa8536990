"""`pdserve serve/check` configuration: the shipped files validate, and every bad field is refused
with a message that names it (no cluster is started here)."""
from pathlib import Path

import pytest

from pdserve.cluster.config import load_serve_config
from pdserve.model.config import ConfigError

CONFIGS = Path(__file__).resolve().parent.parent / "cluster" / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    cfg, model = load_serve_config(path)
    assert model.num_hidden_layers > 0 and cfg.decode.tp >= 1


@pytest.mark.parametrize("toml, field, words", [
    ("[decode]\ntp = 0\n", "decode.tp", "positive"),
    ("[decode]\ndcp = 3\n", "decode.dcp", "must be 1 or decode.tp"),
    ("[decode]\nbackend = \"fast\"\n", "decode.backend", "reference"),
    ("[decode]\ncuda_graphs = true\n", "decode.cuda_graphs", "needs GPUs"),
    ("[decode]\ntp = 2\ncuda_graphs = true\n[resources]\ngpus_per_rank = 1\n",
     "decode.cuda_graphs", "tp = 1 only"),
    ("[api]\nport = 70000\n", "api.port", "1..65535"),
    ("[api]\nmax_body_bytes = 0\n", "api.max_body_bytes", "positive"),
    ("[api]\nbody_timeout_s = -1\n", "api.body_timeout_s", "positive"),
    ("[api]\ndrain_s = -1\n", "api.drain_s", ">= 0"),
    ("[decode]\nmla_fp8_query = \"half\"\n", "decode.mla_fp8_query", "split"),
    ("[decode]\nbackend = \"cutedsl\"\nmla_fp8_query = \"single\"\n", "decode.mla_fp8_query",
     "float8_e4m3fn"),
    ("[state]\nlatent_dtype = \"float8_e4m3fn\"\n[decode]\nmla_fp8_query = \"split\"\n",
     "decode.mla_fp8_query", "cutedsl"),
    ("[state]\nlatent_dtype = \"float7\"\n", "state.latent_dtype", "float7"),
    ("[transfer]\nlease_s = -1\n", "transfer.lease_s", "positive"),
    ("[decode]\nnum_slots = 1\n", "decode.num_slots", "slot 0"),
    ("[model]\nname = \"gpt-9\"\n", "model.name", "gpt-9"),
    ("[decode]\nbatch = 4\n", "decode", "batch"),
    ("[resources]\nprefill_idle_threads = -1\n", "resources.prefill_idle_threads", ">= 0"),
    ("mode = \"mono\"\n", "mode", "one of: disaggregated, monolithic"),
    ("mode = 1\n", "mode", "Expected `str`"),
    ("[decode]\nmode = \"monolithic\"\n", "decode", "top-level key"),
    ("mode = \"monolithic\"\n[decode]\nbackend = \"cutedsl\"\n", "decode.backend", "monolithic"),
    ("mode = \"monolithic\"\n[decode]\ncuda_graphs = true\n[resources]\ngpus_per_rank = 1\n",
     "decode.cuda_graphs", "monolithic"),
    ("mode = \"monolithic\"\n[decode]\ntp = 3\n", "decode.tp", "TP=3"),
    ("mode = \"monolithic\"\n[decode]\ninstances = 0\n", "decode.instances", "positive"),
])
def test_bad_fields_are_named(tmp_path, toml, field, words):
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as err:
        load_serve_config(path)
    assert err.value.field.startswith(field), (err.value.field, str(err.value))
    assert words in str(err.value), str(err.value)


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_serve_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[decode\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_serve_config(bad)


def test_check_prints_the_monolithic_topology(capsys):
    from pdserve.cli import main

    assert main(["check", "--config", str(CONFIGS / "local-tiny-monolithic.toml")]) == 0
    out = capsys.readouterr().out
    assert "monolithic: 1 instance(s) x TP 1 (prefill + decode in each rank, no transfer)" in out
    assert "[prefill] and [transfer] are not used" in out and "1 ranks" in out
    assert "\nprefill:" not in out and "\ntransfer:" not in out
    assert main(["check"]) == 0  # the default stays disaggregated
    out = capsys.readouterr().out
    assert "prefill: 1 instance(s)" in out and "decode: 1 instance(s)" in out and "2 ranks" in out


def test_mode_defaults_to_disaggregated_and_monolithic_ignores_the_prefill_pool(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text("[decode]\ntp = 2\n")
    cfg, _ = load_serve_config(path)
    assert cfg.mode == "disaggregated" and not cfg.monolithic and cfg.num_ranks == 3
    # TP 3 does not fit tiny, but a monolithic deployment has no prefill pool to check
    path.write_text("mode = \"monolithic\"\n[prefill]\ntp = 3\n[decode]\ninstances = 2\ntp = 2\n")
    cfg, _ = load_serve_config(path)
    assert cfg.monolithic and cfg.num_ranks == 4


# == prefill.engine = "vllm" =======================================================================
VLLM_OK = """
[model]
name = "{model}"
dtype = "bfloat16"
[state]
latent_dtype = "bfloat16"
recurrent_dtype = "float32"
conv_dtype = "bfloat16"
[prefill]
engine = "vllm"
tp = {tp}
[prefill.vllm]
export_dir = "{export}"
[resources]
gpus_per_rank = 1
"""
# tiny with Kimi's MLA head dims, which vLLM 0.26's MLA prefill backends need
TINY_VLLM = dict(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=512)


@pytest.fixture
def tiny_vllm_dir(tmp_path):
    """A model directory with only config.json (no weights: seeded, exported at start-up)."""
    import json

    from pdserve.model.config import preset
    from pdserve.model.weights import hf_config_dict

    d = tmp_path / "tiny-vllm"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(hf_config_dict(preset("tiny", **TINY_VLLM))))
    return d


def _vllm_toml(tmp_path, model, extra="", tp=1, replace=()):
    text = VLLM_OK.format(model=model, tp=tp, export=tmp_path / "exports")
    for old, new in replace:
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / "vllm.toml"
    path.write_text(text + extra)
    return path


def test_vllm_engine_config_validates_and_maps_to_the_engine(tmp_path, tiny_vllm_dir):
    from pdserve.cluster.config import (vllm_engine_config, vllm_env, vllm_model_dir,
                                        check_vllm_geometry)

    path = _vllm_toml(tmp_path, tiny_vllm_dir, "[prefill.vllm.env]\nVLLM_USE_FLASHINFER_SAMPLER = "
                      "\"0\"\n[transfer]\nlease_s = 12.5\n", tp=2)
    cfg, model = load_serve_config(path)
    assert cfg.vllm and cfg.prefill.tp == 2 and cfg.prefill.vllm.num_gpu_blocks == 256
    # one actor per vLLM instance (it holds tp GPUs), one per decode rank
    assert cfg.num_ranks == 2
    # no safetensors in the directory: its seeded weights are exported once, keyed by config
    where, export = vllm_model_dir(cfg, model)
    assert export and where.parent == tmp_path / "exports" and where.name.startswith("tiny-vllm-seed0-")
    eng = vllm_engine_config(cfg, where)
    assert (eng.model, eng.tp, eng.dtype, eng.lease_s, eng.num_gpu_blocks, eng.enforce_eager) == \
        (str(where), 2, "bfloat16", 12.5, 256, True)
    from pdserve.prefill.vllm_engine import engine_args
    args = engine_args("prefill-0", 0, eng)
    assert args["distributed_executor_backend"] == "mp"  # not Ray's, inside a Ray actor
    assert args["num_gpu_blocks_override"] == 256 and args["tensor_parallel_size"] == 2
    assert vllm_env(cfg) == {"VLLM_WORKER_MULTIPROC_METHOD": "spawn",
                             "VLLM_SSM_CONV_STATE_LAYOUT": "SD", "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    # a directory with weights is loaded as it is
    (tiny_vllm_dir / "model.safetensors").write_bytes(b"")
    assert vllm_model_dir(cfg, model) == (tiny_vllm_dir, False)

    # the layout vLLM's workers report must be what decode holds
    from types import SimpleNamespace
    geo = SimpleNamespace(latent_dtype="bfloat16", recurrent_dtype="float32",
                          conv_dtype="bfloat16", conv_layout="SD")
    check_vllm_geometry(cfg, geo)
    with pytest.raises(ConfigError) as err:
        check_vllm_geometry(cfg, SimpleNamespace(**{**vars(geo), "recurrent_dtype": "bfloat16"}))
    assert err.value.field == "state.recurrent_dtype" and "vLLM's cache holds bfloat16" in str(err.value)
    with pytest.raises(ConfigError) as err:
        check_vllm_geometry(cfg, SimpleNamespace(**{**vars(geo), "conv_layout": "DS"}))
    assert err.value.field == "prefill.conv_layout"


@pytest.mark.parametrize("extra, replace, field, words", [
    ("", [("gpus_per_rank = 1", "gpus_per_rank = 0")], "resources.gpus_per_rank", "runs on GPUs"),
    ("", [("dtype = \"bfloat16\"\n[state]", "dtype = \"float32\"\n[state]")], "model.dtype",
     "16-bit"),
    ("", [("recurrent_dtype = \"float32\"", "recurrent_dtype = \"bfloat16\"")],
     "state.recurrent_dtype", "vLLM's cache"),
    ("", [("latent_dtype = \"bfloat16\"", "latent_dtype = \"float32\"")], "state.latent_dtype",
     "must be 'bfloat16'"),
    ("", [("tp = 1", "tp = 3")], "prefill.tp", "TP=3"),
    ("", [("[prefill.vllm]", "[prefill.vllm]\ngpu_memory_utilization = 1.5")],
     "prefill.vllm.gpu_memory_utilization", "(0, 1]"),
    ("", [("[prefill.vllm]", "[prefill.vllm]\nmax_model_len = 0")], "prefill.vllm.max_model_len",
     "positive"),
    ("", [("[prefill.vllm]", "[prefill.vllm]\nnum_gpu_blocks = -1")],
     "prefill.vllm.num_gpu_blocks", ">= 0"),
    ("", [("[prefill.vllm]", "[prefill.vllm]\ngpu_blocks = 8")], "prefill.vllm", "gpu_blocks"),
    ("[prefill.vllm.env]\nVLLM_SSM_CONV_STATE_LAYOUT = \"DS\"\n", [], "prefill.vllm.env",
     "prefill.conv_layout"),
    ("[prefill.vllm.env]\nX = 1\n", [], "prefill.vllm.env", "Expected `str`"),
])
def test_vllm_bad_fields_are_named(tmp_path, tiny_vllm_dir, extra, replace, field, words):
    path = _vllm_toml(tmp_path, tiny_vllm_dir, extra, replace=replace)
    with pytest.raises(ConfigError) as err:
        load_serve_config(path)
    assert err.value.field.startswith(field), (err.value.field, str(err.value))
    assert words in str(err.value), str(err.value)


def test_vllm_in_float16_takes_fp16_state_and_its_own_export(tmp_path, tiny_vllm_dir):
    from pdserve.cluster.config import vllm_engine_config, vllm_model_dir

    bf16, _ = load_serve_config(_vllm_toml(tmp_path, tiny_vllm_dir))
    fp16_path = _vllm_toml(tmp_path, tiny_vllm_dir, replace=[("bfloat16", "float16")])
    cfg, model = load_serve_config(fp16_path)
    assert (cfg.model.dtype, cfg.state.latent_dtype, cfg.state.conv_dtype,
            cfg.state.recurrent_dtype) == ("float16", "float16", "float16", "float32")
    where, export = vllm_model_dir(cfg, model)
    assert export and where != vllm_model_dir(bf16, model)[0]   # weights differ by format
    assert vllm_engine_config(cfg, where).dtype == "float16"
    # fp16 activations with bf16 pools: vLLM's cache would not be what decode holds
    path = _vllm_toml(tmp_path, tiny_vllm_dir, replace=[("dtype = \"bfloat16\"\n[state]",
                                                         "dtype = \"float16\"\n[state]")])
    with pytest.raises(ConfigError) as err:
        load_serve_config(path)
    assert err.value.field == "state.latent_dtype" and "must be 'float16'" in str(err.value)
    # pdserve's own engines do not run float16
    path = tmp_path / "ref16.toml"
    path.write_text("[model]\nname = \"tiny\"\ndtype = \"float16\"\n")
    with pytest.raises(ConfigError) as err:
        load_serve_config(path)
    assert err.value.field == "model.dtype" and "prefill.engine = \"vllm\"" in str(err.value)


def test_vllm_monolithic_and_models_vllm_cannot_run_are_refused(tmp_path, tiny_vllm_dir):
    path = tmp_path / "m.toml"
    path.write_text("mode = \"monolithic\"\n" + VLLM_OK.format(model=tiny_vllm_dir, tp=1,
                                                               export=tmp_path))
    with pytest.raises(ConfigError) as err:
        load_serve_config(path)
    assert err.value.field == "prefill.engine" and "disaggregated" in str(err.value)
    # the plain tiny preset has MLA head dims vLLM 0.26 has no prefill backend for
    with pytest.raises(ConfigError) as err:
        load_serve_config(_vllm_toml(tmp_path, "tiny"))
    assert err.value.field == "model.name" and "qk_nope_head_dim=32" in str(err.value)
    # K3's layers are not in vLLM 0.26: refused by the first K3 field, all of them named
    with pytest.raises(ConfigError) as err:
        load_serve_config(_vllm_toml(tmp_path, "kimi-k3"))
    assert err.value.field == "attn_res_block_size"
    assert all(f in str(err.value) for f in ("routed_expert_hidden_size", "hidden_act=situ",
                                             "use_full_rank_gate=True", "reference"))


def test_check_prints_the_vllm_topology(capsys):
    from pdserve.cli import main

    assert main(["check", "--config", str(CONFIGS / "h200-vllm.toml")]) == 0
    out = capsys.readouterr().out
    assert "prefill: 1 instance(s) x TP 2, engine vllm (stock vLLM: one actor per instance " \
           "holding 2 GPU(s)" in out
    assert "vLLM: max_model_len 32768, cache blocks 256" in out
    assert "weights: " in out and "kimi-linear-48b-a3b-seed0-" in out and "exported at start-up" in out
    assert "decode: 1 instance(s) x TP 4" in out
    assert "4 decode ranks + 1 vLLM actor(s) x (4.0 CPU + 2 GPU); 5 actors, 6 GPUs" in out


def test_mla_fp8_query_and_determinism_reach_the_decode_ranks(tmp_path):
    """decode.mla_fp8_query = "single" (with the cutedsl backend over an fp8 latent pool) and
    decode.mla_deterministic = true are what every decode rank is built with, and `pdserve
    check` says so; unset, the query mode is the kernel's default (None; `check` shows
    "single" over an fp8 pool, nothing without an fp8 pool) and determinism false; a
    non-boolean is refused naming the field."""
    from pdserve.cluster.config import describe
    from pdserve.cluster.serve import decode_kwargs
    path = tmp_path / "fp8.toml"
    path.write_text("[state]\nlatent_dtype = \"float8_e4m3fn\"\n"
                    "[decode]\nbackend = \"cutedsl\"\nmla_fp8_query = \"single\"\n")
    cfg, model = load_serve_config(path)
    assert decode_kwargs(cfg)["mla_fp8_query"] == "single"
    assert "backend cutedsl (MLA fp8 query: single e4m3 term)" in describe(cfg, model)
    path.write_text("[state]\nlatent_dtype = \"float8_e4m3fn\"\n"
                    "[decode]\nbackend = \"cutedsl\"\nmla_fp8_query = \"split\"\n")
    cfg, model = load_serve_config(path)
    assert decode_kwargs(cfg)["mla_fp8_query"] == "split"
    assert "backend cutedsl (MLA fp8 query: two e4m3 terms)" in describe(cfg, model)
    path.write_text("[state]\nlatent_dtype = \"float8_e4m3fn\"\n[decode]\nbackend = \"cutedsl\"\n")
    cfg, model = load_serve_config(path)
    assert decode_kwargs(cfg)["mla_fp8_query"] is None
    assert ("backend cutedsl (MLA fp8 query: single e4m3 term, the kernel's default)"
            in describe(cfg, model))
    path.write_text("[decode]\nbackend = \"cutedsl\"\n")
    cfg, model = load_serve_config(path)
    kw = decode_kwargs(cfg)
    assert kw["mla_fp8_query"] is None and kw["mla_deterministic"] is False
    assert "MLA fp8 query" not in describe(cfg, model)
    path.write_text("[decode]\nbackend = \"cutedsl\"\nmla_deterministic = true\n")
    cfg, model = load_serve_config(path)
    assert decode_kwargs(cfg)["mla_deterministic"] is True
    assert "backend cutedsl, deterministic MLA, max batch" in describe(cfg, model)
    path.write_text("[decode]\nmla_deterministic = \"yes\"\n")
    with pytest.raises(ConfigError, match="decode.mla_deterministic"):
        load_serve_config(path)
