"""Process workers: each worker is a child process, past the GIL.

For each worker the parent keeps:

* a :class:`~blobfeed.feeders.transport.SlotArea` (an anonymous ``memfd``)
  and a pipe of free slot indexes back to the child;
* a receiver thread that reads the child's messages and hands each result to
  the worker's :class:`~blobfeed.feeders.source.WorkerIntake`, blocking when
  the internal queue is full (so backpressure reaches the child: it cannot
  get ahead by more than its slots and one pipe buffer);

and per group one watcher thread that waits on every child's sentinel, so a
child that dies is an error within milliseconds, not at the next poll, and
one returner thread that gives a slot back to its worker once no array views
it any more (see :meth:`~.slot_ring.SlotReturns.watch` for why not a finalizer).

Children are started by a ``forkserver`` (never a plain fork of this
multi-threaded process) that has numpy and blobfeed loaded already, ignore
SIGINT (Ctrl-C is the program's to handle), die with the program however it
dies (see :func:`~blobfeed.feeders.child.child_main`), end by themselves
when their source stops or fails, and are killed by ``stop()`` if they do
not.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import BlobfeedError, FetcherError
from ..shared_regions import REGIONS, SharedRegion
from .backends import FetchFun, LaunchPlan, WorkerGroup, WorkerInitFun, WorkerPlan, runs_user_code, thread_main
from .child import child_main
from .chunks import GrantPin
from .read_units import HOLDERS, UNIT_RECORD, ReadUnit
from .starting import _exit_if_importing_main, _main_module, _payload, _payload_fd, describe_exit, early_exit
from .starting import exit_fd, preload_forkserver, process_context, serialize_polls
from .messages import Arrays, LayoutCache, Note, Raised, Result
from .pulling import ENDED, Puller
from .rebatch import BufferPool
from .slot_ring import SlotReturns
from .slot_ring import SlotRing as _SlotRing
from .slot_ring import lendable
from .transport import FdHandle, MessageReader, SlotArea, mem_available, unpack_exception
from .worker_loop import deliver

__all__ = ["ProcessBackend"]

logger = logging.getLogger("blobfeed.feeders.processes")

#: seconds stop() lets a child end by itself before it is killed
STOP_GRACE_S = 0.25
#: slots per worker by default, and for a random-access source's (see ProcessBackend)
SLOTS, UNIT_SLOTS = 8, 24


class ProcessBackend:
    """Workers are child processes (``backend="processes"``).

    Args:
        slots: shared-memory slots per worker: how many large chunks a worker
            can have in flight (in the internal queue, being re-batched, or
            viewed by batches).  None: 8; for a random-access or sharded
            source 24 (a worker process reads up to half its slots ahead of
            the stream), fewer where the machine's available memory would
            hold less than twice their reserve, never under 8.
        slot_bytes: the size of one slot; a larger chunk is pickled through
            the pipe instead (logged once per worker).
        start_method: ``"forkserver"`` (default) or ``"spawn"``; never
            ``"fork"``, which is unsafe in a multi-threaded process.

    ``fetch_fun`` and ``worker_init_fun`` must pickle (a module-level
    function, or anything cloudpickle handles); each worker process gets its
    own copy, so state they keep is per worker.
    """

    #: runs random-access sources (gives its workers read units: LaunchPlan.units)
    random_access = True
    #: can add and remove workers of a running fetch_fun source (LaunchPlan.elastic, WorkerGroup.retire)
    elastic = True
    name = "processes"

    def __init__(self, *, slots: int | None = None, slot_bytes: int = 16 * 1024 * 1024,
                 start_method: str = "forkserver") -> None:
        from ..arguments import check_index

        self.slots = None if slots is None else check_index("slots", slots, minimum=2)
        self.slot_bytes = check_index("slot_bytes", slot_bytes, minimum=4096)
        if start_method not in ("forkserver", "spawn"):
            raise ValueError(f"start_method must be 'forkserver' or 'spawn', got {start_method!r}")
        self.start_method = start_method

    def slots_to_lend(self, batches: int) -> int:
        """Slots per worker (at least ``slots``, at most 64) for ``batches`` of
        each worker's to be lent at once as views of its slots (held by a
        consumer that reads them there); past what a worker lends, a batch
        is copied out of its slot."""
        n = self.slots or SLOTS
        while lendable(n) < batches and n < 64:
            n += 1
        return n

    def slots_for(self, plan: LaunchPlan) -> int:
        """The slots each worker of ``plan`` gets (see ``slots``)."""
        if self.slots is not None:
            return self.slots
        if plan.units is None:
            return SLOTS
        # the reserve counts every slot in full; the pages used are those
        # the units ahead fill (read_units.AHEAD_BYTES): half of what is free
        free = mem_available()
        fits = UNIT_SLOTS if free is None else free // 2 // max(1, len(plan.workers) * self.slot_bytes)
        return max(SLOTS, min(UNIT_SLOTS, fits))

    def check(self, fetch_fun: FetchFun, worker_init_fun: WorkerInitFun | None) -> None:
        _exit_if_importing_main()
        _payload(fetch_fun, worker_init_fun)

    def launch(self, plan: LaunchPlan) -> WorkerGroup:
        _exit_if_importing_main()
        slots = self.slots_for(plan)
        need = len(plan.workers) * slots * self.slot_bytes
        free = mem_available()
        if free is not None and need > free:
            raise BlobfeedError(
                f"source {plan.source!r}: process workers need {need / 2**20:.0f} MiB of shared "
                f"memory ({len(plan.workers)} workers x {slots} slots x "
                f"{self.slot_bytes / 2**20:.1f} MiB) and {free / 2**20:.0f} MiB are available "
                "(the machine's, within this process's cgroup limit); pass "
                "backend=ProcessBackend(slots=..., slot_bytes=...) with less"
            )
        return _ProcessGroup(self, plan, _payload(plan.fetch_fun, plan.worker_init_fun), slots)

    def __repr__(self) -> str:
        return f"ProcessBackend(slots={self.slots}, slot_bytes={self.slot_bytes}, start_method={self.start_method!r})"


class _Worker:
    """The parent's end of one worker process."""

    def __init__(self, group: "_ProcessGroup", w: WorkerPlan, payload_fd: int) -> None:
        self.plan = w
        self.group = group
        self.name = f"blobfeed-fetch-{group.source}-{w.worker_id}"
        backend = group.backend
        self.area, self._area_fd = SlotArea.create(self.name, group.slots, backend.slot_bytes)
        area_fd = self._area_fd
        #: the area as a region other processes may map, once the child mapped it (see _share)
        self._region: SharedRegion | None = None
        self._shared = False
        free_r, free_w = os.pipe()
        os.set_blocking(free_w, False)
        self.ring = _SlotRing(group.slots, free_w, self.area.set_viewed)
        #: where chunks copied out of their slots go (see _slot_result): the receiver's alone
        self._copies = BufferPool(size_classes=True)
        self._lock = threading.Lock()
        self._closed = False
        #: the child said "done" (StopIteration): its exit is not a death
        self.done = False
        self._death_reported = False
        #: set once its death was reported (and it was replaced, or not)
        self.death_handled = threading.Event()
        # two threads polling one forkserver child race to read its exit
        # status (the loser sees EOF and makes it 255): every poll, kill and
        # close takes this, multiprocessing's own polls too (serialize_polls)
        self._proc_lock = threading.RLock()
        self._proc_closed = False
        #: the exit code once known (negative: the signal that killed it)
        self.exitcode: int | None = None
        out_r, out_w = os.pipe()
        #: a random-access source: the pipe its read units go down (see attach_units)
        self.units = group.plan.units
        #: this incarnation's name with the dispenser (a replacement has its own)
        self.holder = next(HOLDERS)
        self.units_w = -1
        units_r = -1
        if self.units is not None:
            units_r, self.units_w = os.pipe()
            os.set_blocking(self.units_w, False)  # written under the dispenser's lock: see _send_unit
        info = w.info
        self.process = group.ctx.Process(
            target=child_main,
            name=self.name,
            args=(
                w.worker_id, info.index, info.num_workers, info.source, info.seed,
                FdHandle(payload_fd), w.intake.on_error, FdHandle(area_fd), group.slots,
                backend.slot_bytes, FdHandle(free_r), FdHandle(out_w), backend.start_method == "forkserver",
                group.plan.epochs, group.plan.first_epoch,
                FdHandle(units_r) if units_r >= 0 else None,
            ),
            daemon=True,
        )
        try:
            self.area.set_hint(group.plan.batch_size_hint())
            self.area.set_whole(self._whole())
            self.process.start()
            serialize_polls(self.process, self._proc_lock)
        except BaseException:
            self.ring.close()
            os.close(out_r)
            os.close(area_fd)
            if self.units_w >= 0:
                os.close(self.units_w)
                self.units_w = -1
            raise
        finally:
            # the child has its copies now (or never will): ours go, but
            # for the area's (see _share)
            os.close(free_r)
            os.close(out_w)
            if units_r >= 0:
                os.close(units_r)
        self.pid: int = self.process.pid or 0
        #: ready when the worker process itself has ended (see starting.exit_fd)
        self.sentinel, self._own_sentinel = exit_fd(self.process)
        #: the child's messages, until the child ended (not until the pipe's EOF: a
        #: process fetch_fun forked may hold its write end for ever), and their layouts
        self.reader, self._layouts = MessageReader(out_r, self.sentinel), LayoutCache()
        self.pipe_fd = out_r
        #: what the group's puller last got from this worker, acted on first
        #: by the receiver thread once it takes over (see blobfeed.feeders.pulling)
        self._pending: Any = True
        #: the group's puller reads its messages; its thread starts at the hand-over (``handed``)
        self.pulled, self.handed = False, threading.Event()
        self.thread = threading.Thread(
            target=thread_main,
            args=(f"blobfeed-recv-{group.source}-{w.worker_id}", self._receive, group.plan.on_thread_exit),
            name=f"blobfeed-recv-{group.source}-{w.worker_id}",
            daemon=True,
        )

    def attach_units(self) -> None:
        """The dispenser pushes the child its units down its pipe (undelivered,
        at most half its slots, and as its units' bytes allow: see
        read_units.AHEAD_BYTES) from the threads that free them (a thread
        per process cost 2-5 context switches a unit)."""
        if self.units is not None:
            ahead = max(2, self.group.slots // 2)
            self.units.attach(self.plan.worker_id, self.holder, ahead, self._send_unit, self._unit_failed)

    def _send_unit(self, r: ReadUnit | None) -> None:
        """A unit down the child's pipe; None: close it (the dispenser calls
        this under its lock, so it never blocks: the pipe is non-blocking
        and holds far more records than a worker's slots)."""
        fd = self.units_w
        if fd < 0:
            return
        if r is None:
            self.units_w = -1
            os.close(fd)
            return
        os.write(fd, UNIT_RECORD.pack(r.unit, r.lo, r.hi))

    def _unit_failed(self, r: ReadUnit | None, exc: BaseException) -> None:
        """Sending unit ``r`` raised: the dispenser detached this child and
        closed its pipe.  Called where a unit was freed, maybe under the
        dealer's lock and a feed's (the stream taking a unit): failing the
        source takes those locks, so a thread of the group's does it."""
        if isinstance(exc, (BrokenPipeError, ConnectionError)):
            return  # the child is gone: its receiver says why
        # the child would end as done while it holds the unit: the stream
        # would wait for it for ever.  The source fails instead.
        wid = self.plan.worker_id
        logger.error("source %r, worker %d: sending read unit %s failed", self.group.source, wid, r, exc_info=exc)
        failure = FetcherError(
            f"source {self.group.source!r}, worker {wid}: blobfeed could not send read unit "
            f"{r.unit if r is not None else '?'} (positions {r.lo if r is not None else '?'} to "
            f"{r.hi if r is not None else '?'}) to its worker process: {exc!r}"
        )
        failure.__cause__ = exc
        self.group.fail_soon(self.plan.intake.source, failure)

    # -- slots --------------------------------------------------------------
    def _slot_result(self, event: Result, message_bytes: int) -> bool:
        """Hand a result the child wrote into a slot to the intake, as
        read-only views of the slot (or copied out: see _SlotRing.hold)."""
        intake = self.plan.intake
        area = self.area
        packed: Arrays = event.raw
        slot = packed.where
        if not self._shared:
            self._share()
        layouts = self._layouts
        used = layouts.nbytes_of(packed)
        root = np.frombuffer(area.mm, np.uint8, count=used, offset=area.offset(slot))
        root.flags.writeable = False
        # Every view's base is `root`, so the slot returns to the child when the last
        # view of it dies: the group's returner thread hears of it (slot_ring.SlotReturns).
        self.group.returns.watch(root, self.ring, slot)
        arrays = layouts.read(root, packed)
        del root
        # Whether to copy the chunk out goes by its rows; a malformed chunk
        # (no such axis) is the intake's to report, as views.
        first, axis = arrays[0], intake.source.axes[0]
        rows = first.shape[axis] if first.ndim > axis else 0
        # A chunk smaller than a batch waits for others only where a reader
        # or the dealer holds it for them: not when it is dealt as it comes
        # into big batches, each piece copied at once (a copy out here would
        # be a second one, made when the pipeline is busiest).
        small = rows and rows < self.group.plan.batch_size_hint() and not intake.source.lets_go_at_once(used // rows)
        if rows and self.ring.hold(bool(small)):
            # Copy out; the views die with this call and the slot goes back.
            # Into recycled memory: fresh pages for every copy cost three
            # times the copy itself (W2p: 8-13 % of the batches/s).
            copied = self._copies.batch([(a.shape, a.dtype) for a in arrays])
            for dst, a in zip(copied, arrays):
                np.copyto(dst, a, casting="no")
            return bool(deliver(intake, event._replace(raw=tuple(copied) if packed.as_tuple else copied),
                                None, used + message_bytes))
        result = Result(event.seconds, arrays, event.state, event.calls)  # (not _replace: twice the calls)
        return bool(deliver(intake, result, GrantPin(self.ring, slot), used + message_bytes))

    def _share(self) -> None:
        """Register the area as a shared region (see blobfeed.shared_regions):
        the child mapped it (it wrote a slot), so it can be sealed against
        new writable mappings, and a consumer in another process may be
        handed its descriptor to read the batches where they lie."""
        with self._lock:
            if self._closed or self._shared:
                return
            self._shared = True
            self._region = self.area.shared_region(self.name, self._area_fd)
            if self._region is not None:
                REGIONS.add(self._region)

    def _whole(self) -> int:
        """The size of the batches the child may assemble itself, 0: none
        (see worker_batches).  Not with ``on_error="skip"``: a chunk skipped
        is logged and counted as the call that made it."""
        intake = self.plan.intake
        return intake.source.whole_batch_size() if intake.on_error == "raise" else 0

    # -- receiving: the group's puller, then the receiver thread -----------------
    def receive_one(self) -> Any:
        """One message to the intake, in the puller's thread (see pulling.Pullable)."""
        # (no hint, nor whole batches, to keep up to date: a pulled worker
        # reads units, which take no batch size and go out as they are read)
        data = self.reader.recv()
        return ENDED if data is None else self._handle(data)

    def hand_over(self, pending: Any) -> None:
        """Start the receiver thread, acting on ``pending`` first (see pulling.Pullable)."""
        self._pending = pending
        try:
            self.thread.start()
        finally:
            self.handed.set()  # (a thread that could not start: nobody waits for its hand-over)

    def await_hand_over(self, timeout: float | None) -> bool:
        """Wait until its thread started (a read in progress puts a hand-over off)."""
        return self.handed.wait(timeout)

    def _receive(self) -> None:
        intake = self.plan.intake
        area = self.area
        hint = self.group.plan.batch_size_hint
        whole = self._whole
        recv = self.reader.recv
        handle = self._handle
        exhausted = False
        if not self.pulled:
            intake.started()  # (a pulled worker's was counted as it was added)
        go, self._pending = self._pending, None
        try:
            while True:
                if isinstance(go, Exception):
                    raise go  # the puller could not take its message
                if go is ENDED:
                    break
                if go is None:
                    self.done = exhausted = True
                    return
                if not go:
                    # the source stopped or failed: so does the child, by
                    # itself (as threads do), while we drain what it sends
                    self._drain()
                    return
                data = recv()
                if data is None:
                    break  # the child ended: its sentinel tells how
                area.set_hint(hint())
                area.set_whole(whole())
                # One message per call: what it held (a chunk viewing a slot)
                # dies with the call, never kept while we wait for the next
                # one -- a stale reference here and the batches a user keeps
                # could take every slot and stall the child.
                go = handle(data)
                del data
            # ended without "done": the child ended; the watcher may have said so already
            self.wait_exit(1.0)
            self.report_death()
        except Exception as exc:
            # A message this thread cannot take (or a bug of blobfeed's): the
            # source fails now, rather than its consumer waiting for a timeout
            # behind a dead receiver.  The child stops with the source.
            logger.exception("source %r, worker %d: the receiver failed", self.group.source, intake.worker_id)
            err = FetcherError(
                f"source {self.group.source!r}, worker {intake.worker_id}: blobfeed cannot take "
                f"its messages: {exc!r}"
            )
            err.__cause__ = exc
            intake.source.fail(err)
        finally:
            intake.finished(exhausted)

    def _drain(self) -> None:
        """Tell the child to stop and discard its messages until it ends (it
        may be blocked sending one); its slots go straight back to it."""
        self.area.set_stop()
        self.ring.stop()
        recv = self.reader.recv
        while True:
            data = recv()
            if data is None:
                break
            try:
                events = pickle.loads(data)
            except Exception:  # an unpicklable result: discarded anyway
                continue
            for event in events:
                if type(event) is Result and type(event.raw) is Arrays:
                    self.ring.release(event.raw.where)
        self.wait_exit(1.0)
        self.report_death()

    def _handle(self, data: bytearray) -> bool | None:
        """Hand one message of the child (a list of events) to the intake.
        Returns False when the worker must stop, None when it is done."""
        intake = self.plan.intake
        try:
            events = pickle.loads(data)
        except Exception as exc:  # a result whose class this process cannot load, say
            err = RuntimeError(f"what the worker process sent could not be unpickled here: {exc!r}")
            err.__cause__ = exc
            return intake.exception(err)
        share = len(data) // max(1, len(events))
        units = self.units
        for event in events:
            kind = type(event)
            if units is not None and (kind is Result or kind is Raised):
                unit = event.state if kind is Result else None
                if not units.delivered(self.holder, unit) and kind is Result:
                    # read by a process that died meanwhile: another reads it again
                    if type(event.raw) is Arrays:
                        self._layouts.nbytes_of(event.raw)  # (the next may say "the same layout")
                        self.ring.release(event.raw.where)
                    continue
                if kind is Result:
                    self.group._deaths[self.plan.worker_id] = 0
            if kind is Result:
                if type(event.raw) is Arrays:
                    go: bool | None = self._slot_result(event, len(data))
                else:
                    go = deliver(intake, event, None, share)
            elif kind is Raised:
                go = deliver(intake, event._replace(error=unpack_exception(event.error, event.tb)))
            elif kind is Note:
                logger.warning("source %r, worker %d: %s", self.group.source, self.plan.worker_id, event.text)
                go = True
            else:
                go = deliver(intake, event)
            if go is not True:
                return go
        return True

    def report_death(self) -> None:
        """The child ended: a death unless it returned by itself (after
        "done", an error it reported, or a stop), or we are stopping it."""
        if self.exitcode == 0 and self.area.ending():
            return
        with self._lock:
            if self.done or self._death_reported or self.group.stopping:
                return
            self._death_reported = True
        try:
            self._report_death()
        finally:
            self.death_handled.set()

    def _report_death(self) -> None:
        code = self.exitcode
        started = self.area.started()
        if self.units is not None and code is not None and (code < 0 if not started else code != 0):
            # a random-access source's worker: its units (those in its pipe
            # too) are read again by a new process.  Before its start only a
            # kill (an exit code is a start-up failing, as the next one would)
            intake = self.plan.intake
            poison = self.units.retire(self.holder, self.area.reading())
            if poison:
                unit, tries = poison[0]
                intake.died(
                    f"worker process pid {self.pid} {describe_exit(code)}; the processes reading "
                    f"{self.units.name_of(unit)} died {tries} times (a sample that kills its reader?)"
                )
                return
            if self.group.replace(self, code):
                intake.stats.deaths[intake.backend] += 1  # counted as any death (died() counts its own)
                return
            self.units.release(self.plan.worker_id)  # not replaced: any worker reads them
        if started or code is None or code < 0:
            self.plan.intake.died(f"worker process pid {self.pid} {describe_exit(code)}",
                                  when="" if started else " while starting")
            return
        self.plan.intake.died(*early_exit(self.pid, code, self.group.main_module))

    # -- the process ------------------------------------------------------------
    def poll(self) -> int | None:
        """The exit code, or None while the process runs.  Never blocks long."""
        with self._proc_lock:
            if self.exitcode is None and not self._proc_closed:
                # is_alive() asks the process (waitpid, or the forkserver),
                # not its sentinel, which a helper it forked may keep open
                self.process.is_alive()
                self.exitcode = self.process.exitcode
            return self.exitcode

    def wait_exit(self, timeout: float | None) -> int | None:
        """Wait until the process ended (at most ``timeout`` s); its exit code or None."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.exitcode is None and not self._proc_closed:
            multiprocessing.connection.wait([self.sentinel], timeout)
        code = self.poll()
        # A spawned child's sentinel is a pipe that closes as it exits, a
        # moment before it can be reaped (its last threads are still going):
        # ended, then, but its exit code is still to come.
        while code is None and not self._proc_closed and multiprocessing.connection.wait([self.sentinel], 0):
            if deadline is not None and time.monotonic() >= deadline:
                break
            time.sleep(0.002)
            code = self.poll()
        return code

    def running(self) -> bool:
        return self.poll() is None

    def kill(self) -> None:
        with self._proc_lock:
            if self.exitcode is None and not self._proc_closed:
                logger.info("stop: killing worker process %s (pid %d)", self.name, self.pid)
                self.process.kill()

    def close(self) -> None:
        """Release what this worker holds once its process and thread ended:
        descriptors now, the mapping now unless batches the user keeps view
        it (then it goes with the last of them)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self.units is not None:
            # closes the units' pipe if attached; once attached, only the
            # dispenser closes it (under its lock), so this cannot race it
            self.units.detach(self.holder)
        if self.units_w >= 0:  # never attached
            os.close(self.units_w)
            self.units_w = -1
        self.ring.close()
        os.close(self.reader.fd)
        if self._own_sentinel:
            os.close(self.sentinel)
        if self.poll() is not None:
            with self._proc_lock:
                self._proc_closed = True
                self.process.close()  # its sentinel descriptor
        with self._lock:
            region, self._region = self._region, None
        if region is not None:
            REGIONS.remove(region)  # before its descriptor closes: see RegionIndex.dup_fd
        os.close(self._area_fd)
        area, self.area = self.area, None  # type: ignore[assignment]
        area.close()  # (viewed: unmapped with the last view)


class _ProcessGroup:
    """The workers of one ``init_data_input_workers`` call, and three kinds of
    helper threads: a receiver per worker, one watcher of the children's
    sentinels, and one returner that gives slots back to the workers."""

    def __init__(self, backend: ProcessBackend, plan: LaunchPlan, payload: bytes, slots: int) -> None:
        self.backend = backend
        self.plan = plan
        #: each worker's slots (ProcessBackend.slots_for)
        self.slots = slots
        payload_fd = _payload_fd(payload)
        self.source = plan.source
        self.ctx = process_context(backend.start_method)
        #: what each worker process imports first (named if it fails there)
        self.main_module = _main_module()
        if backend.start_method == "forkserver":
            preload_forkserver(self.ctx)
        self.stopping = False
        self._join_lock = threading.Lock()
        #: replacements of dead workers (a random-access source); per
        #: worker id, deaths since its last delivered unit
        self._replace_lock = threading.Lock()
        self._joining = False
        self._new_workers: list[_Worker] = []
        #: threads failing the source for a unit that could not be sent (see fail_soon)
        self._failers: list[threading.Thread] = []
        self._deaths: dict[int, int] = {}
        self._released = False
        self._wake_r, self._wake_w = os.pipe()
        #: the watcher ended: every process ended and none can be replaced
        #: any more; the wake pipe is closed (under _replace_lock)
        self._watch_ended = False
        #: the slots the chunks handed out view, given back as they die
        self.returns = SlotReturns()
        self.workers: list[_Worker] = []
        #: the reader's thread receives the workers' messages (see blobfeed.feeders.pulling)
        self.puller: Puller | None = None
        try:
            for w in plan.workers:
                self.workers.append(_Worker(self, w, payload_fd))
        except BaseException:
            self._abort_start()
            raise
        finally:
            # every worker has its copy now (or never will): ours goes (a
            # replacement of a dead worker gets the dataset pickled again:
            # it may be big, and is not kept in RAM for the run for that)
            os.close(payload_fd)
        self.returner = self._thread("slots", self.returns.run)
        if plan.pulled_by is not None:
            self.puller = plan.pulled_by()
        for wk in self.workers:
            self._receive_from(wk)
            wk.attach_units()
        self.watcher = self._thread("watch", self._watch)

    def _receive_from(self, wk: "_Worker") -> None:
        """Read ``wk``'s messages: pulled, or by its own receiver thread."""
        if self.puller is not None and not self.stopping:
            wk.pulled = True
            wk.plan.intake.started()
            if self.puller.add(wk):
                return
        wk.hand_over(True)

    def _hand_over_all(self) -> None:
        """Every worker pulled is read by its own thread from now on."""
        for wk in self.workers if self.puller is not None else ():
            self.puller.hand_over(wk)  # type: ignore[union-attr]

    #: a worker id is replaced at most this many times in a row (its processes
    #: dying without delivering a unit in between): the next death fails the source
    MAX_REPLACEMENTS = 3

    def replace(self, dead: "_Worker", code: int | None) -> bool:
        """Start a process in place of ``dead`` (a random-access source's
        worker that died): same worker id, intake and lane.  False when it
        is not replaced (stopping, or its processes keep dying)."""
        wid = dead.plan.worker_id
        with self._replace_lock:
            if self.stopping or self._joining or self._watch_ended or self._released or dead.plan.intake.halted:
                return False
            deaths = self._deaths[wid] = self._deaths.get(wid, 0) + 1
            if deaths > self.MAX_REPLACEMENTS:
                return False
            logger.warning(
                "source %r, worker %d: worker process pid %d %s; a new process takes its place and the "
                "read units it held are read again", self.source, wid, dead.pid, describe_exit(code),
            )
            try:
                payload_fd = _payload_fd(_payload(self.plan.fetch_fun, self.plan.worker_init_fun))
                try:
                    wk = _Worker(self, dead.plan, payload_fd)
                finally:
                    os.close(payload_fd)
            except Exception:
                logger.exception("source %r, worker %d: the new worker process did not start", self.source, wid)
                return False
            self.workers = self.workers + [wk]  # a new list: others iterate the old one
            self._new_workers.append(wk)
            self._receive_from(wk)
            wk.attach_units()
        self._wake(b"a")  # the watcher watches it too
        return True

    def fail_soon(self, source: Any, failure: BaseException) -> None:
        """Fail ``source`` from a thread of its own: the caller may hold
        locks that failing it takes (joined by :meth:`join`)."""
        self._failers.append(self._thread("fail", functools.partial(source.fail, failure)))

    def _wake(self, what: bytes) -> None:
        """A byte to the watcher, unless it ended (its pipe is closed then)."""
        with self._replace_lock:
            if self._watch_ended:
                return
            try:
                os.write(self._wake_w, what)
            except OSError:
                pass

    def _thread(self, role: str, body: Callable[[], None]) -> threading.Thread:
        """Start one of the group's own daemon threads, ``blobfeed-<role>-<source>``."""
        name = f"blobfeed-{role}-{self.source}"
        t = threading.Thread(target=thread_main, args=(name, body, self.plan.on_thread_exit), name=name, daemon=True)
        t.start()
        return t

    def _abort_start(self) -> None:
        self.stopping = True
        for wk in self.workers:
            wk.kill()
            wk.wait_exit(5.0)
            wk.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    #: how often the watcher looks whether an ended worker's threads ended
    #: too (then it releases what that worker holds)
    REAP_POLL_S = 0.2

    def _watch(self) -> None:
        """Wait on every child's sentinel at once: a death is seen at once.
        A worker whose process and threads ended is closed and dropped (a
        replaced one, a removed one: its slot area and descriptors go now,
        not at stop()); once every process ended and none can be replaced,
        the watcher waits for their threads, ends the returner and ends."""
        waiting = {wk.sentinel: wk for wk in self.workers}
        ended: list[_Worker] = []
        try:
            while True:
                with self._replace_lock:
                    for wk in self._new_workers:
                        waiting[wk.sentinel] = wk
                    self._new_workers = []
                    if not waiting:
                        # every process ended and was reported (here, before
                        # we got here): no replacement can come any more
                        self._watch_ended = True
                        break
                ready = multiprocessing.connection.wait(
                    [*waiting, self._wake_r], self.REAP_POLL_S if ended else None,
                )
                if self._wake_r in ready:
                    if b"x" in os.read(self._wake_r, 64):
                        return
                    ready = [r for r in ready if r != self._wake_r]
                for s in ready:
                    wk = waiting.pop(s)  # type: ignore[arg-type]
                    if wk.pulled:  # its thread reads what it sent, then reports (puts never wait)
                        self.puller.hand_over(wk)  # type: ignore[union-attr]
                        if wk.await_hand_over(10.0) and wk.thread.ident is not None:
                            wk.thread.join(10.0)
                    wk.wait_exit(1.0)
                    # Not a return of child_main (a signal, a crash, os._exit)? Then say so now,
                    # without waiting for a receiver that may be blocked on a full queue.
                    wk.report_death()
                    if wk._death_reported:
                        # its receiver may be reporting it: replaced before we go on
                        wk.death_handled.wait(10.0)
                    ended.append(wk)
                ended = self._reap(ended)
            # every process ended: once their receivers did too (they may
            # still be handing their last results over), nothing needs a
            # slot back any more
            for wk in ended:
                if wk.await_hand_over(None) and wk.thread.ident is not None:  # (a read in progress ends with it)
                    wk.thread.join()
            self._reap(ended)
            self.returns.end()
            self.returner.join()
            self.returns.clear()  # batches the user keeps: their slots need no return
        finally:
            with self._replace_lock:
                self._watch_ended = True
                os.close(self._wake_r)
                os.close(self._wake_w)

    def _reap(self, ended: list[_Worker]) -> list[_Worker]:
        """Close and drop the workers of ``ended`` whose threads ended too;
        returns the others."""
        left = []
        for wk in ended:
            if not wk.handed.is_set() or wk.thread.is_alive() or wk.poll() is None:
                left.append(wk)
                continue
            with self._replace_lock:
                self.workers = [w for w in self.workers if w is not wk]
            wk.close()
        return left

    def request_stop(self) -> None:
        self.stopping = True
        self._hand_over_all()  # the receiver threads drain the children as they stop
        for wk in self.workers:
            area = wk.area
            if area is not None:
                try:
                    area.set_stop()
                except ValueError:
                    pass  # closed meanwhile: the worker has ended
            wk.ring.stop()

    def retire(self, worker_ids: Sequence[int]) -> None:
        """Tell the worker processes ``worker_ids`` to make no further call:
        each sends what it fetched and returns (an exit with code 0 after
        its last message, not a death); its receiver hands every message
        over and ends.  Never waits."""
        ids = set(worker_ids)
        for wk in list(self.workers):
            area = wk.area
            if wk.plan.worker_id in ids and area is not None:
                try:
                    area.set_stop()
                except ValueError:
                    pass  # closed meanwhile: the worker has ended

    def join(self, deadline: float | None) -> list[str]:
        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        with self._replace_lock:
            self._joining = True
        self._hand_over_all()  # every worker's thread runs (and is joined below)
        with self._join_lock:
            if self._released:
                return []
            now = time.monotonic()
            grace_end = now + STOP_GRACE_S if deadline is None else min(deadline, now + STOP_GRACE_S)
            if self.stopping:
                for wk in self.workers:
                    wk.wait_exit(max(0.0, grace_end - time.monotonic()))
                for wk in self.workers:
                    wk.kill()
            stuck = []
            for t in self._failers:
                t.join(left())
                if t.is_alive():
                    stuck.append(t.name)
            for wk in list(self.workers):
                wk.wait_exit(left())
                if wk.await_hand_over(left()) and wk.thread.ident is not None:
                    wk.thread.join(left())
                if wk.running():
                    stuck.append(wk.name)
                if wk.thread.is_alive() or not wk.handed.is_set():
                    stuck.append(wk.thread.name)
            if not any(wk.running() for wk in self.workers):
                self._wake(b"x")
                self.watcher.join(left())
                if self.watcher.is_alive():
                    stuck.append(self.watcher.name)
                if not any(wk.thread.is_alive() or not wk.handed.is_set() for wk in self.workers):
                    self.returns.end()  # no worker needs a slot any more
                self.returner.join(left())
                if self.returner.is_alive():
                    stuck.append(self.returner.name)
            if not stuck:
                self._release()
            ours = [name for name in stuck if not runs_user_code(name)]
            if ours:
                # not a fetch_fun's doing: every worker process was killed
                logger.error(
                    "source %r: blobfeed's own thread(s) %s did not end (worker processes: %s); "
                    "this is a bug in blobfeed", self.source, ", ".join(ours),
                    ", ".join(f"pid {wk.pid} {describe_exit(wk.poll())}" for wk in self.workers),
                )
            return stuck

    def _release(self) -> None:
        """Everything ended: close every descriptor now (not at the next
        garbage collection), so that nothing is left behind after stop()."""
        self._released = True
        for wk in self.workers:
            wk.close()
        # and no reference cycle through us (the coordinator holds this
        # group, the plan holds the coordinator), so that a pipeline, its net
        # and the batch the net's workspace keeps are freed as soon as they
        # are dropped, as with threads
        self.plan = None  # type: ignore[assignment]
        for wk in self.workers:
            wk.group = None  # type: ignore[assignment]
        # batches the user keeps may outlive us: their slots need no return
        self.returns.clear()

    def alive(self) -> list[str]:
        if self._released:
            return []
        out = [wk.name for wk in self.workers if wk.running()]
        out += [wk.thread.name for wk in self.workers if wk.thread.is_alive()]
        if self.watcher.is_alive():
            out.append(self.watcher.name)
        if self.returner.is_alive():
            out.append(self.returner.name)
        return out
