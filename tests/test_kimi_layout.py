"""A model directory in exactly the layout of Kimi's Hugging Face repositories: `tiktoken.model`
(mergeable ranks, trained here on a small corpus), `tokenizer_config.json` with Kimi's added
special tokens, `chat_template.jinja`, `config.json` with `auto_map` / `dtype` / bos / eos /
`model_max_length`, and the weights as shards named by `model.safetensors.index.json`.

It loads; it tokenizes as `tiktoken` does with the same ranks and Kimi's pattern; its chat
template renders as jinja2 renders it; streamed text never splits a character; and it serves
chat completions through `pdserve serve` to the openai client, stopping at `<|im_end|>` (the
config's EOS) and at `[EOS]` (the tokenizer's). The weights are the seeded tiny model's with a
few LM-head rows swapped, found here with the reference model, so that greedy decoding of two
chats emits chosen text and then those stop tokens."""
from __future__ import annotations

import base64
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import httpx
import jinja2
import pytest
import tiktoken
import torch

from pdserve.api.tokenizer import TextStream, load_tokenizer
from pdserve.model.config import preset
from pdserve.model.generate import ReferenceEngine, build_model
from pdserve.model.sampling import SamplingParams
from pdserve.model.weights import full_state, save_checkpoint
from pdserve.state.layout import StateLayout
from ports import free_port
from test_model_equivalence import full_logits

ROOT = Path(__file__).resolve().parent.parent
START_S = 240.0
# Kimi's pre-tokenization pattern as tokenization_kimi.py states it (the oracle's, not pdserve's)
KIMI_PAT = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
# Kimi's added tokens at their offsets after the ranks (163584 + offset in Kimi's vocabulary)
SPECIALS = {"[BOS]": 0, "[EOS]": 1, "<|im_end|>": 2, "<|im_user|>": 3, "<|im_assistant|>": 4,
            "<|start_header_id|>": 6, "<|end_header_id|>": 7, "[EOT]": 9, "<|im_system|>": 10,
            "<|tool_calls_section_begin|>": 11, "<|tool_calls_section_end|>": 12,
            "<|tool_call_begin|>": 13, "<|tool_call_argument_begin|>": 14, "<|tool_call_end|>": 15,
            "<|im_middle|>": 17, "[UNK]": 254, "[PAD]": 255}
CORPUS = ("The state moves from prefill to decode over NIXL. We'll stream tokens; they're "
          "whole characters. naïve café, Grüße, 世界 你好世界, 🙂 and 🙂 again! 12345 + 678 = "
          "13023\n\n") * 20
MERGES = 100
RESERVED = f"<|reserved_token_{256 + MERGES + 100}|>"  # one of the 256 ids, named by none
# Kimi-style: a default system turn, role names, tool calls and tool results, the reply prompt
TEMPLATE = """\
{%- for message in messages -%}
{%- if loop.first and message['role'] != 'system' -%}
<|im_system|>system<|im_middle|>You are a helpful assistant.<|im_end|>
{%- endif -%}
{%- set role = message.get('name') or message['role'] -%}
{%- if message['role'] == 'user' -%}<|im_user|>{{ role }}<|im_middle|>
{%- elif message['role'] == 'assistant' -%}<|im_assistant|>{{ role }}<|im_middle|>
{%- else -%}<|im_system|>{{ role }}<|im_middle|>
{%- endif -%}
{% if message['role'] == 'assistant' and message.get('tool_calls') %}
{{ message['content'] or '' }}<|tool_calls_section_begin|>
{% for call in message['tool_calls'] %}
<|tool_call_begin|>{{ call['id'] }}<|tool_call_argument_begin|>{{ call['function']['arguments'] }}<|tool_call_end|>
{% endfor %}
<|tool_calls_section_end|>
{% elif message['role'] == 'tool' %}
    ## Return of {{ message['tool_call_id'] }}
{{ message['content'] }}
{% else %}
{{ message['content'] }}
{%- endif -%}
<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}
"""
CHAT_A = [{"role": "user", "content": "Say something nice."}]
CHAT_B = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
TEXT_A = "naïve 世界🙂"  # what the served model says to CHAT_A, then <|im_end|>
LAYOUT = StateLayout(latent_dtype="float32", conv_dtype="float32")


