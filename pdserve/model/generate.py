"""The monolithic reference generate loop: prefill then decode in one engine.

This is the baseline every equivalence test compares against (docs/design.md §2): the same weights,
sampling seed and backend must give the same tokens through the disaggregated path.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from pdserve.model.batch import ForwardBatch
from pdserve.model.config import ModelConfig
from pdserve.model.model import HybridModel
from pdserve.model.parallel import TPGroup
from pdserve.model.sampling import (Request, SamplingParams, TokenLogprob, sample,
                                    token_logprobs)
from pdserve.model.weights import init_seeded, load_checkpoint
from pdserve.state.block_table import BlockTable
from pdserve.state.layout import RankShapes, StateLayout
from pdserve.state.pools import PoolExhausted, StatePools


def build_model(config: ModelConfig, tp: TPGroup | None = None, dtype=torch.float32,
                seed: int = 0, checkpoint: str | None = None) -> HybridModel:
    """A model with seeded weights, or loaded from an HF-format directory.

    Refuses (before allocating) a model whose weights would not fit in this machine's memory."""
    with torch.device("meta"):
        need = sum(p.numel() * p.element_size() for p in HybridModel(config, tp, dtype).parameters())
    avail = _available_memory()
    if avail is not None and need > 0.8 * avail:
        raise MemoryError(f"{config.model_type} with {config.num_hidden_layers} layers needs "
                          f"{need / 2**30:.1f} GiB of weights per rank at TP={(tp or TPGroup()).size}; "
                          f"only {avail / 2**30:.1f} GiB of memory is available")
    model = HybridModel(config, tp, dtype)
    if checkpoint is not None:
        load_checkpoint(model, checkpoint)
    else:
        init_seeded(model, seed)
    return model.eval()


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@dataclass
class Sequence:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    table: BlockTable
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "cancelled"
    # with params.logprobs: output[i]'s log-probabilities; with params.prompt_logprobs: the
    # prompt's (entry 0, the first token, has none)
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def history(self) -> list[int]:
        """The output tokens so far, for penalties: those of this sequence, after the ones a
        resumed request carries at the end of its prompt (`position_offset` of them)."""
        done = self.params.position_offset
        return (self.prompt[len(self.prompt) - done:] if done else []) + self.output

    def append(self, token: int, eos: set[int], logprob: TokenLogprob | None = None) -> None:
        self.output.append(token)
        if self.params.logprobs is not None:
            self.logprobs.append(logprob)
        if token in self.params.stop_token_ids or (token in eos and not self.params.ignore_eos):
            self.finish_reason = "stop"
        elif len(self.output) >= self.params.max_tokens:
            self.finish_reason = "length"


def sample_next(seqs: list[Sequence], logits: torch.Tensor, eos: set[int]) -> list[int]:
    """Sample each sequence's next token from its logits row (seeded by output position)."""
    out = []
    for s, row in zip(seqs, logits):
        tok = sample(row, s.params, len(s.output), s.history)
        s.append(tok, eos, token_logprobs(row[None], [tok], [s.params.logprobs])[0])
        out.append(tok)
    return out


def _score_prompt(seq: Sequence, logits: torch.Tensor) -> None:
    """Record the prompt logprobs that the logits of a prefill chunk's every row give: the row
    at prompt position q scores prompt token q + 1."""
    start = seq.table.num_tokens
    if start == 0:
        seq.prompt_logprobs = [None]
    n = min(logits.shape[0], len(seq.prompt) - 1 - start)
    if n > 0:
        seq.prompt_logprobs += token_logprobs(logits[:n], seq.prompt[start + 1:start + 1 + n],
                                              [seq.params.prompt_logprobs] * n)


