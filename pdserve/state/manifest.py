"""`StateManifest`: everything a decode rank needs to compute its reads of one request's state,
and nothing else (docs/design.md §3). Serializable with msgspec (msgpack or JSON)."""
from __future__ import annotations

import hashlib
import json

import msgspec

from pdserve.state.block_table import BlockTable, Topology
from pdserve.state.layout import DTYPE_FIELDS, RankShapes, StateLayout, dtype_of


def model_fingerprint(config, layout: StateLayout) -> str:
    """Hash of the model config and the state dtypes.

    Two engines may exchange state only when their fingerprints match. TP/DCP, the page size and
    the conv layout are deliberately not part of it: the manifest carries them and the transfer
    planner reshards heads, re-pages tokens and converts SD <-> DS on arrival."""
    dtypes = {k: getattr(layout, k) for k in DTYPE_FIELDS}
    blob = json.dumps({"config": config.to_hf_dict(), "dtypes": dtypes, "recurrent": "HVK"},
                      sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


class RegionSizes(msgspec.Struct, frozen=True):
    """Bytes of one unit of each state region on one source rank."""

    latent_page: int      # one page of one MLA layer
    recurrent_slot: int   # one slot of one KDA layer
    conv_slot: int        # one slot of one KDA layer

    @staticmethod
    def of(shapes: RankShapes, layout: StateLayout) -> "RegionSizes":
        def size(name: str) -> int:
            return dtype_of(name).itemsize
        return RegionSizes(
            latent_page=layout.page_tokens * shapes.latent_width * size(layout.latent_dtype),
            recurrent_slot=shapes.kda_heads * shapes.head_dim ** 2 * size(layout.recurrent_dtype),
            conv_slot=shapes.conv_taps * shapes.conv_channels * size(layout.conv_dtype),
        )


class SourceStrides(msgspec.Struct, frozen=True):
    """Bytes from one latent page / KDA slot to the next in a source rank's layer regions.

    Our pools are dense (stride = the unit's own size). vLLM's hybrid allocator is not: it pads
    each KDA state page up to the attention page and lets one buffer hold an MLA layer and KDA
    layers, so a KDA slot is followed by padding. Bytes inside one page or slot stay dense, and
    each kind's region starts at its page/slot 0."""

    latent_page: int
    recurrent_slot: int
    conv_slot: int

    def __post_init__(self) -> None:
        for name in ("latent_page", "recurrent_slot", "conv_slot"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} stride must be >= 1, got {getattr(self, name)}")


class StateManifest(msgspec.Struct, frozen=True):
    """One request's cached state on a source instance."""

    request_id: str
    fingerprint: str
    num_tokens: int                          # N: tokens whose state is cached
    topology: Topology                       # source TP / DCP / interleave
    layout: StateLayout                      # source dtypes, page size, conv layout
    shapes: RankShapes                       # per source rank
    latent_pages: list[list[int]]            # per source DCP rank
    kda_slot: int
    checkpoints: list[tuple[int, int]] = []  # (token_pos, slot_id)
    strides: SourceStrides | None = None     # None = dense regions (our pools)
    # Running slot per KDA layer, overriding kda_slot: vLLM gives each KDA KV-cache group its own
    # block ids, so one request's state sits in different slots in different layers.
    kda_layer_slots: list[int] | None = None

    def __post_init__(self) -> None:
        if self.kda_layer_slots is not None:
            if len(self.kda_layer_slots) != self.shapes.n_kda:
                raise ValueError(f"kda_layer_slots has {len(self.kda_layer_slots)} entries for "
                                 f"{self.shapes.n_kda} KDA layers")
            if self.checkpoints:
                raise ValueError("per-layer KDA slots carry the running state only (no checkpoints)")

    @property
    def sizes(self) -> RegionSizes:
        return RegionSizes.of(self.shapes, self.layout)

    def source_strides(self) -> SourceStrides:
        """The source's strides; dense ones when the manifest names none."""
        if self.strides is not None:
            return self.strides
        s = self.sizes
        return SourceStrides(s.latent_page, s.recurrent_slot, s.conv_slot)

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @staticmethod
    def decode(data: bytes) -> "StateManifest":
        return msgspec.msgpack.decode(data, type=StateManifest)

    def block_table(self) -> BlockTable:
        return BlockTable(latent_pages=[list(p) for p in self.latent_pages],
                          kda_slot=self.kda_slot, checkpoints=list(self.checkpoints),
                          num_tokens=self.num_tokens)


def build_manifest(request_id: str, config, shapes: RankShapes, layout: StateLayout,
                   table: BlockTable, topology: Topology) -> StateManifest:
    if table.num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {table.num_tokens}")
    return StateManifest(
        request_id=request_id, fingerprint=model_fingerprint(config, layout),
        num_tokens=table.num_tokens, topology=topology, layout=layout,
        shapes=shapes, latent_pages=[list(p) for p in table.latent_pages],
        kda_slot=table.kda_slot, checkpoints=list(table.checkpoints),
    )
