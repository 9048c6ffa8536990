"""The serving config: one TOML file validated by msgspec (docs/design.md §7).

Every invalid field is reported with its dotted path (`decode.tp: ...`), and `describe()` prints
the topology and its capacity without starting anything (`pdserve check`).

`mode` (a top-level key) picks the deployment: "disaggregated" (the default: a prefill pool and a
decode pool, state moved over NIXL) or "monolithic" (instances whose ranks prefill and decode
themselves, no transfer: the baseline that measures what disaggregation costs). A monolithic
deployment is sized by `[decode]`; `[prefill]` and `[transfer]` are not used.

`[prefill] engine = "vllm"` prefills with stock vLLM (docs/vllm.md, "Serving with pdserve
serve"): each prefill instance is one actor holding `prefill.tp` GPUs, vLLM runs its own TP
workers and holds the state in its own cache (`[prefill.vllm]` sizes it; `prefill.num_pages` and
`num_slots` are not used). vLLM and pdserve's decode load one HF directory: `model.name` when it
is one (config.json + *.safetensors), else the preset's seeded weights exported at start-up into
`prefill.vllm.export_dir`.
"""
from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal, get_args, get_type_hints

import msgspec

from pdserve.model.config import (PRESETS, ConfigError, ModelConfig, load_model_config,
                                  weights_dir)
from pdserve.model.weights import check_checkpoint
from pdserve.prefill.prefix_cache import PrefixCacheConfig
from pdserve.prefill.scheduler import check_budget
from pdserve.state.block_table import Topology
from pdserve.state.layout import DTYPE_FIELDS, RankShapes, StateLayout, dtype_of
from pdserve.transfer.errors import TopologyError
from pdserve.transfer.planner import check_topology, whole_slot_width

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "local-tiny.toml"


class ModelSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str = "tiny"               # preset or model directory
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"   # float16: vLLM engine only
    seed: int = 0                    # seeded weights when the directory has no safetensors


class StateSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    page_tokens: int = 64
    latent_dtype: str = "float32"
    recurrent_dtype: str = "float32"
    conv_dtype: str = "float32"


class VllmSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`[prefill.vllm]`: the stock vLLM engine of each prefill instance (engine = "vllm")."""
    # where a preset's seeded weights are exported for vLLM (and then loaded by decode too),
    # as <export_dir>/<preset>-seed<seed>-<config hash>; unused when model.name is a directory
    export_dir: str = "~/.cache/pdserve/vllm"
    max_model_len: int = 8192        # longest prompt + output (also caps the API's context)
    gpu_memory_utilization: float = 0.9   # of each of the instance's GPUs (they are its own)
    # vLLM's cache blocks; NIXL registers the cache whole and decode prepares descriptors over
    # it, so the default caps it (0 = as many as memory allows: slow transfers set-up)
    num_gpu_blocks: int = 256
    enforce_eager: bool = True       # no CUDA graph capture in vLLM (prefill-only batches)
    start_timeout_s: float = 900.0   # placement + start-up (a cold Triton cache takes minutes)
    env: dict[str, str] = msgspec.field(default_factory=dict)  # for vLLM's processes


class PrefillSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    instances: int = 1
    tp: int = 1
    engine: Literal["reference", "vllm"] = "reference"
    num_pages: int = 256
    num_slots: int = 16
    conv_layout: Literal["SD", "DS"] = "SD"    # vllm: VLLM_SSM_CONV_STATE_LAYOUT
    # reference engine: the budget of one prefill step (chunked prefill, a chunk from a position
    # p past 2048 costing p/2048 per token), a multiple of 16; 0 = each prompt whole in one step
    # (a long prompt then holds up every prompt behind it)
    chunk_tokens: int = 768
    # reference engine: the prefix cache of each rank (docs/design.md §6)
    prefix_cache: PrefixCacheConfig = PrefixCacheConfig()
    vllm: VllmSection = VllmSection()


class DecodeSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    instances: int = 1
    tp: int = 1
    dcp: int = 1
    interleave: int = 64
    backend: Literal["reference", "cutedsl"] = "reference"
    max_batch: int = 64
    num_pages: int = 256
    num_slots: int = 65
    conv_layout: Literal["SD", "DS"] = "SD"
    cuda_graphs: bool = False        # capture the decode step per batch bucket (GPU, TP 1)
    # the MLA kernel's query with an fp8 latent pool (backend cutedsl; unset: "single"):
    # "single" = one e4m3 term as vLLM's fp8 MLA path rounds it, "split" = two e4m3 terms (as
    # precise as the bf16 query; twice the score MMAs, 7-19 % slower at H=32)
    mla_fp8_query: Literal["single", "split"] | None = None
    # bit-identical MLA outputs from run to run for equal inputs (backend cutedsl): turns off
    # the fp8 kernel's tile pool, which balances a request's last tiles between its CTAs at
    # run time (1.5-4 % of the kernel's time at fp8 H=32)
    mla_deterministic: bool = False


class TransferSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    deadline_s: float = 3.0          # base deadline; plus bytes / expected_gbps
    expected_gbps: float = 1.0
    lease_s: float = 30.0
    verify: bool = False


class ApiSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: int = 8000
    max_queue: int = 256
    request_timeout_s: float = 300.0
    max_body_bytes: int = 4 * 1024 * 1024  # a larger request body is a 413, refused unread
    body_timeout_s: float = 10.0           # a body not received by then is a 408
    drain_s: float = 30.0                  # on SIGTERM/SIGINT: time in-flight requests get
                                           # to finish before they end with an error


class ResourcesSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    cpus_per_rank: float = 1.0
    gpus_per_rank: float = 0.0
    torch_threads: int = 0           # per rank; 0 = the rank's CPU share rounded up
    prefill_idle_threads: int = 0    # prefill threads while no decode has work (0 = off)
    call_timeout_s: float = 120.0    # any single call to a rank actor
    rebuild: bool = True             # replace an instance whose rank died by a new one


class ServeConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    mode: Literal["disaggregated", "monolithic"] = "disaggregated"
    model: ModelSection = ModelSection()
    state: StateSection = StateSection()
    prefill: PrefillSection = PrefillSection()
    decode: DecodeSection = DecodeSection()
    transfer: TransferSection = TransferSection()
    api: ApiSection = ApiSection()
    resources: ResourcesSection = ResourcesSection()

    @property
    def monolithic(self) -> bool:
        return self.mode == "monolithic"

    @property
    def vllm(self) -> bool:
        return not self.monolithic and self.prefill.engine == "vllm"

    @property
    def num_ranks(self) -> int:
        """Ray actors: one per rank, and one per vLLM prefill instance (it holds tp GPUs)."""
        decode = self.decode.instances * self.decode.tp
        if self.monolithic:
            return decode
        return decode + self.prefill.instances * (1 if self.vllm else self.prefill.tp)

    @property
    def device(self) -> str:
        return "cuda" if self.resources.gpus_per_rank > 0 else "cpu"

    def layout(self, conv_layout: str, staging_width: int = 1) -> StateLayout:
        s = self.state
        return StateLayout(s.page_tokens, s.latent_dtype, s.recurrent_dtype, s.conv_dtype,
                           conv_layout, staging_width)

    def decode_layout(self) -> StateLayout:
        """Decode pools with a conv staging slot wide enough to take whole prefill conv slots
        (planner.conv_staging: one read per layer instead of one per section and tap); a
        monolithic rank stages nothing (its prefill writes the conv slots in place)."""
        if self.monolithic:
            return self.layout(self.decode.conv_layout)
        width = whole_slot_width(RankShapes.of(self.model_config()), self.prefill.tp,
                                 self.decode.tp)
        return self.layout(self.decode.conv_layout, width)

    def model_config(self) -> ModelConfig:
        return load_model_config(self.model.name)


def _positive(name: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(name, f"must be positive, got {value}")


def mla_fp8_pool(cfg: ServeConfig) -> bool:
    """Whether decode runs the cutedsl MLA kernel over an fp8 latent pool (where
    decode.mla_fp8_query applies)."""
    return cfg.decode.backend == "cutedsl" and cfg.state.latent_dtype == "float8_e4m3fn"


def validate(cfg: ServeConfig) -> ModelConfig:
    """Check every field against the others and the model; returns the model config."""
    for name in ("prefill.instances", "prefill.tp", "prefill.num_pages", "prefill.num_slots",
                 "decode.instances", "decode.tp", "decode.max_batch", "decode.num_pages",
                 "decode.num_slots", "decode.interleave", "state.page_tokens",
                 "transfer.deadline_s", "transfer.expected_gbps", "transfer.lease_s",
                 "api.max_queue", "api.request_timeout_s", "api.max_body_bytes",
                 "api.body_timeout_s", "resources.cpus_per_rank",
                 "resources.call_timeout_s"):
        section, field = name.split(".")
        _positive(name, getattr(getattr(cfg, section), field))
    if cfg.api.drain_s < 0:
        raise ConfigError("api.drain_s", f"must be >= 0 (0 = end requests in flight at once), "
                          f"got {cfg.api.drain_s}")
    for field in ("torch_threads", "prefill_idle_threads"):
        if getattr(cfg.resources, field) < 0:
            raise ConfigError(f"resources.{field}", f"must be >= 0, got "
                              f"{getattr(cfg.resources, field)}")
    if cfg.prefill.chunk_tokens:
        try:
            check_budget(cfg.prefill.chunk_tokens)
        except ValueError as exc:
            raise ConfigError("prefill.chunk_tokens", f"{exc} (0 = no chunking)") from None
    pc = cfg.prefill.prefix_cache
    if pc.max_bytes < 0:
        raise ConfigError("prefill.prefix_cache.max_bytes",
                          f"must be >= 0 (0 = max_share of the pools), got {pc.max_bytes}")
    if not 0 < pc.max_share <= 1:
        raise ConfigError("prefill.prefix_cache.max_share", f"must be in (0, 1], got {pc.max_share}")
    if pc.checkpoint_interval < 1:
        raise ConfigError("prefill.prefix_cache.checkpoint_interval",
                          f"must be >= 1 block, got {pc.checkpoint_interval}")
    if pc.route_max_queued_tokens < 0:
        raise ConfigError("prefill.prefix_cache.route_max_queued_tokens",
                          f"must be >= 0 prompt tokens, got {pc.route_max_queued_tokens}")
    if not 0 < cfg.api.port < 65536:
        raise ConfigError("api.port", f"must be in 1..65535, got {cfg.api.port}")
    for field in DTYPE_FIELDS:
        try:
            dtype_of(getattr(cfg.state, field))
        except ValueError as exc:
            raise ConfigError(f"state.{field}", str(exc)) from None
    if cfg.prefill.engine == "vllm":
        _validate_vllm(cfg)
    elif cfg.model.dtype == "float16":
        raise ConfigError("model.dtype", "float16 is for prefill.engine = \"vllm\" (what its "
                          "acceptance test runs); pdserve's own engines run float32 or bfloat16")
    if cfg.monolithic:
        # Monolithic mode is the reference baseline: its ranks prefill with the reference
        # engine (pdserve.model.generate.ReferenceEngine) and decode with the reference
        # backend, eagerly: no fused kernels, no captured steps.
        if cfg.decode.backend != "reference":
            raise ConfigError("decode.backend", "mode = \"monolithic\" runs the reference "
                              f"backend; got {cfg.decode.backend!r} (the cutedsl backend needs "
                              "mode = \"disaggregated\")")
        if cfg.decode.cuda_graphs:
            raise ConfigError("decode.cuda_graphs", "not available with mode = \"monolithic\" "
                              "(the monolithic baseline decodes eagerly)")
    if cfg.decode.cuda_graphs and cfg.device != "cuda":
        raise ConfigError("decode.cuda_graphs", "needs GPUs (resources.gpus_per_rank > 0)")
    if cfg.decode.cuda_graphs and cfg.decode.tp > 1:
        raise ConfigError("decode.cuda_graphs", f"capture is implemented for decode.tp = 1 only, "
                          f"got {cfg.decode.tp}")
    if cfg.decode.dcp not in (1, cfg.decode.tp):
        raise ConfigError("decode.dcp", f"must be 1 or decode.tp={cfg.decode.tp}, got {cfg.decode.dcp}")
    if cfg.decode.dcp > 1 and cfg.monolithic:
        raise ConfigError("decode.dcp", f"DCP={cfg.decode.dcp} needs mode = \"disaggregated\" "
                          "(a monolithic rank prefills alone and holds the whole latent)")
    if cfg.decode.dcp > 1 and cfg.decode.cuda_graphs:
        raise ConfigError("decode.dcp", f"DCP={cfg.decode.dcp}: decode.cuda_graphs captures "
                          "DCP 1 only")
    if cfg.decode.num_slots < 2:
        raise ConfigError("decode.num_slots", "needs at least 2 (slot 0 is padding)")
    if cfg.decode.mla_fp8_query is not None and not mla_fp8_pool(cfg):
        raise ConfigError("decode.mla_fp8_query", "applies to the cutedsl MLA kernel over an fp8 "
                          "latent pool: needs decode.backend = \"cutedsl\" and "
                          f"state.latent_dtype = \"float8_e4m3fn\" (got {cfg.decode.backend!r}, "
                          f"{cfg.state.latent_dtype!r})")
    name = cfg.model.name
    if name not in PRESETS and not Path(name).exists():
        raise ConfigError("model.name", f"{name!r} is neither a preset ({', '.join(PRESETS)}) "
                          "nor an existing model directory or config.json")
    try:
        model = cfg.model_config()
    except ConfigError as exc:
        raise ConfigError(f"model.{exc.field}" if exc.field != "model" else "model.name",
                          str(exc).split(": ", 1)[1]) from None
    if (weights := weights_dir(name)) is not None:
        try:  # the weights' headers against the model, before any rank starts
            check_checkpoint(model, weights)
        except ValueError as exc:
            raise ConfigError("model.name", str(exc)) from None
    pools = [("decode", cfg.decode.tp)] if cfg.monolithic else [("prefill", cfg.prefill.tp),
                                                                  ("decode", cfg.decode.tp)]
    for section, tp in pools:
        try:
            model.validate(tp)
        except ConfigError as exc:
            raise ConfigError(f"{section}.tp", f"TP={tp} does not fit the model: {exc}") from None
    if cfg.monolithic:
        return model  # no transfer: no prefill -> decode topology to check
    if cfg.vllm:
        _validate_vllm_model(model)
    try:
        check_topology(RankShapes.of(model, cfg.prefill.tp), Topology(cfg.prefill.tp),
                       Topology(cfg.decode.tp, cfg.decode.dcp, cfg.decode.interleave))
    except TopologyError as exc:
        raise ConfigError("decode.tp", str(exc)) from None
    return model


# vLLM 0.26's MLA prefill backends accept only Kimi's MLA head geometry (seen on the H200: "No
# valid MLA prefill backend ... got (qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)").
VLLM_MLA_DIMS = {"qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
VLLM_MODEL_DTYPES = ("bfloat16", "float16")


def vllm_state_dtypes(model_dtype: str) -> dict[str, str]:
    """The dtypes of vLLM's cache for a KimiLinear in `model_dtype` (the decode pools must hold
    the same): latent and conv state in the model dtype, the KDA recurrent state in fp32."""
    return {"latent_dtype": model_dtype, "recurrent_dtype": "float32", "conv_dtype": model_dtype}


def _validate_vllm(cfg: ServeConfig) -> None:
    """`prefill.engine = "vllm"` against the rest of the config (the model is checked later)."""
    if cfg.monolithic:
        raise ConfigError("prefill.engine", "engine = \"vllm\" needs mode = \"disaggregated\" "
                          "(a monolithic instance prefills with its own reference engine)")
    if cfg.resources.gpus_per_rank <= 0:
        raise ConfigError("resources.gpus_per_rank", "prefill.engine = \"vllm\" runs on GPUs "
                          "(each vLLM instance holds prefill.tp of them, and decode reads its "
                          "cache from GPU memory): set gpus_per_rank > 0")
    if cfg.model.dtype not in VLLM_MODEL_DTYPES:
        raise ConfigError("model.dtype", f"prefill.engine = \"vllm\" runs bfloat16 or float16 "
                          f"(vLLM's MLA kernels need 16-bit activations), got {cfg.model.dtype!r}")
    for field, want in vllm_state_dtypes(cfg.model.dtype).items():
        got = getattr(cfg.state, field)
        if dtype_of(got) != dtype_of(want):
            raise ConfigError(f"state.{field}", f"must be {want!r} with prefill.engine = "
                              f"\"vllm\" (the dtype of vLLM's cache, which decode reads as "
                              f"is), got {got!r}")
    v = cfg.prefill.vllm
    for field in ("max_model_len", "start_timeout_s"):
        _positive(f"prefill.vllm.{field}", getattr(v, field))
    if not 0 < v.gpu_memory_utilization <= 1:
        raise ConfigError("prefill.vllm.gpu_memory_utilization",
                          f"must be in (0, 1], got {v.gpu_memory_utilization}")
    if v.num_gpu_blocks < 0:
        raise ConfigError("prefill.vllm.num_gpu_blocks", f"must be >= 0 (0 = as many as memory "
                          f"allows), got {v.num_gpu_blocks}")
    if not v.export_dir:
        raise ConfigError("prefill.vllm.export_dir", "must not be empty")
    for key in ("VLLM_SSM_CONV_STATE_LAYOUT", "VLLM_WORKER_MULTIPROC_METHOD"):
        if key in v.env:
            raise ConfigError("prefill.vllm.env", f"{key} is set by pdserve ("
                              + ("prefill.conv_layout" if "CONV" in key else "always 'spawn'")
                              + "); remove it")


def k3_features(model: ModelConfig) -> dict:
    """The K3 layers a model config turns on, by field (stock vLLM 0.26 has none of them)."""
    la = model.linear_attn_config
    on = {"attn_res_block_size": model.attn_res_block_size,
          "routed_expert_hidden_size": model.routed_expert_hidden_size,
          "hidden_act": model.hidden_act if model.hidden_act != "silu" else None,
          "linear_attn_config.use_full_rank_gate": la.use_full_rank_gate or None}
    return {k: v for k, v in on.items() if v is not None}


def _validate_vllm_model(model: ModelConfig) -> None:
    k3 = k3_features(model)
    if k3:
        raise ConfigError(next(iter(k3)), "prefill.engine = \"vllm\": vLLM 0.26 has no Kimi K3 "
                          f"model ({_kv(k3)}); prefill it with engine = \"reference\" "
                          "(docs/vllm.md, Kimi K3)")
    bad = {k: getattr(model, k) for k, v in VLLM_MLA_DIMS.items() if getattr(model, k) != v}
    if bad:
        raise ConfigError("model.name", "prefill.engine = \"vllm\": vLLM 0.26's MLA prefill "
                          f"backends need Kimi's MLA head dims ({_kv(VLLM_MLA_DIMS)}); this "
                          f"model has {_kv(bad)} (export one with those dims: docs/vllm.md)")


def _kv(d: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in d.items())


def vllm_model_dir(cfg: ServeConfig, model: ModelConfig) -> tuple[Path, bool]:
    """(the HF directory vLLM and decode load, whether it is an automatic export)."""
    from pdserve.prefill.vllm_engine import export_name

    weights = weights_dir(cfg.model.name)
    if weights is not None:
        return weights, False
    root = Path(cfg.prefill.vllm.export_dir).expanduser()
    return root / export_name(cfg.model.name, model, cfg.model.seed, cfg.model.dtype), True


def vllm_engine_config(cfg: ServeConfig, model_dir: str | Path):
    """The `VllmEngineConfig` of every vLLM prefill instance of `cfg`."""
    from pdserve.prefill.vllm_engine import VllmEngineConfig

    v = cfg.prefill.vllm
    return VllmEngineConfig(model=str(model_dir), tp=cfg.prefill.tp, dtype=cfg.model.dtype,
                            max_model_len=v.max_model_len,
                            gpu_memory_utilization=v.gpu_memory_utilization,
                            num_gpu_blocks=v.num_gpu_blocks or None,
                            enforce_eager=v.enforce_eager, lease_s=cfg.transfer.lease_s,
                            # inside the actor call's own deadline, so a stuck worker RPC
                            # surfaces as vLLM's error rather than as a lost instance
                            rpc_timeout_s=cfg.resources.call_timeout_s / 2)


def vllm_env(cfg: ServeConfig) -> dict[str, str]:
    """Environment of a vLLM prefill actor: spawn (fork fails once CUDA is initialised), the
    conv layout, then the config's own variables."""
    return {"VLLM_WORKER_MULTIPROC_METHOD": "spawn",
            "VLLM_SSM_CONV_STATE_LAYOUT": cfg.prefill.conv_layout, **cfg.prefill.vllm.env}


