"""Fetchers and consumers used across the tests."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

import blobfeed
from blobfeed import EndOfInput

WAIT = 5.0


class ChunkPlan:
    """Deterministic fetchers: worker w returns the chunk sizes in ``sizes[w]``,
    then raises StopIteration.  Sample ids are unique across workers, so the
    consumer can check exactly-once delivery and order within a chunk.

    Blob ``ids``: int64 ``(n,)``; blob ``feat``: float32 ``(n, 2)`` with
    ``feat[:, 0] == ids`` and ``feat[:, 1] == worker``; so row alignment
    across blobs is checkable too.
    """

    def __init__(self, sizes: dict[int, Sequence[int]]) -> None:
        self.sizes = {w: list(s) for w, s in sizes.items()}
        self._pos = dict.fromkeys(self.sizes, 0)
        self._next_id = itertools.count()
        self._lock = threading.Lock()
        self.issued: list[np.ndarray] = []

    @property
    def total(self) -> int:
        return sum(sum(s) for s in self.sizes.values())

    def __call__(self, worker_id: int, batch_size: int) -> list[np.ndarray]:
        sizes = self.sizes[worker_id]
        i = self._pos[worker_id]
        if i >= len(sizes):
            raise StopIteration
        self._pos[worker_id] = i + 1
        n = sizes[i]
        with self._lock:
            start = next(self._next_id) * 100_000
        ids = np.arange(start, start + n, dtype=np.int64)
        self.issued.append(ids)
        feat = np.stack([ids.astype(np.float32), np.full(n, worker_id, np.float32)], axis=1)
        return [ids, feat]


def drain(net: blobfeed.Net, timeout: float = WAIT, *, epochs: bool = False) -> list[dict[str, np.ndarray]]:
    """Run ``net`` until EndOfInput (with ``epochs``, past each epoch's
    end: to the end of the data); returns every batch (copied)."""
    out = []
    while True:
        try:
            blobs = net.run(timeout=timeout)
        except blobfeed.EndOfEpoch:
            if epochs:
                continue
            return out
        except EndOfInput:
            return out
        out.append({k: np.array(v, copy=True) for k, v in blobs.items()})


def drain_in_threads(nets: Sequence[blobfeed.Net]) -> dict[str, list[dict[str, np.ndarray]]]:
    """Drain several nets concurrently (one consumer thread each)."""
    results: dict[str, list[dict[str, np.ndarray]]] = {}
    errors: list[BaseException] = []

    def consume(net: blobfeed.Net) -> None:
        try:
            results[net.name] = drain(net)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=consume, args=(n,), name=f"test-consumer-{n.name}") for n in nets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT * 3)
        assert not t.is_alive(), f"consumer {t.name} hung"
    if errors:
        raise errors[0]
    return results


def blocking_fetcher(release: threading.Event, entered: threading.Event | None = None) -> Callable[[int, int], list]:
    """A fetch_fun stuck until ``release`` is set (bounded so tests never hang)."""

    def fetch(worker_id: int, batch_size: int) -> list:
        if entered is not None:
            entered.set()
        release.wait(30)
        raise StopIteration

    return fetch


def sample(gc: blobfeed.GlobalCoordinator, name: str, **labels: str) -> float:
    """A metric's value through the public registry surface (0 when absent)."""
    value = gc.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def open_fds() -> dict[str, str]:
    """This process's open descriptors: number -> what it is (a number
    reused for something else reads as another descriptor)."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass  # (the listing's own, closed since)
    return out


def fds_opened_since(before: dict[str, str]) -> list[tuple[str, str]]:
    """Descriptors open now that were not open at ``before`` (:func:`open_fds`).

    What was open before and is closed now does not count: a library an
    earlier test used (a Ray cluster's driver, say) closes its own event
    descriptors when it will, and a count would take that for a leak's
    absence or hide a leak behind it."""
    return sorted(set(open_fds().items()) - set(before.items()))


def wait_until(pred: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    """Bounded wait for a state that only metrics or queue sizes show.

    Prefer events; this is for states inside blobfeed the test cannot hook.
    """
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.002)


@contextlib.contextmanager
def local_ray_cluster(nodes: Sequence[dict[str, Any]], **init: Any) -> Iterator[Any]:
    """A Ray cluster of simulated nodes on this machine (``ray.cluster_utils``):
    a head with no CPUs, one node per entry of ``nodes`` (its ``add_node``
    arguments), the driver connected with ``init``'s ``ray.init`` arguments.
    The repository is on the workers' ``PYTHONPATH``: actors import the
    tests' fetchers by reference.  Everything is shut down and restored after."""
    import ray
    from ray.cluster_utils import Cluster

    root = str(Path(__file__).resolve().parent.parent)
    old_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([root] + ([old_path] if old_path else []))
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        for node in nodes:
            c.add_node(**node)
        c.wait_for_nodes()
        ray.init(address=c.address, logging_level=logging.WARNING, log_to_driver=False, **init)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        if old_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old_path


def interrupt_after(monkeypatch: Any, owner: Any, name: str) -> None:
    """``owner.name`` raises ``KeyboardInterrupt`` (what a Ctrl-C raises in
    the main thread) right after its first call did its work; later calls
    are the original's."""
    original = getattr(owner, name)

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        original(*args, **kwargs)
        monkeypatch.setattr(owner, name, original)
        raise KeyboardInterrupt

    monkeypatch.setattr(owner, name, interrupted)


def python_calls_during(body: Callable[[], Any]) -> list[str]:
    """The Python functions called in this thread while ``body()`` runs
    (``file:function``), C code not counted: what a finalizer or weak
    reference callback would run where a Ctrl-C can land."""
    import sys

    calls: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            calls.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        body()
    finally:
        sys.setprofile(None)
    return [c for c in calls if not c.endswith(":python_calls_during")]
