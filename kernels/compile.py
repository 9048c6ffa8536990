"""What every CuTe DSL launcher here shares: global-memory pointers and the compile cache."""
from __future__ import annotations

import threading
from typing import Any, Callable, Hashable

import cutlass.cute as cute


def gmem_ptr(dtype, addr: int, align: int):
    """A global-memory pointer of `dtype` at `addr`, assumed `align`-byte aligned."""
    from cutlass.cute.runtime import make_ptr
    return make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=align)


def fake_ptrs(specs) -> list:
    """Stand-in pointers for compiling without tensors: one per (dtype, align) of `specs`."""
    return [gmem_ptr(dt, 1 << 20, al) for dt, al in specs]


class CompileCache:
    """Compiled variants by key, built once per process. `build(**opts)` compiles one variant;
    with `dump_dir` it is compiled afresh keeping its PTX and cubin there (`.artifacts`)."""

    def __init__(self):
        self._compiled: dict[Hashable, Any] = {}
        self._lock = threading.Lock()

    def get(self, key: Hashable, build: Callable[..., Any], dump_dir: str | None = None):
        if dump_dir is not None:
            return build(options=f"--keep-ptx --keep-cubin --dump-dir={dump_dir}")
        with self._lock:
            fn = self._compiled.get(key)
            if fn is None:
                fn = self._compiled[key] = build()
        return fn
