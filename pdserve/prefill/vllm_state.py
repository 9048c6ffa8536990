"""vLLM's KV cache in pdserve's terms: pure logic behind the `PdserveConnector` (no vLLM import).

- `describe_kv_caches`: a worker's `register_kv_caches` dict (MLA layers: one tensor
  `[blocks, block_tokens, 576]`; KDA layers: `[conv, recurrent]` strided views of a padded page)
  -> a `RegionTable` of byte views over vLLM's own memory (read in place) + a `KvGeometry`.
- `select_blocks` / `manifest_from_vllm`: one request's block ids per KV-cache group -> the latent
  pages and per-layer KDA slots -> a `StateManifest` the planner reads like any other source.
- `LeaseBook` (scheduler side) and `SendTracker` (worker side): which requests vLLM keeps blocks
  for (delay_free) and when they are freed: the decode side's "done", a cancel, or lease expiry.
"""
from __future__ import annotations

import base64
import re
import time
from typing import Literal

import msgspec
import torch

from pdserve.state.block_table import Topology
from pdserve.state.layout import ConvLayout, RankShapes, StateLayout, dtype_name
from pdserve.state.manifest import SourceStrides, StateManifest, model_fingerprint
from pdserve.transfer.nixl_agent import AgentInfo, RankAgent
from pdserve.transfer.regions import RegionTable
from pdserve.transfer.source import SourceRank

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def layer_index(name: str) -> int:
    """Decoder layer number in a vLLM layer name ("model.layers.3.self_attn.attn" -> 3)."""
    m = _LAYER.search(name)
    if m is None:
        raise ValueError(f"cannot find a layer number in vLLM layer name {name!r}")
    return int(m.group(1))


class GroupSpec(msgspec.Struct, frozen=True):
    """One vLLM KV-cache group, reduced to what block selection needs."""

    kind: Literal["mla", "kda"]
    layer_names: list[str]
    block_size: int                  # tokens per logical block (for KDA: the state page's span)
    num_speculative_blocks: int = 0  # KDA scratch blocks that trail the running state


class KvGeometry(msgspec.Struct, frozen=True):
    """One worker's cache layout: page size, dtypes, conv layout, strides, layer order."""

    page_tokens: int                 # tokens per MLA kernel block = our latent page
    latent_dtype: str
    recurrent_dtype: str
    conv_dtype: str
    conv_layout: ConvLayout
    strides: SourceStrides
    num_latent_pages: int            # kernel blocks per MLA layer
    num_slots: int                   # state pages per KDA layer
    mla_layers: list[str]            # vLLM names in our MLA layer order
    kda_layers: list[str]            # vLLM names in our KDA layer order

    def layout(self) -> StateLayout:
        return StateLayout(page_tokens=self.page_tokens, latent_dtype=self.latent_dtype,
                           recurrent_dtype=self.recurrent_dtype, conv_dtype=self.conv_dtype,
                           conv_layout=self.conv_layout)

    def same_layout(self, other: "KvGeometry") -> bool:
        """Equal apart from addresses (every TP rank must agree before one manifest fits all)."""
        return self == other


class PrefillExport(msgspec.Struct, frozen=True):
    """What the connector returns in `kv_transfer_params["pdserve"]` for one request."""

    request_id: str                  # vLLM's request id: the id the source's leases use
    manifest: StateManifest
    agents: list[AgentInfo]          # per source TP rank
    lease_deadline: float            # wall clock (time.time())
    num_tokens: int


PARAMS_KEY = "pdserve"


def encode_export(export: PrefillExport) -> dict:
    # base64 text: vLLM carries kv_transfer_params as plain JSON-like values
    return {PARAMS_KEY: base64.b64encode(msgspec.msgpack.encode(export)).decode("ascii")}


def decode_export(params: dict | None) -> PrefillExport:
    if not params or PARAMS_KEY not in params:
        raise ValueError(f"vLLM returned no pdserve kv_transfer_params (got {params!r}); is "
                         "kv_connector='PdserveConnector' configured?")
    return msgspec.msgpack.decode(base64.b64decode(params[PARAMS_KEY]), type=PrefillExport)


