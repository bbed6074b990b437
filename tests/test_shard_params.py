"""Tier b: sharded data parallelism per chunk (terapipe.shard_params) equals the single-process unsliced reference.

One launch of 4 processes (2 stages x 2 replicas) runs tests/suites/sharded.py: ``looped-bfs``,
``interleaved-1f1b``, ``1f1b``, ``gpipe`` and ``dualpipev`` in fp32 (loss, every first-step gradient and the
parameters after 3 SGD + momentum steps, rel err <= 1e-5; clipped by the global norm in two cases, the norms against
``clip_grad_norm_``'s) and bf16 (bf16 compute over fp32 shards: the master weights' change within bf16 rounding of
the reference's); the AG and RS actions executed per step against the lowered schedule's count at m in {2, 4, 8}
(``looped-bfs``: the same at every m); the model states per rank against the replicated run's; a checkpoint saved
sharded and resumed at the same layout; last, a replica failing in a layer stops its peers within seconds, the one
inside a gather or reduce-scatter through the collective watch. A second launch of 2 processes resumes that
checkpoint with one replica.
"""

from __future__ import annotations

import pytest

from tests.dist_harness import launch
from tests.precision import LOSS_TOL, UPDATE_TOL
from tests.results import assert_stopped_by_the_watch

pytestmark = pytest.mark.multiproc

