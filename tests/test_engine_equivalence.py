"""Tier b: the token pipeline equals the single-process unsliced reference, gradient by gradient.

One launch per topology runs the whole grid (slices {1, [8, 24, 16], 8} x schedules {gpipe, 1f1b} x weight
gradients {per slice, deferred} x micro-batches {1, 3}) inside one process group; see tests/suites/equivalence.py.
Tolerance: fp32 relative error <= 1e-5 for the loss, every parameter gradient after one step, and every
parameter after 3 SGD+momentum steps. At ZeRO 0 the weight gradients of a backward that is not deferred are added
into ``.grad`` inside their GEMMs (checked on every case); ZeRO 1 hooks the accumulation, so there they are not.
"""

from __future__ import annotations

import pytest

from tests.clipping import assert_clipped_by_the_global_norm
from tests.dist_harness import launch
from tests.results import cases_per_rank

pytestmark = pytest.mark.multiproc

TOL = 1e-5


def _check(results: list[dict], expected_cases: int, fused: bool = True) -> None:
    per_rank = cases_per_rank(results, expected_cases)
    for index in range(expected_cases):
        covered: set[str] = set()
        for cases in per_rank:
            case = cases[index]
            where = f"{case['case']} stages={case['stages']} dp={case['dp']}"
            # the weight gradients are added into .grad inside the GEMMs where nothing hooks the accumulation
            assert case["fused"] is fused, where
            assert len(case["loss"]) == len(case["ref_loss"]) == len(case["stock_loss"]) == 3, where
            for got, ref in zip(case["loss"], case["ref_loss"]):
                assert abs(got - ref) <= TOL * abs(ref), f"{where}: loss {case['loss']} != reference {case['ref_loss']}"
            # stock DeepSpeed trains the reference too, every step, to the same parameters
            assert case["stock_loss"] == pytest.approx(case["ref_loss"], rel=TOL), where
            assert case["stock_param_rel_err"] <= TOL, f"{where}: stock DeepSpeed off the reference after 3 steps"
            assert case["grad_rel_err"] <= TOL, f"{where}: gradient of {case['grad_worst']} off by {case['grad_rel_err']}"
            assert case["stock_grad_rel_err"] <= TOL, f"{where}: differs from stock DeepSpeed by {case['stock_grad_rel_err']}"
            assert case["param_rel_err"] <= TOL, \
                f"{where}: after 3 steps {case['param_worst']} off by {case['param_rel_err']}"
            covered.update(case["covered"])
        # every reference parameter got a gradient on some stage (nothing silently untrained)
        assert len(covered) == 4 * 12 + 2 + 2, sorted(covered)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_equivalence_grid(world: int, tmp_path) -> None:
    results = launch("equivalence", world, tmp_path, timeout_s=840)
    _check(results, expected_cases=2 * 3 * 4)
    slices_seen = {tuple(c["slices"]) for c in results[0]["results"]}
    assert slices_seen == {(48, ), (8, 24, 16), (6, 6, 6, 6, 6, 6, 6, 6)}, slices_seen


@pytest.mark.timeout(900)
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_pipeline_times_data_parallel(zero_stage: int, tmp_path) -> None:
    """2 stages x 2 replicas (4 processes), ZeRO 0/1: equal to the reference over the global batch; and with
    gradient clipping, clipped by the norm of the whole model's gradient over the global batch (each replica
    holds the same reduced gradient; ZeRO 1 clips inside its optimizer, over its partitions)."""
    results = launch("equivalence", 4, tmp_path, timeout_s=840,
                     extra={"dp": 2, "zero_stage": zero_stage, "slicings": [1, [8, 24, 16]],
                            "schedules": ["1f1b", "1f1b+W"], "micro_batches": [3], "clip": True})
    _check(results, expected_cases=4, fused=zero_stage == 0)
    assert {c["dp"] for r in results for c in r["results"] if "dp" in c} == {2}
    for rank, r in enumerate(results):
        (clip, ) = [c for c in r["results"] if c["case"] == f"clip zero={zero_stage}"]
        assert_clipped_by_the_global_norm(clip, rank)
