"""The feeding service with real processes and real sockets (issue 18).

Consumers are separate Python processes (tests/service/consumer_proc.py)
that write one JSON line per batch their ``run()`` returned; every wait is
bounded.
"""

from __future__ import annotations

import array
import contextlib
import gc
import json
import re
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import blobfeed
from blobfeed.service import FeedServer

from . import feeds

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
CONSUMER = [sys.executable, str(HERE / "consumer_proc.py")]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def consumer(address: str, out: Path, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([*CONSUMER, address, str(out), *args], env=ENV, stderr=subprocess.PIPE)


class Codes(list):
    """Exit codes that show the consumers' stderr when a comparison fails."""

    def __init__(self, codes: list[int], errs: list[str]) -> None:
        super().__init__(codes)
        self.errs = errs

    def __eq__(self, other: object) -> bool:
        same = list(self) == other
        if not same:
            print("\n".join(e[-3000:] for e in self.errs))
        return same


def finish(procs: list[subprocess.Popen[bytes]], timeout: float = 90.0) -> Codes:
    deadline = time.monotonic() + timeout
    codes, errs = [], []
    for p in procs:
        try:
            _, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"a consumer did not end within {timeout} s") from None
        codes.append(p.returncode)
        errs.append((err or b"").decode(errors="replace"))
    return Codes(codes, errs)


def lines(out: Path) -> list[dict]:
    return [json.loads(x) for x in out.read_text().splitlines() if x.strip()]


def batches(out: Path) -> list[list[int]]:
    return [r["ids"] for r in lines(out) if "ids" in r]


