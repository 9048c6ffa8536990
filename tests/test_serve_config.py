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
    ("[prefill]\nengine = \"vllm\"\n", "prefill.engine", "not wired"),
    ("[api]\nport = 70000\n", "api.port", "1..65535"),
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
