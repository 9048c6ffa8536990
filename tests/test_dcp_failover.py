"""A decode rank of a DCP group killed mid-stream (SIGKILL, real Ray and NIXL): its instance is
lost, the router resumes the request on the other decode instance (re-prefill of prompt + the
tokens streamed, same seed), and the client's stream carries the DCP 1 tokens with none
repeated or missing."""
import os
import signal
import time

import msgspec

from pdserve.cluster.config import ServeConfig, validate
from pdserve.cluster.serve import running_server

from ports import free_port
from test_self_healing import PROMPT, ray_session, reference, stream_in_thread  # noqa: F401

MAX_TOKENS = 64


def test_a_killed_dcp_rank_mid_stream_resumes_elsewhere_with_no_repeated_token():
    cfg = ServeConfig()
    cfg = msgspec.structs.replace(
        cfg,
        prefill=msgspec.structs.replace(cfg.prefill, instances=1, num_slots=9),
        decode=msgspec.structs.replace(cfg.decode, instances=2, tp=2, dcp=2, interleave=1,
                                       num_slots=9, max_batch=8),
        api=msgspec.structs.replace(cfg.api, port=free_port(), request_timeout_s=120),
        # no rebuild of the lost instance: the resume is what is tested, not the healer
        resources=msgspec.structs.replace(cfg.resources, cpus_per_rank=0.25, call_timeout_s=60,
                                          rebuild=False))
    model = validate(cfg)
    want = reference(PROMPT, MAX_TOKENS)
    with running_server(cfg, model, progress=lambda m: None) as (url, router):
        out: dict = {}
        t = stream_in_thread(url, PROMPT, MAX_TOKENS, out)
        deadline = time.monotonic() + 120
        while len(out.get("ids", [])) < 4:
            assert time.monotonic() < deadline and t.is_alive(), out
            time.sleep(0.02)
        busy = [s.inst for s in router.decode
                if any(st["running"] for st in s.inst.ranks.call("stats"))]
        assert len(busy) == 1, "the stream runs on one decode instance"
        os.kill(busy[0].pids[1], signal.SIGKILL)   # a follower: rank 0's next collective fails
        streamed_before = len(out["ids"])
        t.join(timeout=180)
        assert not t.is_alive(), "the stream did not end"
        assert out.get("status") == 200 and out.get("done"), out
        assert "errors" not in out, out["errors"]
        got = out["ids"]
        assert streamed_before < MAX_TOKENS, "the stream ended before the kill"
        assert len(got) == MAX_TOKENS, (len(got), MAX_TOKENS)
        assert got == want
