"""Crafted and malformed HTTP input against a real uvicorn server and the monolithic
`LocalBackend` (tiny preset): bytes that are not UTF-8, deep nesting, oversized, truncated and
slow bodies, unknown paths and methods, out-of-range sampling values, malformed tool calls and
tool results. Each is a typed 4xx in OpenAI's error shape, never a 500 or a logged traceback,
and requests in flight elsewhere run on undisturbed. Raw sockets send what no HTTP client would.
A history with tool calls is served, rendered by the simple template and by a jinja one."""
from __future__ import annotations

import copy
import inspect
import json
import logging
import socket
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace
from urllib.parse import urlsplit

import httpx
import openai
import pytest

from pdserve.api.backend import LocalBackend
from pdserve.api.server import create_app
from pdserve.api.serving import serve_in_thread
from pdserve.api.tokenizer import ByteLevelTokenizer
from pdserve.cluster.config import ApiSection
from pdserve.model.config import preset
from pdserve.api.tokenizer import load_tokenizer
from pdserve.model.generate import ReferenceEngine, build_model
from test_tokenizer import (CALL, SIMPLE_TOOL_PROMPT, TOOL_PROMPT, TOOL_TEMPLATE, WEATHER,
                            byte_model_dir)

MODEL = "tiny"
TOK = ByteLevelTokenizer()
WAIT_S = 10.0       # bound on every wait in this file (a hang guard, not a timing threshold)
MAX_BODY = 1 << 20  # the test servers' api.max_body_bytes
SMALL_BODY = 16 << 10
BODY_TIMEOUT_S = 1.0


@contextmanager
def serve(tokenizer=TOK, **app_kwargs):
    engine = ReferenceEngine(build_model(preset(MODEL)))
    backend = LocalBackend(engine, max_batch=8, max_queue=64, model_name=MODEL)
    with serve_in_thread(create_app(backend, tokenizer, **app_kwargs), startup_s=WAIT_S,
                         shutdown_s=WAIT_S) as url:
        yield SimpleNamespace(url=url, engine=engine, backend=backend)


@pytest.fixture(scope="module")
def main():
    with serve(max_body_bytes=MAX_BODY, body_timeout_s=BODY_TIMEOUT_S) as srv:
        yield srv


@pytest.fixture(autouse=True)
def no_error_logged(caplog):
    """A refused input is the client's error: nothing at ERROR (a traceback) in the server."""
    caplog.set_level(logging.WARNING)
    yield
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


def assert_idle(srv) -> None:
    deadline = time.monotonic() + WAIT_S
    while not (srv.backend.stats()["running"] == 0 and srv.backend.stats()["queued"] == 0
               and srv.engine.pools.empty):
        assert time.monotonic() < deadline, "requests still hold state"
        time.sleep(0.01)


def assert_error(r: httpx.Response, status: int, words: str, param: str | None = None,
                 type_: str = "invalid_request_error") -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert words in error["message"], error
    assert (error["type"], error["param"], error["code"]) == (type_, param, status), error
    return error


def post(url: str, endpoint: str, raw: bytes) -> httpx.Response:
    return httpx.post(f"{url}/v1/{endpoint}", content=raw, timeout=WAIT_S,
                      headers={"Content-Type": "application/json"})


# -- raw HTTP ------------------------------------------------------------------------------------
def connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=WAIT_S)
    sock.settimeout(WAIT_S)  # every recv below fails rather than hangs
    return sock


