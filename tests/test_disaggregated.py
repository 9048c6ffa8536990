"""Reference prefill -> NIXL transfer -> decode runtime equals the monolithic generate loop
(in-process ranks for TP 1 -> 1; Ray rank actors with gloo TP groups for 2 -> 1 and 1 -> 2, the
decode instance running its own decode loop in its rank 0);
continuous batching, cancel and pool exhaustion; a transfer held at its source stalls no
running stream."""
import asyncio
import os
import signal
import time

import pytest
import ray

from pdserve.decode.batcher import Batcher
from pdserve.decode.instance import DecodeInstance, LocalRanks
from pdserve.decode.rank import DecodeRank
from pdserve.model.config import preset, reduced_kimi_k3, reduced_kimi_linear
from pdserve.model.generate import ReferenceEngine, build_model
from pdserve.model.sampling import Request, SamplingParams
from pdserve.prefill.engine import PrefillRank
from pdserve.state.block_table import Topology
from pdserve.state.layout import StateLayout
from pdserve.transfer.dest import TransferConfig

LAYOUT = StateLayout(latent_dtype="float32", conv_dtype="float32")
PROMPTS = [list(b"Disaggregated prefill"), list(b"x"), list(b"hybrid KDA + MLA state moves over NIXL")]
PARAMS = [SamplingParams(max_tokens=10), SamplingParams(max_tokens=6, temperature=0.9, seed=4),
          SamplingParams(max_tokens=8, temperature=0.7, top_p=0.8, top_k=40, seed=9)]


class Pair:
    """One prefill rank and one decode rank (TP 1 each) with their own NIXL agents."""

    def __init__(self, config, tag, decode_pages=128, decode_slots=8, verify=True):
        from pdserve.transfer.dest import TransferConfig
        self.prefill = PrefillRank(f"prefill{tag}", 0, 0, config, layout=LAYOUT, seed=5)
        self.rank = DecodeRank(f"decode{tag}", 0, config, layout=LAYOUT, seed=5,
                               num_pages=decode_pages, num_slots=decode_slots,
                               transfer=TransferConfig(verify=verify))
        self.prefill.connect([self.rank.info()])
        digests = lambda h, s, runs: self.prefill.digests(h.request_id, runs)
        eos = ReferenceEngine(self.prefill.engine.model).eos
        self.decode = DecodeInstance(f"decode{tag}", LocalRanks([self.rank]), LAYOUT, eos,
                                     digests=digests if verify else None)

    def handles(self, prompts, params, ids=None):
        ids = ids or [f"r{i}" for i in range(len(prompts))]
        reqs = [Request(i, p, sp) for i, p, sp in zip(ids, prompts, params)]
        results = self.prefill.prefill(reqs, [self.prefill.info()])
        assert all(r.error is None for r in results), results
        return [r.handle for r in results]

    def drain(self, timeout=5.0):
        end = time.monotonic() + timeout
        while self.prefill.seqs and time.monotonic() < end:
            self.prefill.poll()
            time.sleep(0.005)

    def close(self):
        self.rank.close()
        self.prefill.close()


def decode_to_end(decoder, seqs):
    """Decode `seqs` together until all finish, release them; their token lists."""
    while running := [s for s in seqs if not s.finished]:
        decoder.decode(running)
    for s in seqs:
        decoder.release(s)
    return [s.output for s in seqs]


_MONOLITHIC: dict[str, list] = {}


def monolithic(config, prompts, params):
    """The reference tokens, computed once per (config, prompts, params) for the test run (the
    reduced kimi-linear's take ~15 s on CI, and several tests compare against the same ones)."""
    key = repr((config, prompts, params))
    if key not in _MONOLITHIC:
        eng = ReferenceEngine(build_model(config, seed=5), LAYOUT)
        _MONOLITHIC[key] = [s.output for s in eng.generate(prompts, params)]
    return [list(out) for out in _MONOLITHIC[key]]


@pytest.mark.parametrize("name", ["tiny", "kimi-linear-reduced"])
def test_disaggregated_tokens_equal_monolithic(name):
    config = preset("tiny") if name == "tiny" else reduced_kimi_linear(4, 4, 2, vocab_size=512)
    prompts = PROMPTS if name == "tiny" else [[t % 512 for t in p] for p in PROMPTS]
    want = monolithic(config, prompts, PARAMS)
    pair = Pair(config, f"-eq-{name}")
    try:
        seqs = [pair.decode.admit(h) for h in pair.handles(prompts, PARAMS)]
        pair.drain()
        assert not pair.prefill.seqs, "source state not freed after the transfer"
        assert pair.prefill.engine.pools.empty
        assert decode_to_end(pair.decode, seqs) == want
        assert pair.rank.pools.empty
    finally:
        pair.close()


