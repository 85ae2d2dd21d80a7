"""The ``blobfeed`` console command.

``blobfeed COMMAND [ARGS...]`` as git, pip and docker users know it:
``blobfeed --help`` (``-h``, ``help``) lists the commands,
``blobfeed help COMMAND`` (or ``blobfeed COMMAND --help``) shows a command's
options, ``blobfeed version`` (``--version``, ``-V``) prints the version.
Exit status 2 for a usage error (an unknown command, say)."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable

#: what each command does, in the order the help lists them
SUMMARIES = {
    "demo": "score a real dataset with a real ONNX model, fed by blobfeed (no network)",
    # "bench": made from the workload table by _bench_summary(), so it cannot go stale
    "bench": "",
    "serve": "serve input sources to trainer processes (blobfeed serve MODULE:FUNCTION)",
    "top": "watch a running pipeline or service live from its /metrics address: rates, queues, "
           "waits, the bottleneck (blobfeed top HOST:PORT)",
    "help": "show this help, or a command's: blobfeed help COMMAND",
    "version": "print blobfeed's version",
}


def _bench_summary() -> str:
    """What ``blobfeed bench`` runs, from its own defaults and workload table."""
    from .bench.cli import DEFAULT_WORKLOADS
    from .bench.workloads import WORKLOADS

    default = DEFAULT_WORKLOADS.split(",")
    return (
        f"run the benchmarks, blobfeed beside its baselines and peers: workloads "
        f"{', '.join(default)} by default ({len(WORKLOADS)} with --workloads all); exit 1 if a "
        f"target is missed"
    )


def usage() -> str:
    """The top-level help text."""
    summaries = dict(SUMMARIES, bench=_bench_summary())
    width = max(len(c) for c in summaries) + 2
    lines = [
        "usage: blobfeed [-h] [-V] COMMAND [ARGS...]",
        "",
        "Feed ONNX nets with blobfeed: a demo, the benchmarks and the feeding service.",
        "",
        "commands:",
        *(textwrap.fill(s, 79, initial_indent=f"  {c:<{width}}", subsequent_indent=" " * (width + 2))
          for c, s in summaries.items()),
        "",
        "options:",
        "  -h, --help     show this help and exit",
        "  -V, --version  print blobfeed's version and exit",
        "",
        "Run 'blobfeed COMMAND --help' or 'blobfeed help COMMAND' for its options.",
        "Exit status 2 for a usage error; each command documents its others.",
    ]
    return "\n".join(lines) + "\n"


def _command(name: str) -> Callable[[list[str]], int] | None:
    """The ``main`` of command ``name``, imported only when it runs."""
    if name == "demo":
        from .demo import main as demo_main

        return demo_main
    if name == "serve":
        from .serve import main as serve_main

        return serve_main
    if name == "top":
        from .top import main as top_main

        return top_main
    if name == "bench":
        from .bench.cli import main as bench_main

        return bench_main
    return None


def _version() -> int:
    import blobfeed

    print(f"blobfeed {blobfeed.__version__}")
    return 0


def _unknown(command: str) -> int:
    print(f"blobfeed: unknown command {command!r}; the commands are {', '.join(SUMMARIES)} "
          f"(see 'blobfeed --help')", file=sys.stderr)
    return 2


def _run(main: Callable[[list[str]], int], args: list[str]) -> int:
    """A command's ``main``; argparse's own exit (``--help``, a usage error) becomes its status."""
    try:
        return main(args)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)


def main(argv: list[str] | None = None) -> int:
    """Run the ``blobfeed`` command; returns its exit status."""
    args = sys.argv[1:] if argv is None else list(argv)
    if not args:
        print(usage(), end="", file=sys.stderr)
        return 2
    first, rest = args[0], args[1:]
    if first in ("-h", "--help"):
        print(usage(), end="")
        return 0
    if first in ("-V", "--version", "version"):
        if rest:
            print(f"blobfeed: {first} takes no arguments, got {' '.join(rest)!r}", file=sys.stderr)
            return 2
        return _version()
    if first == "help":
        if not rest:
            print(usage(), end="")
            return 0
        if rest[0] in ("help", "version"):
            print(f"blobfeed {rest[0]}: {SUMMARIES[rest[0]]}")
            return 0
        command = _command(rest[0])
        if command is None:
            return _unknown(rest[0])
        return _run(command, ["--help"])
    if first.startswith("-"):
        print(f"blobfeed: unknown option {first!r} (see 'blobfeed --help')", file=sys.stderr)
        return 2
    command = _command(first)
    if command is None:
        return _unknown(first)
    return _run(command, rest)


if __name__ == "__main__":
    sys.exit(main())
