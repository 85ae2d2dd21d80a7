"""The workloads (docs/BENCHMARKS.md): what each fetcher returns, the
workload table (W1-W6, their process and ordered variants, R1, R2) and the
model W5 runs."""

from __future__ import annotations

import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .measure import Tally


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


class IndexedArrays:
    """W1i, W2i: a workload's in-memory arrays as a map-style dataset
    (``__len__``, ``__getitem__``, a batched ``__getitems__``), the form
    torch's ``Dataset`` and grain's ``RandomAccessDataSource`` take.

    Sample ``i`` is ``(rows[i % len(rows)], labels[i])``: a view of one row
    of the fetcher's own arrays (no copy: blobfeed's stacking is the one
    copy, as the re-batching is W1's and W2's) and, as its label, ``i``
    itself in the label dtype of the workload, so that the delivered stream
    can be checked against the source's order (the last blob is the index).
    Module-level and lazily built, so that it pickles by reference.

    ``stacked``: ``__getitems__`` returns the unit already stacked, a dict
    blob name -> array (one fancy index per blob: ``rows[indices % len(rows)]``,
    ``labels[indices]``), the form an array-backed dataset can take; else a
    list of samples, one tuple per index (torch's form), which blobfeed
    checks and stacks.
    """

    def __init__(self, kind: str, length: int, stacked: bool = False) -> None:
        self.kind = kind
        self.length = length
        self.stacked = stacked
        self._arrays: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_arrays": None}

    def _build(self) -> Any:
        if self.kind == "W1":  # W1's 8 pools of 64 rows, one after the other; float64 labels
            pools = W1Fetch().build()[1]
            rows = np.concatenate([pools[w][0] for w in range(8)])
            labels: np.ndarray = np.arange(self.length, dtype=np.float64)
        else:  # W2's 16 images; int64 labels
            rows = W2Fetch().build()[1]
            labels = np.arange(self.length, dtype=np.int64)
        self._arrays = (rows, labels)
        return self._arrays

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple:
        rows, labels = self._arrays or self._build()
        return rows[i % len(rows)], labels[i]

    def __getitems__(self, indices: list[int]) -> list[tuple] | dict[str, np.ndarray]:
        rows, labels = self._arrays or self._build()
        p = len(rows)
        if self.stacked:
            ix = np.asarray(indices, dtype=np.int64)
            return {"data": rows[ix % p], "label": labels[ix]}
        return [(rows[i % p], labels[i]) for i in indices]


#: W1i, W2i: samples per epoch (a multiple of the batch: no short batch at an epoch's end)
W1I_LENGTH = 4096
W2I_LENGTH = 1024


def w1_dataset() -> IndexedArrays:
    return IndexedArrays("W1", W1I_LENGTH, stacked=True)


def w2_dataset() -> IndexedArrays:
    return IndexedArrays("W2", W2I_LENGTH)


# W7's record file: generated once, from a fixed seed, into a cache folder
W7_BYTES = 2_000_000_000
W7_RECORD_MIN = 4 * 1024
W7_RECORD_MAX = 64 * 1024
#: W7's batch: its record count is a multiple of it (no short batch at an epoch's end)
W7_BATCH = 64
W7_SEED = 7
W7_VERSION = "w7-v1"
W7_DATA = "records.bin"
#: madvise(2)'s MADV_POPULATE_READ (Linux >= 5.14; not in Python 3.11's mmap module)
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
W7_INDEX = "index.npy"


def w7_records_dir() -> Path:
    """``$XDG_CACHE_HOME/blobfeed-bench/w7-v1`` (default ``~/.cache/...``)."""
    return w6_corpus_dir().parent / W7_VERSION


