"""Text <-> token ids for the API: prompts, chat templates, and streamed text with stop strings.

Two tokenizers share one small interface (`encode`, `decode`, `chat_prompt`, `vocab_size`,
`stop_token_ids`, `backend`, `max_token_chars`): the byte-level one of the `tiny` preset, and a Hugging Face
`tokenizer.json` loaded with the `tokenizers` package (no transformers). Both decode through a
`tokenizers.Tokenizer` (`backend`), so `TextStream` streams text for either with
`tokenizers.decoders.DecodeStream`. Stopping on the model's EOS is the engine's job (it reads
`eos_token_id` from the model config); `stop_token_ids` adds the tokenizer's own end tokens (e.g.
a chat template's end-of-turn) when it declares them.
"""
from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Protocol, Sequence

log = logging.getLogger("pdserve.api")

Message = dict  # {"role", "content"} and optionally "name", as chat templates take them


class Tokenizer(Protocol):
    vocab_size: int            # the model's vocabulary: valid prompt ids are below it
    stop_token_ids: list[int]  # end tokens beyond the model config's eos_token_id
    backend: object            # the `tokenizers.Tokenizer` that decodes (and streams) the ids
    skip_special_tokens: bool  # whether decoded text leaves special tokens out
    max_token_chars: int       # the most characters one token stands for: a text of n
                               # characters is at least n / max_token_chars tokens

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def token_bytes(self, token: int) -> bytes: ...  # what one token stands for
    def chat_prompt(self, messages: list[Message]) -> list[int]: ...


def simple_chat_template(messages: list[Message]) -> str:
    """The documented template for models without one: "<|role|>\\ncontent\\n" per message,
    then "<|assistant|>\\n" to prompt the reply."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of the `ByteLevel` pre-tokenizer
    and decoder."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]  # printable Latin-1
    chars, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


@functools.cache
def _byte_backend():
    """The byte vocabulary as a `tokenizers.Tokenizer`: token id b is byte b (a byte-level BPE
    without merges). It decodes as `bytes(ids).decode("utf-8", errors="replace")` does."""
    from tokenizers import Tokenizer as _Tokenizer, decoders, models, pre_tokenizers

    tok = _Tokenizer(models.BPE(vocab={c: b for b, c in _byte_chars().items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


class ByteLevelTokenizer:
    """One token per UTF-8 byte (the `tiny` preset's 256-token vocabulary)."""

    vocab_size = 256
    stop_token_ids: list[int] = []
    skip_special_tokens = False  # there are none
    max_token_chars = 1

    @property
    def backend(self):
        return _byte_backend()

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        bad = [i for i in ids if not 0 <= i < 256]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are not bytes")
        return self.backend.decode(list(ids))

    def token_bytes(self, token: int) -> bytes:
        return bytes([token])

    def chat_prompt(self, messages: list[Message]) -> list[int]:
        return self.encode(simple_chat_template(messages))


class HFTokenizer:
    """`tokenizer.json` (+ `tokenizer_config.json`, `generation_config.json` when present)."""

    skip_special_tokens = True

    def __init__(self, directory: Path, vocab_size: int):
        from tokenizers import Tokenizer as _Tokenizer

        self.backend = self._tok = _Tokenizer.from_file(str(directory / "tokenizer.json"))
        if self._tok.get_vocab_size() > vocab_size:
            raise ValueError(f"{directory}/tokenizer.json has {self._tok.get_vocab_size()} tokens; "
                             f"the model's vocab_size is only {vocab_size}")
        self.vocab_size = vocab_size
        # a vocabulary entry spells its token with at least as many characters as the token
        # decodes to (byte-level BPE: one per byte; added tokens: as they are typed)
        self.max_token_chars = max(map(len, self._tok.get_vocab(with_added_tokens=True)))
        config = _read_json(directory / "tokenizer_config.json")
        self._bos = _token_text(config.get("bos_token"))
        self._eos = _token_text(config.get("eos_token"))
        self._template = _chat_template(config.get("chat_template"))
        if self._template is None:
            log.warning("%s has no chat_template; chat requests use the simple template "
                        "(<|role|>\\ncontent\\n ... <|assistant|>\\n)", directory)
        stops = set()
        if self._eos is not None and (eos := self._tok.token_to_id(self._eos)) is not None:
            stops.add(eos)
        gen_eos = _read_json(directory / "generation_config.json").get("eos_token_id")
        stops.update(gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos])
        self.stop_token_ids = sorted(stops)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def token_bytes(self, token: int) -> bytes:
        return self.decode([token]).encode()

    def chat_prompt(self, messages: list[Message]) -> list[int]:
        if self._template is None:
            return self.encode(simple_chat_template(messages))
        from jinja2.exceptions import TemplateError

        try:
            text = self._template.render(
                messages=messages,
                add_generation_prompt=True, bos_token=self._bos or "", eos_token=self._eos or "")
        except TemplateError as exc:
            raise ValueError(f"the chat template refused them: {exc}") from None
        # The template writes the special tokens itself.
        return self._tok.encode(text, add_special_tokens=False).ids


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_text(token) -> str | None:
    # tokenizer_config.json spells special tokens as a string or as {"content": ...}
    return token.get("content") if isinstance(token, dict) else token