def head(path: str, **headers) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: test", "Content-Type: application/json",
             *(f"{k.replace('_', '-')}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_response(sock: socket.socket) -> httpx.Response:
    """Everything up to the server's close (it closes after these errors), parsed."""
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:  # a byte sent after the server closed draws a reset; the
            if not data:              # answer came before it
                raise
            break
        if not chunk:
            break
        data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    header_block, _, body = rest.partition(b"\r\n\r\n")
    headers = dict(line.decode().split(": ", 1) for line in header_block.split(b"\r\n"))
    return httpx.Response(int(status_line.split()[1]), headers=headers, content=body)


# -- bodies the parser must refuse ---------------------------------------------------------------
CHAT = b'{"model": "tiny", "messages": [{"role": "user", "content": %s}]}'
COMPLETION = b'{"model": "tiny", "prompt": %s}'
DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize("endpoint,raw", [
    ("completions", COMPLETION % b'"caf\xe9 \xff\xfe"'),
    ("chat/completions", CHAT % b'"\xc3\x28"'),
    ("chat/completions", CHAT % b'[{"type": "text", "text": "\xed\xa0\x80"}]'),  # a surrogate
], ids=["latin-1 prompt", "bad continuation", "encoded surrogate"])
def test_invalid_utf8_is_400(main, endpoint, raw):
    assert_error(post(main.url, endpoint, raw), 400, "not valid UTF-8")


@pytest.mark.parametrize("endpoint,raw", [
    ("completions", COMPLETION % DEEP),
    ("chat/completions", CHAT % DEEP),
    ("chat/completions", CHAT % (b'[{"type": "text", "text": "x", "extra": %s}]' % DEEP)),
    ("completions", COMPLETION % (b'{"a": ' * 100_000 + b"1" + b"}" * 100_000)),
], ids=["prompt", "content", "content part", "objects"])
def test_deep_nesting_is_400(main, endpoint, raw):
    assert_error(post(main.url, endpoint, raw), 400, "nested too deeply")


def test_text_part_without_a_string_is_400(main):
    r = post(main.url, "chat/completions", CHAT % b'[{"type": "text", "text": 5}]')
    assert_error(r, 400, "messages[0].content[0].text must be a string",
                 param="messages[0].content[0].text")


def test_refused_bodies_leave_the_server_serving(main):
    for raw in (COMPLETION % DEEP, COMPLETION % b'"\xff"', b"", b"null", b"\x00" * 64):
        assert post(main.url, "completions", raw).status_code == 400
    oai = openai.OpenAI(base_url=main.url + "/v1", api_key="unused", max_retries=0)
    out = oai.completions.create(model=MODEL, prompt="still here", max_tokens=3)
    assert out.usage.completion_tokens == 3
    assert_idle(main)


# -- body size and read deadline ----------------------------------------------------------------
def test_body_limit_defaults_match_the_config():
    params = inspect.signature(create_app).parameters
    api = ApiSection()
    assert params["max_body_bytes"].default == api.max_body_bytes == 4 << 20
    assert params["body_timeout_s"].default == api.body_timeout_s


def test_oversized_content_length_is_413_before_the_body_is_sent(main):
    with connect(main.url) as sock:
        sock.sendall(head("/v1/completions", Content_Length=50 << 20))  # no body byte follows
        r = read_response(sock)
    assert_error(r, 413, f"request body of {50 << 20} bytes is larger than this server's "
                         f"limit of {MAX_BODY} bytes")
    assert r.headers["connection"] == "close"


def test_oversized_chunked_body_is_413():
    # Without a Content-Length the limit applies to the bytes read: one past it is refused.
    with serve(max_body_bytes=SMALL_BODY) as srv, connect(srv.url) as sock:
        payload = b"x" * (SMALL_BODY + 1)
        sock.sendall(head("/v1/completions", Transfer_Encoding="chunked")
                     + b"%x\r\n%s\r\n0\r\n\r\n" % (len(payload), payload))
        assert_error(read_response(sock), 413,
                     f"request body is larger than this server's limit of {SMALL_BODY} bytes")
        at_limit = COMPLETION % json.dumps("y" * (SMALL_BODY - len(COMPLETION))).encode()
        assert len(at_limit) <= SMALL_BODY
        r = post(srv.url, "completions", at_limit)  # a body within the limit is parsed as usual
        assert_error(r, 400, "prompt has", param="prompt")
        assert_idle(srv)


def test_openai_client_sees_413_for_a_prompt_over_the_limit():
    with serve(max_body_bytes=SMALL_BODY) as srv:
        oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0,
                            timeout=WAIT_S)
        with pytest.raises(openai.APIStatusError) as err:
            oai.completions.create(model=MODEL, prompt="z" * (2 * SMALL_BODY), max_tokens=2)
        assert err.value.status_code == 413
        assert "larger than this server's limit" in err.value.message


