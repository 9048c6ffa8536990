"""CuTe DSL routed-experts MoE for the decode step on Hopper (sm_90a): reads only the chosen experts.

The op (contract: `pdserve.kernels.moe_experts`): pairs (token, expert) grouped into runs, one run
per expert; for every pair a = bf16(silu(W1 x) * (W3 x)), out[t, slot] = weight * (W2 a).

Why this shape: at decode batch sizes an expert sees 1..8 tokens (the shared expert all B), so the
op is a weight stream: every chosen expert's 14 MB (Kimi-Linear shapes) must come from DRAM once,
and the FLOPs per weight byte are at most a few. SIMT fp32 FMAs on CUDA cores keep up with HBM
(no MMA), and the work is split over weight rows so that even B = 1 (9 runs) fills every SM.

Two launches, no host sync, static grids (CUDA-graph capturable):
  gate/up  grid (R, ceil(I / rows_a)): CTA (r, n) owns paired rows [n*rows_a, (n+1)*rows_a) of
           expert run_expert[r]: gate row i (w13 row i) and up row i (w13 row I+i). A warp owns
           rows_a / warps paired rows; its lanes stride over Hd with 16-byte loads, every weight
           load of the CTA is issued up front (held as bf16 in registers), then the run's tokens
           are processed in chunks of tc: their x rows are gathered into shared memory (bf16),
           each lane multiplies its weight vectors with every token of the chunk (fp32 FMA, one
           accumulator per token and row), warp-shuffle butterflies reduce, and one lane per token
           writes act[p, i] = bf16(silu(g) * u).
  down     grid (R, ceil(Hd / rows_b)): the same over w2 rows (length I), the chunk's act rows
           staged in shared memory; writes out[t, slot, row] = weight * dot (fp32).
  An empty run's CTAs exit at once (padding runs cost one launch slot each). Each (t, slot) is
  written by exactly one pair and every sum has a fixed order: results are bit-reproducible.
  Weight reads stay at one DRAM pass regardless of tokens per run; x / act rows are re-read
  from L2 by every CTA of the run (a fraction tokens / (2 rows) of the weight bytes).

Defaults (tuning arguments, part of the compile cache key): gate/up 8 paired rows per CTA, one
per warp of 256 threads (Kimi: 9 x 16-byte loads per lane per row, 128 CTAs per run, B = 1 gives
1152 CTAs over 132 SMs); down 32 rows per CTA, 4 per warp of 256 threads (4 loads per lane per
row, 72 CTAs per run, 648 at B = 1); tc = 8 tokens per chunk (shared memory 8 x Hd bf16 = 36 KB
for gate/up). Hd and I are compile-time constants (register arrays, unrolled loops); B, P, R,
the slot count and the x row stride are run-time values. Compiles on a CPU-only machine with
CUTE_DSL_ARCH=sm_90a.
"""
from __future__ import annotations

import math
import threading
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

VEC = 8           # bf16 elements per 16-byte vector
WARP = 32
STAGES = ("gate_up", "down")

ROWS_A = 8        # paired (gate, up) rows per gate/up CTA
ROWS_B = 32       # w2 rows per down CTA
TC = 8            # tokens per chunk
THREADS = 256


