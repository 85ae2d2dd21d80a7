"""``blobfeed demo``: a real dataset and a real ONNX model, fed by blobfeed.

With no arguments it needs no network: scikit-learn's bundled digits images
(1 797 images of 8x8 pixels, shipped inside the scikit-learn wheel) train a
small MLP classifier in well under a second; its weights are exported to ONNX
with ``onnx.helper`` and checked against scikit-learn; then fetcher threads
read the images in variable-size chunks, blobfeed re-batches them and a
``Net`` scores them with onnxruntime, for several passes over the data.  The
metrics are served on 127.0.0.1 while it runs (and after it, until Ctrl-C or
SIGTERM, with ``--serve``).  At the end it reports the throughput, the share
of the run the model spent waiting for input, and the accuracy on the
held-out test split (25 % of the images, never seen in training; the
training images' figure is printed apart and labelled as such).  Every
prediction must match scoring the same images directly with onnxruntime,
sample by sample (exit status 1 otherwise).

``--model PATH`` runs any ONNX model with float inputs instead, fed with
synthetic random data of the right shapes (no accuracy then).

The run and its report are here; the models are in :mod:`.demo_models`,
the checks of what was delivered in :mod:`.demo_checks`.

Needs the ``demo`` extra: ``pip install -e '.[demo]'`` in the clone of blobfeed
(blobfeed is not on the package index), or ``pip install onnx scikit-learn tqdm``.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

import blobfeed
from blobfeed.metrics import MetricsServer, start_http_server

from .argtypes import port, positive_int, seconds_or_more
from .demo_checks import Blocks, Coverage, PositionReader, chunk_sizes
from .demo_models import (
    TEST_SIZE, DemoError, InputSpec, TrainedDigits, decode_pixels, digits_mlp_onnx, inspect_model_inputs,
    train_digits,
)

__all__ = ["InputSpec", "TrainedDigits", "digits_mlp_onnx", "inspect_model_inputs", "main", "train_digits"]

SOURCE = "demo"
NET_NAME = "demo"
#: Seconds ``Net.run()`` may wait for one batch before the demo gives up.
RUN_TIMEOUT = 120.0
#: Extra blob carrying each sample's position in the run (pass * N + sample).
INDEX_BLOB = "blobfeed_demo_index"
#: batches whose checks run together (Blocks): bounds what the checks hold
BLOCK_BATCHES = 64


#: How to get the demo's packages.  blobfeed is installed from its clone (it is
#: not on the package index), so the extra's form is the clone's.
INSTALL_HINT = "pip install -e '.[demo]' in the clone of blobfeed, or pip install onnx scikit-learn tqdm"


class Terminated(KeyboardInterrupt):
    """SIGTERM during the run.  A KeyboardInterrupt, so that it stops the run
    wherever it lands as Ctrl-C does (blobfeed lets one through ``run()``
    and ``stop()`` still ends every thread); exit status 143 (128 + 15)."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated


def _handle_sigterm() -> list[Any]:
    """Make SIGTERM raise :class:`Terminated` in the main thread; returns the
    handler to restore (a list of one), or an empty list where no handler can
    be set (another thread)."""
    if threading.current_thread() is not threading.main_thread():
        return []
    return [signal.signal(signal.SIGTERM, _on_sigterm)]



# --------------------------------------------------------------------------- the run
class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(enabled: str, total: int, desc: str) -> Any:
    show = sys.stderr.isatty() if enabled == "auto" else enabled == "on"
    if not show:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        if enabled == "on":
            raise DemoError(f"--progress on needs tqdm: {INSTALL_HINT}") from None
        return _NoBar()
    return tqdm(total=total, desc=desc, unit="sample", file=sys.stderr, mininterval=0.1, dynamic_ncols=True)


