"""First come, first served (``num_consumers=None``): the promises of the
shared net's dealing when consumers leave, at an epoch's end and at the
data's end, its fairness to a consumer that attaches late, its resume, and
the stop (issue 24).

Consumers are in this process (an attachment and a ``Net`` with no model)
unless the test is about a process that dies; every wait is bounded.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

import blobfeed
from blobfeed.service import FeedServer
from blobfeed.service.served import ARENA_CONSUMERS

from . import feeds
from .test_service import batches, consumer, finish, lines, wait_for

BATCH = 8


def n_batches(samples: int) -> int:
    return -(-samples // BATCH)


def metric(server: FeedServer, name: str, **labels: str) -> float:
    return sum(
        s.value for fam in server.registry.collect() for s in fam.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


class Drain:
    """A consumer's run() loop in a thread: its ids per epoch, and how it ended."""

    def __init__(self, net: blobfeed.Net) -> None:
        self.net = net
        self.epochs: list[list[int]] = [[]]
        self.batches = 0
        self.end: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                got = self.net.run(timeout=30)
            except blobfeed.EndOfEpoch:
                self.epochs.append([])
                continue
            except BaseException as err:  # EndOfInput, or what failed the test
                self.end = err
                return
            self.epochs[-1].extend(int(i) for i in got["id"])
            self.batches += 1


def attach(server: FeedServer) -> tuple[blobfeed.Net, Any]:
    net = blobfeed.Net(None)
    return net, blobfeed.attach_source(net, ["id", "x"], BATCH, "train", server.address, timeout=30)


@pytest.mark.parametrize("epochs", [1, 2])
def test_a_boundary_waits_for_the_batches_a_consumer_that_leaves_still_holds(epochs: int) -> None:
    """A holds batches (its run() never returned them), B runs.  B is told
    neither the epoch's end nor the data's end while A holds batches of that
    epoch: A leaves, B gets them, then the end.  The end went out to B while
    A held them: A's epoch-0 batches reached B after its EndOfEpoch(0), or
    nobody (the data's end)."""
    server = FeedServer()
    # 4 slots: A holds 4 batches, B takes the rest (the fairness bound is another test's)
    server.serve_source("train", ["id", "x"], feeds.Fetch(), BATCH, 2, deterministic=True, epochs=epochs, slots=4)
    server.start()
    counts = server.sources["train"].counts
    per_epoch = n_batches(len(feeds.all_ids(2)))
    net_a, a = attach(server)
    net_b, b = None, None
    try:
        wait_for(lambda: counts.delivered[str(a.consumer)] >= 3, 30, "batches in A's slots")
        net_b, b = attach(server)
        drain = Drain(net_b)
        # B takes every batch of the epoch that A does not hold
        wait_for(lambda: drain.batches + counts.delivered[str(a.consumer)] >= per_epoch or drain.end is not None,
                 30, "B's share of epoch 0")
        held = counts.delivered[str(a.consumer)]
        assert drain.end is None and len(drain.epochs) == 1, (drain.end, [len(e) for e in drain.epochs])
        a.stop()  # never ran: what A holds goes to B, before the end
        drain.thread.join(60)
        assert not drain.thread.is_alive()
    finally:
        for att in (a, b):
            if att is not None:
                att.stop()
        server.stop()
    assert isinstance(drain.end, blobfeed.EndOfInput) and not isinstance(drain.end, blobfeed.EndOfEpoch), drain.end
    assert [sorted(e) for e in drain.epochs] == [feeds.all_ids(2)] * epochs
    assert sum(counts.redealt.values()) == held
    del net_a, net_b


