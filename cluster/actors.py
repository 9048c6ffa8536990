"""Ray actors: one per prefill, decode or monolithic rank, grouped into instances by placement
groups; or one per whole-instance engine (stock vLLM prefill).

A rank actor hosts a `PrefillRank` or a `DecodeRank` (a monolithic rank is a decode rank that
prefills locally); TP ranks of an instance join one torch.distributed group (gloo on CPU, NCCL
on GPU) and are packed together (STRICT_PACK).
`RayRanks` drives an instance's actors in lockstep with a deadline on every call. A rank actor
runs calls one at a time in its default concurrency group, and admission calls (`RayRanks
.admission`: allocate, receive, ...) in a group of their own, so a state transfer into a decode
rank runs while the rank goes on stepping its batch.

A decode instance runs its decode loop inside itself: its rank-0 actor hosts the instance's
`DecodeServer` (`RankHost.serve`: batcher, steps, sampling, streaming) and drives the other
ranks through torch.distributed (`cluster/lockstep.py`); the router reaches it through
`RemoteServer` (submit, cancel, stats, and one `events` call that carries every request's new
tokens), never per step.

A prefill instance runs its prefill loop inside itself too (`pdserve.prefill.server`): rank 0's
actor (or the engine actor) hosts its `PrefillServer`, which steps the ranks back to back (at
TP > 1 through the same step group: rank 0 broadcasts each call, the others follow) while the
router submits requests and reads their results through `RemotePrefill`, never a call per
chunk. The calls that change a rank's state between steps (`LOOP_CALLS`: poll, cancel, renew)
then go through the loop on rank 0, and the other ranks run them as rank 0 broadcasts them.

An engine actor hosts ONE object that is a whole prefill instance (`VllmPrefill`: vLLM spawns
and drives its own TP workers), in a placement group of one bundle with all of the instance's
GPUs. The router sees it as an instance of one rank (`RayRanks` over one actor, or `EngineRanks`
in-process) whose `info` lists every worker's NIXL agent: the calls it makes (`prefill`, `poll`,
`cancel`, `renew`, `stats`, `connect`) have the same signatures as a `PrefillRank`'s.

Ray is imported where it is used, so the router and `EngineRanks` run in a process without Ray
(tests/gpu/test_vllm_serve.py on the H200).
"""
from __future__ import annotations

import collections
import datetime
import functools
import importlib
import os
import socket
import sys
import threading
from dataclasses import dataclass, field
from typing import Callable

from pdserve.prefill.server import LOOP_CALLS, PrefillServer
from pdserve.transfer.errors import PeerLost


class InstanceLost(PeerLost):
    """A rank actor of instance `instance` died or stopped answering."""

    def __init__(self, message: str, instance: str | None = None):
        super().__init__(message)
        self.instance = instance


def remote_cause(exc: BaseException) -> BaseException:
    """The exception an actor method raised, out of the `RayTaskError` Ray wraps it in (its
    `.cause`: the original type with its fields); any other exception as it is."""
    ray = sys.modules.get("ray")  # no Ray loaded: nothing can be wrapped
    while (ray is not None and isinstance(exc, ray.exceptions.RayTaskError)
           and isinstance(exc.cause, BaseException) and exc.cause is not exc):
        exc = exc.cause
    return exc


# A rank actor's concurrency group for admission calls; one at a time, as the batcher admits.
ADMISSION = "admission"
# A decode instance's rank 0: the group its event stream (`DecodeServer.events`) is read in, so
# the router's waiting read holds up neither submissions nor stats.
STREAM = "stream"


@functools.cache
def _remote(cls, groups: tuple[tuple[str, int], ...] = ()):
    """`ray.remote(cls)` with these concurrency groups, made once on first use (Ray is imported
    only here)."""
    import ray

    return ray.remote(concurrency_groups=dict(groups))(cls) if groups else ray.remote(cls)


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


