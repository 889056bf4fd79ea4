"""docs/architecture.md's module map holds to the tree: every package and top-level module of src/gspo has its line,
every line names a package or top-level module that exists, and what each one imports is in its "may import" cell. The map is at package granularity, so a module that
moves inside a package changes nothing here; a new package (or top-level module) fails until its line is written."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "gspo"
PAGE = ROOT / "docs" / "architecture.md"


def _rows() -> dict[str, str]:
    """Each entry of the module map with its "may import" cell (the row's last)."""
    section = PAGE.read_text(encoding="utf-8").split("\n## Module map\n", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| `([\w.]+/?)` \|.*\| ([^|]*) \|$", section, re.M)}


def _map() -> list[str]:
    """The entries of the page's module map, in order: ``name/`` for a package (or a data folder), ``name.py`` for a
    top-level module, each the first cell of a row of the table under "## Module map"."""
    section = PAGE.read_text(encoding="utf-8").split("\n## Module map\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([\w.]+/?)` \|", section, re.M)


def _has_files(folder: Path, pattern: str) -> bool:
    return any(f.is_file() and "__pycache__" not in f.parts for f in folder.rglob(pattern))


def _tree() -> set[str]:
    """The packages (folders holding Python files; a folder a move emptied but for ``__pycache__`` is none) and the
    top-level modules of src/gspo."""
    packages = {f"{p.name}/" for p in PACKAGE.iterdir() if p.is_dir() and _has_files(p, "*.py")}
    return packages | {p.name for p in PACKAGE.glob("*.py")}


def _exists(entry: str) -> bool:
    path = PACKAGE / entry.rstrip("/")
    return path.is_dir() and _has_files(path, "*") if entry.endswith("/") else path.is_file()


def test_the_map_reads_as_a_table_of_entries():
    entries = _map()
    assert len(entries) >= 10 and "cli.py" in entries and "train/" in entries, entries
    assert len(entries) == len(set(entries)), [e for e in entries if entries.count(e) > 1]


def test_every_package_and_top_level_module_has_its_line():
    missing = sorted(_tree() - set(_map()))
    assert not missing, f"add a line for each to the module map of docs/architecture.md: {missing}"


def test_every_line_of_the_map_names_something_that_exists():
    gone = [e for e in _map() if not _exists(e)]
    assert not gone, f"the module map of docs/architecture.md names what src/gspo no longer has: {gone}"


def _entry(module: str) -> str | None:
    """The map's entry a gspo module belongs to: ``name/`` for a package's module, ``name.py`` for a top-level one."""
    parts = module.split(".")
    if parts[0] != "gspo" or len(parts) == 1:
        return None
    return f"{parts[1]}/" if (PACKAGE / parts[1]).is_dir() else f"{parts[1]}.py"


def test_every_entry_imports_only_what_its_line_allows():
    """What each package or top-level module imports (anywhere in its files: module level, functions) is named in its
    "may import" cell: a new dependency is a line of the page, not a surprise in a review."""
    import ast

    rows, found = _rows(), []
    for path in sorted(PACKAGE.rglob("*.py")):
        entry = _entry(".".join(("gspo", *path.relative_to(PACKAGE).with_suffix("").parts)))
        allowed = set(re.findall(r"`([\w.]+/?)`", rows.get(entry, "")))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) and node.module \
                and not node.level else []
            for name in names:
                target = _entry(name)
                if target is not None and target != entry and target not in allowed:
                    found.append(f"{path.relative_to(PACKAGE)} imports {name}: add `{target}` to the line of `{entry}`")
    assert not found, "\n".join(sorted(set(found)))
