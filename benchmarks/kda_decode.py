"""KDA decode step on one GPU: the CuTe DSL kernel vs stock (fla-core Triton + torch), vs the floor.

For H in {12, 32, 96} x B in {1, 2, 4, 8, 16, 32, 64} (K = V = 128, bounded K3 decay, SD conv):
  ours   : pdserve's fused CuTe DSL kernel (conv + norms + gates + delta rule + gated RMSNorm),
           with the launcher's default cluster size; every cluster size is timed too.
  ours_pdl: the same launched with programmatic dependent launch (slot, pool and weight loads
           overlap the previous call; consecutive calls use disjoint slot sets, as PDL requires).
  fla    : fla-core's `fused_recurrent_kda_fwd` (the Triton kernel vLLM vendors) doing the core
           math (gate, beta, L2 norm fused), in place on the same value-major state pool through
           slot indices, as vLLM's decode calls it.
  stock  : fla + the parts fla lacks, in torch: the conv-state update + conv + SiLU before it and
           the gated RMSNorm after it (all captured in one CUDA graph).
  floor  : fp32 state read + written once at the copy bandwidth measured in the same run.
Times: median over CUDA-graph replays; each graph holds N >= MIN_CALLS calls that rotate over
disjoint state (>= ~200 MB, at most 256 sets), so it does not stay in L2; per-call = replay / N.
Slots, as the runtime addresses them (the figures of record): each call is another layer with its
own pool (SlotPool's [n_kda, slots, H, V, K]), the batch holds slots 1..B (SlotPool hands out the
lowest free ids) in slot order (DecodeInstance orders a step's rows by slot). `*_random_slots_us`: the
same kernel with B random slots of one pool of (sets x B + 1) slots per call, as churn could
scatter them at worst. With --marginal also
(t_2N - t_N) / N, which charges no call with the replay's launch or the first call's missing
predecessor (graph_us_marginal).
Every launch choice is passed explicitly (the launcher's `cluster`, `pdl`, `early_rows`,
`first_wave`; --variants). Writes `kda_decode_<device>.json` (e.g. kda_decode_h200.json: the
environment and every figure) to benchmarks/results/ (or --out) through common.write_result and
prints a short table last.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sys
import traceback
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Column, Table, capture_graph, event_times_ms, write_result  # noqa: E402

HEADS = (12, 32, 96)
BATCHES = (1, 2, 4, 8, 16, 32, 64)
D, W = 128, 4
LOWER_BOUND = -5.0
EPS = 1e-5
ROTATE_BYTES = 200 << 20
# calls per graph at least this many: one replay's launch (several us from the start event to the
# first kernel) is spread over the calls; 8 left ~1 us of it on each large-batch call. A decode
# step's graph holds every layer's kernels, so a long graph is what the runtime sees.
MIN_CALLS = 32


def events_ms(fn, reps):
    """Median ms of `fn()` over `reps` timed runs (after warm-up), CUDA events."""
    return statistics.median(event_times_ms(fn, reps, warmup=3))


def copy_bandwidth_GBps():
    n = 1 << 30
    src = torch.randn(n // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = events_ms(lambda: dst.copy_(src), 20)
    return 2 * n / (ms * 1e-3) / 1e9


EAGER_FALLBACKS = []


def graph_us_per_call(calls, reps=20):
    """Median us per call over replays of one CUDA graph holding `calls` (a list of thunks).
    If capture fails, times the calls eagerly and records that in EAGER_FALLBACKS."""
    try:
        return _graph_us_per_call(calls, reps)
    except Exception as exc:  # noqa: BLE001
        torch.cuda.synchronize()
        EAGER_FALLBACKS.append(f"{type(exc).__name__}: {exc}")
        traceback.print_exc()

        def run_all():
            for c in calls:
                c()
        return events_ms(run_all, reps) * 1e3 / len(calls)


def _graph_us_per_call(calls, reps):
    def run(some):
        for c in some:
            c()
    # warm-up (compiles, autotunes) on two calls, outside the graph
    g = capture_graph(lambda: run(calls), warm_up=lambda: run(calls[:2]))
    ms = events_ms(g.replay, reps)
    del g
    return ms * 1e3 / len(calls)


def graph_us_marginal(calls, us_per_call):
    """us per call with the graph's fixed costs taken out: a graph of 2 N calls (the same thunks
    twice) against the N-call figure the caller already has (`us_per_call`, graph_us_per_call
    of `calls`), (t_2N - t_N) / N. A replay's launch (several us before the first kernel) and the
    first call's missing predecessor are then charged to no call, as in a decode step's graph of
    every layer, where one launch serves hundreds of kernels."""
    return 2 * graph_us_per_call(calls * 2) - us_per_call


class Cell:
    """Inputs for one (H, B) and the per-call state they touch, in one of two slot patterns:
    "runtime": `n_sets` layer pools of B + 1 slots each, call i on layer i % n_sets with slots
    1..B in order; "random": one pool of n_sets x B + 1 slots, call i on the i % n_sets-th of
    n_sets disjoint sets of B random slots (random order)."""

    PATTERNS = ("runtime", "random")

    def __init__(self, H, B, seed, pattern="runtime"):
        if pattern not in self.PATTERNS:
            raise ValueError(f"slot pattern must be one of {self.PATTERNS}, got {pattern!r}")
        torch.manual_seed(seed)
        HD = H * D
        self.H, self.B, self.pattern = H, B, pattern
        per_call = B * H * D * D * 4
        self.n_sets = max(2, min(256, math.ceil(ROTATE_BYTES / per_call)))
        dev = "cuda"
        self.rows = [torch.randn(B, HD, device=dev).to(torch.bfloat16) for _ in range(5)]
        self.q, self.k, self.v, self.g_out, self.f = self.rows
        self.beta_raw = torch.randn(B, H, device=dev).to(torch.bfloat16)
        self.conv_weight = torch.randn(3 * HD, W, device=dev) * 0.5
        self.A_log = torch.rand(H, device=dev) * math.log(16.0)
        self.dt_bias = 0.5 * torch.randn(HD, device=dev)
        self.norm_weight = 1.0 + 0.1 * torch.randn(D, device=dev)
        if pattern == "runtime":
            state = torch.randn(self.n_sets, B + 1, H, D, D, device=dev) * 0.3
            conv = torch.randn(self.n_sets, B + 1, W - 1, 3 * HD, device=dev).to(torch.bfloat16)
            slots = torch.arange(1, B + 1, device=dev, dtype=torch.int32)
            self.sets = [(state[i], conv[i], slots) for i in range(self.n_sets)]
        else:
            n_slots = self.n_sets * B + 1
            state = torch.randn(n_slots, H, D, D, device=dev) * 0.3
            conv = torch.randn(n_slots, W - 1, 3 * HD, device=dev).to(torch.bfloat16)
            perm = torch.randperm(n_slots - 1, device=dev) + 1
            self.sets = [(state, conv, perm[i * B:(i + 1) * B].to(torch.int32).contiguous())
                         for i in range(self.n_sets)]
        self.out = torch.empty(B, HD, device=dev, dtype=torch.bfloat16)
        self.cu = torch.arange(B + 1, device=dev, dtype=torch.int32)
        self.n_calls = max(self.n_sets, MIN_CALLS)

    def call_set(self, i):
        """(state pool, conv pool, slot indices) of call i."""
        return self.sets[i % self.n_sets]

    def args(self, i):
        """Keyword arguments of the kernel for call i."""
        state, conv, slots = self.call_set(i)
        return dict(q=self.q, k=self.k, v=self.v, g_out=self.g_out, f=self.f,
                    beta_raw=self.beta_raw, conv_weight=self.conv_weight, A_log=self.A_log,
                    dt_bias=self.dt_bias, norm_weight=self.norm_weight, eps=EPS,
                    lower_bound=LOWER_BOUND, state_pool=state, conv_pool=conv,
                    slot_idx=slots, conv_layout="SD", out=self.out)


def ours_calls(cell, cluster=None, pdl=False, min_blocks=0, early_rows=None, first_wave=None):
    """The cell's calls of the kernel with every launch choice explicit (cutedsl.launch_choices:
    the given ones, the launcher's defaults for the rest)."""
    from pdserve.kernels.kda_decode import cutedsl
    ch = cutedsl.launch_choices(cell.B, cell.H, pdl, torch.cuda.current_device(),
                                cluster=cluster, early_rows=early_rows, first_wave=first_wave,
                                min_blocks=min_blocks)
    return [lambda i=i: cutedsl.launch(**cell.args(i), pdl=pdl, **ch)
            for i in range(cell.n_calls)]


