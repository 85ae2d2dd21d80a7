"""The feeding service's wire format: small JSON records, never a pickle.

Service and consumers talk over a Unix socket of type ``SOCK_SEQPACKET``:
every ``sendmsg`` is one record, delivered whole, in order, with the
descriptors passed alongside it (``SCM_RIGHTS``).  A record is a JSON
object of at most :data:`MAX_RECORD` bytes with a string ``"t"`` (its
kind).  A batch's bytes never travel in a record: they are written once
into a slot of shared memory the consumer mapped when it attached, and the
record only says where (slot, offsets, dtypes, shapes).

Both ends treat what comes off the socket as untrusted: every record is
checked field by field against what its kind allows (:func:`check`), and a
record that does not pass closes the connection with :class:`WireError`
naming what was wrong.  JSON decodes to plain data only, so neither end can
make the other run code.
"""

from __future__ import annotations

import array
import json
import os
import re
import select
import socket
import time
from typing import Any, Sequence

import numpy as np

__all__ = [
    "ACK_FORM", "ALIGN", "MAX_ITEMS", "MAX_RECORD", "MAX_SLOTS", "PROTOCOL", "BatchCheck", "Channel", "WireError", "batch_items", "check",
    "check_slot_offer", "decode_record", "dtype_from_wire", "dtype_to_wire", "freed_slots", "seconds",
    "send_parts", "wire_align",
]

#: the version a consumer and a service must share (8: a ``state``
#: request carries the consumer's number for it, which its ``state_is``
#: names; 7: on a Unix socket
#: the ``hello`` may carry a stream socket on which the consumer writes its
#: ``ack`` records, a JSON line each (see .ackstream); 6: a batch may lie in
#: any of several shared regions (a worker process's slots, the source's
#: arena), each handed over once in an ``arena`` record with its id and
#: header, and let go of in a ``retire`` record; 5: the slots are
#: offered in a ``slots`` record before the consumer's first batch, sized by
#: it, no longer with the ``welcome``; 4: ``ack`` and ``bye``
#: carry the seconds the consumer's run() has waited so far; 3: a batch may
#: lie in the source's arena, handed over once in an ``arena`` record; 2:
#: ``batches`` carry several batches, ``ack`` is cumulative and frees
#: slots; 1 had one record per batch, per acknowledgement and per freed slot)
PROTOCOL = 8
#: the alignment of each array of a batch in a slot (shared memory) and in
#: a TCP frame's payload: array i starts at the end of array i-1 rounded up
#: to a multiple of this, the first at 0.  Part of protocol :data:`PROTOCOL`:
#: changing it changes the bytes on the wire, so it goes with a new
#: protocol number.  It is the service's own, not the process backend's
#: (``feeders.messages.ALIGN``), which may change without touching the wire.
ALIGN = 64
#: batches one ``batches`` record may carry, slots one ``ack`` may free
MAX_ITEMS = 1024
#: the longest record either end accepts
MAX_RECORD = 64 * 1024
#: descriptors one record may carry
MAX_FDS = 4
#: the deepest nesting of lists and objects a record may have (ours need 6;
#: a consumer's state in a ``state_is`` holds the fetchers' states)
MAX_DEPTH = 64
#: slots a service may offer a consumer, and the bytes of them all
MAX_SLOTS = 1024
MAX_SLOT_AREA = 64 << 30
#: bytes a slot may take per sample of the consumer's batch_size (a batch's
#: arrays, each at an :data:`ALIGN`-byte aligned offset: ALIGN bytes more per blob)
MAX_SAMPLE_BYTES = 1 << 30
#: dtype kinds a batch may have: numbers and booleans, no objects or records
_KINDS = frozenset("biufc?")


#: room for the descriptors a record may carry; a record cut short (the flags)
_ANCILLARY = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
_TRUNCATED = int(socket.MSG_TRUNC | socket.MSG_CTRUNC)


