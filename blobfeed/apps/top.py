"""``blobfeed top``: a live view of a running pipeline or feeding service,
from its ``/metrics`` address.

``blobfeed top http://127.0.0.1:9100/metrics`` (or ``127.0.0.1:9100``)
scrapes the address every ``--interval`` seconds and shows each source (its
workers, internal queue, samples/s) and each net it feeds (batches/s,
samples/s, the share of its time it waits for input, its model's share,
and the bottleneck verdict of ``blobfeed_bottleneck_info``).  On a
terminal it redraws in place like ``top`` (q or Ctrl-C quits, and the
terminal is restored); otherwise, or with ``--once`` / ``--iterations N``,
it prints plain text snapshots.  Rates are computed between two scrapes.

A scrape is untrusted input: at most ``--max-bytes`` are read, within
``--timeout`` seconds, and label values are shown without their control
characters.  Exit status 0; 1 when the address cannot be scraped or does
not serve blobfeed metrics (the message names the address); 2 for a usage
error.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import math
import os
import re
import select
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import IO, Iterator
from urllib.parse import urlsplit

from .argtypes import positive_float, positive_int

__all__ = ["ScrapeError", "Snapshot", "main", "normalise_address", "render", "scrape"]

DEFAULT_INTERVAL_S = 2.0
DEFAULT_TIMEOUT_S = 5.0
#: a blobfeed scrape is tens of kilobytes; a service with many consumers, a few hundred
DEFAULT_MAX_BYTES = 8 << 20

#: what helps, per stage of blobfeed_bottleneck_info (docs/TUNING.md)
STAGE_ADVICE = {
    "gil": "input-bound: fetcher threads share the GIL; use backend='processes'",
    "fetch": "input-bound: fetchers compute all the time; add workers if there are cores",
    "workers": "input-bound: too few workers (each busy waiting inside fetch_fun); add workers",
    "copy": "input-bound by moving data: larger chunks and batches",
    "model": "model-bound: input is not the limit",
    "idle": "too little happened to judge",
}

#: sources shown, and nets per source (a scrape may name any number)
MAX_ROWS = 64

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


class ScrapeError(Exception):
    """The address could not be scraped, or is not a blobfeed /metrics."""


def normalise_address(address: str) -> str:
    """``http://host:port/path`` from ``host:port``, ``http://host:port`` or a full URL.

    Raises:
        ValueError: not an http(s) address with a host.
    """
    text = address.strip()
    if "://" not in text:
        text = "http://" + text
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"address {address!r}: not http or https")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"address {address!r}: {exc}") from None
    if not parts.hostname:
        raise ValueError(f"address {address!r}: no host (give host:port or http://host:port/metrics)")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    netloc = host if port is None else f"{host}:{port}"
    path = parts.path or "/metrics"
    return f"{parts.scheme}://{netloc}{path}" + (f"?{parts.query}" if parts.query else "")


def fetch_text(url: str, timeout: float, max_bytes: int) -> str:
    """The body of ``GET url``: at most ``max_bytes``, all within ``timeout`` seconds.

    Raises:
        ScrapeError: unreachable, not 200, too long, too slow, not UTF-8.
    """
    parts = urlsplit(url)
    conn_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    deadline = time.monotonic() + timeout
    conn = conn_class(parts.hostname or "", parts.port, timeout=timeout)
    try:
        conn.request("GET", (parts.path or "/") + (f"?{parts.query}" if parts.query else ""),
                     headers={"Accept": "text/plain"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise ScrapeError(f"{url}: HTTP {resp.status} {_clean(resp.reason)[:80]}")
        chunks, n = [], 0
        while True:
            if time.monotonic() > deadline:
                raise ScrapeError(f"{url}: the answer took more than {timeout:g} s")
            chunk = resp.read(min(65536, max_bytes + 1 - n))
            if not chunk:
                break
            chunks.append(chunk)
            n += len(chunk)
            if n > max_bytes:
                raise ScrapeError(f"{url}: the answer is larger than {max_bytes} bytes (--max-bytes)")
    except ScrapeError:
        raise
    except (OSError, http.client.HTTPException) as exc:
        raise ScrapeError(f"{url}: cannot scrape: {_clean(str(exc)) or type(exc).__name__}") from None
    finally:
        conn.close()
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ScrapeError(f"{url}: not Prometheus text (not UTF-8 at byte {exc.start})") from None


#: (sample name, sorted label pairs) -> value
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@dataclass
class Snapshot:
    """One scrape, as the view needs it."""

    t: float
    samples: Samples
    #: sample name -> its series (labels, value): built once, so a frame costs
    #: one pass over a scrape however many sources it names
    by_name: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for (name, labels), v in self.samples.items():
            self.by_name.setdefault(name, []).append((dict(labels), v))

    def get(self, name: str, **labels: str) -> float | None:
        return self.samples.get((name, tuple(sorted(labels.items()))))

    def series(self, name: str) -> list[tuple[dict[str, str], float]]:
        return self.by_name.get(name, [])


def parse(url: str, text: str, t: float) -> Snapshot:
    """The samples of a Prometheus text exposition (prometheus_client's parser).

    Raises:
        ScrapeError: not Prometheus text, or no blobfeed metric in it.
    """
    from prometheus_client.parser import text_string_to_metric_families

    samples: Samples = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    except Exception as exc:  # the parser raises ValueError, and worse on worse input
        raise ScrapeError(f"{url}: not Prometheus text ({_clean(str(exc))[:120] or type(exc).__name__})") from None
    if not any(name.startswith("blobfeed_") for name, _ in samples):
        raise ScrapeError(f"{url}: no blobfeed metrics there (is it a blobfeed pipeline's or service's /metrics?)")
    return Snapshot(t, samples)


def scrape(url: str, timeout: float = DEFAULT_TIMEOUT_S, max_bytes: int = DEFAULT_MAX_BYTES) -> Snapshot:
    """Scrape ``url`` once (bounded: ``timeout`` seconds, ``max_bytes``)."""
    t = time.monotonic()
    return parse(url, fetch_text(url, timeout, max_bytes), t)


def _clean(text: str) -> str:
    """``text`` without control characters (a scrape may hold terminal escapes)."""
    return _CONTROL.sub("?", text)


def _rate(now: Snapshot, before: Snapshot | None, name: str, **labels: str) -> float | None:
    if before is None or now.t <= before.t:
        return None
    a, b = before.get(name, **labels), now.get(name, **labels)
    if a is None or b is None or b < a:  # a counter reset (the pipeline restarted)
        return None
    return (b - a) / (now.t - before.t)


def _delta(now: Snapshot, before: Snapshot | None, name: str, **labels: str) -> float | None:
    b = now.get(name, **labels)
    if before is None:
        return b  # since the start
    a = before.get(name, **labels)
    if a is None or b is None or b < a:
        return b
    return b - a


def _num(x: float | None, digits: int = 1) -> str:
    if x is None or math.isnan(x):
        return "-"
    if abs(x) >= 1e6:
        return f"{x / 1e6:.{digits}f}M"
    if abs(x) >= 1e4:
        return f"{x / 1e3:.{digits}f}k"
    return f"{x:.{digits}f}"


def _pct(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{100 * x:.0f}%"


def _table(rows: list[list[str]], indent: str = "") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def render(url: str, now: Snapshot, before: Snapshot | None, width: int = 200) -> str:
    """One frame: a header, a table of sources, a table of nets, the verdicts' advice."""
    sources = sorted({labels["source"] for name, series in now.by_name.items() if name.startswith("blobfeed_")
                      for labels, _ in series if "source" in labels})
    nets: dict[str, list[str]] = {}
    for labels, _ in now.series("blobfeed_batches_total"):
        if "source" in labels and "net" in labels:
            nets.setdefault(labels["source"], []).append(labels["net"])
    stages = {(labels.get("source"), labels.get("net")): labels.get("stage", "?")
              for labels, v in now.series("blobfeed_bottleneck_info") if v == 1}
    when = time.strftime("%H:%M:%S")
    rates = "rates over the last %.1f s" % (now.t - before.t) if before is not None else "rates need two scrapes"
    lines = [f"blobfeed top  {_clean(url)}  {when}  ({rates}; wait/model shares "
             f"{'over that time' if before is not None else 'since the start'})", ""]
    if not sources:
        lines.append("no source yet")
        return "\n".join(lines) + "\n"
    srows = [["SOURCE", "WORKERS", "QUEUE", "FILL", "FETCHED/S", "INPUTS/S", "BUFFERED", "CONSUMERS"]]
    nrows = [["SOURCE", "NET", "BATCHES/S", "SAMPLES/S", "WAIT", "MODEL", "DEVQ", "VERDICT"]]
    advice: list[str] = []
    hidden = max(0, len(sources) - MAX_ROWS)
    for src in sources[:MAX_ROWS]:
        depth = now.get("blobfeed_internal_queue_depth", source=src)
        cap = now.get("blobfeed_internal_queue_capacity", source=src)
        consumers = now.get("blobfeed_service_consumers", source=src)
        srows.append([
            _clean(src)[:40], _num(now.get("blobfeed_workers_alive", source=src), 0),
            "-" if depth is None else f"{depth:.0f}/{_num(cap, 0)}",
            _pct(depth / cap) if depth is not None and cap else "-",
            _num(_rate(now, before, "blobfeed_fetched_samples_total", source=src)),
            _num(now.get("blobfeed_inputs_per_second", source=src)),
            _num(now.get("blobfeed_buffered_samples", source=src), 0),
            "-" if consumers is None else f"{consumers:.0f}",
        ])
        for net in sorted(set(nets.get(src, ())))[:MAX_ROWS]:
            wait = _delta(now, before, "blobfeed_dequeue_wait_seconds_sum", source=src, net=net)
            busy = _delta(now, before, "blobfeed_consumer_busy_seconds_total", source=src, net=net)
            model = _delta(now, before, "blobfeed_model_run_seconds_sum", source=src, net=net)
            active = (wait or 0.0) + (busy or 0.0)
            stage = stages.get((src, net))
            nrows.append([
                _clean(src)[:40], _clean(net)[:40],
                _num(_rate(now, before, "blobfeed_batches_total", source=src, net=net)),
                _num(_rate(now, before, "blobfeed_delivered_samples_total", source=src, net=net)),
                _pct((wait or 0.0) / active) if active > 0 else "-",
                _pct((model or 0.0) / active) if active > 0 and model is not None else "-",
                _num(now.get("blobfeed_device_queue_depth", source=src, net=net), 0),
                "-" if stage is None else _clean(stage)[:12],
            ])
            if stage is not None:
                advice.append(f"{_clean(src)[:40]}/{_clean(net)[:40]}: "
                              f"{STAGE_ADVICE.get(stage, 'unknown stage ' + _clean(stage)[:12])}")
    lines += _table(srows)
    if hidden:
        lines.append(f"... and {hidden} more sources")
    lines.append("")
    lines += _table(nrows) if len(nrows) > 1 else ["no net fed yet"]
    if advice:
        lines += ["", "bottleneck (docs/TUNING.md):"] + [f"  {a}" for a in advice]
    return "\n".join(line[:width] for line in lines) + "\n"


# -- the terminal -------------------------------------------------------------------------
_ALT_ON, _ALT_OFF = "\x1b[?1049h", "\x1b[?1049l"
_HIDE, _SHOW = "\x1b[?25l", "\x1b[?25h"
_HOME_CLEAR = "\x1b[H\x1b[2J"


@contextlib.contextmanager
def _terminal(out: IO[str], keys: IO[str] | None) -> Iterator[None]:
    """Alternate screen, no cursor and single keys (cbreak) while inside;
    everything restored on the way out, whatever ends it."""
    saved = None
    fd = None
    if keys is not None:
        import termios
        import tty

        fd = keys.fileno()
        saved = termios.tcgetattr(fd)
        tty.setcbreak(fd)
    out.write(_ALT_ON + _HIDE)
    out.flush()
    try:
        yield
    finally:
        out.write(_SHOW + _ALT_OFF)
        out.flush()
        if saved is not None and fd is not None:
            import termios

            termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def _wait_for_key(keys: IO[str] | None, seconds: float) -> bool:
    """Sleep ``seconds``; True at once if q was pressed."""
    deadline = time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if keys is None:
            time.sleep(left)
            return False
        ready, _, _ = select.select([keys], [], [], left)
        if ready:
            ch = os.read(keys.fileno(), 32)
            if not ch or b"q" in ch or b"Q" in ch:
                return True


def _columns(out: IO[str]) -> int:
    """The terminal's width; 200 where it does not say (a pty never sized)."""
    try:
        return os.get_terminal_size(out.fileno()).columns or 200
    except OSError:
        return 200


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="blobfeed top",
        description="A live view of a running blobfeed pipeline or feeding service, from its /metrics "
                    "address: sources, rates, queues, each net's wait share and the bottleneck verdict. "
                    "Redraws in place on a terminal (q or Ctrl-C quits); prints plain snapshots otherwise. "
                    "Exit status 1 when the address cannot be scraped.",
    )
    p.add_argument("address", help="the /metrics URL (http://127.0.0.1:9100/metrics) or host:port")
    p.add_argument("--interval", "-d", type=positive_float, default=DEFAULT_INTERVAL_S, metavar="SECONDS",
                   help=f"seconds between scrapes (default {DEFAULT_INTERVAL_S:g})")
    count = p.add_mutually_exclusive_group()
    count.add_argument("--once", action="store_true",
                   help="print one snapshot and exit (one scrape: no rates; see --iterations)")
    count.add_argument("--iterations", "-n", type=positive_int, default=None, metavar="N",
                   help="print N snapshots, --interval apart, and exit (rates from the second on)")
    p.add_argument("--timeout", type=positive_float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help=f"bound on one scrape (default {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--max-bytes", type=positive_int, default=DEFAULT_MAX_BYTES, metavar="N",
                   help=f"bound on the size of one scrape (default {DEFAULT_MAX_BYTES})")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run ``blobfeed top``; returns its exit status."""
    p = _parser()
    args = p.parse_args(argv)
    if args.max_bytes < 1024:
        p.error(f"--max-bytes must be at least 1024, got {args.max_bytes}")
    try:
        url = normalise_address(args.address)
    except ValueError as exc:
        p.error(str(exc))
    count = 1 if args.once else args.iterations
    out = sys.stdout
    live = count is None and out.isatty()
    try:
        if live:
            keys = sys.stdin if sys.stdin.isatty() else None
            with _terminal(out, keys):
                _loop(url, args, None, out, keys, live=True)
        else:
            _loop(url, args, count, out, None, live=False)
    except ScrapeError as exc:
        print(f"blobfeed top: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # | head
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - no flush error at exit
        return 0
    return 0


def _loop(url: str, args: argparse.Namespace, count: int | None, out: IO[str], keys: IO[str] | None,
          *, live: bool) -> None:
    before: Snapshot | None = None
    shown = 0
    # SIGTERM ends it as Ctrl-C does: the terminal is restored on the way out
    old = signal.signal(signal.SIGTERM, signal.default_int_handler) if live else None
    try:
        while True:
            now = scrape(url, args.timeout, args.max_bytes)
            width = _columns(out) if live else 200
            frame = render(url, now, before, width)
            if live:
                out.write(_HOME_CLEAR + frame + "\nq or Ctrl-C to quit")
            else:
                out.write(("\n" if shown else "") + frame)
            out.flush()
            shown += 1
            before = now
            if count is not None and shown >= count:
                return
            if _wait_for_key(keys, args.interval):
                return
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)


if __name__ == "__main__":
    sys.exit(main())
