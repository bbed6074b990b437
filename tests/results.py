"""Reading what the ranks of a multi-process launch reported (tests/dist_harness.py ``launch``)."""

from __future__ import annotations


def cases_per_rank(results: list[dict], expected_cases: int, skip_prefix: str = "clip") -> list[list[dict]]:
    """Each rank's cases (those not named ``skip_prefix...``), after checking that no rank failed and that every
    rank ran ``expected_cases`` of them, in the same order on every rank."""
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors[0]
    per_rank = [[c for c in r["results"] if not c["case"].startswith(skip_prefix)] for r in results]
    assert all(len(cases) == expected_cases for cases in per_rank), [len(c) for c in per_rank]
    return per_rank