def test_step_rows_go_to_the_ranks_in_slot_order_and_tokens_stay_with_their_requests():
    """DecodeInstance.decode hands the ranks the step's rows in KDA slot order (the fused KDA
    kernel then walks the state pools in address order), whatever order the caller keeps."""
    config = preset("tiny")
    want = monolithic(config, PROMPTS, PARAMS)
    pair = Pair(config, "-order")
    seen = []
    rank_decode = pair.rank.decode

    def recording(request_ids, tokens, positions):
        seen.append(list(request_ids))
        return rank_decode(request_ids, tokens, positions)
    pair.rank.decode = recording
    try:
        seqs = [pair.decode.admit(h) for h in pair.handles(PROMPTS, PARAMS)]
        slots = {s.request_id: s.table.kda_slot for s in seqs}
        assert slots == {r: t.kda_slot for r, t in pair.rank.tables.items()}
        assert len(set(slots.values())) == 3
        shuffled = [seqs[2], seqs[0], seqs[1]]
        got = pair.decode.decode(shuffled)
        assert got == [s.output[-1] for s in shuffled]
        assert seen[0] == sorted(slots, key=slots.get)
        assert decode_to_end(pair.decode, shuffled) == [want[2], want[0], want[1]]
        assert all(ids == sorted(ids, key=slots.get) for ids in seen)
        assert pair.rank.pools.empty
    finally:
        pair.close()


RESHARD_CONFIGS = {"tiny": lambda: preset("tiny"),
                   "kimi-linear-reduced": lambda: reduced_kimi_linear(2, 4, 2, vocab_size=512),
                   "kimi-k3-reduced": lambda: reduced_kimi_k3(num_layers=5)}


@pytest.mark.parametrize("name,p,d", [("tiny", 2, 1), ("tiny", 1, 2),
                                      ("kimi-linear-reduced", 2, 1),
                                      ("kimi-linear-reduced", 1, 2), ("kimi-k3-reduced", 2, 1)])
def test_resharded_tokens_equal_monolithic(ray_session, p, d, name):
    """KDA state resharded by head (and the replicated latent read from one replica) between
    TP sizes, greedy and seeded; for kimi-linear a 2-layer reduced model (one KDA + dense MLP, one
    MLA + MoE) keeps it short; the reduced K3 (AttnRes, latent MoE, 96 heads) at 2 -> 1."""
    from pdserve.cluster.actors import SourceDigests, start_instance
    config = RESHARD_CONFIGS[name]()
    prompts = [[t % config.vocab_size for t in pr] for pr in PROMPTS]
    want = monolithic(config, prompts, PARAMS)
    common = dict(config=config, layout=LAYOUT, seed=5, num_pages=32, num_slots=8)
    start = lambda role, tp, **kw: start_instance(role, f"{role}-{name}-{p}to{d}", 0, tp,
                                                  {**common, **kw}, 0.5, 0, 120, threads=1)
    pre = start("prefill", p)
    dec = slot = None
    try:
        dec = start("decode", d, transfer=TransferConfig(verify=True))
        pre.ranks.call("connect", dec.agents)
        # the decode loop runs in the decode instance's rank 0, which asks the source's ranks
        # for digests itself
        slot = served(dec, config, digests=SourceDigests([pre]))
        reqs = [Request(f"r{i}", pr, sp) for i, (pr, sp) in enumerate(zip(prompts, PARAMS))]
        results = pre.ranks.call("prefill", reqs, pre.agents)[0]
        assert all(r.error is None for r in results), results

        async def main():
            return await asyncio.gather(*[_collect(slot, r.handle) for r in results])
        assert asyncio.run(main()) == want
        deadline = time.monotonic() + 10
        while not all(st["running"] == 0 and st["pages_free"] == st["pages_total"]
                      for st in dec.ranks.call("stats")):
            assert time.monotonic() < deadline, "decode state not freed on every rank"
            time.sleep(0.01)
        deadline = time.monotonic() + 10
        while any(st["held"] for st in pre.ranks.call("stats")):
            assert time.monotonic() < deadline, "source state not freed after the transfer"
            pre.ranks.call("poll")
            time.sleep(0.01)
    finally:
        if slot is not None:
            slot.close()
        for inst_ in (pre, dec):
            if inst_ is not None:
                inst_.kill()


