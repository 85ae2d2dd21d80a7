"""``blobfeed bench``: workloads W1-W6, W1p-W6p and the ordered modes (docs/BENCHMARKS.md), blobfeed beside its baselines and peers.

Every (workload, runner) measurement runs in a fresh child process so that
peak RSS belongs to that runner alone; repetitions are interleaved (A B A B
...) so slow drift of a shared machine hits every runner alike; the median
of the repetitions is reported, and ratios are taken between runners of the
same invocation.

Workloads W1-W6 run blobfeed's fetchers as threads; W1p, W2p, W4p and W6p
are W1, W2, W4 and W6 with ``backend="processes"`` (2 worker processes).
W1d, W2d and W4pd are W1, W2 and W4p with ``deterministic=True``; W1s and
W2s are W1 and W2 with ``deterministic=True, shuffle_buffer=10000``.  They
run blobfeed alone, and the table's "vs base" column gives blobfeed's
batches/s on each over its batches/s on the default-mode workload in the
same run (the targets of W1d, W2d and W4pd are on that ratio).

R1 and R2 run blobfeed's fetchers as Ray actors (``blobfeed.ray.RayBackend``,
extra ``blobfeed[ray]``) on a local cluster of simulated nodes that each
measurement starts before it connects (a head with no CPUs, and nodes of 2
CPUs with 2 actors each), so that the first batch is timed from ``start()``
on a running cluster, not from Ray's start-up; they are skipped where Ray is
not installed.  R1's fetchers wait on I/O (50 ms per 256 KiB chunk): runners
``ray1``, ``ray2``, ``ray4`` (nodes), and ``ray2max`` (the same chunks with
no wait: the driver's ingest limit).  R2 is W2 through Ray (``ray``: one
node, 2 actors) beside W2 through threads (``blobfeed``) in the same run.

Runners:

* ``blobfeed``   -- the library, a ``Net`` with no model (W5: the MLP).
* ``caffe2``     -- Caffe2's original re-batching, written from its
  description: ``np.append`` growth, ``np.split``, leftover put back with
  ``put(block=False)`` and dropped when the queue is full.  It counts the
  samples it drops.
* ``copy``       -- the copy bound (W2): one ``np.copyto`` per batch into
  buffers rotated through more memory than the last-level cache.
* ``model``      -- the model alone (W5): ``InferenceSession.run`` on pre-made batches.
* in-process peers (W1, W2), where installed: ``grain0`` (grain, no worker
  process, chunks re-batched by grain), ``torch0`` (DataLoader, map-style
  per-sample dataset, ``num_workers=0``), ``torch0it`` (DataLoader over an
  iterable dataset of the chunks, re-batched in the loop).
* process peers (W1p, W2p, W4p, W6p): ``grain2`` (``mp_prefetch``, 2
  workers, chunks re-batched in the parent), ``grain2b`` (the same with the
  re-batching inside the workers: exact batches per worker), ``torch2``
  (DataLoader, map-style per-sample, ``num_workers=2``), ``torch2it``
  (iterable dataset of the chunks, ``num_workers=2``, re-batched in the
  parent) and ``pool`` (``multiprocessing.Pool(2).imap`` of the fetch
  function, re-batched in the parent: what one writes by hand).  grain and
  torch rows are skipped where the package is not installed, and the
  targets that need them say "not evaluated (peer missing)".
* ``raydata`` (W1, W2, W3), where ``ray[data]`` is installed: Ray Data on a
  local cluster of 2 CPUs started before the clock: ``map_batches`` makes
  blocks of the workload's chunks, ``iter_batches`` re-batches them to the
  exact batch (see ``run_raydata``); its PSS column is the whole cluster's.

Exit status: 0 when every evaluated target is met; 1 when any is missed,
including blobfeed losing a sample in any repetition (the missed targets are
listed), or when no target could be evaluated; 2 for a usage error or a
measurement that crashed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import mmap
import multiprocessing
import os
import queue
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "build_parser", "ensure_w6_corpus", "estimate_seconds", "evaluate", "main", "summarize", "verdict",
]


# --------------------------------------------------------------------------- a tally shared with workers
class Tally:
    """What the workers of one measurement report to its runner, through a
    small shared file mapping, so that worker processes report as threads do:

    * a stop flag: blobfeed's and Caffe2's fetchers raise ``StopIteration``
      once it is set;
    * per worker slot, the samples fetched (each slot has one writer);
    * per worker slot, a ring of CPU times, in seconds per sample, of the
      work a fetch did (W4's loop, W6's decodes), from ``time.thread_time``
      in whichever thread or process did it.

    It pickles as its path: a worker process maps the same file on first use.
    """

    WORKERS = 16
    RING = 16384
    _COUNTS = 1  # int64 words: [0] stop flag, [1..16] samples, [17..32] CPU times recorded
    _NTIMES = 1 + WORKERS
    _HEADER = 40  # words before the rings (float64)
    SIZE = 8 * (_HEADER + WORKERS * RING)

    def __init__(self) -> None:
        shm = "/dev/shm"
        folder = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
        fd, self.path = tempfile.mkstemp(prefix="blobfeed-bench-", dir=folder)
        os.ftruncate(fd, self.SIZE)
        os.close(fd)
        self._owner = os.getpid()
        self._q: Any = None  # memoryview of int64
        self._d: Any = None  # memoryview of float64

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path = state["path"]
        self._owner = -1
        self._q = self._d = None

    def _open(self) -> tuple[Any, Any]:
        if self._q is None or self._d is None:
            with open(self.path, "r+b") as f:
                mm = mmap.mmap(f.fileno(), self.SIZE)
            self._q = memoryview(mm).cast("q")
            self._d = memoryview(mm)[8 * self._HEADER :].cast("d")
        return self._q, self._d

    # workers
    @property
    def stopping(self) -> bool:
        q = self._q if self._q is not None else self._open()[0]
        return q[0] != 0

    def add(self, worker: int, samples: int) -> None:
        q = self._q if self._q is not None else self._open()[0]
        q[self._COUNTS + worker % self.WORKERS] += samples

    def cpu(self, worker: int, seconds_per_sample: float) -> None:
        q, d = self._open() if self._q is None or self._d is None else (self._q, self._d)
        w = worker % self.WORKERS
        n = q[self._NTIMES + w]
        d[w * self.RING + n % self.RING] = seconds_per_sample
        q[self._NTIMES + w] = n + 1

    # the runner
    def finish(self) -> None:
        self._open()[0][0] = 1

    def fetched(self) -> int:
        q = self._open()[0]
        return sum(q[self._COUNTS + w] for w in range(self.WORKERS))

    def cpu_median(self) -> float | None:
        """The median CPU time per sample over every worker, skipping each
        worker's first quarter (warm-up) while its ring has not wrapped."""
        q, d = self._open()
        values: list[float] = []
        for w in range(self.WORKERS):
            n = q[self._NTIMES + w]
            if n == 0:
                continue
            ring = d[w * self.RING : w * self.RING + min(n, self.RING)].tolist()
            values += ring[n // 4 :] if n <= self.RING else ring
        return statistics.median(values) if values else None

    def close(self) -> None:
        if self._owner == os.getpid():
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


# --------------------------------------------------------------------------- workloads
class Fetcher:
    """A workload's ``fetch_fun``.  Module-level classes, so that they pickle
    by reference for worker processes: an instance carries only small
    parameters and builds its arrays lazily in whichever process calls it.

    ``fetcher(worker_id, batch_size)`` is blobfeed's (and Caffe2's)
    ``fetch_fun``: it ends with ``StopIteration`` once the tally is finished
    and counts what it returns.  The peers call :meth:`chunk` (the same
    chunks) or :meth:`sample` (one sample, for per-sample datasets).
    """

    #: work whose CPU time is recorded (W4, W6): the ideal is made from it
    timed = False

    def __init__(self, tally: Tally | None = None) -> None:
        self.tally = tally
        self._pos: dict[int, int] = {}
        self._data: Any = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_pos"] = {}
        state["_data"] = None
        return state

    def __call__(self, worker_id: int, batch_size: int) -> list:
        tally = self.tally
        if tally is not None:
            if tally.stopping:
                raise StopIteration
            chunk = self.chunk(worker_id)
            tally.add(worker_id, len(chunk[0]))
            return chunk
        return self.chunk(worker_id)

    def _next(self, worker_id: int, period: int) -> int:
        """The worker's position in its cycle: each worker starts elsewhere."""
        i = self._pos.get(worker_id, worker_id * 977) % period
        self._pos[worker_id] = i + 1
        return i

    def build(self) -> Any:
        raise NotImplementedError

    def chunk(self, worker_id: int) -> list:
        raise NotImplementedError

    def sample(self, index: int, worker_id: int) -> tuple:
        """Sample ``index`` for a map-style dataset: row ``index % len(pool)``
        of a pool made of the workload's own chunks (at least a batch of them),
        so samples come from as much memory as the chunks do."""
        pool = self.__dict__.get("_pool")
        if pool is None:
            chunks: list[list[np.ndarray]] = []
            while sum(len(c[0]) for c in chunks) < self.batch_hint:
                chunks.append(self.chunk(0))
            pool = [np.concatenate([c[k] for c in chunks]) for k in range(len(chunks[0]))]
            self.__dict__["_pool"] = pool
        j = index % len(pool[0])
        return tuple(a[j] for a in pool)

    batch_hint = 32


def _sizes(seed: int, lo: int, hi: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(lo, hi + 1, size=8192)


class W1Fetch(Fetcher):
    """n ~ U[1,64] samples: float64 (n,3) whose row j is j + worker_id; labels its column 0."""

    def build(self) -> Any:
        pools = {}
        for w in range(8):
            data = np.repeat(np.arange(64, dtype=np.float64)[:, None] + w, 3, axis=1)
            pools[w] = (data, data[:, 0].copy())
        self._data = (_sizes(1, 1, 64), pools)
        return self._data

    def chunk(self, worker_id: int) -> list:
        sizes, pools = self._data or self.build()
        n = int(sizes[self._next(worker_id, len(sizes))])
        data, labels = pools[worker_id % 8]
        return [data[:n], labels[:n]]


class W2Fetch(Fetcher):
    """n ~ U[1,16] images: uint8 (n,3,224,224), int64 labels."""

    batch_hint = 64

    def build(self) -> Any:
        rng = np.random.default_rng(2)
        images = rng.integers(0, 255, size=(16, 3, 224, 224), dtype=np.uint8)
        self._data = (_sizes(2, 1, 16), images, np.arange(16, dtype=np.int64))
        return self._data

    def chunk(self, worker_id: int) -> list:
        sizes, images, labels = self._data or self.build()
        n = int(sizes[self._next(worker_id, len(sizes))])
        return [images[:n], labels[:n]]


class W3Fetch(Fetcher):
    """4096 samples: float32 (4096,256), int64 labels."""

    def build(self) -> Any:
        rng = np.random.default_rng(3)
        self._data = (rng.standard_normal((4096, 256)).astype(np.float32), np.arange(4096, dtype=np.int64))
        return self._data

    def chunk(self, worker_id: int) -> list:
        data, labels = self._data or self.build()
        return [data, labels]


def _busy(iterations: int) -> int:
    acc = 0
    for i in range(iterations):
        acc += i * i % 7
    return acc


def calibrate_w4(target_s: float = 0.005) -> tuple[int, float]:
    """Iterations of pure-Python work taking ``target_s`` of CPU time, and the
    measured time.  CPU time (``time.thread_time``), so that a busy machine
    does not shrink the work: wall time would count the waits for a core."""

    def cpu_time(iterations: int) -> float:
        t0 = time.thread_time()
        _busy(iterations)
        return time.thread_time() - t0

    n = 10_000
    while cpu_time(n) <= 0.002:
        n *= 2
    for _ in range(2):  # rescale on medians: one timing can be an outlier
        n = int(n * target_s / statistics.median(cpu_time(n) for _ in range(7)))
    return n, statistics.median(cpu_time(n) for _ in range(15))


class W4Fetch(Fetcher):
    """~5 ms of pure-Python work (calibrated in the runner's process), then
    32 samples.  Records the CPU time of each call (``time.thread_time``: GIL
    waits excluded) so the ideal comes from the very calls the pipeline made."""

    timed = True

    def __init__(self, tally: Tally | None = None) -> None:
        super().__init__(tally)
        self.iterations, _ = calibrate_w4()

    def build(self) -> Any:
        data = np.random.default_rng(4).standard_normal((32, 1024)).astype(np.float32)
        self._data = (data, np.arange(32, dtype=np.int64))
        return self._data

    def chunk(self, worker_id: int) -> list:
        data, labels = self._data or self.build()
        t0 = time.thread_time()
        _busy(self.iterations)
        if self.tally is not None:
            self.tally.cpu(worker_id, (time.thread_time() - t0) / 32)
        return [data, labels]

    def sample(self, index: int, worker_id: int) -> tuple:
        """A 32nd of a fetch's work, then one row."""
        data, labels = self._data or self.build()
        t0 = time.thread_time()
        _busy(self.iterations // 32)
        if self.tally is not None:
            self.tally.cpu(worker_id, time.thread_time() - t0)
        j = index % 32
        return data[j], labels[j]


class W5Fetch(Fetcher):
    """n ~ U[1,256] samples float32 (n,784) for the MLP."""

    def build(self) -> Any:
        rng = np.random.default_rng(5)
        self._data = (_sizes(5, 1, 256), rng.standard_normal((256, 784)).astype(np.float32))
        return self._data

    def chunk(self, worker_id: int) -> list:
        sizes, data = self._data or self.build()
        n = int(sizes[self._next(worker_id, len(sizes))])
        return [data[:n]]


# W6's corpus: generated once, from a fixed seed, into a cache folder
W6_FILES = 300
W6_SIZE = (500, 375)  # width, height
W6_QUALITY = 90
W6_NOISE_SIGMA = 6.0
W6_VERSION = "w6-v1"


def w6_corpus_dir() -> Path:
    """``$XDG_CACHE_HOME/blobfeed-bench/w6-v1`` (default ``~/.cache/...``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "blobfeed-bench" / W6_VERSION


def _w6_paths(folder: Path | str) -> list[str]:
    return [os.path.join(folder, f"{i:03d}.jpg") for i in range(W6_FILES)]


def _w6_image(rng: np.random.Generator) -> np.ndarray:
    """One RGB image: a smooth colour gradient, a few soft blobs, Gaussian noise."""
    w, h = W6_SIZE
    y = np.linspace(0.0, 1.0, h)[:, None, None]
    x = np.linspace(0.0, 1.0, w)[None, :, None]
    img = rng.uniform(70, 185, 3) + rng.uniform(-50, 50, 3) * x + rng.uniform(-50, 50, 3) * y
    yy = np.arange(h, dtype=np.float64)[:, None]
    xx = np.arange(w, dtype=np.float64)[None, :]
    for _ in range(int(rng.integers(2, 6))):
        cy, cx, s = rng.uniform(0, h), rng.uniform(0, w), rng.uniform(20, 80)
        blob = np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * s * s))[..., None]
        img = img + blob * rng.uniform(-60, 60, 3)
    img = img + rng.normal(0.0, W6_NOISE_SIGMA, (h, w, 3))
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def ensure_w6_corpus(folder: Path | None = None, progress: Any = None) -> Path:
    """W6's 300 JPEGs (500x375, quality 90), made once from seed 6 and reused.

    Written to a temporary folder beside the cache folder and renamed into
    place, so a crash or a concurrent run never leaves half a corpus behind.
    """
    folder = w6_corpus_dir() if folder is None else Path(folder)
    if all(os.path.exists(p) for p in _w6_paths(folder)):
        return folder
    from PIL import Image

    if progress is not None:
        progress.write(f"blobfeed bench: generating W6's corpus ({W6_FILES} JPEGs) in {folder}\n")
        progress.flush()
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{W6_VERSION}-", dir=folder.parent))
    try:
        rng = np.random.default_rng(6)
        for path in _w6_paths(tmp):
            Image.fromarray(_w6_image(rng), "RGB").save(path, "JPEG", quality=W6_QUALITY)
        try:
            os.rename(tmp, folder)
        except OSError:  # another run got there first, or a broken folder is in the way
            if not all(os.path.exists(p) for p in _w6_paths(folder)):
                raise
    finally:
        if tmp.exists():
            for p in tmp.iterdir():
                p.unlink()
            tmp.rmdir()
    return folder


def _decode(path: str) -> Any:
    from PIL import Image

    return Image.open(path).convert("RGB").resize((224, 224), Image.Resampling.BILINEAR)


class W6Fetch(Fetcher):
    """n ~ U[1,8] JPEGs decoded with Pillow: uint8 (n,224,224,3), int64
    labels (the file's index).  Records the CPU time of each decode."""

    timed = True

    def __init__(self, tally: Tally | None = None) -> None:
        super().__init__(tally)
        self.folder = str(ensure_w6_corpus())

    def build(self) -> Any:
        self._data = (_sizes(6, 1, 8), _w6_paths(self.folder))
        return self._data

    def _decode_into(self, out: np.ndarray, k: int, index: int, worker_id: int, paths: list[str]) -> None:
        t0 = time.thread_time()
        out[k] = np.asarray(_decode(paths[index]))
        if self.tally is not None:
            self.tally.cpu(worker_id, time.thread_time() - t0)

    def chunk(self, worker_id: int) -> list:
        sizes, paths = self._data or self.build()
        n = int(sizes[self._next(worker_id, len(sizes))])
        key = -1 - worker_id  # the worker's own cursor through the files
        first = self._pos.get(key, worker_id * 150)
        self._pos[key] = first + n
        labels = np.arange(first, first + n, dtype=np.int64) % W6_FILES
        out = np.empty((n, 224, 224, 3), np.uint8)
        for k in range(n):
            self._decode_into(out, k, int(labels[k]), worker_id, paths)
        return [out, labels]

    def sample(self, index: int, worker_id: int) -> tuple:
        _, paths = self._data or self.build()
        j = index % W6_FILES
        out = np.empty((1, 224, 224, 3), np.uint8)
        self._decode_into(out, 0, j, worker_id, paths)
        return out[0], np.int64(j)


class R1Fetch(Fetcher):
    """R1: a fetcher that waits on I/O: 50 ms, then 64 samples of float32
    (64, 1024) (256 KiB) and int64 labels."""

    batch_hint = 64
    delay_s = 0.05

    def build(self) -> Any:
        rng = np.random.default_rng(3)
        self._data = (rng.random((64, 1024), dtype=np.float32), np.arange(64, dtype=np.int64))
        return self._data

    def chunk(self, worker_id: int) -> list:
        data, labels = self._data or self.build()
        if self.delay_s:
            time.sleep(self.delay_s)
        return [data, labels]


class R1FastFetch(R1Fetch):
    """R1's chunks without the wait: what the driver can take in."""

    delay_s = 0.0


@dataclass(frozen=True)
class Workload:
    id: str
    batch: int
    blobs: tuple[str, ...]
    fetcher: Callable[[Tally | None], Fetcher]
    runners: tuple[str, ...]
    what: str
    backend: str = "threads"
    #: cores of the ideal (0: no ideal): W4's threads share one core under
    #: the GIL; Pillow releases it, so W6's threads may use both
    ideal_cores: int = 0
    #: modules the workload itself needs (its rows are skipped without them)
    needs: tuple[str, ...] = ()
    #: ``init_data_input_workers(deterministic=..., shuffle_buffer=...)``
    deterministic: bool = False
    shuffle_buffer: int = 0
    #: the default-mode workload this one is set against (same fetcher,
    #: batch and backend): the table shows blobfeed's batches/s over that
    #: workload's, when both ran
    base: str = ""


IN_PROCESS_PEERS = ("grain0", "torch0", "torch0it")
#: W1s and W2s: samples in the shuffle buffer
SHUFFLE_BUFFER = 10_000
#: the seed of the ordered workloads (W1d, W2d, W4pd, W1s, W2s): the same
#: batches, in the same order, on every run
ORDERED_SEED = 0
PROCESS_PEERS = ("grain2", "grain2b", "torch2", "torch2it", "pool")

WORKLOADS = {
    "W1": Workload("W1", 32, ("data", "label"), W1Fetch, ("blobfeed", "caffe2", *IN_PROCESS_PEERS, "raydata"),
                   "per-batch overhead"),
    "W2": Workload("W2", 64, ("data", "label"), W2Fetch, ("blobfeed", "caffe2", "copy", *IN_PROCESS_PEERS, "raydata"),
                   "bandwidth"),
    "W3": Workload("W3", 32, ("data", "label"), W3Fetch, ("blobfeed", "caffe2", "raydata"), "big chunks"),
    "W4": Workload("W4", 32, ("data", "label"), W4Fetch, ("blobfeed", "caffe2"), "CPU-bound fetchers", ideal_cores=1),
    "W5": Workload("W5", 128, ("data",), W5Fetch, ("blobfeed", "model"), "end to end with a model"),
    "W6": Workload("W6", 32, ("data", "label"), W6Fetch, ("blobfeed",), "JPEG decoding (Pillow frees the GIL)",
                   ideal_cores=2, needs=("PIL",)),
    "W1p": Workload("W1p", 32, ("data", "label"), W1Fetch, ("blobfeed", *PROCESS_PEERS), "W1, process workers",
                    backend="processes"),
    "W2p": Workload("W2p", 64, ("data", "label"), W2Fetch, ("blobfeed", *PROCESS_PEERS), "W2, process workers",
                    backend="processes"),
    "W4p": Workload("W4p", 32, ("data", "label"), W4Fetch, ("blobfeed", *PROCESS_PEERS), "W4, process workers",
                    backend="processes", ideal_cores=2),
    "W6p": Workload("W6p", 32, ("data", "label"), W6Fetch, ("blobfeed", *PROCESS_PEERS), "W6, process workers",
                    backend="processes", ideal_cores=2, needs=("PIL",)),
    # Ray actors on a local cluster of simulated nodes (blobfeed[ray])
    "R1": Workload("R1", 64, ("data", "label"), R1Fetch, ("ray1", "ray2", "ray4", "ray2max"),
                   "I/O-bound fetchers on 1, 2, 4 Ray nodes", needs=("ray",)),
    "R2": Workload("R2", 64, ("data", "label"), W2Fetch, ("blobfeed", "ray"), "W2 through Ray beside threads",
                   needs=("ray",)),
    # the ordered modes: blobfeed only, each against its default-mode workload
    "W1d": Workload("W1d", 32, ("data", "label"), W1Fetch, ("blobfeed",), "W1, deterministic=True",
                    deterministic=True, base="W1"),
    "W2d": Workload("W2d", 64, ("data", "label"), W2Fetch, ("blobfeed",), "W2, deterministic=True",
                    deterministic=True, base="W2"),
    "W4pd": Workload("W4pd", 32, ("data", "label"), W4Fetch, ("blobfeed",), "W4p, deterministic=True",
                     backend="processes", ideal_cores=2, deterministic=True, base="W4p"),
    "W1s": Workload("W1s", 32, ("data", "label"), W1Fetch, ("blobfeed",), "W1, deterministic, shuffle_buffer=10000",
                    deterministic=True, shuffle_buffer=SHUFFLE_BUFFER, base="W1"),
    "W2s": Workload("W2s", 64, ("data", "label"), W2Fetch, ("blobfeed",), "W2, deterministic, shuffle_buffer=10000",
                    deterministic=True, shuffle_buffer=SHUFFLE_BUFFER, base="W2"),
}

#: the optional package each peer needs; the others need only the standard library
RUNNER_NEEDS = {
    "grain0": "grain", "grain2": "grain", "grain2b": "grain",
    "torch0": "torch", "torch0it": "torch", "torch2": "torch", "torch2it": "torch",
    "ray": "ray", "ray1": "ray", "ray2": "ray", "ray4": "ray", "ray2max": "ray",
    "raydata": "ray.data",
}
#: what ``import ray.data`` needs beyond Ray (the extra ``ray[data]``):
#: ``find_spec("ray.data")`` alone succeeds without them
RAYDATA_NEEDS = ("ray", "pandas", "pyarrow", "fsspec")


def _mlp_bytes() -> bytes:
    from .models import mlp_onnx

    return mlp_onnx([784, 256, 10], seed=0)[0]


def _session_options() -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    return so


# --------------------------------------------------------------------------- measurement
def _pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:  # gone meanwhile, or no such file on this kernel
        pass
    return 0


def _descendants(root: int) -> list[int]:
    """``root`` and every process below it (children of children too: the
    forkserver's workers, grain's and torch's), from /proc."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rfind(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def tree_pss_mb(root: int | None = None) -> float:
    """Total PSS of ``root`` (default this process) and its descendants, MiB:
    shared pages (shared memory, the forkserver's) are counted once in all."""
    return sum(_pss_kb(pid) for pid in _descendants(os.getpid() if root is None else root)) / 1024


@dataclass
class Meter:
    """Counts batches in a timed window after a warm-up.

    With ``pss``, the total PSS of this process and its descendants is read
    about once a second inside the window (the time it takes is left out of
    the window) and its maximum is reported.
    """

    seconds: float
    warmup: float = 0.5
    pss: bool = False
    batches: int = 0
    samples: int = 0
    nbytes: int = 0
    t_start: float = 0.0
    t_first: float | None = None
    t_window: float = 0.0
    t_end: float = 0.0
    pss_mb: float = 0.0
    t_pss: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def begin(self) -> None:
        self.t_start = time.perf_counter()

    def tick(self, arrays: Any) -> bool:
        """Record one batch; False once the window is over."""
        now = time.perf_counter()
        if self.t_first is None:
            self.t_first = now
            self.t_window = now + self.warmup
            return True
        if now < self.t_window:
            return True
        if self.batches == 0:
            self.t_window = now  # the window starts at the first batch after warm-up
            self.t_pss = now
        self.batches += 1
        self.samples += len(arrays[0])
        self.nbytes += sum(a.nbytes for a in arrays)
        self.t_end = now
        going = now - self.t_window < self.seconds
        if self.pss and (now >= self.t_pss or not going):
            self.pss_mb = max(self.pss_mb, tree_pss_mb())
            if going:
                spent = time.perf_counter() - now
                self.t_window += spent  # not the pipeline's time
                self.t_pss = now + spent + 1.0
        return going

    def result(self, **extra: Any) -> dict[str, Any]:
        dt = max(self.t_end - self.t_window, 1e-9)
        out = {
            "batches_per_s": self.batches / dt,
            "gb_per_s": self.nbytes / dt / 1e9,
            "first_batch_ms": ((self.t_first or self.t_start) - self.t_start) * 1e3,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }
        if self.pss:
            out["pss_mb"] = self.pss_mb
        out.update(self.extra)
        out.update(extra)
        return out


def _ideal(wl: Workload, tally: Tally, batches_per_s: float) -> dict[str, Any]:
    """``wl``'s ideal from the CPU times its workers recorded in this very
    run: ``ideal_cores / (batch x the median CPU time of one sample)``."""
    if not wl.ideal_cores:
        return {}
    per_sample = tally.cpu_median()
    if not per_sample:
        return {}
    ideal = wl.ideal_cores / (wl.batch * per_sample)
    return {"ideal_batches_per_s": ideal, "ideal_ratio": batches_per_s / ideal, "cpu_per_sample_ms": per_sample * 1e3}


def _rebatched(chunks: Iterable[Any], batch: int) -> Iterator[list[np.ndarray]]:
    """Exact batches of ``batch`` samples from chunks of any size, in one
    plain loop: a batch inside one chunk is a view of it, one that spans
    chunks is one ``np.concatenate`` of the pieces."""
    parts: list[list[np.ndarray]] = []
    have = 0
    for chunk in chunks:
        m = len(chunk[0])
        start = 0
        while have + m - start >= batch:
            take = batch - have
            piece = [a[start : start + take] for a in chunk]
            if parts:
                parts.append(piece)
                yield [np.concatenate(col) for col in zip(*parts)]
                parts = []
            else:
                yield piece
            have = 0
            start += take
        if start < m:
            parts.append([a[start:] for a in chunk] if start else list(chunk))
            have += m - start


def run_blobfeed(wl: Workload, seconds: float) -> dict[str, Any]:
    import blobfeed

    tally = Tally()
    try:
        return _run_blobfeed(wl, seconds, tally, blobfeed)
    finally:
        tally.close()


def _run_blobfeed(wl: Workload, seconds: float, tally: Tally, blobfeed: Any, backend: Any = None,
                  workers: int = 2) -> dict[str, Any]:
    fetch = wl.fetcher(tally)
    model = _mlp_bytes() if wl.id == "W5" else None
    net = blobfeed.Net(model, name="bench", session_options=_session_options() if model else None)
    gc = blobfeed.GlobalCoordinator()
    if backend is None and wl.backend != "threads":
        backend = wl.backend
    kwargs: dict[str, Any] = {} if backend is None else {"backend": backend}
    if wl.deterministic or wl.shuffle_buffer:
        kwargs.update(deterministic=wl.deterministic, shuffle_buffer=wl.shuffle_buffer, seed=ORDERED_SEED)
    blobfeed.init_data_input_workers(net, list(wl.blobs), fetch, wl.batch, num_worker_threads=workers, coordinator=gc,
                                     **kwargs)
    m = Meter(seconds, pss=backend is not None)
    wait_key = ("blobfeed_dequeue_wait_seconds_sum", {"source": "train", "net": "bench"})
    delivered = 0
    m.begin()
    gc.start()
    wait0 = 0.0
    while True:
        out = net.run(timeout=60)
        arrays = [out[n] for n in wl.blobs] if model is None else [net.workspace.fetch_blob("data")]
        delivered += len(arrays[0])
        before = m.batches
        going = m.tick(arrays)
        if before == 0 and m.batches == 1:
            wait0 = gc.registry.get_sample_value(*wait_key) or 0.0
        if not going:
            break
    waited = (gc.registry.get_sample_value(*wait_key) or 0.0) - wait0
    window = max(m.t_end - m.t_window, 1e-9)
    extra: dict[str, Any] = {}
    if model is not None:
        extra = _interleaved_model_ratio(net, model, wl, seconds)
        delivered += extra.pop("delivered")
    # Drain to the end: every fetched sample must come out exactly once.
    tally.finish()
    while True:
        try:
            out = net.run(timeout=60)
        except blobfeed.EndOfInput:
            break
        delivered += len(out[wl.blobs[0]]) if model is None else len(net.workspace.fetch_blob("data"))
    gc.stop()
    bps = m.batches / window
    extra.update(_ideal(wl, tally, bps))
    return m.result(samples_lost=int(tally.fetched() - delivered), wait_share=waited / window, **extra)


def _interleaved_model_ratio(net: Any, model: bytes, wl: Workload, seconds: float) -> dict[str, Any]:
    """W5: alternate short slices of the fed net and of the model alone on
    pre-made batches, in this process, so that both see the same machine.

    While the model-alone slice runs, blobfeed's queues are full and its
    threads asleep: that slice is the model alone.
    """
    import onnxruntime as ort

    sess = ort.InferenceSession(model, sess_options=_session_options(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((wl.batch, 784)).astype(np.float32)
    fed = alone = 0
    t_fed = t_alone = 0.0
    delivered = 0
    slice_s = 0.25
    for _ in range(max(4, int(seconds / slice_s / 2))):
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < slice_s:
            net.run(timeout=60)
            delivered += len(net.workspace.fetch_blob("data"))
            fed += 1
        t_fed += time.perf_counter() - t0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < slice_s:
            sess.run(None, {"data": x})
            alone += 1
        t_alone += time.perf_counter() - t0
    return {"model_ratio": (fed / t_fed) / (alone / t_alone), "delivered": delivered}


def _caffe2_pipeline(wl: Workload, fetch: Fetcher) -> tuple[Callable[[], list], Callable[[], dict[str, int]], Callable[[], None]]:
    """Caffe2's data_workers re-batching (see the module docstring)."""
    internal: queue.Queue = queue.Queue(800)
    device: queue.Queue = queue.Queue(4)
    stop = threading.Event()
    stats = {"dropped": 0, "held": 0}
    bs = wl.batch

    def fetcher(wid: int) -> None:
        while not stop.is_set():
            try:
                chunk = fetch(wid, bs)
            except StopIteration:
                return
            while True:
                try:
                    internal.put(chunk, timeout=0.1)
                    break
                except queue.Full:
                    if stop.is_set():
                        stats[f"held{wid}"] = len(chunk[0])  # not a loss of the algorithm
                        return

    def enqueuer() -> None:
        while not stop.is_set():
            cur: list | None = None
            while cur is None or len(cur[0]) < bs:
                try:
                    chunk = internal.get(timeout=0.1)
                except queue.Empty:
                    if stop.is_set():
                        stats["held"] = 0 if cur is None else len(cur[0])
                        return
                    continue
                if cur is None:
                    cur = [a.copy() for a in chunk]
                else:
                    cur = [np.append(c, a, axis=0) for c, a in zip(cur, chunk)]
            if len(cur[0]) > bs:
                parts = [np.split(c, [bs]) for c in cur]
                cur = [p[0] for p in parts]
                leftover = [p[1] for p in parts]
                try:
                    internal.put(leftover, block=False)
                except queue.Full:
                    stats["dropped"] += len(leftover[0])  # Caffe2 dropped these silently
            while True:
                try:
                    device.put(cur, timeout=0.1)
                    break
                except queue.Full:
                    if stop.is_set():
                        stats["held"] = len(cur[0])
                        return

    threads = [threading.Thread(target=fetcher, args=(w,), daemon=True) for w in range(2)]
    threads.append(threading.Thread(target=enqueuer, daemon=True))

    def start() -> None:
        for t in threads:
            t.start()

    def get() -> list:
        return device.get(timeout=60)

    def finish() -> dict[str, int]:
        stop.set()
        for t in threads:
            t.join(5)
        held = sum(len(item[0]) for item in list(internal.queue)) + sum(len(b[0]) for b in list(device.queue))
        return {"dropped": stats["dropped"], "held": held + sum(v for k, v in stats.items() if k.startswith("held"))}

    return get, finish, start


def run_caffe2(wl: Workload, seconds: float) -> dict[str, Any]:
    tally = Tally()
    try:
        fetch = wl.fetcher(tally)
        get, finish, start = _caffe2_pipeline(wl, fetch)
        m = Meter(seconds)
        delivered = 0
        m.begin()
        start()
        while True:
            batch = get()
            delivered += len(batch[0])
            if not m.tick(batch):
                break
        tally.finish()
        counts = finish()
        fetched = tally.fetched()
        lost = fetched - delivered - counts["held"]
        extra = _ideal(wl, tally, m.result()["batches_per_s"])
        return m.result(samples_lost=int(lost), dropped_counted=counts["dropped"],
                        lost_share=lost / max(fetched, 1), **extra)
    finally:
        tally.close()


def run_copy(wl: Workload, seconds: float) -> dict[str, Any]:
    chunk = wl.fetcher(None).chunk(0)
    batch_bytes = wl.batch * chunk[0][0].nbytes
    src = np.random.default_rng(0).integers(0, 255, size=batch_bytes, dtype=np.uint8)
    # rotate through 256 MiB of destinations: far more than any last-level cache
    n_buf = max(2, (256 << 20) // batch_bytes)
    bufs = [np.empty(batch_bytes, np.uint8) for _ in range(n_buf)]
    for b in bufs:
        b.fill(1)  # fault the pages in first: this bound is about copying
    m = Meter(seconds)
    m.begin()
    i = 0
    while True:
        dst = bufs[i % n_buf]
        np.copyto(dst, src)
        i += 1
        if not m.tick([dst]):
            break
    return m.result(samples_lost=0)


def run_model(wl: Workload, seconds: float) -> dict[str, Any]:
    import onnxruntime as ort

    sess = ort.InferenceSession(_mlp_bytes(), sess_options=_session_options(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    batches = [rng.standard_normal((wl.batch, 784)).astype(np.float32) for _ in range(8)]
    m = Meter(seconds)
    m.begin()
    i = 0
    while True:
        x = batches[i % len(batches)]
        sess.run(None, {"data": x})
        i += 1
        if not m.tick([x]):
            break
    return m.result(samples_lost=0)


def _peer(wl: Workload, seconds: float, body: Callable[[Fetcher, Meter], Any], pss: bool | None = None) -> dict[str, Any]:
    """Runs a peer: ``body(fetcher, meter)`` feeds the meter until it says
    stop; then the result, with the ideal where the workload has one.  Peers
    do not count samples: they are not checked for losses.  ``pss``: read
    the process tree's PSS (default: with worker processes)."""
    tally = Tally()
    try:
        fetcher = wl.fetcher(tally)
        m = Meter(seconds, pss=wl.backend != "threads" if pss is None else pss)
        body(fetcher, m)
        return m.result(samples_lost=0, **_ideal(wl, tally, m.result()["batches_per_s"]))
    finally:
        tally.close()


def _feed(m: Meter, batches: Iterable[Any]) -> None:
    for batch in batches:
        if not m.tick(batch):
            return


def run_torch(wl: Workload, seconds: float, workers: int, iterable: bool) -> dict[str, Any]:
    """torch's DataLoader.  Map-style (``iterable`` False): one sample per
    ``__getitem__``, the default collate, batches made in the workers.
    Iterable: the workload's own chunks, ``batch_size=None``, re-batched in
    this process by the same plain loop as the other peers.  Worker
    processes start with ``fork``, torch's default on Linux."""
    import torch.utils.data as tud

    def body(fetcher: Fetcher, m: Meter) -> None:
        def worker() -> int:
            info = tud.get_worker_info()
            return 0 if info is None else info.id

        class Chunks(tud.IterableDataset):
            def __iter__(self) -> Iterator[list]:
                w = worker()
                while True:
                    yield fetcher.chunk(w)

        class Samples(tud.Dataset):
            def __len__(self) -> int:
                return 10**9

            def __getitem__(self, i: int) -> tuple:
                return fetcher.sample(i, worker() if fetcher.timed else 0)

        context = "fork" if workers else None
        if iterable:
            loader = tud.DataLoader(Chunks(), batch_size=None, num_workers=workers, multiprocessing_context=context)
        else:
            loader = tud.DataLoader(Samples(), batch_size=wl.batch, num_workers=workers, shuffle=False,
                                    multiprocessing_context=context)
        m.begin()
        it = iter(loader)
        try:
            tensors = ([t.numpy() for t in item] for item in it)
            _feed(m, _rebatched(tensors, wl.batch) if iterable else tensors)
        finally:
            shutdown = getattr(it, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()

    return _peer(wl, seconds, body)


#: grain's ``min_shm_size``: smaller arrays are pickled, as blobfeed's process workers do below 32 KiB
GRAIN_MIN_SHM_BYTES = 32 * 1024


class GrainChunk:
    """grain's map function: element ``i`` is a chunk of worker ``i % workers``
    (``mp_prefetch`` gives worker ``w`` the elements ``w, w + workers, ...``)."""

    def __init__(self, fetcher: Fetcher, workers: int) -> None:
        self.fetcher = fetcher
        self.workers = workers

    def __call__(self, i: Any) -> tuple:
        return tuple(self.fetcher.chunk(int(i) % self.workers))


def run_grain(wl: Workload, seconds: float, workers: int, batch_in_workers: bool) -> dict[str, Any]:
    """grain: a ``MapDataset`` of the workload's chunks, read without grain's
    read threads (they only cost here), ``min_shm_size`` 32 KiB, re-batched
    by grain's own ``RebatchIterDataset`` -- in the parent, or inside each
    worker before ``mp_prefetch`` (``batch_in_workers``: exact batches per
    worker)."""
    import grain  # type: ignore[import-not-found]  # an optional peer

    def body(fetcher: Fetcher, m: Meter) -> None:
        ds = grain.MapDataset.range(0, 2**40).map(GrainChunk(fetcher, max(workers, 1)))
        it_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=0))
        it_ds = grain.experimental.WithOptionsIterDataset(
            it_ds, grain.experimental.DatasetOptions(min_shm_size=GRAIN_MIN_SHM_BYTES)
        )
        if batch_in_workers:
            it_ds = grain.experimental.RebatchIterDataset(it_ds, wl.batch)
        if workers:
            it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
        if not batch_in_workers:
            it_ds = grain.experimental.RebatchIterDataset(it_ds, wl.batch)
        m.begin()
        it = iter(it_ds)
        try:
            _feed(m, (list(b) for b in it))
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()

    return _peer(wl, seconds, body)


_POOL_FETCHER: Fetcher | None = None
#: chunks asked of the pool and not yet taken: ``imap`` alone would queue
#: results without bound whenever the workers outrun the parent
POOL_IN_FLIGHT = 8


def _pool_init(fetcher: Fetcher) -> None:
    global _POOL_FETCHER
    _POOL_FETCHER = fetcher


def _pool_fetch(i: int) -> list:
    ident = multiprocessing.current_process()._identity
    assert _POOL_FETCHER is not None
    return _POOL_FETCHER.chunk(ident[-1] - 1 if ident else 0)


def run_pool(wl: Workload, seconds: float) -> dict[str, Any]:
    """``multiprocessing.Pool(2).imap`` of the fetch function, re-batched in
    this process: what one writes by hand.  ``forkserver``: with Linux's
    default ``fork`` the pool hung now and then (a worker forked while one of
    the parent's threads held a lock), which stalled a whole bench run."""

    def body(fetcher: Fetcher, m: Meter) -> None:
        in_flight = threading.Semaphore(POOL_IN_FLIGHT)
        stop = threading.Event()

        def tasks() -> Iterator[int]:
            i = 0
            while not stop.is_set():
                if in_flight.acquire(timeout=0.1):
                    yield i
                    i += 1

        m.begin()
        pool = multiprocessing.get_context("forkserver").Pool(2, initializer=_pool_init, initargs=(fetcher,))
        try:
            def chunks() -> Iterator[list]:
                for chunk in pool.imap(_pool_fetch, tasks()):
                    in_flight.release()
                    yield chunk

            _feed(m, _rebatched(chunks(), wl.batch))
        finally:
            stop.set()
            pool.terminate()
            pool.join()

    return _peer(wl, seconds, body)


#: Ray actors per simulated node, and the CPUs of a node
RAY_ACTORS_PER_NODE = 2


def run_ray(wl: Workload, seconds: float, nodes: int, fetcher: Callable[[Tally | None], Fetcher] | None = None) -> dict[str, Any]:
    """``wl`` through ``blobfeed.ray.RayBackend`` on a local cluster of
    ``nodes`` simulated nodes of 2 CPUs (2 actors of 1 CPU each), started
    (and its start-up timed) before the pipeline, and shut down after it.
    The PSS column is the whole cluster's (every Ray process is a
    descendant of this one)."""
    import dataclasses
    import logging

    import ray
    from ray.cluster_utils import Cluster

    import blobfeed
    from blobfeed.ray import RayBackend

    if fetcher is not None:
        wl = dataclasses.replace(wl, fetcher=fetcher)
    t0 = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        for _ in range(nodes):
            cluster.add_node(num_cpus=RAY_ACTORS_PER_NODE)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level=logging.WARNING, log_to_driver=False)
        cluster_s = time.perf_counter() - t0
        tally = Tally()
        try:
            out = _run_blobfeed(wl, seconds, tally, blobfeed, backend=RayBackend(actor_options={"num_cpus": 1}),
                                workers=nodes * RAY_ACTORS_PER_NODE)
        finally:
            tally.close()
        out.update(ray_nodes=nodes, ray_actors=nodes * RAY_ACTORS_PER_NODE, cluster_start_s=cluster_s)
        return out
    finally:
        ray.shutdown()
        cluster.shutdown()


#: Ray Data (``raydata``): the CPUs of its local cluster (this machine's 2,
#: as blobfeed's 2 fetcher threads); the bytes of one block, Ray Data's
#: default ``target_max_block_size`` (each ``map_batches`` call makes one
#: block of about this many bytes of the workload's chunks); and
#: ``iter_batches``'s ``prefetch_batches``.  From a sweep on this machine
#: (docs/BENCHMARKS.md, "Ray Data as a peer"): blocks of 1-16 MiB were
#: slower on all three workloads (W2: 25 batches/s at 4 MiB, a batch
#: spanning several blocks), 64 MiB about the same; prefetching 1-4
#: batches cost W1 and W3 up to half (its formatting threads and the loop
#: share the GIL) and did not help W2 beyond the noise
RAYDATA_CPUS = 2
RAYDATA_BLOCK_BYTES = 128 << 20
RAYDATA_PREFETCH = 0
#: the dataset's rows (one a chunk) and read tasks: far more chunks than a
#: window takes, in read tasks small enough to plan at once
RAYDATA_ROWS = 10**8
RAYDATA_READ_TASKS = 100


class RayDataChunks:
    """Ray Data's ``map_batches`` function: the batch's rows are chunk
    numbers; row ``i`` becomes a chunk of worker ``i % workers`` (as grain's
    element ``i``), and the call returns them concatenated: one block."""

    def __init__(self, fetcher: Fetcher, blobs: tuple[str, ...], workers: int) -> None:
        self.fetcher = fetcher
        self.blobs = blobs
        self.workers = workers

    def __call__(self, rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        chunks = [self.fetcher.chunk(int(i) % self.workers) for i in rows["id"]]
        return {name: np.concatenate([c[k] for c in chunks]) for k, name in enumerate(self.blobs)}


def run_raydata(wl: Workload, seconds: float) -> dict[str, Any]:
    """Ray Data: ``ray.data.range`` of chunk numbers, ``map_batches`` making
    blocks of ``RAYDATA_BLOCK_BYTES`` of the workload's own chunks (Ray
    tasks of 1 CPU, at most ``RAYDATA_CPUS`` at once), and
    ``iter_batches(batch_size=wl.batch, batch_format="numpy", drop_last=True)``
    re-batching them to the workload's exact batch.  The local cluster
    (``address="local"``: its own, never one that happens to run here) is
    started before the clock, as R1's; the PSS column is the whole
    cluster's (every Ray process descends from this one)."""
    import logging

    import ray
    import ray.data

    t0 = time.perf_counter()
    ray.init(address="local", num_cpus=RAYDATA_CPUS, include_dashboard=False, logging_level=logging.WARNING,
             log_to_driver=False)
    try:
        cluster_s = time.perf_counter() - t0
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ctx.target_max_block_size = RAYDATA_BLOCK_BYTES
        logging.getLogger("ray.data").setLevel(logging.WARNING)

        def body(fetcher: Fetcher, m: Meter) -> None:
            one = fetcher.chunk(0)
            per_block = max(1, round(RAYDATA_BLOCK_BYTES / sum(a.nbytes for a in one)))
            ds = ray.data.range(RAYDATA_ROWS, override_num_blocks=RAYDATA_READ_TASKS).map_batches(
                RayDataChunks(fetcher, wl.blobs, RAYDATA_CPUS), batch_size=per_block, batch_format="numpy"
            )
            m.extra.update(chunks_per_block=per_block, cluster_start_s=cluster_s)
            m.begin()
            it = iter(ds.iter_batches(batch_size=wl.batch, batch_format="numpy", prefetch_batches=RAYDATA_PREFETCH,
                                      drop_last=True))
            try:
                for batch in it:
                    if not m.tick([batch[name] for name in wl.blobs]):
                        return
            finally:
                close = getattr(it, "close", None)
                if close is not None:
                    close()  # shuts the executor down
                # Ray Data's formatting threads end at their next batch; one
                # still inside ``ray.get`` at ``ray.shutdown()`` makes Ray end
                # the process ("The core worker has already been shutdown")
                for t in threading.enumerate():
                    if t.name == "iter_threaded":
                        t.join(10)
            raise RuntimeError(f"{wl.id}/raydata: the dataset ended inside the window")

        return _peer(wl, seconds, body, pss=True)
    finally:
        ray.shutdown()


RUNNERS: dict[str, Callable[[Workload, float], dict[str, Any]]] = {
    "blobfeed": run_blobfeed,
    "caffe2": run_caffe2,
    "copy": run_copy,
    "model": run_model,
    "grain0": lambda wl, s: run_grain(wl, s, 0, False),
    "grain2": lambda wl, s: run_grain(wl, s, 2, False),
    "grain2b": lambda wl, s: run_grain(wl, s, 2, True),
    "torch0": lambda wl, s: run_torch(wl, s, 0, False),
    "torch0it": lambda wl, s: run_torch(wl, s, 0, True),
    "torch2": lambda wl, s: run_torch(wl, s, 2, False),
    "torch2it": lambda wl, s: run_torch(wl, s, 2, True),
    "pool": run_pool,
    "ray": lambda wl, s: run_ray(wl, s, 1),
    "ray1": lambda wl, s: run_ray(wl, s, 1),
    "ray2": lambda wl, s: run_ray(wl, s, 2),
    "ray4": lambda wl, s: run_ray(wl, s, 4),
    "ray2max": lambda wl, s: run_ray(wl, s, 2, R1FastFetch),
    "raydata": run_raydata,
}


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _torch_available() -> bool:
    return installed("torch")


def available_packages() -> frozenset[str]:
    """The optional packages of this machine the bench can use; ``ray.data``
    stands for Ray with its extra ``ray[data]``."""
    have = {p for p in ("torch", "grain", "PIL", "ray") if installed(p)}
    if all(installed(p) for p in RAYDATA_NEEDS):
        have.add("ray.data")
    return frozenset(have)


# --------------------------------------------------------------------------- the report
TARGETS = [
    # (workload, description, numerator runner, denominator runner, metric, threshold);
    # denominator "ideal": the run's own ideal_ratio; "model": W5's interleaved model_ratio
    ("W1", "batches/s vs Caffe2", "blobfeed", "caffe2", "batches_per_s", 2.0),
    ("W2", "GB/s vs the copy bound", "blobfeed", "copy", "gb_per_s", 0.7),
    ("W2", "batches/s vs Caffe2", "blobfeed", "caffe2", "batches_per_s", 4.0),
    ("W3", "batches/s vs Caffe2", "blobfeed", "caffe2", "batches_per_s", 6.0),
    ("W4", "batches/s vs one core's ideal", "blobfeed", "ideal", "batches_per_s", 0.9),
    ("W5", "batches/s vs the model alone (interleaved)", "blobfeed", "model", "batches_per_s", 0.85),
    ("W4p", "batches/s vs the two-core ideal", "blobfeed", "ideal", "batches_per_s", 0.85),
    ("W6p", "batches/s vs the two-core ideal", "blobfeed", "ideal", "batches_per_s", 0.85),
]

PEER_TARGETS = [
    # (workload, description, peers, threshold): blobfeed's batches/s over the best of the peers that ran
    ("W1", "batches/s vs the best in-process peer", IN_PROCESS_PEERS, 1.0),
    ("W2", "batches/s vs the best in-process peer", IN_PROCESS_PEERS, 1.0),
    ("W1p", "batches/s vs the best process peer", PROCESS_PEERS, 1.5),
    ("W2p", "batches/s vs the best process peer", PROCESS_PEERS, 2.0),
    ("W1", "batches/s vs Ray Data", ("raydata",), 1.0),
    ("W2", "batches/s vs Ray Data", ("raydata",), 1.0),
    ("W3", "batches/s vs Ray Data", ("raydata",), 1.0),
]

#: first batch after ``start()``, milliseconds
FIRST_BATCH_TARGETS = [("W1", 50.0), ("W1p", 500.0)]

#: (workload, threshold): blobfeed's batches/s in an ordered mode over its
#: batches/s on the workload's ``base`` (default mode) in the same run;
#: evaluated only when both ran.  W1s and W2s have no target: the table's
#: "vs base" column shows what shuffling costs.
MODE_TARGETS = [("W1d", 0.8), ("W2d", 0.8), ("W4pd", 0.9)]


def base_ratio(results: dict[str, dict[str, Any]], wl: str) -> float | None:
    """blobfeed's batches/s on ``wl`` over its batches/s on ``wl``'s base
    workload (W1d: W1), or None when ``wl`` has no base or either did not run."""
    w = WORKLOADS.get(wl)
    a = results.get(f"{wl}/blobfeed")
    b = results.get(f"{w.base}/blobfeed") if w is not None and w.base else None
    if a is None or b is None or not b["batches_per_s"]:
        return None
    return float(a["batches_per_s"] / b["batches_per_s"])

GRAIN_PEERS = ("grain2", "grain2b")


def _keys_in_all(results: list[dict[str, Any]]) -> list[str]:
    common = set(results[0]).intersection(*results[1:])
    return [k for k in results[0] if k in common]


def _median(results: list[dict[str, Any]]) -> dict[str, Any]:
    return {k: statistics.median(r[k] for r in results) for k in _keys_in_all(results)}


#: Meter's warm-up before each measured window, seconds.
WARMUP_S = Meter.warmup
#: Per-measurement cost beyond warm-up and window: a child's start-up, set-up
#: and drain.  With the constants below it makes ``estimate_seconds`` match
#: runs on this project's 2-core machine: the default run of W1-W5 without
#: torch or grain took about 212 s; the extras of the peers, of process
#: workers and of W6 were timed on single short measurements.
CHILD_OVERHEAD_S = 0.4
#: W5/blobfeed's interleaved slices (see ``_interleaved_model_ratio``).
W5_SLICE_S = 0.25
#: W2/copy faults in 256 MiB of buffers first.
COPY_SETUP_S = 0.6
#: torch's import; its worker processes (``num_workers=2``, forked) on top.
TORCH_EXTRA_S = 1.3
TORCH_WORKERS_S = 0.1
#: grain's import; its worker processes (spawned, importing grain again) on top.
GRAIN_EXTRA_S = 0.2
GRAIN_WORKERS_S = 0.5
#: blobfeed's process workers: the forkserver, the children, the drain.
PROCESSES_EXTRA_S = 0.3
#: ``multiprocessing.Pool(2)``: start and terminate.
POOL_EXTRA_S = 0.15
#: Pillow's import (in the workers too) and W6's first decodes.
W6_EXTRA_S = 0.2
#: The drain of a shuffled source after the clock: the buffer's 10 000
#: samples still leave as batches (W2s: 156 of 9.6 MB, about 0.4 s at its
#: rate; W1s: 312 small ones, 0.05 s).
SHUFFLE_DRAIN_S = {"W1s": 0.1, "W2s": 0.5}
#: A local Ray cluster: the head, then each simulated node (with its actors' start).
RAY_CLUSTER_S = 6.0
RAY_NODE_S = 1.5
#: raydata: ``import ray.data``, a local cluster, Ray Data's first batch
#: (its workers' start) and ``ray.shutdown()``.
RAYDATA_EXTRA_S = 9.0


def _packages(packages: Collection[str] | bool) -> frozenset[str]:
    """A set of installed optional packages; ``True``/``False`` stand for all/none."""
    if packages is True:
        return frozenset({"torch", "grain", "PIL", "ray", "ray.data"})
    if packages is False:
        return frozenset({"PIL"})
    return frozenset(packages)


def _plan(workloads: list[str], packages: Collection[str] | bool) -> list[tuple[str, str]]:
    """The (workload, runner) measurements of one repetition, in order:
    those whose packages are installed."""
    have = _packages(packages)
    return [
        (w, r)
        for w in workloads
        if all(n in have for n in WORKLOADS[w].needs)
        for r in WORKLOADS[w].runners
        if RUNNER_NEEDS.get(r, "numpy") in have | {"numpy"}
    ]


def _skipped_workloads(workloads: list[str], packages: Collection[str] | bool) -> dict[str, str]:
    have = _packages(packages)
    return {
        w: f"{', '.join(n for n in WORKLOADS[w].needs if n not in have)} not installed"
        for w in workloads
        if any(n not in have for n in WORKLOADS[w].needs)
    }


def estimate_seconds(workloads: list[str], seconds: float, repeats: int, packages: Collection[str] | bool) -> float:
    """Approximate wall time of a run: a model of it, not a measurement.
    ``packages``: the optional packages installed (torch, grain, PIL, ray,
    ray.data), or
    True for all of them, False for none but Pillow."""
    one = 0.0
    for w, r in _plan(workloads, packages):
        wl = WORKLOADS[w]
        one += CHILD_OVERHEAD_S + WARMUP_S + seconds
        if (w, r) == ("W5", "blobfeed"):
            one += 2 * W5_SLICE_S * max(4, int(seconds / W5_SLICE_S / 2))
        elif r == "copy":
            one += COPY_SETUP_S
        elif r.startswith("torch"):
            one += TORCH_EXTRA_S + (TORCH_WORKERS_S if r.startswith("torch2") else 0.0)
        elif r.startswith("grain"):
            one += GRAIN_EXTRA_S + (GRAIN_WORKERS_S if r.startswith("grain2") else 0.0)
        elif r == "pool":
            one += POOL_EXTRA_S
        elif r == "raydata":
            one += RAYDATA_EXTRA_S
        elif r.startswith("ray"):
            nodes = {"ray2": 2, "ray2max": 2, "ray4": 4}.get(r, 1)
            one += RAY_CLUSTER_S + RAY_NODE_S * nodes
        elif r == "blobfeed" and wl.backend == "processes":
            one += PROCESSES_EXTRA_S
        if r == "blobfeed":
            one += SHUFFLE_DRAIN_S.get(w, 0.0)
        if "PIL" in wl.needs:
            one += W6_EXTRA_S
    return one * repeats


def _child(wl_id: str, runner: str, seconds: float) -> dict[str, Any]:
    env = dict(os.environ)
    proc = subprocess.run(
        [sys.executable, "-m", "blobfeed.apps.bench", "--child", wl_id, runner, str(seconds)],
        check=False, capture_output=True, text=True, timeout=seconds * 10 + 120, env=env,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{wl_id}/{runner} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize(raw: dict[tuple[str, str], list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Every measurement's repetitions -> ``{"W1/blobfeed": {...}}``.

    Each figure is the median of the repetitions, except
    ``samples_lost_total``: the samples lost summed over all of them, so a
    loss in one repetition cannot hide behind the median.  A workload with
    an ideal gets a ``W4/ideal`` row: blobfeed's yardstick.
    """
    results = {}
    for (w, r), runs in raw.items():
        results[f"{w}/{r}"] = _median(runs)
        results[f"{w}/{r}"]["samples_lost_total"] = int(sum(run["samples_lost"] for run in runs))
    for w in WORKLOADS:
        b = results.get(f"{w}/blobfeed")
        if b and "ideal_batches_per_s" in b:
            results[f"{w}/ideal"] = {"batches_per_s": b["ideal_batches_per_s"]}
        ratio = base_ratio(results, w)
        if b and ratio is not None:
            b["base_ratio"] = ratio
    return results


def run_all(workloads: list[str], seconds: float, repeats: int, progress: Any = sys.stderr) -> dict[str, Any]:
    packages = available_packages()
    plan = _plan(workloads, packages)
    raw: dict[tuple[str, str], list[dict[str, Any]]] = {k: [] for k in plan}
    if any(w for w, _ in plan if "PIL" in WORKLOADS[w].needs):
        ensure_w6_corpus(progress=progress)
    total = len(plan) * repeats
    done = 0
    t0 = time.monotonic()
    for rep in range(repeats):
        for w, r in plan:
            done += 1
            progress.write(f"\r[{done}/{total}] {w:<3} {r:<9} rep {rep + 1}/{repeats}  {time.monotonic() - t0:5.0f} s elapsed ")
            progress.flush()
            raw[(w, r)].append(_child(w, r, seconds))
    progress.write("\n")
    results = summarize(raw)
    return {"seconds": seconds, "repeats": repeats, "torch": "torch" in packages, "grain": "grain" in packages,
            "pillow": "PIL" in packages, "raydata": "ray.data" in packages, "skipped": _skipped_workloads(workloads, packages),
            "results": results, "python": sys.version.split()[0], "cpus": os.cpu_count()}


def _row(wl: str, target: str, ratio: Any, ok: bool | None, detail: str = "") -> dict[str, Any]:
    return {"workload": wl, "target": target, "ratio": ratio, "ok": ok, "detail": detail}


def evaluate(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets of the workloads the report holds, each with ``ok``:
    True (met), False (missed) or None (not evaluated: a peer it needs did
    not run, because its package is not installed)."""
    res = report["results"]
    rows = []
    for wl, what, num, den, metric, threshold in TARGETS:
        a = res.get(f"{wl}/{num}")
        if a is None:
            continue
        target = f"{what} >= {threshold}"
        # ideal: each run against the ideal measured in it; W5: against the
        # model alone in interleaved slices of the same run; then the median
        if den == "ideal":
            if "ideal_ratio" not in a:
                rows.append(_row(wl, target, None, None, "no CPU time recorded"))
                continue
            ratio = a["ideal_ratio"]
        elif den == "model":
            ratio = a["model_ratio"]
        else:
            b = res.get(f"{wl}/{den}")
            if b is None:
                continue
            ratio = a[metric] / b[metric]
        rows.append(_row(wl, target, ratio, ratio >= threshold))
    for wl, what, peers, threshold in PEER_TARGETS:
        a = res.get(f"{wl}/blobfeed")
        if a is None:
            continue
        target = f"{what} >= {threshold}"
        ran = [p for p in peers if f"{wl}/{p}" in res]
        missing = [p for p in peers if p not in ran]
        if not ran:
            rows.append(_row(wl, target, None, None, f"peer missing: {', '.join(missing)}"))
            continue
        best = max(ran, key=lambda p: res[f"{wl}/{p}"]["batches_per_s"])
        ratio = a["batches_per_s"] / res[f"{wl}/{best}"]["batches_per_s"]
        detail = f"best: {best}" + (f"; not run: {', '.join(missing)}" if missing else "")
        rows.append(_row(wl, target, ratio, ratio >= threshold, detail))
    for wl, threshold in MODE_TARGETS:
        if f"{wl}/blobfeed" not in res:
            continue
        base = WORKLOADS[wl].base
        target = f"batches/s vs {base} >= {threshold}"
        ratio = base_ratio(res, wl)
        if ratio is None:
            rows.append(_row(wl, target, None, None, f"{base} not in this run"))
        else:
            rows.append(_row(wl, target, ratio, ratio >= threshold))
    for wl in WORKLOADS:
        a = res.get(f"{wl}/blobfeed")
        if a:
            lost = a.get("samples_lost_total", a["samples_lost"])
            rows.append(_row(wl, "samples lost == 0", lost, lost == 0))
    for wl in ("W2", "W3"):
        a, b = res.get(f"{wl}/blobfeed"), res.get(f"{wl}/caffe2")
        if a and b:
            rows.append(_row(wl, "peak RSS <= Caffe2's", a["peak_rss_mb"] / b["peak_rss_mb"],
                             a["peak_rss_mb"] <= b["peak_rss_mb"]))
    a = res.get("W2p/blobfeed")
    if a:
        target = "total PSS <= grain's"
        grains = [res[f"W2p/{p}"] for p in GRAIN_PEERS if f"W2p/{p}" in res]
        if not grains:
            rows.append(_row("W2p", target, None, None, f"peer missing: {', '.join(GRAIN_PEERS)}"))
        else:
            least = min(g["pss_mb"] for g in grains)
            rows.append(_row("W2p", target, a["pss_mb"] / least, a["pss_mb"] <= least,
                             f"{a['pss_mb']:.0f} MiB against {least:.0f} MiB"))
    rows += _ray_scaling_rows(res)
    w5 = res.get("W5/blobfeed")
    if w5:
        rows.append(_row("W5", "model waits for input < 10 %", w5["wait_share"], w5["wait_share"] < 0.10))
    for wl, limit_ms in FIRST_BATCH_TARGETS:
        a = res.get(f"{wl}/blobfeed")
        if a:
            rows.append(_row(wl, f"first batch <= {limit_ms:g} ms", a["first_batch_ms"], a["first_batch_ms"] <= limit_ms))
    for wl, why in report.get("skipped", {}).items():
        rows.append(_row(wl, "every target", None, None, f"workload skipped: {why}"))
    return rows


#: R1: throughput on k nodes over k x the one-node throughput, up to the
#: driver's ingest limit (R1/ray2max)
RAY_SCALING_TARGET = 0.8


def _ray_scaling_rows(res: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    one = res.get("R1/ray1")
    limit = res.get("R1/ray2max")
    for k in (2, 4):
        a = res.get(f"R1/ray{k}")
        if a is None or one is None or not one["batches_per_s"]:
            continue
        target = f"scaling efficiency on {k} nodes >= {RAY_SCALING_TARGET}"
        want = k * one["batches_per_s"]
        eff = a["batches_per_s"] / want
        if limit is not None and want > 0.9 * limit["batches_per_s"]:
            rows.append(_row("R1", target, eff, None,
                             f"{want:.0f} batches/s is past the driver's ingest limit ({limit['batches_per_s']:.0f})"))
        else:
            rows.append(_row("R1", target, eff, eff >= RAY_SCALING_TARGET))
    return rows


def _measured(value: Any) -> str:
    if value is None:
        return "-"
    return str(value) if isinstance(value, int) else f"{value:.2f}"


def _result_text(row: dict[str, Any]) -> str:
    if row["ok"] is None:
        return "not evaluated (peer missing)" if row.get("detail", "").startswith("peer missing") else "not evaluated"
    return "ok" if row["ok"] else "MISSED"


def verdict(rows: list[dict[str, Any]]) -> tuple[int, list[str]]:
    """The exit status for the ``rows``, and the lines that say why.

    0 when every evaluated row is met; 1 when any is missed, or when no row
    was evaluated at all (nothing was checked: not a pass).  Rows not
    evaluated (a peer missing) neither pass nor fail; they are listed.
    """
    evaluated = [row for row in rows if row["ok"] is not None]
    not_evaluated = [
        f"  not evaluated: {row['workload']} {row['target']} ({row.get('detail') or 'no data'})"
        for row in rows if row["ok"] is None
    ]
    if not evaluated:
        return 1, ["verdict: no target could be evaluated"] + not_evaluated
    missed = [row for row in evaluated if not row["ok"]]
    if not missed:
        return 0, [f"verdict: all {len(evaluated)} targets met"] + not_evaluated
    return 1, [f"verdict: MISSED {len(missed)} of {len(evaluated)} targets:"] + [
        f"  {row['workload']} {row['target']}: measured {_measured(row['ratio'])}"
        + (f" ({row['detail']})" if row.get("detail") else "")
        for row in missed
    ] + not_evaluated


def _installed_text(report: dict[str, Any]) -> str:
    names = (("torch", "torch"), ("grain", "grain"), ("pillow", "Pillow"), ("raydata", "Ray Data"))
    return ", ".join(f"{shown} {'yes' if report.get(key) else 'not installed (skipped)'}" for key, shown in names)


def format_report(report: dict[str, Any]) -> str:
    lines = [
        (f"blobfeed bench: {report['seconds']:g} s per measurement, median of {report['repeats']}, "
         f"python {report['python']}, {report['cpus']} cpus, {_installed_text(report)}"),
        "",
        (f"{'workload/runner':<16}{'batches/s':>11}{'GB/s':>7}{'peak RSS MB':>12}{'PSS MB':>8}{'first ms':>9}"
         f"{'lost':>10}{'vs ideal':>9}{'vs base':>13}"),
    ]
    results = report["results"]
    for key, r in results.items():
        if key.endswith("/ideal"):
            lines.append(f"{key:<16}{r['batches_per_s']:>11.1f}")
            continue
        pss = f"{r['pss_mb']:.0f}" if "pss_mb" in r else ""
        ideal = f"{r['ideal_ratio']:.2f}" if "ideal_ratio" in r else ""
        wl, runner = key.split("/", 1)
        ratio = base_ratio(results, wl) if runner == "blobfeed" else None
        vs_base = f"{ratio:.2f} x {WORKLOADS[wl].base}" if ratio is not None else ""
        lines.append(
            f"{key:<16}{r['batches_per_s']:>11.1f}{r['gb_per_s']:>7.2f}{r['peak_rss_mb']:>12.0f}{pss:>8}"
            f"{r['first_batch_ms']:>9.1f}{int(r['samples_lost']):>10d}{ideal:>9}{vs_base:>13}".rstrip()
        )
    for wl, why in report.get("skipped", {}).items():
        lines.append(f"{wl + '/*':<16} skipped: {why}")
    lines += ["", f"{'target':<56}{'measured':>10}  result"]
    for row in evaluate(report):
        text = f"{row['workload'] + ' ' + row['target']:<56}{_measured(row['ratio']):>10}  {_result_text(row)}"
        detail = row.get("detail", "")
        if row["ok"] is None and detail.startswith("peer missing: "):
            detail = detail[len("peer missing: "):]
        if detail and row["ok"] is not False:  # a missed row ends with MISSED; the verdict gives its detail
            text += f"  [{detail}]"
        lines.append(text)
    return "\n".join(lines)


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


DEFAULT_WORKLOADS = "W1,W2,W3,W4,W5"
ALL_WORKLOADS = ",".join(WORKLOADS)
DEFAULT_SECONDS = 5.0
DEFAULT_REPEATS = 3


def parse_workloads(text: str) -> list[str]:
    """``W1,W2p`` (any case) or ``all`` -> workload ids.

    Raises:
        ValueError: naming the unknown ones.
    """
    by_upper = {w.upper(): w for w in WORKLOADS}
    out: list[str] = []
    unknown = []
    for token in (t.strip() for t in text.split(",")):
        if not token:
            continue
        if token.lower() == "all":
            out += [w for w in WORKLOADS if w not in out]
        elif token.upper() in by_upper:
            if by_upper[token.upper()] not in out:
                out.append(by_upper[token.upper()])
        else:
            unknown.append(token)
    if unknown:
        raise ValueError(f"unknown workloads {unknown}; choose from {', '.join(WORKLOADS)} or all")
    return out


def _run_length(workloads: list[str], packages: Collection[str]) -> str:
    n = len(_plan(workloads, packages))
    est = estimate_seconds(workloads, DEFAULT_SECONDS, DEFAULT_REPEATS, packages)
    return f"{n * DEFAULT_REPEATS} measurements ({n} per repeat x {DEFAULT_REPEATS} repeats) and takes about {est:.0f} s ({est / 60:.1f} min)"


def build_parser() -> argparse.ArgumentParser:
    """The ``blobfeed bench`` command line; its epilog estimates the default run's length."""
    packages = available_packages()
    wls = DEFAULT_WORKLOADS.split(",")
    everything = list(WORKLOADS)
    missing = [p for p in ("torch", "grain") if p not in packages]
    if not missing:
        peer_note = "torch and grain are installed, so their rows are included"
    else:
        full = _packages(True)
        peer_note = (
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed, so "
            f"{'its' if len(missing) == 1 else 'their'} rows are skipped (with both: the default run "
            f"{_run_length(wls, full)}; --workloads all {_run_length(everything, full)})"
        )
    epilog = (
        f"The default invocation runs {_run_length(wls, packages)} on a 2-core machine; "
        f"--workloads all runs {_run_length(everything, packages)}; {peer_note}. The first run that "
        f"includes W6 or W6p also generates W6's JPEG corpus into {w6_corpus_dir()} (a few seconds). "
        f"Each measurement is a child process: start-up, a {WARMUP_S:g} s warm-up, then the measured "
        f"window. Exit status: 0 when every evaluated target is met; 1 when any target is missed, "
        f"including blobfeed losing a sample in any repetition (the missed targets are listed), or when "
        f"no target could be evaluated; 2 for a usage error or a measurement that crashed. A target "
        f"whose peer is not installed is reported as not evaluated, neither met nor missed."
    )
    p = argparse.ArgumentParser(
        prog="blobfeed bench",
        description="Run workloads W1-W6 and W1p-W6p (docs/BENCHMARKS.md) against blobfeed, its "
        "baselines and its peers, and blobfeed's ordered modes (W1d, W2d, W4pd: deterministic=True; "
        "W1s, W2s: with shuffle_buffer=10000) against its default mode; print one table and the "
        "targets, and exit with the verdict.",
        epilog=epilog,
    )
    p.add_argument(
        "--workloads", default=DEFAULT_WORKLOADS,
        help=f"comma-separated subset of {', '.join(WORKLOADS)}, or all (default: {DEFAULT_WORKLOADS})",
    )
    p.add_argument(
        "--seconds", type=_positive_float, default=DEFAULT_SECONDS,
        help=f"measured seconds per measurement, after a {WARMUP_S:g} s warm-up (default: {DEFAULT_SECONDS:g} s)",
    )
    p.add_argument(
        "--repeats", type=_positive_int, default=DEFAULT_REPEATS,
        help=f"repetitions of every measurement; the median is reported (default: {DEFAULT_REPEATS})",
    )
    p.add_argument("--json", metavar="PATH", help="also write the raw results and the verdict here (default: none)")
    p.add_argument("--child", nargs=3, metavar=("WORKLOAD", "RUNNER", "SECONDS"), help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run ``blobfeed bench``; returns the exit status (see the module docstring)."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.child:
        wl_id, runner, secs = args.child
        print(json.dumps(RUNNERS[runner](WORKLOADS[wl_id], float(secs))))
        return 0
    try:
        wls = parse_workloads(args.workloads)
    except ValueError as exc:
        p.error(str(exc))
    if not wls:
        p.error("no workload given")
    packages = available_packages()
    n = len(_plan(wls, packages)) * args.repeats
    est = estimate_seconds(wls, args.seconds, args.repeats, packages)
    print(f"blobfeed bench: {n} measurements, about {est:.0f} s", file=sys.stderr, flush=True)
    try:
        report = run_all(wls, args.seconds, args.repeats)
    except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError) as exc:  # a child crashed or hung
        print(f"blobfeed bench: a measurement failed, no verdict: {exc}", file=sys.stderr)
        return 2
    rows = evaluate(report)
    status, why = verdict(rows)
    print(format_report(report))
    print()
    print("\n".join(why))
    if args.json:
        report["targets"] = rows
        report["passed"] = status == 0
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return status


if __name__ == "__main__":
    # Run the module as blobfeed.apps.bench, not as __main__: worker processes
    # (blobfeed's, grain's) then find the fetch functions by reference.
    from blobfeed.apps.bench import main as _main

    sys.exit(_main())
