"""Free TCP ports for the tests' servers.

A port found free by bind(("127.0.0.1", 0)) lies in the kernel's ephemeral range, where every
outgoing connection (Ray's gRPC clients, workers) also takes its local port, so it can be gone by
the time the server binds it ("Address already in use"). These ports come from below that range
and above Ray's default worker ports (10002-19999), where nothing takes one on its own.
"""
import random
import socket

LOW = 20000


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768                     # the Linux default


def free_port() -> int:
    high = _ephemeral_start() - 1
    for _ in range(500):
        port = random.randint(LOW, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free TCP port in {LOW}..{high}")
