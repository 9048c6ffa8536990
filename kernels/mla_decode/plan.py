"""The launch plan of the CuTe DSL MLA decode: every choice a call makes, resolved here and
nowhere else.

`plan_call` turns a call's shape (batch, heads, longest context, cache dtype, page size), the
device's properties and the caller's explicit choices into a `Plan`: the split count, the head
groups, the attention kernel's compile-time variant (`Attention`) and the combine's
(`Combine`). Every field of a variant is a tuning choice or a property the kernel is built for;
the variant is the compiled-kernel cache key (launch.py), so no choice can reach a kernel without
selecting its own compiled object. Nothing here reads the environment; the device's SM count and
shared memory come from the device (`Device.of`), or are passed explicitly (CPU compile tests).

The defaults, per call (`plan_call`):
  * early_kv = True: the kernel reads seq_lens, the block table and its first KV tiles before
    the PDL wait, overlapping the previous kernel's tail. Contract: the kernel right before it
    in the stream writes none of those (the decode runtime writes the new token's latent, then
    absorbs the query, then attends). Callers that cannot keep it pass early_kv=False.
  * fp8_query = "single" over an fp8 cache: the query as one e4m3 term (the rounding vLLM's fp8
    MLA path applies); "split" = two e4m3 terms, as precise as the bf16 query, twice the score
    MMAs. With a bf16 cache the query is never rounded ("split").
  * head_groups: 2 CTAs per split share a request's heads where H > 16 and the context is short
    (fp8: B x L <= 64K; bf16: L <= 2K), else 1: small launches get more CTAs.
  * num_splits: one wave of CTAs over the SMs, at least two 64-token tiles per split.
  * consumers: two consumer warpgroups taking alternate tiles for fp8 splits of more than two
    tiles, else one (bf16 always one).
  * pool_div = 4 (fp8, more than one split, >= 32 tiles a split, not deterministic): the last
    quarter of each split's tiles is drawn at run time by whichever CTA of the request is free.
    It varies the partials' rounding from run to run; deterministic=True turns it off.
  * d_split = 2 (bf16, one consumer, no pool) where the doubled launch takes at most half of the
    SMs: two CTAs per split, each writing 256 of the 512 latent dims.
  * lazy_max, q_half, xmerge: on wherever they apply (two fp8 consumers; xmerge with any two).
  * qk_joint: on for the fp8 two-term query at 16 padded heads.
  * pv_group / pv_in_flight / pv_prefetch (fp8 PV): (4, 2, on) at 16 padded heads; (2, 3, on)
    at 32 with two consumers; (2, 2, off) at 32 with one (the prefetch would spill there).
  * bf16_partials: the fp8 cache's split partials are bf16, the bf16 cache's fp32.
  * combine (column chunks, split groups): (1, 1) up to 8 splits, (1, 4) up to 31; from 32,
    (8, 32) when the attention grid fills >= 3/4 of the SMs, else (4, 8) for fp32 partials and
    (2, 8) for bf16 ones (the combine's CTAs become resident beside the attention grid).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, fields

TILE_N = 64                     # tokens per tile; a tile never straddles a page
MAX_SPLITS = 1024               # the combine's limit
FP8_QUERY_MODES = ("split", "single")
POOL_DIVS = (0, 2, 4, 8)

HEAD_GROUP_FP8_MAX_TOKENS = 64 * 1024   # head_groups 2 (H > 16): fp8 up to this B x L
HEAD_GROUP_BF16_MAX_SEQ = 2048          # bf16 up to this context length
POOL_MIN_TILES = 32                      # the tile pool where a split has at least this many
POOL_DIV = 4                             # its share: 1 / POOL_DIV of each split's tiles
COMBINE_UNROLL = 8                       # CombineKernel.unroll: splits in a thread's first loads
COMBINE_WIDE_MIN_SPLITS = 32


@dataclass(frozen=True)
class Device:
    """The properties of the GPU a plan is made for: SM count and the opt-in maximum of dynamic
    shared memory per block (bytes)."""
    sm_count: int
    smem_per_block: int

    @staticmethod
    def of(device) -> "Device":
        """The properties of CUDA device `device` (a torch.device, index or "cuda"), read from
        it once per process."""
        import torch
        dev = torch.device(device)
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        return _device_props(index)


@functools.lru_cache(maxsize=None)
def _device_props(index: int) -> Device:
    import torch
    props = torch.cuda.get_device_properties(index)
    smem = getattr(props, "shared_memory_per_block_optin", None)
    if not smem:
        import cuda.bindings.driver as drv
        drv.cuInit(0)
        err, dev = drv.cuDeviceGet(index)
        assert err == drv.CUresult.CUDA_SUCCESS, err
        err, smem = drv.cuDeviceGetAttribute(
            drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev)
        assert err == drv.CUresult.CUDA_SUCCESS, err
    return Device(int(props.multi_processor_count), int(smem))


@dataclass(frozen=True)
class Attention:
    """The attention kernel's compile-time variant (attention.MlaDecodeKernel; the compile cache
    key). Every field is explicit; `plan_call` fills them, the kernel checks them."""
    kv_fp8: bool            # cache: fp8 e4m3 (else bf16)
    h_pad: int              # heads padded to the wgmma N: 16 or 32
    page_tokens: int        # a multiple of 64
    early_kv: bool          # seq_lens, block table and KV tiles read before the PDL wait
    head_groups: int        # CTAs per split sharing a request's heads
    consumers: int          # consumer warpgroups: 1, or 2 taking alternate tiles
    q_terms: int            # fp8 query terms: 2 (Q_hi + Q_lo) or 1 (Q_hi)
    pool_div: int           # 1 / pool_div of each split's tiles drawn at run time; 0: no pool
    d_split: int            # CTAs per (split, request) dividing the 512 latent dims: 1 or 2
    lazy_max: bool          # fp8, two consumers: the running maxima move only on a rise
    q_half: bool            # fp8, two consumers: each loads and stores half of Q
    xmerge: bool            # two consumers: each merges and writes half of the heads
    qk_joint: bool          # fp8 two-term query at h_pad 16: one wgmma of N = 32 per k-step
    pv_group: int           # fp8 PV: M blocks per wgmma group (0 with a bf16 cache)
    pv_in_flight: int       # fp8 PV: wgmma groups in flight (0 with a bf16 cache)
    pv_prefetch: bool       # fp8 PV: each k-step's V words loaded one k-step ahead
    bf16_partials: bool     # split partials in bf16 (else fp32)
    smem_limit: int         # the device's dynamic shared memory per block (bytes)


@dataclass(frozen=True)
class Combine:
    """The split-KV combine's compile-time variant (combine.CombineKernel)."""
    chunks: int             # CTAs per (request, head), each a column chunk of the 512
    groups: int             # split groups per CTA
    bf16_partials: bool


