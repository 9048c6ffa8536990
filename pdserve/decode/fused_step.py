"""The whole decode step in as few kernels as the math allows (what `decode.backend =
"cutedsl"` runs on Hopper; any backend runs it, each op falling back to its torch reference).

Built once from a loaded `HybridModel` (TP = 1), whose weights it re-lays out in place: the
parameters become views of concatenated tensors, so nothing is duplicated and the model's own
forward (the oracle) still reads the same values.
  - the projections (KDA's and MLA's in and out, a dense MLP's) are `decode_linear` (a split-K
    weight-streaming GEMM with the tokens in the MMA's N, PDL-launched: its first weight tiles
    are requested while the previous kernel runs); the router and the LM head, with fp32
    outputs, and the small batched GEMMs stay cuBLAS.
  - KDA: q, k, v, f_a, g_a, b_proj as one [3HD + 2D + H, hidden] weight (one GEMM); f_b and
    g_b as one block-diagonal [2HD, 2D] weight (one decode_linear on the f_a | g_a columns: the
    zero blocks cost 2HD*D*2 bytes a layer; the PDL chain in_proj -> gates -> KDA -> o_proj
    stays unbroken); then the fused KDA op (conv, gates, delta rule, gated norm) and o_proj.
  - MLA: q_proj and kv_a as one weight, the new latent row normalized straight into the paged
    cache (latent_store); W_UK / W_UV split out of kv_b_proj once, in bf16.
  - MoE: experts stacked as w13 [G, 2I, hidden] (gate rows then up rows) and w2 [G, hidden, I],
    the shared expert as group G-1 = E; the router op lays out the (token, expert) pairs by
    expert, and the experts op (a grouped GEMM with the tokens in the MMA's N dimension)
    reads only the experts some token chose. The weighted combine of a token's pairs happens
    inside the next add_rmsnorm.
  - every residual add is fused with the RMSNorm after it; the LM head is a bf16 GEMM with
    fp32 output.
The projections' kernel tuning is a `StepTuning` argument. A step is device ops only (no host
sync), so `DecodeGraphs` captures it whole. Rebuild it after loading new weights (W_UK / W_UV
and the gates' block-diagonal weight are copies).
"""
from __future__ import annotations

import msgspec
import torch
import torch.nn.functional as F

from pdserve.kernels import registry
from pdserve.kernels import (decode_linear, kda_decode, latent_store, mla_decode, moe_experts,
                             moe_route, rmsnorm)
from pdserve.kernels.decode_linear import LinearTuning
from pdserve.model.batch import DecodeBatch
from pdserve.model.model import HybridModel, NotSupportedYet
from pdserve.state.pools import StatePools


