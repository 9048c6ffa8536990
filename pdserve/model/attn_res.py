"""K3's attention residuals (AttnRes, vLLM 0.33 `model.py:796-894`): the residual add of each
sublayer input is replaced by a learned softmax mixture over block summaries.

State of one forward pass (per token, never cached across steps):
- `blocks`: block 0 is the embedding, block k >= 1 the sum of the sublayer outputs of layers
  [(k-1)B, kB) (B = attn_res_block_size; at most MAX_BLOCKS, the vLLM kernels' cap);
- `prefix`: the running sum of the sublayer outputs since the last block boundary (kept in the
  model dtype, as vLLM rounds `prefix += delta` to bf16).

Each sublayer (pre-attention, MLP side, and the final output) owns an RMSNorm weight w_n and a
[1, hidden] projection w_q, and mixes the sources x_j in {blocks..., prefix}:

    logit_j = <x_j, w_n * w_q> * rsqrt(mean(x_j^2) + eps)      h = sum_j softmax(logit)_j x_j

The sublayer input is then RMSNorm(h) by the layer's input / post-attention layernorm (the final
mixture goes to `model.norm`). At a block-write layer (i % B == 0) the pre-attention mixture is
taken first, then `prefix` becomes block i/B and restarts from that layer's attention output.
"""
from __future__ import annotations

import torch
from torch import nn

from pdserve.model.parallel import TPGroup, sharded

MAX_BLOCKS = 8


class ResProj(nn.Module):
    """A `*_res_proj` weight: the [1, hidden] query w_q of one mixture (replicated)."""

    def __init__(self, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.weight = sharded((1, hidden), None, TPGroup(), dtype, "linear")


def mix(sources: torch.Tensor, norm_weight: torch.Tensor, proj_weight: torch.Tensor,
        eps: float) -> torch.Tensor:
    """sources [S, T, hidden] -> the RMS-scored softmax mixture [T, hidden], fp32 inside and
    returned in the sources' dtype. Element-wise products and per-row sums only, so a token's
    result does not depend on how many tokens share the call."""
    x = sources.float()
    w = norm_weight.float() * proj_weight.float().view(-1)
    logits = (x * w).sum(-1) * torch.rsqrt(x.pow(2).mean(-1) + eps)    # [S, T]
    return (torch.softmax(logits, dim=0)[..., None] * x).sum(0).to(sources.dtype)


class AttnResStream:
    """The blocks and prefix of one forward pass, fed by the decoder layers in order; `layer`
    arguments are `pdserve.model.model.DecoderLayer`s (their `index`, `*_res_norm`,
    `*_res_proj` and layernorms)."""

    def __init__(self, embedding: torch.Tensor, block_size: int, eps: float):
        self.blocks: list[torch.Tensor] = []
        self.prefix = embedding
        self.block_size, self.eps = block_size, eps
        self._restart = False

    def _mix(self, norm: nn.Module, proj: ResProj) -> torch.Tensor:
        return mix(torch.stack(self.blocks + [self.prefix]), norm.weight, proj.weight, self.eps)

    def attention_input(self, layer) -> torch.Tensor:
        h = self._mix(layer.self_attention_res_norm, layer.self_attention_res_proj)
        if layer.index % self.block_size == 0:
            self.blocks.append(self.prefix)
            self._restart = True
        return layer.input_layernorm(h)

    def mlp_input(self, layer) -> torch.Tensor:
        return layer.post_attention_layernorm(self._mix(layer.mlp_res_norm, layer.mlp_res_proj))

    def add(self, delta: torch.Tensor) -> None:
        """A sublayer's output joins the prefix (or starts it, after a block write)."""
        self.prefix = delta if self._restart else (self.prefix.float() + delta.float()).to(
            self.prefix.dtype)
        self._restart = False

    def output(self, inner, rows: list[int] | None) -> torch.Tensor:
        """The final mixture (`model.output_attn_res_*`) of the selected rows, before
        `model.norm`."""
        if rows is not None:
            self.blocks = [b[rows] for b in self.blocks]
            self.prefix = self.prefix[rows]
        return self._mix(inner.output_attn_res_norm, inner.output_attn_res_proj)
