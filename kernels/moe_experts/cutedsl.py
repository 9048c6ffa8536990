"""CuTe DSL routed experts for decode steps on Hopper (sm_90a): a grouped GEMM with the tokens
in the MMA's N dimension, reading only the experts some token chose.

The op (contract: `pdserve.kernels.moe_experts`) in two launches of one kernel, `stage`:
  gate_up  act[p, i] = silu(x_t . W1_g[i]) * (x_t . W3_g[i])    (t = pair_token[p])
  down     rows[p, n] = act_p . W2_g[n]
A run is one group's pairs [group_end[g-1], group_end[g]) (1..B tokens: each token picks an
expert at most once). At decode batch sizes a run has few tokens, so the op streams weights:
every chosen expert's bytes come from DRAM once, and the MMA is swapped (weights = A, M = 128
weight rows; tokens = B, N = the batch bucket BN) so that 1..64 tokens fill one wgmma N tile.

CTA (j, slot): weight-row tile j (gate_up: gate rows [64j, 64j+64) and the matching up rows;
down: hidden rows [128j, 128j+128)) of runs slot, slot + slots, ... (static grid for CUDA
graphs; `slots` from the launch's CTAs per SM, so few runs (B = 1: 9) and many (B = 64, random
routing: ~120) both fill the GPU without a wave of empty CTAs).
  warp 0 first compacts the non-empty groups into a run list in shared memory (group_end is
  cumulative, G <= 1024 groups);
  warp 4 (producer) streams each run's K tiles: two [64, 64] TMA boxes of weights and
  [BN, 64] rows of src into a `stages`-deep ring. gate_up's src is x itself, every token of
  the step (rows past B zero-filled), so no gathered copy of x is made: column n of the tile
  is token n, stored only when token n has a pair in the run (a [BN] token -> pair map the
  consumers build in shared memory per run). down's src is act, the run's pairs from its
  first one (rows past the run belong to other runs or are out of bounds; never stored);
  warps 0-3 (one warpgroup) run the wgmma m64nBNk16 chain into fp32 accumulators [128, BN],
  then store the run's columns: gate_up rounds as the torch MLP does (bf16 gate and up, bf16
  silu, bf16 product), down rounds once to bf16.
Every output element is written by one thread with a fixed summation order: results are
reproducible run to run. Compiles on a CPU-only machine with CUTE_DSL_ARCH=sm_90a.
"""
from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import BFloat16, Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup

from ..compile import CompileCache, fake_ptrs, gmem_ptr
from ..mla_decode.common import wgmma_c_mn_view
from . import MAX_TOKENS

STAGES = ("gate_up", "down")
WARP = 32
BM = 128              # weight rows of a CTA tile (two 64-row TMA boxes)
BK = 64               # reduction columns of a ring stage (one 128-byte swizzle row)
CONSUMER_WARPS = 4
THREADS = 32 * (CONSUMER_WARPS + 1)
MAX_GROUPS = 32 * 32  # the run list's warp scan: up to 32 groups per lane
BAR_CONSUMERS = 1     # named barrier of the consumer warpgroup (0 is the CTA's)


def token_tile(batch: int) -> int:
    """The MMA N tile for a step of `batch` tokens: the batch rounded up to 8, 16, 32 or 64."""
    return next(n for n in (8, 16, 32, 64) if batch <= n)


@cute.jit
def _group_span(mEnd: cute.Tensor, g: Int32):
    """(first pair, end) of group g from the cumulative group ends."""
    s = Int32(0)
    if g > 0:
        s = mEnd[g - 1]
    return s, mEnd[g]


