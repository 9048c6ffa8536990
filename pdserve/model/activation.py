"""Gated activations of the MLPs: act(gate, up) for `hidden_act`.

- silu (Kimi Linear): silu(g) * u.
- situ (K3, vLLM 0.33 `activation.py:163`): beta*tanh(g/beta) * sigmoid(g) * lam*tanh(u/lam),
  i.e. SiLU with its linear factor g soft-capped at +-beta and the up value soft-capped at
  +-lam (K3: beta 4, lam 25). K3 uses it in every MLP: the dense one, the shared experts and
  the routed (latent) experts.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

GatedAct = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def situ_mul(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float
             ) -> torch.Tensor:
    """SiTU in fp32, returned in the input dtype."""
    g, u = gate.float(), up.float()
    capped_gate = beta * torch.tanh(g / beta)
    capped_up = linear_beta * torch.tanh(u / linear_beta)
    return (capped_gate * torch.sigmoid(g) * capped_up).to(gate.dtype)


def gated_activation(config) -> GatedAct:
    """The model's act(gate, up) (the config is validated: situ carries both betas)."""
    if config.hidden_act == "situ":
        beta, lam = config.activation_situ_beta, config.activation_situ_linear_beta
        return lambda gate, up: situ_mul(gate, up, beta, lam)
    return silu_mul
