"""Fetchers reading ``.npy`` shards from a folder: real file I/O.

The example first writes a small data set as shards into a temporary folder
(``shard-000.data.npy`` + ``shard-000.sample_id.npy``, ...; shards of
different sizes, as real ones are).  Three fetcher threads then share the list
of shards: each takes the next unread shard, opens it with
``np.load(..., mmap_mode="r")`` (only the pages a chunk touches are read from
disk) and returns it in chunks of up to ``batch_size`` samples; when no shard
is left it raises ``StopIteration``.  blobfeed re-batches the chunks and a
small MLP scores every batch.

The example checks that every sample of every shard was scored exactly once
and that the scores match numpy on the data as written.

Run:  python examples/file_shards.py
"""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path

import numpy as np

import blobfeed
from blobfeed.apps.models import mlp_onnx, mlp_reference

FEATURES = 24
BATCH = 100
N_SHARDS = 12


def write_shards(folder: Path, rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """Writes the shards; returns (all features by sample id, sample count)."""
    sizes = rng.integers(150, 700, size=N_SHARDS)
    features = rng.standard_normal((int(sizes.sum()), FEATURES)).astype(np.float32)
    start = 0
    for i, n in enumerate(sizes):
        stop = start + int(n)
        np.save(folder / f"shard-{i:03d}.data.npy", features[start:stop])
        np.save(folder / f"shard-{i:03d}.sample_id.npy", np.arange(start, stop, dtype=np.int64))
        start = stop
    return features, start


class ShardReader:
    """``fetch_fun`` over the shards of a folder, shared by every fetcher thread.

    Thread-safe: the list of unread shards is taken under a lock; each worker
    then reads its own open shard alone.
    """

    def __init__(self, folder: Path) -> None:
        self._unread = sorted(folder.glob("shard-*.data.npy"))
        self._lock = threading.Lock()
        self._open: dict[int, tuple[np.ndarray, np.ndarray, int]] = {}  # worker -> (data, ids, pos)
        self.shards_read = 0

    def _next_shard(self) -> tuple[np.ndarray, np.ndarray] | None:
        with self._lock:
            if not self._unread:
                return None
            path = self._unread.pop(0)
            self.shards_read += 1
        ids_path = path.with_name(path.name.replace(".data.npy", ".sample_id.npy"))
        return np.load(path, mmap_mode="r"), np.load(ids_path, mmap_mode="r")

    def __call__(self, worker_id: int, batch_size: int) -> list[np.ndarray]:
        current = self._open.get(worker_id)
        if current is None or current[2] >= len(current[0]):
            shard = self._next_shard()
            if shard is None:
                self._open.pop(worker_id, None)  # drop the memory maps
                raise StopIteration
            current = (shard[0], shard[1], 0)
        data, ids, pos = current
        self._open[worker_id] = (data, ids, pos + batch_size)
        # Slices of the memory map: plain ndarray views, read from disk on use.
        return [np.asarray(data[pos : pos + batch_size]), np.asarray(ids[pos : pos + batch_size])]

    def close(self) -> None:
        self._open.clear()


def main() -> None:
    model, weights = mlp_onnx([FEATURES, 48, 3], seed=2)
    # ignore_cleanup_errors: Windows cannot delete a file that is still memory
    # mapped (the net's workspace keeps the last batch, which may be a view).
    with tempfile.TemporaryDirectory(prefix="blobfeed-shards-", ignore_cleanup_errors=True) as tmp:
        folder = Path(tmp)
        features, n_samples = write_shards(folder, np.random.default_rng(2))
        on_disk = sum(p.stat().st_size for p in folder.iterdir())

        reader = ShardReader(folder)
        coordinator = blobfeed.GlobalCoordinator()
        net = blobfeed.Net(model, name="scorer")
        blobfeed.init_data_input_workers(
            net, ["data", "sample_id"], reader, batch_size=BATCH, num_worker_threads=3,
            input_source_name="shards", timeout=10.0, coordinator=coordinator,
        )
        scores = np.full((n_samples, 3), np.nan, np.float32)
        times_seen = np.zeros(n_samples, np.int64)
        batches = 0
        try:
            coordinator.start()
            while True:
                try:
                    out = net.run()
                except blobfeed.EndOfInput:
                    break
                batch_ids = net.workspace.fetch_blob("sample_id")
                scores[batch_ids] = out["logits"]
                np.add.at(times_seen, batch_ids, 1)
                batches += 1
        finally:
            ok = coordinator.stop()
            reader.close()

    failures = []
    if reader.shards_read != N_SHARDS:
        failures.append(f"read {reader.shards_read} of {N_SHARDS} shards")
    if not (times_seen == 1).all():
        failures.append(
            f"{int((times_seen == 0).sum())} samples never scored, {int((times_seen > 1).sum())} scored twice"
        )
    elif not np.allclose(scores, mlp_reference(features, weights), atol=1e-4):
        failures.append("scores differ from numpy on the data as written")
    if not ok:
        failures.append("stop() left threads running")

    print(f"{N_SHARDS} shards, {n_samples} samples, {on_disk / 1e6:.1f} MB on disk -> {batches} batches of <= {BATCH}")
    if failures:
        print("FAILED: " + "; ".join(failures))
        raise SystemExit(1)
    print("every sample of every shard scored exactly once; scores match numpy; clean stop")


if __name__ == "__main__":
    main()
