"""Which transport an address names, for both ends of a connection.

* a path (or ``unix:PATH``): a Unix ``SOCK_SEQPACKET`` socket; batches in
  shared memory passed at attach (:class:`~.wire.Channel`, :mod:`.slots`);
* ``tcp://HOST:PORT``: a TCP stream; batches inline after their records
  (:class:`~.tcp.StreamChannel`, :class:`~.slots.StreamBuffers`).
"""

from __future__ import annotations

import socket
from typing import Any, Callable

from .slots import ConsumerMapping, StreamBuffers
from .tcp import StreamChannel, connect_tcp
from .wire import BatchCheck, Channel, WireError, check_slot_offer

__all__ = ["connect", "consumer_slots", "is_tcp"]


def is_tcp(address: str) -> bool:
    """True if ``address`` names a TCP service (``tcp://HOST:PORT``)."""
    return address.startswith("tcp://")


def connect(address: str, timeout: float, peer: str) -> Channel | StreamChannel:
    """A channel to the service at ``address`` (its socket's timeout: ``timeout``).

    Raises:
        ValueError: a malformed TCP address.
        OSError: no service there.
    """
    if is_tcp(address):
        return StreamChannel(connect_tcp(address, timeout), peer)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(timeout)
    try:
        sock.connect(address)
    except OSError:
        sock.close()
        raise
    return Channel(sock, peer)


def consumer_slots(
    channel: Channel | StreamChannel, offer: dict[str, Any], fds: list[int], most: int, check: BatchCheck,
    on_free: Callable[[Any], None],
) -> ConsumerMapping | StreamBuffers:
    """The consumer's end of the slots the service's ``slots`` record
    (``offer``) offered, checked against the limits a consumer sets
    (:func:`~.wire.check_slot_offer`; ``most``: the welcome's slots): the
    shared memory it passed (Unix), or buffers of the consumer's own that
    batches are read into (TCP).  ``fds`` stay the caller's to close.

    Raises:
        WireError: an offer over the limits; descriptors where none (or not one) belong.
        OSError: the memory cannot be mapped.
    """
    slots, slot_bytes = offer["slots"], offer["slot_bytes"]
    check_slot_offer(slots, slot_bytes, most, check.batch_size, check.n_blobs, channel.peer)
    if isinstance(channel, StreamChannel):
        if fds:
            raise WireError(f"{channel.peer} sent descriptors over TCP")
        # from now on the stream carries batches, a slot at most each
        channel.max_payload = slot_bytes
        channel.payload_kinds = frozenset({"batch"})
        return StreamBuffers(channel, slots, slot_bytes, check, on_free)
    if len(fds) != 1:
        raise WireError(f"{channel.peer} sent {len(fds)} descriptors with its slots, not 1")
    return ConsumerMapping(fds[0], slots, slot_bytes, on_free, check)
