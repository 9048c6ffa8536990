"""`pdserve capacity --config` / `pdserve check` predict what a live decode instance admits: on
the tiny preset at DCP 1, 2 and 4 (Ray rank actors, gloo, state over NIXL), requests of 30 + 994
tokens are admitted until the pools are full, and the next one is refused (PoolExhausted, the
router's 429), exactly the predicted count; DCP 2 and 4 admit 2x and 4x DCP 1 on the same
pools per rank. The same instances give the DCP 1 tokens at DCP 4 (greedy and seeded)."""
import asyncio
import time

import pytest

from pdserve.decode.capacity import pool_capacity
from pdserve.model.config import preset
from pdserve.model.sampling import Request, SamplingParams
from pdserve.state.block_table import Topology

from test_dcp import DCP_PARAMS, DCP_PROMPTS, _served
from test_disaggregated import LAYOUT, _collect, monolithic

PROMPT, OUTPUT = 30, 994        # 1,024 tokens reserved per request: 16 pages of 64 at DCP 1
NUM_PAGES, NUM_SLOTS = 33, 10   # 32 usable pages per rank; 9 slots


def predicted(dcp: int) -> int:
    return pool_capacity(NUM_PAGES, NUM_SLOTS, NUM_SLOTS - 1, Topology(dcp, dcp, 1),
                         LAYOUT.page_tokens, PROMPT, OUTPUT).admitted


def live_admitted(slot, handles, limit_s: float = 120.0) -> tuple[int, list[str]]:
    """Submit every handle at once; (how many the instance admitted, the refusals' errors).
    An admitted request keeps decoding (994 tokens) until every one is decided, then leaves
    (which cancels it)."""
    async def main():
        decided, done = [], asyncio.Event()

        async def probe(h):
            async for ev in slot.stream(h, h.request_id, deadline_s=limit_s):
                if ev.error is not None:
                    decided.append(ev.error)
                    break
                if ev.token is not None:
                    decided.append(None)
                    if len(decided) == len(handles):
                        done.set()
                    await asyncio.wait_for(done.wait(), limit_s)
                    break
            if len(decided) == len(handles):
                done.set()
        await asyncio.gather(*[probe(h) for h in handles])
        return decided
    got = asyncio.run(main())
    return got.count(None), [e for e in got if e is not None]


@pytest.fixture(scope="module")
def instances(ray_session):
    from concurrent.futures import ThreadPoolExecutor

    from pdserve.cluster.actors import start_instance
    config = preset("tiny")
    common = dict(config=config, layout=LAYOUT, seed=5, num_slots=NUM_SLOTS)
    started, slots = [], {}

    def start(c):  # c = 0: the prefill instance (TP 1); else a decode instance of DCP = TP = c
        if c == 0:
            return start_instance("prefill", "prefill-dcpcap", 0, 1, {**common, "num_pages": 24},
                                  0.25, 0, 120, threads=1)
        return start_instance("decode", f"decode-dcpcap-{c}", 0, c,
                              {**common, "num_pages": NUM_PAGES, "topology": Topology(c, c, 1)},
                              0.25, 0, 120, threads=1)
    try:
        with ThreadPoolExecutor(4) as pool:  # the instances start side by side
            futures = [pool.submit(start, c) for c in (0, 1, 2, 4)]
            for f in futures:
                try:
                    started.append(f.result())
                except Exception:
                    pass  # raised below, once every other start has ended
            if len(started) < 4:
                futures[[f.exception() is not None for f in futures].index(True)].result()
        pre, decs = started[0], dict(zip((1, 2, 4), started[1:]))
        for c, dec in decs.items():
            pre.ranks.call("connect", dec.agents)
            slots[c] = (dec, _served(dec, config, Topology(c, c, 1), max_batch=NUM_SLOTS - 1))
        yield config, pre, slots
    finally:
        for _, slot in slots.values():
            slot.close()
        for inst in started:
            inst.kill()


@pytest.mark.parametrize("dcp", [1, 2, 4])
def test_live_admission_equals_the_capacity_prediction(instances, dcp):
    config, pre, slots = instances
    dec, slot = slots[dcp]
    want = predicted(dcp)
    assert want == 2 * dcp  # the pages bind: 16 / dcp pages per request, 32 per rank
    params = SamplingParams(max_tokens=OUTPUT, ignore_eos=True)
    reqs = [Request(f"cap{dcp}-{i}", [(7 * i + t) % 256 for t in range(PROMPT)], params)
            for i in range(want + 1)]
    results = pre.ranks.call("prefill", reqs, pre.agents)[0]
    assert all(r.error is None for r in results), results
    admitted, refused = live_admitted(slot, [r.handle for r in results])
    assert admitted == want
    assert len(refused) == 1 and "no room" in refused[0], refused
    for r in results:  # the refused request's source state (the router cancels it so too)
        pre.ranks.call("cancel", r.handle.request_id)
    deadline = time.monotonic() + 30
    while not all(st["running"] == 0 and st["pages_free"] == st["pages_total"]
                  for st in dec.ranks.call("stats")):
        assert time.monotonic() < deadline, "cancelled requests' pages not freed"
        time.sleep(0.01)
    while any(st["held"] for st in pre.ranks.call("stats")):
        assert time.monotonic() < deadline, "source state not freed"
        pre.ranks.call("poll")
        time.sleep(0.01)


def test_check_and_capacity_print_the_same_admission_figure(tmp_path, capsys):
    from pdserve.cli import main
    cfg = tmp_path / "dcp.toml"
    cfg.write_text(f'mode = "disaggregated"\n[model]\nname = "tiny"\n[state]\n'
                   f'latent_dtype = "float32"\nconv_dtype = "float32"\n'
                   f'[prefill]\nnum_pages = 40\n[decode]\ntp = 4\ndcp = 4\ninterleave = 1\n'
                   f'num_pages = {NUM_PAGES}\nnum_slots = {NUM_SLOTS}\n')
    args = ["--config", str(cfg), "--context-tokens", str(PROMPT), "--output-tokens", str(OUTPUT)]
    assert main(["capacity", *args]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"admits {predicted(4)} concurrent request(s) of 1,024 tokens"), line
    assert main(["check", *args]) == 0
    # p = 1 -> d = 4 stages conv state: the admission in flight holds a second slot (9 - 1 = 8)
    assert line in capsys.readouterr().out.splitlines()


def test_dcp4_tokens_equal_dcp1(instances):
    """TP 4 / DCP 4 at interleave 1 from a TP 1 prefill: the 150-token prompt puts rows on all
    four ranks, the 1-token one on rank 0 only until it decodes."""
    config, pre, slots = instances
    dec, slot = slots[4]
    reqs = [Request(f"tok4-{i}", pr, sp) for i, (pr, sp) in enumerate(zip(DCP_PROMPTS, DCP_PARAMS))]
    results = pre.ranks.call("prefill", reqs, pre.agents)[0]
    assert all(r.error is None for r in results), results

    async def main():
        return await asyncio.gather(*[_collect(slot, r.handle) for r in results])
    assert asyncio.run(main()) == monolithic(config, DCP_PROMPTS, DCP_PARAMS)
