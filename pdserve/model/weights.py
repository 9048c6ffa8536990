"""Weights: deterministic seeded initialization and HF-format safetensors checkpoints.

Seeded init draws the FULL tensor of each parameter (by its HF name) and slices it for this TP
rank; a checkpoint is read slice by slice (`pdserve.model.checkpoint`), each rank reading only
its part. Either way every TP size and every process computes the same model. Seeded values
depend only on (seed, parameter name): a parameter's generator is seeded from a hash of both.

A checkpoint may ship a linear's `<name>.weight` as MXFP4 (`<name>.weight_packed` +
`<name>.weight_scale`, `pdserve.model.mxfp4`), as K3 ships its routed experts; loading
dequantizes it into the parameter.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from pdserve.model import mxfp4
from pdserve.model.checkpoint import INDEX_FILE, Checkpoint
from pdserve.model.parallel import shard_of

WEIGHTS_FILE = "model.safetensors"


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _draw(shape: tuple[int, ...], kind: str, g: torch.Generator, device="cpu") -> torch.Tensor:
    """A fp32 tensor of init kind `kind` from generator `g` (on `device`)."""
    randn = lambda: torch.randn(shape, generator=g, device=device)  # noqa: E731
    if kind == "linear":  # variance-preserving, so deep random stacks keep sane activations
        return randn() / math.sqrt(shape[-1])
    if kind == "embedding":
        return randn()
    if kind == "norm":  # near 1 but not exactly, so a wrongly sliced norm weight shows
        return 1.0 + 0.1 * randn()
    if kind == "conv":
        return randn() / math.sqrt(shape[-1])
    if kind == "a_log":  # A in [1, 16] as in the reference init
        return torch.log(torch.empty(shape, device=device).uniform_(1.0, 16.0, generator=g))
    if kind == "dt_bias":
        return 0.5 * randn()
    if kind == "bias":
        return 0.1 * randn()
    raise ValueError(f"unknown init kind {kind!r}")


def init_full(name: str, shape: tuple[int, ...], kind: str, seed: int) -> torch.Tensor:
    """The full fp32 tensor of parameter `name`, drawn from its own generator."""
    try:
        return _draw(shape, kind, _generator(seed, name))
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def init_random(model: torch.nn.Module, seed: int = 0) -> None:
    """Fill every parameter in place on its own device with values of its init kind, from one
    device generator: random weights for benchmarks at full size (a 27-layer Kimi Linear is
    made on the GPU in seconds), not the seeded per-name values of `init_seeded`. Each rank's
    shard is drawn at its own shape."""
    gens: dict[torch.device, torch.Generator] = {}
    for p in model.parameters():
        g = gens.setdefault(p.device, torch.Generator(p.device).manual_seed(seed))
        with torch.no_grad():
            for chunk in (p.view(-1, *p.shape[-1:]).split(4096) if p.dim() > 1 else [p]):
                chunk.copy_(_draw(tuple(chunk.shape), p.init, g, p.device))


def init_seeded(model: torch.nn.Module, seed: int = 0) -> None:
    """Fill every parameter of `model` with this rank's slice of the seeded full tensor."""
    for name, p in model.named_parameters():
        full = init_full(name, p.full_shape, p.init, seed)
        with torch.no_grad():  # in place on the parameter: bumps its version (caches key on it)
            p.copy_(shard_of(full, p.shard_dim, model.tp).to(p.dtype))


def full_state(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """The full (unsharded) seeded tensors by HF name — what a checkpoint of the model holds."""
    return {name: init_full(name, p.full_shape, p.init, seed).to(p.dtype).contiguous()
            for name, p in model.named_parameters()}


# What vLLM needs beyond our fields to load a directory: `architectures` picks the model class
# (vLLM's registry maps KimiLinearForCausalLM to its kimi_linear model), and
# `max_position_embeddings` bounds max_model_len (without it vLLM assumes 2048). Kimi Linear is
# NoPE, so the bound is the model's 1M context, not a RoPE limit.
VLLM_FIELDS = {"kimi_linear": {"architectures": ["KimiLinearForCausalLM"],
                               "max_position_embeddings": 1048576}}


# compressed-tensors' description of MXFP4 routed experts (config.json `quantization_config`)
MXFP4_EXPERTS_QUANTIZATION = {
    "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {"routed_experts": {
        "format": "mxfp4-pack-quantized",
        "targets": ["re:.*block_sparse_moe\\.experts\\.\\d+\\.w[123]$"],
        "weights": {"num_bits": 4, "type": "float", "strategy": "group",
                    "group_size": mxfp4.GROUP, "symmetric": True, "scale_dtype": "torch.uint8",
                    "dynamic": False},
        "input_activations": None}},
}
_ROUTED_EXPERT = re.compile(r"\.block_sparse_moe\.experts\.\d+\.w[123]\.weight$")


