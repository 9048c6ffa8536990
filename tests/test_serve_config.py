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
