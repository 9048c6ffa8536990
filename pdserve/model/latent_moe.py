"""K3's latent MoE (vLLM 0.33 `KimiMoE`): the routed experts work in a narrower latent space.

    weights, ids = route(x)                       (router on the full hidden state, fp32 logits)
    z   = routed_expert_down_proj(x)              hidden -> latent (K3: 7168 -> 3584)
    r   = sum_k weights_k * expert_{ids_k}(z)     experts latent -> inter -> latent (K3: 3072)
    r   = routed_expert_norm(r)                   RMSNorm(latent), when latent_moe_use_norm
    out = routed_expert_up_proj(r) + shared(x)    latent -> hidden; shared experts on x

TP: the expert intermediates are split across ranks (as in the plain MoE); the down/up
projections and the norm are replicated, so the latent partial sums are reduced before the norm
(it is not linear) and the shared experts' partial sums are reduced on their own.
"""
from __future__ import annotations

import torch

from pdserve.model.moe import MoE
from pdserve.model.norms import RMSNorm
from pdserve.model.parallel import Linear, TPGroup


class LatentMoE(MoE):
    def __init__(self, config, tp: TPGroup, dtype: torch.dtype):
        latent = config.routed_expert_hidden_size
        super().__init__(config, tp, dtype, expert_dim=latent)
        hidden = config.hidden_size
        self.routed_expert_down_proj = Linear(hidden, latent, tp, "replicated", dtype)
        if config.latent_moe_use_norm:
            self.routed_expert_norm = RMSNorm(latent, config.rms_norm_eps, dtype)
        self.routed_expert_up_proj = Linear(latent, hidden, tp, "replicated", dtype)

    def forward(self, x: torch.Tensor, dense: bool = False) -> torch.Tensor:
        weights, ids = self.route(x)
        z = self.routed_expert_down_proj(x)
        r = self.tp.all_reduce(self.routed(z, weights, ids, dense))
        if hasattr(self, "routed_expert_norm"):
            r = self.routed_expert_norm(r)
        out = self.routed_expert_up_proj(r.to(x.dtype)).float()
        if hasattr(self, "shared_experts"):
            out += self.tp.all_reduce(self.shared_experts(x).float())
        return out.to(x.dtype)
