"""One NIXL agent per rank: registers the rank's state regions, tracks peers by generation, keeps
prepared descriptor lists per (peer, kind, unit), and runs READs with a deadline.

Agent metadata travels through the caller (Ray calls in a cluster, pipes or plain calls in
tests): `RankAgent.info()` on one side, `RankAgent.connect(info)` on the other.
"""
from __future__ import annotations

import importlib
import os
import time
from dataclasses import dataclass, field

import msgspec
import numpy as np
import torch

from pdserve.transfer.errors import PeerLost, TransferCancelled, TransferTimeout
from pdserve.transfer.planner import DOFF, KIND, KINDS, LAYER, LEN, SOFF, SRC, STAGED
from pdserve.transfer.regions import RegionTable

POLL_S = 0.0005  # between completion checks; keeps a CPU core mostly free while waiting
SPIN_S = 0.0002  # checks without a sleep first
# Each kind has one prepared list per side: an entry per transfer unit of every layer. A request
# indexes it with numpy arrays (one index per unit); NIXL merges index runs that are contiguous on
# both sides into one descriptor before the backend sees them (NIXL >= 1.5; checked in
# tests/test_transfer_nixl.py), so a long run costs one UCX operation whatever the unit size.
# (This replaced extra 16-unit "coarse" lists. On VRAM merged runs can be far longer than the
# 256-unit span that once failed in post_reads on the H200; not yet rerun there.)
# Entries a prepared list may have. A source whose regions need more (vLLM's whole KV cache in
# 16 KB units: millions) gets a descriptor list per request instead, one entry per read.
MAX_PREPARED = 1 << 20
PROGRESS_DELAY_US = 200  # NIXL's progress thread sleep between polls (see _calm_progress_thread)
NOTIFY_READ_BYTES = 64   # the READ that carries a notification from an agent without progress thread
NOTIFY_S = 5.0           # deadline for that READ


def load_nixl():
    """NIXL's Python API module. The `nixl` meta package picks a CUDA build from the toolkit it
    detects, which on a GPU-less machine with a CUDA toolkit names a wheel we did not install;
    so import an installed build directly and fall back to the meta package."""
    for name in ("nixl_cu12._api", "nixl_cu13._api", "nixl._api"):
        try:
            api = importlib.import_module(name)
        except ImportError:
            continue
        _calm_progress_thread(api)
        return api
    raise ImportError("NIXL is not installed (pip install nixl-cu12)")


def _calm_progress_thread(api) -> None:
    """NIXL's Python API creates agents with a progress-thread delay of 0, i.e. a thread that
    busy-polls a whole core per agent even when idle (measured: 1 idle agent = 1 core, 10 = all
    cores of this VM). Give the thread a short sleep instead; transfers are still progressed by
    our own completion polling."""
    bind = api.nixlBind
    if getattr(bind, "_pdserve_delay", None) is not None:
        return
    make_agent = bind.nixlAgent

    def agent_with_delay(name, config):
        config.pthrDelay = PROGRESS_DELAY_US
        return make_agent(name, config)

    bind.nixlAgent = agent_with_delay
    bind._pdserve_delay = PROGRESS_DELAY_US


class AgentInfo(msgspec.Struct, frozen=True):
    """What a peer needs to read from (or notify) this rank."""

    instance: str
    rank: int
    generation: int
    name: str
    metadata: bytes                                 # NIXL agent metadata
    regions: dict[str, list[tuple[int, int]]]       # kind -> per layer (address, bytes)
    mem: str = "DRAM"
    device: int = 0


@dataclass
class _Peer:
    info: AgentInfo
    dlists: dict[tuple[str, int], tuple[object, np.ndarray]] = field(default_factory=dict)


