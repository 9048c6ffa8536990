"""Chunked prefill: which prompt tokens each step of a reference prefill rank runs.

A step runs at most `budget` prompt tokens, of any number of prompts, in one forward. Prompts
with the fewest tokens left go first, so a short prompt that arrives while a long one prefills is
done one step later rather than after the long one's whole prefill; the oldest prompt in progress
gets at least one unit every step, so a stream of short prompts cannot starve it.

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
        """`budget`: prompt tokens per step; None = every prompt whole in its first step."""
        check_budget(budget)
        self.budget = budget
        self._seqs: list[Sequence] = []
        self._stops: dict[str, list[int]] = {}

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
        oldest = self._seqs[0]
        take = {oldest.request_id: _cut(oldest, UNIT, self._end(oldest))}
        used = take[oldest.request_id]
        # fewest tokens left first; sorted() is stable, so ties go in arrival order
        for s in sorted(self._seqs, key=_left):
            had = take.get(s.request_id, 0)
            n = _cut(s, self.budget - used + had, self._end(s))
            if n > had:
                used += n - had
                take[s.request_id] = n
        return [(s, s.prompt[s.table.num_tokens:s.table.num_tokens + take[s.request_id]])
                for s in self._seqs if take.get(s.request_id)]


def _left(seq: Sequence) -> int:
    return len(seq.prompt) - seq.table.num_tokens


def _cut(seq: Sequence, allowance: int, total: int) -> int:
    """How many of `seq`'s next prompt tokens, up to position `total` (its prompt's end or a
    stop), fit `allowance` with the chunk cut where the result stays bit-exact (module
    docstring); 0 if none do."""
    pos = seq.table.num_tokens
    if total - pos <= allowance:
        return total - pos
    end = (pos + allowance) // UNIT * UNIT  # pos is on a unit boundary (every cut is)
    if end <= pos:
        return 0
    if total - end == 1:  # never leave one token alone: one unit less, or one token over
        end = end - UNIT if end - UNIT > pos else total
    return end - pos