TOL = 1e-5
# [schedule, virtual stages, micro-batches, precision, clipped, prefetch, sampler, release, more terapipe keys]
CASES = [["looped-bfs", 2, 4, "fp32"], ["interleaved-1f1b", 2, 4, "fp32"], ["1f1b", 1, 4, "fp32", True],
         ["gpipe", 1, 2, "fp32"],
         ["dualpipev", 2, 4, "fp32", True], ["looped-bfs", 2, 4, "bf16"], ["interleaved-1f1b", 2, 2, "bf16", True],
         ["1f1b", 1, 2, "bf16"],
         # one chunk gathered at a time; a module without an input sampler (the slice check on the first batch)
         ["interleaved-1f1b", 2, 2, "fp32", False, False, False],
         # chunks whole from their first run to their last (one gather and one reduce-scatter per chunk and step)
         ["interleaved-1f1b", 2, 4, "fp32", True, True, True, "step"], ["looped-bfs", 2, 2, "bf16", False, True, True,
                                                                          "step"],
         # slices "auto" (profiled on whole layers at init) and re-planned from the sharded steps' timelines
         ["looped-bfs", 2, 2, "fp32", False, True, True, "run",
          {"slices": "auto", "replan": {"enabled": True, "warmup_steps": 1, "measure_steps": 1, "min_gain": 0.0}}]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[list[dict], list[dict]]:
    tmp = tmp_path_factory.mktemp("sharded")
    ckpt = tmp / "ckpt"
    four = launch("sharded", 4, tmp / "four", timeout_s=840,
                  extra={"cases": CASES, "gathers": True, "memory": True, "checkpoint": str(ckpt), "fault": True})
    two = launch("sharded", 2, tmp / "two", timeout_s=300, extra={"resume": str(ckpt)})
    return four, two


@pytest.mark.timeout(1200)
def test_every_schedule_equals_the_reference_sharded(runs) -> None:
    four, _ = runs
    for rank, r in enumerate(four):
        cases = r["results"][:len(CASES)]
        for spec, case in zip(CASES, cases):
            where = f"{case['case']}, rank {rank}"
            assert "error" not in case, f"{where}: {case.get('error')}\n{case.get('traceback')}"
            assert case["sharded"] > 0, where
            for got, want in zip([case["eval_loss"], *case["losses"]], [case["ref_losses"][0], *case["ref_losses"]]):
                assert abs(got - want) <= LOSS_TOL * abs(want), f"{where}: {case['losses']} {case['ref_losses']}"
            if spec[3] == "fp32":
                assert case["grad_rel_err"] <= TOL, (where, case["grad_worst"], case["grad_rel_err"])
                assert case["param_rel_err"] <= TOL, (where, case["param_worst"], case["param_rel_err"])
            else:   # rounded as bf16 compute rounds, and no further
                assert 1e-4 < case["update_rel_err"] <= UPDATE_TOL["bf16"], (where, case["update_worst"])
            if len(spec) > 4 and spec[4]:
                for got, want in zip(case["norms"], case["ref_norms"]):
                    assert abs(got - want) <= (1e-5 if spec[3] == "fp32" else 5e-3) * want, (where, case["norms"])
            assert case["gathers"] == case["planned"][0] and case["reduce_scatters"] == case["planned"][1], where
            if len(spec) > 7 and spec[7] == "step":   # once per chunk of the rank
                assert case["gathers"] == case["reduce_scatters"] == 2, where
            if len(spec) > 8 and "replan" in spec[8]:   # the re-planner decided from the sharded steps
                assert case["plan_source"] in ("profiled", "replanned") and case["replanned"], where


def test_gathers_per_step_are_the_schedules(runs) -> None:
    four, _ = runs
    for rank, r in enumerate(four):
        by_case = {c["case"]: c for c in r["results"]}
        bfs, deep = by_case["gathers looped-bfs"], by_case["gathers interleaved-1f1b"]
        assert bfs["executed"] == bfs["planned"] and deep["executed"] == deep["planned"], rank
        assert bfs["executed"][0] == bfs["executed"][1] == bfs["executed"][2], rank   # m = 2, 4, 8: the same
        assert bfs["executed"][0][0] <= 4, rank                                   # at most 2 runs per chunk
        assert deep["executed"][0][0] < deep["executed"][1][0] < deep["executed"][2][0], rank


def test_model_states_per_rank_are_a_replicas_share_plus_a_gathered_chunk(runs) -> None:
    four, _ = runs
    for rank, r in enumerate(four):
        mem = next(c for c in r["results"] if c["case"] == "memory looped-bfs")
        replicated = mem["replicated"]
        whole = replicated["params"] + replicated["grads"] + replicated["optimizer"]
        for label in ("sharded", "sharded_no_prefetch"):
            got = mem[label]
            held = got["params"] + got["grads"] + got["optimizer"]
            # uneven shards round up by at most one row per tensor
            assert held <= 0.52 * whole, (rank, label, held, whole)
            assert got["replicated_params"] == replicated["params"], (rank, label)
        # at the peak, one chunk gathered (two when the next run's gather is started early)
        alone, early = mem["sharded_no_prefetch"], mem["sharded"]
        assert alone["gathered_peak"] <= alone["largest_chunk"] + 1e-9, rank
        assert alone["params"] + alone["grads"] + alone["optimizer"] + alone["gathered_peak"] <= \
            whole / 2 + alone["largest_chunk"], rank
        assert early["gathered_peak"] <= 2 * early["largest_chunk"], rank


def test_a_sharded_checkpoint_resumes_at_the_same_and_at_another_data_parallel_size(runs) -> None:
    four, two = runs
    for rank, r in enumerate(four):
        for name in ("checkpoint looped-bfs", "checkpoint looped-bfs parallel write"):
            case = next(c for c in r["results"] if c["case"] == name)
            assert "error" not in case, case
            assert case["resumed"] == case["went_on"] and case["param_max_abs"] == 0.0, (rank, case)
            # the save gathers one layer whole at a time (DeepSpeed's loop keeps the previous layer's state while
            # it asks for the next), never the whole stage, whichever replicas write the layers; a replica that
            # does not write the optimizer state keeps nothing of it
            held, layers = case["save_held"], case["layer_bytes"]
            assert held["left"] == 0, (rank, name, held)
            assert held["peak"] <= sum(layers[-2:]), (rank, name, held, layers)
            if not case["writes"]:
                assert held["peak"] <= layers[-1] or name.endswith("parallel write"), (rank, held, layers)
                assert held["peak_optimizer"] <= layers[-1], (rank, name, held, layers)
    # 2 stages x 2 replicas (ranks 0, 1 | 2, 3) saved; 2 stages x 1 replica (ranks 0 | 1) resumed
    for stage, (saved_rank, resumed) in enumerate(zip((0, 2), two)):
        went_on = next(c for c in four[saved_rank]["results"] if c["case"] == "checkpoint looped-bfs")
        case = resumed["results"][0]
        assert "error" not in case, case
        assert case["stage"] == stage
        assert abs(case["loss"] - went_on["went_on"]) <= 1e-5 * abs(went_on["went_on"]), (case["loss"], went_on)
        expected = went_on["expected"]
        assert set(case["params"]) == set(expected), stage
        import torch

        for name, values in expected.items():
            got, want = torch.tensor(case["params"][name]), torch.tensor(values)
            assert float((got - want).norm() / want.norm()) <= 1e-5, (stage, name)


def test_a_zero1_checkpoint_at_another_data_parallel_size_is_refused_before_loading_then_loads_weights(runs) -> None:
    _, two = runs
    for rank, r in enumerate(two):
        case = next(c for c in r["results"] if c["case"] == "zero at another data-parallel size")
        assert "error" not in case, case
        assert "partitioned over 2 data-parallel replicas, this run has 1" in case["refusal"], case
        assert "load_optimizer_states=False" in case["refusal"] and case["untouched"], case
        assert case["steps"] == 3, case   # "zero1" was saved after the third step


def test_a_checkpoint_crosses_between_sharded_and_zero_runs_only_without_the_optimizer_state(runs) -> None:
    """The optimizer formats differ (whole shard_params tensors vs ZeRO's partitioned files): asked for the optimizer
    state, every rank refuses with the rule and the fix and the engine stays usable; without it, the weights and the
    step count load exactly, the optimizer starts fresh, and the run trains on."""
    four, _ = runs
    for rank, r in enumerate(four):
        case = next(c for c in r["results"] if c["case"] == "checkpoint across optimizer formats")
        assert "error" not in case, (rank, case.get("error"), case.get("traceback"))
        for key, saved, own in (("zero_refusal", "the torch optimizer's state dict", "ZeRO's partitioned"),
                                ("sharded_refusal", "ZeRO's partitioned", "the torch optimizer's state dict")):
            assert f"holds its optimizer state as {saved}" in case[key], (rank, case[key])
            assert f"this run keeps it as {own}" in case[key] and "load_optimizer_states=False" in case[key], rank
        assert case["flag_after_refusal"] is None, (rank, case["flag_after_refusal"])
        assert case["zero_from_sharded"] == 0.0 and case["sharded_from_zero"] == 0.0, (rank, case)
        assert case["zero_steps"] == 2 and case["sharded_steps"] == 3, (rank, case)
        assert case["zero_fresh_state"] and case["sharded_fresh_state"], (rank, case)
        assert case["zero_loss"] > 0 and case["sharded_loss"] > 0, (rank, case)


def test_a_checkpoint_moves_between_sharded_and_plain_fp32_runs_with_the_optimizer_state(runs) -> None:
    """Both keep the torch optimizer's state as whole tensors: a run without shard_params resumes the sharded
    checkpoint, and a sharded run that run's checkpoint, each with Adam's state: step 3 as the sharded resume's."""
    four, _ = runs
    for rank, r in enumerate(four):
        case = next(c for c in r["results"] if c["case"] == "checkpoint between sharded and plain runs")
        assert "error" not in case, (rank, case.get("error"), case.get("traceback"))
        for name in ("plain", "sharded"):
            got = case[name]
            assert got["steps"] == 2, (rank, name, got)
            assert abs(got["loss"] - got["ref_loss"]) <= 1e-6 * abs(got["ref_loss"]), (rank, name, got)
            assert got["param_rel_err"] <= 1e-6, (rank, name, got)


@pytest.mark.timeout(1200)
def test_a_replica_failing_mid_step_stops_every_rank_within_seconds(runs) -> None:
    # stage 0's second replica raises in a layer; a peer inside the schedule's gathers or reduce-scatters, which
    # cannot watch the abort flag, is stopped by the collective watch
    four, _ = runs
    assert_stopped_by_the_watch([r["results"][-1] for r in four], "simulated out of memory in a sharded layer",
                                "the schedule's gathers and reduce-scatters")
