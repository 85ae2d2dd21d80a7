"""The ``blobfeed`` console command."""

from __future__ import annotations

import sys

USAGE = """usage: blobfeed COMMAND [options]
       blobfeed --version

commands:
  demo    score a real dataset with a real ONNX model, fed by blobfeed (no network)
  bench   run workloads W1-W5 against blobfeed and its baselines; exit 1 if a target is missed
  serve   serve input sources to trainer processes (blobfeed serve MODULE:FUNCTION --help)
"""


def main(argv: list[str] | None = None) -> int:
    """Run the ``blobfeed`` command; returns its exit status."""
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        import blobfeed

        print(f"blobfeed {blobfeed.__version__}")
        return 0
    command, rest = args[0], args[1:]
    if command == "demo":
        from .demo import main as demo_main

        return demo_main(rest)
    if command == "serve":
        from .serve import main as serve_main

        return serve_main(rest)
    if command == "bench":
        from .bench.cli import main as bench_main

        return bench_main(rest)
    print(f"blobfeed: unknown command {command!r}\n{USAGE}", end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