@dataclass(frozen=True)
class Plan:
    """What one call runs: `num_splits` KV splits per request, its heads over `head_groups` CTAs
    per split, the attention variant, and the combine's when there are several splits.
    `fp8_query` is the query rounding the call applies (the reference's `fp8_query` that
    matches it)."""
    num_splits: int
    head_groups: int
    fp8_query: str
    deterministic: bool
    attention: Attention
    combine: Combine | None

    def choices(self) -> dict:
        """The explicit arguments of `plan_call` that give this plan back (for callers that
        record the plan and pass every choice, e.g. the benchmarks)."""
        a = self.attention
        out = dict(num_splits=self.num_splits, head_groups=self.head_groups,
                   early_kv=a.early_kv, fp8_query=self.fp8_query,
                   deterministic=self.deterministic, consumers=a.consumers,
                   pool_div=a.pool_div, d_split=a.d_split, lazy_max=a.lazy_max,
                   q_half=a.q_half, xmerge=a.xmerge, qk_joint=a.qk_joint,
                   bf16_partials=a.bf16_partials)
        if a.kv_fp8:
            out.update(pv_group=a.pv_group, pv_in_flight=a.pv_in_flight,
                       pv_prefetch=a.pv_prefetch)
        if self.combine is not None:
            out["combine"] = (self.combine.chunks, self.combine.groups)
        return out

    def record(self) -> dict:
        """Every field, flat (for result files)."""
        out = {f.name: getattr(self.attention, f.name) for f in fields(Attention)}
        out.update(num_splits=self.num_splits, fp8_query=self.fp8_query,
                   deterministic=self.deterministic,
                   combine=None if self.combine is None
                   else [self.combine.chunks, self.combine.groups])
        return out


