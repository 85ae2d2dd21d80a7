"""Security: the metrics endpoint listens on loopback unless the user names
another address, and nothing in blobfeed evaluates or unpickles data -- least
of all data that came from the network."""

from __future__ import annotations

import ast
import re
import inspect
import os
import pickle
import socket
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

import blobfeed
from blobfeed import Net, init_data_input_workers
from blobfeed.metrics import start_http_server

from .helpers import WAIT

PACKAGE = Path(blobfeed.__file__).parent
SOURCES = sorted(PACKAGE.rglob("*.py"))
#: Process workers exchange pickles with child processes this program
#: started itself (its own code, its own user, over pipes no one else holds):
#: the only place pickle may appear.  Nothing from the network or a file.
#: (feeders/starting.py pickles the fetch_fun for those children: it dumps, never loads)
PICKLE_TRUSTED = {"feeders/processes.py", "feeders/child.py", "feeders/transport.py", "feeders/starting.py"}
#: ``blobfeed serve MODULE:FUNCTION`` imports the module its operator names
#: on the command line (as ``python -m`` does): code of the operator's own,
#: never anything a peer sent
OPERATOR_CODE = {"apps/serve.py": r"calls \.import_module\(\)$"}


def listening(port: int) -> list[str]:
    """Addresses a TCP socket of this machine listens on at ``port`` (from /proc/net)."""
    found = []
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            addr, hexport = fields[1].split(":")
            if int(hexport, 16) != port or fields[3] != "0A":  # 0A: LISTEN
                continue
            raw = bytes.fromhex(addr)
            # /proc/net prints each 32-bit word in host (little-endian) order
            words = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
            family = socket.AF_INET if width == 4 else socket.AF_INET6
            found.append(socket.inet_ntop(family, words))
    return found


@pytest.fixture
def pipeline(gc: blobfeed.GlobalCoordinator) -> Iterator[blobfeed.GlobalCoordinator]:
    net = Net(name="n")
    init_data_input_workers(net, ["x"], lambda w, b: [np.zeros(4)], 4, coordinator=gc)
    gc.start()
    net.run(timeout=WAIT)
    yield gc


def test_endpoint_listens_on_loopback_only_by_default(pipeline: blobfeed.GlobalCoordinator) -> None:
    assert inspect.signature(start_http_server).parameters["addr"].default == "127.0.0.1"
    variants: list[dict[str, Any]] = [{"registry": pipeline.registry}, {}]  # the global registry's too
    for kwargs in variants:
        with start_http_server(0, **kwargs) as server:
            assert server.addr == "127.0.0.1"
            assert listening(server.port) == ["127.0.0.1"], "the kernel says it listens elsewhere"
            with urllib.request.urlopen(server.url, timeout=WAIT) as resp:
                assert resp.status == 200


def test_endpoint_is_unreachable_from_another_interface(pipeline: blobfeed.GlobalCoordinator) -> None:
    """Connecting through this machine's own non-loopback address is refused."""
    try:  # the address this host would use to reach the outside (no packet is sent)
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        probe.connect(("192.0.2.1", 9))
        address = probe.getsockname()[0]
        probe.close()
    except OSError:
        pytest.skip("no non-loopback IPv4 interface")
    if address.startswith("127."):
        pytest.skip("no non-loopback IPv4 interface")
    with start_http_server(0, registry=pipeline.registry) as server:
        with pytest.raises(OSError):
            socket.create_connection((address, server.port), timeout=WAIT).close()


def test_another_address_only_when_the_user_names_it(pipeline: blobfeed.GlobalCoordinator) -> None:
    with start_http_server(0, addr="0.0.0.0", registry=pipeline.registry) as server:
        assert server.addr == "0.0.0.0" and listening(server.port) == ["0.0.0.0"]
    assert listening(server.port) == [], "close() must release the port"


MARKER_ENV = "BLOBFEED_SECURITY_MARKER"


