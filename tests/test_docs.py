"""Tier a: the documents and the code speak of the project only.

README, docs/ and the code describe the project as it is: no issue numbers (the tracker's history belongs in git),
and no pointer to a file outside the repository (a reader of a clone has only what it holds).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ISSUE = re.compile(r"\bissues?[- ]?#?\d+", re.IGNORECASE)
# documents a reader is pointed to that are not in the repository
OUTSIDE = re.compile(r"\bDESIGN\.md\b|\bSTYLE\.md\b|\.\./shared\b")


def _texts() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
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
