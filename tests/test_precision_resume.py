"""Tier b: bf16 and fp16 runs at ZeRO stage 0 and 1 resume from a checkpoint exactly, on 2 stages (one launch of
2 ranks) and on 2 stages x 2 replicas (one launch of 4 ranks), every case in one process group
(tests/suites/precision_resume.py).

Exactly means bit for bit: a fresh engine that loads the checkpoint trains the next 3 steps with the losses, loss
scales and learning rates of the run that went on without stopping, and ends with the same fp32 master weights.
bf16 at ZeRO stage 0 is the case DeepSpeed 0.19.8's own load gets wrong (its BF16_Optimizer is handed one state
dict where it indexes a list per data-parallel rank: ``KeyError: 0``); the engine loads that optimizer itself
(runtime/execution/checkpoint.py). Loading weights only (``load_optimizer_states=False``) must leave the fp32 master
weights
equal to the loaded weights, which DeepSpeed leaves at their initial values without ZeRO. The step on which a
dynamic fp16 scale doubles moves the weights as a static scale's does, and the csv monitor logs the doubled scale
after it, as DeepSpeed's does. A step with an inf or nan gradient (from the data, on every replica or on one, or in
one stage's gradient alone) is skipped on every rank as stock DeepSpeed 0.19.8 skips it, in fp16 (the scale halved
or the hysteresis spent, down to ``min_loss_scale``, where ZeRO 1 raises DeepSpeed's error on every rank and ZeRO 0
stays) and in bf16, with 3 slices and unsliced, and training goes on as DeepSpeed's does.

fp16 on a CPU: DeepSpeed's CPU accelerator refuses it where oneDNN has no fp16 kernels ("Type fp16 is not
supported on your device."); the suite lets DeepSpeed build its fp16 optimizers anyway (torch computes fp16 on any
CPU), because the optimizers' checkpoint state is what is tested.
"""

from __future__ import annotations

import pytest
import torch

from ds_terapipe.runtime.execution.checkpoint import CheckpointError, bf16_optimizer_file, load_bf16_optimizer_state
from tests.dist_harness import launch

OPTIMIZERS = {"bf16 zero0": "BF16_Optimizer", "bf16 zero1": "DeepSpeedZeroOptimizer",
              "fp16 zero0": "FP16_UnfusedOptimizer", "fp16 zero1": "DeepSpeedZeroOptimizer"}
#: how each case's checkpoint holds the optimizer state (``optimizer_format``), and the other ZeRO stage's way
FORMATS = {"bf16 zero0": ("bf16", "zero"), "bf16 zero1": ("zero", "bf16"), "fp16 zero0": ("fp16", "zero"),
           "fp16 zero1": ("zero", "fp16")}


#: DeepSpeed 0.19.8 through the overflow cases' steps (OVERFLOW_STEPS in tests/suites/precision_resume.py): fp16 from
#: a scale of 2^8 with min_loss_scale 64 and the default hysteresis 2. ZeRO 0 (FP16_UnfusedOptimizer) halves the
#: scale on every overflow and stays at the minimum; ZeRO 1 (DynamicLossScaler) spends its hysteresis on the first
#: overflow, halves on the next two, and raises on the overflow at the minimum, on every rank. bf16 skips every
#: step with an inf or nan gradient (its ``check_grad_overflow``), with no scale.
SKIPPED = {"fp16": [0, 1, 2, 3, 3, 4], "bf16": [0, 1, 2, 3, 3]}
FP16_SCALES = {0: [256.0, 128.0, 64.0, 64.0, 64.0, 64.0], 1: [256.0, 256.0, 128.0, 64.0, 64.0]}
FP16_HYSTERESIS = [2, 1, 1, 1, 1]
AT_MINIMUM = "Exception: Current loss scale already at minimum - cannot decrease scale anymore. Exiting run."
#: how far a run's fp32 master weights may end from stock DeepSpeed's at ZeRO 1 (slices round fp16/bf16 sums
#: otherwise; measured 1.2e-5 and 6.6e-5; a step moves them about 1e-2)
TOLERANCE = {"fp16": 2e-4, "bf16": 5e-4}