# -- worker side: tensors -> regions ---------------------------------------------------------------
def byte_span(t: torch.Tensor, nbytes: int) -> torch.Tensor:
    """`nbytes` of t's storage starting at t's first element, as a contiguous uint8 view (no copy)."""
    storage = t.untyped_storage()
    start = t.storage_offset() * t.element_size()
    if start + nbytes > storage.nbytes():
        raise ValueError(f"span of {nbytes} B at byte {start} runs past the {storage.nbytes()}-byte "
                         "storage")
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, start, (nbytes,))


def _dense_inner(t: torch.Tensor, what: str) -> int:
    """Bytes of one entry along dim 0; the dims inside it must be dense (row-major)."""
    expect = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size > 1 and stride != expect:
            raise ValueError(f"{what}: inner dims {tuple(t.shape[1:])} are not dense "
                             f"(strides {t.stride()})")
        expect *= size
    return expect * t.element_size()


def _strided_region(t: torch.Tensor, what: str) -> tuple[torch.Tensor, int]:
    """(byte view from entry 0 to the end of the last entry, stride between entries in bytes)."""
    entry = _dense_inner(t, what)
    stride = t.stride(0) * t.element_size()
    if stride < entry:
        raise ValueError(f"{what}: entries overlap (stride {stride} B < {entry} B)")
    return byte_span(t, (t.shape[0] - 1) * stride + entry), stride


def describe_kv_caches(kv_caches: dict, shapes: RankShapes, conv_layout: ConvLayout
                       ) -> tuple[RegionTable, KvGeometry]:
    """Region table and geometry of one worker's vLLM KV cache for the model with `shapes`.

    MLA layers are tensors, KDA layers lists `[conv, recurrent]` (vLLM's MambaSpec order); each
    becomes a byte view of vLLM's own memory, so transfers read the cache in place."""
    mla = sorted((n for n, t in kv_caches.items() if isinstance(t, torch.Tensor)), key=layer_index)
    kda = sorted((n for n, t in kv_caches.items() if not isinstance(t, torch.Tensor)), key=layer_index)
    if (len(mla), len(kda)) != (shapes.n_mla, shapes.n_kda):
        raise ValueError(f"vLLM registered {len(mla)} MLA + {len(kda)} KDA layers; the model has "
                         f"{shapes.n_mla} + {shapes.n_kda}")
    latent, rec, conv = [], [], []
    lat_strides, rec_strides, conv_strides = set(), set(), set()
    page_tokens = num_pages = num_slots = None
    dtypes = {}
    for name in mla:
        t = kv_caches[name]
        if t.dim() == 4 and t.shape[2] == 1:  # [blocks, tokens, 1 head, width]
            t = t.squeeze(2)
        if t.dim() != 3 or t.shape[2] != shapes.latent_width:
            raise ValueError(f"{name}: MLA cache {tuple(t.shape)} is not [blocks, tokens, "
                             f"{shapes.latent_width}]")
        view, stride = _strided_region(t, name)
        latent.append(view)
        lat_strides.add(stride)
        page_tokens, num_pages = t.shape[1], t.shape[0]
        dtypes["latent"] = dtype_name(t.dtype)
    want_conv = ((shapes.conv_taps, shapes.conv_channels) if conv_layout == "SD"
                 else (shapes.conv_channels, shapes.conv_taps))
    want_rec = (shapes.kda_heads, shapes.head_dim, shapes.head_dim)
    for name in kda:
        tensors = list(kv_caches[name])
        if len(tensors) != 2:
            raise ValueError(f"{name}: expected [conv, recurrent] state tensors, got {len(tensors)}")
        c, r = tensors
        if tuple(c.shape[1:]) != want_conv:
            raise ValueError(f"{name}: conv state {tuple(c.shape[1:])} per slot, expected "
                             f"{want_conv} for the {conv_layout} layout (VLLM_SSM_CONV_STATE_LAYOUT)")
        if tuple(r.shape[1:]) != want_rec:
            raise ValueError(f"{name}: recurrent state {tuple(r.shape[1:])} per slot, expected "
                             f"{want_rec} [heads, V, K]")
        cv, cs = _strided_region(c, f"{name} conv")
        rv, rs = _strided_region(r, f"{name} recurrent")
        conv.append(cv)
        rec.append(rv)
        conv_strides.add(cs)
        rec_strides.add(rs)
        num_slots = c.shape[0]
        dtypes["conv"], dtypes["recurrent"] = dtype_name(c.dtype), dtype_name(r.dtype)
    for what, s in (("latent page", lat_strides), ("recurrent slot", rec_strides),
                    ("conv slot", conv_strides)):
        if len(s) > 1:
            raise ValueError(f"vLLM layers disagree on the {what} stride: {sorted(s)}")
    # Kinds without layers keep a nominal stride of 1: the planner never reads them.
    strides = SourceStrides(next(iter(lat_strides), 1), next(iter(rec_strides), 1),
                            next(iter(conv_strides), 1))
    geometry = KvGeometry(
        page_tokens=page_tokens or 1, latent_dtype=dtypes.get("latent", "bfloat16"),
        recurrent_dtype=dtypes.get("recurrent", "float32"),
        conv_dtype=dtypes.get("conv", "bfloat16"), conv_layout=conv_layout, strides=strides,
        num_latent_pages=num_pages or 0, num_slots=num_slots or 0, mla_layers=mla, kda_layers=kda)
    return RegionTable({"mla_latent": latent, "kda_recurrent": rec, "kda_conv": conv}), geometry


