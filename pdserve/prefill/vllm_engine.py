"""The `vllm` prefill engine: stock vLLM (`vllm.LLM`) behind the prefill interface of
`pdserve.prefill.engine.PrefillRank`.

One `VllmPrefill` is a whole prefill instance (vLLM drives its own TP workers). It loads an HF
directory written by `pdserve export`, runs each request's prompt with max_tokens=1 (all N prompt
tokens are computed and the first output token is sampled, so decode resumes from the state after
exactly N tokens), and turns the `PdserveConnector`'s `kv_transfer_params` into a `StateHandle`.
vLLM frees the blocks itself once the decode side says "done", on cancel, or at lease expiry.

vLLM is imported only when an engine is built (GPU machines); this module imports without it.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import msgspec

from pdserve.model.config import load_config
from pdserve.model.sampling import Request, SamplingParams
from pdserve.prefill.engine import PrefillResult
from pdserve.prefill.handle import StateHandle
from pdserve.prefill.vllm_state import decode_export
from pdserve.transfer.nixl_agent import AgentInfo

CONNECTOR = "PdserveConnector"
CONNECTOR_MODULE = "pdserve.prefill.vllm_connector"
WORKER_EXTENSION = "pdserve.prefill.vllm_worker.PdserveWorkerExtension"


class VllmEngineConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: str                          # HF directory (`pdserve export --out DIR`)
    tp: int = 1
    dtype: str = "bfloat16"             # vLLM's MLA kernels need 16-bit activations
    max_model_len: int = 8192
    gpu_memory_utilization: float = 0.5
    # vLLM's cache is registered with NIXL whole, and the decode side prepares descriptors over
    # it, so a cap here bounds that cost too (None = whatever memory allows).
    num_gpu_blocks: int | None = None
    enforce_eager: bool = True
    lease_s: float = 30.0
    rpc_timeout_s: float = 30.0         # deadline for every call into the workers


def engine_args(instance: str, generation: int, cfg: VllmEngineConfig) -> dict:
    """Keyword arguments of `vllm.LLM` for a pdserve prefill instance."""
    args = dict(
        model=cfg.model, tensor_parallel_size=cfg.tp, dtype=cfg.dtype,
        max_model_len=cfg.max_model_len, gpu_memory_utilization=cfg.gpu_memory_utilization,
        enforce_eager=cfg.enforce_eager,
        skip_tokenizer_init=True,       # token ids in, token ids out
        enable_prefix_caching=False,    # one running KDA slot per request, no align-mode tables
        async_scheduling=False,         # the exported state must be the one after the prompt
        worker_extension_cls=WORKER_EXTENSION,
        kv_transfer_config=dict(
            kv_connector=CONNECTOR, kv_connector_module_path=CONNECTOR_MODULE,
            kv_role="kv_producer", engine_id=instance,
            kv_connector_extra_config={"lease_s": cfg.lease_s, "generation": generation}),
    )
    if cfg.num_gpu_blocks is not None:
        args["num_gpu_blocks_override"] = cfg.num_gpu_blocks
    if cfg.tp > 1:
        # vLLM picks its Ray executor when it runs inside a Ray placement group (a pdserve
        # engine actor); its own spawned workers are what the actor's GPUs are held for.
        args["distributed_executor_backend"] = "mp"
    return args


EXPORT_TAGS = {"bfloat16": "bf16", "float16": "fp16"}   # the weight format in the export key


def export_name(name: str, config, seed: int, dtype: str = "bfloat16") -> str:
    """Directory name of an automatic export: the preset, the seed and a hash of the config and
    the weight format."""
    from pdserve.model.weights import hf_config_dict

    key = (json.dumps(hf_config_dict(config), sort_keys=True, default=str)
           + f"|seed={seed}|{EXPORT_TAGS[dtype]}")
    p = Path(name)
    stem = p.parent.name if p.name == "config.json" else p.name
    return f"{stem}-seed{seed}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def ensure_export(directory: str | Path, config, seed: int, dtype: str = "bfloat16",
                  lock_timeout_s: float = 3600.0) -> Path:
    """`directory` as an HF directory of `config`'s seeded weights in `dtype` (the layout
    `pdserve export` writes): written once, atomically (a temporary directory renamed into place
    under a file lock), and reused while it is there. Waits at most `lock_timeout_s` for another
    process's export (the full 48B model takes minutes)."""
    import torch

    from pdserve.model.weights import export_checkpoint

    out = Path(directory).expanduser()
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    lock_path = out.parent / f".{out.name}.lock"
    with open(lock_path, "w") as lock:
        deadline = time.monotonic() + lock_timeout_s
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{out}: another live process has held the export "
                                       f"lock {lock_path} for over {lock_timeout_s:.0f} s (its "
                                       "export is still running or stuck)") from None
                time.sleep(0.5)
        if (out / "config.json").exists() and any(out.glob("*.safetensors")):
            return out
        tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            export_checkpoint(str(tmp), config, seed=seed, dtype=getattr(torch, dtype))
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def vllm_sampling_kwargs(params: SamplingParams) -> dict:
    """vLLM SamplingParams for the first token of a pdserve request (max_tokens=1).

    Greedy is bit-identical to a monolithic vLLM run; with temperature > 0 the first token is
    vLLM's own draw (its sampler, seeded with the request's seed), the rest pdserve's."""
    kw = dict(max_tokens=1, temperature=params.temperature, top_p=params.top_p,
              seed=params.seed, stop_token_ids=list(params.stop_token_ids),
              ignore_eos=params.ignore_eos, detokenize=False)
    if params.top_k:
        kw["top_k"] = params.top_k
    return kw


