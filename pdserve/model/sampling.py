"""Per-request sampling: greedy, temperature, top-k, top-p, with a seed.

Randomness for the token at output position i comes from a generator seeded by (seed, i), not from
a generator carried across steps, so any engine (prefill for the first token, a decode instance
for the rest, a re-prefill after a failure) draws exactly the same token for the same logits.
"""
from __future__ import annotations

import hashlib

import msgspec
import torch


class SamplingParams(msgspec.Struct, frozen=True):
    max_tokens: int = 16
    temperature: float = 0.0          # 0 = greedy
    top_k: int = 0                    # 0 = off
    top_p: float = 1.0
    seed: int | None = None           # None with temperature > 0: fresh randomness per request
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    # Output positions already produced elsewhere: a request resumed after a failure continues
    # the same random stream (position i draws with (seed, position_offset + i)).
    position_offset: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.position_offset < 0:
            raise ValueError(f"position_offset must be >= 0, got {self.position_offset}")

    def with_seed(self) -> "SamplingParams":
        """A copy with a concrete seed (drawn now when unset), so the request is replayable."""
        if self.seed is not None:
            return self
        return msgspec.structs.replace(self, seed=int(torch.randint(0, 2**62, ()).item()))


def _generator(seed: int, position: int) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{position}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def sample(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """One token id from fp32 logits [vocab] for output position `position` (0 = first token)."""
    if params.temperature == 0.0:
        return int(torch.argmax(logits).item())
    if params.seed is None:
        raise ValueError("sampling with temperature > 0 needs a seed; call with_seed() first")
    logits = logits.float().cpu() / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        order = torch.argsort(logits, descending=True)
        probs = torch.softmax(logits[order], dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least the best token)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        logits[order[drop]] = float("-inf")
    probs = torch.softmax(logits, dim=-1)
    g = _generator(params.seed, params.position_offset + position)
    return int(torch.multinomial(probs, 1, generator=g).item())


class Request(msgspec.Struct, frozen=True):
    """One generation request: token ids in, sampling settings."""

    request_id: str
    prompt: list[int]
    params: SamplingParams = SamplingParams()
