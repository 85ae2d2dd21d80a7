"""One rule for what ``run()`` hands out, on every backend (issue 19, item 4):
every array of a batch is read-only, whether it is a view of a chunk
(threads: the fetcher's own array; processes: a shared-memory slot) or a
copy; ``np.array(x)`` gives a writable copy.  A model's outputs are fresh
arrays of onnxruntime's, the caller's to write."""

from __future__ import annotations

import numpy as np
import pytest

import blobfeed
from blobfeed import EndOfInput, Net, init_data_input_workers

from .helpers import WAIT

#: 64 KiB per chunk: above the processes backend's shared-memory threshold (32 KiB)
BIG_ROWS, BIG_COLS = 64, 128
SMALL_ROWS = 8


class Source:
    """Worker 0 returns ``chunks`` arrays of ``rows`` rows of float64 (the same
    objects every time it is asked again: they are the user's own data)."""

    def __init__(self, rows: int, cols: int, chunks: int) -> None:
        self.data = [np.full((rows, cols), float(i)) for i in range(chunks)]
        self.i = 0

    def __call__(self, worker_id: int, batch_size: int) -> list[np.ndarray]:
        if self.i >= len(self.data):
            raise StopIteration
        self.i += 1
        return [self.data[self.i - 1]]


def _batches(gc: blobfeed.GlobalCoordinator, fetch: Source, batch_size: int, **kw) -> list[np.ndarray]:
    net = Net(name="n")
    init_data_input_workers(net, ["x"], fetch, batch_size, num_worker_threads=1, coordinator=gc, **kw)
    gc.start()
    out = []
    while True:
        try:
            out.append(net.run(timeout=WAIT)["x"])
        except EndOfInput:
            return out


def _assert_read_only(x: np.ndarray) -> None:
    assert not x.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        x -= 0.5
    y = np.array(x)
    y -= 0.5  # a copy is the caller's
    assert y.flags.writeable


