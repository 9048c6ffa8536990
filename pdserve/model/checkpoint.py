"""An HF checkpoint directory as shipped, checked from its headers and read slice by slice.

The layouts: `model.safetensors`, or shards `model-0000k-of-0000n.safetensors` named by
`model.safetensors.index.json` (its `weight_map`: tensor -> file; only the files it names are
read); without an index, every `*.safetensors` file in the directory. `Checkpoint` reads the
index and each file's header (names, shapes, dtypes; no tensor data) and `check` matches them
against a model's parameters, so a bad directory fails before any weight is read, let alone
placed on a device, with a `CheckpointError` naming the tensor and the file: a shard the index
names that is missing, a tensor the index names that its file lacks (or one a shard holds that
the index does not name), a parameter with no tensor, a tensor no parameter takes, a shape or
dtype that does not fit, and a `quantization_config` other than compressed-tensors' MXFP4.

`load` then reads, through safetensors' memory map (`get_slice`), only the part of each tensor
this TP rank holds: a row or column range of a sharded weight, the whole of a replicated one. A
floating tensor (fp32, fp16, bf16: Kimi ships bf16 with a few fp32 tensors) is cast to the
parameter's dtype; a linear may come as its MXFP4 pair (`pdserve.model.mxfp4`), of which the
groups covering the rank's columns are read and dequantized. The tensors of K3's MTP drafter
layers (`num_nextn_predict_layers`, not built) are passed over.
"""
from __future__ import annotations

import json
import re
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.model import mxfp4

INDEX_FILE = "model.safetensors.index.json"
FLOAT_DTYPES = ("F32", "F16", "BF16")
MXFP4_FORMAT = "mxfp4-pack-quantized"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class CheckpointError(ValueError):
    """A checkpoint directory that does not fit the model: the message names the tensor (or
    field) and the file."""


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: "BF16", "F32", "U8", ...


def check_quantization(config: dict, where: Path) -> None:
    """`quantization_config` is absent or compressed-tensors' MXFP4 (K3's routed experts);
    anything else is refused, naming it."""
    q = config.get("quantization_config")
    if q is None:
        return
    method = q.get("quant_method") if isinstance(q, dict) else None
    formats = {g.get("format", q.get("format")) for g in (q.get("config_groups") or {}).values()
               if isinstance(g, dict)} if method == "compressed-tensors" else set()
    if method != "compressed-tensors" or formats != {MXFP4_FORMAT}:
        got = f"quant_method {method!r}" + (f", formats {sorted(map(str, formats))}"
                                             if method == "compressed-tensors" else "")
        raise CheckpointError(f"{where}: quantization_config: {got} is not supported; pdserve "
                              f"loads float weights (fp32, fp16, bf16) and compressed-tensors "
                              f"{MXFP4_FORMAT!r} linears")


