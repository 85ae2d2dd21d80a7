"""The feeding service as a named Ray actor (issue 18, "Across machines, on
Ray"): ``blobfeed.ray.serve_on_ray`` and ``attach_source(...,
address="ray://NAME")`` on a local Ray cluster of simulated nodes.

The session's one cluster (``ray_cluster`` in tests/conftest.py,
``ray.cluster_utils.Cluster``: a head with no CPUs and two worker nodes of 2
CPUs, tagged ``a`` and ``b`` so that the service and each consumer are
placed on a node of the test's choosing; the driver in the namespace
``NAMESPACE``).
Consumers are Ray tasks (their worker processes are reused: cheap) or, where
a test kills one, Ray actors; everything asks for a quarter of a CPU so a
2-core CI machine holds it.  Every wait is bounded.

The reference streams are the socket tests' (``local_streams``: what nets in
one process get from the same source); the same exactly-once, re-attach,
re-deal and resume guarantees as tests/service/test_service.py, with the
batches travelling through Ray's object store between nodes.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
import traceback
from typing import Any

import pytest

if os.environ.get("CI") == "true":
    import ray  # the extra is installed by .ci/run: its absence is a failure
else:
    ray = pytest.importorskip("ray")

import blobfeed
from blobfeed.ray import RayBackend, RayService, serve_on_ray
from blobfeed.reader import Inlet
from blobfeed.service.ray_attach import RayAttachment

from tests.helpers import interrupt_after

from . import feeds
from .test_service import local_streams

NAMESPACE = "blobfeed-service-tests"  # the driver's: RAY_NAMESPACE in tests/conftest.py
#: the bound of every wait here
WAIT = 30.0
#: what every task and actor here asks for; NODE[x]: placed on node x
CPU = 0.25
NODE = {"a": {"a": 0.01}, "b": {"b": 0.01}}
#: seconds a silent consumer keeps its place (the service's minimum: 4 heartbeats)
LEASE = 2.0


@pytest.fixture
def cluster(ray_cluster: Any) -> Any:
    """The session's cluster (tests/conftest.py): its worker processes started, blobfeed imported in them."""
    return ray_cluster


def wire(workers: int = 2, **kw: Any) -> None:
    """What the service actor runs (``setup``): the socket tests' source."""
    blobfeed.serve_source("train", ["id", "x"], feeds.Fetch(), 8, workers, **kw)


def serve(name: str, node: str = "a", workers: int = 2, **kw: Any) -> RayService:
    return serve_on_ray(
        name, functools.partial(wire, workers, **kw), actor_options={"num_cpus": CPU, "resources": NODE[node]},
        lease=LEASE, start_timeout=WAIT,
    )


def _run(net: blobfeed.Net, out: dict[str, Any], limit: int | None) -> None:
    """Batches (their ids) until ``limit``, the end of the input, or an error (its type and text)."""
    while limit is None or len(out["batches"]) < limit:
        try:
            got = net.run()
        except blobfeed.EndOfEpoch:
            out["epoch_ends"] += 1
            continue
        except blobfeed.EndOfInput:
            out["end"] = "input"
            return
        except blobfeed.BlobfeedError as err:
            out["end"] = type(err).__name__
            out["error"] = str(err)
            out["t"] = time.time()
            return
        out["read_only"] &= not got["id"].flags.writeable and not got["x"].flags.writeable
        out["batches"].append(got["id"].tolist())


@ray.remote
def consume(address: str, index: int | None = None, num: int | None = None) -> dict[str, Any]:
    """A consumer as a Ray task: everything it gets, where it ran."""
    net = blobfeed.Net(None, name=f"rank{index}")
    out: dict[str, Any] = {
        "node": ray.get_runtime_context().get_node_id(), "batches": [], "epoch_ends": 0, "end": None,
        "read_only": True,
    }
    with blobfeed.attach_source(net, ["id", "x"], 8, "train", address, consumer_index=index, num_consumers=num,
                                timeout=WAIT) as att:
        _run(net, out, None)
    # what its run() waited in all, as this process measured it (the bye told the service)
    out["waited"] = att.reader.waited()
    return out


