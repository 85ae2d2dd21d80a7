"""The package's imports run one way (docs/ARCHITECTURE.md).

Every import counts, function-level and ``TYPE_CHECKING`` ones included:
a module may import only modules of lower layers, and the applications only
public modules.  A new module must be given its layer here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "blobfeed"

#: lower imports higher never; same layer never (except a package and its parts)
LAYERS: dict[str, int] = {
    "blobfeed.errors": 0, "blobfeed.arguments": 0, "blobfeed.worker_info": 0, "blobfeed.stats": 0,
    # the bottleneck verdict: reads the hub's sums (types only)
    "blobfeed.bottleneck": 0.5,
    # the worker-count tuner (num_worker_threads="auto"): reads the verdict's
    # snapshots, acts through the coordinator it is handed
    "blobfeed.autotune": 0.6,
    # the byte limit that follows need (max_buffered_bytes="auto"): reads the hub's sums
    # (types only), sets the limit of the queue it is handed
    "blobfeed.buffers": 0.65,
    # shared memory another process may map (worker slots, the service's arena): where a batch lies
    "blobfeed.shared_regions": 0.7,
    "blobfeed.queues": 1,
    # warnings a stranger can cause: a few per window, the rest counted (the endpoint's, the service's)
    "blobfeed.log_throttle": 0.8,
    "blobfeed.feeders.chunks": 2,
    "blobfeed.feeders.rebatch": 3,
    "blobfeed.feeders.shuffle": 3.05,
    # random-access sources: read units (the dispenser, the reader), and the dealer that orders them
    "blobfeed.feeders.pulling": 3.06, "blobfeed.feeders.read_units": 3.07, "blobfeed.feeders.indexed": 3.08, "blobfeed.feeders.dealing.indexed": 3.3,
    # sharded sources: a random-access source with its own reader
    "blobfeed.feeders.sharded": 3.09,
    "blobfeed.feeders.dealing.base": 3.1, "blobfeed.feeders.dealing.turns": 3.1,
    "blobfeed.feeders.dealing.positions": 3.1, "blobfeed.feeders.dealing.rounds": 3.12,
    "blobfeed.feeders.dealing.stages": 3.15, "blobfeed.feeders.dealing.arrival": 3.2,
    "blobfeed.feeders.dealing.lanes": 3.2, "blobfeed.feeders.dealing": 3.5,
    "blobfeed.feeders.replay": 3, "blobfeed.feeders.messages": 3,
    # a worker process's batches assembled in its own slots (its messages only)
    "blobfeed.feeders.worker_batches": 3.01,
    # a worker process's slot as the place its random-access reader stacks a unit (messages only)
    "blobfeed.feeders.unit_slots": 3.01,
    "blobfeed.feeders.source": 4,
    "blobfeed.feeders.worker_loop": 4.5,
    "blobfeed.feeders.enqueuer": 5, "blobfeed.feeders.reading": 5.5,
    "blobfeed.feeders.backends": 6,
    "blobfeed.feeders.transport": 6,
    "blobfeed.feeders.child": 7, "blobfeed.feeders.starting": 7, "blobfeed.feeders.slot_ring": 7,
    "blobfeed.feeders.processes": 8, "blobfeed.feeders.ray_backend": 8, "blobfeed.feeders.ray_pins": 7,
    # a Ray fetch actor's calls, put back in the order the driver made them (read units only)
    "blobfeed.feeders.ray_calls": 7,
    "blobfeed.feeders": 9,
    # the /metrics endpoint (its HTTP server), re-exported by blobfeed.metrics
    "blobfeed.endpoint": 9.9,
    "blobfeed.net": 10, "blobfeed.metrics": 10,
    "blobfeed.coordinator.groups": 10.2, "blobfeed.coordinator.registry": 10.3,
    "blobfeed.coordinator.checkpoint": 10.3, "blobfeed.coordinator.elastic": 10.4,
    "blobfeed.coordinator.monitor": 10.45,
    "blobfeed.coordinator.lifecycle": 10.5,
    "blobfeed.coordinator.wiring": 10.6,
    "blobfeed.coordinator": 11,
    # the reader seam: the one way in to a source besides the public names
    "blobfeed.reader": 11.02,
    # the feeding service: a source served to nets in other processes
    "blobfeed.service.wire": 11.1, "blobfeed.service.ackstream": 11.12, "blobfeed.service.state_file": 11.12, "blobfeed.service.tcp": 11.15,
    "blobfeed.service.socket_path": 11.12,
    "blobfeed.service.slots": 11.2,
    "blobfeed.service.arena": 11.22,
    # what a connection lends its consumer of the shared memory its batches lie in
    "blobfeed.service.lending": 11.24,
    "blobfeed.service.transport": 11.25, "blobfeed.service.served": 11.3,
    "blobfeed.service.ledger": 11.32, "blobfeed.service.admission": 11.35,
    # a consumer's state requests and their answers, by number
    "blobfeed.service.state_requests": 11.33,
    "blobfeed.service.connection": 11.4, "blobfeed.service.server": 11.5, "blobfeed.service.consumer": 11.5,
    # the consumer end's dealer (every transport's), the consumer end over Ray (consumer.py
    # dispatches ray:// addresses down to it) and the service as a Ray actor (a FeedServer)
    "blobfeed.service.remote": 11.05, "blobfeed.service.ray_attach": 11.45, "blobfeed.service.ray_service": 11.6,
    "blobfeed.service": 11.8,
    # Caffe2's module name (from blobfeed import data_workers): re-exports the coordinator's
    "blobfeed.data_workers": 11.9,
    "blobfeed": 12,
    "blobfeed.ray": 13,
    # the applications (blobfeed.apps): one way among themselves too
    "blobfeed.apps.argtypes": 13.9, "blobfeed.apps.demo_models": 13.92, "blobfeed.apps.demo_checks": 13.92,
    "blobfeed.apps": 14, "blobfeed.apps.models": 14, "blobfeed.apps.demo": 14, "blobfeed.apps.bench": 14,
    "blobfeed.apps.bench.measure": 14.1, "blobfeed.apps.bench.workloads": 14.2,
    "blobfeed.apps.bench.autobench": 14.25,
    "blobfeed.apps.bench.report": 14.3, "blobfeed.apps.bench.library": 14.3, "blobfeed.apps.bench.peers.base": 14.3,
    "blobfeed.apps.bench.service": 14.3, "blobfeed.apps.bench.direct": 14.35,
    **{f"blobfeed.apps.bench.peers.{peer}": 14.4 for peer in (
        "caffe2", "copy_bound", "grain_dataset", "model_alone", "mp_pool", "ray_data", "torch_dataloader", "work_bound")},
    "blobfeed.apps.bench.peers": 14.5, "blobfeed.apps.bench.runner": 14.6, "blobfeed.apps.bench.cli": 14.7,
    "blobfeed.apps.bench.__main__": 14.8, "blobfeed.apps.serve": 14.8, "blobfeed.apps.top": 14.8, "blobfeed.apps.cli": 14.9,
}
APPS = {m for m in LAYERS if m == "blobfeed.apps" or m.startswith("blobfeed.apps.")}
#: what an application may import of the package
PUBLIC = {"blobfeed", "blobfeed.metrics", "blobfeed.ray", "blobfeed.service"} | APPS


SERVICE = {m for m in LAYERS if m == "blobfeed.service" or m.startswith("blobfeed.service.")}
#: what the feeding service may import of the core: modules whose names are
#: public (the errors, Net, the coordinator, the metrics), the argument
#: checks and the log throttle every layer shares, and the reader seam
SERVICE_MAY = {
    "blobfeed.errors", "blobfeed.arguments", "blobfeed.net", "blobfeed.coordinator", "blobfeed.metrics",
    "blobfeed.queues", "blobfeed.reader", "blobfeed.log_throttle",
}
#: the service's imports of the core's insides still to go, each with the
#: step of issue 25 that removes it; a new one fails the test
SERVICE_DEBTS: set[tuple[str, str]] = set()


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, name: str | None = None) -> set[str]:
    """Every blobfeed module ``path`` (module ``name``) imports, wherever the
    import statement is."""
    name = module_name(path) if name is None else name
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "blobfeed")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "blobfeed":
                continue
            # `from . import x` / `from .feeders import y`: x may be a module
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in LAYERS else target)
    found.discard(name)
    return found


def all_modules() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py"))


def test_every_module_has_a_layer() -> None:
    missing = [module_name(p) for p in all_modules() if module_name(p) not in LAYERS]
    assert not missing, f"give these modules a layer in tests/test_layers.py: {missing}"


@pytest.mark.parametrize("path", all_modules(), ids=module_name)
def test_imports_run_one_way(path: Path) -> None:
    me = module_name(path)
    bad = []
    for target in sorted(imports_of(path)):
        if me in APPS and target not in PUBLIC:
            bad.append(f"{target} (an application uses public modules only)")
        elif me in APPS and target not in APPS:
            continue  # the library's public modules are below every application
        elif target not in LAYERS:
            bad.append(f"{target} (no layer)")
        elif LAYERS[target] >= LAYERS[me] and not me.startswith(target + "."):
            bad.append(f"{target} (layer {LAYERS[target]} >= {me}'s {LAYERS[me]})")
        elif me.startswith(target + "."):
            bad.append(f"{target} (a module must not import its own package)")
    assert not bad, f"{me} imports upward: {bad}"


#: the most lines a module may have (issue 25): a module past it does more
#: than one thing, and is split into modules named for what they do
MAX_MODULE_LINES = 900


def test_no_module_is_over_900_lines() -> None:
    long = {module_name(p): n for p in all_modules() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by what they do): {long}"


def test_the_check_catches_an_upward_import(tmp_path: Path) -> None:
    """The checker itself: planted upward imports, at module and function level, are found."""
    fake = tmp_path / "queues.py"
    fake.write_text(
        (PKG / "queues.py").read_text()
        + "\ndef f():\n    from .coordinator import GlobalCoordinator\n"
        + "\nif False:\n    from . import net\n"
    )
    found = imports_of(fake, "blobfeed.queues")
    assert {"blobfeed.coordinator", "blobfeed.net"} <= found


def _imported_names(path: Path, name: str) -> list[tuple[str, str]]:
    """(module, name) of every ``from blobfeed... import name`` in ``path``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "blobfeed":
                found += [(target, a.name) for a in node.names]
    return found


