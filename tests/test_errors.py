"""Errors cross Ray as types and the router decides on the type, never on the message.

Tiny rank actors (real Ray, on a local cluster this module starts) raise each error where the
real ranks raise it: a transfer deadline, a lost peer or instance, an exhausted pool, a failed
integrity check, a bad request. The real `Router`, `RayRanks`, a `DecodeServer` (its `Batcher`)
and a `DecodeInstance` that prefills locally (monolithic) sit on top. Every error's message is the
same decoy naming every other kind, so any decision taken from the text would be wrong."""
from __future__ import annotations

import asyncio
import pickle
import sys
import time

import httpx
import pytest
import ray

from pdserve.api.backend import BackendUnavailable, BadRequest, DeadlineExceeded, Overloaded
from pdserve.api.server import create_app
from pdserve.api.serving import serve_in_thread
from pdserve.api.tokenizer import ByteLevelTokenizer
from pdserve.cluster.actors import ADMISSION, Instance, InstanceLost, RayRanks, remote_cause
from pdserve.cluster.router import DecodeSlot, Router
from pdserve.decode.instance import DecodeInstance
from pdserve.decode.server import DecodeServer
from pdserve.model.generate import Sequence
from pdserve.model.sampling import Request, SamplingParams
from pdserve.prefill.engine import PrefillResult
from pdserve.prefill.handle import StateHandle
from pdserve.state.block_table import BlockTable
from pdserve.state.pools import PoolExhausted
from pdserve.transfer.errors import IntegrityError, PeerLost, TransferError, TransferTimeout

# Ray workers cannot import this test module: ship the fake ranks by value (the errors they
# raise are pdserve's own classes, imported there by reference).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

DECOY = "PoolExhausted InstanceLost PeerLost deadline exceeded zeroed state bad request"
TOKENS = 8
CALL_TIMEOUT_S = 30.0


def error(kind: str, instance: str) -> BaseException:
    """One error of each kind, as the real layers raise it (all with the decoy message)."""
    return {
        "transfer_deadline": lambda: TransferTimeout(DECOY),
        "peer_lost": lambda: PeerLost(DECOY),
        "instance_lost": lambda: InstanceLost(DECOY, instance),
        "pool_exhausted": lambda: PoolExhausted(DECOY),
        "integrity": lambda: IntegrityError(DECOY),
        "value_error": lambda: ValueError(DECOY),       # a rank's word for a bad request
        "bad_request": lambda: BadRequest(DECOY, 422),
    }[kind]()


class _Faults:
    """Errors scheduled per method: the next `count` calls (after `after` good ones) raise.
    Output position p gets token 100 + p, whichever rank produces it, so a retried or resumed
    request streams exactly the tokens of an undisturbed one."""

    def __init__(self, instance: str):
        self.instance, self.plans, self.calls = instance, {}, {}
        self.offsets: dict[str, int] = {}  # request id -> its first output position
        self.delay = 0.0

    def call(self, method: str, *args):
        self.calls[method] = self.calls.get(method, 0) + 1
        return getattr(self, method)(*args)

    def plan(self, method: str, kind: str, count: int = 1, after: int = 0,
             names: str | None = None) -> None:
        """`names`: the instance an InstanceLost names (default: this one)."""
        self.plans[method] = [kind, count, after, names or self.instance]

    def count(self, method: str) -> int:
        return self.calls.get(method, 0)

    def _fault(self, method: str) -> BaseException | None:
        plan = self.plans.get(method)
        if plan is None or plan[1] == 0:
            return None
        if plan[2] > 0:
            plan[2] -= 1
            return None
        plan[1] -= 1
        return error(plan[0], plan[3])

    def _raise(self, method: str) -> None:
        exc = self._fault(method)
        if exc is not None:
            raise exc


class FaultyPrefill(_Faults):
    """A prefill rank: the first token and a handle without state; a scheduled error either
    fails the whole call (raised) or comes back in the request's result (as a real rank's
    refusal does)."""

    def prefill(self, requests, agents, threads=None):
        self._raise("prefill_call")
        out = []
        for r in requests:
            exc = self._fault("prefill")
            if exc is not None:
                out.append(PrefillResult(r.request_id, error=f"{type(exc).__name__}: {exc}",
                                         exc=exc))
                continue
            out.append(PrefillResult(r.request_id, StateHandle(
                r.request_id, self.instance, 0, [], None, 100 + r.params.position_offset,
                r.params, len(r.prompt), time.time() + 30)))
        return out

    def poll(self):
        return []

    def cancel(self, request_id):
        return None


