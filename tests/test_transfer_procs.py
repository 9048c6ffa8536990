"""Source and destination ranks in separate processes with real NIXL agents (UCX over DRAM):
READ, notification and source free end to end; a source killed mid-transfer gives a typed error
within the deadline and frees the destination; a restarted source (same name, new generation)
evicts its stale agent and serves new transfers."""
import multiprocessing as mp
import os
import signal
import sys
import time

import pytest

from pdserve.state.layout import RankShapes

sys.path.insert(0, os.path.dirname(__file__))
from transfer_procs import dest_main, source_main  # noqa: E402

SMALL = RankShapes(n_mla=2, n_kda=3, latent_width=576, kda_heads=32, head_dim=128, conv_taps=3,
                   tp=1, mla_heads=32)
# big enough that the READ takes a while on DRAM: 24 KDA layers x 8 MiB + 4 MLA layers x 32K tokens
BIG = RankShapes(n_mla=4, n_kda=24, latent_width=576, kda_heads=128, head_dim=128, conv_taps=3,
                 tp=1, mla_heads=32)

CTX = mp.get_context("spawn")


def recv(conn, timeout=60.0):
    if not conn.poll(timeout):
        raise TimeoutError(f"no answer within {timeout} s")
    return conn.recv()


class Proc:
    def __init__(self, target, *args):
        self.conn, child = CTX.Pipe()
        self.p = CTX.Process(target=target, args=(child, *args), daemon=True)
        self.p.start()
        self.ready = recv(self.conn)

    def ask(self, *msg, timeout=60.0):
        self.conn.send(msg)
        return recv(self.conn, timeout)

    def stop(self):
        if self.p.is_alive():
            try:
                self.conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
            self.p.join(10)
        if self.p.is_alive():
            self.p.kill()
            self.p.join(5)


def handshake(src, dst):
    assert src.ask("connect", dst.ready[1]) == ("ok",)
    assert dst.ask("connect", src.ready[1]) == ("ok",)


def test_end_to_end_read_notify_and_source_free_across_processes():
    src = Proc(source_main, "prefill", 0, SMALL, 300, 32)
    dst = Proc(dest_main, SMALL, 300, 32, True)
    try:
        handshake(src, dst)
        dst.conn.send(("receive", src.ready[2], "prefill"))
        msg = recv(dst.conn)
        while msg[0] == "need_digests":  # verify mode: the source hashes its ranges
            _, digests = src.ask("digests", "req-7", msg[1])
            dst.conn.send(("digests", digests))
            msg = recv(dst.conn)
        assert msg[0] == "done", msg
        _, stats, exact, _ = msg
        assert exact and stats["bytes"] > 0 and stats["verify_s"] >= 0
        event = recv(src.conn, 10)
        assert event[0] == "event" and event[1] == ("freed", "req-7")
        assert event[2:] == (2, 0)  # source pools back to the 2 pre-test pages, no slot
    finally:
        dst.stop()
        src.stop()


def test_killed_source_is_a_typed_error_within_the_deadline_then_restart_works():
    n = 32768
    src = Proc(source_main, "prefill", 0, BIG, n, 550)
    dst = Proc(dest_main, BIG, n, 550, False)
    try:
        handshake(src, dst)
        manifest = src.ready[2]
        dst.conn.send(("receive", manifest, "prefill"))
        time.sleep(0.02)
        os.kill(src.p.pid, signal.SIGKILL)
        msg = recv(dst.conn, 60)
        # ~0.35 GB: deadline = 3 s + bytes / 1 GB/s
        if msg[0] == "done":
            pytest.fail(f"the transfer finished before the kill ({msg[3]:.3f} s); make BIG bigger")
        _, etype, text, elapsed, freed, tb = msg
        assert etype in ("PeerLost", "TransferTimeout"), tb
        assert elapsed < 3.0 + 1.0 + 2.0, elapsed
        assert freed, "destination allocation not freed"

        # restart under the same instance name with a new generation: no crash, new agent used
        reborn = Proc(source_main, "prefill", 1, BIG, n, 550)
        try:
            handshake(reborn, dst)
            dst.conn.send(("receive", reborn.ready[2], "prefill"))
            msg = recv(dst.conn, 60)
            assert msg[0] == "done" and msg[2], msg
            # a handle from the dead generation is refused with PeerLost, not a crash
            reply = dst.ask("connect", src.ready[1])
            assert reply[:2] == ("error", "PeerLost") and "is stale" in reply[2]
        finally:
            reborn.stop()
    finally:
        dst.stop()
        src.stop()
