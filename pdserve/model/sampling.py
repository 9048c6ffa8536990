"""Per-request sampling: greedy, temperature, top-k, top-p, with a seed.

Randomness for the token at output position i is a hash of (seed, i, token id), not a generator
carried across steps, so any engine (prefill for the first token, a decode instance for the rest,
a re-prefill after a failure) and any device (the CPU reference, the GPU decode step) draws the
same token for the same logits.
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


_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32), in 16-bit halves so no product overflows."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32), the same on every device: integer ops only."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _row_key(seed: int, position: int) -> int:
    digest = hashlib.sha256(f"{seed}:{position}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def _gumbel(keys: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Gumbel noise [rows, n] (float64) for vocabulary ids `index` [rows, n] of rows keyed by
    `keys` [rows] (int64): a function of (key, token id) only, so it does not depend on the
    device, the batch or the order the candidates are visited in."""
    a = _mix32(keys[:, None] ^ _mix32(index))
    b = _mix32(a ^ 0x9E3779B9)
    u = ((a >> 5) * 67108864 + (b >> 6)).double().add_(0.5).mul_(2.0 ** -53)
    return -torch.log(-torch.log(u))


def sample_batch(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]
                 ) -> list[int]:
    """Each row's token for output position `positions[i]` from fp32 logits [rows, vocab], on
    whatever device the logits live (CPU and GPU give the same tokens for the same logits).

    Greedy rows take the argmax. A sampled row draws by the Gumbel-max rule: the argmax over the
    kept tokens of logits / temperature + Gumbel noise keyed by (seed, position_offset +
    position, token id), which is a draw from softmax(logits / temperature) restricted to them.
    Kept: the `top_k` best (ties by lower id), then the smallest prefix of those whose
    probability mass reaches `top_p` (always at least the best token)."""
    rows = logits.shape[0]
    if len(params) != rows or len(positions) != rows:
        raise ValueError(f"{rows} logits rows for {len(params)} params and {len(positions)} "
                         "positions")
    out = logits.argmax(dim=-1)
    hot = [i for i, p in enumerate(params) if p.temperature > 0.0]
    if hot:
        for i in hot:
            if params[i].seed is None:
                raise ValueError("sampling with temperature > 0 needs a seed; call with_seed() "
                                 "first")
        out = out.clone()
        dev = logits.device
        sel = torch.tensor(hot, device=dev)
        temps = torch.tensor([params[i].temperature for i in hot], dtype=torch.float32,
                             device=dev)
        keys = torch.tensor([_row_key(params[i].seed, params[i].position_offset + positions[i])
                             for i in hot], dtype=torch.long, device=dev)
        scaled = logits[sel].float() / temps[:, None]
        filtered = [j for j, i in enumerate(hot) if params[i].top_k or params[i].top_p < 1.0]
        plain = [j for j in range(len(hot)) if j not in set(filtered)]
        if plain:
            p = torch.tensor(plain, device=dev)
            vocab = torch.arange(scaled.shape[1], device=dev).expand(len(plain), -1)
            score = scaled[p].double() + _gumbel(keys[p], vocab)
            out[sel[p]] = score.argmax(dim=-1)
        if filtered:
            f = torch.tensor(filtered, device=dev)
            vals, order = scaled[f].sort(dim=-1, descending=True, stable=True)
            V = vals.shape[1]
            top_k = torch.tensor([params[hot[j]].top_k or V for j in filtered], device=dev)
            top_p = torch.tensor([params[hot[j]].top_p for j in filtered], dtype=torch.float64,
                                 device=dev)
            rank = torch.arange(V, device=dev)
            logit_k = vals.double().masked_fill(rank >= top_k[:, None], float("-inf"))
            probs = torch.softmax(logit_k, dim=-1)
            before = torch.cumsum(probs, dim=-1) - probs
            keep = (rank < top_k[:, None]) & ((before < top_p[:, None]) | (rank == 0))
            n = int(keep.sum(dim=-1).max().item())        # the candidates a row may draw
            score = vals[:, :n].double() + _gumbel(keys[f], order[:, :n])
            score = score.masked_fill(~keep[:, :n], float("-inf"))
            out[sel[f]] = order[:, :n].gather(1, score.argmax(dim=-1, keepdim=True))[:, 0]
    return out.tolist()


def sample(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """One token id from fp32 logits [vocab] for output position `position` (0 = first token)."""
    return sample_batch(logits[None], [params], [position])[0]


class Request(msgspec.Struct, frozen=True):
    """One generation request: token ids in, sampling settings."""

    request_id: str
    prompt: list[int]
    params: SamplingParams = SamplingParams()