class MoeExpertRowsSm90:
    """One stage of the op (gate_up or down) for fixed (hidden, inter) and tuning choices.

    rows: weight rows per CTA (gate_up: paired gate/up rows), a multiple of threads / 32 (each
    warp owns rows / warps of them); tc: tokens per chunk (1..32); threads: CTA size."""

    def __init__(self, stage: str, hidden: int, inter: int, rows: int, tc: int = TC,
                 threads: int = THREADS):
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
        for name, v in (("hidden", hidden), ("inter", inter)):
            if not (isinstance(v, int) and v > 0 and v % VEC == 0):
                raise ValueError(f"{name} must be a positive multiple of {VEC}, got {v!r}")
        if not (isinstance(threads, int) and threads % WARP == 0 and WARP <= threads <= 1024):
            raise ValueError(f"threads must be a multiple of {WARP} in [{WARP}, 1024], got {threads!r}")
        warps = threads // WARP
        if not (isinstance(rows, int) and rows > 0 and rows % warps == 0):
            raise ValueError(f"rows must be a positive multiple of threads/32 = {warps}, got {rows!r}")
        if not (isinstance(tc, int) and 1 <= tc <= WARP):
            raise ValueError(f"tc must be an int in 1..{WARP}, got {tc!r}")
        self.stage = stage
        self.gate_up = stage == "gate_up"
        self.hidden, self.inter = hidden, inter
        self.K = hidden if self.gate_up else inter      # reduction length (a weight row)
        self.N = inter if self.gate_up else hidden      # output rows per expert
        self.NS = 2 if self.gate_up else 1              # weight row sets (gate, up) / (down)
        self.ROWS, self.TC, self.THREADS = rows, tc, threads
        self.WARPS = warps
        self.RPW = rows // warps                        # rows per warp
        self.NV = self.K // VEC                         # 16-byte vectors per row
        self.NVL = -(-self.NV // WARP)                  # vectors per lane per row
        self.TAIL = self.NV % WARP != 0                 # the last lane pass is partial
        self.tiles = -(-self.N // rows)
        self.STAGE_ITERS = -(-(tc * self.NV) // threads)

    def smem_bytes(self) -> int:
        return self.TC * self.K * 2 + 64

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        src: cute.Pointer, w: cute.Pointer, pair_token: cute.Pointer, run_expert: cute.Pointer,
        run_start: cute.Pointer, dst: cute.Pointer, R: Int32, n_src: Int32, P: Int32, ss: Int32,
        stream,
    ):
        self.kernel(src, w, pair_token, run_expert, run_start, dst, R, n_src, P, ss).launch(
            grid=[R, self.tiles, 1], block=[self.THREADS, 1, 1], stream=stream)

    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        src: cute.Pointer, w: cute.Pointer, pair_token: cute.Pointer, run_expert: cute.Pointer,
        run_start: cute.Pointer, dst: cute.Pointer, R: Int32, n_src: Int32, P: Int32, ss: Int32,
    ):
        K, N, NS, TCn, RPW, NV, NVL = self.K, self.N, self.NS, self.TC, self.RPW, self.NV, self.NVL
        tidx, _, _ = cute.arch.thread_idx()
        r, n, _ = cute.arch.block_idx()
        lane = tidx % WARP
        warp = tidx // WARP

        smem = cutlass.memory.SmemAllocator()
        sX = smem.allocate_tensor(BFloat16, cute.make_layout((TCn, K), stride=(K, 1)), 16)

        mStart = cute.make_tensor(run_start, cute.make_layout(R + 1))
        start = mStart[r]
        end = mStart[r + 1]
        if start < end:
            e = cute.make_tensor(run_expert, cute.make_layout(R))[r]
            # expert e's weight block: [NS * N, K] rows (gate_up: gate rows then up rows)
            mW = cute.make_tensor(w + Int64(e) * Int64(NS * N * K),
                                  cute.make_layout((NS * N, K), stride=(K, 1)))
            row0 = n * self.ROWS + warp * RPW

            mTok = cute.make_tensor(pair_token, cute.make_layout(P))
            src_rows = P
            if cutlass.const_expr(self.gate_up):
                src_rows = n_src
            mSrc = cute.make_tensor(
                src, cute.make_layout((src_rows, K), stride=(ss * VEC, 1)))   # ss: row stride in vectors
            rF = cute.make_rmem_tensor(cute.make_layout((VEC, NS, RPW)), Float32)
            acc = cute.make_rmem_tensor(cute.make_layout((TCn, NS, RPW)), Float32)
            rV = cute.make_rmem_tensor(cute.make_layout(VEC), BFloat16)

            # ---- the run's tokens, tc at a time ----------------------------------------------
            for c0 in range(start, end, TCn):
                nt = end - c0
                if nt > TCn:
                    nt = TCn
                # every weight load of this warp, issued before any use (the first chunk reads
                # DRAM, later chunks of a long run re-read L2: weights held across chunks would
                # be converted to fp32 once, hoisted, and double the registers)
                rW = cute.make_rmem_tensor(
                    cute.make_layout((VEC, NVL, NS, RPW), stride=(1, VEC, VEC * NVL, VEC * NVL * NS)),
                    BFloat16)
                if cutlass.const_expr(self.TAIL):
                    rW.fill(0.0)       # lanes past the row end multiply zeros
                for q in cutlass.range_constexpr(RPW):
                    row = row0 + q
                    if row < N:
                        for h in cutlass.range_constexpr(NS):
                            for j in cutlass.range_constexpr(NVL):
                                v = j * WARP + lane
                                if cutlass.const_expr(not self.TAIL or j < NVL - 1):
                                    cute.autovec_copy(
                                        cute.make_tensor(mW[h * N + row, None].iterator + v * VEC,
                                                         cute.make_layout(VEC)),
                                        rW[None, j, h, q])
                                else:
                                    if v < NV:
                                        cute.autovec_copy(
                                            cute.make_tensor(mW[h * N + row, None].iterator + v * VEC,
                                                             cute.make_layout(VEC)),
                                            rW[None, j, h, q])

                cute.arch.sync_threads()          # the previous chunk's readers are done
                # stage the chunk's source rows (gate_up: x[token]; down: act[pair]) in smem
                for it in cutlass.range_constexpr(self.STAGE_ITERS):
                    idx = it * self.THREADS + tidx
                    c = idx // NV
                    vv = idx - c * NV
                    if c < nt:
                        srow = c0 + c
                        if cutlass.const_expr(self.gate_up):
                            srow = mTok[c0 + c]
                        cute.autovec_copy(
                            cute.make_tensor(mSrc[srow, None].iterator + vv * VEC,
                                             cute.make_layout(VEC)), rV)
                        cute.autovec_copy(
                            rV, cute.make_tensor(sX.iterator + c * K + vv * VEC,
                                                 cute.make_layout(VEC)))
                cute.arch.sync_threads()

                acc.fill(0.0)
                for j in cutlass.range_constexpr(NVL):
                    v = j * WARP + lane
                    if cutlass.const_expr(self.TAIL and j == NVL - 1):
                        v = cutlass.min(v, NV - 1)    # in-bounds smem; its weights are zeros
                    for q in cutlass.range_constexpr(RPW):
                        for h in cutlass.range_constexpr(NS):
                            rF[None, h, q].store(rW[None, j, h, q].load().to(Float32))
                    for c in cutlass.range_constexpr(TCn):
                        if c < nt:
                            cute.autovec_copy(
                                cute.make_tensor(sX.iterator + c * K + v * VEC,
                                                 cute.make_layout(VEC)), rV)
                            xf = rV.load().to(Float32)
                            for q in cutlass.range_constexpr(RPW):
                                for h in cutlass.range_constexpr(NS):
                                    a = acc[c, h, q]
                                    for k in cutlass.range_constexpr(VEC):
                                        a = a + rF[k, h, q] * xf[k]
                                    acc[c, h, q] = a

                # reduce over the warp, write
                for c in cutlass.range_constexpr(TCn):
                    if c < nt:
                        for q in cutlass.range_constexpr(RPW):
                            row = row0 + q
                            vals = [acc[c, h, q] for h in range(NS)]
                            for off in cutlass.range_constexpr(5):
                                for h in cutlass.range_constexpr(NS):
                                    vals[h] = vals[h] + cute.arch.shuffle_sync_bfly(
                                        vals[h], offset=1 << (4 - off))
                            if lane == c:
                                if row < N:
                                    if cutlass.const_expr(self.gate_up):
                                        g = vals[0]
                                        y = g / (1.0 + cute.math.exp(-g)) * vals[1]
                                        mAct = cute.make_tensor(
                                            dst, cute.make_layout((P, N), stride=(N, 1)))
                                        mAct[c0 + c, row] = y.to(BFloat16)
                                    else:
                                        mRows = cute.make_tensor(
                                            dst, cute.make_layout((P, N), stride=(N, 1)))
                                        mRows[c0 + c, row] = vals[0].to(BFloat16)


# ----------------------------------------------------------------------------------------------
# Compilation cache and host entry point
# ----------------------------------------------------------------------------------------------
_compiled: dict[tuple, Any] = {}
_lock = threading.Lock()


def _ptr(dtype, addr: int, align: int):
    from cutlass.cute.runtime import make_ptr
    return make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=align)


