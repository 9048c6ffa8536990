"""Third-party clients against `pdserve serve` (the default config, in a process of its own):
lm-eval's `local-completions` model on local JSONL tasks of both request kinds it sends a
completions server (loglikelihood: echo + logprobs; generate_until: greedy with a stop string),
checked against the reference model; and guidellm's benchmark, checked request by request
against the token counts it was configured with. Both clients are in the `test` extra; a test
skips (saying why) only where its client is not installed."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdserve.api.tokenizer import ByteLevelTokenizer
from pdserve.model.config import preset
from pdserve.model.generate import ReferenceEngine, build_model
from pdserve.model.sampling import SamplingParams
from ports import free_port
from test_api_surface import full_logprobs

ROOT = Path(__file__).resolve().parent.parent
TOK = ByteLevelTokenizer()
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
START_S = 240.0


def _client(module: str):
    return pytest.importorskip(module, reason=f"{module} is not installed (pdserve's `test` "
                                              "extra pins it: pip install -e '.[test]')")


# module-scoped and first in each test's arguments: a missing client skips before the server
@pytest.fixture(scope="module")
def lm_eval():
    return _client("lm_eval")


@pytest.fixture(scope="module")
def guidellm():
    return _client("guidellm")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The base URL of a `pdserve serve` started here with the default config on a free port;
    it is sent SIGTERM at the end (and killed if it does not stop)."""
    port = free_port()
    cfg = tmp_path_factory.mktemp("serve") / "serve.toml"
    text = (ROOT / "cluster/configs/local-tiny.toml").read_text()
    assert "port = 8000" in text
    cfg.write_text(text.replace("port = 8000", f"port = {port}"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "serve", "--config", str(cfg),
                             "--max-seconds", "1200"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_S
        while True:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"pdserve serve did not come up in {START_S} s"
            time.sleep(1)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The tiny preset's byte vocabulary as a Hugging Face tokenizer directory (what both
    clients load to count and encode tokens)."""
    d = tmp_path_factory.mktemp("tokenizer")
    TOK.backend.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 16320}))
    return d


@pytest.fixture(scope="module")
def model():
    return build_model(preset("tiny"), seed=0)  # what the default config serves


def _greedy(model, prompt: str, n: int) -> str:
    seq = ReferenceEngine(model).generate([TOK.encode(prompt)],
                                          SamplingParams(max_tokens=n, ignore_eos=True))[0]
    return TOK.decode(seq.output)


def _task(directory: Path, name: str, rows: list[dict], **spec) -> None:
    """A local lm-eval task: `rows` as a JSONL test split, `spec` as the rest of its YAML."""
    data = directory / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = {"task": name, "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data)}}, "test_split": "test", **spec}
    (directory / f"{name}.yaml").write_text(json.dumps(spec))  # JSON is YAML


def test_lm_eval_loglikelihood_and_generate_until(lm_eval, server, tokenizer_dir, model,
                                                  tmp_path, monkeypatch):
    from lm_eval.tasks import TaskManager

    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    # loglikelihood: one continuation that is the model's greedy next character (is_greedy
    # must then be True) and two that are not
    ctx = next(c for c in (f"pdserve {i}:" for i in range(500))
               if (g := _greedy(model, c, 1)).isascii() and g.isprintable() and not g.isspace())
    ll_rows = [{"context": "Disaggregated prefill", "continuation": " and decode"},
               {"context": "KDA + MLA", "continuation": " hybrid state"},
               {"context": ctx, "continuation": _greedy(model, ctx, 1)}]
    _task(tmp_path, "pdserve_ll", ll_rows, output_type="loglikelihood",
          doc_to_text="{{context}}", doc_to_target="{{continuation}}", target_delimiter="",
          metric_list=[{"metric": "acc"}])
    # generate_until: greedy text up to a stop string taken from the first prompt's output
    prompts, n = ["Hello, ", "The state moves over NIXL"], 12
    outs = [_greedy(model, p, n) for p in prompts]
    stop = next(ch for i, ch in enumerate(outs[0]) if i >= 3 and ch.isascii()
                and ch.isprintable() and ch not in outs[0][:i])
    want = [o.split(stop)[0] for o in outs]
    assert len(want[0]) < len(outs[0])  # the stop string ends the first one early
    _task(tmp_path, "pdserve_gen", [{"prompt": p, "target": w} for p, w in zip(prompts, want)],
          output_type="generate_until", doc_to_text="{{prompt}}", doc_to_target="{{target}}",
          generation_kwargs={"until": [stop], "max_gen_toks": n, "do_sample": False,
                             "temperature": 0},
          metric_list=[{"metric": "exact_match"}])

    res = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"base_url={server}/v1/completions,model=tiny,tokenizer={tokenizer_dir},"
                   "tokenizer_backend=huggingface,num_concurrent=2,max_retries=1,timeout=120",
        tasks=["pdserve_ll", "pdserve_gen"], task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True)

    lls = sorted(res["samples"]["pdserve_ll"], key=lambda s: s["doc_id"])
    assert len(lls) == len(ll_rows)
    for s, row in zip(lls, ll_rows):
        got, greedy = s["filtered_resps"][0]
        ids = TOK.encode(row["context"] + row["continuation"])
        lp = full_logprobs(model, ids)
        start = len(TOK.encode(row["context"]))
        positions = range(start, len(ids))
        assert got == pytest.approx(sum(lp[i - 1, ids[i]].item() for i in positions), abs=1e-3)
        assert greedy == all(int(lp[i - 1].argmax()) == ids[i] for i in positions)
    assert [s["filtered_resps"][0][1] for s in lls] == [False, False, True]
    assert res["results"]["pdserve_ll"]["acc,none"] == pytest.approx(1 / 3)

    gens = sorted(res["samples"]["pdserve_gen"], key=lambda s: s["doc_id"])
    assert [s["filtered_resps"][0] for s in gens] == want
    assert res["results"]["pdserve_gen"]["exact_match,none"] == 1.0


def test_guidellm_runs_every_request_with_the_configured_token_counts(guidellm, server,
                                                                      tokenizer_dir, tmp_path):
    requests, prompt_tokens, output_tokens = 6, 24, 8
    out = tmp_path / "guidellm.json"
    run = subprocess.run(
        [sys.executable, "-m", "guidellm", "run",
         "--backend", f"kind=openai_http,target={server},model=tiny",
         "--profile", "kind=concurrent,streams=2",
         "--constraint", f"kind=max_requests,count={requests}",
         "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},"
                   f"output_tokens={output_tokens}",
         "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
         "--output", f"kind=json,path={out}", "--disable-console-interactive"],
        capture_output=True, text=True, timeout=300, env=os.environ | OFFLINE, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    bench = json.loads(out.read_text())["benchmarks"][0]
    assert bench["metrics"]["request_totals"] == {"successful": requests, "errored": 0,
                                                  "incomplete": 0, "total": requests}
    done = bench["requests"]["successful"]
    assert len(done) == requests
    for r in done:
        body = json.loads(r["request_args"])["body"]
        # guidellm streams chat with usage on every chunk (stream_options.continuous_usage_stats)
        assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
        assert body["max_completion_tokens"] == output_tokens and body["ignore_eos"] is True
        text = "".join(part["text"] for m in body["messages"] for part in m["content"])
        assert len(TOK.encode(text)) == prompt_tokens
        assert r["output_metrics"]["text_tokens"] == output_tokens
        assert r["input_metrics"]["text_tokens"] == len(TOK.chat_prompt(
            [{"role": "user", "content": text}]))