def test_short_body_is_408_and_disturbs_nothing(main):
    """A body shorter than its Content-Length: the server gives up after body_timeout_s while a
    stream started before runs on and finishes."""
    oai = openai.OpenAI(base_url=main.url + "/v1", api_key="unused", max_retries=0,
                        timeout=WAIT_S)
    stream = oai.completions.create(model=MODEL, prompt="in flight", max_tokens=200,
                                    temperature=0, stream=True, extra_body={"ignore_eos": True})
    events = iter(stream)
    text = [next(events).choices[0].text]
    with connect(main.url) as sock:
        sock.sendall(head("/v1/completions", Content_Length=100) + b'{"model": "tiny"')
        r = read_response(sock)  # the socket's timeout is the hang guard
    assert_error(r, 408, f"did not arrive within {BODY_TIMEOUT_S:g} s (16 bytes received of "
                         f"the 100 its Content-Length announces)", type_="timeout")
    chunks = list(events)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert sum(len(c.choices[0].text.encode()) for c in chunks) + len(text[0].encode()) > 0
    assert_idle(main)


def test_trickled_body_is_408(main):
    """A body that keeps arriving, a byte at a time, still ends at the deadline."""
    body = COMPLETION % b'"slow"'
    with connect(main.url) as sock:
        sock.sendall(head("/v1/completions", Content_Length=len(body)))
        stop = threading.Event()

        def trickle():
            for byte in body:
                if stop.wait(0.2):
                    return
                try:
                    sock.send(bytes([byte]))
                except OSError:  # the server answered and closed
                    return
        sender = threading.Thread(target=trickle, daemon=True)
        sender.start()
        try:
            r = read_response(sock)
        finally:
            stop.set()
            sender.join(WAIT_S)
    assert_error(r, 408, "did not arrive within", type_="timeout")


# -- paths and methods --------------------------------------------------------------------------
def test_unknown_path_is_404_in_openai_shape(main):
    r = httpx.get(main.url + "/v1/nothing", timeout=WAIT_S)
    assert_error(r, 404, "no such endpoint: GET /v1/nothing")
    oai = openai.OpenAI(base_url=main.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="no such endpoint: POST /v1/embeddings"):
        oai.embeddings.create(model=MODEL, input="x")


@pytest.mark.parametrize("method,path,allow", [
    ("GET", "/v1/completions", "POST"), ("DELETE", "/v1/chat/completions", "POST"),
    ("POST", "/health", "GET"), ("PUT", "/v1/models", "GET")])
def test_wrong_method_is_405_in_openai_shape(main, method, path, allow):
    r = httpx.request(method, main.url + path, timeout=WAIT_S)
    assert_error(r, 405, f"method {method} is not allowed on {path}; use {allow}")
    assert r.headers["allow"] == allow


# -- sampling ranges ------------------------------------------------------------------------------
@pytest.mark.parametrize("params,field,words", [
    ({"temperature": 1e9}, "temperature", "temperature must be in 0..2, got 1000000000.0"),
    ({"temperature": 2.5}, "temperature", "temperature must be in 0..2"),
    ({"temperature": -0.1}, "temperature", "temperature must be in 0..2"),
    ({"top_p": 1.5}, "top_p", "top_p must be in (0, 1], got 1.5"),
    ({"top_p": 0.0}, "top_p", "top_p must be in (0, 1]"),
    ({"top_p": -1.0}, "top_p", "top_p must be in (0, 1]"),
    ({"max_tokens": -1}, "max_tokens", "max_tokens must be >= 1, got -1"),
    ({"seed": 2**64}, "seed", "seed must be a signed 64-bit integer"),
    ({"seed": -2**63 - 1}, "seed", "seed must be a signed 64-bit integer"),
    ({"presence_penalty": 2.5}, "presence_penalty", "presence_penalty must be in -2..2, got 2.5"),
    ({"frequency_penalty": -2.1}, "frequency_penalty", "frequency_penalty must be in -2..2"),
    ({"n": 0}, "n", "n must be in 1..64, got 0"),
], ids=lambda v: json.dumps(v) if isinstance(v, dict) else None)
def test_out_of_range_sampling_is_400_naming_the_field(main, params, field, words):
    oai = openai.OpenAI(base_url=main.url + "/v1", api_key="unused", max_retries=0)
    for call in (lambda: oai.completions.create(model=MODEL, prompt="x", **params),
                 lambda: oai.chat.completions.create(
                     model=MODEL, messages=[{"role": "user", "content": "x"}], **params)):
        with pytest.raises(openai.BadRequestError) as err:
            call()
        assert words in err.value.message
        assert err.value.body["param"] == field and err.value.body["code"] == 400