# (element type, assumed alignment in bytes) of the kernel's pointer arguments, in order:
# src, w, pair_token, run_expert, run_start, dst
_PTR_SPECS = ((BFloat16, 16), (BFloat16, 16), (Int32, 4), (Int32, 4), (Int32, 4), (BFloat16, 16))


def _fake_args():
    import cuda.bindings.driver as cuda
    ptrs = tuple(_ptr(dt, 1 << 20, al) for dt, al in _PTR_SPECS)
    return ptrs + (Int32(1), Int32(1), Int32(1), Int32(1), cuda.CUstream(0))


def compile_stage(stage: str, hidden: int, inter: int, rows: int | None = None, tc: int = TC,
                  threads: int = THREADS, dump_dir: str | None = None):
    """Compile (or fetch from the process cache) one stage. Works without a GPU when
    CUTE_DSL_ARCH=sm_90a is set. With `dump_dir` the PTX and cubin are kept there and exposed as
    `.artifacts.PTX` / `.artifacts.CUBIN` (the cache is bypassed)."""
    if rows is None:
        rows = ROWS_A if stage == "gate_up" else ROWS_B
    kern = MoeExpertRowsSm90(stage, hidden, inter, rows, tc, threads)
    key = (stage, hidden, inter, rows, tc, threads)
    if dump_dir is not None:
        return cute.compile(kern, *_fake_args(),
                            options=f"--keep-ptx --keep-cubin --dump-dir={dump_dir}")
    with _lock:
        fn = _compiled.get(key)
        if fn is None:
            fn = cute.compile(kern, *_fake_args())
            _compiled[key] = fn
    return fn