@dataclass
class RunStats:
    """What one fed run measured."""

    #: samples returned by ``Net.run()``
    samples: int
    #: batches returned by ``Net.run()``
    batches: int
    #: seconds from ``start()`` to the end of input
    wall: float
    #: seconds ``Net.run()`` waited for input (``blobfeed_dequeue_wait_seconds_sum``)
    wait: float
    #: ``blobfeed_delivered_samples_total`` at the end
    metric_samples: float
    #: did ``stop()`` join every thread
    clean_stop: bool
    #: how many times each position was delivered
    seen: Coverage


def _feed_and_run(
    *,
    net: blobfeed.Net,
    blob_names: list[str],
    fetch_fun: Callable[[int, int], list[np.ndarray]],
    total: int,
    args: argparse.Namespace,
    batch_size: int,
    drop_last: bool,
    consume: Callable[[dict[str, np.ndarray], blobfeed.Workspace], None],
    on_running: Callable[[str], None] | None,
    keep_serving: list[MetricsServer],
    metrics: "_Metrics",
) -> RunStats:
    """Feed ``net`` from ``fetch_fun`` until the data ends, stop; the metrics
    are served by ``metrics.server`` (bound before anything else ran).

    With ``--serve`` the metrics server is left open after a run that got to
    the end of its input and appended to ``keep_serving``: the caller closes
    it.  Otherwise it is closed here.
    """
    gc, server = metrics.coordinator, metrics.server
    blobfeed.init_data_input_workers(
        net,
        blob_names,
        fetch_fun,
        batch_size=batch_size,
        num_worker_threads=args.workers,
        input_source_name=SOURCE,
        timeout=RUN_TIMEOUT,
        drop_last=drop_last,
        coordinator=gc,
    )
    after = ", and after it until stopped: --serve" if args.serve is not None else ""
    print(f"metrics     {server.url}  (served while the demo runs{after})", flush=True)
    seen = Coverage(total // args.passes, args.passes)
    positions = Blocks(BLOCK_BATCHES, seen.add)
    samples = batches = 0
    bar = _progress(args.progress, total, "scoring")
    clean = False
    finished = False
    try:
        t0 = time.perf_counter()
        gc.start()
        while True:
            try:
                outputs = net.run()
            except blobfeed.EndOfInput:
                break
            pos = net.workspace.fetch_blob(INDEX_BLOB)
            positions.add(pos)
            consume(outputs, net.workspace)
            samples += len(pos)
            batches += 1
            bar.update(len(pos))
            if batches == 1 and on_running is not None:
                on_running(server.url)
        wall = time.perf_counter() - t0
        labels = {"source": SOURCE, "net": NET_NAME}
        wait = gc.registry.get_sample_value("blobfeed_dequeue_wait_seconds_sum", labels) or 0.0
        delivered = gc.registry.get_sample_value("blobfeed_delivered_samples_total", labels) or 0.0
        positions.flush()
        finished = True
    finally:
        bar.close()
        clean = gc.stop()
        if finished and args.serve is not None:
            keep_serving.append(server)
        else:
            server.close()
    return RunStats(samples, batches, wall, wait, delivered, clean, seen)


def _report_run(stats: RunStats, expected: int) -> tuple[list[str], list[str]]:
    """The report lines every run shares, and the problems found (second list)."""
    problems = []
    lines = [
        f"samples     {stats.samples}",
        f"batches     {stats.batches}",
        f"wall time   {stats.wall:.3f} s",
        f"throughput  {stats.samples / stats.wall:,.0f} samples/s" if stats.wall > 0 else "throughput  n/a",
        f"model wait  {stats.wait / stats.wall:.1%} of the run waiting for input "
        f"({stats.wait:.3f} s of {stats.wall:.3f} s, blobfeed_dequeue_wait_seconds_sum)"
        if stats.wall > 0 else "model wait  n/a",
    ]
    if stats.samples != expected:
        problems.append(f"expected {expected} samples, blobfeed delivered {stats.samples}")
    if int(stats.metric_samples) != stats.samples:
        problems.append(
            f"blobfeed_delivered_samples_total says {stats.metric_samples:g}, "
            f"Net.run() returned {stats.samples}"
        )
    if not stats.clean_stop:
        problems.append("stop() did not join every thread")
    return lines, problems


def _run_digits(
    args: argparse.Namespace, on_running: Callable[[str], None] | None, keep_serving: list[MetricsServer],
    metrics: "_Metrics",
) -> int:
    try:
        import onnx  # noqa: F401
        import sklearn  # noqa: F401
    except ImportError as exc:
        raise DemoError(f"blobfeed demo needs {exc.name}: {INSTALL_HINT}") from exc
    t0 = time.perf_counter()
    data = train_digits(args.seed)
    n = len(data.labels)
    held = data.test_idx
    x = decode_pixels(data.raw)

    # Direct scoring: the whole data set in one onnxruntime call, no blobfeed.
    import onnxruntime as ort

    direct = ort.InferenceSession(data.model, providers=["CPUExecutionProvider"])
    direct_pred = direct.run(["logits"], {"pixels": x})[0].argmax(axis=1)
    direct_right = direct_pred == data.labels
    direct_correct = int(direct_right.sum())
    is_test = np.zeros(n, bool)
    is_test[held] = True
    n_test, n_train = int(is_test.sum()), int((~is_test).sum())

    print(
        f"dataset     scikit-learn digits: {n} images of 8x8 pixels, 10 classes (bundled, no download)"
    )
    print(
        f"model       MLP {data.layers} trained in {data.train_seconds:.2f} s on {n_train} images "
        f"({n_test} held out for testing); exported to ONNX "
        f"(matches scikit-learn: max |dprob| {data.max_prob_diff:.1e})"
    )
    if data.note:
        print(f"note        {data.note}")
    print(
        f"feeding     {args.passes} passes x {n} images, batch size {args.batch_size}, "
        f"{args.workers} fetcher workers, chunks of 1..{2 * args.batch_size} images "
        f"(setup {time.perf_counter() - t0:.2f} s)",
        flush=True,
    )

    reader = PositionReader(n, args.passes)
    raw_flat = data.raw.reshape(n, -1)
    sizes: dict[int, Callable[[], int]] = {}

    def fetch_fun(worker_id: int, batch_size: int) -> list[np.ndarray]:
        # one entry per worker, written only by that worker's thread
        next_size = sizes.get(worker_id)
        if next_size is None:
            next_size = sizes[worker_id] = chunk_sizes(args.seed, worker_id, batch_size)
        span = reader.take(next_size())
        if span is None:
            raise StopIteration
        start, stop = span
        s0 = start % n
        s1 = s0 + (stop - start)
        return [
            decode_pixels(raw_flat[s0:s1]),
            data.labels[s0:s1],
            np.arange(start, stop, dtype=np.int64),
        ]

    total = reader.total
    # Counted batch by batch: nothing here grows with --passes (a position
    # p is image p % n; Coverage checks each position came exactly once).
    tally = {"same": 0, "labels_out_of_step": 0, "right_test": 0, "right_train": 0}

    def score(position: np.ndarray, logits: np.ndarray, label: np.ndarray) -> None:
        image = position % n
        pred = logits.argmax(axis=1)
        right = pred == label
        test = is_test[image]
        tally["same"] += int((pred == direct_pred[image]).sum())
        tally["labels_out_of_step"] += int((label != data.labels[image]).sum())
        tally["right_test"] += int((right & test).sum())
        tally["right_train"] += int((right & ~test).sum())

    scored = Blocks(BLOCK_BATCHES, score)

    def consume(outputs: dict[str, np.ndarray], ws: blobfeed.Workspace) -> None:
        scored.add(ws.fetch_blob(INDEX_BLOB), outputs["logits"], ws.fetch_blob("label"))

    net = blobfeed.Net(data.model, name=NET_NAME)
    stats = _feed_and_run(
        net=net,
        blob_names=["pixels", "label", INDEX_BLOB],
        fetch_fun=fetch_fun,
        total=total,
        args=args,
        batch_size=args.batch_size,
        drop_last=False,
        consume=consume,
        on_running=on_running,
        keep_serving=keep_serving,
        metrics=metrics,
    )
    scored.flush()
    lines, problems = _report_run(stats, total)
    if not stats.seen.exact():
        problems.append(stats.seen.problem())
    if tally["labels_out_of_step"]:
        problems.append(f"{tally['labels_out_of_step']} labels arrived out of step")
    same = tally["same"]
    # The accuracy worth quoting is the held-out split's: the model never saw
    # those images.  Both figures count blobfeed's predictions, every pass.
    fed_test, fed_train = tally["right_test"], tally["right_train"]
    match = same == total and stats.seen.exact() and fed_test + fed_train == direct_correct * args.passes
    if not match:
        problems.append(f"{total - same} of {total} predictions differ from direct scoring")
    lines += [
        f"accuracy    {fed_test / (n_test * args.passes):.4f} on the {n_test} held-out test images "
        f"({round(100 * n_test / n)} % split, never seen in training): "
        f"blobfeed {fed_test}/{n_test * args.passes} over {args.passes} passes, "
        f"direct onnxruntime {int(direct_right[is_test].sum())}/{n_test}",
        f"            {fed_train / (n_train * args.passes):.4f} on the {n_train} training images "
        f"(the model was fitted to them: not a measure of accuracy)",
        f"predictions {same}/{total} identical to direct scoring: {'MATCH' if match else 'MISMATCH'}",
        f"clean stop  {'yes' if stats.clean_stop else 'NO'}",
    ]
    return _finish(lines, problems)


def _run_model(
    args: argparse.Namespace, on_running: Callable[[str], None] | None, keep_serving: list[MetricsServer],
    metrics: "_Metrics",
) -> int:
    import onnxruntime as ort

    path = args.model
    if not os.path.isfile(path):
        raise DemoError(f"--model {path!r}: no such file")
    try:
        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own exception types
        raise DemoError(f"--model {path!r}: onnxruntime cannot load it: {exc}") from exc
    specs = inspect_model_inputs(session)
    fixed = next((s.fixed_batch for s in specs if s.fixed_batch is not None), None)
    batch_size = fixed if fixed is not None else args.batch_size
    del session
    n = args.samples
    print(f"model       {path}")
    for s in specs:
        dims = ", ".join(str(d) for d in ("N" if s.fixed_batch is None else s.fixed_batch, *s.sample_shape))
        print(f"input       {s.name}: {s.dtype.name} [{dims}]  synthetic standard normal data")
    if fixed is not None and fixed != args.batch_size:
        print(f"note        the model fixes the batch size at {fixed}: using it, and dropping a last smaller batch")
    print(
        f"feeding     {args.passes} passes x {n} samples, batch size {batch_size}, "
        f"{args.workers} fetcher workers, chunks of 1..{2 * batch_size} samples",
        flush=True,
    )
    reader = PositionReader(n, args.passes)
    rngs: dict[int, tuple[np.random.Generator, Callable[[], int]]] = {}

    def fetch_fun(worker_id: int, hint: int) -> list[np.ndarray]:
        state = rngs.get(worker_id)
        if state is None:
            state = rngs[worker_id] = (
                np.random.default_rng([args.seed, worker_id, 1]),
                chunk_sizes(args.seed, worker_id, hint),
            )
        rng, next_size = state
        span = reader.take(next_size())
        if span is None:
            raise StopIteration
        start, stop = span
        k = stop - start
        arrays = [
            rng.standard_normal((k, *s.sample_shape), dtype=np.float32).astype(s.dtype, copy=False)
            for s in specs
        ]
        return [*arrays, np.arange(start, stop, dtype=np.int64)]

    total = reader.total
    out_shapes: dict[str, tuple[int, ...]] = {}

    def consume(outputs: dict[str, np.ndarray], ws: blobfeed.Workspace) -> None:
        if not out_shapes:
            out_shapes.update({k: tuple(np.shape(v)) for k, v in outputs.items()})

    try:
        net = blobfeed.Net(path, name=NET_NAME)
        stats = _feed_and_run(
            net=net,
            blob_names=[s.name for s in specs] + [INDEX_BLOB],
            fetch_fun=fetch_fun,
            total=total,
            args=args,
            batch_size=batch_size,
            drop_last=fixed is not None,
            consume=consume,
            on_running=on_running,
            keep_serving=keep_serving,
            metrics=metrics,
        )
    except (blobfeed.BlobfeedError, DemoError):
        raise
    except Exception as exc:  # the model failed on the data: onnxruntime's own types
        raise DemoError(f"--model {path!r}: running it failed: {exc}") from exc
    expected = total - total % batch_size if fixed is not None else total
    lines, problems = _report_run(stats, expected)
    if fixed is None and not stats.seen.exact():
        problems.append("some samples were not scored exactly once")
    for name, shape in out_shapes.items():
        lines.append(f"output      {name}: {list(shape)} (first batch)")
    if fixed is not None and expected != total:
        lines.append(f"dropped     {total - expected} samples (not a whole batch of {fixed})")
    lines.append(f"clean stop  {'yes' if stats.clean_stop else 'NO'}")
    return _finish(lines, problems)


def serve_after_run(server: MetricsServer, seconds: float) -> None:
    """Keep ``server`` up for ``seconds`` (``inf``: until stopped), then close it.

    SIGINT (Ctrl-C) and SIGTERM end the wait early: in the main thread their
    handlers are swapped for ones that just end it, and restored after.
    """
    stop = threading.Event()
    if math.isinf(seconds):
        how = "until Ctrl-C or SIGTERM"
    else:
        how = f"for {seconds:g} s (Ctrl-C or SIGTERM stops it sooner)"
    previous: dict[int, Any] = {}
    try:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, lambda signum, frame: stop.set())
        # Printed once the handlers are in place: a signal sent on reading it is handled.
        print(f"serving     {server.url} {how}; pid {os.getpid()}", flush=True)
        stop.wait(None if math.isinf(seconds) else seconds)
    except KeyboardInterrupt:  # not the main thread: Ctrl-C arrives as usual
        pass
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        server.close()
    print("serving     stopped", flush=True)


