"""Data parallel: two nets fed from one input source.

Caffe2's data-parallel pattern: one ``init_data_input_workers`` call per net,
all with the same ``input_source_name``.  The calls share one source, so the
fetchers fill it once and each sample reaches exactly one net.  Each net is
driven by its own consumer thread (``Net.run`` is for one thread per net), as
each replica of a model would be on its own device.

Which net gets what depends on the mode:

* arrival order (the default, Caffe2's): first come, first served.  The next
  chunk goes to whichever net asks first, so a net whose thread runs more
  often gets more, and the shares can be very uneven (one run on a busy
  2-core machine gave 11 349 and 651 samples).  That is expected: use it when
  the replicas only need every sample to be used once, as fast as they can.
* ``deterministic=True``: the source deals its batches in turn, batch *i* to
  the *i mod 2*-th net wired, so the shares are even (within one batch)
  whatever the timing.  With a fetcher that is itself deterministic, the
  batches are also the same on every run (docs/RESUME.md);
  this one is not (its workers share a cursor).
* ``equal=True`` (with ``deterministic=True`` here): what a DDP-style loop
  needs, where every step runs every replica once.  The batches go out in
  rounds, one per net, and the last incomplete round is dropped (counted as
  ``blobfeed_dropped_samples_total{reason="equal"}``, and logged), so both
  nets get exactly the same number of batches and no step waits for a net
  that ran out first.

The example runs all three, and checks that every sample id reached exactly
one of the two nets (with ``equal=True``: or was counted as dropped), that
each net's predictions match numpy, that the deterministic run's shares are
even and that the equal run's batch counts are the same.

Run:  python examples/data_parallel.py
"""

from __future__ import annotations

import threading

import numpy as np

import blobfeed
from blobfeed.apps.models import mlp_onnx, mlp_reference

N_SAMPLES = 12_000
FEATURES = 16
BATCH = 128
SOURCE = "train"


def run(
    model: bytes, features: np.ndarray, expected: np.ndarray, *, deterministic: bool, equal: bool = False,
    batch: int = BATCH,
) -> list[str]:
    """Feed two replicas from one source; returns the failures (none: it checked out)."""
    ids = np.arange(N_SAMPLES, dtype=np.int64)
    # One dataset, read in chunks of 1..BATCH samples by every fetcher of the source.
    cursor = {"pos": 0}
    lock = threading.Lock()

    def fetch_fun(worker_id: int, batch_size: int) -> list[np.ndarray]:
        n = int(np.random.default_rng().integers(1, batch_size + 1))
        with lock:
            start = cursor["pos"]
            if start >= N_SAMPLES:
                raise StopIteration
            cursor["pos"] = start + n
        return [features[start : start + n], ids[start : start + n]]

    coordinator = blobfeed.GlobalCoordinator()  # isolated: its own metrics registry
    nets = [blobfeed.Net(model, name=f"replica{i}") for i in range(2)]
    for net in nets:
        # The same source name for both calls: they share the source.
        blobfeed.init_data_input_workers(
            net, ["data", "sample_id"], fetch_fun, batch_size=batch,
            num_worker_threads=2, input_source_name=SOURCE, timeout=10.0,
            coordinator=coordinator, deterministic=deterministic, equal=equal,
        )

    seen: dict[str, list[np.ndarray]] = {net.name: [] for net in nets}
    mismatches: dict[str, int] = {net.name: 0 for net in nets}
    errors: list[BaseException] = []

    def consume(net: blobfeed.Net) -> None:
        try:
            while True:
                try:
                    out = net.run()
                except blobfeed.EndOfInput:
                    return
                batch_ids = np.array(net.workspace.fetch_blob("sample_id"), copy=True)
                seen[net.name].append(batch_ids)
                if not np.allclose(out["logits"], expected[batch_ids], atol=1e-4):
                    mismatches[net.name] += 1
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    # One thread per net: with deterministic=True the source runs at most
    # about two batches ahead of its slowest net, so one thread draining one
    # net to its end first would wait for itself.
    consumers = [threading.Thread(target=consume, args=(net,), name=f"consumer-{net.name}") for net in nets]
    try:
        coordinator.start()
        for t in consumers:
            t.start()
        for t in consumers:
            t.join(timeout=60)
    finally:
        # samples of the last incomplete round (equal=True), read before the
        # stop, which would add what it discards
        dropped = coordinator.registry.get_sample_value(
            "blobfeed_dropped_samples_total", {"source": SOURCE, "reason": "equal"}
        ) or 0.0
        ok = coordinator.stop()  # also wakes a consumer still waiting in run()

    failures = []
    if errors:
        failures.append(f"a consumer failed: {errors[0]!r}")
    if any(t.is_alive() for t in consumers):
        failures.append("a consumer did not finish")
    per_net = {name: int(sum(len(b) for b in batches)) for name, batches in seen.items()}
    got = np.concatenate([b for batches in seen.values() for b in batches] or [np.empty(0, np.int64)])
    dupes = len(got) - len(np.unique(got))
    if dupes or len(got) + dropped != N_SAMPLES or not np.isin(got, ids).all():
        failures.append(
            f"{len(got)} samples delivered ({dupes} duplicates) and {dropped:.0f} dropped, "
            f"expected each of {N_SAMPLES} once"
        )
    if not equal and dropped:
        failures.append(f"{dropped:.0f} samples dropped without equal=True")
    if deterministic and abs(per_net["replica0"] - per_net["replica1"]) > batch:
        failures.append(f"deterministic=True dealt uneven shares: {per_net}")
    if equal and len(seen["replica0"]) != len(seen["replica1"]):
        failures.append(f"equal=True dealt {len(seen['replica0'])} and {len(seen['replica1'])} batches")
    if any(mismatches.values()):
        failures.append(f"batches whose predictions differ from numpy: {mismatches}")
    if not ok:
        failures.append("stop() left threads running")

    mode = "deterministic=True (batches dealt in turn)" if deterministic else "arrival order (first come, first served)"
    if equal:
        mode = "deterministic=True, equal=True (rounds of one batch per net)"
    split = ", ".join(f"{name}: {n} samples in {len(seen[name])} batches" for name, n in per_net.items())
    tail = f"; {dropped:.0f} samples of the last incomplete round dropped" if equal else ""
    print(f"{mode}: source {SOURCE!r} fed 2 nets; {split}{tail}")
    return failures


def main() -> None:
    model, weights = mlp_onnx([FEATURES, 32, 4], seed=1)
    rng = np.random.default_rng(1)
    features = rng.standard_normal((N_SAMPLES, FEATURES)).astype(np.float32)
    expected = mlp_reference(features, weights)

    failures = run(model, features, expected, deterministic=False)
    failures += run(model, features, expected, deterministic=True)
    # 75 batches of 160: the 38th round has one batch, for replica0 only, and is dropped
    failures += run(model, features, expected, deterministic=True, equal=True, batch=160)
    if failures:
        print("FAILED: " + "; ".join(failures))
        raise SystemExit(1)
    print(f"in every mode each of {N_SAMPLES} samples reached exactly one net (or, with equal=True, "
          "was counted as dropped); predictions match numpy; the dealt shares are even, and equal "
          "with equal=True; clean stops")


if __name__ == "__main__":
    main()