class FaultyDecode(_Faults):
    """A decode (or monolithic) rank: `receive` stands for the transfer, `decode` for a step."""

    def stats(self):
        return {"pages_free": 10}

    def receive(self, request_id, position_offset):
        self._raise("receive")
        self.offsets[request_id] = position_offset

    def admit(self, request):
        self._raise("admit")
        self.offsets[request.request_id] = request.params.position_offset
        return 1

    def prefill(self, request_ids, threads=None):
        return [100 + self.offsets[r] for r in request_ids]

    def decode(self, request_ids, tokens, positions):
        self._raise("decode")
        time.sleep(self.delay)
        return [100 + self.offsets[r] + p for r, p in zip(request_ids, positions)]

    def slow(self, seconds):
        self.delay = seconds

    def free(self, request_id):
        return None


class TransferEngine(DecodeInstance):
    """`DecodeInstance`'s admission without state: the transfer is one call into the rank."""

    def _receive(self, handle: StateHandle) -> Sequence:
        self.ranks.call("receive", handle.request_id, handle.params.position_offset)
        return Sequence(handle.request_id, [], handle.params, BlockTable([[]], 1, [], 0),
                        [handle.first_token], handle.finished)


@pytest.fixture(scope="module")
def local_ray():
    """A Ray cluster of this module's own; one that is already running is not ours to use."""
    if ray.is_initialized():
        pytest.skip("a Ray session this module did not start is running")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def instance(role: str, name: str, cls) -> Instance:
    # the admission concurrency group of a real rank actor (`RankActor`): admission calls it
    actor = ray.remote(num_cpus=0, concurrency_groups={ADMISSION: 1})(cls).remote(name)
    return Instance(role, name, 0, RayRanks(name, [actor], CALL_TIMEOUT_S), None)


def plan(inst: Instance, method: str, kind: str, count: int = 1, after: int = 0,
         names: str | None = None) -> None:
    ray.get(inst.ranks.actors[0].call.remote("plan", method, kind, count, after, names))


def calls(inst: Instance, method: str) -> int:
    return ray.get(inst.ranks.actors[0].call.remote("count", method))


def slot(inst: Instance, engine: DecodeInstance) -> DecodeSlot:
    """The instance's decode loop in this process (`DecodeServer`, as `assemble` runs it over
    in-process ranks) over the fake rank actor: every rank error crosses Ray as it would."""
    return DecodeSlot(inst, DecodeServer(engine, 4, 16, lambda: inst.ranks.call("stats")[0]))


class Cluster:
    def __init__(self, prefill: int = 1, decode: int = 1, monolithic: bool = False):
        if monolithic:
            self.prefill = []
            self.decode = [instance("monolithic", f"mono-{i}", FaultyDecode) for i in range(decode)]
            slots = [slot(d, DecodeInstance(d.name, d.ranks, None, set(), local_prefill=True))
                     for d in self.decode]
        else:
            self.prefill = [instance("prefill", f"prefill-{i}", FaultyPrefill)
                            for i in range(prefill)]
            self.decode = [instance("decode", f"decode-{i}", FaultyDecode) for i in range(decode)]
            slots = [slot(d, TransferEngine(d.name, d.ranks, None, set())) for d in self.decode]
        self.router = Router("tiny", 4096, self.prefill, slots, max_queue=16)

    def run(self, max_tokens: int = TOKENS, deadline_s: float | None = 30.0, rid: str = "r"):
        """(tokens, last event) of one request through the router."""
        async def go():
            req = Request(rid, [104, 105], SamplingParams(max_tokens=max_tokens))
            events = [ev async for ev in self.router.generate(req, deadline_s)]
            return [e.token for e in events if e.token is not None], events[-1]
        return asyncio.run(go())

    def close(self) -> None:
        asyncio.run(self.router.close())
        for inst in self.prefill + self.decode:
            for a in inst.ranks.actors:
                ray.kill(a)