@pytest.mark.parametrize("backend", ["threads", "processes"])
@pytest.mark.parametrize("rows", [BIG_ROWS, SMALL_ROWS], ids=["big", "small"])
def test_every_batch_is_read_only_and_never_changes_the_source(
    gc: blobfeed.GlobalCoordinator, backend: str, rows: int
) -> None:
    """Batches inside one chunk (views) and batches spanning two (copies)
    alike, for chunks above and below the processes backend's slot size."""
    fetch = Source(rows, BIG_COLS, 3)
    # rows // 2: the first batches lie inside a chunk; 3 * rows // 4 spans chunks
    for bs in (rows // 2, 3 * rows // 4):
        batches = _batches(gc, Source(rows, BIG_COLS, 3) if bs != rows // 2 else fetch, bs, backend=backend)
        assert sum(len(b) for b in batches) == 3 * rows
        for x in batches:
            _assert_read_only(x)
        assert gc.stop(timeout=WAIT)
    # the user's own arrays: unchanged, and still writable (their flags untouched)
    for i, a in enumerate(fetch.data):
        assert (a == float(i)).all()
        assert a.flags.writeable


def test_whole_chunks_are_read_only_views_and_the_fetchers_array_stays_writable(
    gc: blobfeed.GlobalCoordinator,
) -> None:
    fetch = Source(SMALL_ROWS, 4, 2)
    batches = _batches(gc, fetch, 3, dont_rebatch=True)
    assert [len(b) for b in batches] == [SMALL_ROWS, SMALL_ROWS]
    for x in batches:
        _assert_read_only(x)
    assert all(a.flags.writeable for a in fetch.data)


def test_shuffled_and_deterministic_batches_are_read_only(gc: blobfeed.GlobalCoordinator) -> None:
    batches = _batches(gc, Source(SMALL_ROWS, 4, 4), 4, deterministic=True, shuffle_buffer=16, seed=1)
    assert len(batches) == 8
    for x in batches:
        _assert_read_only(x)


def test_model_outputs_are_writable_and_the_workspace_inputs_read_only(gc: blobfeed.GlobalCoordinator) -> None:
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [None, 4])],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [None, 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    net = Net(model.SerializeToString(), name="m")
    fetch = Source(SMALL_ROWS, 4, 1)
    init_data_input_workers(net, ["x"], fetch, 4, num_worker_threads=1, coordinator=gc)
    gc.start()
    y = net.run(timeout=WAIT)["y"]
    y -= 0.5  # the model's output: a fresh array, the caller's
    _assert_read_only(net.workspace.fetch_blob("x"))
    assert (fetch.data[0] == 0.0).all()


# -- Net(writable=True): what torch.from_numpy wants, without a warning per batch -------------------


def _writable_batches(gc: blobfeed.GlobalCoordinator, fetch: Source, batch_size: int, **kw) -> list[np.ndarray]:
    net = Net(name="w", writable=True)
    init_data_input_workers(net, ["x"], fetch, batch_size, num_worker_threads=1, coordinator=gc, **kw)
    gc.start()
    out = []
    while True:
        try:
            x = net.run(timeout=WAIT)["x"]
        except EndOfInput:
            return out
        assert x.flags.writeable
        x -= 0.5  # torch.from_numpy(x) shares this memory and may write it
        out.append(x)


@pytest.mark.parametrize("backend", ["threads", "processes"])
# 2 MiB chunks: batches of 1 MiB and more that span chunks are filled in
# blobfeed's recycled buffers (rebatch.BufferPool), handed out as they are
@pytest.mark.parametrize("rows", [2048, BIG_ROWS, SMALL_ROWS], ids=["huge", "big", "small"])
def test_writable_batches_are_the_callers_and_never_change_the_source(
    gc: blobfeed.GlobalCoordinator, backend: str, rows: int, monkeypatch
) -> None:
    from blobfeed.feeders import rebatch

    copies = []
    real = rebatch._writable_copy
    monkeypatch.setattr(rebatch, "_writable_copy", lambda a: copies.append(a.shape) or real(a))
    # rows // 2: batches inside a chunk (views: copied); 3 * rows // 4 spans
    # chunks (blobfeed's own copies: handed out as they are, not copied again)
    for bs, views in ((rows // 2, 6), (3 * rows // 4, 2)):
        copies.clear()
        fetch = Source(rows, BIG_COLS, 3)
        batches = _writable_batches(gc, fetch, bs, backend=backend)
        assert sum(len(b) for b in batches) == 3 * rows
        assert all((b == np.floor(b)).sum() == 0 for b in batches)  # every one written once
        assert gc.stop(timeout=WAIT)
        for i, a in enumerate(fetch.data):
            assert (a == float(i)).all(), "writing a batch changed the fetcher's array"
        if backend == "threads":
            # 3 chunks of 4/4 batches: 6 inside a chunk; of 3/4: the 1st, and the 4th's rest
            assert len(copies) == views, (bs, copies)


def test_writable_whole_chunks_leave_the_fetchers_array_alone(gc: blobfeed.GlobalCoordinator) -> None:
    fetch = Source(SMALL_ROWS, 4, 2)
    batches = _writable_batches(gc, fetch, 3, dont_rebatch=True)
    assert [len(b) for b in batches] == [SMALL_ROWS, SMALL_ROWS]
    assert all((a == float(i)).all() and a.flags.writeable for i, a in enumerate(fetch.data))


def test_writable_is_a_flag() -> None:
    with pytest.raises(TypeError, match="writable"):
        Net(name="w", writable="yes")  # type: ignore[arg-type]
    assert Net(name="w").writable is False


def test_writable_shuffled_and_deterministic_batches(gc: blobfeed.GlobalCoordinator) -> None:
    fetch = Source(SMALL_ROWS, 4, 4)
    batches = _writable_batches(gc, fetch, 4, deterministic=True, shuffle_buffer=16, seed=1)
    assert len(batches) == 8
    assert all((a == float(i)).all() for i, a in enumerate(fetch.data))