def hf_config_dict(config, quantization: dict | None = None) -> dict:
    """config.json as written: our fields plus the ones vLLM reads (pdserve ignores them)."""
    d = config.to_hf_dict()
    for key, value in VLLM_FIELDS.get(d.get("model_type"), {}).items():
        d.setdefault(key, value)
    if quantization is not None:
        d["quantization_config"] = quantization
    return d


def mxfp4_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors with every routed expert weight replaced by its MXFP4 pair, as the K3
    checkpoint ships them (`<expert>.w1.weight_packed`, `<expert>.w1.weight_scale`, ...)."""
    out = {}
    for name, t in tensors.items():
        if _ROUTED_EXPERT.search(name):
            base = name[:-len("weight")]
            out[base + mxfp4.PACKED], out[base + mxfp4.SCALE] = mxfp4.quantize(t)
        else:
            out[name] = t
    return out


def shard_names(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """The tensors in order, cut into shards of at most `max_shard_bytes` (a larger tensor
    makes a shard of its own), as transformers' `save_pretrained` cuts them."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def save_checkpoint(directory: str | Path, config, tensors: dict[str, torch.Tensor],
                    max_shard_bytes: int | None = None) -> Path:
    """Write `config.json` + the weights (HF layout) into `directory`: `model.safetensors`, or
    with `max_shard_bytes` the shards `model-0000k-of-0000n.safetensors` and
    `model.safetensors.index.json`. MXFP4 tensors among them add the `quantization_config` that
    says so."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    quant = (MXFP4_EXPERTS_QUANTIZATION if any(k.endswith(mxfp4.PACKED) for k in tensors)
             else None)
    (d / "config.json").write_text(json.dumps(hf_config_dict(config, quant), indent=2))
    if max_shard_bytes is None:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / WEIGHTS_FILE))
        return d
    shards = shard_names(tensors, max_shard_bytes)
    weight_map = {}
    for k, names in enumerate(shards, 1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in names}, str(d / file),
                  metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (d / INDEX_FILE).write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return d


def load_checkpoint(model: torch.nn.Module, directory: str | Path) -> Checkpoint:
    """Load every parameter from the checkpoint in `directory` (`pdserve.model.checkpoint`):
    checked from the headers first, then each rank's slices read (MXFP4 weights dequantized to
    the parameter's dtype). A directory that does not fit raises `CheckpointError` naming the
    tensor and the file before anything is read."""
    ckpt = Checkpoint(directory)
    ckpt.load(model)
    return ckpt


def check_checkpoint(config, directory: str | Path) -> None:
    """Check the directory's tensors against the model of `config` (headers only; a
    meta-device model gives the names and shapes), so a bad directory fails before any rank
    starts."""
    from pdserve.model.model import HybridModel

    with torch.device("meta"):
        model = HybridModel(config, None)
    Checkpoint(directory).check(model)


def export_checkpoint(directory: str | Path, config, seed: int = 0,
                      dtype: torch.dtype = torch.bfloat16, mxfp4_routed: bool = False) -> Path:
    """Seeded weights of `config` as an HF directory in `dtype`, without building the model's
    tensors (a meta-device model gives names, shapes and init kinds). bf16 by default: vLLM casts
    to bf16 on load, so both engines then see the same values. `mxfp4_routed` ships the routed
    experts as MXFP4 (quantized from the seeded values), as K3's checkpoint does."""
    from pdserve.model.model import HybridModel

    with torch.device("meta"):
        model = HybridModel(config, None, dtype)
    tensors = full_state(model, seed)
    return save_checkpoint(directory, config, mxfp4_experts(tensors) if mxfp4_routed else tensors)
