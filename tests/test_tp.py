"""TP = 2 (two processes, gloo) computes the same model as TP = 1."""
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pdserve.model.config import preset
from pdserve.model.generate import ReferenceEngine, build_model
from pdserve.model.parallel import TPGroup
from pdserve.model.sampling import Request, SamplingParams
from pdserve.state.layout import StateLayout

PROMPTS = [list(b"tensor parallel"), list(b"KDA + MLA hybrid model, sharded by heads")]
FORCED = [11, 200, 3]
LAYOUT = StateLayout(page_tokens=16, latent_dtype="float32", conv_dtype="float32")


def _logits_and_tokens(tp: TPGroup):
    torch.set_num_threads(1)
    model = build_model(preset("tiny"), tp, seed=7)
    eng = ReferenceEngine(model, LAYOUT, num_pages=32, num_slots=4)
    seqs = [eng.admit(Request(f"r{i}", p, SamplingParams(max_tokens=len(FORCED) + 1)))
            for i, p in enumerate(PROMPTS)]
    rows = [eng.step(seqs, PROMPTS)]
    for t in FORCED:
        rows.append(eng.step(seqs, [[t], [t]]))
    for s in seqs:
        eng.release(s)
    greedy = eng.generate(PROMPTS, SamplingParams(max_tokens=6))
    sampled = eng.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=5))
    return (torch.stack(rows), [s.output for s in greedy], [s.output for s in sampled],
            eng.pools.slots.recurrent.shape, eng.pools.empty)


def _worker(fn, rank, world, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.save(fn(TPGroup.from_dist()), os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def tp_results(fn, world: int = 2, timeout_s: float = 240) -> list:
    """fn(tp) on `world` spawned gloo processes (fn importable from a module): what each rank
    returned, in rank order."""
    with tempfile.TemporaryDirectory() as d:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_worker, args=(fn, r, world, os.path.join(d, "init"), d))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=timeout_s)
            assert not p.is_alive(), "TP worker hung"
            assert p.exitcode == 0, f"TP worker failed with exit code {p.exitcode}"
        return [torch.load(os.path.join(d, f"{r}.pt"), weights_only=False) for r in range(world)]


def test_tp2_equals_tp1():
    ref_logits, ref_greedy, ref_sampled, ref_shape, _ = _logits_and_tokens(TPGroup())
    results = tp_results(_logits_and_tokens)
    for logits, greedy, sampled, shape, empty in results:
        scale = ref_logits.abs().max()
        assert torch.allclose(logits, ref_logits, atol=1e-5 * scale, rtol=0)
        assert greedy == ref_greedy and sampled == ref_sampled
        assert shape[2] == ref_shape[2] // 2  # each rank holds half the KDA heads
        assert empty
