"""CuTe DSL skinny GEMM for decode steps on Hopper (sm_90a): y = x @ W^T with a few tokens,
streaming W at the copy rate.

The op (contract: `pdserve.kernels.decode_linear`) is memory bound at B <= 64: every weight
byte is read once and used by B tokens. So the MMA is swapped (weights = A, M = BM weight rows;
tokens = B, N = the batch bucket BN, tokens past B zero-filled by TMA) and K is split so that
the grid (m_tiles x splits) puts ~1 CTA on every SM, each streaming its [BM, K / splits] slab.

CTA (j, s): weight rows [BM j, BM j + BM) (the last tile's rows past N zero-filled by TMA,
never stored), K tiles [s kps, (s + 1) kps) of BK = 64 columns (kps = K / (64 splits)).
  warp 4 (producer) streams the K tiles: BM / 64 [64, 64] TMA boxes of W and a [BN, 64] box of
  x per stage of a `stages`-deep ring. With PDL the first ring's worth of W is requested before
  griddepcontrol.wait (W does not depend on the previous kernel; x does);
  warps 0-3 (one warpgroup) run the wgmma m64nBNk16 chain into fp32 accumulators [BM, BN] and
  store them as split s's partial tile in the workspace, in register order (element i of
  thread t at [i, t]: coalesced, and the reducing CTA reads it with the same thread mapping).
  Then one thread adds 1 to the m-tile's arrival counter (fence.acq_rel.gpu + atom.acq_rel.gpu,
  as CUTLASS's split-K semaphore releases; the warpgroup barrier orders the CTA's stores before
  it). The CTA that sees splits - 1 arrivals before its own is the last: it resets the counter
  to 0 (the next launch, or graph replay, starts from 0), copies the partials L2 -> shared with
  cp.async (many in flight, no registers held) into its drained ring, sums them in split order
  0..splits-1, rounds to bf16 and writes y. With one split there is no workspace: y directly.
The sum order is fixed whatever the arrival order: results are bit-identical run to run.
Compiles on a CPU-only machine with CUTE_DSL_ARCH=sm_90a.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup

from ..compile import CompileCache, fake_ptrs, gmem_ptr
from . import MAX_TOKENS, token_tile

BK = 64               # reduction columns of a ring stage (one 128-byte swizzle row)
CONSUMER_WARPS = 4
CONSUMERS = 32 * CONSUMER_WARPS
THREADS = CONSUMERS + 32
BAR_CONSUMERS = 1     # named barrier of the consumer warpgroup (0 is the CTA's)
BMS = (64, 128)
# Defaults measured on the H200 (benchmarks/decode_linear.py --sweep): 64-row tiles (more
# m-tiles, fewer splits, less to reduce), a 6-deep ring, ~1 CTA per SM, which leaves room on
# every SM for the next kernel's CTAs to start streaming their weights under PDL.
DEFAULT_BM = 64
DEFAULT_STAGES = 6
CTAS_PER_SM = 1


class DecodeLinearSm90:
    """y [B, N] = x [B, K] @ W [N, K]^T for fixed (N, K), weight tile `bm`, token tile `bn`,
    `splits` K chunks, ring depth `stages` and x's row stride `ldx` (elements; None: K, dense
    rows)."""

    def __init__(self, n: int, k: int, bm: int, bn: int, splits: int,
                 stages: int = DEFAULT_STAGES, pdl: bool = True, ldx: int | None = None):
        if not (isinstance(n, int) and n > 0):
            raise ValueError(f"n must be a positive int, got {n!r}")
        if bm not in BMS:
            raise ValueError(f"bm must be one of {BMS}, got {bm!r}")
        if bn not in (8, 16, 32, 64):
            raise ValueError(f"bn must be 8, 16, 32 or 64, got {bn!r}")
        if not (isinstance(splits, int) and splits >= 1):
            raise ValueError(f"splits must be a positive int, got {splits!r}")
        if not (isinstance(k, int) and k > 0 and k % (BK * splits) == 0):
            raise ValueError(f"k must be a positive multiple of {BK} * splits = "
                             f"{BK * splits}, got {k!r}")
        if not (isinstance(stages, int) and 2 <= stages <= 8):
            raise ValueError(f"stages must be in 2..8, got {stages!r}")
        ldx = k if ldx is None else ldx
        if not (isinstance(ldx, int) and ldx >= k and ldx % 8 == 0):
            raise ValueError(f"ldx must be an int >= k = {k} and a multiple of 8 (16-byte rows "
                             f"for TMA), got {ldx!r}")
        self.N, self.K, self.BM, self.BN = n, k, bm, bn
        self.splits, self.stages, self.pdl = splits, stages, pdl
        self.kps = k // (BK * splits)                      # K tiles per split
        self.ldx = ldx
        self.m_tiles = -(-n // bm)
        self.boxes = bm // 64
        self.nv = bm * bn // CONSUMERS                     # accumulators per consumer thread
        self.tx_bytes = (bm + bn) * BK * 2
        # splits whose partials the last CTA copies at once: the largest divisor of splits
        # whose partial tiles fit the weight ring
        ring_words = stages * bm * BK // 2
        self.red_chunk = max(d for d in range(1, splits + 1)
                             if splits % d == 0 and d * bm * bn <= ring_words)

    def workspace_words(self) -> int:
        """fp32 words of the partial tiles, [m_tiles, splits, nv / 4, 128, 4] (none for one
        split)."""
        return 0 if self.splits == 1 else self.m_tiles * self.splits * self.nv * CONSUMERS

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(self, x: cute.Pointer, w: cute.Pointer, y: cute.Pointer, ws: cute.Pointer,
                 counters: cute.Pointer, B: Int32, stream):
        N, K, S, nv = self.N, self.K, self.splits, self.nv
        mW = cute.make_tensor(w, cute.make_layout((N, K), stride=(K, 1)))
        mX = cute.make_tensor(x, cute.make_layout((B, K), stride=(self.ldx, 1)))
        mY = cute.make_tensor(y, cute.make_layout((B, N), stride=(N, 1)))
        # a split's partial tile in register order: thread t's accumulators 4i..4i+3 are 16
        # contiguous bytes at [i, t] (vector stores and loads, coalesced across threads)
        mWs = cute.make_tensor(ws, cute.make_layout(
            (self.m_tiles, S, nv // 4, CONSUMERS, 4),
            stride=(S * nv * CONSUMERS, nv * CONSUMERS, 4 * CONSUMERS, 4, 1)))
        mCnt = cute.make_tensor(counters, cute.make_layout(self.m_tiles))

        K_MAJOR = cute.nvgpu.OperandMajorMode.K
        mma = sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, K_MAJOR, K_MAJOR, Float32,
                                                (1, 1, 1), (64, self.BN))
        atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, BFloat16)
        st = self.stages
        # the weight ring as TMA writes it (one 64-row box per index, BM / 64 per stage) and as
        # the MMA reads it ([BM, 64] per stage): the same bytes
        sA_box = cute.tile_to_shape(atom, (64, BK, self.boxes * st), (0, 1, 2))
        sA_mma = cute.tile_to_shape(atom, (self.BM, BK, st), (0, 1, 2))
        sB_layout = cute.tile_to_shape(atom, (self.BN, BK, st), (0, 1, 2))
        tma_a, mW_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mW, cute.slice_(sA_box, (None, None, 0)), (64, BK))
        tma_b, mX_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mX, cute.slice_(sB_layout, (None, None, 0)),
            (self.BN, BK))

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, 2 * st]
            last: cute.struct.Align[cute.struct.MemRange[Int32, 4], 16]
            sA: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sA_mma)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sB_layout)], 1024]

        red_copy = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                       Float32, num_bits_per_copy=128)
        self.kernel(mma, tma_a, mW_tma, tma_b, mX_tma, mY, mWs, mCnt, sA_box, sA_mma,
                    sB_layout, red_copy, SharedStorage).launch(grid=(self.m_tiles, S, 1),
                                                     block=(THREADS, 1, 1), stream=stream,
                                                     use_pdl=self.pdl)

    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, mma: cute.TiledMma, tma_a: cute.CopyAtom, mW_tma: cute.Tensor,
               tma_b: cute.CopyAtom, mX_tma: cute.Tensor, mY: cute.Tensor, mWs: cute.Tensor,
               mCnt: cute.Tensor, sA_box: cute.ComposedLayout, sA_mma: cute.ComposedLayout,
               sB_layout: cute.ComposedLayout, red_copy: cute.CopyAtom,
               SharedStorage: cutlass.Constexpr):
        BM, BN, S, kps, nv = self.BM, self.BN, self.splits, self.kps, self.nv
        tidx, _, _ = cute.arch.thread_idx()
        j, split, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sLast = storage.last.get_tensor(cute.make_layout(4))
        sA = storage.sA.get_tensor(sA_mma.outer, swizzle=sA_mma.inner)
        sB = storage.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
        producer, consumer = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, CONSUMER_WARPS),
            tx_count=self.tx_bytes,
        ).make_participants()

        if warp == CONSUMER_WARPS:
            # ---------------- producer ----------------
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
            sA_t = storage.sA.get_tensor(sA_box.outer, swizzle=sA_box.inner)
            gW = cute.local_tile(mW_tma, (64, BK), (None, None))
            tAs, tAg = cpasync.tma_partition(tma_a, 0, cute.make_layout(1),
                                             cute.group_modes(sA_t, 0, 2),
                                             cute.group_modes(gW, 0, 2))
            gX = cute.local_tile(mX_tma, (BN, BK), (0, None))
            tBs, tBg = cpasync.tma_partition(tma_b, 0, cute.make_layout(1),
                                             cute.group_modes(sB, 0, 2),
                                             cute.group_modes(gX, 0, 2))
            k0 = split * kps
            # the first ring's W tiles do not depend on the previous kernel: request them
            # before waiting for it (PDL), x after
            early = min(self.stages, kps)
            handles = []
            for kt in cutlass.range_constexpr(early):
                h = producer.acquire_and_advance()
                for b in cutlass.range_constexpr(self.boxes):
                    cute.copy(tma_a, tAg[None, self.boxes * j + b, k0 + kt],
                              tAs[None, self.boxes * h.index + b], tma_bar_ptr=h.barrier)
                handles.append(h)
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_wait()     # x is the previous kernel's output
            for kt in cutlass.range_constexpr(early):
                h = handles[kt]
                cute.copy(tma_b, tBg[None, k0 + kt], tBs[None, h.index], tma_bar_ptr=h.barrier)
            for kt in cutlass.range(early, kps, unroll=1):
                h = producer.acquire_and_advance()
                for b in cutlass.range_constexpr(self.boxes):
                    cute.copy(tma_a, tAg[None, self.boxes * j + b, k0 + kt],
                              tAs[None, self.boxes * h.index + b], tma_bar_ptr=h.barrier)
                cute.copy(tma_b, tBg[None, k0 + kt], tBs[None, h.index], tma_bar_ptr=h.barrier)
            if cutlass.const_expr(self.pdl):
                # every load issued: the next kernel may launch and start its own set-up
                cute.arch.griddepcontrol_launch_dependents()
        else:
            # ---------------- consumer warpgroup ----------------
            if cutlass.const_expr(self.pdl):
                # the workspace, counters and y may still be in use by the previous kernel
                cute.arch.griddepcontrol_wait()
            thr = mma.get_slice(tidx)
            tCrA = thr.make_fragment_A(thr.partition_A(sA))      # (MMA, BM/64, 4, stages)
            tCrB = thr.make_fragment_B(thr.partition_B(sB))      # (MMA, 1, 4, stages)
            acc = thr.make_fragment_C(thr.partition_shape_C((BM, BN)))
            coord = thr.partition_C(cute.make_identity_tensor((BM, BN)))
            mma.set(warpgroup.Field.ACCUMULATE, True)
            acc.fill(0.0)
            for kt in cutlass.range(kps, unroll=1):
                h = consumer.wait_and_advance()
                warpgroup.fence()
                for kb in cutlass.range_constexpr(BK // 16):
                    cute.gemm(mma, acc, tCrA[None, None, kb, h.index],
                              tCrB[None, None, kb, h.index], acc)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                h.release()

            B, N = mY.shape
            if cutlass.const_expr(S == 1):
                self._store(mY, acc, coord, j, B, N)          # no partials to sum
            else:
                # this split's partial tile, then its arrival
                for i in cutlass.range_constexpr(nv):
                    mWs[j, split, i // 4, tidx, i % 4] = acc[i]
                cute.arch.barrier(barrier_id=BAR_CONSUMERS, number_of_threads=CONSUMERS)
                if tidx == 0:
                    cute.arch.fence_acq_rel_gpu()      # release the warpgroup's partial stores
                    arrived = cute.arch.atomic_add(mCnt.iterator + j, Int32(1),
                                                   sem="acq_rel", scope="gpu")
                    last = Int32(0)
                    if arrived == S - 1:
                        cute.arch.fence_acq_rel_gpu()  # acquire the other splits' partials
                        mCnt[j] = Int32(0)             # all arrived: ready for the next launch
                        last = Int32(1)
                    sLast[0] = last
                cute.arch.barrier(barrier_id=BAR_CONSUMERS, number_of_threads=CONSUMERS)
                if sLast[0] == 1:
                    # every partial, this split's too (its own stores are visible to it), in
                    # split order. cp.async (L2 -> shared, 16 bytes a copy) brings `red_chunk`
                    # splits at once into the drained weight ring, without registers to hold
                    # them; each thread copies and reads back only its own words
                    R = self.red_chunk
                    sRed = cute.make_tensor(
                        cute.recast_ptr(storage.sA.data_ptr(), dtype=Float32),
                        cute.make_layout((R, nv // 4, CONSUMERS, 4),
                                         stride=(nv * CONSUMERS, 4 * CONSUMERS, 4, 1)))
                    total = cute.make_fragment_like(acc)
                    total.fill(0.0)
                    for c in cutlass.range(S // R, unroll=1):
                        for u in cutlass.range_constexpr(R):
                            for i4 in cutlass.range_constexpr(nv // 4):
                                cute.copy(red_copy, mWs[j, c * R + u, i4, tidx, None],
                                          sRed[u, i4, tidx, None])
                        cute.arch.cp_async_commit_group()
                        cute.arch.cp_async_wait_group(0)
                        for u in cutlass.range_constexpr(R):
                            for i in cutlass.range_constexpr(nv):
                                total[i] = total[i] + sRed[u, i // 4, tidx, i % 4]
                    self._store(mY, total, coord, j, B, N)

    @cute.jit
    def _store(self, mY: cute.Tensor, vals: cute.Tensor, coord: cute.Tensor, j: Int32, B: Int32,
               N: Int32):
        """y[token, row] = vals rounded to bf16 for the tile's rows < N and tokens < B."""
        for i in cutlass.range_constexpr(self.nv):
            m, n = coord[i][0], coord[i][1]
            row = self.BM * j + m
            if n < B and row < N:
                mY[n, row] = vals[i].to(BFloat16)


