"""Start a deployment on Ray and serve it over HTTP (`pdserve serve` / `demo`): disaggregated
(prefill and decode instances) or monolithic (instances that do both), per the config's `mode`.

Locally `ray.init()` starts an embedded cluster; inside `ray job submit` (RAY_ADDRESS is set) or
with `--address`, it attaches to the running cluster.

With `prefill.engine = "vllm"` each prefill instance is one engine actor running stock vLLM
(`VllmPrefill`, imported only inside that actor) on `prefill.tp` GPUs; `assemble` wires started
instances into the router the same way for both engines, and runs without Ray (the GPU test
builds the instances in-process).
"""
from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from pathlib import Path

from pdserve.cluster.actors import (Instance, SourceDigests, serve_decode, start_engine_instance,
                                    start_instance)
from pdserve.cluster.config import (ServeConfig, check_vllm_geometry, vllm_engine_config,
                                    vllm_env, vllm_model_dir)
from pdserve.cluster.preflight import check_resources, listen_socket, local_resources
from pdserve.cluster.router import DecodeSlot, Router
from pdserve.decode.instance import DecodeInstance
from pdserve.decode.server import DecodeServer
from pdserve.model.config import PRESETS
from pdserve.state.block_table import Topology
from pdserve.transfer.dest import TransferConfig

log = logging.getLogger("pdserve.serve")

VLLM_FACTORY = "pdserve.prefill.vllm_engine:VllmPrefill"
SUBREAPER_ENV = "RAY_kill_child_processes_on_worker_exit_with_raylet_subreaper"


def _init_ray(cfg: ServeConfig, address: str | None) -> None:
    """Attach to (or start) Ray, having checked that it holds the CPUs and GPUs `cfg` needs."""
    import ray

    address = address or os.environ.get("RAY_ADDRESS")
    if ray.is_initialized() or address:
        if not ray.is_initialized():
            ray.init(address=address, log_to_driver=False)
        check_resources(cfg, ray.cluster_resources(), "the Ray cluster")
        return
    check_resources(cfg, local_resources(cfg), "this machine")
    if cfg.prefill.engine == "vllm":
        # vLLM's engine core and TP workers are processes of the engine actor: if the actor dies
        # without closing them (killed, crashed), the raylet reaps them (Ray's subreaper, Linux)
        # instead of leaving them holding GPU memory. A cluster started by `ray start` needs the
        # same variable set there (docs/vllm.md).
        os.environ.setdefault(SUBREAPER_ENV, "true")
    need = cfg.num_ranks * cfg.resources.cpus_per_rank
    ray.init(num_cpus=max(int(need + 0.999), os.cpu_count() or 1), include_dashboard=False,
             log_to_driver=False)


def _eos(model) -> set[int]:
    eos = model.eos_token_id
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


def prepare_vllm_model(cfg: ServeConfig, model, progress=print) -> Path:
    """The HF directory vLLM and decode load: `model.name` when it is one, else the preset's
    seeded weights exported (once) into `prefill.vllm.export_dir`."""
    from pdserve.prefill.vllm_engine import ensure_export

    path, export = vllm_model_dir(cfg, model)
    if export and not (path / "config.json").exists():
        progress(f"exporting the seeded weights of {cfg.model.name} (seed {cfg.model.seed}, "
                 f"{cfg.model.dtype}) for "
                 f"vLLM to {path} (once) ...")
    return ensure_export(path, model, cfg.model.seed, cfg.model.dtype) if export else path


