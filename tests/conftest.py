"""Shared fixtures: an isolated coordinator per test, a thread-leak check,
and one local Ray cluster for every Ray test, in one test process."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Any, Iterator

import pytest

import blobfeed

#: Upper bound of every wait in the tests: nothing should ever get near it.
WAIT = 5.0


def _blobfeed_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("blobfeed-")}


@pytest.fixture(scope="session", autouse=True)
def sigint_handed_on() -> Iterator[None]:
    """Children get SIGINT's default disposition, whatever this process got.

    A process started with SIGINT ignored (a background job of a shell
    without job control, as some CI runners start their commands) hands
    that on to every child it starts, and Python in the child then never
    raises KeyboardInterrupt: the tests that interrupt a child would time
    out.  A handler of our own is reset to the default in a child."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield


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



#: the Ray cluster (``ray.cluster_utils.Cluster``): a head with no
#: CPUs, so every actor runs on a worker node, and two worker nodes of 2 CPUs.
#: The first carries the resource ``spot`` (tests/test_ray.py places actors
#: by it and adds a second such node) and ``a``, the second ``b``
#: (tests/service/test_ray_service.py places the service and each consumer on
#: a node of its choosing).  Every actor and task asks for a quarter of a CPU.
RAY_NODES = ({"num_cpus": 2, "resources": {"spot": 1, "a": 1}}, {"num_cpus": 2, "resources": {"b": 1}})
#: the driver's namespace (the named service actors of tests/service/test_ray_service.py)
RAY_NAMESPACE = "blobfeed-service-tests"
#: the bound on starting the cluster's first actors (Ray starts its worker
#: processes and their imports lazily: seconds on a loaded machine)
RAY_START_S = 120.0


def _uses_ray(item: pytest.Item) -> bool:
    """The test needs the session's Ray cluster: it asks for it (directly or
    through a fixture), or it is a tests/contract case on the Ray backend
    (its ``backend`` fixture asks for the cluster only then)."""
    if "ray_cluster" in getattr(item, "fixturenames", ()):
        return True
    callspec = getattr(item, "callspec", None)
    return callspec is not None and callspec.params.get("backend_name") == "ray"


#: the xdist group of every Ray test (``--dist loadgroup``): one test process runs them all
RAY_GROUP = "ray"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The Ray tests run first, in their order, as one xdist group: one test
    process takes them all, on one cluster, started at the first of them and
    shut down after the last (:func:`pytest_runtest_teardown`), before any
    other test of that process runs (the cluster's processes, threads and
    sockets would be in the way of the leak checks); the other processes
    (pyproject's ``-n 2``: the other one) runs the other tests meanwhile, and all share
    what is left after.  Each
    process started a cluster of its own before (10-27 s each), and ran its
    Ray tests last, beside the other process's cluster.  As the last group
    of the order the Ray tests took most of the suite's time in their
    process while the other one had finished (CI: 353 s against 318 s split
    over both): first, nothing waits for them.  In that arrangement a Ray
    test of the contract once timed out waiting for its first batch on the
    cluster that had run every other Ray test (tests/contract/
    test_stop_and_accounts.py, ray-det-shuffle); no Ray test leaves an
    actor behind (checked after each of them, in one run: none alive, and
    the CPUs of the last one's tasks and actors freed within moments)."""
    ray_tests = [i for i in items if _uses_ray(i)]
    for item in ray_tests:
        item.add_marker(pytest.mark.xdist_group(RAY_GROUP))
    items[:] = ray_tests + [i for i in items if not _uses_ray(i)]


class _XdistGroupIds:
    """pytest-xdist (3.8) puts a test in its ``xdist_group`` by appending
    ``@group`` to ``Item._nodeid`` in the test process, and its
    ``loadgroup`` scheduler reads the group off the test ids that process
    sends.  pytest 9 keeps a test's id in ``Item._id`` and no longer reads
    ``_nodeid``, so the groups never reached the scheduler: the bench's
    real runs (one group, tests/test_bench_cli.py) ran in both test
    processes, twice.  In a test process of ``--dist loadgroup`` this names the group
    in the id pytest 9 reads, as xdist does on pytest < 9 (there it is
    left to xdist)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        if not hasattr(self.config, "workerinput") or not self.config.getvalue("loadgroup"):
            return
        try:
            from _pytest.nodeid import coerce_node_id
        except ImportError:  # pytest < 9: xdist's own way works
            return
        for item in items:
            names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                            for m in item.iter_markers("xdist_group")})
            if names and "@" not in item.nodeid:
                item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(names)}")  # type: ignore[attr-defined]


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_XdistGroupIds(config), "blobfeed-xdist-group-ids")


class _RayCluster:
    """The test process's one local Ray cluster (see :data:`RAY_NODES`),
    this process connected to it, what Ray starts lazily (worker processes,
    their imports) paid at its start, once, with a generous bound, not
    inside a test's waits.  Started for the first test that asks for it;
    shut down after the last Ray test of the process
    (:func:`pytest_runtest_teardown`), or at the end of the session."""

    def __init__(self) -> None:
        self.cluster: Any = None
        self._stack: contextlib.ExitStack | None = None
        self._failed: BaseException | None = None

    def get(self) -> Any:
        if self._failed is not None:  # as a session fixture's error: once, then the same for each test
            raise RuntimeError("the Ray cluster failed to start (at an earlier test)") from self._failed
        if self.cluster is None:
            try:
                self._start()
            except BaseException as exc:
                self._failed = exc
                raise
        return self.cluster

    def _start(self) -> None:
        import ray

        from .helpers import local_ray_cluster

        stack = contextlib.ExitStack()
        try:
            cluster = stack.enter_context(local_ray_cluster(list(RAY_NODES), namespace=RAY_NAMESPACE))

            @ray.remote(num_cpus=0.25)
            class Warm:
                def ready(self) -> int:
                    import tests.contract.fetchers  # noqa: F401  (what the actors import: blobfeed with it)

                    return os.getpid()

            @ray.remote(num_cpus=0.25)
            def warm_task() -> int:
                import blobfeed  # noqa: F401  (what every consumer task imports)

                return os.getpid()

            # actors and tasks (whose worker processes Ray keeps for the next tasks), two of each on each node
            warm = [Warm.options(resources={node: 0.01}).remote() for node in "abab"]
            ray.get([w.ready.remote() for w in warm] + [warm_task.options(resources={node: 0.01}).remote()
                                                        for node in "abab"], timeout=RAY_START_S)
            for w in warm:
                ray.kill(w)
        except BaseException:
            stack.close()
            raise
        self._stack, self.cluster = stack, cluster

    def close(self) -> None:
        stack, self._stack, self.cluster = self._stack, None, None
        if stack is not None:
            stack.close()


_RAY = _RayCluster()


@pytest.fixture
def ray_cluster() -> Any:
    """The process's one local Ray cluster (:class:`_RayCluster`), up from
    the first Ray test to the last.  In CI (``CI=true``) a missing ``ray``
    is a failure, not a skip."""
    if os.environ.get("CI") == "true":
        import ray  # noqa: F401  (CI installs the extra: its absence is a failure)
    else:
        pytest.importorskip("ray")
    return _RAY.get()


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After the last Ray test of this process (the next test, if any, is
    not one; its own fixtures torn down), the cluster is shut down."""
    yield
    if _RAY.cluster is not None and (nextitem is None or not _uses_ray(nextitem)):
        _RAY.close()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _RAY.close()
