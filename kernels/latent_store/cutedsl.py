"""CuTe DSL MLA latent store on Hopper (sm_90a): one CTA per row, one launch.

Threads 0..R/8-1 own 16-byte vectors of c_kv: they load kv, sum squares (warp butterflies and
a shared-memory pass over the c_kv warps), and write bf16(x * rsqrt(mean + eps) * w) straight
into the row's slot of the paged cache; the next P/8 threads copy k_pe beside it. Padding rows
(new_page 0) exit at once. Compile-time: R and P (bf16 cache); B and strides are run-time.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64

from ..compile import CompileCache, fake_ptrs, gmem_ptr

VEC = 8
WARP = 32


class LatentStoreSm90:
    def __init__(self, rank: int, rope: int):
        if rank % (VEC * WARP) or rope % VEC or rope <= 0:
            raise ValueError(f"rank must be a multiple of {VEC * WARP} and rope of {VEC}, "
                             f"got rank {rank}, rope {rope}")
        self.R, self.P = rank, rope
        self.NR, self.NP = rank // VEC, rope // VEC
        self.RW = self.NR // WARP                        # warps over c_kv
        self.THREADS = -(-(self.NR + self.NP) // WARP) * WARP

    @cute.jit
    def __call__(self, kv: cute.Pointer, weight: cute.Pointer, data: cute.Pointer,
                 new_page: cute.Pointer, new_row: cute.Pointer, B: Int32, s_kv: Int32,
                 page_tokens: Int32, eps: Float32, stream):
        self.kernel(kv, weight, data, new_page, new_row, s_kv, page_tokens, eps).launch(
            grid=[B, 1, 1], block=[self.THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, kv: cute.Pointer, weight: cute.Pointer, data: cute.Pointer,
               new_page: cute.Pointer, new_row: cute.Pointer, s_kv: Int32, page_tokens: Int32,
               eps: Float32):
        W = self.R + self.P
        tidx, _, _ = cute.arch.thread_idx()
        b, _, _ = cute.arch.block_idx()
        lane = tidx % WARP
        warp = tidx // WARP
        smem = cutlass.memory.SmemAllocator()
        sRed = smem.allocate_tensor(Float32, cute.make_layout(WARP), 16)
        page = cute.make_tensor(new_page, cute.make_layout(1 << 30))[b]
        if page != 0:
            row = cute.make_tensor(new_row, cute.make_layout(1 << 30))[b]
            dst = data + (page * Int64(page_tokens) + row) * Int64(W)
            rV = cute.make_rmem_tensor(cute.make_layout(VEC), BFloat16)
            ssq = Float32(0.0)
            x = rV.load().to(Float32)
            if tidx < self.NR + self.NP:
                cute.autovec_copy(cute.make_tensor(kv + b * s_kv + tidx * VEC,
                                                   cute.make_layout(VEC)), rV)
                x = rV.load().to(Float32)
                if tidx < self.NR:
                    for k in cutlass.range_constexpr(VEC):
                        ssq = ssq + x[k] * x[k]
            for off in cutlass.range_constexpr(5):
                ssq = ssq + cute.arch.shuffle_sync_bfly(ssq, offset=1 << (4 - off))
            if lane == 0:
                sRed[warp] = ssq
            cute.arch.sync_threads()
            if tidx < self.NR:
                tot = Float32(0.0)
                for w in cutlass.range_constexpr(self.RW):
                    tot = tot + sRed[w]
                inv = cute.math.rsqrt(tot / Float32(self.R) + eps)
                rW = cute.make_rmem_tensor(cute.make_layout(VEC), BFloat16)
                cute.autovec_copy(cute.make_tensor(weight + tidx * VEC, cute.make_layout(VEC)),
                                  rW)
                rV.store((x * inv * rW.load().to(Float32)).to(BFloat16))
            if tidx < self.NR + self.NP:
                cute.autovec_copy(rV, cute.make_tensor(dst + tidx * VEC, cute.make_layout(VEC)))


_cache = CompileCache()
_SPECS = ((BFloat16, 16), (BFloat16, 16), (BFloat16, 16), (Int64, 8), (Int64, 8))


def compile_variant(rank: int, rope: int, dump_dir: str | None = None):
    """Compile (or fetch) one variant; works without a GPU under CUTE_DSL_ARCH=sm_90a. With
    `dump_dir` the PTX and cubin are kept there (`.artifacts`), bypassing the cache."""
    import cuda.bindings.driver as cuda

    def build(**opts):
        return cute.compile(LatentStoreSm90(rank, rope), *fake_ptrs(_SPECS), Int32(1), Int32(1),
                            Int32(64), Float32(1e-6), cuda.CUstream(0), **opts)
    return _cache.get((rank, rope), build, dump_dir)


def launch(kv, weight, eps, data, new_page, new_row, kv_scale=None):
    """The kernel on the current torch stream (arguments validated by the guard)."""
    import cuda.bindings.driver as cuda
    import torch
    R = weight.shape[0]
    fn = compile_variant(R, kv.shape[1] - R)
    tensors = (kv, weight, data, new_page, new_row)
    ptrs = [gmem_ptr(dt, t.data_ptr(), al) for t, (dt, al) in zip(tensors, _SPECS)]
    fn(*ptrs, Int32(kv.shape[0]), Int32(kv.stride(0)), Int32(data.shape[1]), Float32(eps),
       cuda.CUstream(torch.cuda.current_stream(kv.device).cuda_stream))
    return data
