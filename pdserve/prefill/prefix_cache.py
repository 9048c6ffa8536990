"""The prefix cache of a reference prefill rank: full latent pages and KDA checkpoints of
prompts it prefilled, for the next request that starts with the same tokens (docs/design.md §2).

A block is `page_tokens` prompt tokens (one latent page). Its key chains xxh3-64 over the key of
the block before it (the model fingerprint for the first block) and its token ids, so a key
names the whole prefix up to the block's end. An entry owns the block's latent page and, where a
checkpoint was taken, a KDA slot holding the state after the block. A hit of k blocks needs all
k pages and a checkpoint at block k; the request then shares the pages (never written again: a
prefill writes only its own positions) and starts from a copy of the checkpoint, like a chunked
prefill resuming at block k.

Entries a request uses or made are pinned (refcounted) until its state is released; the rest
are evicted least recently used, leaves first (a block whose successor is cached stays, or the
successor could not be reached), to keep the cache within its byte bound and to make room in
the pools for new requests. Where nothing can be evicted a request still prefills, uncached.

The router keeps a `PrefixIndex` per prefill instance, a copy of which keys it holds and which
of them have a checkpoint, fed by `PrefixCache.changes()`, so it can send a request where its
longest prefix is cached without asking every instance.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import msgspec
import numpy as np
import xxhash

from pdserve.prefill.scheduler import UNIT
from pdserve.state.pools import StatePools


class PrefixCacheConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The prefix cache of a reference prefill rank (`[prefill.prefix_cache]`): at most
    `max_bytes` of state, or (0) `max_share` of the pools' bytes; a KDA checkpoint every
    `checkpoint_interval` blocks besides the one at each prompt's last full block."""

    enabled: bool = True
    max_bytes: int = 0
    max_share: float = 0.5
    checkpoint_interval: int = 16
    # the router sends a request to the instance holding its longest cached prefix unless that
    # instance has more than this many prompt tokens queued (then the least loaded takes it)
    route_max_queued_tokens: int = 8192


@dataclass
class _Entry:
    parent: int | None
    tokens: bytes           # the block's token ids (a key collision must not become a hit)
    page: int
    slot: int = 0           # checkpoint: the KDA state after the block; 0 = none
    refs: int = 0
    children: int = 0


class Hit(msgspec.Struct, frozen=True):
    """What a request takes from the cache: its first `tokens` prompt tokens' state. `shared`:
    how far its blocks are cached at all (past `tokens` where they have no checkpoint): where
    its prompt leaves the cached one's, so it takes a checkpoint there for the next."""

    tokens: int = 0
    pages: list[int] = []
    slot: int = 0           # the checkpoint at `tokens` (0: no hit)
    keys: list[int] = []    # entries pinned for the request
    shared: int = 0


class PrefixChanges(msgspec.Struct, frozen=True):
    """What a cache changed since its previous `changes()`: `entries` maps a key to whether it
    now has a checkpoint, or to None where it was evicted; `full`: `entries` is the whole
    cache (the first answer, or after more changes than were kept). `root` and `block` let the
    reader key prompts as the cache does; `stats` is the cache's `stats()`."""

    root: int
    block: int
    full: bool
    entries: dict[int, bool | None]
    stats: dict[str, int]


def _block_bytes(tokens: list[int]) -> bytes:
    return np.asarray(tokens, dtype=np.int64).tobytes()


def block_keys(root: int, block: int, prompt: list[int]) -> list[tuple[int, bytes]]:
    """(key, token bytes) of each full block of `prompt`: xxh3-64 chained from `root`."""
    out, key = [], root
    for start in range(0, len(prompt) - block + 1, block):
        data = _block_bytes(prompt[start:start + block])
        key = xxhash.xxh3_64_intdigest(key.to_bytes(8, "little") + data)
        out.append((key, data))
    return out


def resumable(pos: int, length: int) -> bool:
    """Whether a prefill of `length` tokens can start from the state at `pos` with the bits of
    a whole prefill: on a KDA chunk boundary, leaving no single token (the chunked prefill's
    rule, `pdserve.prefill.scheduler`)."""
    return pos % UNIT == 0 and length - pos >= 2


