"""Per-request sampling: greedy, temperature, top-k, top-p, with a seed; presence and
frequency penalties; log-probabilities of the chosen tokens.

Randomness for the token at output position i is a hash of (seed, i, token id), not a generator
carried across steps, so any engine (prefill for the first token, a decode instance for the rest,
a re-prefill after a failure) and any device (the CPU reference, the GPU decode step) draws the
same token for the same logits.

Penalties (OpenAI's): a row's logit for token j loses `frequency_penalty * c_j +
presence_penalty * (c_j > 0)`, where c_j counts j among the request's output tokens so far,
before temperature, top-k and top-p (and before greedy's argmax). Log-probabilities are the
model's own distribution, log_softmax of the raw logits (before penalties, temperature, top-k and
top-p, as vLLM reports them by default), so they do not depend on how the token was drawn.
"""
from __future__ import annotations

import hashlib

import msgspec
import torch

MAX_PENALTY = 2.0      # OpenAI's range for presence_penalty and frequency_penalty: -2..2
MAX_LOGPROBS = 20      # OpenAI's top_logprobs maximum


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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Log-probabilities: None = none; k >= 0 = each output token's, with the k most likely
    # alternatives. `prompt_logprobs` likewise for every prompt token after the first.
    logprobs: int | None = None
    prompt_logprobs: int | None = None

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
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise ValueError(f"{name} must be in -{MAX_PENALTY:g}..{MAX_PENALTY:g}, got "
                                 f"{getattr(self, name)!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in 0..{MAX_LOGPROBS}, got {k}")

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def plain(self) -> bool:
        """Greedy, unpenalized and without logprobs: the argmax alone is the whole answer."""
        return self.temperature == 0.0 and not self.penalized and self.logprobs is None

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


def penalize(logits: torch.Tensor, params: list[SamplingParams],
             histories: list[list[int]] | None) -> torch.Tensor:
    """`logits` with each penalized row's presence and frequency penalties subtracted, counted
    over `histories[i]` (row i's output tokens so far); the tensor itself where no row is."""
    rows = [i for i, p in enumerate(params) if p.penalized]
    if not rows:
        return logits
    if histories is None or len(histories) != len(params):
        raise ValueError("penalized rows need their output histories")
    out, vocab = logits.float().clone(), logits.shape[-1]
    for i in rows:
        if histories[i]:
            ids = torch.tensor(histories[i], dtype=torch.long, device=out.device)
            counts = torch.bincount(ids, minlength=vocab).to(out.dtype)
            out[i] -= params[i].frequency_penalty * counts \
                + params[i].presence_penalty * (counts > 0).to(out.dtype)
    return out


def sample_batch(logits: torch.Tensor, params: list[SamplingParams], positions: list[int],
                 histories: list[list[int]] | None = None) -> list[int]:
    """Each row's token for output position `positions[i]` from fp32 logits [rows, vocab], on
    whatever device the logits live (CPU and GPU give the same tokens for the same logits).

    Greedy rows take the argmax. A sampled row draws by the Gumbel-max rule: the argmax over the
    kept tokens of logits / temperature + Gumbel noise keyed by (seed, position_offset +
    position, token id), which is a draw from softmax(logits / temperature) restricted to them.
    Kept: the `top_k` best (ties by lower id), then the smallest prefix of those whose
    probability mass reaches `top_p` (always at least the best token). Penalized rows are
    penalized first, over `histories[i]` (`penalize`)."""
    rows = logits.shape[0]
    if len(params) != rows or len(positions) != rows:
        raise ValueError(f"{rows} logits rows for {len(params)} params and {len(positions)} "
                         "positions")
    logits = penalize(logits, params, histories)
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


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """A token's log-probability under the model's distribution at its position, and the `top`
    most likely tokens there as (id, log-probability), best first."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = []


def token_logprobs(logits: torch.Tensor, tokens: list[int], ks: list[int | None]
                   ) -> list[TokenLogprob | None]:
    """Row i's `tokens[i]` under log_softmax(logits[i]) (fp32) with its `ks[i]` most likely
    alternatives (ties by lower id); None for rows whose `ks[i]` is None."""
    out: list[TokenLogprob | None] = [None] * len(ks)
    rows = [i for i, k in enumerate(ks) if k is not None]
    if not rows:
        return out
    dev = logits.device
    lp = torch.log_softmax(logits[torch.tensor(rows, device=dev)].float(), dim=-1)
    chosen = lp.gather(1, torch.tensor([[tokens[i]] for i in rows], device=dev))[:, 0].tolist()
    k_max = max(ks[i] for i in rows)
    vals, ids = lp.sort(dim=-1, descending=True, stable=True) if k_max else (lp, lp)
    vals, ids = vals[:, :k_max].tolist(), ids[:, :k_max].tolist()
    for j, i in enumerate(rows):
        top = list(zip(ids[j][:ks[i]], vals[j][:ks[i]]))
        out[i] = TokenLogprob(tokens[i], chosen[j], top)
    return out


class Sampled(msgspec.Struct, frozen=True, array_like=True):
    """A step's draws: row i's token and, where its params ask for them, its log-probabilities
    (`logprobs[i]`) and, after a prefill, its prompt's (`prompt_logprobs[i]`, entry 0 None)."""

    tokens: list[int]
    logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs: list[list[TokenLogprob | None] | None] | None = None


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], positions: list[int],
                histories: list[list[int]] | None = None) -> Sampled:
    """`sample_batch`, with each row's log-probabilities where its params ask for them."""
    tokens = sample_batch(logits, params, positions, histories)
    ks = [p.logprobs for p in params]
    if all(k is None for k in ks):
        return Sampled(tokens)
    return Sampled(tokens, token_logprobs(logits, tokens, ks))


def sample(logits: torch.Tensor, params: SamplingParams, position: int,
           history: list[int] | None = None) -> int:
    """One token id from fp32 logits [vocab] for output position `position` (0 = first token);
    `history`: the output tokens before it (for penalties)."""
    return sample_batch(logits[None], [params], [position], [history or []])[0]


class Request(msgspec.Struct, frozen=True):
    """One generation request: token ids in, sampling settings."""

    request_id: str
    prompt: list[int]
    params: SamplingParams = SamplingParams()