class RankAgent:
    def __init__(self, instance: str, rank: int, generation: int, regions: RegionTable,
                 device: str = "cpu", registered: RegionTable | None = None,
                 progress_thread: bool = True):
        """`regions`: what peers read, per (kind, layer). `registered`: the memory to register
        with NIXL when it is not simply `regions` (vLLM's layers alias one buffer, and
        registering a byte twice breaks NIXL).

        `progress_thread`: NIXL's UCX progress thread, which answers peers while this process
        is busy elsewhere. A source needs it (readers connect and notify it whenever they act).
        A destination drives its own progress (`wait` polls its reads, `notify` waits for its
        message), so it can run without: during DRAM reads the thread took 16-20 % of a core in
        every destination process, CPU the copies lacked (2-core VM, DCP2 at 8K: 15.5 -> 11.6
        ms). `DecodeRank` does so on DRAM; on VRAM (the GPU copies) it keeps the thread until
        the notification READ has been run on the H200."""
        api = load_nixl()
        self.instance, self.rank, self.generation = instance, rank, generation
        self.name = f"{instance}.r{rank}.g{generation}"
        self.regions = regions
        self.mem = "VRAM" if str(device).startswith("cuda") else "DRAM"
        self.device = 0 if self.mem == "DRAM" else int(str(device).partition(":")[2] or 0)
        if self.mem == "VRAM":
            # UCX turns CUDA-IPC GET off on GPUs without active NVLink peers (one GPU, PCIe),
            # and a READ then falls back to TCP emulation (measured 0.45 GB/s on the H200).
            # UCX reads this when the agent's context is created; a user's setting wins.
            os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "on")
        self.addresses = regions.addresses()  # fixed for the agent's life (pools never move)
        self.agent = api.nixl_agent(self.name, api.nixl_agent_config(
            enable_prog_thread=progress_thread, backends=["UCX"]))
        # Without a progress thread a standalone notification would wait in the send queue
        # until this process next polls; `notify` sends it with a READ into this scratch
        # buffer instead, and waits for that READ.
        self._scratch = (None if progress_thread else
                         torch.empty(NOTIFY_READ_BYTES, dtype=torch.uint8,
                                     device="cpu" if self.mem == "DRAM" else f"cuda:{self.device}"))
        scratch = [] if self._scratch is None else [(self._scratch.data_ptr(), NOTIFY_READ_BYTES)]
        self._registered = self.agent.register_memory(
            [(a, n, self.device, "") for a, n in
             _merge((registered or regions).addresses()) + scratch], self.mem)
        self.peers: dict[tuple[str, int], _Peer] = {}
        self._local_dlists: dict[tuple[str, int], tuple[object, np.ndarray]] = {}

    # -- peers ------------------------------------------------------------------------------
    def info(self) -> AgentInfo:
        return AgentInfo(self.instance, self.rank, self.generation, self.name,
                         self.agent.get_agent_metadata(), self.addresses, self.mem,
                         self.device)

    def connect(self, info: AgentInfo) -> str:
        """Know `info`'s agent; a newer generation of a known peer evicts the old agent, an
        older one is refused (it is a stale handle from before a restart)."""
        key = (info.instance, info.rank)
        known = self.peers.get(key)
        if known is not None:
            if info.generation < known.info.generation:
                raise PeerLost(f"{info.name} is stale: {info.instance} rank {info.rank} restarted "
                               f"as generation {known.info.generation}")
            if info.generation == known.info.generation:
                return known.info.name
            self.forget(info.instance, info.rank)
        self.agent.add_remote_agent(info.metadata)
        self.peers[key] = _Peer(info)
        return info.name

    def forget(self, instance: str, rank: int) -> None:
        """Drop a peer: its prepared lists and its NIXL agent entry."""
        peer = self.peers.pop((instance, rank), None)
        if peer is None:
            return
        for handle, _ in peer.dlists.values():
            self.agent.release_dlist_handle(handle)
        try:
            self.agent.remove_remote_agent(peer.info.name)
        except Exception:  # already gone on the NIXL side; nothing else to free
            pass

    def peer(self, instance: str, rank: int) -> AgentInfo:
        try:
            return self.peers[(instance, rank)].info
        except KeyError:
            raise PeerLost(f"{self.name}: no connection to {instance} rank {rank}") from None

    def notify(self, instance: str, rank: int, message: bytes, timeout_s: float = NOTIFY_S) -> None:
        """Send `message` to a peer. Without a progress thread: as the notification of a small
        READ from the peer, returning once that READ completed (so the message is out), or
        raising `PeerLost` / `TransferTimeout` within `timeout_s`."""
        info = self.peer(instance, rank)
        if self._scratch is None:  # a progress thread sends it
            self.agent.send_notif(info.name, message)
            return
        addr, size = next(iter(info.regions.values()))[0]
        n = min(NOTIFY_READ_BYTES, size)
        handle = self._per_request(self.peers[(instance, rank)],
                                   np.array([self._scratch.data_ptr()]), np.array([addr]),
                                   np.array([n]), message)
        try:
            state = self.agent.transfer(handle)
            if state == "ERR":
                raise PeerLost(f"{self.name}: notifying {info.name} failed")
        except Exception as exc:
            self.release([("notify", handle, n)])
            raise _as_peer_lost(exc, self.name) from exc
        if state == "DONE":  # completed inside the post
            self.release([("notify", handle, n)])
            return
        self.wait([("notify", handle, n)], time.monotonic() + timeout_s)

    def notifications(self) -> dict[str, list[bytes]]:
        return self.agent.get_new_notifs()

    # -- prepared descriptor lists ----------------------------------------------------------
    def _dlist(self, owner: str, regions: dict[str, list[tuple[int, int]]], kind: str, unit: int,
               mem: str, device: int) -> tuple[object, np.ndarray]:
        """An entry per `unit` bytes of every layer of `kind`; returns (handle, per-layer index
        of the layer's first entry)."""
        descs, bases, count = [], [], 0
        for addr, nbytes in regions[kind]:
            if nbytes % unit:
                raise ValueError(f"{kind}: region of {nbytes} bytes is not a multiple of the "
                                 f"{unit}-byte transfer unit")
            starts = np.arange(addr, addr + nbytes, unit, dtype=np.int64)
            descs.append(np.stack([starts, np.full_like(starts, unit),
                                   np.full_like(starts, device)], axis=1))
            bases.append(count)
            count += len(starts)
        xfer = self.agent.get_xfer_descs(np.concatenate(descs), mem)
        return self.agent.prep_xfer_dlist(owner, xfer, mem), np.array(bases, dtype=np.int64)

    def _local(self, kind: str, unit: int):
        key = (kind, unit)
        if key not in self._local_dlists:
            self._local_dlists[key] = self._dlist("NIXL_INIT_AGENT", self.addresses, kind, unit,
                                                  self.mem, self.device)
        return self._local_dlists[key]

    def _remote(self, peer: _Peer, kind: str, unit: int):
        key = (kind, unit)
        if key not in peer.dlists:
            peer.dlists[key] = self._dlist(peer.info.name, peer.info.regions, kind, unit,
                                           peer.info.mem, peer.info.device)
        return peer.dlists[key]

    def _prepped(self, peer: _Peer, kind: str, local_kind: str, unit: int, rows: np.ndarray,
                 units_per_read: np.ndarray):
        """A READ indexing the prepared lists: one index per unit of every read (vectorized:
        with DCP a request has thousands of one-page reads)."""
        lh, lbase = self._local(local_kind, unit)
        rh, rbase = self._remote(peer, kind, unit)
        first = np.cumsum(units_per_read) - units_per_read
        within = np.arange(int(units_per_read.sum()), dtype=np.int64) - np.repeat(first, units_per_read)
        lidx = np.repeat(lbase[rows[:, LAYER]] + rows[:, DOFF] // unit, units_per_read) + within
        ridx = np.repeat(rbase[rows[:, LAYER]] + rows[:, SOFF] // unit, units_per_read) + within
        return self.agent.make_prepped_xfer("READ", lh, lidx.astype(np.int32), rh,
                                            ridx.astype(np.int32), b"")

    def _too_many(self, peer: _Peer, kind: str, local_kind: str, unit: int) -> bool:
        count = lambda regions, k: sum(n // unit for _, n in regions[k])
        return max(count(self.addresses, local_kind),
                   count(peer.info.regions, kind)) > MAX_PREPARED

    def _per_request(self, peer: _Peer, local: np.ndarray, remote: np.ndarray, nbytes: np.ndarray,
                     notif: bytes = b""):
        """A READ over descriptor lists made for these reads (one entry per read)."""
        ldescs = np.stack([local, nbytes, np.full_like(nbytes, self.device)], axis=1)
        rdescs = np.stack([remote, nbytes, np.full_like(nbytes, peer.info.device)], axis=1)
        return self.agent.initialize_xfer(
            "READ", self.agent.get_xfer_descs(ldescs, self.mem),
            self.agent.get_xfer_descs(rdescs, peer.info.mem), peer.info.name, notif)

    # -- reads ------------------------------------------------------------------------------
    def post_reads(self, src_instance: str, table: np.ndarray, units: dict[str, int]
                   ) -> tuple[list[tuple[str, object, int]], tuple[float, float], int]:
        """Post one READ per (source rank, kind, staged) group of a plan's `table` (planner
        COLUMNS): over the prepared lists, or over per-request lists where prepared ones would
        be too large. Every read moves whole units. Returns the posted (kind, handle, bytes),
        the seconds spent preparing them as (wall, this thread's CPU) (index arrays and handles:
        the control cost; UCX may move data inside the post itself, which neither includes; on a
        busy host the wall time also holds other processes' turns) and the number of descriptors
        the backend gets
        (after NIXL merges runs contiguous on both sides)."""
        prep, prep_cpu, descriptors = 0.0, 0.0, 0
        t0, c0 = time.perf_counter(), time.thread_time()
        # group key; bincount finds the few present groups in O(reads), unlike a sort
        key = (table[:, SRC] * len(KINDS) + table[:, KIND]) * 2 + table[:, STAGED]
        groups = np.flatnonzero(np.bincount(key)) if len(key) else []
        prep += time.perf_counter() - t0
        prep_cpu += time.thread_time() - c0
        posted = []
        try:
            for g in groups:
                t0, c0 = time.perf_counter(), time.thread_time()
                src_rank, k, staged = int(g) // 2 // len(KINDS), int(g) // 2 % len(KINDS), g % 2
                rows = table[key == g]
                peer = self.peers.get((src_instance, src_rank))
                if peer is None:
                    raise PeerLost(f"{self.name}: no connection to {src_instance} rank {src_rank}")
                kind = KINDS[k]
                unit, local_kind = units[kind], "kda_conv_staging" if staged else kind
                n = -(-rows[:, LEN] // unit)
                nbytes = n * unit
                local = np.array([a for a, _ in self.addresses[local_kind]])[rows[:, LAYER]] + rows[:, DOFF]
                remote = np.array([a for a, _ in peer.info.regions[kind]])[rows[:, LAYER]] + rows[:, SOFF]
                handle = (self._per_request(peer, local, remote, nbytes)
                          if self._too_many(peer, kind, local_kind, unit)
                          else self._prepped(peer, kind, local_kind, unit, rows, n))
                posted.append((kind, handle, int(nbytes.sum())))
                descriptors += 1 + int(np.count_nonzero((local[1:] != local[:-1] + nbytes[:-1])
                                                        | (remote[1:] != remote[:-1] + nbytes[:-1])))
                prep += time.perf_counter() - t0
                prep_cpu += time.thread_time() - c0
                if self.agent.transfer(handle) == "ERR":
                    raise PeerLost(f"{self.name}: posting a read from {peer.info.name} failed")
        except Exception as exc:
            self.release(posted)
            raise _as_peer_lost(exc, self.name) from exc
        return posted, (prep, prep_cpu), descriptors

    def wait(self, posted: list[tuple[str, object, int]], deadline: float,
             cancel=None) -> dict[str, float]:
        """Wait for every posted READ until `deadline` (time.monotonic()) or until the `cancel`
        event is set; returns per-kind seconds. Handles are released whatever happens."""
        start, done = time.monotonic(), {}
        pending = list(range(len(posted)))
        try:
            while pending:
                if cancel is not None and cancel.is_set():
                    raise TransferCancelled(f"{self.name}: cancelled with {len(pending)} "
                                            "reads unconfirmed")
                for i in list(pending):
                    kind, handle, _ = posted[i]
                    state = self.agent.check_xfer_state(handle)
                    if state == "DONE":
                        pending.remove(i)
                        done[kind] = max(done.get(kind, 0.0), time.monotonic() - start)
                    elif state == "ERR":
                        raise PeerLost(f"{self.name}: a {kind} read failed (peer error)")
                if pending:
                    if time.monotonic() > deadline:
                        raise TransferTimeout(
                            f"{self.name}: {len(pending)} of {len(posted)} reads unfinished at the "
                            f"deadline ({time.monotonic() - start:.2f} s after posting)")
                    # a notification's READ (or an inline-moved read) is done within microseconds
                    time.sleep(POLL_S if time.monotonic() - start > SPIN_S else 0)
        except Exception as exc:
            raise _as_peer_lost(exc, self.name) from exc
        finally:
            self.release(posted)
        return done

    def release(self, posted) -> None:
        for _, handle, _ in posted:
            try:
                self.agent.release_xfer_handle(handle)
            except Exception:  # a failed or aborted handle; NIXL already dropped it
                pass

    def close(self) -> None:
        """Drop peers, prepared lists and registrations (idempotent)."""
        if self._registered is None:
            return
        for key in list(self.peers):
            self.forget(*key)
        for handle, _ in self._local_dlists.values():
            self.agent.release_dlist_handle(handle)
        self._local_dlists.clear()
        self.agent.deregister_memory(self._registered)
        self._registered = None


def _merge(addresses: dict[str, list[tuple[int, int]]]) -> list[tuple[int, int]]:
    """Registration intervals: the per-layer regions of one kind's tensor are adjacent, so merge
    them; never across kinds, since two tensors can be adjacent in virtual memory yet separate
    allocations, and CUDA IPC maps only the allocation holding a registration's first byte (a
    read past it failed on the H200 with cuMemcpyDtoDAsync "invalid argument")."""
    out: list[list[int]] = []
    for layers in addresses.values():
        merged: list[list[int]] = []
        for a, n in sorted(layers):
            if merged and merged[-1][0] + merged[-1][1] == a:
                merged[-1][1] += n
            else:
                merged.append([a, n])
        out += merged
    return [(a, n) for a, n in out]


def _as_peer_lost(exc: Exception, who: str) -> Exception:
    """NIXL signals a dead peer with its own exception types; surface them as PeerLost."""
    if isinstance(exc, (PeerLost, TransferTimeout, TransferCancelled)):
        return exc
    text = f"{type(exc).__name__}: {exc}"
    if "DISCONNECT" in text.upper() or "REMOTE" in text.upper() or "BACKEND" in text.upper():
        return PeerLost(f"{who}: peer lost during transfer ({text})")
    return exc
