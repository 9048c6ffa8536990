"""`PrefillServer`: a prefill instance's prefill loop, run inside the instance.

The loop owns the instance's scheduling. A caller `submit`s a request (no wait) and reads the
results of all of its requests through `results`, one call that waits for the next ones; the
loop runs prefill steps back to back while any prompt is in progress and hands each step the
requests that arrived since the last, so a chunked prefill (`pdserve.prefill.scheduler`) makes
no call per chunk: a chunk follows the one before at once, and a short prompt submitted while a
long one prefills joins the next step. Calls that change the ranks' state between steps
(`poll`, `cancel`, `renew`) run in the loop (`control`), so every TP rank sees them in the same
order as the steps. A request past its deadline is cancelled on the ranks and answered with an
error.

`ranks` is the instance as its rank 0 drives it, `call(method, *args)` -> per-rank results, rank
0's first: `Lockstep` in rank 0's actor (each call broadcast to the other ranks first), the
engine in an engine actor, or, where the loop runs in the router's process, the instance's
`RayRanks` or `EngineRanks`. A rank group that fails as a whole (`InstanceLost`: a TP peer or
the actor died) breaks the loop: `results` then raises it, and the caller routes elsewhere.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future

from pdserve.model.sampling import Request
from pdserve.transfer.errors import PeerLost

from pdserve.prefill.engine import PrefillResult

LOOP_CALLS = ("poll", "cancel", "renew")  # what `control` runs between steps
MAX_NEW = 16  # requests a step takes in (the rest wait for the next step)


class PrefillServer:
    def __init__(self, name: str, ranks, agents: list, timeout_s: float = 60.0):
        self.name, self.ranks, self.agents, self.timeout_s = name, ranks, agents, timeout_s
        self.steps = 0  # prefill steps run
        self._cv = threading.Condition()
        self._new: list[tuple[Request, float | None, int | None]] = []
        self._ops: list[tuple[str, tuple, Future]] = []
        self._done: list[PrefillResult] = []
        # in progress on the ranks: request id -> (deadline, torch threads asked for)
        self._open: dict[str, tuple[float | None, int | None]] = {}
        self._broken: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"prefill-{name}")
        self._thread.start()

    # -- what callers call --------------------------------------------------------------------
    def submit(self, request: Request, deadline_s: float | None = None,
               threads: int | None = None) -> None:
        """Queue `request` for the next step. `deadline_s`: from now, after which it is
        cancelled; `threads`: torch threads its steps may use (the caller knows when the
        host's other ranks idle; a step uses them only if every request in it asked)."""
        end = None if deadline_s is None else time.monotonic() + deadline_s
        with self._cv:
            self._check()
            self._new.append((request, end, threads))
            self._cv.notify_all()

    def results(self, wait_s: float) -> list[PrefillResult]:
        """The results finished since the previous call, waiting up to `wait_s` for one."""
        end = time.monotonic() + wait_s
        with self._cv:
            while not self._done and self._broken is None and not self._closed:
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            out, self._done = self._done, []
            if not out:
                self._check()
            return out

    def control(self, method: str, *args):
        """`method` of the ranks, run by the loop between two steps; rank 0's answer."""
        if method not in LOOP_CALLS:
            raise ValueError(f"{method!r} does not run in the prefill loop "
                             f"(only {', '.join(LOOP_CALLS)})")
        fut: Future = Future()
        with self._cv:
            self._check()
            self._ops.append((method, args, fut))
            self._cv.notify_all()
        return fut.result(self.timeout_s)

    def stats(self) -> dict:
        with self._cv:
            return {"queued": len(self._new), "prefilling": len(self._open), "steps": self.steps}

    def shutdown(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(self.timeout_s)

    # -- the loop -----------------------------------------------------------------------------
    def _check(self) -> None:
        if self._broken is not None:
            raise self._broken
        if self._closed:
            raise PeerLost(f"prefill instance {self.name}: its prefill loop has stopped")

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._new or self._ops or self._open or self._closed):
                    self._cv.wait()
                if self._closed:
                    break
                new, self._new = self._new[:MAX_NEW], self._new[MAX_NEW:]
                ops, self._ops = self._ops, []
            try:
                for method, args, fut in ops:
                    self._control(method, args, fut)
                self._expire(new)
                self._step(new)
            except BaseException as exc:  # the rank group failed as a whole: nothing runs now
                self._break(exc, ops)
                return
        self._break(PeerLost(f"prefill instance {self.name}: its prefill loop has stopped"), [])

    def _control(self, method: str, args: tuple, fut: Future) -> None:
        try:
            fut.set_result(self.ranks.call(method, *args)[0])
        except PeerLost as exc:
            fut.set_exception(exc)
            raise
        except Exception as exc:  # the call's own failure: its caller gets it
            fut.set_exception(exc)
            return
        if method == "cancel" and args[0] in self._open:  # it left the scheduler: answer it
            del self._open[args[0]]
            self._publish([PrefillResult(args[0], error=f"request {args[0]} was cancelled "
                                                        "while prefilling")])

    def _expire(self, new: list) -> None:
        """Cancel the requests whose deadline passed (those not started yet never start)."""
        now, late = time.monotonic(), []
        for item in list(new):
            if item[1] is not None and item[1] < now:
                new.remove(item)
                late.append(item[0].request_id)
        for rid, (end, _) in list(self._open.items()):
            if end is not None and end < now:
                self.ranks.call("cancel", rid)
                del self._open[rid]
                late.append(rid)
        if late:
            self._publish([PrefillResult(rid, error=f"request {rid}: prefill deadline passed",
                                         exc=TimeoutError(f"request {rid}: prefill deadline "
                                                          "passed"))
                           for rid in late])

    def _step(self, new: list) -> None:
        for req, end, threads in new:
            self._open[req.request_id] = (end, threads)
        if not self._open:
            return
        asks = {threads for _, threads in self._open.values()}
        threads = asks.pop() if len(asks) == 1 else None
        try:
            out = self.ranks.call("prefill", [r for r, _, _ in new], self.agents, threads)[0]
        except PeerLost:
            raise
        except Exception as exc:  # a failed step: its requests fail, the ranks drop them
            failed = list(self._open)
            self._open.clear()
            for rid in failed:
                try:
                    self.ranks.call("cancel", rid)
                except PeerLost:
                    raise
                except Exception:
                    pass  # the failure is what the request hears of
            self._publish([PrefillResult(rid, error=f"{type(exc).__name__}: {exc}", exc=exc)
                           for rid in failed])
            return
        self.steps += 1
        for res in out:
            self._open.pop(res.request_id, None)
        self._publish(out)

    def _publish(self, results: list[PrefillResult]) -> None:
        if results:
            with self._cv:
                self._done.extend(results)
                self._cv.notify_all()

    def _break(self, exc: BaseException, ops: list) -> None:
        broken = exc if isinstance(exc, PeerLost) else PeerLost(
            f"prefill instance {self.name}: its prefill loop failed: "
            f"{type(exc).__name__}: {exc}")
        with self._cv:
            self._broken = broken
            ops += self._ops
            self._ops = []
            self._cv.notify_all()
        for _, _, fut in ops:
            if not fut.done():
                fut.set_exception(broken)
