"""The API's tokenizers and streamed text: one byte-level tokenizer, and `TextStream` over
`tokenizers.decoders.DecodeStream` for it and for a Hugging Face byte-level BPE, where multi-byte
UTF-8 characters split across tokens stream whole and the pieces add up to the full decode; chat
template sources and stop tokens; tool calls, tool results and `tools` through a real jinja
template and the simple one, for each tokenizer kind. Kimi's tiktoken layout:
tests/test_kimi_layout.py."""
from __future__ import annotations

import base64
import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pdserve.api.chat_template import simple_chat_template
from pdserve.api.tokenizer import ByteLevelTokenizer, TextStream, load_tokenizer

TEXT = "héllo 世界 🙂"
REPLACEMENT = "\ufffd"


def stream(tok, ids: list[int], stops=()) -> list[str]:
    """Every delta TextStream returns for `ids`, the flush last."""
    text = TextStream(tok, stops)
    return [text.push(i) for i in ids] + [text.flush()]


def assert_whole_characters(pieces: list[str], full: str) -> None:
    assert "".join(pieces) == full
    for piece in pieces:
        assert REPLACEMENT not in piece, pieces  # no character emitted before it is complete


def test_byte_tokenizer_is_the_utf8_bytes():
    tok = ByteLevelTokenizer()
    ids = tok.encode(TEXT)
    assert ids == list(TEXT.encode("utf-8")) and tok.vocab_size == 256
    assert tok.backend.encode(TEXT).ids == ids  # the tokenizers pipeline is the same vocabulary
    assert tok.decode(ids) == TEXT
    with pytest.raises(ValueError, match=r"token ids \[256\] are not bytes"):
        tok.decode([104, 256])


def test_byte_decode_replaces_invalid_bytes_as_python_does():
    tok, rng = ByteLevelTokenizer(), random.Random(0)
    tricky = [0x80, 0x82, 0x9F, 0xAC, 0xC0, 0xC2, 0xE2, 0xED, 0xA0, 0xF0, 0xF4, 0xFF]
    for _ in range(2000):
        raw = bytes(rng.choice([rng.randrange(256), rng.choice(tricky)])
                    for _ in range(rng.randint(0, 12)))
        assert tok.decode(list(raw)) == raw.decode("utf-8", errors="replace"), raw


def test_byte_tokenizer_streams_multibyte_characters_whole():
    tok = ByteLevelTokenizer()
    pieces = stream(tok, tok.encode(TEXT))
    assert_whole_characters(pieces, TEXT)
    # one piece per character, on the token that completes it; nothing before
    assert [p for p in pieces if p] == list(TEXT)
    assert pieces[:3] == ["h", "", "é"]  # é is 2 bytes
    assert pieces[-5:] == ["", "", "", "🙂", ""]  # 🙂 is 4 bytes