def result_from_output(req: Request, params: SamplingParams, instance: str, generation: int,
                       first_token: int, finish_reason: str | None,
                       kv_transfer_params: dict | None) -> PrefillResult:
    """A `PrefillResult` from one vLLM output (`params` carry the concrete seed)."""
    if kv_transfer_params and "pdserve_error" in kv_transfer_params:
        return PrefillResult(req.request_id, error=kv_transfer_params["pdserve_error"])
    try:
        export = decode_export(kv_transfer_params)
    except Exception as exc:
        return PrefillResult(req.request_id, error=f"{type(exc).__name__}: {exc}")
    finished = "stop" if finish_reason == "stop" else ("length" if req.params.max_tokens <= 1
                                                       else None)
    return PrefillResult(req.request_id, StateHandle(
        req.request_id, instance, generation, export.agents, export.manifest, first_token,
        params, export.num_tokens, export.lease_deadline, finished))


class HandleBook:
    """Our request id -> vLLM's request id (the key of its lease in vLLM's workers), with when it
    was recorded. vLLM's workers free a request's blocks themselves (the decode side's done, the
    lease, an abort), so entries whose request no worker holds any more are dropped by `prune`;
    only entries older than `min_age_s` go, so one recorded just before the workers registered
    its lease stays."""

    def __init__(self, min_age_s: float):
        self.min_age_s = min_age_s
        self._ids: dict[str, tuple[str, float]] = {}

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, request_id: str, vllm_id: str, now: float) -> None:
        self._ids[request_id] = (vllm_id, now)

    def pop(self, request_id: str) -> str | None:
        entry = self._ids.pop(request_id, None)
        return None if entry is None else entry[0]

    def get(self, request_id: str, instance: str) -> str:
        entry = self._ids.get(request_id)
        if entry is None:
            raise KeyError(f"prefill instance {instance} holds no state for request "
                           f"{request_id!r} (never prefilled here, or already read, cancelled or "
                           f"expired)")
        return entry[0]

    def prune(self, held: set[str], now: float) -> list[str]:
        """Drop (and return) our ids whose vLLM request is in no worker's `held` set and that
        were recorded at least min_age_s ago."""
        gone = [rid for rid, (vid, t) in self._ids.items()
                if vid not in held and now - t >= self.min_age_s]
        for rid in gone:
            del self._ids[rid]
        return gone


PRUNE_S = 10.0   # how often poll() asks the workers what they hold, and the minimum entry age