class Payload:
    """Unpickling this runs code: it creates the marker file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def test_endpoint_never_executes_or_unpickles_request_data(pipeline: blobfeed.GlobalCoordinator,
                                                            tmp_path: Path) -> None:
    """Pickles and Python expressions sent to the endpoint -- as a body, a
    query, a header, a path -- run nothing; the endpoint only answers GETs."""
    marker = tmp_path / "pwned"
    blob = pickle.dumps(Payload(str(marker)))
    expr = f"__import__('builtins').open({str(marker)!r}, 'w')"
    with start_http_server(0, registry=pipeline.registry) as server:
        base = f"http://127.0.0.1:{server.port}"
        attempts = [
            urllib.request.Request(f"{base}/metrics", data=blob, method="POST",
                                   headers={"Content-Type": "application/python-pickle"}),
            urllib.request.Request(f"{base}/metrics", data=blob, method="PUT"),
            urllib.request.Request(f"{base}/metrics?name[]={urllib.parse.quote(expr)}"),
            urllib.request.Request(f"{base}/metrics", headers={"Accept": expr, "X-Pickle": blob.hex()}),
            urllib.request.Request(f"{base}/{urllib.parse.quote(expr)}"),
        ]
        statuses = []
        for req in attempts:
            try:
                with urllib.request.urlopen(req, timeout=WAIT) as resp:
                    statuses.append(resp.status)
                    resp.read()
            except urllib.error.HTTPError as err:
                statuses.append(err.code)
        with urllib.request.urlopen(f"{base}/metrics", timeout=WAIT) as resp:
            assert "blobfeed_fetched_samples_total" in resp.read().decode()
    assert not marker.exists(), "request data was executed"
    assert statuses[0] >= 400 and statuses[1] >= 400, f"the endpoint accepted a POST/PUT body: {statuses}"


# -- static checks of the package source -------------------------------------------------------------
FORBIDDEN_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle", "joblib",
                     "yaml", "jsonpickle", "code", "codeop"}
FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__", "execfile", "input"}
FORBIDDEN_ATTRS = {"system", "popen", "spawnl", "spawnlp", "spawnv", "getstatusoutput", "getoutput",
                   "import_module", "run_module", "run_path", "read_pickle"}
#: ``x.load(...)`` / ``x.loads(...)`` deserialize code for these ``x`` (json's do not)
UNSAFE_LOADERS = FORBIDDEN_MODULES | {"torch", "pd", "pandas"}


def _calls(tree: ast.AST) -> Iterator[tuple[int, str, ast.Call]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name):
                yield node.lineno, f.id, node
            elif isinstance(f, ast.Attribute):
                yield node.lineno, f.attr, node


def scan(source: str, name: str = "<src>") -> list[str]:
    """Every construct that could evaluate or deserialize code in ``source``."""
    tree = ast.parse(source, name)
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mods = [(node.module or "").split(".")[0]]
        else:
            continue
        problems += [f"{name}:{node.lineno}: imports {m}" for m in mods if m in FORBIDDEN_MODULES]
    for line, fn, call in _calls(tree):
        if fn in FORBIDDEN_CALLS and isinstance(call.func, ast.Name):
            problems.append(f"{name}:{line}: calls {fn}()")
        elif fn in FORBIDDEN_ATTRS:
            problems.append(f"{name}:{line}: calls .{fn}()")
        elif fn in ("load", "loads") and isinstance(call.func, ast.Attribute) \
                and isinstance(call.func.value, ast.Name) and call.func.value.id in UNSAFE_LOADERS:
            problems.append(f"{name}:{line}: calls {call.func.value.id}.{fn}()")
        for kw in call.keywords:
            if kw.arg == "shell" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False):
                problems.append(f"{name}:{line}: {fn}(shell=...)")
            if kw.arg == "allow_pickle" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False):
                problems.append(f"{name}:{line}: {fn}(allow_pickle=...)")
    return problems


def test_the_scan_finds_what_it_looks_for() -> None:
    bad = """