def launch(x, w13, w2, pair_token, run_expert, run_start, act, rows,
           rows_a: int = ROWS_A, rows_b: int = ROWS_B, tc_a: int = TC, tc_b: int = TC,
           threads_a: int = THREADS, threads_b: int = THREADS):
    """Both launches on the current torch stream (arguments already validated by the guard)."""
    import cuda.bindings.driver as cuda
    import torch

    B, Hd = x.shape
    I = w2.shape[2]
    P = pair_token.shape[0]
    R = run_expert.shape[0]
    fa = compile_stage("gate_up", Hd, I, rows_a, tc_a, threads_a)
    fb = compile_stage("down", Hd, I, rows_b, tc_b, threads_b)
    stream = cuda.CUstream(torch.cuda.current_stream(x.device).cuda_stream)
    for fn, src, w, dst, n_src, ss in ((fa, x, w13, act, B, x.stride(0) // VEC),
                                       (fb, act, w2, rows, B, I // VEC)):
        tensors = (src, w, pair_token, run_expert, run_start, dst)
        ptrs = [_ptr(dt, t.data_ptr(), al) for t, (dt, al) in zip(tensors, _PTR_SPECS)]
        fn(*ptrs, Int32(R), Int32(n_src), Int32(P), Int32(ss), stream)
    return rows