class VllmPrefill:
    """A prefill instance running stock vLLM (TP = `cfg.tp` workers inside vLLM)."""

    def __init__(self, instance: str, generation: int, cfg: VllmEngineConfig):
        from vllm import LLM  # GPU only; see module docstring

        # vLLM forks its engine core by default, which fails in a process that has touched CUDA
        # already (seen on the H200: "Cannot re-initialize CUDA in forked subprocess").
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        self.instance, self.generation, self.cfg = instance, generation, cfg
        self.config = load_config(cfg.model)
        self.llm = LLM(**engine_args(instance, generation, cfg))
        self.handles = HandleBook(PRUNE_S)
        self._pruned = time.monotonic()

    def _rpc(self, method: str, *args) -> list:
        return self.llm.collective_rpc(method, timeout=self.cfg.rpc_timeout_s, args=args)

    def info(self) -> list[AgentInfo]:
        """Every TP rank's NIXL agent, in rank order."""
        from pdserve.prefill.vllm_connector import RankExport

        infos = [msgspec.msgpack.decode(raw, type=RankExport).agent for raw in self._rpc("pdserve_info")]
        return sorted(infos, key=lambda a: a.rank)

    def connect(self, infos: list[AgentInfo]) -> None:
        self._rpc("pdserve_connect", [msgspec.msgpack.encode(i) for i in infos])

    def geometry(self):
        """vLLM's cache layout (`KvGeometry`), the same on every worker (checked)."""
        from pdserve.prefill.vllm_connector import RankExport

        geos = [msgspec.msgpack.decode(raw, type=RankExport).geometry
                for raw in self._rpc("pdserve_info")]
        if any(not g.same_layout(geos[0]) for g in geos[1:]):
            raise RuntimeError(f"prefill instance {self.instance}: vLLM's workers report "
                               f"different cache layouts: {geos}")
        return geos[0]

    def prefill(self, requests: list[Request], agents: list[AgentInfo] | None = None,
                threads: int | None = None) -> list[PrefillResult]:
        """Prefill `requests` together (vLLM batches them); first token + handle per request.
        `agents` and `threads` are accepted for parity with `PrefillRank.prefill` (the router
        calls both alike): the handles carry vLLM's own rank agents, and vLLM's workers own
        their threads."""
        from vllm import SamplingParams as VllmSamplingParams

        params = [r.params.with_seed() for r in requests]
        outs = self.llm.generate([{"prompt_token_ids": list(r.prompt)} for r in requests],
                                 [VllmSamplingParams(**vllm_sampling_kwargs(p)) for p in params],
                                 use_tqdm=False)
        results = []
        for req, p, out in zip(requests, params, outs):
            c = out.outputs[0]
            if not c.token_ids:
                results.append(PrefillResult(req.request_id, error=f"vLLM produced no token "
                                             f"(finish_reason={c.finish_reason})"))
                continue
            res = result_from_output(req, p, self.instance, self.generation, int(c.token_ids[0]),
                                     c.finish_reason, out.kv_transfer_params)
            if res.handle is not None:
                self.handles.add(req.request_id, res.handle.manifest.request_id,
                                 time.monotonic())
                if res.handle.finished:  # nothing to transfer: free vLLM's blocks now
                    self.cancel(req.request_id)
            results.append(res)
        return results

    def poll(self) -> list[tuple[str, str]]:
        """vLLM's workers free state themselves (done / lease expiry); every PRUNE_S this drops
        the handles of requests they no longer hold, so the book does not grow with traffic."""
        now = time.monotonic()
        if len(self.handles) and now - self._pruned >= PRUNE_S:
            self._pruned = now
            self.handles.prune({r for rank in self._rpc("pdserve_held") for r in rank}, now)
        return []

    def cancel(self, request_id: str) -> bool:
        vllm_id = self.handles.pop(request_id)
        return vllm_id is not None and any(self._rpc("pdserve_cancel", vllm_id))

    def renew(self, request_id: str, lease_s: float) -> float:
        return min(self._rpc("pdserve_renew", self.handles.get(request_id, self.instance), lease_s))

    def digests(self, request_id: str, runs, rank: int = 0) -> list[int]:
        return self._rpc("pdserve_digests", self.handles.get(request_id, self.instance),
                         list(runs))[rank]

    def stats(self) -> dict:
        held = self._rpc("pdserve_held")
        return {"held": len(held[0]) if held else 0, "engine": "vllm", "tp": self.cfg.tp,
                "time": time.time()}

    def close(self) -> None:
        # vLLM tears its workers (and so the connectors' agents) down with the engine; shut its
        # engine core down now rather than at garbage collection (the GPUs are freed then)
        llm, self.llm = self.llm, None
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        try:
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
        except Exception:
            pass