# ----------------------------------------------------------------------------------------------
_cache = CompileCache()
# x, w, y, workspace, counters
_SPECS = ((BFloat16, 16), (BFloat16, 16), (BFloat16, 16), (Float32, 16), (Int32, 4))
_sm_counts: dict[int, int] = {}
_scratch: dict[tuple, tuple] = {}


def compile_variant(n: int, k: int, bm: int, bn: int, splits: int,
                    stages: int = DEFAULT_STAGES, pdl: bool = True, ldx: int | None = None,
                    dump_dir: str | None = None):
    """Compile (or fetch) one variant; works without a GPU under CUTE_DSL_ARCH=sm_90a. With
    `dump_dir` the PTX and cubin are kept there (`.artifacts`), bypassing the cache."""
    import cuda.bindings.driver as cuda
    key = (n, k, bm, bn, splits, stages, pdl, k if ldx is None else ldx)

    def build(**opts):
        return cute.compile(DecodeLinearSm90(*key), *fake_ptrs(_SPECS), Int32(bn),
                            cuda.CUstream(0), **opts)
    return _cache.get(key, build, dump_dir)


def default_splits(n: int, k: int, bm: int, sms: int, ctas_per_sm: int = CTAS_PER_SM) -> int:
    """The divisor of K / 64 whose grid (m_tiles x splits) is nearest `ctas_per_sm` CTAs per SM
    (the smaller one on a tie)."""
    kt = k // BK
    m_tiles = -(-n // bm)
    target = ctas_per_sm * sms
    return min((d for d in range(1, kt + 1) if kt % d == 0),
               key=lambda d: (abs(m_tiles * d - target), d))


def _scratch_for(dev, n: int, k: int, bm: int, bn: int, splits: int):
    """The workspace and arrival counters of one variant on `dev`: allocated once, reused by
    every launch (static addresses for CUDA graphs; the kernel leaves the counters at 0)."""
    import torch
    key = (dev.index, n, k, bm, bn, splits)
    got = _scratch.get(key)
    if got is None:
        if torch.cuda.is_current_stream_capturing():
            # zeroed counters made inside a capture would be zero only in its replays
            raise RuntimeError(f"decode_linear: first call of variant {key[1:]} inside a CUDA "
                               "graph capture; run it once before capturing")
        shape = DecodeLinearSm90(n, k, bm, bn, splits)
        got = _scratch[key] = (
            torch.empty(max(shape.workspace_words(), 4), dtype=torch.float32, device=dev),
            torch.zeros(shape.m_tiles, dtype=torch.int32, device=dev))
    return got


def sm_count(dev) -> int:
    import torch
    sms = _sm_counts.get(dev.index)
    if sms is None:
        sms = _sm_counts[dev.index] = torch.cuda.get_device_properties(dev).multi_processor_count
    return sms


def launch(x, w, *, bm: int = DEFAULT_BM, splits: int | None = None,
           stages: int = DEFAULT_STAGES, pdl: bool = True, ctas_per_sm: int = CTAS_PER_SM):
    """y [B, N] on the current torch stream (arguments validated by the guard; x's rows may be
    strided). Tuning: `bm` (weight rows per CTA), `splits` (K chunks, default ~`ctas_per_sm`
    CTAs per SM), `stages` (ring depth), `pdl` (programmatic dependent launch).
    Launches of one variant share a workspace: run them on one stream at a time."""
    import cuda.bindings.driver as cuda
    import torch
    B, K = x.shape
    N = w.shape[0]
    if not 1 <= B <= MAX_TOKENS:
        raise ValueError(f"batch {B} not in 1..{MAX_TOKENS}")
    dev = x.device
    bn = token_tile(B)
    splits = splits or default_splits(N, K, bm, sm_count(dev), ctas_per_sm)
    y = torch.empty(B, N, dtype=x.dtype, device=dev)
    ws, counters = _scratch_for(dev, N, K, bm, bn, splits)
    # one row's stride is irrelevant: dense, so B = 1 calls of every slice share a variant
    ldx = x.stride(0) if B > 1 else K
    fn = compile_variant(N, K, bm, bn, splits, stages, pdl, ldx)
    tensors = (x, w, y, ws, counters)
    ptrs = [gmem_ptr(dt, t.data_ptr(), al) for t, (dt, al) in zip(tensors, _SPECS)]
    fn(*ptrs, Int32(B), cuda.CUstream(torch.cuda.current_stream(dev).cuda_stream))
    return y


__all__ = ["DecodeLinearSm90", "compile_variant", "default_splits", "launch", "sm_count",
           "DEFAULT_BM", "DEFAULT_STAGES", "CTAS_PER_SM"]
