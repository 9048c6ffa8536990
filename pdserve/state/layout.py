"""State layouts: what one rank caches per request, in which dtype and order (docs/design.md §3).

`StateLayout` is everything about cached state that two engines must agree on before they can
exchange it; `RankShapes` derives the per-rank tensor shapes from a model config and a TP size.
"""
from __future__ import annotations

from typing import Literal

import msgspec
import torch

ConvLayout = Literal["SD", "DS"]  # SD = (taps, channels); DS = (channels, taps)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
}


def dtype_of(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    for name, d in DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"unsupported dtype {dtype}")


# the StateLayout fields that name a pool dtype (checked, fingerprinted and matched as a set)
DTYPE_FIELDS = ("latent_dtype", "recurrent_dtype", "conv_dtype")


class StateLayout(msgspec.Struct, frozen=True):
    """How cached state is stored. Part of the model fingerprint."""

    page_tokens: int = 64
    latent_dtype: str = "bfloat16"
    recurrent_dtype: str = "float32"
    conv_dtype: str = "bfloat16"
    conv_layout: ConvLayout = "SD"
    # Destination pools only: the conv staging slot holds this many times the rank's own conv
    # channels. Wide enough (planner.whole_slot_width: d / p when p divides d), a decode rank of
    # TP d takes whole conv slots from a prefill of TP p (one read per layer instead of one per
    # q/k/v section and tap); see planner.conv_staging.
    conv_staging_width: int = 1

    def __post_init__(self) -> None:
        if self.page_tokens < 1:
            raise ValueError(f"page_tokens must be >= 1, got {self.page_tokens}")
        if self.conv_staging_width < 1:
            raise ValueError(f"conv_staging_width must be >= 1, got {self.conv_staging_width}")
        for field in DTYPE_FIELDS:
            dtype_of(getattr(self, field))
        if self.conv_layout not in ("SD", "DS"):
            raise ValueError(f"conv_layout must be 'SD' or 'DS', got {self.conv_layout!r}")


class RankShapes(msgspec.Struct, frozen=True):
    """Per-rank cached-state shapes of one model at one TP size."""

    n_mla: int
    n_kda: int
    latent_width: int       # kv_lora_rank + qk_rope_head_dim
    kda_heads: int          # local heads = H / tp
    head_dim: int           # K = V
    conv_taps: int          # W - 1
    tp: int
    mla_heads: int          # total MLA heads (for topology checks; the latent is head-free)

    @property
    def kda_heads_total(self) -> int:
        return self.kda_heads * self.tp

    @property
    def conv_section(self) -> int:
        """Channels of one of the q / k / v sections on this rank."""
        return self.kda_heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        return 3 * self.conv_section

    @staticmethod
    def of(config, tp: int = 1) -> "RankShapes":
        la = config.linear_attn_config
        if la.num_heads % tp:
            raise ValueError(f"KDA heads {la.num_heads} not divisible by TP={tp}")
        return RankShapes(
            n_mla=len(config.mla_layer_ids), n_kda=len(config.kda_layer_ids),
            latent_width=config.latent_width, kda_heads=la.num_heads // tp,
            head_dim=la.head_dim, conv_taps=la.short_conv_kernel_size - 1, tp=tp,
            mla_heads=config.num_attention_heads,
        )

    def at_tp(self, tp: int) -> "RankShapes":
        """The same model's shapes at another TP size."""
        total = self.kda_heads_total
        if total % tp:
            raise ValueError(f"KDA heads {total} not divisible by TP={tp}")
        return msgspec.structs.replace(self, kda_heads=total // tp, tp=tp)


def conv_to_sd(state: torch.Tensor, layout: ConvLayout) -> torch.Tensor:
    """View a per-slot conv state [.., taps, C] (SD) or [.., C, taps] (DS) as (taps, channels)."""
    return state if layout == "SD" else state.transpose(-1, -2)


def conv_from_sd(state_sd: torch.Tensor, layout: ConvLayout) -> torch.Tensor:
    """Inverse of `conv_to_sd`: a (taps, channels) tensor in the requested layout (contiguous)."""
    return (state_sd if layout == "SD" else state_sd.transpose(-1, -2)).contiguous()