@ray.remote
class Consumer:
    """A consumer as a Ray actor, driven step by step (and killed) by the test."""

    def __init__(self, address: str, index: int | None = None, num: int | None = None) -> None:
        self.net = blobfeed.Net(None, name=f"rank{index}")
        self.att = blobfeed.attach_source(
            self.net, ["id", "x"], 8, "train", address, consumer_index=index, num_consumers=num, timeout=WAIT,
        )

    def take(self, n: int | None) -> dict[str, Any]:
        out: dict[str, Any] = {"batches": [], "epoch_ends": 0, "end": None, "read_only": True}
        _run(self.net, out, n)
        return out

    def state(self) -> dict[str, Any]:
        return self.att.state_dict()

    def pid(self) -> int:
        return os.getpid()

    def stop(self) -> bool:
        return self.att.stop()


def consumer(address: str, node: str, index: int | None = None, num: int | None = None) -> Any:
    return Consumer.options(num_cpus=CPU, resources=NODE[node]).remote(address, index, num)


def task(address: str, node: str, index: int | None = None, num: int | None = None) -> Any:
    return consume.options(num_cpus=CPU, resources=NODE[node]).remote(address, index, num)


def flat(*streams: list[list[int]]) -> list[int]:
    return [i for s in streams for b in s for i in b]


