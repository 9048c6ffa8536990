"""Benchmark: warpgroup-MMA throughput per SM for the shapes the MLA decode kernel issues (H200).

The fp8 MLA kernel at H = 32 issues e4m3 wgmma m64n32k32 for S^T (both operands in shared
memory) and fp16 wgmma m64n32k16 with A from registers for PV. This measures how many FMAs per
SM and clock such shapes sustain, for N = 16 / 32 / 64 / 128 and 1-3 warpgroups per SM issuing
at once: one CTA per SM (the device's SM count), each warpgroup running `iters` x (576 / k)
back-to-back MMAs into one fp32 accumulator (one commit and wait per 576-deep pass). Operand values are whatever shared memory
and the filled registers hold: the rate does not depend on them. FMA per clock assumes the
1,980 MHz boost clock the H200 holds under load.

    python benchmarks/wgmma_rate.py [--out DIR] [--iters 2000]

Writes `wgmma_rate_<device>.json` (e.g. wgmma_rate_h200.json) to benchmarks/results/ (or --out).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Column, Table, event_times_ms, write_result  # noqa: E402

K = 576                  # the MLA latent + rope width: the K of one S^T pass
CLOCK_HZ = 1.98e9


def _kernel_class():
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass import Float16, Float32
    from cutlass.cute.nvgpu import warpgroup

    E4M3 = cutlass.Float8E4M3FN

    class WgmmaRate:
        """`wgs` warpgroups per CTA, each `iters` passes of K / k MMAs of 64 x n (fp8: e4m3
        m64nNk32, A and B in smem; else fp16 m64nNk16, A in registers, B in smem)."""

        def __init__(self, n: int, fp8: bool, wgs: int, iters: int, sms: int):
            self.n, self.fp8, self.wgs, self.iters, self.sms = n, fp8, wgs, iters, sms

        @cute.jit
        def __call__(self, out: cute.Tensor, stream):
            km = cute.nvgpu.OperandMajorMode.K
            if cutlass.const_expr(self.fp8):
                dt = E4M3
                mma = sm90_utils.make_trivial_tiled_mma(dt, dt, km, km, Float32, (1, 1, 1),
                                                        (64, self.n))
                atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW64, dt)
            else:
                dt = Float16
                mma = sm90_utils.make_trivial_tiled_mma(dt, dt, km, km, Float32, (1, 1, 1),
                                                        (64, self.n),
                                                        warpgroup.OperandSource.RMEM)
                atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128, dt)
            sA_layout = cute.tile_to_shape(atom, (64, K), (0, 1))
            sB_layout = cute.tile_to_shape(atom, (self.n, K), (0, 1))

            @cute.struct
            class Storage:
                a: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sA_layout)], 1024]
                b: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sB_layout)], 1024]

            self.kernel(mma, out, sA_layout, sB_layout, Storage).launch(
                grid=(self.sms, 1, 1), block=(128 * self.wgs, 1, 1), stream=stream)

        @cute.kernel
        def kernel(self, mma: cute.TiledMma, out: cute.Tensor, sA_layout: cute.ComposedLayout,
                   sB_layout: cute.ComposedLayout, Storage: cutlass.Constexpr):
            tidx, _, _ = cute.arch.thread_idx()
            bid, _, _ = cute.arch.block_idx()
            storage = cutlass.memory.SmemAllocator().allocate(Storage)
            sA = storage.a.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
            sB = storage.b.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
            thr = mma.get_slice(tidx % 128)
            tB = thr.make_fragment_B(thr.partition_B(sB))
            acc = thr.make_fragment_C(thr.partition_shape_C((64, self.n)))
            acc.fill(0.0)
            if cutlass.const_expr(self.fp8):
                tA = thr.make_fragment_A(thr.partition_A(sA))
            else:
                tA = thr.make_fragment_A(thr.partition_shape_A((64, 16)))
                tA.fill(1.0)
            steps = K // (32 if self.fp8 else 16)
            for _ in cutlass.range(self.iters, unroll=1):
                warpgroup.fence()
                for k in cutlass.range_constexpr(steps):
                    mma.set(warpgroup.Field.ACCUMULATE, True)
                    a = tA[None, None, k] if self.fp8 else tA[None, None, 0]
                    cute.gemm(mma, acc, a, tB[None, None, k], acc)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
            # the accumulator is used, so no MMA can be dropped
            out[bid * 128 * self.wgs + tidx] = acc.load().reduce(cute.ReductionOp.ADD,
                                                                 Float32(0.0), 0)

    return WgmmaRate


def rate(n: int, fp8: bool, wgs: int, iters: int) -> dict:
    """FMAs per SM and second (best of 5 timed launches after a warm-up)."""
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    import torch
    from cutlass.cute.runtime import from_dlpack

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.zeros(sms * 128 * wgs, device="cuda")
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    mo = from_dlpack(out, assumed_align=16)
    fn = cute.compile(_kernel_class()(n, fp8, wgs, iters, sms), mo, stream)
    fn(mo, stream)
    torch.cuda.synchronize()
    times = [ms * 1e-3 for ms in event_times_ms(lambda: fn(mo, stream), 5)]
    k = 32 if fp8 else 16
    fmas = sms * wgs * iters * (K // k) * 64 * n * k
    t = min(times)
    return {"mma": f"e4m3 m64n{n}k32 (A, B smem)" if fp8 else f"f16 m64n{n}k16 (A regs)",
            "n": n, "fp8": fp8, "warpgroups": wgs, "seconds": t,
            "fma_per_sm_s": fmas / t / sms, "fma_per_clk_at_1980mhz": fmas / t / sms / CLOCK_HZ}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    ap.add_argument("--iters", type=int, default=2000)
    args = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        sys.exit("wgmma_rate.py needs a Hopper GPU (sm_90)")
    rows = []
    table = Table([Column("mma", width=28, left=True), Column("wgs", "warpgroups"),
                   Column("FMA/clk/SM", "fma_per_clk_at_1980mhz", ".0f", 11)])
    print(table.header())
    for fp8 in (True, False):
        for n in (16, 32, 64, 128):
            for wgs in (1, 2, 3):
                r = rate(n, fp8, wgs, args.iters)
                rows.append(r)
                print(table.row(r), flush=True)
    from mla_decode import device_tag
    path = write_result(f"wgmma_rate_{device_tag()}", dict(
        op="wgmma_rate", k=K, iters=args.iters, clock_assumed_hz=CLOCK_HZ, rows=rows), args.out)
    print("wrote", path)


if __name__ == "__main__":
    main()
