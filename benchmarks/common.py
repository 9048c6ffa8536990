"""Shared by the benchmarks: environment facts, result files, text tables, CUDA-event and
CUDA-graph timing."""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

RESULTS = Path(__file__).resolve().parent / "results"


def environment(commit: str | None = None) -> dict:
    """`commit`: the tree's commit as the caller knows it (a device copy's git metadata may be
    stale); else the checkout's own."""
    import torch

    env = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "python": platform.python_version(), "torch": torch.__version__,
           "machine": platform.machine(), "cpu_count": os.cpu_count(),
           "torch_threads": torch.get_num_threads(),
           "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else
           f"CPU ({platform.processor() or platform.machine()})", "commit": commit or _commit()}
    if torch.cuda.is_available():
        env["cuda"] = torch.version.cuda
        env["capability"] = list(torch.cuda.get_device_capability(0))
        env["sm_count"] = torch.cuda.get_device_properties(0).multi_processor_count
    for dist, module in (("pdserve", "pdserve"), ("nvidia-cutlass-dsl", "cutlass"),
                         ("fla-core", "fla"), ("triton", "triton")):
        v = _version(dist, module)
        if v:
            env[dist] = v
    return env


def _version(dist: str, module: str) -> str | None:
    """The installed distribution's version, else the module's __version__ (the H200 carries
    some packages on PYTHONPATH without their metadata), else None (not installed)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(dist)
    except PackageNotFoundError:
        pass
    try:
        return getattr(__import__(module), "__version__", None)
    except Exception:  # noqa: BLE001 - an unimportable package is simply not recorded
        return None


def _commit() -> str | None:
    import subprocess
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, timeout=10, cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def write_result(name: str, figures: dict, out_dir: str | os.PathLike | None = None,
                 commit: str | None = None) -> Path:
    """Write `{environment, figures}` as JSON to `<out_dir or results/>/<name>.json`."""
    d = Path(out_dir) if out_dir else RESULTS
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{name}.json"
    path.write_text(json.dumps({"environment": environment(commit), "figures": figures}, indent=2))
    return path


class Column(NamedTuple):
    """One column of a text table of dict rows. `value`: the row's key (default `head`) or a
    function of the row; `fmt`: a format spec for it (default: integers as they are, floats to 4
    significant digits); a missing or None value prints "-". `width`: the least width, which a
    table printed row by row as its figures arrive needs for values wider than the heading."""
    head: str
    value: str | Callable[[Mapping], Any] | None = None
    fmt: str = ""
    width: int = 0
    left: bool = False  # names read better left-aligned, figures right-aligned

    def cell(self, row: Mapping) -> str:
        v = self.value(row) if callable(self.value) else row.get(self.value or self.head)
        if v is None:
            return "-"
        if self.fmt:
            return format(v, self.fmt)
        return f"{v:.4g}" if isinstance(v, float) else str(v)


class Table:
    """A plain-text table: `header()` and `row(r)` print one line each at the columns' fixed
    widths (for rows printed as they are measured); `format(rows)` sizes the columns to their
    contents. A column given as a string is `Column(that string)`."""

    def __init__(self, columns: Sequence[Column | str]):
        self.columns = [c if isinstance(c, Column) else Column(c) for c in columns]

    @classmethod
    def of(cls, rows: Sequence[Mapping]) -> Table:
        """A column per key of the first row, headed by the key."""
        return cls(list(rows[0]) if rows else [])

    def header(self) -> str:
        return self._line([c.head for c in self.columns], self._widths())

    def row(self, row: Mapping) -> str:
        return self._line([c.cell(row) for c in self.columns], self._widths())

    def format(self, rows: Sequence[Mapping]) -> str:
        cells = [[c.cell(r) for c in self.columns] for r in rows]
        widths = [max([w] + [len(line[i]) for line in cells])
                  for i, w in enumerate(self._widths())]
        heads = [c.head for c in self.columns]
        return "\n".join(self._line(line, widths) for line in [heads] + cells)

    def _widths(self) -> list[int]:
        return [max(c.width, len(c.head)) for c in self.columns]

    def _line(self, cells: list[str], widths: list[int]) -> str:
        return " ".join(cell.ljust(w) if c.left else cell.rjust(w)
                        for cell, w, c in zip(cells, widths, self.columns)).rstrip()


def event_times_ms(fn, reps: int, warmup: int = 0) -> list[float]:
    """Milliseconds of each of `reps` runs of fn(), each between two CUDA events on the current
    stream, after `warmup` untimed runs."""
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times


def capture_graph(run_all, warm_up=None):
    """A CUDA graph of run_all(), captured after warm_up() (default run_all) ran once on a side
    stream, so that compiling and autotuning happen outside the capture."""
    import torch
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        (warm_up or run_all)()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run_all()
    torch.cuda.synchronize()
    return g
