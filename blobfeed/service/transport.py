"""The carriers: how batches travel between a service and a consumer,
chosen once from the address (:func:`carrier_for`), for both ends.

* a path (or ``unix:PATH``): :data:`UNIX`, a Unix ``SOCK_SEQPACKET``
  socket; batches written once into shared memory passed at attach
  (:class:`~.wire.Channel`, :mod:`.slots`), several per ``batches`` record;
* ``tcp://HOST:PORT``: :data:`TCP`, a TCP stream; each batch's bytes
  inline after its record (:class:`~.tcp.StreamChannel`,
  :class:`~.slots.StreamBuffers`);
* ``ray://[NAMESPACE/]NAME``: :data:`RAY`, a Ray actor's methods; batches
  in Ray's object store (:mod:`.ray_attach`, :mod:`.ray_service`).

Whatever the carrier, what was sent and acknowledged is the consumer's
:class:`~.ledger.Ledger` on the service, and every batch is checked by
:class:`~.wire.BatchCheck` on the consumer.  On the service, a connection's
:class:`BatchSender` (:class:`SlotSender` or :class:`StreamSender`) is what
its sender thread hands each batch to: nothing downstream asks which
carrier it has.
"""

from __future__ import annotations

import socket
import struct
import time
from typing import Any, Callable, Sequence

import numpy as np

from .lending import Lending, NoLending
from .slots import ConsumerMapping, SlotArea, StreamBuffers, StreamSlots
from .tcp import StreamChannel, accepted, connect_tcp, format_tcp
from .wire import MAX_RECORD, BatchCheck, Channel, WireError, check_slot_offer

__all__ = [
    "RAY", "TCP", "UNIX", "BatchSender", "Carrier", "SlotSender", "StreamSender", "carrier_for", "connect",
    "is_tcp",
]

#: at most this many batches in one ``batches`` record (fewer if their layout is long)
BATCHES_PER_RECORD = 64
#: a ``batches`` record goes out once its batches' slots hold this many bytes
#: (large batches go one by one: the consumer starts on the first while the
#: next is copied)
FLUSH_BYTES = 1 << 20
#: batches this large are kept as their slot's copy once written (their
#: source buffer is freed at once: S1's 9.6 MB batches held one per slot
#: in flight otherwise); smaller ones are not worth the views
LET_GO_BYTES = 1 << 16


class Carrier:
    """One way batches travel (see the module).  Stateless: one object per kind."""

    #: its name, for messages
    name = ""
    #: batches go through memory both ends map (the slots' descriptor is
    #: passed, and the source's arena may be)
    shared_memory = False
    #: the service reads a consumer's records in bursts, without blocking
    #: past the first (``recv(socket.MSG_DONTWAIT)``; a TCP frame may come in pieces)
    reads_in_bursts = False

    def connect(self, address: str, timeout: float, peer: str) -> Channel | StreamChannel:
        """A channel to the service at ``address`` (its socket's timeout: ``timeout``).

        Raises:
            ValueError: a malformed address.
            OSError: no service there.
        """
        raise NotImplementedError(f"the {self.name} carrier has no channel")

    def channel(self, sock: socket.socket, peer: str) -> Channel | StreamChannel:
        """The service's channel on a connection it accepted."""
        raise NotImplementedError(f"the {self.name} carrier has no channel")

    def sender(self, channel: Any, ledger: Any) -> "BatchSender":
        """What a connection's sender thread hands its batches to."""
        raise NotImplementedError(f"the {self.name} carrier has no sender")

    def accepted(self, sock: socket.socket, origin: Any) -> str | None:
        """Ready a connection the service accepted (``origin``: what
        ``accept()`` said of the peer): where it came from, for messages,
        if the carrier says.

        Raises:
            OSError: the peer went away at once.
        """
        return None

    def peer_pid(self, sock: socket.socket) -> int | None:
        """The peer's process as the kernel says, if the carrier can tell.

        Raises:
            OSError: the kernel could not say.
        """
        return None

    def lending(self, channel: Any, peer_pid: Callable[[], int]) -> NoLending:
        """What a connection lends its consumer of the memory its batches
        lie in (:mod:`.lending`; ``peer_pid``: the consumer's process)."""
        return NoLending()

    def consumer_slots(
        self, channel: Any, offer: dict[str, Any], fds: list[int], most: int, check: BatchCheck,
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
        check_slot_offer(offer["slots"], offer["slot_bytes"], most, check.batch_size, check.n_blobs, channel.peer)
        return self._consumer_slots(channel, offer, fds, check, on_free)

    def _consumer_slots(
        self, channel: Any, offer: dict[str, Any], fds: list[int], check: BatchCheck, on_free: Callable[[Any], None],
    ) -> ConsumerMapping | StreamBuffers:
        raise NotImplementedError(f"the {self.name} carrier has no slots")

    def __repr__(self) -> str:
        return f"<{self.name} carrier>"


#: seconds between tries to connect to a Unix socket whose listen backlog is full
BACKLOG_RETRY_S = 0.05


class _Unix(Carrier):
    name = "unix"
    shared_memory = True
    reads_in_bursts = True

    def connect(self, address: str, timeout: float, peer: str) -> Channel:
        """Connect within ``timeout`` s.  A Unix socket whose listen backlog
        is full refuses at once (EAGAIN), whatever the timeout: tried again
        every :data:`BACKLOG_RETRY_S` until then (the service is there, busy)."""
        deadline = time.monotonic() + timeout
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            try:
                sock.connect(address)
                return Channel(sock, peer)
            except BlockingIOError:
                sock.close()
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"its listen backlog stayed full for {timeout:g} s (too many connections "
                                       "at once: it is busy)") from None
                # nothing tells of room in another's backlog: a bounded pause between tries
                time.sleep(min(BACKLOG_RETRY_S, max(0.0, deadline - time.monotonic())))
            except OSError:
                sock.close()
                raise

    def channel(self, sock: socket.socket, peer: str) -> Channel:
        return Channel(sock, peer)

    def sender(self, channel: Any, ledger: Any) -> "SlotSender":
        return SlotSender(channel, ledger)

    def peer_pid(self, sock: socket.socket) -> int:
        return int(struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                       struct.calcsize("3i")))[0])

    def lending(self, channel: Any, peer_pid: Callable[[], int]) -> Lending:
        return Lending(channel, peer_pid)

    def _consumer_slots(
        self, channel: Any, offer: dict[str, Any], fds: list[int], check: BatchCheck, on_free: Callable[[Any], None],
    ) -> ConsumerMapping:
        if len(fds) != 1:
            raise WireError(f"{channel.peer} sent {len(fds)} descriptors with its slots, not 1")
        return ConsumerMapping(fds[0], offer["slots"], offer["slot_bytes"], on_free, check)


