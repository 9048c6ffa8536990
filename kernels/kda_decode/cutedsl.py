"""CuTe DSL fused KDA decode step for Hopper (sm_90a).

One launch per KDA layer and decode step computes, for B requests and H local heads (K = V = 128),
exactly the op of `reference.kda_decode_reference` (see that module for the math and the contract):
short conv (width 4) + SiLU of q, k, v with the conv state rolled in place; L2 norm of q, k (q scaled
by K^-1/2); beta = sigmoid; per-channel log decay (K3 bounded form or Kimi-Linear softplus form);
the delta-rule update of the fp32 state [V, K] in place; o = S q; gated RMSNorm.

Geometry (the split design of vLLM's Blackwell `KdaSplit`, written from scratch for sm_90):
  grid (C, H, B), cluster (C, 1, 1), 256 threads per CTA.
  CTA `c` of the cluster for (request b, head h) owns value rows [c*R, (c+1)*R), R = 128 / C, of
  the head's 128 x 128 fp32 state: each row is handled by a half warp (16 lanes x 8 keys, two
  16-byte loads per lane per row), RPT = R / 16 rows per thread, all kept in registers.
  Every CTA of the cluster computes the (cheap, 128-channel) q / k conv, norms and decays itself;
  the v conv, gate and output only for its own rows. The output RMSNorm needs the sum of o^2 over
  all 128 rows: each CTA multicasts its partial sum into every cluster peer's shared memory (DSMEM)
  and the cluster barrier publishes them; all CTAs add the partials in the same order, so they
  agree bit for bit. The same barrier orders the q / k conv-state reads of every CTA before the
  rolled state is written back (each CTA writes its own channel range).
  C = 1 (large batches) needs no cluster at all; `choose_cluster` picks C from B*H.
  The state loads are issued first and every other global load right after, before any use, so
  one DRAM round trip (after the slot index) covers them all.
  PDL variant (`pdl=True`): the slot index, the state rows (for grids of >= 128 CTAs only the
  first 3 row passes, `choose_early_rows`, except in the grid's first `first_wave` CTAs, one per
  SM, `choose_first_wave`), conv rows and parameters are loaded before `griddepcontrol.wait`
  (overlapping the previous kernel's tail); the projected rows and the other row passes after
  it; dependents are triggered right after the wait. Contract: the immediately preceding kernel
  in the stream must not write the pools, slot_idx or the parameters.

Slot 0 is padding: a request whose slot index is 0 touches neither pool and gets output zeros.
H, B and the pool sizes are run-time values; the compiled variants are (C, conv layout, decay form,
PDL); each compiles in well under a second, also on a CPU-only machine (CUTE_DSL_ARCH=sm_90a).
`launch` resolves the launch choices (cluster size, early row passes, first wave) for a call;
each is also an explicit argument. Measured figures: docs/kernels.md and
benchmarks/results/kda_decode_h200.json.
"""
from __future__ import annotations

import functools
import threading
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from ..compile import gmem_ptr

D = 128          # K = V = head dim
W = 4            # conv width
TAPS = W - 1
THREADS = 256
LANES = 16       # lanes per state row
ROWS_PER_PASS = THREADS // LANES   # 16
CLUSTER_SIZES = (1, 2, 4, 8)
MAX_EARLY_ROWS = D // ROWS_PER_PASS   # early_rows: row passes of a C = 1 CTA
Q_SCALE = D ** -0.5
L2_EPS = 1e-6


def _sigmoid(x):
    return 1.0 / (1.0 + cute.math.exp(-x))