class Checkpoint:
    """The tensors of a checkpoint directory, from its index and headers."""

    def __init__(self, directory: str | Path):
        self.directory = d = Path(directory)
        config = d / "config.json"
        check_quantization(json.loads(config.read_text()) if config.exists() else {}, config)
        index = d / INDEX_FILE
        if index.exists():
            files = self._indexed(index)
        else:
            files = {f: None for f in sorted(d.glob("*.safetensors"))}
            if not files:
                raise CheckpointError(f"{d}: no {INDEX_FILE} and no *.safetensors files")
        self.tensors: dict[str, TensorInfo] = {}
        for f, names in files.items():
            with safe_open(str(f), framework="pt") as st:
                keys = set(st.keys())
                for k in keys:
                    sl = st.get_slice(k)
                    self.tensors[k] = TensorInfo(f, tuple(sl.get_shape()), sl.get_dtype())
            if names is not None:
                lacking, unnamed = sorted(names - keys), sorted(keys - names)
                if lacking:
                    raise CheckpointError(f"{index} puts {lacking[0]} in {f.name}, which lacks "
                                          f"it ({len(lacking)} tensors missing there)")
                if unnamed:
                    raise CheckpointError(f"{f} holds {unnamed[0]}, which {index.name} does not "
                                          f"name ({len(unnamed)} such tensors)")
        self.bytes_read = 0  # of tensor data, by `load`

    def _indexed(self, index: Path) -> dict[Path, set[str]]:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            assert isinstance(weight_map, dict)
        except (ValueError, KeyError, TypeError, AssertionError):
            raise CheckpointError(f"{index}: not an index (a JSON object with a weight_map of "
                                  "tensor -> file)") from None
        files: dict[Path, set[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(self.directory / file, set()).add(name)
        for f, names in files.items():
            if not f.exists():
                raise CheckpointError(f"{index} names shard {f.name}, which is missing "
                                      f"({len(names)} tensors, e.g. {min(names)})")
        return files

    # -- matching the model ----------------------------------------------------------------
    def _sources(self, name: str) -> tuple[str, ...] | None:
        """The tensors parameter `name` is loaded from: itself, or its MXFP4 pair."""
        if name in self.tensors:
            return (name,)
        if name.endswith(".weight"):
            base = name[:-len("weight")]
            pair = (base + mxfp4.PACKED, base + mxfp4.SCALE)
            if all(k in self.tensors for k in pair):
                return pair
        return None

    def _where(self, name: str) -> str:
        return f"{name} in {self.tensors[name].file.name}"

    def check(self, model: torch.nn.Module) -> dict[str, tuple[str, ...]]:
        """Each parameter's source tensors, having checked names, shapes and dtypes (headers
        only); raises `CheckpointError` at the first problem."""
        params = dict(model.named_parameters())
        sources = {name: self._sources(name) for name in params}
        missing = sorted(name for name, src in sources.items() if src is None)
        if missing:
            more = f" and {len(missing) - 1} more tensors" if len(missing) > 1 else ""
            raise CheckpointError(f"{self.directory} lacks {missing[0]} (shape "
                                  f"{params[missing[0]].full_shape}){more}")
        used = {k for src in sources.values() for k in src}
        unused = sorted(k for k in self.tensors if k not in used and not _drafter(k, model))
        if unused:
            raise CheckpointError(f"{self.directory} has {len(unused)} tensors the model does "
                                  f"not use, e.g. {self._where(unused[0])}")
        for name, src in sources.items():
            self._check_one(name, params[name], src)
        return sources

    def _check_one(self, name: str, p: torch.nn.Parameter, src: tuple[str, ...]) -> None:
        full = p.full_shape
        if len(src) == 1:
            info = self.tensors[name]
            if info.dtype not in FLOAT_DTYPES:
                raise CheckpointError(f"{self._where(name)}: dtype {info.dtype}, expected a float "
                                      f"({', '.join(FLOAT_DTYPES)}) for the model's {p.dtype}")
            if info.shape != full:
                raise CheckpointError(f"{self._where(name)}: shape {info.shape}, the model's is "
                                      f"{full}")
            return
        if full[-1] % mxfp4.GROUP:
            raise CheckpointError(f"{self._where(src[0])}: MXFP4 needs the input dim of {full} to "
                                  f"be a multiple of {mxfp4.GROUP}")
        want = {src[0]: (*full[:-1], full[-1] // 2), src[1]: (*full[:-1], full[-1] // mxfp4.GROUP)}
        for k, shape in want.items():
            info = self.tensors[k]
            if info.dtype != "U8":
                raise CheckpointError(f"{self._where(k)}: dtype {info.dtype}, MXFP4 is U8")
            if info.shape != shape:
                raise CheckpointError(f"{self._where(k)}: shape {info.shape}, expected {shape} "
                                      f"for the model's {name} {full}")

    # -- reading ---------------------------------------------------------------------------
    def load(self, model: torch.nn.Module) -> None:
        """Check, then fill every parameter with this rank's slice of its tensor."""
        sources = self.check(model)
        tp = model.tp
        with ExitStack() as stack:
            opened = {}

            def slice_of(key: str):
                f = self.tensors[key].file
                if f not in opened:
                    opened[f] = stack.enter_context(safe_open(str(f), framework="pt"))
                return opened[f].get_slice(key)

            for name, p in model.named_parameters():
                dim = p.shard_dim
                n = 0 if dim is None else p.shape[dim]
                lo, hi = (0, None) if dim is None else (tp.rank * n, (tp.rank + 1) * n)
                if len(sources[name]) == 1:
                    value = self._read(slice_of(name), dim, lo, hi)
                else:
                    value = self._read_mxfp4(*map(slice_of, sources[name]), p, dim, lo, hi)
                with torch.no_grad():  # bumps the parameter's version, unlike .data
                    p.copy_(value.to(p.dtype))

    def _read(self, sl, dim: int | None, lo: int, hi: int | None) -> torch.Tensor:
        """Rows lo:hi of dimension `dim` (all of it when None), read from the memory map."""
        index = (slice(None),) * (dim or 0) + (slice(lo, hi),)
        t = sl[index]
        self.bytes_read += t.numel() * t.element_size()
        return t

    def _read_mxfp4(self, packed, scale, p, dim, lo, hi) -> torch.Tensor:
        last = len(p.full_shape) - 1
        if dim != last:  # rows of both (or all of them)
            return mxfp4.dequantize(self._read(packed, dim, lo, hi), self._read(scale, dim, lo, hi))
        # the 32-column groups covering [lo, hi), then the rank's columns of them
        g0, g1 = lo // mxfp4.GROUP, -(-hi // mxfp4.GROUP)
        w = mxfp4.dequantize(self._read(packed, dim, g0 * mxfp4.GROUP // 2, g1 * mxfp4.GROUP // 2),
                             self._read(scale, dim, g0, g1))
        return w[..., lo - g0 * mxfp4.GROUP:hi - g0 * mxfp4.GROUP]


def _drafter(name: str, model: torch.nn.Module) -> bool:
    """A tensor of K3's MTP drafter layers, numbered after the main ones (not built)."""
    c = model.config
    m = _LAYER.match(name)
    return (m is not None and c.num_hidden_layers <= int(m.group(1))
            < c.num_hidden_layers + c.num_nextn_predict_layers)
