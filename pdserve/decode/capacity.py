"""Capacity planning: how many concurrent requests and cached tokens fit on one decode instance.

Everything is per rank (one GPU of a TP group); every rank of the group holds the same amount.

    usable  = floor(gpu_memory_gib * 2^30 * memory_utilization) - reserve_gib * 2^30
    weights = sum over parameters of (numel / tp if TP-split else numel) * bytes per element
    state   = usable - weights                              (ValueError when <= 0)

Per request (tokens_per_request N = context_tokens + output_tokens: pages for the whole
generation are reserved at admission, so a running request never runs out):

    kda_slot   = n_kda * (H/tp * D * D * recurrent_bytes + (W-1) * 3*H/tp*D * conv_bytes)
    page       = n_mla * page_tokens * 576 * latent_bytes    (576 = kv_lora + rope width;
                                                             a page id spans all MLA layers)
    pages      = ceil(ceil(N / dcp) / page_tokens)           (DCP rank 0 holds the most tokens)
    request    = kda_slot + pages * page
    max_requests       = floor(state / request)
    kv_capacity_tokens = floor(state * N / request)          (vLLM's "GPU KV cache size":
                                                              concurrency x tokens per request)

The latent is replicated across TP ranks and split across DCP ranks (DCP is 1 or tp); KDA state is
split across TP by head and replicated across DCP, so DCP shrinks only the `pages` term.

Shared prefix (prefix_tokens P): every request shares the prefix's latent pages that hold only
prefix tokens on every DCP rank, floor(P / (dcp * page_tokens)) of them, stored once; its KDA state
cannot be shared (each request advances its own), so one checkpoint slot holds the state at the
prefix end and each request copies it into its own slot:

    shared          = shared_pages * page + kda_slot
    private_request = kda_slot + (pages - shared_pages) * page
    max_requests_shared       = floor((state - shared) / private_request)
    kv_capacity_tokens_shared = floor((state - shared) * N / private_request)   (logical tokens)

Weights are counted parameter by parameter as `pdserve.model` shards them (column/row-parallel
projections, heads and expert intermediates split by TP; f_a/g_a, q_a, kv_a, norms and the router
replicated; embedding and LM head split over the vocabulary). K3's latent-MoE projections and
AttnRes vectors, which the reference model does not implement yet, are counted replicated, as vLLM
holds them. Weights are
`weight_dtype` (bf16) except what the model keeps in fp32 (KDA conv, A_log, dt_bias, o_norm, router
bias); routed experts are `expert_bits` per weight (default: the weight dtype; 4.25 = MXFP4 with one
E8M0 scale per 32 weights). Not counted: activations and workspaces (use `reserve_gib`; the 10 %
left by the default utilization is meant for the CUDA context, NCCL buffers and graphs), spec-decode
extra slots, MTP/vision weights, and the fp8 latent's per-tensor scale (4 bytes).
docs/capacity.md works through the K3 TP8 DCP1/DCP8 example.
"""
from __future__ import annotations

import argparse
import asyncio
import math
from collections.abc import AsyncIterator, Sequence
from fractions import Fraction
from typing import TYPE_CHECKING, Protocol

import msgspec

from pdserve.model.config import ConfigError, load_model_config
from pdserve.state.block_table import Topology
from pdserve.state.layout import RankShapes, StateLayout, dtype_of
from pdserve.state.manifest import RegionSizes

if TYPE_CHECKING:
    from pdserve.decode.batcher import TokenEvent
    from pdserve.prefill.handle import StateHandle

GIB = 2 ** 30
ALLOWED_DTYPES = {
    "latent_dtype": ("bfloat16", "float8_e4m3fn"),
    "recurrent_dtype": ("float32", "bfloat16"),
    "conv_dtype": ("bfloat16", "float32"),
    "weight_dtype": ("bfloat16", "float16", "float32"),
}


