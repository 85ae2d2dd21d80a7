"""The repository's Markdown stands alone.

Every ``*.md`` file of the repository (README.md, docs/, examples/, any
other) is read, and:

* no link or relative path may leave the repository: a target that
  resolves outside the repository root, an absolute filesystem path, a
  ``file:`` URL, or any mention of the development machine's shared folder
  or the contract and benchmark files kept there (files that users of the
  repository never see) is a failure;
* every relative link target must exist, and a ``#fragment`` must name a
  heading (or an HTML anchor) of the target Markdown file;
* a repository path mentioned in prose or in an inline code span
  (``docs/CONTRACT.md``, ``tests/test_pipeline.py::test_x``) must exist.

Links to public web pages (``http(s)://``, ``mailto:``) are allowed.
The check is a plain function, :func:`link_problems`; the tests below run
it on the repository and on planted bad links, to show it catches them.
"""

from __future__ import annotations

import os
import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

#: the outside names, spelled in parts so this file does not itself mention them
UP = "../" + "shared"
SPEC = "SP" + "EC.md"
BENCH = "BEN" + "CH.md"

REPO = Path(__file__).resolve().parent.parent

#: Directories that are not part of the repository's documentation.
SKIP_DIRS = {
    ".git", ".venv", "venv", "env", "node_modules", "build", "dist", "__pycache__",
    ".pytest_cache", ".mypy_cache", ".ruff_cache", ".tox", ".hypothesis",
}

#: Text that points at files outside the repository, wherever it appears
#: (prose, code spans, fenced code, link targets).
FORBIDDEN = [
    (re.compile(r"\.\./+" + "shared" + r"\b"), "points into " + UP + ", outside the repository"),
    (
        re.compile(r"(?<![\w.-])(?:" + "shared" + r"/)?(?:" + "SP" + "EC|" + "BEN" + r"CH)\.md\b", re.IGNORECASE),
        "names " + SPEC + " / " + BENCH + ", files outside the repository "
        "(the contract is docs/CONTRACT.md, the workloads docs/BENCHMARKS.md)",
    ),
    (re.compile(r"(?<![\w.-])/work/"), "an absolute path of the development machine"),
]

_WEB_SCHEME = re.compile(r"^(?:https?|mailto|ftp):", re.IGNORECASE)
_ANY_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")

# [text](target "title") and ![alt](target); the text may hold one level of [brackets]
_INLINE_LINK = re.compile(
    r"!?\[(?:[^\[\]\n]|\[[^\[\]\n]*\])*\]\(\s*(<[^>\n]*>|[^)\s]+)(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)"
)
_REF_DEFINITION = re.compile(r"^ {0,3}\[[^\]\n]+\]:\s*(<[^>\n]*>|\S+)", re.MULTILINE)
_AUTOLINK = re.compile(r"<([a-zA-Z][a-zA-Z0-9+.-]*:[^>\s]*)>")
_HTML_ATTR = re.compile(r"""\b(?:href|src)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)
_HTML_ANCHOR = re.compile(r"""<a\s[^>]*\b(?:name|id)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)
_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)[ \t]*#*[ \t]*$", re.MULTILINE)
_FENCE_OPEN = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_CODE_SPAN = re.compile(r"(`+)(.+?)(?<!`)\1(?!`)", re.DOTALL)


def _blank(text: str) -> str:
    """``text`` with every character but newlines replaced by a space (offsets kept)."""
    return re.sub(r"[^\n]", " ", text)


def strip_fences(text: str) -> str:
    """Blank out fenced code blocks, keeping line numbers."""
    out: list[str] = []
    fence: str | None = None
    for line in text.splitlines(keepends=True):
        if fence is None:
            m = _FENCE_OPEN.match(line)
            if m:
                fence = m.group(1)
                out.append(_blank(line))
                continue
            out.append(line)
        else:
            stripped = line.strip()
            if stripped.startswith(fence) and set(stripped) == {fence[0]}:
                fence = None
            out.append(_blank(line))
    return "".join(out)