def start(cfg: ServeConfig, model, address: str | None = None, progress=print) -> Router:
    """Start every instance (with placement groups) and return the router over them."""
    _init_ray(cfg, address)
    checkpoint = None
    if cfg.model.name not in PRESETS and any(Path(cfg.model.name).glob("*.safetensors")):
        checkpoint = cfg.model.name
    model_dir = prepare_vllm_model(cfg, model, progress) if cfg.vllm else None
    if model_dir is not None:
        checkpoint = str(model_dir)  # decode loads exactly the weights vLLM loads
    common = dict(config=model, seed=cfg.model.seed, checkpoint=checkpoint, device=cfg.device,
                  dtype=cfg.model.dtype)
    res = cfg.resources
    prefill, decode = [], []
    try:
        for i in range(0 if cfg.monolithic else cfg.prefill.instances):
            progress(f"starting prefill-{i} (TP {cfg.prefill.tp}, engine {cfg.prefill.engine}) ...")
            if cfg.vllm:
                prefill.append(start_engine_instance(
                    f"prefill-{i}", 0, VLLM_FACTORY, (vllm_engine_config(cfg, model_dir),),
                    res.cpus_per_rank, cfg.prefill.tp, res.call_timeout_s,
                    cfg.prefill.vllm.start_timeout_s, vllm_env(cfg)))
                continue
            prefill.append(start_instance(
                "prefill", f"prefill-{i}", 0, cfg.prefill.tp,
                dict(common, layout=cfg.layout(cfg.prefill.conv_layout),
                     num_pages=cfg.prefill.num_pages, num_slots=cfg.prefill.num_slots,
                     lease_s=cfg.transfer.lease_s, chunk_tokens=cfg.prefill.chunk_tokens or None,
                     # pages laid out per decode DCP rank: one read per rank and layer
                     decode_topology=Topology(cfg.decode.tp, cfg.decode.dcp, cfg.decode.interleave)),
                res.cpus_per_rank, res.gpus_per_rank, res.call_timeout_s, res.torch_threads))
        # a monolithic instance is a decode instance whose ranks prefill each request themselves
        role = "monolithic" if cfg.monolithic else "decode"
        for i in range(cfg.decode.instances):
            progress(f"starting {role}-{i} (TP {cfg.decode.tp}, backend {cfg.decode.backend}"
                     f"{', prefill + decode' if cfg.monolithic else ''}) ...")
            decode.append(start_instance(
                role, f"{role}-{i}", 0, cfg.decode.tp,
                dict(common, **decode_kwargs(cfg)),
                res.cpus_per_rank, res.gpus_per_rank, res.call_timeout_s, res.torch_threads))
        return assemble(cfg, model, prefill, decode)
    except Exception:
        for inst in prefill + decode:
            inst.kill()
        raise


def max_context(cfg: ServeConfig) -> int:
    """The most tokens (prompt + output) one request may hold: the API's limit, and the
    context the decode step's CUDA graphs are captured for."""
    decode_tokens = (cfg.decode.num_pages - 1) * cfg.state.page_tokens
    if cfg.monolithic:  # one pool holds the prompt and the output
        return decode_tokens
    if cfg.vllm:  # vLLM's cache is sized in its own blocks; max_model_len bounds one request
        return min(cfg.prefill.vllm.max_model_len, decode_tokens)
    return min(cfg.prefill.num_pages - 1, cfg.decode.num_pages - 1) * cfg.state.page_tokens


def decode_kwargs(cfg: ServeConfig) -> dict:
    """A decode rank's settings from the config (beside the model's `common` ones)."""
    transfer = TransferConfig(cfg.transfer.deadline_s, cfg.transfer.expected_gbps,
                              cfg.transfer.verify, cfg.transfer.lease_s)
    return dict(layout=cfg.decode_layout(), num_pages=cfg.decode.num_pages,
                num_slots=cfg.decode.num_slots, backend=cfg.decode.backend, transfer=transfer,
                cuda_graphs=cfg.decode.cuda_graphs, graph_max_tokens=max_context(cfg),
                mla_fp8_query=cfg.decode.mla_fp8_query,
                mla_deterministic=cfg.decode.mla_deterministic)