@pytest.mark.parametrize("path", [p for p in all_modules() if module_name(p) in SERVICE], ids=module_name)
def test_the_service_uses_public_names_and_the_reader_seam_only(path: Path) -> None:
    """The feeding service is a consumer of the library like any other: it
    reaches the core through public modules and names and the reader seam
    (``blobfeed.reader``), never through the core's insides."""
    me = module_name(path)
    bad = sorted(
        t for t in imports_of(path)
        if t not in SERVICE and t not in SERVICE_MAY and (me, t) not in SERVICE_DEBTS
    )
    assert not bad, f"{me} imports the core's insides: {bad} (use public names or blobfeed.reader)"
    private = sorted(
        f"{mod}.{n}" for mod, n in _imported_names(path, me)
        if mod not in SERVICE and mod in SERVICE_MAY and n.startswith("_")
    )
    assert not private, f"{me} imports private names of the core: {private}"
    unlisted = sorted(
        f"{mod}.{n}" for mod, n in _imported_names(path, me)
        if mod not in SERVICE and mod in SERVICE_MAY and n not in _exported(mod) and (mod, n) not in SERVICE_SHARED
    )
    assert not unlisted, (
        f"{me} imports names the core does not export (not in their module's __all__): {unlisted}"
    )


def _exported(module: str) -> set[str]:
    """A module's ``__all__``, read from its source (or its package's ``__init__.py``)."""
    base = PKG.parent / Path(*module.split("."))
    path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


