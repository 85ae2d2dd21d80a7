"""S1, S2, S8 and attach: blobfeed's feeding service (``blobfeed.service``)
against independent pipelines, each consumer a process of its own.

* ``service`` (S1, S2, S8): one :class:`blobfeed.service.FeedServer` in the
  measuring process, its source's 2 workers (the backend a user would pick
  for the fetcher: processes for S1 and S8, threads for S2; see
  ``workloads.S1_BACKEND_WHY``), and 4 consumer processes (S8: 8) that
  attach to it by index (``consumer_index=k, num_consumers=4``, as torchrun
  ranks would) and take batches as fast as they can (a ``Net`` with no model).
* ``pipes`` (S1, S2): 4 consumer processes, each with its own pipeline
  (``init_data_input_workers`` with 2 workers: processes for S1, threads
  for S2): what each rank runs without the service.
* ``bare`` (S2): the service's shape with nothing of blobfeed in it (a
  sender and a receiver thread per consumer, one record per batch of
  bytes made in advance, each acknowledged): what the transport alone
  costs in one Python process, beside what the service's guarantees add.
* ``attach`` (workload attach): the service of S1, running; consumer
  processes attach to it one after another, and each times
  ``attach_source(...)`` to the first batch ``net.run()`` returns.

The consumers are started as the bench's measuring children are (the
current directory dropped from ``sys.path``) and report each batch in a
:class:`~.measure.Tally` slot of their own; the measuring process times
the window from outside (:func:`~.measure.watch_consumers`) and reads the
whole tree's PSS: the service, its workers and the consumers, or the 4
pipelines with all their workers.  At the window's two ends it reads, from
/proc, the CPU time and context switches of the service (this process and
its worker processes) and of each consumer (with what it started), and
reports them per batch (:func:`per_batch_costs`).  After the window the
fetchers stop, the consumers drain to ``EndOfInput`` and report what they
took: one sample fetched and not delivered fails the run, as for every
blobfeed runner.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any

from .measure import STEP_CPU, STEP_CTX, Tally, Usage, watch_consumers
from .workloads import WORKLOADS, Workload

#: the served source's name and the service's workers
SOURCE = "train"
SERVICE_WORKERS = 2
#: seconds a consumer waits for a batch, and for its process to end after the drain
CONSUMER_TIMEOUT_S = 60.0
#: attach: consumers attach one after another until the window is over, at least this many
ATTACH_CYCLES_MIN = 3
#: the usage group of the measuring process, where the service runs
SERVICE_GROUP = "service"
#: bare: batches a consumer may have unacknowledged, the digits of a
#: batch's number at the head of its record, the end; a receive takes at
#: most a record of the service's (wire.MAX_RECORD + 1, as its recvmsg:
#: Python allocates the whole buffer at each call, so a bigger one would
#: cost bare what the service never pays)
BARE_WINDOW = 16
BARE_NUMBER = 12
BARE_RECV = (64 << 10) + 1
BARE_END = b"end"

#: A consumer process's ``__main__``: the current directory off ``sys.path``
#: first (see ``runner.CHILD_MAIN``: run from the folder holding the clone,
#: its ``blobfeed/`` would be taken for the package), then :func:`consumer_main`.
CONSUMER_MAIN = (
    "import sys\n"
    "if sys.path and sys.path[0] == '':\n"
    "    del sys.path[0]\n"
    "from blobfeed.apps.bench.service import consumer_main\n"
    "sys.exit(consumer_main(sys.argv[1:]))\n"
)


def consumer_command(*args: str) -> list[str]:
    """The command line of a consumer process."""
    return [sys.executable, "-c", CONSUMER_MAIN, *args]


def _batch_bytes(wl: Workload) -> int:
    chunk = wl.fetcher(None).chunk(0)
    return wl.batch * sum(a.nbytes // len(a) for a in chunk)


# --------------------------------------------------------------------------- the consumer processes
def _consume(net: Any, blob: str, slot: int, counts: Tally, stop_on_flag: bool) -> tuple[int, int]:
    """``net.run()`` until ``EndOfInput`` (or ``counts``' stop flag, with
    ``stop_on_flag``), each batch counted in ``slot``; (samples, batches)."""
    import blobfeed

    samples = batches = 0
    while True:
        try:
            out = net.run(timeout=CONSUMER_TIMEOUT_S)
        except blobfeed.EndOfEpoch:
            continue
        except blobfeed.EndOfInput:
            return samples, batches
        samples += len(out[blob])
        batches += 1
        del out  # the batch's slot goes back before the next wait
        counts.add(slot, 1)
        if stop_on_flag and counts.stopping:
            return samples, batches


def _serve_consumer(wl: Workload, a: argparse.Namespace, counts: Tally) -> dict[str, Any]:
    import blobfeed

    net = blobfeed.Net(None, name=f"consumer{a.index}")
    index = a.index if a.num is not None else None  # first come: the service picks
    with blobfeed.attach_source(net, list(wl.blobs), wl.batch, SOURCE, a.address, consumer_index=index,
                                num_consumers=a.num, timeout=CONSUMER_TIMEOUT_S):
        samples, batches = _consume(net, wl.blobs[0], a.index, counts, False)
    return {"delivered": samples, "batches": batches}


def _pipe_consumer(wl: Workload, a: argparse.Namespace, counts: Tally) -> dict[str, Any]:
    import blobfeed

    fetched = Tally()
    try:
        net = blobfeed.Net(None, name=f"pipe{a.index}")
        gc = blobfeed.GlobalCoordinator()
        kwargs: dict[str, Any] = {} if wl.pipes_backend == "threads" else {"backend": wl.pipes_backend}
        blobfeed.init_data_input_workers(net, list(wl.blobs), wl.fetcher(fetched), wl.batch,
                                         num_worker_threads=SERVICE_WORKERS, coordinator=gc, **kwargs)
        gc.start()
        try:
            samples, batches = _consume(net, wl.blobs[0], a.index, counts, True)
            fetched.finish()  # then drain: every sample fetched must come out
            more, _ = _consume(net, wl.blobs[0], a.index, Tally.attach(counts.path), False)
        finally:
            gc.stop()
        return {"delivered": samples + more, "batches": batches, "lost": fetched.fetched() - samples - more}
    finally:
        fetched.close()


def _attach_consumer(wl: Workload, a: argparse.Namespace, counts: Tally) -> dict[str, Any]:
    import blobfeed

    net = blobfeed.Net(None, name="attach")
    t0 = time.perf_counter()
    att = blobfeed.attach_source(net, list(wl.blobs), wl.batch, SOURCE, a.address, timeout=CONSUMER_TIMEOUT_S)
    t1 = time.perf_counter()
    try:
        out = net.run(timeout=CONSUMER_TIMEOUT_S)
        t2 = time.perf_counter()
        n = len(out[wl.blobs[0]])
        del out
    finally:
        att.stop()
    counts.add(a.index, 1)
    return {"delivered": n, "batches": 1, "attach_ms": (t2 - t0) * 1e3, "connect_ms": (t1 - t0) * 1e3}


def _bare_consumer(wl: Workload, a: argparse.Namespace, counts: Tally) -> dict[str, Any]:
    """The bare consumer: each record that comes is a batch, counted and
    acknowledged at once, until the measuring process says ``end``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(CONSUMER_TIMEOUT_S)
    sock.connect(a.address)
    batches = 0
    try:
        while True:
            data = sock.recv(BARE_RECV)
            if not data or data == BARE_END:
                break
            # an acknowledgement of the form and length the service's consumer sends
            sock.send(b'{"t":"ack","g":%s,"slots":[%d],"waited":0.0}' % (data[:BARE_NUMBER], batches % BARE_WINDOW))
            batches += 1
            counts.add(a.index, 1)
    finally:
        sock.close()
    return {"delivered": batches * wl.batch, "batches": batches}


