"""Stock vLLM prefill (VllmPrefill: vLLM + PdserveConnector) on a reduced kimi-linear-48b-a3b, and
the cost of handing its state to pdserve: per prompt length (1K / 8K / 32K tokens by default)

- TTFT: wall time of `VllmPrefill.prefill` for one request (max_tokens=1 in vLLM: all N prompt
  tokens computed and the first token sampled), measured in the prefill process; median of
  --repeats after one warm-up;
- export cost: per request, the connector building the `StateManifest` (`manifest_from_vllm`) and
  encoding it into kv_transfer_params, plus the engine decoding it into a handle; once per engine,
  describing vLLM's KV tensors and registering them with NIXL (`register_in_place`);
- transfer: a decode process (pdserve `DestRank` over `StatePools` on cuda) pulls the state over
  NIXL (VRAM to VRAM); wall time of `DestRank.receive` (plan + READs + arrival + "done") and the
  READs alone, GB/s of the payload, against a device copy of the same bytes in this run and the
  4245 GB/s copy ceiling (read + write) of the H200.

The model keeps kimi-linear-48b-a3b's head counts and widths (hidden 2304, KDA 32 x 128, MLA 576
latent) with --layers layers (MLA every 4th and the last), --experts experts and a --vocab vocabulary,
so vLLM loads it in seconds. vLLM's engine core runs inside the prefill process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) rather than in a process of its own, so the connector's steps
run where this script times them by wrapping the connector module's functions; everything else is
stock (eager mode, the VllmEngineConfig default). The prefill engine and the decode side each live
in their own process; every wait has a deadline.

    python3 benchmarks/vllm_prefill.py [--contexts 1024 8192 32768] [--repeats 3] [--out DIR]
"""
from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Column, Table, write_result  # noqa: E402

from pdserve.model.weights import export_checkpoint  # noqa: E402
from pdserve.prefill.child import Child, serve_child  # noqa: E402

COPY_CEILING_GBPS = 4245.0   # H200 device copy, counted as read + write (shared/device/README.md)
NAME = "vllm_prefill_h200"
CHILD_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0",      # its JIT sources are not on the H200 carry
             "VLLM_ENABLE_V1_MULTIPROCESSING": "0",   # connector in this process: timeable
             "TOKENIZERS_PARALLELISM": "false"}
SEED = 11


