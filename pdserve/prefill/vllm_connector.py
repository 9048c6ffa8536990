"""`PdserveConnector`: a vLLM KV connector (V1 + HMA) that makes a stock vLLM engine a pdserve
prefill instance, with no patch to vLLM:

    kv_transfer_config = {"kv_connector": "PdserveConnector",
                          "kv_connector_module_path": "pdserve.prefill.vllm_connector",
                          "kv_role": "kv_producer", "engine_id": "<instance>",
                          "kv_connector_extra_config": {"lease_s": 30, "generation": 1}}

Scheduler side: prefill only (nothing is ever loaded). When a request finishes with its first
token, vLLM keeps its blocks (delay_free) and its output's `kv_transfer_params["pdserve"]` carries
a `PrefillExport`: the `StateManifest` (MLA kernel blocks as latent pages, the running KDA slot
of every KDA layer, vLLM's strides and dtypes) and every TP rank's NIXL `AgentInfo`. Aborted or
failed requests are freed at once.

Worker side: `register_kv_caches` registers vLLM's own cache tensors with a pdserve `RankAgent`, so
`pdserve.transfer` reads them in place; `get_finished` reports a request as finished sending once
every decode rank sent "done" (pdserve.transfer.source's message), a cancel arrived, or its lease
expired. The logic lives in `vllm_state` (tested without vLLM); this module is the glue.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorHandshakeMetadata, KVConnectorMetadata, KVConnectorRole,
    SupportsHMA)

from pdserve.model.config import load_config
from pdserve.prefill.vllm_state import (
    GroupSpec, KvGeometry, LeaseBook, PrefillExport, SendTracker, describe_kv_caches,
    encode_export, manifest_from_vllm, register_in_place)
from pdserve.state.layout import RankShapes
from pdserve.transfer.nixl_agent import AgentInfo, RankAgent

log = logging.getLogger(__name__)


class ConnectorSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`kv_connector_extra_config`."""

    lease_s: float = 30.0        # source state lifetime without a reader
    generation: int = 0          # bumped on restart, so decode ranks evict stale agents
    model_config: str = ""       # pdserve config.json (default: vLLM's model directory)


class RankExport(msgspec.Struct, frozen=True):
    """One worker's handshake: its agent and its cache geometry."""

    agent: AgentInfo
    geometry: KvGeometry


@dataclass
class PdHandshake(KVConnectorHandshakeMetadata):
    payload: bytes  # msgpack RankExport (msgspec keeps the contract; vLLM just carries bytes)


@dataclass
class PdStepMetadata(KVConnectorMetadata):
    holds: dict[str, float] = field(default_factory=dict)  # request id -> lease seconds
    cancels: list[str] = field(default_factory=list)


def group_specs(kv_cache_config) -> list[GroupSpec]:
    """vLLM's KV-cache groups as GroupSpecs: state (Mamba) groups are KDA, the rest MLA."""
    from vllm.v1.kv_cache_interface import MambaSpec

    out = []
    for g in kv_cache_config.kv_cache_groups:
        spec = g.kv_cache_spec
        kda = isinstance(spec, MambaSpec)
        out.append(GroupSpec("kda" if kda else "mla", list(g.layer_names), spec.block_size,
                             getattr(spec, "num_speculative_blocks", 0) if kda else 0))
    return out


def conv_layout() -> str:
    """vLLM's conv-state layout: SD by default, DS under VLLM_SSM_CONV_STATE_LAYOUT=DS."""
    try:
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
        return "DS" if is_conv_state_dim_first() else "SD"
    except ImportError:  # older layouts of the package: the variable is the source of truth
        return os.environ.get("VLLM_SSM_CONV_STATE_LAYOUT", "SD").upper()


class PdserveConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        tc = vllm_config.kv_transfer_config
        self.settings = msgspec.convert(dict(tc.kv_connector_extra_config or {}), ConnectorSettings)
        self.instance = tc.engine_id
        self.tp = vllm_config.parallel_config.tensor_parallel_size
        self.config = load_config(self.settings.model_config or vllm_config.model_config.model)
        self.shapes = RankShapes.of(self.config, self.tp)
        if role == KVConnectorRole.SCHEDULER:
            self.groups = group_specs(kv_cache_config)
            self.leases = LeaseBook(self.settings.lease_s)
            self.ranks: dict[int, RankExport] = {}
        else:
            self.agent: RankAgent | None = None
            self.tracker: SendTracker | None = None
            self.geometry: KvGeometry | None = None

    # == scheduler side ============================================================================
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False  # a producer never loads

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output) -> PdStepMetadata:
        holds, cancels = self.leases.take()
        return PdStepMetadata(holds, cancels)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict | None]:
        from vllm.v1.request import RequestStatus

        hold = request.status == RequestStatus.FINISHED_LENGTH_CAPPED
        if not hold and request.status != RequestStatus.FINISHED_STOPPED:
            return False, None  # aborted / failed: free the blocks now
        try:
            # stopped: the first token ended the request; describe it (the handle says so) but
            # let vLLM free the blocks at once, as nothing will read them
            return hold, self._export(request, block_ids, hold)
        except Exception as exc:  # never take the engine down: the request fails, alone
            log.exception("pdserve: cannot export request %s", request.request_id)
            return False, {"pdserve_error": f"{type(exc).__name__}: {exc}"}

    def _export(self, request, block_ids, hold: bool) -> dict:
        n = request.num_prompt_tokens
        if request.num_computed_tokens != n:
            # the state must be the one after exactly the prompt (async scheduling may run ahead)
            raise RuntimeError(f"request {request.request_id}: {request.num_computed_tokens} tokens "
                               f"computed, expected the {n} prompt tokens (disable async scheduling)")
        if sorted(self.ranks) != list(range(self.tp)):
            raise RuntimeError(f"handshakes from TP ranks {sorted(self.ranks)} of {self.tp}")
        geometry = self.ranks[0].geometry
        manifest = manifest_from_vllm(request.request_id, self.config, self.shapes, geometry,
                                      self.groups, block_ids, n)
        deadline = self.leases.hold(request.request_id) if hold else time.monotonic()
        return encode_export(PrefillExport(
            request.request_id, manifest, [self.ranks[r].agent for r in range(self.tp)],
            time.time() + (deadline - time.monotonic()), n))

    def update_connector_output(self, connector_output) -> None:
        self.leases.freed(connector_output.finished_sending)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        for tp_rank, meta in metadata.items():
            self.ranks[tp_rank] = msgspec.msgpack.decode(meta.payload, type=RankExport)
        first = next(iter(self.ranks.values()), None)
        bad = [r for r, x in self.ranks.items() if first and not x.geometry.same_layout(first.geometry)]
        if bad:
            raise RuntimeError(f"TP ranks {bad} report a KV cache layout different from rank 0's")

    # == worker side ===============================================================================
    def register_kv_caches(self, kv_caches: dict) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        regions, self.geometry = describe_kv_caches(kv_caches, self.shapes, conv_layout())
        first = next(iter(kv_caches.values()))
        device = str((first if hasattr(first, "device") else first[0]).device)
        self.agent = register_in_place(self.instance, get_tensor_model_parallel_rank(),
                                       self.settings.generation, regions, device)
        self.tracker = SendTracker(self.agent)

    def get_handshake_metadata(self) -> PdHandshake | None:
        if self.agent is None:
            return None
        return PdHandshake(msgspec.msgpack.encode(RankExport(self.agent.info(), self.geometry)))

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.tracker is not None and isinstance(connector_metadata, PdStepMetadata):
            self.tracker.apply(connector_metadata.holds, connector_metadata.cancels)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        return None  # decode reads the cache in place; nothing is copied out

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.tracker is None:
            return None, None
        freed = self.tracker.poll()
        return (freed or None), None

    def shutdown(self) -> None:
        if getattr(self, "agent", None) is not None:
            self.agent.close()
            self.agent = None

    # == called through the worker extension (pdserve.prefill.vllm_worker) ========================
    def pdserve_info(self) -> bytes:
        return msgspec.msgpack.encode(RankExport(self.agent.info(), self.geometry))

    def pdserve_connect(self, infos: list[bytes]) -> None:
        for raw in infos:
            self.agent.connect(msgspec.msgpack.decode(raw, type=AgentInfo))

    def pdserve_cancel(self, request_id: str) -> bool:
        return self.tracker.source.cancel(request_id)

    def pdserve_renew(self, request_id: str, lease_s: float) -> float:
        """New deadline as wall clock (time.time())."""
        deadline = self.tracker.source.renew(request_id, lease_s)
        return time.time() + (deadline - time.monotonic())

    def pdserve_digests(self, request_id: str, runs: list) -> list[int]:
        return self.tracker.source.digests(request_id, [tuple(r) for r in runs])

    def pdserve_held(self) -> list[str]:
        return sorted(self.tracker.source.leases)