def strip_code_spans(text: str) -> str:
    return _CODE_SPAN.sub(lambda m: _blank(m.group(0)), text)


def slugify(heading: str) -> str:
    """GitHub's anchor for a heading (github-slugger's rule)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links: their text only
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    kept = []
    for ch in text.strip().lower():
        cat = unicodedata.category(ch)
        if ch in " -" or cat[0] in "LMN" or cat == "Pc":
            kept.append(ch)
    return "".join(kept).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every ``#fragment`` a Markdown text defines: heading slugs and HTML anchors."""
    prose = strip_fences(text)
    seen: dict[str, int] = {}
    out: set[str] = set()
    for m in _HEADING.finditer(prose):
        slug = slugify(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    out.update(a for a in _HTML_ANCHOR.findall(text))
    return out


def _top_level_names(root: Path) -> list[str]:
    try:
        entries = list(root.iterdir())
    except OSError:
        return []
    return sorted(
        e.name for e in entries
        if e.is_dir() and e.name not in SKIP_DIRS and not e.name.endswith(".egg-info")
    )


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _inside(path: Path, root: Path) -> bool:
    try:
        path.relative_to(root)
        return True
    except ValueError:
        return False


def link_problems(text: str, md_path: Path, root: Path = REPO) -> list[str]:
    """Everything wrong with the links and paths of one Markdown text.

    Args:
        text: the Markdown.
        md_path: where it lives (relative links resolve against its folder);
            it need not exist.
        root: the repository root no link may leave.

    Returns:
        One ``"<file>:<line>: <problem>"`` string per problem; empty when all is well.
    """
    root = root.resolve()
    md_path = md_path if md_path.is_absolute() else root / md_path
    base = md_path.parent.resolve()
    try:
        shown = md_path.resolve().relative_to(root).as_posix()
    except ValueError:
        shown = str(md_path)
    found: set[tuple[int, str]] = set()

    def report(offset: int, message: str) -> None:
        found.add((_line_of(text, offset), message))

    # 1. text that points at files users never see, anywhere in the file
    for pattern, message in FORBIDDEN:
        for m in pattern.finditer(text):
            report(m.start(), f"{message}: {m.group(0)!r}")

    # 2. link targets (not inside code)
    prose = strip_fences(text)
    links_text = strip_code_spans(prose)
    targets: list[tuple[int, str]] = []
    for regex in (_INLINE_LINK, _REF_DEFINITION, _AUTOLINK, _HTML_ATTR):
        for m in regex.finditer(links_text):
            target = m.group(1)
            if target.startswith("<") and target.endswith(">"):
                target = target[1:-1]
            targets.append((m.start(1), target))
    own_anchors: set[str] | None = None
    for offset, target in sorted(targets):
        if _WEB_SCHEME.match(target):
            continue
        if _ANY_SCHEME.match(target):
            report(offset, f"link {target!r}: only web links may leave the repository")
            continue
        path_part, _, fragment = target.partition("#")
        path_part = unquote(path_part.split("?", 1)[0])
        fragment = unquote(fragment)
        if not path_part:  # "#section" of this file
            if own_anchors is None:
                own_anchors = anchors(text)
            if fragment and fragment not in own_anchors:
                report(offset, f"link {target!r}: no heading or anchor #{fragment} in this file")
            continue
        if path_part.startswith("/") or re.match(r"^[A-Za-z]:[\\/]", path_part):
            report(offset, f"link {target!r}: an absolute path; use a path relative to this file")
            continue
        resolved = (base / path_part).resolve()
        if not _inside(resolved, root):
            report(offset, f"link {target!r} leaves the repository (resolves to {resolved})")
            continue
        if not resolved.exists():
            report(offset, f"link {target!r}: {resolved.relative_to(root).as_posix()} does not exist")
            continue
        if fragment and resolved.is_file() and resolved.suffix.lower() == ".md":
            if fragment not in anchors(resolved.read_text(encoding="utf-8")):
                report(offset, f"link {target!r}: no heading or anchor #{fragment} in {resolved.name}")

    # 3. repository paths mentioned in prose or code spans, and any ../ path
    tops = _top_level_names(root)
    if tops:
        mention = re.compile(
            r"(?<![\w./@:-])((?:\.\./)+[\w.-][\w./-]*[\w/]|(?:\./)?(?:"
            + "|".join(re.escape(t) for t in tops)
            + r")/[\w./-]*[\w/]|(?:\./)?(?:"
            + "|".join(re.escape(t) for t in tops)
            + r")/)"
        )
    else:
        mention = re.compile(r"(?<![\w./@:-])((?:\.\./)+[\w.-][\w./-]*[\w/])")
    for m in mention.finditer(prose):
        token = m.group(1)
        if token.startswith("../"):
            resolved = (base / token).resolve()
            if not _inside(resolved, root):
                report(m.start(1), f"path {token!r} leaves the repository (resolves to {resolved})")
                continue
        else:
            resolved = (root / token).resolve()
        if not resolved.exists():
            report(m.start(1), f"path {token!r} does not exist in the repository")
    return [f"{shown}:{line}: {message}" for line, message in sorted(found)]


def markdown_files(root: Path = REPO) -> list[Path]:
    """Every ``*.md`` file under ``root``, skipping virtualenvs, caches and build output."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info")
        )
        found += [Path(dirpath) / f for f in sorted(filenames) if f.lower().endswith(".md")]
    return found


def repo_problems(root: Path = REPO) -> list[str]:
    out: list[str] = []
    for md in markdown_files(root):
        out += link_problems(md.read_text(encoding="utf-8"), md, root)
    return out


# --------------------------------------------------------------------------- the repository


def test_the_walk_finds_the_documentation() -> None:
    found = {p.relative_to(REPO).as_posix() for p in markdown_files()}
    for expected in ("README.md", "docs/CONTRACT.md", "docs/BENCHMARKS.md", "docs/RELIABILITY.md"):
        assert expected in found, f"{expected} not found by the walk: {sorted(found)}"


@pytest.mark.parametrize(
    "md", markdown_files(), ids=lambda p: p.relative_to(REPO).as_posix()
)
def test_no_link_leaves_the_repository_and_none_dangles(md: Path) -> None:
    problems = link_problems(md.read_text(encoding="utf-8"), md)
    assert not problems, "\n".join(problems)


def test_readme_points_at_the_contract_and_the_benchmarks() -> None:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert "](docs/CONTRACT.md)" in text
    assert "](docs/BENCHMARKS.md)" in text


# --------------------------------------------------------------------------- the check itself


PLANTED_BAD = [
    (f"The contract is [the spec]({UP}/{SPEC}).", UP),
    (f"See `{UP[3:]}/{BENCH}` for the workloads.", f"{SPEC} / {BENCH}"),
    (f"As {SPEC} says, batches are exact.", f"{SPEC} / {BENCH}"),
    (f"```sh\ncat {UP}/{BENCH}\n```", UP),
    ("[up and out](../../outside.md)", "leaves the repository"),
    ("[ref link][r]\n\n[r]: ../elsewhere/x.md", "leaves the repository"),
    ('<a href="../../x.html">x</a>', "leaves the repository"),
    ("Copy ../../secrets.txt first.", "leaves the repository"),
    ("[gone](docs/NO_SUCH_FILE.md)", "does not exist"),
    ("[bad anchor](docs/CONTRACT.md#no-such-section)", "no heading or anchor"),
    ("# Title\n\n[here](#not-a-heading)", "no heading or anchor"),
    ("[abs](/etc/passwd)", "absolute path"),
    ("[local](file:///work/main/README.md)", "only web links"),
    (f"Read /work/{UP[3:]}/{SPEC} first.", "development machine"),
    ("See docs/NOPE.md for details.", "does not exist"),
    ("Run `tests/test_nothing_here.py::test_x`.", "does not exist"),
]


@pytest.mark.parametrize("text, expected", PLANTED_BAD, ids=[t for t, _ in PLANTED_BAD])
def test_the_check_catches_a_planted_bad_link(text: str, expected: str) -> None:
    problems = link_problems(text, REPO / "PLANTED.md")
    assert problems, f"no problem found in {text!r}"
    assert any(expected in p for p in problems), problems


def test_the_check_accepts_good_links() -> None:
    text = """# Planted

## A section: `with code`

[the contract](docs/CONTRACT.md), [its errors](docs/CONTRACT.md#errors-and-who-causes-each),
[benchmarks][b], [a web page](https://onnxruntime.ai/docs/), <https://prometheus.io>,
[this section](#a-section-with-code), [a folder](examples/), docs/RELIABILITY.md,
`tests/test_pipeline.py::test_batch_inside_one_chunk_is_a_view`, `/tmp/bench.json`,
`blobfeed-fetch-<source>-<id>`, and in code, which is not a link: `a[0](x)`.

```python
x = data[lo:hi](1)   # not a link either
```

[b]: docs/BENCHMARKS.md
"""
    assert link_problems(text, REPO / "PLANTED.md") == []


def test_links_resolve_from_the_file_that_holds_them() -> None:
    # from docs/, ../README.md is inside the repository and CONTRACT.md a sibling
    ok = "[readme](../README.md), [contract](CONTRACT.md#the-data-path)"
    assert link_problems(ok, REPO / "docs" / "PLANTED.md") == []
    # the same targets from the root: ../README.md leaves, CONTRACT.md is missing
    problems = link_problems(ok, REPO / "PLANTED.md")
    assert any("leaves the repository" in p for p in problems), problems
    assert any("does not exist" in p for p in problems), problems


def test_the_walk_catches_a_planted_bad_file(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "examples").mkdir()
    (tmp_path / ".venv").mkdir()
    (tmp_path / "README.md").write_text("# R\n\nSee [the guide](docs/GUIDE.md).\n")
    (tmp_path / "docs" / "GUIDE.md").write_text("# Guide\n\nBack to [the readme](../README.md).\n")
    (tmp_path / "examples" / "NOTES.md").write_text(f"The spec: [spec](../{UP}/{SPEC})\n")
    (tmp_path / ".venv" / "IGNORED.md").write_text("[x](../../../nowhere.md)\n")
    problems = repo_problems(tmp_path)
    assert problems, "the planted bad link was not caught"
    assert all(p.startswith("examples/NOTES.md:1:") for p in problems), problems
    assert any("leaves the repository" in p for p in problems), problems
    assert any(UP in p for p in problems), problems
    # and the same tree without the bad file is clean
    (tmp_path / "examples" / "NOTES.md").write_text("See [the guide](../docs/GUIDE.md#guide).\n")
    assert repo_problems(tmp_path) == []


# --------------------------------------------------------------------------- the docs follow the code

import ast  # noqa: E402
import inspect  # noqa: E402

import blobfeed  # noqa: E402

CONTRACT = REPO / "docs" / "CONTRACT.md"
README = REPO / "README.md"
API = REPO / "docs" / "API.md"
RESUME = REPO / "docs" / "RESUME.md"


def _section(text: str, heading: str) -> str:
    """The body of the Markdown section whose heading line starts with ``heading``."""
    start = text.index("\n" + heading) + 1
    level = heading.split(" ", 1)[0]
    rest = text[start + len(heading):]
    ends = [m.start() for m in re.finditer(r"^#{1,%d} " % len(level), rest, re.MULTILINE)]
    return rest[: ends[0]] if ends else rest


def _documented_params(call: str) -> list[tuple[str, str, object]]:
    """``(name, kind, default)`` of each parameter of a documented call
    ``f(a, b=1, *, c=None) -> T``; ``kind`` is ``"positional"`` or ``"keyword"``,
    ``default`` is ``inspect.Parameter.empty`` when there is none."""
    tree = ast.parse("def " + call.strip() + ": ...")
    args = tree.body[0].args
    out: list[tuple[str, str, object]] = []
    pos = args.posonlyargs + args.args
    defaults = [inspect.Parameter.empty] * (len(pos) - len(args.defaults)) + [
        ast.literal_eval(d) for d in args.defaults
    ]
    out += [(a.arg, "positional", d) for a, d in zip(pos, defaults)]
    out += [
        (a.arg, "keyword", inspect.Parameter.empty if d is None else ast.literal_eval(d))
        for a, d in zip(args.kwonlyargs, args.kw_defaults)
    ]
    return out


def _code_params(fn: object) -> list[tuple[str, str, object]]:
    kinds = {
        inspect.Parameter.POSITIONAL_ONLY: "positional",
        inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
        inspect.Parameter.KEYWORD_ONLY: "keyword",
    }
    return [(p.name, kinds[p.kind], p.default) for p in inspect.signature(fn).parameters.values()]


def test_contract_signature_of_init_data_input_workers_is_the_codes() -> None:
    section = _section(CONTRACT.read_text(encoding="utf-8"), "## Feeding a net")
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block, "docs/CONTRACT.md lost the signature block of init_data_input_workers"
    call = " ".join(block.group(1).split())
    assert call.startswith("init_data_input_workers("), call
    assert _documented_params(call) == _code_params(blobfeed.init_data_input_workers), (
        "docs/CONTRACT.md's signature of init_data_input_workers differs from the code's:\n"
        f"  docs: {call}\n  code: {inspect.signature(blobfeed.init_data_input_workers)}"
    )
    returns = inspect.signature(blobfeed.init_data_input_workers).return_annotation
    assert call.endswith("-> " + str(returns).strip("'\"")), call


def test_api_signature_of_init_data_input_workers_is_the_codes() -> None:
    heading = re.search(r"^## `(init_data_input_workers\(.*\))`$", API.read_text(encoding="utf-8"), re.M)
    assert heading, "docs/API.md lost its init_data_input_workers heading"
    assert _documented_params(heading.group(1)) == _code_params(blobfeed.init_data_input_workers), (
        "docs/API.md's signature of init_data_input_workers differs from the code's:\n"
        f"  docs: {heading.group(1)}\n  code: {inspect.signature(blobfeed.init_data_input_workers)}"
    )


def test_contract_argument_table_lists_every_parameter() -> None:
    section = _section(CONTRACT.read_text(encoding="utf-8"), "## Feeding a net")
    rows = re.findall(r"^\| `(\w+)` \|", section.split("### ", 1)[0], re.M)
    params = [name for name, _, _ in _code_params(blobfeed.init_data_input_workers)]
    assert rows == params, (
        f"docs/CONTRACT.md's argument table lists {rows}; init_data_input_workers takes {params} "
        "(one row per parameter, in the signature's order)"
    )


def test_worker_info_fields_are_documented() -> None:
    import dataclasses

    fields = [f.name for f in dataclasses.fields(blobfeed.WorkerInfo)]
    section = _section(CONTRACT.read_text(encoding="utf-8"), "## Inside a fetcher")
    rows = re.findall(r"^\| `(\w+)` \|", section, re.M)
    assert rows == fields, f"docs/CONTRACT.md's WorkerInfo table lists {rows}; WorkerInfo has {fields}"
    api = API.read_text(encoding="utf-8")
    m = re.search(r"a frozen `WorkerInfo\(([^)]*)\)`", api)
    assert m, "docs/API.md lost its WorkerInfo(...) line"
    assert [f.strip() for f in " ".join(m.group(1).split()).split(",")] == fields


_ALIASES = {"blob layout": ("blob layout", "blob names")}


def test_every_refusal_of_load_state_dict_is_named() -> None:
    from blobfeed.coordinator.checkpoint import _LAYOUT

    # what the layout check compares (its own words), and the checks outside it
    named = sorted({what.split(" (")[0] for _, what in _LAYOUT}) + ["number of nets", "version", "epoch"]
    row = re.search(r"^\| `load_state_dict\(name, state\)` \|.*$", API.read_text(encoding="utf-8"), re.M)
    prose = re.search(r"Needs `deterministic=True`; a state of another.*?refused", RESUME.read_text(encoding="utf-8"), re.S)
    contract = re.search(r"Refused with `ValueError` naming the difference:.*?after `start\(\)`",
                         CONTRACT.read_text(encoding="utf-8"), re.S)
    for where, m in (("docs/API.md's method table", row), ("docs/RESUME.md", prose),
                     ("CONTRACT's load_state_dict", contract)):
        assert m, f"{where}: the list of what load_state_dict refuses is gone"
        text = " ".join(m.group(0).split())
        # CONTRACT spells the blob layout out: "blob names or axes"
        missing = [n for n in named if not any(a in text for a in _ALIASES.get(n, (n,)))]
        assert not missing, f"{where} does not name {missing} among what load_state_dict refuses"


_NUMBER_WORDS = {"two": 2, "three": 3, "four": 4, "five": 5, "six": 6}


def test_architecture_counts_its_design_points() -> None:
    section = _section((REPO / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8"), "## Performance design points")
    m = re.search(r"(\w+) design\s+points follow from those measurements:\n\n((?:- .*\n(?:  .*\n)*)+)", section)
    assert m, "docs/ARCHITECTURE.md's Performance section lost its design points"
    said = _NUMBER_WORDS[m.group(1).lower()]
    bullets = len(re.findall(r"^- ", m.group(2), re.M))
    assert said == bullets, f"docs/ARCHITECTURE.md says {m.group(1)} design points and lists {bullets}"


def test_dataloader_migration_knows_shuffle_and_epochs() -> None:
    section = _section((REPO / "docs" / "MIGRATING.md").read_text(encoding="utf-8"), "## From PyTorch's `DataLoader`")
    assert "No sampler or shuffling" not in section
    for name in ("shuffle_buffer", "epochs=", "deterministic=True"):
        assert name in section, f"docs/MIGRATING.md's DataLoader migration does not mention {name}"
    assert "call\n  `init_data_input_workers` again for the next pass" not in section


def test_no_test_reason_cites_a_line_number() -> None:
    """xfail/skip reasons name functions, not ``file.py:123``: lines move and the
    reason then points at nothing (issue 19)."""
    cited = re.compile(r"\b[\w/]+\.py:\d+")
    bad = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if not re.search(r"\breason\s*=", text):
            continue  # no keyword argument named reason: nothing to parse (most files)
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if isinstance(node, ast.keyword) and node.arg == "reason":
                try:
                    reason = ast.literal_eval(node.value)
                except ValueError:
                    continue
                if isinstance(reason, str) and cited.search(reason):
                    bad.append(f"{path.relative_to(REPO)}:{node.lineno}: {cited.search(reason).group(0)}")
    assert not bad, "reasons citing line numbers:\n" + "\n".join(bad)


# an install command naming blobfeed as if it were on the package index
_UNPUBLISHED = re.compile(r"pip3?\s+install\s+(?:-\S+\s+)*['\"]?blobfeed(?:\[|\b(?![\w.-]))")


def test_no_install_hint_names_the_unpublished_package() -> None:
    """blobfeed is installed from its clone (``pip install -e '.[demo]'``): an
    error message or a doc saying ``pip install 'blobfeed[demo]'`` sends the
    user to a package that does not exist on the index (issue 19)."""
    bad = []
    for dirpath, dirnames, filenames in os.walk(REPO):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        for name in filenames:
            path = Path(dirpath) / name
            if path.suffix not in {".py", ".md", ".toml", ".cfg", ".txt", ".sh"} and path.name != "run":
                continue
            if path.resolve() == Path(__file__).resolve():
                continue  # this file spells the wrong forms out to test the check
            text = path.read_text(encoding="utf-8", errors="replace")
            for m in _UNPUBLISHED.finditer(text):
                bad.append(f"{path.relative_to(REPO)}:{_line_of(text, m.start())}: {m.group(0)!r}")
    assert not bad, "install hints for a package that is not published:\n" + "\n".join(bad)


@pytest.mark.parametrize("text", [
    "pip install 'blobfeed[demo]'", 'pip install "blobfeed[ray]"', "pip install blobfeed",
    "pip install -U blobfeed[examples]",
])
def test_the_install_check_catches_the_unpublished_forms(text: str) -> None:
    assert _UNPUBLISHED.search(text)


@pytest.mark.parametrize("text", [
    "pip install -e '.[demo]'", "pip install blobfeed-extras-not", "pip install onnx scikit-learn tqdm",
])
def test_the_install_check_accepts_the_clone_forms(text: str) -> None:
    assert not _UNPUBLISHED.search(text)


def test_data_parallel_docs_say_first_come_first_served_and_show_deterministic() -> None:
    """Uneven shares between nets of one source are the default's nature
    (issue 19: 11 349 / 651 samples): the docs say so and show the even mode."""
    readme = README.read_text(encoding="utf-8")
    m = re.search(r"^Data parallel: call `init_data_input_workers` once per net(?:.+\n)+", readme, re.M)
    assert m, "README lost its data-parallel paragraph"
    para = " ".join(m.group(0).split())
    assert "first come, first served" in para and "deterministic=True" in para, para
    shared = " ".join(_section(CONTRACT.read_text(encoding="utf-8"), "## Shared input sources").split())
    assert "first come, first served" in shared and "deterministic=True" in shared
    example = (REPO / "examples" / "data_parallel.py").read_text(encoding="utf-8")
    assert "first come, first served" in example and "deterministic=deterministic" in example


def test_readme_tells_operators_what_the_demo_does_on_a_signal() -> None:
    quick = " ".join(_section(README.read_text(encoding="utf-8"), "## Quickstart").split())
    for said in ("SIGTERM", "143", "--version", "--passes"):
        assert said in quick, f"README's Quickstart does not mention {said}"


# --------------------------------------------------------------------------- the metrics tables


def _metric_rows(heading: str) -> dict[str, str]:
    """``{exported family name: type}`` of one table of docs/METRICS.md (a
    counter's ``_total`` is the exposition's suffix, not the family's name)."""
    section = _section((REPO / "docs" / "METRICS.md").read_text(encoding="utf-8"), heading)
    rows = re.findall(r"^\| `(blobfeed_\w+)` \| (\w+) \|", section, re.M)
    return {(name[: -len("_total")] if kind == "counter" else name): kind for name, kind in rows}


def test_the_pipeline_metrics_table_is_what_a_pipeline_exports() -> None:
    """Every family a coordinator's registry exports is in the table, and the
    table lists nothing else (issue 24: 24 listed, 26 exported)."""
    import numpy as np

    gc = blobfeed.GlobalCoordinator()
    net = blobfeed.Net(name="n")
    blobfeed.init_data_input_workers(net, ["x"], lambda w, b: [np.zeros((4, 2), np.float32)], 8, coordinator=gc)
    try:
        gc.start()
        net.run(timeout=10)
        exported = {m.name: m.type for m in gc.registry.collect() if m.name.startswith("blobfeed_")}
    finally:
        assert gc.stop()
    assert _metric_rows("## Pipeline metrics") == exported


def test_the_service_metrics_table_is_what_a_service_exports() -> None:
    from blobfeed.service.server import FeedServer, _ServiceCollector

    exported = {m.name: m.type for m in _ServiceCollector(FeedServer()).collect()}
    assert _metric_rows("## Feeding service metrics") == exported
