"""Child-process targets for tests/test_child_process.py (importable by spawned children)."""
import os
import time

from pdserve.prefill.child import serve_child


def echo_main(conn, env):
    def build():
        return {"echo": lambda x: x, "env": lambda k: os.environ.get(k),
                "boom": lambda: 1 / 0, "sleep": time.sleep, "die": lambda: os._exit(3)}
    serve_child(conn, "echo", build, env)


def broken_main(conn):
    def build():
        raise ValueError("no engine today")
    serve_child(conn, "broken", build)
