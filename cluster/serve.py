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

from pdserve.cluster.actors import (Instance, SourceDigests, serve_decode, serve_prefill,
                                    start_engine_instance, start_instance)
from pdserve.cluster.config import (ServeConfig, check_vllm_geometry, vllm_engine_config,
                                    vllm_env, vllm_model_dir)
from pdserve.cluster.preflight import check_resources, listen_socket, local_resources
from pdserve.cluster.router import DecodeSlot, Router
from pdserve.decode.instance import DecodeInstance
from pdserve.decode.server import DecodeServer
from pdserve.model.config import weights_dir
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


class Builder:
    """Starts the config's instances on Ray: each one at start-up (generation 0), and a new
    generation of one whose rank died when the router rebuilds it (`rebuild_prefill`,
    `rebuild_decode`: started in a placement group of its own and wired as `assemble` wired
    the first)."""

    def __init__(self, cfg: ServeConfig, model, progress=print):
        self.cfg, self.model = cfg, model
        weights = weights_dir(cfg.model.name)
        checkpoint = None if weights is None else str(weights)
        self.model_dir = prepare_vllm_model(cfg, model, progress) if cfg.vllm else None
        if self.model_dir is not None:
            checkpoint = str(self.model_dir)  # decode loads exactly the weights vLLM loads
        self.common = dict(config=model, seed=cfg.model.seed, checkpoint=checkpoint,
                           device=cfg.device, dtype=cfg.model.dtype)

    def prefill(self, name: str, generation: int = 0) -> Instance:
        cfg, res = self.cfg, self.cfg.resources
        if cfg.vllm:
            return start_engine_instance(
                name, generation, VLLM_FACTORY, (vllm_engine_config(cfg, self.model_dir),),
                res.cpus_per_rank, cfg.prefill.tp, res.call_timeout_s,
                cfg.prefill.vllm.start_timeout_s, vllm_env(cfg))
        return start_instance(
            "prefill", name, generation, cfg.prefill.tp,
            dict(self.common, layout=cfg.layout(cfg.prefill.conv_layout),
                 num_pages=cfg.prefill.num_pages, num_slots=cfg.prefill.num_slots,
                 lease_s=cfg.transfer.lease_s, chunk_tokens=cfg.prefill.chunk_tokens or None,
                 prefix_cache=cfg.prefill.prefix_cache,
                 # pages laid out per decode DCP rank: one read per rank and layer
                 decode_topology=Topology(cfg.decode.tp, cfg.decode.dcp, cfg.decode.interleave)),
            res.cpus_per_rank, res.gpus_per_rank, res.call_timeout_s, res.torch_threads)

    def decode(self, name: str, generation: int = 0) -> Instance:
        # a monolithic instance is a decode instance whose ranks prefill each request themselves
        cfg, res = self.cfg, self.cfg.resources
        return start_instance("monolithic" if cfg.monolithic else "decode", name, generation,
                              cfg.decode.tp, dict(self.common, **decode_kwargs(cfg)),
                              res.cpus_per_rank, res.gpus_per_rank, res.call_timeout_s,
                              res.torch_threads)

    def rebuild_prefill(self, old: Instance, prefill: list[Instance],
                        decode: list[DecodeSlot]) -> Instance:
        """`old`'s next generation, connected to the decode ranks; with `transfer.verify` each
        decode instance learns where the new source's digests come from."""
        new = self.prefill(old.name, old.generation + 1)
        try:
            if self.cfg.vllm:
                check_vllm_geometry(self.cfg, new.ranks.call("geometry")[0])
            new.ranks.call("connect", [a for d in decode for a in d.inst.agents])
            serve_prefill(new)
            if self.cfg.transfer.verify:
                sources = SourceDigests([new if p.name == old.name else p for p in prefill])
                for d in decode:
                    if d.inst.alive:
                        d.server.sources(sources)
        except Exception:
            new.kill()
            raise
        return new

    def rebuild_decode(self, old: Instance, prefill: list[Instance]) -> DecodeSlot:
        """`old`'s next generation, serving; every live prefill instance connected to it."""
        new = self.decode(old.name, old.generation + 1)
        try:
            for p in prefill:
                if p.alive and new.agents:
                    p.ranks.call("connect", new.agents)
            return decode_slot(self.cfg, self.model, new, prefill)
        except Exception:
            new.kill()
            raise


