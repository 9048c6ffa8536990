"""Checks every CuTe DSL guard starts with: the device and the DSL itself."""
from __future__ import annotations


def sm90_refusal(device_type: str, capability) -> str | None:
    """Why a call on this device is not for an sm_90a kernel, or None."""
    if device_type != "cuda":
        return f"needs a CUDA device, got {device_type}"
    if capability != (9, 0):
        return f"needs sm_90 (Hopper), got capability {capability}"
    return None


def cutedsl_refusal() -> str | None:
    """Why CuTe DSL cannot be imported here, or None."""
    try:
        import cutlass  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the environment
        return f"CuTe DSL unavailable: {type(exc).__name__}: {exc}"
    return None