def test_byte_stream_of_invalid_bytes_ends_as_the_full_decode():
    tok, rng = ByteLevelTokenizer(), random.Random(1)
    for _ in range(300):
        ids = [rng.choice([rng.randrange(256), 0xE2, 0x82, 0xF0, 0x9F])
               for _ in range(rng.randint(1, 20))]
        pieces = stream(tok, ids)
        assert "".join(pieces) == tok.decode(ids), ids
        # a replacement character is only ever emitted with the valid text after it, or last
        assert all(not p.endswith(REPLACEMENT) for p in pieces[:-1]), (ids, pieces)


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    """A small byte-level BPE trained here: few merges, so some tokens hold part of a
    multi-byte character (🙂 is four one-byte tokens, "naï" ends in half of ï)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["héllo wörld", "hello world 世界", "世界 and 🙂 and ü", "naïve café"] * 50
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=280, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<s>", "</s>"], show_progress=False))
    d = tmp_path_factory.mktemp("bpe")
    tok.save(str(d / "tokenizer.json"))
    return d


def test_hf_byte_level_bpe_streams_split_characters_whole(bpe_dir):
    tok = load_tokenizer(str(bpe_dir), vocab_size=300)
    text = TEXT + " naïve"
    ids = tok.encode(text)
    alone = [tok.backend.decode([i]) for i in ids]
    assert any(REPLACEMENT in a for a in alone), "no token splits a character: test is vacuous"
    pieces = stream(tok, ids)
    assert_whole_characters(pieces, tok.decode(ids))
    assert "".join(pieces) == text
    assert "🙂" in pieces  # its four byte tokens stream as one piece


def test_hf_stream_skips_special_and_unknown_ids(bpe_dir):
    tok = load_tokenizer(str(bpe_dir), vocab_size=300)
    eos = tok.backend.token_to_id("</s>")
    ids = tok.encode("héllo") + [eos] + [290] + tok.encode(" 世界")  # 290: padding, no token
    pieces = stream(tok, ids)
    assert_whole_characters(pieces, tok.decode(ids))
    assert "".join(pieces) == "héllo 世界"


def test_stop_strings_cut_split_characters_cleanly():
    tok = ByteLevelTokenizer()
    pieces = stream(tok, tok.encode("a世b🙂c"), stops=["🙂"])
    assert_whole_characters(pieces, "a世b")


def _tok_dir(tmp_path, config: dict, template_file: str | None = None):
    from tokenizers import models

    vocab = {"[UNK]": 0, "<|im_end|>": 1, "hi": 2, "[": 3, "]": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|im_end|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if template_file is not None:
        (tmp_path / "chat_template.jinja").write_text(template_file)
    return load_tokenizer(str(tmp_path), vocab_size=8)


def test_chat_template_sources_and_transformers_extras(tmp_path):
    from pdserve.api.chat_template import load_chat_template

    # named templates: "default" is used; chat_template.jinja takes precedence over the config
    named = [{"name": "tool_use", "template": "no"}, {"name": "default", "template": "hi"}]
    assert _tok_dir(tmp_path, {"chat_template": named}).chat_prompt([]) == [2]
    assert _tok_dir(tmp_path, {"chat_template": "no"}, "{{ 'hi' }}").chat_prompt([]) == [2]
    # transformers' tojson takes json.dumps' arguments and keeps non-ASCII; loopcontrols work
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{{ m | tojson(separators=(',', ':')) }}{% endfor %}{{ bos_token }}")
    t = load_chat_template(tmp_path, {"bos_token": {"content": "<s>"}})
    assert t.render([{"role": "user", "content": "é<"}, {"role": "x"}]) == \
        '{"role":"user","content":"é<"}<s>'
    (tmp_path / "chat_template.jinja").write_text("{% generation %}x{% endgeneration %}")
    with pytest.raises(ValueError, match="chat_template.jinja: the chat template does not "
                                         "compile.*generation"):
        load_chat_template(tmp_path, {})


def test_stop_tokens_include_the_end_of_a_chat_turn(tmp_path):
    # no eos_token, no generation_config: <|im_end|> (Kimi's and ChatML's end of turn) still
    assert _tok_dir(tmp_path, {}).stop_token_ids == [1]


# -- tools: tool calls and results in the history, `tools` in the prompt ----------------------
# A small template that uses all of it, as tool-use templates do: the tool schemas through
# `tools`, an assistant's `tool_calls`, a tool result's `tool_call_id`.
TOOL_TEMPLATE = """\
{% if tools %}
<tools>
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}
</tools>
{% endif %}
{% for m in messages %}
{% if m.role == 'tool' %}
<result of="{{ m.tool_call_id }}">{{ m.content }}</result>
{% else %}
<{{ m.role }}>{{ m.content }}{% for call in m.tool_calls or [] %}<call id="{{ call.id }}">\
{{ call.function.name }}({{ call.function.arguments }})</call>{% endfor %}</{{ m.role }}>
{% endif %}
{% endfor %}
{% if add_generation_prompt %}<assistant>{% endif %}"""
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
# a conversation as the server hands it to the template (a calls-only turn's content is "")
TOOL_MESSAGES = [{"role": "user", "content": "Weather in Paris?"},
                 {"role": "assistant", "content": "", "tool_calls": [CALL]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "21°C, sunny"}]
SCHEMA_LINE = ('{"type": "function", "function": {"name": "get_weather", "description": '
               '"Current weather in a city", "parameters": {"type": "object", "properties": '
               '{"city": {"type": "string"}}, "required": ["city"]}}}')
TOOL_PROMPT = ("<tools>\n" + SCHEMA_LINE + "\n</tools>\n"
               "<user>Weather in Paris?</user>\n"
               '<assistant><call id="call_1">get_weather({"city": "Paris"})</call></assistant>\n'
               '<result of="call_1">21°C, sunny</result>\n'
               "<assistant>")
SIMPLE_TOOL_PROMPT = ("<|tools|>\n" + SCHEMA_LINE + "\n"
                      "<|user|>\nWeather in Paris?\n"
                      '<|assistant|>\n{"tool_calls": [{"id": "call_1", "type": "function", '
                      '"function": {"name": "get_weather", "arguments": "{\\"city\\": '
                      '\\"Paris\\"}"}}]}\n'
                      "<|tool|>\n21°C, sunny\n"
                      "<|assistant|>\n")


def byte_model_dir(path, kind: str, template: str | None):
    """A model directory whose tokenizer is one token per byte, as `tokenizer.json` (kind "hf",
    256 ids) or Kimi's `tiktoken.model` ("tiktoken": 256 ranks and 256 reserved specials), with
    `template` as its chat_template.jinja; returns (directory, vocab_size)."""
    if kind == "hf":
        ByteLevelTokenizer().backend.save(str(path / "tokenizer.json"))
    else:
        (path / "tiktoken.model").write_text("".join(
            f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)))
    (path / "tokenizer_config.json").write_text("{}")
    if template is not None:
        (path / "chat_template.jinja").write_text(template)
    return path, 256 if kind == "hf" else 512


@pytest.mark.parametrize("kind", ["hf", "tiktoken"])
def test_chat_prompt_renders_tools_and_tool_messages(tmp_path, kind):
    directory, vocab_size = byte_model_dir(tmp_path, kind, TOOL_TEMPLATE)
    tok = load_tokenizer(str(directory), vocab_size)
    assert tok.decode(tok.chat_prompt(TOOL_MESSAGES, [WEATHER])) == TOOL_PROMPT
    # without tools the template's tools block is left out
    assert tok.decode(tok.chat_prompt(TOOL_MESSAGES)) == TOOL_PROMPT.split("</tools>\n")[1]


@pytest.mark.parametrize("kind", ["hf", "tiktoken"])
def test_simple_template_renders_tools_and_tool_messages(tmp_path, kind):
    directory, vocab_size = byte_model_dir(tmp_path, kind, None)
    tok = load_tokenizer(str(directory), vocab_size)
    assert tok.decode(tok.chat_prompt(TOOL_MESSAGES, [WEATHER])) == SIMPLE_TOOL_PROMPT
    assert ByteLevelTokenizer().chat_prompt(TOOL_MESSAGES, [WEATHER]) == \
        list(SIMPLE_TOOL_PROMPT.encode())


def test_simple_template_puts_tool_calls_after_the_content():
    said = [{"role": "assistant", "content": "Checking.", "tool_calls": [CALL]}]
    assert simple_chat_template(said) == (
        '<|assistant|>\nChecking.\n{"tool_calls": [{"id": "call_1", "type": "function", '
        '"function": {"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}}]}\n'
        "<|assistant|>\n")
    # no tools, no calls: the template as it always was
    assert simple_chat_template([{"role": "user", "content": "hé"}], []) == \
        "<|user|>\nhé\n<|assistant|>\n"