def test_first_come_loses_nothing_when_a_consumer_dies_after_the_fetchers_finished(tmp_path: Path) -> None:
    """The tester's case: a consumer SIGKILLed once everything was dealt.
    The others had been told the data's end while it held batches, and what
    it held was re-dealt to nobody: samples lost, and fetched != delivered +
    dropped + buffered."""
    server = FeedServer()
    server.serve_source("train", ["id", "x"], feeds.Fetch(), BATCH, 2)
    server.start()
    total = n_batches(len(feeds.all_ids(2)))
    counts = server.sources["train"].counts
    outs = [tmp_path / f"c{i}.jsonl" for i in range(3)]
    try:
        holder = consumer(server.address, outs[0], "--hold-after", "2")
        wait_for(lambda: outs[0].exists() and {"holding": 2} in lines(outs[0]), 30, "the holder's 2 batches")
        others = [consumer(server.address, o) for o in outs[1:]]
        wait_for(lambda: sum(counts.delivered.values()) >= total, 60, "every batch dealt")
        wait_for(lambda: all(o.exists() and any("attached" in r for r in lines(o)) for o in outs[1:]), 60,
                 "the others attached")
        holder.send_signal(signal.SIGKILL)
        assert finish([holder]) == [-signal.SIGKILL]
        assert finish(others, 60) == [0, 0]
        fetched = metric(server, "blobfeed_fetched_samples_total", source="train")
        delivered = metric(server, "blobfeed_delivered_samples_total", source="train")
        dropped = metric(server, "blobfeed_dropped_samples_total", source="train")
        buffered = metric(server, "blobfeed_buffered_samples", source="train")
    finally:
        server.stop()
    flat = sorted(i for o in outs for b in batches(o) for i in b)
    assert flat == feeds.all_ids(2)
    assert all(lines(o)[-1] == {"end": "input"} for o in outs[1:])
    assert fetched == len(flat) == delivered + dropped + buffered, (fetched, delivered, dropped, buffered)