class CapacityInput(msgspec.Struct, frozen=True):
    model: str                        # preset name or model directory / config.json
    context_tokens: int               # prompt tokens per request (shared prefix included)
    gpu_memory_gib: float = 139.0     # per GPU; an H200 shows about 139 GiB (141 GB nominal)
    memory_utilization: float = 0.9   # fraction of gpu_memory_gib this instance may use
    reserve_gib: float = 0.0          # activations / workspaces taken out of that fraction
    tp: int = 1
    dcp: int = 1                      # 1 or tp
    page_tokens: int = 64
    latent_dtype: str = "bfloat16"
    recurrent_dtype: str = "float32"
    conv_dtype: str = "bfloat16"
    weight_dtype: str = "bfloat16"
    expert_bits: float | None = None  # routed-expert bits per weight; None = weight_dtype
    prefix_tokens: int = 0            # tokens of context_tokens shared by every request
    output_tokens: int = 0


class CapacityReport(msgspec.Struct, frozen=True):
    input: CapacityInput
    usable_bytes: int                 # all figures are per rank
    weight_bytes: int
    weight_breakdown: dict[str, int]
    state_bytes: int
    kda_slot_bytes: int               # one request, all KDA layers, recurrent + conv
    latent_token_bytes: int           # one token, all MLA layers, before DCP
    page_bytes: int                   # one page id, all MLA layers
    tokens_per_request: int
    pages_per_request: int
    request_bytes: int
    max_requests: int
    kv_capacity_tokens: int
    latent_pool_tokens: int           # every state byte as latent pages (no KDA): grows x dcp
    shared_pages: int = 0
    shared_bytes: int = 0
    private_request_bytes: int = 0
    max_requests_shared: int | None = None
    kv_capacity_tokens_shared: int | None = None


def weight_parts(config) -> list[tuple[str, int, bool, str]]:
    """(group, parameter count, split across TP, storage "w" | "fp32" | "expert") for the model."""
    c, la, h = config, config.linear_attn_config, config.hidden_size
    parts: list[tuple[str, int, bool, str]] = []

    def add(group: str, count: int, split: bool, store: str = "w", times: int = 1) -> None:
        parts.append((group, count * times, split, store))

    add("embed+lm_head", c.vocab_size * h, True, times=1 if c.tie_word_embeddings else 2)
    add("norms", h, False)  # final norm
    layers = c.num_hidden_layers
    add("norms", 2 * h, False, times=layers)  # input / post-attention norms
    if c.attn_res_block_size is not None:  # K3 AttnRes: norm + projection vector per sublayer
        add("norms", 2 * 2 * h, False, times=layers)
        add("norms", 2 * h, False)  # the final AttnRes

    n_kda, n_mla = len(c.kda_layer_ids), len(c.mla_layer_ids)
    H, D, W = la.num_heads, la.head_dim, la.short_conv_kernel_size
    proj = H * D
    add("kda", 3 * proj * h, True, times=n_kda)           # q, k, v
    add("kda", 3 * proj * W, True, "fp32", n_kda)         # depthwise short conv
    add("kda", D * h, False, times=n_kda)                 # f_a (replicated low rank)
    add("kda", proj * D, True, times=n_kda)               # f_b
    add("kda", H + proj, True, "fp32", n_kda)             # A_log, dt_bias
    add("kda", H * h, True, times=n_kda)                  # b (beta)
    if la.use_full_rank_gate:
        add("kda", proj * h, True, times=n_kda)           # g
    else:
        add("kda", D * h, False, times=n_kda)             # g_a
        add("kda", proj * D, True, times=n_kda)           # g_b
    add("kda", D, False, "fp32", n_kda)                   # o_norm
    add("kda", h * proj, True, times=n_kda)               # o_proj

    Hm, qk, R = c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim, c.kv_lora_rank
    if c.q_lora_rank is None:
        add("mla", Hm * qk * h, True, times=n_mla)
    else:
        add("mla", c.q_lora_rank * (h + 1), False, times=n_mla)  # q_a + its norm
        add("mla", Hm * qk * c.q_lora_rank, True, times=n_mla)   # q_b
    add("mla", (R + c.qk_rope_head_dim) * h + R, False, times=n_mla)  # kv_a + its norm
    add("mla", Hm * (c.qk_nope_head_dim + c.v_head_dim) * R, True, times=n_mla)  # kv_b
    if c.mla_use_output_gate:
        add("mla", Hm * c.v_head_dim * h, True, times=n_mla)
    add("mla", h * Hm * c.v_head_dim, True, times=n_mla)  # o_proj

    n_moe = sum(c.is_moe_layer(i) for i in range(layers))
    add("dense_mlp", 3 * c.intermediate_size * h, True, times=layers - n_moe)
    if n_moe:
        E, inter = c.num_experts, c.moe_intermediate_size
        add("moe_router", E * h, False, times=n_moe)
        if c.moe_router_activation_func == "sigmoid":
            add("moe_router", E, False, "fp32", n_moe)    # e_score_correction_bias
        add("moe_shared", 3 * inter * c.num_shared_experts * h, True, times=n_moe)
        d_e = c.routed_expert_hidden_size or h
        add("moe_experts", E * 3 * inter * d_e, True, "expert", n_moe)
        if c.routed_expert_hidden_size is not None:       # K3 latent down / up (+ norm)
            norm = d_e if c.latent_moe_use_norm else 0
            add("latent_moe", 2 * d_e * h + norm, False, times=n_moe)
    return parts


