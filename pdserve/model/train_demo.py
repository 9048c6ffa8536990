"""The `demo` preset's weights: the tiny architecture (KDA + MLA + MoE, byte vocabulary) trained
for a few CPU minutes on English every Python has offline, CPython's pydoc topics
(`pydoc_data/topics.py`), so that `pdserve demo` and `pdserve generate` print readable text.

    python -m pdserve.model.train_demo [--steps 600] [--seed 0] [--out pdserve/model/demo]

Training runs the served forward itself (`HybridModel.forward` with autograd, over fresh state
pools each step), so the trained function is exactly the one prefill and decode compute. Every
tenth topic is held out for `perplexity`. One torch thread and a seeded init and data order make
a run reproducible from its seed on one machine (other CPUs' kernels round differently, and
another Python's topics differ a little).
"""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import msgspec
import torch
import torch.nn.functional as F

from pdserve.model.batch import ForwardBatch
from pdserve.model.config import SHIPPED_WEIGHTS, ModelConfig, preset
from pdserve.model.model import HybridModel
from pdserve.model.weights import init_seeded, save_checkpoint
from pdserve.state.block_table import BlockTable
from pdserve.state.layout import RankShapes, StateLayout
from pdserve.state.pools import StatePools

HELDOUT_EVERY = 10  # topic i (in key order) is held out when i % HELDOUT_EVERY == 0
LAYOUT = StateLayout(latent_dtype="float32", conv_dtype="float32")
# Openings of training topics: the demo model continues them in the topics' English
# (`pdserve demo` and `pdserve generate` default to them).
PROMPTS = ('The "for" statement is used to ', "A class definition defines ",
           "Exceptions are a means of ", "A function definition defines ",
           "Strings implement all of the ", 'The "with" statement is used to ')


class Corpus(msgspec.Struct, frozen=True):
    train: bytes
    heldout: bytes


class TrainConfig(msgspec.Struct, frozen=True):
    steps: int = 600
    seed: int = 0
    batch: int = 8            # sequences per step
    length: int = 128         # bytes per sequence
    lr: float = 3e-3          # peak; linear warm-up, then cosine down to lr / 10
    warmup: int = 30
    weight_decay: float = 0.1  # on matrices only
    clip: float = 1.0         # gradient norm


def corpus() -> Corpus:
    """The pydoc topics as UTF-8 bytes, in key order, every HELDOUT_EVERY-th held out."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    # a text listed under two keys counts once ("else" is "if"), so none is on both sides
    texts = list(dict.fromkeys(topics[key] for key in sorted(topics)))
    parts: tuple[list[str], list[str]] = ([], [])
    for i, text in enumerate(texts):
        parts[i % HELDOUT_EVERY == 0].append(text)
    train, heldout = ("\n\n".join(p).encode() for p in parts)
    return Corpus(train, heldout)


def logits(model: HybridModel, rows: torch.Tensor, grad: bool = False) -> torch.Tensor:
    """fp32 logits [B * L, vocab] of every position of `rows` [B, L] (byte ids), each row a
    fresh sequence; `grad` runs the forward with autograd (its no_grad decorator unwrapped)."""
    B, L = rows.shape
    shapes = RankShapes.of(model.config, model.tp.size)
    pages = -(-L // LAYOUT.page_tokens)
    pools = StatePools(shapes, LAYOUT, B * pages + 1, B + 1)
    tables = [BlockTable(latent_pages=[pools.latent.allocate(pages)],
                         kda_slot=pools.slots.allocate(1)[0]) for _ in range(B)]
    forward = HybridModel.forward.__wrapped__ if grad else HybridModel.forward
    return forward(model, rows.reshape(-1), ForwardBatch.of(tables, [L] * B), pools)


def perplexity(model: HybridModel, text: bytes, length: int = 256, batch: int = 8) -> float:
    """Per-byte perplexity of `text` through the reference forward, in windows of `length`
    predicted bytes (each window a fresh sequence; a tail shorter than a window is left out)."""
    data = torch.tensor(list(text), dtype=torch.long)
    n = (len(data) - 1) // length
    if n < 1:
        raise ValueError(f"{len(text)} bytes do not fill one window of {length} + 1")
    total = 0.0
    for start in range(0, n, batch):
        idx = torch.arange(start, min(start + batch, n))[:, None] * length + torch.arange(length + 1)
        windows = data[idx]
        out = logits(model, windows[:, :-1])
        total += F.cross_entropy(out, windows[:, 1:].reshape(-1), reduction="sum").item()
    return math.exp(total / (n * length))


def _lr(tc: TrainConfig, step: int) -> float:
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    progress = (step - tc.warmup) / max(tc.steps - tc.warmup, 1)
    return tc.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(tc: TrainConfig, config: ModelConfig | None = None, text: bytes | None = None,
          log=print) -> HybridModel:
    """The model of `config` (default: the demo preset) trained from its seeded init on random
    windows of `text` (default: the corpus' training part)."""
    config = config or preset("demo")
    data = torch.tensor(list(corpus().train if text is None else text), dtype=torch.long)
    model = HybridModel(config)
    init_seeded(model, tc.seed)
    params = list(model.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2],
                              "weight_decay": tc.weight_decay},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=tc.lr, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(tc.seed)
    t0 = time.perf_counter()
    for step in range(tc.steps):
        starts = torch.randint(0, len(data) - tc.length - 1, (tc.batch, 1), generator=g)
        windows = data[starts + torch.arange(tc.length + 1)]
        loss = F.cross_entropy(logits(model, windows[:, :-1], grad=True),
                               windows[:, 1:].reshape(-1))
        for group in opt.param_groups:
            group["lr"] = _lr(tc, step)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, tc.clip)
        opt.step()
        if step % 50 == 0 or step == tc.steps - 1:
            log(f"step {step:4d}  loss {loss.item():.3f} nats/byte  "
                f"{time.perf_counter() - t0:6.1f} s")
    for p in params:
        p.requires_grad_(False)
    return model.eval()


def save(model: HybridModel, out: str | Path) -> Path:
    """`config.json` + `model.safetensors` (bf16: half the bytes; the served fp32 model loads
    the rounded values, and `perplexity` is measured on them)."""
    tensors = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    return save_checkpoint(out, model.config, tensors)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdserve.model.train_demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = TrainConfig()
    ap.add_argument("--steps", type=int, default=defaults.steps)
    ap.add_argument("--seed", type=int, default=defaults.seed)
    ap.add_argument("--out", default=str(SHIPPED_WEIGHTS["demo"]),
                    help="output directory (default: the shipped demo weights)")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    torch.set_num_threads(1)
    model = train(TrainConfig(steps=args.steps, seed=args.seed))
    out = save(model, args.out)
    from pdserve.model.generate import build_model
    shipped = build_model(model.config, checkpoint=str(out))
    print(f"wrote {out}; held-out perplexity {perplexity(shipped, corpus().heldout):.3f} "
          "per byte (bf16 weights)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
