"""The consumers' own waits on the service's scrape: every ``ack`` (and the
``bye``) carries the seconds the consumer's ``run()`` has waited in all,
and the service exports what each connection's total grew by as
``blobfeed_service_consumer_run_wait_seconds_total{source,consumer}``.

What is compared is what the consumer itself measured (its feed's
``blobfeed_dequeue_wait_seconds`` sum), never a time the test expects.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

import blobfeed
from blobfeed.service import FeedServer
from blobfeed.service.wire import PROTOCOL, WireError, check

from . import feeds
from .test_service import hand_hello
from .test_service import consumer, finish, lines, wait_for

RUN_WAIT = "blobfeed_service_consumer_run_wait_seconds"
SERVICE_WAIT = "blobfeed_service_consumer_wait_seconds"


class SlowFetch(feeds.Fetch):
    """Fetch's batches, each call a few milliseconds late: a source slower
    than its consumer, whose run() must wait."""

    def __call__(self, worker_id: int, batch_size: int) -> list[Any]:
        time.sleep(0.005)  # the data source's own slowness, not a synchronisation
        return super().__call__(worker_id, batch_size)


def scrape(url: str) -> dict[tuple[str, str, str], float]:
    """The service's ``/metrics`` over HTTP: (family, source, consumer) -> value of its counters."""
    with urllib.request.urlopen(url, timeout=10) as r:  # (the URL names /metrics)
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_total") and {"source", "consumer"} <= set(s.labels):
                out[(fam.name, s.labels["source"], s.labels["consumer"])] = s.value
    return out


def test_each_consumer_s_own_wait_reaches_the_service_s_scrape_per_source_and_consumer(tmp_path: Path) -> None:
    server = FeedServer(metrics_port=0)
    server.serve_source("slow", ["id", "x"], SlowFetch(), 8, 2)
    server.serve_source("fast", ["id", "x"], feeds.Fetch(), 8, 2)
    with server.start():
        outs = {name: tmp_path / f"{name}.jsonl" for name in ("slow", "fast")}
        procs = [consumer(server.address, out, "--source", name, "--report-wait") for name, out in outs.items()]
        assert finish(procs) == [0, 0]
        # the bye is the consumer's last record: once it left, the count is whole
        wait_for(lambda: all(s.connected == 0 for s in server.sources.values()), 10, "both consumers' ends seen")
        got = scrape(server.metrics_url)
    for name, out in outs.items():
        rec = lines(out)
        label = str(rec[0]["attached"])
        assert rec[-2] == {"end": "input"}
        measured = rec[-1]["waited"]
        assert measured > 0  # every run() waits a little, if only for the queue's lock
        # the service's count is the consumer's own, to float rounding
        assert got[(RUN_WAIT, name, label)] == pytest.approx(measured, rel=1e-9, abs=1e-9), name
        # the service's side of the wait stays, under its own name
        assert (SERVICE_WAIT, name, label) in got
    assert {(f, s) for f, s, _ in got if f == RUN_WAIT} == {(RUN_WAIT, "slow"), (RUN_WAIT, "fast")}


def test_over_tcp_the_same_records_carry_the_wait() -> None:
    server = FeedServer("tcp://127.0.0.1:0")
    server.serve_source("train", ["id", "x"], SlowFetch(calls=10), 8, 2)
    with server.start():
        net = blobfeed.Net(None)
        with blobfeed.attach_source(net, ["id", "x"], 8, "train", server.address, timeout=30) as att:
            with pytest.raises(blobfeed.EndOfInput):
                for _ in range(10_000):
                    net.run()
        measured = att.reader.waited()
        wait_for(lambda: server.sources["train"].connected == 0, 10, "the consumer's end seen")
        counted = server.sources["train"].counts.run_waited
    assert measured > 0
    assert counted == {str(att.consumer): pytest.approx(measured, rel=1e-9, abs=1e-9)}


@pytest.mark.parametrize(
    "value, why",
    [
        (True, "is not a number of seconds"),
        (-0.5, "is not a number of seconds"),
        (float("nan"), "is not a number of seconds"),
        (float("inf"), "is not a number of seconds"),
        ("1.0", "is not a number of seconds"),
        (None, "is not a number of seconds"),
        (2.0**62, "is not a number of seconds"),
    ],
)
def test_the_wire_refuses_a_wait_that_is_not_a_number_of_seconds(value: Any, why: str) -> None:
    with pytest.raises(WireError, match=f"consumer 3 sent a 'ack' record whose 'waited' {why}"):
        check({"t": "ack", "g": -1, "slots": [], "waited": value}, ("ack",), "consumer 3")
    with pytest.raises(WireError, match="'waited'"):
        check({"t": "bye", "waited": value}, ("bye",), "consumer 3")


def test_the_wire_takes_a_wait_as_a_float_and_requires_it() -> None:
    assert check({"t": "ack", "g": -1, "slots": [], "waited": 0}, ("ack",), "c")["waited"] == 0.0
    assert type(check({"t": "bye", "waited": 2}, ("bye",), "c")["waited"]) is float
    assert check({"t": "ack", "g": 1, "slots": [], "waited": 1.5e-05}, ("ack",), "c")["waited"] == 1.5e-05
    with pytest.raises(WireError, match="without 'waited'"):
        check({"t": "ack", "g": -1, "slots": []}, ("ack",), "c")
    with pytest.raises(WireError, match="without 'waited'"):
        check({"t": "bye"}, ("bye",), "c")


