"""The spawned-child harness that runs each vLLM engine in its own process (pdserve.prefill.child):
replies, errors that name the stage, deadlines, and a child that dies."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from child_targets import broken_main, echo_main  # noqa: E402

from pdserve.prefill.child import Child, ChildFailed  # noqa: E402


def test_calls_errors_deadlines_and_death():
    with Child("echo", echo_main, {"PDSERVE_CHILD_T": "on"}, start_s=60, log=lambda m: None) as c:
        assert c.call("echo", [1, "two"]) == [1, "two"]
        assert c.call("env", "PDSERVE_CHILD_T") == "on"
        with pytest.raises(ChildFailed, match=r"stage 'echo: boom'[\s\S]*ZeroDivisionError"):
            c.call("boom")
        assert c.call("echo", 5) == 5                      # still serving after an error
        with pytest.raises(ChildFailed, match=r"died during 'die' \(exit code 3\)"):
            c.call("die", timeout=30)
    assert not c.proc.is_alive()
    c = Child("slow", echo_main, {}, start_s=60, log=lambda m: None)
    with pytest.raises(ChildFailed, match=r"no reply to 'sleep' within 0.5 s \(child stopped\)"):
        c.call("sleep", 30, timeout=0.5)
    assert not c.proc.is_alive()  # a late reply must not answer a later call


def test_a_failed_start_names_the_stage():
    with pytest.raises(ChildFailed, match=r"stage 'broken: start-up'[\s\S]*no engine today"):
        Child("broken", broken_main, start_s=60, log=lambda m: None)