CONSUMERS: dict[str, Callable[[Workload, argparse.Namespace, Tally], dict[str, Any]]] = {
    "service": _serve_consumer, "pipe": _pipe_consumer, "attach": _attach_consumer, "bare": _bare_consumer,
}


def consumer_main(argv: list[str]) -> int:
    """A consumer process (see :data:`CONSUMER_MAIN`): runs, then prints one
    JSON line of what it took."""
    p = argparse.ArgumentParser(prog="blobfeed bench consumer")
    p.add_argument("mode", choices=sorted(CONSUMERS))
    p.add_argument("workload", choices=sorted(WORKLOADS))
    p.add_argument("index", type=int)
    p.add_argument("counts", help="the path of the measurement's counting Tally")
    p.add_argument("--address", default=None)
    p.add_argument("--num", type=int, default=None)
    a = p.parse_args(argv)
    counts = Tally.attach(a.counts)
    print(json.dumps(CONSUMERS[a.mode](WORKLOADS[a.workload], a, counts)), flush=True)
    return 0


# --------------------------------------------------------------------------- the measuring process
class _Consumers:
    """Consumer processes started by this one; their output in temporary files."""

    def __init__(self, main: str | None = None) -> None:
        #: the processes' ``__main__`` (None: :data:`CONSUMER_MAIN`)
        self.main = main
        self.procs: list[tuple[subprocess.Popen[bytes], IO[bytes], IO[bytes]]] = []

    def start(self, *args: str) -> None:
        out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        command = consumer_command(*args) if self.main is None else [sys.executable, "-c", self.main, *args]
        self.procs.append((subprocess.Popen(command, stdout=out, stderr=err), out, err))

    @staticmethod
    def _stderr(err: IO[bytes]) -> str:
        err.seek(0)
        return err.read().decode(errors="replace")[-2000:]

    def check(self) -> None:
        """Raises RuntimeError, with its stderr, if a consumer ended badly."""
        for k, (proc, _, err) in enumerate(self.procs):
            code = proc.poll()
            if code is not None and code != 0:
                raise RuntimeError(f"consumer {k} exited with {code}:\n{self._stderr(err)}")

    def results(self, timeout: float = CONSUMER_TIMEOUT_S) -> list[dict[str, Any]]:
        """Waits for every consumer; what each printed."""
        deadline = time.monotonic() + timeout
        out_list = []
        for k, (proc, out, err) in enumerate(self.procs):
            try:
                code = proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"consumer {k} did not end within {timeout:g} s:\n{self._stderr(err)}") from None
            if code != 0:
                raise RuntimeError(f"consumer {k} exited with {code}:\n{self._stderr(err)}")
            out.seek(0)
            lines = out.read().decode().strip().splitlines()
            if not lines:
                raise RuntimeError(f"consumer {k} printed nothing:\n{self._stderr(err)}")
            out_list.append(json.loads(lines[-1]))
        return out_list

    def kill(self) -> None:
        for proc, out, err in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            out.close()
            err.close()
        self.procs = []


