"""Tier b: progressive freezing under DeepSpeed's master-copy optimizers (bf16, fp16, ZeRO 1) equals the fp32
unsliced reference with the same layers frozen at the same steps, and a frozen weight stops moving.

DeepSpeed's BF16_Optimizer, ZeRO 1 and the fp16 optimizers keep fp32 master copies (flat partitions, or one copy
per parameter) that their inner optimizer updates whole: with SGD momentum a frozen weight would keep moving. The
freezer holds the frozen elements still around that update and zeroes their state (runtime/features/frozen_state.py).
One
launch of 2 ranks (bf16/fp16/fp32 x ZeRO 0/1, gpipe, 1f1b, interleaved-1f1b, dualpipev; with vocabulary
parallelism, the tied table in the shards, fp32 and bf16; a Hugging Face Llama, untied head, with and without
vocabulary parallelism) and one of 4 (2 stages x 2 replicas, where ZeRO 1 and
BF16_Optimizer split the master copies between the replicas); tests/suites/freeze_precision.py.

Measured: master-weight updates within 1.8e-2 of the reference in bf16 (its rounding), 5e-3 in fp16, 2.2e-5 in
fp32; losses within 2e-5. With the frozen elements not held, the frozen weights move at every step (13-37
parameters on stage 0) and stage 0's update is off by 240%.

Steps DeepSpeed skips (an fp16 overflow, bf16 inf/nan gradients; cases in the same launches): the auto policy
compares the norms of the steps taken only, unscaled by the scale of their backward (fp16's scale doubles at each
step taken here, so each check's step moves it, and halves at each overflow), read from ZeRO 1's
partitions as from ZeRO 0's gradients: the same norms (within 2e-2 of the fp32 run's, measured 3.6e-3) and the same
freezes at the same steps as a run of the clean steps alone; a freeze schedule counts the steps taken; a repack
keeps the loss scaler's state and the step counters as they were. Without their rules: a nan norm read as stable
(freezes), ZeRO 1's norms all 0 (a cleared ``.grad``), the scaled norms, schedules early by the skipped steps.

The rules behind the launches (which optimizers freezing holds still and a repack moves, the repack factor, the
auto policy's norm) are tier a: no process group, run by ``-m 'not multiproc'``.
"""

from __future__ import annotations

import pytest

from tests.dist_harness import launch
from tests.precision import check_precision_case

# [precision, ZeRO stage, schedule, virtual stages(, vocabulary parallelism(, model: "gpt" or "llama"(, freeze)))]; the
# Llama's head is untied, so its stage 0 ends with nothing left to train (the BF16_Optimizer norm over no gradient)
TWO_RANKS = [["bf16", 0, "1f1b", 1], ["bf16", 1, "gpipe", 1], ["fp32", 1, "1f1b", 1], ["fp16", 0, "1f1b", 1],
             ["fp16", 1, "interleaved-1f1b", 2], ["bf16", 0, "dualpipev", 2],
             ["fp32", 0, "1f1b", 1, True], ["bf16", 0, "gpipe", 1, True], ["fp32", 1, "interleaved-1f1b", 2, True],
             ["bf16", 0, "1f1b", 1, False, "llama"], ["fp32", 1, "gpipe", 1, True, "llama"],
             ["bf16", 1, "interleaved-1f1b", 2, True, "llama"],
             # the same matrix without freezing: the Llama in bf16, plain and with vocabulary parallelism
             ["bf16", 0, "gpipe", 1, False, "llama", False], ["bf16", 1, "1f1b", 1, True, "llama", False],
             # repacking after stage 0 froze: the master copies and optimizer state move to the new layout
             ["bf16", 0, "1f1b", 1, False, "gpt", True, True], ["bf16", 1, "gpipe", 1, False, "gpt", True, True],
             ["fp32", 1, "1f1b", 1, False, "gpt", True, True], ["bf16", 1, "1f1b", 1, False, "llama", True, True],
             ["fp16", 0, "1f1b", 1, False, "gpt", True, True], ["fp16", 1, "gpipe", 1, False, "gpt", True, True],
             # with two chunks per rank: once half the chunks froze (a rank's worth), 2 x 2 chunks -> 1 x 2 chunks
             ["bf16", 1, "interleaved-1f1b", 2, False, "gpt", True, True],
             ["fp32", 0, "dualpipev", 2, False, "llama", True, True],
             # with vocabulary parallelism: the rows of the head (and of the input embedding) split again
             ["bf16", 1, "1f1b", 1, True, "gpt", True, True], ["fp32", 0, "gpipe", 1, True, "llama", True, True]]