# == pure helpers ==================================================================================
def median_or_none(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def copy_fraction(nbytes: int, seconds: float, ceiling_gbps: float = COPY_CEILING_GBPS) -> float:
    """Share of the copy ceiling a transfer of `nbytes` in `seconds` reaches; a transfer reads and
    writes every byte once, as the ceiling's copy does."""
    return 2 * nbytes / seconds / (ceiling_gbps * 1e9)


def summarize(n: int, runs: list[dict], copy_s: float | None) -> dict:
    """One row of the table from the measured (post-warm-up) runs of one prompt length."""
    nbytes = runs[0]["bytes"]
    wall = statistics.median(r["receive_s"] for r in runs)
    reads = statistics.median(r["reads_s"] for r in runs)
    row = {"context": n, "repeats": len(runs),
           "ttft_ms": statistics.median(r["ttft_s"] for r in runs) * 1e3,
           "ttft_ms_all": [r["ttft_s"] * 1e3 for r in runs],
           "export_ms": _ms(median_or_none(r["export_s"] for r in runs)),
           "manifest_ms": _ms(median_or_none(r["manifest_s"] for r in runs)),
           "encode_ms": _ms(median_or_none(r["encode_s"] for r in runs)),
           "handle_decode_ms": _ms(median_or_none(r["handle_s"] for r in runs)),
           "state_bytes": nbytes, "bytes_by_kind": runs[0]["bytes_by_kind"],
           "latent_pages": runs[0]["latent_pages"], "descriptors": runs[0]["descriptors"],
           "transfer_ms": wall * 1e3, "reads_ms": reads * 1e3,
           "control_ms": statistics.median(r["control_s"] for r in runs) * 1e3,
           "gbps": nbytes / wall / 1e9, "reads_gbps": nbytes / reads / 1e9,
           "fraction_of_copy_ceiling": copy_fraction(nbytes, wall),
           "reads_fraction_of_copy_ceiling": copy_fraction(nbytes, reads)}
    if copy_s:
        row.update(device_copy_gbps=nbytes / copy_s / 1e9, fraction_of_device_copy=copy_s / wall)
    return row


def _ms(s):
    return None if s is None else s * 1e3


TABLE = Table([Column("context"), Column("TTFT ms", "ttft_ms", ".1f"),
               Column("export ms", "export_ms", ".3f"),
               Column("state MB", lambda r: r["state_bytes"] / 1e6, ".2f"),
               Column("xfer ms", "transfer_ms", ".2f"), Column("GB/s", "gbps", ".2f"),
               Column("reads GB/s", "reads_gbps", ".2f"),
               Column("of 4245", "reads_fraction_of_copy_ceiling", ".2%")])


# == child processes ===============================================================================
def prefill_main(conn, cfg: dict, vocab: int, env: dict) -> None:
    def build():
        t_start = time.perf_counter()
        import pdserve.prefill.vllm_connector as vc   # imports vLLM
        import pdserve.prefill.vllm_engine as ve
        from pdserve.model.sampling import Request, SamplingParams
        from pdserve.prefill.vllm_state import _union_table
        from pdserve.transfer.nixl_agent import AgentInfo

        times: dict[str, list[float]] = {"describe": [], "register": [], "manifest": [],
                                         "encode": [], "handle": []}
        registered: list[int] = []

        def timed(key, fn):
            def wrapper(*a, **kw):
                t0 = time.perf_counter()
                out = fn(*a, **kw)
                times[key].append(time.perf_counter() - t0)
                return out
            return wrapper

        def register(instance, rank, generation, regions, device="cpu"):
            registered.append(sum(v.numel() for v in _union_table(regions).layers["registered"]))
            return reg(instance, rank, generation, regions, device)

        # the connector module looks these up at call time: wrapping them times the real calls
        reg = timed("register", vc.register_in_place)
        vc.register_in_place = register
        vc.describe_kv_caches = timed("describe", vc.describe_kv_caches)
        vc.manifest_from_vllm = timed("manifest", vc.manifest_from_vllm)
        vc.encode_export = timed("encode", vc.encode_export)
        ve.decode_export = timed("handle", ve.decode_export)

        eng = ve.VllmPrefill("bench-prefill", 1, msgspec.convert(cfg, ve.VllmEngineConfig))
        startup_s = time.perf_counter() - t_start

        def startup():
            return {"startup_s": startup_s, "describe_s": sum(times["describe"]) or None,
                    "register_s": sum(times["register"]) or None,
                    "registered_bytes": sum(registered) or None,
                    "connector_in_process": bool(times["register"])}

        def geometry():
            raw = eng._rpc("pdserve_info")[0]
            return msgspec.msgpack.encode(msgspec.msgpack.decode(raw, type=vc.RankExport).geometry)

        def prefill(rid, n, seed):
            rng = random.Random(seed)
            prompt = [rng.randrange(vocab) for _ in range(n)]
            for v in times.values():
                v.clear()
            t0 = time.perf_counter()
            (res,) = eng.prefill([Request(rid, prompt, SamplingParams(max_tokens=2, ignore_eos=True))])
            ttft = time.perf_counter() - t0
            got = {k: (sum(v) if v else None) for k, v in times.items()}
            return msgspec.msgpack.encode(res), ttft, got

        return {"startup": startup, "geometry": geometry, "prefill": prefill,
                "info": lambda: [msgspec.msgpack.encode(i) for i in eng.info()],
                "connect": lambda infos: eng.connect([msgspec.msgpack.decode(i, type=AgentInfo)
                                                      for i in infos]),
                "held": lambda: eng._rpc("pdserve_held"), "close": eng.close}

    serve_child(conn, "vllm-prefill", build, env)


def decode_main(conn, model_dir: str, layout: dict, num_pages: int, num_slots: int,
                env: dict) -> None:
    def build():
        import torch

        from pdserve.model.config import load_config
        from pdserve.prefill.handle import StateHandle
        from pdserve.state.block_table import Topology
        from pdserve.state.layout import RankShapes, StateLayout
        from pdserve.state.pools import StatePools
        from pdserve.transfer.dest import DestRank, TransferConfig
        from pdserve.transfer.nixl_agent import AgentInfo, RankAgent
        from pdserve.transfer.planner import DestAllocation
        from pdserve.transfer.regions import RegionTable

        lt = msgspec.convert(layout, StateLayout)
        pools = StatePools(RankShapes.of(load_config(model_dir)), lt, num_pages, num_slots,
                           device="cuda", conv_staging=True)
        # generous deadline: UCX may emulate VRAM reads over TCP on one GPU (~0.45 GB/s seen)
        dst = DestRank(RankAgent("bench-decode", 0, 0, RegionTable.of_pools(pools), "cuda"), pools,
                       TransferConfig(base_deadline_s=60.0, expected_gbps=0.05))
        topo = Topology(1)

        def receive(raw):
            h = msgspec.msgpack.decode(raw, type=StateHandle)
            m = h.manifest
            pages, slots, stage = dst.allocate(m, topo)
            alloc = DestAllocation(topo, lt, [pages], [slots], [stage])
            before = dict(dst.metrics.snapshot().bytes_by_kind)  # cumulative: take the delta
            t0 = time.perf_counter()
            st = dst.receive(m, alloc, h.instance)
            wall = time.perf_counter() - t0
            after = dst.metrics.snapshot().bytes_by_kind
            pools.latent.free(pages)  # receive kept them for decoding; the benchmark is done
            pools.slots.free(slots)
            by_kind = dict(st["seconds_by_kind"])
            return {"bytes": st["bytes"], "receive_s": wall, "reads_s": max(by_kind.values()),
                    "control_s": st["control_s"], "descriptors": st["descriptors"],
                    "runs": st["runs"], "reads_s_by_kind": by_kind,
                    "bytes_by_kind": {k: v - before.get(k, 0) for k, v in after.items()},
                    "latent_pages": len(m.latent_pages[0])}

        def copy(nbytes, repeats=20):
            """Median seconds of a device copy of `nbytes` (random bytes, not zeros)."""
            a = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
            b = torch.empty_like(a)
            times = []
            for _ in range(repeats):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                b.copy_(a)
                e1.record()
                e1.synchronize()
                times.append(e0.elapsed_time(e1) / 1e3)
            return statistics.median(times)

        def connect(infos):
            for i in infos:
                dst.agent.connect(msgspec.msgpack.decode(i, type=AgentInfo))

        return {"info": lambda: msgspec.msgpack.encode(dst.agent.info()), "connect": connect,
                "receive": receive, "copy": copy, "close": dst.agent.close}

    serve_child(conn, "pdserve-decode", build, env)


def stage(msg: str) -> None:
    print(f"== {msg}", flush=True)


# == main ==========================================================================================
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--repeats", type=int, default=3, help="measured runs per length (after 1 warm-up)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (MLA every 4th and the last)")
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--num-gpu-blocks", type=int, default=96,
                    help="vLLM cache blocks (bounds memory and the decode side's NIXL descriptors; "
                         "must hold two of the longest prompts)")
    ap.add_argument("--gpu-mem", type=float, default=0.3, help="vLLM gpu_memory_utilization")
    ap.add_argument("--workdir", default=None, help="where the HF weights go (default: a temp dir)")
    ap.add_argument("--out", default=None, help="result directory (default benchmarks/results)")
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("vllm_prefill: needs a CUDA GPU (run it on the H200 through the device tool)",
              file=sys.stderr)
        return 2
    from pdserve.model.config import reduced_kimi_linear
    from pdserve.prefill.engine import PrefillResult
    from pdserve.prefill.vllm_state import KvGeometry

    config = reduced_kimi_linear(args.layers, args.experts, min(2, args.experts), args.vocab)
    max_len = max(args.contexts) + 128
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        model_dir = os.path.join(tmp, "kimi-hf")
        stage(f"export reduced kimi-linear-48b-a3b ({args.layers} layers, {args.experts} experts, "
              f"vocab {args.vocab}) to {model_dir}")
        t0 = time.perf_counter()
        export_checkpoint(model_dir, config, seed=SEED)
        stage(f"exported in {time.perf_counter() - t0:.1f} s")
        cfg = dict(model=model_dir, max_model_len=max_len, gpu_memory_utilization=args.gpu_mem,
                   num_gpu_blocks=args.num_gpu_blocks, enforce_eager=True, lease_s=120.0,
                   rpc_timeout_s=120.0)
        pre = Child("vllm-prefill", prefill_main, cfg, args.vocab, CHILD_ENV, start_s=900)
        dec = None
        try:
            startup = pre.call("startup")
            geo = msgspec.msgpack.decode(pre.call("geometry"), type=KvGeometry)
            stage(f"vLLM cache: kernel block {geo.page_tokens} tokens, {geo.num_latent_pages} "
                  f"latent pages, {geo.num_slots} slots, conv {geo.conv_layout}, strides "
                  f"{geo.strides}; registration {startup}")
            layout = dict(page_tokens=64, latent_dtype=geo.latent_dtype,
                          recurrent_dtype=geo.recurrent_dtype, conv_dtype=geo.conv_dtype,
                          conv_layout=geo.conv_layout)
            dec = Child("pdserve-decode", decode_main, model_dir, layout,
                        math.ceil(max_len / 64) + 8, 4, CHILD_ENV, start_s=300)
            pre.call("connect", [dec.call("info")])
            dec.call("connect", pre.call("info"))
            rows, first = [], {}
            for n in args.contexts:
                runs = []
                for r in range(args.repeats + 1):
                    stage(f"prefill {n} tokens, run {r}")
                    raw, ttft, ex = pre.call("prefill", f"bench-{n}-{r}", n, SEED + 1000 * n + r)
                    res = msgspec.msgpack.decode(raw, type=PrefillResult)
                    if res.handle is None:
                        raise RuntimeError(f"prefill of {n} tokens failed: {res.error}")
                    stage(f"transfer {n} tokens, run {r} (TTFT {ttft * 1e3:.1f} ms)")
                    st = dec.call("receive", msgspec.msgpack.encode(res.handle))
                    parts = [ex.get(k) for k in ("manifest", "encode", "handle")]
                    st.update(ttft_s=ttft, manifest_s=ex.get("manifest"), encode_s=ex.get("encode"),
                              handle_s=ex.get("handle"),
                              export_s=sum(parts) if all(p is not None for p in parts) else None)
                    runs.append(st)
                first[n] = {"ttft_ms": runs[0]["ttft_s"] * 1e3,
                            "transfer_ms": runs[0]["receive_s"] * 1e3,
                            "note": "warm-up run: includes NIXL descriptor preparation on first use"}
                copy_s = dec.call("copy", runs[1]["bytes"] if len(runs) > 1 else runs[0]["bytes"])
                rows.append(summarize(n, runs[1:] or runs, copy_s))
        finally:
            if dec is not None:
                dec.close()
            pre.close()

    print(TABLE.format(rows), flush=True)
    print(f"once per engine: describe {startup['describe_s']} s, NIXL registration "
          f"{startup['register_s']} s of {startup['registered_bytes']} bytes; "
          f"engine start-up {startup['startup_s']:.1f} s", flush=True)
    path = write_result(NAME, {
        "model": f"reduced kimi-linear-48b-a3b: {args.layers} layers ({len(config.kda_layer_ids)} KDA, "
                 f"{len(config.mla_layer_ids)} MLA), {args.experts} experts, vocab {args.vocab}, "
                 "real head counts and widths, seeded bf16 weights",
        "engine": "vLLM + PdserveConnector (VllmPrefill), TP 1, eager, bf16, prefix caching off, "
                  "async scheduling off, engine core in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0)",
        "cache": {"num_gpu_blocks": args.num_gpu_blocks, "kernel_block_tokens": geo.page_tokens,
                  "latent_pages": geo.num_latent_pages, "slots": geo.num_slots,
                  "conv_layout": geo.conv_layout, "strides": msgspec.to_builtins(geo.strides)},
        "ttft": "wall time of VllmPrefill.prefill for one request in the prefill process",
        "export": "per request: manifest_from_vllm + encode_export (connector, scheduler side) + "
                  "decode_export (engine); once per engine: describe_kv_caches + register_in_place",
        "transfer": "pdserve DestRank on cuda (StatePools), NIXL UCX VRAM -> VRAM, one process "
                    "each; transfer_ms = DestRank.receive wall (plan, READs, arrival, done), "
                    "reads_ms = the READs alone",
        "copy_ceiling_gbps": COPY_CEILING_GBPS,
        "fraction_of_copy_ceiling": "2 x state bytes / seconds / 4245 GB/s (a transfer reads and "
                                    "writes each byte once, as the ceiling's copy)",
        "device_copy": "torch copy_ of the same bytes on the decode GPU, CUDA events, median of 20",
        "startup": startup, "warmup": first, "rows": rows}, args.out)
    print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
