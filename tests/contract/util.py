"""The matrix and the checks of the contract suite.

As CPython's ``test_concurrent_futures/util.py`` (``create_executor_tests``)
runs each behaviour file against every executor, :func:`matrix` runs a
behaviour against every backend x mode: the backends ``threads`` and
``processes`` always, Ray on the modes a test names (Ray costs seconds per
pipeline on a loaded 2-core machine).  Everything here goes through the
public API: ``blobfeed.*``, ``blobfeed.ray.RayBackend`` and the metrics as
the coordinator's registry serves them.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import pytest

import blobfeed
from blobfeed import EndOfEpoch, EndOfInput, Net, init_data_input_workers

from .fetchers import ESPAN, WSPAN

SRC = "train"
BLOBS = ["ids", "feat"]
SEED = 4321
BS = 8
#: the bound of every wait; nothing gets near it
WAIT = 10.0
#: samples the shuffle buffer holds (two batches: it holds data mid-run)
SHUFFLE = 16

#: mode name -> the keyword arguments of init_data_input_workers
MODES: dict[str, dict[str, Any]] = {
    "arrival": {},
    "det": {"deterministic": True},
    "shuffle": {"shuffle_buffer": SHUFFLE},
    "det-shuffle": {"deterministic": True, "shuffle_buffer": SHUFFLE},
    "epochs2": {"epochs": 2},
}
ALL_MODES = tuple(MODES)
DET_MODES = ("det", "det-shuffle")
#: modes where a chunk's samples stay together and in order
ORDERED_CONTENT = ("arrival", "det", "epochs2")
LOCAL_BACKENDS = ("threads", "processes")

#: ("batch", ids, feat) or ("end", epoch)
Event = tuple[Any, ...]


def matrix(modes: Iterable[str] = ALL_MODES, *, backends: Iterable[str] = LOCAL_BACKENDS,
           ray: Iterable[Any] = (), extra: tuple[str, dict[str, Any]] | None = None) -> pytest.MarkDecorator:
    """Parametrize a test over ``backend_name`` x ``mode`` (test ids
    ``<backend>-<mode>``): every mode on ``backends``, and the ``ray`` modes
    on Ray.  ``extra=(argname, {id: value})`` crosses one more argument with
    the local backends; a Ray entry then names its case, ``(mode, id)``."""
    modes = tuple(modes)
    if extra is None:
        params = [pytest.param(b, m, id=f"{b}-{m}") for b in backends for m in modes]
        params += [pytest.param("ray", m, id=f"ray-{m}") for m in ray]
        return pytest.mark.parametrize("backend_name, mode", params)
    name, values = extra
    params = [pytest.param(b, m, v, id=f"{b}-{m}-{k}") for b in backends for m in modes for k, v in values.items()]
    params += [pytest.param("ray", m, values[k], id=f"ray-{m}-{k}") for m, k in ray]
    return pytest.mark.parametrize(f"backend_name, mode, {name}", params)


def epochs_of(mode: str) -> int:
    return int(MODES[mode].get("epochs", 1))


# ---------------------------------------------------------------------------------------------
# wiring and running
# ---------------------------------------------------------------------------------------------
def wire(gc: blobfeed.GlobalCoordinator, backend: Any, mode: str, fetch: Any, *, workers: Sequence[int] = (3,),
         bs: int = BS, source: str = SRC, max_buffered: int = 8, **kw: Any) -> tuple[list[Net], list[dict[int, int]]]:
    """One ``init_data_input_workers`` call per entry of ``workers`` (its
    worker count), each feeding a net of its own from ``source``.  Returns
    the nets and, per call, its workers as ``{worker id: index}``."""
    nets, calls = [], []
    for i, n in enumerate(workers):
        net = Net(name=f"{source}-net{i}")
        before = set(gc.get_worker_ids())
        init_data_input_workers(net, BLOBS, fetch, bs, num_worker_threads=n, input_source_name=source,
                                coordinator=gc, backend=backend, seed=SEED, max_buffered_batches=max_buffered,
                                **MODES[mode], **kw)
        new = sorted(set(gc.get_worker_ids()) - before)
        assert len(new) == n
        nets.append(net)
        calls.append({w: j for j, w in enumerate(new)})
    return nets, calls


def next_event(net: Net, timeout: float = WAIT) -> Event | None:
    """The net's next batch (copied) or epoch end; None at EndOfInput."""
    try:
        out = net.run(timeout=timeout)
    except EndOfEpoch as end:
        return ("end", end.epoch)
    except EndOfInput:
        return None
    return ("batch", np.array(out["ids"]), np.array(out["feat"]))


