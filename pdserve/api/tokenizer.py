"""Text <-> token ids for the API: prompts, chat templates, and streamed text with stop strings.

Three tokenizers share one small interface (`encode`, `decode`, `decode_stream`, `chat_prompt`,
`vocab_size`, `stop_token_ids`, `max_token_chars`): the byte-level one of the `tiny` preset, a
Hugging Face `tokenizer.json` loaded with the `tokenizers` package (no transformers), and Kimi's
`tiktoken.model` through the `tiktoken` package (`pdserve.api.tiktoken_tokenizer`). Chat
templates render as transformers renders them (`pdserve.api.chat_template`). Stopping on the
model's EOS is the engine's job (it reads `eos_token_id` from the model config);
`stop_token_ids` adds the tokenizer's own end tokens: `tokenizer_config.json`'s `eos_token`,
`generation_config.json`'s `eos_token_id`, and the end of a chat turn, `<|im_end|>` (Kimi's and
ChatML's), where the vocabulary has it.
"""
from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Callable, Protocol, Sequence

from pdserve.api.chat_template import (ChatTemplate, Message, load_chat_template,
                                       simple_chat_template, special_text)

log = logging.getLogger("pdserve.api")

END_OF_TURN = ("<|im_end|>",)  # a chat reply ends here even where the configs name only [EOS]
TIKTOKEN_FILE = "tiktoken.model"


class Tokenizer(Protocol):
    vocab_size: int            # the model's vocabulary: valid prompt ids are below it
    stop_token_ids: list[int]  # end tokens beyond the model config's eos_token_id
    max_token_chars: int       # the most characters one token stands for: a text of n
                               # characters is at least n / max_token_chars tokens

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def token_bytes(self, token: int) -> bytes: ...  # what one token stands for
    def chat_prompt(self, messages: list[Message], tools: list[dict] | None = None
                    ) -> list[int]: ...  # `tools`: the template's `tools` variable

    def decode_stream(self) -> Callable[[int], str | None]:
        """A fresh incremental decoder: called with each token, it returns the text that
        token completes (whole characters only), or None while a character is incomplete."""


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


def _tokenizers_stream(backend, skip_special_tokens: bool) -> Callable[[int], str | None]:
    """`tokenizers.decoders.DecodeStream` over `backend`: it emits text only once it no longer
    ends in U+FFFD, so a character split over several tokens streams whole."""
    from tokenizers.decoders import DecodeStream

    return functools.partial(DecodeStream(skip_special_tokens=skip_special_tokens).step, backend)


class ByteLevelTokenizer:
    """One token per UTF-8 byte (the `tiny` preset's 256-token vocabulary)."""

    vocab_size = 256
    stop_token_ids: list[int] = []
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

    def decode_stream(self) -> Callable[[int], str | None]:
        return _tokenizers_stream(self.backend, skip_special_tokens=False)  # there are none

    def token_bytes(self, token: int) -> bytes:
        return bytes([token])

    def chat_prompt(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        return self.encode(simple_chat_template(messages, tools))


def read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def chat_template_or_warn(directory: Path, config: dict) -> ChatTemplate | None:
    template = load_chat_template(directory, config)
    if template is None:
        log.warning("%s has no chat template; chat requests use the simple template "
                    "(<|role|>\\ncontent\\n ... <|assistant|>\\n)", directory)
    return template


def stop_ids(directory: Path, config: dict, token_id: Callable[[str], int | None]) -> list[int]:
    """The tokenizer's end tokens (see the module docstring); `token_id` maps a token's text to
    its id, or None where the vocabulary lacks it."""
    names = [special_text(config.get("eos_token")), *END_OF_TURN]
    stops = {i for name in names if name is not None and (i := token_id(name)) is not None}
    gen_eos = read_json(directory / "generation_config.json").get("eos_token_id")
    stops.update(gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos])
    return sorted(stops)


class HFTokenizer:
    """`tokenizer.json` (+ `tokenizer_config.json`, `chat_template.jinja`,
    `generation_config.json` when present)."""

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
        config = read_json(directory / "tokenizer_config.json")
        self._template = chat_template_or_warn(directory, config)
        self.stop_token_ids = stop_ids(directory, config, self._tok.token_to_id)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def decode_stream(self) -> Callable[[int], str | None]:
        return _tokenizers_stream(self._tok, skip_special_tokens=True)

    def token_bytes(self, token: int) -> bytes:
        return self.decode([token]).encode()

    def chat_prompt(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        if self._template is None:
            return self.encode(simple_chat_template(messages, tools))
        # The template writes the special tokens itself.
        text = self._template.render(messages, tools=tools)
        return self._tok.encode(text, add_special_tokens=False).ids


def load_tokenizer(model_spec: str, vocab_size: int) -> Tokenizer:
    """The tokenizer of a model: `tokenizer.json` in its directory, else Kimi's
    `tiktoken.model`, else byte-level when the vocabulary is the 256 bytes; anything else is an
    error naming what is missing."""
    directory = Path(model_spec)
    if directory.is_file():
        directory = directory.parent
    if (directory / "tokenizer.json").exists():
        return HFTokenizer(directory, vocab_size)
    if (directory / TIKTOKEN_FILE).exists():
        from pdserve.api.tiktoken_tokenizer import TiktokenTokenizer

        return TiktokenTokenizer(directory, vocab_size)
    if vocab_size == ByteLevelTokenizer.vocab_size:
        return ByteLevelTokenizer()
    raise ValueError(f"model {model_spec!r} has a {vocab_size}-token vocabulary and no "
                     f"tokenizer.json or {TIKTOKEN_FILE}; give a model directory that contains "
                     "one")


class TextStream:
    """Turns a request's output tokens into text deltas for streaming, honouring stop strings.

    The text comes from the tokenizer's `decode_stream`, which emits text only once a
    character is complete, so a character split over several tokens (a multi-byte UTF-8 char
    in the byte vocabulary, or a BPE token boundary inside one) streams whole. `flush` adds
    what is still held at the end, so the deltas concatenate to the full decode. Text that
    could still grow into a stop string is held back; once a stop string appears, the text is
    cut before it and `stopped` is set."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str] = ()):
        self._tok = tokenizer
        self._step = tokenizer.decode_stream()
        self._stops = list(stops)
        self._ids: list[int] = []
        self._pending: list[int] = []  # pushed since the stream last returned text
        self._text = ""                # decoded text (whole characters) so far
        self._sent = 0                 # characters of it already returned
        self.stopped = False

    def push(self, token: int) -> str:
        """Add one output token; returns the text that is now safe to emit (maybe "")."""
        if self.stopped:
            return ""
        self._ids.append(token)
        self._pending.append(token)
        piece = self._step(token)
        if piece is not None:
            self._text += piece
            self._pending.clear()
        return self._take(final=False)

    def flush(self) -> str:
        """The rest of the text at the end of the request."""
        if not self.stopped and self._pending:
            # What the stream still holds (a character left incomplete): the full decode's
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
