"""Log-probabilities in OpenAI's two response shapes, written piece by piece.

Completions (the legacy shape): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`,
parallel lists with one entry per token; `top_logprobs[i]` maps a token's text to its
log-probability, the chosen token included (as vLLM does); a token that is part of a
character is spelled "bytes:\\xNN" (OpenAI's spelling); an echoed prompt's first token has
None for both (nothing precedes it). Chat: `{"content": [{"token", "logprob", "bytes",
"top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...]}`.

A stream sends one piece per chunk; `merge` of the pieces is what the whole response holds, so
the two agree by construction.
"""
from __future__ import annotations

from pdserve.api.tokenizer import Tokenizer
from pdserve.model.sampling import TokenLogprob


class LogprobWriter:
    """One choice's logprobs; `text_offset` runs on across the pieces of the choice."""

    def __init__(self, tokenizer: Tokenizer, chat: bool):
        self.tokenizer, self.chat = tokenizer, chat
        self.offset = 0

    def _text(self, token: int) -> str:
        """The token's text; a token that is not whole UTF-8 characters (one byte of a
        multi-byte character) is spelled "bytes:\\xNN..." as OpenAI does, so that distinct
        tokens never share a `top_logprobs` key."""
        raw = self.tokenizer.token_bytes(token)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def piece(self, tokens: list[int], entries: list[TokenLogprob | None]) -> dict:
        if self.chat:
            return {"content": [self._chat_entry(e) for e in entries]}
        texts = [self._text(t) for t in tokens]
        offsets = []
        for t in tokens:  # where each token's text starts in the choice's text
            offsets.append(self.offset)
            self.offset += len(self.tokenizer.decode([t]))
        return {"tokens": texts,
                "token_logprobs": [None if e is None else e.logprob for e in entries],
                "top_logprobs": [None if e is None else self._top_map(e) for e in entries],
                "text_offset": offsets}

    def _top_map(self, entry: TokenLogprob) -> dict[str, float]:
        top = {self._text(t): lp for t, lp in entry.top}
        top.setdefault(self._text(entry.token), entry.logprob)
        return top

    def _chat_entry(self, entry: TokenLogprob) -> dict:
        def one(token: int, logprob: float) -> dict:
            text = self._text(token)
            return {"token": text, "logprob": logprob,
                    "bytes": list(self.tokenizer.token_bytes(token))}
        return one(entry.token, entry.logprob) | {
            "top_logprobs": [one(t, lp) for t, lp in entry.top]}


def merge(pieces: list[dict], chat: bool) -> dict:
    """The pieces of one choice as one logprobs object."""
    keys = ("content",) if chat else ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {k: [x for p in pieces for x in p[k]] for k in keys}
