"""blobfeed itself, the library under test: its fetchers as threads or
worker processes (``blobfeed``; W5 with the model, set against the model
alone in interleaved slices), and as Ray actors on a local cluster of
simulated nodes (``ray``, ``ray1``, ``ray2``, ``ray4``, ``ray2max``).
Unlike the peers it counts every sample: one lost fails the run."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .measure import Meter, Tally
from .workloads import ORDERED_SEED, Fetcher, R1FastFetch, Workload, mlp_bytes, session_options


def run_blobfeed(wl: Workload, seconds: float) -> dict[str, Any]:
    """``wl`` through blobfeed's threads or worker processes (``wl.backend``)."""
    import blobfeed

    if wl.dataset is not None:
        return run_indexed(wl, seconds)
    tally = Tally()
    try:
        return _run_blobfeed(wl, seconds, tally, blobfeed)
    finally:
        tally.close()


def run_indexed(wl: Workload, seconds: float, shuffle: bool | None = None, workers: int = 2) -> dict[str, Any]:
    """``wl``'s map-style dataset (W1i, W2i, W7) as a random-access source:
    ``blobfeed.RandomAccessSource(dataset, shuffle=..., seed=0)`` (the
    default read size: W1i's units are 16 batches, W2i's and W7's one) on ``workers`` threads or worker processes
    (``wl.backend``), endless (``epochs=None``; each epoch's end is an
    ``EndOfEpoch``, skipped).  ``shuffle``: None for ``wl.shuffle``.

    A random-access source's stream is exact, so nothing is counted at the
    fetch: the index of every sample delivered in the warm-up and the
    window (the last blob) is checked against the source's documented order
    (``range(n)`` per epoch, or ``default_rng((seed, epoch)).permutation(n)``);
    ``samples_lost`` is the number of positions where they differ (a sample
    dropped, repeated or out of place).  The source is stopped after the
    window: what it read ahead is not a loss."""
    import blobfeed

    assert wl.dataset is not None, f"{wl.id} has no dataset"
    shuffle = wl.shuffle if shuffle is None else shuffle
    dataset = wl.dataset()
    n = len(dataset)
    # Any: init_data_input_workers's annotation names only a fetch_fun
    source: Any = blobfeed.RandomAccessSource(dataset, shuffle=shuffle, seed=ORDERED_SEED)
    net = blobfeed.Net(None, name="bench")
    gc = blobfeed.GlobalCoordinator()
    kwargs: dict[str, Any] = {} if wl.backend == "threads" else {"backend": wl.backend}
    blobfeed.init_data_input_workers(net, list(wl.blobs), source, wl.batch, num_worker_threads=workers, coordinator=gc,
                                     epochs=None, **kwargs)
    m = Meter(seconds, cpu=True)
    wait_key = ("blobfeed_dequeue_wait_seconds_sum", {"source": "train", "net": "bench"})
    seen: list[np.ndarray] = []
    wait0 = 0.0
    m.begin()
    gc.start()
    try:
        while True:
            try:
                out = net.run(timeout=60)
            except blobfeed.EndOfEpoch:
                continue
            arrays = [out[name] for name in wl.blobs]
            seen.append(np.array(arrays[-1], dtype=np.int64))  # a copy: the indexes, checked after the window
            before = m.batches
            going = m.tick(arrays)
            if before == 0 and m.batches == 1:
                wait0 = gc.registry.get_sample_value(*wait_key) or 0.0
            if not going:
                break
        waited = (gc.registry.get_sample_value(*wait_key) or 0.0) - wait0
    finally:
        gc.stop()
    got = np.concatenate(seen)
    epochs = -(-len(got) // n)
    order = np.concatenate([
        np.random.default_rng((ORDERED_SEED, e)).permutation(n) if shuffle else np.arange(n) for e in range(epochs)
    ])[: len(got)]
    window = max(m.t_end - m.t_window, 1e-9)
    return m.result(samples_lost=int(np.count_nonzero(got != order)), wait_share=waited / window,
                    samples_checked=len(got), dataset_length=n)


def _run_blobfeed(wl: Workload, seconds: float, tally: Tally, blobfeed: Any, backend: Any = None,
                  workers: int = 2) -> dict[str, Any]:
    fetch = wl.fetcher(tally)
    model = mlp_bytes() if wl.id == "W5" else None
    net = blobfeed.Net(model, name="bench", session_options=session_options() if model else None)
    gc = blobfeed.GlobalCoordinator()
    if backend is None and wl.backend != "threads":
        backend = wl.backend
    kwargs: dict[str, Any] = {} if backend is None else {"backend": backend}
    if wl.deterministic or wl.shuffle_buffer:
        kwargs.update(deterministic=wl.deterministic, shuffle_buffer=wl.shuffle_buffer, seed=ORDERED_SEED)
    blobfeed.init_data_input_workers(net, list(wl.blobs), fetch, wl.batch, num_worker_threads=workers, coordinator=gc,
                                     **kwargs)
    m = Meter(seconds)
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
    extra.update(wl.ideal(tally, bps))
    return m.result(samples_lost=int(tally.fetched() - delivered), wait_share=waited / window, **extra)


#: W5: the seconds of each slice, fed net and model alone in turn
W5_SLICE_S = 0.25


def _interleaved_model_ratio(net: Any, model: bytes, wl: Workload, seconds: float) -> dict[str, Any]:
    """W5: alternate short slices of the fed net and of the model alone on
    pre-made batches, in this process, so that both see the same machine.

    While the model-alone slice runs, blobfeed's queues are full and its
    threads asleep: that slice is the model alone.
    """
    import onnxruntime as ort

    sess = ort.InferenceSession(model, sess_options=session_options(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((wl.batch, 784)).astype(np.float32)
    fed = alone = 0
    t_fed = t_alone = 0.0
    delivered = 0
    slice_s = W5_SLICE_S
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


#: blobfeed's runners, by the name the workloads give them
RUNNERS: dict[str, Callable[[Workload, float], dict[str, Any]]] = {
    "blobfeed": run_blobfeed,
    "sequential": lambda wl, s: run_indexed(wl, s, shuffle=False),
    "ray": lambda wl, s: run_ray(wl, s, 1),
    "ray1": lambda wl, s: run_ray(wl, s, 1),
    "ray2": lambda wl, s: run_ray(wl, s, 2),
    "ray4": lambda wl, s: run_ray(wl, s, 4),
    "ray2max": lambda wl, s: run_ray(wl, s, 2, R1FastFetch),
}
#: the optional package a runner needs (blobfeed's threads and processes need none)
NEEDS = {name: "ray" for name in RUNNERS if name.startswith("ray")}
