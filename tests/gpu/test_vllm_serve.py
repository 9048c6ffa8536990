"""`pdserve serve` with `prefill.engine = "vllm"`, on one GPU without Ray (the H200 has none).

A serving config (TOML, validated by `load_serve_config`) names the tiny model exported with the
MLA head dims vLLM 0.26 runs. In one child process: the vLLM actor's environment (`vllm_env`), a
real `VllmPrefill` built from the config (`vllm_engine_config`), one pdserve decode rank on cuda
(`decode_kwargs`), wired by `assemble_local`: the router, its prefill queue and poller, the
`EngineRanks` adapter over the engine, the config check of vLLM's cache layout, decode admission
with the NIXL transfer, and the batcher: the same `assemble` that `pdserve serve` runs over Ray
actors. The requests go in together (vLLM prefills them as one batch), through
`Router.generate`, as the OpenAI API calls it.

Check: each request's 16 streamed tokens (vLLM's first token, then pdserve's decode) equal vLLM's
own monolithic greedy generation (plain `vllm.LLM`, another process, run first), or diverge only
at a bf16 near-tie (pdserve's pick within TIE of vLLM's top log-prob there; see
test_vllm_prefill.py's TestTiny for why); no transfer failed; and vLLM holds no served request
after its next engine step.

Run on the H200: python3 -m pytest -q -x tests/gpu/test_vllm_serve.py
"""
from __future__ import annotations

import time

from pdserve.prefill.child import Child, serve_child
from vllm_fixtures import (CHILD_ENV, GPU_MEM, MAX_MODEL_LEN, NUM_GPU_BLOCKS, TINY_LENGTHS,
                           TINY_TOKENS, VLLM_MARKS, divergence_failure, make_prompts,
                           reference_kwargs, reference_main)

pytestmark = VLLM_MARKS

SERVE_TOML = """
[model]
name = "{model}"
dtype = "bfloat16"
[state]
page_tokens = 64
latent_dtype = "bfloat16"
recurrent_dtype = "float32"
conv_dtype = "bfloat16"
[prefill]
engine = "vllm"
tp = 1
[prefill.vllm]
max_model_len = {max_model_len}
gpu_memory_utilization = {gpu_mem}
num_gpu_blocks = {blocks}
enforce_eager = true
[prefill.vllm.env]
VLLM_USE_FLASHINFER_SAMPLER = "0"
[decode]
tp = 1
num_pages = 256
num_slots = 17
max_batch = 16
[transfer]
# generous: on one GPU without NVLink peers UCX may fall back to its TCP emulation (~0.45 GB/s)
deadline_s = 60.0
expected_gbps = 0.05
lease_s = 30.0
[resources]
gpus_per_rank = 1
call_timeout_s = 180
"""


def serve_main(conn, config_path: str, env: dict) -> None:
    """The in-process deployment of `config_path`: VllmPrefill + a cuda decode rank + router."""
    def build():
        import asyncio
        import os

        from pdserve.cluster.config import load_serve_config, vllm_engine_config, vllm_env
        from pdserve.cluster.serve import assemble_local, decode_kwargs, prepare_vllm_model
        from pdserve.decode.rank import DecodeRank
        from pdserve.model.sampling import Request, SamplingParams
        from pdserve.prefill.vllm_engine import VllmPrefill

        cfg, model = load_serve_config(config_path)
        os.environ.update(vllm_env(cfg))         # what the engine actor sets before vLLM
        model_dir = prepare_vllm_model(cfg, model)
        engine = VllmPrefill("prefill-0", 0, vllm_engine_config(cfg, model_dir))
        # after vLLM's start-up, so its memory profiling does not count the decode pools
        rank = DecodeRank("decode-0", 0, config=model, seed=cfg.model.seed,
                          checkpoint=str(model_dir), device="cuda", dtype=cfg.model.dtype,
                          **decode_kwargs(cfg))
        router = assemble_local(cfg, model, [engine], [rank])

        async def one(rid, prompt, max_tokens):
            out, finish = [], None
            req = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            async for ev in router.generate(req, 300.0):
                if ev.finish_reason == "error":
                    raise RuntimeError(f"request {rid}: {ev.error}")
                if ev.token is not None:
                    out.append(ev.token)
                finish = ev.finish_reason or finish
            return out, finish

        def generate(reqs):
            async def main():
                return await asyncio.gather(*[one(*r) for r in reqs])
            t0 = time.perf_counter()
            res = asyncio.run(main())
            return res, time.perf_counter() - t0

        def close():
            asyncio.run(router.close())
            for inst in router.instances:
                inst.kill()

        return {"generate": generate,
                "info": lambda: {"max_context": router.max_context, "model_dir": str(model_dir),
                                 "geometry": str(engine.geometry()), "health": router.health()},
                "stats": lambda: {**router.stats(), "decode": rank.stats()},
                "held": lambda: engine._rpc("pdserve_held"),
                "close": close}

    serve_child(conn, "pdserve-serve-vllm", build, env)


def test_served_greedy_tokens_equal_vllm_monolithic(tiny_dir, tmp_path):
    from pdserve.model.config import load_config

    vocab = load_config(tiny_dir).vocab_size
    prompts = make_prompts(TINY_LENGTHS, vocab)
    # vLLM's own generation first, in a process that exits before the deployment starts
    with Child("vllm-reference-serve", reference_main, tiny_dir, reference_kwargs(vocab),
               CHILD_ENV) as ref:
        want = ref.call("generate", prompts, TINY_TOKENS, vocab, "all", vocab)
    path = tmp_path / "serve-vllm.toml"
    path.write_text(SERVE_TOML.format(model=tiny_dir, max_model_len=MAX_MODEL_LEN,
                                      gpu_mem=GPU_MEM, blocks=NUM_GPU_BLOCKS))
    with Child("pdserve-serve-vllm", serve_main, str(path), CHILD_ENV) as srv:
        info = srv.call("info")
        print(f"[serve] {info}", flush=True)
        assert info["health"] is None and info["model_dir"] == str(tiny_dir)
        assert info["max_context"] == MAX_MODEL_LEN
        reqs = [(f"serve-{n}", p, TINY_TOKENS) for n, p in zip(TINY_LENGTHS, prompts)]
        results, secs = srv.call("generate", reqs, timeout=600)
        print(f"[serve] {len(reqs)} requests in {secs:.2f} s", flush=True)
        failures = []
        for n, (got, finish), (w, dense, margins) in zip(TINY_LENGTHS, results, want):
            print(f"  {n:4d} tokens: vLLM    {w}\n              served  {got} ({finish})",
                  flush=True)
            if len(got) != TINY_TOKENS or finish != "length":
                failures.append(f"{n}-token prompt: {len(got)} tokens, finish {finish!r}")
                continue
            if got[0] != w[0]:
                failures.append(f"{n}-token prompt: first token {got[0]} != vLLM's {w[0]} (both "
                                "from vLLM: the prefill path is wrong)")
                continue
            if msg := divergence_failure(n, got, w, dense, margins, who="the served"):
                failures.append(msg)
        assert not failures, "; ".join(failures)
        stats = srv.call("stats")
        print(f"[serve] router stats {stats}", flush=True)
        assert stats["decode"].get("transfer_failures", 0) == 0
        # the decode side sent "done" for every request: vLLM frees them at its next engine
        # step, so after one more request at most that one is held (its own "done" comes later)
        srv.call("generate", [("serve-after", prompts[0], 2)], timeout=300)
        still = {r for rank in srv.call("held") for r in rank}
        assert len(still) <= 1, f"vLLM still holds {sorted(still)} after the decode side read them"