class MoeExpertsSm90:
    """One stage for fixed (hidden, inter, groups), token tile `bn` and ring depth `stages`."""

    def __init__(self, stage: str, hidden: int, inter: int, groups: int, bn: int,
                 stages: int = 4, pdl: bool = True, shared: bool = False,
                 prefetch_tiles: int = 4):
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
        if not (isinstance(hidden, int) and hidden > 0 and hidden % BM == 0):
            raise ValueError(f"hidden must be a positive multiple of {BM}, got {hidden!r}")
        if not (isinstance(inter, int) and inter > 0 and inter % 64 == 0):
            raise ValueError(f"inter must be a positive multiple of 64, got {inter!r}")
        if not (isinstance(groups, int) and 1 <= groups <= MAX_GROUPS):
            raise ValueError(f"groups must be in 1..{MAX_GROUPS}, got {groups!r}")
        if bn not in (8, 16, 32, 64):
            raise ValueError(f"bn must be 8, 16, 32 or 64, got {bn!r}")
        if not (isinstance(stages, int) and 2 <= stages <= 8):
            raise ValueError(f"stages must be in 2..8, got {stages!r}")
        if not (isinstance(prefetch_tiles, int) and prefetch_tiles >= 0):
            raise ValueError(f"prefetch_tiles must be a non-negative int, got {prefetch_tiles!r}")
        self.stage, self.gate_up, self.pdl = stage, stage == "gate_up", pdl
        self.shared, self.prefetch_tiles = shared, prefetch_tiles
        self.hidden, self.inter, self.G, self.BN, self.stages = hidden, inter, groups, bn, stages
        self.K = hidden if self.gate_up else inter          # reduction length
        self.N = inter if self.gate_up else hidden          # output columns per pair
        self.KT = self.K // BK
        # weight rows of one group in the [G * rows, K] view, in 64-row boxes
        self.boxes_per_group = (2 * inter if self.gate_up else hidden) // 64
        self.m_tiles = inter // 64 if self.gate_up else hidden // BM
        self.gpl = -(-groups // WARP)                        # groups per lane in the scan
        self.tx_bytes = (BM + bn) * BK * 2

    def smem_bytes(self) -> int:
        return self.stages * (BM + self.BN) * BK * 2 + 2048 + 12 * self.G + 4 * self.BN + 1024

    @cute.jit
    def _boxes(self, g: Int32, j: Int32):
        """The two 64-row weight boxes of CTA row j in group g (gate_up: gate rows 64j and up
        rows I + 64j; down: hidden rows 128j and 128j + 64)."""
        box0 = g * self.boxes_per_group + 2 * j
        box1 = box0 + 1
        if cutlass.const_expr(self.gate_up):
            box0 = g * self.boxes_per_group + j
            box1 = box0 + self.inter // 64
        return box0, box1

    @cute.jit
    def _prefetch(self, tma_a: cute.CopyAtom, tAg: cute.Tensor, g: Int32, j: Int32, tiles):
        """Group g's first `tiles` K tiles of CTA row j, DRAM -> L2 (no data dependence)."""
        box0, box1 = self._boxes(g, j)
        for kt in cutlass.range_constexpr(tiles):
            cute.prefetch(tma_a, tAg[None, box0, kt])
            cute.prefetch(tma_a, tAg[None, box1, kt])

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(self, src: cute.Pointer, w: cute.Pointer, group_end: cute.Pointer,
                 pair_token: cute.Pointer, dst: cute.Pointer, T: Int32, P: Int32, slots: Int32,
                 stream):
        """src [T, K] (gate_up: x, T = B tokens; down: act, T = P pairs), dst [P, N]."""
        K, N, G = self.K, self.N, self.G
        rows = G * self.boxes_per_group * 64
        mW = cute.make_tensor(w, cute.make_layout((rows, K), stride=(K, 1)))
        mSrc = cute.make_tensor(src, cute.make_layout((T, K), stride=(K, 1)))
        mDst = cute.make_tensor(dst, cute.make_layout((P, N), stride=(N, 1)))
        mEnd = cute.make_tensor(group_end, cute.make_layout(G))
        mPairToken = cute.make_tensor(pair_token, cute.make_layout(P))

        K_MAJOR = cute.nvgpu.OperandMajorMode.K
        mma = sm90_utils.make_trivial_tiled_mma(BFloat16, BFloat16, K_MAJOR, K_MAJOR, Float32,
                                                (1, 1, 1), (64, self.BN))
        atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, BFloat16)
        st = self.stages
        # the weight ring as TMA writes it (one 64-row box per index, two per stage) and as
        # the MMA reads it ([128, 64] per stage): the same bytes
        sA_box = cute.tile_to_shape(atom, (64, BK, 2 * st), (0, 1, 2))
        sA_mma = cute.tile_to_shape(atom, (BM, BK, st), (0, 1, 2))
        sB_layout = cute.tile_to_shape(atom, (self.BN, BK, st), (0, 1, 2))
        tma_a, mW_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mW, cute.slice_(sA_box, (None, None, 0)), (64, BK))
        tma_b, mSrc_tma = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mSrc, cute.slice_(sB_layout, (None, None, 0)),
            (self.BN, BK))

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, 2 * st]
            runs: cute.struct.Align[cute.struct.MemRange[Int32, 3 * G + 4], 16]
            tok_pair: cute.struct.Align[cute.struct.MemRange[Int32, self.BN], 16]
            sA: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sA_mma)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(sB_layout)], 1024]

        self.kernel(mma, tma_a, mW_tma, tma_b, mSrc_tma, mDst, mEnd, mPairToken, sA_box,
                    sA_mma, sB_layout, SharedStorage).launch(grid=(self.m_tiles, slots, 1),
                                          block=(THREADS, 1, 1), stream=stream,
                                          use_pdl=self.pdl)

    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, mma: cute.TiledMma, tma_a: cute.CopyAtom, mW_tma: cute.Tensor,
               tma_b: cute.CopyAtom, mSrc_tma: cute.Tensor, mDst: cute.Tensor,
               mEnd: cute.Tensor, mPairToken: cute.Tensor, sA_box: cute.ComposedLayout, sA_mma: cute.ComposedLayout,
               sB_layout: cute.ComposedLayout, SharedStorage: cutlass.Constexpr):
        G, BN, KT = self.G, self.BN, self.KT
        tidx, _, _ = cute.arch.thread_idx()
        j, slot, _ = cute.arch.block_idx()
        _, slots, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % WARP

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sRuns = storage.runs.get_tensor(cute.make_layout(3 * G + 4))
        sTokPair = storage.tok_pair.get_tensor(cute.make_layout(BN))
        sA_t = storage.sA.get_tensor(sA_box.outer, swizzle=sA_box.inner)
        gW = cute.local_tile(mW_tma, (64, BK), (None, None))
        tAs, tAg = cpasync.tma_partition(tma_a, 0, cute.make_layout(1),
                                         cute.group_modes(sA_t, 0, 2),
                                         cute.group_modes(gW, 0, 2))

        # PDL. gate_up runs after moe_route, which lets it launch at once: while the router
        # still runs, the CTAs of slot 0 bring the shared expert (the last group; every token
        # chose it) to L2. down needs only act from gate_up: its run list (route's group_end,
        # complete before gate_up let down launch) and its first weight tiles come first.
        if cutlass.const_expr(self.pdl and self.gate_up):
            if cutlass.const_expr(self.shared):
                if slot == 0 and warp == CONSUMER_WARPS:
                    self._prefetch(tma_a, tAg, Int32(G - 1), j, self.KT)
            cute.arch.griddepcontrol_wait()   # route's pairs and group_end
        # ---- the run list: (group, first pair, end) of every non-empty group, ascending ----
        if warp == 0:
            cnt = Int32(0)
            for c in cutlass.range_constexpr(self.gpl):
                g = lane * self.gpl + c
                if g < G:
                    s, e = _group_span(mEnd, g)
                    if e > s:
                        cnt += 1
            incl = cnt
            for off in (1, 2, 4, 8, 16):
                v = cute.arch.shuffle_sync_up(incl, offset=off)
                if lane >= off:
                    incl += v
            pos = incl - cnt
            for c in cutlass.range_constexpr(self.gpl):
                g = lane * self.gpl + c
                if g < G:
                    s, e = _group_span(mEnd, g)
                    if e > s:
                        sRuns[3 * pos] = g
                        sRuns[3 * pos + 1] = s
                        sRuns[3 * pos + 2] = e
                        pos += 1
            if lane == WARP - 1:
                sRuns[3 * G] = incl
        cute.arch.sync_threads()
        n_runs = sRuns[3 * G]
        if cutlass.const_expr(self.pdl and not self.gate_up):
            if slot < n_runs and warp == CONSUMER_WARPS:
                self._prefetch(tma_a, tAg, sRuns[3 * slot], j,
                               min(self.prefetch_tiles, self.KT))
            cute.arch.griddepcontrol_wait()   # gate_up's act

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
            for r in cutlass.range(slot, n_runs, slots, unroll=1):
                box0, box1 = self._boxes(sRuns[3 * r], j)
                first = sRuns[3 * r + 1]                           # down: the run's pairs
                if cutlass.const_expr(self.gate_up):
                    first = Int32(0)                               # gate_up: all of x
                gS = cute.local_tile(cute.domain_offset((first, 0), mSrc_tma), (BN, BK),
                                     (0, None))
                tBs, tBg = cpasync.tma_partition(tma_b, 0, cute.make_layout(1),
                                                 cute.group_modes(sB, 0, 2),
                                                 cute.group_modes(gS, 0, 2))
                for kt in cutlass.range(KT, unroll=1):
                    h = producer.acquire_and_advance()
                    cute.copy(tma_a, tAg[None, box0, kt], tAs[None, 2 * h.index],
                              tma_bar_ptr=h.barrier)
                    cute.copy(tma_a, tAg[None, box1, kt], tAs[None, 2 * h.index + 1],
                              tma_bar_ptr=h.barrier)
                    cute.copy(tma_b, tBg[None, kt], tBs[None, h.index], tma_bar_ptr=h.barrier)
            if cutlass.const_expr(self.pdl):
                # every load issued: the next kernel may launch and start its own set-up
                cute.arch.griddepcontrol_launch_dependents()
        else:
            # ---------------- consumer warpgroup ----------------
            thr = mma.get_slice(tidx)
            tCrA = thr.make_fragment_A(thr.partition_A(sA))      # (MMA, 2, 4, stages)
            tCrB = thr.make_fragment_B(thr.partition_B(sB))      # (MMA, 1, 4, stages)
            acc = thr.make_fragment_C(thr.partition_shape_C((BM, BN)))
            acc_mn = wgmma_c_mn_view(acc)
            c_mn = wgmma_c_mn_view(thr.partition_C(cute.make_identity_tensor((BM, BN))))
            n_rows = cute.size(acc_mn, mode=[0])                 # 4: 2 rows x 2 M blocks
            n_cols = cute.size(acc_mn, mode=[1])
            mma.set(warpgroup.Field.ACCUMULATE, True)
            for r in cutlass.range(slot, n_runs, slots, unroll=1):
                start = sRuns[3 * r + 1]
                nt = sRuns[3 * r + 2] - start
                if cutlass.const_expr(self.gate_up):
                    # token -> pair of this run (-1: no pair); built while the ring fills
                    if tidx < BN:
                        sTokPair[tidx] = Int32(-1)
                    cute.arch.barrier(barrier_id=BAR_CONSUMERS, number_of_threads=128)
                    if tidx < nt:
                        sTokPair[mPairToken[start + tidx]] = start + tidx
                    cute.arch.barrier(barrier_id=BAR_CONSUMERS, number_of_threads=128)
                acc.fill(0.0)
                for kt in cutlass.range(KT, unroll=1):
                    h = consumer.wait_and_advance()
                    warpgroup.fence()
                    for kb in cutlass.range_constexpr(BK // 16):
                        cute.gemm(mma, acc, tCrA[None, None, kb, h.index],
                                  tCrB[None, None, kb, h.index], acc)
                    warpgroup.commit_group()
                    warpgroup.wait_group(0)
                    h.release()
                # store this run's columns (tokens); rows of the tile are weight rows
                if cutlass.const_expr(self.gate_up):
                    for ri in cutlass.range_constexpr(n_rows // 2):
                        for c in cutlass.range_constexpr(n_cols):
                            m, n = c_mn[ri, c][0], c_mn[ri, c][1]
                            p = sTokPair[n]
                            if p >= 0:
                                gate = acc_mn[ri, c].to(BFloat16).to(Float32)
                                up = acc_mn[ri + n_rows // 2, c].to(BFloat16).to(Float32)
                                s = (gate / (1.0 + cute.math.exp(-gate))).to(BFloat16)
                                mDst[p, 64 * j + m] = (s.to(Float32) * up).to(BFloat16)
                    # the map is rebuilt for the next run only after every thread stored
                    cute.arch.barrier(barrier_id=BAR_CONSUMERS, number_of_threads=128)
                else:
                    for ri in cutlass.range_constexpr(n_rows):
                        for c in cutlass.range_constexpr(n_cols):
                            m, n = c_mn[ri, c][0], c_mn[ri, c][1]
                            if n < nt:
                                mDst[start + n, BM * j + m] = acc_mn[ri, c].to(BFloat16)


# ----------------------------------------------------------------------------------------------
_cache = CompileCache()
# src, w, group_end, pair_token, dst
_SPECS = ((BFloat16, 16), (BFloat16, 16), (Int32, 4), (Int32, 4), (BFloat16, 16))
_sm_counts: dict[int, int] = {}


def compile_variant(stage: str, hidden: int, inter: int, groups: int, bn: int,
                    stages: int = 4, pdl: bool = True, shared: bool = False,
                    prefetch_tiles: int = 4, dump_dir: str | None = None):
    """Compile (or fetch) one stage; works without a GPU under CUTE_DSL_ARCH=sm_90a. With
    `dump_dir` the PTX and cubin are kept there (`.artifacts`), bypassing the cache."""
    import cuda.bindings.driver as cuda
    key = (stage, hidden, inter, groups, bn, stages, pdl, shared, prefetch_tiles)

    def build(**opts):
        return cute.compile(MoeExpertsSm90(*key), *fake_ptrs(_SPECS), Int32(64), Int32(64),
                            Int32(1), cuda.CUstream(0), **opts)
    return _cache.get(key, build, dump_dir)


def run_slots(runs_max: int, m_tiles: int, sms: int, ctas_per_sm: int) -> int:
    """Grid rows of runs: enough CTAs for `ctas_per_sm` on every SM, at most one per run."""
    return max(1, min(runs_max, math.ceil(ctas_per_sm * sms / m_tiles)))


def launch(x, w13, w2, pair_token, group_end, shared: bool = False, stages: int = 4,
           ctas_per_sm: int = 2, pdl: bool = True, prefetch_tiles: int = 4):
    """Both stages on the current torch stream (arguments validated by the guard); `shared`:
    the last group is a shared expert. Tuning: `stages` (ring depth), `ctas_per_sm` (grid rows
    of runs), `pdl` (programmatic dependent launch: gate_up starts while moe_route runs and
    brings the shared expert to L2; down's set-up and its first `prefetch_tiles` weight tiles
    overlap gate_up's tail)."""
    import cuda.bindings.driver as cuda
    import torch
    B, H = x.shape
    G, I = w2.shape[0], w2.shape[2]
    P = pair_token.shape[0]
    dev = x.device
    sms = _sm_counts.get(dev.index)
    if sms is None:
        sms = _sm_counts[dev.index] = torch.cuda.get_device_properties(dev).multi_processor_count
    bn = token_tile(B)
    act = torch.empty(P, I, dtype=x.dtype, device=dev)
    rows = torch.empty(P, H, dtype=x.dtype, device=dev)
    stream = cuda.CUstream(torch.cuda.current_stream(dev).cuda_stream)
    for stage, src, w, dst in (("gate_up", x, w13, act), ("down", act, w2, rows)):
        fn = compile_variant(stage, H, I, G, bn, stages, pdl, shared, prefetch_tiles)
        tensors = (src, w, group_end, pair_token, dst)
        ptrs = [gmem_ptr(dt, t.data_ptr(), al) for t, (dt, al) in zip(tensors, _SPECS)]
        m_tiles = I // 64 if stage == "gate_up" else H // BM
        slots = run_slots(min(P, G), m_tiles, sms, ctas_per_sm)
        fn(*ptrs, Int32(src.shape[0]), Int32(P), Int32(slots), stream)
    return rows


__all__ = ["MoeExpertsSm90", "compile_variant", "launch", "run_slots", "token_tile",
           "MAX_TOKENS"]
