"""Tier b: sequence parallelism inside the token pipeline (terapipe.sequence_parallel) equals the single-process
unsliced reference.

One launch of 4 processes: 2 stages x 2 sequence ranks, the reference GPT (learned positions) and a Hugging Face
Llama (rotary positions, grouped-query attention: 4 query heads over 2 KV heads, one KV head per sequence rank; and
as Mistral with a sliding window), gpt-oss (attention sinks) and DeepSeek-V3 (latent attention), gpipe and 1f1b, m
in {1, 3}, unequal and equal slices, gradient clipping, interleaved-1f1b and dualpipev; loss, every first-step
gradient and the parameters after 3 SGD + momentum steps on every rank, fp32 rel err <= 1e-5; bf16 at ZeRO 0 (also
clipped) and 1, fp16 at ZeRO 0 and 1 and fp32 at ZeRO 1 against the fp32 reference (the master weights' change
within the precision's rounding); packed rows (document masks; gpipe, 1f1b, interleaved-1f1b; fp32 and bf16; a plan
per batch) against the reference under the same masks; vocabulary parallelism (row shards against the reference's
rows); ``engine.compile()`` (aot_eager, a Llama compiled again after a freeze); freezing by schedule and by
gradient norms, and a repack onto fewer stages; the re-planner switching plans; checkpoints (fp32, bf16 at ZeRO 0,
vocabulary-parallel) resumed at the same layout, and at sequence degree 1 from 2 and 2 from 1; eval_batch's loss; the
refusals; activation and KV memory at degree 1 and 2; last, a sequence rank failing in a layer stops its peers
within seconds, the one inside an all-to-all through the collective watch (tests/suites/sequence.py). A launch of its
own does the same with the failure in init's profile.
"""

from __future__ import annotations

import pytest

from tests.dist_harness import launch
from tests.precision import LOSS_TOL, UPDATE_TOL, check_precision_case
from tests.results import assert_stopped_by_the_watch

pytestmark = pytest.mark.multiproc

TOL = 1e-5
UNEQUAL = [16, 24, 8]
CASES = [["gpt", "gpipe", 1, UNEQUAL], ["gpt", "1f1b", 3, UNEQUAL], ["gpt", "1f1b", 3, 2],
         ["llama", "gpipe", 3, UNEQUAL], ["llama", "1f1b", 1, UNEQUAL], ["gpt", "1f1b", 2, UNEQUAL, 0, True],
         # two chunks per rank: the sequence split is inside every unit, whatever the placement
         ["gpt", "interleaved-1f1b", 2, UNEQUAL], ["llama", "dualpipev", 2, UNEQUAL],
         # slices "auto": each rank profiles its share of every slice with the all-to-alls, one plan for all
         ["gpt", "1f1b", 2, "auto"],
         # vocabulary parallelism: each sequence rank's share through VF/VB (and EF/EB: GPT tied, Llama untied)
         ["gpt", "1f1b", 2, UNEQUAL, 0, False, True], ["llama", "gpipe", 1, UNEQUAL, 0, True, True],
         # freezing by schedule (with slices "auto": re-planned after each freeze), and with vocabulary parallelism
         ["gpt", "1f1b", 2, "auto", 0, False, False, [[1, 2], [2, 4]]],
         ["llama", "gpipe", 2, UNEQUAL, 0, False, True, [[1, 3]]],
         # a sliding window (Mistral's, 10 keys) inside each rank's heads' attention over the whole slice
         ["mistral", "1f1b", 2, UNEQUAL],
         # attention sinks (each rank trains its heads'), latent attention (values narrower than keys)
         ["gpt_oss", "gpipe", 2, UNEQUAL], ["deepseek_v3", "1f1b", 1, UNEQUAL],
         # chunked attention (chunks cut inside slices), temperature tuning at each rank's token offset
         ["llama4_text", "1f1b", 2, UNEQUAL],
         # engine.compile() (aot_eager): the layers around each rank's all-to-alls and attention, compiled again
         # after a freeze (one slice length: every further length is a recompile, 15-30 s on 2 cores)
         ["llama", "1f1b", 1, 2, 0, False, False, [[1, 2]], "aot_eager"]]
# [precision, ZeRO stage, model, schedule]: the master weights' change against the fp32 reference's
# (+ clipped by the global norm: bf16 at ZeRO 0 takes DeepSpeed's norm over its model axis, the sequence ranks)
PRECISION_CASES = [["bf16", 1, "llama", "gpipe"], ["bf16", 1, "gpt", "1f1b"], ["fp16", 0, "gpt", "gpipe"],
                   ["fp16", 1, "llama", "1f1b"], ["fp32", 1, "gpt", "1f1b"], ["bf16", 0, "llama", "gpipe"],
                   ["bf16", 0, "gpt", "1f1b", True]]