@contextmanager
def _running_service(wl: Workload, fetched: Tally, num_consumers: int | None) -> Iterator[Any]:
    import blobfeed

    server = blobfeed.FeedServer(log_interval=3600.0)
    server.serve_source(SOURCE, list(wl.blobs), wl.fetcher(fetched), wl.batch, SERVICE_WORKERS,
                        num_consumers=num_consumers, backend=wl.backend)
    try:
        server.start()
        yield server
    finally:
        server.stop()


#: the service's threads by what they do (thread name prefix -> role), for the
#: per-step costs: where a batch's CPU goes inside the service
THREAD_ROLES = (
    ("blobfeed-service-send", "sender"),  # reads its reader: re-batching, the copy into the arena; sends
    ("blobfeed-service-recv", "receiver"),  # each connection's: acknowledgements, frees
    ("blobfeed-recv-", "intake"),  # a worker process's receiver: its chunks into the dealer
    ("blobfeed-fetch-", "fetchers"),  # worker threads: fetch_fun, the chunk into the dealer
    ("blobfeed-slots", "slot returner"),  # gives worker processes their slots back
)


def thread_role(tid: int) -> str:
    """The role of this process's thread ``tid`` (see :data:`THREAD_ROLES`)."""
    name = next((t.name for t in threading.enumerate() if t.native_id == tid), "")
    return next((role for prefix, role in THREAD_ROLES if name.startswith(prefix)), "other threads")