#: [policy, precision, ZeRO stage, steps] (tests/suites/freeze_precision.py, _skips_case): "nan" and "inf" are steps
#: DeepSpeed skips; the first auto case, fp32 on the clean steps alone, is what the others must equal
SKIPPING = ["clean", "clean", "nan", "clean", "inf", "clean"]
SKIP_CASES = [["auto", "fp32", 0, ["clean"] * 4], ["auto", "fp16", 0, SKIPPING], ["auto", "fp16", 1, SKIPPING],
              ["auto", "bf16", 0, SKIPPING],
              ["schedule repack", "fp16", 0, ["clean", "nan", "clean", "clean", "inf", "clean"]],
              ["schedule repack", "fp16", 1, ["clean", "nan", "clean", "clean", "inf", "clean"]]]
FOUR_RANK_SKIP_CASES = [SKIP_CASES[0], ["auto", "bf16", 1, SKIPPING]]   # ZeRO 1 fragments on 2 replicas
FOUR_RANKS = [["bf16", 1, "1f1b", 1], ["fp32", 1, "gpipe", 1], ["bf16", 0, "1f1b", 1], ["fp16", 1, "1f1b", 1],
              ["bf16", 1, "1f1b", 1, True, "llama"], ["bf16", 1, "1f1b", 1, False, "gpt", True, True],
              ["bf16", 1, "looped-bfs", 2, False, "gpt", True, True], ["bf16", 1, "1f1b", 1, True, "llama", True, True]]


