"""A served source's arena: big batches assembled once, in memory every
consumer maps (blobfeed/service/arena.py).  Real processes and sockets where
it matters; every wait bounded."""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import blobfeed
from blobfeed.reader import REGIONS
from blobfeed.service import FeedServer
from blobfeed.service.arena import SourceArena, consumer_pidfd
from blobfeed.service.slots import ConsumerMapping, StreamBuffers, sealed_memfd
from blobfeed.service.wire import WireError

from . import feeds
from .test_service import batches, consumer, finish, lines, wait_for

BATCH = 32  # of BigFetch's 64 KiB rows: 2 MiB, so assembled in the arena


def big_served(**kw) -> FeedServer:
    server = FeedServer()
    server.serve_source("train", ["id", "x"], feeds.BigFetch(), BATCH, 2, **kw)
    return server.start()


def take(net: blobfeed.Net) -> dict[str, np.ndarray]:
    """The net's next batch, past epoch ends."""
    for _ in range(100):
        try:
            return net.run(timeout=20)
        except blobfeed.EndOfEpoch:
            continue
    raise AssertionError("100 epoch ends in a row")


def drain_ids(server: FeedServer) -> list[int]:
    """The ids one consumer attached now takes until the source's end."""
    net = blobfeed.Net(None)
    got: list[int] = []
    with blobfeed.attach_source(net, ["id", "x"], BATCH, "train", server.address):
        while True:
            try:
                out = net.run(timeout=20)
            except blobfeed.EndOfInput:
                return got
            got.extend(out["id"].tolist())
            del out


def open_descriptors() -> dict[str, str]:
    """This process's descriptors and what each is, after a collection."""
    gc.collect()
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:  # the listing's own descriptor
            pass
    return out