def per_batch_costs(usage: dict[str, Usage], batches: int) -> dict[str, float]:
    """The window's hand-off costs per batch taken: CPU microseconds and
    context switches of the ``service`` group (when there is one) over
    every batch, and of the consumers (groups ``consumer<k>``: a consumer
    process with whatever it started) summed over every batch, that is
    what a consumer spends on each batch it takes."""
    if not batches:
        return {}
    out: dict[str, float] = {}
    consumers = [u for name, u in usage.items() if name.startswith("consumer")]
    for who, group in (("service", [usage[SERVICE_GROUP]] if SERVICE_GROUP in usage else []), ("consumer", consumers)):
        if group:
            out[f"{who}_cpu_us_per_batch"] = sum(u.cpu_s for u in group) / batches * 1e6
            out[f"{who}_ctx_per_batch"] = sum(u.switches for u in group) / batches
    return out


def _window_result(wl: Workload, counts: Tally, consumers: _Consumers, seconds: float, t_start: float,
                   service: bool, service_pids: list[int] | None = None, consumers_from: int = 0) -> dict[str, Any]:
    """The window's figures.  ``service``: this process runs the service
    (its threads, and its workers below it); ``service_pids``: the service
    group is these processes instead (``direct``'s workers), the consumers
    being ``consumers.procs`` from ``consumers_from`` on."""
    procs = consumers.procs[consumers_from:]
    groups = {f"consumer{k}": [proc.pid] for k, (proc, _, _) in enumerate(procs)}
    if service_pids is not None:
        groups[SERVICE_GROUP] = list(service_pids)
    elif service:  # this process runs the service: its threads, and its workers below it (the consumers apart)
        groups[SERVICE_GROUP] = [os.getpid()]
    # a pipeline's worker processes apart from its net's process (the
    # consumer): where a pipeline's CPU a batch goes, beside the service's steps
    below = None if service or service_pids is not None else {
        f"consumer{k}{WORKERS_SUFFIX}": [proc.pid] for k, (proc, _, _) in enumerate(procs)}
    w = watch_consumers(counts, wl.consumers, seconds, t_start, consumers.check, usage=groups,
                        thread_roles=thread_role if service else None, usage_below=below)
    total = sum(w.batches)
    fair = min(w.batches) / (total / len(w.batches)) if total else 0.0
    return {
        "batches_per_s": total / w.seconds,
        "gb_per_s": total * _batch_bytes(wl) / w.seconds / 1e9,
        "first_batch_ms": w.first_batch_s * 1e3,
        "pss_mb": w.pss_mb,
        "consumer_min_share": fair,  # the slowest consumer's batches over the mean
        **per_batch_costs(w.usage, total),
        **service_steps(w.usage, w.threads, total),
        **pipeline_steps(w.usage, total),
    }


#: the group of a consumer's worker processes is the consumer's name and this
WORKERS_SUFFIX = " workers"


def pipeline_steps(usage: dict[str, Usage], batches: int) -> dict[str, float]:
    """``pipes``' steps: over every batch, the CPU microseconds (and context
    switches) of the pipelines' worker processes, and of the rest of the
    consumer processes (each pipeline's net's process: its intake, its
    re-batching, ``run()``); empty without a workers group.  Their sum is
    the consumer's row."""
    workers = [u for name, u in usage.items() if name.startswith("consumer") and name.endswith(WORKERS_SUFFIX)]
    nets = [u for name, u in usage.items() if name.startswith("consumer") and not name.endswith(WORKERS_SUFFIX)]
    if not batches or not workers:
        return {}
    out = {}
    for role, group in (("worker processes", workers), ("net's process", nets)):
        out[STEP_CPU + role] = sum(u.cpu_s for u in group) / batches * 1e6
        out[STEP_CTX + role] = sum(u.switches for u in group) / batches
    return out