class RankHost:
    """Body of a rank actor (`RankActor()` is its Ray actor class)."""

    def __init__(self, role: str, instance: str, rank: int, world: int):
        self.role, self.instance, self.rank, self.world = role, instance, rank, world
        self.obj = None
        self.steps = None    # the instance's step group (TP > 1), see cluster/lockstep.py
        self.srv = None      # rank 0's `DecodeServer` or `PrefillServer`, once it serves
        self.led = False     # a prefill rank > 0 whose rank 0 serves: it follows every step
        self.served: collections.Counter = collections.Counter()  # calls taken, by method

    def address(self) -> tuple[str, int]:
        """A free TCP port on this node, for the TP group's rendezvous (rank 0)."""
        with socket.socket() as s:
            s.bind(("", 0))
            return _node_ip(), s.getsockname()[1]

    def setup(self, master: tuple[str, int], kwargs: dict, threads: int = 1) -> dict:
        import torch
        import torch.distributed as dist

        from pdserve.model.parallel import TPGroup

        torch.set_num_threads(max(1, threads))
        tp = TPGroup()
        if self.world > 1:
            backend = "nccl" if kwargs.get("device", "cpu").startswith("cuda") else "gloo"
            dist.init_process_group(backend, init_method=f"tcp://{master[0]}:{master[1]}",
                                    rank=self.rank, world_size=self.world,
                                    timeout=datetime.timedelta(seconds=120))
            tp = TPGroup.from_dist()
        from pdserve.cluster.lockstep import follow, step_group
        if self.role == "prefill":
            from pdserve.prefill.engine import PrefillRank
            self.obj = PrefillRank(self.instance, self.rank, tp=tp, **kwargs)
        else:
            from pdserve.decode.rank import DecodeRank
            self.obj = DecodeRank(self.instance, self.rank, tp=tp,
                                  local_prefill=self.role == "monolithic", **kwargs)
        if self.world > 1:
            self.steps = step_group(self.world)
            if self.rank > 0:  # a TP peer runs the steps its rank 0 broadcasts
                threading.Thread(target=follow, args=(self.obj, self.steps, self.instance),
                                 name="pdserve-follow", daemon=True).start()
        return {"pid": os.getpid(), "node": _node_ip()}

    def call(self, method: str, *args):
        self.served[method] += 1
        if self.role == "prefill" and method in LOOP_CALLS:
            if isinstance(self.srv, PrefillServer):  # between two steps, on every rank
                return self.srv.control(method, *args)
            if self.led:  # rank 0 runs it on this rank too, in step
                return None
        return getattr(self.obj, method)(*args)

    def lead(self) -> None:
        """A prefill rank > 0: from now on rank 0's loop drives this rank's state."""
        self.led = True

    def serve_prefill(self, peers: list, agents: list, timeout_s: float) -> None:
        """Rank 0 of a prefill instance: run its prefill loop here (`PrefillServer`), driving
        `peers` (the actors of ranks 1..) through the step group."""
        import ray

        from pdserve.cluster.lockstep import Lockstep

        if self.rank != 0 or self.role != "prefill":
            raise ValueError(f"instance {self.instance}: only a prefill instance's rank 0 runs "
                             f"a prefill loop (this is {self.role} rank {self.rank})")
        ray.get([p.lead.remote() for p in peers], timeout=timeout_s)
        self.srv = PrefillServer(self.instance, Lockstep(self.instance, self.obj, self.steps,
                                                         None), agents, timeout_s)

    def calls(self) -> dict[str, int]:
        """How many calls of each method this actor has taken (`call` and `server`)."""
        return dict(self.served)

    def serve(self, peers: list, engine: dict, max_batch: int, max_queue: int,
              timeout_s: float) -> None:
        """Rank 0 of a decode instance: run its decode loop here (`DecodeServer` over a
        `DecodeInstance` built with `engine`'s settings), driving `peers` (the actors of
        ranks 1..) through the step group and their admission group."""
        from pdserve.cluster.lockstep import Lockstep
        from pdserve.decode.instance import DecodeInstance
        from pdserve.decode.server import DecodeServer

        if self.rank != 0 or self.role == "prefill":
            raise ValueError(f"instance {self.instance}: only a decode instance's rank 0 "
                             f"serves (this is {self.role} rank {self.rank})")
        view = RayRanks(self.instance, peers, timeout_s, ADMISSION) if peers else None
        ranks = Lockstep(self.instance, self.obj, self.steps, view)
        inst = DecodeInstance(self.instance, ranks, local_prefill=self.role == "monolithic",
                              **engine)
        self.srv = DecodeServer(inst, max_batch, max_queue, self.obj.stats)

    def server(self, method: str, *args):
        """`method` of this rank's `DecodeServer` or `PrefillServer` (`RemoteServer`,
        `RemotePrefill` call it)."""
        self.served[method] += 1
        if self.srv is None:
            raise RuntimeError(f"instance {self.instance}: rank {self.rank} runs no loop")
        out = getattr(self.srv, method)(*args)
        return _portable(out) if method == "events" else out