class PrefixIndex:
    """Which blocks a prefill instance's cache holds, as its `changes()` report them (the
    router's copy): `match` is the hit that instance would give a prompt, as far as the last
    report says (an eviction since makes it a smaller hit there, never a wrong one)."""

    def __init__(self):
        self.root = self.block = 0
        self.entries: dict[int, bool] = {}  # key -> has a checkpoint
        self.stats: dict[str, int] = {}

    def apply(self, ch: PrefixChanges) -> None:
        # a full answer builds a new dict: a reader in another thread sees the old or the new
        entries = {} if ch.full else self.entries
        for key, checkpoint in ch.entries.items():
            if checkpoint is None:
                entries.pop(key, None)
            else:
                entries[key] = checkpoint
        self.root, self.block, self.entries, self.stats = ch.root, ch.block, entries, ch.stats

    def match(self, prompt: list[int]) -> int:
        """Prompt tokens the instance's cache would give `prompt`."""
        if not self.block:
            return 0
        best = 0
        for i, (key, _) in enumerate(block_keys(self.root, self.block, prompt), 1):
            checkpoint = self.entries.get(key)
            if checkpoint is None:
                break
            if checkpoint and resumable(i * self.block, len(prompt)):
                best = i * self.block
        return best


class PrefixCache:
    """`max_bytes`: the most state (latent pages + checkpoint slots) the cache holds;
    `interval`: a checkpoint every this many blocks, besides the one at each prompt's last full
    block."""

    LOG_SLACK = 1024  # changes kept for the reader beyond twice the entries

    def __init__(self, pools: StatePools, fingerprint: str, max_bytes: int, interval: int):
        if interval < 1:
            raise ValueError(f"checkpoint_interval must be >= 1 block, got {interval}")
        self.pools, self.max_bytes, self.interval = pools, max_bytes, interval
        self.block = pools.layout.page_tokens
        self.page_bytes = pools.latent.data[:, 0].nbytes
        self.slot_bytes = pools.slots.recurrent[:, 0].nbytes + pools.slots.conv[:, 0].nbytes
        self._root = xxhash.xxh3_64_intdigest(fingerprint.encode())
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._lock = threading.RLock()
        self.bytes = 0
        # tokens_saved: prompt tokens that hits kept from being prefilled
        self.counts = {"hits": 0, "misses": 0, "tokens_saved": 0, "evictions": 0}
        # entries changed since the last `changes()` (None: evicted); `_full`: report them all
        self._changed: dict[int, bool | None] = {}
        self._full = True

    # -- keys and positions -----------------------------------------------------------------
    def keys(self, prompt: list[int]) -> list[tuple[int, bytes]]:
        """(key, token bytes) of each full block of `prompt`."""
        return block_keys(self._root, self.block, prompt)

    def stops(self, length: int, start: int, shared: int = 0) -> list[int]:
        """The positions after `start` where a prompt of `length` tokens takes checkpoints:
        every `interval` blocks, at its last full block (where the conversation's next turn
        starts) and at `shared` (where it leaves a cached prompt: the next request with that
        prefix hits all of it, not just up to the interval), where the state there can be cut
        bit-exactly."""
        full = length // self.block
        ends = [b * self.block for b in range(1, full + 1)
                if b % self.interval == 0 or b == full or b * self.block == shared]
        return [p for p in ends if p > start and p % UNIT == 0
                and (p == length or resumable(p, length))]

    # -- requests ---------------------------------------------------------------------------
    def acquire(self, prompt: list[int]) -> Hit:
        """The longest usable cached prefix of `prompt`, its entries pinned (a miss: none)."""
        with self._lock:
            chain = []
            for key, data in self.keys(prompt):
                e = self._entries.get(key)
                if e is None or e.tokens != data:
                    break
                chain.append(key)
            k = shared = len(chain)
            while k and not (self._entries[chain[k - 1]].slot
                             and resumable(k * self.block, len(prompt))):
                k -= 1
            if not k:
                self.counts["misses"] += 1
                return Hit(shared=shared * self.block)
            keys = chain[:k]
            for key in keys:
                self._entries[key].refs += 1
                self._entries.move_to_end(key)
            self.counts["hits"] += 1
            self.counts["tokens_saved"] += k * self.block
            return Hit(k * self.block, [self._entries[key].page for key in keys],
                       self._entries[keys[-1]].slot, keys, shared * self.block)

    def insert(self, prompt: list[int], pages: list[int], checkpoints: dict[int, int],
               hit: Hit) -> tuple[list[int], set[int], set[int]]:
        """Cache the full blocks of a prefilled `prompt` after those it `hit`: `pages` are its
        latent pages, `checkpoints` its KDA snapshots by position. Returns the keys pinned for
        it (the hit's and the new ones) and the pages and slots the cache now owns; a block
        already cached (a concurrent prefill of the same prefix) or past the bound stays the
        request's."""
        with self._lock:
            keys, pages_taken, slots_taken = list(hit.keys), set(), set()
            parent = hit.keys[-1] if hit.keys else None
            for i, (key, data) in enumerate(self.keys(prompt)):
                if i < len(hit.keys):
                    continue
                e = self._entries.get(key)
                if e is not None:
                    if e.tokens != data:
                        break
                    # pinned as a hit's: evicting it to make room would orphan the next block
                    e.refs += 1
                    self._entries.move_to_end(key)
                    keys.append(key)
                    parent = key
                    slot = checkpoints.get((i + 1) * self.block, 0)
                    if not e.slot and slot and self._evict_until(
                            lambda: self.bytes + self.slot_bytes <= self.max_bytes):
                        e.slot = slot  # the checkpoint where this prompt left the cached one
                        self.bytes += self.slot_bytes
                        slots_taken.add(slot)
                        self._note(key, True)
                    continue
                slot = checkpoints.get((i + 1) * self.block, 0)
                need = self.page_bytes + (self.slot_bytes if slot else 0)
                if not self._evict_until(lambda: self.bytes + need <= self.max_bytes):
                    break
                self._entries[key] = _Entry(parent, data, pages[i], slot, refs=1)
                self._note(key, bool(slot))
                if parent is not None:
                    self._entries[parent].children += 1
                self.bytes += need
                keys.append(key)
                pages_taken.add(pages[i])
                if slot:
                    slots_taken.add(slot)
                parent = key
            return keys, pages_taken, slots_taken

    def release(self, keys: list[int]) -> None:
        """Unpin a request's entries (its state is freed)."""
        with self._lock:
            for key in keys:
                self._entries[key].refs -= 1

    def make_room(self, pages: int, slots: int) -> bool:
        """Evict unpinned entries until the pools have `pages` pages and `slots` slots free;
        False if they cannot."""
        latent, pool = self.pools.latent, self.pools.slots
        with self._lock:
            return self._evict_until(lambda: latent.num_free >= pages and pool.num_free >= slots)

    # -- eviction ---------------------------------------------------------------------------
    def _evict_until(self, done) -> bool:
        while not done():
            victim = next((k for k, e in self._entries.items() if not e.refs and not e.children),
                          None)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def _evict(self, key: int) -> None:
        e = self._entries.pop(key)
        self._note(key, None)
        if e.parent is not None:
            self._entries[e.parent].children -= 1
        self.pools.latent.free([e.page])
        self.bytes -= self.page_bytes
        if e.slot:
            self.pools.slots.free([e.slot])
            self.bytes -= self.slot_bytes
        self.counts["evictions"] += 1

    # -- what the router sees ---------------------------------------------------------------
    def _note(self, key: int, checkpoint: bool | None) -> None:
        # a reader that stopped asking costs a bounded log: past the entries themselves it is
        # cheaper to send them all
        if not self._full:
            self._changed[key] = checkpoint
            if len(self._changed) > 2 * len(self._entries) + self.LOG_SLACK:
                self._full, self._changed = True, {}

    def changes(self) -> PrefixChanges:
        """What changed since the last call (the first call, and one after the log overflowed:
        everything). One reader: the router, through rank 0."""
        with self._lock:
            full = self._full
            entries = ({k: bool(e.slot) for k, e in self._entries.items()} if full
                       else self._changed)
            self._changed, self._full = {}, False
            return PrefixChanges(self._root, self.block, full, entries, self.stats())

    def stats(self) -> dict:
        with self._lock:
            return {f"prefix_{k}": v for k, v in self.counts.items()} | {
                "prefix_entries": len(self._entries), "prefix_bytes": self.bytes,
                "prefix_cached_tokens": len(self._entries) * self.block,
                "prefix_checkpoints": sum(1 for e in self._entries.values() if e.slot)}
