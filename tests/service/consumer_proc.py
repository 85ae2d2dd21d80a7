"""A consumer process for the service tests: attaches, runs, writes one
JSON line per batch (its ids) and a last line with how it ended."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import blobfeed


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("address")
    p.add_argument("out")
    p.add_argument("--index", type=int, default=None)
    p.add_argument("--num", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--die-after", type=int, default=None, help="SIGKILL itself after this many batches")
    p.add_argument("--timeout", type=float, default=20.0)
    p.add_argument("--max-batches", type=int, default=None, help="detach after this many batches (exit 0)")
    p.add_argument("--check-rows", action="store_true", help="each row of x holds its id throughout (exit 6 if not)")
    p.add_argument("--hold-after", type=int, default=None,
                   help="after this many batches, wait (up to 60 s) for SIGUSR1 before the next run()")
    p.add_argument("--source", default="train")
    p.add_argument("--report-wait", action="store_true",
                   help="after detaching, a last line with the seconds run() waited in all, as this process measured")
    a = p.parse_args()
    if a.hold_after is not None:
        # blocked in every thread (they inherit it), so sigtimedwait takes it
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    net = blobfeed.Net(None, name=f"rank{a.index}")
    with open(a.out, "w") as out:
        def line(obj: object) -> None:
            out.write(json.dumps(obj) + "\n")
            out.flush()

        try:
            att = blobfeed.attach_source(
                net, ["id", "x"], a.batch_size, a.source, a.address, consumer_index=a.index,
                num_consumers=a.num, timeout=a.timeout,
            )
        except (ValueError, blobfeed.BlobfeedError) as err:
            line({"end": "refused", "type": type(err).__name__, "error": str(err)})
            return 3
        line({"attached": att.consumer})
        n = 0
        try:
            while True:
                try:
                    got = net.run()
                except blobfeed.EndOfEpoch as e:
                    line({"epoch_end": e.epoch})
                    continue
                assert not got["id"].flags.writeable
                if a.check_rows and not (got["x"] == got["id"][:, None]).all():
                    line({"end": "bad rows", "ids": got["id"].tolist()})
                    return 6
                line({"ids": got["id"].tolist()})
                n += 1
                if n == a.max_batches:
                    line({"end": "enough"})
                    return 0
                if a.die_after is not None and n >= a.die_after:
                    os.kill(os.getpid(), signal.SIGKILL)
                if n == a.hold_after:
                    line({"holding": n})
                    if signal.sigtimedwait({signal.SIGUSR1}, 60) is None:
                        line({"end": "never released"})
                        return 5
        except blobfeed.EndOfInput:
            line({"end": "input"})
        except blobfeed.BlobfeedError as err:
            line({"end": "error", "type": type(err).__name__, "error": str(err), "t": time.time()})
            return 4
        finally:
            att.stop()
            if a.report_wait:
                line({"waited": att.reader.waited()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
