"""Fixtures of the contract suite: the backend a test runs on, and one local
Ray cluster for the whole package (started at the first Ray test, shut down
after the last test of ``tests/contract``, so ``tests/test_ray.py``, which
starts its own, never meets it)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

import blobfeed

ROOT = Path(__file__).resolve().parents[2]
#: what each Ray actor asks for: the fetchers here do little, two cores hold them
RAY_ACTOR = {"num_cpus": 0.25}
#: the bound on starting the cluster and its first actors (Ray starts its
#: worker processes and their imports lazily: seconds on a loaded machine)
RAY_START_S = 120.0


@pytest.fixture(scope="package")
def ray_cluster() -> Iterator[Any]:
    """A one-node local cluster of 2 CPUs, this process connected to it, its
    first actors already started (their imports paid here, not in a test's
    bounded waits)."""
    if os.environ.get("CI") == "true":
        import ray  # CI installs the extra: its absence is a failure
    else:
        ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    # the actors import the fetchers of this package by reference
    old_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([old_path] if old_path else []))
    t0 = time.monotonic()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    try:
        ray.init(address=cluster.address, logging_level=logging.WARNING, log_to_driver=False)

        @ray.remote(num_cpus=0.25)
        class Warm:
            def ready(self) -> int:
                import tests.contract.fetchers  # noqa: F401  (what every actor imports)

                return os.getpid()

        warm = [Warm.remote() for _ in range(3)]
        ray.get([w.ready.remote() for w in warm], timeout=RAY_START_S)
        for w in warm:
            ray.kill(w)
        logging.getLogger("tests.contract").info("Ray cluster up in %.1f s", time.monotonic() - t0)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        if old_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old_path


@pytest.fixture
def backend(request: pytest.FixtureRequest, backend_name: str) -> Any:
    """What ``init_data_input_workers(backend=...)`` gets for ``backend_name``."""
    if backend_name != "ray":
        return backend_name
    cluster = request.getfixturevalue("ray_cluster")
    from blobfeed.ray import RayBackend

    return RayBackend(address=cluster.address, actor_options=RAY_ACTOR)


@pytest.fixture
def gc() -> Iterator[blobfeed.GlobalCoordinator]:
    """An isolated coordinator (its own registry), stopped after the test."""
    coordinator = blobfeed.GlobalCoordinator(log_interval=0.05)
    try:
        yield coordinator
    finally:
        assert coordinator.stop(timeout=5.0), "a thread outlived stop()"