def parse_variant(name):
    """'c<C>' (a fixed cluster size C), 'e<R>' (R state row passes loaded before the PDL wait,
    `early_rows`; PDL only), 'w<N>' (the first N CTAs load every pass before the wait,
    `first_wave`; PDL only), in that order, any of them, e.g. 'c1e2w0' -> launch keywords."""
    from pdserve.kernels.kda_decode import cutedsl
    m = re.fullmatch(r"(?:c(\d+))?(?:e(\d+))?(?:w(\d+))?", name)
    kw = {}
    if m:
        for key, group in (("cluster", 1), ("early_rows", 2), ("first_wave", 3)):
            if m.group(group) is not None:
                kw[key] = int(m.group(group))
    if (not kw or kw.get("cluster", 1) not in cutedsl.CLUSTER_SIZES
            or not 0 <= kw.get("early_rows", 0) <= cutedsl.MAX_EARLY_ROWS):
        raise ValueError(f"variant {name!r}: expected c<C>, e<R>, w<N> or a combination in "
                         f"that order (c1e2w0), with C in {cutedsl.CLUSTER_SIZES}, R in "
                         f"0..{cutedsl.MAX_EARLY_ROWS} and N >= 0")
    return kw


def torch_conv(cell, i):
    """Stock conv part in torch: causal conv update + SiLU over [q|k|v], state rolled in place."""
    _, conv, slots = cell.call_set(i)
    x = torch.cat([cell.q, cell.k, cell.v], dim=1)                    # [B, 3HD]
    idx = slots.long()
    win = torch.cat([conv[idx], x[:, None]], dim=1)                   # [B, W, 3HD]
    conv[idx] = win[:, 1:]
    y = F.silu((win.float() * cell.conv_weight.t()[None]).sum(1)).to(torch.bfloat16)
    return y.view(cell.B, 3, cell.H, D)


