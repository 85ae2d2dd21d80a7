"""The service's end of one consumer: a handshake, then two threads.

* the *receiver* (the thread that accepted the handshake) reads the
  consumer's records: ``ack`` (its ``run()`` returned every item up to
  ``g``; and the slots whose views died since; and how long its ``run()``
  has waited in all), ``state``, ``bye``;
* the *sender* takes the consumer's next batches from its outlet, writes
  each once into a free slot and sends them together in a ``batches``
  record (Unix socket: every batch ready with a free slot; over TCP one
  ``batch`` frame each).

Anything off the socket is checked (:mod:`.wire`); a record that breaks the
protocol ends the connection as if the consumer had left, and the service
goes on serving the others.

On a Unix socket the batches go through shared memory (:class:`.SlotArea`);
on TCP (:mod:`.tcp`) each batch's bytes follow its record on the stream,
sent from the batch's own arrays (:class:`.StreamSlots` keeps the slots'
bookkeeping, so the flow control is the same).
"""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from typing import Any, Callable

import numpy as np

from ..reader import EpochEnd
from .ackstream import AckStream
from .admission import ClosureLog, RefusalLog, Refused, admit
from .ledger import Ledger
from .served import POLL_S, SLOTS_MAX, End, Item, IndexOutlet, ServedSource, SharedOutlet
from .slots import SlotArea, StreamSlots, batch_nbytes
from .tcp import StreamChannel
from .transport import UNIX, BatchSender, Carrier
from .wire import MAX_ITEMS, Channel, CheckedRecord, WireError, check, freed_slots, wire_align

__all__ = ["Connection", "HANDSHAKE_S", "Refused"]

logger = logging.getLogger("blobfeed.service")

#: seconds a peer has from its connection to the end of its hello (the
#: whole hello, not each read: a hello that trickles in is dropped too)
HANDSHAKE_S = 5.0

#: seconds the receiver naps between bursts of a consumer's records (Unix
#: socket): how late an acknowledgement may be counted while the sender has
#: free slots for that consumer (it never waits for slots meanwhile)
ACK_NAP_S = 0.002
#: seconds a consumer's connection may stay open, saying nothing, after it
#: closed its acknowledgement stream: blobfeed's consumer closes the stream
#: after its connection (a stop) or with it (its process's end), so one that
#: keeps the connection could never acknowledge its batches again
ACKS_GONE_S = 1.0
#: acknowledgements of nothing (no item, no slot freed) a consumer may send in a row
MAX_IDLE_ACKS = 64