def _union_table(regions: RegionTable) -> RegionTable:
    """Disjoint byte views covering every region once. vLLM's layers alias one buffer (an MLA
    layer and KDA layers), and NIXL crashes deregistering a span registered twice."""
    by_storage: dict[int, tuple[torch.Tensor, list[tuple[int, int]]]] = {}
    for tensors in regions.layers.values():
        for t in tensors:
            st = t.untyped_storage()
            start = t.storage_offset() * t.element_size()
            by_storage.setdefault(st.data_ptr(), (t, []))[1].append((start, start + t.numel() * t.element_size()))
    views = []
    for t, spans in by_storage.values():
        merged: list[list[int]] = []
        for a, b in sorted(spans):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        st = t.untyped_storage()
        views += [torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, a, (b - a,))
                  for a, b in merged]
    # one kind per view: `RankAgent` merges adjacent regions of one kind into one registration,
    # and two storages adjacent in virtual memory are still separate allocations (CUDA IPC)
    return RegionTable({f"registered{i}": [v] for i, v in enumerate(views)})


def register_in_place(instance: str, rank: int, generation: int, regions: RegionTable,
                      device: str = "cpu") -> RankAgent:
    """A `RankAgent` over `regions` (aliasing allowed) that registers each byte once."""
    return RankAgent(instance, rank, generation, regions, device, registered=_union_table(regions))


# -- scheduler side: block ids -> manifest ---------------------------------------------------------
def running_slot(ids: list[int], num_speculative_blocks: int = 0) -> int:
    """The block holding the running state: the last one before the speculative scratch blocks.
    ("none" mode holds [state, *scratch]; "align" mode a position-indexed list whose last
    state-bearing entry is the newest.) Block 0 is vLLM's null block and never a state."""
    keep = len(ids) - num_speculative_blocks
    if keep < 1 or ids[keep - 1] <= 0:
        raise ValueError(f"no running KDA state block in {ids} "
                         f"(num_speculative_blocks={num_speculative_blocks})")
    return ids[keep - 1]