def service_steps(usage: dict[str, Usage], threads: dict[str, Usage], batches: int) -> dict[str, float]:
    """The service's CPU microseconds and context switches per batch by
    step (its threads by role, and its worker processes: the service
    group's time that none of its own threads spent, their switches left in
    the service's total); empty without them.  Flat keys, so that the
    repetitions' median is taken key by key."""
    if not batches or not threads or SERVICE_GROUP not in usage:
        return {}
    out = {}
    for role, u in threads.items():
        out[STEP_CPU + role] = u.cpu_s / batches * 1e6
        out[STEP_CTX + role] = u.switches / batches
    own = sum(u.cpu_s for u in threads.values())
    out[STEP_CPU + "worker processes"] = max(0.0, usage[SERVICE_GROUP].cpu_s - own) / batches * 1e6
    return out


def run_service(wl: Workload, seconds: float) -> dict[str, Any]:
    """S1, S2, S8: one service, ``wl.consumers`` consumer processes dealt by index."""
    fetched, counts = Tally(), Tally()
    consumers = _Consumers()
    try:
        t_start = time.perf_counter()
        with _running_service(wl, fetched, wl.consumers) as server:
            for k in range(wl.consumers):
                consumers.start("service", wl.id, str(k), counts.path, "--address", str(server.address),
                                "--num", str(wl.consumers))
            out = _window_result(wl, counts, consumers, seconds, t_start, service=True)
            fetched.finish()  # the source ends: every consumer drains to EndOfInput
            done = consumers.results()
        delivered = sum(r["delivered"] for r in done)
        out.update(peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                   samples_lost=int(fetched.fetched() - delivered))
        return out
    finally:
        consumers.kill()
        counts.close()
        fetched.close()


def run_pipes(wl: Workload, seconds: float) -> dict[str, Any]:
    """S1, S2's yardstick: ``wl.consumers`` processes, each with its own pipeline."""
    counts = Tally()
    consumers = _Consumers()
    try:
        t_start = time.perf_counter()
        for k in range(wl.consumers):
            consumers.start("pipe", wl.id, str(k), counts.path)
        out = _window_result(wl, counts, consumers, seconds, t_start, service=False)
        counts.finish()  # each pipeline stops its fetchers and drains
        done = consumers.results()
        out.update(peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                   samples_lost=int(sum(r["lost"] for r in done)))
        return out
    finally:
        consumers.kill()
        counts.close()


def run_attach(wl: Workload, seconds: float) -> dict[str, Any]:
    """attach: consumer processes attach to a running service (S1's source,
    first come) one after another, for ``seconds`` and at least
    :data:`ATTACH_CYCLES_MIN` times; each takes one batch and detaches.
    ``first_batch_ms`` is the median from ``attach_source(...)`` to that
    batch (``attach_ms_max`` the slowest); the process's start is not in it."""
    fetched, counts = Tally(), Tally()
    attached: list[dict[str, Any]] = []
    try:
        with _running_service(wl, fetched, None) as server:
            t0 = time.perf_counter()
            while len(attached) < ATTACH_CYCLES_MIN or time.perf_counter() - t0 < seconds:
                consumers = _Consumers()
                try:
                    consumers.start("attach", wl.id, "0", counts.path, "--address", str(server.address))
                    attached += consumers.results()
                finally:
                    consumers.kill()
            # the rest of the source, to the end: every sample fetched must come out once
            fetched.finish()
            consumers = _Consumers()
            try:
                consumers.start("service", wl.id, "1", counts.path, "--address", str(server.address))
                drained = consumers.results()[0]["delivered"]
            finally:
                consumers.kill()
        times = [r["attach_ms"] for r in attached]
        delivered = drained + sum(r["delivered"] for r in attached)
        return {
            "first_batch_ms": statistics.median(times), "attach_ms_max": max(times), "attach_cycles": len(times),
            "connect_ms": statistics.median(r["connect_ms"] for r in attached),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "samples_lost": int(fetched.fetched() - delivered),
        }
    finally:
        counts.close()
        fetched.close()


def _bare_batch(wl: Workload) -> bytes:
    """One batch's bytes (its arrays end to end), made once in advance."""
    fetch = wl.fetcher(None)
    rows: list[list[Any]] = [[] for _ in wl.blobs]
    have = 0
    while have < wl.batch:
        chunk = fetch.chunk(have)
        for k, a in enumerate(chunk):
            rows[k].append(a)
        have += len(chunk[0])
    import numpy as np

    return b"".join(np.concatenate(r)[:wl.batch].tobytes() for r in rows)


