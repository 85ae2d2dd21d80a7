"""Fixtures of the contract suite: the backend a test runs on.  The Ray
cases run on the one local Ray cluster (``ray_cluster`` in
tests/conftest.py), with every other Ray test, in one test process, first."""

from __future__ import annotations

from typing import Any, Iterator

import pytest

import blobfeed

#: what each Ray actor asks for: the fetchers here do little, two cores hold them
RAY_ACTOR = {"num_cpus": 0.25}


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