#: buffers one sendmsg call gathers (Linux's IOV_MAX is 1024)
_IOV = 512


def _when_room(send: Any, sock: socket.socket, deadline: float, peer: str) -> Any:
    """``send()`` (one that raises ``BlockingIOError`` while ``sock``'s
    buffer is full), tried again as room comes, until ``deadline``.

    Raises:
        TimeoutError: no room by ``deadline``: the peer does not read.
    """
    poller = None
    while True:
        try:
            return send()
        except BlockingIOError:
            pass
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{peer} took nothing sent to it for a while: it does not read")
        if poller is None:
            poller = select.poll()
            poller.register(sock, select.POLLOUT)
        poller.poll(int(left * 1000) + 1)


def send_parts(sock: socket.socket, parts: list[memoryview], deadline: float | None, peer: str) -> None:
    """``parts`` whole on the stream ``sock``, with as few system calls as
    the kernel takes, waiting for room in its buffer for ever (``deadline``
    None) or until ``deadline`` (``time.monotonic()``).

    Raises:
        TimeoutError: ``deadline`` came first (the peer does not read);
            part may have gone, so the stream is cut: close it.
        OSError: the socket failed.
    """
    flags = 0 if deadline is None else socket.MSG_DONTWAIT
    i = 0
    while i < len(parts):
        chunk = parts[i:i + _IOV]
        if deadline is None:
            sent = sock.sendmsg(chunk)
        else:
            sent = _when_room(lambda: sock.sendmsg(chunk, (), flags), sock, deadline, peer)
        while sent:
            n = parts[i].nbytes
            if sent >= n:
                sent -= n
                i += 1
            else:
                parts[i] = parts[i][sent:]
                sent = 0