def w7_offsets(size: int) -> np.ndarray:
    """The records' offsets for a file of at most ``size`` bytes: record
    sizes drawn uniformly in [4 KiB, 64 KiB] from seed 7, as many as fit,
    their count cut to a multiple of :data:`W7_BATCH`; ``n + 1`` int64
    offsets, the last one the file's size."""
    mean = (W7_RECORD_MIN + W7_RECORD_MAX) / 2
    draws = int(size / mean * 1.2) + 4 * W7_BATCH
    sizes = np.random.default_rng(W7_SEED).integers(W7_RECORD_MIN, W7_RECORD_MAX + 1, size=draws)
    ends = np.cumsum(sizes, dtype=np.int64)
    n = int(np.searchsorted(ends, size, side="right")) // W7_BATCH * W7_BATCH
    if n == 0:
        raise ValueError(f"W7: {size} bytes hold no {W7_BATCH} records of {W7_RECORD_MIN}-{W7_RECORD_MAX} bytes")
    return np.concatenate([[0], ends[:n]]).astype(np.int64)


def w7_records_ok(folder: Path | str, size: int = W7_BYTES) -> bool:
    """Whether ``folder`` holds W7's file for ``size``: the index is the
    expected one and the data file has exactly its last offset's bytes."""
    data, index = os.path.join(folder, W7_DATA), os.path.join(folder, W7_INDEX)
    try:
        offsets = np.load(index, allow_pickle=False)
        have = os.path.getsize(data)
    except (OSError, ValueError):
        return False
    want = w7_offsets(size)
    return offsets.shape == want.shape and bool(np.array_equal(offsets, want)) and have == int(want[-1])


def ensure_w7_records(folder: Path | str | None = None, size: int = W7_BYTES, progress: Any = None) -> Path:
    """W7's record file (``records.bin``, random bytes from seed 7) and its
    index of offsets (``index.npy``), made once and reused while they pass
    the size check (:func:`w7_records_ok`); a folder that fails it is
    written again.  Written beside the cache folder and renamed into place,
    so a crash or a concurrent run never leaves half a file behind."""
    folder = w7_records_dir() if folder is None else Path(folder)
    if w7_records_ok(folder, size):
        return folder
    offsets = w7_offsets(size)
    if progress is not None:
        progress.write(f"blobfeed bench: generating W7's record file ({int(offsets[-1]) / 1e9:.2f} GB, "
                       f"{len(offsets) - 1} records) in {folder}\n")
        progress.flush()
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        rng = np.random.default_rng(W7_SEED + 1)
        left = int(offsets[-1])
        with open(tmp / W7_DATA, "wb") as f:
            while left:
                block = min(left, 64 << 20)
                f.write(rng.bytes(block))
                left -= block
            # on disk before the first measurement: in the minutes after the file
            # was written (its pages still being written back, we think), W7's
            # shuffled read measured about 10 x slower than later
            f.flush()
            os.fsync(f.fileno())
        np.save(tmp / W7_INDEX, offsets, allow_pickle=False)
        if folder.exists():  # a broken or older file: ours, written again
            for name in (W7_DATA, W7_INDEX):
                (folder / name).unlink(missing_ok=True)
            folder.rmdir()
        try:
            os.rename(tmp, folder)
        except OSError:  # another run got there first
            if not w7_records_ok(folder, size):
                raise
    finally:
        if tmp.exists():
            for p in tmp.iterdir():
                p.unlink()
            tmp.rmdir()
    return folder


