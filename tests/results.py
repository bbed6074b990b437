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


def assert_stopped_by_the_watch(faults: list[dict], error: str, inside: str, where: str = "train_batch") -> None:
    """One case per rank of a launch whose last case is a fault (the suites' ``_fault``: the origin raised
    ``error`` in ``where``, every rank lingered until all had stopped): every other rank raised ``PeerFailedError``
    naming the origin, within a quarter of its p2p deadline and before any rank left (no exit closed its
    connections), and one of them was stopped by the collective watch while ``inside``."""
    assert all(f["case"] == "fault" for f in faults), faults
    origin = next(f for f in faults if f["origin"])
    assert origin["raised"] == "RuntimeError" and error in origin["message"], origin
    first_left = min(f["left_at"] for f in faults)
    for fault in faults:
        if fault is origin:
            continue
        assert fault["raised"] == "PeerFailedError", fault
        assert f"rank {origin['rank']} (stage 0) failed in {where}: RuntimeError: {error}" in fault["message"], \
            fault["message"]
        assert fault["raised_at"] < first_left, fault
        assert fault["raised_at"] - origin["raised_at"] < fault["p2p_timeout_s"] / 4, fault
    assert any(f"inside {inside}" in f["message"] for f in faults), faults
