"""Decode step at Kimi-Linear-48B-A3B shapes on one GPU: pdserve's fused step (decode.backend =
"cutedsl", one CUDA graph per batch bucket) against stock vLLM at the same shapes, run in child
processes of the same device session so every ratio comes from one machine.

pdserve: random bf16 weights made on the GPU, random cached state (latent rows, KDA recurrent
and conv state) at the given context. A row's step time is the wall time of one serving step:
the packed inputs copied in, the graph replayed, the greedy token ids copied out (median over
--steps). `kernels_per_layer` comes from a profiled eager step; `breakdown` lists one KDA+MoE
and one MLA+MoE layer's kernels (eager, profiled) at B=1 and B=32; `floor_ms` is the bytes a
step must move (weights of the experts some token chose, the other weights, the LM head, the
KDA state read and written, the latent rows read) at --copy-gbps.

Routing: "concentrated" makes the router's correction bias dominate, so every token of a layer
picks the same 8 experts, which is what vLLM's dummy weights (uniform +-1e-3) do; the vLLM
comparison is made at that routing, the same expert bytes on both sides. "random" is pdserve's
own init, where the tokens of a batch spread over many experts (reported per row).

stock vLLM: `vllm.LLM(load_format="dummy", compilation_config={"mode": 0, "cudagraph_mode":
"FULL_DECODE_ONLY"})`, one process per layer count; inter-token latency from the generate
timings of two output lengths (the prompt prefill cancels).

    python benchmarks/decode_step.py [--layers 8 27] [--batches 1 8 32 64]
        [--contexts 512 8192] [--routing concentrated random] [--what pdserve vllm]
        [--merge FILE ...] [--out DIR] [--name decode_step_h200] [--commit SHA]
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

COPY_GBPS = 4245.0      # H200 device copy (read + write), ../shared/device/README.md
VLLM_OUT = (4, 132)     # output lengths whose time difference gives vLLM's ITL


def kimi_config(layers: int):
    from pdserve.model.config import reduced_kimi_linear
    return reduced_kimi_linear(layers, num_experts=256, top_k=8, vocab_size=163840)


# -- pdserve ---------------------------------------------------------------------------------
def build(layers: int, seed: int = 0):
    import torch
    from pdserve.model.model import HybridModel
    from pdserve.model.weights import init_random
    config = kimi_config(layers)
    with torch.device("cuda"):
        model = HybridModel(config, dtype=torch.bfloat16).eval()
    init_random(model, seed)
    return config, model


def set_routing(model, routing: str) -> None:
    """Routing "concentrated": the correction bias x100 dominates the router's choice (vLLM's dummy
    weights behave so); "random": the init's own bias. In place, so a captured graph sees it."""
    scale = {"concentrated": 100.0, "random": 1.0}[routing]
    for layer in model.model.layers:
        moe = getattr(layer, "block_sparse_moe", None)
        if moe is not None:
            b = moe.gate.e_score_correction_bias
            if not hasattr(b, "init_bias"):
                b.init_bias = b.detach().clone()
            b.data.copy_(b.init_bias * scale)


def random_state(pools, seed: int = 1):
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    for t, scale in ((pools.latent.data, 1.0), (pools.slots.recurrent, 0.05),
                     (pools.slots.conv, 1.0)):
        for chunk in t.view(-1, t.shape[-1]).split(1 << 16):
            chunk.copy_(torch.randn(chunk.shape, generator=g, device="cuda") * scale)


def weight_bytes(model, config, experts_touched: float) -> dict:
    """Bytes of weights one step reads: every non-expert weight, the chosen experts."""
    expert = sum(p.numel() * p.element_size()
                 for p in model.model.layers[1].block_sparse_moe.experts[0].parameters())
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    moe_layers = sum(1 for layer in model.model.layers if hasattr(layer, "block_sparse_moe"))
    all_experts = moe_layers * config.num_experts * expert
    embed = model.model.embed_tokens.weight
    dense = total - all_experts - embed.numel() * embed.element_size()
    return {"dense": dense, "experts": experts_touched * moe_layers * expert}


