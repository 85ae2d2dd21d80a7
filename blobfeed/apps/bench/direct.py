"""S1's ``direct`` runner: the shortest path a batch of S1 could take in
Python, with nothing of blobfeed in it.

Two worker processes each run W2's fetcher and copy its chunks, piece by
piece, into whole batches in slots of a shared-memory file of their own (as
blobfeed's worker processes assemble whole batches).  Each batch's slot goes
straight to a consumer process, dealt in turn, as one small record on a Unix
``SOCK_SEQPACKET`` socket; the consumer maps both workers' files read-only,
views the batch where it lies, counts it, and sends the slot back on the
same socket.  No process in between, no thread hand-off, no ledger, no
checks, no order: what the machine allows for S1's work when the batch's way
from a worker to a consumer costs one record each way.  The floor beside
which the service's (and the pipelines') per-batch costs read.

The measuring process only times the window (the consumers count in a
:class:`~.measure.Tally`, as the service's do) and reads the tree's PSS;
the per-batch table's ``service`` row is the two worker processes (the
fetching, the copy, the records), its ``consumer`` row the consumers.

The ``ledger`` runner is the same path with the least a service that keeps
its guarantees must add to it: batch *g* (numbered across the workers in
turn, as a lane dealer numbers them) goes to consumer *g* mod *n* (dealing
by index: with 2 workers and 4 consumers each consumer hears from one
worker, as with the service's ``deterministic=True``); each worker tells a
ledger (a thread of the measuring process, whose whole CPU is in the
``service`` row with the workers') what it sends where before it sends it; each consumer holds
:data:`LEDGER_HOLD` batches (the one its ``run()`` returned and one queued),
then acknowledges the oldest to the ledger and gives its slot straight back
to its worker.  What a redesign that takes the service's threads off a
batch's way (the worker telling the consumer itself, the service keeping
the ledger) could reach, beside ``direct`` and ``service``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import mmap
import os
import select
import socket
import struct
import tempfile
import threading
import time
from typing import Any, Callable

import numpy as np

from .measure import Tally
from .service import CONSUMER_TIMEOUT_S, SERVICE_WORKERS, _Consumers, _window_result
from .workloads import WORKLOADS, Workload

__all__ = ["RUNNERS", "child_main", "run_direct"]

#: slots of a worker's file (a worker process of blobfeed has 8 for a fetcher's batches)
DIRECT_SLOTS = 8
#: a record: (slot, batch number), the same each way
RECORD = struct.Struct("<qq")
#: ``ledger``: a worker's word to the ledger before a batch goes (its number, consumer, worker, slot)
SENT = struct.Struct("<qqqq")
#: ``ledger``: a consumer's acknowledgement (the batch's number)
ACK = struct.Struct("<q")
#: ``ledger``: the batches a consumer holds before it acknowledges the oldest
LEDGER_HOLD = 2
#: slots are laid out as blobfeed's: each array at a multiple of this
_ALIGN = 64

#: The ``__main__`` of a worker or consumer process of this runner (the
#: current directory off ``sys.path`` first, as ``service.CONSUMER_MAIN``).
DIRECT_MAIN = (
    "import sys\n"
    "if sys.path and sys.path[0] == '':\n"
    "    del sys.path[0]\n"
    "from blobfeed.apps.bench.direct import child_main\n"
    "sys.exit(child_main(sys.argv[1:]))\n"
)


def _layout(wl: Workload) -> tuple[list[tuple[np.dtype, tuple[int, ...], int]], int]:
    """Each blob's (dtype, per-sample shape, offset in a slot), and a slot's bytes."""
    chunk = wl.fetcher(None).chunk(0)
    layout, off = [], 0
    for a in chunk:
        layout.append((a.dtype, a.shape[1:], off))
        off += -(-(a.nbytes // len(a) * wl.batch) // _ALIGN) * _ALIGN
    return layout, off


def _slots(wl: Workload, ledger: bool) -> int:
    """Slots of a worker's file: ``ledger``'s consumers hold LEDGER_HOLD
    batches each, and with dealing by index a worker deals to its share of
    them only (batch g from worker g mod 2 to consumer g mod n), so it has
    that many more than they hold."""
    if not ledger:
        return DIRECT_SLOTS
    return max(DIRECT_SLOTS, LEDGER_HOLD * -(-wl.consumers // SERVICE_WORKERS) + 4)


def _area(where: str, worker: int) -> str:
    return os.path.join(where, f"area{worker}")


def _address(where: str, worker: int) -> str:
    return os.path.join(where, f"worker{worker}")


def _ledger_address(where: str) -> str:
    return os.path.join(where, "ledger")


def _connect(path: str) -> socket.socket:
    """A connection to ``path``, which may not listen yet."""
    deadline = time.monotonic() + CONSUMER_TIMEOUT_S
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    while True:
        try:
            sock.connect(path)
            return sock
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                sock.close()
                raise RuntimeError(f"{path} did not listen within {CONSUMER_TIMEOUT_S:g} s") from None
            time.sleep(0.01)


def _worker(wl: Workload, index: int, where: str, counts: Tally, ledger: bool = False) -> dict[str, Any]:
    """Fill whole batches and deal them in turn to the consumers, until the
    measuring process's stop flag, or a consumer goes away.  ``ledger``:
    batch g to consumer g mod n, the ledger told first (see the module)."""
    layout, slot_bytes = _layout(wl)
    fetch = wl.fetcher(None)
    with open(_area(where, index), "r+b") as f:
        area = mmap.mmap(f.fileno(), _slots(wl, ledger) * slot_bytes)
    book = _connect(_ledger_address(where)) if ledger else None
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.settimeout(CONSUMER_TIMEOUT_S)
    listener.bind(_address(where, index))
    listener.listen(wl.consumers)
    conns: list[socket.socket | None] = [None] * wl.consumers
    free = list(range(_slots(wl, ledger)))
    batches = 0
    try:
        for _ in range(wl.consumers):
            sock, _ = listener.accept()
            sock.settimeout(CONSUMER_TIMEOUT_S)
            conns[RECORD.unpack(sock.recv(RECORD.size))[0]] = sock
        socks = [s for s in conns if s is not None]
        left: list[np.ndarray] | None = None
        while not counts.stopping:
            # without a free slot, wait for an acknowledgement (the consumers
            # answer each batch at once) or a consumer's end, which says stop
            ready = select.select(socks, [], [], 0 if free else None)[0]
            for sock in ready:
                try:
                    data = sock.recv(RECORD.size)
                except ConnectionResetError:
                    data = b""
                if not data:
                    return {"batches": batches}  # a consumer went away: the run is over
                free.append(RECORD.unpack(data)[0])
            if not free:
                continue  # (acknowledgements only: the stop flag is looked at again)
            slot = free.pop()
            base = slot * slot_bytes
            dst = [np.ndarray((wl.batch, *shape), dt, buffer=area, offset=base + off) for dt, shape, off in layout]
            have = 0
            while have < wl.batch:
                if left is None:
                    left = fetch.chunk(index)
                n = len(left[0])
                take = min(n, wl.batch - have)
                for d, a in zip(dst, left):
                    np.copyto(d[have:have + take], a[:take], casting="no")
                have += take
                left = None if take == n else [a[take:] for a in left]
            del dst
            if book is None:
                conns[batches % wl.consumers].send(RECORD.pack(slot, batches))  # type: ignore[union-attr]
            else:
                g = batches * SERVICE_WORKERS + index  # the workers' batches in turn (as a lane dealer's)
                book.send(SENT.pack(g, g % wl.consumers, index, slot))  # the ledger knows before it goes
                conns[g % wl.consumers].send(RECORD.pack(slot, g))  # type: ignore[union-attr]
            batches += 1
        return {"batches": batches}
    finally:
        for conn in conns:
            if conn is not None:
                conn.close()
        listener.close()
        if book is not None:
            book.close()


def _consumer(wl: Workload, index: int, where: str, counts: Tally, ledger: bool = False) -> dict[str, Any]:
    """Take every batch the workers deal here, counting each, until both
    are done.  ``ledger``: hold :data:`LEDGER_HOLD` batches, then
    acknowledge the oldest to the ledger as its slot goes back."""
    layout, slot_bytes = _layout(wl)
    socks: list[socket.socket] = []
    areas: dict[int, mmap.mmap] = {}
    book = _connect(_ledger_address(where)) if ledger else None
    held: collections.deque[tuple[socket.socket, int, int, list[np.ndarray]]] = collections.deque()
    hold = LEDGER_HOLD if ledger else 0
    for w in range(SERVICE_WORKERS):
        sock = _connect(_address(where, w))  # (the worker may not listen yet)
        sock.send(RECORD.pack(index, 0))
        with open(_area(where, w), "rb") as f:
            areas[sock.fileno()] = mmap.mmap(f.fileno(), _slots(wl, ledger) * slot_bytes, prot=mmap.PROT_READ)
        socks.append(sock)
    samples = batches = 0
    reset: set[socket.socket] = set()
    try:
        while socks:
            ready = select.select(socks, [], [], CONSUMER_TIMEOUT_S)[0]
            if not ready:
                raise RuntimeError(f"no batch within {CONSUMER_TIMEOUT_S:g} s")
            for sock in ready:
                try:
                    data = sock.recv(RECORD.size)
                except ConnectionResetError:
                    # the worker stopped with acknowledgements unread: Linux
                    # says so before the batches it sent last, which follow
                    if sock not in reset:
                        reset.add(sock)
                        continue
                    data = b""
                if not data:
                    socks.remove(sock)
                    sock.close()
                    continue
                slot, g = RECORD.unpack(data)
                area, base = areas[sock.fileno()], slot * slot_bytes
                arrays = [np.ndarray((wl.batch, *shape), dt, buffer=area, offset=base + off)
                          for dt, shape, off in layout]
                samples += len(arrays[0])
                held.append((sock, slot, g, arrays))
                del arrays
                while len(held) > hold:
                    back, slot, g, _ = held.popleft()  # (its views die here)
                    try:
                        if book is not None:
                            book.send(ACK.pack(g))  # run() returned it
                        back.send(RECORD.pack(slot, g))
                    except OSError:
                        pass  # the worker stopped: its end comes next
                batches += 1
                counts.add(index, 1)
    finally:
        for sock in socks:
            sock.close()
        if book is not None:
            book.close()
    return {"delivered": samples, "batches": batches}


class _Ledger:
    """``ledger``'s service: one thread that hears what each worker sends
    where and what each consumer acknowledged, reading each socket's
    records in bursts; what is in flight, by batch number."""

    def __init__(self, path: str) -> None:
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._listener.bind(path)
        self._listener.listen(64)
        self.in_flight: dict[int, tuple[int, int, int]] = {}
        #: acknowledgements read before the worker's word of their batch
        self._early: set[int] = set()
        self.acknowledged = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="blobfeed-bench-ledger", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        socks = [self._listener]
        in_flight, early = self.in_flight, self._early
        try:
            # once told to stop, until every worker and consumer closed: what they sent is all read
            while not (self._stop and len(socks) == 1):
                for sock in select.select(socks, [], [], 0.1)[0]:
                    if sock is self._listener:
                        socks.append(sock.accept()[0])  # (blocking: MSG_DONTWAIT reads below)
                        continue
                    while True:
                        try:
                            data = sock.recv(SENT.size, socket.MSG_DONTWAIT)
                        except BlockingIOError:
                            break
                        except OSError:
                            data = b""
                        if not data:
                            socks.remove(sock)
                            sock.close()
                            break
                        if len(data) == SENT.size:
                            g, c, w, slot = SENT.unpack(data)
                            if g in early:
                                early.discard(g)
                                self.acknowledged += 1
                            else:
                                in_flight[g] = (c, w, slot)
                        elif in_flight.pop(ACK.unpack(data)[0], None) is None:
                            early.add(ACK.unpack(data)[0])
                        else:
                            self.acknowledged += 1
        finally:
            for sock in socks:
                sock.close()

    def close(self) -> None:
        """Once the workers and consumers ended: the ledger has read all they sent.

        Raises:
            RuntimeError: it did not end (a peer's socket still open).
        """
        self._stop = True
        self._thread.join(CONSUMER_TIMEOUT_S)
        if self._thread.is_alive():
            raise RuntimeError(f"the ledger did not end within {CONSUMER_TIMEOUT_S:g} s")

    @property
    def early(self) -> int:
        """Acknowledgements of batches no worker said it sent."""
        return len(self._early)


def child_main(argv: list[str]) -> int:
    """A worker or consumer process of this runner (see :data:`DIRECT_MAIN`):
    runs, then prints one JSON line of what it did."""
    p = argparse.ArgumentParser(prog="blobfeed bench direct")
    p.add_argument("role", choices=("worker", "consumer"))
    p.add_argument("workload", choices=sorted(WORKLOADS))
    p.add_argument("index", type=int)
    p.add_argument("counts", help="the path of the measurement's counting Tally")
    p.add_argument("where", help="the folder of the workers' files and sockets")
    p.add_argument("--ledger", action="store_true", help="the ledger runner's worker or consumer")
    a = p.parse_args(argv)
    counts = Tally.attach(a.counts)
    run = _worker if a.role == "worker" else _consumer
    print(json.dumps(run(WORKLOADS[a.workload], a.index, a.where, counts, a.ledger)), flush=True)
    return 0


def run_direct(wl: Workload, seconds: float, ledger: bool = False) -> dict[str, Any]:
    """S1's work on its shortest path (see the module): batches/s of the
    consumers, the tree's PSS, and per batch the CPU and context switches
    of the workers (the ``service`` row; ``ledger``: and the measuring
    process, whose thread keeps the ledger) and of the consumers."""
    _, slot_bytes = _layout(wl)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    procs = _Consumers(main=DIRECT_MAIN)
    counts = Tally()
    book = None
    flag = ["--ledger"] if ledger else []
    try:
        with tempfile.TemporaryDirectory(prefix="blobfeed-direct-", dir=shm) as where:
            if ledger:
                book = _Ledger(_ledger_address(where))
            for w in range(SERVICE_WORKERS):
                with open(_area(where, w), "wb") as f:
                    f.truncate(_slots(wl, ledger) * slot_bytes)
            t_start = time.perf_counter()
            for w in range(SERVICE_WORKERS):
                procs.start("worker", wl.id, str(w), counts.path, where, *flag)
            for k in range(wl.consumers):
                procs.start("consumer", wl.id, str(k), counts.path, where, *flag)
            workers = [proc.pid for proc, _, _ in procs.procs[:SERVICE_WORKERS]]
            out = _window_result(wl, counts, procs, seconds, t_start, service=False,
                                 service_pids=workers + ([os.getpid()] if ledger else []),
                                 consumers_from=SERVICE_WORKERS)
            counts.finish()  # the workers stop; each consumer ends when both have
            done = procs.results()
            if book is not None:
                book.close()
                out.update(acknowledged=book.acknowledged, in_flight=len(book.in_flight), unknown=book.early)
        out.update(delivered=sum(r.get("delivered", 0) for r in done))
        return out
    finally:
        procs.kill()
        counts.close()
        if book is not None:
            with contextlib.suppress(RuntimeError):  # (the run failed already: that error is the one to see)
                book.close()


def run_ledger(wl: Workload, seconds: float) -> dict[str, Any]:
    """``direct`` with a ledger and consumers that hold batches (see the module)."""
    return run_direct(wl, seconds, ledger=True)


#: this module's runners (see ``runner.RUNNERS``)
RUNNERS: dict[str, Callable[[Workload, float], dict[str, Any]]] = {"direct": run_direct, "ledger": run_ledger}
