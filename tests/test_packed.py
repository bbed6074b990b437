"""Tier b: packed documents through the token pipeline (terapipe.packed) equal the unsliced reference.

One launch of 2 ranks (tests/suites/packed.py): rows packing documents of skewed lengths as
``((input_ids, position_ids), labels)``, mixed in each step with rows of one document and plain ``input_ids``,
on gpipe, 1f1b, interleaved-1f1b, looped-bfs, dualpipev and zbv, slices cutting documents anywhere; against the
reference GPT run unsliced under ``packed_documents``: losses, every first-step gradient and the parameters after 3
steps within 1e-5 (measured: 5e-7); in bf16 (1f1b) the fp32 master weights' change within bf16's tolerance; with
``plan_per_batch`` (1f1b with rank 0's planner, gpipe and interleaved-1f1b with a stand-in that cuts wherever a
row starts a document) every step runs the plan for its documents, the same on every rank, and stays exact.
Then the refusals, each on every rank before the step: position ids that do not restart at 0, of another length,
an attention mask in their place, and packed rows without ``terapipe.packed``.
The attention and position rules themselves, and the Hugging Face layers against ``transformers``' packed
forward, are tier a (tests/test_documents.py).
"""

from __future__ import annotations

import pytest

from tests.dist_harness import launch
from tests.precision import LOSS_TOL, UPDATE_TOL

pytestmark = pytest.mark.multiproc

TOL = 1e-5
SEQ_LEN, GRANULARITY = 48, 8   # tests/suites/packed.py
CASES = [["gpipe", 1, [8, 24, 16]], ["1f1b", 1, 3], ["interleaved-1f1b", 2, [16, 16, 16]],
         ["looped-bfs", 2, [8, 40]], ["dualpipev", 2, [24, 24]], ["zbv", 2, [8, 24, 16]],
         ["1f1b", 1, [8, 24, 16], "bf16"],
         ["1f1b", 1, "auto", "per-batch"], ["gpipe", 1, "auto", "per-batch cuts"],
         ["interleaved-1f1b", 2, "auto", "per-batch cuts"]]
REFUSALS = {"no restart": "must start each row at 0", "length": "differ in shape",
            "mask": "look like an attention mask", "not packed": 'set "packed": true'}


@pytest.fixture(scope="module")
def packed_results(tmp_path_factory) -> list[dict]:
    results = launch("packed", 2, tmp_path_factory.mktemp("packed"), timeout_s=540,
                     extra={"cases": CASES, "refusals": list(REFUSALS)})
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors[0]
    return [r["results"] for r in results]


@pytest.mark.timeout(600)
def test_packed_rows_equal_the_document_masked_reference(packed_results) -> None:
    for rank, cases in enumerate(packed_results):
        trained = [c for c in cases if c["case"].startswith("packed")]
        assert len(trained) == len(CASES)
        for case in trained:
            where = f"{case['case']}, rank {rank}"
            if case["case"].endswith("bf16"):   # BF16_Optimizer: the master weights' change, as the other bf16 tests
                assert "error" not in case and case["optimizer"] == "BF16_Optimizer", (where, case)
                assert all(abs(a - b) <= LOSS_TOL * abs(b) for a, b in zip(case["losses"], case["ref_losses"])), where
                assert case["update_rel_err"] <= UPDATE_TOL["bf16"], (where, case["update_worst"])
                continue
            assert "error" not in case, f"{where}: {case.get('error')}\n{case.get('traceback')}"
            if "per-batch" in case["case"]:
                _check_per_batch(case, packed_results[0][trained.index(case)], where)
            for got, ref in zip(case["losses"], case["ref_losses"]):
                assert abs(got - ref) <= TOL * abs(ref), f"{where}: {case['losses']} != {case['ref_losses']}"
            assert case["grad_rel_err"] <= TOL, f"{where}: gradient of {case['grad_worst']}"
            assert case["param_rel_err"] <= TOL, f"{where}: after 3 steps {case['param_worst']}"
    for index in range(len(CASES)):   # every reference parameter compared on one rank or the other
        covered = set().union(*(cases[index]["covered"] for cases in packed_results))
        assert len(covered) == packed_results[0][index]["num_ref_params"], sorted(covered)


def _check_per_batch(case: dict, rank0: dict, where: str) -> None:
    """Each step ran rank 0's plan for that step's documents (the same slicing on every rank)."""
    assert case["sources"] == ["documents"] * len(case["sources"]), (where, case["sources"])
    assert case["slicings"] == rank0["slicings"] and case["contexts"] == rank0["contexts"], where
    assert all(sum(s) == SEQ_LEN for s in case["slicings"]), (where, case["slicings"])
    if case["case"].endswith("cuts"):   # the replaced planner: a slicing per step, from the step's documents
        for slices, context in zip(case["slicings"], case["contexts"]):
            starts = [sum(slices[:i]) // GRANULARITY for i in range(1, len(slices))]
            restarts = [k for k in range(1, len(context)) if context[k] < context[k - 1] + GRANULARITY]
            assert starts == restarts, (where, slices, context)
        assert len({tuple(s) for s in case["slicings"]}) > 1, (where, case["slicings"])
    else:   # the real planner ran on rank 0 once per step
        assert len(rank0["planning_ms"]) == len(case["slicings"]), (where, rank0["planning_ms"])


@pytest.mark.timeout(600)
def test_bad_position_ids_are_refused_on_every_rank(packed_results) -> None:
    for rank, cases in enumerate(packed_results):
        refused = {c["case"].removeprefix("refuse "): c for c in cases if c["case"].startswith("refuse")}
        assert sorted(refused) == sorted(REFUSALS)
        for kind, text in REFUSALS.items():
            case = refused[kind]
            assert case["raised"] == "ValueError", (rank, case)
            # the first stage says why; the other rank points at it
            assert (text if rank == 0 else "refused the position ids of the next batch") in case["message"], case