def check_vllm_geometry(cfg: ServeConfig, geometry) -> None:
    """vLLM's cache as its workers report it (`KvGeometry`) against what the config says decode
    holds: a mismatch would fail every transfer, so it stops the start-up instead."""
    for field in DTYPE_FIELDS:
        if dtype_of(getattr(geometry, field)) != dtype_of(getattr(cfg.state, field)):
            raise ConfigError(f"state.{field}", f"vLLM's cache holds {getattr(geometry, field)}, "
                              f"the config says {getattr(cfg.state, field)!r}")
    if geometry.conv_layout != cfg.prefill.conv_layout:
        raise ConfigError("prefill.conv_layout", f"vLLM's conv state is {geometry.conv_layout} "
                          f"(VLLM_SSM_CONV_STATE_LAYOUT), the config says "
                          f"{cfg.prefill.conv_layout!r}")


def load_serve_config(path: str | Path | None = None) -> tuple[ServeConfig, ModelConfig]:
    p = Path(path) if path else DEFAULT_CONFIG
    if not p.exists():
        raise ConfigError("--config", f"no such file: {p}")
    try:
        raw = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("--config", f"{p}: not valid TOML: {exc}") from None
    try:
        cfg = msgspec.convert(raw, ServeConfig)
    except msgspec.ValidationError as exc:
        msg, _, where = str(exc).partition(" - at `$.")
        field = where.rstrip("`") or (msg.split("`")[1] if "`" in msg else "?")
        if "unknown field `mode`" in msg:  # TOML puts a key after [section] into that section
            msg += "; `mode` is a top-level key: put it above the first [section]"
        raise ConfigError(field, msg + _allowed(field)) from None
    return cfg, validate(cfg)