def drain(net: Net, limit: int | None = None, timeout: float = WAIT) -> list[Event]:
    """Events of ``net`` until EndOfInput (or ``limit`` events)."""
    events: list[Event] = []
    deadline = time.monotonic() + timeout * 3
    while limit is None or len(events) < limit:
        assert time.monotonic() < deadline, f"{net.name}: no end after {len(events)} events"
        ev = next_event(net, timeout)
        if ev is None:
            break
        events.append(ev)
    return events


def drain_all(nets: Sequence[Net]) -> list[list[Event]]:
    """Drain every net, each from a thread of its own when there are several
    (a deterministic source deals batches in turn: one net left unread would
    stall the others)."""
    if len(nets) == 1:
        return [drain(nets[0])]
    out: list[list[Event]] = [[] for _ in nets]
    errors: list[BaseException] = []

    def consume(i: int) -> None:
        try:
            out[i] = drain(nets[i])
        except BaseException as exc:  # re-raised below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=consume, args=(i,), name=f"test-consumer-{i}") for i in range(len(nets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT * 4)
        assert not t.is_alive(), f"consumer {t.name} hung"
    if errors:
        raise errors[0]
    return out


def batches(events: Sequence[Event]) -> list[Event]:
    return [e for e in events if e[0] == "batch"]


def by_epoch(events: Sequence[Event], epochs: int) -> list[list[Event]]:
    """The batches of each epoch; every epoch but the last ends with its
    ``EndOfEpoch`` (of that epoch, in order)."""
    out: list[list[Event]] = [[]]
    for ev in events:
        if ev[0] == "end":
            assert ev[1] == len(out) - 1, f"EndOfEpoch({ev[1]}) after epoch {len(out) - 1}'s batches"
            out.append([])
        else:
            out[-1].append(ev)
    assert len(out) == epochs, f"{len(out) - 1} epoch ends, expected {epochs - 1}"
    return out