def torch_norm(cell, o):
    of = o.float().view(cell.B, cell.H, D)
    of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + EPS) * cell.norm_weight
    cell.out.copy_((of * torch.sigmoid(cell.g_out.float().view(cell.B, cell.H, D))).view(cell.B, -1))


def fla_core(cell, i, qkv=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    B, H = cell.B, cell.H
    state, _, slots = cell.call_set(i)
    if qkv is None:
        q = cell.q.view(1, B, H, D)
        k = cell.k.view(1, B, H, D)
        v = cell.v.view(1, B, H, D)
    else:
        q, k, v = (qkv[:, i].reshape(1, B, H, D) for i in range(3))
    o, _ = fused_recurrent_kda_fwd(
        q=q, k=k, v=v, g=cell.f.view(1, B, H, D), beta=cell.beta_raw.view(1, B, H),
        A_log=cell.A_log, dt_bias=cell.dt_bias, scale=D ** -0.5,
        initial_state=state, inplace_final_state=True, state_v_first=True,
        cu_seqlens=cell.cu, ssm_state_indices=slots,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
        lower_bound=LOWER_BOUND)
    return o


def quick_check(cell):
    """One call of ours vs the reference on a copy of the pools (guards against timing garbage)."""
    from pdserve.kernels.kda_decode import kda_decode_cutedsl, kda_decode_reference
    a = cell.args(0)
    state, conv, s = a["state_pool"], a["conv_pool"], a["slot_idx"].long()
    st0, cv0 = state[s].clone(), conv[s].clone()
    ref_state, ref_conv = state.clone(), conv.clone()
    ref_out = torch.empty_like(cell.out)
    kda_decode_reference(**{**a, "state_pool": ref_state, "conv_pool": ref_conv, "out": ref_out})
    cell.out.fill_(float("nan"))
    kda_decode_cutedsl(**a)
    torch.cuda.synchronize()
    rel = lambda x, y: ((x.double() - y.double()).norm() / y.double().norm()).item()
    res = {"state_rel_err": rel(state[s], ref_state[s]),
           "out_rel_err": rel(cell.out, ref_out),
           "out_all_written": bool(not cell.out.isnan().any())}
    state[s] = st0                      # restore (not needed for timing, but tidy)
    conv[s] = cv0
    return res


def _pair(r: dict, plain: str, pdl: str) -> str:
    """"plain/pdl" microseconds, "-" for one not measured."""
    us = lambda k: f"{r[k]:.1f}" if k in r else "-"
    return f"{us(plain)}/{us(pdl)}"


def _best_cluster(r: dict) -> str | None:
    """"cluster:us" of the fastest cluster size in the sweep."""
    if "ours_us_by_cluster" not in r:
        return None
    c, t = min(r["ours_us_by_cluster"].items(), key=lambda kv: kv[1])
    return f"{c}:{t:.1f}"


def _variant(r: dict, name: str) -> str:
    t = r.get("variants_us", {}).get(name, {})
    return "err" if "error" in t else _pair(t, "plain", "pdl")


US = ".1f"
CELLS_TABLE = Table([
    "H", "B", Column("ours", "ours_us", US), Column("C", "cluster_default"),
    Column("best C", _best_cluster), Column("fla", "fla_us", US), Column("stock", "stock_us", US),
    Column("floor", "floor_us", ".2f"), Column("%floor", "frac_of_floor", ".0%"),
    Column("x stock", "speedup_vs_stock", ".2f"), Column("x fla", "speedup_vs_fla_core", ".2f"),
    Column("pdl", "ours_pdl_us", US), Column("%floor", "pdl_frac_of_floor", ".0%"),
    Column("rnd", "ours_random_slots_us", US), Column("pdl rnd", "ours_pdl_random_slots_us", US)])
MARGINAL_TABLE = Table([
    "H", "B", Column("floor", "floor_us", ".2f"), Column("ours", "ours_marginal_us", US),
    Column("pdl", "ours_pdl_marginal_us", US), Column("stock", "stock_marginal_us", US)])


def variants_table(names: list[str]) -> Table:
    """Plain / PDL microseconds of the launcher's default and of each named variant."""
    return Table(["H", "B", Column("floor", "floor_us", ".2f"),
                  Column("default", lambda r: _pair(r, "ours_us", "ours_pdl_us"))]
                 + [Column(v, lambda r, v=v: _variant(r, v)) for v in names])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    ap.add_argument("--name", default=None, help="result file name (default kda_decode_<device>)")
    ap.add_argument("--heads", type=int, nargs="*", default=list(HEADS))
    ap.add_argument("--batches", type=int, nargs="*", default=list(BATCHES))
    ap.add_argument("--no-cluster-sweep", action="store_true")
    ap.add_argument("--occupancy-sweep", action="store_true",
                    help="also time a register cap for 3 CTAs/SM (C = 1, 2; B*H >= 192)")
    ap.add_argument("--variants", nargs="*", default=[],
                    help="also time these kernel variants plain and with PDL and tabulate them "
                         "beside the default, e.g. c1 c2 c4 c8, e0 e2 e8 (state row passes "
                         "before the PDL wait), w0 w132 (CTAs that load every pass before it), "
                         "c1e4w0 (see parse_variant)")
    ap.add_argument("--no-stock", action="store_true", help="skip fla-core / torch stock timings")
    ap.add_argument("--no-random-slots", action="store_true",
                    help="skip ours with random slots over one pool (*_random_slots_us)")
    ap.add_argument("--marginal", action="store_true",
                    help="also time ours (plain, PDL) and stock per call with the graph's fixed "
                         "costs taken out (2N- vs N-call graphs; *_marginal_us in the JSON)")
    args = ap.parse_args(argv)
    variants = {name: parse_variant(name) for name in args.variants}   # fail before any timing
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    torch.backends.cuda.matmul.allow_tf32 = False
    from pdserve.kernels.kda_decode import cutedsl

    dev = torch.cuda.get_device_properties(0)
    bw = copy_bandwidth_GBps()
    print(f"device {dev.name}, copy bandwidth {bw:.0f} GB/s", flush=True)
    res = {"copy_GBps": bw,
           "config": {"K": D, "V": D, "conv_width": W, "lower_bound": LOWER_BOUND,
                      "conv_layout": "SD", "rotate_bytes": ROTATE_BYTES,
                      "timing": "median of 20 CUDA-graph replays / calls per graph",
                      "slots": "runtime: a pool per layer, slots 1..B in order; "
                               "*_random_slots_us: B random slots of one pool (module docstring)"},
           "cells": {}}
    for H in args.heads:
        for B in args.batches:
            key = f"H{H}_B{B}"
            cell = Cell(H, B, seed=H * 100 + B)
            state_bytes = 2 * B * H * D * D * 4
            r = {"H": H, "B": B, "floor_us": state_bytes / (bw * 1e9) * 1e6,
                 "launch_choices": cutedsl.launch_choices(B, H, False, 0),
                 "launch_choices_pdl": cutedsl.launch_choices(B, H, True, 0),
                 "cluster_default": cutedsl.choose_cluster(B, H),
                 "cluster_default_pdl": cutedsl.choose_cluster(B, H, pdl=True),
                 "calls_per_graph": cell.n_calls,
                 "slot_sets": cell.n_sets, "slot_pattern": cell.pattern}
            try:
                r.update(quick_check(cell))
                r["ours_us"] = graph_us_per_call(ours_calls(cell))
                r["ours_pdl_us"] = graph_us_per_call(ours_calls(cell, pdl=True))
                if args.marginal:
                    r["ours_marginal_us"] = graph_us_marginal(ours_calls(cell), r["ours_us"])
                    r["ours_pdl_marginal_us"] = graph_us_marginal(ours_calls(cell, pdl=True),
                                                                  r["ours_pdl_us"])
                if not args.no_cluster_sweep:
                    r["ours_us_by_cluster"] = {
                        str(c): graph_us_per_call(ours_calls(cell, c)) for c in cutedsl.CLUSTER_SIZES}
                    r["ours_pdl_us_by_cluster"] = {
                        str(c): graph_us_per_call(ours_calls(cell, c, True)) for c in (1, 2, 4)}
                    if args.occupancy_sweep and B * H >= 192:   # occupancy variants (register cap for 3 CTAs per SM)
                        r["ours_pdl_us_min_blocks3"] = {
                            str(c): graph_us_per_call(ours_calls(cell, c, True, 3)) for c in (1, 2)}
            except Exception as exc:  # noqa: BLE001
                r["ours_error"] = f"{type(exc).__name__}: {exc}"
                traceback.print_exc()
            for name, kw in variants.items():
                try:
                    r.setdefault("variants_us", {})[name] = {
                        mode: graph_us_per_call(ours_calls(cell, pdl=pdl, **kw))
                        for mode, pdl in (("plain", False), ("pdl", True))}
                except Exception as exc:  # noqa: BLE001
                    r.setdefault("variants_us", {})[name] = {"error": f"{type(exc).__name__}: {exc}"}
                    traceback.print_exc()
            try:
                if not args.no_stock:
                    calls = range(cell.n_calls)
                    r["fla_us"] = graph_us_per_call([lambda i=i: fla_core(cell, i) for i in calls])
                    r["torch_conv_us"] = graph_us_per_call(
                        [lambda i=i: torch_conv(cell, i) for i in calls])
                    o = fla_core(cell, 0)
                    r["torch_norm_us"] = graph_us_per_call([lambda: torch_norm(cell, o) for _ in calls])
                    stock = [lambda i=i: torch_norm(cell, fla_core(cell, i, torch_conv(cell, i)))
                             for i in calls]
                    r["stock_us"] = graph_us_per_call(stock)
                    if args.marginal:
                        r["stock_marginal_us"] = graph_us_marginal(stock, r["stock_us"])
            except Exception as exc:  # noqa: BLE001
                r["stock_error"] = f"{type(exc).__name__}: {exc}"
                traceback.print_exc()
            if not args.no_random_slots:
                cell = None                         # its pools go before the next ones come
                torch.cuda.empty_cache()
                try:
                    cell = Cell(H, B, seed=H * 100 + B, pattern="random")
                    r["ours_random_slots_us"] = graph_us_per_call(ours_calls(cell))
                    r["ours_pdl_random_slots_us"] = graph_us_per_call(ours_calls(cell, pdl=True))
                except Exception as exc:  # noqa: BLE001
                    r["random_slots_error"] = f"{type(exc).__name__}: {exc}"
                    traceback.print_exc()
            if "ours_us" in r:
                r["frac_of_floor"] = r["floor_us"] / r["ours_us"]
                r["achieved_GBps"] = state_bytes / (r["ours_us"] * 1e-6) / 1e9
                if "stock_us" in r:
                    r["speedup_vs_stock"] = r["stock_us"] / r["ours_us"]
                if "fla_us" in r:
                    r["speedup_vs_fla_core"] = r["fla_us"] / r["ours_us"]
            if "ours_pdl_us" in r:
                r["pdl_frac_of_floor"] = r["floor_us"] / r["ours_pdl_us"]
                if "stock_us" in r:
                    r["pdl_speedup_vs_stock"] = r["stock_us"] / r["ours_pdl_us"]
            res["cells"][key] = r
            print(key, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
            cell = None
            torch.cuda.empty_cache()

    res["eager_fallbacks"] = EAGER_FALLBACKS
    from mla_decode import device_tag
    out = write_result(args.name or f"kda_decode_{device_tag()}", res, args.out)

    cells = list(res["cells"].values())
    print(f"\nKDA decode step, {dev.name}, copy {bw:.0f} GB/s; us per call (CUDA graph), bounded gate, SD conv; "
          "slots as the runtime has them (rnd: random slots of one pool)")
    print(CELLS_TABLE.format(cells))
    if args.marginal:
        print("\nper call without the graph's fixed costs (2N- vs N-call graphs), us")
        print(MARGINAL_TABLE.format(cells))
    if args.variants:
        print("\nvariants, us per call plain / pdl (default: the launcher's choice)")
        print(variants_table(args.variants).format(cells))
    print(f"json: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
