"""A consumer's acknowledgements on a stream of their own (Unix socket, protocol 7).

A consumer acknowledges every batch before its ``run()`` returns it.  On
the connection's ``SOCK_SEQPACKET`` socket each acknowledgement is a record
the service's receiver must read on its own (a system call, and the
interpreter lock handed over, per batch).  So a consumer on a Unix socket
opens a ``SOCK_STREAM`` socket pair at attach and hands the service one end
with its ``hello``: it writes its ``ack`` records there, one JSON line each,
and the service reads every line that has arrived in one read.

What the stream keeps: an ``ack`` sent is in the service's buffer before
``send`` returns (a consumer killed next still has it counted); a send after
the service shut its end fails (``EPIPE``), so ``run()`` returns no batch
whose acknowledgement cannot be counted; a consumer sends its ``bye`` (on
the connection's socket) after its last ``ack``, and the service reads the
stream before any record of the connection's socket, so the ``bye`` comes
after them all.

Untrusted: only a connected Unix stream socket is taken; a line is at most
:data:`~.wire.MAX_RECORD` bytes and must be an ``ack`` record, checked as
one off the connection's socket.
"""

from __future__ import annotations

import os
import re
import socket

from .wire import ACK_FORM, MAX_RECORD, WireError, check, decode_record, freed_slots

__all__ = ["AckStream"]

#: bytes read at once: a burst's acknowledgements (about 60 bytes each),
#: and reads at most per call: what one call holds is bounded (the rest
#: stays in the socket for the next), whatever a consumer floods it with
READ_BYTES = 1 << 16
READS = 4
#: one line of the form blobfeed's consumer writes (any other goes the general way)
_LINE = re.compile(ACK_FORM.pattern + rb"\n")


class AckStream:
    """The service's end of one consumer's acknowledgement stream.

    One reader (the connection's receiver).  ``fileno()`` for ``poll``.
    """

    def __init__(self, sock: socket.socket, peer: str) -> None:
        sock.setblocking(False)
        self.sock = sock
        #: who is at the other end, for messages
        self.peer = peer
        #: False once the consumer closed its end (read to its end)
        self.open = True
        #: the last read stopped at its bound with more maybe waiting (see read)
        self.more = False
        self._tail = b""

    @classmethod
    def adopt(cls, fd: int, peer: str) -> "AckStream":
        """The stream from the descriptor a consumer's ``hello`` carried
        (the caller's no more: closed here if it is refused).

        Raises:
            WireError: not a Unix stream socket.
        """
        try:
            sock = socket.socket(fileno=fd)  # its family and type read from the descriptor
        except OSError as err:
            os.close(fd)
            raise WireError(f"{peer} sent a descriptor with its hello that is not a socket ({err})") from None
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
            what = f"{sock.family.name} {sock.type.name}"
            sock.close()
            raise WireError(f"{peer} sent a {what} socket with its hello, not a Unix stream socket for its "
                            "acknowledgements")
        try:
            sock.getpeername()  # (an unconnected or listening one has no peer: nothing would ever come)
        except OSError as err:
            sock.close()
            raise WireError(f"{peer} sent a Unix stream socket for its acknowledgements that is not connected "
                            f"({err})") from None
        return cls(sock, peer)

    def fileno(self) -> int:
        return self.sock.fileno()

    def read(self) -> tuple[list[tuple[int, list[int], float]], WireError | None]:
        """The ``ack`` records that arrived since the last read, in order,
        each checked, as ``(g, slots, waited)`` (without waiting; none if
        none), and the error that ends the stream if one came after them: a
        line over :data:`~.wire.MAX_RECORD` bytes, or one that is not a
        well-formed ``ack`` (those before it are returned: they count).  At
        most :data:`READS` x :data:`READ_BYTES` are read a call; ``more``
        says the bound stopped it.  ``open`` is False once the consumer's
        end is closed and everything it sent was read (or it broke the
        protocol).

        Raises:
            OSError: the socket failed.
        """
        if not self.open:
            return [], None
        chunks = [self._tail] if self._tail else []
        self.more = True
        for _ in range(READS):
            try:
                # never waits, whatever the descriptor's flags (the consumer
                # holds the other end of it and could clear O_NONBLOCK)
                data = self.sock.recv(READ_BYTES, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            except ConnectionResetError:
                data = b""
            if not data:
                self.open = False
                break
            chunks.append(data)
            if len(data) < READ_BYTES:
                break  # read to its end for now: the next comes with the next wake-up
        else:
            return self._lines(chunks)  # READS full reads: more may be there
        self.more = False
        return self._lines(chunks)

    def _lines(self, chunks: list[bytes]) -> tuple[list[tuple[int, list[int], float]], WireError | None]:
        """(:meth:`read`.)  The acknowledgements in what was read, and the
        error after them if a line was bad."""
        if not chunks:
            return [], None
        data = b"".join(chunks)
        end = data.rfind(b"\n") + 1
        self._tail = data[end:]
        peer = self.peer
        out: list[tuple[int, list[int], float]] = []
        match = _LINE.match
        at = 0
        try:
            while at < end:
                m = match(data, at)
                if m is not None:
                    # the form blobfeed's consumer writes: its fields are checked by the pattern
                    g, slots, waited = m.groups()
                    w = float(waited)
                    if not w < 2**62:
                        raise WireError(f"{peer} sent an 'ack' record whose 'waited' is not a number of seconds "
                                        f"(finite, >= 0): {waited[:24]!r}")
                    out.append((int(g), [int(x) for x in slots.split(b",")] if slots else [], w))
                    at = m.end()
                    continue
                stop = data.index(b"\n", at)
                line = data[at:stop]
                at = stop + 1
                if len(line) > MAX_RECORD:
                    raise WireError(f"{peer} sent an acknowledgement line of over {MAX_RECORD} bytes")
                record = check(decode_record(line, peer), ("ack",), peer)
                out.append((record["g"], freed_slots(record, peer), record["waited"]))
            if len(self._tail) > MAX_RECORD:
                raise WireError(f"{peer} sent an acknowledgement line of over {MAX_RECORD} bytes")
            if self._tail and not self.open:
                raise WireError(f"{peer} closed its acknowledgements in the middle of one: {self._tail[:40]!r}")
        except WireError as err:
            self.open = False
            return out, err
        return out, None

    def shut(self) -> None:
        """No more acknowledgements: the consumer's next send fails (``EPIPE``);
        what it sent before stays readable."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.shut()
        self.sock.close()