def weight_bytes(config, tp: int, weight_dtype: str = "bfloat16",
                 expert_bits: float | None = None) -> dict[str, int]:
    """Bytes per rank of each weight group."""
    w = dtype_of(weight_dtype).itemsize
    bits = Fraction(str(expert_bits)) if expert_bits is not None else Fraction(8 * w)
    out: dict[str, int] = {}
    for group, count, split, store in weight_parts(config):
        n = count // tp if split else count
        size = {"w": n * w, "fp32": n * 4, "expert": math.ceil(n * bits / 8)}[store]
        out[group] = out.get(group, 0) + size
    return out


def _check(inp: CapacityInput) -> None:
    def bad(field: str, message: str) -> ValueError:
        return ValueError(f"{field}: {message}")

    for field, value in (("tp", inp.tp), ("page_tokens", inp.page_tokens),
                         ("context_tokens", inp.context_tokens)):
        if value < 1:
            raise bad(field, f"must be >= 1, got {value}")
    if inp.dcp not in (1, inp.tp):
        raise bad("dcp", f"must be 1 or tp={inp.tp}, got {inp.dcp}")
    if inp.gpu_memory_gib <= 0:
        raise bad("gpu_memory_gib", f"must be positive, got {inp.gpu_memory_gib}")
    if not 0 < inp.memory_utilization <= 1:
        raise bad("memory_utilization", f"must be in (0, 1], got {inp.memory_utilization}")
    for field in ("reserve_gib", "output_tokens"):
        if getattr(inp, field) < 0:
            raise bad(field, f"must be >= 0, got {getattr(inp, field)}")
    if not 0 <= inp.prefix_tokens <= inp.context_tokens:
        raise bad("prefix_tokens", f"must be in 0..context_tokens={inp.context_tokens}, "
                                   f"got {inp.prefix_tokens}")
    if inp.expert_bits is not None and inp.expert_bits <= 0:
        raise bad("expert_bits", f"must be positive, got {inp.expert_bits}")
    for field, allowed in ALLOWED_DTYPES.items():
        if getattr(inp, field) not in allowed:
            raise bad(field, f"{getattr(inp, field)!r} is not one of {allowed}")


