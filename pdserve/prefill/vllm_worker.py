"""Worker extension for vLLM (`worker_extension_cls`): lets the process that owns a `vllm.LLM`
reach each worker's `PdserveConnector` through `LLM.collective_rpc` (agent info, connect,
cancel, renew, digests), since the connector's NIXL agent lives in the worker process."""
from __future__ import annotations


class PdserveWorkerExtension:
    """Mixed into vLLM's worker class; every method runs in one worker, between engine steps."""

    def _pdserve(self):
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return get_kv_transfer_group()

    def pdserve_info(self) -> bytes:
        return self._pdserve().pdserve_info()

    def pdserve_connect(self, infos: list[bytes]) -> None:
        self._pdserve().pdserve_connect(infos)

    def pdserve_cancel(self, request_id: str) -> bool:
        return self._pdserve().pdserve_cancel(request_id)

    def pdserve_renew(self, request_id: str, lease_s: float) -> float:
        return self._pdserve().pdserve_renew(request_id, lease_s)

    def pdserve_digests(self, request_id: str, runs: list) -> list[int]:
        return self._pdserve().pdserve_digests(request_id, runs)

    def pdserve_held(self) -> list[str]:
        return self._pdserve().pdserve_held()
