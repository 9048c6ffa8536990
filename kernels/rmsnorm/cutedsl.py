"""CuTe DSL residual add + RMSNorm on Hopper (sm_90a): one CTA per row, one launch.

A thread owns NV 16-byte vectors of the row (8 bf16 each): it forms d (the delta row, or the
weighted sum of the row's MoE pairs, fp32 in slot order, rounded to bf16), r = bf16(res + d),
writes r, and adds r^2 into the row's sum; warp butterflies and one shared-memory pass give the
sum to every thread, which then writes bf16(r * rsqrt(mean + eps) * w). Every value is read
once from DRAM/L2 and the row's partial sums have a fixed order: results are reproducible.

Compile-time: D, the delta kind ("none" | "rows" | "pairs"), the slot count S (pairs) and
whether residual_out is written; row strides and B are run-time values.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32

from ..compile import CompileCache, fake_ptrs, gmem_ptr

VEC = 8
WARP = 32
DELTAS = ("none", "rows", "pairs")


class AddRmsNormSm90:
    def __init__(self, dim: int, delta: str, slots: int, write_residual: bool,
                 pdl: bool = True):
        if delta not in DELTAS:
            raise ValueError(f"delta must be one of {DELTAS}, got {delta!r}")
        if dim % VEC or dim <= 0:
            raise ValueError(f"dim must be a positive multiple of {VEC}, got {dim}")
        self.D, self.delta, self.S, self.write_residual = dim, delta, slots, write_residual
        self.pdl = pdl
        nvec = dim // VEC
        self.THREADS = min(1024, -(-nvec // WARP) * WARP)
        self.NV = -(-nvec // self.THREADS)          # vectors per thread
        self.NVEC = nvec
        self.WARPS = self.THREADS // WARP

    @cute.jit
    def __call__(self, residual: cute.Pointer, delta: cute.Pointer, token_pair: cute.Pointer,
                 pair_weight: cute.Pointer, weight: cute.Pointer, out: cute.Pointer,
                 residual_out: cute.Pointer, B: Int32, s_res: Int32, s_delta: Int32,
                 s_out: Int32, s_rout: Int32, eps: Float32, stream):
        self.kernel(residual, delta, token_pair, pair_weight, weight, out, residual_out,
                    s_res, s_delta, s_out, s_rout, eps).launch(
            grid=[B, 1, 1], block=[self.THREADS, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, residual: cute.Pointer, delta: cute.Pointer, token_pair: cute.Pointer,
               pair_weight: cute.Pointer, weight: cute.Pointer, out: cute.Pointer,
               residual_out: cute.Pointer, s_res: Int32, s_delta: Int32, s_out: Int32,
               s_rout: Int32, eps: Float32):
        D, NV, S = self.D, self.NV, self.S
        tidx, _, _ = cute.arch.thread_idx()
        b, _, _ = cute.arch.block_idx()
        lane = tidx % WARP
        warp = tidx // WARP
        smem = cutlass.memory.SmemAllocator()
        sRed = smem.allocate_tensor(Float32, cute.make_layout(self.WARPS), 16)

        rR = cute.make_rmem_tensor(cute.make_layout((VEC, NV)), Float32)
        rV = cute.make_rmem_tensor(cute.make_layout(VEC), BFloat16)
        rA = cute.make_rmem_tensor(cute.make_layout(VEC), Float32)
        rR.fill(0.0)
        ssq = Float32(0.0)
        if cutlass.const_expr(self.pdl):
            # the next projection (decode_linear) may launch now and request its first weight
            # tiles; this kernel was itself launched early after moe_experts' down stage (it
            # triggers once its loads are issued): its rows are read only after it completes
            cute.arch.griddepcontrol_launch_dependents()
            cute.arch.griddepcontrol_wait()
        for j in cutlass.range_constexpr(NV):
            v = j * self.THREADS + tidx
            if v < self.NVEC:
                cute.autovec_copy(cute.make_tensor(residual + b * s_res + v * VEC,
                                                   cute.make_layout(VEC)), rV)
                x = rV.load().to(Float32)
                if cutlass.const_expr(self.delta == "rows"):
                    cute.autovec_copy(cute.make_tensor(delta + b * s_delta + v * VEC,
                                                       cute.make_layout(VEC)), rV)
                    x = x + rV.load().to(Float32)
                if cutlass.const_expr(self.delta == "pairs"):
                    rA.fill(0.0)
                    for s in cutlass.range_constexpr(S):
                        p = cute.make_tensor(token_pair, cute.make_layout(1 << 30))[b * S + s]
                        w = cute.make_tensor(pair_weight, cute.make_layout(1 << 30))[p]
                        cute.autovec_copy(cute.make_tensor(delta + p * s_delta + v * VEC,
                                                           cute.make_layout(VEC)), rV)
                        rA.store(rA.load() + rV.load().to(Float32) * w)
                    # d rounds to bf16 before the add, as the model's MoE output does
                    x = x + rA.load().to(BFloat16).to(Float32)
                rV.store(x.to(BFloat16))             # r = bf16(res + d)
                if cutlass.const_expr(self.write_residual):
                    cute.autovec_copy(rV, cute.make_tensor(residual_out + b * s_rout + v * VEC,
                                                           cute.make_layout(VEC)))
                r = rV.load().to(Float32)
                rR[None, j].store(r)
                for k in cutlass.range_constexpr(VEC):
                    ssq = ssq + r[k] * r[k]
        for off in cutlass.range_constexpr(5):
            ssq = ssq + cute.arch.shuffle_sync_bfly(ssq, offset=1 << (4 - off))
        if lane == 0:
            sRed[warp] = ssq
        cute.arch.sync_threads()
        tot = Float32(0.0)
        for w in cutlass.range_constexpr(self.WARPS):
            tot = tot + sRed[w]
        inv = cute.math.rsqrt(tot / Float32(D) + eps)
        for j in cutlass.range_constexpr(NV):
            v = j * self.THREADS + tidx
            if v < self.NVEC:
                cute.autovec_copy(cute.make_tensor(weight + v * VEC, cute.make_layout(VEC)), rV)
                y = rR[None, j].load() * inv * rV.load().to(Float32)
                rV.store(y.to(BFloat16))
                cute.autovec_copy(rV, cute.make_tensor(out + b * s_out + v * VEC,
                                                       cute.make_layout(VEC)))


_cache = CompileCache()
# (dtype, assumed alignment) of the pointer arguments, in order
_SPECS = ((BFloat16, 16), (BFloat16, 16), (Int32, 4), (Float32, 4), (BFloat16, 16),
          (BFloat16, 16), (BFloat16, 16))


def compile_variant(dim: int, delta: str, slots: int, write_residual: bool,
                    pdl: bool = True, dump_dir: str | None = None):
    """Compile (or fetch) one variant; works without a GPU under CUTE_DSL_ARCH=sm_90a. With
    `dump_dir` the PTX and cubin are kept there (`.artifacts`), bypassing the cache."""
    import cuda.bindings.driver as cuda
    key = (dim, delta, slots, write_residual, pdl)

    def build(**opts):
        kern = AddRmsNormSm90(*key)
        return cute.compile(kern, *fake_ptrs(_SPECS), Int32(1), Int32(1), Int32(1), Int32(1),
                            Int32(1), Float32(1e-6), cuda.CUstream(0), **opts)
    return _cache.get(key, build, dump_dir)


def launch(residual, delta, weight, eps, out, residual_out=None, token_pair=None,
           pair_weight=None, pdl: bool = True):
    """The kernel on the current torch stream (arguments validated by the guard); `pdl`:
    programmatic dependent launch (the CTAs start during the previous kernel's tail)."""
    import cuda.bindings.driver as cuda
    import torch
    kind = "none" if delta is None else ("rows" if token_pair is None else "pairs")
    slots = token_pair.shape[1] if token_pair is not None else 0
    fn = compile_variant(residual.shape[1], kind, slots, residual_out is not None, pdl)
    dummy = residual
    tensors = (residual, delta if delta is not None else dummy,
               token_pair if token_pair is not None else dummy,
               pair_weight if pair_weight is not None else dummy, weight, out,
               residual_out if residual_out is not None else dummy)
    ptrs = [gmem_ptr(dt, t.data_ptr(), al) for t, (dt, al) in zip(tensors, _SPECS)]
    stride = lambda t: Int32(t.stride(0) if t is not None else 0)  # noqa: E731
    fn(*ptrs, Int32(residual.shape[0]), stride(residual), stride(delta), stride(out),
       stride(residual_out), Float32(eps),
       cuda.CUstream(torch.cuda.current_stream(residual.device).cuda_stream))
    return out