@pytest.fixture
def cluster(local_ray):
    made = []

    def make(**kw) -> Cluster:
        made.append(Cluster(**kw))
        return made[-1]
    yield make
    for c in made:
        c.close()


FULL = [100 + p for p in range(TOKENS)]  # an undisturbed request's tokens


# -- the types and their fields survive pickling (what Ray does to them) ---------------------
@pytest.mark.parametrize("exc,fields", [
    (TransferTimeout("t"), {}), (PeerLost("p"), {}), (IntegrityError("i"), {}),
    (InstanceLost("l", "decode-3"), {"instance": "decode-3"}), (PoolExhausted("x"), {}),
    (BadRequest("b", 422), {"status": 422}), (Overloaded("o", 2.5), {"retry_after": 2.5}),
    (BackendUnavailable("u", 7.0), {"retry_after": 7.0}), (DeadlineExceeded("d"), {}),
], ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else "")
def test_error_types_pickle_with_their_fields(exc, fields):
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc) and str(back) == str(exc)
    assert {k: getattr(back, k) for k in fields} == fields


def test_a_rank_error_reaches_the_caller_as_itself(cluster):
    c = cluster()
    d = c.decode[0]
    plan(d, "receive", "instance_lost")
    with pytest.raises(InstanceLost) as info:
        d.ranks.call("receive", "x", 0)
    assert type(info.value) is InstanceLost and info.value.instance == "decode-0"
    assert str(info.value) == DECOY  # not Ray's wrapper and its traceback
    assert isinstance(info.value.__cause__, ray.exceptions.RayTaskError)
    assert remote_cause(info.value.__cause__) is info.value
    plan(d, "receive", "bad_request")
    with pytest.raises(BadRequest) as info:
        d.ranks.call("receive", "x", 0)
    assert info.value.status == 422


# -- disaggregated: the router's decision per type ----------------------------------------------
@pytest.mark.parametrize("kind,cls", [("transfer_deadline", TransferTimeout),
                                      ("integrity", IntegrityError), ("peer_lost", PeerLost)])
def test_a_transfer_failure_is_retried_once(cluster, kind, cls):
    c = cluster()
    plan(c.decode[0], "receive", kind)
    tokens, last = c.run()
    assert tokens == FULL and last.finish_reason == "length"
    assert c.router.retries == 1 and calls(c.prefill[0], "prefill") == 2  # a fresh prefill
    assert c.decode[0].alive  # a lost source peer is no reason to drop the decode instance

    c.router.retries = 0
    plan(c.decode[0], "receive", kind, count=2)  # the retry fails too: an error event
    tokens, last = c.run(rid="again")
    # each prefill's first token streams before its transfer: two tokens, then the error
    assert tokens == FULL[:2] and last.finish_reason == "error" and isinstance(last.exc, cls)
    assert c.router.retries == 1 and c.decode[0].alive


def test_a_lost_decode_instance_is_dropped_and_the_request_re_prefilled(cluster):
    c = cluster(decode=2)
    plan(c.decode[0], "receive", "instance_lost")  # decode-0 is picked first (same stats)
    tokens, last = c.run()
    assert tokens == FULL and last.finish_reason == "length"
    assert not c.decode[0].alive and c.decode[1].alive
    assert c.router.retries == 0 and c.router.resumed == 1
    assert calls(c.prefill[0], "prefill") == 2


def test_a_decode_instance_lost_mid_stream_resumes_without_repeating(cluster):
    c = cluster(decode=2)
    plan(c.decode[0], "decode", "instance_lost", after=3)
    tokens, last = c.run()
    assert last.finish_reason == "length" and len(tokens) == TOKENS
    assert tokens == FULL  # decode-0 streamed four, decode-1 the rest
    assert not c.decode[0].alive and c.router.resumed == 1


def test_a_lost_instance_of_the_other_role_is_the_one_dropped(cluster):
    """An `InstanceLost` that names the prefill instance (its digests call failed during the
    transfer, say) drops that instance, not the decode instance that saw it."""
    c = cluster(prefill=2)
    plan(c.decode[0], "receive", "instance_lost", names="prefill-0")
    tokens, last = c.run()
    assert tokens == FULL and last.finish_reason == "length"
    assert not c.prefill[0].alive and c.prefill[1].alive and c.decode[0].alive


