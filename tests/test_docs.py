"""Tier a: the documents and the code speak of the project only.

README, docs/ and the code describe the project as it is: no issue numbers (the tracker's history belongs in git),
and no pointer to a file outside the repository (a reader of a clone has only what it holds). Their relative links
lead to files (and headings) that exist.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ISSUE = re.compile(r"\bissues?[- ]?#?\d+", re.IGNORECASE)
# documents a reader is pointed to that are not in the repository
OUTSIDE = re.compile(r"\bDESIGN\.md\b|\bSTYLE\.md\b|\.\./shared\b")


def _documents() -> list[Path]:
    return [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _texts() -> list[Path]:
    files = _documents()
    for folder in ("ds_terapipe", "benchmarks", "examples", "tests"):
        files += [p for p in sorted((ROOT / folder).rglob("*.py")) if p != Path(__file__).resolve()]
    return files


@pytest.mark.parametrize("pattern", [ISSUE, OUTSIDE], ids=["issue numbers", "files outside the repository"])
def test_documents_and_code_speak_of_the_project_only(pattern: re.Pattern) -> None:
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}" for path in _texts()
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert not found, "\n".join(found)


def test_the_patterns_catch_what_they_are_for() -> None:
    assert ISSUE.search("the floor (issue 16)") and ISSUE.search("Issue-13's item") and ISSUE.search("issue #7")
    assert not ISSUE.search("an issue the planner has") and not ISSUE.search("DeepSpeed #3195")
    assert OUTSIDE.search("see DESIGN.md") and OUTSIDE.search("../shared/gpu") and not OUTSIDE.search("docs/design.md")


# a markdown link or image: [text](target) / ![alt](target)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub renders it: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _prose(path: Path) -> list[tuple[int, str]]:
    """The numbered lines outside fenced code blocks (a link inside one is an example, not a link)."""
    lines, fenced = [], False
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append((n, line))
    return lines


def _anchors(path: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for _, line in _prose(path) if re.match(r"#{1,6} ", line)}


def _broken_links(path: Path, root: Path = ROOT) -> list[str]:
    broken = []
    for n, line in _prose(path):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # https:, mailto:: not a file of the repository
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{path.relative_to(root)}:{n}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{path.relative_to(root)}:{n}: {target} (no such heading)")
    return broken


def test_relative_links_in_readme_and_docs_resolve() -> None:
    broken = [b for path in _documents() for b in _broken_links(path)]
    assert not broken, "\n".join(broken)


def test_the_link_check_catches_what_it_is_for(tmp_path: Path) -> None:
    assert _slug('Repacking (`"freeze": {..., "repack": true}`)') == "repacking-freeze--repack-true"
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n[ok](page.md#a-page) [gone](missing.md) [no heading](#b-page) "
                    "![img](missing.png) [web](https://example.org)\n```\n[example](not_checked.md)\n```\n")
    assert [b.split(": ", 1)[1] for b in _broken_links(page, root=tmp_path)] == [
        "missing.md (no such file)", "#b-page (no such heading)", "missing.png (no such file)"]
