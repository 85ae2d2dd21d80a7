"""The feeding service over TCP: a framed stream instead of records and descriptors.

A TCP stream carries neither record boundaries nor descriptors, so both are
made explicit.  Every frame is::

    prefix (16 bytes)  b"BFD1", record length (u32), payload length (u64), big-endian
    record             a JSON object of at most MAX_RECORD bytes, as on the Unix socket
    payload            the raw bytes of a batch's arrays (``batch`` records only)

The payload is what the Unix transport writes into a shared slot: each
array's bytes at its aligned offset (``wire.ALIGN``, 64 bytes, part of the
protocol), packed from offset 0.  The
consumer reads it into a buffer of its own for the slot the record names,
after checking that the record's arrays, the payload's length, the slot
size and the layout of the source agree (:class:`~.slots.StreamBuffers`).
So flow control (a slot is sent again only once the consumer freed it),
acknowledgements, exactly-once delivery and resume are the Unix transport's.

Each end says up front how much payload it accepts (``max_payload``: none
on the service, one slot on the consumer) and after which kinds of record;
a frame that announces more, or payload after another kind, is refused
before a byte of it is read.  TCP carries no peer credentials and this
transport no authentication: see docs/SERVICE.md.
"""

from __future__ import annotations

import io
import ipaddress
import json
import logging
import socket
import struct
import threading
import time
from typing import Any, Sequence

import numpy as np

from .wire import MAX_RECORD, WireError, decode_record, send_parts, wire_align

__all__ = ["PREFIX", "StreamChannel", "connect_tcp", "format_tcp", "is_loopback", "listen_tcp", "parse_tcp"]

logger = logging.getLogger("blobfeed.service")

#: magic, record bytes, payload bytes
PREFIX = struct.Struct("!4sIQ")
MAGIC = b"BFD1"
#: seconds without traffic before the kernel probes a silent peer, between probes, probes
_KEEPALIVE = (10, 5, 3)


def parse_tcp(address: str) -> tuple[str, int]:
    """``(host, port)`` of ``tcp://HOST:PORT``; an empty HOST is loopback
    (``tcp://:PORT`` means ``tcp://127.0.0.1:PORT``), an IPv6 HOST is in
    brackets (``tcp://[::1]:PORT``).

    Raises:
        ValueError: not of that form, or a port outside 0-65535.
    """
    if not address.startswith("tcp://"):
        raise ValueError(f"{address!r} is not a TCP address (tcp://HOST:PORT)")
    rest = address[len("tcp://"):]
    host, sep, port = rest.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if not host:
            raise ValueError(f"{address!r}: empty IPv6 address in brackets")
    elif ":" in host:
        raise ValueError(f"{address!r}: an IPv6 address goes in brackets, as in tcp://[::1]:{port}")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535 or "/" in host:
        raise ValueError(f"{address!r}: expected tcp://HOST:PORT with a port from 0 to 65535")
    return host or "127.0.0.1", int(port)