def wire_align(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN` (an array's bytes in a slot or frame)."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


class WireError(ValueError):
    """A record broke the protocol (the message says which and how)."""


def dtype_to_wire(dt: np.dtype) -> str:
    return dt.str


def dtype_from_wire(text: Any, where: str) -> np.dtype:
    """The dtype a record names, if it is a plain number type."""
    if not isinstance(text, str) or len(text) > 8:
        raise WireError(f"{where}: dtype must be a short string, got {text!r}")
    try:
        # (no warnings.catch_warnings here: it changes the filters of every
        # thread while it lasts; a deprecated spelling that only warns is
        # held to the kind check below like any other)
        dt = np.dtype(text)
    except (TypeError, ValueError, SyntaxError, Warning) as err:  # "f8,(" raises SyntaxError
        raise WireError(f"{where}: unknown dtype {text!r}") from err
    if dt.kind not in _KINDS or dt.hasobject or dt.fields is not None or dt.subdtype is not None:
        raise WireError(f"{where}: dtype {text!r} is not a plain number type")
    return dt


class Channel:
    """One end of a connection: records out, records (and descriptors) in.

    ``send`` is thread-safe enough for one sender thread plus small records
    from others: a ``sendmsg`` on a ``SOCK_SEQPACKET`` socket is atomic.
    """

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        #: who is at the other end, for messages
        self.peer = peer

    def send(
        self, record: dict[str, Any], fds: Sequence[int] = (), wait: bool = True, deadline: float | None = None,
    ) -> None:
        """Send one record (and ``fds``).  ``wait=False``: raise
        ``BlockingIOError`` rather than wait for room in the socket's buffer
        (a peer that does not read).  ``deadline`` (``time.monotonic()``):
        wait for room until then, then raise ``TimeoutError`` (nothing was
        sent: a record goes whole or not at all); a record with ``fds``
        (the service's, never under a deadline) waits as ``wait`` says."""
        data = json.dumps(record, separators=(",", ":")).encode()
        if len(data) > MAX_RECORD:
            raise WireError(f"record of {len(data)} bytes to {self.peer} is over {MAX_RECORD}")
        if deadline is not None and not fds:
            _when_room(lambda: self.sock.send(data, socket.MSG_DONTWAIT), self.sock, deadline, self.peer)
            return
        flags = 0 if wait else socket.MSG_DONTWAIT
        if fds:
            self.sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))], flags)
        elif wait:
            self.sock.sendall(data)
        else:
            self.sock.send(data, flags)  # one record, whole or not at all (SOCK_SEQPACKET)

    def send_encoded(self, data: bytes) -> None:
        """Send one record already encoded (``json.dumps`` of a dict with a ``t``)."""
        if len(data) > MAX_RECORD:
            raise WireError(f"record of {len(data)} bytes to {self.peer} is over {MAX_RECORD}")
        self.sock.sendall(data)

    def recv(self, flags: int = 0) -> tuple[dict[str, Any], list[int]] | None:
        """The next record and the descriptors that came with it; None at EOF.
        ``flags``: ``socket.MSG_DONTWAIT`` raises ``BlockingIOError`` rather
        than wait when no record is there.

        Raises:
            WireError: a record that is too long, not JSON, or not an object
                with a string ``t`` (descriptors that came with it are closed).
            OSError: the socket failed.
        """
        data, ancdata, got_flags, _ = self.sock.recvmsg(MAX_RECORD + 1, _ANCILLARY, flags)
        fds = _fds_of(ancdata) if ancdata else []
        if not data and not fds:
            return None
        try:
            if got_flags & socket.MSG_CTRUNC:
                # (the kernel says so too when this process is out of descriptors)
                raise WireError(f"{self.peer} sent a record whose descriptors could not all be taken: more than "
                                f"{MAX_FDS}, or this process is out of descriptors")
            if got_flags & _TRUNCATED or len(data) > MAX_RECORD:
                raise WireError(f"{self.peer} sent a record over {MAX_RECORD} bytes")
            record = decode_record(data, self.peer)
        except WireError:
            for fd in fds:
                os.close(fd)
            raise
        return record, fds

    def recv_within(self, seconds: float) -> tuple[dict[str, Any], list[int]] | None:
        """:meth:`recv` within ``seconds`` (a record comes whole on this socket).

        Raises:
            TimeoutError: nothing came in time.
        """
        self.sock.settimeout(seconds)
        return self.recv()

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class CheckedRecord(dict[str, Any]):
    """A record whose fields were checked as it was read (:func:`fast_ack`):
    :func:`check` lets it through as it is."""


#: an ``ack`` exactly as blobfeed's consumer writes it (``consumer.Attachment._ack``):
#: g of -1 or up to 18 digits, at most MAX_ITEMS slots of up to 9 digits each,
#: the wait as Python's float repr (no sign, no NaN)
ACK_FORM = re.compile(
    rb'\{"t":"ack","g":(-1|0|[1-9][0-9]{0,17}),'
    rb'"slots":\[((?:0|[1-9][0-9]{0,8})(?:,(?:0|[1-9][0-9]{0,8})){0,%d})?\],'
    rb'"waited":((?:0|[1-9][0-9]{0,17})(?:\.[0-9]{1,20})?(?:e[-+][0-9]{1,3})?)\}' % (MAX_ITEMS - 1)
)


def fast_ack(data: bytes) -> CheckedRecord | None:
    """``data`` read as an ``ack`` without the JSON decoder, when it has the
    exact form blobfeed's consumer sends (one a batch: the decoder and the
    field checks cost more than the rest of its handling); None for any
    other form, which goes the general way.  What it returns passed the
    checks :func:`check` and :func:`freed_slots` make.

    Raises:
        WireError: the form is right but the wait is out of range.
    """
    m = ACK_FORM.fullmatch(data)
    if m is None:
        return None
    g, slots, waited = m.groups()
    return CheckedRecord(
        t="ack", g=int(g), slots=[int(x) for x in slots.split(b",")] if slots else [],
        waited=seconds(float(waited), "a consumer sent an 'ack' record whose 'waited'"),
    )


def decode_record(data: bytes, peer: str) -> dict[str, Any]:
    """One record off the wire: a JSON object with a kind (``"t"``), its
    fields still unchecked (see :func:`check`), or an ``ack`` checked
    already (:func:`fast_ack`).

    Raises:
        WireError: not JSON, or not an object with a kind.
    """
    if data[:10] == b'{"t":"ack"':
        try:
            ack = fast_ack(data)
        except WireError as err:
            raise WireError(f"{peer}: {err}") from None
        if ack is not None:
            return ack
    if not _shallow(data):
        raise WireError(f"{peer} sent a record nested deeper than {MAX_DEPTH} lists and objects (or unbalanced)")
    try:
        record = json.loads(data.decode())  # (bytes would have their encoding guessed first)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise WireError(f"{peer} sent a record that is not JSON: {data[:40]!r}") from None
    if not isinstance(record, dict) or not isinstance(record.get("t"), str):
        raise WireError(f"{peer} sent a record without a kind: {data[:40]!r}")
    return record


#: a JSON string (brackets inside one do not nest), and a bracket pair with nothing inside
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_ESCAPE = re.compile(rb"\\.", re.DOTALL)
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_NOT_STRUCTURE = bytes(c for c in range(256) if c not in b'[]{}"\\')


def _shallow(data: bytes) -> bool:
    """True if ``data`` nests lists and objects at most :data:`MAX_DEPTH`
    deep (checked before decoding: Python's decoder recurses once per level,
    and 60 000 levels fit a 64 KiB record)."""
    if data.count(b"[") + data.count(b"{") <= MAX_DEPTH:
        return True
    # escape pairs first (an escaped quote is no string's bound, and what
    # follows any other backslash must not become one), then what strings
    # hold but brackets and quotes (a string's bounds stay where they
    # were), then the strings, then the rest
    unescaped = _ESCAPE.sub(b"", data)
    brackets = _STRING.sub(b"", unescaped.translate(None, _NOT_STRUCTURE)).translate(None, _NOT_BRACKETS)
    if not brackets:
        return True
    steps = np.frombuffer(brackets, np.uint8)
    depth = np.cumsum(np.where((steps == ord("[")) | (steps == ord("{")), 1, -1))
    return int(depth.max()) <= MAX_DEPTH


def _fds_of(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(data[: len(data) - len(data) % a.itemsize])
            fds.extend(a)
    return fds


#: a field's type: a number of seconds (see :func:`seconds`)
_SECONDS = object()

#: per kind, each field's type (bool is never an int here)
_FIELDS: dict[str, dict[str, Any]] = {
    # consumer -> service
    "hello": {
        "protocol": int, "source": str, "blobs": list, "batch_size": int, "index": (int, type(None)),
        "num": (int, type(None)), "pid": int,
    },
    # everything up to item g (-1: nothing new) was returned by run(); these
    # slots are free; run() has waited this many seconds in all for this
    # attachment's batches (never less than in the consumer's last record)
    "ack": {"g": int, "slots": list, "waited": _SECONDS},
    # the state, asked for; id: the consumer's number for this request (1, 2, ...: a
    # request interrupted before it went leaves its number out), which the answer names
    "state": {"id": int},
    # it leaves; run()'s wait in all, as in "ack" (its last wait, for the end, came after the last ack)
    "bye": {"waited": _SECONDS},
    # service -> consumer
    # the consumer's index, and the most slots it will be offered (its queue's bound)
    "welcome": {"consumer": int, "slots": int, "epoch": int, "service": str},
    # its slots (Unix socket: their memory's descriptor alongside), before its first batch
    "slots": {"slots": int, "slot_bytes": int},
    "refused": {"error": str, "kind": str},
    "batch": {"g": int, "slot": int, "n": int, "arrays": list},
    # several batches (Unix socket): each [g, slot, n, arrays] as in "batch",
    # or [g, slot, n, arrays, region slot, region id] for a batch that lies
    # in a shared region ("arena")
    "batches": {"items": list},
    # a shared region (its descriptor alongside): a header of offset bytes,
    # then slots of slot_bytes; id: how batch entries name it
    "arena": {"id": int, "offset": int, "slots": int, "slot_bytes": int},
    # the region id holds no more batches sent from now: let go of it once
    # the batches of it still viewed are gone
    "retire": {"id": int},
    "epoch_end": {"g": int, "epoch": int, "dropped": int},
    "end": {"error": (str, type(None)), "kind": str},
    "state_is": {"id": int, "state": (dict, type(None)), "error": (str, type(None))},
}


def freed_slots(record: dict[str, Any], peer: str) -> list[int]:
    """The slots an ``ack`` frees: a list of at most :data:`MAX_ITEMS` ints
    (each slot's range is the ring's to check)."""
    slots = record["slots"]
    if len(slots) > MAX_ITEMS or not all(type(s) is int for s in slots):
        raise WireError(f"{peer} sent an 'ack' whose slots are not a list of at most {MAX_ITEMS} ints")
    return slots


def batch_items(record: dict[str, Any], peer: str) -> list[list[Any]]:
    """The entries of a ``batches`` record: 1 to :data:`MAX_ITEMS` lists
    ``[g, slot, n, arrays]`` of three ints and a list, and for a batch that
    lies in a shared region two more ints, its slot there and the region's
    id (their values are the slots' and regions' to check)."""
    items = record["items"]
    if not 0 < len(items) <= MAX_ITEMS:
        raise WireError(f"{peer} sent a 'batches' record of {len(items)} batches (1 to {MAX_ITEMS})")
    for entry in items:
        if not (
            type(entry) is list and (len(entry) == 4 or len(entry) == 6) and type(entry[0]) is int
            and 0 <= entry[0] < 2**62 and type(entry[1]) is int and type(entry[2]) is int and type(entry[3]) is list
            and (len(entry) == 4 or (type(entry[4]) is int and type(entry[5]) is int))
        ):
            raise WireError(
                f"{peer} sent a 'batches' entry that is not [g, slot, n, arrays(, region slot, region id)]: "
                f"{str(entry)[:60]}"
            )
    return items


def seconds(value: Any, where: str) -> float:
    """``value`` as a number of seconds: an int or a float (never a bool),
    finite, from 0 up to 2**62 (JSON lets NaN and Infinity through);
    else :class:`WireError` starting with ``where``."""
    # NaN fails both comparisons
    if type(value) not in (int, float) or not 0 <= value < 2**62:
        raise WireError(f"{where} is not a number of seconds (finite, >= 0): {str(value)[:24]}")
    return float(value)


#: the most characters of a value a peer sent that an error message quotes
SHOWN_CHARS = 120


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` for a message, cut to ``limit`` characters (saying
    how long it was): what a peer sent is quoted back to it and logged, and
    a record may hold 64 KiB of it."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def check(record: dict[str, Any], kinds: Sequence[str], peer: str) -> dict[str, Any]:
    """``record`` if it is one of ``kinds`` with exactly the fields that
    kind has, each of its type; else :class:`WireError`."""
    kind = record["t"]
    if kind not in kinds:
        raise WireError(f"{peer} sent a record of kind {shown(kind)} here (expected one of {sorted(kinds)})")
    if type(record) is CheckedRecord:
        return record
    fields = _FIELDS[kind]
    extra = set(record) - set(fields) - {"t"}
    if extra:
        raise WireError(f"{peer} sent a {kind!r} record with unknown fields {shown(sorted(extra))}")
    for name, typ in fields.items():
        if name not in record:
            raise WireError(f"{peer} sent a {kind!r} record without {name!r}")
        value = record[name]
        if typ is _SECONDS:
            record[name] = seconds(value, f"{peer} sent a {kind!r} record whose {name!r}")
            continue
        if isinstance(value, bool) or not isinstance(value, typ):
            raise WireError(f"{peer} sent a {kind!r} record whose {name!r} is {type(value).__name__}")
        if isinstance(value, int) and not -(2**62) < value < 2**62:
            raise WireError(f"{peer} sent a {kind!r} record whose {name!r} is out of range")
    return record


def check_slot_offer(slots: int, slot_bytes: int, most: int, batch_size: int, n_blobs: int, peer: str) -> None:
    """What a consumer lets a service make it map or reserve: 3 to ``most``
    slots (the welcome's word, at most :data:`MAX_SLOTS`), each of 64 bytes
    to :data:`MAX_SAMPLE_BYTES` per sample of the consumer's ``batch_size``
    (plus :data:`ALIGN` per blob), :data:`MAX_SLOT_AREA` in all.

    Raises:
        WireError: naming the offer and the limit it breaks.
    """
    largest = batch_size * MAX_SAMPLE_BYTES + ALIGN * n_blobs
    if not 3 <= slots <= most:
        raise WireError(f"{peer} offered {slots} slots (3 to {most}, as its welcome said)")
    if not 64 <= slot_bytes <= largest:
        raise WireError(
            f"{peer} offered slots of {slot_bytes} bytes (64 to {largest}: at most {MAX_SAMPLE_BYTES} bytes a "
            f"sample for batches of {batch_size})"
        )
    if slots * slot_bytes > MAX_SLOT_AREA:
        raise WireError(
            f"{peer} offered {slots} slots of {slot_bytes} bytes: {slots * slot_bytes} bytes in all, over "
            f"{MAX_SLOT_AREA}"
        )


class BatchCheck:
    """What a consumer checks of every batch a service sends, whatever
    carries it (Unix socket, TCP, Ray): one array per blob, each of ``n``
    rows with ``0 < n <= batch_size``, and each blob's dtype and per-sample
    shape those of the first batch (a source's first chunk fixes them).
    Not thread-safe: one receiver thread uses it."""

    def __init__(self, batch_size: int, n_blobs: int) -> None:
        self.batch_size = batch_size
        self.n_blobs = n_blobs
        #: (dtype, per-sample shape) of each blob, from the first batch
        self.layout: list[tuple[np.dtype, tuple[int, ...]]] | None = None

    def rows(self, n: Any, n_arrays: int, where: str) -> None:
        """A batch of ``n`` samples in ``n_arrays`` arrays (before looking at them)."""
        if type(n) is not int or not 0 < n <= self.batch_size:
            raise WireError(f"{where}: a batch of {n} samples; this consumer attached with batch_size={self.batch_size}")
        if n_arrays != self.n_blobs:
            raise WireError(f"{where}: a batch of {n_arrays} arrays; the consumer attached with {self.n_blobs} blobs")

    def arrays(self, n: int, arrays: Sequence[tuple[np.dtype, tuple[int, ...]]], where: str) -> None:
        """Each array's (dtype, shape): ``n`` rows, the first batch's layout."""
        layout = [(dt, tuple(shape[1:])) for dt, shape in arrays]
        for i, (_, shape) in enumerate(arrays):
            if not shape or shape[0] != n:
                raise WireError(f"{where}: array {i}: bad shape {list(shape)!r} for {n} samples")
        if self.layout is None:
            self.layout = layout
        elif layout != self.layout:
            raise WireError(f"{where}: a batch of (dtype, per-sample shape) {_show(layout)}; the first batch had "
                            f"{_show(self.layout)}")


def _show(layout: list[tuple[np.dtype, tuple[int, ...]]]) -> str:
    return "[" + ", ".join(f"({dt.str}, {sample})" for dt, sample in layout) + "]"
