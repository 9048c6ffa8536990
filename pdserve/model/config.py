"""Model configuration: HF-style `config.json` for `kimi_linear` (flat) and `kimi_k3` (nested
`text_config`) parsed into one validated msgspec struct, plus the built-in presets.

Every validation error names the offending field (`ConfigError.field`), so a bad config file or
preset override is fixed at the first try instead of failing deep inside a layer.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import msgspec

ACTIVATIONS = ("silu", "situ")
ROUTER_FUNCS = ("sigmoid", "softmax")
# AttnRes sources: vLLM 0.33's AttnRes kernels hold at most this many blocks (+ the prefix)
MAX_ATTN_RES_BLOCKS = 8


class ConfigError(ValueError):
    """A config value is invalid; `field` is its dotted path."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class LinearAttnConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """KDA settings (`linear_attn_config`); layer lists are 1-indexed as in the HF config."""

    kda_layers: list[int]
    full_attn_layers: list[int]
    num_heads: int
    head_dim: int
    short_conv_kernel_size: int = 4
    gate_lower_bound: float | None = None  # K3 bounded decay; None = Kimi Linear softplus
    use_full_rank_gate: bool = False       # K3 output gate g = W_g x; else g_b(g_a(x))
    # eps of the gated RMSNorm on the KDA output (o_norm). Not `rms_norm_eps`: vLLM 0.26 builds
    # o_norm without one, so fla's default 1e-5 applies whatever the config says. The seeded
    # decays leave tiny per-head outputs (mean o^2 ~1e-5), where 1e-6 vs 1e-5 rescales a head
    # up to 3x: the two engines must agree on it.
    o_norm_eps: float = 1e-5


class ModelConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """The text model. Field names follow the HF config so files round-trip unchanged."""

    model_type: Literal["kimi_linear", "kimi_k3"]
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    linear_attn_config: LinearAttnConfig
    # MLA
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    mla_use_nope: bool = True
    mla_use_output_gate: bool = False
    # MoE
    num_experts: int | None = None
    num_experts_per_token: int = 1
    num_shared_experts: int = 0
    moe_intermediate_size: int = 0
    moe_renormalize: bool = True
    moe_router_activation_func: str = "sigmoid"
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    use_grouped_topk: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    routed_expert_hidden_size: int | None = None  # K3 latent MoE
    latent_moe_use_norm: bool = False
    # misc
    hidden_act: str = "silu"
    activation_situ_beta: float | None = None
    activation_situ_linear_beta: float | None = None
    attn_res_block_size: int | None = None  # K3 AttnRes
    # K3's MTP drafter layers: checkpoint tensors beyond the main model (not built here)
    num_nextn_predict_layers: int = 0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str = "bfloat16"

    # -- derived facts ------------------------------------------------------------------------
    def is_kda_layer(self, i: int) -> bool:
        """Layer i (0-indexed) is KDA; otherwise MLA."""
        return (i + 1) in self.linear_attn_config.kda_layers

    @property
    def kda_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_kda_layer(i)]

    @property
    def mla_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if not self.is_kda_layer(i)]

    def is_moe_layer(self, i: int) -> bool:
        return (self.num_experts is not None and i >= self.first_k_dense_replace
                and i % self.moe_layer_freq == 0)

    @property
    def latent_width(self) -> int:
        """Elements per cached MLA token row: [c_kv | k_pe]."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def to_hf_dict(self) -> dict[str, Any]:
        d = msgspec.to_builtins(self)
        if self.model_type == "kimi_k3":
            return {"model_type": "kimi_k3", "text_config": d}
        return d

    def replace(self, **changes: Any) -> "ModelConfig":
        cfg = msgspec.structs.replace(self, **changes)
        cfg.validate()
        return cfg

    # -- validation ---------------------------------------------------------------------------
    def validate(self, tp: int = 1) -> None:
        """Raise ConfigError naming the first bad field; `tp` checks divisibility by TP size."""
        la = self.linear_attn_config
        positive = {
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads, "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim, "v_head_dim": self.v_head_dim,
            "linear_attn_config.num_heads": la.num_heads,
            "linear_attn_config.head_dim": la.head_dim,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ConfigError(name, f"must be positive, got {value}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ConfigError("q_lora_rank", f"must be positive or null, got {self.q_lora_rank}")
        if self.qk_rope_head_dim < 0:
            raise ConfigError("qk_rope_head_dim", f"must be >= 0, got {self.qk_rope_head_dim}")
        if la.short_conv_kernel_size < 2:
            raise ConfigError("linear_attn_config.short_conv_kernel_size",
                              f"must be >= 2, got {la.short_conv_kernel_size}")
        self._validate_layers()
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError("hidden_act", f"unknown activation {self.hidden_act!r}; "
                              f"expected one of {ACTIVATIONS}")
        for name in ("activation_situ_beta", "activation_situ_linear_beta"):
            value = getattr(self, name)
            if self.hidden_act == "situ" and value is None:
                raise ConfigError(name, "hidden_act='situ' needs activation_situ_beta and "
                                  "activation_situ_linear_beta")
            if value is not None and not value > 0:
                raise ConfigError(name, f"must be positive, got {value}")
        self._validate_attn_res()
        if self.num_nextn_predict_layers < 0:
            raise ConfigError("num_nextn_predict_layers",
                              f"must be >= 0, got {self.num_nextn_predict_layers}")
        if la.gate_lower_bound is not None and not -5.0 <= la.gate_lower_bound < 0.0:
            raise ConfigError("linear_attn_config.gate_lower_bound",
                              f"must be in [-5, 0), got {la.gate_lower_bound}")
        if not self.mla_use_nope:
            raise ConfigError("mla_use_nope", "only NoPE MLA is supported (Kimi models are NoPE)")
        if self.rms_norm_eps <= 0:
            raise ConfigError("rms_norm_eps", f"must be positive, got {self.rms_norm_eps}")
        if la.o_norm_eps <= 0:
            raise ConfigError("linear_attn_config.o_norm_eps", f"must be positive, got {la.o_norm_eps}")
        self._validate_moe()
        self._validate_tp(tp)

    def _validate_layers(self) -> None:
        la, n = self.linear_attn_config, self.num_hidden_layers
        for name, layers in (("kda_layers", la.kda_layers), ("full_attn_layers", la.full_attn_layers)):
            bad = [x for x in layers if not 1 <= x <= n]
            if bad:
                raise ConfigError(f"linear_attn_config.{name}",
                                  f"layer numbers {bad} outside 1..{n} (lists are 1-indexed)")
            if len(set(layers)) != len(layers):
                raise ConfigError(f"linear_attn_config.{name}", "lists a layer twice")
        both = sorted(set(la.kda_layers) & set(la.full_attn_layers))
        if both:
            raise ConfigError("linear_attn_config.kda_layers",
                              f"layers {both} are also in full_attn_layers")
        missing = sorted(set(range(1, n + 1)) - set(la.kda_layers) - set(la.full_attn_layers))
        if missing:
            raise ConfigError("linear_attn_config.kda_layers",
                              f"layers {missing} are in neither kda_layers nor full_attn_layers")

    def _validate_attn_res(self) -> None:
        b = self.attn_res_block_size
        if b is None:
            return
        if b < 1:
            raise ConfigError("attn_res_block_size", f"must be >= 1, got {b}")
        blocks = -(-self.num_hidden_layers // b)  # the embedding's block + one per B-1 layers
        if blocks > MAX_ATTN_RES_BLOCKS:
            raise ConfigError("attn_res_block_size",
                              f"{b} makes {blocks} AttnRes blocks over num_hidden_layers="
                              f"{self.num_hidden_layers}; at most {MAX_ATTN_RES_BLOCKS} "
                              f"(vLLM's AttnRes kernels)")

    def _validate_latent_moe(self) -> None:
        latent = self.routed_expert_hidden_size
        if latent is None:
            if self.latent_moe_use_norm:
                raise ConfigError("latent_moe_use_norm",
                                  "needs routed_expert_hidden_size (the latent MoE)")
            return
        if self.num_experts is None:
            raise ConfigError("routed_expert_hidden_size", "set without num_experts (no MoE)")
        if latent <= 0:
            raise ConfigError("routed_expert_hidden_size", f"must be positive, got {latent}")

    def _validate_moe(self) -> None:
        self._validate_latent_moe()
        if self.num_experts is None:
            return
        if not self.routed_scaling_factor > 0:
            raise ConfigError("routed_scaling_factor",
                              f"must be positive, got {self.routed_scaling_factor}")
        if self.num_experts <= 0:
            raise ConfigError("num_experts", f"must be positive, got {self.num_experts}")
        if not 1 <= self.num_experts_per_token <= self.num_experts:
            raise ConfigError("num_experts_per_token",
                              f"must be in 1..num_experts={self.num_experts}, "
                              f"got {self.num_experts_per_token}")
        if self.moe_intermediate_size <= 0:
            raise ConfigError("moe_intermediate_size",
                              f"must be positive, got {self.moe_intermediate_size}")
        if self.moe_router_activation_func not in ROUTER_FUNCS:
            raise ConfigError("moe_router_activation_func",
                              f"unknown router function {self.moe_router_activation_func!r}; "
                              f"expected one of {ROUTER_FUNCS}")
        if self.num_shared_experts < 0:
            raise ConfigError("num_shared_experts", f"must be >= 0, got {self.num_shared_experts}")
        if self.moe_layer_freq < 1:
            raise ConfigError("moe_layer_freq", f"must be >= 1, got {self.moe_layer_freq}")
        if self.first_k_dense_replace < 0:
            raise ConfigError("first_k_dense_replace",
                              f"must be >= 0, got {self.first_k_dense_replace}")
        if self.num_expert_group < 1 or self.num_experts % self.num_expert_group:
            raise ConfigError("num_expert_group", f"{self.num_expert_group} does not divide "
                              f"num_experts={self.num_experts}")
        if not 1 <= self.topk_group <= self.num_expert_group:
            raise ConfigError("topk_group", f"must be in 1..num_expert_group="
                              f"{self.num_expert_group}, got {self.topk_group}")
        per_group = self.num_experts // self.num_expert_group
        if self.topk_group * per_group < self.num_experts_per_token:
            raise ConfigError("topk_group", f"{self.topk_group} groups of {per_group} experts "
                              f"cannot supply num_experts_per_token={self.num_experts_per_token}")

    def _validate_tp(self, tp: int) -> None:
        if tp < 1:
            raise ConfigError("tp", f"must be >= 1, got {tp}")
        checks = {
            "linear_attn_config.num_heads": self.linear_attn_config.num_heads,
            "num_attention_heads": self.num_attention_heads,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
        }
        if self.num_experts is not None:
            checks["moe_intermediate_size"] = self.moe_intermediate_size
        for name, value in checks.items():
            if value % tp:
                raise ConfigError(name, f"{value} is not divisible by TP={tp}")


def _fail(exc: msgspec.ValidationError, prefix: str) -> ConfigError:
    # msgspec says e.g. "Expected `int`, got `str` - at `$.linear_attn_config.num_heads`"
    msg = str(exc)
    field = "?"
    if " - at `$" in msg:
        msg, _, path = msg.partition(" - at `$")
        field = path.rstrip("`").lstrip(".")
    elif "missing required field `" in msg:
        field = msg.split("`")[1]
    return ConfigError(f"{prefix}{field}", msg)


def parse_config(data: dict[str, Any] | str | bytes, tp: int = 1) -> ModelConfig:
    """Parse an HF config dict / JSON text (kimi_linear flat or kimi_k3 nested) and validate."""
    if isinstance(data, (str, bytes)):
        try:
            data = json.loads(data)
        except json.JSONDecodeError as exc:
            raise ConfigError("config.json", f"not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError("config.json", "top level must be an object")
    model_type = data.get("model_type")
    prefix = ""
    if model_type == "kimi_k3":
        text = data.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError("text_config", "kimi_k3 config needs a text_config object")
        data, prefix = {**text, "model_type": "kimi_k3"}, "text_config."
    elif model_type != "kimi_linear":
        raise ConfigError("model_type",
                          f"unsupported model_type {model_type!r}; expected kimi_linear or kimi_k3")
    try:
        cfg = msgspec.convert(data, ModelConfig)
    except msgspec.ValidationError as exc:
        raise _fail(exc, prefix) from None
    try:
        cfg.validate(tp)
    except ConfigError as exc:
        raise ConfigError(prefix + exc.field, str(exc).split(": ", 1)[1]) from None
    return cfg


def load_config(path: str | Path, tp: int = 1) -> ModelConfig:
    """Load `config.json` from a model directory (or the file itself)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        raise ConfigError("config.json", f"no such file: {p}")
    return parse_config(p.read_text(), tp)


# -- presets ----------------------------------------------------------------------------------
def _layers(n: int, mla: list[int]) -> dict[str, list[int]]:
    return dict(kda_layers=[i for i in range(1, n + 1) if i not in mla], full_attn_layers=mla)


def _tiny() -> dict[str, Any]:
    # ~2 M parameters: byte vocabulary, 2 KDA + 1 MLA + 1 KDA layers, dense first layer, MoE after.
    return dict(
        model_type="kimi_linear", vocab_size=256, hidden_size=128, num_hidden_layers=4,
        intermediate_size=256, bos_token_id=None, eos_token_id=None,
        linear_attn_config=dict(**_layers(4, [3]), num_heads=4, head_dim=32,
                                short_conv_kernel_size=4),
        num_attention_heads=4, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, mla_use_nope=True,
        num_experts=8, num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=64,
        routed_scaling_factor=2.446, first_k_dense_replace=1, num_expert_group=1, topk_group=1,
        torch_dtype="float32",
    )


def _kimi_linear() -> dict[str, Any]:
    mla = [4, 8, 12, 16, 20, 24, 27]
    return dict(
        model_type="kimi_linear", vocab_size=163840, hidden_size=2304, num_hidden_layers=27,
        intermediate_size=9216, bos_token_id=163584, eos_token_id=163586,
        linear_attn_config=dict(**_layers(27, mla), num_heads=32, head_dim=128,
                                short_conv_kernel_size=4),
        num_attention_heads=32, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, q_lora_rank=None, mla_use_nope=True,
        num_experts=256, num_experts_per_token=8, num_shared_experts=1,
        moe_intermediate_size=1024, moe_router_activation_func="sigmoid",
        routed_scaling_factor=2.446, first_k_dense_replace=1, use_grouped_topk=True,
        num_expert_group=1, topk_group=1, moe_renormalize=True,
    )


def _kimi_k3() -> dict[str, Any]:
    mla = list(range(4, 93, 4)) + [93]
    return dict(
        model_type="kimi_k3", vocab_size=163840, hidden_size=7168, num_hidden_layers=93,
        intermediate_size=33792, bos_token_id=163584, eos_token_id=163586,
        linear_attn_config=dict(**_layers(93, mla), num_heads=96, head_dim=128,
                                short_conv_kernel_size=4, gate_lower_bound=-5.0,
                                use_full_rank_gate=True),
        num_attention_heads=96, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, mla_use_nope=True, mla_use_output_gate=True,
        num_experts=896, num_experts_per_token=16, num_shared_experts=2,
        moe_intermediate_size=3072, routed_expert_hidden_size=3584, latent_moe_use_norm=True,
        moe_router_activation_func="sigmoid", routed_scaling_factor=2.446,
        first_k_dense_replace=1, num_expert_group=1, topk_group=1,
        hidden_act="situ", activation_situ_beta=4.0, activation_situ_linear_beta=25.0,
        attn_res_block_size=12,
    )


def _demo() -> dict[str, Any]:
    # the tiny architecture, with trained weights shipped in SHIPPED_WEIGHTS["demo"]
    # (pdserve.model.train_demo)
    return _tiny()


PRESETS = {"tiny": _tiny, "demo": _demo, "kimi-linear-48b-a3b": _kimi_linear,
           "kimi-k3": _kimi_k3}
# Presets whose weights ship with pdserve, as HF directories inside the package; the others
# are seeded (`pdserve.model.weights.init_seeded`).
SHIPPED_WEIGHTS = {"demo": Path(__file__).resolve().parent / "demo"}


def weights_dir(spec: str) -> Path | None:
    """Where model `spec` loads its weights from: a preset's shipped directory, the spec itself
    when it is a directory holding safetensors, or None (a preset's seeded weights)."""
    if spec in PRESETS:
        return SHIPPED_WEIGHTS.get(spec)
    path = Path(spec).expanduser()
    return path if path.is_dir() and any(path.glob("*.safetensors")) else None


def preset_dict(name: str) -> dict[str, Any]:
    """The HF-style config dict of a preset (kimi_k3 nested under text_config)."""
    if name not in PRESETS:
        raise ConfigError("model", f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    d = PRESETS[name]()
    if d["model_type"] == "kimi_k3":
        return {"model_type": "kimi_k3", "text_config": {k: v for k, v in d.items()
                                                          if k != "model_type"}}
    return d


def preset(name: str, tp: int = 1, **overrides: Any) -> ModelConfig:
    """A preset as a validated ModelConfig; `overrides` replace top-level text fields."""
    d = preset_dict(name)
    if overrides:
        if "text_config" in d:
            d["text_config"].update(overrides)
        else:
            d.update(overrides)
    return parse_config(d, tp)


def reduced_kimi_linear(num_layers: int = 4, num_experts: int = 8, top_k: int = 2,
                        vocab_size: int = 1024, tp: int = 1) -> ModelConfig:
    """kimi-linear-48b-a3b head shapes with fewer layers/experts and a small vocabulary, for
    tests and CPU benchmarks. MLA sits at every 4th layer and the last, as in the full model."""
    mla = sorted({i for i in range(4, num_layers + 1, 4)} | {num_layers})
    return preset("kimi-linear-48b-a3b", tp=tp, num_hidden_layers=num_layers,
                  num_experts=num_experts, num_experts_per_token=top_k, vocab_size=vocab_size,
                  linear_attn_config={**preset_dict("kimi-linear-48b-a3b")["linear_attn_config"],
                                      **_layers(num_layers, mla)})


def reduced_kimi_k3(num_layers: int = 5, hidden_size: int = 192, kda_heads: int = 96,
                    mla_heads: int = 96, head_dim: int = 16, num_experts: int = 16,
                    top_k: int = 4, attn_res_block_size: int = 2, vocab_size: int = 512,
                    tp: int = 1) -> ModelConfig:
    """kimi-k3's structure (AttnRes, latent MoE at hidden/2 with 2 shared experts, SiTU, bounded
    full-rank-gated KDA, q_lora + output-gated MLA) at small dims for CPU tests: 96 KDA and 96 MLA
    heads by default, of `head_dim` (KDA head and MLA nope/v dims). MLA sits at every 4th layer
    and the last, as in the full model; a small block size gives several AttnRes blocks."""
    mla = sorted({i for i in range(4, num_layers + 1, 4)} | {num_layers})
    la = {**preset_dict("kimi-k3")["text_config"]["linear_attn_config"],
          **_layers(num_layers, mla), "num_heads": kda_heads, "head_dim": head_dim}
    return preset("kimi-k3", tp=tp, num_hidden_layers=num_layers, hidden_size=hidden_size,
                  intermediate_size=2 * hidden_size, vocab_size=vocab_size, linear_attn_config=la,
                  num_attention_heads=mla_heads, q_lora_rank=3 * head_dim,
                  kv_lora_rank=2 * head_dim, qk_nope_head_dim=head_dim,
                  qk_rope_head_dim=head_dim // 2, v_head_dim=head_dim,
                  num_experts=num_experts, num_experts_per_token=top_k,
                  moe_intermediate_size=2 * head_dim, routed_expert_hidden_size=hidden_size // 2,
                  attn_res_block_size=attn_res_block_size, torch_dtype="float32")


def load_model_config(spec: str, tp: int = 1) -> ModelConfig:
    """A preset name or a model directory / config.json path."""
    if spec in PRESETS:
        return preset(spec, tp)
    return load_config(spec, tp)
