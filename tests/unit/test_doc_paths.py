"""The docs name today's modules and anchors: every `folder/module.py` of stoker that README.md or docs/*.md names
exists, and every link from one of them into a doc's heading (`file.md#anchor`, `#anchor`) lands on a heading.
Modules move (data/ was split by role) and docs are split by topic; a stale path or a dead link then fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PACKAGES = {p.name for p in (ROOT / "stoker").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
# A path of stoker's: `stoker/x/y.py`, `x/y.py` or `x/y/z.py` with x one of stoker's folders.
PATH = re.compile(r"(?<![\w/.-])((?:stoker/)?([a-z_]+)/(?:[a-z_]+/)*[a-z_0-9]+\.py)\b")
LINK = re.compile(r"\]\(([^)\s]*?)(#[^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} (.+?)\s*#*\s*$", re.MULTILINE)
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
BARE = re.compile(r"`([A-Za-z_0-9]+\.py)\b")  # `module.py` with no folder: some file of the repository's
# A row of architecture.md's "Every module in a line": | `folder/` | `a.py`, `b.py` | ... (an empty folder: the last)
ROW = re.compile(r"^\| (?:`([a-z_/]+)/`)? *\| ((?:`[a-z_0-9]+\.py`(?:, )?)+) \|", re.MULTILINE)


def named_paths(text: str) -> set[str]:
    """The stoker module paths a doc names (a path under tests/ or tools/ is the repository's own, checked too)."""
    found = set()
    for match in PATH.finditer(text):
        path, top = match.group(1), match.group(2)
        if top in PACKAGES or top in ("stoker", "tests", "tools"):
            found.add(path)
    return found


def exists(path: str) -> bool:
    if path.startswith(("stoker/", "tests/", "tools/")):
        return (ROOT / path).is_file()
    return (ROOT / "stoker" / path).is_file()


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its words
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    for heading in HEADING.findall(FENCE.sub("", doc.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        result.add(base if n == 0 else f"{base}-{n}")
    return result


def test_slug_is_githubs():
    assert slug("Held-out workloads: auto against every fixed count (`bench autoscale --workloads fgh`)") == (
        "held-out-workloads-auto-against-every-fixed-count-bench-autoscale---workloads-fgh"
    )
    assert slug("Contract: `summary.json`") == "contract-summaryjson"


def test_every_module_path_the_docs_name_exists():
    missing = [
        f"{doc.relative_to(ROOT)}: {path}"
        for doc in DOCS
        for path in sorted(named_paths(doc.read_text()))
        if not exists(path)
    ]
    assert not missing, "docs name modules that do not exist:\n" + "\n".join(missing)


def table_paths(text: str) -> list[str]:
    """The modules of a table that names a folder in one column and its modules in the next."""
    paths, folder = [], ""
    for row_folder, modules in ROW.findall(text):
        folder = row_folder or folder
        paths += [f"{folder}/{name}" for name in re.findall(r"`([a-z_0-9]+\.py)`", modules)]
    return paths


def repository_names() -> set[str]:
    return {p.name for top in ("stoker", "tests", "tools") for p in (ROOT / top).rglob("*.py")}


def test_every_module_in_a_line_exists():
    text = (ROOT / "docs" / "architecture.md").read_text()
    paths = table_paths(text)
    assert len(paths) > 80, "the table of every module was not found"
    assert not [p for p in paths if not exists(p.removeprefix("stoker/"))]
    modules = {str(p.relative_to(ROOT / "stoker")) for p in (ROOT / "stoker").rglob("*.py")}
    unlisted = {m for m in modules if not m.startswith("bench/") and not m.endswith("/__init__.py")}
    unlisted -= {p.removeprefix("stoker/") for p in paths}
    assert not unlisted, f"modules missing from architecture.md's every module in a line: {sorted(unlisted)}"


def test_every_bare_module_name_is_a_file_of_the_repository():
    names = repository_names()
    stale = [f"{doc.relative_to(ROOT)}: {n}" for doc in DOCS for n in set(BARE.findall(doc.read_text())) - names]
    assert not stale, "docs name modules that no longer exist:\n" + "\n".join(stale)


def test_the_check_sees_a_stale_path():
    assert table_paths("| `data/` | `dataset.py`, `index.py` | x |\n| | `remote.py` | y |") == [
        "data/dataset.py",
        "data/index.py",
        "data/remote.py",
    ]
    assert named_paths("see `data/remote.py` and stoker/pipeline/autoscale.py, not my_model.py") == {
        "data/remote.py",
        "stoker/pipeline/autoscale.py",
    }
    assert not exists("data/remote.py") and exists("data/transports/object_store.py")


def test_every_link_into_a_heading_lands_on_one():
    dead = []
    for doc in DOCS:
        for target, anchor in LINK.findall(FENCE.sub("", doc.read_text())):
            if target.startswith(("http://", "https://")):
                continue
            linked = (doc.parent / target) if target else doc
            if not linked.is_file():
                dead.append(f"{doc.relative_to(ROOT)}: {target}{anchor} (no such file)")
            elif anchor[1:] not in anchors(linked):
                dead.append(f"{doc.relative_to(ROOT)}: {target}{anchor}")
    assert not dead, "links to headings that do not exist:\n" + "\n".join(dead)
