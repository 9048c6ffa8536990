"""Per-op backend registry with guards.

A backend registers an implementation of an op (e.g. "kda_decode", "mla_decode") together with a
guard: a function of the step's problem description (arch, heads, batch, dtypes, layouts, ...) that
returns None when the implementation supports it, or a short reason when it does not. `resolve`
picks the requested backend when its guard passes and otherwise falls back to "reference", logging
the reason once per (op, backend, reason) so a fallback is never silent and never spams.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping

log = logging.getLogger("pdserve.kernels")

REFERENCE = "reference"

Guard = Callable[[Mapping[str, Any]], "str | None"]


@dataclass(frozen=True)
class Entry:
    impl: Callable[..., Any]
    guard: Guard


@dataclass(frozen=True)
class Resolution:
    impl: Callable[..., Any]
    backend: str            # the backend that will run
    fallback_reason: str | None  # why the requested backend was not used, if it was not


_entries: dict[tuple[str, str], Entry] = {}
_logged: set[tuple[str, str, str]] = set()


def register(op: str, backend: str, impl: Callable[..., Any], guard: Guard | None = None) -> None:
    """Register `impl` for `op` under `backend` (re-registration replaces the entry)."""
    _entries[(op, backend)] = Entry(impl, guard or (lambda problem: None))


def backends(op: str) -> list[str]:
    return sorted(b for (o, b) in _entries if o == op)


def fallbacks() -> list[tuple[str, str, str]]:
    """Every (op, requested backend, reason) that fell back so far in this process."""
    return sorted(_logged)


def resolve(op: str, backend: str, problem: Mapping[str, Any]) -> Resolution:
    """The implementation that serves `op` for `problem` when `backend` is requested."""
    ref = _entries.get((op, REFERENCE))
    if ref is None:
        raise KeyError(f"op {op!r} has no {REFERENCE!r} implementation registered")
    if backend == REFERENCE:
        return Resolution(ref.impl, REFERENCE, None)
    entry = _entries.get((op, backend))
    if entry is None:
        reason = f"backend {backend!r} is not registered for {op!r} (known: {backends(op)})"
    else:
        try:
            reason = entry.guard(problem)
        except Exception as exc:  # a broken guard must not take the step down, but must be seen
            reason = f"guard raised {type(exc).__name__}: {exc}"
        if reason is None:
            return Resolution(entry.impl, backend, None)
    key = (op, backend, reason)
    if key not in _logged:
        _logged.add(key)
        log.warning("%s: falling back from %s to %s: %s", op, backend, REFERENCE, reason)
    return Resolution(ref.impl, REFERENCE, reason)