def plan_capacity(inp: CapacityInput) -> CapacityReport:
    """Per-rank memory plan of one decode instance; ValueError names the bad field."""
    _check(inp)
    try:
        config = load_model_config(inp.model)
    except ConfigError as exc:  # "model: <config field>: ..."
        raise ValueError(f"model: {exc}") from None
    try:
        config.validate(inp.tp)
    except ConfigError as exc:  # "tp: <config field>: ... not divisible by TP=..."
        raise ValueError(f"tp: {exc}") from None

    weights = weight_bytes(config, inp.tp, inp.weight_dtype, inp.expert_bits)
    usable = (math.floor(Fraction(str(inp.gpu_memory_gib)) * GIB
                         * Fraction(str(inp.memory_utilization)))
              - math.floor(Fraction(str(inp.reserve_gib)) * GIB))
    state = usable - sum(weights.values())
    if state <= 0:
        raise ValueError(
            f"gpu_memory_gib: weights need {sum(weights.values()) / GIB:.1f} GiB per rank at "
            f"tp={inp.tp} but only {usable / GIB:.1f} GiB is usable (gpu_memory_gib x "
            f"memory_utilization - reserve_gib); raise tp or lower expert_bits")

    shapes = RankShapes.of(config, inp.tp)
    sizes = RegionSizes.of(shapes, StateLayout(
        page_tokens=inp.page_tokens, latent_dtype=inp.latent_dtype,
        recurrent_dtype=inp.recurrent_dtype, conv_dtype=inp.conv_dtype))
    slot = shapes.n_kda * (sizes.recurrent_slot + sizes.conv_slot)
    page = shapes.n_mla * sizes.latent_page
    topo = Topology(tp=inp.tp, dcp=inp.dcp)
    tokens = inp.context_tokens + inp.output_tokens
    pages = -(-topo.local_count(0, tokens) // inp.page_tokens)  # rank 0 holds the most tokens
    request = slot + pages * page
    report = dict(
        input=inp, usable_bytes=usable, weight_bytes=sum(weights.values()),
        weight_breakdown=weights, state_bytes=state, kda_slot_bytes=slot,
        latent_token_bytes=page // inp.page_tokens, page_bytes=page, tokens_per_request=tokens,
        pages_per_request=pages, request_bytes=request, max_requests=state // request,
        kv_capacity_tokens=state * tokens // request,
        latent_pool_tokens=state // page * inp.page_tokens * inp.dcp)
    if inp.prefix_tokens:
        # Pages holding only prefix tokens on every DCP rank; the last rank holds the fewest.
        shared_pages = topo.local_count(inp.dcp - 1, inp.prefix_tokens) // inp.page_tokens
        shared = shared_pages * page + slot  # + the KDA checkpoint at the prefix end
        private = slot + (pages - shared_pages) * page
        room = max(state - shared, 0)
        report.update(shared_pages=shared_pages, shared_bytes=shared,
                      private_request_bytes=private, max_requests_shared=room // private,
                      kv_capacity_tokens_shared=room * tokens // private)
    return CapacityReport(**report)


class PoolCapacity(msgspec.Struct, frozen=True):
    """What one live decode instance admits at once: requests of `tokens_per_request` tokens
    (prompt + output: pages for the whole generation are reserved at admission) each, until
    the next one is refused (PoolExhausted, the router's 429) or waits for room."""

    tokens_per_request: int
    pages_per_request: int   # on the DCP rank holding the most of a request's tokens
    by_pages: int            # (num_pages - 1) // pages_per_request (page 0 is padding)
    by_slots: int            # num_slots - 1 (slot 0), less a staging slot while one arrives
    by_batch: int            # the batcher holds at most max_batch requests
    admitted: int            # the least of the three
    tokens_held: int         # admitted * tokens_per_request: the instance's cached tokens


def pool_capacity(num_pages: int, num_slots: int, max_batch: int, topology: Topology,
                  page_tokens: int, context_tokens: int, output_tokens: int,
                  staging: bool = False) -> PoolCapacity:
    """The admission bound of a decode instance with these per-rank pools. Every rank allocates
    pages for its DCP share of the request (`DestRank.allocate`: at least one page), so the
    rank with the most of its tokens decides; the KDA slot is one per rank whatever the DCP.
    `staging`: the transfer stages conv state (the prefill's TP or conv layout differ), so the
    one admission in flight (the batcher admits one at a time) holds a second slot."""
    for field, value in (("num_pages", num_pages), ("num_slots", num_slots),
                         ("max_batch", max_batch), ("context_tokens", context_tokens)):
        if value < 1:
            raise ValueError(f"{field}: must be >= 1, got {value}")
    if output_tokens < 0:
        raise ValueError(f"output_tokens: must be >= 0, got {output_tokens}")
    tokens = context_tokens + output_tokens
    pages = max(-(-max(topology.local_count(r, tokens), 1) // page_tokens)
                for r in range(topology.dcp))
    by_pages, by_slots = (num_pages - 1) // pages, num_slots - 1 - int(staging)
    admitted = max(min(by_pages, by_slots, max_batch), 0)
    return PoolCapacity(tokens, pages, by_pages, by_slots, max_batch, admitted,
                        admitted * tokens)


class EventStream(Protocol):
    """What the admission probe needs of a decode instance: `pdserve.cluster.router.DecodeSlot`."""

    def stream(self, work: StateHandle, request_id: str,
               deadline_s: float | None) -> AsyncIterator[TokenEvent]: ...


def probe_admission(slot: EventStream, handles: Sequence[StateHandle],
                    limit_s: float = 120.0) -> tuple[int, list[str]]:
    """Measure what `pool_capacity` predicts: submit every handle to the live instance at once;
    (how many it admitted, the refused requests' errors). A request counts as admitted at its
    first token and then holds its pages, still decoding, until every request is decided (its
    first token or its refusal), then leaves its stream, which cancels it. So each request's
    output must outlast the probe, or a finished one frees room for a later one."""
    async def main() -> list[str | None]:
        decided: list[str | None] = []  # None: admitted; else the refusal's error
        done = asyncio.Event()

        async def probe(h: StateHandle) -> None:
            async for ev in slot.stream(h, h.request_id, deadline_s=limit_s):
                if ev.error is not None:
                    decided.append(ev.error)
                    break
                if ev.token is not None:
                    decided.append(None)
                    if len(decided) == len(handles):
                        done.set()
                    await asyncio.wait_for(done.wait(), limit_s)
                    break
            if len(decided) == len(handles):
                done.set()
        await asyncio.gather(*[probe(h) for h in handles])
        return decided
    got = asyncio.run(main())
    return got.count(None), [e for e in got if e is not None]


def format_pool(cap: PoolCapacity, topology: Topology) -> str:
    """One line: the figure `pdserve check` and `pdserve capacity --config` print."""
    bound = min(("pages", cap.by_pages), ("slots", cap.by_slots), ("max_batch", cap.by_batch),
                key=lambda kv: kv[1])[0]
    return (f"admits {cap.admitted} concurrent request(s) of {cap.tokens_per_request:,} tokens "
            f"per decode instance (TP {topology.tp}, DCP {topology.dcp}, interleave "
            f"{topology.interleave}): {cap.pages_per_request} page(s) per request on its "
            f"fullest rank, bound by {bound} (pages {cap.by_pages}, slots {cap.by_slots}, "
            f"max_batch {cap.by_batch}); {cap.tokens_held:,} tokens held")


def format_table(reports: list[CapacityReport], labels: list[str]) -> str:
    """A plain-text table, one column per report."""
    def gib(x: int) -> str:
        return f"{x / GIB:.2f} GiB"

    def mib(x: int) -> str:
        return f"{x / 2 ** 20:.2f} MiB"

    rows = [
        ("usable / rank", lambda r: gib(r.usable_bytes)),
        ("weights / rank", lambda r: gib(r.weight_bytes)),
        ("state budget / rank", lambda r: gib(r.state_bytes)),
        ("KDA slot / request", lambda r: mib(r.kda_slot_bytes)),
        ("latent B / token / rank", lambda r: f"{r.latent_token_bytes / r.input.dcp:g}"),
        ("latent pages / request", lambda r: f"{r.pages_per_request} x {mib(r.page_bytes)}"),
        ("bytes / request / rank", lambda r: mib(r.request_bytes)),
        ("max concurrent requests", lambda r: f"{r.max_requests:,}"),
        ("KV capacity (tokens)", lambda r: f"{r.kv_capacity_tokens:,}"),
        ("latent-only pool (tokens)", lambda r: f"{r.latent_pool_tokens:,}"),
    ]
    if any(r.input.prefix_tokens for r in reports):
        rows += [
            ("shared prefix pages", lambda r: f"{r.shared_pages:,}"),
            ("bytes / request, shared", lambda r: mib(r.private_request_bytes)),
            ("max requests, shared", lambda r: f"{r.max_requests_shared:,}"),
            ("KV capacity, shared", lambda r: f"{r.kv_capacity_tokens_shared:,}"),
        ]
    cells = [[""] + labels] + [[name] + [fmt(r) for r in reports] for name, fmt in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                               for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
                     for row in cells)


def cmd_capacity(args: argparse.Namespace) -> int:
    inp = CapacityInput(**{f: getattr(args, f) for f in CapacityInput.__struct_fields__})
    report = plan_capacity(inp)
    if args.json:
        print(msgspec.json.encode(report).decode())
        return 0
    bits = inp.expert_bits if inp.expert_bits is not None else inp.weight_dtype
    print(f"{inp.model}, tp={inp.tp}, {inp.gpu_memory_gib:g} GiB x {inp.memory_utilization:g} "
          f"per GPU; latent {inp.latent_dtype}, recurrent {inp.recurrent_dtype}, experts {bits}; "
          f"{inp.context_tokens:,} + {inp.output_tokens:,} tokens ({inp.prefix_tokens:,} shared)")
    print(format_table([report], [f"dcp={inp.dcp}"]))
    return 0


def add_cli(subparsers) -> argparse.ArgumentParser:
    """Register `capacity` on an argparse subparsers object; the handler is `args.func`."""
    defaults = {f.name: f.default for f in msgspec.structs.fields(CapacityInput)}
    p = subparsers.add_parser("capacity", help="concurrent requests and cached tokens that fit "
                                               "on a decode instance (per-rank memory plan)")
    p.add_argument("--model", default="kimi-k3", help="preset or model directory (default kimi-k3)")
    p.add_argument("--context-tokens", type=int, required=True,
                   help="prompt tokens per request, shared prefix included")
    p.add_argument("--output-tokens", type=int, default=defaults["output_tokens"])
    p.add_argument("--prefix-tokens", type=int, default=defaults["prefix_tokens"],
                   help="leading context tokens shared by every request (default 0)")
    p.add_argument("--gpu-memory-gib", type=float, default=defaults["gpu_memory_gib"],
                   help="memory per GPU in GiB (default 139, an H200 as measured)")
    p.add_argument("--memory-utilization", type=float, default=defaults["memory_utilization"])
    p.add_argument("--reserve-gib", type=float, default=defaults["reserve_gib"],
                   help="activation / workspace reserve per GPU in GiB")
    p.add_argument("--tp", type=int, default=defaults["tp"])
    p.add_argument("--dcp", type=int, default=defaults["dcp"], help="1 or tp")
    p.add_argument("--page-tokens", type=int, default=defaults["page_tokens"])
    for field, allowed in ALLOWED_DTYPES.items():
        p.add_argument(f"--{field.replace('_', '-')}", default=defaults[field],
                       help=f"one of {', '.join(allowed)} (default {defaults[field]})")
    p.add_argument("--expert-bits", type=float, default=None,
                   help="routed-expert bits per weight, 4.25 = MXFP4 (default: weight dtype)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_capacity)
    return p