class _Tcp(Carrier):
    name = "tcp"

    def connect(self, address: str, timeout: float, peer: str) -> StreamChannel:
        return StreamChannel(connect_tcp(address, timeout), peer)

    def channel(self, sock: socket.socket, peer: str) -> StreamChannel:
        # the service accepts no payload from a consumer: a frame that announces some is refused unread
        return StreamChannel(sock, peer)

    def sender(self, channel: Any, ledger: Any) -> "StreamSender":
        return StreamSender(channel, ledger)

    def accepted(self, sock: socket.socket, origin: Any) -> str:
        accepted(sock)
        return format_tcp(origin[0], origin[1])[len("tcp://"):]

    def _consumer_slots(
        self, channel: Any, offer: dict[str, Any], fds: list[int], check: BatchCheck, on_free: Callable[[Any], None],
    ) -> StreamBuffers:
        if fds:
            raise WireError(f"{channel.peer} sent descriptors over TCP")
        # from now on the stream carries batches, a slot at most each
        channel.max_payload = offer["slot_bytes"]
        channel.payload_kinds = frozenset({"batch"})
        return StreamBuffers(channel, offer["slots"], offer["slot_bytes"], check, on_free)


class _Ray(Carrier):
    """Attaching is :class:`~.ray_attach.RayAttachment`'s, serving :class:`~.ray_service.RayFeedServer`'s."""

    name = "ray"


UNIX: Carrier = _Unix()
TCP: Carrier = _Tcp()
RAY: Carrier = _Ray()


def carrier_for(address: str) -> Carrier:
    """The carrier ``address`` names: ``tcp://`` TCP, ``ray://`` Ray, anything else a Unix socket's path."""
    if address.startswith("tcp://"):
        return TCP
    if address.startswith("ray://"):
        return RAY
    return UNIX


def is_tcp(address: str) -> bool:
    """True if ``address`` names a TCP service (``tcp://HOST:PORT``)."""
    return carrier_for(address) is TCP


def connect(address: str, timeout: float, peer: str) -> Channel | StreamChannel:
    """A channel to the service at ``address`` (its socket's timeout: ``timeout``).

    Raises:
        ValueError: a malformed TCP address.
        OSError: no service there.
    """
    return carrier_for(address).connect(address, timeout, peer)


