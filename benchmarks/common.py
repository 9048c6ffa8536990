"""Shared by the benchmarks: environment facts, result files, CUDA-event and CUDA-graph timing."""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
from pathlib import Path

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