def _portable(events: list) -> list:
    """`events` with every error that would not survive pickling replaced by one that does
    (same type name and message): one unpicklable exception must not break the stream that
    carries every request's tokens."""
    import pickle

    from pdserve.decode.batcher import TokenEvent

    out = []
    for ev in events:
        if ev.exc is not None:
            try:
                pickle.dumps(ev.exc)
            except Exception:
                ev = TokenEvent(ev.request_id, ev.token, ev.index, ev.finish_reason, ev.error,
                                RuntimeError(f"{type(ev.exc).__name__}: {ev.exc}"))
        out.append(ev)
    return out


def RankActor():
    return _remote(RankHost, ((ADMISSION, 1), (STREAM, 1)))


def engine_factory(path: str) -> Callable:
    """The callable named by a "module:attr" path (it builds a whole-instance engine)."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


class EngineHost:
    """Body of an engine actor: one whole prefill instance built by `factory(instance,
    generation, *args)` (a "module:attr" path, imported in the actor: vLLM is imported only
    here; or a picklable callable), with `env` set in the actor's process before it is built
    (vLLM reads its settings from the environment and its workers inherit it)."""

    def __init__(self, factory: str | Callable, instance: str, generation: int, args: tuple,
                 env: dict[str, str]):
        os.environ.update(env)
        build = engine_factory(factory) if isinstance(factory, str) else factory
        self.instance = instance
        self.obj = build(instance, generation, *args)
        self.srv: PrefillServer | None = None

    def ping(self) -> dict:
        return {"pid": os.getpid(), "node": _node_ip()}

    def call(self, method: str, *args):
        if self.srv is None:
            return getattr(self.obj, method)(*args)
        if method in LOOP_CALLS:  # between the loop's steps
            return self.srv.control(method, *args)
        return self.srv.ranks.call(method, *args)[0]  # not during a step (vLLM: one thread)

    def serve_prefill(self, peers: list, agents: list, timeout_s: float) -> None:
        """Run the instance's prefill loop here (`PrefillServer` over the engine, whose
        calls take turns with the loop's steps)."""
        self.srv = PrefillServer(self.instance, EngineRanks(self.instance, self.obj, timeout_s),
                                 agents, timeout_s)

    def server(self, method: str, *args):
        """`method` of the engine's `PrefillServer` (`RemotePrefill` calls it)."""
        if self.srv is None:
            raise RuntimeError(f"instance {self.instance}: the engine runs no prefill loop")
        return getattr(self.srv, method)(*args)


def EngineActor():
    return _remote(EngineHost, ((ADMISSION, 1), (STREAM, 1)))


class EngineRanks:
    """`RankGroup` of size 1 over a whole-instance engine in this process (no Ray): every call
    runs under one lock, as an actor runs them one at a time (a `vllm.LLM` is not thread-safe,
    and the router calls it from its prefill queue and its poller)."""

    size = 1

    def __init__(self, name: str, engine, timeout_s: float):
        self.name, self.engine, self.timeout_s = name, engine, timeout_s
        self.actors: list = []
        self._lock = threading.Lock()

    def call(self, method: str, *args) -> list:
        # the wait for a call already running is bounded like an actor call's answer
        if not self._lock.acquire(timeout=self.timeout_s):
            raise InstanceLost(f"instance {self.name}: {method} could not start within "
                               f"{self.timeout_s} s (another call still runs)", self.name)
        try:
            return [getattr(self.engine, method)(*args)]
        finally:
            self._lock.release()

    def call_each(self, method: str, args: list[tuple]) -> list:
        (one,) = args
        return self.call(method, *one)