def _check(results: list[dict], expected: int) -> None:
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors[0]
    for rank, payload in enumerate(results):
        cases = [c for c in payload["results"] if not c["case"].startswith("skips ")]
        assert len(cases) == expected, len(cases)
        for case in cases:
            where = f"{case['case']}, rank {rank}"
            check_precision_case(case, rank)
            assert case["compared"] > 0, where
            assert not any(case["moved"]), f"{where}: frozen parameters moved: {case['moved']}"
            assert not any(case["state_nonzero"]), f"{where}: frozen state not zero: {case['state_nonzero']}"
            assert case["frozen_layers"] == (None if "no-freeze" in case["case"] else 4), where
            # a repack once stage 0 froze: 1 stage x every rank a replica, the others keep their layout
            assert case["layout"] == ([1, len(results)] if case["case"].endswith("repack") else
                                      [2, len(results) // 2]), (where, case["layout"])
    # stage 0 holds the frozen layers: something froze there (else the checks above pass vacuously)
    assert any(max(c["frozen_counts"]) > 0 for c in results[0]["results"] if "frozen_counts" in c)


def _check_skipped_steps(results: list[dict], expected: int) -> None:
    """The skipped-step cases (SKIP_CASES): see the module docstring."""
    per_rank = [[c for c in payload["results"] if c["case"].startswith("skips ")] for payload in results]
    assert all(len(cases) == expected for cases in per_rank), [len(cases) for cases in per_rank]
    errors = [(c["case"], c["traceback"]) for cases in per_rank for c in cases if "error" in c]
    assert not errors, errors[0]
    ref = per_rank[0][0]   # fp32 on the clean steps: the checks are rank 0's, where the rule runs
    assert ref["precision"] == "fp32" and ref["skipped"][-1] == 0 and len(ref["checks"]) >= 2, ref
    assert ref["events"] and max(ref["frozen"]) > 0, ref   # the auto policy froze something
    for rank, cases in enumerate(per_rank):
        for case, twin in zip(cases, per_rank[0]):
            where = f"{case['case']}, rank {rank}"
            poisoned = sum(what != "clean" for what in case["steps"])
            assert case["skipped"][-1] == poisoned, (where, case["skipped"])   # DeepSpeed skipped each
            # every rank decides the same: rank 0's frozen layers and events
            assert (case["frozen"], case["events"]) == (twin["frozen"], twin["events"]), where
            taken_before = [0] + case["taken"][:-1]
            if case["policy"] == "auto":
                # the same freezes at the same optimizer steps as the clean run (skipped steps not counted)
                clean = [f for f, what in zip(case["frozen"], case["steps"]) if what == "clean"]
                assert clean == ref["frozen"], (where, case["frozen"], ref["frozen"])
                assert [e[::2] for e in case["events"]] == [e[::2] for e in ref["events"]], (where, case["events"])
                if case["precision"] == "fp16" and rank == 0:   # the scale moved between checks
                    assert len(set(case["scales"])) > 1, (where, case["scales"])
                if rank == 0:
                    assert len(case["checks"]) == len(ref["checks"]), (where, case["checks"])
                    for mine, theirs in zip(case["checks"], ref["checks"]):
                        assert sorted(mine) == sorted(theirs), (where, mine, theirs)
                        worst = max(abs(mine[k] - theirs[k]) / theirs[k] for k in theirs)
                        assert worst <= 2e-2, (where, worst, mine, theirs)
            else:
                # [[2, 4]]: from the third step taken, the global step after one skipped step
                assert case["frozen"] == [4 if t >= 2 else 0 for t in taken_before], (where, case["frozen"])
                assert case["events"] == [[2, 3, [0, 4]]], (where, case["events"])
                assert case["layout"] == [1, len(results)], where
                around = case["repack"]
                assert around["before"]["skipped_steps"] == 1, (where, around)
                assert around["after"] == around["before"], (where, around)


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_freeze_with_master_copy_optimizers(tmp_path) -> None:
    results = launch("freeze_precision", 2, tmp_path, timeout_s=540,
                     extra={"cases": TWO_RANKS, "skip_cases": SKIP_CASES})
    _check(results, len(TWO_RANKS))
    _check_skipped_steps(results, len(SKIP_CASES))


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_freeze_with_master_copies_split_between_replicas(tmp_path) -> None:
    results = launch("freeze_precision", 4, tmp_path, timeout_s=540,
                     extra={"cases": FOUR_RANKS, "skip_cases": FOUR_RANK_SKIP_CASES})
    _check(results, len(FOUR_RANKS))
    _check_skipped_steps(results, len(FOUR_RANK_SKIP_CASES))


def test_which_optimizers_freezing_can_hold_still() -> None:
    """The rule behind the refusal at init (runtime/features/frozen_state.py), without a process group: a torch
    optimizer,
    and DeepSpeed's wrappers whose master copies it can locate; the fused FP16_Optimizer and an unknown wrapper are
    refused with the rule and the fix."""
    import torch

    from ds_terapipe.runtime.features.frozen_state import frozen_state_problem

    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    assert frozen_state_problem(sgd) is None
    wrappers = {name: type(name, (), {"__init__": lambda self: setattr(self, "optimizer", sgd)})
                for name in ("BF16_Optimizer", "FP16_UnfusedOptimizer", "FP16_Optimizer", "Mystery")}
    bf16 = wrappers["BF16_Optimizer"]()
    bf16.bf16_groups = []
    assert frozen_state_problem(bf16) is None
    assert frozen_state_problem(wrappers["FP16_UnfusedOptimizer"]()) is None
    assert "fused FP16_Optimizer" in frozen_state_problem(wrappers["FP16_Optimizer"]())
    assert "does not know where Mystery keeps" in frozen_state_problem(wrappers["Mystery"]())
    assert "needs a torch optimizer" in frozen_state_problem(object())


def test_which_optimizers_a_repack_can_move() -> None:
    """The rule behind the repack's refusal at init (runtime/features/repack.py), without a process group: a torch
    optimizer, DeepSpeed's flat master copies (BF16_Optimizer, ZeRO 1 in any precision) and fp16's per-parameter
    copies (FP16_UnfusedOptimizer) move; the fused FP16_Optimizer and a wrapper whose masters the repack cannot
    locate are refused with the rule and the fix."""
    from types import SimpleNamespace

    import torch

    from ds_terapipe.runtime.features.repack import check_repack_supported

    inner = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    bf16 = type("BF16_Optimizer", (), {})()
    bf16.optimizer, bf16.bf16_groups = inner, []
    zero = type("DeepSpeedZeroOptimizer", (), {})()
    zero.optimizer, zero.single_partition_of_fp32_groups, zero.dtype = inner, [], torch.bfloat16
    zero16 = type("DeepSpeedZeroOptimizer", (), {})()
    zero16.optimizer, zero16.single_partition_of_fp32_groups, zero16.dtype = inner, [], torch.float16
    fused16 = type("FP16_Optimizer", (), {})()
    fused16.optimizer = inner
    unfused16 = type("FP16_UnfusedOptimizer", (), {})()
    unfused16.optimizer, unfused16.fp16_groups, unfused16.fp32_groups = inner, [], []
    unknown = type("SomeWrapper", (), {})()
    unknown.optimizer = inner

    def problem(optimizer):
        engine = SimpleNamespace(optimizer=optimizer, module=SimpleNamespace(rebuild_spec={"layers": []}),
                                 micro_batches=2, num_stages=2, training_dataloader=None, config={})
        return check_repack_supported(engine)

    for ok in (inner, bf16, zero, zero16, unfused16):
        assert problem(ok) is None, type(ok).__name__
    for refused in (fused16, unknown):
        assert "repack works with a torch optimizer (fp32), BF16_Optimizer" in problem(refused), type(refused).__name__


def test_the_repack_rule_counts_frozen_chunks_in_whole_ranks() -> None:
    """The repack shrinks the pipeline by the frozen work in whole ranks' worth: with one chunk per rank the frozen
    stages; with v chunks per rank floor(frozen chunks / v) (a frozen chunk 0 alone leaves every rank most of its
    work)."""
    from ds_terapipe.runtime.features.repack import repack_factor, repacked_rank

    assert [repack_factor(4, f) for f in range(4)] == [1, 2, 2, 4]
    assert [repack_factor(2, f, 2) for f in range(4)] == [1, 1, 2, 2]
    assert [repack_factor(4, f, 2) for f in (1, 2, 3, 4, 6)] == [1, 2, 2, 2, 4]
    # the rank that was stage s of replica r: the k old stages merged into one keep apart as replicas
    assert [repacked_rank(s, 0, 1, 2) for s in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_the_auto_policy_norm_of_a_layer_sums_its_rows_over_the_pipeline() -> None:
    """Under vocabulary parallelism an untied input embedding's table is rows on every stage: layer 0's norm is the
    layer's own gradient with every stage's rows, each counted once however many replicas report it."""
    from ds_terapipe.runtime.features.freeze import layer_norms

    # 2 stages x 2 replicas: ranks 0, 1 are stage 0 (layer 0's position table, layer 1), ranks 2, 3 stage 1
    stage0 = {0: 9.0, 1: 4.0, (0, 0): 16.0}
    stage1 = {2: 1.0, (0, 1): 56.0}
    norms = layer_norms([stage0, dict(stage0), stage1, dict(stage1)], scale=2.0)
    assert norms == {0: 4.5, 1: 1.0, 2: 0.5}   # sqrt(9 + 16 + 56) / 2