def _allowed(field: str) -> str:
    """' (one of ...)' for a Literal-typed `section.field` or top-level key, else ''."""
    section, _, name = field.partition(".")
    try:
        hint = get_type_hints(ServeConfig)[section]
        args = get_args(get_type_hints(hint)[name] if name else hint)
    except (KeyError, TypeError):
        return ""
    return f" (one of: {', '.join(map(str, args))})" if args else ""


def _fp8_query_text(mode: str | None) -> str:
    """decode.mla_fp8_query in words; unset, the kernel's default ("single")."""
    terms = {"split": "two e4m3 terms", "single": "single e4m3 term"}
    if mode is not None:
        return terms[mode]
    return "single e4m3 term, the kernel's default"


def describe(cfg: ServeConfig, model: ModelConfig) -> str:
    """The topology and per-rank state capacity, for `pdserve check`."""
    from pdserve.state.manifest import RegionSizes

    lines = [f"model {cfg.model.name}: {model.num_hidden_layers} layers "
             f"({len(model.kda_layer_ids)} KDA, {len(model.mla_layer_ids)} MLA), dtype {cfg.model.dtype}"]
    if cfg.monolithic:
        pools = [("monolithic", cfg.decode, f" (prefill + decode in each rank, no transfer), "
                  f"backend {cfg.decode.backend}, max batch {cfg.decode.max_batch}")]
    else:
        pools = [("prefill", cfg.prefill, f", engine {cfg.prefill.engine}"),
                 ("decode", cfg.decode, f", DCP {cfg.decode.dcp}, backend {cfg.decode.backend}"
                  + (f" (MLA fp8 query: {_fp8_query_text(cfg.decode.mla_fp8_query)})"
                     if mla_fp8_pool(cfg) else "")
                  + (", deterministic MLA" if cfg.decode.mla_deterministic else "")
                  + f", max batch {cfg.decode.max_batch}")]
    for role, sec, extra in pools:
        if role == "prefill" and cfg.vllm:
            lines += _describe_vllm(cfg, model)
            continue
        shapes = RankShapes.of(model, sec.tp)
        sizes = RegionSizes.of(shapes, cfg.layout(sec.conv_layout))
        slot = shapes.n_kda * (sizes.recurrent_slot + sizes.conv_slot)
        page = shapes.n_mla * sizes.latent_page
        # disaggregated decode ranks also hold a conv staging slot per slot (planner.conv_staging)
        staging = (sec.num_slots * shapes.n_kda * sizes.conv_slot
                   * cfg.decode_layout().conv_staging_width
                   if role == "decode" and not cfg.monolithic else 0)
        lines.append(f"{role}: {sec.instances} instance(s) x TP {sec.tp}{extra}")
        lines.append(f"  per rank: {sec.num_slots - 1} KDA slots x {slot / 2**20:.2f} MiB, "
                     f"{sec.num_pages - 1} latent pages x {page / 2**20:.3f} MiB "
                     f"({(sec.num_pages - 1) * cfg.state.page_tokens:,} tokens); state "
                     f"{((sec.num_slots * slot) + sec.num_pages * page + staging) / 2**30:.3f} GiB"
                     + (f" (conv staging {staging / 2**20:.1f} MiB)" if staging else ""))
    if cfg.monolithic:
        lines.append("  sized by [decode]; [prefill] and [transfer] are not used in this mode")
    else:
        lines.append(f"transfer: deadline {cfg.transfer.deadline_s} s + bytes / "
                     f"{cfg.transfer.expected_gbps} GB/s, lease {cfg.transfer.lease_s} s, "
                     f"verify {cfg.transfer.verify}")
    lines.append(f"api: http://{cfg.api.host}:{cfg.api.port}/v1 (queue {cfg.api.max_queue})")
    if cfg.vllm:
        decode = cfg.decode.instances * cfg.decode.tp
        lines.append(f"resources: {cfg.resources.cpus_per_rank} CPU + "
                     f"{cfg.resources.gpus_per_rank} GPU per decode rank; {decode} decode ranks + "
                     f"{cfg.prefill.instances} vLLM actor(s) x ({cfg.resources.cpus_per_rank} CPU + "
                     f"{cfg.prefill.tp} GPU); {cfg.num_ranks} actors, "
                     f"{decode * cfg.resources.gpus_per_rank + cfg.prefill.instances * cfg.prefill.tp:g}"
                     " GPUs")
    else:
        lines.append(f"resources: {cfg.resources.cpus_per_rank} CPU + "
                     f"{cfg.resources.gpus_per_rank} GPU per rank; {cfg.num_ranks} ranks")
    return "\n".join(lines)


def _describe_vllm(cfg: ServeConfig, model: ModelConfig) -> list[str]:
    v, p = cfg.prefill.vllm, cfg.prefill
    path, export = vllm_model_dir(cfg, model)
    blocks = v.num_gpu_blocks or "as many as memory allows"
    return [
        f"prefill: {p.instances} instance(s) x TP {p.tp}, engine vllm (stock vLLM: one actor "
        f"per instance holding {p.tp} GPU(s); vLLM spawns its {p.tp} TP worker(s))",
        f"  vLLM: max_model_len {v.max_model_len}, cache blocks {blocks}, "
        f"gpu_memory_utilization {v.gpu_memory_utilization}, enforce_eager {v.enforce_eager}, "
        f"conv layout {p.conv_layout}; state held in vLLM's cache (prefill.num_pages/num_slots "
        "not used)",
        f"  weights: {path}" + (" (the preset's seeded weights, exported at start-up unless "
                                "there)" if export else " (vLLM and decode load this directory)"),
    ]