import pickle
from yaml import load
import subprocess, numpy as np, os
x = eval("1")
exec("y = 2")
obj = pickle.loads(b"")
subprocess.run("ls", shell=True)
np.load("f.npy", allow_pickle=True)
os.system("ls")
import json
json.loads("{}")
"""
    found = scan(bad)
    assert len(found) == 8, found
    assert not any("json" in p for p in found), "json.loads is safe"


def test_no_eval_exec_or_unpickling_anywhere_in_the_package() -> None:
    assert SOURCES, PACKAGE
    assert any(p.parent.name == "feeders" for p in SOURCES), "the scan must reach subpackages"
    problems = []
    for path in SOURCES:
        rel = path.relative_to(PACKAGE).as_posix()
        found = scan(path.read_text(), rel)
        if rel in PICKLE_TRUSTED:
            found = [p for p in found if not re.search(r"imports (pickle|cloudpickle)$|calls pickle\.loads\(\)$", p)]
        if rel in OPERATOR_CODE:
            found = [p for p in found if not re.search(OPERATOR_CODE[rel], p)]
        problems += found
    assert not problems, problems


def test_net_model_bytes_go_to_onnxruntime_only(tmp_path: Path) -> None:
    """A model given as bytes is parsed by onnxruntime (protobuf), never
    unpickled: a pickle is rejected and runs nothing."""
    marker = tmp_path / "pwned"
    with pytest.raises(Exception) as info:
        Net(pickle.dumps(Payload(str(marker))))
    assert not marker.exists()
    assert not isinstance(info.value, (pickle.UnpicklingError, AttributeError)), info.value
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("escape", ["\\n", '\\"', "\\\\", "\\u005b"])
def test_a_record_nested_deeper_than_the_bound_is_refused_whatever_its_strings_hold(escape: str) -> None:
    """The nesting check stripped strings after dropping what follows a
    backslash, so ``"\\n"`` became ``"\\"``, read as an escaped quote: the
    "string" swallowed every bracket up to the next quote and a record 500
    deep was decoded (found by review).  Escape pairs go first now."""
    import json

    from blobfeed.service.wire import MAX_DEPTH, WireError, decode_record

    deep = MAX_DEPTH + 10
    record = '{"t":"ack","a":"' + escape + '","b":' + "[" * deep + "]" * deep + ',"c":"z"}'
    assert json.loads(record)["t"] == "ack"  # valid JSON: only the depth is wrong
    with pytest.raises(WireError, match="nested deeper"):
        decode_record(record.encode(), "a peer")
    shallow = '{"t":"ack","a":"' + escape + '","b":' + "[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1) + "}"  # with its own {
    assert decode_record(shallow.encode(), "a peer")["t"] == "ack"


# -- the acknowledgement's own parser (one ack a batch: no JSON decoder) ----------------
ACKS_BLOBFEED_SENDS = [
    b'{"t":"ack","g":0,"slots":[],"waited":0.0}',
    b'{"t":"ack","g":-1,"slots":[3],"waited":12.5}',
    b'{"t":"ack","g":123456789012345678,"slots":[0,1,63,1023],"waited":1e-05}',
    b'{"t":"ack","g":7,"slots":[2],"waited":1.5e+16}',
    b'{"t":"ack","g":7,"slots":[2],"waited":4.611686018427388e+18}',  # over 2**62 seconds: refused
    b'{"t":"ack","g":7,"slots":[2],"waited":1e+999}',  # infinite: refused
]
ACKS_OF_OTHER_SHAPES = [
    b'{"t": "ack", "g": 0, "slots": [], "waited": 0.0}',  # spaces: the general decoder's
    b'{"t":"ack","g":0,"slots":[],"waited":0.0,"x":1}',  # an unknown field: refused
    b'{"t":"ack","g":true,"slots":[],"waited":0.0}',  # a bool: refused
    b'{"t":"ack","g":01,"slots":[],"waited":0.0}',  # not JSON
    b'{"t":"ack","g":-2,"slots":[],"waited":0.0}',
    b'{"t":"ack","g":0,"slots":[-1],"waited":0.0}',
    b'{"t":"ack","g":0,"slots":[1.5],"waited":0.0}',  # a float slot: refused
    b'{"t":"ack","g":0,"slots":[],"waited":NaN}',  # refused
    b'{"t":"ack","g":0,"slots":[],"waited":-0.0}',
    b'{"t":"ack","g":99999999999999999999,"slots":[],"waited":0.0}',  # out of range: refused
    b'{"t":"ack","g":0,"slots":[' + b",".join(b"1" for _ in range(1025)) + b'],"waited":0.0}',  # too many
    b'{"t":"ack","g":0,"slots":[],"waited":0.0}\n',
    b'{"t":"ack","g":0,"slots":[],"waited":0.0}{"t":"bye","waited":0.0}',
]


def _as_the_service_reads(data: bytes) -> Any:
    """What the service makes of one record from a consumer: the checked
    record, or the WireError's text."""
    from blobfeed.service.wire import WireError, check, decode_record, freed_slots

    try:
        record = check(decode_record(data, "peer"), ("ack", "state", "bye"), "peer")
        if record["t"] == "ack":
            freed_slots(record, "peer")
        return dict(record)
    except WireError as err:
        return f"WireError: {err}"


def _as_json_reads(data: bytes) -> Any:
    """The same through the JSON decoder alone (the reference)."""
    import json as json_module

    from blobfeed.service.wire import WireError, _shallow, check, freed_slots

    try:
        if not _shallow(data):
            raise WireError("deep")
        try:
            record = json_module.loads(data)
        except ValueError:
            raise WireError("not JSON") from None
        if not isinstance(record, dict) or not isinstance(record.get("t"), str):
            raise WireError("no kind")
        record = check(record, ("ack", "state", "bye"), "peer")
        if record["t"] == "ack":
            freed_slots(record, "peer")
        return dict(record)
    except WireError as err:
        return f"WireError: {err}"


@pytest.mark.parametrize("data", ACKS_BLOBFEED_SENDS + ACKS_OF_OTHER_SHAPES)
def test_an_ack_is_read_as_the_json_decoder_and_the_checks_read_it(data: bytes) -> None:
    fast, reference = _as_the_service_reads(data), _as_json_reads(data)
    if isinstance(reference, str):
        assert isinstance(fast, str), f"{data[:60]!r} was accepted: {fast!r}"
    else:
        assert fast == reference
        assert all(type(fast[k]) is type(reference[k]) for k in reference)


def test_the_acks_blobfeed_sends_take_the_short_way() -> None:
    from blobfeed.service import wire

    def short(data: bytes) -> bool:
        try:
            return wire.fast_ack(data) is not None
        except wire.WireError:
            return True  # its form, a wait out of range: refused there

    assert all(short(d) for d in ACKS_BLOBFEED_SENDS)
    assert all(wire.fast_ack(d) is None for d in ACKS_OF_OTHER_SHAPES[:2])