def select_blocks(block_ids: tuple[list[int], ...] | list[list[int]], groups: list[GroupSpec],
                  geometry: KvGeometry, num_tokens: int) -> tuple[list[int], list[int]]:
    """(latent pages in token order, running slot per KDA layer) of one request.

    Pages are MLA *kernel* blocks (`geometry.page_tokens` tokens): a logical block b of
    `block_size` tokens is kernel blocks b*ratio .. b*ratio+ratio-1, adjacent in memory."""
    if len(block_ids) != len(groups):
        raise ValueError(f"{len(block_ids)} block lists for {len(groups)} KV-cache groups")
    of_layer = {n: i for i, g in enumerate(groups) for n in g.layer_names}
    mla_groups = sorted({of_layer[n] for n in geometry.mla_layers})
    pages: list[int] = []
    if mla_groups:
        if len(mla_groups) > 1:
            # One MLA group holds every MLA layer for Kimi (MLA layers are the minority, and vLLM's
            # group size is the smallest layer count); several would need pages per layer.
            raise NotImplementedError(f"MLA layers span {len(mla_groups)} KV-cache groups "
                                      f"{mla_groups}; pdserve expects one")
        g = groups[mla_groups[0]]
        if g.block_size % geometry.page_tokens:
            raise ValueError(f"MLA block size {g.block_size} is not a multiple of the kernel "
                             f"block size {geometry.page_tokens}")
        ratio = g.block_size // geometry.page_tokens
        logical = list(block_ids[mla_groups[0]])[:-(-num_tokens // g.block_size)]
        if len(logical) * g.block_size < num_tokens:
            raise ValueError(f"{len(logical)} MLA blocks of {g.block_size} tokens cannot hold "
                             f"{num_tokens} tokens")
        pages = [b * ratio + j for b in logical for j in range(ratio)]
        pages = pages[:-(-num_tokens // geometry.page_tokens)]
    slots = []
    for name in geometry.kda_layers:
        g = groups[of_layer[name]]
        slots.append(running_slot(list(block_ids[of_layer[name]]), g.num_speculative_blocks))
    return pages, slots


def manifest_from_vllm(request_id: str, config, shapes: RankShapes, geometry: KvGeometry,
                       groups: list[GroupSpec], block_ids, num_tokens: int) -> StateManifest:
    """The `StateManifest` of one request held in vLLM's cache (shapes are per TP rank)."""
    pages, slots = select_blocks(block_ids, groups, geometry, num_tokens)
    layout = geometry.layout()
    return StateManifest(
        request_id=request_id, fingerprint=model_fingerprint(config, layout),
        num_tokens=num_tokens, topology=Topology(tp=shapes.tp), layout=layout, shapes=shapes,
        latent_pages=[pages], kda_slot=slots[0] if slots else 0, strides=geometry.strides,
        kda_layer_slots=slots if slots else None)


# -- leases ----------------------------------------------------------------------------------------
class LeaseBook:
    """Scheduler side: requests whose blocks vLLM keeps for us, and the holds not yet sent to
    the workers (they travel in the next step's connector metadata)."""

    def __init__(self, lease_s: float, clock=time.monotonic):
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        self.lease_s, self.clock = lease_s, clock
        self.held: dict[str, float] = {}      # request id -> deadline (clock seconds)
        self._pending: dict[str, float] = {}  # request id -> lease seconds, for the workers
        self._cancels: list[str] = []

    def hold(self, request_id: str) -> float:
        self.held[request_id] = self.clock() + self.lease_s
        self._pending[request_id] = self.lease_s
        return self.held[request_id]

    def cancel(self, request_id: str) -> bool:
        """Ask the workers to free a held request now (they report it as finished sending)."""
        if request_id not in self.held:
            return False
        self._cancels.append(request_id)
        return True

    def take(self) -> tuple[dict[str, float], list[str]]:
        """(new holds, cancels) for this step's metadata; empties both."""
        out = (self._pending, self._cancels)
        self._pending, self._cancels = {}, []
        return out

    def freed(self, request_ids) -> None:
        """Workers reported these requests as finished sending: vLLM frees their blocks now."""
        for r in request_ids or ():
            self.held.pop(r, None)

    def overdue(self, grace_s: float) -> list[str]:
        """Held past their deadline by more than `grace_s`: a worker failed to free them."""
        now = self.clock()
        return [r for r, d in self.held.items() if d + grace_s < now]


class SendTracker:
    """Worker side: leases in a `SourceRank` over this worker's agent; each request freed (done
    from every destination rank, cancelled, or expired) is reported to vLLM once."""

    def __init__(self, agent, clock=time.monotonic):
        self._freed: set[str] = set()
        self.source = SourceRank(agent, release=self._release, clock=clock)

    def _release(self, request_id: str) -> None:
        self._freed.add(request_id)  # vLLM frees the blocks once get_finished reports it

    def apply(self, holds: dict[str, float], cancels: list[str]) -> None:
        for request_id, lease_s in holds.items():
            self.source.hold(request_id, lease_s)
        for request_id in cancels:
            self.source.cancel(request_id)

    def poll(self) -> set[str]:
        """Handle notifications and expiries; the request ids freed since the last poll."""
        self.source.poll()
        out, self._freed = self._freed, set()
        return out