def _check_overflow(case: dict, precision: str, rank: int) -> None:
    """A step whose gradients hold an inf or nan anywhere (every replica's loss, one replica's loss, one gradient
    element of stage 0 on replica 0) is skipped on every rank as stock DeepSpeed skips it, and training goes on as
    DeepSpeed's does (tests/suites/precision_resume.py, ``_overflow_case``)."""
    steps = case["steps"]
    for name, run in case["runs"].items():
        where = f"{precision} {name}, rank {rank}"
        zero = int(name.split()[0].removeprefix("zero"))
        stock = case["runs"][f"zero{zero} stock"]
        raises = precision == "fp16" and zero == 1
        count = len(steps) - raises
        assert run["raised"] == ([count, AT_MINIMUM] if raises else None), (where, run["raised"])
        assert run["skipped"] == SKIPPED[precision][:count], (where, run["skipped"])
        assert run["global_steps"] == list(range(1, count + 1)), (where, run["global_steps"])
        if precision == "fp16":
            assert run["scales"] == FP16_SCALES[zero], (where, run["scales"])
            if rank == 0:   # the monitor logs each step's next scale, as DeepSpeed's does
                assert run["monitor_scales"] == run["scales"], (where, run["monitor_scales"])
            if zero == 1:
                assert run["hysteresis"] == FP16_HYSTERESIS, (where, run["hysteresis"])
        for key in ("scales", "hysteresis", "lrs", "monitor_scales"):
            assert run[key] == stock[key], (where, key, run[key], stock[key])
        skipped = [0] + run["skipped"]
        for step in range(count):
            if skipped[step + 1] > skipped[step]:   # nothing moved: weights, optimizer state, lr scheduler
                assert (run["weights_moved"][step], run["state_moved"][step]) == (0.0, 0.0), (where, step, run)
                assert run["norms"][step] == float("inf"), (where, step, run["norms"])
                assert run["lrs"][step] == run["lrs"][step - 1], (where, step, run["lrs"])
            else:
                assert run["weights_moved"][step] > 0.0, (where, step, run["weights_moved"])
        # training goes on as stock DeepSpeed's does (whose fp16 at ZeRO 0 divides by a scale it never applied:
        # the token pipeline's ZeRO 0 is held to its own ZeRO 1 instead)
        if run is not stock:
            assert run["vs_zero1" if zero == 0 and precision == "fp16" else "vs_stock"] < TOLERANCE[precision], (
                where, run["vs_stock"], run["vs_zero1"])
    if "zero1 unsliced" in case["runs"]:   # the same computation as DeepSpeed's, so the same numbers
        unsliced, stock = case["runs"]["zero1 unsliced"], case["runs"]["zero1 stock"]
        clean = [i for i, what in enumerate(steps[:len(unsliced["losses"])]) if what == "clean"]
        assert [unsliced["losses"][i] for i in clean] == [stock["losses"][i] for i in clean], (unsliced, stock)
        assert unsliced["vs_stock"] == 0.0, unsliced["vs_stock"]


def _check(results: list[dict], world: int) -> None:
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors[0]
    for rank, payload in enumerate(results):
        cases = {case["case"]: case for case in payload["results"]}
        assert cases.pop("host")["world"] == world
        growths = {zero: cases.pop(f"fp16 growth zero{zero}") for zero in (0, 1)}
        for precision in ("fp16", "bf16") if world > 2 else ("fp16",):
            overflow = cases.pop(f"{precision} overflow")
            assert "error" not in overflow, f"{overflow.get('error')}\n{overflow.get('traceback')}"
            _check_overflow(overflow, precision, rank)
        # get_global_grad_norm() is the unscaled gradients' norm at ZeRO 0 as at ZeRO 1 (FP16_UnfusedOptimizer
        # reports the scaled one, 256x; it also counts the tied embedding once per stage holding it: not equal)
        norms = [growths[zero].get("norms", [float("nan")])[0] for zero in (0, 1)]
        assert 0.5 < norms[0] / norms[1] < 2.0, (rank, norms)
        for zero, growth in growths.items():
            # the step on which the dynamic scale grows is divided by the scale of its backward, not the new one
            assert "error" not in growth, f"{growth.get('error')}\n{growth.get('traceback')}"
            assert growth["scales"] == {"fp16": [256.0, 256.0, 512.0], "fp16 static": [256.0] * 3}, growth["scales"]
            assert growth["losses"]["fp16"] == growth["losses"]["fp16 static"], growth["losses"]
            if rank == 0:   # the monitor logs the scale the next step uses, as DeepSpeed's does
                assert growth["monitor_scales"] == growth["scales"]["fp16"], growth["monitor_scales"]
            assert growth["master_max_diff"][0] == 0.0, (f"fp16 zero{zero}, rank {rank}: the step that doubled the "
                                                         "scale moved the weights elsewhere", growth["master_max_diff"])
        assert sorted(cases) == sorted(OPTIMIZERS), sorted(cases)
        for name, case in cases.items():
            where = f"{name}, rank {rank} of {world}"
            assert "error" not in case, f"{where}: {case.get('error')}\n{case.get('traceback')}"
            assert case["optimizer"] == OPTIMIZERS[name], (where, case["optimizer"])
            # the same precision at the other ZeRO stage keeps the state another way: refused with the fix
            other, refusal = case["other_stage"]
            assert (case["format"], other) == FORMATS[name], (where, case["format"], other)
            assert "holds its optimizer state as" in refusal and "load_optimizer_states=False" in refusal, (
                where, refusal)
            # the checkpoint is worth testing: the weights moved before it was written
            assert case["loaded_vs_initial"][0] > 0.0, (where, case["loaded_vs_initial"])
            for key in ("losses", "scales", "lrs"):
                assert case["resumed"][key] == case["uninterrupted"][key], (
                    f"{where}: {key} after resuming {case['resumed'][key]} != uninterrupted "
                    f"{case['uninterrupted'][key]}")
            assert case["master_max_diff"][0] == 0.0, (where, "fp32 master weights differ", case["master_max_diff"])
            assert case["weights_only_master_vs_weights"][0] == 0.0, (
                where, "weights only: fp32 masters are not the loaded weights", case["weights_only_master_vs_weights"])
            assert case["step"] == 2 and case["global_steps"] == [5, 5], (where, case["step"], case["global_steps"])
        # fp16 without ZeRO trains as far as with ZeRO 1 (DeepSpeed 0.19.8 leaves its loss unscaled, so its
        # optimizer's unscaling shrank every step by the loss scale: 1/256 here until the engine scaled it)
        moved = {name: cases[name]["loaded_vs_initial"][0] for name in ("fp16 zero0", "fp16 zero1")}
        assert 0.5 < moved["fp16 zero0"] / moved["fp16 zero1"] < 2.0, (rank, moved)
        if world == 2:   # the loss scale moved while the fp16 runs trained, so resuming it is tested
            assert len(set(cases["fp16 zero0"]["uninterrupted"]["scales"])) > 1


