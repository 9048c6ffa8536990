"""Kimi's tokenizer: `tiktoken.model` through the `tiktoken` package, as the Kimi-Linear and
K2/K3 repositories ship it (no `tokenizer.json`).

What `tokenization_kimi.py` in those repositories does, without transformers or remote code:
- `tiktoken.model`: one line per token, base64 bytes and rank; the ranks are the ids;
- special tokens: the `num_base` ids after the ranks and 256 reserved ones, named by
  `tokenizer_config.json`'s `added_tokens_decoder` (`[BOS]`, `[EOS]`, `<|im_end|>`,
  `<|im_user|>`, `<|im_assistant|>`, `<|im_system|>`, `<|im_middle|>`, the tool-call tokens)
  and `<|reserved_token_{id}|>` for the rest;
- Kimi's pre-tokenization pattern (`PATTERN`: Han runs apart, cased words with English
  contractions, numbers of at most 3 digits, punctuation runs, whitespace);
- encode: special tokens in the text are recognised (the chat template writes them), no BOS is
  added, and the text goes to tiktoken in chunks of at most 400,000 characters with runs of
  over 25,000 whitespace or non-whitespace characters cut, where tiktoken would fail;
- decode: special tokens are left out of the text.
The chat template and the stop tokens come as for any tokenizer (`pdserve.api.tokenizer`).
"""
from __future__ import annotations

import base64
import binascii
import codecs
import re
from pathlib import Path
from typing import Callable

from pdserve.api.chat_template import Message, simple_chat_template, special_text
from pdserve.api.tokenizer import TIKTOKEN_FILE, chat_template_or_warn, read_json, stop_ids

PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
NUM_RESERVED = 256
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000
# a run is tried only where it starts (the lookbehinds), so the scan stays linear
_LONG_RUN = re.compile(rf"(?<!\s)\s{{{MAX_RUN_CHARS + 1},}}|(?<!\S)\S{{{MAX_RUN_CHARS + 1},}}")


def read_ranks(path: Path) -> dict[bytes, int]:
    """The mergeable ranks of a tiktoken file. Not `tiktoken.load.load_tiktoken_bpe`: it caches
    a local file's contents by its path in the temp directory, so a file rewritten at the same
    path would load stale."""
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise ValueError(f"{path}:{n}: not a tiktoken rank line (base64 bytes, a space, "
                             "the rank)") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: the ranks are not 0..{len(ranks) - 1}, one per token")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"{path}: {len(missing)} single bytes have no rank (e.g. "
                         f"{bytes(missing[:4])!r}); every byte must, or tiktoken cannot encode "
                         "text containing them")
    return ranks


def special_tokens(config: dict, num_base: int, where: str) -> dict[str, int]:
    """Kimi's special tokens: ids num_base .. num_base + 256 (and any named one beyond), named
    by `added_tokens_decoder`, `<|reserved_token_{id}|>` where it names none."""
    named = {int(i): special_text(t) for i, t in config.get("added_tokens_decoder", {}).items()}
    low = sorted(i for i in named if i < num_base)
    if low:
        raise ValueError(f"{where}: added_tokens_decoder gives {named[low[0]]!r} the id "
                         f"{low[0]}, which is a {TIKTOKEN_FILE} rank (below {num_base})")
    end = max([num_base + NUM_RESERVED - 1, *named]) + 1
    return {named.get(i) or f"<|reserved_token_{i}|>": i for i in range(num_base, end)}


def _pieces(text: str):
    """The text in the pieces Kimi's tokenizer hands tiktoken (see the module docstring)."""
    for start in range(0, len(text), MAX_ENCODE_CHARS):
        chunk = text[start:start + MAX_ENCODE_CHARS]
        cuts = [c for m in _LONG_RUN.finditer(chunk)
                for c in range(m.start() + MAX_RUN_CHARS, m.end(), MAX_RUN_CHARS)]
        bounds = [0, *cuts, len(chunk)]
        yield from (chunk[a:b] for a, b in zip(bounds, bounds[1:]))


class TiktokenTokenizer:
    """`tiktoken.model` + `tokenizer_config.json` (+ `chat_template.jinja`,
    `generation_config.json` when present)."""

    def __init__(self, directory: Path, vocab_size: int):
        import tiktoken

        path = directory / TIKTOKEN_FILE
        ranks = read_ranks(path)
        config_path = directory / "tokenizer_config.json"
        config = read_json(config_path)
        self._num_base = len(ranks)
        self._specials = special_tokens(config, self._num_base, str(config_path))
        if (n := max(self._specials.values()) + 1) > vocab_size:
            raise ValueError(f"{path} with the special tokens of {config_path} has {n} tokens; "
                             f"the model's vocab_size is only {vocab_size}")
        self._enc = tiktoken.Encoding(name=str(path), pat_str=PATTERN, mergeable_ranks=ranks,
                                      special_tokens=self._specials)
        self._special_text = {i: s for s, i in self._specials.items()}
        self.vocab_size = vocab_size
        self.max_token_chars = max(max(map(len, ranks)), max(map(len, self._specials)))
        self._template = chat_template_or_warn(directory, config)
        self.stop_token_ids = stop_ids(directory, config, self._specials.get)

    def encode(self, text: str) -> list[int]:
        return [t for piece in _pieces(text)
                for t in self._enc.encode(piece, allowed_special="all")]

    def _bytes(self, token: int) -> bytes:
        """A rank's bytes; special tokens and ids past the vocabulary decode to nothing."""
        return self._enc.decode_single_token_bytes(token) if 0 <= token < self._num_base else b""

    def decode(self, ids: list[int]) -> str:
        return b"".join(map(self._bytes, ids)).decode("utf-8", errors="replace")

    def decode_stream(self) -> Callable[[int], str | None]:
        # the incremental decoder holds a character's leading bytes until it is complete
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        return lambda token: utf8.decode(self._bytes(token)) or None

    def token_bytes(self, token: int) -> bytes:
        special = self._special_text.get(token)
        return special.encode() if special is not None else self._bytes(token)

    def chat_prompt(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        if self._template is None:
            return self.encode(simple_chat_template(messages, tools))
        return self.encode(self._template.render(messages, tools=tools))
