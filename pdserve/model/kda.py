"""Kimi Delta Attention layer (reference, TP-sharded by heads).

Per token x: q, k, v projections -> short causal conv + SiLU -> L2-norm (q scaled by K^-1/2);
beta = sigmoid(b_proj x); per-channel log decay from the low-rank forget gate f_b(f_a(x));
gated delta rule on the per-head state S [V, K]; output RMSNorm gated by sigmoid(g) with g
low-rank (Kimi Linear) or full-rank (K3); row-parallel o_proj. Parameter names are HF's.

State lives in the `SlotPool` only: every sequence reads its slot, advances it and writes it back.
Prefill (more than one new token) uses the chunked form, decode the recurrent form.
"""
from __future__ import annotations

import torch
from torch import nn

from pdserve.model import kda_ops
from pdserve.model.batch import DecodeBatch, ForwardBatch
from pdserve.model.parallel import Linear, TPGroup, sharded, vector_map
from pdserve.state.layout import conv_from_sd, conv_to_sd
from pdserve.state.pools import SlotPool


class KDAAttention(nn.Module):
    def __init__(self, config, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        la = config.linear_attn_config
        hidden, H, D, W = config.hidden_size, la.num_heads, la.head_dim, la.short_conv_kernel_size
        self.heads, self.head_dim = tp.split(H, "linear_attn_config.num_heads"), D
        self.lower_bound, self.eps = la.gate_lower_bound, la.o_norm_eps
        proj = H * D
        self.q_proj = Linear(hidden, proj, tp, "column", dtype)
        self.k_proj = Linear(hidden, proj, tp, "column", dtype)
        self.v_proj = Linear(hidden, proj, tp, "column", dtype)
        # Conv and decay parameters stay fp32 whatever the runtime dtype (as vLLM keeps them).
        self.q_conv1d = _Conv(proj, W, tp)
        self.k_conv1d = _Conv(proj, W, tp)
        self.v_conv1d = _Conv(proj, W, tp)
        self.f_a_proj = Linear(hidden, D, tp, "replicated", dtype)
        self.f_b_proj = Linear(D, proj, tp, "column", dtype)
        self.A_log = sharded((1, 1, H, 1), 2, tp, torch.float32, "a_log")
        self.dt_bias = sharded((proj,), 0, tp, torch.float32, "dt_bias")
        self.b_proj = Linear(hidden, H, tp, "column", dtype)
        if la.use_full_rank_gate:
            self.g_proj = Linear(hidden, proj, tp, "column", dtype)
        else:
            self.g_a_proj = Linear(hidden, D, tp, "replicated", dtype)
            self.g_b_proj = Linear(D, proj, tp, "column", dtype)
        self.o_norm = _Norm(D)
        self.o_proj = Linear(proj, hidden, tp, "row", dtype)
        self._conv_w, self._conv_w_key = None, None   # `conv_weight` cache (not a buffer)

    def conv_weight(self) -> torch.Tensor:
        """[3*H_local*D, W] contiguous, packed [q | k | v] like the conv state's channels.

        Cached: built once per load of the conv weights and rebuilt only when one of them is
        replaced (`.to(device)`, a new Parameter) or changed in place (a checkpoint's `copy_`
        bumps its version counter), so a decode step launches no kernel for it (the fused op's
        PDL contract, see `forward`). The key is host-side metadata only: no sync, no kernel."""
        ws = [c.weight for c in (self.q_conv1d, self.k_conv1d, self.v_conv1d)]
        key = tuple((w.data_ptr(), w._version, w.dtype, w.device) for w in ws)
        if self._conv_w_key != key:
            with torch.no_grad():
                packed = torch.cat([w[:, 0] for w in ws])
                c = self._conv_w
                if (c is not None and c.shape == packed.shape and c.dtype == packed.dtype
                        and c.device == packed.device):
                    c.copy_(packed)     # same address: a captured graph sees the new values
                else:
                    self._conv_w = packed
            self._conv_w_key = key
        return self._conv_w

    def forward(self, x: torch.Tensor, batch: ForwardBatch | DecodeBatch, pool: SlotPool,
                layer: int, kda_step=None) -> torch.Tensor:
        """`kda_step`: an optional fused decode-step op (the decode runtime's backend dispatch,
        signature of `pdserve.kernels.kda_decode`); it returns None to decline a step.

        PDL contract (enforced here): the fused op may be launched with programmatic dependent
        launch (the registry's "cutedsl" entry is), and then reads slot_idx, both pools and the
        parameters (conv weight, A_log, dt_bias, norm weight) *before* waiting for the kernel
        just before it in the stream. So nothing that op reads early may be produced right
        before it: the packed conv weight is cached across steps (`conv_weight`, and fetched
        before the projections so even a rebuild is several kernels back), the int32 slot ids
        come ready-made with the batch (`DecodeBatch.kda_slots`, built with the batch, copied
        into a captured graph's static inputs before replay), the rest are views of parameters
        and pools. The kernel right before the op is the last projection, whose output (like
        every projected row) is read only after the wait."""
        T, H, D = x.shape[0], self.heads, self.head_dim
        conv_w = self.conv_weight()
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        f_raw = self.f_b_proj(self.f_a_proj(x))
        beta_raw = self.b_proj(x)
        gate = self.g_proj(x) if hasattr(self, "g_proj") else self.g_b_proj(self.g_a_proj(x))
        decode = isinstance(batch, DecodeBatch)
        if kda_step is not None and decode:
            # padding rows carry slot 0, which the op leaves untouched; no kernel may run
            # between the gate projection above and the op (see the PDL contract above)
            out = kda_step(q, k, v, gate, f_raw, beta_raw, conv_w, self.A_log.view(H),
                           self.dt_bias, self.o_norm.weight, self.eps, self.lower_bound,
                           pool.recurrent[layer], pool.conv[layer], batch.kda_slots,
                           pool.layout)
            if out is not None:
                return self.o_proj(out.to(x.dtype))
        qkv = torch.cat([q, k, v], dim=-1).float()
        f = f_raw.float().view(T, H, D)
        g = kda_ops.kda_log_decay(f, self.A_log.view(H), self.dt_bias.view(H, D),
                                  self.lower_bound)
        beta = vector_map(torch.sigmoid, beta_raw.float())

        if decode:
            o = self._decode(qkv, conv_w, g, beta, batch, pool, layer)
        else:
            o = torch.empty(T, H, D, dtype=torch.float32, device=x.device)
            for seq in batch.seqs:
                rows = seq.rows
                state, conv_state = pool.read(layer, seq.table.kda_slot)
                mixed, conv_state = kda_ops.short_conv(qkv[rows], conv_w, conv_state)
                q, k, v = mixed.view(seq.length, 3, H, D).unbind(1)
                q = kda_ops.l2_normalize(q) * D ** -0.5
                k = kda_ops.l2_normalize(k)
                rule = kda_ops.delta_rule_recurrent if seq.length == 1 else kda_ops.delta_rule_chunked
                o[rows], state = rule(q, k, v, g[rows], beta[rows], state)
                pool.write(layer, seq.table.kda_slot, state, conv_state)

        out = kda_ops.gated_rmsnorm(o, self.o_norm.weight, gate.float().view(T, H, D), self.eps)
        return self.o_proj(out.reshape(T, H * D).to(x.dtype))

    def _decode(self, qkv: torch.Tensor, conv_w: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, batch: DecodeBatch, pool: SlotPool, layer: int) -> torch.Tensor:
        """One token for every row at once, state gathered and scattered by slot-id tensors.
        Padding rows store back the state they read, so slot 0 stays bit-identical."""
        B, H, D = g.shape
        recurrent, conv = pool.recurrent[layer], pool.conv[layer]
        state, conv_state = recurrent[batch.slots], conv[batch.slots]
        mixed, new_conv = kda_ops.short_conv(qkv[:, None], conv_w,
                                             conv_to_sd(conv_state, pool.layout).float())
        q, k, v = mixed.view(B, 3, H, D).unbind(1)
        q = kda_ops.l2_normalize(q) * D ** -0.5
        k = kda_ops.l2_normalize(k)
        # rows x heads as one head axis: the recurrence is independent per head
        o, new_state = kda_ops.delta_rule_recurrent(
            q.reshape(1, B * H, D), k.reshape(1, B * H, D), v.reshape(1, B * H, D),
            g.reshape(1, B * H, D), beta.reshape(1, B * H), state.reshape(B * H, D, D))
        live = batch.live
        recurrent.index_put_((batch.slots,), torch.where(
            live[:, None, None, None], new_state.view(state.shape).to(recurrent.dtype), state))
        conv.index_put_((batch.slots,), torch.where(
            live[:, None, None], conv_from_sd(new_conv, pool.layout).to(conv.dtype), conv_state))
        return o.view(B, H, D)


class _Conv(nn.Module):
    """Depthwise conv weight in HF's [C, 1, W] shape, split by channel."""

    def __init__(self, channels: int, width: int, tp: TPGroup):
        super().__init__()
        self.weight = sharded((channels, 1, width), 0, tp, torch.float32, "conv")


class _Norm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = sharded((dim,), None, TPGroup(), torch.float32, "norm")