@pytest.mark.parametrize("top_k,words", [
    (10**9, f"top_k must be >= 0 (0 = off) and at most the vocabulary size {TOK.vocab_size}, "
            "got 1000000000"),
    (TOK.vocab_size + 1, "at most the vocabulary size"),
    (-1, "top_k must be >= 0"),
])
def test_top_k_outside_the_vocabulary_is_400(main, top_k, words):
    r = httpx.post(main.url + "/v1/completions", timeout=WAIT_S,
                   json={"model": MODEL, "prompt": "x", "top_k": top_k})
    assert_error(r, 400, words, param="top_k")


def test_sampling_bounds_themselves_are_accepted(main):
    oai = openai.OpenAI(base_url=main.url + "/v1", api_key="unused", max_retries=0)
    for params, extra in [({"temperature": 2.0, "top_p": 1.0, "seed": 2**63 - 1},
                           {"top_k": TOK.vocab_size}),
                          ({"temperature": 0.0, "seed": -2**63}, {"top_k": 0}),
                          ({"top_p": 1e-9, "seed": 0}, {"top_k": 1})]:
        out = oai.completions.create(model=MODEL, prompt="edge", max_tokens=2, **params,
                                     extra_body=extra)
        assert out.usage.completion_tokens == 2
    assert_idle(main)


# -- tools: a history with tool calls and results, tools described with tool_choice "none" -------
# What an agent sends after running a tool: the call the model made and the tool's result.
HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [CALL]},
           {"role": "tool", "tool_call_id": "call_1", "content": "21°C, sunny"}]


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0,
                         timeout=WAIT_S)


def prompts_sent(srv, monkeypatch) -> list[list[int]]:
    """Collects the prompt token ids of every request the server hands its (real) backend."""
    sent, generate = [], srv.backend.generate

    def spy(request, deadline_s):
        sent.append(request.prompt)
        return generate(request, deadline_s)
    monkeypatch.setattr(srv.backend, "generate", spy)
    return sent


def test_tool_history_with_the_simple_template_is_served(main, monkeypatch):
    sent = prompts_sent(main, monkeypatch)
    out = client(main).chat.completions.create(
        model=MODEL, messages=HISTORY, tools=[WEATHER], tool_choice="none",
        parallel_tool_calls=False, max_tokens=3)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 3
    assert out.choices[0].message.tool_calls is None  # never parsed out of the output
    assert [TOK.decode(p) for p in sent] == [SIMPLE_TOOL_PROMPT]
    assert out.usage.prompt_tokens == len(SIMPLE_TOOL_PROMPT.encode())
    assert_idle(main)


def test_tool_history_with_a_jinja_template_is_served(tmp_path, monkeypatch):
    directory, vocab_size = byte_model_dir(tmp_path, "hf", TOOL_TEMPLATE)
    tok = load_tokenizer(str(directory), vocab_size)
    with serve(tok) as srv:
        sent = prompts_sent(srv, monkeypatch)
        out = client(srv).chat.completions.create(
            model=MODEL, messages=HISTORY, tools=[WEATHER], tool_choice="none", max_tokens=2)
        assert out.usage.completion_tokens == 2
        # the tool's result and schema reach the model as the template writes them
        assert [tok.decode(p) for p in sent] == [TOOL_PROMPT]
        assert_idle(srv)


