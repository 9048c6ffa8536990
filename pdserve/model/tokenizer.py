"""Byte-level tokenizer for the `tiny` preset (vocabulary 256: one id per byte)."""
from __future__ import annotations


class ByteTokenizer:
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        bad = [i for i in ids if not 0 <= i < 256]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are not bytes")
        return bytes(ids).decode("utf-8", errors="replace")