@pytest.mark.multiproc
@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", [2, 4], ids=["2stages", "2stages_x_2replicas"])
def test_bf16_and_fp16_at_zero_0_and_1_resume_bit_for_bit(tmp_path, world: int) -> None:
    _check(launch("precision_resume", world, tmp_path, timeout_s=360, extra={"force_fp16": True}),
           world)


def test_bf16_optimizer_state_of_another_replica_count_or_precision_is_refused(tmp_path) -> None:
    (tmp_path / "bf16_zero_pp_rank_1_mp_rank_03_optim_states.pt").write_bytes(b"")
    assert bf16_optimizer_file(str(tmp_path), dp_rank=1, dp_world_size=2, mp_rank=3, saved_dp_world_size=2) == str(
        tmp_path / "bf16_zero_pp_rank_1_mp_rank_03_optim_states.pt")
    with pytest.raises(CheckpointError, match=r"partitioned over 4 data-parallel ranks, this run has 2: .*resume "
                                              r"with 4 replicas, or load weights only \(load_optimizer_states=False\)"):
        bf16_optimizer_file(str(tmp_path), dp_rank=1, dp_world_size=2, mp_rank=3, saved_dp_world_size=4)
    with pytest.raises(CheckpointError, match=r"lacks bf16_zero_pp_rank_0_mp_rank_03_optim_states.pt.*not saved "
                                              r"with bf16 at ZeRO stage 0; load weights only"):
        bf16_optimizer_file(str(tmp_path), dp_rank=0, dp_world_size=2, mp_rank=3, saved_dp_world_size=2)


def test_a_bf16_load_refreshes_the_masters_then_hands_the_optimizer_its_ranks_state(tmp_path) -> None:
    """``load_bf16_optimizer_state``: BF16_Optimizer reads its own data-parallel rank's entry of the list it is
    given; its fp32 masters are refreshed from the loaded weights first, and with weights only (no file) that is
    all there is to do: without it the first step would overwrite the loaded weights with the initial masters."""
    path = tmp_path / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"of": "dp rank 1"}}, path)
    calls: list = []

    class BF16Optimizer:   # the two calls made of DeepSpeed's BF16_Optimizer
        def refresh_fp32_params(self) -> None:
            calls.append("masters from the loaded weights")

        def load_state_dict(self, states: list, load_optimizer_states: bool, load_from_fp32_weights: bool) -> None:
            calls.append((states, load_optimizer_states, load_from_fp32_weights))

    load_bf16_optimizer_state(BF16Optimizer(), str(path), dp_rank=1, dp_world_size=2, load_from_fp32_weights=False)
    assert calls == ["masters from the loaded weights", ([None, {"of": "dp rank 1"}], True, False)]
    calls.clear()
    load_bf16_optimizer_state(BF16Optimizer(), None, dp_rank=1, dp_world_size=2, load_from_fp32_weights=True)
    assert calls == ["masters from the loaded weights"]