def target_ids(tok) -> list[int]:
    """TEXT_A as the served model is made to say it: 🙂 as its four byte tokens, so that the
    stream has a character split over tokens."""
    return tok.encode("naïve 世界") + list("🙂".encode())


def train_ranks(corpus: str, merges: int) -> dict[bytes, int]:
    """A byte-level BPE: the 256 bytes, then the most frequent adjacent pair, `merges` times."""
    words = Counter(tuple(bytes([b]) for b in w.encode())
                    for w in re.findall(r" ?\w+| ?[^\w\s]+|\s+", corpus))
    ranks = {bytes([b]): b for b in range(256)}
    for _ in range(merges):
        pairs: Counter = Counter()
        for w, n in words.items():
            for pair in zip(w, w[1:]):
                pairs[pair] += n
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        ranks[a + b] = len(ranks)
        merged: Counter = Counter()
        for w, n in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == (a, b):
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] += n
        words = merged
    return ranks


def oracle(ranks: dict[bytes, int]) -> tiktoken.Encoding:
    n = len(ranks)
    named = {n + off: s for s, off in SPECIALS.items()}
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + 256)}
    return tiktoken.Encoding("kimi-oracle", pat_str=KIMI_PAT, mergeable_ranks=ranks,
                             special_tokens=specials)


def jinja2_render(messages, **kw) -> str:
    """The template rendered by plain jinja2 with transformers' settings."""
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True,
                             extensions=["jinja2.ext.loopcontrols"])
    return env.from_string(TEMPLATE).render(messages=messages, bos_token="[BOS]",
                                            eos_token="[EOS]", unk_token="[UNK]",
                                            pad_token="[PAD]", **kw)


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    return ReferenceEngine(model).generate([prompt], SamplingParams(max_tokens=n,
                                                                    ignore_eos=True))[0].output


def _swap(perm: list[int], a: int, b: int) -> None:
    perm[a], perm[b] = perm[b], perm[a]


def _force(model, perm: list[int], prompt: list[int], targets: list[int]) -> None:
    """Swap LM-head rows (in `perm`: new row j is old row perm[j]) so that greedy decoding of
    `prompt` emits `targets`: at each step, the row of the token the model would emit trades
    places with the target's. Earlier steps keep their argmax: neither swapped row was above
    it. One forward over prompt + targets gives every step's logits."""
    logits = full_logits(model, prompt + targets, LAYOUT)[len(prompt) - 1:]
    for i, target in enumerate(targets):
        got = int(logits[i][perm].argmax())
        if got != target:
            assert got not in targets[:i] and target not in targets[:i], (i, got, targets)
            _swap(perm, got, target)