class RayRanks:
    """`RankGroup` over an instance's actors: every call has a deadline, a dead or silent
    actor surfaces as `InstanceLost` naming the instance, and an exception a rank raised is
    raised here as itself (its type and fields, not Ray's wrapper)."""

    def __init__(self, name: str, actors: list, timeout_s: float, group: str | None = None):
        """`group`: the actors' concurrency group the calls run in (None: the default one)."""
        self.name, self.actors, self.timeout_s, self.group = name, actors, timeout_s, group
        self.size = len(actors)
        # Ray runs one submitter's calls to an actor in submission order. Submitting a call to
        # every rank under one lock keeps that order the same on all ranks when threads (a
        # prefill queue, the router's poller) call at once: a `poll` freeing state on rank 0
        # before a `prefill` but on rank 1 after it would give the ranks different slot ids for
        # one request, and the manifest carries rank 0's (seen as wrong tokens from TP2 prefill).
        self._submit = threading.Lock()

    @functools.cached_property
    def admission(self) -> RayRanks:
        """The same actors, called in their admission concurrency group (rank actors only)."""
        view = RayRanks(self.name, self.actors, self.timeout_s, ADMISSION)
        view._submit = self._submit  # one submission order per group, on every rank
        return view

    def _method(self, actor):
        return actor.call if self.group is None else actor.call.options(
            concurrency_group=self.group)

    def __reduce__(self):
        # shipped to a decode instance's rank 0 (digests from the sources): the same actors,
        # a submission lock of its own there
        return RayRanks, (self.name, self.actors, self.timeout_s, self.group)

    def call(self, method: str, *args) -> list:
        return self.call_each(method, [args] * self.size)

    def call_each(self, method: str, args: list[tuple]) -> list:
        return self.answers(self.submit_each(method, args), method)

    def submit_each(self, method: str, args: list[tuple]) -> list:
        """Start `method` on every rank with per-rank args; `answers` waits for them."""
        with self._submit:
            return [self._method(a).remote(method, *x)
                    for a, x in zip(self.actors, args, strict=True)]

    def call_one(self, rank: int, method: str, *args):
        """`method` on one rank only (same deadline and errors as `call`)."""
        with self._submit:
            ref = self._method(self.actors[rank]).remote(method, *args)
        return self.answers([ref], method)[0]

    def answers(self, refs, method: str, timeout_s: float | None = None) -> list:
        """The ranks' results of `refs`, within `timeout_s` (default: the call timeout)."""
        return _answers(self.name, refs, method, self.timeout_s if timeout_s is None
                        else timeout_s)


def _answers(name: str, refs, method: str, timeout_s: float) -> list:
    """`ray.get` with a deadline; a dead or silent actor is `InstanceLost` naming the instance,
    an exception raised in it is raised here as itself (its type and fields)."""
    import ray

    try:
        return ray.get(refs, timeout=timeout_s)
    except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
        raise InstanceLost(f"instance {name}: a rank died during {method}: "
                           f"{type(exc).__name__}", name) from exc
    except ray.exceptions.GetTimeoutError as exc:
        for r in refs:
            ray.cancel(r, force=False)
        raise InstanceLost(f"instance {name}: {method} did not answer within {timeout_s} s",
                           name) from exc
    except ray.exceptions.RayTaskError as exc:
        cause = remote_cause(exc)
        if cause is exc:  # a cause Ray could not carry: the wrapper says what it was
            raise
        raise cause from exc  # the remote traceback stays in the chain for logs


class RemoteServer:
    """A decode instance's `DecodeServer` in its rank-0 actor, as the router calls it: the
    same methods, each a Ray call with a deadline (`events` waits `wait_s` beyond it, in the
    actor's stream group); `cancel` does not wait (a lost instance holds nothing)."""

    def __init__(self, name: str, actor, timeout_s: float):
        self.name, self.actor, self.timeout_s = name, actor, timeout_s

    def _call(self, method: str, *args, group: str | None = None, wait_s: float = 0.0):
        fn = self.actor.server if group is None else self.actor.server.options(
            concurrency_group=group)
        return _answers(self.name, [fn.remote(method, *args)], method,
                        self.timeout_s + wait_s)[0]

    def submit(self, work, request_id: str, deadline_s: float | None = None) -> None:
        self._call("submit", work, request_id, deadline_s)

    def cancel(self, request_id: str) -> None:
        self.actor.server.remote("cancel", request_id)

    def events(self, wait_s: float) -> list:
        return self._call("events", wait_s, group=STREAM, wait_s=wait_s)

    def stats(self) -> dict:
        return self._call("stats")

    def sources(self, digests) -> None:
        self._call("sources", digests)

    def shutdown(self) -> None:
        self._call("shutdown")


