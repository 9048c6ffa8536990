"""OpenAI-compatible HTTP API (FastAPI) over a `GenerationBackend`.

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (JSON, or SSE with `stream`),
`GET /v1/models`, `GET /health`, `GET /metrics`. Bodies are validated with msgspec Structs; every
bad input is a 400 whose OpenAI-style error names the field. Overload is a 429 and an unavailable
backend a 503, both with Retry-After; a request the backend refuses as bad is its `BadRequest`'s
status (400), one past its deadline a 504: decided on the exception's type, never its text. A
request whose client disconnects is cancelled at once, and every request ends by its deadline
(`request_timeout_s`), which the backend also receives.

Bodies are bounded before they are parsed: one larger than `max_body_bytes` is a 413 (refused
on its Content-Length, or as soon as the bytes read pass the limit), one not received within
`body_timeout_s` a 408 (a slow or truncated upload never holds a handler); bytes that are not
UTF-8 and JSON nested past the parser's depth limit are 400s. Unknown paths (404) and methods
(405) answer in the same error shape as everything else.

Sampling follows OpenAI: `temperature` defaults to 1.0 (send 0 for greedy) and lies in 0..2,
`top_p` defaults to 1.0 and lies in (0, 1]; `seed` (a signed 64-bit integer) makes sampling
reproducible; `presence_penalty` and `frequency_penalty` (-2..2). `n` samples per prompt and a
list of prompts run as one backend request per choice (choice i*n + j: prompt i, sample j, whose
seed is derived from `seed` and j). `logprobs` (completions: 0..20 alternatives; chat: `logprobs`
+ `top_logprobs`), `echo` with the prompt's logprobs, `stream_options` (`include_usage`,
`continuous_usage_stats`) and `response_format` {"type": "text"}; `user`, `metadata`, `store`,
`service_tier` are accepted and change nothing. Tools as vLLM serves them without a tool-call
parser: a history with tool calls (assistant `tool_calls`, their content then optional) and
tool results (role "tool" with `tool_call_id`) goes to the chat template as transformers passes
it, and `tools` are rendered through the template's `tools` variable with `tool_choice` "none";
any other `tool_choice` (or none with tools, which means "auto") is a 400, since the output is
never parsed for tool calls. `parallel_tool_calls` is accepted and changes nothing. OpenAI
fields not implemented (deprecated function calling, JSON modes, `logit_bias`, `suffix`, ...)
are a 400 that names them. A chat without `max_tokens` runs to EOS or the end of the context;
a completion stops after `default_max_tokens` (16, OpenAI's). A text prompt longer than the
context could hold in any tokenization (`Tokenizer.max_token_chars` characters per token) is
refused before it is tokenized. Extensions, spelled as in vLLM: `top_k` (0..vocabulary size,
0 = off), `ignore_eos`, and `return_token_ids` (each choice or chunk then carries the output
`token_ids`).
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
import uuid
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Literal

import msgspec
from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request as HttpRequest
from starlette.responses import Response, StreamingResponse

from pdserve.api.backend import (BackendUnavailable, BadRequest, DeadlineExceeded,
                                 GenerationBackend, Overloaded, TokenEvent)
from pdserve.api.chat_template import Message
from pdserve.api.logprobs import LogprobWriter, merge
from pdserve.api.metrics import ApiMetrics
from pdserve.api.tokenizer import TextStream, Tokenizer
from pdserve.model.sampling import MAX_LOGPROBS, Request, SamplingParams

log = logging.getLogger("pdserve.api")

_ERROR_TYPES = {408: "timeout", 429: "rate_limit_error", 503: "service_unavailable",
                504: "timeout"}  # other 4xx: invalid_request_error, 5xx: server_error
MAX_BODY_BYTES = 4 * 1024 * 1024  # api.max_body_bytes: room for the largest shipped context
                                  # (262K tokens) as a JSON list of token ids
BODY_TIMEOUT_S = 10.0             # api.body_timeout_s
MAX_TEMPERATURE = 2.0             # OpenAI's documented range is 0..2
_INT64 = (-2**63, 2**63 - 1)      # what every engine's seed (a torch generator's) accepts


def _error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


class ApiError(Exception):
    """An error answered as OpenAI does: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 retry_after: float | None = None, close: bool = False):
        super().__init__(message)
        self.status, self.param, self.retry_after = status, param, retry_after
        self.close = close

    def response(self) -> Response:
        headers = {}
        if self.close:  # the body was not read to its end: the connection cannot carry another
            headers["Connection"] = "close"  # request, and closing it stops the upload
        if self.retry_after is not None:  # HTTP wants whole seconds
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
        return _json({"error": {"message": str(self), "type": _error_type(self.status),
                                "param": self.param, "code": self.status}},
                     self.status, headers)


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param)