# packed rows (tests/suites/packed.py: documents of skewed lengths, mixed with plain rows, against the reference under
# the same document mask) at sequence degree 2: [schedule, virtual stages, slices, precision, degree]
# (+ a plan per batch: rank 0's planner from the shares' profiled costs, or a stand-in cutting at document starts)
PACKED_CASES = [["gpipe", 1, [8, 24, 16], "fp32", 2], ["1f1b", 1, 3, "fp32", 2],
                ["interleaved-1f1b", 2, [16, 16, 16], "fp32", 2], ["1f1b", 1, [8, 24, 16], "bf16", 2],
                ["1f1b", 1, "auto", "per-batch", 2], ["interleaved-1f1b", 2, "auto", "per-batch cuts", 2]]


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> list[dict]:
    return launch("sequence", 4, tmp_path_factory.mktemp("sequence"), timeout_s=840,
                  extra={"cases": CASES, "precision_cases": PRECISION_CASES, "packed_cases": PACKED_CASES,
                         "features": True, "fault": True})


@pytest.mark.timeout(900)
def test_sequence_parallel_equals_the_reference(four_ranks) -> None:
    results = four_ranks
    errors = [c for r in results for c in r["results"] if "error" in c]
    assert not errors, errors[0]
    for rank, r in enumerate(results):
        cases = r["results"][:-1]   # the last: the fault (below)
        assert len(cases) == len(CASES) + len(PRECISION_CASES) + len(PACKED_CASES) + 10
        for case in cases[len(CASES):len(CASES) + len(PRECISION_CASES)]:
            check_precision_case(case, rank)
            assert case["compared"] > 0, case
        packed = cases[len(CASES) + len(PRECISION_CASES):len(CASES) + len(PRECISION_CASES) + len(PACKED_CASES)]
        for case in packed:
            where = f"{case['case']}, rank {rank}"
            for got, want in zip(case["losses"], case["ref_losses"]):
                assert abs(got - want) <= LOSS_TOL * abs(want), f"{where}: {case['losses']} {case['ref_losses']}"
            if "bf16" in case["case"]:
                assert case["update_rel_err"] <= UPDATE_TOL["bf16"], (where, case["update_worst"])
            else:
                assert case["grad_rel_err"] <= TOL and case["param_rel_err"] <= TOL, (where, case["grad_worst"],
                                                                                   case["param_worst"])
            assert case["covered"], where
            if "per-batch" in case["case"]:   # every step ran the plan made for its documents, the same on all ranks
                assert case["sources"] == ["documents"] * 3, (where, case["sources"])
                assert all(sum(s) == 48 and all(t % 2 == 0 for t in s) for s in case["slicings"]), where
                assert case["slicings"] == results[0]["results"][cases.index(case)]["slicings"], where
                if "cuts" in case["case"]:
                    assert len({tuple(s) for s in case["slicings"]}) > 1, (where, case["slicings"])
        cases = cases[:len(CASES)] + cases[len(CASES) + len(PRECISION_CASES) + len(PACKED_CASES):]
        for case in cases[:len(CASES)]:
            where = f"{case['case']}, rank {rank}"
            # stage = rank // 2 (DeepSpeed's topology: pipe outermost), sequence rank = rank % 2
            assert (case["stage"], case["sequence_rank"]) == (rank // 2, rank % 2), where
            assert case["layout"] == [2, 2, 1], where
            for got, want in zip(case["losses"], case["ref_losses"]):
                assert abs(got - want) <= TOL * abs(want), f"{where}: losses {case['losses']} {case['ref_losses']}"
            assert case["grad_rel_err"] <= TOL, f"{where}: gradient of {case['grad_worst']} {case['grad_rel_err']}"
            assert case["param_rel_err"] <= TOL, f"{where}: {case['param_worst']} {case['param_rel_err']}"
            assert min(case["compared"]) > 0, where
            assert case["compiled"] == ("compiled=" in case["case"]), where
            if "slices=auto" in case["case"]:
                # (a freeze re-plans from the profiled costs, switching where that pays: "replanned")
                assert case["source"] in ("profiled", "cache", "replanned") and sum(case["slices"]) == 48, (where, case)
                assert case["source"] != "replanned" or "freeze" in case["case"], (where, case["source"])
                assert all(s % 2 == 0 for s in case["slices"]), (where, case["slices"])
                assert case["slices"] == results[0]["results"][cases.index(case)]["slices"], where
            # each sequence rank holds half the heads' keys and values (GPT and DeepSeek-V3: 4 -> 2; the other
            # Hugging Face models: 2 KV heads -> 1); one slice (a plan may choose it) keeps no KV carry
            model = case["case"].split("model=")[1].split()[0]
            want = ([2] if model in ("gpt", "deepseek_v3") else [1]) if len(case["slices"]) > 1 else []
            assert case["kv_heads"] == (None if case["compiled"] else want), (where, case["kv_heads"])
        for ck in cases[len(CASES):len(CASES) + 3]:   # fp32, bf16 at ZeRO 0, fp32 with vocab_parallel
            assert ck["resumed"] == ck["uninterrupted"] and ck["resume_err"] == 0.0, ck
            assert ck["eval_loss"] == pytest.approx(ck["first_train_loss"], rel=1e-6), ck
            refusal = ck["logits_refusal"]   # each rank holds its share of the logits
            assert "return_logits=True" in refusal and "no rank holds them whole" in refusal, ck
        od = cases[len(CASES) + 3]   # written at sequence degree 2, resumed at 1 (2 replicas), and the other way
        for way in ("2to1", "1to2"):
            assert od[way]["resumed"] == pytest.approx(od[way]["uninterrupted"], rel=1e-6), od
            assert od[way]["resume_err"] <= TOL, od
        rp = cases[len(CASES) + 4]   # re-planned from six 8-token slices after one measured step, on every rank
        assert rp["switch"] and rp["ran"][0] == [8] * 6 and rp["ran"][2] == rp["best"] != [8] * 6, rp
        assert rp["best"] == results[0]["results"][len(CASES) + 4 + len(PRECISION_CASES) + len(PACKED_CASES)]["best"]
        for got, want in zip(rp["losses"], rp["ref_losses"]):
            assert abs(got - want) <= TOL * abs(want), rp
        assert rp["param_rel_err"] <= TOL and rp["compared"] > 0, rp
        fa = cases[len(CASES) + 5]   # frozen by gradient norms: the same layers at the same steps on every rank
        assert fa["decided"] and fa["decided"] == results[0]["results"][
            len(CASES) + 5 + len(PRECISION_CASES) + len(PACKED_CASES)]["decided"], fa
        for got, want in zip(fa["losses"], fa["ref_losses"]):
            assert abs(got - want) <= TOL * abs(want), fa
        assert fa["param_rel_err"] <= TOL and fa["compared"] > 0, fa
        rk = cases[len(CASES) + 6]   # repacked after the first stage froze: 2 x 2 x 1 -> 1 stage x 2 x 2 replicas
        assert rk["layouts"] == [[2, 2, 1], [1, 2, 2], [1, 2, 2]], rk
        for got, want in zip(rk["losses"], rk["ref_losses"]):
            assert abs(got - want) <= TOL * abs(want), rk
        assert rk["param_rel_err"] <= TOL and rk["compared"] > 0, rk
        ref = cases[len(CASES) + 7]
        assert "slice lengths must be multiples of 2" in ref["odd_slice"], ref
        assert "but the model was built with sequence_parallel=1" in ref["module"], ref
        assert "assembling the costs failed (planted)" in ref["assembly"], ref
        # the same plan at sequence degree 1 (2 replicas) and 2: activations and KV carry per rank at most 0.55x
        one, two = cases[len(CASES) + 8:]
        assert one["stage"] == two["stage"] == rank // 2
        assert two["kv_bytes"] == one["kv_bytes"] / 2, (one, two)
        act = two["activation_bytes"] / one["activation_bytes"]
        total = (two["activation_bytes"] + two["kv_bytes"]) / (one["activation_bytes"] + one["kv_bytes"])
        assert act <= 0.55 and total <= 0.55, (rank, act, total, one, two)


@pytest.mark.timeout(400)
def test_a_sequence_rank_failing_in_init_s_profile_stops_every_rank_within_seconds(tmp_path) -> None:
    # stage 0's second sequence rank raises in a layer before the first attention while slices "auto" are
    # profiled; its sequence peer, inside that attention's all-to-all, is stopped by the collective watch
    results = launch("sequence", 4, tmp_path, timeout_s=300, extra={"init_fault": True})
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors[0]
    faults = [r["results"][-1] for r in results]
    assert_stopped_by_the_watch(faults, "simulated out of memory while profiling",
                                "engine init's slice check and profile", where="engine init")


@pytest.mark.timeout(900)
def test_a_sequence_rank_failing_mid_step_stops_every_rank_within_seconds(four_ranks) -> None:
    # stage 0's second sequence rank raises in a layer; its sequence peer, inside that layer's all-to-all, which
    # cannot watch the abort flag, is stopped by the collective watch
    assert_stopped_by_the_watch([r["results"][-1] for r in four_ranks],
                                "simulated out of memory in a sequence-parallel layer", "the schedule's all-to-alls")


@pytest.mark.timeout(900)
def test_sequence_parallel_with_data_parallel_replicas(tmp_path) -> None:
    """8 processes: 2 stages x 2 sequence ranks x 2 replicas (DeepSpeed's data axis), fp32 at ZeRO 0 and 1: the
    sequence sum of the gradients comes before the data-parallel mean; equal to the reference over the global
    batch on every rank."""
    results = launch("sequence", 8, tmp_path, timeout_s=840,
                     extra={"cases": [["gpt", "1f1b", 2, UNEQUAL], ["gpt", "gpipe", 1, UNEQUAL, 1]]})
    for rank, r in enumerate(results):
        for case in r["results"]:
            where = f"{case['case']}, rank {rank}"
            assert "error" not in case, (where, case.get("error"), case.get("traceback"))
            assert case["layout"] == [2, 2, 2], where
            for got, want in zip(case["losses"], case["ref_losses"]):
                assert abs(got - want) <= TOL * abs(want), f"{where}: losses {case['losses']} {case['ref_losses']}"
            assert case["grad_rel_err"] <= TOL and case["param_rel_err"] <= TOL, (where, case)
