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
reproducible. Extensions, spelled as in vLLM: `top_k` (0..vocabulary size, 0 = off),
`ignore_eos`, and `return_token_ids` (each choice or chunk then carries the output `token_ids`).
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

import msgspec
from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request as HttpRequest
from starlette.responses import Response, StreamingResponse

from pdserve.api.backend import (BackendUnavailable, BadRequest, DeadlineExceeded,
                                 GenerationBackend, Overloaded, TokenEvent)
from pdserve.api.metrics import ApiMetrics
from pdserve.api.tokenizer import TextStream, Tokenizer
from pdserve.model.sampling import Request, SamplingParams

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
    include_usage: bool = False


class _Body(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Fields both endpoints take. Unknown fields are errors, not silently ignored."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None  # None = OpenAI's default, 1.0
    top_p: float | None = None
    top_k: int | None = None          # extension: 0 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False          # extension
    return_token_ids: bool = False    # extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Unsupported, but accepted at their no-op values because clients send those explicitly.
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class CompletionBody(_Body, kw_only=True):
    prompt: Any  # checked by hand so the error can say what a prompt may be
    echo: bool | None = None
    best_of: int | None = None
    logprobs: int | None = None


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    content: Any  # a string or a list of text parts; checked by hand


class ChatBody(_Body, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None


_NO_OP_VALUES = {"n": 1, "best_of": 1, "echo": False, "logprobs": False,
                 "presence_penalty": 0.0, "frequency_penalty": 0.0}
_ROLES = ("system", "developer", "user", "assistant")


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


def _check_no_ops(body: _Body) -> None:
    for field, no_op in _NO_OP_VALUES.items():
        value = getattr(body, field, None)
        if value is not None and (type(value) is not type(no_op) or value != no_op):
            raise _bad(f"{field}={value!r} is not supported by this server", field)


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


def _completion_prompt(prompt: Any, tokenizer: Tokenizer) -> list[int]:
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and all(type(t) is int for t in prompt):
        ids = prompt
    else:
        raise _bad("prompt must be a string or list of token ids (one prompt per request)",
                   "prompt")
    if not ids:
        raise _bad("prompt must not be empty", "prompt")
    bad = [t for t in ids if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise _bad(f"prompt token ids {bad[:5]} are outside the vocabulary of "
                   f"{tokenizer.vocab_size}", "prompt")
    return ids


def _chat_messages(messages: list[ChatMessage]) -> list[tuple[str, str]]:
    if not messages:
        raise _bad("messages must contain at least one message", "messages")
    out = []
    for i, m in enumerate(messages):
        if m.role not in _ROLES:
            raise _bad(f"messages[{i}].role must be one of {', '.join(_ROLES)}; got {m.role!r}",
                       f"messages[{i}].role")
        out.append((m.role, _message_text(m.content, f"messages[{i}].content")))
    return out


def _message_text(content: Any, where: str) -> str:
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
class _Job:
    """A validated request, ready for the backend."""

    id: str
    chat: bool
    prompt: list[int]
    params: SamplingParams
    stops: list[str]
    stream: bool
    include_usage: bool
    token_ids: bool
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
                 body_timeout_s: float):
        self.backend, self.tokenizer = backend, tokenizer
        self.timeout, self.default_max_tokens = request_timeout_s, default_max_tokens
        self.max_body, self.body_timeout = max_body_bytes, body_timeout_s
        self.metrics = ApiMetrics(backend)

    def job(self, raw: bytes, chat: bool) -> _Job:
        body = _decode(raw, ChatBody if chat else CompletionBody)
        if body.model != self.backend.model_name:
            raise _bad(f"model {body.model!r} is not served here; this server serves "
                       f"{self.backend.model_name!r}", "model")
        _check_no_ops(body)
        _check_sampling(body, self.tokenizer.vocab_size)
        if body.stream_options is not None and not body.stream:
            raise _bad("stream_options is only allowed with stream=true", "stream_options")
        if chat:
            messages = _chat_messages(body.messages)
            try:
                prompt = self.tokenizer.chat_prompt(messages)
            except ValueError as exc:  # e.g. a model's template insists roles alternate
                raise _bad(f"messages: {exc}", "messages") from None
            prompt_field = "messages"
        else:
            prompt = _completion_prompt(body.prompt, self.tokenizer)
            prompt_field = "prompt"
        max_tokens = self._max_tokens(body, chat, prompt, prompt_field)
        try:
            params = SamplingParams(max_tokens=max_tokens,
                                    temperature=_default(body.temperature, 1.0),
                                    top_k=_default(body.top_k, 0), top_p=_default(body.top_p, 1.0),
                                    seed=body.seed,
                                    stop_token_ids=self.tokenizer.stop_token_ids,
                                    ignore_eos=body.ignore_eos)
        except ValueError as exc:  # its messages start with the field name
            raise _bad(str(exc), str(exc).split()[0]) from None
        return _Job(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", chat, prompt, params,
                    _stops(body.stop), body.stream,
                    body.stream_options is not None and body.stream_options.include_usage,
                    body.return_token_ids, int(time.time()))

    def _max_tokens(self, body: _Body, chat: bool, prompt: list[int], prompt_field: str) -> int:
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
        return value if value is not None else min(self.default_max_tokens, room)

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
        events = self.backend.generate(Request(job.id, job.prompt, job.params), self.timeout)
        try:
            first = await _unless_disconnected(http, _next_event(events, deadline))
        except (Overloaded, BackendUnavailable) as exc:
            track.done("rejected")
            status = 429 if isinstance(exc, Overloaded) else 503
            raise ApiError(status, str(exc), retry_after=exc.retry_after) from None
        except BadRequest as exc:
            track.done("invalid")
            raise ApiError(exc.status, str(exc)) from None
        except _Failed as exc:
            track.done("error")
            raise ApiError(exc.status, str(exc)) from None
        except _ClientGone:
            track.done("cancelled")
            return Response(status_code=499)  # nobody reads it; 499 = client closed request
        except Exception:
            track.done("error")
            raise
        track.prompt(len(job.prompt))
        if job.stream:
            async def cleanup():  # for a stream that ends before its body ever ran
                await events.aclose()
                track.done("cancelled")  # no-op when the stream counted its outcome
            return _ClosingStream(self._sse(job, first, events, deadline, track), cleanup)
        try:
            body = await _unless_disconnected(
                http, self._collect(job, first, events, deadline, track))
        except _Failed as exc:
            track.done("error")
            raise ApiError(exc.status, str(exc)) from None
        except _ClientGone:
            track.done("cancelled")
            return Response(status_code=499)
        except Exception:
            track.done("error")
            raise
        track.done("ok")
        return _json(body)

    async def _pieces(self, job: _Job, first: TokenEvent, events: AsyncIterator[TokenEvent],
                      deadline: float, track) -> AsyncIterator[tuple[str, list[int], str | None]]:
        """(text delta, new token ids, finish reason) until the request finishes."""
        text = TextStream(self.tokenizer, job.stops)
        ev = first
        while True:
            if ev.finish_reason in ("error", "cancelled"):
                raise _Failed(ev.error or "the backend cancelled the request", _status(ev.exc))
            ids, delta = [], ""
            if ev.token is not None:
                track.token()
                ids, delta = [ev.token], text.push(ev.token)
            finish = "stop" if text.stopped else ev.finish_reason
            if finish is not None:
                yield delta + text.flush(), ids, finish
                return
            yield delta, ids, None
            ev = await _next_event(events, deadline)

    async def _collect(self, job, first, events, deadline, track) -> dict:
        text, ids = [], []
        try:
            async for delta, new, finish in self._pieces(job, first, events, deadline, track):
                text.append(delta)
                ids += new
        finally:
            await events.aclose()  # a stop string ends the request before the backend does
        if job.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": "".join(text)}}
        else:
            choice = {"index": 0, "text": "".join(text)}
        choice |= {"logprobs": None, "finish_reason": finish}
        if job.token_ids:
            choice["token_ids"] = ids
        return self._envelope(job, choice, final=True) | {"usage": _usage(job, len(ids))}

    async def _sse(self, job, first, events, deadline, track) -> AsyncIterator[bytes]:
        outcome, generated = "cancelled", 0
        try:
            if job.chat:
                yield _event(self._chunk(job, {"role": "assistant", "content": ""}, [], None))
            async for delta, ids, finish in self._pieces(job, first, events, deadline, track):
                generated += len(ids)
                if delta or finish or (ids and job.token_ids):
                    content = ({"content": delta} if delta else {}) if job.chat else delta
                    yield _event(self._chunk(job, content, ids, finish))
            if job.include_usage:
                yield _event(self._envelope(job, None, final=False)
                             | {"usage": _usage(job, generated)})
            outcome = "ok"
        except _Failed as exc:
            outcome = "error"
            yield _event({"error": {"message": str(exc), "type": _error_type(exc.status),
                                    "param": None, "code": exc.status}})
        except Exception:
            outcome = "error"
            raise
        finally:
            await events.aclose()
            track.done(outcome)
        yield b"data: [DONE]\n\n"

    def _chunk(self, job: _Job, content, ids: list[int], finish: str | None) -> dict:
        if job.chat:
            choice = {"index": 0, "delta": content}
        else:
            choice = {"index": 0, "text": content}
        choice |= {"logprobs": None, "finish_reason": finish}
        if job.token_ids:
            choice["token_ids"] = ids
        return self._envelope(job, choice, final=False)

    def _envelope(self, job: _Job, choice: dict | None, final: bool) -> dict:
        kind = ("chat.completion" if final else "chat.completion.chunk") if job.chat \
            else "text_completion"
        return {"id": job.id, "object": kind, "created": job.created,
                "model": self.backend.model_name, "choices": [] if choice is None else [choice]}

    def health(self) -> Response:
        reason = self.backend.health()
        body = {"status": "ok" if reason is None else "unhealthy",
                "model": self.backend.model_name, "stats": self.backend.stats()}
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
    return 500


def _default(value, default):
    return default if value is None else value


def _usage(job: _Job, generated: int) -> dict:
    return {"prompt_tokens": len(job.prompt), "completion_tokens": generated,
            "total_tokens": len(job.prompt) + generated}


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
               body_timeout_s: float = BODY_TIMEOUT_S) -> FastAPI:
    """The API app. It owns `backend` from then on: the backend is closed when the app shuts
    down. `default_max_tokens` applies when a request gives no limit (OpenAI's is 16); a body
    larger than `max_body_bytes` is a 413, one not received within `body_timeout_s` a 408."""
    for name, value in (("request_timeout_s", request_timeout_s),
                        ("max_body_bytes", max_body_bytes), ("body_timeout_s", body_timeout_s)):
        if value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    api = _Api(backend, tokenizer, request_timeout_s, default_max_tokens, max_body_bytes,
               body_timeout_s)

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
