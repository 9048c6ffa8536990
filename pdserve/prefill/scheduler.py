"""Chunked prefill: which prompt tokens each step of a reference prefill rank runs.

A step runs prompt tokens of any number of prompts, in one forward, up to a `budget`: a chunk
starting at position p costs a token per token, or p / `CONTEXT_TOKENS` per token once p passes
`CONTEXT_TOKENS`, as its MLA attention reads the whole context before it (expanded again in
every step), so a step deep into a long prompt takes fewer tokens and takes about as long as one
near its start. Prompts whose rest fits go first, fewest tokens
left first, and a step that finishes any prompt runs only those: a short prompt that arrives
while a long one prefills waits for the step under way and then runs alone, not beside the long
one's next chunk. The oldest prompt in progress, when the step before left it out (or when
nothing else fits), gets at least one unit, so a stream of short prompts cannot starve it.

Chunks are cut where the result stays bit-exact with prefilling the prompt whole and alone
(reference backend): a cut falls on a multiple of the KDA delta rule's chunk (`UNIT`), so the
rule runs the same chunks either way, and never leaves a single token (a one-token step takes
the decode forms of KDA and MLA), at the cost of a step running one token over the budget. A
prompt may also name stops, positions a chunk must end at (where the prefix cache takes a KDA
checkpoint); they are unit boundaries too. The
model computes each row alike whatever else shares its step (`pdserve.model.parallel.MIN_ROWS`,
`pdserve.model.mla.NAIVE_ROWS`).
"""
from __future__ import annotations

from pdserve.model.generate import Sequence
from pdserve.model.kda_ops import CHUNK_TOKENS

UNIT = CHUNK_TOKENS
# The context length from which a prompt token's MLA attention costs about as much as the rest
# of its forward, and the cost grows with it (the tiny preset on the CPU: a 64-token step takes
# ~16 ms at position 0 and ~72 ms at 15K; rounded down).
CONTEXT_TOKENS = 2048


def cost(pos: int, n: int) -> int:
    """What a chunk of `n` prompt tokens from position `pos` costs of a step's budget: a token
    each within `CONTEXT_TOKENS` of context, pos / `CONTEXT_TOKENS` each (rounded up) past it."""
    return -(-n * max(pos, CONTEXT_TOKENS) // CONTEXT_TOKENS)


def check_budget(budget: int | None) -> None:
    """Refuse a per-step budget that cannot cut chunks on `UNIT` boundaries (None: no budget)."""
    if budget is not None and (budget < UNIT or budget % UNIT):
        raise ValueError(f"the prefill step budget must be a positive multiple of {UNIT} "
                         f"tokens (the KDA chunk), got {budget}")


class ChunkScheduler:
    """The prompts in progress on one rank, in arrival order, and the plan of each step.

    Every TP rank of an instance gets the same calls in the same order and so makes the same
    plans (the plan depends only on them)."""

    def __init__(self, budget: int | None):
        """`budget`: the cost of prompt tokens per step (`cost`); None = every prompt whole in
        its first step."""
        check_budget(budget)
        self.budget = budget
        self._seqs: list[Sequence] = []
        self._stops: dict[str, list[int]] = {}
        self._left_out: str | None = None  # the oldest prompt, when the last plan left it out

    def __len__(self) -> int:
        return len(self._seqs)

    def add(self, seq: Sequence, stops: list[int] = ()) -> None:
        """`stops`: ascending prompt positions, multiples of `UNIT`, that chunks end at."""
        self._seqs.append(seq)
        self._stops[seq.request_id] = list(stops)

    def remove(self, request_id: str) -> Sequence | None:
        for i, s in enumerate(self._seqs):
            if s.request_id == request_id:
                del self._stops[request_id]
                return self._seqs.pop(i)
        return None

    def _end(self, seq: Sequence) -> int:
        """Where `seq`'s next chunk ends at the latest: its next stop, else its prompt's end."""
        pos = seq.table.num_tokens
        return next((p for p in self._stops[seq.request_id] if p > pos), len(seq.prompt))

    def plan(self) -> list[tuple[Sequence, list[int]]]:
        """The next step: (sequence, its chunk of prompt tokens), in arrival order."""
        if self.budget is None:
            return [(s, s.prompt[s.table.num_tokens:self._end(s)]) for s in self._seqs]
        if not self._seqs:
            return []
        oldest, take, used = self._seqs[0], {}, 0
        if self._left_out == oldest.request_id:
            take[oldest.request_id] = n = _cut(oldest, 0, self._end(oldest), unit=True)
            used = cost(oldest.table.num_tokens, n)
        order = sorted(self._seqs, key=_left)  # stable: ties go in arrival order
        for s in order:  # the prompts whose rest fits, fewest tokens left first
            pos, had = s.table.num_tokens, take.get(s.request_id, 0)
            left = len(s.prompt) - pos
            if self._end(s) == len(s.prompt) and left > had and (
                    used - cost(pos, had) + cost(pos, left) <= self.budget):
                used += cost(pos, left) - cost(pos, had)
                take[s.request_id] = left
        if not any(take.get(s.request_id) == _left(s) for s in self._seqs):
            for s in order:  # none finishes: fill the step, fewest tokens left first
                pos, had = s.table.num_tokens, take.get(s.request_id, 0)
                n = _cut(s, self.budget - used + cost(pos, had), self._end(s))
                if n > had:
                    used += cost(pos, n) - cost(pos, had)
                    take[s.request_id] = n
        if not take:  # nothing fits (a tight budget deep into a prompt): one unit
            take[oldest.request_id] = _cut(oldest, 0, self._end(oldest), unit=True)
        self._left_out = None if take.get(oldest.request_id) else oldest.request_id
        return [(s, s.prompt[s.table.num_tokens:s.table.num_tokens + take[s.request_id]])
                for s in self._seqs if take.get(s.request_id)]


def _left(seq: Sequence) -> int:
    return len(seq.prompt) - seq.table.num_tokens


def _cut(seq: Sequence, allowance: int, total: int, unit: bool = False) -> int:
    """How many of `seq`'s next prompt tokens, up to position `total` (its prompt's end or a
    stop), fit `allowance` (`cost`) with the chunk cut where the result stays bit-exact (module
    docstring); 0 if none do. `unit`: at least one unit, whatever it costs."""
    pos = seq.table.num_tokens
    if cost(pos, total - pos) <= allowance:
        return total - pos
    end = pos  # pos is on a unit boundary (every cut is)
    while end + UNIT < total and (cost(pos, end + UNIT - pos) <= allowance
                                  or (unit and end == pos)):
        end += UNIT
    if end == pos:
        return total - pos if unit else 0  # (unit: the rest is at most one unit)
    if total - end == 1:  # never leave one token alone: one unit less, or one token over
        end = end - UNIT if end - UNIT > pos else total
    return end - pos
