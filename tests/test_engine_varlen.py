"""Tier b: variable sequence lengths in one run (64, 32, 128, 32, 64) on 2 ranks, and micro-batches of different
lengths in one step (tests/suites/mixed.py).

Each length gets its own plan, made once (auto: from the costs measured at init, never re-profiled), every
step's gradients equal the unsliced reference at that step's weights, a length the granularity cannot cover
fails on every rank with the fix in the message, and a checkpoint of the auto run resumes every length's slicing.
"""

from __future__ import annotations

import pytest

from tests.dist_harness import launch

pytestmark = pytest.mark.multiproc


@pytest.mark.timeout(600)
def test_variable_lengths(tmp_path) -> None:
    results = launch("varlen", 2, tmp_path, timeout_s=500)
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors[0]
    for rank in results:
        auto, fixed = rank["results"]
        for case in (auto, fixed):
            assert case["plans"] == [32, 64, 128]
            assert [s["length"] for s in case["steps"]] == [64, 32, 128, 32, 64]
            for step in case["steps"]:
                assert sum(step["slices"]) == step["length"] and all(s % 8 == 0 for s in step["slices"])
                assert step["loss"] == pytest.approx(step["ref_loss"], rel=1e-5), step
                assert step["grad_rel_err"] <= 1e-5, step
            assert "sequence length 60, not a multiple of terapipe.granularity=8" in case["bad_length"]
        # auto: profiled once at init; the other lengths are planned from those costs, no re-profiling; each
        # length keeps its own plan, so length 64 runs (and reports) the profiled plan again
        assert [s["source"] for s in auto["steps"]] == ["profiled", "planned", "planned", "planned", "profiled"]
        assert [s["slices"] for s in fixed["steps"]][:3] == [[24, 24, 16], [16, 8, 8], [48, 40, 40]]
        # a checkpoint keeps every length's slicing: the loading engine's own plan for 64 differed (set by the
        # worker) and it had planned no other length; it runs the checkpoint's three and trains the same loss
        resume = auto["resume"]
        assert resume["restored"] == resume["plans"] and sorted(resume["plans"]) == ["128", "32", "64"], resume
        assert resume["profiled"] != resume["plans"]["64"] and set(resume["sources"].values()) == {"checkpoint"}
        assert resume["losses"][0] == resume["losses"][1], resume  # bit for bit at length 128


MIXED_STEPS, MIXED_EVAL = [[64, 32, 16], [16, 64, 48]], [32, 64, 16]   # tests/suites/mixed.py
MIXED_CASES = [["gpipe", 3, False, None], ["1f1b", "auto", False, None], ["1f1b", 4, False, True],
               ["interleaved-1f1b", 2, False, None], ["dualpipev", 4, False, None], ["1f1b", 3, True, None],
               ["looped-bfs", 4, True, None], ["1f1b", 4, False, None, True],
               ["interleaved-1f1b", 4, True, None, True], ["1f1b", "auto", False, None, True, True]]


@pytest.mark.timeout(600)
def test_micro_batches_of_different_lengths_in_one_step(tmp_path) -> None:
    """Each micro-batch of a step runs its own length's slicing (the schedule without the units a shorter one
    lacks): losses, the parameters after 2 steps and an evaluation equal the unsliced reference that averages
    the micro-batches' losses, on every schedule, with deferred weight gradients, vocabulary parallelism and
    packed documents (position ids restarting per document), also planned per batch."""
    results = launch("mixed", 2, tmp_path, timeout_s=540, extra={"cases": MIXED_CASES})
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors[0]
    for rank, got in enumerate(results):
        assert len(got["results"]) == len(MIXED_CASES)
        for case in got["results"]:
            where = f"{case['case']}, rank {rank}"
            assert "error" not in case, f"{where}: {case.get('error')}\n{case.get('traceback')}"
            assert [[sum(s) for s in step] for step in case["step_slices"]] == MIXED_STEPS, where
            slices = MIXED_CASES[got["results"].index(case)][1]
            if slices != "auto":   # n equal slices, fewer when a length has fewer 8-token units
                counts = [[min(slices, n // 8) for n in step] for step in MIXED_STEPS]
                assert [[len(s) for s in step] for step in case["step_slices"]] == counts, where
                # the schedule of the largest count, without the units a micro-batch does not have
                trimmed = [len(set(c)) > 1 for c in counts]
                assert ["-slices" in name for name in case["schedules"]] == trimmed, (where, case["schedules"])
            for loss, ref in zip(case["losses"], case["ref_losses"]):
                assert loss == pytest.approx(ref, rel=1e-5), (where, case["losses"], case["ref_losses"])
            assert case["param_rel_err"] <= 1e-5, (where, case["param_worst"])
            assert [sum(s) for s in case["eval_slices"]] == MIXED_EVAL, where
            assert case["eval_loss"] == pytest.approx(case["ref_eval"], rel=1e-5), where
    for index in range(len(MIXED_CASES)):   # every parameter compared on one rank or the other
        covered = set().union(*(r["results"][index]["covered"] for r in results))
        assert len(covered) >= 10, covered