class StepTuning(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`decode_linear` tuning per projection of the step. The kernel's defaults won on the
    H200's 27-layer step (o_proj at bm 128 / 4 splits / 8 stages did not: docs/kernels.md)."""
    in_proj: LinearTuning = LinearTuning()
    gates: LinearTuning = LinearTuning()
    o_proj: LinearTuning = LinearTuning()
    mlp: LinearTuning = LinearTuning()


class _Ops:
    """The registry's choice per op for `backend`, resolved on each call's problem (a refused
    call runs the reference; the registry logs each reason once)."""

    def __init__(self, backend: str):
        self.backend = backend

    def _run(self, op: str, problem, *args, **kwargs):
        res = registry.resolve(op, self.backend, problem(*args, **kwargs))
        return res.impl(*args, **kwargs)

    def norm(self, residual, delta, weight, eps, out, residual_out=None):
        """out = rms_norm(residual + delta); delta: None, rows, or (rows, token_pair, weight)."""
        pairs = {}
        if isinstance(delta, tuple):
            delta, tp, pw = delta
            pairs = dict(token_pair=tp, pair_weight=pw)
        return self._run(rmsnorm.OP, rmsnorm.add_rmsnorm_problem, residual, delta, weight, eps,
                         out, residual_out, **pairs)

    def linear(self, x, w, tuning: LinearTuning):
        """x @ w.T (bf16) for the step's projections."""
        return self._run(decode_linear.OP, decode_linear.decode_linear_problem, x, w, tuning)

    def route(self, *args):
        return self._run(moe_route.OP, moe_route.moe_route_problem, *args)

    def experts(self, *args):
        return self._run(moe_experts.OP, moe_experts.moe_experts_problem, *args)

    def store(self, *args):
        return self._run(latent_store.OP, latent_store.latent_store_problem, *args)

    def kda(self, *args):
        return self._run(kda_decode.OP, kda_decode.kda_decode_problem, *args)

    def mla(self, *args, **kwargs):
        return self._run(mla_decode.OP, mla_decode.problem_from_tensors, *args, **kwargs)


def _concat(linears, dim: int = 0) -> torch.Tensor:
    """One tensor holding the linears' weights along `dim`; each weight becomes a view of it."""
    ws = [lin.weight for lin in linears]
    cat = torch.cat([w.data for w in ws], dim)
    off = 0
    for w in ws:
        n = w.shape[dim]
        w.data = cat.narrow(dim, off, n)
        off += n
    return cat


def _stack(weights) -> torch.Tensor:
    """[n, *shape] holding `weights` (parameters of one shape); each becomes a view of it."""
    st = torch.stack([w.data for w in weights])
    for i, w in enumerate(weights):
        w.data = st[i]
    return st


def _block_diagonal(weights) -> torch.Tensor:
    """[sum n_i, sum k_i] with weight i ([n_i, k_i]) on the diagonal, zeros elsewhere (a copy)."""
    return torch.block_diag(*[w.data for w in weights]).contiguous()


def _mm_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T with fp32 output (fp32 accumulation of the bf16 products, no weight cast)."""
    if x.is_cuda:
        return torch.mm(x, w.t(), out_dtype=torch.float32)
    return x.float() @ w.float().t()


class _Kda:
    def __init__(self, attn, ops: _Ops, tuning: StepTuning):
        if hasattr(attn, "g_proj"):
            raise NotSupportedYet("fused decode step: KDA with a full-rank output gate (K3)")
        self.ops, self.a, self.t = ops, attn, tuning
        self.HD = attn.heads * attn.head_dim
        self.D, self.H = attn.head_dim, attn.heads
        self.w_in = _concat([attn.q_proj, attn.k_proj, attn.v_proj, attn.f_a_proj,
                             attn.g_a_proj, attn.b_proj])
        self.w_gates = _block_diagonal([attn.f_b_proj.weight, attn.g_b_proj.weight])
        self.conv_w = attn.conv_weight()

    def __call__(self, h, batch: DecodeBatch, pools: StatePools, idx: int):
        a, HD, D, H = self.a, self.HD, self.D, self.H
        y = self.ops.linear(h, self.w_in, self.t.in_proj)
        fg = self.ops.linear(y[:, 3 * HD:3 * HD + 2 * D], self.w_gates, self.t.gates)
        pool = pools.slots
        out = self.ops.kda(y[:, :HD], y[:, HD:2 * HD], y[:, 2 * HD:3 * HD], fg[:, HD:], fg[:, :HD],
                           y[:, 3 * HD + 2 * D:], self.conv_w, a.A_log.view(H), a.dt_bias,
                           a.o_norm.weight, a.eps, a.lower_bound, pool.recurrent[idx],
                           pool.conv[idx], batch.kda_slots, pool.layout)
        return self.ops.linear(out.to(h.dtype), a.o_proj.weight, self.t.o_proj)


class _Mla:
    def __init__(self, attn, ops: _Ops, tuning: StepTuning):
        if not hasattr(attn, "q_proj") or hasattr(attn, "g_proj"):
            raise NotSupportedYet("fused decode step: MLA with q_lora or an output gate (K3)")
        self.ops, self.a, self.t = ops, attn, tuning
        self.Hq = attn.heads * (attn.nope + attn.rope)
        self.w_in = _concat([attn.q_proj, attn.kv_a_proj_with_mqa])
        w = attn.kv_b_proj.weight.view(attn.heads, attn.nope + attn.v_dim, attn.rank)
        self.w_uk = w[:, :attn.nope].contiguous()                    # [H, nope, R]
        self.w_uv_t = w[:, attn.nope:].transpose(1, 2).contiguous()  # [H, R, v]

    def __call__(self, h, batch: DecodeBatch, pools: StatePools, idx: int):
        a, R, nope = self.a, self.a.rank, self.a.nope
        pool = pools.latent
        y = self.ops.linear(h, self.w_in, self.t.in_proj)
        B = y.shape[0]
        q = y[:, :self.Hq].view(B, a.heads, nope + a.rope)
        self.ops.store(y[:, self.Hq:], a.kv_a_layernorm.weight, a.kv_a_layernorm.eps,
                       pool.data[idx], batch.new_page, batch.new_row,
                       pool.scale if pool.is_fp8 else None)
        q_abs = torch.empty(B, a.heads, R + a.rope, dtype=h.dtype, device=h.device)
        q_abs[:, :, :R] = torch.bmm(q[:, :, :nope].transpose(0, 1), self.w_uk).transpose(0, 1)
        q_abs[:, :, R:] = q[:, :, nope:]
        lat, _ = self.ops.mla(q_abs, pool.data[idx], batch.mla_pages, batch.mla_seq_lens,
                              a.scale, pool.scale if pool.is_fp8 else None,
                              max_seq_len=batch.pages.shape[1] * pool.page_tokens)
        o = torch.bmm(lat.to(h.dtype).transpose(0, 1), self.w_uv_t)        # [H, B, v]
        return self.ops.linear(o.transpose(0, 1).reshape(B, -1), a.o_proj.weight, self.t.o_proj)


class _Mlp:
    def __init__(self, mlp, ops: _Ops, tuning: StepTuning):
        self.ops, self.t = ops, tuning
        self.w13 = _concat([mlp.gate_proj, mlp.up_proj])
        self.w2 = mlp.down_proj.weight
        self.inter = mlp.gate_proj.weight.shape[0]

    def __call__(self, h):
        gu = self.ops.linear(h, self.w13, self.t.mlp)
        return self.ops.linear(F.silu(gu[:, :self.inter]) * gu[:, self.inter:], self.w2,
                               self.t.mlp)


class _Moe:
    def __init__(self, moe, ops: _Ops):
        c = moe.cfg
        self.ops, self.cfg = ops, c
        experts = list(moe.experts)
        self.shared = int(hasattr(moe, "shared_experts"))
        if self.shared:
            se = moe.shared_experts
            if se.gate_proj.weight.shape != experts[0].w1.weight.shape:
                raise NotSupportedYet("fused decode step: shared experts wider than one routed "
                                      "expert (num_shared_experts > 1)")
            gates = [e.w1.weight for e in experts] + [se.gate_proj.weight]
            ups = [e.w3.weight for e in experts] + [se.up_proj.weight]
            downs = [e.w2.weight for e in experts] + [se.down_proj.weight]
        else:
            gates = [e.w1.weight for e in experts]
            ups = [e.w3.weight for e in experts]
            downs = [e.w2.weight for e in experts]
        self.inter = gates[0].shape[0]
        # w13 [G, 2I, hidden]: gate rows then up rows of each expert (their params become views)
        self.w13 = torch.cat([torch.stack([g.data for g in gates]),
                              torch.stack([u.data for u in ups])], 1)
        for i, (g, u) in enumerate(zip(gates, ups)):
            g.data, u.data = self.w13[i, :self.inter], self.w13[i, self.inter:]
        self.w2 = _stack(downs)                                   # [G, hidden, I]
        self.gate_w = moe.gate.weight
        self.bias = getattr(moe.gate, "e_score_correction_bias", None)
        self.E = len(experts)

    def __call__(self, h):
        c, B = self.cfg, h.shape[0]
        k = c.num_experts_per_token
        S, P = k + self.shared, B * (k + self.shared)
        dev = h.device
        i32 = dict(dtype=torch.int32, device=dev)
        logits = _mm_f32(h, self.gate_w)
        pair_token, pair_weight = torch.empty(P, **i32), torch.empty(P, dtype=torch.float32,
                                                                     device=dev)
        token_pair = torch.empty(B, S, **i32)
        group_end = torch.empty(self.E + self.shared, **i32)
        self.ops.route(logits, self.bias, k, c.num_expert_group, c.topk_group,
                       c.moe_router_activation_func, c.moe_renormalize,
                       c.routed_scaling_factor, self.shared, pair_token, pair_weight,
                       token_pair, group_end)
        rows = self.ops.experts(h, self.w13, self.w2, pair_token, group_end, bool(self.shared))
        return rows, token_pair, pair_weight


class FusedDecodeStep:
    """`step(ids, batch) -> fp32 logits [B, vocab]` for a `DecodeBatch`, with `backend`'s ops."""

    def __init__(self, model: HybridModel, pools: StatePools, backend: str,
                 tuning: StepTuning | None = None):
        if model.tp.size != 1:
            raise NotSupportedYet(f"fused decode step at TP={model.tp.size} (TP = 1 only)")
        if model.dtype != torch.bfloat16:
            raise NotSupportedYet(f"fused decode step needs a bf16 model, got {model.dtype}")
        c = model.config
        for field, on in (("attn_res_block_size", c.attn_res_block_size is not None),
                          ("hidden_act", c.hidden_act != "silu"),
                          ("routed_expert_hidden_size", c.routed_expert_hidden_size is not None)):
            if on:   # K3's AttnRes, SiTU and latent MoE are not in the fused layer
                raise NotSupportedYet(f"fused decode step: {field}={getattr(c, field)!r} (K3)")
        self.model, self.pools, self.ops = model, pools, _Ops(backend)
        self.tuning = t = tuning or StepTuning()
        self.layers = []
        for layer, idx in zip(model.model.layers, model.cache_index):
            attn = (_Kda if layer.is_kda else _Mla)(layer.self_attn, self.ops, t)
            ffn = (_Moe(layer.block_sparse_moe, self.ops) if hasattr(layer, "block_sparse_moe")
                   else _Mlp(layer.mlp, self.ops, t))
            self.layers.append((layer, idx, attn, ffn))

    def layer(self, i: int, x, delta, h, batch: DecodeBatch):
        """Layer i on the residual stream `x` (updated in place) with the previous layer's FFN
        output `delta` still to add; `h` is scratch. Returns this layer's FFN output."""
        layer, idx, attn, ffn = self.layers[i]
        n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
        self.ops.norm(x, delta, n1.weight, n1.eps, h, None if delta is None else x)
        a = attn(h, batch, self.pools, idx)
        self.ops.norm(x, a, n2.weight, n2.eps, h, x)
        return ffn(h)

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, batch: DecodeBatch) -> torch.Tensor:
        m = self.model
        x = F.embedding(ids, m.model.embed_tokens.weight)         # the residual stream
        h = torch.empty_like(x)
        delta = None
        for i in range(len(self.layers)):
            delta = self.layer(i, x, delta, h, batch)
        n = m.model.norm
        self.ops.norm(x, delta, n.weight, n.eps, h)
        return _mm_f32(h, m.lm_head.weight)