class KdaDecodeSm90:
    """One compiled variant: cluster size, conv layout ("SD"/"DS"), decay form (bounded or not)."""

    def __init__(self, cluster: int, conv_layout: str, bounded: bool, pdl: bool = False,
                 min_blocks: int = 0, early_rows: int | None = None):
        if cluster not in CLUSTER_SIZES:
            raise ValueError(f"cluster must be one of {CLUSTER_SIZES}, got {cluster}")
        if conv_layout not in ("SD", "DS"):
            raise ValueError(f"conv_layout must be 'SD' or 'DS', got {conv_layout!r}")
        if early_rows is not None and not (isinstance(early_rows, int)
                                           and 0 <= early_rows <= MAX_EARLY_ROWS):
            raise ValueError(f"early_rows must be None or 0..{MAX_EARLY_ROWS}, got {early_rows!r}")
        self.C = cluster
        self.R = D // cluster                 # value rows per CTA
        self.RPT = self.R // ROWS_PER_PASS    # rows per thread
        self.conv_layout = conv_layout
        self.bounded = bounded
        self.pdl = pdl
        self.min_blocks = min_blocks          # CTAs per SM the register allocation must allow
        # PDL: state row passes loaded before griddepcontrol.wait (None: all), the rest right
        # after the projected rows (choose_early_rows)
        self.early_rows = (self.RPT if early_rows is None or not pdl
                           else min(early_rows, self.RPT))

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        q: cute.Pointer, k: cute.Pointer, v: cute.Pointer, gate: cute.Pointer, f: cute.Pointer,
        beta: cute.Pointer, conv_w: cute.Pointer, a_log: cute.Pointer, dt_bias: cute.Pointer,
        norm_w: cute.Pointer, state: cute.Pointer, conv: cute.Pointer, slots: cute.Pointer,
        out: cute.Pointer,
        B: Int32, H: Int32, n_slots: Int32, first_wave: Int32,
        sq: Int32, sk: Int32, sv: Int32, sg: Int32, sf: Int32, sb: Int32, so: Int32,
        eps: Float32, lower_bound: Float32,
        stream,
    ):
        self.kernel(
            q, k, v, gate, f, beta, conv_w, a_log, dt_bias, norm_w, state, conv, slots, out,
            B, H, n_slots, first_wave, sq, sk, sv, sg, sf, sb, so, eps, lower_bound,
        ).launch(
            grid=[self.C, H, B], block=[THREADS, 1, 1], cluster=[self.C, 1, 1],
            stream=stream, use_pdl=self.pdl, **self._occupancy(),
        )

    def _occupancy(self) -> dict:
        # minctasm caps the registers so `min_blocks` CTAs fit an SM; an explicit smem carveout
        # (percent; 1 KB of shared memory per CTA) keeps compilation free of device queries.
        if self.min_blocks <= 1:
            return {}
        return {"min_blocks_per_mp": self.min_blocks, "preferred_smem_carveout": 10}

    @staticmethod
    def _load_rows(mS, rS, row0, rgrp, lane, first: int, end: int):
        """Row passes [first, end) of this CTA's state rows -> registers (16-byte loads)."""
        for i in range(first, end):
            row = row0 + i * ROWS_PER_PASS + rgrp
            for j in range(2):
                src = cute.make_tensor(
                    mS[row, None].iterator + (64 * j + 4 * lane), cute.make_layout(4))
                cute.autovec_copy(src, rS[None, j, i])

    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        q: cute.Pointer, k: cute.Pointer, v: cute.Pointer, gate: cute.Pointer, f: cute.Pointer,
        beta: cute.Pointer, conv_w: cute.Pointer, a_log: cute.Pointer, dt_bias: cute.Pointer,
        norm_w: cute.Pointer, state: cute.Pointer, conv: cute.Pointer, slots: cute.Pointer,
        out: cute.Pointer,
        B: Int32, H: Int32, n_slots: Int32, first_wave: Int32,
        sq: Int32, sk: Int32, sv: Int32, sg: Int32, sf: Int32, sb: Int32, so: Int32,
        eps: Float32, lower_bound: Float32,
    ):
        C = self.C
        R = self.R
        RPT = self.RPT
        tidx, _, _ = cute.arch.thread_idx()
        cr, h, b = cute.arch.block_idx()      # cr = rank in the cluster (cluster spans grid x)
        HD = H * D
        CH = 3 * HD                           # conv channels [q | k | v]

        # ---- shared memory ------------------------------------------------------------------
        smem = cutlass.memory.SmemAllocator()
        sX = smem.allocate_tensor(Float32, cute.make_layout(2 * D), 16)     # conv+silu q | k
        sA = smem.allocate_tensor(Float32, cute.make_layout(D), 16)         # decay exp(g)
        sV = smem.allocate_tensor(Float32, cute.make_layout(R), 16)         # conv+silu v rows
        sGw = smem.allocate_tensor(Float32, cute.make_layout(R), 16)        # w * sigmoid(gate)
        sO = smem.allocate_tensor(Float32, cute.make_layout(R), 16)         # o rows
        sRed = smem.allocate_tensor(Float32, cute.make_layout(8), 16)       # per-warp sum sq
        sClu = smem.allocate_tensor(Float32, cute.make_layout(8), 16)       # cluster partials

        if cutlass.const_expr(C > 1):
            # Peers' shared memory must exist before the DSMEM stores below.
            cute.arch.cluster_arrive_relaxed()

        mSlots = cute.make_tensor(slots, cute.make_layout(B))
        mOut = cute.make_tensor(out, cute.make_layout((B, HD), stride=(so, 1)))
        slot = mSlots[b]
        row0 = cr * R                          # first value row of this CTA

        if slot == 0:
            # Padding request: output zeros, leave every pool untouched.
            if cutlass.const_expr(self.pdl):
                cute.arch.griddepcontrol_wait()
                cute.arch.griddepcontrol_launch_dependents()
            if tidx < R:
                mOut[b, h * D + row0 + tidx] = BFloat16(0.0)
            if cutlass.const_expr(C > 1):
                cute.arch.cluster_wait()
        else:
            lane = tidx % LANES
            rgrp = tidx // LANES
            warp = tidx // 32
            # ---- 1. issue the state loads (registers), latency overlaps the rest --------------
            head = Int64(slot) * Int64(H) + Int64(h)
            mS = cute.make_tensor(
                state + head * Int64(D * D),
                cute.make_layout((D, D), stride=(D, 1)))
            rS = cute.make_rmem_tensor(cute.make_layout((4, 2, RPT), stride=(1, 4, 8)), Float32)
            KdaDecodeSm90._load_rows(mS, rS, row0, rgrp, lane, 0, self.early_rows)
            # the grid's first `first_wave` CTAs (launch order) load every pass early: they are
            # the ones that become resident while the previous grid drains
            in_first_wave = (b * H + h) * C + cr < first_wave
            if cutlass.const_expr(self.early_rows < RPT):
                if in_first_wave:
                    KdaDecodeSm90._load_rows(mS, rS, row0, rgrp, lane, self.early_rows, RPT)

            # ---- 2. every other global load, all issued before any use (one DRAM round trip) ---
            # threads 0..127: q channel `ch` and the decay of key `ch`; threads 128..255: k
            # channel `ch`; threads 128..128+R also the v channel, gate and norm weight of row ch.
            sec = tidx // D                     # 0 = q, 1 = k
            ch = tidx % D
            cch = sec * HD + h * D + ch         # conv channel
            vr = row0 + ch % R                  # value row (meaningful for v threads)
            vcc = 2 * HD + h * D + vr
            if cutlass.const_expr(self.conv_layout == "SD"):
                mConv = cute.make_tensor(
                    conv + Int64(slot) * Int64(TAPS * CH),
                    cute.make_layout((TAPS, CH), stride=(CH, 1)))
            else:
                mConv = cute.make_tensor(
                    conv + Int64(slot) * Int64(TAPS * CH),
                    cute.make_layout((TAPS, CH), stride=(1, TAPS)))
            mW = cute.make_tensor(conv_w, cute.make_layout((CH, W), stride=(W, 1)))
            t0 = mConv[0, cch]
            t1 = mConv[1, cch]
            t2 = mConv[2, cch]
            rW = cute.make_rmem_tensor(cute.make_layout(W), Float32)
            cute.autovec_copy(mW[cch, None], rW)
            dtb = cute.make_tensor(dt_bias, cute.make_layout(HD))[h * D + ch]
            alog = cute.make_tensor(a_log, cute.make_layout(H))[h]
            vt0 = mConv[0, vcc]
            vt1 = mConv[1, vcc]
            vt2 = mConv[2, vcc]
            rWv = cute.make_rmem_tensor(cute.make_layout(W), Float32)
            cute.autovec_copy(mW[vcc, None], rWv)
            nw = cute.make_tensor(norm_w, cute.make_layout(D))[vr]
            if cutlass.const_expr(self.pdl):
                # Everything above may run before the previous kernel in the stream finishes
                # (it must not write the pools, slot_idx or the parameters); the projected rows
                # below are its outputs. Triggering only after the wait keeps two-back kernels
                # (possibly the same layer on the same slots) fully ordered.
                cute.arch.griddepcontrol_wait()
                cute.arch.griddepcontrol_launch_dependents()
            xq = cute.make_tensor(q, cute.make_layout((B, HD), stride=(sq, 1)))[b, h * D + ch]
            xk = cute.make_tensor(k, cute.make_layout((B, HD), stride=(sk, 1)))[b, h * D + ch]
            fr = cute.make_tensor(f, cute.make_layout((B, HD), stride=(sf, 1)))[b, h * D + ch]
            braw = cute.make_tensor(beta, cute.make_layout((B, H), stride=(sb, 1)))[b, h]
            vx = cute.make_tensor(v, cute.make_layout((B, HD), stride=(sv, 1)))[b, h * D + vr]
            gr = cute.make_tensor(gate, cute.make_layout((B, HD), stride=(sg, 1)))[b, h * D + vr]
            if cutlass.const_expr(self.early_rows < RPT):
                if not in_first_wave:
                    KdaDecodeSm90._load_rows(mS, rS, row0, rgrp, lane, self.early_rows, RPT)

            # ---- 3. conv + SiLU, sums of squares, decays, v, gate ------------------------------
            xb = xq
            if sec == 1:
                xb = xk
            x = xb.to(Float32)
            y = rW[0] * t0.to(Float32) + rW[1] * t1.to(Float32) + rW[2] * t2.to(Float32) + rW[3] * x
            y = y * _sigmoid(y)
            sX[tidx] = y
            ssq = y * y
            for off in cutlass.range_constexpr(5):
                ssq = ssq + cute.arch.shuffle_sync_bfly(ssq, offset=1 << (4 - off))
            if tidx % 32 == 0:
                sRed[warp] = ssq
            if sec == 0:
                A = cute.math.exp(alog)
                xf = fr.to(Float32) + dtb
                g = Float32(0.0)
                if cutlass.const_expr(self.bounded):
                    g = lower_bound * _sigmoid(A * xf)
                else:
                    sp = xf
                    if xf <= 20.0:
                        sp = cute.math.log1p(cute.math.exp(xf))
                    g = -A * sp
                sA[ch] = cute.math.exp(g)
            else:
                if ch < R:
                    yv = (rWv[0] * vt0.to(Float32) + rWv[1] * vt1.to(Float32)
                          + rWv[2] * vt2.to(Float32) + rWv[3] * vx.to(Float32))
                    sV[ch] = yv * _sigmoid(yv)
                    sGw[ch] = nw * _sigmoid(gr.to(Float32))
            bt = _sigmoid(braw.to(Float32))

            cute.arch.sync_threads()

            # ---- 4. delta rule on the register-resident rows ------------------------------------
            inv_q = cute.math.rsqrt(sRed[0] + sRed[1] + sRed[2] + sRed[3] + L2_EPS) * Q_SCALE
            inv_k = cute.math.rsqrt(sRed[4] + sRed[5] + sRed[6] + sRed[7] + L2_EPS)
            rK = cute.make_rmem_tensor(cute.make_layout((4, 2), stride=(1, 4)), Float32)
            rQ = cute.make_rmem_tensor(cute.make_layout((4, 2), stride=(1, 4)), Float32)
            rA = cute.make_rmem_tensor(cute.make_layout((4, 2), stride=(1, 4)), Float32)
            for j in cutlass.range_constexpr(2):
                for e in cutlass.range_constexpr(4):
                    key = 64 * j + 4 * lane + e
                    rK[e, j] = sX[D + key] * inv_k
                    rQ[e, j] = sX[key] * inv_q
                    rA[e, j] = sA[key]
            for i in cutlass.range_constexpr(RPT):
                lrow = i * ROWS_PER_PASS + rgrp
                dot = Float32(0.0)
                for j in cutlass.range_constexpr(2):
                    for e in cutlass.range_constexpr(4):
                        rS[e, j, i] = rS[e, j, i] * rA[e, j]
                        dot = dot + rS[e, j, i] * rK[e, j]
                for off in cutlass.range_constexpr(4):
                    dot = dot + cute.arch.shuffle_sync_bfly(dot, offset=1 << (3 - off))
                u = bt * (sV[lrow] - dot)
                od = Float32(0.0)
                for j in cutlass.range_constexpr(2):
                    for e in cutlass.range_constexpr(4):
                        rS[e, j, i] = rS[e, j, i] + u * rK[e, j]
                        od = od + rS[e, j, i] * rQ[e, j]
                for off in cutlass.range_constexpr(4):
                    od = od + cute.arch.shuffle_sync_bfly(od, offset=1 << (3 - off))
                row = row0 + lrow
                for j in cutlass.range_constexpr(2):
                    dst = cute.make_tensor(
                        mS[row, None].iterator + (64 * j + 4 * lane), cute.make_layout(4))
                    cute.autovec_copy(rS[None, j, i], dst)
                if lane == 0:
                    sO[lrow] = od

            cute.arch.sync_threads()

            # ---- 5. RMS over all 128 rows (cluster-wide) ----------------------------------------
            if warp == 0:
                part = Float32(0.0)
                for r in cutlass.range_constexpr((R + 31) // 32):
                    if cutlass.const_expr(R >= 32):
                        o_r = sO[r * 32 + tidx]
                        part = part + o_r * o_r
                    else:
                        if tidx < R:
                            o_r = sO[tidx]
                            part = part + o_r * o_r
                for off in cutlass.range_constexpr(5):
                    part = part + cute.arch.shuffle_sync_bfly(part, offset=1 << (4 - off))
                if cutlass.const_expr(C > 1):
                    cute.arch.cluster_wait()       # pairs with the relaxed arrive at entry
                    if tidx < C:
                        # st.shared::cluster to peer `tidx`'s sClu[cr]
                        cute.arch.inline_ptx(
                            "{ .reg .b32 ra; mapa.shared::cluster.u32 ra, {$r0}, {$r1}; "
                            "st.shared::cluster.f32 [ra], {$r2}; }",
                            read_only_args=[sClu.iterator + cr, tidx, part])
                else:
                    if tidx == 0:
                        sClu[0] = part
            else:
                if cutlass.const_expr(C > 1):
                    cute.arch.cluster_wait()
            if cutlass.const_expr(C > 1):
                cute.arch.cluster_arrive()         # release: DSMEM partials + conv-state reads
                cute.arch.cluster_wait()           # acquire
            else:
                cute.arch.sync_threads()
            total = Float32(0.0)
            for c in cutlass.range_constexpr(C):
                total = total + sClu[c]
            rstd = cute.math.rsqrt(total * (1.0 / D) + eps)
            if tidx < R:
                mOut[b, h * D + row0 + tidx] = (sO[tidx] * rstd * sGw[tidx]).to(BFloat16)

            # ---- 6. roll the conv state (after every CTA of the cluster has read it) ------------
            if ch >= row0:
                if ch < row0 + R:
                    mConv[0, cch] = t1
                    mConv[1, cch] = t2
                    mConv[2, cch] = xb
            if sec == 1:
                if ch < R:
                    mConv[0, vcc] = vt1
                    mConv[1, vcc] = vt2
                    mConv[2, vcc] = vx


# ----------------------------------------------------------------------------------------------
# Compilation cache and host entry point
# ----------------------------------------------------------------------------------------------
_compiled: dict[tuple, Any] = {}
_lock = threading.Lock()


# Pointer element types and the alignments (bytes) the kernel is compiled for, in argument order.
_PTR_SPECS = (
    ("q", BFloat16, 2), ("k", BFloat16, 2), ("v", BFloat16, 2), ("g_out", BFloat16, 2),
    ("f", BFloat16, 2), ("beta_raw", BFloat16, 2), ("conv_weight", Float32, 16),
    ("A_log", Float32, 4), ("dt_bias", Float32, 4), ("norm_weight", Float32, 4),
    ("state_pool", Float32, 16), ("conv_pool", BFloat16, 2), ("slot_idx", Int32, 4),
    ("out", BFloat16, 2),
)


def _fake_args():
    import cuda.bindings.driver as cuda
    ptrs = tuple(gmem_ptr(dt, 1 << 20, al) for _, dt, al in _PTR_SPECS)
    i = Int32(1)
    return ptrs + (i,) * 11 + (Float32(1e-6), Float32(-5.0), cuda.CUstream(0))


def compile_variant(cluster: int, conv_layout: str, bounded: bool, pdl: bool = False,
                    dump_dir: str | None = None, min_blocks: int = 0,
                    early_rows: int | None = None):
    """Compile (or fetch from the process cache) one variant. Works without a GPU when
    CUTE_DSL_ARCH=sm_90a is set. With `dump_dir`, the PTX and cubin are written there and
    exposed as `.artifacts.PTX` / `.artifacts.CUBIN` (the cache is bypassed)."""
    kern = KdaDecodeSm90(cluster, conv_layout, bounded, pdl, min_blocks, early_rows)
    key = (cluster, conv_layout, bool(bounded), bool(pdl), min_blocks, kern.early_rows)
    if dump_dir is not None:
        return cute.compile(kern, *_fake_args(),
                            options=f"--keep-ptx --keep-cubin --dump-dir={dump_dir}")
    with _lock:
        fn = _compiled.get(key)
        if fn is None:
            fn = cute.compile(kern, *_fake_args())
            _compiled[key] = fn
    return fn


def cubin_resources(cubin: bytes) -> dict[str, int]:
    """Registers per thread and spill stack bytes of the kernel in `cubin`, read from the ELF's
    `.nv.info` section (EIATTR_REGCOUNT 0x2f, EIATTR_FRAME_SIZE 0x11 / MIN_STACK_SIZE 0x12:
    what `cuobjdump --dump-resource-usage` prints as REG / STACK; a non-zero stack here means
    spills), so it works on a CPU-only machine."""
    import struct
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    hdrs = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    stroff = hdrs[shstrndx][4]
    res = {"stack": 0}
    for h in hdrs:
        name = cubin[stroff + h[0]: cubin.index(b"\0", stroff + h[0])]
        if name != b".nv.info":
            continue
        p, end = h[4], h[4] + h[5]
        while p < end:
            fmt, attr = cubin[p], cubin[p + 1]
            p += 2
            if fmt == 4:                                   # EIFMT_SVAL: u16 size + payload
                size, = struct.unpack_from("<H", cubin, p)
                if attr in (0x2F, 0x11, 0x12) and size == 8:   # (function symbol, value)
                    v = struct.unpack_from("<I", cubin, p + 6)[0]
                    if attr == 0x2F:
                        res["regs"] = v
                    else:
                        res["stack"] = max(res["stack"], v)
                p += 2 + size
            elif fmt == 3:
                p += 2
            elif fmt == 2:
                p += 1
    return res


def choose_cluster(batch: int, heads: int, pdl: bool = False) -> int:
    """CTAs per (request, head): a few at small batch to spread the state over more SMs, 1 once
    there are enough (request, head) pairs: without PDL up to 256 CTAs in total; with PDL, whose
    early loads already hide most of the latency, only up to 64 (H200 sweeps). 8-CTA clusters
    compile and work but never won."""
    limit = 64 if pdl else 256
    c = 4
    while c > 1 and batch * heads * c > limit:
        c //= 2
    return c


def choose_early_rows(batch: int, heads: int, cluster: int) -> int | None:
    """PDL: state row passes each CTA loads before griddepcontrol.wait (None = all; the grid's
    first `choose_first_wave` CTAs load all of them regardless). With all of them early, a grid
    of many CTAs leaves DRAM idle after the wait while every resident CTA waits on the projected
    rows. On the H200, a few early passes and the rest after the wait were faster for grids of
    >= 128 CTAs and slower below, so smaller grids keep every load early; with the first wave,
    3 early passes beat 2 and 4."""
    return 3 if batch * heads * cluster >= 128 else None


@functools.lru_cache(maxsize=None)
def choose_first_wave(device_index: int) -> int:
    """PDL with early_rows < all: how many CTAs, in launch order, still load every row pass
    before the wait: one per SM. The first CTAs of a grid become resident as the previous grid
    drains and wait there; loading their whole state meanwhile keeps DRAM busy through that
    tail, while the later CTAs (which pass the wait at once) keep the early_rows order. On the
    H200 one per SM was faster than none at every measured shape and two per SM gained
    nothing; the SM count is read from the device."""
    import torch
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _check_first_wave(first_wave) -> None:
    if first_wave is not None and not (isinstance(first_wave, int) and 0 <= first_wave < 2 ** 31):
        raise ValueError(f"first_wave must be None or an int in [0, 2^31), got {first_wave!r}")


def launch_choices(batch: int, heads: int, pdl: bool, device_index: int, *,
                   cluster: int | None = None, early_rows: int | None = None,
                   first_wave: int | None = None, min_blocks: int = 0) -> dict:
    """Every launch choice of one call, the caller's where given, else the default
    (choose_cluster, choose_early_rows, choose_first_wave for device `device_index`): the one
    place they are resolved (`launch`; the benchmark records and passes them)."""
    _check_first_wave(first_wave)
    C = cluster or choose_cluster(batch, heads, pdl)
    return dict(cluster=C,
                early_rows=choose_early_rows(batch, heads, C) if early_rows is None else early_rows,
                first_wave=choose_first_wave(device_index) if first_wave is None else first_wave,
                min_blocks=min_blocks)


def launch(q, k, v, g_out, f, beta_raw, conv_weight, A_log, dt_bias, norm_weight, eps,
           lower_bound, state_pool, conv_pool, slot_idx, conv_layout, out,
           cluster: int | None = None, pdl: bool = False, min_blocks: int = 0,
           early_rows: int | None = None, first_wave: int | None = None):
    """Run the kernel on the current torch stream (arguments already validated by the guard)."""
    _check_first_wave(first_wave)
    import cuda.bindings.driver as cuda
    import torch

    B, HD = q.shape
    H = A_log.shape[0]
    ch = launch_choices(B, H, pdl, q.device.index if q.device.index is not None
                        else torch.cuda.current_device(), cluster=cluster,
                        early_rows=early_rows, first_wave=first_wave, min_blocks=min_blocks)
    first_wave = ch["first_wave"]
    fn = compile_variant(ch["cluster"], conv_layout, lower_bound is not None, pdl,
                         min_blocks=ch["min_blocks"], early_rows=ch["early_rows"])
    tensors = (q, k, v, g_out, f, beta_raw, conv_weight, A_log, dt_bias, norm_weight,
               state_pool, conv_pool, slot_idx, out)
    ptrs = [gmem_ptr(dt, t.data_ptr(), al) for t, (_, dt, al) in zip(tensors, _PTR_SPECS)]
    stream = cuda.CUstream(torch.cuda.current_stream(q.device).cuda_stream)
    fn(*ptrs, Int32(B), Int32(H), Int32(state_pool.shape[0]), Int32(first_wave),
       Int32(q.stride(0)), Int32(k.stride(0)), Int32(v.stride(0)), Int32(g_out.stride(0)),
       Int32(f.stride(0)), Int32(beta_raw.stride(0)), Int32(out.stride(0)),
       Float32(eps), Float32(lower_bound if lower_bound is not None else 0.0), stream)
    return out