def test_a_lost_prefill_instance_sends_the_prefill_elsewhere(cluster):
    c = cluster(prefill=2)
    plan(c.prefill[0], "prefill_call", "instance_lost")
    tokens, last = c.run()
    assert tokens == FULL and last.finish_reason == "length"
    assert not c.prefill[0].alive and c.prefill[1].alive


def test_a_full_decode_pool_after_the_first_token_is_an_error_event(cluster):
    c = cluster()
    plan(c.decode[0], "receive", "pool_exhausted")
    tokens, last = c.run()
    assert tokens == FULL[:1] and last.finish_reason == "error"
    assert isinstance(last.exc, PoolExhausted) and "instances are full" in last.error
    assert c.router.retries == 0 and calls(c.prefill[0], "cancel") == 1  # source state freed


def test_a_full_prefill_pool_is_overloaded(cluster):
    c = cluster()
    plan(c.prefill[0], "prefill", "pool_exhausted", count=1000)
    t0 = time.monotonic()
    with pytest.raises(Overloaded) as info:
        c.run(deadline_s=3.0)
    assert isinstance(info.value.__cause__, PoolExhausted) and time.monotonic() - t0 < 15


@pytest.mark.parametrize("kind,status", [("value_error", 400), ("bad_request", 422)])
def test_a_bad_request_at_prefill_is_refused_not_retried(cluster, kind, status):
    c = cluster(prefill=2)
    plan(c.prefill[0], "prefill", kind)
    plan(c.prefill[1], "prefill", kind)
    with pytest.raises(BadRequest) as info:
        c.run()
    assert info.value.status == status
    assert calls(c.prefill[0], "prefill") + calls(c.prefill[1], "prefill") == 1
    assert all(p.alive for p in c.prefill) and c.router.retries == 0


def test_the_request_deadline_is_not_retried(cluster):
    c = cluster()
    ray.get(c.decode[0].ranks.actors[0].call.remote("slow", 0.3))
    tokens, last = c.run(max_tokens=100, deadline_s=1.5)
    assert last.finish_reason == "error" and isinstance(last.exc, DeadlineExceeded)
    assert 1 < len(tokens) < 100 and c.router.retries == 0 and c.decode[0].alive


# -- monolithic: the same decisions over a DecodeInstance that prefills locally ----------------
def test_monolithic_refusals_by_type(cluster):
    c = cluster(decode=2, monolithic=True)
    plan(c.decode[0], "admit", "pool_exhausted")
    with pytest.raises(Overloaded):
        c.run(rid="full")
    plan(c.decode[0], "admit", "value_error")
    with pytest.raises(BadRequest) as info:
        c.run(rid="bad")
    assert info.value.status == 400 and isinstance(info.value.__cause__, ValueError)
    plan(c.decode[0], "admit", "transfer_deadline")  # a failure of no monolithic kind
    tokens, last = c.run(rid="odd")
    assert last.finish_reason == "error" and isinstance(last.exc, TransferError)
    assert c.router.retries == 0 and all(d.alive for d in c.decode)
    plan(c.decode[0], "admit", "instance_lost")
    tokens, last = c.run(rid="lost")
    assert tokens == FULL and last.finish_reason == "length"
    assert not c.decode[0].alive and c.decode[1].alive


# -- and the HTTP answers they become -------------------------------------------------------------
def test_http_status_follows_the_type(cluster):
    c = cluster(monolithic=True)
    app = create_app(c.router, ByteLevelTokenizer(), request_timeout_s=30)
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
    with serve_in_thread(app, startup_s=10, shutdown_s=10) as url:
        plan(c.decode[0], "admit", "pool_exhausted")
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 429 and "Retry-After" in r.headers
        plan(c.decode[0], "admit", "bad_request")
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 422 and r.json()["error"]["message"].endswith(DECOY)
        plan(c.decode[0], "admit", "value_error")
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 400
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
        plan(c.decode[0], "admit", "instance_lost")  # the only instance: 503 from then on
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 503 and "Retry-After" in r.headers
        assert httpx.get(f"{url}/health", timeout=10).status_code == 503
