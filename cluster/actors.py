"""Ray actors: one per prefill, decode or monolithic rank, grouped into instances by placement
groups.

A rank actor hosts a `PrefillRank`, `DecodeRank` or `MonolithicRank`; TP ranks of an instance
join one torch.distributed group (gloo on CPU, NCCL on GPU) and are packed together (STRICT_PACK).
`RayRanks` drives an instance's actors in lockstep with a deadline on every call.
"""
from __future__ import annotations

import datetime
import socket
import threading
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pdserve.transfer.errors import PeerLost


class InstanceLost(PeerLost):
    """A rank actor of an instance died or stopped answering."""


@ray.remote
class RankActor:
    def __init__(self, role: str, instance: str, rank: int, world: int):
        self.role, self.instance, self.rank, self.world = role, instance, rank, world
        self.obj = None

    def address(self) -> tuple[str, int]:
        """A free TCP port on this node, for the TP group's rendezvous (rank 0)."""
        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

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
        if self.role == "prefill":
            from pdserve.prefill.engine import PrefillRank
            self.obj = PrefillRank(self.instance, self.rank, tp=tp, **kwargs)
        elif self.role == "decode":
            from pdserve.decode.rank import DecodeRank
            self.obj = DecodeRank(self.instance, self.rank, tp=tp, **kwargs)
        else:
            from pdserve.decode.rank import MonolithicRank
            self.obj = MonolithicRank(self.instance, self.rank, tp=tp, **kwargs)
        return {"pid": __import__("os").getpid(), "node": ray.util.get_node_ip_address()}

    def call(self, method: str, *args):
        return getattr(self.obj, method)(*args)


class RayRanks:
    """`RankGroup` over an instance's actors: every call has a deadline, and a dead or silent
    actor surfaces as `InstanceLost` naming the instance."""

    def __init__(self, name: str, actors: list, timeout_s: float):
        self.name, self.actors, self.timeout_s = name, actors, timeout_s
        self.size = len(actors)
        # Ray runs one submitter's calls to an actor in submission order. Submitting a call to
        # every rank under one lock keeps that order the same on all ranks when threads (a
        # prefill queue, the router's poller) call at once: a `poll` freeing state on rank 0
        # before a `prefill` but on rank 1 after it would give the ranks different slot ids for
        # one request, and the manifest carries rank 0's (seen as wrong tokens from TP2 prefill).
        self._submit = threading.Lock()

    def call(self, method: str, *args) -> list:
        with self._submit:
            refs = [a.call.remote(method, *args) for a in self.actors]
        return self._get(refs, method)

    def call_each(self, method: str, args: list[tuple]) -> list:
        with self._submit:
            refs = [a.call.remote(method, *x) for a, x in zip(self.actors, args, strict=True)]
        return self._get(refs, method)

    def _get(self, refs, method: str) -> list:
        try:
            return ray.get(refs, timeout=self.timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
            raise InstanceLost(f"instance {self.name}: a rank died during {method}: "
                               f"{type(exc).__name__}") from exc
        except ray.exceptions.GetTimeoutError as exc:
            for r in refs:
                ray.cancel(r, force=False)
            raise InstanceLost(f"instance {self.name}: {method} did not answer within "
                               f"{self.timeout_s} s") from exc
        except ray.exceptions.RayTaskError as exc:
            raise exc.as_instanceof_cause() from None


@dataclass
class Instance:
    role: str
    name: str
    generation: int
    ranks: RayRanks
    pg: object
    agents: list = field(default_factory=list)
    alive: bool = True

    def kill(self) -> None:
        self.alive = False
        for a in self.ranks.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass
        try:
            remove_placement_group(self.pg)
        except Exception:
            pass


ROLES = ("prefill", "decode", "monolithic")


def start_instance(role: str, name: str, generation: int, tp: int, kwargs: dict,
                   cpus: float, gpus: float, timeout_s: float, threads: int = 0) -> Instance:
    """Create the placement group and rank actors of one instance and set its ranks up."""
    if role not in ROLES:
        raise ValueError(f"instance {name}: role must be one of {', '.join(ROLES)}, got {role!r}")
    bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    pg = placement_group([bundle] * tp, strategy="STRICT_PACK", name=f"{name}-g{generation}")
    if not pg.wait(timeout_seconds=timeout_s):
        remove_placement_group(pg)
        raise RuntimeError(f"instance {name}: the cluster cannot place {tp} x {bundle} "
                           f"within {timeout_s} s (see `ray status`)")
    actors = [RankActor.options(
        num_cpus=cpus, num_gpus=gpus, name=f"{name}-r{r}-g{generation}",
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r),
    ).remote(role, name, r, tp) for r in range(tp)]
    ranks = RayRanks(name, actors, timeout_s)
    try:
        master = ray.get(actors[0].address.remote(), timeout=timeout_s)
        threads = threads or max(1, int(cpus + 0.999))
        ray.get([a.setup.remote(master, {**kwargs, "generation": generation}, threads)
                 for a in actors], timeout=timeout_s)
        # NIXL agents of the ranks; a monolithic rank transfers nothing and has none
        agents = [] if role == "monolithic" else ranks.call("info")
    except Exception:
        Instance(role, name, generation, ranks, pg).kill()
        raise
    return Instance(role, name, generation, ranks, pg, agents)