def _bare_send(sock: socket.socket, batch: bytes, window: threading.Semaphore, stop: threading.Event) -> None:
    g = 0
    try:
        while not stop.is_set():
            if window.acquire(timeout=0.1):
                sock.send(b"%0*d" % (BARE_NUMBER, g) + batch)
                g += 1
    except OSError:
        pass  # the consumer is gone: results() says why


def _bare_receive(sock: socket.socket, window: threading.Semaphore) -> None:
    try:
        while sock.recv(BARE_RECV):
            window.release()
    except OSError:
        pass


def run_bare(wl: Workload, seconds: float) -> dict[str, Any]:
    """S2's service written plainly, with nothing of blobfeed in it: this
    process keeps a sender and a receiver thread for each of the
    ``wl.consumers`` consumer processes, on a Unix ``SOCK_SEQPACKET``
    socket as the service's; the sender sends one record per batch (the
    batch's bytes, made once in advance: no fetching, no re-batching, no
    ledger, no slots), at most :data:`BARE_WINDOW` unacknowledged (a
    semaphore); the consumer acknowledges each as it comes.  What a
    one-process Python service that acknowledges each batch costs when it
    does nothing else, written as one would first write it: the yardstick
    for how much of the service's per-batch cost is its guarantees."""
    batch = _bare_batch(wl)
    stop = threading.Event()
    threads: list[threading.Thread] = []
    socks: list[socket.socket] = []
    with tempfile.TemporaryDirectory(prefix="blobfeed-bare-") as where:
        address = os.path.join(where, "sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        counts = Tally()
        consumers = _Consumers()
        try:
            listener.bind(address)
            listener.listen(wl.consumers)
            listener.settimeout(0.2)
            t_start = time.perf_counter()
            for k in range(wl.consumers):
                consumers.start("bare", wl.id, str(k), counts.path, "--address", address)
            deadline = time.monotonic() + CONSUMER_TIMEOUT_S
            while len(socks) < wl.consumers:
                try:
                    sock, _ = listener.accept()
                except TimeoutError:
                    consumers.check()  # one that died at its start: its exit code and stderr
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"bare: {wl.consumers - len(socks)} consumers did not connect "
                                           f"within {CONSUMER_TIMEOUT_S:g} s") from None
                    continue
                sock.settimeout(None)
                k = len(socks)
                socks.append(sock)
                window = threading.Semaphore(BARE_WINDOW)
                # named as the service's, so that the per-step rows compare
                threads += [
                    threading.Thread(target=_bare_send, args=(sock, batch, window, stop),
                                     name=f"blobfeed-service-send-bare-{k}", daemon=True),
                    threading.Thread(target=_bare_receive, args=(sock, window),
                                     name=f"blobfeed-service-recv-bare-{k}", daemon=True),
                ]
            for t in threads:
                t.start()
            out = _window_result(wl, counts, consumers, seconds, t_start, service=True)
            stop.set()
            for t in threads[::2]:
                t.join(CONSUMER_TIMEOUT_S)
            for sock in socks:
                try:
                    sock.send(BARE_END)
                except OSError:
                    pass  # that consumer is gone: results() says how
            consumers.results()
            for t in threads:
                t.join(CONSUMER_TIMEOUT_S)
            out.update(peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
            return out
        finally:
            stop.set()
            for sock in socks:
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # wakes a receiver blocked in recv (close would not)
                except OSError:
                    pass
                sock.close()
            listener.close()
            consumers.kill()
            for t in threads:
                if t.ident is not None:  # started (a failed accept leaves some unstarted)
                    t.join(CONSUMER_TIMEOUT_S)
            counts.close()


#: the service's runners, by the name the workloads give them
RUNNERS: dict[str, Callable[[Workload, float], dict[str, Any]]] = {
    "service": lambda wl, s: (run_attach if wl.id == "attach" else run_service)(wl, s),
    "pipes": run_pipes,
    "bare": run_bare,
}
#: they need no optional package
NEEDS: dict[str, str] = {}