@pytest.fixture(scope="module")
def kimi(tmp_path_factory) -> SimpleNamespace:
    """The directory (`dir`), and the tokens the served model says to CHAT_B before [EOS]
    (`b_own`)."""
    d = tmp_path_factory.mktemp("kimi-layout")
    ranks = train_ranks(CORPUS, MERGES)
    (d / "tiktoken.model").write_text("".join(
        f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    n = len(ranks)
    (d / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": {str(n + off): {"content": s, "lstrip": False, "normalized":
                                                False, "rstrip": False, "single_word": False,
                                                "special": True}
                                 for s, off in SPECIALS.items()},
        "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>",
                                      "<|start_header_id|>", "<|end_header_id|>", "[EOT]",
                                      "<|im_system|>", "<|im_middle|>"],
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "chat_template": "not this one: chat_template.jinja takes precedence",
        "model_max_length": 1048576, "tokenizer_class": "TikTokenTokenizer"}))
    (d / "chat_template.jinja").write_text(TEMPLATE)
    cfg = preset("tiny", vocab_size=n + 256, bos_token_id=n + SPECIALS["[BOS]"],
                 eos_token_id=n + SPECIALS["<|im_end|>"], torch_dtype="bfloat16")
    tensors = {k: v.to(torch.bfloat16) if v.dtype == torch.float32 and v.dim() == 2 else v
               for k, v in full_state(build_model(cfg), seed=0).items()}
    save_checkpoint(d, cfg, tensors, max_shard_bytes=400_000)
    tok = load_tokenizer(str(d), cfg.vocab_size)
    model = build_model(cfg, checkpoint=str(d))  # float32, as local-tiny.toml serves it
    perm = list(range(cfg.vocab_size))
    target_a = target_ids(tok) + [n + SPECIALS["<|im_end|>"]]
    _force(model, perm, tok.chat_prompt(CHAT_A), target_a)
    # CHAT_B: a few tokens of the model's own, then [EOS] where that swap leaves CHAT_A alone
    with torch.no_grad():
        model.lm_head.weight.copy_(model.lm_head.weight[perm].clone())
    own = _greedy(model, tok.chat_prompt(CHAT_B), 8)
    k = next(k for k in range(2, 8) if own[k] not in target_a + own[:k]
             and not set(own[:k + 1]) & set(tok.stop_token_ids))
    _swap(perm, own[k], n + SPECIALS["[EOS]"])
    tensors["lm_head.weight"] = tensors["lm_head.weight"][perm]
    for f in d.glob("model-*.safetensors"):
        f.unlink()
    save_checkpoint(d, cfg, tensors, max_shard_bytes=400_000)
    conf = json.loads((d / "config.json").read_text())
    conf.update(auto_map={"AutoConfig": "configuration_kimi.KimiLinearConfig",
                          "AutoModelForCausalLM": "modeling_kimi.KimiLinearForCausalLM"},
                dtype="bfloat16", model_max_length=1048576)
    (d / "config.json").write_text(json.dumps(conf, indent=2))
    return SimpleNamespace(dir=d, b_own=own[:k])


@pytest.fixture(scope="module")
def kimi_dir(kimi) -> Path:
    return kimi.dir


@pytest.fixture(scope="module")
def tok(kimi_dir):
    return load_tokenizer(str(kimi_dir), json.loads((kimi_dir / "config.json").read_text())
                          ["vocab_size"])


@pytest.fixture(scope="module")
def enc(kimi_dir):
    return oracle(train_ranks(CORPUS, MERGES))


TEXTS = ["The state moves over NIXL.", "We'll stream; THEY'RE whole. I'd say Don't",
         "naïve café Grüße", "你好世界 and 世界🙂🙂", "12345678 + 3.14159", "  leading\n\n\ttabs  \r\n",
         f"a<|im_end|>b [EOS] {RESERVED}", "Ünïcödé ÀÉÎ ǅemal", ""]


def test_the_layout_loads_and_tokenizes_as_tiktoken(kimi_dir, tok, enc):
    assert (kimi_dir / "model.safetensors.index.json").exists()
    assert not (kimi_dir / "tokenizer.json").exists()
    n = enc.n_vocab - 256
    assert type(tok).__name__ == "TiktokenTokenizer" and tok.vocab_size == n + 256
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == enc.encode(text, allowed_special="all"), text
        special = [s for s in ("<|im_end|>", "[EOS]", RESERVED) if s in text]
        assert tok.decode(ids) == functools.reduce(lambda t, s: t.replace(s, ""), special, text)
    assert tok.encode("<|im_end|>") == [n + 2] and tok.encode("[BOS]") == [n]
    # a whitespace run past Kimi's 25,000-character cut tokenizes as its two halves do
    long = "x " + " " * 30_000 + "y"
    assert tok.encode(long) == (enc.encode(long[:25_001], allowed_special="all")
                                + enc.encode(long[25_001:], allowed_special="all"))
    # stop: the tokenizer's eos_token ([EOS]) and the end of a chat turn; the config's EOS is
    # <|im_end|> too, which the engine stops on from config.json
    assert tok.stop_token_ids == [n + 1, n + 2]
    assert tok.token_bytes(n + 2) == b"<|im_end|>" and tok.max_token_chars == len(
        "<|tool_call_argument_begin|>")