# -- request bodies ---------------------------------------------------------------------------
class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False           # a last chunk with the request's usage
    continuous_usage_stats: bool = False  # every chunk carries the usage so far (vLLM's)


class _Body(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Fields both endpoints take. Unknown fields are errors, not silently ignored; OpenAI fields
    this server does not implement are declared, so that the 400 can say so (`_UNSUPPORTED`)."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None  # None = OpenAI's default, 1.0
    top_p: float | None = None
    top_k: int | None = None          # extension: 0 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    ignore_eos: bool = False          # extension
    return_token_ids: bool = False    # extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: Any = None       # {"type": "text"} only
    # Accepted; they do not change what is generated.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # Not implemented: refused by name unless at their no-op value.
    logit_bias: dict[str, float] | None = None


class CompletionBody(_Body, kw_only=True):
    prompt: Any  # checked by hand so the error can say what a prompt may be
    echo: bool = False
    logprobs: int | None = None       # the top-k alternatives per token (OpenAI: 0..5)
    best_of: int | None = None        # only equal to n
    suffix: str | None = None


class CalledFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str  # JSON text as the model wrote it; templates get it as sent (OpenAI's)


class ToolCall(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    type: Literal["function"]
    function: CalledFunction


class FunctionDef(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    name: str  # omit_defaults: the template sees only the keys the client sent
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema
    strict: bool | None = None  # moot: no call is generated (tool_choice "none")


class Tool(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionDef


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    role: str
    content: Any = None  # a string or a list of text parts; checked by hand
    name: str | None = None  # given to the chat template; the simple template leaves it out
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None           # tool messages: the call they answer
    function_call: Any = None  # OpenAI's deprecated function calling: refused by name


class ChatBody(_Body, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    parallel_tool_calls: bool | None = None  # moot: no call is generated (tool_choice "none")
    tools: list[Tool] | None = None
    tool_choice: Any = None  # only "none": see _chat_tools
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None


# field -> what it may be set to here (what every client sends when it means "off")
_UNSUPPORTED: dict[str, tuple] = {
    "logit_bias": ({},), "suffix": ("",), "functions": ([],), "function_call": ("none",),
    "modalities": (["text"],), "audio": (), "prediction": (), "reasoning_effort": (),
    "web_search_options": (),
}
_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_CHOICES = 64  # n x prompts: each is a request of its own


def _decode(raw: bytes, kind: type[_Body]) -> _Body:
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as exc:
        # msgspec says e.g. "Expected `int`, got `str` - at `$.max_tokens`" or
        # "Object missing required field `role` - at `$.messages[1]`"
        msg, _, at = str(exc).partition(" - at `$")
        path = at.rstrip("`").lstrip(".")
        if "field `" in msg:
            field = msg.split("`")[1]
            path = f"{path}.{field}" if path else field
            if "unknown field" in msg:
                raise _bad(f"{path}: unknown or unsupported field", path) from None
            raise _bad(f"{path} is required", path) from None
        raise _bad(f"{path or 'request body'}: {msg}", path or None) from None
    except msgspec.DecodeError as exc:
        raise _bad(f"request body is not valid JSON: {exc}", None) from None
    except UnicodeDecodeError as exc:  # msgspec checks UTF-8 only inside strings, and so
        bad = exc.object[exc.start:exc.start + 1]  # raises this instead of a DecodeError
        raise _bad(f"request body is not valid UTF-8: a JSON string holds byte {bad.hex()} "
                   f"({exc.reason})", None) from None
    except RecursionError:  # the parser's depth limit (the interpreter's): bounded nesting
        raise _bad("request body is not valid JSON for this API: arrays or objects nested too "
                   "deeply", None) from None


def _check_unsupported(body: _Body) -> None:
    """A 400 naming the first OpenAI field set to something this server does not implement."""
    for field, no_ops in _UNSUPPORTED.items():
        value = getattr(body, field, None)
        if value is not None and value not in no_ops:
            raise _bad(f"{field} is not supported by this server", field)
    fmt = body.response_format
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        kind = fmt.get("type") if isinstance(fmt, dict) else type(fmt).__name__
        raise _bad(f"response_format of type {kind!r} is not supported by this server (only "
                   "'text')", "response_format")
    if not 1 <= body.n <= MAX_CHOICES:
        raise _bad(f"n must be in 1..{MAX_CHOICES}, got {body.n}", "n")
    if isinstance(body, CompletionBody) and body.best_of not in (None, body.n):
        raise _bad(f"best_of={body.best_of} (other than n) is not supported by this server",
                   "best_of")


def _check_sampling(body: _Body, vocab_size: int) -> None:
    """Ranges a user would expect (OpenAI's where it documents one); SamplingParams checks only
    what the sampler needs, so 1e9 would otherwise pass as a valid temperature or top_k."""
    if body.temperature is not None and not 0 <= body.temperature <= MAX_TEMPERATURE:
        raise _bad(f"temperature must be in 0..{MAX_TEMPERATURE:g}, got {body.temperature!r}",
                   "temperature")
    if body.top_p is not None and not 0 < body.top_p <= 1:
        raise _bad(f"top_p must be in (0, 1], got {body.top_p!r}", "top_p")
    if body.top_k is not None and not 0 <= body.top_k <= vocab_size:
        raise _bad(f"top_k must be >= 0 (0 = off) and at most the vocabulary size "
                   f"{vocab_size}, got {body.top_k}", "top_k")
    if body.seed is not None and not _INT64[0] <= body.seed <= _INT64[1]:
        raise _bad(f"seed must be a signed 64-bit integer, got {body.seed}", "seed")


def _logprobs(body: _Body) -> int | None:
    """How many alternatives per token the request wants (None: no logprobs)."""
    if isinstance(body, CompletionBody):
        k, field = body.logprobs, "logprobs"
    else:
        k, field = body.top_logprobs, "top_logprobs"
        if k is not None and not body.logprobs:
            raise _bad("top_logprobs needs logprobs=true", "top_logprobs")
        if body.logprobs and k is None:
            k = 0
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise _bad(f"{field} must be in 0..{MAX_LOGPROBS}, got {k}", field)
    return k


def _choice_seed(seed: int | None, j: int) -> int | None:
    """Choice j's seed: the request's for choice 0 (so n=1 and choice 0 agree), one derived
    from it for the others (so their draws differ)."""
    if seed is None or j == 0:
        return seed
    digest = hashlib.sha256(f"{seed}:choice:{j}".encode()).digest()
    return int.from_bytes(digest[:8], "little") - 2**63


def _prompt_texts(prompt: Any) -> list[str | list[int]]:
    """The prompts of a completion request: a string, a list of token ids, or a list of
    either."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                   and all(type(t) is int for t in prompt)):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(
            isinstance(p, str) or (isinstance(p, list) and all(type(t) is int for t in p))
            for p in prompt):
        return prompt
    raise _bad("prompt must be a string, a list of token ids, or a list of strings or of "
               "token-id lists", "prompt")


def _completion_prompt(prompt: str | list[int], tokenizer: Tokenizer, where: str) -> list[int]:
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    if not ids:
        raise _bad(f"{where} must not be empty", "prompt")
    bad = [t for t in ids if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise _bad(f"{where} token ids {bad[:5]} are outside the vocabulary of "
                   f"{tokenizer.vocab_size}", "prompt")
    return ids


def _chat_tools(body: ChatBody) -> list[dict] | None:
    """The tools to describe to the model in the prompt (the template's `tools`), or None.

    As vLLM without a tool-call parser: the output is never parsed for tool calls, so only
    tool_choice "none" can be honoured. "auto" (also the default when tools are given),
    "required" and a named function all promise calls returned as `tool_calls`."""
    choice = body.tool_choice
    if choice not in (None, "none") or (body.tools and choice is None):
        got = "absent with tools, which means 'auto'" if choice is None else f"got {choice!r}"
        raise _bad(f"tool_choice is not supported by this server unless it is 'none' ({got}): "
                   "this server does not parse tool calls out of the model's output; send "
                   "tool_choice 'none' to have the tools described in the prompt",
                   "tool_choice")
    return msgspec.to_builtins(body.tools) if body.tools else None


def _chat_messages(messages: list[ChatMessage]) -> list[Message]:
    if not messages:
        raise _bad("messages must contain at least one message", "messages")
    return [_chat_message(m, f"messages[{i}]") for i, m in enumerate(messages)]


def _chat_message(m: ChatMessage, where: str) -> Message:
    """A message as transformers hands it to a template: tool calls as dicts (arguments the
    JSON text sent), a tool result with the id of the call it answers. The shapes of tool
    calls are msgspec's to check (`ToolCall`); which role may carry what is checked here."""
    if m.role == "function":
        raise _bad(f"{where}.role 'function' (OpenAI's deprecated function calling) is not "
                   "supported by this server; send a tool result as role 'tool' with "
                   "tool_call_id", f"{where}.role")
    if m.role not in _ROLES:
        raise _bad(f"{where}.role must be one of {', '.join(_ROLES)}; got {m.role!r}",
                   f"{where}.role")
    if m.function_call is not None:
        raise _bad(f"{where}.function_call (OpenAI's deprecated function calling) is not "
                   "supported by this server; use tool_calls", f"{where}.function_call")
    if m.tool_calls is not None and m.role != "assistant":
        raise _bad(f"{where}.tool_calls is only allowed in assistant messages",
                   f"{where}.tool_calls")
    if m.role == "tool" and m.tool_call_id is None:
        raise _bad(f"{where}.tool_call_id is required in a tool message (the id of the call it "
                   "answers)", f"{where}.tool_call_id")
    if m.role != "tool" and m.tool_call_id is not None:
        raise _bad(f"{where}.tool_call_id is only allowed in tool messages",
                   f"{where}.tool_call_id")
    calls = msgspec.to_builtins(m.tool_calls) if m.tool_calls else None  # [] means no calls
    # a turn that only calls tools has null content; templates expect text
    content = "" if calls and m.content is None else _message_text(m.content, f"{where}.content")
    message = {"role": m.role, "content": content}
    if m.role == "tool":
        message["tool_call_id"] = m.tool_call_id
    if calls:
        message["tool_calls"] = calls
    if m.name is not None:
        message["name"] = m.name
    return message


def _message_text(content: Any, where: str) -> str:
    if content is None:
        raise _bad(f"{where} is required", where)
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or a list of text parts", where)
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "text" \
                and not isinstance(part.get("text"), str):
            raise _bad(f"{where}[{j}].text must be a string", f"{where}[{j}].text")
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise _bad(f"{where}[{j}] must be {{\"type\": \"text\", \"text\": ...}}; "
                       f"got {kind!r} (only text is supported)", f"{where}[{j}]")
        texts.append(part["text"])
    return "".join(texts)


# Every stop string is checked against the text at every token: the list is bounded (OpenAI
# allows 4 sequences; a few more are served for clients that send a handful).
MAX_STOPS = 16
MAX_STOP_CHARS = 256


def _stops(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else stop or []
    if len(stops) > MAX_STOPS:
        raise _bad(f"stop has {len(stops)} strings; at most {MAX_STOPS} are served", "stop")
    for i, s in enumerate(stops):
        if not s:
            raise _bad(f"stop[{i}] must be a non-empty string", "stop")
        if len(s) > MAX_STOP_CHARS:
            raise _bad(f"stop[{i}] has {len(s)} characters; at most {MAX_STOP_CHARS}", "stop")
    return stops


@dataclass
class _Choice:
    """One choice of a request: a prompt and the sampling of one of its `n` samples; each runs
    as a backend request of its own."""

    index: int
    request: Request


@dataclass
class _Job:
    """A validated request, ready for the backend."""

    id: str
    chat: bool
    choices: list[_Choice]
    prompt_tokens: int    # each prompt counted once, as in OpenAI's usage
    stops: list[str]
    stream: bool
    include_usage: bool
    continuous_usage: bool
    token_ids: bool
    echo: bool
    logprobs: int | None  # alternatives per token; None: no logprobs
    created: int


class _Failed(Exception):
    """The request failed after admission (backend error or deadline)."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


class _ClientGone(Exception):
    pass


class _ClosingStream(StreamingResponse):
    """Closes its body iterator and runs `cleanup` however the response ends. Starlette stops
    iterating when the client disconnects but leaves the generator to the garbage collector;
    closing it now is what cancels the request in the backend and frees its state at once."""

    def __init__(self, body: AsyncIterator[bytes], cleanup: Callable[[], Awaitable[None]]):
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._cleanup = cleanup

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await self._cleanup()


# -- the app ----------------------------------------------------------------------------------
class _Api:
    def __init__(self, backend: GenerationBackend, tokenizer: Tokenizer,
                 request_timeout_s: float, default_max_tokens: int, max_body_bytes: int,
                 body_timeout_s: float, no_logprobs: str | None):
        self.backend, self.tokenizer = backend, tokenizer
        self.no_logprobs = no_logprobs
        self.timeout, self.default_max_tokens = request_timeout_s, default_max_tokens
        self.max_body, self.body_timeout = max_body_bytes, body_timeout_s
        self.metrics = ApiMetrics(backend)

    def job(self, raw: bytes, chat: bool) -> _Job:
        body = _decode(raw, ChatBody if chat else CompletionBody)
        if body.model != self.backend.model_name:
            raise _bad(f"model {body.model!r} is not served here; this server serves "
                       f"{self.backend.model_name!r}", "model")
        _check_unsupported(body)
        _check_sampling(body, self.tokenizer.vocab_size)
        if body.stream_options is not None and not body.stream:
            raise _bad("stream_options is only allowed with stream=true", "stream_options")
        logprobs = _logprobs(body)
        if logprobs is not None and self.no_logprobs:
            raise _bad(f"logprobs is not supported by this deployment: {self.no_logprobs}",
                       "logprobs")
        if chat:
            tools = _chat_tools(body)
            messages = _chat_messages(body.messages)
            self._check_length(sum(len(m["content"]) for m in messages), "messages", "messages")
            try:
                prompts = [self.tokenizer.chat_prompt(messages, tools)]
            except ValueError as exc:  # e.g. a model's template insists roles alternate
                raise _bad(f"messages: {exc}", "messages") from None
            field = "messages"
        else:
            texts = _prompt_texts(body.prompt)
            if len(texts) * body.n > MAX_CHOICES:
                raise _bad(f"{len(texts)} prompts x n={body.n} choices: at most {MAX_CHOICES} "
                           "per request", "n" if body.n > 1 else "prompt")
            prompts = []
            for i, text in enumerate(texts):
                where = "prompt" if len(texts) == 1 else f"prompt[{i}]"
                if isinstance(text, str):  # bounded before the tokenizer sees it
                    self._check_length(len(text), where, "prompt")
                prompts.append(_completion_prompt(text, self.tokenizer, where))
            field = "prompt"
        echo = not chat and body.echo
        job_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        choices = []
        for i, prompt in enumerate(prompts):
            max_tokens = self._max_tokens(body, chat, prompt, field)
            for j in range(body.n):
                index = i * body.n + j
                params = self._params(body, max_tokens, _choice_seed(body.seed, j), logprobs,
                                      logprobs if echo else None)
                rid = job_id if len(prompts) * body.n == 1 else f"{job_id}-{index}"
                choices.append(_Choice(index, Request(rid, prompt, params)))
        options = body.stream_options or StreamOptions()
        return _Job(job_id, chat, choices, sum(map(len, prompts)), _stops(body.stop),
                    body.stream, options.include_usage, options.continuous_usage_stats,
                    body.return_token_ids, echo, logprobs, int(time.time()))

    def _params(self, body: _Body, max_tokens: int, seed: int | None, logprobs: int | None,
                prompt_logprobs: int | None) -> SamplingParams:
        try:
            return SamplingParams(max_tokens=max_tokens,
                                  temperature=_default(body.temperature, 1.0),
                                  top_k=_default(body.top_k, 0), top_p=_default(body.top_p, 1.0),
                                  seed=seed, stop_token_ids=self.tokenizer.stop_token_ids,
                                  ignore_eos=body.ignore_eos,
                                  presence_penalty=_default(body.presence_penalty, 0.0),
                                  frequency_penalty=_default(body.frequency_penalty, 0.0),
                                  logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        except ValueError as exc:  # its messages start with the field name
            raise _bad(str(exc), str(exc).split()[0]) from None

    def _check_length(self, chars: int, where: str, field: str) -> None:
        """A text too long for the context in any tokenization is refused before the tokenizer
        runs: it takes at least chars / max_token_chars tokens."""
        limit = self.backend.max_context * self.tokenizer.max_token_chars
        if chars > limit:
            raise _bad(f"{where} has {chars} characters; the model's maximum context of "
                       f"{self.backend.max_context} tokens holds at most {limit}", field)

    def _max_tokens(self, body: _Body, chat: bool, prompt: list[int], prompt_field: str) -> int:
        """The request's limit; without one, OpenAI's: a chat runs to EOS or the context's end,
        a completion stops after `default_max_tokens`."""
        field, value = "max_tokens", body.max_tokens
        if chat and body.max_completion_tokens is not None:
            field, value = "max_completion_tokens", body.max_completion_tokens
        limit = self.backend.max_context
        if value is not None and value < 1:
            raise _bad(f"{field} must be >= 1, got {value}", field)
        room = limit - len(prompt)
        if room < 1:
            raise _bad(f"the prompt has {len(prompt)} tokens; the model's maximum context is "
                       f"{limit} tokens (prompt + output)", prompt_field)
        if value is not None and value > room:
            raise _bad(f"{field}={value} plus the prompt's {len(prompt)} tokens exceeds the "
                       f"model's maximum context of {limit} tokens", field)
        if value is not None:
            return value
        return room if chat else min(self.default_max_tokens, room)

    async def body(self, http: HttpRequest) -> bytes:
        """The body, read no further than `max_body` bytes and for no longer than
        `body_timeout` seconds."""
        declared = http.headers.get("content-length")
        declared = int(declared) if declared and declared.isdigit() else None  # h11 checked it
        if declared is not None and declared > self.max_body:  # refused before reading a byte
            raise self._too_large(declared)
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.body_timeout):
                async for chunk in http.stream():
                    size += len(chunk)
                    if size > self.max_body:
                        raise self._too_large(None)
                    chunks.append(chunk)
        except TimeoutError:
            of = f" of the {declared} its Content-Length announces" if declared is not None else ""
            raise ApiError(408, f"the request body did not arrive within "
                                f"{self.body_timeout:g} s ({size} bytes received{of})",
                           close=True) from None
        except ClientDisconnect:
            raise _ClientGone() from None
        return b"".join(chunks)

    def _too_large(self, declared: int | None) -> ApiError:
        size = "" if declared is None else f" of {declared} bytes"
        return ApiError(413, f"request body{size} is larger than this server's limit of "
                             f"{self.max_body} bytes", close=True)

    async def generate(self, http: HttpRequest, chat: bool) -> Response:
        track = self.metrics.track()
        try:
            job = self.job(await self.body(http), chat)
        except ApiError:
            track.done("invalid")
            raise
        except _ClientGone:
            track.done("cancelled")
            return Response(status_code=499)
        deadline = asyncio.get_running_loop().time() + self.timeout
        streams = [self.backend.generate(c.request, self.timeout) for c in job.choices]

        async def close_all():
            for events in streams:
                await events.aclose()
        try:
            firsts = await _unless_disconnected(
                http, _all(_next_event(events, deadline) for events in streams))
        except BaseException as exc:
            await close_all()
            if isinstance(exc, (Overloaded, BackendUnavailable)):
                track.done("rejected")
                status = 429 if isinstance(exc, Overloaded) else 503
                raise ApiError(status, str(exc), retry_after=exc.retry_after) from None
            if isinstance(exc, BadRequest):
                track.done("invalid")
                raise ApiError(exc.status, str(exc)) from None
            if isinstance(exc, _Failed):
                track.done("error")
                raise ApiError(exc.status, str(exc)) from None
            if isinstance(exc, _ClientGone):
                track.done("cancelled")
                return Response(status_code=499)  # nobody reads it; 499 = client closed request
            track.done("error")
            raise
        track.prompt(job.prompt_tokens)
        runs = [_Run(c, first, events, LogprobWriter(self.tokenizer, chat))
                for c, first, events in zip(job.choices, firsts, streams)]
        if job.stream:
            async def cleanup():  # for a stream that ends before its body ever ran
                await close_all()
                track.done("cancelled")  # no-op when the stream counted its outcome
            return _ClosingStream(self._sse(job, runs, deadline, track), cleanup)
        try:
            body = await _unless_disconnected(http, self._collect(job, runs, deadline, track))
        except _Failed as exc:
            track.done("error")
            raise ApiError(exc.status, str(exc)) from None
        except _ClientGone:
            track.done("cancelled")
            return Response(status_code=499)
        except Exception:
            track.done("error")
            raise
        finally:
            await close_all()  # a stop string ends the request before the backend does
        track.done("ok")
        return _json(body)

    async def _pieces(self, job: _Job, run: "_Run", deadline: float, track
                      ) -> AsyncIterator[tuple[str, list[int], list, str | None]]:
        """(text delta, new token ids, their logprobs, finish reason) until the choice ends."""
        text = TextStream(self.tokenizer, job.stops)
        ev = run.first
        while True:
            if ev.finish_reason in ("error", "cancelled"):
                raise _Failed(ev.error or "the backend cancelled the request", _status(ev.exc))
            ids, delta, entries = [], "", []
            if ev.token is not None:
                track.token()
                ids, delta = [ev.token], text.push(ev.token)
                entries = [ev.logprob]
            finish = "stop" if text.stopped else ev.finish_reason
            run.generated += len(ids)
            if finish is not None:
                yield delta + text.flush(), ids, entries, finish
                return
            yield delta, ids, entries, None
            ev = await _next_event(run.events, deadline)

    def _echo(self, job: _Job, run: "_Run") -> tuple[str, dict | None]:
        """An echoed prompt's text and logprobs piece (completions with `echo`)."""
        prompt = run.choice.request.prompt
        if job.logprobs is None:
            return self.tokenizer.decode(prompt), None
        entries = run.first.prompt_logprobs or [None] * len(prompt)
        return self.tokenizer.decode(prompt), run.writer.piece(prompt, entries)

    async def _collect_one(self, job: _Job, run: "_Run", deadline: float, track) -> dict:
        text, ids, pieces = [], [], []
        if job.echo:
            prompt_text, piece = self._echo(job, run)
            text.append(prompt_text)
            pieces += [piece] if piece else []
        async for delta, new, entries, finish in self._pieces(job, run, deadline, track):
            text.append(delta)
            ids += new
            if job.logprobs is not None and new:
                pieces.append(run.writer.piece(new, entries))
        if job.chat:
            choice = {"index": run.choice.index,
                      "message": {"role": "assistant", "content": "".join(text)}}
        else:
            choice = {"index": run.choice.index, "text": "".join(text)}
        choice |= {"logprobs": None if job.logprobs is None else merge(pieces, job.chat),
                   "finish_reason": finish}
        if job.token_ids:
            choice["token_ids"] = ids
        return choice

    async def _collect(self, job: _Job, runs: list["_Run"], deadline: float, track) -> dict:
        choices = await _all(self._collect_one(job, r, deadline, track) for r in runs)
        return self._envelope(job, sorted(choices, key=lambda c: c["index"]), final=True) \
            | {"usage": _usage(job, runs)}

    async def _chunks(self, job: _Job, run: "_Run", deadline: float, track
                      ) -> AsyncIterator[dict]:
        """One choice's stream chunks."""
        if job.chat:
            yield self._chunk(job, run, {"role": "assistant", "content": ""}, [], None, None)
        if job.echo:
            prompt_text, piece = self._echo(job, run)
            yield self._chunk(job, run, prompt_text, [], piece, None)
        async for delta, ids, entries, finish in self._pieces(job, run, deadline, track):
            piece = run.writer.piece(ids, entries) if job.logprobs is not None and ids else None
            if delta or finish or (ids and (job.token_ids or piece)):
                content = ({"content": delta} if delta else {}) if job.chat else delta
                yield self._chunk(job, run, content, ids, piece, finish)

    async def _sse(self, job: _Job, runs: list["_Run"], deadline: float, track
                   ) -> AsyncIterator[bytes]:
        outcome = "cancelled"
        try:
            async with aclosing(_merged([self._chunks(job, r, deadline, track) for r in runs])
                                ) as chunks:
                async for chunk in chunks:
                    if job.continuous_usage:
                        chunk["usage"] = _usage(job, runs)
                    yield _event(chunk)
            if job.include_usage:
                yield _event(self._envelope(job, [], final=False) | {"usage": _usage(job, runs)})
            outcome = "ok"
        except _Failed as exc:
            outcome = "error"
            yield _event({"error": {"message": str(exc), "type": _error_type(exc.status),
                                    "param": None, "code": exc.status}})
        except Exception:
            outcome = "error"
            raise
        finally:
            for r in runs:
                await r.events.aclose()
            track.done(outcome)
        yield b"data: [DONE]\n\n"

    def _chunk(self, job: _Job, run: "_Run", content, ids: list[int], logprobs: dict | None,
               finish: str | None) -> dict:
        if job.chat:
            choice = {"index": run.choice.index, "delta": content}
        else:
            choice = {"index": run.choice.index, "text": content}
        choice |= {"logprobs": logprobs, "finish_reason": finish}
        if job.token_ids:
            choice["token_ids"] = ids
        return self._envelope(job, [choice], final=False)

    def _envelope(self, job: _Job, choices: list[dict], final: bool) -> dict:
        kind = ("chat.completion" if final else "chat.completion.chunk") if job.chat \
            else "text_completion"
        return {"id": job.id, "object": kind, "created": job.created,
                "model": self.backend.model_name, "choices": choices}

    def health(self) -> Response:
        """200 "ok"; 200 "degraded" while some kind of instance runs below its configured
        count (it serves, with less capacity); 503 "unhealthy" when it cannot serve."""
        reason = self.backend.health()
        capacity = self.backend.capacity()
        degraded = any(c["live"] < c["configured"] for c in capacity.values())
        body = {"status": "unhealthy" if reason else "degraded" if degraded else "ok",
                "model": self.backend.model_name, "capacity": capacity,
                "stats": self.backend.stats()}
        if reason is None:
            return _json(body)
        return _json(body | {"reason": reason}, 503, {"Retry-After": "5"})

    def models(self) -> Response:
        return _json({"object": "list", "data": [{
            "id": self.backend.model_name, "object": "model", "created": 0,
            "owned_by": "pdserve", "max_model_len": self.backend.max_context}]})


def _status(exc: BaseException | None) -> int:
    """The HTTP status of a request that failed with `exc` after admission."""
    if isinstance(exc, BadRequest):
        return exc.status
    if isinstance(exc, DeadlineExceeded):  # the backend enforces the same deadline and may
        return 504                          # notice it first
    if isinstance(exc, BackendUnavailable):  # e.g. ended by the shutdown's drain
        return 503
    return 500


def _default(value, default):
    return default if value is None else value


@dataclass
class _Run:
    """A choice in flight: its first event, its event stream, its logprobs writer, and how
    many tokens it generated so far."""

    choice: _Choice
    first: TokenEvent
    events: AsyncIterator[TokenEvent]
    writer: LogprobWriter
    generated: int = 0


def _usage(job: _Job, runs: list[_Run]) -> dict:
    generated = sum(r.generated for r in runs)
    return {"prompt_tokens": job.prompt_tokens, "completion_tokens": generated,
            "total_tokens": job.prompt_tokens + generated}


async def _all(work) -> list:
    """Await every awaitable of `work` concurrently; the first failure cancels the rest (and
    waits for them to unwind) before it is raised."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.wait(tasks)


_END = object()


async def _merged(streams: list[AsyncIterator]) -> AsyncIterator:
    """The items of several async iterators as they come; the first failure is raised (the
    others are cancelled)."""
    if len(streams) == 1:  # nothing to interleave
        async for item in streams[0]:
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def drain(stream):
        try:
            async for item in stream:
                await queue.put(item)
            await queue.put(_END)
        except Exception as exc:
            await queue.put(exc)
    tasks = [asyncio.ensure_future(drain(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is _END:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.wait(tasks)


async def _next_event(events: AsyncIterator[TokenEvent], deadline: float) -> TokenEvent:
    try:
        async with asyncio.timeout_at(deadline):
            return await anext(events)
    except TimeoutError:
        raise _Failed("deadline exceeded: the request did not finish within the server's "
                      "request timeout", 504) from None
    except StopAsyncIteration:
        raise _Failed("the backend ended the request without a finish event") from None


async def _unless_disconnected(http: HttpRequest, work):
    """Await `work` unless the client disconnects first (then raise _ClientGone).

    Starlette does not cancel a handler whose client went away; without this a queued or
    non-streaming request would keep its place and its state until it finished."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(http))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # let the backend iterator unwind (it cancels the request)
    if task.cancelled():
        raise _ClientGone()
    return task.result()


async def _disconnected(http: HttpRequest) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


def _json(body: Any, status: int = 200, headers: dict | None = None) -> Response:
    return Response(msgspec.json.encode(body), status, headers, media_type="application/json")


def _event(body: dict) -> bytes:
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


def create_app(backend: GenerationBackend, tokenizer: Tokenizer, request_timeout_s: float = 300.0,
               default_max_tokens: int = 16, max_body_bytes: int = MAX_BODY_BYTES,
               body_timeout_s: float = BODY_TIMEOUT_S, no_logprobs: str | None = None
               ) -> FastAPI:
    """The API app. It owns `backend` from then on: the backend is closed when the app shuts
    down. `default_max_tokens` applies when a request gives no limit (OpenAI's is 16); a body
    larger than `max_body_bytes` is a 413, one not received within `body_timeout_s` a 408.
    `no_logprobs`, when set, says why the backend has no logprobs: a request for them (chat or
    completions, echo included) is then a 400 naming `logprobs` and giving that reason."""
    for name, value in (("request_timeout_s", request_timeout_s),
                        ("max_body_bytes", max_body_bytes), ("body_timeout_s", body_timeout_s)):
        if value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    api = _Api(backend, tokenizer, request_timeout_s, default_max_tokens, max_body_bytes,
               body_timeout_s, no_logprobs)

    @asynccontextmanager
    async def lifespan(_app):
        yield
        await backend.close()

    app = FastAPI(title="pdserve", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def _api_error(_request, exc: ApiError) -> Response:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException) -> Response:
        # the router's own 404 / 405, in the shape clients parse (and with its Allow header)
        if exc.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = (f"method {request.method} is not allowed on {request.url.path}"
                       + (f"; use {exc.headers['Allow']}" if exc.headers and "Allow" in exc.headers
                          else ""))
        else:
            message = str(exc.detail)
        response = ApiError(exc.status_code, message).response()
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(Exception)
    async def _unexpected(_request, exc: Exception) -> Response:
        log.error("unhandled error", exc_info=exc)
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}").response()

    @app.post("/v1/completions")
    async def completions(request: HttpRequest) -> Response:
        return await api.generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HttpRequest) -> Response:
        return await api.generate(request, chat=True)

    @app.get("/v1/models")
    async def models() -> Response:
        return api.models()

    @app.get("/health")
    async def health() -> Response:
        return api.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(api.metrics.render(), media_type="text/plain; version=0.0.4")

    return app