def _chat_template(template):
    """Compile the HF chat template in a sandbox (templates come with downloaded models)."""
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if not template:
        return None
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def load_tokenizer(model_spec: str, vocab_size: int) -> Tokenizer:
    """The tokenizer of a model: `tokenizer.json` in its directory, else byte-level when the
    vocabulary is the 256 bytes; anything else is an error naming what is missing."""
    directory = Path(model_spec)
    if directory.is_file():
        directory = directory.parent
    if (directory / "tokenizer.json").exists():
        return HFTokenizer(directory, vocab_size)
    if vocab_size == ByteLevelTokenizer.vocab_size:
        return ByteLevelTokenizer()
    raise ValueError(f"model {model_spec!r} has a {vocab_size}-token vocabulary and no "
                     f"tokenizer.json; give a model directory that contains one")


class TextStream:
    """Turns a request's output tokens into text deltas for streaming, honouring stop strings.

    The text comes from `tokenizers.decoders.DecodeStream` over the tokenizer's `backend`: it
    emits text only once it no longer ends in U+FFFD, so a character split over several tokens
    (a multi-byte UTF-8 char in the byte vocabulary, or a byte-level BPE token boundary inside
    one) streams whole. `flush` adds what is still held at the end, so the deltas concatenate to
    the full decode. Text that could still grow into a stop string is held back; once a stop
    string appears, the text is cut before it and `stopped` is set."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str] = ()):
        from tokenizers.decoders import DecodeStream

        self._tok = tokenizer
        self._stream = DecodeStream(skip_special_tokens=tokenizer.skip_special_tokens)
        self._stops = list(stops)
        self._ids: list[int] = []
        self._pending: list[int] = []  # pushed since DecodeStream last returned text
        self._text = ""                # decoded text (whole characters) so far
        self._sent = 0                 # characters of it already returned
        self.stopped = False

    def push(self, token: int) -> str:
        """Add one output token; returns the text that is now safe to emit (maybe "")."""
        if self.stopped:
            return ""
        self._ids.append(token)
        self._pending.append(token)
        piece = self._stream.step(self._tok.backend, token)
        if piece is not None:
            self._text += piece
            self._pending.clear()
        return self._take(final=False)

    def flush(self) -> str:
        """The rest of the text at the end of the request."""
        if not self.stopped and self._pending:
            # What DecodeStream still holds (a character left incomplete): the full decode's
            # tail, which ends in U+FFFD as the full decode does.
            full = self._tok.decode(self._ids)
            if full.startswith(self._text):
                self._text = full
            else:  # a decoder whose windows do not add up to the whole: the held ids alone
                self._text += self._tok.decode(self._pending)
            self._pending.clear()
        return self._take(final=True)

    def _take(self, final: bool) -> str:
        # A stop string cannot start before _sent: whatever could still begin one was held back.
        hits = [i for s in self._stops if (i := self._text.find(s, self._sent)) >= 0]
        if hits:
            self._text = self._text[:min(hits)]
            self.stopped = final = True
        end = len(self._text) if final else len(self._text) - self._held()
        out, self._sent = self._text[self._sent:end], end
        return out

    def _held(self) -> int:
        """Length of the longest unsent suffix that is the start of some stop string."""
        longest = max((len(s) for s in self._stops), default=1)
        for k in range(min(len(self._text) - self._sent, longest - 1), 0, -1):
            tail = self._text[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0