def _edit(body: dict, path: str, value) -> None:
    """Sets `value` at the dotted `path` of `body` ("messages.1.tool_calls"); `...` removes
    the key."""
    *parents, last = [int(k) if k.isdigit() else k for k in path.split(".")]
    node = body
    for key in parents:
        node = node[key]
    if value is ...:
        del node[last]
    else:
        node[last] = value


MALFORMED = [
    ("messages.1.tool_calls.0.function.name", 5, "messages[1].tool_calls[0].function.name",
     "Expected `str`, got `int`"),
    ("messages.1.tool_calls.0.function.arguments", {"city": "Paris"},
     "messages[1].tool_calls[0].function.arguments", "Expected `str`, got `object`"),
    ("messages.1.tool_calls.0.function.arguments", ...,
     "messages[1].tool_calls[0].function.arguments", "is required"),
    ("messages.1.tool_calls.0.function", "get_weather", "messages[1].tool_calls[0].function",
     "Expected `object`, got `str`"),
    ("messages.1.tool_calls.0.id", ..., "messages[1].tool_calls[0].id", "is required"),
    ("messages.1.tool_calls.0.type", "fn", "messages[1].tool_calls[0].type",
     "Invalid enum value 'fn'"),
    ("messages.1.tool_calls.0.index", 0, "messages[1].tool_calls[0].index", "unknown"),
    ("messages.1.tool_calls", "get_weather", "messages[1].tool_calls",
     "Expected `array | null`, got `str`"),
    ("messages.0.tool_calls", [CALL], "messages[0].tool_calls",
     "only allowed in assistant messages"),
    ("messages.2.tool_call_id", ..., "messages[2].tool_call_id",
     "required in a tool message"),
    ("messages.2.tool_call_id", 1, "messages[2].tool_call_id", "Expected `str | null`"),
    ("messages.0.tool_call_id", "call_1", "messages[0].tool_call_id",
     "only allowed in tool messages"),
    ("messages.2.content", None, "messages[2].content", "messages[2].content is required"),
    ("messages.2.role", "function", "messages[2].role",
     "role 'function' (OpenAI's deprecated function calling) is not supported"),
    ("messages.1.function_call", {"name": "get_weather", "arguments": "{}"},
     "messages[1].function_call", "deprecated function calling) is not supported"),
    ("tools.0.function.name", ..., "tools[0].function.name", "is required"),
    ("tools.0.type", "retrieval", "tools[0].type", "Invalid enum value 'retrieval'"),
    ("tools.0.function.parameters", "object", "tools[0].function.parameters",
     "Expected `object | null`, got `str`"),
    ("tools.0.function.examples", [], "tools[0].function.examples", "unknown"),
]


@pytest.mark.parametrize("path,value,param,words", MALFORMED,
                         ids=[f"{p}={v!r}" for p, v, _, _ in MALFORMED])
def test_malformed_tool_fields_are_400_naming_the_field(main, path, value, param, words):
    body = {"messages": copy.deepcopy(HISTORY), "tools": [copy.deepcopy(WEATHER)]}
    _edit(body, path, value)
    with pytest.raises(openai.BadRequestError) as err:
        client(main).chat.completions.create(model=MODEL, tool_choice="none", max_tokens=2,
                                             **body)
    error = err.value.body
    assert error["message"].startswith(param) and words in error["message"], error
    assert (error["param"], error["code"]) == (param, 400), error


@pytest.mark.parametrize("choice", [
    {}, {"tool_choice": "auto"}, {"tool_choice": "required"},
    {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}],
    ids=["absent", "auto", "required", "named"])
def test_tool_choice_other_than_none_is_400(main, choice):
    with pytest.raises(openai.BadRequestError) as err:
        client(main).chat.completions.create(model=MODEL, messages=HISTORY, tools=[WEATHER],
                                             max_tokens=2, **choice)
    assert err.value.body["param"] == "tool_choice"
    assert "this server does not parse tool calls out of the model's output; send " \
           "tool_choice 'none'" in err.value.message
    got = repr(choice["tool_choice"]) if choice else "absent with tools, which means 'auto'"
    assert got in err.value.message