def format_tcp(host: str, port: int) -> str:
    """The ``tcp://`` address of ``host``:``port`` (IPv6 in brackets)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def is_loopback(host: str) -> bool:
    """True if the numeric address ``host`` is a loopback address."""
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


def _tune(sock: socket.socket) -> None:
    """Small records go at once (an ack must not wait behind Nagle's timer),
    and a peer that vanished without a word (a cable, a partition) is found
    by the kernel's keepalive probes, not never."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in zip(("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT"), _KEEPALIVE):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def listen_tcp(address: str, backlog: int = 64) -> tuple[socket.socket, str]:
    """A listening socket for ``tcp://HOST:PORT`` and its real address (port
    0: one the kernel picked).  A non-loopback address is logged as a warning:
    anyone who can reach it can attach.

    Raises:
        ValueError: a malformed address, or a host that does not resolve.
        OSError: the address cannot be bound (taken, not this machine's).
    """
    host, port = parse_tcp(address)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise ValueError(f"listen={address!r}: cannot resolve {host!r}: {err}") from None
    family, kind, proto, _, sockaddr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        # a restarted service may take its port back while old connections linger in TIME_WAIT
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(backlog)
    except OSError as err:
        sock.close()
        raise OSError(
            err.errno, f"listen={address!r}: cannot listen on {sockaddr[0]} port {port}: {err.strerror}"
        ) from None
    bound = sock.getsockname()
    real = format_tcp(bound[0], bound[1])
    if not is_loopback(bound[0]):
        logger.warning(
            "service: listening on %s, which is not a loopback address: anyone who can reach this port can "
            "attach and read the served data (TCP has no peer credentials; the service has no "
            "authentication and no encryption). Keep it behind a firewall or a private network.", real,
        )
    return sock, real


def connect_tcp(address: str, timeout: float) -> socket.socket:
    """A connected socket to the service at ``tcp://HOST:PORT``.

    Raises:
        ValueError: a malformed address or port 0.
        OSError: no service there (refused, unreachable, timed out).
    """
    host, port = parse_tcp(address)
    if port == 0:
        raise ValueError(f"{address!r}: port 0 is for listening; attach to the port the service printed")
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        _tune(sock)
    except OSError:
        sock.close()
        raise
    return sock


def accepted(sock: socket.socket) -> None:
    """Tune a socket the service accepted (see :func:`_tune`)."""
    _tune(sock)


class StreamChannel:
    """One end of a TCP connection: framed records out and in, with the raw
    bytes of a batch after its record.

    ``send`` may be called from several threads: a frame goes out whole
    under a lock (records from one thread never land inside another's
    payload).  ``recv`` and :meth:`recv_payload_into` belong to one thread.

    Args:
        sock: a connected stream socket.
        peer: who is at the other end, for messages.
        max_payload: the most payload bytes one frame may announce (0: none).
        payload_kinds: the kinds of record that may carry payload.
    """

    def __init__(
        self, sock: socket.socket, peer: str, max_payload: int = 0, payload_kinds: Sequence[str] = (),
    ) -> None:
        self.sock = sock
        self.peer = peer
        self.max_payload = max_payload
        self.payload_kinds = frozenset(payload_kinds)
        #: one frame out at a time (an RLock only so that a send of this
        #: thread under way, a signal handler's send inside it, is refused:
        #: its frame would land inside the other's; never taken twice)
        self._send_lock = threading.RLock()
        # buffered: a small record costs one system call, not three
        self._in: io.BufferedReader = sock.makefile(  # type: ignore[assignment]
            "rb", buffering=MAX_RECORD + PREFIX.size
        )
        #: payload bytes of the last record, not read yet
        self.unread = 0

    # -- out -----------------------------------------------------------------------------
    def send(
        self, record: dict[str, Any], fds: Sequence[int] = (), payload: Sequence[np.ndarray] = (), wait: bool = True,
        deadline: float | None = None,
    ) -> None:
        """Send ``record``, then ``payload``'s arrays each at a ``wire.ALIGN``
        aligned offset (the slot layout; padding is zeros).

        ``wait=False``: a record that cannot go out at once raises instead
        of blocking: ``TimeoutError`` if another send holds the connection,
        ``BlockingIOError`` if the socket's
        buffer is full (a peer that does not read); nothing was sent then.
        Only part of it fitting raises ``ConnectionError``: the frame is
        cut, the connection must be closed.  ``deadline``
        (``time.monotonic()``): wait for room until then, then raise
        ``TimeoutError`` (part of the frame may be out: close the connection).

        Raises:
            WireError: descriptors (TCP cannot carry them), or a record over MAX_RECORD.
            OSError: the connection failed (and see ``wait``).
        """
        if fds:
            raise WireError(f"a TCP connection cannot pass descriptors (to {self.peer})")
        data = json.dumps(record, separators=(",", ":")).encode()
        if len(data) > MAX_RECORD:
            raise WireError(f"record of {len(data)} bytes to {self.peer} is over {MAX_RECORD}")
        # the slot layout (SlotArea.write's): each array at an aligned offset, zeros between
        parts: list[memoryview] = []
        size = 0
        for a in payload:
            if a.nbytes:
                # its bytes, whatever its dtype and strides (a copy only if not C-contiguous)
                parts.append(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)
                size += a.nbytes
            if wire_align(size) > size:
                parts.append(memoryview(bytes(wire_align(size) - size)))
                size = wire_align(size)
        head = memoryview(PREFIX.pack(MAGIC, len(data), size) + data)
        lock = self._send_lock
        # (RLock._is_owned, untyped: what threading.Condition asks)
        if lock._is_owned():  # type: ignore[attr-defined]
            raise TimeoutError(f"the connection to {self.peer} is sending in this thread already (a signal "
                               "handler's send inside another): a frame cannot go inside a frame")
        # The lock is taken inside the try, and released by one C call with
        # no check first: a Ctrl-C lands when a call returns (the acquire's
        # too), and must not leave it taken.
        try:
            if not wait:
                # not a moment's wait: stop() tells every consumer in turn, and a
                # wait per consumer whose sender is stuck adds up (0.5 s each
                # was 16 s for 30); the sender tells it after its frame instead
                if not lock.acquire(blocking=False):
                    raise TimeoutError(f"the connection to {self.peer} is busy sending (it does not read?)")
                frame = head.tobytes() + b"".join(p.tobytes() for p in parts)
                if self.sock.send(frame, socket.MSG_DONTWAIT) != len(frame):
                    raise ConnectionError(f"{self.peer} does not read: a record was cut short")
                return
            if not lock.acquire(timeout=-1 if deadline is None else max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"the connection to {self.peer} is busy sending (it does not read?)")
            send_parts(self.sock, [head, *parts], deadline, self.peer)
        finally:
            try:
                lock.release()
            except RuntimeError:  # (not had)
                pass

    # -- in ------------------------------------------------------------------------------
    def recv(self, flags: int = 0) -> tuple[dict[str, Any], list[int]] | None:
        """The next record (and no descriptors: ``[]``); None at EOF between frames.

        Its payload, if any (``unread`` bytes), must be read with
        :meth:`recv_payload_into` before the next ``recv``.  ``flags`` must
        be 0: a frame may come in pieces, so a read never stops half-way
        for want of bytes (the carrier does not read in bursts).

        Raises:
            ValueError: ``flags`` other than 0.
            WireError: a frame that is not ours, too long, announcing more
                payload than allowed or after a kind that carries none, not
                JSON, not an object with a string ``t``, or cut short.
            OSError: the socket failed (``socket.timeout`` included).
        """
        if flags:
            raise ValueError(f"a TCP channel reads whole frames only (flags {flags})")
        if self._in.closed:
            raise ConnectionError(f"the connection to {self.peer} is closed")
        if self.unread:
            raise WireError(f"{self.unread} payload bytes from {self.peer} were not read before the next record")
        prefix = self._read(PREFIX.size, "frame", eof_ok=True)
        if prefix is None:
            return None
        size, payload = self._frame(prefix)
        if payload > self.max_payload:
            raise WireError(
                f"{self.peer} announced {payload} bytes of payload after a record; at most "
                f"{self.max_payload} here"
            )
        data = self._read(size, "record")
        assert data is not None
        record = decode_record(data, self.peer)
        if payload and record["t"] not in self.payload_kinds:
            raise WireError(f"{self.peer} sent {payload} bytes of payload after a {record['t']!r} record")
        self.unread = payload
        return record, []

    def _frame(self, prefix: bytes) -> tuple[int, int]:
        """A frame's record and payload sizes, from its prefix, checked.

        Raises:
            WireError: not a blobfeed frame, or a record over ``MAX_RECORD``.
        """
        magic, size, payload = PREFIX.unpack(prefix)
        if magic != MAGIC:
            raise WireError(f"{self.peer} sent {prefix[:8]!r} where a frame starts: not a blobfeed peer")
        if size > MAX_RECORD:
            raise WireError(f"{self.peer} sent a record of {size} bytes, over {MAX_RECORD}")
        return size, payload

    def recv_within(self, seconds: float) -> tuple[dict[str, Any], list[int]] | None:
        """:meth:`recv` of the connection's first frame (the hello, the
        welcome), all of it within ``seconds``: a peer that sends it a byte
        at a time cannot stretch it (each read's timeout is what is left).
        Only before any other read (it reads the socket, not the buffer).

        Raises:
            TimeoutError: the frame was not all there in time.
            WireError, OSError: as :meth:`recv`.
        """
        deadline = time.monotonic() + seconds
        prefix = self._read_by(PREFIX.size, deadline, "frame", eof_ok=True)
        if prefix is None:
            return None
        size, payload = self._frame(prefix)
        if payload:
            raise WireError(f"{self.peer} announced {payload} bytes of payload after its first record; none belong there")
        data = self._read_by(size, deadline, "record")
        assert data is not None
        return decode_record(data, self.peer), []

    def _read_by(self, n: int, deadline: float, what: str, eof_ok: bool = False) -> bytes | None:
        """``n`` bytes off the socket itself by ``deadline`` (see :meth:`recv_within`)."""
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.peer}: its first {what} did not arrive in time")
            self.sock.settimeout(left)
            k = self.sock.recv_into(view[got:])
            if not k:
                if not got and eof_ok:
                    return None
                raise WireError(f"{self.peer} closed the connection inside a {what} ({got} of {n} bytes)")
            got += k
        return bytes(buf)

    def recv_payload_into(self, buf: memoryview) -> None:
        """Read the last record's payload, exactly ``len(buf)`` bytes, into ``buf``.

        Raises:
            WireError: ``len(buf)`` is not what the frame announced, or the
                connection ended inside the payload.
            OSError: the socket failed.
        """
        if buf.nbytes != self.unread:
            raise WireError(f"{self.peer} sent {self.unread} bytes of payload; its record says {buf.nbytes}")
        got = 0
        while got < buf.nbytes:
            n = self._in.readinto(buf[got:])
            if not n:
                raise WireError(f"{self.peer} closed the connection {buf.nbytes - got} bytes before a payload's end")
            got += n
        self.unread = 0

    def _read(self, n: int, what: str, eof_ok: bool = False) -> bytes | None:
        data = self._in.read(n) if n else b""
        if len(data) == n:
            return data
        if not data and eof_ok:
            return None
        raise WireError(f"{self.peer} closed the connection inside a {what} ({len(data)} of {n} bytes)")

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._in.close()
        self.sock.close()