# ---------------------------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------------------------
def check_batches(events: Sequence[Event], bs: int, *, drop_last: bool) -> None:
    """Exact batch sizes (only an epoch's last batch smaller, none with
    drop_last), blobs aligned row by row."""
    groups: list[list[Event]] = [[]]
    for ev in events:
        if ev[0] == "end":
            groups.append([])
        else:
            groups[-1].append(ev)
    for g in groups:
        for i, (_, ids, feat) in enumerate(g):
            n = len(ids)
            if drop_last or i < len(g) - 1:
                assert n == bs, f"batch {i} of an epoch has {n} samples, expected {bs}: {[len(b[1]) for b in g]}"
            else:
                assert 0 < n <= bs, f"last batch has {n} samples"
            assert feat.shape == (n, 2), f"feat is {feat.shape} for {n} ids"
            np.testing.assert_array_equal(feat[:, 0], ids.astype(np.float64), err_msg="blobs not aligned")
            np.testing.assert_array_equal(feat[:, 1], ((ids % ESPAN) // WSPAN).astype(np.float64),
                                          err_msg="blobs not aligned (worker column)")


def ids_of(events: Sequence[Event]) -> np.ndarray:
    parts = [e[1] for e in events if e[0] == "batch"]
    return np.concatenate(parts) if parts else np.empty(0, np.int64)


def check_exactly_once(ids: np.ndarray, chunks: Sequence[np.ndarray], *, complete: bool = True) -> None:
    """Every sample of ``chunks`` exactly once (``complete=False``: at most
    once, and only those)."""
    uniq, counts = np.unique(ids, return_counts=True)
    assert (counts == 1).all(), f"delivered twice: {uniq[counts > 1][:10]}"
    want = np.concatenate(chunks) if chunks else np.empty(0, np.int64)
    if complete:
        missing = np.setdiff1d(want, ids)
        extra = np.setdiff1d(ids, want)
        assert not len(missing) and not len(extra), (
            f"{len(missing)} samples missing (e.g. {missing[:5]}), {len(extra)} unknown (e.g. {extra[:5]})")
    else:
        assert np.isin(ids, want).all(), "a sample no fetcher returned"


def check_chunks_kept_together(ids: np.ndarray, chunks: Sequence[np.ndarray]) -> None:
    """A chunk's samples consecutive and in order where delivered, and each
    worker's chunks in the order it returned them (``chunks`` as
    :meth:`Fetch.chunks` gives them: in call order per worker)."""
    pos = {int(i): p for p, i in enumerate(ids)}
    last: dict[int, tuple[int, int]] = {}  # worker id -> (position, first id) of its latest chunk seen
    for chunk in chunks:
        p = [pos[int(i)] for i in chunk if int(i) in pos]
        assert all(b - a == 1 for a, b in zip(p, p[1:])), f"chunk {chunk[0]}.. split or reordered"
        if not p:
            continue
        wid = int(chunk[0] % ESPAN) // WSPAN
        if wid in last:
            assert last[wid][0] < p[0], f"worker {wid}'s chunk {chunk[0]}.. delivered before its chunk {last[wid][1]}.."
        last[wid] = (p[0], int(chunk[0]))


# ---------------------------------------------------------------------------------------------
# metrics, through the coordinator's registry
# ---------------------------------------------------------------------------------------------
def scrape(gc: blobfeed.GlobalCoordinator) -> list[Any]:
    return [s for fam in gc.registry.collect() for s in fam.samples]


def metric(gc: blobfeed.GlobalCoordinator, name: str, source: str = SRC, **labels: str) -> float:
    """The sum of ``name`` over every label value not given (0 when absent)."""
    want = {"source": source, **labels}
    return sum(s.value for s in scrape(gc)
               if s.name == name and all(s.labels.get(k) == v for k, v in want.items()))


def accounts(gc: blobfeed.GlobalCoordinator, source: str = SRC) -> dict[str, float]:
    """fetched, delivered (every net), dropped (every reason: a reason added
    later counts too) and buffered, from ONE scrape."""
    samples = scrape(gc)

    def total(name: str) -> float:
        return sum(s.value for s in samples if s.name == name and s.labels.get("source") == source)

    return {
        "fetched": total("blobfeed_fetched_samples_total"),
        "delivered": total("blobfeed_delivered_samples_total"),
        "dropped": total("blobfeed_dropped_samples_total"),
        "buffered": total("blobfeed_buffered_samples"),
    }


def balanced(a: dict[str, float]) -> bool:
    return a["fetched"] == a["delivered"] + a["dropped"] + a["buffered"]


def assert_identity(gc: blobfeed.GlobalCoordinator, what: str, source: str = SRC,
                    timeout: float = 0.5) -> dict[str, float]:
    """fetched == delivered + dropped + buffered, within ``timeout`` (a
    scrape is not atomic: a chunk in flight between two counters may show
    for a moment; at rest the identity is exact)."""
    seen: list[dict[str, float]] = []

    def ok() -> bool:
        seen.append(accounts(gc, source))
        return balanced(seen[-1])

    try:
        wait_until(ok, what, timeout)
    except AssertionError:
        a = seen[-1]
        gap = a["fetched"] - a["delivered"] - a["dropped"] - a["buffered"]
        raise AssertionError(f"{what}: fetched != delivered + dropped + buffered: {a} (unaccounted {gap:+g})") from None
    return seen[-1]


def wait_until(pred: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    """Bounded wait for a state only the metrics show (no hook to wait on)."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.002)


def wait_quiet(gc: blobfeed.GlobalCoordinator, source: str = SRC, quiet: float = 0.1) -> float:
    """Wait (bounded) until the source's fetchers stopped fetching: its
    accepted chunks did not change for ``quiet`` seconds, as when every
    worker waits on a full queue.  Returns the chunk count."""
    deadline = time.monotonic() + WAIT
    last, since = metric(gc, "blobfeed_fetched_chunks_total", source), time.monotonic()
    while True:
        now = metric(gc, "blobfeed_fetched_chunks_total", source)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return now
        assert time.monotonic() < deadline, f"{source}'s fetchers never stopped fetching ({now} chunks)"
        time.sleep(0.005)


# ---------------------------------------------------------------------------------------------
# what a stop must leave behind: nothing
# ---------------------------------------------------------------------------------------------
def blobfeed_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("blobfeed-"))


def _parents() -> dict[int, int]:
    parents: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] not in ("Z", "X"):
            parents[int(d)] = int(fields[1])
    return parents


def describe(pids: Iterable[int]) -> list[str]:
    return [f"{p}: {_cmdline(p).replace(bytes(1), b' ').decode(errors='replace')[:120]}" for p in sorted(pids)]


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def descendants() -> set[int]:
    """Live processes under this one."""
    parents = _parents()
    out: set[int] = set()
    todo = [os.getpid()]
    while todo:
        p = todo.pop()
        kids = {c for c, pp in parents.items() if pp == p} - out
        out |= kids
        todo.extend(kids)
    return out


def new_processes(before: set[int]) -> set[int]:
    """Processes under this one that were not there ``before``, but for
    multiprocessing's own helpers (its forkserver and resource tracker:
    children of this process, made once and kept for the program's life; the
    workers are the forkserver's children) and Ray's cluster processes."""
    parents = _parents()
    out = set()
    for pid in descendants() - before:
        cmd = _cmdline(pid)
        if parents.get(pid) == os.getpid() and b"from multiprocessing." in cmd:
            continue
        if b"ray" in cmd.lower() and b"forkserver" not in cmd:
            continue
        out.add(pid)
    return out


def live_ray_actors() -> list[Any]:
    from ray._private import state

    return [a for a in state.actors().values() if a.get("State") != "DEAD"]