# the choices plan_call takes, by name (benchmarks parse them from text)
CHOICES = ("num_splits", "head_groups", "early_kv", "fp8_query", "deterministic", "consumers",
           "pool_div", "d_split", "lazy_max", "q_half", "xmerge", "qk_joint", "pv_group",
           "pv_in_flight", "pv_prefetch", "bf16_partials", "combine")


def check_fp8_query(fp8_query: str) -> str:
    if fp8_query not in FP8_QUERY_MODES:
        raise ValueError(f"fp8_query must be {' or '.join(map(repr, FP8_QUERY_MODES))}, "
                         f"got {fp8_query!r}")
    return fp8_query


def h_pad_for(heads: int) -> int:
    return 16 if heads <= 16 else 32


def split_tiles(max_seq_len: int | None, num_splits: int) -> int | None:
    """Tiles in each split of the longest request (None when its length is unknown)."""
    if max_seq_len is None:
        return None
    return -(-(-(-int(max_seq_len) // TILE_N)) // int(num_splits))


def choose_head_groups(batch: int, heads: int, max_seq_len: int | None, kv_fp8: bool) -> int:
    """2 where H > 16 and the context is short (the split count per group halves, which only
    pays while the launch is small), else 1."""
    if heads <= 16 or heads % 2 or max_seq_len is None:
        return 1
    if kv_fp8:
        return 2 if batch * int(max_seq_len) <= HEAD_GROUP_FP8_MAX_TOKENS else 1
    return 2 if int(max_seq_len) <= HEAD_GROUP_BF16_MAX_SEQ else 1


def choose_num_splits(requests: int, max_seq_len: int, sm_count: int) -> int:
    """KV splits per request: one wave of CTAs (one per SM) over the `requests` the launch
    sees, at least two tiles per split."""
    tiles = max(1, -(-int(max_seq_len) // TILE_N))
    return max(1, min(sm_count // max(1, requests), -(-tiles // 2), MAX_SPLITS))


def choose_consumers(kv_fp8: bool, tiles_per_split: int | None) -> int:
    """bf16: 1. fp8: 1 where each split has at most 2 tiles (the pair's merge and second Q
    split cost more than running two tiles side by side saves), else 2 (also when the split
    size is unknown)."""
    if not kv_fp8:
        return 1
    return 1 if tiles_per_split is not None and tiles_per_split <= 2 else 2


def choose_pool_div(kv_fp8: bool, max_seq_len: int | None, num_splits: int,
                    deterministic: bool) -> int:
    """The fp8 tile pool's share where there is more than one split and the longest request's
    splits have at least POOL_MIN_TILES tiles (below, its id-driven tile loop costs more than
    evening out the splits' ends gains); 0 otherwise and when deterministic."""
    if deterministic or not kv_fp8 or num_splits < 2:
        return 0
    tiles = split_tiles(max_seq_len, num_splits)
    return POOL_DIV if tiles is not None and tiles >= POOL_MIN_TILES else 0


def choose_d_split(kv_fp8: bool, consumers: int, pool_div: int, requests: int,
                   num_splits: int, sm_count: int) -> int:
    """2 (latent halves) for a bf16 cache with one consumer and no pool where the doubled launch
    takes at most half of the SMs: each CTA's chain is shorter by a quarter of its MMAs, for a
    second (mostly L2) read of every tile; larger launches lose. Else 1."""
    if kv_fp8 or consumers != 1 or pool_div:
        return 1
    return 2 if 2 * requests * num_splits <= sm_count // 2 else 1


def choose_pv(h_pad: int, consumers: int) -> tuple[int, int, bool]:
    """fp8 PV (pv_group, pv_in_flight, pv_prefetch): as many wgmma groups in flight as the
    registers allow without a spill; at h_pad 32 one consumer cannot also hold the prefetched
    V words."""
    if h_pad == 16:
        return 4, 2, True
    return (2, 3, True) if consumers == 2 else (2, 2, False)


def choose_combine(num_splits: int, main_ctas: int, bf16_partials: bool,
                   sm_count: int) -> tuple[int, int]:
    """(column chunks, split groups) of the combine after an attention grid of `main_ctas`
    CTAs: one group while every split is among a thread's first loads, 4 up to 31 splits; from
    32 (small batch, long contexts) each head over several CTAs of many groups, fewer when the
    attention grid leaves SMs free for the combine's CTAs to become resident early."""
    if num_splits < COMBINE_WIDE_MIN_SPLITS:
        return (1, 1) if num_splits <= COMBINE_UNROLL else (1, 4)
    if 4 * int(main_ctas) >= 3 * sm_count:
        return 8, 32
    return (2, 8) if bf16_partials else (4, 8)


def _pick(value, default):
    return default if value is None else value


@functools.lru_cache(maxsize=4096)
def plan_call(batch: int, heads: int, max_seq_len: int | None, kv_fp8: bool, page_tokens: int,
              device: Device, *, num_splits: int | None = None, head_groups: int | None = None,
              early_kv: bool = True, fp8_query: str | None = None, deterministic: bool = False,
              consumers: int | None = None, pool_div: int | None = None,
              d_split: int | None = None, lazy_max: bool | None = None,
              q_half: bool | None = None, xmerge: bool | None = None,
              qk_joint: bool | None = None, pv_group: int | None = None,
              pv_in_flight: int | None = None, pv_prefetch: bool | None = None,
              bf16_partials: bool | None = None,
              combine: tuple[int, int] | None = None) -> Plan:
    """The plan of one call of `batch` requests of `heads` heads whose longest context is
    `max_seq_len` (None: unknown; then num_splits is required). Each keyword left None takes
    its default (module docstring), given the choices made before it; a choice the kernel
    cannot take is refused with a ValueError naming it (here or when the kernel is built)."""
    kv_fp8 = bool(kv_fp8)
    if fp8_query is not None:
        check_fp8_query(fp8_query)
    query = (fp8_query or "single") if kv_fp8 else "split"
    groups = _pick(head_groups, choose_head_groups(batch, heads, max_seq_len, kv_fp8))
    if groups < 1 or heads % groups:
        raise ValueError(f"head_groups={groups} must divide H={heads}")
    requests, hv = batch * groups, heads // groups
    if num_splits is None:
        if max_seq_len is None:
            raise ValueError("plan_call needs max_seq_len or num_splits")
        num_splits = choose_num_splits(requests, max_seq_len, device.sm_count)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be 1..{MAX_SPLITS}, got {num_splits}")
    hp = h_pad_for(hv)
    cons = _pick(consumers, choose_consumers(kv_fp8, split_tiles(max_seq_len, num_splits)))
    pool = _pick(pool_div, choose_pool_div(kv_fp8, max_seq_len, num_splits, deterministic))
    if deterministic and pool:
        raise ValueError(f"pool_div={pool}: the tile pool is not deterministic")
    halves = _pick(d_split, choose_d_split(kv_fp8, cons, pool, requests, num_splits,
                                           device.sm_count))
    pair_fp8 = kv_fp8 and cons == 2
    q_terms = 1 if query == "single" else 2
    if kv_fp8:
        group, in_flight, prefetch = choose_pv(hp, cons)
        group, in_flight = _pick(pv_group, group), _pick(pv_in_flight, in_flight)
        prefetch = _pick(pv_prefetch, prefetch)
    else:
        group = in_flight = 0
        prefetch = False
        if (pv_group, pv_in_flight, pv_prefetch) != (None, None, None):
            raise ValueError("pv_group / pv_in_flight / pv_prefetch: fp8 cache only")
    bf16_part = _pick(bf16_partials, kv_fp8)
    attention = Attention(
        kv_fp8=kv_fp8, h_pad=hp, page_tokens=int(page_tokens), early_kv=bool(early_kv),
        head_groups=groups, consumers=cons, q_terms=q_terms, pool_div=pool, d_split=halves,
        lazy_max=_pick(lazy_max, pair_fp8), q_half=_pick(q_half, pair_fp8),
        xmerge=_pick(xmerge, cons == 2),
        qk_joint=_pick(qk_joint, kv_fp8 and hp == 16 and q_terms == 2),
        pv_group=group, pv_in_flight=in_flight, pv_prefetch=prefetch,
        bf16_partials=bf16_part, smem_limit=device.smem_per_block)
    comb = None
    if num_splits > 1:
        shape = combine or choose_combine(num_splits, requests * num_splits * halves, bf16_part,
                                          device.sm_count)
        comb = Combine(int(shape[0]), int(shape[1]), bf16_part)
    elif combine is not None:
        raise ValueError("combine: one split has no combine")
    return Plan(num_splits, groups, query, bool(deterministic), attention, comb)