# ---------------------------------------------------------------------------------------------
def test_by_index_across_nodes_is_exactly_the_stream_of_four_nets_in_one_process(cluster: Any) -> None:
    with serve("by-index", workers=4, deterministic=True, num_consumers=4) as service:
        assert service.address == f"ray://{NAMESPACE}/by-index"
        # two consumers beside the service, two on the other node
        outs = ray.get([task(service.address, "ab"[i // 2], i, 4) for i in range(4)], timeout=WAIT)
        stats = service.stats()["train"]
    assert [o["end"] for o in outs] == ["input"] * 4, [o.get("error") for o in outs]
    assert len({o["node"] for o in outs}) == 2
    assert all(o["read_only"] for o in outs)
    streams = [o["batches"] for o in outs]
    assert sorted(flat(*streams)) == feeds.all_ids(4)
    assert streams == local_streams(4, 1, deterministic=True)
    assert stats["acknowledged"] == {str(i): len(s) for i, s in enumerate(streams)}
    # each consumer's own wait, as its acknowledgements and bye reported it
    assert stats["run_waited"] == {str(i): pytest.approx(o["waited"], rel=1e-9, abs=1e-9) for i, o in enumerate(outs)}


def test_first_come_with_ray_actors_as_workers_is_exactly_once(cluster: Any) -> None:
    # the service's fetchers are Ray actors too (RayBackend), on the other node
    backend = RayBackend(actor_options={"num_cpus": CPU, "resources": NODE["b"]})
    with serve("first-come", workers=2, backend=backend) as service:
        outs = ray.get([task(service.address, n) for n in "aba"], timeout=WAIT)
        stats = service.stats()["train"]
    assert [o["end"] for o in outs] == ["input"] * 3, [o.get("error") for o in outs]
    got = flat(*(o["batches"] for o in outs))
    assert sorted(got) == feeds.all_ids(2)  # each sample once: none lost, none twice
    assert sum(stats["acknowledged"].values()) == sum(len(o["batches"]) for o in outs)


def test_a_killed_consumer_index_re_attaches_and_its_stream_goes_on_exactly(cluster: Any) -> None:
    with serve("re-attach", deterministic=True, num_consumers=2) as service:
        dying = consumer(service.address, "b", 1, 2)
        first = ray.get(dying.take.remote(4), timeout=WAIT)
        peer = task(service.address, "a", 0, 2)
        # it holds batches it was sent and its run() never returned (prefetched)
        ray.kill(dying)
        # a restarted rank comes back for its index while the dead one's lease runs
        t0 = time.monotonic()
        again = task(service.address, "a", 1, 2)
        other, second = ray.get([peer, again], timeout=WAIT)
        waited = time.monotonic() - t0
    reference = local_streams(2, 1, deterministic=True)
    assert first["batches"] + second["batches"] == reference[1]
    assert other["batches"] == reference[0]
    assert second["end"] == other["end"] == "input"
    assert waited < LEASE + 5.0


def test_a_killed_first_come_consumer_s_batches_go_to_the_others(cluster: Any) -> None:
    with serve("re-deal") as service:
        dying = consumer(service.address, "b")
        first = ray.get(dying.take.remote(3), timeout=WAIT)
        ray.kill(dying)
        outs = ray.get([task(service.address, n) for n in "ab"], timeout=WAIT)
        stats = service.stats()["train"]
    got = flat(first["batches"], *(o["batches"] for o in outs))
    assert sorted(got) == feeds.all_ids(2)
    assert sum(stats["redealt"].values()) > 0  # it died holding prefetched batches


def test_a_consumer_silent_past_its_lease_is_re_dealt_and_gets_no_batch_twice(cluster: Any) -> None:
    """A consumer process that stops answering (SIGSTOP here; a debugger, a
    stalled node) is taken as gone once its lease expires: its batches go to
    the others.  When it wakes, its run() raises instead of returning one of
    the batches it still holds: they went to another consumer."""
    with serve("silent") as service:
        sleeper = consumer(service.address, "a")
        first = ray.get(sleeper.take.remote(2), timeout=WAIT)
        pid = ray.get(sleeper.pid.remote(), timeout=WAIT)
        os.kill(pid, signal.SIGSTOP)
        try:
            other = ray.get(task(service.address, "b"), timeout=WAIT)
        finally:
            os.kill(pid, signal.SIGCONT)
        woke = ray.get(sleeper.take.remote(None), timeout=WAIT)
        stats = service.stats()["train"]
        ray.kill(sleeper)
    assert woke["batches"] == [] and woke["end"] == "ServiceError", woke
    assert sorted(flat(first["batches"], other["batches"])) == feeds.all_ids(2)
    assert sum(stats["redealt"].values()) > 0


def test_stop_and_resume_continue_exactly(cluster: Any) -> None:
    kw = dict(deterministic=True, num_consumers=2, epochs=2)
    service = serve("resume", **kw)
    try:
        cs = [consumer(service.address, "ab"[i], i, 2) for i in range(2)]
        # each rank stops at its own point, past the first epoch's end (25
        # batches each: the second epoch starts once every rank ended the first)
        firsts = ray.get([cs[0].take.remote(27), cs[1].take.remote(31)], timeout=WAIT)
        assert [f["epoch_ends"] for f in firsts] == [1, 1]
        from_consumer = ray.get(cs[0].state.remote(), timeout=WAIT)
        assert from_consumer == service.state_dict()
        assert service.stop() is True
        state = service.state_dict()
        assert state == from_consumer  # nothing was acknowledged after: the same position
        # the consumers learn the service stopped, naming it
        ends = ray.get([c.take.remote(1) for c in cs], timeout=WAIT)
        assert [e["end"] for e in ends] == ["ServiceError"] * 2
        assert all(service.address in e["error"] for e in ends)
        ray.get([c.stop.remote() for c in cs], timeout=WAIT)
    finally:
        service.stop()
    resumed = serve_on_ray(
        "resume", functools.partial(wire, 2, **kw), actor_options={"num_cpus": CPU, "resources": NODE["b"]},
        lease=LEASE, resume_state=state, start_timeout=WAIT,
    )
    with resumed:
        seconds = ray.get([task(resumed.address, "ab"[i], i, 2) for i in range(2)], timeout=WAIT)
        # the state handed in went through a file on the actor's node (this
        # machine): read at start and gone, whatever happens to the actor later
        import glob
        import tempfile
        assert not glob.glob(os.path.join(tempfile.gettempdir(), "blobfeed-ray-*"))
    reference = local_streams(2, 1, deterministic=True, epochs=2)
    for i in range(2):
        assert firsts[i]["batches"] + seconds[i]["batches"] == reference[i], i


def test_consumers_learn_within_a_second_that_the_service_actor_died(cluster: Any) -> None:
    service = serve("dies", deterministic=True, num_consumers=2, epochs=None)
    try:
        cs = [consumer(service.address, "ab"[i], i, 2) for i in range(2)]
        ray.get([c.take.remote(3) for c in cs], timeout=WAIT)
        waiting = [c.take.remote(None) for c in cs]  # until an error (timeout=WAIT: 30 s if unheard)
        time.sleep(0.3)  # let them run and wait on the service
        killed_at = time.time()
        ray.kill(service.actor)
        ends = ray.get(waiting, timeout=WAIT)
    finally:
        service.stop(timeout=10)
    for e in ends:
        assert e["end"] == "ServiceError", e
        assert service.address in e["error"] and "died" in e["error"]
        assert e["t"] - killed_at < 1.0, e["t"] - killed_at
    # the error a call to the dead service raises, kept by the caller (its
    # traceback with it), keeps no object of the call alive
    del waiting, ends, cs
    before = _references_held()
    with pytest.raises(blobfeed.ServiceError, match="died") as info:
        service.stats(timeout=WAIT)
    assert not set(_references_held()) - set(before), _references_held()
    assert "_get" in "".join(traceback.format_tb(info.value.__traceback__))  # the traceback still says where


def _references_held() -> dict[bytes, Any]:
    """The objects this process holds references to."""
    core = ray._private.worker.global_worker.core_worker
    return {k: v for k, v in core.get_all_reference_counts().items() if v.get("local") or v.get("submitted")}


def test_bad_attach_arguments_are_a_value_error_and_an_unknown_name_a_service_error(cluster: Any) -> None:
    with serve("bad-attach", deterministic=True, num_consumers=2) as service:
        args = dict(input_blob_names=["id", "x"], batch_size=8, input_source_name="train")
        for change, expected in [
            (dict(batch_size=16), "is served in batches of 8; the consumer asked for batch_size=16"),
            (dict(input_blob_names=["x", "id"]), "carries blobs ['id', 'x']; the consumer asked for ['x', 'id']"),
            (dict(num_consumers=3), "is dealt to 2 consumers; the consumer asked for num_consumers=3"),
            (dict(input_source_name="eval"), "this service has no source 'eval'"),
        ]:
            with pytest.raises(ValueError) as info:
                blobfeed.attach_source(blobfeed.Net(None), address=service.address, **{**args, **change})
            assert expected in str(info.value)
        net = blobfeed.Net(None)
        with blobfeed.attach_source(net, ["id", "x"], 8, "train", service.address, consumer_index=0) as att:
            assert att.consumer == 0
            net.run(timeout=WAIT)
            # its holder is alive (heard from lately): refused at once
            with pytest.raises(ValueError, match="consumer index 0 is attached already"):
                blobfeed.attach_source(blobfeed.Net(None), ["id", "x"], 8, "train", service.address, consumer_index=0)
    with pytest.raises(blobfeed.ServiceError, match="no Ray actor named 'nothing-here'"):
        blobfeed.attach_source(blobfeed.Net(None), ["id", "x"], 8, "train", "ray://nothing-here")


def test_an_interrupted_attach_frees_its_index_at_once_and_an_interrupted_stop_is_finished_by_the_next(
    cluster: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Ctrl-C inside attach_source() after the welcome: the service had
    counted the consumer, whose index stayed taken until its lease ran out
    (a retry at once was refused).  Inside stop(): the next stop() finishes.
    The lease is long: each attach after an interrupted one finds the index
    free because the consumer said bye, not because its lease ran out."""
    args: dict[str, Any] = dict(consumer_index=0, num_consumers=1, timeout=WAIT, connect_timeout=10)
    with serve_on_ray(
        "interrupted", functools.partial(wire, 2, deterministic=True, num_consumers=1),
        actor_options={"num_cpus": CPU, "resources": NODE["a"]}, lease=60.0, start_timeout=WAIT,
    ) as service:
        for where in ("waiting for the welcome", "the inlet starting"):
            if where == "the inlet starting":
                interrupt_after(monkeypatch, Inlet, "start")
            else:
                call = RayAttachment._call

                def answered(self: RayAttachment, ref: Any, timeout: float | None = None) -> Any:
                    ray.wait([ref], timeout=WAIT)  # the welcome came; the Ctrl-C lands before it is read
                    monkeypatch.setattr(RayAttachment, "_call", call)
                    raise KeyboardInterrupt

                monkeypatch.setattr(RayAttachment, "_call", answered)
            with pytest.raises(KeyboardInterrupt):
                blobfeed.attach_source(blobfeed.Net(None), ["id", "x"], 8, "train", service.address, **args)
            monkeypatch.undo()
        net = blobfeed.Net(None)
        att = blobfeed.attach_source(net, ["id", "x"], 8, "train", service.address, **args)  # not refused
        net.run(timeout=WAIT)
        interrupt_after(monkeypatch, att._threads[-1], "join")
        with pytest.raises(KeyboardInterrupt):
            att.stop()
        assert att.stop()
        assert not [t for t in threading.enumerate() if t.name.startswith("blobfeed-attach-ray")]