def _mappings(name: str) -> list[tuple[int, int, str]]:
    """(start, end, permissions) of this process's mappings of memfd ``name``."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            if f"memfd:{name}" in line:
                span, perms = line.split()[:2]
                lo, hi = (int(x, 16) for x in span.split("-"))
                out.append((lo, hi, perms))
    return out


def test_big_batches_go_to_consumers_through_the_arena_exactly_once_with_their_bytes(tmp_path: Path) -> None:
    with big_served(deterministic=True, num_consumers=2) as server:
        outs = [tmp_path / f"c{i}.jsonl" for i in range(2)]
        procs = [consumer(server.address, outs[i], "--index", str(i), "--batch-size", str(BATCH), "--check-rows")
                 for i in range(2)]
        assert finish(procs) == [0, 0]
        arena = server.sources["train"].arena
        assert arena.slots > 0 and arena.slot_bytes >= BATCH * feeds.BIG_ROW * 4
    got = [i for o in outs for b in batches(o) for i in b]
    assert sorted(got) == feeds.all_ids(2)
    # batch i went to consumer i % 2, every batch but an epoch's last whole
    assert all(len(b) == BATCH for o in outs for b in batches(o)[:-1])


def test_a_consumer_s_batch_is_a_read_only_view_of_the_arena() -> None:
    with big_served() as server:
        net = blobfeed.Net(None)
        with blobfeed.attach_source(net, ["id", "x"], BATCH, "train", server.address):
            out = net.run(timeout=20)
            addr = out["x"].__array_interface__["data"][0]
            maps = _mappings("blobfeed-train-batches")
            # the service's mapping (rw) and the consumer's (read-only), of one memfd
            assert {p[:2] for _, _, p in maps} == {"rw", "r-"}
            assert any(lo <= addr < hi and p.startswith("r-") for lo, hi, p in maps)
            assert not out["x"].flags.writeable
            assert (out["x"] == out["id"][:, None]).all()
            del out


def test_a_batch_kept_after_detaching_never_changes_while_the_service_goes_on() -> None:
    """A detached consumer that keeps a batch still views its arena slot:
    the slot stays out of circulation while that process lives (here, this
    one), so the batch never changes under it."""
    with big_served(epochs=None) as server:
        arena = server.sources["train"].arena
        net = blobfeed.Net(None)
        with blobfeed.attach_source(net, ["id", "x"], BATCH, "train", server.address):
            kept = take(net)
        before = np.array(kept["x"])
        net2 = blobfeed.Net(None)
        with blobfeed.attach_source(net2, ["id", "x"], BATCH, "train", server.address):
            for _ in range(3 * arena.slots):  # every other slot reused many times over
                out = take(net2)
                assert (out["x"] == out["id"][:, None]).all()
                del out
        assert np.array_equal(kept["x"], before)
        assert (kept["x"] == kept["id"][:, None]).all()


def test_a_killed_consumer_s_slots_come_back_once_its_process_is_gone(tmp_path: Path) -> None:
    with big_served(epochs=None, slots=3) as server:
        out = tmp_path / "dies.jsonl"
        # it dies holding the batches in its slots (run() returned them, it never freed them)
        p = consumer(server.address, out, "--batch-size", str(BATCH), "--die-after", "2")
        assert finish([p]) == [-9]
        arena = server.sources["train"].arena
        wait_for(lambda: server.sources["train"].connected == 0, 10, "the consumer's end seen")
        net = blobfeed.Net(None)
        with blobfeed.attach_source(net, ["id", "x"], BATCH, "train", server.address):
            for _ in range(5):
                b = take(net)
                assert (b["x"] == b["id"][:, None]).all()
                del b
            assert not arena._parked  # taken back: the process is gone


def test_big_batches_over_tcp_are_sent_from_the_arena_s_bytes(tmp_path: Path) -> None:
    server = FeedServer(listen="tcp://127.0.0.1:0")
    server.serve_source("train", ["id", "x"], feeds.BigFetch(), BATCH, 2)
    with server.start():
        out = tmp_path / "tcp.jsonl"
        assert finish([consumer(server.address, out, "--batch-size", str(BATCH), "--check-rows")]) == [0]
    assert sorted(i for b in batches(out) for i in b) == feeds.all_ids(2)


# -- the arena itself ------------------------------------------------------------------------
def test_the_arena_hands_out_slots_and_takes_them_back_when_their_views_die() -> None:
    arena = SourceArena("unit", lambda slot_bytes: 2)
    a = arena.take(5000)
    assert a is not None and arena.slot_bytes == 8192 and arena.slots == 2
    b = arena.take(100)
    assert b is not None and arena.take(100) is None  # full
    assert arena.take(9000) is None  # larger than a slot
    view = a[64:64 + 800].view(np.float64)
    del a
    assert arena.take(100) is None  # `view` still keeps its slot
    del view
    c = arena.take(100)
    assert c is not None
    del b, c
    arena.close()
    assert arena.take(100) is None
    gc.collect()
    assert not _mappings("blobfeed-unit-batches")


def test_locate_says_where_a_batch_lies_only_when_it_is_one_slot_of_the_arena() -> None:
    arena = SourceArena("where", lambda slot_bytes: 3)
    try:
        s0, s1 = arena.take(4096), arena.take(4096)
        assert s0 is not None and s1 is not None
        ids = s0[:64].view(np.int64)
        x = s0[64:64 + 8 * 12].view(np.float32).reshape(8, 3)
        located = REGIONS.locate([ids, x])
        assert located is not None
        region, slot, text = located
        assert region is arena.region
        assert slot * arena.slot_bytes == s0.__array_interface__["data"][0] - region.base
        assert text == '[["<i8",[8],0],["<f4",[8,3],64]]'
        assert REGIONS.locate([ids, s1[:96].view(np.float32).reshape(8, 3)]) is None  # two slots
        assert REGIONS.locate([ids, np.zeros((8, 3), np.float32)]) is None  # not in the arena
        assert REGIONS.locate([x[:, :2]]) is None  # not contiguous
        del ids, x, s0, s1
    finally:
        arena.close()


def test_a_departed_consumer_s_slots_stay_taken_until_its_process_exits() -> None:
    arena = SourceArena("park", lambda slot_bytes: 1)
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        root = arena.take(100)
        assert root is not None
        arena.park(child.pid, consumer_pidfd(child.pid), [root[:8]])
        del root
        assert arena.take(100) is None  # the child lives: it may still view the slot
        child.communicate(timeout=10)  # it exits
        assert arena.take(100) is not None
        assert not arena._parked
    finally:
        child.kill()
        child.wait(10)
        arena.close()


def test_a_consumer_that_exited_already_gives_its_slots_back_at_once() -> None:
    arena = SourceArena("gone", lambda slot_bytes: 1)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(10)
    root = arena.take(100)
    assert root is not None
    arena.park(child.pid, consumer_pidfd(child.pid), [root])
    del root
    assert arena.take(100) is not None
    arena.close()


# -- a lying service -----------------------------------------------------------------------------
def _consumer_mapping() -> ConsumerMapping:
    fd, mm = sealed_memfd("slots-test", 4 * 1024)
    try:
        return ConsumerMapping(fd, 4, 1024, lambda ref: None)
    finally:
        os.close(fd)
        mm.close()


@pytest.mark.parametrize("slots, slot_bytes, size, nfds, expected", [
    (2, 4096, 8192, 2, "with 2 descriptors, not 1"),
    (0, 4096, 8192, 1, "an arena of 0 slots"),
    (4097, 4096, 8192, 1, "an arena of 4097 slots"),
    (2, 1 << 40, 8192, 1, "an arena of 2 slots of 1099511627776 bytes"),
    (4, 4096, 8192, 1, "arena 1 holds 8192 bytes, not 0 + 4 x 4096"),
])
def test_an_arena_that_does_not_add_up_is_refused(slots: int, slot_bytes: int, size: int, nfds: int,
                                                   expected: str) -> None:
    m = _consumer_mapping()
    fd, mm = sealed_memfd("arena-test", size)
    fds = [fd] + [os.dup(fd) for _ in range(nfds - 1)]
    try:
        with pytest.raises(WireError, match=re.escape(expected)):
            m.add_arena(fds, 1, 0, slots, slot_bytes, "svc")
    finally:
        for f in fds:
            os.close(f)
        mm.close()
        m.close()


def test_arena_batches_are_checked_like_slot_batches() -> None:
    m = _consumer_mapping()
    fd, mm = sealed_memfd("arena-test", 2 * 4096)
    meta = [["<i8", [8], 0], ["<f4", [8, 3], 64]]
    try:
        with pytest.raises(WireError, match="in arena 7, which it never sent"):
            m.views(0, 8, meta, "svc", 0, 7)
        m.add_arena([fd], 7, 0, 2, 4096, "svc")
        with pytest.raises(WireError, match="sent arena 7 a second time"):
            m.add_arena([fd], 7, 0, 2, 4096, "svc")
        with pytest.raises(WireError, match="in arena 8, which it never sent"):
            m.views(0, 8, meta, "svc", 0, 8)
        ids, x = m.views(0, 8, meta, "svc", 1, 7)
        assert ids.shape == (8,) and x.shape == (8, 3) and not x.flags.writeable
        with pytest.raises(WireError, match="slot 2 of arena 7, of 2"):
            m.views(0, 8, meta, "svc", 2, 7)
        with pytest.raises(WireError, match="do not fit a slot of 4096"):
            m.views(1, 8, [["<i8", [8], 4090]], "svc", 0, 7)
        # a layout checked against the arena's larger slots is checked again against a slot's
        m.views(1, 8, [["<i8", [8], 2048]], "svc", 0, 7)
        with pytest.raises(WireError, match="do not fit a slot of 1024"):
            m.views(1, 8, [["<i8", [8], 2048]], "svc")
        del ids, x
    finally:
        os.close(fd)
        mm.close()
        m.close()


def test_a_batch_in_an_arena_over_tcp_is_refused() -> None:
    with pytest.raises(WireError, match="a batch in an arena, over TCP"):
        StreamBuffers.views(object.__new__(StreamBuffers), 0, 8, [], "svc", 0)  # type: ignore[arg-type]


def test_consumers_gone_before_their_first_arena_batch_lose_no_batch() -> None:
    """Found by review: the arena record went out after the batch was taken
    and before it was recorded as sent; a consumer gone by then (a broken
    pipe) took the batch with it, and a first-come source's acknowledged
    prefix stuck behind it for good."""
    from .test_service import hand_hello

    with big_served() as server:
        for _ in range(10):
            s, fds = hand_hello(server.address, batch_size=BATCH)
            for fd in fds:
                os.close(fd)
            s.close()  # gone before its first batch
        got = drain_ids(server)
    assert sorted(got) == feeds.all_ids(2)


def test_a_consumer_gone_before_its_welcome_loses_no_batch() -> None:
    """The first consumer's handshake takes the first batch (it sizes the
    slots) before the welcome goes out; a consumer gone by then (the
    welcome's send fails) took that batch with it."""
    import json
    import socket

    from blobfeed.service.wire import PROTOCOL

    with big_served() as server:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(server.address)
        s.send(json.dumps({"t": "hello", "protocol": PROTOCOL, "source": "train", "blobs": ["id", "x"],
                           "batch_size": BATCH, "index": None, "num": None, "pid": os.getpid()}).encode())
        s.close()  # before the welcome
        got = drain_ids(server)
    assert sorted(got) == feeds.all_ids(2)


def test_only_batches_run_returned_wait_for_a_departed_process_and_on_one_descriptor() -> None:
    """Found by review: every batch a detaching consumer had been sent was
    parked until its process exited, also those its run() never returned
    (they cannot be in the user's hands), and each departure kept a pidfd of
    its own: a process that attached again and again used the arena up and
    piled descriptors.  Now only what run() returned and was not freed
    waits (a net keeps its last batch), on one pidfd per process."""
    with big_served(epochs=None, slots=3) as server:
        arena = server.sources["train"].arena
        fds_before: dict[str, str] = {}
        for cycle in range(5):
            if cycle == 1:  # the arena and the first pidfd are there now
                fds_before = open_descriptors()
            net = blobfeed.Net(None)
            with blobfeed.attach_source(net, ["id", "x"], BATCH, "train", server.address):
                take(net)  # its other slots hold batches sent ahead, never returned
                wait_for(lambda: sum(server.sources["train"].counts.delivered.values()) >= 3 * (cycle + 1),
                         10, "batches sent ahead")
            # its connection's thread done (it closes the socket and the pidfd after the hand-back)
            wait_for(lambda: server.sources["train"].connected == 0 and not server._connections, 10,
                     "the consumer's end seen")
        parked = arena._parked[os.getpid()]
        # at most each net's last batch, which the net still holds (one that
        # came through the consumer's slots, the arena being busy, is not here)
        assert 1 <= len(parked[1]) <= 5
        # Descriptors the collector closes meanwhile may go.  The one that
        # may come is the last net's own slots, when its last batch came
        # through them (the arena busy); a departure's pidfd may not.
        fds_after = open_descriptors()
        came = [t for _, t in set(fds_after.items()) - set(fds_before.items())]
        assert len(came) <= 1 and all(t.startswith("/memfd:blobfeed-train-batches") for t in came), came
        assert [t for t in fds_after.values() if t == "anon_inode:[pidfd]"] == ["anon_inode:[pidfd]"]


def test_a_consumer_s_descriptor_above_1023_is_watched_all_the_same() -> None:
    """Found by review: parked processes were watched with select(), which
    refuses descriptors past 1023: a busy service's next batch failed its
    source with ValueError."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1100:
        pytest.skip(f"the hard descriptor limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1100), hard))
    arena = SourceArena("high", lambda slot_bytes: 1)
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    filler: list[int] = []
    try:
        while not filler or filler[-1] < 1030:
            filler.append(os.dup(0))
        root = arena.take(100)
        assert root is not None
        pidfd = consumer_pidfd(child.pid)
        assert pidfd > 1023
        arena.park(child.pid, pidfd, [root])
        del root
        assert arena.take(100) is None  # watched, still alive
        child.communicate(timeout=10)
        assert arena.take(100) is not None
    finally:
        for fd in filler:
            os.close(fd)
        child.kill()
        child.wait(10)
        arena.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_consumer_refuses_shared_memory_that_can_shrink() -> None:
    """A hostile service could truncate unsealed memory under a consumer's
    views (SIGBUS in the consumer): slots and arena must come sealed."""
    fd = os.memfd_create("unsealed")
    try:
        os.ftruncate(fd, 8192)
        with pytest.raises(WireError, match="can shrink"):
            ConsumerMapping(fd, 2, 4096, lambda ref: None)
        m = _consumer_mapping()
        with pytest.raises(WireError, match="an arena that can shrink"):
            m.add_arena([fd], 1, 0, 2, 4096, "svc")
        m.close()
    finally:
        os.close(fd)


def test_a_stopped_server_kept_by_its_caller_lets_go_of_its_arena() -> None:
    """stop() closed the arena's descriptor, but its mapping (and the
    mapping's own descriptor) stayed while the server object lived, since
    batches still viewed it at the stop: a notebook that kept each stopped
    server grew by the arena's memory and a descriptor per run."""
    kept = []
    for _ in range(2):
        server = big_served(epochs=None)
        net = blobfeed.Net(None)
        with blobfeed.attach_source(net, ["id", "x"], BATCH, "train", server.address):
            for _ in range(6):
                take(net)
        del net
        assert server.stop()
        kept.append(server)
        del server
        wait_for(lambda: not _mappings("blobfeed-train-batches")
                 and not any("blobfeed-train-batches" in what for what in open_descriptors().values()),
                 10, "the arena unmapped and its descriptors closed")