class W7Records:
    """W7's map-style dataset: record ``i`` of the memory-mapped file.

    A sample is ``(data, size, index)``: ``data`` a uint8 array of 64 KiB
    (the largest record) with the record's bytes copied in and zeros after
    them, ``size`` the record's length (int64: what of ``data`` is the
    record), ``index`` the record's number (int64; the last blob, so the
    delivered stream can be checked against the source's order).  Every
    byte of the record is read.  The file is mapped lazily, in the process
    that reads (a worker process maps its own), and its page tables are
    built at once (``MADV_POPULATE_READ``, Linux >= 5.14; skipped where
    refused): a first pass that faults the pages in one at a time costs a
    shuffled read one fault per record or so against one per 64 KiB in
    order (the kernel maps 16 neighbouring pages per fault), the gap W7
    measured in the first epoch; mapped up front, both pay the same once.
    """

    def __init__(self, folder: Path | str) -> None:
        self.folder = str(folder)
        self._map: Any = None
        self._offsets = np.load(os.path.join(self.folder, W7_INDEX), allow_pickle=False)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_map": None}

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def _file(self) -> np.ndarray:
        if self._map is None:
            with open(os.path.join(self.folder, W7_DATA), "rb") as f:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            try:
                mapped.madvise(MADV_POPULATE_READ)
            except (OSError, ValueError):  # an older kernel, another system: faulted in as read
                pass
            # a plain array over the map (not np.memmap: slicing it is cheaper per record)
            self._map = np.frombuffer(mapped, dtype=np.uint8)
        return self._map

    def _fill(self, out: np.ndarray, i: int) -> int:
        lo, hi = int(self._offsets[i]), int(self._offsets[i + 1])
        n = hi - lo
        out[:n] = self._file()[lo:hi]
        out[n:] = 0
        return n

    def __getitem__(self, i: int) -> tuple:
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f"W7 has {len(self)} records; asked for {i}")
        out = np.empty(W7_RECORD_MAX, np.uint8)
        n = self._fill(out, i)
        return out, np.int64(n), np.int64(i)

    def __getitems__(self, indices: list[int]) -> list[tuple]:
        out = np.empty((len(indices), W7_RECORD_MAX), np.uint8)  # one allocation for the read
        return [(out[k], np.int64(self._fill(out[k], int(i))), np.int64(i)) for k, i in enumerate(indices)]


class DatasetOnly(Fetcher):
    """W7's ``fetcher``: it has none (it is read as a map-style dataset only)."""

    def chunk(self, worker_id: int) -> list:
        raise TypeError("W7 has no fetch_fun: it is read as a random-access source (Workload.dataset)")


def w7_dataset() -> W7Records:
    return W7Records(ensure_w7_records())


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
    #: S1, S2, S8, attach: consumer processes fed by one feeding service whose
    #: workers use ``backend``; ``pipes_backend``: the backend of the
    #: independent pipelines (one per consumer) it is set against
    consumers: int = 0
    pipes_backend: str = ""
    #: S1, S2, S8: why the service's workers use ``backend`` (the legend says it)
    backend_why: str = ""
    #: W1i, W2i, W7: a random-access source (``blobfeed.RandomAccessSource``)
    #: over the map-style dataset this makes, instead of ``fetcher``; the
    #: last blob is each sample's index
    dataset: Callable[[], Any] | None = None
    #: its ``shuffle`` (a global shuffle of each epoch)
    shuffle: bool = False
    #: environment every runner's child process of this workload gets
    #: (unless the caller's environment sets the variable already)
    child_env: tuple[tuple[str, str], ...] = ()

    def ideal(self, tally: Tally, batches_per_s: float) -> dict[str, Any]:
        """The ideal from the CPU times the workers recorded in this very
        run: ``ideal_cores / (batch x the median CPU time of one sample)``;
        nothing when the workload has no ideal or no time was recorded."""
        if not self.ideal_cores:
            return {}
        per_sample = tally.cpu_median()
        if not per_sample:
            return {}
        best = self.ideal_cores / (self.batch * per_sample)
        return {"ideal_batches_per_s": best, "ideal_ratio": batches_per_s / best,
                "cpu_per_sample_ms": per_sample * 1e3}


#: W7: glibc keeps the memory a process frees (no block over 64 MiB is
#: mapped on its own, the heap is never trimmed below 1 GiB of free space).
#: A loader that allocates a fresh 4 MiB batch and frees it (torch's collate,
#: W7's dataset) otherwise runs at one of two speeds from run to run, as
#: glibc's moving thresholds hand the block back to the kernel (its pages
#: faulted in and zeroed again each batch: 700 faults a batch) or keep it
#: (12); with this every runner reads at its best speed (BENCHMARKS.md, W7).
KEEP_FREED_MEMORY = (("MALLOC_MMAP_THRESHOLD_", str(64 << 20)), ("MALLOC_TRIM_THRESHOLD_", str(1 << 30)))
IN_PROCESS_PEERS = ("grain0", "torch0", "torch0it")
#: W1s and W2s: samples in the shuffle buffer
SHUFFLE_BUFFER = 10_000
#: the seed of the ordered workloads (W1d, W2d, W4pd, W1s, W2s): the same
#: batches, in the same order, on every run
ORDERED_SEED = 0
PROCESS_PEERS = ("grain2", "grain2b", "torch2", "torch2it", "pool")
#: S1, S2: the consumer processes (trainer ranks) of the service; S8: S1's, with more
SERVICE_CONSUMERS = 4
SERVICE_CONSUMERS_MANY = 8
#: The backend of the service's workers is the one a user would pick for
#: the fetcher, as the independent pipelines' is.  S1 (and S8, attach):
#: W2's fetcher stands for an image loader (reading files, decoding,
#: augmenting in Python), which users run in worker processes (as torch's
#: DataLoader workers); the pipelines it is set against are process
#: pipelines too.  On W2's stand-in itself (slices of 16 images in memory)
#: threads would copy less; that is not what the workload stands for.
S1_BACKEND_WHY = ("processes: W2's fetcher stands for loading images (files, decoding, Python augmentation), "
                  "which a user runs in worker processes")
