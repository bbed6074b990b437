"""Tier b: variable sequence lengths in one run (64, 32, 128, 32, 64) on 2 ranks.

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