class RemotePrefill(RemoteServer):
    """A prefill instance's `PrefillServer` in its rank-0 (or engine) actor, as the router
    calls it: `submit` does not wait (it runs in the actor's admission group; a failed one
    surfaces at the next `results`), `results` waits `wait_s` beyond the call deadline in the
    stream group, so neither queues behind a `LOOP_CALLS` call waiting for a step."""

    def __init__(self, name: str, actor, timeout_s: float):
        super().__init__(name, actor, timeout_s)
        self._submits: list = []
        self._lock = threading.Lock()

    def __reduce__(self):
        # shipped with its `Instance` (a decode rank 0's `SourceDigests`): the same actor
        return RemotePrefill, (self.name, self.actor, self.timeout_s)

    def submit(self, request, deadline_s: float | None = None,
               threads: int | None = None) -> None:
        ref = self.actor.server.options(concurrency_group=ADMISSION).remote(
            "submit", request, deadline_s, threads)
        with self._lock:
            self._submits.append(ref)

    def results(self, wait_s: float) -> list:
        import ray

        with self._lock:
            done, self._submits = ray.wait(self._submits, num_returns=len(self._submits),
                                           timeout=0) if self._submits else ([], [])
        if done:
            _answers(self.name, done, "submit", self.timeout_s)
        return self._call("results", wait_s, group=STREAM, wait_s=wait_s)


@dataclass
class Instance:
    """`ranks`: `RayRanks` (one actor per rank, or one engine actor), or in-process ranks.
    `engine`: one object speaks for every rank (`agents` has one entry per rank of the engine)."""
    role: str
    name: str
    generation: int
    ranks: object
    pg: object
    agents: list = field(default_factory=list)
    alive: bool = True
    engine: bool = False
    pids: list[int] = field(default_factory=list)  # the rank (or engine) actors' processes
    # a prefill instance's loop in its actor (`serve_prefill`); None: the router runs it
    server: object = None

    def digests(self, src_rank: int, request_id: str, runs) -> list[int]:
        """xxh3 digests of `runs` computed by source rank `src_rank` (transfer.verify)."""
        if self.engine:
            return self.ranks.call("digests", request_id, runs, src_rank)[0]
        if not getattr(self.ranks, "actors", None):  # in-process ranks
            return self.ranks.call_each("digests", [(request_id, runs)])[src_rank]
        return self.ranks.call_one(src_rank, "digests", request_id, runs)

    def kill(self) -> None:
        self.alive = False
        if not getattr(self.ranks, "actors", None):  # in-process ranks: close them
            try:
                self.ranks.call("close")
            except Exception:
                pass
            return
        import ray
        from ray.util.placement_group import remove_placement_group

        if self.engine:  # let the engine stop its own processes (vLLM's workers) first
            try:
                ray.get(self.ranks.actors[0].call.remote("close"), timeout=30)
            except Exception:
                pass
        for a in self.ranks.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass
        try:
            remove_placement_group(self.pg)
        except Exception:
            pass


class SourceDigests:
    """The `DigestSource` of a decode instance (transfer.verify): a handle's source rank
    hashes what will be read. Picklable, so a decode instance's rank 0 asks the sources itself."""

    def __init__(self, prefill: list[Instance]):
        self.by_name = {p.name: p for p in prefill}

    def __call__(self, handle, src_rank: int, runs) -> list[int]:
        return self.by_name[handle.instance].digests(src_rank, handle.request_id, runs)


ROLES = ("prefill", "decode", "monolithic")


def serve_decode(inst: Instance, engine: dict, max_batch: int, max_queue: int) -> RemoteServer:
    """Start the decode loop of a decode (or monolithic) instance in its rank-0 actor
    (`RankHost.serve`; `engine`: the `DecodeInstance` settings) and return its server."""
    actors = inst.ranks.actors
    inst.ranks.answers([actors[0].serve.remote(actors[1:], engine, max_batch, max_queue,
                                                inst.ranks.timeout_s)], "serve")
    return RemoteServer(inst.name, actors[0], inst.ranks.timeout_s)


def serve_prefill(inst: Instance) -> None:
    """Start a prefill instance's prefill loop in its rank-0 (or engine) actor and set
    `inst.server` to it; an in-process instance keeps None (the router runs its loop)."""
    actors = getattr(inst.ranks, "actors", None)
    if not actors:
        return
    inst.ranks.answers([actors[0].serve_prefill.remote(actors[1:], inst.agents,
                                                       inst.ranks.timeout_s)], "serve_prefill")
    inst.server = RemotePrefill(inst.name, actors[0], inst.ranks.timeout_s)


