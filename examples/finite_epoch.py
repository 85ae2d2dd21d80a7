"""One epoch over a finite dataset: a last partial batch, then ``EndOfInput``.

Each fetcher reads its own half of the dataset in chunks of 50 samples and
raises ``StopIteration`` when its half is done.  When every fetcher of the
source has finished, the samples the re-batcher still holds form one last,
smaller batch; after it, ``net.run()`` raises ``EndOfInput`` (at once, every
time it is called again).  With ``drop_last=True`` that partial batch is
dropped instead, and counted in ``blobfeed_dropped_samples_total``.

The example checks both: 1000 samples in batches of 64 are 15 full batches
and one of 40, or 15 batches and 40 dropped samples; every sample once.

Run:  python examples/finite_epoch.py
"""

from __future__ import annotations

import numpy as np

import blobfeed

N_SAMPLES = 1_000
BATCH = 64
CHUNK = 50
N_WORKERS = 2


def run_epoch(drop_last: bool) -> tuple[list[int], np.ndarray, float, bool]:
    """Feeds one epoch to a net; returns (batch sizes, ids seen, samples dropped, run() ended cleanly)."""
    labels = np.arange(N_SAMPLES, dtype=np.int64)
    images = np.repeat(labels.astype(np.float32)[:, None], 8, axis=1)  # row i is all i's
    share = N_SAMPLES // N_WORKERS
    position: dict[int, int] = {}

    def fetch_fun(worker_id: int, batch_size: int) -> list[np.ndarray]:
        # Each worker id belongs to one thread, so this per-worker state needs no lock.
        shard = worker_id % N_WORKERS
        start = position.setdefault(worker_id, shard * share)
        end = min(start + CHUNK, (shard + 1) * share)
        if start >= end:
            raise StopIteration  # this worker's part of the epoch is done
        position[worker_id] = end
        return [images[start:end], labels[start:end]]

    coordinator = blobfeed.GlobalCoordinator()
    net = blobfeed.Net(name="trainer")  # no model: run() returns the dequeued blobs
    blobfeed.init_data_input_workers(
        net, ["image", "label"], fetch_fun, batch_size=BATCH, num_worker_threads=N_WORKERS,
        drop_last=drop_last, timeout=10.0, coordinator=coordinator,
    )
    sizes: list[int] = []
    seen: list[np.ndarray] = []
    ended = False
    try:
        coordinator.start()
        while True:
            try:
                batch = net.run()
            except blobfeed.EndOfInput:
                break
            sizes.append(len(batch["label"]))
            if not np.array_equal(batch["image"][:, 0], batch["label"]):
                raise SystemExit("FAILED: blobs of one batch are not aligned")
            seen.append(np.array(batch["label"], copy=True))
        # The source has ended for good: run() keeps saying so, without waiting.
        try:
            net.run(timeout=1.0)
        except blobfeed.EndOfInput:
            ended = True
        except blobfeed.DequeueTimeout:
            ended = False
        dropped = sum(
            coordinator.registry.get_sample_value(
                "blobfeed_dropped_samples_total", {"source": "train", "reason": reason}
            ) or 0.0
            for reason in ("drop_last", "stopped", "error")
        )
    finally:
        ok = coordinator.stop()
    ids = np.sort(np.concatenate(seen)) if seen else np.empty(0, np.int64)
    return sizes, ids, dropped, ended and ok


def main() -> None:
    failures = []
    full, rest = divmod(N_SAMPLES, BATCH)

    sizes, ids, dropped, ended = run_epoch(drop_last=False)
    print(f"drop_last=False: {len(sizes)} batches, sizes {sizes[0]} ... {sizes[-1]}, then EndOfInput")
    if sizes != [BATCH] * full + [rest]:
        failures.append(f"expected {full} batches of {BATCH} and one of {rest}, got {sizes}")
    if not np.array_equal(ids, np.arange(N_SAMPLES)):
        failures.append(f"expected each of {N_SAMPLES} samples once, got {len(ids)} ({len(np.unique(ids))} distinct)")
    if dropped or not ended:
        failures.append(f"dropped {dropped:g} samples / run() after the end did not raise EndOfInput at once")

    sizes, ids, dropped, ended = run_epoch(drop_last=True)
    print(f"drop_last=True:  {len(sizes)} batches of {BATCH}, {dropped:g} samples dropped, then EndOfInput")
    if sizes != [BATCH] * full or dropped != rest or len(np.unique(ids)) != full * BATCH or not ended:
        failures.append(f"drop_last=True: sizes {sizes}, {dropped:g} dropped, ended cleanly: {ended}")

    if failures:
        print("FAILED: " + "; ".join(failures))
        raise SystemExit(1)
    print(f"{N_SAMPLES} samples: {full} full batches + a last batch of {rest} (or {rest} dropped); clean stop")


if __name__ == "__main__":
    main()