def start(cfg: ServeConfig, model, address: str | None = None, progress=print) -> Router:
    """Start every instance (with placement groups) and return the router over them, which
    rebuilds an instance whose rank dies (`Builder`)."""
    _init_ray(cfg, address)
    build = Builder(cfg, model, progress)
    prefill, decode = [], []
    try:
        for i in range(0 if cfg.monolithic else cfg.prefill.instances):
            progress(f"starting prefill-{i} (TP {cfg.prefill.tp}, engine {cfg.prefill.engine}) ...")
            prefill.append(build.prefill(f"prefill-{i}"))
        role = "monolithic" if cfg.monolithic else "decode"
        for i in range(cfg.decode.instances):
            progress(f"starting {role}-{i} (TP {cfg.decode.tp}, backend {cfg.decode.backend}"
                     f"{', prefill + decode' if cfg.monolithic else ''}) ...")
            decode.append(build.decode(f"{role}-{i}"))
        return assemble(cfg, model, prefill, decode, build if cfg.resources.rebuild else None)
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
                mla_deterministic=cfg.decode.mla_deterministic,
                topology=Topology(cfg.decode.tp, cfg.decode.dcp, cfg.decode.interleave))


def decode_slot(cfg: ServeConfig, model, d: Instance, prefill: list[Instance]) -> DecodeSlot:
    """Decode instance `d`'s decode loop (`DecodeServer`), started in its rank-0 actor (or here
    for in-process ranks), reading state from `prefill`; the router's slot over it."""
    engine = dict(layout=cfg.decode_layout(), eos=_eos(model),
                  topology=Topology(cfg.decode.tp, cfg.decode.dcp, cfg.decode.interleave),
                  digests=SourceDigests(prefill) if cfg.transfer.verify else None,
                  idle_threads=cfg.resources.prefill_idle_threads)
    max_batch = min(cfg.decode.max_batch, cfg.decode.num_slots - 1)
    if getattr(d.ranks, "actors", None):  # the loop runs in the instance's rank 0
        return DecodeSlot(d, serve_decode(d, engine, max_batch, cfg.api.max_queue))
    # in-process ranks: the loop runs here
    return DecodeSlot(d, DecodeServer(DecodeInstance(d.name, d.ranks, local_prefill=cfg.monolithic,
                                                     **engine), max_batch, cfg.api.max_queue,
                                      lambda: d.ranks.call("stats")[0]))


def assemble(cfg: ServeConfig, model, prefill: list[Instance], decode: list[Instance],
             build: Builder | None = None) -> Router:
    """The router over started prefill and decode instances (Ray actors or in-process): every
    prefill instance learns the decode ranks' agents, and each decode instance runs its decode
    loop (`decode_slot`). A vLLM instance's cache layout is checked against the config first.
    In monolithic mode `prefill` is empty and the decode instances prefill locally. With
    `build` the router rebuilds an instance whose rank dies; without it (in-process ranks) a
    dead instance stays dead."""
    if cfg.vllm:
        for p in prefill:
            check_vllm_geometry(cfg, p.ranks.call("geometry")[0])
    agents = [a for d in decode for a in d.agents]
    for p in prefill:
        p.ranks.call("connect", agents)
        serve_prefill(p)  # its prefill loop runs in the instance from now on
    slots = [decode_slot(cfg, model, d, prefill) for d in decode]
    return Router(cfg.model.name, max_context(cfg), prefill, slots, cfg.api.max_queue,
                  cfg.resources.prefill_idle_threads, build,
                  cfg.prefill.prefix_cache.route_max_queued_tokens)


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
    router.closing()  # no rebuild starts now; one under way kills what it built
    for inst in router.instances:
        inst.kill()


# VllmPrefill asks vLLM for the first token only: no logprobs for it or the prompt
VLLM_NO_LOGPROBS = ("prefill.engine = \"vllm\" prefills the prompt and samples the first token "
                    "in vLLM, which returns no logprobs for them (echo without logprobs works)")


def app_options(cfg: ServeConfig) -> dict:
    """`create_app`'s keyword arguments from the config."""
    return dict(request_timeout_s=cfg.api.request_timeout_s,
                max_body_bytes=cfg.api.max_body_bytes, body_timeout_s=cfg.api.body_timeout_s,
                no_logprobs=VLLM_NO_LOGPROBS if cfg.vllm else None)


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
                         **app_options(cfg))
        with serve_in_thread(app, cfg.api.host, cfg.api.port, sock=sock) as url:
            yield url, router
    finally:
        sock.close()
        stop(router)