class Connection:
    """One consumer connected to the service.

    ``carrier``: how its batches travel (:mod:`.transport`), the service's,
    chosen once from its address: the channel, the sender its batches go
    through and what it lends the consumer (:mod:`.lending`) are that
    carrier's.  ``origin``: where the consumer came from, if the carrier
    says (TCP: its ``HOST:PORT``), for messages.
    """

    def __init__(
        self,
        sock: socket.socket,
        number: int,
        sources: Callable[[str], ServedSource],
        state: Callable[[str | None], dict[str, Any]],
        service: str,
        carrier: Carrier = UNIX,
        origin: str | None = None,
        refusals: RefusalLog | None = None,
        closures: ClosureLog | None = None,
    ) -> None:
        self.number = number
        #: acknowledgements of nothing in a row (see _count_idle_ack)
        self._idle_acks = 0
        #: where its refusal (or a handshake it did not finish) is logged: the service's, shared
        self._refusals = refusals if refusals is not None else RefusalLog()
        #: where its close for breaking the protocol is logged (the service's, shared)
        self.closures = closures if closures is not None else ClosureLog()
        self.origin = origin
        #: how its batches travel
        self.carrier = carrier
        self.channel: Channel | StreamChannel = carrier.channel(
            sock, f"connection {number}" if origin is None else f"connection {number} from {origin}"
        )
        #: the shared memory lent to the consumer (Unix socket), what each of its slots stands for
        self.lending = carrier.lending(self.channel, self._kernel_pid)
        self.peer = self.channel.peer
        self.label = str(number)
        self._sources = sources
        self._state = state
        self._service = service
        #: what was sent and not acknowledged (made at admission)
        self.ledger: Ledger | None = None
        self.closed = threading.Event()
        self.source: ServedSource | None = None
        self.outlet: IndexOutlet | SharedOutlet | None = None
        self.area: SlotArea | StreamSlots | None = None
        self.sender: threading.Thread | None = None
        #: the thread running serve() (set by the server)
        self.receiver: threading.Thread | None = None
        #: called once the handshake is over, whatever its outcome (the
        #: server bounds the connections in their handshake)
        self.on_handshake_done: Callable[[], None] = _nothing
        #: set once the consumer was told the end (data done, failure, stop)
        self._ended = False
        #: why the service stops, once it does (the sender tells the consumer)
        self._stopping: str | None = None
        #: set once the consumer was told the service stops (also after the data's end)
        self._stop_told = False
        self._sender_done = False
        self._tell_lock = threading.Lock()
        #: the seconds the consumer's run() has waited in all, as it last said (ack, bye)
        self._run_waited = 0.0
        #: the sender waits for the consumer to free slots: the receiver reads
        #: each record as it comes rather than in bursts (see serve)
        self._starved = False
        #: ends the receiver's nap between bursts (the sender starves, or a close)
        self._nudge = threading.Event()
        #: the acknowledgements of the burst being read, as one (see _merge_ack)
        self._merged: list[Any] | None = None
        #: where the consumer writes its acknowledgements, if it gave one (Unix socket, protocol 7)
        self._acks: AckStream | None = None
        #: connection resets read past (see _next_record)
        self._resets = 0

    # -- the receiver ------------------------------------------------------------------
    def serve(self) -> None:
        """Body of the receiver thread: handshake, then records until the consumer leaves."""
        try:
            try:
                if not self._handshake():
                    return
            finally:
                self.on_handshake_done()
            if self._acks is not None:
                self._receive_bursts(self._acks)
                return
            # On the Unix socket, records are read in bursts: once none is
            # left, the receiver naps ACK_NAP_S before it looks again (unless
            # the sender waits for slots), so a consumer that acknowledges
            # every batch wakes it a few hundred times a second, not once a
            # batch.  Over TCP a frame may come in pieces: one record a read.
            burst = self.carrier.reads_in_bursts
            wait = 0  # recv's flags: block for the first record of a burst
            # Until the consumer's end or its bye, even once the service closed
            # the connection (a stop): what it sent before is still read, so
            # an acknowledgement on its way counts before the state is saved.
            while True:
                try:
                    record = self._next_record(wait, ("ack", "state", "bye"))
                except BlockingIOError:
                    self._take_merged()
                    self._nap()
                    wait = 0
                    continue
                if record is None:
                    return
                if burst and record["t"] == "ack":
                    # counted with the burst's others once it ends: one
                    # settling, one free and one wake-up of the sender for all
                    self._merge_ack(record)
                    wait = socket.MSG_DONTWAIT
                    continue
                self._take_merged()
                if self._handle(record):
                    return
                if burst:
                    wait = socket.MSG_DONTWAIT
        except WireError as err:
            # the text, not the error: a kept log record (a memory handler,
            # pytest's caplog) would keep its traceback's frames, and with them
            # this connection's slots, alive
            self.closures.event("service: %s; connection closed", str(err))
        except OSError as err:
            if not self.closed.is_set():
                logger.info("service: %s: %s", self.peer, str(err))
        except Exception:
            logger.exception("service: %s failed", self.peer)
        finally:
            try:
                # what the consumer acknowledged before it broke the protocol, left or failed counts
                self._take_merged()
            except WireError as err:
                self.closures.event("service: %s; connection closed", str(err))
            except Exception:
                logger.exception("service: %s failed", self.peer)
            self._leave()

    def _receive_bursts(self, acks: AckStream) -> None:
        """:meth:`serve`'s loop for a consumer with an acknowledgement stream:
        whatever is there on either socket, the stream first (what the
        consumer acknowledged before it sent a record came before it);
        then, unless the sender waits for slots, a nap of ACK_NAP_S."""
        channel = self.channel
        assert isinstance(channel, Channel)
        poller = select.poll()
        poller.register(channel.sock, select.POLLIN)
        poller.register(acks.fileno(), select.POLLIN)
        main = channel.sock.fileno()
        gone_at = None  # when the stream was found closed
        while True:
            if acks.open:
                ready = poller.poll()
            else:
                if gone_at is None:
                    gone_at = time.monotonic()
                left = gone_at + ACKS_GONE_S - time.monotonic()
                ready = poller.poll(max(0, int(left * 1000))) if left > 0 else []
                if not ready:
                    # it holds its batches and can never acknowledge them: they go to the others
                    raise WireError(f"{self.peer} closed its acknowledgement stream but kept its connection "
                                    f"open ({ACKS_GONE_S:.3g} s): it could acknowledge nothing more")
            self._take_acks(acks, poller)
            # the socket only when it has something (a system call, and the
            # interpreter lock handed over, saved per burst)
            while any(fd == main for fd, _ in ready):
                try:
                    record = self._next_record(socket.MSG_DONTWAIT, ("state", "bye"))
                except BlockingIOError:
                    break
                self._take_acks(acks, poller, everything=True)  # what it sent before this, or before it went
                if record is None or self._handle(record):
                    return
            self._nap()

    def _next_record(self, flags: int, kinds: tuple[str, ...]) -> dict[str, Any] | None:
        """The consumer's next record, checked to be one of ``kinds``; None at
        its end.  ``flags``: ``socket.MSG_DONTWAIT`` raises
        ``BlockingIOError`` when none is there (only where records are read in bursts: a Unix socket)."""
        channel = self.channel
        while True:
            try:
                got = channel.recv(flags)
            except ConnectionResetError:
                # A consumer that died with records unread (batches sent to
                # it) resets the socket, and Linux reports the reset before
                # the records it sent last, its acknowledgements: read them
                # (a batch run() returned is acknowledged).
                self._resets += 1
                if self._resets > 1:
                    raise
                continue
            if got is None:
                return None
            record, fds = got
            for fd in fds:
                os.close(fd)  # a consumer never sends descriptors
            if fds:
                raise WireError(f"{self.peer} sent descriptors")
            return check(record, kinds, self.peer)

    def _nap(self) -> None:
        """Between bursts: ACK_NAP_S for more records to gather, unless the
        sender waits for this consumer's slots (or the connection closes)."""
        if not self._starved and not self.closed.is_set():
            self._nudge.wait(ACK_NAP_S)
            self._nudge.clear()

    def _take_acks(self, acks: AckStream, poller: Any, everything: bool = False) -> None:
        """Count what arrived on the acknowledgement stream (see :meth:`_merge`);
        ``everything``: all that is there (before a record of the other
        socket, or at the consumer's end), not one bounded read."""
        while acks.open:
            got, error = acks.read()
            merge = self._merge
            for g, slots, waited in got:
                merge(g, slots, waited)
            self._take_merged()
            if not acks.open:
                poller.unregister(acks.fileno())
            if error is not None:
                raise error
            if not (everything and acks.more):
                return

    def _handshake(self) -> bool:
        try:
            got = self.channel.recv_within(HANDSHAKE_S)  # the whole hello, however it trickles in
        except (socket.timeout, TimeoutError):
            self._refusals.refused(self.peer, f"it did not finish its hello within {HANDSHAKE_S:.3g} s (said "
                                              "nothing within, or too slowly); closed")
            return False
        except WireError as err:
            self._refusals.refused(self.peer, f"{err}; closed")
            return False
        if got is None:
            return False
        record, fds = got
        try:
            hello = check(record, ("hello",), self.peer)
        except WireError as err:
            for fd in fds:
                os.close(fd)
            self._refusals.refused(self.peer, f"{err}; closed")
            return False
        self.channel.sock.settimeout(None)
        try:
            # checked before the admission, which claims an outlet
            if len(fds) > 1:
                for fd in fds:
                    os.close(fd)
                raise WireError(f"{self.peer} sent {len(fds)} descriptors with its hello (at most 1: the stream "
                                "of its acknowledgements)")
            # (kept here at once: whatever happens next, leaving closes it)
            self._acks = AckStream.adopt(fds[0], self.peer) if fds else None
            source, outlet = admit(hello, self._sources, self)
        except (Refused, WireError) as err:
            self._refusals.refused(self.peer, str(err))
            self.channel.send({"t": "refused", "error": str(err), "kind": "value"})
            return False
        self.source, self.outlet = source, outlet
        self.label = outlet.label if isinstance(outlet, IndexOutlet) else str(self.number)
        self.peer = f"consumer {self.label} of source {source.name!r} ({self._pid_text(hello['pid'])})"
        if self.origin is not None:
            self.peer += f" from {self.origin}"
        self.channel.peer = self.peer
        if self._acks is not None:
            self._acks.peer = self.peer
        self.ledger = Ledger(outlet, source.counts, self.label)
        self.ledger.peer = self.peer
        # Welcomed at once: its slots are made and offered (a "slots" record)
        # before its first batch, sized by that batch.  Before it, only
        # epoch ends or the end may come, and neither needs a slot.
        self._welcome()
        logger.info("service: %s attached", self.peer)
        sender = threading.Thread(target=self._send_loop, name=f"blobfeed-service-send-{self.number}", daemon=True)
        # published once started: a sender that could not start (out of
        # threads) is no thread to tell, wait for or join; the receiver
        # reports the error and leaves, handing back what was taken
        sender.start()
        self.sender = sender
        return True

    def _pid_text(self, said: int) -> str:
        """Who the consumer is, for messages: on the Unix socket the process
        the kernel says it is (what its hello said beside it, if that
        differs: a peer may name any process); over TCP what it said."""
        try:
            pid = self.carrier.peer_pid(self.channel.sock)
        except OSError:
            pid = None
        if pid is None:
            return f"pid {said}, as it says"
        return f"pid {pid}" if pid == said else f"pid {pid}; its hello said {said}"

    def _kernel_pid(self) -> int:
        """The consumer's process, as the kernel says (a carrier that knows it: Unix socket)."""
        pid = self.carrier.peer_pid(self.channel.sock)
        if pid is None:
            raise OSError(f"the {self.carrier.name} carrier cannot tell its peer's process")
        return pid

    def _welcome(self) -> None:
        """Welcome the consumer: its index, and the most slots it will be offered."""
        source, outlet = self.source, self.outlet
        assert source is not None and outlet is not None
        self._most_slots = source.terms.slots or (source.slots if source.slot_bytes else SLOTS_MAX)
        self.channel.send(
            {"t": "welcome", "consumer": outlet.index if isinstance(outlet, IndexOutlet) else self.number,
             "slots": self._most_slots, "epoch": 0, "service": self._service}
        )

    def _offer_slots(self, batch: Any, sender: BatchSender) -> SlotArea | StreamSlots:
        """Make the consumer's slots, sized by the source's batches (this,
        its first, if the source's first), and offer them (a ``slots``
        record, with their descriptor on a Unix socket)."""
        source = self.source
        assert source is not None
        if source.slot_bytes is None:
            # a whole batch, whatever this one holds (an epoch's last may be smaller)
            full = sum(wire_align(a.nbytes // batch.n * source.terms.batch_size) for a in batch.arrays)
            source.slot_bytes = max(full, batch_nbytes(batch.arrays), 64)
        slot_bytes = max(source.slot_bytes, batch_nbytes(batch.arrays))
        slots = min(self._most_slots, source.slots)
        area = sender.slots(f"blobfeed-{source.name}-{self.label}", slots, slot_bytes)
        try:
            sender.offer(area)
        except BaseException:
            area.close()
            area.unmap()
            raise
        finally:
            area.close_fd()
        # published once its descriptor is closed (close() and _leave() act on it from the receiver)
        self.area = area
        if self.closed.is_set():
            area.close()  # close() came before there was an area to wake
        return area

    def _merge_ack(self, record: dict[str, Any]) -> None:
        """``record`` (an ``ack``) added to the burst's others not counted yet
        (see :meth:`_merge`)."""
        # fast_ack checked the slots already
        self._merge(record["g"], record["slots"] if type(record) is CheckedRecord
                    else freed_slots(record, self.peer), record["waited"])

    def _merge(self, g: int, slots: list[int], waited: float) -> None:
        """An acknowledgement (of items up to ``g``, freeing ``slots``, the
        consumer's wait ``waited``) added to the burst's others not counted
        yet (``_merged``): the last item acknowledged, every slot freed, the
        last wait, how many; counted at once past MAX_ITEMS of them or of
        their slots (what one holds is bounded).  Each is checked against
        the one before it as :meth:`_take_ack` would (what came before a
        lie still counts: the receiver takes it as it leaves)."""
        if g == -1 and not slots:
            self._count_idle_ack()
        else:
            self._idle_acks = 0
        merged = self._merged
        if merged is None or g > merged[0]:
            # the ledger's own check now: a g never sent among good ones
            # must not take them along when the burst is taken
            assert self.ledger is not None
            self.ledger.check_ack(g)
        if merged is None:
            merged = self._merged = [g, list(slots), waited, 1]
        else:
            if g != -1 and g <= merged[0]:
                raise WireError(f"{self.peer} acknowledged items up to {g} after it acknowledged up to {merged[0]}")
            if waited < merged[2]:
                raise WireError(f"{self.peer} said its run() has waited {waited!r} s in all, less than the "
                                f"{merged[2]!r} s it said before")
            if g != -1:
                merged[0] = g
            merged[2] = waited
            merged[1] += slots
            merged[3] += 1
        if merged[3] >= MAX_ITEMS or len(merged[1]) >= MAX_ITEMS:
            self._take_merged()

    def _count_idle_ack(self) -> None:
        """An ``ack`` of no item that frees no slot (a wait report at most;
        the callers reset the count at any other, inline: once an ack):
        a consumer of ours never sends one (each acknowledges a batch or
        frees slots), and a peer that sends them in a loop only costs the
        service their parsing.  Past :data:`MAX_IDLE_ACKS` in a row, the
        connection is closed."""
        self._idle_acks += 1
        if self._idle_acks > MAX_IDLE_ACKS:
            raise WireError(f"{self.peer} acknowledged nothing and freed no slot {self._idle_acks} times in a row "
                            f"(at most {MAX_IDLE_ACKS})")

    def _take_merged(self) -> None:
        """Count the burst's acknowledgements read so far (see :meth:`_merge_ack`)."""
        merged, self._merged = self._merged, None
        if merged is not None:
            self._take_ack(merged[0], merged[1], merged[2])

    def _take_ack(self, g: int, slots: list[int], waited: float) -> None:
        """The consumer's run() returned every item up to ``g`` (-1: nothing
        new), its views of ``slots`` died, its run() waited ``waited`` s in
        all: the items settle, and the slots that may be written again go
        back to the ring at once."""
        self._consumer_waited(waited)
        ledger = self.ledger
        assert ledger is not None
        back = ledger.ack(g)[1] if g != -1 else []
        if slots:
            if self.area is None:
                raise WireError(f"{self.peer} freed slot {slots[0]}, which it does not hold (it was offered none)")
            freed = ledger.free(slots)  # checks them first: a refused free lets go of nothing
            self.lending.freed(slots)
            back = back + freed if back else freed
        if back:
            assert self.area is not None
            self.area.give_back(back, self.peer)

    def _handle(self, record: dict[str, Any]) -> bool:
        """Act on one of the consumer's records; True when it said bye."""
        kind = record["t"]
        if kind == "ack":
            # one per batch run() returns: the slots it frees go back to the ring at once
            slots = record["slots"] if type(record) is CheckedRecord else freed_slots(record, self.peer)
            if record["g"] == -1 and not slots:
                self._count_idle_ack()
            else:
                self._idle_acks = 0
            self._take_ack(record["g"], slots, record["waited"])
        elif kind == "state":
            asked = record["id"]  # (an int, checked: the consumer matches it to its call)
            try:
                state = self._state(self.source.name if self.source is not None else None)
                reply = {"t": "state_is", "id": asked, "state": state, "error": None}
            except (ValueError, RuntimeError) as err:
                reply = {"t": "state_is", "id": asked, "state": None, "error": str(err)}
            try:
                self.channel.send(reply)
            except WireError as err:
                # too big for a record (first come: what is acknowledged past
                # the position, fetcher states): the consumer only asked; the
                # service's own state has no such bound
                self.channel.send({"t": "state_is", "id": asked, "state": None, "error": (
                    f"{err}: take the state from the service (FeedServer.state_dict(), "
                    "RayService.state_dict() or --state-file)")})
        elif kind == "bye":
            self._consumer_waited(record["waited"])
            self.closed.set()
            return True
        return False

    def _consumer_waited(self, total: float) -> None:
        """The consumer's run() has waited ``total`` seconds in all (checked
        finite and >= 0 by the wire): what it grew by since its last record
        counts for its label.  Its records come in order on one connection,
        so a total that shrinks is a lie."""
        if total < self._run_waited:
            raise WireError(
                f"{self.peer} said its run() has waited {total!r} s in all, less than the {self._run_waited!r} s "
                "it said before"
            )
        if total > self._run_waited:
            assert self.source is not None
            self.source.counts.run_waited[self.label] += total - self._run_waited
            self._run_waited = total

    # -- the sender --------------------------------------------------------------------
    def _send_loop(self) -> None:
        try:
            self._send_items()
        finally:
            # The service stops and tell_stopped() could not tell the
            # consumer at once (this thread was sending): this thread tells
            # it, after its frame (a frame is never cut).
            with self._tell_lock:
                self._sender_done = True
                tell = self._stopping is not None and self._claim_stop()
            if tell:
                try:
                    self.channel.send({"t": "end", "error": self._stopping, "kind": "stopped"})
                except OSError:
                    self.close()

    def _send_items(self) -> None:
        source, outlet, area, ledger = self.source, self.outlet, self.area, self.ledger
        assert source is not None and outlet is not None and ledger is not None
        pending: Item | End | None = None  # taken from the outlet, not sent yet
        # The item taken for this consumer until its ledger records it: should
        # anything fail in between (a descriptor that could not be had, the
        # consumer gone while the record before it went out), it is handed
        # back as unacknowledged (finally, below), never lost.
        in_hand: Item | None = None
        counts = source.counts
        delivered = counts.delivered
        sender = self.carrier.sender(self.channel, ledger)
        # a batch that lies in shared memory (a worker process's slot, the
        # source's arena) goes as a reference to it, where the carrier lends it
        lending = self.lending
        try:
            while not self.closed.is_set() and not self._ended and self._stopping is None:
                if lending.moved():
                    # regions went (a worker replaced): what was sent of them goes first
                    delivered[self.label] += sender.flush()
                    lending.retire_gone()
                if pending is None:
                    if sender.pending():
                        # batches kept for one record: sent once no other is ready at once
                        pending = outlet.next(self, 0.0)
                        if pending is None:
                            delivered[self.label] += sender.flush()
                            continue
                    else:
                        t0 = time.perf_counter()
                        pending = outlet.next(self, POLL_S)
                        counts.waited[self.label] += time.perf_counter() - t0
                        if pending is None:
                            continue
                item, pending = pending, None
                if isinstance(item, End):
                    # the connection stays: the consumer still acknowledges
                    # what it has, and leaves when it is done
                    delivered[self.label] += sender.flush()
                    self._end(item)
                    return
                in_hand = item
                if type(item.batch) is EpochEnd:
                    delivered[self.label] += sender.flush()
                    g = ledger.number()
                    ledger.record(g, item)
                    in_hand = None
                    ledger.sent(g)  # before: the acknowledgement may come before send() returns
                    self.channel.send(
                        {"t": "epoch_end", "g": g, "epoch": item.batch.epoch, "dropped": item.batch.dropped}
                    )
                    continue
                if area is None:
                    area = self._offer_slots(item.batch, sender)  # before its first batch, sized by it
                slot = area.take_nowait()
                if slot is None:
                    delivered[self.label] += sender.flush()  # what the consumer frees depends on what it has
                    # A consumer with half its slots' batches still to return
                    # frees slots at its own pace: wait for a quarter of them
                    # (or POLL_S) and send those together, not a record and a
                    # wake-up on both sides per slot freed.
                    want = max(1, area.slots // 4) if 2 * ledger.outstanding() >= area.slots else 1
                    self._starved = True
                    self._nudge.set()
                    try:
                        while slot is None and not self.closed.is_set() and self._stopping is None:
                            slot = area.take(POLL_S, want)
                    finally:
                        self._starved = False
                    if slot is None:
                        return  # (stopping, or the consumer gone: in_hand goes back)
                # held and unacknowledged from now, before it is written:
                # a "free" of it that arrives during the write is early
                # (kept until the acknowledgement), never a reuse
                ledger.hold(slot)
                g = ledger.number()
                loan = lending.loan(item.batch.arrays)
                if loan is None:
                    item, meta, text = sender.write(area, slot, item)
                    ledger.record(g, item, slot, meta)
                    in_hand = None
                else:
                    # the consumer reads it where it lies; its slot only
                    # stands for it (the flow control).  Recorded first:
                    # should the consumer be gone, the batch is
                    # unacknowledged (dealt again), not lost
                    meta = None
                    ledger.record(g, item, slot, meta)
                    in_hand = None
                    text = lending.lend(loan, g, slot, item.batch.arrays)
                sent = sender.send_batch(g, slot, item.batch.n, meta, text, item.batch.arrays, area.slot_bytes)
                if sent:  # (most batches wait for the record that takes several)
                    delivered[self.label] += sent
            if isinstance(pending, Item):
                self._unsent(pending)  # taken just before a stop: dealt again, not lost
            # batches written and not sent (the service stops, or the
            # consumer left) stay in the ledger: unacknowledged, dealt again
        except OSError as err:
            if not self.closed.is_set():
                logger.info("service: sending to %s failed: %s", self.peer, str(err))
            if isinstance(err, (ConnectionResetError, BrokenPipeError)):
                # the consumer died: the receiver still reads what it sent
                # last (its acknowledgements), then its end, and leaves
                return
            self.close()  # the consumer is gone for us: wake the receiver
        except Exception:
            logger.exception("service: sender of %s failed", self.peer)
            self.close()
        finally:
            if in_hand is not None:
                self._unsent(in_hand)  # taken for the consumer, never recorded: dealt again

    def _unsent(self, item: Item) -> None:
        """An item taken for the consumer that never reached it: it counts as unacknowledged."""
        assert self.ledger is not None
        self.ledger.unsent(item)

    def _end(self, end: End) -> None:
        err = end.error
        if err is None:
            record = {"t": "end", "error": None, "kind": "end"}
        else:
            kind = "fetcher" if not getattr(err, "service_stop", False) else "stopped"
            record = {"t": "end", "error": str(err), "kind": kind}
        self._ended = True
        if record["kind"] == "stopped":
            with self._tell_lock:
                self._stop_told = True
        self.channel.send(record)

    def tell_stopped(self, reason: str) -> None:
        """The service stops: tell the consumer (best effort), also one that
        has the data's end already (it may still be returning batches); it
        answers ``bye`` once its ``run()`` returns no more batches, and
        ``closed`` is set then.

        Never blocks for long: if the connection is busy (the sender is in
        the middle of a batch, or stuck sending to a consumer that does not
        read) the sender tells it after that frame; a stuck one is freed
        when the stop closes the connection."""
        if self.sender is None:
            self.close()  # still in its handshake
            return
        record = {"t": "end", "error": reason, "kind": "stopped"}
        with self._tell_lock:
            self._stopping = reason
            if not self._claim_stop():
                return
            try:
                self.channel.send(record, wait=False)
            except (TimeoutError, BlockingIOError):
                # nothing went out: the sender tells, unless it is done already
                if self._sender_done:
                    self.close()  # closing is the only word left
                else:
                    self._stop_told = False
            except OSError:
                self.close()

    def _claim_stop(self) -> bool:
        """(Under ``_tell_lock``.) True if the stop is still to be told; it is claimed."""
        if self._stop_told or self.closed.is_set():
            return False
        self._stop_told = True
        return True

    def close(self) -> None:
        self.closed.set()
        self._nudge.set()
        if self._acks is not None:
            self._acks.shut()  # the consumer's next acknowledgement fails: run() returns no batch uncounted
        try:
            self.channel.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if self.area is not None:
            self.area.close()

    # -- leaving -----------------------------------------------------------------------
    def _leave(self) -> None:
        self.close()
        if self.sender is not None and self.sender is not threading.current_thread():
            self.sender.join(timeout=10.0)
        source, outlet, area = self.source, self.outlet, self.area
        # what its run() never returned cannot be in the user's hands
        ledger = self.ledger
        not_returned = ledger.not_returned() if ledger is not None else set()
        if source is not None and outlet is not None and ledger is not None:
            ledger.close()

            def keep(item: Item, slot: int, meta: Any) -> Item:
                # copied out of the slot, so the area goes with its
                # consumer: with many slots in flight, re-dealt batches of
                # several consumers that left would keep each one's whole
                # area mapped until dealt again
                return item._replace(batch=item.batch._replace(arrays=_copied(area.read(slot, meta))))  # type: ignore[union-attr]

            unacked = ledger.hand_back(keep if area is not None and area.holds_bytes else None)
            source.release(self, outlet, unacked)
            logger.info("service: %s left (%d unacknowledged)", self.peer, len(unacked))
        self.lending.leave(not_returned, source.arena.park if source is not None else None)
        if area is not None:
            area.unmap()  # unless what it left unacknowledged still views it
        if self._acks is not None:
            self._acks.close()
        self.channel.close()


def _nothing() -> None:
    pass


def _copied(arrays: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    """Read-only copies of ``arrays``."""
    out = tuple(np.array(a) for a in arrays)
    for a in out:
        a.flags.writeable = False
    return out