def _finish(lines: list[str], problems: list[str]) -> int:
    print("\n".join(lines))
    for p in problems:
        print(f"FAILED      {p}")
    return 1 if problems else 0


@dataclass
class _Metrics:
    """The run's coordinator (its own registry) and the server of its metrics."""

    coordinator: blobfeed.GlobalCoordinator
    server: MetricsServer


def _bind_metrics(port: int) -> _Metrics:
    """A coordinator with a registry of its own, and its metrics served on
    ``127.0.0.1:port``: done first, so that a taken port is found at once.

    Raises:
        DemoError: the port cannot be bound; one message naming it.
    """
    gc = blobfeed.GlobalCoordinator()  # isolated: its own registry; starts nothing yet
    try:
        server = start_http_server(port, addr="127.0.0.1", registry=gc.registry)
    except OSError as exc:
        gc.stop()
        # said once: the library's own message names the address already, and
        # wrapping str(exc) repeated it, after an "[Errno 98]"
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        hint = "; choose another --metrics-port, or 0 for any free port" if port else ""
        raise DemoError(f"cannot serve metrics on 127.0.0.1:{port}: {reason}{hint}") from None
    return _Metrics(gc, server)


def build_parser() -> argparse.ArgumentParser:
    """The ``blobfeed demo`` command line."""
    p = argparse.ArgumentParser(
        prog="blobfeed demo",
        description="Score scikit-learn's bundled digits with an MLP trained on the spot and "
        "exported to ONNX, fed by blobfeed; or, with --model, any ONNX model with float inputs "
        "fed with synthetic data. No network needed. The model trains on "
        f"{round(100 * (1 - TEST_SIZE))} % of the digits; every image is fed and scored, and the "
        f"accuracy reported is on the other {round(100 * TEST_SIZE)} %, the "
        "held-out test images, never seen in training (the training images' accuracy is "
        "printed apart, labelled as such). Exit status: 0 when every prediction matches "
        "direct onnxruntime scoring, 1 when a check fails, 2 for a usage problem.",
    )
    p.add_argument("--batch-size", type=positive_int, default=64, help="samples per batch (default 64)")
    p.add_argument("--workers", type=positive_int, default=2, help="fetcher threads (default 2)")
    p.add_argument("--passes", type=positive_int, default=100, help="passes over the data (default 100)")
    p.add_argument(
        "--metrics-port", type=port, default=0,
        help="port for the metrics on 127.0.0.1 (default 0: a free port, printed); bound before anything "
        "else runs: a taken port fails at once with exit status 2",
    )
    p.add_argument(
        "--serve", type=seconds_or_more, nargs="?", const=math.inf, default=None, metavar="SECONDS",
        help="keep serving the metrics after the run, so the printed URL can be visited: "
        "until Ctrl-C or SIGTERM, or for SECONDS when given (default: stop serving when the run ends)",
    )
    p.add_argument(
        "--model", metavar="PATH",
        help="an ONNX model with float inputs to feed synthetic data instead of the digits classifier",
    )
    p.add_argument(
        "--samples", type=positive_int, default=None,
        help="samples per pass with --model (default 1024)",
    )
    p.add_argument(
        "--seed", type=int, default=0,
        help="seed for training, the held-out split, chunk sizes and synthetic data (default 0)",
    )
    p.add_argument(
        "--progress", choices=("auto", "on", "off"), default="auto",
        help="progress bar on stderr (default auto: when stderr is a terminal)",
    )
    return p