class ReferenceEngine:
    """Owns a model and the state pools of one rank; runs prefill and decode steps."""

    def __init__(self, model: HybridModel, layout: StateLayout | None = None,
                 num_pages: int = 256, num_slots: int = 16, checkpoint_interval: int = 0,
                 pools: StatePools | None = None):
        """`pools`: the state pools to run in (a decode rank's own, which its decode step also
        reads); None: new ones of `layout`, `num_pages` and `num_slots`."""
        self.model, self.config = model, model.config
        if pools is None:
            pools = StatePools(RankShapes.of(self.config, model.tp.size),
                               layout or StateLayout(latent_dtype="float32", conv_dtype="float32"),
                               num_pages, num_slots, device=next(model.parameters()).device)
        self.pools, self.layout, self.shapes = pools, pools.layout, pools.shapes
        if checkpoint_interval % self.layout.page_tokens:
            raise ValueError(f"checkpoint_interval={checkpoint_interval} must be a multiple of "
                             f"page_tokens={self.layout.page_tokens}")
        self.checkpoint_interval = checkpoint_interval
        eos = self.config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])

    # -- state ------------------------------------------------------------------------------
    def admit(self, request: Request) -> Sequence:
        """Reserve pages for prompt + max_tokens and a KDA slot; refuse cleanly when full."""
        request_id, prompt, params = request.request_id, request.prompt, request.params
        if not prompt:
            raise ValueError(f"request {request_id}: empty prompt")
        bad = [t for t in prompt if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"request {request_id}: token ids {bad[:5]} outside the vocabulary "
                             f"of {self.config.vocab_size}")
        need = self.pools.latent.pages_for(len(prompt) + params.max_tokens)
        n_ckpt = (len(prompt) - 1) // self.checkpoint_interval if self.checkpoint_interval else 0
        if need > self.pools.latent.num_free or 1 + n_ckpt > self.pools.slots.num_free:
            raise PoolExhausted(f"request {request_id}: needs {need} latent pages and "
                                f"{1 + n_ckpt} KDA slots; {self.pools.latent.num_free} pages and "
                                f"{self.pools.slots.num_free} slots free")
        pages = self.pools.latent.allocate(need)
        try:  # the check above can race a prefill's checkpoint slot taken in another thread
            slot = self.pools.slots.allocate(1)[0]
        except PoolExhausted:
            self.pools.latent.free(pages)
            raise
        return Sequence(request_id, list(prompt), params.with_seed(),
                        BlockTable(latent_pages=[pages], kda_slot=slot))

    def release(self, seq: Sequence) -> None:
        """Free everything the sequence holds (idempotent)."""
        t = seq.table
        if t.latent_pages and t.latent_pages[0]:
            self.pools.latent.free(t.latent_pages[0])
            t.latent_pages = [[]]
        slots = [s for s in t.all_slots if s > 0]
        if slots:
            self.pools.slots.free(slots)
        t.kda_slot, t.checkpoints = 0, []

    # -- steps ------------------------------------------------------------------------------
    def step(self, seqs: list[Sequence], chunks: list[list[int]]) -> torch.Tensor:
        """Feed `chunks[i]` to `seqs[i]` (one batched forward); logits of each last token.
        A chunk of a prompt whose sequence asks for prompt logprobs also records them."""
        batch = ForwardBatch.of([s.table for s in seqs], [len(c) for c in chunks])
        ids = torch.tensor([t for c in chunks for t in c], dtype=torch.long,
                           device=self.pools.latent.data.device)
        scored = [i for i, s in enumerate(seqs) if s.params.prompt_logprobs is not None
                  and s.table.num_tokens < len(s.prompt)]
        if not scored:
            logits = self.model(ids, batch, self.pools, logit_rows=batch.last_rows())
        else:
            rows = [list(range(b.start, b.start + b.length)) if i in scored
                    else [b.start + b.length - 1] for i, b in enumerate(batch.seqs)]
            every = self.model(ids, batch, self.pools, logit_rows=[r for rs in rows for r in rs])
            starts = [0]
            for rs in rows:
                starts.append(starts[-1] + len(rs))
            for i in scored:
                _score_prompt(seqs[i], every[starts[i]:starts[i + 1]])
            logits = every[[end - 1 for end in starts[1:]]]
        for s, c in zip(seqs, chunks):
            s.table.num_tokens += len(c)
        return logits

    def prefill(self, seqs: list[Sequence]) -> list[int]:
        """Run every prompt token (batched, varlen) and sample each first output token.

        With `checkpoint_interval`, prompts are prefilled in chunks of that many tokens and the
        KDA state at each chunk boundary is snapshotted into a checkpoint slot."""
        step = self.checkpoint_interval or max(len(s.prompt) for s in seqs)
        logits: dict[str, torch.Tensor] = {}
        pos = 0
        while active := [s for s in seqs if pos < len(s.prompt)]:
            out = self.step(active, [s.prompt[pos:pos + step] for s in active])
            for s, row in zip(active, out):
                done = s.table.num_tokens
                if done == len(s.prompt):
                    logits[s.request_id] = row
                elif self.checkpoint_interval:
                    snap = self.pools.slots.allocate(1)[0]
                    self.pools.slots.copy(s.table.kda_slot, snap)
                    s.table.checkpoints.append((done, snap))
            pos += step
        first = []
        for s in seqs:
            row = logits[s.request_id]
            tok = sample(row, s.params, 0, s.history)
            s.append(tok, self.eos, token_logprobs(row[None], [tok], [s.params.logprobs])[0])
            first.append(tok)
        return first

    def decode(self, seqs: list[Sequence]) -> list[int]:
        """One token for every running sequence (fed its last output token)."""
        return sample_next(seqs, self.step(seqs, [[s.output[-1]] for s in seqs]), self.eos)

    def generate(self, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams,
                 on_step=None) -> list[Sequence]:
        """Prefill all prompts together, then decode the unfinished ones in one batch per step.
        State is freed as each sequence finishes. `on_step(seqs)` is called after every step."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        seqs: list[Sequence] = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
                seqs.append(self.admit(Request(f"req-{i}", list(p), sp)))
            self.prefill(seqs)
            if on_step:
                on_step(seqs)
            while running := [s for s in seqs if not s.finished]:
                self.decode(running)
                if on_step:
                    on_step(seqs)
        finally:
            for s in seqs:
                self.release(s)
        return seqs


@dataclass
class Timing:
    prefill_s: float = 0.0
    decode_s: list[float] = field(default_factory=list)


def timed_generate(engine: ReferenceEngine, prompts, params) -> tuple[list[Sequence], Timing]:
    """`generate` with wall time of the prefill and of each decode step."""
    timing, last = Timing(), [time.perf_counter(), True]

    def on_step(_):
        now = time.perf_counter()
        if last[1]:
            timing.prefill_s = now - last[0]
        else:
            timing.decode_s.append(now - last[0])
        last[:] = [now, False]

    return engine.generate(prompts, params, on_step), timing