#: names the service takes from the core that its modules do not export,
#: each a helper every layer shares, with why
SERVICE_SHARED: dict[tuple[str, str], str] = {
    ("blobfeed.queues", "drained"): "what a weakref callback queue holds, taken without waiting (the arena's too)",
    ("blobfeed.errors", "release_frames"): "an error kept by a caller must not keep its frames' locals alive",
    ("blobfeed.coordinator", "resolve_backend"): "backend='processes' made into the object whose slots "
                                                 "the service sizes for what its consumers hold",
}


def test_the_service_debts_are_still_owed() -> None:
    """Each listed debt is still there: a paid one leaves the list."""
    owed = {(module_name(p), t) for p in all_modules() for t in imports_of(p) if module_name(p) in SERVICE}
    assert SERVICE_DEBTS <= owed, f"paid, remove from SERVICE_DEBTS: {sorted(SERVICE_DEBTS - owed)}"


def test_the_core_names_no_service_module() -> None:
    """No module below the service names one of its modules (in a string,
    as a list of stoppers once did): the core knows no consumer."""
    bad = []
    for path in all_modules():
        me = module_name(path)
        if me in SERVICE or me in APPS or LAYERS.get(me, 0) > LAYERS["blobfeed.service"]:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "blobfeed.service" in node.value:
                bad.append(f"{me}: {node.value[:60]!r}")
    assert not bad, f"the core names service modules: {bad}"


#: private attributes the service reads of objects other than ``self``: its
#: own objects' and Ray's, none of the core's (ray_service.py is item 3's)
SERVICE_PRIVATE_OK = {
    ("blobfeed.service.ray_service", "_forget"),          # FeedServer's, from its Ray actor
    ("blobfeed.service.ray_service", "_held_elsewhere"),  # FeedServer's, from its Ray actor
    ("blobfeed.service.ray_service", "_get"),             # its own RayService handle's
    ("blobfeed.service.ray_service", "_actor_id"),        # Ray's ActorHandle
    ("blobfeed.service.consumer", "_is_owned"),           # threading.RLock's, as threading.Condition asks it
    ("blobfeed.service.tcp", "_is_owned"),                # threading.RLock's, as threading.Condition asks it
}


@pytest.mark.parametrize("path", [p for p in all_modules() if module_name(p) in SERVICE], ids=module_name)
def test_the_service_reads_no_private_attribute_of_another_object(path: Path) -> None:
    """The service reaches the core's objects through their public methods
    (the reader seam): no ``x._name`` on anything but ``self``/``cls``
    (namedtuple's ``_replace`` is public), beyond the listed ones."""
    me = module_name(path)
    bad = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        if node.attr in ("_replace", "_asdict", "_fields"):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        if (me, node.attr) not in SERVICE_PRIVATE_OK:
            bad.append(f"line {node.lineno}: {ast.unparse(node)}")
    assert not bad, f"{me} reads private attributes: {bad}"
