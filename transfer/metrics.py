"""Transfer metrics: bytes and seconds per state kind, descriptors, failures, lease expiries.
A plain accumulator; the API layer exports `snapshot()`."""
from __future__ import annotations

import threading
from collections import Counter

import msgspec

from pdserve.transfer.planner import KINDS


class TransferStats(msgspec.Struct):
    transfers: int = 0
    failures: dict[str, int] = {}
    bytes_by_kind: dict[str, int] = {}
    seconds_by_kind: dict[str, float] = {}
    descriptors: int = 0
    plan_runs: int = 0
    control_seconds: float = 0.0   # plan + post + notify
    verify_seconds: float = 0.0
    lease_expiries: int = 0
    sources_freed: int = 0


class TransferMetrics:
    def __init__(self):
        self._lock = threading.Lock()
        self._bytes, self._secs, self._fail = Counter(), Counter(), Counter()
        self._n = self._desc = self._runs = self._expired = self._freed = 0
        self._control = self._verify = 0.0

    def transfer(self, bytes_by_kind: dict[str, int], seconds_by_kind: dict[str, float],
                 descriptors: int, runs: int, control_s: float, verify_s: float) -> None:
        with self._lock:
            self._n += 1
            self._bytes.update(bytes_by_kind)
            self._secs.update(seconds_by_kind)
            self._desc += descriptors
            self._runs += runs
            self._control += control_s
            self._verify += verify_s

    def failure(self, error: Exception) -> None:
        with self._lock:
            self._fail[type(error).__name__] += 1

    def lease_expired(self) -> None:
        with self._lock:
            self._expired += 1

    def source_freed(self) -> None:
        with self._lock:
            self._freed += 1

    def snapshot(self) -> TransferStats:
        with self._lock:
            return TransferStats(
                transfers=self._n, failures=dict(self._fail),
                bytes_by_kind={k: self._bytes[k] for k in KINDS},
                seconds_by_kind={k: self._secs[k] for k in KINDS}, descriptors=self._desc,
                plan_runs=self._runs, control_seconds=self._control,
                verify_seconds=self._verify, lease_expiries=self._expired,
                sources_freed=self._freed)
