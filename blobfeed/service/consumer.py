"""The consumer's end of a served source: one more reader of a source.

``attach_source`` connects a net to a source a :class:`FeedServer` serves.
The net gets a reader as it would from a local source (``Net.add_reader``),
of an :class:`~blobfeed.reader.Inlet`: a receiver thread puts the batches
the service sends (views of the shared slots, read-only) into the inlet,
and the inlet tells the service each batch ``run()`` returned (``ack``).  So ``net.run()``,
``for out in net``, ``EndOfEpoch``, ``EndOfInput``, timeouts and errors
behave as with a local source.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import socket
import threading
import time
import weakref
from typing import Any, Callable, Sequence

import numpy as np

from ..arguments import check_index, check_timeout
from ..errors import FetcherError, ServiceError
from ..net import Net
from ..reader import Batch, Inlet
from .remote import Attached, open_inlet
from .slots import ConsumerMapping, StreamBuffers
from .state_requests import StateRequests
from .transport import RAY, carrier_for
from .wire import MAX_ITEMS, MAX_SLOTS, PROTOCOL, BatchCheck, WireError, batch_items, check, send_parts

__all__ = ["Attachment", "attach_source"]

logger = logging.getLogger("blobfeed.service")

#: seconds between the outbox thread's looks at the batches that died and
#: that the net's thread did not take along: a slot dropped while run()
#: waits goes back within one, one dropped while the user's loop is
#: elsewhere within two
OUTBOX_POLL_S = 0.02
#: seconds stop() waits for the service to close the connection after the bye
#: (and what the bye itself, and the one the receiver sends, may wait for room)
BYE_WAIT_S = 1.0
#: seconds an acknowledgement may wait for room in the socket at least
#: (run()'s timeout if longer): a service that reads nothing for so long
#: fails run(), for good.  Only a consumer with some 280 acknowledgements
#: unread (more slots than the default's 64) can fill the socket, so a
#: pause of the service's (a collection, a busy host) shorter than this
#: costs nothing
ACK_SEND_S = 10.0

#: the environment variable :func:`attach_source` reads the address from
ADDRESS_ENV = "BLOBFEED_SERVICE"


class Attachment(Attached):
    """A net attached to a served source (what :func:`attach_source` returns).

    ``stop()`` (or leaving a ``with`` block) detaches: the service takes
    back what this consumer had not acknowledged.
    """

    def __init__(
        self,
        net: Net,
        names: list[str],
        batch_size: int,
        source_name: str,
        address: str,
        index: int | None,
        num: int | None,
        timeout: float,
        connect_timeout: float,
        coordinator: Any,
    ) -> None:
        super().__init__(net, names, source_name, address)
        try:
            #: how the batches travel, chosen once from the address
            self._carrier = carrier_for(address)
            self._channel = self._carrier.connect(address, connect_timeout, self._service)
        except OSError as err:
            raise ServiceError(f"cannot attach to source {source_name!r}: no {self._service} ({err})") from err
        #: one send on the sockets at a time (an RLock only so that a Ctrl-C
        #: landing right after its acquire can be told apart, as
        #: threading.Condition tells it: never taken twice, see _lock_by)
        self._send_lock = threading.RLock()
        #: run()'s timeout when it is given none: what a send of the outbox thread may wait
        self._timeout = timeout
        #: why the sockets were shut, a send having missed its deadline (see _stalled)
        self._stall: str | None = None
        self._closed = False
        #: the service said it stops (set under the send lock): run() returns no more batches
        self._stop_heard = False
        #: why no acknowledgement can be counted any more (the service went
        #: away): run() raises this rather than return a batch, also where a
        #: send would still succeed (TCP accepts a write after the peer closed)
        self._gone: str | None = None
        self._stopped = threading.Event()
        #: state_dict()'s requests and the service's answers
        self._states = StateRequests(self._service)
        #: None to end the outbox thread
        self._out: queue.SimpleQueue[Any] = queue.SimpleQueue()
        #: weakrefs of batches whose views all died, appended by their
        #: callback (``deque.append``: C code, in whatever thread dropped the
        #: last view, where a Ctrl-C lands at any Python bytecode and would
        #: be swallowed with the slot).  They go with the net's next
        #: acknowledgement, or before its next wait; those it leaves (it
        #: waits, or the user's loop is elsewhere) the outbox thread takes
        #: (see _outbox)
        self._died: collections.deque[Any] = collections.deque()
        #: the thread that runs the net (it acknowledges), once known
        self._net_thread: int | None = None
        #: where the acknowledgements go on a Unix socket: a stream of their
        #: own, whose other end goes with the hello (see .ackstream)
        self._acks: socket.socket | None = None
        try:
            hello = {
                "t": "hello", "protocol": PROTOCOL, "source": source_name, "blobs": names,
                "batch_size": batch_size, "index": index, "num": num, "pid": os.getpid(),
            }
            if self._carrier.shared_memory:  # a Unix socket (protocol 7)
                self._acks, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
                with theirs:
                    self._channel.send(hello, fds=[theirs.fileno()])
            else:
                self._send(hello, connect_timeout)
            welcome = self._welcome(connect_timeout)
            self._channel.sock.settimeout(None)
        except WireError as err:
            self._close_sockets()
            raise ServiceError(f"cannot attach to source {source_name!r}: {err}") from None
        except ConnectionError as err:  # it dropped the connection at once (it could not take it)
            self._close_sockets()
            raise ServiceError(
                f"{self._service} closed the connection while attaching source {source_name!r} ({err})"
            ) from err
        except BaseException:
            self._close_sockets()
            raise
        # Past the welcome the service counts this consumer as attached: an
        # exception from here on (a Ctrl-C at any bytecode) must detach it,
        # or the connection stays open, its index taken, for the process's life.
        try:
            #: the slots, once the service offered them (a "slots" record, before the first batch)
            self._mapping: ConsumerMapping | StreamBuffers | None = None
            self._most_slots = welcome["slots"]
            self._check = BatchCheck(batch_size, len(names))
            self.consumer = welcome["consumer"]
            self._service = f"service at {address} (source {source_name!r}, consumer {self.consumer})"
            self._states.service = self._service
            #: the slots' roots of the batches run() handed out as views (weak:
            #: alive while the user, or the net, keeps any view of one)
            self._handed: collections.deque[weakref.ref[np.ndarray]] = collections.deque()
            #: batches handed out as copies because the kept ones held the slots
            self.copied = 0
            self._threads = []
            #: stop() told the outbox thread to end (see stop)
            self._outbox_told = False
            self.inlet = open_inlet(
                net, names, batch_size, source_name, welcome["slots"], timeout, self._ack, coordinator
            )
        except BaseException:
            self._close_sockets()
            raise
        self._open(
            [(self._receive, f"blobfeed-attach-recv-{source_name}"),
             (self._outbox, f"blobfeed-attach-out-{source_name}")],
            before_wait=self._before_wait, hand_out=self._hand_out,
        )
        logger.info("attached to %s", self._service)

    def _send(self, record: dict[str, Any], within: float) -> None:
        """Send ``record`` within ``within`` s (see :meth:`_lock_by`).  The
        send lock not had in time fails this call only (the send that holds
        it has its own deadline); the send itself timing out ends the
        attachment (:meth:`_stalled`)."""
        deadline = time.monotonic() + within
        self._lock_by(lambda: deadline, stall=False)
        try:
            self._channel.send(record, deadline=deadline)
        except TimeoutError as err:
            self._stalled(err)
            raise
        finally:
            self._send_lock.release()

    def _lock_by(self, deadline: Callable[[], float], stall: bool = True) -> None:
        """Take the send lock by ``deadline()`` (``time.monotonic()``, asked
        only if the lock is not free at once).  Every send waits for room in
        the socket until a deadline: a service that stops reading must not
        hang run(), state_dict() or stop().

        Raises:
            TimeoutError: another send held it until then, waiting for room:
                with ``stall``, the service counts as not reading (see
                :meth:`_stalled`): an acknowledgement that cannot go ends
                the attachment, or a later one would count its batch.
        """
        lock = self._send_lock
        if _held_here(lock):
            # this thread holds it in a frame below (a signal handler's call
            # in the middle of a send): it cannot be had before that frame
            # goes on, and taking it again would put a record inside another
            err = TimeoutError(f"{self._service}: a send of this thread is under way (a call from a signal "
                               "handler during another): nothing more can be sent before it is done")
            if stall:
                self._stalled(err)
            raise err
        try:
            if not lock.acquire(False) and not lock.acquire(timeout=max(0.0, deadline() - time.monotonic())):
                err = TimeoutError(f"{self._service} took nothing this consumer sent for a while: it does not read")
                if stall:
                    self._stalled(err)  # (without the lock: what it sets and shuts is safe so, and frees the holder)
                raise err
        except BaseException:
            # a Ctrl-C right after the acquire, before this returned: the
            # caller's finally would never release it (not held before: see
            # above).  One C call (a check first would be one more place for it)
            try:
                lock.release()
            except RuntimeError:  # (not had)
                pass
            raise

    def _ack_deadline(self) -> float:
        """What sending an acknowledgement (or slots freed) from run() may
        wait for: as long as run() was given to wait, and ACK_SEND_S at least."""
        return time.monotonic() + max(ACK_SEND_S, self.reader.asked_until - time.perf_counter())

    def _line_out(self, line: bytes, deadline: Callable[[], float]) -> None:
        """(Under the send lock.)  ``line`` on the acknowledgement stream: at
        once as a rule (one system call), else waiting for room until
        ``deadline()``."""
        acks = self._acks
        assert acks is not None
        try:
            sent = acks.send(line, socket.MSG_DONTWAIT)
        except BlockingIOError:
            sent = 0
        if sent < len(line):
            send_parts(acks, [memoryview(line)[sent:]], deadline(), self._service)

    def _stalled(self, err: TimeoutError) -> None:
        """A send missed its deadline (or the send lock did): the service
        does not read.  Part of a record may have gone (a stream's), so
        nothing may follow it: the service counts as gone (run() raises), and
        both sockets are shut, which ends the receiver (it fails the inlet
        with this reason) and any wait for room."""
        if self._gone is None:
            self._stall = f"{self._service} does not read what this consumer sends ({err})"
            self._gone = f"{self._stall}: this batch is not handed out (its acknowledgement cannot be counted)"
        for sock in (self._channel.sock, self._acks):
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _close_sockets(self) -> None:
        self._channel.close()
        if self._acks is not None:
            try:
                self._acks.shutdown(socket.SHUT_RDWR)  # (wakes a send waiting for room in another thread)
            except OSError:
                pass
            self._acks.close()

    def _welcome(self, timeout: float) -> dict[str, Any]:
        try:
            got = self._channel.recv_within(timeout)  # the whole welcome, however it trickles in
        except (socket.timeout, TimeoutError):
            raise ServiceError(f"{self._service} did not answer the attach of source {self.source_name!r}") from None
        if got is None:
            raise ServiceError(f"{self._service} closed the connection while attaching source {self.source_name!r}")
        record, fds = got
        for fd in fds:
            os.close(fd)
        record = check(record, ("welcome", "refused"), self._service)
        if record["t"] == "refused":
            raise ValueError(f"{self._service} refused the attach: {record['error']}")
        if fds:
            raise WireError(f"{self._service} sent descriptors with its welcome")
        if not 3 <= record["slots"] <= MAX_SLOTS:
            raise WireError(f"{self._service} said it will offer {record['slots']} slots (3 to {MAX_SLOTS})")
        return record

    def _ack(self, g: int) -> None:
        """Sent before run() returns: once run() returned a batch, its
        acknowledgement is in the socket even if the process dies next
        (a SIGKILL); the slots freed since take the same record.

        Raises:
            ServiceError: the service said it stops, or the record could not
                be sent: the service cannot count the batch (a resumed
                service deals it again), so run() must not return it.
        """
        self._net_thread = threading.get_ident()
        try:
            slots = self._freed_slots()
            # waits (for the lock, for room) as long as run() was given, and
            # ACK_SEND_S at least: run(timeout) raises within it
            lock = self._send_lock
            if _held_here(lock):
                self._lock_by(self._ack_deadline)  # (raises: a call inside another send)
            try:
                if not lock.acquire(False):  # (_lock_by's first step, inline: once a batch)
                    self._lock_by(self._ack_deadline)
                if self._closed:
                    # stop() detached (its bye went first): an acknowledgement
                    # now would come after it, uncounted, and the batch be dealt again
                    raise ServiceError(
                        f"{self._service}: detached (stop()): this batch is not handed out (the service deals it "
                        "again)"
                    )
                if self._gone is not None:
                    raise ServiceError(self._gone)
                if self._stop_heard:
                    raise ServiceError(
                        f"{self._service} stopped: this batch is not handed out (a resumed service deals it again)"
                    )
                # the wait read under the lock: the totals go out in the order they were read
                acks = self._acks
                if acks is not None:
                    # _line_out's steps, written out: once a batch, and the
                    # two calls cost a consumer of small batches about 1 µs
                    # a batch (S2, interleaved against this form)
                    line = _ack_line(g, slots, self._waited())
                    try:
                        sent = acks.send(line, socket.MSG_DONTWAIT)  # (the rule: room at once)
                    except BlockingIOError:
                        sent = 0
                    if sent < len(line):
                        send_parts(acks, [memoryview(line)[sent:]], self._ack_deadline(), self._service)
                else:
                    self._channel.send({"t": "ack", "g": g, "slots": slots, "waited": self._waited()},
                                       deadline=self._ack_deadline())
            except TimeoutError as err:
                self._stalled(err)
                raise
            finally:
                # (not held before: see above; one C call, no check first: a
                # Ctrl-C lands when a call returns, and could between the two)
                try:
                    lock.release()
                except RuntimeError:  # (not had: _lock_by raised)
                    pass
        except OSError as err:
            raise ServiceError(
                f"{self._service} cannot be told this batch was returned ({err}): it is not handed out "
                "(a resumed service deals it again)"
            ) from err

    def _heard_stop(self) -> None:
        """The service stops: from now on run() returns no batch, and the
        service is told so (``bye``) after every acknowledgement sent
        before, so that the state it saves counts each of them."""
        deadline = time.monotonic() + BYE_WAIT_S
        try:
            self._lock_by(lambda: deadline)
        except TimeoutError:
            self._stop_heard = True  # (a send waits for room: the service stops, it reads no more)
            return
        try:
            if self._stop_heard:
                return
            self._stop_heard = True
            try:
                self._channel.send({"t": "bye", "waited": self._waited()}, deadline=deadline)
            except OSError:
                pass  # gone already (or not reading): it saves what it read
        finally:
            self._send_lock.release()

    def _went_away(self, why: str) -> None:
        """The service is gone: no acknowledgement counts from now on, so
        run() raises ``why`` instead of returning a batch already queued."""
        # (without the lock if a send holds it, waiting for room: it fails too)
        locked = self._send_lock.acquire(timeout=BYE_WAIT_S)
        try:
            if self._gone is None:
                self._gone = why
        finally:
            if locked:
                self._send_lock.release()

    def _send_waited(self, record: dict[str, Any], deadline: Callable[[], float]) -> None:
        """Send ``record`` with the wait so far (an ``ack``, the ``bye``),
        by ``deadline()`` (see :meth:`_lock_by`): read under the send lock,
        so that the service never sees it shrink (the net's thread and the
        outbox thread both send acks)."""
        self._lock_by(deadline)
        try:
            record["waited"] = self._waited()
            if record["t"] == "ack" and self._acks is not None:
                self._line_out(_ack_line(record["g"], record["slots"], record["waited"]), deadline)
            else:
                self._channel.send(record, deadline=deadline())
        except TimeoutError as err:
            self._stalled(err)
            raise
        finally:
            self._send_lock.release()

    # -- threads -----------------------------------------------------------------------
    def _receive(self) -> None:
        inlet, mapping = self.inlet, self._mapping
        gone = f"{self._service} is gone"  # what state_dict() says from now on
        try:
            self._receive_records(inlet, mapping)
        except (WireError, ServiceError, OSError) as err:
            if not self._closed:
                if self._stall is not None:  # it shut the sockets: say why, not that they closed
                    err = ServiceError(self._stall)
                error = _bare(err if isinstance(err, ServiceError) else _named(err, self._service))
                gone = str(error)  # (it names the service)
                self._went_away(f"{error}: this batch is not handed out (its acknowledgement cannot be counted)")
                self.inlet.fail(error)
        except Exception as exc:
            logger.error("receiver of %s failed: %r", self._service, exc)
            gone = f"{self._service}: the receiver failed: {exc!r}"
            self.inlet.fail(_bare(ServiceError(f"{self._service}: the receiver failed: {exc!r}"), exc))
        finally:
            self._states.gone(gone)
            self._out.put(None)  # the outbox thread ends: nothing can be sent from now on

    def _receive_records(self, inlet: Inlet, mapping: ConsumerMapping | StreamBuffers | None) -> None:
        while True:
            got = self._channel.recv()
            if got is None:
                raise ServiceError(f"{self._service} closed the connection (it stopped or died)")
            record, fds = got
            try:
                record = check(record, ("batches", "batch", "epoch_end", "end", "state_is", "arena", "retire",
                                        "slots"), self._service)
                if record["t"] == "slots":
                    if mapping is not None:
                        raise WireError(f"{self._service} offered slots a second time")
                    mapping = self._mapping = self._carrier.consumer_slots(
                        self._channel, record, fds, self._most_slots, self._check, self._died.append
                    )
                    continue
                if record["t"] == "arena":
                    if not self._carrier.shared_memory or not isinstance(mapping, ConsumerMapping):
                        raise WireError(f"{self._service} sent an arena over TCP or before its slots")
                    mapping.add_arena(fds, record["id"], record["offset"], record["slots"], record["slot_bytes"],
                                      self._service)
                    continue
                if record["t"] == "retire":
                    if fds:
                        raise WireError(f"{self._service} sent descriptors with a 'retire' record")
                    if not isinstance(mapping, ConsumerMapping):
                        raise WireError(f"{self._service} retired an arena over TCP or before its slots")
                    mapping.retire(record["id"], self._service)
                    continue
                if fds:
                    raise WireError(f"{self._service} sent descriptors with a {record['t']!r} record")
            finally:
                for fd in fds:
                    os.close(fd)
            kind = record["t"]
            if kind in ("batches", "batch") and mapping is None:
                raise WireError(f"{self._service} sent a batch before it offered slots")
            if kind == "batches":
                views = mapping.views  # type: ignore[union-attr]
                batches = []
                for entry in batch_items(record, self._service):
                    g, slot, n, meta = entry[:4]
                    batches.append((views(slot, n, meta, self._service, *entry[4:]), n, g))
                if not inlet.put_many(batches):
                    return
                del batches  # (its views must die with the net's hold of them: their slots are freed then)
            elif kind == "batch":
                n = record["n"]
                arrays = mapping.views(record["slot"], n, record["arrays"], self._service)  # type: ignore[union-attr]
                if not inlet.put(arrays, n, record["g"]):
                    return
                del arrays  # (as batches: this frame waits for the next record)
            elif kind == "epoch_end":
                if min(record["epoch"], record["dropped"], record["g"]) < 0:
                    raise WireError(f"{self._service} sent an 'epoch_end' record with a negative number: "
                                    f"epoch {record['epoch']}, dropped {record['dropped']}, g {record['g']}")
                if not inlet.end_epoch(record["epoch"], record["dropped"], record["g"]):
                    return
            elif kind == "state_is":
                self._states.answered(record)
            else:  # end
                if self._ended(record):
                    self._after_the_end()
                return

    def _ended(self, record: dict[str, Any]) -> bool:
        """The service's ``end``; True when it is the stream's (the data's
        end or a worker's error), after which the connection still matters."""
        kind, text = record["kind"], record["error"]
        if kind == "end" and text is None:
            self.inlet.finish()  # what is queued, then EndOfInput
            return True
        if kind == "fetcher":
            # the stream reached an error of the service's workers: what came
            # before it is still handed out, then the error
            err = FetcherError(f"{self._service}: {text}")
            self.inlet.end_with(err)
            return True
        # The service stops: run() returns no batch from now on (the bye
        # tells the service every acknowledgement is in), then fails.
        self._heard_stop()
        self.inlet.fail(ServiceError(f"{self._service}: {text}"))
        return False

    def _after_the_end(self) -> None:
        """The stream's end came, but batches before it may still wait here
        unacknowledged.  Reads on: should the service stop or go away while
        some do, they are not handed out (their acknowledgements could not
        be counted, and a resumed service deals them again)."""
        try:
            while True:
                got = self._channel.recv()
                if got is None:
                    why = "closed the connection"
                    break
                record, fds = got
                for fd in fds:
                    os.close(fd)
                record = check(record, ("end", "state_is"), self._service)
                if record["t"] == "state_is":
                    self._states.answered(record)
                    continue
                self._heard_stop()
                why = f"stopped ({record['error']})"
                break
        except (WireError, OSError) as err:
            why = f"failed ({err})"
        left = self.inlet.unreturned()
        if left and not self._closed:
            text = (f"{self._service} {why} before this consumer acknowledged the {left} items it still had: "
                    "they are not handed out (a resumed service deals them again)")
            self._went_away(text)
            self.inlet.fail(ServiceError(text))

    def _hand_out(self, batch: Batch) -> Batch:
        """What ``run()`` hands out for ``batch`` (the net's thread): the
        batch itself, a view of one of the service's slots; or, when the
        batches handed out before whose views are still alive hold all the
        slots but one, a copy of it, so its slot goes back to the service
        at once.  A local source's worker slots are rationed the same way:
        batches a user keeps never stall the stream."""
        mapping = self._mapping
        arrays = batch.arrays
        root = arrays[0] if arrays else None
        while isinstance(root, np.ndarray) and isinstance(root.base, np.ndarray):
            root = root.base
        if mapping is None or not isinstance(root, np.ndarray) or root.base is None:
            return batch  # not a view of the service's memory (copied already, or on a device)
        handed = self._handed
        while handed and handed[0]() is None:
            handed.popleft()  # (they die in order as a rule: O(1) a batch)
        if handed and handed[-1]() is root:
            return batch  # handed out just before and given back (a net's other source failed): counted once
        if len(handed) >= mapping.slots - 1:
            handed = self._handed = collections.deque([ref for ref in handed if ref() is not None])
            if any(ref() is root for ref in handed):
                return batch  # handed out before (given back, and out again): counted once
        if len(handed) < mapping.slots - 1:
            handed.append(weakref.ref(root))
            return batch
        self.copied += 1
        if self.copied == 1:
            logger.info(
                "%s: the user keeps %d batches run() returned, as many as leaves one of the %d slots free: "
                "batches are copied out of the shared memory from now on while that lasts, so the "
                "service's slots keep circulating", self._service, len(handed), mapping.slots,
            )
        copies = []
        for a in arrays:
            c = np.array(a)
            c.flags.writeable = False  # as the views were: read-only unless Net(writable=True)
            copies.append(c)
        return Batch(tuple(copies), batch.n)

    def _before_wait(self) -> None:
        """The net's ``run()`` is about to wait for a batch (its thread,
        ``reader.waiting`` set): the slots kept back go to the service now
        when it may be short of slots for this consumer (half of them or
        more lent out, as this end counts them); else with the next
        acknowledgement.  (Sent only once all of them but one were out, one
        record a batch fewer on S1, it measured the same: with process
        workers a consumer's slots are its batches' worker slots, which the
        workers wait for, so the earlier bound stays.)"""
        mapping = self._mapping
        if not self._died or mapping is None or self._closed:
            return
        if 2 * len(mapping.outstanding) < mapping.slots:
            return  # the service has half of them or more free: nothing waits on these
        slots = self._freed_slots()
        if slots:
            try:
                self._send_waited({"t": "ack", "g": -1, "slots": slots}, self._ack_deadline)
            except OSError:
                pass  # the receiver reports the service's end

    def _freed_slots(self) -> list[int]:
        """The slots whose batches died since the last look (without waiting)."""
        mapping = self._mapping
        if mapping is None:
            return []  # no slots, so no batch
        slots: list[int] = []
        died = self._died
        if died:
            freed = mapping.freed
            while died and len(slots) < MAX_ITEMS:
                try:
                    ref = died.popleft()  # (the net's thread or the outbox thread: each ref to one of them)
                except IndexError:
                    break
                slot = freed(ref)
                if slot is not None:
                    slots.append(slot)
        return slots

    def _outbox(self) -> None:
        """Free the slots whose batches died that the net's thread does not
        take along soon: while its run() waits, or when the oldest of them
        waited a whole look (the user's loop is elsewhere: it sleeps, or
        another thread dropped batches it kept), so that the service can
        fill them meanwhile.  Looked at every OUTBOX_POLL_S: what dies in the
        dropping thread is only appended there (see ``_died``), nothing
        wakes this one: a callback that woke it would do so once a batch,
        where the net's acknowledgements take nearly all of them along
        anyway; a net that takes batches as they come takes them first."""
        get = self._out.get
        died = self._died
        oldest = None  # the oldest that died, as the last look found it
        while True:
            try:
                if get(timeout=OUTBOX_POLL_S) is None:
                    return
            except queue.Empty:
                pass
            if not died:
                oldest = None
                continue
            try:
                head = died[0]
            except IndexError:  # (the net's thread took it meanwhile)
                oldest = None
                continue
            if self._closed or (head is not oldest and not self.reader.waiting):
                oldest = head  # (the net's thread takes it along with its next acknowledgement, or the next look)
                continue
            oldest = None
            slots = self._freed_slots()
            if not slots:
                continue
            try:
                self._send_waited({"t": "ack", "g": -1, "slots": slots},
                                  lambda: time.monotonic() + max(self._timeout, ACK_SEND_S))
            except OSError:
                pass  # the receiver reports the service's end

    # -- the user's side ---------------------------------------------------------------
    def state_dict(self, timeout: float = 10.0) -> dict[str, Any]:
        """The service's state (every source's position, as of what its
        consumers acknowledged), asked of the service.

        Raises:
            ValueError: the service's source is not resumable.
            ServiceError: the service is gone or did not answer in ``timeout``.
        """
        deadline = time.monotonic() + timeout
        box: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()  # (made before the lock is taken)
        try:
            self._lock_by(lambda: deadline, stall=False)
        except TimeoutError:  # (another send holds the socket, with its own deadline)
            raise ServiceError(f"{self._service} took no state request within {timeout} s") from None
        try:
            try:
                # numbered under the send lock (a send that fails ends the attachment: see below)
                self._channel.send({"t": "state", "id": self._states.ask(box)}, deadline=deadline)
            except TimeoutError as err:
                self._stalled(err)  # (over TCP part of it may have gone)
                raise ServiceError(f"{self._service} is gone: {err}") from err
            except OSError as err:
                raise ServiceError(f"{self._service} is gone: {err}") from err
            finally:
                self._send_lock.release()
            try:
                reply = box.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise ServiceError(f"{self._service} did not answer for its state within {timeout} s") from None
        finally:
            self._states.forget(box)
        if self._states.is_gone(reply):
            raise ServiceError(reply["error"])
        if reply["error"] is not None:
            raise ValueError(reply["error"])
        return reply["state"]

    def _await_close(self, timeout: float) -> None:
        """After the bye: what the service still sends, dropped, until it
        closes the connection (its answer to the bye), within ``timeout``.
        Once it closed, it lets go of this consumer before it admits the
        next consumer of its index: stop() then attach_source() of the same
        index is not refused as attached already."""
        receiver = self._threads[0] if self._threads else None
        deadline = time.monotonic() + timeout
        if receiver is not None and receiver.ident is not None:
            receiver.join(timeout)  # it reads to the close itself, unless the stopped inlet ended it first
        sock = self._channel.sock
        try:
            while (left := deadline - time.monotonic()) > 0:
                sock.settimeout(left)
                if not sock.recv(1 << 16):  # (descriptors a record carried are not taken: the kernel drops them)
                    return
        except OSError:  # (the timeout too)
            pass

    def stop(self, timeout: float = 10.0) -> bool:
        """Detach: the service takes back what was not acknowledged.
        Idempotent: a stop that was interrupted (a Ctrl-C) is finished by
        the next call.  Returns True when this attachment's threads ended."""
        deadline = time.monotonic() + timeout
        if not self._closed:
            self._closed = True  # first: the service's answer to bye is to close
            try:
                bye_by = min(deadline, time.monotonic() + BYE_WAIT_S)
                self._send_waited({"t": "bye"}, lambda: bye_by)
            except OSError:
                pass  # (gone, or not reading: the close below ends the connection)
        # each step below may run again (an interrupted stop's next call)
        self.inlet.stop()
        self._await_close(min(BYE_WAIT_S, max(0.0, deadline - time.monotonic())))
        self._close_sockets()
        if not self._outbox_told:
            self._out.put(None)
            self._outbox_told = True
        for t in self._threads:
            if t.ident is not None:  # (one interrupted before it started is not)
                t.join(max(0.0, deadline - time.monotonic()))
        # The coordinator retires the inlet and keeps the source's
        # counts (they outlive it), not the source: with it, its error and
        # its reader's last batch would keep the slots mapped for the life
        # of the process; nor may the inlet keep this attachment and its
        # mapping (the batches still in use keep the mapping themselves)
        ended = self.inlet.close(max(0.0, deadline - time.monotonic()))
        mapping, self._mapping = self._mapping, None
        if mapping is not None:
            mapping.close()
        return ended and not any(t.is_alive() for t in self._threads)



def _ack_line(g: int, slots: Sequence[int], waited: float) -> bytes:
    """An ``ack`` record on the acknowledgement stream, written by hand: it
    goes out once or twice a batch, and ``json.dumps`` of a dict costs
    several times this."""
    return b'{"t":"ack","g":%d,"slots":[%s],"waited":%r}\n' % (g, ",".join(map(str, slots)).encode(), waited)


def _named(err: BaseException, service: str) -> ServiceError:
    """``err`` (a broken protocol, a failed socket) as the consumer's ServiceError, naming the service."""
    text = str(err)
    return ServiceError(text if service in text else f"{service}: {text}")


def _bare(error: ServiceError, cause: BaseException | None = None) -> ServiceError:
    """``error`` without the receiver's frames: a traceback holds its
    frames' locals (the slots' mapping, the last batch's views), and a
    failed source keeps its error (the metrics hub keeps the source), so a
    dead service's shared memory would stay mapped for good.  ``cause``
    (its ``__cause__``) is kept, bare too."""
    error.__traceback__ = None
    error.__context__ = None
    error.__suppress_context__ = True
    if cause is not None:
        cause.__traceback__ = None
        cause.__context__ = None
        error.__cause__ = cause
    return error


def attach_source(
    net: Net,
    input_blob_names: Sequence[str],
    batch_size: int,
    input_source_name: str = "train",
    address: str | os.PathLike[str] | None = None,
    *,
    consumer_index: int | None = None,
    num_consumers: int | None = None,
    timeout: float = 600.0,
    connect_timeout: float = 30.0,
    coordinator: Any = None,
) -> Attachment:
    """Feed ``net`` from source ``input_source_name`` of a feeding service.

    The net then runs as if the source were local: ``net.run()``,
    ``for out in net``, ``EndOfEpoch``/``EndOfInput``, ``timeout`` and
    errors with their cause.  Each batch reaches exactly one consumer.

    An address ``ray://NAME`` (or ``ray://NAMESPACE/NAME``) attaches to a
    service running as a Ray actor (:func:`blobfeed.ray.serve_on_ray`): the
    batches come through Ray's object store, and the call returns a
    :class:`~.ray_attach.RayAttachment`, with the same methods.

    Args:
        net: the net to feed.
        input_blob_names: the blobs, as the service serves them (same names, same order).
        batch_size: must equal the service's batch size for the source.
        input_source_name: the served source.
        address: the service's socket path, or ``tcp://HOST:PORT`` for a
            service listening on TCP; default ``$BLOBFEED_SERVICE``.
        consumer_index: this consumer's index (its rank), for a source the
            service deals by index (``num_consumers``); None: the lowest free one.
        num_consumers: if given, checked against the service's.
        timeout: seconds ``run()`` waits for a batch (as ``init_data_input_workers``).
        connect_timeout: seconds to wait for the service to accept.
        coordinator: whose metrics registry counts this feed (default the global one).

    Returns:
        An :class:`Attachment`: ``stop()`` detaches; ``state_dict()`` asks the service.

    Raises:
        ValueError: bad arguments, or the service refused them (another
            batch size, blob layout, num_consumers, an index taken).
        ServiceError: no service at ``address``, or it did not answer.
    """
    if address is None:
        address = os.environ.get(ADDRESS_ENV)
        if not address:
            raise ValueError(f"attach_source: no address given and ${ADDRESS_ENV} is not set")
    address = os.fspath(address)
    if address.startswith("unix:"):
        address = address[5:]
    if not isinstance(net, Net):
        raise TypeError(f"net must be a blobfeed.Net, got {type(net).__name__}")
    names = list(input_blob_names)
    if not names or not all(isinstance(n, str) and n for n in names) or len(set(names)) != len(names):
        raise ValueError(f"input_blob_names must be distinct non-empty str, got {names!r}")
    batch_size = check_index("batch_size", batch_size)
    if not isinstance(input_source_name, str) or not input_source_name:
        raise ValueError(f"input_source_name must be a non-empty str, got {input_source_name!r}")
    if num_consumers is not None:
        num_consumers = check_index("num_consumers", num_consumers)
    if consumer_index is not None:
        consumer_index = check_index("consumer_index", consumer_index, minimum=0)
        if num_consumers is not None and consumer_index >= num_consumers:
            raise ValueError(f"consumer_index={consumer_index} is not below num_consumers={num_consumers}")
    timeout = check_timeout("timeout", timeout)
    connect_timeout = check_timeout("connect_timeout", connect_timeout)
    if carrier_for(address) is RAY:
        # a service running as a named Ray actor (blobfeed.ray.serve_on_ray): Ray carries the batches
        from .ray_attach import RayAttachment

        return RayAttachment(  # type: ignore[return-value]  # the same stop/state_dict/context manager
            net, names, batch_size, input_source_name, address, consumer_index, num_consumers,
            timeout, connect_timeout, coordinator,
        )
    return Attachment(
        net, names, batch_size, input_source_name, address, consumer_index, num_consumers,
        timeout, connect_timeout, coordinator,
    )


def _held_here(lock: Any) -> bool:
    """Does this thread hold ``lock`` (an RLock) already, a send of its own
    under way in a frame below (a signal handler's call inside it)?  What
    threading.Condition asks (``RLock._is_owned``, untyped)."""
    return bool(lock._is_owned())