def main(argv: Sequence[str] | None = None, *, on_running: Callable[[str], None] | None = None) -> int:
    """Run ``blobfeed demo``.

    Args:
        argv: the command-line arguments after ``demo``; default ``sys.argv[1:]``.
        on_running: called once with the metrics URL, in the calling thread,
            right after the first batch has been scored (the pipeline is
            running and the endpoint is up): for tests and embedding.

    Returns:
        The exit status: 0 when the run checked out, 1 when a check failed
        (e.g. accuracy differs from direct scoring), 2 for a usage problem
        (bad model, missing package, busy port).
    """
    parser = build_parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as exc:  # argparse exits on --help and on errors
        return int(exc.code or 0)
    if args.samples is not None and args.model is None:
        parser.print_usage(sys.stderr)
        print("blobfeed demo: error: --samples only applies with --model", file=sys.stderr)
        return 2
    if args.samples is None:
        args.samples = 1024
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # The port first: a taken --metrics-port fails at once, before the
    # training, the model's load and the workers (it used to fail after them).
    try:
        metrics = _bind_metrics(args.metrics_port)
    except DemoError as exc:
        print(f"blobfeed demo: error: {exc}", file=sys.stderr)
        return 2
    keep_serving: list[MetricsServer] = []
    # An operator's SIGTERM (kill, a container stop) ends the run as Ctrl-C
    # does: a line, the threads stopped, an exit status; not a silent death.
    previous = _handle_sigterm()
    try:
        if args.model is not None:
            status = _run_model(args, on_running, keep_serving, metrics)
        else:
            status = _run_digits(args, on_running, keep_serving, metrics)
        for server in keep_serving:
            serve_after_run(server, args.serve)
        return status
    except DemoError as exc:
        print(f"blobfeed demo: error: {exc}", file=sys.stderr)
        return 2
    except blobfeed.BlobfeedError as exc:
        print(f"blobfeed demo: the feed failed: {exc!r}", file=sys.stderr)
        return 1
    except Terminated:
        print("blobfeed demo: terminated (SIGTERM)", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("blobfeed demo: interrupted", file=sys.stderr)
        return 130
    finally:
        for server in keep_serving:
            server.close()  # idempotent: closes it when the report itself failed
        metrics.server.close()  # idempotent: when the run never got to feeding
        metrics.coordinator.stop()
        for handler in previous:
            # None: the handler was not set from Python; the default is the nearest
            signal.signal(signal.SIGTERM, signal.SIG_DFL if handler is None else handler)


if __name__ == "__main__":
    sys.exit(main())