def wait_for(pred, timeout: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def served(workers: int = 2, name: str = "train", **kw) -> FeedServer:
    server = FeedServer()
    server.serve_source(name, ["id", "x"], feeds.Fetch(), 8, workers, **kw)
    return server.start()


def local_streams(nets: int, workers_per_net: int, calls: int = feeds.CALLS, **kw) -> list[list[list[int]]]:
    """What ``nets`` nets in one process get from the same source (the reference)."""
    gc = blobfeed.GlobalCoordinator()
    ns = [blobfeed.Net(None, name=f"n{i}") for i in range(nets)]
    for net in ns:
        blobfeed.init_data_input_workers(
            net, ["id", "x"], feeds.Fetch(calls), 8, workers_per_net, coordinator=gc, timeout=20, **kw
        )
    gc.start()
    got: list[list[list[int]]] = [[] for _ in ns]
    import threading

    def drain(i: int) -> None:
        while True:
            try:
                got[i].append(ns[i].run()["id"].tolist())
            except blobfeed.EndOfEpoch:
                continue
            except blobfeed.EndOfInput:
                return

    ts = [threading.Thread(target=drain, args=(i,)) for i in range(nets)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert gc.stop()
    return got


def test_by_index_exactly_once_and_equal_to_four_nets_in_one_process(tmp_path: Path) -> None:
    with served(4, deterministic=True, num_consumers=4) as server:
        outs = [tmp_path / f"c{i}.jsonl" for i in range(4)]
        procs = [consumer(server.address, outs[i], "--index", str(i), "--num", "4") for i in range(4)]
        assert finish(procs) == [0] * 4
    streams = [batches(o) for o in outs]
    flat = [i for s in streams for b in s for i in b]
    assert sorted(flat) == feeds.all_ids(4)
    assert streams == local_streams(4, 1, deterministic=True)
    assert all(lines(o)[-1] == {"end": "input"} for o in outs)


@pytest.mark.parametrize("by_index", [True, False])
def test_batches_go_from_the_dealer_to_each_sender_with_no_enqueuer_between(
    tmp_path: Path, by_index: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each connection's sender assembles the batches it sends straight
    from the dealer: the service runs no enqueuer thread (one per consumer
    index before) and its readers hold no device queue of batches."""
    seen: list[str] = []
    start = threading.Thread.start

    def recorded(self: threading.Thread) -> None:  # every thread started, however short-lived
        seen.append(self.name)
        start(self)

    monkeypatch.setattr(threading.Thread, "start", recorded)
    kw: dict[str, Any] = dict(deterministic=True, num_consumers=2) if by_index else {}
    with served(2, **kw) as server:
        outs = [tmp_path / f"c{i}.jsonl" for i in range(2)]
        args = [["--index", str(i), "--num", "2"] if by_index else [] for i in range(2)]
        procs = [consumer(server.address, outs[i], *args[i]) for i in range(2)]
        assert finish(procs) == [0] * 2
    assert sorted(i for o in outs for b in batches(o) for i in b) == feeds.all_ids(2)
    assert any(n.startswith("blobfeed-service-send") for n in seen), seen
    assert not [n for n in seen if n.startswith("blobfeed-enqueue")], seen


def test_first_come_exactly_once_across_four_consumers(tmp_path: Path) -> None:
    with served(2) as server:
        outs = [tmp_path / f"c{i}.jsonl" for i in range(4)]
        procs = [consumer(server.address, o) for o in outs]
        assert finish(procs) == [0] * 4
        counts = server.sources["train"].counts
        assert sum(counts.acknowledged.values()) == sum(len(batches(o)) for o in outs)
    flat = [i for o in outs for b in batches(o) for i in b]
    assert sorted(flat) == feeds.all_ids(2)


def test_equal_shares_drop_the_incomplete_round(tmp_path: Path) -> None:
    with served(2, deterministic=True, num_consumers=3, equal=True, epochs=2) as server:
        outs = [tmp_path / f"c{i}.jsonl" for i in range(3)]
        procs = [consumer(server.address, outs[i], "--index", str(i)) for i in range(3)]
        assert finish(procs) == [0] * 3
        dropped = server.registry.get_sample_value(
            "blobfeed_dropped_samples_total", {"source": "train", "reason": "equal"}
        )
    per_epoch = []
    for o in outs:
        counts, n = [], 0
        for r in lines(o):
            if "ids" in r:
                n += 1
            elif "epoch_end" in r or r.get("end") == "input":
                counts.append(n)
                n = 0
        per_epoch.append(counts)
    assert per_epoch[0] == per_epoch[1] == per_epoch[2], per_epoch
    total = sum(len(batches(o)) for o in outs)
    samples = sum(len(b) for o in outs for b in batches(o))
    # 2 epochs: every sample but the dropped ones reached one consumer
    per_epoch_batches = -(-len(feeds.all_ids(2)) // 8)
    assert per_epoch_batches % 3 != 0  # so a round is incomplete
    assert total == 2 * (per_epoch_batches - per_epoch_batches % 3)
    assert samples + dropped == 2 * len(feeds.all_ids(2))


def test_equal_and_deterministic_over_epochs_deal_what_nets_in_one_process_get(tmp_path: Path) -> None:
    """equal=True, deterministic=True, 3 consumers, 2 epochs of 19 batches
    (an incomplete last round): every epoch starts its rounds at consumer
    0, as for 3 nets in one process.  The service did equal shares on its
    own, over an inner stream dealt without equal, so the dropped batch
    shifted epoch 1 by one: consumer k got what local net k + 1 gets."""
    server = FeedServer()
    server.serve_source("train", ["id", "x"], feeds.Fetch(10), 8, 3, deterministic=True, num_consumers=3,
                        equal=True, epochs=2)
    with server.start():
        outs = [tmp_path / f"c{i}.jsonl" for i in range(3)]
        procs = [consumer(server.address, outs[i], "--index", str(i), "--num", "3") for i in range(3)]
        assert finish(procs) == [0] * 3
    reference = local_streams(3, 1, calls=10, deterministic=True, equal=True, epochs=2)
    assert -(-len(feeds.all_ids(3, 10)) // 8) % 3 == 1  # an incomplete last round each epoch
    for i in range(3):
        assert batches(outs[i]) == reference[i], i


def test_a_killed_consumer_s_batches_go_to_the_others(tmp_path: Path) -> None:
    with served(2) as server:
        outs = [tmp_path / f"c{i}.jsonl" for i in range(3)]
        dying = consumer(server.address, outs[0], "--die-after", "3")
        assert finish([dying]) == [-signal.SIGKILL]
        procs = [consumer(server.address, o) for o in outs[1:]]
        assert finish(procs) == [0, 0]
        redealt = sum(server.sources["train"].counts.redealt.values())
    flat = [i for o in outs for b in batches(o) for i in b]
    assert sorted(flat) == feeds.all_ids(2)
    assert redealt > 0  # it died holding prefetched batches


def test_a_killed_consumer_index_re_attaches_and_the_stream_goes_on_exactly(tmp_path: Path) -> None:
    with served(2, deterministic=True, num_consumers=2) as server:
        first, second, other = (tmp_path / n for n in ("first.jsonl", "second.jsonl", "other.jsonl"))
        dying = consumer(server.address, first, "--index", "1", "--die-after", "4")
        peer = consumer(server.address, other, "--index", "0")
        assert finish([dying]) == [-signal.SIGKILL]
        again = consumer(server.address, second, "--index", "1")
        assert finish([peer, again]) == [0, 0]
    reference = local_streams(2, 1, deterministic=True)
    # the reference wires 2 workers as 2 calls of 1: the same worker ids, the same stream
    assert batches(first) + batches(second) == reference[1]
    assert batches(other) == reference[0]


def test_a_consumer_index_that_does_not_come_back_fails_the_source_naming_it(tmp_path: Path) -> None:
    # 4 slots: the peer must not have taken its whole stream before the grace period is over
    with served(2, deterministic=True, num_consumers=2, grace_period=0.5, slots=4) as server:
        dying = consumer(server.address, tmp_path / "d.jsonl", "--index", "1", "--die-after", "2")
        peer = consumer(server.address, tmp_path / "p.jsonl", "--index", "0")
        assert finish([dying]) == [-signal.SIGKILL]
        assert finish([peer]) == [4]
    end = lines(tmp_path / "p.jsonl")[-1]
    assert end["end"] == "error" and end["type"] == "FetcherError"
    assert "consumer 1 left and did not come back within 0.5 s" in end["error"]


def _serve_cli(tmp_path: Path, *extra: str, env: dict | None = None) -> tuple[subprocess.Popen[str], str]:
    sock = str(tmp_path / "feed.sock")
    p = subprocess.Popen(
        [sys.executable, "-m", "blobfeed.apps.cli", "serve", "tests.service.feeds:wire_by_index",
         "--listen", sock, *extra],
        env={**ENV, **(env or {})}, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    assert p.stdout is not None
    line = p.stdout.readline()  # bounded: the server prints it once listening, or exits
    assert "listening on" in line, (line, p.stderr.read() if p.poll() is not None else "")
    return p, sock


def consumers_learn_of_the_end(p: subprocess.Popen[bytes], address: str, tmp_path: Path, sig: int) -> None:
    """Two consumers of the service ``p`` (at ``address``) take batches; ``sig``
    ends the service: each run() raises ServiceError naming it within 1 s."""
    try:
        outs = [tmp_path / f"c{i}.jsonl" for i in range(2)]
        # --timeout 60: a consumer that does not hear of the end would wait a minute
        procs = [consumer(address, outs[i], "--index", str(i), "--timeout", "60") for i in range(2)]
        wait_for(lambda: all(o.exists() and len(lines(o)) > 5 for o in outs), what="batches")
        ended_at = time.time()
        p.send_signal(sig)
        assert finish(procs, 30) == [4, 4]
        for o in outs:
            end = lines(o)[-1]
            assert end["type"] == "ServiceError" and address in end["error"], end
            assert end["t"] - ended_at < 1.0
        assert p.wait(30) == (-signal.SIGKILL if sig == signal.SIGKILL else 0)
    finally:
        p.kill()
        p.wait(10)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_consumers_learn_within_a_second_that_the_service_ended(tmp_path: Path, sig: int) -> None:
    p, sock = _serve_cli(tmp_path, env={"N": "2", "BLOBFEED_TEST_CALLS": "100000"})
    consumers_learn_of_the_end(p, sock, tmp_path, sig)
    assert not os.path.exists(sock) or sig == signal.SIGKILL


def resume_is_exact(tmp_path: Path, serve: Any) -> None:
    """``serve(*flags)`` starts ``blobfeed serve`` (2 consumers by index, 2
    epochs) and returns (process, address).  Two consumers take batches,
    SIGTERM saves the state, a service started with ``--resume`` serves the
    rest: each consumer's two parts are its stream of one uninterrupted run."""
    state = tmp_path / "state.json"
    p, address = serve("--state-file", str(state))
    first = [tmp_path / f"a{i}.jsonl" for i in range(2)]
    try:
        # each consumer holds after its 13th batch, mid-epoch, until the service is gone
        procs = [consumer(address, first[i], "--index", str(i), "--hold-after", "13") for i in range(2)]
        wait_for(lambda: all(o.exists() and {"holding": 13} in lines(o) for o in first), what="13 batches each")
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
        for c in procs:
            c.send_signal(signal.SIGUSR1)
        assert finish(procs, 30) == [4, 4]  # their next run(): the service stopped
    finally:
        p.kill()
        p.wait(10)
    saved = json.loads(state.read_text())
    assert saved["version"] == 1 and "train" in saved["sources"]
    p, address = serve("--state-file", str(state), "--resume")
    second = [tmp_path / f"b{i}.jsonl" for i in range(2)]
    try:
        assert finish([consumer(address, second[i], "--index", str(i)) for i in range(2)]) == [0, 0]
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(30)
    reference = local_streams(2, 1, deterministic=True, epochs=2)
    for i in range(2):
        a, b = batches(first[i]), batches(second[i])
        assert a + b == reference[i], (i, len(a), len(b), len(reference[i]), a[-3:], b[:3], saved)


def test_sigterm_saves_the_state_and_a_resumed_service_continues_exactly(tmp_path: Path) -> None:
    resume_is_exact(tmp_path, lambda *flags: _serve_cli(tmp_path, *flags, env={"N": "2", "EPOCHS": "2"}))


@pytest.mark.parametrize("kwargs, expected", [
    (dict(batch_size=16), "is served in batches of 8; the consumer asked for batch_size=16"),
    (dict(input_blob_names=["x", "id"]), "carries blobs ['id', 'x']; the consumer asked for ['x', 'id']"),
    (dict(num_consumers=3), "is dealt to 2 consumers; the consumer asked for num_consumers=3"),
    (dict(consumer_index=2), "the consumer asked for consumer_index=2"),
    (dict(input_source_name="eval"), "this service has no source 'eval'"),
])
def test_bad_attach_arguments_are_a_value_error_at_attach(kwargs: dict, expected: str) -> None:
    with served(2, deterministic=True, num_consumers=2) as server:
        args = dict(input_blob_names=["id", "x"], batch_size=8, input_source_name="train")
        args.update(kwargs)
        with pytest.raises(ValueError, match=expected.replace("[", r"\[").replace("]", r"\]")):
            blobfeed.attach_source(blobfeed.Net(None), address=server.address, **args)


def test_an_index_attached_twice_is_refused(tmp_path: Path) -> None:
    with served(2, deterministic=True, num_consumers=2) as server:
        with blobfeed.attach_source(blobfeed.Net(None), ["id", "x"], 8, "train", server.address, consumer_index=0):
            with pytest.raises(ValueError, match="consumer index 0 is attached already"):
                blobfeed.attach_source(blobfeed.Net(None), ["id", "x"], 8, "train", server.address, consumer_index=0)


def test_a_stranger_sending_garbage_is_refused_and_the_service_keeps_serving(caplog, tmp_path: Path) -> None:
    garbage = [
        b"\x00\xff not json",
        b"[1, 2, 3]",
        json.dumps({"t": "hello", "protocol": 1}).encode(),
        json.dumps({"t": "ack", "g": 0}).encode(),
        json.dumps({"t": "hello", "protocol": 1, "source": "train", "blobs": ["id", "x"], "batch_size": True,
                    "index": None, "num": None, "pid": 1}).encode(),
        b"{" * 70000,
        b"[" * 60000,  # nested deeper than any record may be: no RecursionError
    ]
    # 4 slots: the liar cannot have been sent the whole data set (and its end) before its lie
    with served(2, slots=4) as server:
        for data in garbage:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.settimeout(10)
            s.connect(server.address)
            try:
                s.send(data)
            except OSError:
                pass
            assert s.recv(100) == b""  # closed on us, nothing else said
            s.close()
        # a valid hello, then an acknowledgement of something never sent
        net = blobfeed.Net(None)
        with blobfeed.attach_source(net, ["id", "x"], 8, "train", server.address) as att:
            att._send_waited({"t": "ack", "g": 12345, "slots": []}, lambda: time.monotonic() + 10.0)  # where its acknowledgements go
            with pytest.raises(blobfeed.ServiceError):
                for _ in range(10_000):
                    net.run(timeout=10)
        # the service still serves everything to a well-behaved consumer
        out = tmp_path / "good.jsonl"
        assert finish([consumer(server.address, out)]) == [0]
    assert len(batches(out)) > 0
    warned = [r.getMessage() for r in caplog.records if r.name == "blobfeed.service"]
    assert any("not JSON" in m for m in warned)
    assert any("acknowledged items up to 12345" in m for m in warned)
    assert any("nested deeper than 64" in m for m in warned)
    caplog.clear()  # its records' errors hold the frames that held this consumer's batches


def attach_run_detach(address: str, source: str) -> None:
    """One attach/detach cycle of a consumer in this process: three run()s."""
    net = blobfeed.Net(None)
    with blobfeed.attach_source(net, ["id", "x"], 8, source, address):
        for _ in range(3):
            try:
                net.run(timeout=10)
            except blobfeed.EndOfEpoch:
                pass


def _fds() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return out


def test_twenty_attach_detach_cycles_leave_nothing_behind() -> None:
    import threading

    # this test's own areas, by their source's name: an earlier test's may
    # still be on their way out
    with served(2, name="cycles", epochs=None) as server:
        def cycle() -> None:
            attach_run_detach(server.address, "cycles")

        def plain_fds() -> int:
            return sum("memfd:" not in f for f in _fds())

        def areas() -> int:
            return sum("memfd:blobfeed-cycles-" in f for f in _fds())

        cycle()
        fds, threads = plain_fds(), threading.active_count()
        for _ in range(20):
            cycle()
        wait_for(lambda: plain_fds() <= fds and threading.active_count() <= threads, 10, "cleanup")
        # what the last consumer left unacknowledged waits in its slots for
        # the next one: that area, mapped here by the service and by the
        # consumer, at most (20 cycles without cleanup would hold 21)
        gc.collect()
        assert areas() <= 2
    gc.collect()
    assert areas() == 0
    assert not os.path.exists(server.address)


def test_a_consumer_leaving_while_the_service_stops_leaves_no_slots_mapped(monkeypatch: pytest.MonkeyPatch) -> None:
    """stop() let go of the batches held for re-dealing before a consumer
    that was just leaving had handed its unacknowledged ones back: they
    arrived after, kept its slot area mapped for as long as the server
    object lived (seen in CI as one memfd left after the 20-cycle test)."""
    from blobfeed.service import served as served_mod

    server = served(2, name="leaving", epochs=None)
    release, drop_held = served_mod.ServedSource.release, served_mod.ServedSource.drop_held
    dropped = threading.Event()

    def drop_held_seen(self):  # type: ignore[no-untyped-def]
        dropped.set()
        drop_held(self)

    def release_once_stopping(self, conn, outlet, unacked):  # type: ignore[no-untyped-def]
        # The leaving consumer's hand-back comes late: after stop() let go of
        # what is held, if stop() does not wait for it (given up after 1 s,
        # when stop() waits for this thread instead).
        server._stopping.wait(10)
        dropped.wait(1)
        release(self, conn, outlet, unacked)

    monkeypatch.setattr(served_mod.ServedSource, "release", release_once_stopping)
    monkeypatch.setattr(served_mod.ServedSource, "drop_held", drop_held_seen)
    try:
        net = blobfeed.Net(None)
        att = blobfeed.attach_source(net, ["id", "x"], 8, "leaving", server.address)
        held = [net.run(timeout=10) for _ in range(2)]  # in flight: unacknowledged until the next run()
        att.stop()
        del held, net, att
    finally:
        assert server.stop()
    gc.collect()
    assert sum("memfd:blobfeed-leaving-" in f for f in _fds()) == 0


def test_a_batch_run_took_as_the_service_stops_is_not_returned_unless_the_state_counts_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    """The consumer closed its connection as soon as it was told the service
    stops; a run() that had just taken a batch then could not acknowledge
    it, the saved state did not count it and a resume dealt it again (seen
    in CI: one batch twice across a SIGTERM and --resume).  A run() that
    takes a batch once the consumer was told raises instead of returning
    it (the service saves its state after the consumer's bye)."""
    from blobfeed.feeders import reading as reading_mod

    server = FeedServer(state_file=tmp_path / "state.json")
    server.serve_source("train", ["id", "x"], feeds.Fetch(), 8, 2, epochs=None)
    server.start()
    net = blobfeed.Net(None)
    att = blobfeed.attach_source(net, ["id", "x"], 8, "train", server.address)
    returned = reading_mod._InletReader.returned
    late = threading.Event()

    def returned_after_the_stop(self):  # type: ignore[no-untyped-def]
        if late.is_set():
            # the batch was taken; the service's "stopped" comes before its acknowledgement
            stopper = threading.Thread(target=server.stop)
            stopper.start()
            wait_for(lambda: att.inlet.error is not None, 10, "the consumer told of the stop")
            returned(self)
            stopper.join(10)
        else:
            returned(self)

    monkeypatch.setattr(reading_mod._InletReader, "returned", returned_after_the_stop)
    try:
        got = [net.run(timeout=10) for _ in range(3)]
        late.set()
        with pytest.raises(blobfeed.ServiceError, match="this batch is not handed out"):
            net.run(timeout=10)
    finally:
        att.stop()
        server.stop()  # waits for the stop the patched returned() began
    assert sum(server.sources["train"].counts.acknowledged.values()) == len(got) == 3


def test_a_second_stop_waits_for_the_first_to_finish(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """stop() says True once every thread ended; a stop() called while
    another was under way returned True at once, before the first had even
    saved the state (CI: a test read the acknowledged counts after it, and
    found them empty)."""
    server = FeedServer(state_file=tmp_path / "state.json")
    server.serve_source("train", ["id", "x"], feeds.Fetch(), 8, 2, epochs=None)
    server.start()
    saving, release = threading.Event(), threading.Event()
    save = server.save_state

    def slow_save() -> bool:
        saving.set()
        assert release.wait(10)
        return save()

    monkeypatch.setattr(server, "save_state", slow_save)
    first = threading.Thread(target=server.stop)
    first.start()
    second: list[bool] = []
    waiter = threading.Thread(target=lambda: second.append(server.stop()))
    try:
        assert saving.wait(10), "the first stop() never reached its save"
        waiter.start()
        waiter.join(0.3)
        assert not second, "a second stop() returned while the first was still saving"
    finally:
        release.set()
        first.join(10)
    waiter.join(10)
    assert second == [True]


@pytest.mark.parametrize("role", ["recv", "send"])
def test_a_thread_that_cannot_start_closes_one_connection_not_the_service(
    monkeypatch: pytest.MonkeyPatch, role: str,
) -> None:
    """Out of threads (a container's pids.max), the accept thread died of
    the receiver's failed start ("can't start new thread"): no consumer
    could attach any more, and stop() raised joining the thread that never
    started, before it saved the state.  A sender that cannot start failed
    the same way, from the receiver.  Now only that connection goes."""
    server = FeedServer()
    server.serve_source("train", ["id", "x"], feeds.Fetch(), 8, 2, epochs=None)
    server.start()
    start = threading.Thread.start
    failed: list[str] = []

    def start_or_fail(self: threading.Thread) -> None:
        if self.name.startswith(f"blobfeed-service-{role}-") and not failed:
            failed.append(self.name)
            raise RuntimeError("can't start new thread")
        start(self)

    monkeypatch.setattr(threading.Thread, "start", start_or_fail)
    try:
        with pytest.raises(blobfeed.ServiceError):
            # refused at its attach (no receiver), or at its first run() (no sender)
            first_net = blobfeed.Net(None)
            first = blobfeed.attach_source(first_net, ["id", "x"], 8, "train", server.address, timeout=10)
            try:
                first_net.run(timeout=10)
            finally:
                first.stop()
        assert failed
        net = blobfeed.Net(None)
        with blobfeed.attach_source(net, ["id", "x"], 8, "train", server.address, timeout=10):
            assert net.run(timeout=10)["id"].shape == (8,)
    finally:
        monkeypatch.setattr(threading.Thread, "start", start)
        assert server.stop()


def test_a_stop_called_from_inside_a_stop_returns_at_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A signal handler that calls stop() runs in whatever thread the signal
    lands in, maybe the one that is stopping already: it must not wait for
    itself (60 s)."""
    server = FeedServer(state_file=tmp_path / "state.json")
    server.serve_source("train", ["id", "x"], feeds.Fetch(), 8, 2, epochs=None)
    server.start()
    inner: list[tuple[bool, float]] = []
    save = server.save_state

    def save_and_stop_again() -> bool:
        t0 = time.monotonic()
        inner.append((server.stop(), time.monotonic() - t0))
        return save()

    monkeypatch.setattr(server, "save_state", save_and_stop_again)
    assert server.stop()
    assert len(inner) == 1 and inner[0][0] is False and inner[0][1] < 1.0, inner
    assert server.stop()  # and once it ended, what it returned


def test_an_acknowledgement_sent_just_before_the_consumer_died_with_batches_unread_counts(tmp_path: Path) -> None:
    """A consumer killed with batches unread in its socket resets the
    connection, and Linux reports the reset before the records it sent last:
    the service took the reset for the end and lost the acknowledgement of a
    batch run() had returned (it was dealt again: seen as a duplicate in the
    killed-consumer tests once more slots were in flight)."""

    with served(2, slots=4) as server:
        s, fds = hand_hello(server.address)  # the welcome, and the slots with their descriptor
        for fd in fds:
            os.close(fd)
        record = json.loads(s.recv(1 << 16))
        first = record["items"][0][0] if record["t"] == "batches" else record["g"]
        # the service fills the other slots meanwhile: they stay unread
        wait_for(lambda: sum(server.sources["train"].counts.delivered.values()) >= 4, 10, "the slots filled")
        s.send(json.dumps({"t": "ack", "g": first, "slots": [], "waited": 0.0}).encode())
        s.close()  # as a SIGKILL would, with batches unread
        wait_for(lambda: server.sources["train"].connected == 0, 10, "the consumer's end seen")
        assert sum(server.sources["train"].counts.acknowledged.values()) == 1


def test_a_consumer_that_leaves_with_batches_unacknowledged_leaves_no_slots_mapped() -> None:
    """What it had not acknowledged is copied out of its slots for the next
    consumer: the service kept views of the slots instead, so with many
    slots in flight, batches left by several consumers kept each one's whole
    area mapped until dealt again (the 20-cycle test saw 3 areas)."""
    with served(2, name="leaver", epochs=None) as server:
        net = blobfeed.Net(None)
        with blobfeed.attach_source(net, ["id", "x"], 8, "leaver", server.address):
            net.run(timeout=10)
            wait_for(lambda: sum(server.sources["leaver"].counts.delivered.values()) >= 3, 10, "batches in flight")
        del net
        wait_for(lambda: server.sources["leaver"].connected == 0, 10, "the consumer's end seen")
        gc.collect()
        assert len(server.sources["leaver"].shared.redeal) >= 1  # re-dealt later, from copies
        wait_for(lambda: not any("memfd:blobfeed-leaver-" in f for f in _fds()), 10, "the slots unmapped")


def test_a_batch_layout_checked_once_is_still_checked_against_each_record() -> None:
    """The consumer remembers the [dtype, shape, offset] it checked; a later
    record that lies (another sample count, an offset past the slot, a shape
    dressed as something else) is refused all the same."""
    from blobfeed.service.slots import ConsumerMapping
    from blobfeed.service.wire import WireError

    from blobfeed.service.slots import sealed_memfd

    fd, mm = sealed_memfd("layout-test", 4 * 1024)
    try:
        m = ConsumerMapping(fd, 4, 1024, lambda ref: None)
    finally:
        os.close(fd)
        mm.close()
    good = [["<f8", [8, 3], 0], ["<i8", [8], 192]]
    a, b = m.views(1, 8, good, "svc")
    assert a.shape == (8, 3) and b.shape == (8,) and not a.flags.writeable
    del a, b
    for n, meta, what in [
        (7, good, "for 7 samples"),
        (8, [["<f8", [8, 3], 1024], good[1]], "do not fit"),
        (8, [["<f8", {8: 0, 3: 0}, 0], good[1]], "must be [dtype, shape, offset]"),
        (8, [["<f8", [8, 3], 0, 0], good[1]], "must be [dtype, shape, offset]"),
        (8, [["|O8", [8, 3], 0], good[1]], "not a plain number type"),
        (8, [["<f8", [8, True], 0], good[1]], "bad shape"),
        (8, [["<f8", [8, 3], 0.0], good[1]], "must be [dtype, shape, offset]"),
    ]:
        with pytest.raises(WireError, match=re.escape(what)):
            m.views(2, n, meta, "svc")
    m.close()


def test_a_consumer_of_another_protocol_is_refused_naming_both() -> None:
    """Protocol 8 changed the records (a state request carries its number,
    which the answer names; 7: on a Unix socket the hello may carry a
    stream for the consumer's acknowledgements; 6: a batch may lie in any of several
    shared regions, each named by an id; 5: the slots are offered before the
    first batch, sized by it; 4: acks carry the consumer's wait; 3: batches
    in the source's arena; 2: batches together, cumulative acks carrying
    the freed slots): a peer of an older protocol is told so, not fed."""
    from blobfeed.service.wire import PROTOCOL

    assert PROTOCOL == 8
    with served(2) as server:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(10)
        s.connect(server.address)
        s.send(json.dumps({"t": "hello", "protocol": 7, "source": "train", "blobs": ["id", "x"],
                           "batch_size": 8, "index": None, "num": None, "pid": os.getpid()}).encode())
        reply = json.loads(s.recv(1 << 16))
        s.close()
    assert reply["t"] == "refused"
    assert "protocol 7 (this service speaks 8): upgrade blobfeed on one side" in reply["error"]


def hand_hello(address: str, index: int | None = None, batch_size: int = 8) -> tuple[socket.socket, list[int]]:
    """Attach by hand (as consumer ``index``; None: first come): the socket
    after the welcome and the ``slots`` record (it comes before the first
    batch), and the descriptors that came with it (the caller's)."""
    from blobfeed.service.wire import PROTOCOL

    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(10)
    s.connect(address)
    s.send(json.dumps({"t": "hello", "protocol": PROTOCOL, "source": "train", "blobs": ["id", "x"],
                       "batch_size": batch_size, "index": index, "num": None, "pid": os.getpid()}).encode())
    data, ancdata, _, _ = s.recvmsg(1 << 16, socket.CMSG_SPACE(16))
    assert json.loads(data)["t"] == "welcome" and not ancdata
    data, ancdata, _, _ = s.recvmsg(1 << 16, socket.CMSG_SPACE(16))
    assert json.loads(data)["t"] == "slots"
    fds = [int.from_bytes(d[k:k + 4], sys.byteorder) for _l, _k, d in ancdata for k in range(0, len(d) - len(d) % 4, 4)]
    return s, fds


def test_a_consumer_cannot_shrink_or_write_the_shared_memory_it_is_handed(tmp_path: Path) -> None:
    """A consumer is handed the descriptor of the memory its batches are
    written into.  Unsealed, a hostile one truncated it and the service died
    of SIGBUS at its next write (every consumer with it), or mapped it
    writable and changed batches under the service.  The memory is sealed:
    its size is fixed, and nobody but the service may write it."""
    import mmap

    p, sock = _serve_cli(tmp_path, env={"N": "2", "BLOBFEED_TEST_CALLS": "100000"})
    try:
        s, fds = hand_hello(sock, 0)
        assert fds, "the welcome carries the slots' descriptor"
        size = os.fstat(fds[0]).st_size
        with pytest.raises(PermissionError):
            os.ftruncate(fds[0], 0)
        with pytest.raises(PermissionError):
            mmap.mmap(fds[0], size)  # writable
        with pytest.raises(PermissionError):
            os.pwrite(fds[0], b"x", 0)
        assert os.fstat(fds[0]).st_size == size
        for fd in fds:
            os.close(fd)
        s.close()
        # the service still serves (it wrote into the hostile consumer's slots meanwhile)
        outs = [tmp_path / f"good{i}.jsonl" for i in range(2)]
        procs = [consumer(sock, outs[i], "--index", str(i), "--max-batches", "20") for i in range(2)]
        assert finish(procs) == [0, 0]
        assert [len(batches(o)) for o in outs] == [20, 20]
        assert p.poll() is None
    finally:
        p.kill()
        p.wait(10)


@pytest.mark.parametrize("deterministic", [False, True])
def test_dealt_by_index_a_share_follows_the_speed_unless_deterministic(deterministic: bool) -> None:
    """num_consumers gives each index a net of its own.  Without
    deterministic=True each takes the source's chunks as they come (as n
    nets in one process): a rank that runs alone takes most batches.  With
    it, batch i goes to consumer i % n: the rank alone gets its own batches,
    then nothing until the other takes its turn."""
    # 3 slots: what rank 0's connection takes ahead of its run() is small (~5 of ~50 batches)
    with served(2, num_consumers=2, slots=3, deterministic=deterministic) as server:
        nets = [blobfeed.Net(None, name=f"rank{i}") for i in range(2)]
        atts = [blobfeed.attach_source(nets[i], ["id", "x"], 8, "train", server.address, consumer_index=i)
                for i in range(2)]
        try:
            got: list[list[list[int]]] = [[], []]
            with pytest.raises(blobfeed.DequeueTimeout if deterministic else blobfeed.EndOfInput):
                for _ in range(100):
                    got[1].append(nets[1].run(timeout=0.5 if deterministic else 20)["id"].tolist())
            alone = len(got[1])

            def drain(i: int) -> None:  # each rank in its own thread, as each in its process
                while True:
                    try:
                        got[i].append(nets[i].run(timeout=20)["id"].tolist())
                    except blobfeed.EndOfInput:
                        return

            threads = [threading.Thread(target=drain, args=(i,)) for i in range(2 if deterministic else 1)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert not any(t.is_alive() for t in threads)
        finally:
            for a in atts:
                a.stop()
    total = len(got[0]) + len(got[1])
    if deterministic:
        assert 0 < alone <= 12 and abs(len(got[0]) - len(got[1])) <= 1
    else:
        assert alone > total // 2 + 5
    assert sorted(i for g in got for b in g for i in b) == feeds.all_ids(2)


def test_a_source_ended_by_the_service_s_stop_reaches_the_consumer_as_stopped() -> None:
    """When the stop ends the inner nets' feeds before the connection told
    its consumer "stopped", the sender hands on the end it dequeued: it went
    out as a worker's error ("fetcher", the consumer raised FetcherError
    with a queue's message) instead of the service's stop."""
    from blobfeed.service.connection import Connection
    from blobfeed.service.served import _dequeue

    class Reader:
        def ready(self) -> int:
            return 1

        def read(self, timeout: float) -> None:
            raise blobfeed.EndOfInput("queue 'train/consumer-0' is closed and drained")

    source = type("S", (), {"error": None, "stopped": True, "name": "train"})()
    end = _dequeue(source, Reader(), 0.1)  # type: ignore[arg-type]
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn = Connection(a, 0, lambda name: None, dict, "service at x")
        conn._end(end)
        record = json.loads(b.recv(1 << 16))
    finally:
        a.close()
        b.close()
    assert record["kind"] == "stopped" and "the service stopped" in record["error"]


# -- the slots' size comes from the first real batch (issue 24, item 2) -------------------

CARRIERS = [None, "tcp://127.0.0.1:0"]


def items_of(net: blobfeed.Net, limit: int = 100, timeout: float = 20.0) -> list[Any]:
    """What ``net.run()`` gives until EndOfInput: each batch's ids (its rows
    checked: x holds the id), ``"epoch"`` for an EndOfEpoch."""
    got: list[Any] = []
    for _ in range(limit):
        try:
            out = net.run(timeout=timeout)
        except blobfeed.EndOfEpoch:
            got.append("epoch")
            continue
        except blobfeed.EndOfInput:
            return got
        assert (out["x"] == out["id"][:, None]).all()
        got.append(out["id"].tolist())
    raise AssertionError(f"no end after {limit} items: {got}")


@pytest.mark.parametrize("listen", CARRIERS)
def test_a_consumer_welcomed_before_the_first_batch_gets_slots_of_its_size(listen: str | None) -> None:
    """The first chunk takes longer than grace_period: the consumer was
    welcomed before the service had seen a batch, with slots of 64 bytes,
    and failed on the first one ("192 bytes at offset 64 do not fit a slot
    of 64")."""
    with FeedServer(listen) as server:
        server.serve_source("train", ["id", "x"], feeds.EpochSizes([3], first_delay=1.0), 8, 1, grace_period=0.2)
        server.start()
        net = blobfeed.Net(None)
        with blobfeed.attach_source(net, ["id", "x"], 8, "train", server.address):
            assert items_of(net) == [list(range(0, 8)), list(range(8, 16)), list(range(16, 24))]


@pytest.mark.parametrize("listen", CARRIERS)
@pytest.mark.parametrize("upto", ["epoch", "end"])
def test_a_service_resumed_at_an_epoch_s_end_or_the_data_s_end_serves_on(
    tmp_path: Path, listen: str | None, upto: str,
) -> None:
    """A state saved at an epoch's end: the resumed service's first item is
    the EndOfEpoch, its consumer was welcomed with slots of 64 bytes and
    failed at the next epoch's first batch (a SIGTERM on an epoch boundary
    broke every resume).  At the data's end, the first item is the end."""
    state = tmp_path / "state.json"

    def serve(resume: bool) -> FeedServer:
        server = FeedServer(listen, state_file=state, resume=resume)
        server.serve_source("train", ["id", "x"], feeds.EpochSizes([2]), 8, 1, deterministic=True,
                            num_consumers=1, epochs=2)
        return server.start()

    first_part = [list(range(0, 8)), list(range(8, 16))]
    second_part = [list(range(1000, 1008)), list(range(1008, 1016))]
    with serve(False) as server:
        net = blobfeed.Net(None)
        with blobfeed.attach_source(net, ["id", "x"], 8, "train", server.address):
            got = [net.run(timeout=20)["id"].tolist() for _ in range(2)]
            if upto == "end":
                with pytest.raises(blobfeed.EndOfEpoch):
                    net.run(timeout=20)
                got += [net.run(timeout=20)["id"].tolist() for _ in range(2)]
    assert got == (first_part if upto == "epoch" else first_part + second_part)
    with serve(True) as server:
        net = blobfeed.Net(None)
        with blobfeed.attach_source(net, ["id", "x"], 8, "train", server.address):
            rest = items_of(net)
    assert rest == (["epoch", *second_part] if upto == "epoch" else [])


@pytest.mark.parametrize("listen", CARRIERS)
def test_consumers_whose_first_batch_equal_drops_get_the_next_ones(listen: str | None) -> None:
    """equal=True, an epoch of one batch for two consumers: that batch is
    dropped, so each consumer's first item is the epoch's end; both were
    welcomed with slots of 64 bytes and failed at the next epoch."""
    with FeedServer(listen) as server:
        server.serve_source("train", ["id", "x"], feeds.EpochSizes([1, 2]), 8, 1, deterministic=True,
                            num_consumers=2, equal=True, epochs=2)
        server.start()
        nets = [blobfeed.Net(None, name=f"rank{i}") for i in range(2)]
        atts = [blobfeed.attach_source(nets[i], ["id", "x"], 8, "train", server.address, consumer_index=i)
                for i in range(2)]
        got: list[Any] = [None, None]
        errors: list[BaseException] = []

        def drain(i: int) -> None:
            try:
                got[i] = items_of(nets[i])
            except BaseException as err:  # shown below
                errors.append(err)

        threads = [threading.Thread(target=drain, args=(i,)) for i in range(2)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
        finally:
            for a in atts:
                a.stop()
        assert not errors, errors
        dropped = server.registry.get_sample_value(
            "blobfeed_dropped_samples_total", {"source": "train", "reason": "equal"}
        )
        assert dropped == 8  # epoch 0's one batch
    assert sorted(got) == [["epoch", list(range(1000, 1008))], ["epoch", list(range(1008, 1016))]]


# -- what a consumer checks of a batch, whatever carries it (issue 24) --------------------


class FakeUnixService:
    """A Unix-socket 'service' that welcomes one consumer, offers it slots
    (a sealed memfd of ``slots`` x ``slot_bytes``), then sends ``records``
    (each a record, or a record and the descriptors sent with it) and stays
    until the consumer leaves."""

    def __init__(self, path: Path, records: list[Any], slots: int = 3, slot_bytes: int = 1024) -> None:
        from blobfeed.service.slots import sealed_memfd

        self.address = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.bind(self.address)
        self.sock.listen(1)
        self.sock.settimeout(10)
        self.records = records
        self.slots, self.slot_bytes = slots, slot_bytes
        self.fd, self.mm = sealed_memfd("fake-slots", slots * slot_bytes)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            conn.settimeout(10)
            # its hello, and the stream its acknowledgements go to: kept open
            # (read or not) as a service keeps it, so that they can be sent
            _, ancdata, _, _ = conn.recvmsg(1 << 16, socket.CMSG_SPACE(16))
            kept = [socket.socket(fileno=int.from_bytes(d[k:k + 4], sys.byteorder))
                    for _l, _k, d in ancdata for k in range(0, len(d) - len(d) % 4, 4)]
            conn.send(json.dumps({"t": "welcome", "consumer": 0, "slots": self.slots, "epoch": 0,
                                  "service": self.address}).encode())
            conn.sendmsg([json.dumps({"t": "slots", "slots": self.slots, "slot_bytes": self.slot_bytes}).encode()],
                         [(socket.SOL_SOCKET, socket.SCM_RIGHTS, self.fd.to_bytes(4, sys.byteorder))])
            for r in self.records:
                if isinstance(r, tuple):  # (a record, descriptors sent with it)
                    conn.sendmsg([r[0]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", r[1]))])
                else:
                    conn.send(r)
            try:
                while (data := conn.recv(1 << 16)):
                    if b'"bye"' in data and json.loads(data).get("t") == "bye":
                        break  # as a service answers a bye: it closes (the consumer's stop() waits for that)
                    self.heard(conn, data)
            except OSError:
                pass
            finally:
                for k in kept:
                    k.close()

    def heard(self, conn: socket.socket, data: bytes) -> None:
        """A record the consumer sent on the connection (ignored here)."""

    def close(self) -> None:
        self.sock.close()
        self.thread.join(10)
        os.close(self.fd)
        self.mm.close()


def fake_service_error(tmp_path: Path, records: list[bytes], match: str, runs: int = 1,
                       **fake: Any) -> blobfeed.ServiceError:
    """A consumer (blobs id and x, batch_size 8) attached to a
    FakeUnixService sending ``records``: within ``runs`` calls of run(),
    a ServiceError matching ``match``, returned."""
    service = FakeUnixService(tmp_path / "fake.sock", records, **fake)
    net = blobfeed.Net(None)
    try:
        with blobfeed.attach_source(net, ["id", "x"], 8, "train", service.address, timeout=10):
            with pytest.raises(blobfeed.ServiceError, match=match) as info:
                for _ in range(runs):
                    net.run(timeout=10)
        return info.value
    finally:
        service.close()


def batches_record(*entries: list[Any]) -> bytes:
    return json.dumps({"t": "batches", "items": list(entries)}).encode()


ID8, X8 = ["<i8", [8], 0], ["<f4", [8, 3], 64]


@pytest.mark.parametrize("records, expected", [
    ([batches_record([0, 0, 8, [ID8]])], "a batch of 1 arrays; the consumer attached with 2 blobs"),
    ([batches_record([0, 0, 8, [ID8, X8, ["<f4", [8], 192]]])], "a batch of 3 arrays; the consumer attached with 2"),
    ([batches_record([0, 0, 9, [["<i8", [9], 0], ["<f4", [9, 3], 128]]])],
     "a batch of 9 samples; this consumer attached with batch_size=8"),
    # empty, so 0 bytes, but no array numpy can make: numpy's bare ValueError came out, unnamed
    ([batches_record([0, 0, 8, [ID8, ["<f4", [8, 0, 10**30], 64]]])],
     f"array 1: bad shape [8, 0, {10**30}] for 8 samples"),
    ([batches_record([0, 0, 8, [ID8, X8]], [1, 1, 8, [ID8, ["<f4", [8, 4], 64]]])],
     "the first batch had [(<i8, ()), (<f4, (3,))]"),
])
def test_a_unix_consumer_checks_a_batch_s_blobs_rows_and_layout_as_tcp_does(
    tmp_path: Path, records: list[bytes], expected: str,
) -> None:
    """A Unix-socket consumer handed out a batch missing a blob, with a blob
    too many, or of 9 rows for batch_size=8 (TCP refused all three): every
    carrier now makes the one check (blobfeed.service.wire.BatchCheck)."""
    err = fake_service_error(tmp_path, records, re.escape(expected), runs=3)
    assert str(tmp_path / "fake.sock") in str(err)


def test_descriptors_with_a_retire_record_are_a_service_error(tmp_path: Path) -> None:
    """Every record but the slots and an arena must come without
    descriptors; a retire took them silently (and closed them)."""
    r, w = os.pipe()
    try:
        fake_service_error(tmp_path, [(json.dumps({"t": "retire", "id": 5}).encode(), [r])],
                           "sent descriptors with a 'retire' record")
    finally:
        os.close(r)
        os.close(w)


def test_unix_slots_offered_over_the_consumer_s_limits_are_a_service_error(tmp_path: Path) -> None:
    """As over TCP: no more slots than the welcome said, no slot over 1 GiB
    per sample of the consumer's batch_size; the memory is not mapped."""
    fake_service_error(tmp_path, [batches_record([0, 0, 8, [ID8, X8]])], "offered slots of 8589938688 bytes",
                       slot_bytes=(8 << 30) + 4096)


# -- a slot freed before its batch is acknowledged (issue 24, item 6) ----------------------


def _records(s: socket.socket) -> Any:
    """The records a hand-made consumer receives (descriptors closed)."""
    while True:
        data, ancdata, _, _ = s.recvmsg(1 << 16, socket.CMSG_SPACE(16))
        for _l, _k, d in ancdata:
            for k in range(0, len(d) - len(d) % 4, 4):
                os.close(int.from_bytes(d[k:k + 4], sys.byteorder))
        if not data:
            return
        yield json.loads(data)


def test_a_consumer_freeing_slots_it_never_acknowledged_cannot_corrupt_the_others() -> None:
    """A lying consumer freed the slots of batches it never acknowledged,
    then left: the service wrote new batches into those slots, and at its
    departure dealt its 'unacknowledged' batches again out of the
    overwritten slots (the honest consumer got 32 samples twice and 48
    never).  A freed slot whose batch is unacknowledged now comes back only
    with the acknowledgement; the batch in it is intact until then."""
    with served(2, slots=4) as server:
        s, fds = hand_hello(server.address)
        for fd in fds:
            os.close(fd)
        s.settimeout(2)  # no more batches within 2 s: its frees were not taken for acknowledgements
        freed = 0
        with contextlib.suppress(TimeoutError):
            for record in _records(s):
                if record["t"] == "end":
                    break
                if record["t"] == "batches":
                    slots = [entry[1] for entry in record["items"]]
                    s.send(json.dumps({"t": "ack", "g": -1, "slots": slots, "waited": 0.0}).encode())
                    freed += len(slots)
                    if freed >= 12:  # three times its slots: rewritten, if the service reused them
                        break
        s.close()
        wait_for(lambda: server.sources["train"].connected == 0, 10, "the liar's departure seen")
        net = blobfeed.Net(None)
        with blobfeed.attach_source(net, ["id", "x"], 8, "train", server.address):
            got = items_of(net)
    flat = [i for b in got if b != "epoch" for i in b]
    assert sorted(flat) == feeds.all_ids(2)


def test_a_consumer_placing_batches_on_a_device_frees_slots_before_it_acknowledges_them() -> None:
    """A net on a GPU copies each batch to the device as it queues it: the
    host views die, and the slot is freed, before run() returns (and
    acknowledges) the batch.  That consumer is honest: it is served to the
    end, every batch once."""
    with served(2, slots=3) as server:
        net = blobfeed.Net(None)
        net._place = lambda arrays: tuple(np.array(a) for a in arrays)  # type: ignore[method-assign]  # a device copy
        with blobfeed.attach_source(net, ["id", "x"], 8, "train", server.address):
            got = items_of(net)
    assert sorted(i for b in got if b != "epoch" for i in b) == feeds.all_ids(2)


# -- a consumer lets go of a dead service's memory (issue 24, item 7) ---------------------


def _memfds() -> tuple[int, int]:
    """This process's mappings of memfds, and its open memfd descriptors."""
    with open("/proc/self/maps") as f:
        maps = sum("memfd:" in line for line in f)
    return maps, sum("memfd:" in f for f in _fds())


def test_a_consumer_lets_go_of_a_killed_service_s_memory(tmp_path: Path) -> None:
    """After the service was SIGKILLed and the consumer got its
    ServiceError, stop() and dropping the net left the dead service's slots
    mapped: the error's cause held the receiver's frame (its mapping, the
    last batch's views), and the metrics hub held the source holding that
    error for the life of the process."""
    gc.collect()
    before = _memfds()
    p, sock = _serve_cli(tmp_path, env={"N": "1", "BLOBFEED_TEST_CALLS": "100000"})
    try:
        net = blobfeed.Net(None)
        att = blobfeed.attach_source(net, ["id", "x"], 8, "train", sock, consumer_index=0, timeout=20)
        for _ in range(5):
            net.run(timeout=20)
        assert _memfds() > before
        p.kill()
        p.wait(10)
        with pytest.raises(blobfeed.ServiceError) as info:
            for _ in range(10_000):
                net.run(timeout=20)
        assert sock in str(info.value)
        att.stop()
        del net, att, info
    finally:
        p.kill()
        p.wait(10)
    gc.collect()
    assert _memfds() == before


def test_a_consumer_lets_go_of_a_lying_service_s_memory(tmp_path: Path) -> None:
    """A service that lied (a batch of 9 rows) left one memfd open in the
    consumer: the error kept the frame that held the mapping."""
    gc.collect()
    before = _memfds()
    fake = FakeUnixService(tmp_path / "fake.sock", [
        batches_record([0, 0, 8, [ID8, X8]]), batches_record([1, 1, 9, [["<i8", [9], 0], ["<f4", [9, 3], 128]]]),
    ])
    try:
        net = blobfeed.Net(None)
        att = blobfeed.attach_source(net, ["id", "x"], 8, "train", fake.address, timeout=10)
        try:
            with pytest.raises(blobfeed.ServiceError, match="a batch of 9 samples"):
                for _ in range(3):
                    net.run(timeout=10)
        finally:
            att.stop()
        del net, att
    finally:
        fake.close()
    gc.collect()
    assert _memfds() == before


def test_a_writable_net_attached_to_a_service_gets_batches_it_may_write() -> None:
    """``Net(writable=True)`` (for torch.from_numpy) holds for a net fed by a
    service too: its batches are views of the service's read-only shared
    memory, so each is copied once (issue 24: the consumer's feed ignored it)."""
    server = FeedServer()
    server.serve_source("train", ["id", "x"], feeds.Fetch(), 8, 2)
    server.start()
    try:
        net = blobfeed.Net(None, name="w", writable=True)
        with blobfeed.attach_source(net, ["id", "x"], 8, "train", server.address):
            for _ in range(5):
                out = net.run(timeout=20)
                assert all(a.flags.writeable for a in out.values())
                ids = out["id"].copy()
                out["id"][:] = -1  # the caller's own memory: the next batch is unaffected
                assert (ids >= 0).all()
    finally:
        assert server.stop()


def test_a_free_that_lands_while_its_slot_is_written_is_no_reuse(monkeypatch) -> None:
    """The slot a batch is being written into was neither free nor
    unacknowledged yet: a liar's "free" of it (the ring is last in, first
    out, so the slot is predictable) landing during the write put it back
    in the ring, the next batch was written over it, and at the liar's
    departure its batch was dealt again out of the overwritten slot (found
    by review: 8 ids twice, 8 never).  A slot is held and unacknowledged
    from the moment it is taken."""
    from blobfeed.service import slots as slots_mod
    from blobfeed.service.wire import PROTOCOL, Channel

    server = FeedServer()
    server.serve_source("train", ["id", "x"], feeds.Fetch(), 8, 2, deterministic=True)
    server.start()
    writes = []
    real = slots_mod.SlotArea.write_encoded

    def write_while_the_liar_frees(self, slot, arrays):
        writes.append(slot)
        if len(writes) == 3:  # the liar's ack, read by the receiver during this write
            conn = next(c for c in server._connections if c.area is self)
            with contextlib.suppress(Exception):
                conn._handle({"t": "ack", "g": -1, "slots": [slot], "waited": 0.0})
        return real(self, slot, arrays)

    monkeypatch.setattr(slots_mod.SlotArea, "write_encoded", write_while_the_liar_frees)
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(server.address)
        s.settimeout(2)
        ch = Channel(s, "the service")
        ch.send({"t": "hello", "protocol": PROTOCOL, "source": "train", "blobs": ["id", "x"], "batch_size": 8,
                 "index": None, "num": None, "pid": os.getpid()})
        got = 0
        with contextlib.suppress(socket.timeout, OSError):
            while got < 6:
                received = ch.recv()
                if received is None:
                    break
                rec, fds = received
                for fd in fds:
                    os.close(fd)
                if rec["t"] == "batches":
                    got += len(rec["items"])
        s.close()  # leaves without acknowledging anything
        wait_for(lambda: not server._connections, 20, "the liar's connection closed")
        monkeypatch.setattr(slots_mod.SlotArea, "write_encoded", real)
        net = blobfeed.Net(None, name="honest")
        ids: list[int] = []
        with blobfeed.attach_source(net, ["id", "x"], 8, "train", server.address):
            while True:
                try:
                    ids += net.run(timeout=20)["id"].tolist()
                except blobfeed.EndOfEpoch:
                    continue
                except blobfeed.EndOfInput:
                    break
        assert len(writes) >= 3, "the liar's free never raced a write: the test proves nothing"
        assert sorted(ids) == sorted(feeds.all_ids(2))
    finally:
        assert server.stop()


@pytest.mark.parametrize("tcp", [False, True])
def test_a_state_too_big_for_a_record_is_an_error_for_the_asker_not_a_disconnection(tcp: bool) -> None:
    """A consumer's state_dict() whose reply passed a record's 64 KiB (first
    come: what is acknowledged past the position, fetcher states) was a
    protocol break: the consumer that only asked was disconnected and its
    batches dealt again (found by review).  It gets a ValueError saying
    where to take the state instead, and goes on."""
    server = FeedServer("tcp://127.0.0.1:0" if tcp else None)
    server.serve_source("train", ["id", "x"], feeds.Fetch(), 8, 2, deterministic=True)
    server.start()
    try:
        net = blobfeed.Net(None, name="asker")
        with blobfeed.attach_source(net, ["id", "x"], 8, "train", server.address) as att:
            net.run(timeout=20)
            (conn,) = list(server._connections)
            conn._state = lambda source: {"huge": "x" * 70_000}
            with pytest.raises(ValueError, match="take the state from the service"):
                att.state_dict()
            assert len(net.run(timeout=20)["id"]) == 8  # still attached
    finally:
        assert server.stop()