def served(dec, config, max_batch=4, **engine):
    """The router's view (`DecodeSlot`) of Ray decode instance `dec` running its own decode
    loop in its rank 0 (`serve_decode`, as `pdserve serve` starts it)."""
    from pdserve.cluster.actors import serve_decode
    from pdserve.cluster.router import DecodeSlot
    engine = dict(layout=LAYOUT, eos={config.eos_token_id}, topology=Topology(dec.ranks.size),
                  **engine)
    return DecodeSlot(dec, serve_decode(dec, engine, max_batch, 16))


async def _collect(batcher, handle, delay=0.0, cancel_after=None, hold=None):
    """`handle`'s tokens from `batcher` (a `Batcher`, or a `DecodeSlot`: the same stream)."""
    await asyncio.sleep(delay)
    tokens = []
    async for ev in batcher.stream(handle, handle.request_id, deadline_s=60):
        if ev.token is not None:
            tokens.append(ev.token)
        if cancel_after is not None and len(tokens) >= cancel_after:
            if hold is not None:
                await hold.wait()  # keep the request running until told to let go
            break
        if ev.finish_reason:
            assert ev.error is None, ev.error
    return tokens


async def _until(check, what: str, limit_s: float = 120.0) -> None:
    """Wait for `check()` (a hang guard, not a timing requirement)."""
    give_up = time.monotonic() + limit_s
    while not await asyncio.to_thread(check):
        assert time.monotonic() < give_up, f"waited {limit_s} s for {what}"
        await asyncio.sleep(0.01)


def test_a_transfer_held_at_its_source_stalls_no_running_stream(ray_session):
    """Admission runs beside the steps: while a request's reads wait for its source (the
    prefill rank's process stopped, so the READs it serves cannot complete), a stream already
    running on the same decode instance (a Ray rank actor running its own decode loop) goes on
    getting tokens. Once the source goes on, the held request joins and both give the
    monolithic tokens."""
    from pdserve.cluster.actors import start_instance
    config = preset("tiny")
    reqs = [Request("running", list(b"a stream that keeps going"),
                    SamplingParams(max_tokens=120, ignore_eos=True)),
            Request("held", PROMPTS[2], PARAMS[2])]
    want = monolithic(config, [r.prompt for r in reqs], [r.params for r in reqs])
    common = dict(config=config, layout=LAYOUT, seed=5, num_pages=32, num_slots=8)
    start = lambda role, **kw: start_instance(role, f"{role}-held", 0, 1, {**common, **kw},
                                              0.5, 0, 120, threads=1)
    pre = start("prefill")
    dec = slot = stopped = None
    try:
        # the transfer deadline outlasts the hold: the test ends the hold, not the deadline
        dec = start("decode", transfer=TransferConfig(base_deadline_s=120))
        pre.ranks.call("connect", dec.agents)
        source_pid = ray.get(pre.ranks.actors[0].__ray_call__.remote(lambda _: os.getpid()))
        results = pre.ranks.call("prefill", reqs, pre.agents)[0]
        assert all(r.error is None for r in results), results
        running, held = [r.handle for r in results]
        slot = served(dec, config)
        got = {"running": [], "held": []}
        pages_free = lambda: dec.ranks.call("stats")[0]["pages_free"]

        async def collect(handle):
            async for ev in slot.stream(handle, handle.request_id, deadline_s=600):
                assert ev.error is None, ev.error
                if ev.token is not None:
                    got[handle.request_id].append(ev.token)

        async def main():
            nonlocal stopped
            first = asyncio.create_task(collect(running))
            await _until(lambda: got["running"], "the running stream's first token")
            before = pages_free()
            os.kill(source_pid, signal.SIGSTOP)
            stopped = source_pid
            second = asyncio.create_task(collect(held))
            # its admission has allocated: its reads are next, and they need the source
            await _until(lambda: pages_free() < before, "the held request's allocation")
            at = len(got["running"])
            await _until(lambda: len(got["running"]) >= at + 8, "8 more running tokens")
            assert not got["held"], ("the held request's state arrived while its source was "
                                     "stopped: this transport reads without the source")
            os.kill(source_pid, signal.SIGCONT)
            stopped = None
            await asyncio.gather(first, second)

        asyncio.run(main())
        assert [got["running"], got["held"]] == want
        assert all(st["running"] == 0 and st["pages_free"] == st["pages_total"]
                   for st in dec.ranks.call("stats"))
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        if slot is not None:
            slot.close()
        for inst in (pre, dec):
            if inst is not None:
                inst.kill()


