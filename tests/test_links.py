"""Every relative link of the tracked Markdown files points at a tracked file (and, with ``#section``, at a heading of
it), and every ``benchmarks/README.md#<section>`` that code cites exists: run outputs moved out of the tree once and left
links into removed directories behind."""
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[(?:[^\]]|\][^(])*?\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CITE = re.compile(r"benchmarks/README\.md#([\w-]+)")


def _tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z", *patterns], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return [ROOT / p for p in out.stdout.split("\0") if p]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(md: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in md.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if fenced or not line.startswith("#"):
            continue
        slug = _slug(line.lstrip("#"))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(md: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", md.read_text(encoding="utf-8"), flags=re.S)  # code blocks hold no links
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_relative_links_in_markdown_resolve():
    tracked = set(_tracked())
    broken = []
    for md in _tracked("*.md"):
        for target in _links(md):
            path, _, anchor = target.partition("#")
            dest = (md.parent / path).resolve() if path else md
            exists = dest in tracked or (dest.is_dir() and any(str(t).startswith(f"{dest}/") for t in tracked))
            if not exists:
                broken.append(f"{md.relative_to(ROOT)}: {target} (no such tracked file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{md.relative_to(ROOT)}: {target} (no heading #{anchor})")
    assert not broken, "\n".join(broken)


def test_code_cites_existing_sections_of_the_benchmarks_page():
    anchors = _anchors(ROOT / "benchmarks" / "README.md")
    missing = [f"{f.relative_to(ROOT)}: #{a}" for f in _tracked("src", "benchmarks", "tests", "scripts")
               if f.suffix in (".py", ".sh") for a in CITE.findall(f.read_text(encoding="utf-8")) if a not in anchors]
    assert not missing, "\n".join(missing)