#: S2: W1's fetcher slices an array in memory: nothing to gain from
#: processes, a pipe and a copy to lose; a user picks threads (the default).
S2_BACKEND_WHY = "threads: W1's fetcher is trivial (slices of an array in memory), so a user keeps the default"

#: W7's peers: torch's map-style DataLoader (shuffle=True) and grain's
#: DataLoader (IndexSampler with shuffle), each at 0, 1, 2 and 4 worker
#: processes: its target is set against the best of them
W7_PEER_WORKERS = (0, 1, 2, 4)
W7_PEERS = (*(f"torchmap{k}" for k in W7_PEER_WORKERS), *(f"grainmap{k}" for k in W7_PEER_WORKERS))

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
    # the feeding service (blobfeed.service): consumer processes of one service
    "S1": Workload("S1", 64, ("data", "label"), W2Fetch,
                   ("service", "pipes", "direct", "ledger", "copy", "copy2", "raysplit"),
                   "W2 from one service to 4 consumer processes", backend="processes", consumers=SERVICE_CONSUMERS,
                   pipes_backend="processes", backend_why=S1_BACKEND_WHY),
    "S2": Workload("S2", 32, ("data", "label"), W1Fetch, ("service", "pipes", "bare", "raysplit"),
                   "W1 from one service to 4 consumer processes", backend="threads", consumers=SERVICE_CONSUMERS,
                   pipes_backend="threads", backend_why=S2_BACKEND_WHY),
    "S8": Workload("S8", 64, ("data", "label"), W2Fetch, ("service",),
                   "S1 with 8 consumer processes: one service past 4 consumers", backend="processes",
                   consumers=SERVICE_CONSUMERS_MANY, backend_why=S1_BACKEND_WHY),
    "attach": Workload("attach", 64, ("data", "label"), W2Fetch, ("service",),
                       "first batch after attach_source on a running service", backend="processes", consumers=1,
                       backend_why=S1_BACKEND_WHY),
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
    # random-access sources: the same data behind a map-style dataset, against the fetch_fun form
    "W1i": Workload("W1i", 32, ("data", "label"), W1Fetch, ("blobfeed",), "W1's arrays as a random-access source",
                    base="W1", dataset=w1_dataset),
    "W2i": Workload("W2i", 64, ("data", "label"), W2Fetch, ("blobfeed",), "W2's arrays as a random-access source",
                    base="W2", dataset=w2_dataset),
    # a global shuffle over a 2 GB memory-mapped record file (written once into the cache folder)
    "W7": Workload("W7", W7_BATCH, ("data", "size", "index"), DatasetOnly, ("blobfeed", "sequential", "work2", "hand2", *W7_PEERS),
                   "a global shuffle over a 2 GB record file", backend="processes", dataset=w7_dataset,
                   shuffle=True, child_env=KEEP_FREED_MEMORY),
}


def mlp_bytes() -> bytes:
    """W5's model: an MLP 784-256-10 as ONNX bytes."""
    from ..models import mlp_onnx

    return mlp_onnx([784, 256, 10], seed=0)[0]


def session_options() -> Any:
    """The options of every ONNX session the bench runs (the fed net's and
    the model alone's alike): one intra-op and one inter-op thread."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    return so
