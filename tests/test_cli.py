"""The ``blobfeed`` command itself: its help, ``help`` and ``version`` as
git/pip/docker users expect them, and the messages of every option type."""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

import blobfeed
from blobfeed.apps import cli, demo, serve
from blobfeed.apps.bench import cli as bench_cli
from blobfeed.apps.bench import workloads

ROOT = Path(__file__).resolve().parent.parent


def test_top_level_help_follows_the_conventions(capsys: pytest.CaptureFixture[str]) -> None:
    for flag in ("--help", "-h", "help"):
        assert cli.main([flag]) == 0
        out = capsys.readouterr().out
        assert out.startswith("usage: blobfeed [-h] [-V] COMMAND [ARGS...]\n"), out
        assert re.search(r"^  -h, --help +show this help and exit$", out, re.M), out
        assert re.search(r"^  -V, --version +print blobfeed's version and exit$", out, re.M), out
        assert "Run 'blobfeed COMMAND --help' or 'blobfeed help COMMAND' for its options." in out
        for command in ("demo", "bench", "serve", "help", "version"):
            assert re.search(rf"^  {command} +\S", out, re.M), (command, out)


def test_the_bench_line_says_what_bench_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """It said "W1-W5" while bench's table has 20 workloads: the line is made
    from bench's default and its workload table."""
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80, out
    start = out.index("  bench ")
    line = " ".join(out[start: out.index("  serve ", start)].split())  # wrapped
    default = bench_cli.DEFAULT_WORKLOADS.split(",")
    assert f"workloads {', '.join(default)} by default" in line, line
    assert f"({len(workloads.WORKLOADS)} with --workloads all)" in line, line


def test_version_in_every_spelling(capsys: pytest.CaptureFixture[str]) -> None:
    for spelling in ("version", "--version", "-V"):
        assert cli.main([spelling]) == 0
        assert capsys.readouterr().out == f"blobfeed {blobfeed.__version__}\n"
    assert cli.main(["version", "extra"]) == 2
    assert "takes no arguments" in capsys.readouterr().err


@pytest.mark.parametrize("command, expect", [
    ("demo", "usage: blobfeed demo"), ("bench", "usage: blobfeed bench"), ("serve", "usage: blobfeed serve"),
])
def test_help_command_shows_the_commands_help(command: str, expect: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["help", command]) == 0
    help_out = capsys.readouterr().out
    assert help_out.startswith(expect), help_out
    assert cli.main([command, "--help"]) == 0
    assert capsys.readouterr().out == help_out  # the same text both ways


def test_unknown_commands_and_options_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["frobnicate"], ["help", "frobnicate"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert "unknown command 'frobnicate'" in err and "blobfeed --help" in err, err
    assert cli.main(["--frobnicate"]) == 2
    assert "unknown option '--frobnicate'" in capsys.readouterr().err
    assert cli.main([]) == 2  # no command: the help, on stderr
    assert "usage: blobfeed" in capsys.readouterr().err


def test_the_console_command_in_a_subprocess() -> None:
    proc = subprocess.run([sys.executable, "-m", "blobfeed.apps.cli", "help", "bench"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: blobfeed bench"), proc.stdout


# --------------------------------------------------------------------------- option types
def _custom_types(parser: argparse.ArgumentParser) -> list[tuple[str, object]]:
    return [(a.option_strings[0], a.type) for a in parser._actions
            if a.option_strings and callable(a.type) and a.type not in (int, float, str)]


PARSERS = {"demo": demo.build_parser, "bench": bench_cli.build_parser, "serve": serve._parser}


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_every_custom_type_names_what_it_wants(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``--batch-size=abc`` said "invalid _positive value": argparse shows a
    type function's __name__.  Every custom type has a name a user reads."""
    parser = PARSERS[name]()
    types = _custom_types(parser)
    assert types or name == "serve"
    for option, _ in types:
        argv = [f"{option}=abc"] + (["x:y"] if name == "serve" else [])
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        m = re.search(rf"argument {re.escape(option)}: invalid ([a-z ]+): 'abc'$", err, re.M)
        assert m, err
        assert " " in m.group(1), err  # words, not a function's name


def test_the_demo_batch_size_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--batch-size=abc"]) == 2
    assert "argument --batch-size: invalid positive integer: 'abc'" in capsys.readouterr().err
    assert demo.main(["--metrics-port=70000"]) == 2
    assert "argument --metrics-port: must be 0..65535, got 70000" in capsys.readouterr().err


def test_the_serve_metrics_port_is_checked_as_a_port(capsys: pytest.CaptureFixture[str]) -> None:
    for bad, said in (("abc", "invalid port number: 'abc'"), ("-1", "must be 0..65535, got -1")):
        with pytest.raises(SystemExit):
            serve._parser().parse_args(["x:y", "--metrics-port", bad])
        assert said in capsys.readouterr().err


def test_the_serve_help_says_what_the_flags_do_as_the_docs_do() -> None:
    """--help left /readyz out of --metrics-port, and said the state is
    saved on SIGTERM/SIGINT only (SIGHUP, and every source's end, stop and
    save it too)."""
    text = " ".join(serve._parser().format_help().split())
    assert "/metrics, /healthz and /readyz" in text, text
    assert "at every stop (SIGTERM, SIGINT, SIGHUP, or every source ended)" in text, text


# --------------------------------------------------------------------------- a taken metrics port
def _listener() -> tuple[socket.socket, int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, s.getsockname()[1]


def test_serve_with_a_taken_metrics_port_fails_before_the_target_runs(tmp_path: Path) -> None:
    """Issue 24: the port was found taken only in start(), after the target
    had wired its sources (and process workers started), and the message had
    an "[Errno 98]" in it.  Now: one line naming the port, exit 2, and the
    target never imported."""
    marker = tmp_path / "imported"
    target = tmp_path / "wiring.py"
    target.write_text(f"open({str(marker)!r}, 'w').close()\ndef wire():\n    pass\n")
    sock, port = _listener()
    with sock:
        proc = subprocess.run(
            [sys.executable, "-m", "blobfeed.apps.cli", "serve", f"{target}:wire", "--metrics-port", str(port)],
            capture_output=True, text=True, timeout=60, cwd=ROOT,
        )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [
        f"blobfeed serve: cannot serve metrics on 127.0.0.1:{port}: Address already in use; "
        "choose another --metrics-port, or 0 for any free port"], proc.stderr
    assert not marker.exists()


def test_serve_serves_its_metrics_and_health(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "N": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "blobfeed.apps.cli", "serve", "tests.service.feeds:wire_by_index",
         "--listen", str(tmp_path / "feed.sock"), "--metrics-port", "0"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        assert "listening on" in proc.stdout.readline()  # bounded: printed once listening, or the process exits
        line = proc.stdout.readline()
        m = re.match(r"blobfeed serve: metrics on (http://127\.0\.0\.1:\d+)/metrics$", line.strip())
        assert m, line
        with urllib.request.urlopen(m.group(1) + "/metrics", timeout=10) as resp:
            assert b"blobfeed_" in resp.read()
        for path in ("/healthz", "/readyz"):  # as FeedServer serves them itself
            with urllib.request.urlopen(m.group(1) + path, timeout=10) as resp:
                assert resp.status == 200 and resp.read().strip() == b"ok", path
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
