"""The hybrid KDA + MLA decoder (Kimi Linear and Kimi K3).

embed -> per layer: x += attn(input_layernorm(x)); x += ffn(post_attention_layernorm(x))
-> norm -> lm_head. Layer i is KDA or MLA by the config's 1-indexed lists; FFN i is MoE when
i >= first_k_dense_replace and i % moe_layer_freq == 0, else the dense MLP. Embedding and LM head
are split over the vocabulary across TP ranks. K3 replaces the residual adds by AttnRes
(`attn_res`: each sublayer input is a mixture over block summaries), its MoE is the latent MoE
(`latent_moe`) and its MLPs use SiTU (`activation`).
"""
from __future__ import annotations

import torch
from torch import nn

from pdserve.model.attn_res import AttnResStream, ResProj
from pdserve.model.activation import gated_activation
from pdserve.model.batch import DecodeBatch, ForwardBatch
from pdserve.model.kda import KDAAttention
from pdserve.model.latent_moe import LatentMoE
from pdserve.model.mla import MLAAttention
from pdserve.model.moe import MLP, MoE
from pdserve.model.norms import RMSNorm
from pdserve.model.parallel import TPGroup, matmul_rows, sharded
from pdserve.state.pools import StatePools


class NotSupportedYet(NotImplementedError):
    """The config parses but uses a feature the reference model does not implement yet."""


class Residual:
    """The plain residual stream x (Kimi Linear): x <- x + sublayer(norm(x)). `AttnResStream`
    is K3's replacement, with the same methods."""

    def __init__(self, x: torch.Tensor):
        self.x = x

    def attention_input(self, layer: "DecoderLayer") -> torch.Tensor:
        return layer.input_layernorm(self.x)

    def mlp_input(self, layer: "DecoderLayer") -> torch.Tensor:
        return layer.post_attention_layernorm(self.x)

    def add(self, delta: torch.Tensor) -> None:
        self.x = self.x + delta

    def output(self, inner, rows: list[int] | None) -> torch.Tensor:
        return self.x if rows is None else self.x[rows]


class DecoderLayer(nn.Module):
    def __init__(self, config, i: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.index, self.is_kda = i, config.is_kda_layer(i)
        hidden = config.hidden_size
        self.self_attn = (KDAAttention if self.is_kda else MLAAttention)(config, tp, dtype)
        if config.is_moe_layer(i):
            moe = LatentMoE if config.routed_expert_hidden_size is not None else MoE
            self.block_sparse_moe = moe(config, tp, dtype)
        else:
            self.mlp = MLP(hidden, config.intermediate_size, tp, dtype,
                           act=gated_activation(config))
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps, dtype)
        if config.attn_res_block_size is not None:
            self.self_attention_res_norm = RMSNorm(hidden, config.rms_norm_eps, dtype)
            self.self_attention_res_proj = ResProj(hidden, dtype)
            self.mlp_res_norm = RMSNorm(hidden, config.rms_norm_eps, dtype)
            self.mlp_res_proj = ResProj(hidden, dtype)

    def forward(self, res: Residual | AttnResStream, batch, pools: StatePools, cache_index: int,
                kda_step=None, mla_step=None) -> None:
        """Advance the residual stream `res` by this layer's attention and FFN."""
        h = res.attention_input(self)
        if self.is_kda:
            res.add(self.self_attn(h, batch, pools.slots, cache_index, kda_step))
        else:
            res.add(self.self_attn(h, batch, pools.latent, cache_index, mla_step))
        h = res.mlp_input(self)
        if hasattr(self, "block_sparse_moe"):
            # GPU decode steps run the static-shape (dense) MoE so an eager step equals its
            # CUDA-graph replay; on the CPU the sparse form does top_k/E of the expert work
            # (tiny decode step, B = 1: 6.4 -> 3.9 ms; benchmarks/results/decode_cpu.json).
            dense = isinstance(batch, DecodeBatch) and h.is_cuda
            res.add(self.block_sparse_moe(h, dense=dense))
        else:
            res.add(self.mlp(h))


class _Embedding(nn.Module):
    def __init__(self, vocab: int, hidden: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.weight = sharded((vocab, hidden), 0, tp, dtype, "embedding")
        self.tp = tp
        self.offset = tp.rank * self.weight.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.offset
        inside = (local >= 0) & (local < self.weight.shape[0])
        x = self.weight[local.clamp(0, self.weight.shape[0] - 1)] * inside[:, None]
        return self.tp.all_reduce(x)


class _Inner(nn.Module):  # "model." prefix of the HF parameter names
    def __init__(self, config, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = _Embedding(config.vocab_size, config.hidden_size, tp, dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp, dtype)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if config.attn_res_block_size is not None:
            self.output_attn_res_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
            self.output_attn_res_proj = ResProj(config.hidden_size, dtype)


class _LMHead(nn.Module):
    def __init__(self, vocab: int, hidden: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.weight = sharded((vocab, hidden), 0, tp, dtype, "linear")


class HybridModel(nn.Module):
    """Weights are uninitialized after construction: use `pdserve.model.weights` to fill them."""

    def __init__(self, config, tp: TPGroup | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config, self.tp, self.dtype = config, tp or TPGroup(), dtype
        if config.tie_word_embeddings:
            raise NotSupportedYet("tie_word_embeddings=True is not supported yet")
        config.validate(self.tp.size)
        self.model = _Inner(config, self.tp, dtype)
        self.lm_head = _LMHead(config.vocab_size, config.hidden_size, self.tp, dtype)
        # index of each layer within its state group (KDA slot pool / latent pool)
        kda, mla = config.kda_layer_ids, config.mla_layer_ids
        self.cache_index = [kda.index(i) if i in kda else mla.index(i)
                            for i in range(config.num_hidden_layers)]

    @torch.no_grad()
    def forward(self, token_ids: torch.Tensor, batch: ForwardBatch | DecodeBatch,
                pools: StatePools, logit_rows: list[int] | None = None,
                kda_step=None, mla_step=None) -> torch.Tensor:
        """Run one step; returns fp32 logits [len(logit_rows), vocab] (default: every row).

        Cached state is read from and written to `pools` for every sequence of `batch`; the
        caller advances each `table.num_tokens` afterwards. A decode-only `ForwardBatch` runs as
        a `DecodeBatch` (static shapes, no host syncs: the step CUDA graphs capture). `kda_step`
        / `mla_step` are optional fused decode ops used by every KDA / MLA layer on decode steps
        (see KDAAttention, MLAAttention)."""
        if token_ids.shape[0] != batch.num_rows:
            raise ValueError(f"{token_ids.shape[0]} token ids for a batch of {batch.num_rows} rows")
        if isinstance(batch, ForwardBatch) and batch.is_decode:
            batch = DecodeBatch.of([s.table for s in batch.seqs], pools.latent.page_tokens,
                                   token_ids.device)
        x = self.model.embed_tokens(token_ids)
        c = self.config
        res = (Residual(x) if c.attn_res_block_size is None
               else AttnResStream(x, c.attn_res_block_size, c.rms_norm_eps))
        for layer, idx in zip(self.model.layers, self.cache_index):
            layer(res, batch, pools, idx, kda_step, mla_step)
        x = self.model.norm(res.output(self.model, logit_rows))
        logits = matmul_rows(x.float(), self.lm_head.weight.float().t())
        return self.tp.all_gather_last(logits)
