"""The `vllm` prefill engine's pure parts (engine arguments, sampling mapping, handles from vLLM
outputs) and the HF directory `pdserve export` writes for vLLM. Building a `vllm.LLM` is GPU only
(tests/gpu/); everything here runs on the CPU."""
import json
import subprocess
import sys

import pytest

from pdserve.model.config import load_config, preset
from pdserve.model.sampling import Request, SamplingParams
from pdserve.prefill.vllm_engine import (
    HandleBook, VllmEngineConfig, engine_args, result_from_output, vllm_sampling_kwargs)
from pdserve.prefill.vllm_state import PrefillExport, encode_export
from pdserve.state.block_table import Topology
from pdserve.state.layout import RankShapes, StateLayout
from pdserve.state.manifest import StateManifest


def test_engine_module_imports_without_vllm():
    # a fresh interpreter with vllm made unimportable: the engine module must still load
    code = ("import sys; sys.modules['vllm'] = None; import pdserve.prefill.vllm_engine as e; "
            "print(e.CONNECTOR)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "PdserveConnector"


def test_handle_book_drops_only_old_entries_no_worker_holds():
    book = HandleBook(min_age_s=10.0)
    book.add("read", "v-read", now=0.0)        # read by the decode side: freed by the workers
    book.add("held", "v-held", now=0.0)        # still leased (e.g. renewed while queued)
    book.add("young", "v-young", now=95.0)     # recorded just now, lease maybe not registered yet
    assert book.prune({"v-held"}, now=100.0) == ["read"]
    assert len(book) == 2
    assert book.get("held", "p0") == "v-held"
    with pytest.raises(KeyError, match="prefill instance p0 holds no state for request 'read'"):
        book.get("read", "p0")
    assert book.prune({"v-held"}, now=105.0) == ["young"]
    assert book.pop("held") == "v-held" and book.pop("held") is None and len(book) == 0


def test_engine_args_configure_the_connector_as_a_producer():
    args = engine_args("p0", 3, VllmEngineConfig(model="/m", tp=2, lease_s=12.0, num_gpu_blocks=64))
    kv = args["kv_transfer_config"]
    assert kv == {"kv_connector": "PdserveConnector",
                  "kv_connector_module_path": "pdserve.prefill.vllm_connector",
                  "kv_role": "kv_producer", "engine_id": "p0",
                  "kv_connector_extra_config": {"lease_s": 12.0, "generation": 3}}
    assert args["tensor_parallel_size"] == 2 and args["num_gpu_blocks_override"] == 64
    assert args["enable_prefix_caching"] is False and args["async_scheduling"] is False
    assert args["skip_tokenizer_init"] is True
    assert args["worker_extension_cls"] == "pdserve.prefill.vllm_worker.PdserveWorkerExtension"
    assert "num_gpu_blocks_override" not in engine_args("p0", 0, VllmEngineConfig(model="/m"))


def test_sampling_maps_to_one_token():
    kw = vllm_sampling_kwargs(SamplingParams(max_tokens=40, temperature=0.7, top_k=5, top_p=0.9,
                                             seed=11, stop_token_ids=[2], ignore_eos=True))
    assert kw == {"max_tokens": 1, "temperature": 0.7, "top_p": 0.9, "seed": 11,
                  "stop_token_ids": [2], "ignore_eos": True, "detokenize": False, "top_k": 5}
    assert "top_k" not in vllm_sampling_kwargs(SamplingParams())


def _export(n=9):
    shapes = RankShapes.of(preset("tiny"))
    m = StateManifest("vllm-req-1", "f" * 32, n, Topology(), StateLayout(), shapes, [[1]], 2)
    return PrefillExport("vllm-req-1", m, [], 1234.0, n)


def test_result_carries_the_manifest_first_token_and_lease():
    req = Request("ours-1", list(range(9)), SamplingParams(max_tokens=8, seed=5))
    res = result_from_output(req, req.params, "p0", 2, 77, "length", encode_export(_export()))
    h = res.handle
    assert res.error is None
    assert (h.request_id, h.instance, h.generation, h.first_token, h.prompt_tokens) == (
        "ours-1", "p0", 2, 77, 9)
    assert h.manifest.request_id == "vllm-req-1"  # the id the source's leases use
    assert h.lease_deadline == 1234.0 and h.finished is None and h.params.seed == 5


def test_result_says_when_the_first_token_ends_the_request_or_fails():
    req = Request("a", [1, 2], SamplingParams(max_tokens=8))
    assert result_from_output(req, req.params, "p0", 0, 3, "stop",
                              encode_export(_export())).handle.finished == "stop"
    one = Request("b", [1, 2], SamplingParams(max_tokens=1))
    assert result_from_output(one, one.params, "p0", 0, 3, "length",
                              encode_export(_export())).handle.finished == "length"
    bad = result_from_output(req, req.params, "p0", 0, 3, "length", {"pdserve_error": "boom"})
    assert bad.handle is None and bad.error == "boom"
    none = result_from_output(req, req.params, "p0", 0, 3, "length", None)
    assert none.handle is None and "PdserveConnector" in none.error


# -- the exported directory --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-hf")
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "export", "--model", "tiny", "--out",
                        str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return out


def test_export_writes_what_vllm_reads(exported):
    d = json.loads((exported / "config.json").read_text())
    assert d["architectures"] == ["KimiLinearForCausalLM"] and d["model_type"] == "kimi_linear"
    assert d["max_position_embeddings"] >= 32768
    la = d["linear_attn_config"]
    assert la["kda_layers"] == [1, 2, 4] and la["full_attn_layers"] == [3]
    assert {"num_heads", "head_dim", "short_conv_kernel_size"} <= set(la)
    # pdserve reads the same file back unchanged (extra fields are ignored, fingerprint stable)
    assert load_config(exported) == preset("tiny")
    from safetensors import safe_open
    with safe_open(str(exported / "model.safetensors"), framework="pt") as st:
        names = set(st.keys())
    for name in ("model.layers.0.self_attn.q_conv1d.weight", "model.layers.0.self_attn.A_log",
                 "model.layers.2.self_attn.kv_a_proj_with_mqa.weight",
                 "model.layers.1.block_sparse_moe.experts.0.w1.weight",
                 "model.layers.1.block_sparse_moe.gate.e_score_correction_bias",
                 "model.layers.0.mlp.gate_proj.weight", "lm_head.weight"):
        assert name in names, name  # vLLM's kimi_linear load_weights names


def test_vllms_own_config_class_reads_the_export(exported):
    vllm_cfg = _import_vllm_config()
    d = json.loads((exported / "config.json").read_text())
    cfg = vllm_cfg(**d)
    ours = preset("tiny")
    assert [cfg.is_kda_layer(i) for i in range(4)] == [ours.is_kda_layer(i) for i in range(4)]
    assert cfg.is_mla and cfg.is_moe and cfg.is_linear_attn
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.num_experts_per_token) == (64, 16, 2)


def _import_vllm_config():
    from test_vllm_connector import import_vllm  # one place decides how vLLM is imported

    import_vllm()
    from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig

    return KimiLinearConfig


def test_export_waits_for_another_exporter_only_until_its_deadline(tmp_path):
    """`pdserve serve` exports a preset once under a file lock; a second start waits for it, but
    not forever: it gets an error naming the lock."""
    import fcntl
    import time

    from pdserve.prefill.vllm_engine import ensure_export
    out = tmp_path / "tiny-export"
    with open(tmp_path / ".tiny-export.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another exporter holds it
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="export lock"):
            ensure_export(out, preset("tiny"), seed=0, lock_timeout_s=0.5)
        assert 0.5 <= time.monotonic() - t0 < 10
    assert not out.exists()