def test_requests_joining_and_leaving_a_running_batch_keep_their_tokens():
    config = preset("tiny")
    prompts = PROMPTS * 2
    params = [SamplingParams(max_tokens=n, temperature=t, seed=i) for i, (n, t) in
              enumerate([(12, 0), (3, 0.8), (9, 0), (5, 1.0), (14, 0.5), (2, 0)])]
    alone = [monolithic(config, [p], [sp])[0] for p, sp in zip(prompts, params)]
    pair = Pair(config, "-batch", verify=False)
    batcher = Batcher(pair.decode, max_batch=4)
    try:
        handles = pair.handles(prompts, params)

        async def main():
            return await asyncio.gather(*[_collect(batcher, h, delay=0.01 * i)
                                          for i, h in enumerate(handles)])
        got = asyncio.run(main())
        assert got == alone
        assert batcher.steps > 0
        assert pair.rank.pools.empty
    finally:
        batcher.shutdown()
        pair.close()


def test_cancel_mid_generation_returns_pools_to_start_and_exhaustion_is_clean():
    config = preset("tiny")
    pair = Pair(config, "-cancel", decode_pages=4, decode_slots=3, verify=False)
    batcher = Batcher(pair.decode, max_batch=8)
    try:
        start = (pair.rank.pools.latent.num_free, pair.rank.pools.slots.num_free)
        big = SamplingParams(max_tokens=100)
        handles = pair.handles([list(b"a" * 60), list(b"b" * 60), list(b"c" * 10)],
                               [big, big, SamplingParams(max_tokens=5)])

        async def main():
            # the first takes 3 of 3 pages; the second cannot fit -> a clear error event
            hold = asyncio.Event()
            first = asyncio.create_task(_collect(batcher, handles[0], cancel_after=4, hold=hold))
            while batcher.running == 0:
                await asyncio.sleep(0.01)
            events = [ev async for ev in batcher.stream(handles[1], handles[1].request_id)]
            hold.set()
            tokens = await first
            return tokens, events
        tokens, events = asyncio.run(main())
        assert len(tokens) == 4
        assert events[-1].finish_reason == "error" and "no room for request r1" in events[-1].error
        deadline = time.monotonic() + 5
        while (pair.rank.pools.latent.num_free, pair.rank.pools.slots.num_free) != start:
            assert time.monotonic() < deadline, "cancel did not free the decode pools"
            time.sleep(0.01)
        # capacity is back: the third request runs to completion
        async def third():
            return await _collect(batcher, handles[2])
        assert asyncio.run(third()) == monolithic(config, [list(b"c" * 10)], [SamplingParams(max_tokens=5)])[0]
    finally:
        batcher.shutdown()
        pair.close()


def test_decode_side_ids_may_differ_from_the_source_ids():
    """vLLM numbers its requests itself, so a handle's request_id (ours) and its manifest's (the
    source's) differ; decode must key the request by ours, and the source must still hear (by its
    own id) that it was read. (Verify mode is off: the reference prefill rank looks digests up by
    the handle's id, which this test renames.)"""
    import msgspec
    config = preset("tiny")
    want = monolithic(config, PROMPTS[:2], PARAMS[:2])
    pair = Pair(config, "-ids", verify=False)
    try:
        handles = [msgspec.structs.replace(h, request_id=f"client-{i}")
                   for i, h in enumerate(pair.handles(PROMPTS[:2], PARAMS[:2]))]
        assert all(h.manifest.request_id != h.request_id for h in handles)
        seqs = [pair.decode.admit(h) for h in handles]
        assert sorted(pair.rank.tables) == ["client-0", "client-1"]
        assert decode_to_end(pair.decode, seqs) == want
        assert pair.rank.pools.empty
        pair.drain()
        assert not pair.prefill.seqs, "the source was not told (by its own id) that it was read"
    finally:
        pair.close()