def _hello(address: str) -> socket.socket:
    """Attach by hand (first come): the welcome read, its descriptors closed."""
    s, fds = hand_hello(address)
    for fd in fds:
        os.close(fd)
    return s


def _closed_on_us(s: socket.socket) -> bool:
    """Reads (the batches the service sent meanwhile) until the service closes the connection."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        data, ancdata, _, _ = s.recvmsg(1 << 16, socket.CMSG_SPACE(16))
        for _level, _kind, d in ancdata:
            for k in range(0, len(d) - len(d) % 4, 4):
                os.close(int.from_bytes(d[k:k + 4], sys.byteorder))
        if not data and not ancdata:
            return True
    return False


def test_a_consumer_lying_about_its_wait_is_disconnected_naming_it_and_the_service_keeps_serving(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    caplog.set_level(logging.WARNING, logger="blobfeed.service")
    lies: list[tuple[list[str], str]] = [
        # the total shrinks between two records of one connection
        (['{"t":"ack","g":-1,"slots":[],"waited":1.5}', '{"t":"ack","g":-1,"slots":[],"waited":0.5}'],
         "said its run() has waited 0.5 s in all, less than the 1.5 s it said before"),
        (['{"t":"ack","g":-1,"slots":[],"waited":2.0}', '{"t":"bye","waited":1.0}'],
         "said its run() has waited 1.0 s in all, less than the 2.0 s"),
        (['{"t":"ack","g":-1,"slots":[],"waited":-1.0}'], "'waited' is not a number of seconds"),
        (['{"t":"ack","g":-1,"slots":[],"waited":NaN}'], "'waited' is not a number of seconds (finite, >= 0): nan"),
        (['{"t":"ack","g":-1,"slots":[],"waited":Infinity}'], "'waited' is not a number of seconds"),
        (['{"t":"ack","g":-1,"slots":[],"waited":true}'], "'waited' is not a number of seconds"),
        (['{"t":"ack","g":-1,"slots":[]}'], "without 'waited'"),
    ]
    # 4 slots: a liar is not sent the whole data set (and its end) before its lie is read
    with FeedServer() as server:
        server.serve_source("train", ["id", "x"], feeds.Fetch(), 8, 2, slots=4)
        server.start()
        for records, _ in lies:
            s = _hello(server.address)
            try:
                for r in records:
                    s.send(r.encode())
                assert _closed_on_us(s)
            finally:
                s.close()
        wait_for(lambda: server.sources["train"].connected == 0, 10, "the liars' ends seen")
        # the service still serves everything to a well-behaved consumer
        out = tmp_path / "good.jsonl"
        assert finish([consumer(server.address, out, "--report-wait")]) == [0]
        assert lines(out)[-2] == {"end": "input"}
        counted = dict(server.sources["train"].counts.run_waited)
    warned = [r.getMessage() for r in caplog.records if r.name == "blobfeed.service"]
    for n, (_, why) in enumerate(lies):
        # each warning names the consumer by its label: liar n was consumer n
        assert any(f"consumer {n} of source 'train'" in m and why in m and "connection closed" in m
                   for m in warned), (why, warned)
    # the honest part of the first two liars counts; the good consumer's count is its own
    assert counted["0"] == 1.5 and counted["1"] == 2.0
    good = str(lines(out)[0]["attached"])
    assert counted[good] == pytest.approx(lines(out)[-1]["waited"], rel=1e-9, abs=1e-9)


def test_on_ray_the_largest_total_stands_whatever_order_the_calls_run_in() -> None:
    """Ray runs a consumer's acknowledgements on several threads: an older
    total arriving after a newer one is no lie there, and counts nothing."""
    import collections
    import types

    from blobfeed.service import ray_service
    from blobfeed.service.served import Item

    class _Outlet:
        label = "0"

        def acked(self, item: Item) -> None:
            pass

    class _Server:
        sources: dict[str, object] = {}
        closure_log = None

    conn = ray_service._RayConsumer(_Server(), 0)  # type: ignore[arg-type]
    counts = types.SimpleNamespace(acknowledged=collections.Counter(), run_waited=collections.Counter())
    conn.attached(types.SimpleNamespace(counts=counts, name="train"), _Outlet(), 1)  # type: ignore[arg-type]
    conn.label = "0"
    for waited in (0.25, 1.0, 0.5, None, 1.0, 1.75):
        assert conn.ack(-1, waited) is True
    assert counts.run_waited == {"0": 1.75}
    with pytest.raises(WireError, match="not a number of seconds"):
        ray_service.seconds(float("nan"), "consumer 0 sent waited")


def test_a_wait_shown_as_json_by_the_consumer_is_valid_json() -> None:
    """The consumer formats its acks by hand (%r of a float): every finite float is a JSON number."""
    for v in (0.0, 1e-05, 123456789.125, 1.5e+20, 5e-324, math.pi):
        assert json.loads('{"waited":%r}' % v)["waited"] == v
