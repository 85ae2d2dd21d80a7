"""The carriers (blobfeed/service/transport.py): chosen once from the
address, for both ends; a connection's sender thread hands its batches to
the carrier's sender and never asks which carrier it has."""

from __future__ import annotations

import inspect
import json
import socket
from typing import Any

import numpy as np

from blobfeed.service import connection, consumer, transport
from blobfeed.service.transport import RAY, TCP, UNIX, SlotSender, StreamSender, carrier_for


def test_an_address_names_its_carrier_in_one_place() -> None:
    assert carrier_for("tcp://127.0.0.1:5000") is TCP
    assert carrier_for("ray://feed") is RAY and carrier_for("ray://ns/feed") is RAY
    assert carrier_for("/tmp/blobfeed.sock") is UNIX and carrier_for("relative.sock") is UNIX
    assert UNIX.shared_memory and not TCP.shared_memory


def test_the_sender_thread_does_not_branch_on_the_transport() -> None:
    body = inspect.getsource(connection.Connection._send_items)
    for word in ("StreamChannel", "stream", "tcp", "isinstance(self.channel"):
        assert word not in body, f"Connection._send_items still asks which transport it has ({word!r})"
    assert "startswith" not in inspect.getsource(consumer.Attachment)


class _Ledger:
    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def sent(self, g: int) -> None:
        self.log.append(("sent", g))


class _Channel:
    peer = "test"

    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def send_encoded(self, data: bytes) -> None:
        self.log.append(("record", json.loads(data)))

    def send(self, record: dict[str, Any], fds: Any = (), payload: Any = ()) -> None:
        self.log.append(("frame", record, len(payload)))


def test_on_the_unix_socket_batches_go_together_and_the_ledger_hears_first() -> None:
    log: list[Any] = []
    sender = SlotSender(_Channel(log), _Ledger(log))
    for g in range(3):
        assert sender.send_batch(g, g, 2, None, '[["<i8",[2],0]]', (), 64) == 0
    assert sender.pending() and log == []
    assert sender.flush() == 3 and not sender.pending()
    assert log[0] == ("sent", 2)
    assert log[1][0] == "record" and [e[0] for e in log[1][1]["items"]] == [0, 1, 2]
    assert sender.flush() == 0 and len(log) == 2


def test_over_tcp_each_batch_is_one_frame_at_once() -> None:
    log: list[Any] = []
    sender = StreamSender(_Channel(log), _Ledger(log))
    x = np.arange(2, dtype=np.int64)
    assert sender.send_batch(0, 1, 2, [["<i8", [2], 0]], None, (x,), 64) == 1
    assert log == [("sent", 0), ("frame", {"t": "batch", "g": 0, "slot": 1, "n": 2, "arrays": [["<i8", [2], 0]]}, 1)]
    assert not sender.pending() and sender.flush() == 0


def test_each_carrier_connects_with_its_own_channel(tmp_path: Any) -> None:
    path = str(tmp_path / "s.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(path)
    server.listen(1)
    try:
        channel = transport.connect(path, 5.0, "test")
        try:
            assert type(channel) is transport.Channel
        finally:
            channel.close()
    finally:
        server.close()