def profile_kernels(fn) -> list[tuple[str, float]]:
    """(kernel name, device µs) of every kernel fn() launches, in launch order."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
              and not e.name.startswith(("Memcpy", "Memset"))]
    return [(e.name, e.device_time) for e in events]


def _short(name: str) -> str:
    return name.split("(")[0][:70]


def breakdown(fused, batch_fn, B: int) -> dict:
    """Kernels of layer 1 (KDA + MoE) and of the first MLA layer at batch B, eager."""
    import torch
    x = torch.randn(B, fused.model.config.hidden_size, device="cuda").to(torch.bfloat16)
    h = torch.empty_like(x)
    batch = batch_fn(B)
    delta = fused.layer(0, x, None, h, batch)
    out = {}
    mla = next(i for i, (layer, *_) in enumerate(fused.layers) if not layer.is_kda)
    for name, i in (("kda_moe", 1), ("mla_moe", mla)):
        fused.layer(i, x, delta, h, batch)
        ks = profile_kernels(lambda: fused.layer(i, x, delta, h, batch))
        total = sum(t for _, t in ks)
        out[name] = {"kernels": len(ks), "us": round(total, 1),
                     "top": [{"kernel": _short(n), "us": round(t, 1),
                              "share": round(t / total, 3)}
                             for n, t in sorted(ks, key=lambda kt: -kt[1])[:12]]}
    return out


def run_pdserve(layers, batches, contexts, routings, steps):
    import torch
    from pdserve.decode.fused_step import FusedDecodeStep
    from pdserve.decode.graphs import DecodeGraphs
    from pdserve.kernels import registry
    from pdserve.model.batch import DecodeBatch
    from pdserve.state.block_table import BlockTable
    from pdserve.state.layout import RankShapes, StateLayout
    from pdserve.state.pools import StatePools

    t0 = time.time()
    config, model = build(layers)
    layout = StateLayout(latent_dtype="bfloat16", recurrent_dtype="float32",
                         conv_dtype="bfloat16")
    Bmax, Lmax = max(batches), max(contexts) + steps + 64
    pages_per = -(-Lmax // layout.page_tokens)
    pools = StatePools(RankShapes.of(config, 1), layout, Bmax * pages_per + 1, Bmax + 1,
                       device="cuda")
    random_state(pools)
    fused = FusedDecodeStep(model, pools, "cutedsl")
    stage(f"{layers} layers: built in {time.time() - t0:.0f} s")

    def tables_for(B, ctx):
        return [BlockTable([list(range(1 + i * pages_per, 1 + (i + 1) * pages_per))], 1 + i,
                           [], ctx) for i in range(B)]

    rows = []
    state_per_req = (pools.slots.recurrent[:, 0].numel() * 4 + pools.slots.conv[:, 0].numel() * 2)
    for routing in routings:
        set_routing(model, routing)
        for ctx in contexts:
            graphs = DecodeGraphs(model, pools, ctx + steps + 64, buckets=tuple(batches),
                                  forward=fused)
            for B in batches:
                tables = tables_for(B, ctx)
                tokens = [(7 * i + 3) % config.vocab_size for i in range(B)]
                for _ in range(3):
                    graphs.run(tables, tokens)[1].tolist()
                times = []
                for _ in range(steps):
                    t = time.perf_counter()
                    graphs.run(tables, tokens)[1].tolist()
                    times.append((time.perf_counter() - t) * 1e3)
                ms = statistics.median(times)
                batch = DecodeBatch.of(tables, layout.page_tokens, "cuda")
                ids = torch.tensor(tokens, device="cuda")
                ks = profile_kernels(lambda: fused(ids, batch))
                touched = experts_touched(fused, ids, batch)
                wb = weight_bytes(model, config, touched)
                latent = len(config.mla_layer_ids) * B * (ctx + 1) * pools.latent.width * 2
                state = 2 * B * state_per_req
                lm = model.lm_head.weight.numel() * 2
                floor_bytes = wb["dense"] + wb["experts"] + state + latent
                floor_ms = floor_bytes / (COPY_GBPS * 1e9) * 1e3
                rows.append({"layers": layers, "batch": B, "context": ctx, "routing": routing,
                             "pdserve_ms": round(ms, 3), "tok_s_user": round(1e3 / ms, 1),
                             "kernels_per_layer": round(len(ks) / layers, 1),
                             "experts_touched_per_layer": round(touched, 1),
                             "floor_ms": round(floor_ms, 3),
                             "share_of_floor": round(floor_ms / ms, 3),
                             "bytes": {"weights": wb["dense"], "experts": wb["experts"],
                                       "lm_head": lm, "kda_state": state, "latent": latent}})
                stage(f"  {routing} ctx {ctx} B {B}: {ms:.3f} ms, {len(ks) / layers:.1f} kernels/layer, "
                      f"{touched:.0f} experts/layer, floor {floor_ms:.3f} ms")
            del graphs
            torch.cuda.empty_cache()
    bd = {}
    if "concentrated" in routings:
        set_routing(model, "concentrated")
        bd = {f"B{B}": breakdown(fused, lambda n: DecodeBatch.of(
            tables_for(n, contexts[0]), layout.page_tokens, "cuda"), B)
            for B in (1, 32) if B <= Bmax}
    fallbacks = [list(f) for f in registry.fallbacks()]
    return rows, bd, fallbacks


def experts_touched(fused, ids, batch) -> float:
    """Mean over MoE layers of the experts (shared excluded) some token chose this step."""
    import torch
    counts = []
    orig = type(fused.ops).route

    def spy(ops, *args):
        out = orig(ops, *args)
        ge = args[-1]                                      # group_end
        sizes = torch.diff(ge.long(), prepend=ge.new_zeros(1).long())
        counts.append(int((sizes[:args[0].shape[1]] > 0).sum()))
        return out
    type(fused.ops).route = spy
    try:
        fused(ids, batch)
    finally:
        type(fused.ops).route = orig
    return sum(counts) / max(1, len(counts))


# -- stock vLLM --------------------------------------------------------------------------------
def vllm_child(layers: int, batches, contexts, out: str) -> None:
    import random
    import os
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    from vllm import LLM, SamplingParams
    from pdserve.model.weights import hf_config_dict
    config = kimi_config(layers)
    d = Path(tempfile.mkdtemp(prefix="kimi-vllm-"))
    (d / "config.json").write_text(json.dumps(hf_config_dict(config)))
    t0 = time.time()
    llm = LLM(model=str(d), load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
              max_model_len=max(contexts) + 256, max_num_seqs=max(batches),
              gpu_memory_utilization=0.9, enable_prefix_caching=False, seed=0,
              compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                  "cudagraph_capture_sizes": sorted(set(batches))})
    stage(f"vLLM {layers} layers: started in {time.time() - t0:.0f} s")
    rng = random.Random(0)
    rows = []
    for ctx in contexts:
        for B in batches:
            def gen(n):
                prompts = [{"prompt_token_ids": [rng.randrange(1000, 150000) for _ in range(ctx)]}
                           for _ in range(B)]
                sp = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
                t = time.perf_counter()
                llm.generate(prompts, sp, use_tqdm=False)
                return time.perf_counter() - t
            gen(VLLM_OUT[1])                                   # warm
            # the prefill of both lengths cancels; the median of a few differences keeps one
            # slow scheduling round out
            reps = 3 if ctx * B <= 64 * 1024 else 1
            itl = statistics.median(
                (gen(VLLM_OUT[1]) - gen(VLLM_OUT[0])) / (VLLM_OUT[1] - VLLM_OUT[0])
                for _ in range(reps))
            rows.append({"layers": layers, "batch": B, "context": ctx,
                         "vllm_ms": round(itl * 1e3, 3)})
            stage(f"  vLLM ctx {ctx} B {B}: {itl * 1e3:.3f} ms")
    import vllm
    Path(out).write_text(json.dumps({"vllm": vllm.__version__, "rows": rows}))


def run_vllm(layers, batches, contexts) -> dict:
    out = tempfile.mktemp(suffix=".json")
    cmd = [sys.executable, __file__, "--vllm-child", str(layers), "--child-out", out,
           "--batches", *map(str, batches), "--contexts", *map(str, contexts)]
    proc = subprocess.run(cmd, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"vLLM child for {layers} layers failed (exit {proc.returncode})")
    return json.loads(Path(out).read_text())


def stage(msg: str) -> None:
    print(f"[decode_step {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def table(rows) -> str:
    lines = [f"{'layers':>6} {'B':>3} {'ctx':>5} {'routing':>12} {'pdserve ms':>10} "
             f"{'vLLM ms':>8} {'ratio':>6} {'k/layer':>7} {'floor':>6}"]
    for r in rows:
        v = r.get("vllm_ms")
        p = r.get("pdserve_ms")
        ratio = f"{v / p:.2f}" if v and p else "-"
        lines.append(f"{r['layers']:>6} {r['batch']:>3} {r['context']:>5} "
                     f"{r.get('routing', '-'):>12} {p if p else '-':>10} {v if v else '-':>8} "
                     f"{ratio:>6} {r.get('kernels_per_layer', '-'):>7} "
                     f"{r.get('share_of_floor', '-'):>6}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 27])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 8192])
    ap.add_argument("--routing", nargs="+", default=["concentrated", "random"],
                    choices=["concentrated", "random"])
    ap.add_argument("--what", nargs="*", default=["pdserve", "vllm"], choices=["pdserve", "vllm"],
                    help="what to run here (none: only merge --merge files)")
    ap.add_argument("--merge", nargs="*", default=[],
                    help="rows of earlier calls of this script in the same device session")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="decode_step_h200")
    ap.add_argument("--commit", default=None, help="the tree's commit where it has no .git")
    ap.add_argument("--vllm-child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.vllm_child is not None:
        vllm_child(a.vllm_child, a.batches, a.contexts, a.child_out)
        return 0
    import torch
    if a.what and not torch.cuda.is_available():
        print("decode_step.py needs a CUDA GPU", file=sys.stderr)
        return 2
    rows, breakdowns, fallbacks, vllm_version, env = [], {}, [], None, None
    for f in a.merge:
        prev = json.loads(Path(f).read_text())
        env = env or prev["environment"]
        prev = prev["figures"]
        vllm_version = prev.get("vllm_version") or vllm_version
        breakdowns.update(prev.get("breakdown", {}))
        fallbacks += prev.get("fallbacks", [])
        for r in prev["rows"]:
            if "pdserve_ms" in r:
                rows.append({k: v for k, v in r.items() if k not in ("vllm_ms", "speedup_vs_vllm")})
            if "vllm_ms" in r:
                rows.append({k: r[k] for k in ("layers", "batch", "context", "vllm_ms")})
    for layers in a.layers:
        if "pdserve" in a.what:
            r, bd, fb = run_pdserve(layers, a.batches, a.contexts, a.routing, a.steps)
            rows += r
            if bd:
                breakdowns[f"{layers}_layers"] = bd
            fallbacks += fb
            gc.collect()
            torch.cuda.empty_cache()
        if "vllm" in a.what:
            v = run_vllm(layers, a.batches, a.contexts)
            vllm_version = v["vllm"]
            rows += v["rows"]
    # pair each vLLM row with pdserve's concentrated row of the same shape
    merged, seen = [], {}
    for r in rows:
        if "pdserve_ms" in r:
            merged.append(dict(r))
            if r["routing"] == "concentrated":
                seen[(r["layers"], r["batch"], r["context"])] = merged[-1]
    invalid = []
    for r in rows:
        if "vllm_ms" in r and r["vllm_ms"] <= 0:      # a slow short run: not a measurement
            invalid.append(r)
            continue
        if "vllm_ms" in r:
            key = (r["layers"], r["batch"], r["context"])
            if key in seen:
                seen[key]["vllm_ms"] = r["vllm_ms"]
                seen[key]["speedup_vs_vllm"] = round(r["vllm_ms"] / seen[key]["pdserve_ms"], 3)
            else:
                merged.append(dict(r))
    figures = {"rows": merged, "vllm_invalid": invalid, "breakdown": breakdowns,
               "fallbacks": fallbacks,
               "vllm_version": vllm_version, "copy_gbps": COPY_GBPS,
               "vllm_out_lengths": VLLM_OUT}
    if not a.what and env is not None:       # merged only: the runs' own machine and commit
        figures["merged_from"] = [Path(f).name for f in a.merge]
        d = Path(a.out) if a.out else Path(__file__).resolve().parent / "results"
        d.mkdir(parents=True, exist_ok=True)
        path = d / f"{a.name}.json"
        path.write_text(json.dumps({"environment": env, "figures": figures}, indent=2))
    else:
        path = write_result(a.name, figures, a.out, commit=a.commit)
    print(table(merged))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