def test_the_chat_template_renders_as_jinja2_does(tok, enc):
    chats = [CHAT_A, CHAT_B,
             [{"role": "user", "content": "weather?", "name": "ana"},
              {"role": "assistant", "content": None, "tool_calls": [
                  {"id": "functions.get_weather:0", "type": "function",
                   "function": {"name": "get_weather", "arguments": '{"city": "北京"}'}}]},
              {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "晴 21°C"},
              {"role": "assistant", "content": "Sunny, 21 °C 🙂"},
              {"role": "user", "content": "thanks"}]]
    for messages in chats:
        text = jinja2_render(messages, add_generation_prompt=True)
        assert text.endswith("<|im_assistant|>assistant<|im_middle|>")
        assert tok.chat_prompt(messages) == enc.encode(text, allowed_special="all"), text
    assert "<|im_middle|>    ## Return of functions.get_weather:0\n晴 21°C" in text  # trim_blocks
    assert "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>" in text


def test_streamed_text_never_splits_a_character(tok, enc):
    # 🙂 as a token of its first three bytes and its last byte; 世 as its three bytes
    head = tok.encode("naïve ") + [enc.encode_single_token("🙂".encode()[:3])]
    assert tok.decode(head).endswith("\ufffd")  # what a decode of each prefix would show
    ids = head + [0x82] + list("世".encode()) + tok.encode(" Grüße") + tok.encode("<|im_end|>")
    text = "naïve 🙂世 Grüße"
    assert tok.decode(ids) == text
    stream = TextStream(tok)
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces), pieces
    assert "🙂" in pieces and "世" in pieces  # each on the token that completes it


@pytest.fixture(scope="module")
def server(kimi_dir, tmp_path_factory):
    """`pdserve serve` of the directory (local-tiny.toml's topology) on a free port; SIGTERM at
    the end (killed if it does not stop)."""
    port = free_port()
    cfg = tmp_path_factory.mktemp("serve") / "serve.toml"
    text = (ROOT / "cluster/configs/local-tiny.toml").read_text()
    assert 'name = "tiny"' in text and "port = 8000" in text
    cfg.write_text(text.replace('name = "tiny"', f'name = "{kimi_dir}"')
                   .replace("port = 8000", f"port = {port}"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "serve", "--config", str(cfg),
                             "--max-seconds", "900"], stdout=subprocess.PIPE,
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


def test_serve_chat_stops_at_im_end_and_eos_streaming_whole_characters(server, kimi, tok):
    from openai import OpenAI

    client = OpenAI(base_url=server + "/v1", api_key="none", timeout=120, max_retries=0)
    model = client.models.list().data[0].id
    a = client.chat.completions.create(model=model, messages=CHAT_A, max_tokens=40,
                                       temperature=0)
    assert (a.choices[0].message.content, a.choices[0].finish_reason) == (TEXT_A, "stop")
    chunks = list(client.chat.completions.create(model=model, messages=CHAT_A, max_tokens=40,
                                                 temperature=0, stream=True))
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(pieces) == TEXT_A and all("\ufffd" not in p for p in pieces), pieces
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    # CHAT_B: tokens of the model's own, then [EOS] (the tokenizer's eos_token)
    b = client.chat.completions.create(model=model, messages=CHAT_B, max_tokens=40,
                                       temperature=0)
    assert b.choices[0].finish_reason == "stop"
    assert b.choices[0].message.content == tok.decode(kimi.b_own)
    # without the stop, the same tokens run on to max_tokens
    c = client.chat.completions.create(model=model, messages=CHAT_B, temperature=0,
                                       max_tokens=len(kimi.b_own))
    assert (c.choices[0].message.content, c.choices[0].finish_reason) == (
        tok.decode(kimi.b_own), "length")


def test_serve_refuses_a_bad_directory_before_starting(kimi_dir, tmp_path):
    """A missing shard: `pdserve serve` exits 2 naming it, before Ray or any rank starts."""
    bad = tmp_path / "bad"
    shutil.copytree(kimi_dir, bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"]
    shard = index["model.norm.weight"]
    (bad / shard).unlink()
    cfg = tmp_path / "serve.toml"
    cfg.write_text((ROOT / "cluster/configs/local-tiny.toml").read_text()
                   .replace('name = "tiny"', f'name = "{bad}"'))
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "serve", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert f"model.name: {bad}/model.safetensors.index.json names shard {shard}, which is " \
           "missing" in r.stderr
    assert "Ray" not in r.stdout + r.stderr.replace("pdserve serve: error", "")
