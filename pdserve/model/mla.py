"""Multi-head latent attention with NoPE (reference, TP-sharded by heads, latent replicated).

Cache per token: [c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)], c_kv = RMSNorm(kv_a). Two forms
over the same cached rows, read back from the `LatentPool`:
- naive (prefill): expand c_kv through kv_b_proj into per-head k_nope and v, causal softmax;
- absorbed (decode): q_nope is pulled into the latent space with W_UK, attention runs as MQA over
  the 576-wide rows, and W_UV maps the latent output back to v_head_dim per head.
Scale is (qk_nope + qk_rope)^-1/2. K3 adds q_lora (q_a -> RMSNorm -> q_b) and a sigmoid output gate.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model.batch import DecodeBatch, ForwardBatch
from pdserve.model.dcp import DCPDecodeBatch
from pdserve.model.norms import RMSNorm
from pdserve.model.parallel import MIN_ROWS, Linear, TPGroup
from pdserve.state.pools import LatentPool

NAIVE_ROWS = 64  # the prefill attention's row granularity (`MLAAttention._naive`)


def absorbed_attention(q_abs: torch.Tensor, rows: torch.Tensor, kv_lora_rank: int,
                       scale: float, visible: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """MQA over latent rows. q_abs [..., T, H, R+P], rows [..., L, R+P] -> (latent out
    [..., T, H, R], lse [..., T, H]); leading dims batch sequences.

    With `visible` [..., T, L], query t sees only the rows where it is True (causal masks,
    padded rows of a fixed-width gather)."""
    scores = torch.einsum("...thc,...lc->...thl", q_abs.float(), rows.float()) * scale
    if visible is not None:
        scores = scores.masked_fill(~visible[..., :, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("...thl,...lr->...thr", torch.exp(scores - lse[..., None]),
                       rows[..., :kv_lora_rank].float())
    return out, lse


def merge_partials(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """The exact softmax attention from partials over disjoint row sets: out [c, ..., R] and
    lse [c, ...] (natural log) -> [..., R]. Partials are summed in index order (the DCP rank
    they came from), so the result does not depend on when each arrived. A partial over no
    rows (lse -inf, its out undefined) weighs nothing; at least one must have rows."""
    top = lse.max(dim=0).values
    weight = torch.exp(lse - top)                               # [c, ...]
    total = torch.zeros_like(out[0])
    for k in range(out.shape[0]):
        part = torch.where(torch.isfinite(lse[k])[..., None], out[k], 0.0)
        total = total + weight[k][..., None] * part
    return total / weight.sum(dim=0)[..., None]


class MLAAttention(nn.Module):
    def __init__(self, config, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        hidden = config.hidden_size
        H = config.num_attention_heads
        self.heads = tp.split(H, "num_attention_heads")
        self.nope, self.rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.rank = config.v_head_dim, config.kv_lora_rank
        self.scale = (self.nope + self.rope) ** -0.5
        qk = self.nope + self.rope
        if config.q_lora_rank is None:
            self.q_proj = Linear(hidden, H * qk, tp, "column", dtype)
        else:
            self.q_a_proj = Linear(hidden, config.q_lora_rank, tp, "replicated", dtype)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps, dtype)
            self.q_b_proj = Linear(config.q_lora_rank, H * qk, tp, "column", dtype)
        self.kv_a_proj_with_mqa = Linear(hidden, self.rank + self.rope, tp, "replicated", dtype)
        self.kv_a_layernorm = RMSNorm(self.rank, config.rms_norm_eps, dtype)
        self.kv_b_proj = Linear(self.rank, H * (self.nope + self.v_dim), tp, "column", dtype)
        if config.mla_use_output_gate:
            self.g_proj = Linear(hidden, H * self.v_dim, tp, "column", dtype)
        self.o_proj = Linear(H * self.v_dim, hidden, tp, "row", dtype)

    def query(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(
            self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(x.shape[0], self.heads, self.nope + self.rope)

    def latent(self, x: torch.Tensor) -> torch.Tensor:
        """Cache rows [T, R + P] for the new tokens."""
        kv = self.kv_a_proj_with_mqa(x)
        return torch.cat([self.kv_a_layernorm(kv[:, :self.rank]), kv[:, self.rank:]], dim=-1)

    def w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, R] and W_UV [H, v, R] from kv_b_proj."""
        w = self.kv_b_proj.weight.float().view(self.heads, self.nope + self.v_dim, self.rank)
        return w[:, :self.nope], w[:, self.nope:]

    def forward(self, x: torch.Tensor, batch: ForwardBatch | DecodeBatch, pool: LatentPool,
                layer: int, mla_step=None) -> torch.Tensor:
        """`mla_step`: an optional fused decode attention over the paged cache (the decode
        runtime's backend dispatch, signature of `pdserve.kernels.mla_decode`); it returns None
        to decline a step, which then runs the torch path."""
        T = x.shape[0]
        q = self.query(x).float()
        new_rows = self.latent(x)
        if isinstance(batch, DCPDecodeBatch):
            _store_decode_rows(pool, layer, batch, new_rows, batch.store)
            out = self._dcp_decode(q, pool, layer, batch, mla_step)
        elif isinstance(batch, DecodeBatch):
            _store_decode_rows(pool, layer, batch, new_rows)
            out = None if mla_step is None else self._fused_decode(q, pool, layer, batch, mla_step)
            if out is None:
                out = self._absorbed(q[:, None], _gather_rows(pool, layer, batch),
                                     batch.context)[:, 0]
        else:
            out = torch.empty(T, self.heads, self.v_dim, dtype=torch.float32, device=x.device)
            for seq in batch.seqs:
                pool.write(layer, seq.pages, seq.context, new_rows[seq.rows])
                rows = pool.read(layer, seq.pages, seq.context + seq.length)
                attend = self._absorbed if seq.length == 1 else self._naive
                out[seq.rows] = attend(q[seq.rows], rows, seq.context)
        if hasattr(self, "g_proj"):
            out = out * torch.sigmoid(self.g_proj(x).float().view(T, self.heads, self.v_dim))
        return self.o_proj(out.reshape(T, -1).to(x.dtype))

    def _naive(self, q: torch.Tensor, rows: torch.Tensor, context: int) -> torch.Tensor:
        # rows padded (masked) to a multiple of NAIVE_ROWS: the softmax and the products that
        # sum over rows then round alike for any length, so a query's output is the same whether
        # its prompt is prefilled whole or in chunks (docs/design.md §6)
        rows = F.pad(rows, (0, 0, 0, -rows.shape[0] % NAIVE_ROWS))
        T, L = q.shape[0], rows.shape[0]
        # and queries on at least MIN_ROWS rows, as `_absorb`'s: below that the products round
        # by row count (a chunk's or a prefix hit's last few rows)
        if T < MIN_ROWS and q.device.type == "cpu":
            return self._naive(F.pad(q, (0, 0, 0, 0, 0, MIN_ROWS - T)), rows, context)[:T]
        kv = (rows[:, :self.rank] @ self.kv_b_proj.weight.float().t()).view(
            L, self.heads, self.nope + self.v_dim)
        k_nope, v = kv[..., :self.nope], kv[..., self.nope:]
        k_pe = rows[:, self.rank:]
        scores = (torch.einsum("thd,lhd->thl", q[..., :self.nope], k_nope)
                  + torch.einsum("thd,ld->thl", q[..., self.nope:], k_pe)) * self.scale
        visible = torch.arange(L)[None, :] <= context + torch.arange(T)[:, None]
        scores = scores.masked_fill(~visible[:, None, :].to(scores.device), float("-inf"))
        return torch.einsum("thl,lhd->thd", torch.softmax(scores, dim=-1), v)

    def _absorb(self, q: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
        """q [..., H, nope+rope] -> [..., H, R+P]: q_nope pulled into the latent space (W_UK).
        On the CPU the product runs on at least MIN_ROWS rows per head, so a row's result does
        not depend on how many rows share the step (`parallel.MIN_ROWS`)."""
        absorbed = _per_head("thn,hnr->thr", q[..., :self.nope], w_uk)
        return torch.cat([absorbed, q[..., self.nope:]], dim=-1)

    def _fused_decode(self, q: torch.Tensor, pool: LatentPool, layer: int, batch: DecodeBatch,
                      mla_step) -> torch.Tensor | None:
        """The decode attention by `mla_step` over the paged cache (the new rows already stored):
        bf16 absorbed queries in, the latent output back through W_UV; None if it declines.
        Padding rows attend to their page-0 row (seq_len 1); their output is discarded. The
        split count follows from the batch's page width, so a captured step needs no host sync."""
        w_uk, w_uv = self.w_uk_uv()
        res = mla_step(self._absorb(q, w_uk).to(torch.bfloat16), pool.data[layer],
                       batch.mla_pages, batch.mla_seq_lens, self.scale,
                       pool.scale if pool.is_fp8 else None,
                       max_seq_len=batch.pages.shape[1] * pool.page_tokens)
        if res is None:
            return None
        return torch.einsum("bhr,hvr->bhv", res[0].float(), w_uv)

    def _dcp_decode(self, q: torch.Tensor, pool: LatentPool, layer: int,
                    batch: DCPDecodeBatch, mla_step) -> torch.Tensor:
        """Decode attention of this rank's heads over a DCP group's shards (docs/design.md §5,
        DCP): the absorbed queries of every head are gathered from the group, each rank attends
        its own rows with every head (a partial output and its LSE), the partials of this
        rank's heads come back from every rank (one all-to-all) and merge exactly."""
        w_uk, w_uv = self.w_uk_uv()
        q_all = batch.dcp.all_gather_heads(self._absorb(q, w_uk))     # [B, H, R+P]
        lat, lse = self._partial(q_all, pool, layer, batch, mla_step)
        parts = batch.dcp.scatter_heads(torch.cat([lat, lse[..., None]], dim=-1))
        return torch.einsum("bhr,hvr->bhv", merge_partials(parts[..., :-1], parts[..., -1]), w_uv)

    def _partial(self, q_abs: torch.Tensor, pool: LatentPool, layer: int,
                 batch: DCPDecodeBatch, mla_step) -> tuple[torch.Tensor, torch.Tensor]:
        """(latent out [B, H, R] fp32, lse [B, H]) of q_abs over this rank's rows: by `mla_step`
        (which returns each row's LSE) unless it declines, else in torch."""
        res = None if mla_step is None else mla_step(
            q_abs.to(torch.bfloat16), pool.data[layer], batch.mla_pages, batch.mla_seq_lens,
            self.scale, pool.scale if pool.is_fp8 else None,
            max_seq_len=batch.pages.shape[1] * pool.page_tokens)
        if res is not None:  # a row with no rows here ran on one padding row: no weight
            empty = (batch.local_len == 0)[:, None]
            return res[0].float(), torch.where(empty, float("-inf"), res[1].float())
        rows = _gather_rows(pool, layer, batch)
        visible = torch.arange(rows.shape[1], device=rows.device) < batch.local_len[:, None]
        lat, lse = absorbed_attention(q_abs[:, None], rows, self.rank, self.scale,
                                      visible[:, None, :])
        return lat[:, 0], lse[:, 0]

    def _absorbed(self, q: torch.Tensor, rows: torch.Tensor,
                  context: int | torch.Tensor) -> torch.Tensor:
        """q [..., T, H, nope+rope] of the tokens at positions context.. over their sequence's
        rows [..., L, R+P] (row i is token i; later rows are masked out). Leading dims batch
        sequences, with `context` then a tensor of those dims."""
        w_uk, w_uv = self.w_uk_uv()
        q_abs = self._absorb(q, w_uk)
        T, L = q.shape[-3], rows.shape[-2]
        pos = torch.as_tensor(context, device=q.device)[..., None, None] + torch.arange(
            T, device=q.device)[:, None]
        visible = torch.arange(L, device=q.device) <= pos          # [..., T, L]
        lat, _ = absorbed_attention(q_abs, rows, self.rank, self.scale, visible)
        return _per_head("thr,hvr->thv", lat, w_uv)


def _per_head(equation: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., H, d] times each head's matrix of w by `equation` (over "t h d"), flattening the
    leading dims; on the CPU on at least MIN_ROWS rows, so a row's result does not depend on
    how many rows share the step (`parallel.MIN_ROWS`)."""
    flat = x.reshape(-1, *x.shape[-2:])
    n = flat.shape[0]
    if flat.device.type == "cpu" and n < MIN_ROWS:
        flat = F.pad(flat, (0, 0, 0, 0, 0, MIN_ROWS - n))
    return torch.einsum(equation, flat, w)[:n].view(*x.shape[:-1], -1)


def _store_decode_rows(pool: LatentPool, layer: int, batch: DecodeBatch,
                       new_rows: torch.Tensor, mask: torch.Tensor | None = None) -> None:
    """Store the new latent of each row in `mask` (default: the live ones) at its position, by
    tensor indices only. Other rows store back what their page-0 slot already holds, so the
    pool is left bit-identical there."""
    data, page, row = pool.data[layer], batch.new_page, batch.new_row
    mask = batch.live if mask is None else mask
    data.index_put_((page, row),
                    torch.where(mask[:, None], pool.quantize(new_rows), data[page, row]))


def _gather_rows(pool: LatentPool, layer: int, batch: DecodeBatch) -> torch.Tensor:
    """Every row's pages as [B, max_pages * page_tokens, R+P] fp32 (dequantized)."""
    return pool.dequantize(pool.data[layer][batch.pages].flatten(1, 2))
