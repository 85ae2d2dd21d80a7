"""Shared fixtures: an isolated coordinator per test and a thread-leak check."""

from __future__ import annotations

import threading
from typing import Iterator

import pytest

import blobfeed

#: Upper bound of every wait in the tests: nothing should ever get near it.
WAIT = 5.0


def _blobfeed_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("blobfeed-")}


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    """Every blobfeed thread a test starts must be gone when it ends.

    Threads deliberately left stuck inside a fetch_fun must be released by
    the test itself (they are named ``blobfeed-...`` too).
    """
    before = _blobfeed_threads()
    yield
    leaked = []
    for t in _blobfeed_threads() - before:
        t.join(WAIT)
        if t.is_alive():
            leaked.append(t.name)
    assert not leaked, f"threads left running: {leaked}"


@pytest.fixture
def gc() -> Iterator[blobfeed.GlobalCoordinator]:
    """An isolated coordinator with its own registry, stopped after the test."""
    coordinator = blobfeed.GlobalCoordinator(log_interval=0.05)
    try:
        yield coordinator
    finally:
        assert coordinator.stop(timeout=WAIT), "a thread outlived stop()"