def assemble(cfg: ServeConfig, model, prefill: list[Instance], decode: list[Instance]) -> Router:
    """The router over started prefill and decode instances (Ray actors or in-process): every
    prefill instance learns the decode ranks' agents, and each decode instance runs its decode
    loop (`DecodeServer`): in its rank-0 actor, or here for in-process ranks.
    A vLLM instance's cache layout is checked against the config first. In monolithic mode
    `prefill` is empty and the decode instances prefill locally."""
    if cfg.vllm:
        for p in prefill:
            check_vllm_geometry(cfg, p.ranks.call("geometry")[0])
    agents = [a for d in decode for a in d.agents]
    for p in prefill:
        p.ranks.call("connect", agents)
    engine = dict(layout=cfg.decode_layout(), eos=_eos(model),
                  topology=Topology(cfg.decode.tp, cfg.decode.dcp, cfg.decode.interleave),
                  digests=SourceDigests(prefill) if cfg.transfer.verify else None,
                  idle_threads=cfg.resources.prefill_idle_threads)
    max_batch = min(cfg.decode.max_batch, cfg.decode.num_slots - 1)
    slots = []
    for d in decode:
        if getattr(d.ranks, "actors", None):  # the loop runs in the instance's rank 0
            server = serve_decode(d, engine, max_batch, cfg.api.max_queue)
        else:  # in-process ranks: the loop runs here
            server = DecodeServer(DecodeInstance(d.name, d.ranks, local_prefill=cfg.monolithic,
                                                 **engine), max_batch, cfg.api.max_queue,
                                  lambda d=d: d.ranks.call("stats")[0])
        slots.append(DecodeSlot(d, server))
    router = Router(cfg.model.name, max_context(cfg), prefill, slots, cfg.api.max_queue,
                    cfg.resources.prefill_idle_threads)
    router.instances = prefill + decode
    return router


def assemble_local(cfg: ServeConfig, model, prefill_engines: list, decode_ranks: list) -> Router:
    """An in-process deployment, no Ray: `prefill_engines[i]` is a whole prefill instance named
    "prefill-{i}" (a `VllmPrefill`: its own TP workers), `decode_ranks[i]` the one rank (TP 1) of
    decode instance "decode-{i}", built with `decode_kwargs(cfg)`. The same router and wiring
    as `start` (tests/gpu/test_vllm_serve.py runs it on a GPU machine without Ray)."""
    from pdserve.cluster.actors import local_engine_instance
    from pdserve.decode.instance import LocalRanks

    prefill = [local_engine_instance(f"prefill-{i}", 0, e, cfg.resources.call_timeout_s)
               for i, e in enumerate(prefill_engines)]
    decode = [Instance("decode", f"decode-{i}", 0, LocalRanks([r]), None, [r.info()])
              for i, r in enumerate(decode_ranks)]
    return assemble(cfg, model, prefill, decode)


def stop(router: Router) -> None:
    for inst in getattr(router, "instances", []):
        inst.kill()


@contextmanager
def running_server(cfg: ServeConfig, model, address: str | None = None, progress=print):
    """Cluster + HTTP server in a background thread; yields (base URL, router). The API's port
    is bound before anything starts (a taken port fails at once, as a `ConfigError`)."""
    from pdserve.api.server import create_app
    from pdserve.api.serving import serve_in_thread
    from pdserve.api.tokenizer import load_tokenizer

    sock = listen_socket(cfg.api.host, cfg.api.port)
    try:
        router = start(cfg, model, address, progress)
    except BaseException:
        sock.close()
        raise
    try:
        app = create_app(router, load_tokenizer(cfg.model.name, model.vocab_size),
                         request_timeout_s=cfg.api.request_timeout_s,
                         max_body_bytes=cfg.api.max_body_bytes,
                         body_timeout_s=cfg.api.body_timeout_s)
        with serve_in_thread(app, cfg.api.host, cfg.api.port, sock=sock) as url:
            yield url, router
    finally:
        sock.close()
        stop(router)
