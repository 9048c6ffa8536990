"""Helpers and fixtures shared by the stock-vLLM GPU tests (test_vllm_prefill.py,
test_vllm_serve.py): seeded prompts, vLLM's own monolithic generation in a child process, the
tiny model exported with the MLA head dims vLLM 0.26 runs, and the skip marks."""
from __future__ import annotations

import importlib.util
import math
import os
import random

import pytest
import torch

from pdserve.model.weights import export_checkpoint
from pdserve.prefill.child import serve_child

SEED = 7
GPU_MEM = 0.3             # of the GPU for each vLLM engine, so a decode process fits beside it
NUM_GPU_BLOCKS = 64       # also bounds the NIXL descriptors the decode side prepares
MAX_MODEL_LEN = 1024
TINY_LENGTHS = (5, 70, 300)
TINY_TOKENS = 16
TIE = 0.125               # log-prob: 8 bf16 steps of a logit in [2, 4); near-ties below it
# Both engines' model dtype, and the format the weights are exported in (so both load identical
# values). fp16 by default: its rounding noise on the reduced kimi's first decode step is 1.3e-3
# against 1.0-1.2e-2 for bf16 (benchmarks/results/precision_noise_cpu.json), so the 1e-2 logit
# criterion tests the handoff, not two engines' bf16 rounding. PDSERVE_VLLM_TEST_DTYPE=bfloat16
# runs the deployment dtype.
DTYPE = os.environ.get("PDSERVE_VLLM_TEST_DTYPE", "float16")
CHILD_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0",   # its JIT sources are not on the H200 carry
             "TOKENIZERS_PARALLELISM": "false"}


def have(*names: str) -> bool:
    return any(importlib.util.find_spec(n) is not None for n in names)


VLLM_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (H200 via the device tool)"),
    pytest.mark.skipif(not have("vllm"), reason="vllm is not importable (the H200 gets vLLM 0.26.0 "
                       "from shared/device/make-vllm-carry.sh; see docs/vllm.md)"),
    pytest.mark.skipif(not have("nixl_cu12", "nixl_cu13", "nixl"), reason="NIXL is not installed"),
]


# == pure helpers (no GPU) ===========================================================================
def make_prompts(lengths, vocab: int, seed: int = SEED) -> list[list[int]]:
    """Seeded random token ids, one prompt per length (no special tokens: both sides take ids)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def dense_logprobs(entry, vocab: int) -> list[float]:
    """vLLM's {token: Logprob} for one position -> a dense list; tokens it left out are NaN."""
    out = [math.nan] * vocab
    for tok, lp in entry.items():
        if 0 <= tok < vocab:
            out[tok] = float(getattr(lp, "logprob", lp))
    return out


def top2_margin(entry) -> float:
    """Top-1 minus top-2 log-probability of one vLLM position (inf with a single entry)."""
    top = sorted((float(getattr(lp, "logprob", lp)) for lp in entry.values()), reverse=True)
    return top[0] - top[1] if len(top) > 1 else math.inf


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or of the shorter list's end), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def divergence_failure(n: int, got: list[int], want: list[int], dense, margins,
                       who: str = "pdserve's") -> str | None:
    """Print where greedy `got` leaves vLLM's `want` (n-token prompt); a failure message unless
    `who` pick there is within TIE of vLLM's top (a bf16 near-tie, numerics, not an error)."""
    i = first_divergence(got, want)
    if i is None:
        return None
    gap = max(dense[i]) - dense[i][got[i]]
    print(f"        diverges at {i}: vLLM's top-2 margin {margins[i]:.4f}, {who} pick {gap:.4f} "
          "below vLLM's top", flush=True)
    if gap > TIE:
        return (f"{n}-token prompt diverges at token {i} with {who} pick {gap:.4f} below "
                f"vLLM's top (> {TIE})")
    return None


# == vLLM's own generation ========================================================================
def reference_main(conn, model_dir: str, llm_kwargs: dict, env: dict) -> None:
    """Plain `vllm.LLM` (no connector): vLLM's own monolithic generation."""
    def build():
        from vllm import LLM, SamplingParams

        llm = LLM(model=model_dir, **llm_kwargs)

        def generate(prompts, max_tokens, k, dense_at, vocab):
            """Greedy; per prompt (tokens, dense log-probs at output position `dense_at` (every
            position for "all") when k == vocab, vLLM's top-1 minus top-2 log-prob at every
            position)."""
            sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                detokenize=False, logprobs=k)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
            res = []
            for o in outs:
                c = o.outputs[0]
                entries = [c.logprobs[i] for i in range(len(c.token_ids))]
                margins = [top2_margin(e) for e in entries]
                if dense_at == "all":
                    dense = [dense_logprobs(e, vocab) for e in entries]
                else:
                    dense = dense_logprobs(entries[dense_at], vocab) if dense_at is not None else None
                res.append((list(c.token_ids), dense, margins))
            return res

        return {"generate": generate}

    serve_child(conn, "vllm-reference", build, env)


def reference_kwargs(vocab: int) -> dict:
    """A plain engine with the prefill engine's numerics (eager, DTYPE, same cache) + logprobs."""
    return dict(dtype=DTYPE, max_model_len=MAX_MODEL_LEN, gpu_memory_utilization=GPU_MEM,
                enforce_eager=True, skip_tokenizer_init=True, enable_prefix_caching=False,
                async_scheduling=False, num_gpu_blocks_override=NUM_GPU_BLOCKS,
                max_logprobs=vocab, seed=0)


# vLLM 0.26's MLA prefill backends accept only Kimi's MLA geometry (seen on the H200: "No valid
# MLA prefill backend ... got (qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)"), so the
# tiny model keeps its 4 layers / 128 hidden / byte vocabulary and takes Kimi's MLA head dims.
TINY_VLLM = dict(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=512)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from pdserve.model.config import preset
    return str(export_checkpoint(str(tmp_path_factory.mktemp("tiny-hf")),
                                 preset("tiny", **TINY_VLLM), seed=SEED, dtype=getattr(torch, DTYPE)))


