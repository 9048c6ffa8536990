"""Feed-forward blocks: the dense gated MLP and the routed MoE with shared experts.

Router (vLLM's grouped top-k, `noaux_tc`): scores = sigmoid(logits) (or softmax); experts are
selected by scores + e_score_correction_bias (restricted to the best `topk_group` groups, a group
scored by the sum of its two best biased scores); the weights are the UNbiased scores of the
chosen experts, renormalized to sum to 1 when `moe_renormalize`, times `routed_scaling_factor`.
Expert intermediates are split across TP ranks; routed + shared outputs are reduced once.
"""
from __future__ import annotations

import torch
from torch import nn

from pdserve.model.activation import GatedAct, gated_activation, silu_mul
from pdserve.model.parallel import Linear, TPGroup, matmul_rows, sharded, vector_map


class MLP(nn.Module):
    """down(act(gate(x), up(x))), act SiLU-gated by default (`pdserve.model.activation`);
    `reduce=False` leaves the row-parallel sum to the caller."""

    def __init__(self, hidden: int, inter: int, tp: TPGroup, dtype: torch.dtype,
                 names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 reduce: bool = True, act: GatedAct = silu_mul):
        super().__init__()
        self.names, self.act = names, act
        setattr(self, names[0], Linear(hidden, inter, tp, "column", dtype))
        setattr(self, names[1], Linear(hidden, inter, tp, "column", dtype))
        setattr(self, names[2], Linear(inter, hidden, tp, "row", dtype, reduce=reduce))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(self.act(gate(x), up(x)))


def route(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, groups: int,
          topk_group: int, func: str, renormalize: bool, scaling: float
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k]) for router logits [T, E]."""
    logits = logits.float()
    scores = vector_map(torch.sigmoid, logits) if func == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = scores if bias is None else scores + bias.float()
    if groups > 1:
        T, E = choice.shape
        per_group = choice.view(T, groups, E // groups)
        group_score = per_group.topk(min(2, E // groups), dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(topk_group, dim=-1).indices, True)
        choice = per_group.masked_fill(~keep[..., None], float("-inf")).view(T, E)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


class Gate(nn.Module):
    def __init__(self, hidden: int, experts: int, dtype: torch.dtype, with_bias: bool):
        super().__init__()
        self.weight = sharded((experts, hidden), None, TPGroup(), dtype, "linear")
        if with_bias:
            self.e_score_correction_bias = sharded((experts,), None, TPGroup(), torch.float32,
                                                   "bias")


class MoE(nn.Module):
    """Router and experts on the hidden state; `expert_dim` (the latent MoE) gives the experts
    another input/output width than the router's hidden size."""

    def __init__(self, config, tp: TPGroup, dtype: torch.dtype, expert_dim: int | None = None):
        super().__init__()
        hidden, inter = config.hidden_size, config.moe_intermediate_size
        act = gated_activation(config)
        self.cfg, self.tp = config, tp
        self.gate = Gate(hidden, config.num_experts, dtype,
                         with_bias=config.moe_router_activation_func == "sigmoid")
        self.experts = nn.ModuleList(
            MLP(expert_dim or hidden, inter, tp, dtype, names=("w1", "w3", "w2"), reduce=False,
                act=act)
            for _ in range(config.num_experts))
        if config.num_shared_experts:
            self.shared_experts = MLP(hidden, inter * config.num_shared_experts, tp, dtype,
                                      reduce=False, act=act)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32, expert ids [T, k]) from fp32 router logits of x [T, hidden]."""
        c = self.cfg
        logits = matmul_rows(x.float(), self.gate.weight.float().t())
        return route(logits, getattr(self.gate, "e_score_correction_bias", None),
                     c.num_experts_per_token, c.num_expert_group, c.topk_group,
                     c.moe_router_activation_func, c.moe_renormalize, c.routed_scaling_factor)

    def forward(self, x: torch.Tensor, dense: bool = False) -> torch.Tensor:
        weights, ids = self.route(x)
        out = self.routed(x, weights, ids, dense)
        if hasattr(self, "shared_experts"):
            out += self.shared_experts(x).float()
        return self.tp.all_reduce(out).to(x.dtype)

    def routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
               dense: bool) -> torch.Tensor:
        """This rank's fp32 partial of the weighted expert sum over x [T, expert width].

        `dense` (decode steps): every expert runs on every row with routing weight 0 where it
        was not chosen, so shapes are static and nothing syncs with the host. Each row still sums
        its experts' outputs in ascending expert order and the unchosen terms add exact zeros,
        so both forms give the same sums (up to the expert matmuls' row count)."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        if dense:
            w = torch.zeros(x.shape[0], len(self.experts), dtype=weights.dtype,
                            device=x.device).scatter_(1, ids, weights)
            for e, expert in enumerate(self.experts):
                out += expert(x).float() * w[:, e, None]
        else:
            for e in ids.unique().tolist():
                tok, slot = (ids == e).nonzero(as_tuple=True)
                out.index_add_(0, tok, self.experts[e](x[tok]).float() * weights[tok, slot, None])
        return out
