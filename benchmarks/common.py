"""Shared by the benchmarks: environment facts and result files."""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def environment() -> dict:
    import torch

    env = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "python": platform.python_version(), "torch": torch.__version__,
           "machine": platform.machine(), "cpu_count": os.cpu_count(),
           "torch_threads": torch.get_num_threads(),
           "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else
           f"CPU ({platform.processor() or platform.machine()})"}
    try:
        from importlib.metadata import version
        env["pdserve"] = version("pdserve")
    except Exception:
        pass
    return env


def write_result(name: str, figures: dict, out_dir: str | os.PathLike | None = None) -> Path:
    """Write `{environment, figures}` as JSON to `<out_dir or results/>/<name>.json`."""
    d = Path(out_dir) if out_dir else RESULTS
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{name}.json"
    path.write_text(json.dumps({"environment": environment(), "figures": figures}, indent=2))
    return path
