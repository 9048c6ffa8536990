"""Typed transfer errors. Every failure of a transfer surfaces as one of these, with a message
that names the request, the peer and what was expected.

They are plain exception classes (any field beside the message has a default), so they pickle:
raised in a rank actor they reach the caller as themselves (`RayRanks` unwraps Ray's
`RayTaskError`), and the router decides on the class: `PeerLost` and the other transfer
failures are retried once; an `InstanceLost` (cluster.actors, a `PeerLost`) drops the instance
it names."""
from __future__ import annotations


class TransferError(RuntimeError):
    """Base class: the transfer did not complete; the destination allocation has been freed."""


class TopologyError(TransferError, ValueError):
    """The (source, destination) topology pair cannot be served."""


class TransferTimeout(TransferError):
    """The transfer did not finish within its deadline (sized by its bytes; not the request's
    deadline, which is `pdserve.decode.batcher.DeadlineExceeded`)."""


class PeerLost(TransferError):
    """The peer died, disconnected, or is a stale generation."""


class IntegrityError(TransferError):
    """The bytes that arrived are not the bytes that were sent, or are a zeroed KDA state."""


class LeaseExpired(TransferError):
    """The source state's lease expired before it was read."""


class TransferCancelled(TransferError):
    """The transfer was cancelled by the caller."""