def start_instance(role: str, name: str, generation: int, tp: int, kwargs: dict,
                   cpus: float, gpus: float, timeout_s: float, threads: int = 0) -> Instance:
    """Create the placement group and rank actors of one instance and set its ranks up."""
    import ray

    if role not in ROLES:
        raise ValueError(f"instance {name}: role must be one of {', '.join(ROLES)}, got {role!r}")
    pg, actors = _placed_actors(
        name, generation, cpus, gpus, tp, timeout_s, f"{tp} rank(s)",
        lambda r, opts: RankActor().options(name=f"{name}-r{r}-g{generation}", **opts).remote(
            role, name, r, tp))
    ranks = RayRanks(name, actors, timeout_s)
    try:
        master = ray.get(actors[0].address.remote(), timeout=timeout_s)
        threads = threads or max(1, int(cpus + 0.999))
        ready = ray.get([a.setup.remote(master, {**kwargs, "generation": generation}, threads)
                         for a in actors], timeout=timeout_s)
        # NIXL agents of the ranks; a monolithic rank transfers nothing and has none
        agents = [] if role == "monolithic" else ranks.call("info")
    except Exception:
        Instance(role, name, generation, ranks, pg).kill()
        raise
    return Instance(role, name, generation, ranks, pg, agents, pids=[r["pid"] for r in ready])


def _placed_actors(name: str, generation: int, cpus: float, gpus: float, count: int,
                   timeout_s: float, what: str, make: Callable) -> tuple[object, list]:
    """A STRICT_PACK placement group of `count` bundles of (cpus, gpus) and one actor in each,
    made by `make(bundle index, actor options)`. If placement does not happen within
    `timeout_s`, or an actor cannot be created (arguments that do not pickle), whatever exists
    is given back and the error raised."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    pg = placement_group([bundle] * count, strategy="STRICT_PACK", name=f"{name}-g{generation}")
    if not pg.wait(timeout_seconds=timeout_s):
        remove_placement_group(pg)
        raise RuntimeError(f"instance {name}: the cluster cannot place {what} ({count} x "
                           f"{bundle}) on one node within {timeout_s} s (see `ray status`)")
    actors = []
    try:
        for i in range(count):
            actors.append(make(i, dict(num_cpus=cpus, num_gpus=gpus,
                                       scheduling_strategy=PlacementGroupSchedulingStrategy(
                                           pg, placement_group_bundle_index=i))))
    except Exception:
        for a in actors:
            ray.kill(a)
        remove_placement_group(pg)
        raise
    return pg, actors


def start_engine_instance(name: str, generation: int, factory: str | Callable, args: tuple,
                          cpus: float, gpus: int, timeout_s: float, start_timeout_s: float,
                          env: dict[str, str] | None = None) -> Instance:
    """One prefill instance run by a single engine actor (`EngineHost`) that holds all of its
    `gpus` (vLLM: TP workers it spawns itself, which inherit the actor's CUDA_VISIBLE_DEVICES).
    `start_timeout_s` bounds placement and the engine's start-up (vLLM: minutes on a cold Triton
    cache); `timeout_s` every later call."""
    import ray

    pg, (actor,) = _placed_actors(
        name, generation, cpus, gpus, 1, start_timeout_s, "one engine actor",
        lambda _, opts: EngineActor().options(name=f"{name}-engine-g{generation}", **opts).remote(
            factory, name, generation, tuple(args), dict(env or {})))
    ranks = RayRanks(name, [actor], timeout_s)
    inst = Instance("prefill", name, generation, ranks, pg, engine=True)
    try:
        try:  # the constructor (the engine's start-up) runs before any method call returns
            inst.pids = [ray.get(actor.ping.remote(), timeout=start_timeout_s)["pid"]]
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"instance {name}: the engine did not start within "
                               f"{start_timeout_s} s") from None
        except ray.exceptions.RayActorError as exc:
            raise RuntimeError(f"instance {name}: the engine failed to start: {exc}") from None
        inst.agents = ranks.call("info")[0]  # one AgentInfo per worker of the engine
    except Exception:
        inst.kill()
        raise
    return inst


def local_engine_instance(name: str, generation: int, engine, timeout_s: float) -> Instance:
    """The same instance over an engine object in this process (no Ray, no placement)."""
    ranks = EngineRanks(name, engine, timeout_s)
    return Instance("prefill", name, generation, ranks, None, ranks.call("info")[0], engine=True)