# -- the service's end: a connection's batches out ----------------------------------------
class BatchSender:
    """What a connection's sender thread hands each batch to.

    ``send_batch`` sends a batch (or keeps it for the next ``flush``);
    ``flush`` sends what was kept; both tell the ledger what they send
    before they send it (its acknowledgement may come before the send
    returns) and return how many batches went out.  One thread (the
    connection's sender) uses it.
    """

    def __init__(self, channel: Any, ledger: Any) -> None:
        self.channel = channel
        self.ledger = ledger

    def slots(self, name: str, slots: int, slot_bytes: int) -> SlotArea | StreamSlots:
        """The consumer's slots (made, not offered yet)."""
        raise NotImplementedError

    def offer(self, area: SlotArea | StreamSlots) -> None:
        """Offer ``area``'s slots to the consumer (a ``slots`` record)."""
        self.channel.send(
            {"t": "slots", "slots": area.slots, "slot_bytes": area.slot_bytes}, fds=[area.fd] if area.fd >= 0 else ()
        )

    def write(self, area: Any, slot: int, item: Any) -> tuple[Any, Any, str | None]:
        """Put ``item``'s batch into ``slot``: (the item to keep in flight,
        the record's meta of its arrays, that meta's JSON text or None)."""
        raise NotImplementedError

    def send_batch(self, g: int, slot: int, n: int, meta: Any, text: str | None, arrays: Sequence[np.ndarray],
                   slot_bytes: int) -> int:
        raise NotImplementedError

    def pending(self) -> bool:
        """Batches kept for the next flush?"""
        return False

    def flush(self) -> int:
        return 0


class SlotSender(BatchSender):
    """Unix socket: a batch is copied once into a slot of shared memory;
    the batches written and not sent yet go together in one ``batches``
    record once no other batch is ready at once (or no slot is free, or
    :data:`FLUSH_BYTES` / a record's worth are waiting): a record, a
    syscall and a wake-up per burst rather than per batch, and never a wait
    with a batch unsent."""

    def __init__(self, channel: Any, ledger: Any) -> None:
        super().__init__(channel, ledger)
        self._ready: list[str] = []  # each [g, slot, n, arrays(, arena slot)] as JSON text
        self._ready_bytes = 0
        self._last_g = -1
        self._per_record = BATCHES_PER_RECORD

    def slots(self, name: str, slots: int, slot_bytes: int) -> SlotArea:
        return SlotArea(name, slots, slot_bytes)

    def write(self, area: Any, slot: int, item: Any) -> tuple[Any, Any, str | None]:
        meta, text = area.write_encoded(slot, item.batch.arrays)
        if area.slot_bytes >= LET_GO_BYTES:
            # the slot holds the batch now: keep that (for a consumer that
            # leaves without acknowledging it), and let the inner pipeline's
            # buffer go back to its pool at once rather than at the acknowledgement
            item = item._replace(batch=item.batch._replace(arrays=area.read(slot, meta)))
        return item, meta, text

    def send_batch(self, g: int, slot: int, n: int, meta: Any, text: str | None, arrays: Sequence[np.ndarray],
                   slot_bytes: int) -> int:
        entry = f"[{g},{slot},{n},{text}]"
        if not self._ready and self._per_record == BATCHES_PER_RECORD:
            # as many as fit half a record (a batch's layout does not change)
            self._per_record = max(1, min(BATCHES_PER_RECORD, MAX_RECORD // 2 // (len(entry) + 1)))
        self._ready.append(entry)
        self._last_g = g
        self._ready_bytes += slot_bytes
        if len(self._ready) >= self._per_record or self._ready_bytes >= FLUSH_BYTES:
            return self.flush()
        return 0

    def pending(self) -> bool:
        return bool(self._ready)

    def flush(self) -> int:
        """Send the batches written (the last numbered ``last_g``) in one record."""
        self._ready_bytes = 0
        ready = self._ready
        if not ready:
            return 0
        self.ledger.sent(self._last_g)  # before: the acknowledgement may come before send() returns
        data = ('{"t":"batches","items":[' + ",".join(ready) + "]}").encode()
        self.channel.send_encoded(data)
        n = len(ready)
        ready.clear()
        return n


class StreamSender(BatchSender):
    """TCP: each batch one ``batch`` frame, its bytes after the record,
    sent from the batch's own arrays (the slots are bookkeeping only)."""

    def slots(self, name: str, slots: int, slot_bytes: int) -> StreamSlots:
        return StreamSlots(slots, slot_bytes)

    def write(self, area: Any, slot: int, item: Any) -> tuple[Any, Any, str | None]:
        return item, area.write(slot, item.batch.arrays), None

    def send_batch(self, g: int, slot: int, n: int, meta: Any, text: str | None, arrays: Sequence[np.ndarray],
                   slot_bytes: int) -> int:
        self.ledger.sent(g)  # before: the acknowledgement may come before send() returns
        self.channel.send({"t": "batch", "g": g, "slot": slot, "n": n, "arrays": meta}, payload=arrays)
        return 1