def test_a_consumer_that_attaches_late_gets_its_share_of_a_small_data_set() -> None:
    """The first consumer prefetched most of a small data set into its 64
    slots, and one that attached a moment later got EndOfInput at once,
    with no batch: first come, a consumer holds at most its share ahead."""
    server = FeedServer()
    server.serve_source("train", ["id", "x"], feeds.Fetch(), BATCH, 2, max_buffered_batches=200)
    server.start()
    samples = len(feeds.all_ids(2))
    counts = server.sources["train"].counts
    net_a, a = attach(server)
    b = None
    try:
        # everything fetched: what A did not take waits in the service
        slots = 64  # 1 KiB batches: many in flight (checked below)
        wait_for(lambda: metric(server, "blobfeed_fetched_samples_total", source="train") >= samples
                 and counts.delivered[str(a.consumer)] >= slots // ARENA_CONSUMERS, 30, "the fetch")
        ahead = counts.delivered[str(a.consumer)]
        net_b, b = attach(server)
        drains = [Drain(net_a), Drain(net_b)]
        for d in drains:
            d.thread.join(60)
        slots = server.sources["train"].slots
    finally:
        for att in (a, b):
            if att is not None:
                att.stop()
        server.stop()
    assert slots == 64  # 1 KiB batches: many in flight
    assert ahead == slots // ARENA_CONSUMERS < n_batches(samples)
    assert drains[1].batches > 0
    assert sorted(drains[0].epochs[0] + drains[1].epochs[0]) == feeds.all_ids(2)
    del net_a, net_b


def test_a_service_resumed_twice_deals_no_batch_again(tmp_path: Path) -> None:
    """Consumers acknowledged out of order, SIGTERM (the batches acknowledged
    past the saved position are saved as such), resume, stop again before any
    consumer attached, resume again: those batches were loaded but not saved
    the second time, and the third run dealt them again."""
    state = tmp_path / "state.json"

    def server(resume: bool) -> FeedServer:
        s = FeedServer(state_file=state, resume=resume)
        s.serve_source("train", ["id", "x"], feeds.Fetch(), BATCH, 2, deterministic=True, slots=4)
        return s.start()

    first = server(False)
    counts = first.sources["train"].counts
    net_a, a = attach(first)  # holds its batches: never runs
    b = None
    try:
        wait_for(lambda: counts.delivered[str(a.consumer)] >= 3, 30, "batches in A's slots")
        net_b, b = attach(first)
        returned = [int(i) for _ in range(5) for i in net_b.run(timeout=30)["id"]]
        wait_for(lambda: sum(counts.acknowledged.values()) == 5, 30, "B's acknowledgements")
    finally:
        first.stop()
        for att in (a, b):
            if att is not None:
                att.stop()
    saved = json.loads(state.read_text())["sources"]["train"]
    assert saved["acked_after"], saved  # B's batches lie past the position (A's come first)
    server(True).stop()  # no consumer attaches
    assert json.loads(state.read_text())["sources"]["train"]["acked_after"] == saved["acked_after"]
    third = server(True)
    net_c, c = attach(third)
    try:
        drain = Drain(net_c)
        drain.thread.join(60)
    finally:
        c.stop()
        third.stop()
    assert isinstance(drain.end, blobfeed.EndOfInput), drain.end
    assert sorted(returned + drain.epochs[0]) == feeds.all_ids(2)
    del net_a, net_b, net_c


def test_a_first_come_state_with_batches_acknowledged_past_its_position_is_refused_by_index(tmp_path: Path) -> None:
    """A first-come state lists the batches consumers acknowledged past its
    position (``acked_after``); a service that deals the source by index
    cannot skip them, and once dealt them again (a batch twice).  Refused,
    naming the field, before anything starts."""
    state = tmp_path / "state.json"
    first = FeedServer(state_file=state)
    first.serve_source("train", ["id", "x"], feeds.Fetch(), BATCH, 2, deterministic=True, slots=4)
    first.start()
    net_a, a = attach(first)  # holds its batches: never runs
    b = None
    try:
        counts = first.sources["train"].counts
        wait_for(lambda: counts.delivered[str(a.consumer)] >= 3, 30, "batches in A's slots")
        net_b, b = attach(first)
        for _ in range(3):
            net_b.run(timeout=30)
        wait_for(lambda: sum(counts.acknowledged.values()) == 3, 30, "B's acknowledgements")
    finally:
        first.stop()
        for att in (a, b):
            if att is not None:
                att.stop()
    assert json.loads(state.read_text())["sources"]["train"]["acked_after"]
    by_index = FeedServer(state_file=state, resume=True)
    by_index.serve_source("train", ["id", "x"], feeds.Fetch(), BATCH, 2, deterministic=True, num_consumers=1)
    try:
        with pytest.raises(ValueError, match=r"acked_after.*first come.*by index"):
            by_index.start()
    finally:
        by_index.stop()


def test_a_consumer_holding_the_end_returns_no_batch_the_saved_state_does_not_count(tmp_path: Path) -> None:
    """SIGTERM while a consumer already holds the rest of its stream and the
    end: it was not told the service stops, kept returning batches through
    the drain, and one returned between the save and the close was dealt
    again on resume.  Told, its run() returns no batch any more."""
    state = tmp_path / "state.json"
    ids = sorted(int(i) for w in range(2) for c in range(6) for i in feeds.ids_of(w, c))

    def server(resume: bool) -> FeedServer:
        s = FeedServer(state_file=state, resume=resume)
        # 2 x 6 chunks: 5 batches, all in the consumer's slots with the end
        # (dealt by index: first come, the end waits for them to be returned)
        s.serve_source("train", ["id", "x"], feeds.Fetch(calls=6), BATCH, 2, deterministic=True, num_consumers=1)
        return s.start()

    first = server(False)
    net, att = attach(first)
    try:
        wait_for(lambda: any(c._ended for c in list(first._connections)), 30, "the end sent to the consumer")
        returned = [int(i) for _ in range(2) for i in net.run(timeout=30)["id"]]
        save = first.save_state
        late: list[Any] = []

        def save_then_run() -> bool:
            # a run() of the consumer's right after the save, before the connection is closed
            saved = save()
            try:
                late.append(net.run(timeout=5))
            except blobfeed.BlobfeedError as err:
                late.append(err)
            return saved

        first.save_state = save_then_run  # type: ignore[method-assign]
        first.stop()
    finally:
        first.stop()
        att.stop()
    assert len(late) == 1
    if isinstance(late[0], dict):
        returned += [int(i) for i in late[0]["id"]]
    else:
        assert isinstance(late[0], blobfeed.ServiceError), late[0]
    second = server(True)
    net2, att2 = attach(second)
    try:
        drain = Drain(net2)
        drain.thread.join(60)
    finally:
        att2.stop()
        second.stop()
    assert sorted(returned + drain.epochs[0]) == ids
    del net, net2


def test_a_consumer_that_does_not_answer_the_stop_cannot_acknowledge_after_the_save(tmp_path: Path) -> None:
    """A consumer that does not say bye when told the service stops (stalled,
    or an older blobfeed): the state was saved while its connection was still
    open, so an acknowledgement it sent then counted nowhere, and its run()
    had returned the batch.  The connection is closed before the save: on a
    Unix socket that acknowledgement fails (its run() raises instead)."""
    from .test_service import hand_hello

    server = FeedServer(state_file=tmp_path / "state.json")
    server.serve_source("train", ["id", "x"], feeds.Fetch(), BATCH, 2, deterministic=True, slots=4)
    server.start()
    sock, fds = hand_hello(server.address)
    for fd in fds:
        os.close(fd)
    try:
        record = json.loads(sock.recv(1 << 16))
        assert record["t"] == "batches"
        first = record["items"][0][0]
        save = server.save_state
        after_save: list[BaseException | None] = []

        def save_then_ack() -> bool:
            saved = save()
            try:
                sock.send(json.dumps({"t": "ack", "g": first, "slots": [], "waited": 0.0}).encode())
                after_save.append(None)
            except OSError as err:
                after_save.append(err)
            return saved

        server.save_state = save_then_ack  # type: ignore[method-assign]
        server.stop()
    finally:
        server.stop()
        sock.close()
    assert isinstance(after_save[0], BrokenPipeError), after_save
    assert sum(server.sources["train"].counts.acknowledged.values()) == 0


class _Feed:
    """An inner reader that gives a scripted stream (then EndOfInput), and
    counts what the stream moved past."""

    def __init__(self, items: list[Any]) -> None:
        self.items = list(items)
        self.passed: list[Any] = []

    def ready(self) -> int:
        return len(self.items)

    def read(self, timeout: float) -> Any:
        if not self.items:
            raise blobfeed.EndOfInput("scripted stream done")
        return self.items.pop(0)

    def returned(self, batch: Any) -> None:
        self.passed.append(batch)

    def count_dropped(self, reason: str, samples: int) -> None:
        pass


def _outlet(items: list[Any], slots: int = 64, skip: set[int] | None = None) -> Any:
    from types import SimpleNamespace

    from blobfeed.service.served import SharedOutlet, _Counts

    source = SimpleNamespace(
        name="train", error=None, stopped=False, slots=slots, counts=_Counts(),
        hub=SimpleNamespace(count_dropped=lambda *a: None),
    )
    return SharedOutlet(source, _Feed(items), set() if skip is None else skip)  # type: ignore[arg-type]


def test_the_first_come_rules_step_by_step() -> None:
    """The dealing's rules on a scripted stream, whoever leaves and joins
    when: a batch out keeps its epoch's end (and the data's end) from every
    consumer, its own holder too; what a consumer leaves goes to one still in
    that epoch; one that joins while batches of an epoch are out starts in it."""
    from blobfeed.feeders.chunks import Batch, EpochEnd

    from blobfeed.service.served import End, Item

    b = [Batch((), 1) for _ in range(6)]
    out = _outlet([b[0], b[1], b[2], b[3], EpochEnd(0), b[4], b[5]])
    x, y, j = (type("Conn", (), {"label": n})() for n in "xyj")
    out.join(x)
    out.join(y)
    got = {c: [] for c in (x, y, j)}

    def take(c: Any) -> Any:
        item = out.next(c, 0.01)  # the scripted feed's end is seen by waiting for it, as the real one's
        if isinstance(item, Item):
            got[c].append(item)
        return item

    assert [take(x).batch, take(x).batch, take(y).batch, take(y).batch] == b[:4]
    assert take(x) is None  # the feed's epoch end is taken; x's own batches of epoch 0 are out
    for item in got[x]:
        out.acked(item)
    assert take(x) is None  # y still holds two of epoch 0
    out.left(y, got[y])  # y leaves: x is still in epoch 0, and takes them
    assert [take(x).batch, take(x).batch] == b[2:4]
    assert take(x) is None
    for item in got[x][2:]:
        out.acked(item)
    assert take(x).batch == EpochEnd(0)
    assert take(x).batch is b[4]
    out.join(j)  # a batch of epoch 1 is out: j starts in epoch 1
    assert take(j).batch is b[5]
    assert take(j) is None and take(x) is None  # the data's end waits for b4 and b5
    out.acked(got[x][-1])
    assert take(j) is None  # its own b5 is out: it may still leave
    out.left(j, got[j][-1:])
    assert take(x).batch is b[5]
    assert take(x) is None
    out.acked(got[x][-1])
    assert take(x) == End(None)
    assert take(x) == End(None)  # the end stays
    assert out.acked_after() == [] and out.prefix == 7 and len(out.feed.passed) == 7
    assert sum(out.source.counts.redealt.values()) == 3


def test_first_come_deals_a_bounded_way_past_a_batch_a_consumer_holds(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """A consumer that holds one batch unacknowledged while another goes on:
    everything acknowledged past it must be kept (the position cannot pass
    it), and it grew by one entry a batch without bound (a peer that took 4
    batches and went quiet: 47 000 entries in 26 s, growing).  Past
    MAX_AHEAD batches the dealing waits for that batch (a warning names its
    holder), and goes on once it is back."""
    from blobfeed.feeders.chunks import Batch
    from blobfeed.service import served
    from blobfeed.service.served import Item

    monkeypatch.setattr(served, "MAX_AHEAD", 20)
    out = _outlet([Batch((), 1) for _ in range(100)])
    quiet, busy = (type("Conn", (), {"label": n})() for n in ("quiet", "busy"))
    out.join(quiet)
    out.join(busy)
    held = out.next(quiet, 0.0)
    assert isinstance(held, Item)
    taken = 0
    with caplog.at_level("WARNING", logger="blobfeed.service"):
        for _ in range(100):
            item = out.next(busy, 0.0)
            if item is None:
                break
            out.acked(item)
            taken += 1
    assert taken == 19, taken  # 20 dealt past the position: the held one and 19
    assert len(out._acked) <= 20 and len(out._items) <= 21
    assert "quiet" in caplog.text and "holds" in caplog.text, caplog.text
    out.acked(held)  # back: the position moves, and the dealing goes on
    assert isinstance(out.next(busy, 0.0), Item)


def test_first_come_consumers_that_left_long_ago_have_no_series(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each first-come consumer's counters were a series labelled by its
    connection, kept for good: a peer attaching in a loop grew the service's
    memory and every scrape (10 000 attaches: 1.75 MB of /metrics).  A
    consumer that leaves keeps its series until KEEP_LEFT more have left,
    then its series goes (summed into one series, each fold was a jump that
    rate() read as batches); the monitor's total still counts it."""
    from blobfeed.service import served

    monkeypatch.setattr(served, "KEEP_LEFT", 4)
    server = FeedServer()
    server.serve_source("train", ["id", "x"], feeds.Fetch(), BATCH, 2, epochs=None)
    server.start()
    try:
        taken = 0
        for _ in range(12):
            net, att = attach(server)
            try:
                net.run(timeout=30)
                taken += 1
            finally:
                att.stop()
        wait_for(lambda: server.sources["train"].connected == 0, 30, "the consumers gone")
        name = "blobfeed_service_batches_acknowledged_total"
        labels = {s.labels["consumer"] for fam in server.registry.collect() for s in fam.samples if s.name == name}
        assert len(labels) == 4, labels  # the last 4 to leave
        assert metric(server, name) < taken
        assert server.sources["train"].counts.total_acknowledged() == taken
    finally:
        server.stop()


def test_first_come_a_consumer_holds_at_most_its_share() -> None:
    """64 slots among at least 4 consumers: 16 each; with 8 attached, 8 each."""
    from blobfeed.feeders.chunks import Batch

    out = _outlet([Batch((), 1) for _ in range(100)])
    conns = [type("Conn", (), {"label": str(i)})() for i in range(8)]
    out.join(conns[0])
    assert sum(out.next(conns[0], 0.0) is not None for _ in range(20)) == 16
    for c in conns[1:]:
        out.join(c)
    assert out.next(conns[0], 0.0) is None
    assert sum(out.next(conns[1], 0.0) is not None for _ in range(20)) == 8


def test_a_resumed_outlet_saves_what_it_is_still_to_skip_and_tells_a_skipped_epoch_end() -> None:
    """A resume skips the batches acknowledged past the saved position: until
    dealt, they are saved again as such, also when the position waits right
    at one (offset 0); and an epoch end among them is still told (the stream
    passes it, the consumers must hear of it)."""
    from blobfeed.feeders.chunks import Batch, EpochEnd

    b = [Batch((), 1) for _ in range(5)]
    out = _outlet([b[0], b[1], EpochEnd(0), b[3], b[4]], skip={2, 3})
    x = type("Conn", (), {"label": "x"})()
    out.join(x)
    assert out.acked_after() == [2, 3]
    got = [out.next(x, 0.01), out.next(x, 0.01)]
    assert [i.batch for i in got] == b[:2]
    for item in got:
        out.acked(item)
    assert out.prefix == 2 and out.acked_after() == [0, 1]
    assert out.next(x, 0.01).batch == EpochEnd(0)
    assert out.next(x, 0.01).batch is b[4]  # b3 skipped
    assert out.acked_after() == [] and out.prefix == 4


def test_a_state_whose_position_waits_at_a_batch_acknowledged_after_it_resumes(tmp_path: Path) -> None:
    state = tmp_path / "state.json"

    def server(resume: bool) -> FeedServer:
        s = FeedServer(state_file=state, resume=resume)
        s.serve_source("train", ["id", "x"], feeds.Fetch(), BATCH, 2, deterministic=True)
        return s

    server(False).start().stop()
    saved = json.loads(state.read_text())
    saved["sources"]["train"]["acked_after"] = [0, 2]
    state.write_text(json.dumps(saved))
    resumed = server(True).start()
    try:
        assert resumed.sources["train"].shared.skip == {0, 2}
    finally:
        resumed.stop()
    saved["sources"]["train"]["acked_after"] = [-1]
    state.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=r"\['acked_after'\]: expected a list of ints >= 0"):
        server(True).start()


def test_a_state_taken_while_an_acknowledgement_lands_is_one_moment() -> None:
    """ServedSource.state_dict read the inner position, then what was
    acknowledged past it: an acknowledgement between the two reads moved
    the prefix, and the state skipped batches another consumer still held
    and dealt acknowledged ones again (found by review).  Both are read at
    one moment now."""
    import os
    import socket
    import time

    from blobfeed.service.wire import PROTOCOL, Channel

    server = FeedServer()
    server.serve_source("train", ["id", "x"], feeds.Fetch(), 8, 2, deterministic=True, slots=3)
    server.start()
    src = server.sources["train"]
    chans = []

    def raw(k: int) -> tuple[Channel, list[int]]:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(server.address)
        s.settimeout(10)
        ch = Channel(s, "the service")
        chans.append(s)
        ch.send({"t": "hello", "protocol": PROTOCOL, "source": "train", "blobs": ["id", "x"], "batch_size": 8,
                 "index": None, "num": None, "pid": os.getpid()})
        got: list[int] = []
        while len(got) < k:
            received = ch.recv()
            assert received is not None
            rec, fds = received
            for fd in fds:
                os.close(fd)
            if rec["t"] == "batches":
                got += [it[0] for it in rec["items"]]
        return ch, got

    try:
        a, _ = raw(3)
        b, _ = raw(3)
        c, _ = raw(3)
        c.send({"t": "ack", "g": 2, "slots": [], "waited": 0.0})  # C returned its three
        deadline = time.monotonic() + 20
        while len(src.shared.acked_after()) < 3:
            assert time.monotonic() < deadline, "C's acknowledgement never counted"
            time.sleep(0.01)
        held_by_b = sorted(s for s, out in src.shared._out.items() if out[0] is not None and s not in (0, 1, 2))
        real = src.coordinator.state_dict

        def with_a_landing_between(name: str):
            inner = real(name)
            a.send({"t": "ack", "g": 2, "slots": [], "waited": 0.0})  # A returned its three, now
            prefix, until = src.shared.prefix, time.monotonic() + 0.5
            while src.shared.prefix == prefix and time.monotonic() < until:
                time.sleep(0.01)  # before the fix, A's acknowledgement moved the prefix here
            return inner

        src.coordinator.state_dict = with_a_landing_between
        state = src.state_dict()
        src.coordinator.state_dict = real
        pos = state["inner"]["position"]["batches"]
        counted = set(range(pos)) | {pos + k for k in state["acked_after"]}
        assert not counted & set(held_by_b), (state, held_by_b)
    finally:
        for s in chans:
            s.close()
        assert server.stop()


@pytest.mark.parametrize("by_index", [False, True])
def test_the_service_s_scrape_balances_while_a_consumer_holds_batches(tmp_path: Path, by_index: bool) -> None:
    """Batches sent to a consumer and not acknowledged yet are still the
    source's: its scrape counts them as buffered, so fetched == delivered +
    dropped + buffered holds while a consumer holds them (it missed them)."""
    server = FeedServer()
    server.serve_source("train", ["id", "x"], feeds.Fetch(), BATCH, 2, max_buffered_batches=200,
                        **(dict(num_consumers=1) if by_index else {}))
    server.start()
    out = tmp_path / "c.jsonl"
    holder = consumer(server.address, out, "--hold-after", "2", *(["--index", "0", "--num", "1"] if by_index else []))
    try:
        wait_for(lambda: out.exists() and {"holding": 2} in lines(out), 30, "the holder's 2 batches")
        counts = server.sources["train"].counts
        # the service sent it more than it returned: those are out, unacknowledged
        wait_for(lambda: sum(counts.delivered.values()) > 2, 30, "batches sent ahead")
        every = len(feeds.all_ids(2))
        wait_for(lambda: metric(server, "blobfeed_fetched_samples_total", source="train") == every, 30, "the fetch")
        names = ("fetched_samples_total", "delivered_samples_total", "dropped_samples_total", "buffered_samples")
        f, d, x, b = (metric(server, f"blobfeed_{n}", source="train") for n in names)
        assert f == d + x + b, dict(fetched=f, delivered=d, dropped=x, buffered=b)
        holder.send_signal(signal.SIGUSR1)
        assert finish([holder]) == [0]
    finally:
        holder.kill()
        server.stop()
    assert sorted(i for b in batches(out) for i in b) == feeds.all_ids(2)


def test_a_first_come_source_serves_at_most_max_consumers_at_once() -> None:
    """Anyone who can attach could attach any number of consumers to a
    first-come source (each two threads, a socket and its slots' memory:
    286 held 1.5 GB, a review found).  Past ``max_consumers`` an attach is
    refused naming the bound, and a place that frees up is taken again."""
    server = FeedServer()
    server.serve_source("train", ["id", "x"], feeds.Fetch(), BATCH, 1, epochs=None, max_consumers=2)
    server.start()
    attached: list[Any] = []
    try:
        nets = [blobfeed.Net(None, name=f"c{i}") for i in range(3)]
        for net in nets[:2]:
            attached.append(blobfeed.attach_source(net, ["id", "x"], BATCH, "train", server.address))
        with pytest.raises(ValueError, match=r"2 consumers are attached, the most it serves at once "
                                             r"\(max_consumers=2\)"):
            blobfeed.attach_source(nets[2], ["id", "x"], BATCH, "train", server.address)
        assert len(nets[0].run(timeout=20)["id"]) == BATCH
        attached[0].stop()
        wait_for(lambda: server.sources["train"].connected == 1, 10, "the first consumer's place freed")
        attached.append(blobfeed.attach_source(nets[2], ["id", "x"], BATCH, "train", server.address))
        assert len(nets[2].run(timeout=20)["id"]) == BATCH
    finally:
        for a in attached:
            a.stop()
        assert server.stop()


def test_max_consumers_is_checked_where_it_is_given() -> None:
    from blobfeed.service.served import DEFAULT_MAX_CONSUMERS

    server = FeedServer()
    with pytest.raises(ValueError, match="max_consumers"):
        server.serve_source("a", ["id", "x"], feeds.Fetch(), BATCH, 1, max_consumers=0)
    with pytest.raises(ValueError, match="max_consumers bounds a first-come source"):
        server.serve_source("b", ["id", "x"], feeds.Fetch(), BATCH, 1, num_consumers=2, max_consumers=4)
    server.serve_source("c", ["id", "x"], feeds.Fetch(), BATCH, 1)
    assert server.sources["c"].terms.max_consumers == DEFAULT_MAX_CONSUMERS
    assert server.stop()


@pytest.mark.parametrize("num_consumers", [None, 1], ids=["first-come", "by-index"])
def test_a_batch_taken_for_a_consumer_whose_send_failed_is_dealt_again(
    monkeypatch: pytest.MonkeyPatch, num_consumers: int | None
) -> None:
    """A failure between taking a batch for a consumer and recording it in
    its ledger (a descriptor that could not be had, a consumer gone while
    the record of the batches before it went out) lost the batch: never
    acknowledged nor handed back, first come waited for it at the data's
    end for ever, and by index it was simply missing."""
    from blobfeed.reader import REGIONS

    real, failed = REGIONS.locate, threading.Event()

    def locate_once_failing(arrays: Any) -> Any:
        if not failed.is_set():
            failed.set()
            raise OSError(24, "Too many open files (the test's)")
        return real(arrays)

    monkeypatch.setattr(REGIONS, "locate", locate_once_failing)
    server = FeedServer()
    server.serve_source("train", ["id", "x"], feeds.Fetch(), BATCH, 2, deterministic=True,
                        num_consumers=num_consumers, grace_period=30)
    with server.start():
        index = {} if num_consumers is None else {"consumer_index": 0, "num_consumers": 1}
        first = blobfeed.Net(None, name="first")
        with pytest.raises((blobfeed.ServiceError, blobfeed.DequeueTimeout)):
            with blobfeed.attach_source(first, ["id", "x"], BATCH, "train", server.address, timeout=5, **index):
                assert failed.wait(10)
                while True:  # the service closed this connection when its sender failed
                    first.run(timeout=5)
        # by index, the index is free once the service has seen the first consumer leave
        wait_for(lambda: server.sources["train"].connected == 0, 10, "the first consumer's end seen")
        net = blobfeed.Net(None, name="second")
        ids: list[int] = []
        with blobfeed.attach_source(net, ["id", "x"], BATCH, "train", server.address, timeout=10, **index):
            while True:
                try:
                    ids.extend(net.run(timeout=10)["id"].tolist())
                except blobfeed.EndOfInput:
                    break
    assert sorted(ids) == feeds.all_ids(2)



class _SecondEpochWaits(feeds.Fetch):
    """One worker's epochs; the second waits for ``go``.  (Kept on the
    class: the service pickles a stateful fetcher, which an Event is not.)"""

    go = threading.Event()
    ended = 0

    def __call__(self, worker_id: int, batch_size: int) -> list[Any]:
        if type(self).ended:
            type(self).go.wait(30)
        try:
            return super().__call__(worker_id, batch_size)
        except StopIteration:
            type(self).ended += 1
            raise


def test_a_consumer_that_leaves_holding_only_an_epoch_s_end_is_not_said_to_hold_batches(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The epoch's end a consumer was told and did not read yet is an item
    it leaves unacknowledged, not a batch: no "left with 0 batches" warning
    (it would alarm, and spend the departures' budget of log lines)."""
    _SecondEpochWaits.go, _SecondEpochWaits.ended = threading.Event(), 0
    fetch = _SecondEpochWaits()
    server = FeedServer()
    server.serve_source("train", ["id", "x"], fetch, BATCH, 1, epochs=2)
    server.start()
    net, att = attach(server)
    try:
        with caplog.at_level("INFO", logger="blobfeed.service"):
            for _ in range(n_batches(len(feeds.all_ids(1)))):
                net.run(timeout=30)
            # every batch of the epoch returned: its end comes next, unread
            wait_for(lambda: att.inlet.unreturned() >= 1, 30, "the epoch's end at the consumer")
            assert att.inlet.unreturned() == 1  # (the next epoch waits for go)
            att.stop()
            wait_for(lambda: server.sources["train"].connected == 0, 30, "the service to see it leave")
    finally:
        fetch.go.set()
        att.stop()
        server.stop()
    assert "left (1 unacknowledged)" in caplog.text, caplog.text  # its departure was logged (at INFO)
    assert "batches unacknowledged" not in caplog.text, caplog.text
