"""What a half-precision case against the fp32 reference must show (tests/test_vocab_precision.py,
tests/test_freeze_precision.py): the optimizer DeepSpeed picked for its precision and ZeRO stage, losses close to
the reference's, and the fp32 master weights' change within the precision's rounding of the reference's."""

from __future__ import annotations

# bf16 rounds to 8 bits of mantissa, fp16 to 11: the master-weight change over a few steps stays within these.
# fp32: the change is small next to the weights, so their rounding (1e-7 of a weight) reaches 2e-5 of the change
# (seen on a Llama's attention projections); a wrong update is off by 8e-2 or more.
UPDATE_TOL = {"bf16": 5e-2, "fp16": 1e-2, "fp32": 1e-4}
LOSS_TOL = 1e-4
OPTIMIZERS = {("bf16", 0): "BF16_Optimizer", ("fp16", 0): "FP16_UnfusedOptimizer", ("fp32", 0): "SGD",
              ("bf16", 1): "DeepSpeedZeroOptimizer", ("fp16", 1): "DeepSpeedZeroOptimizer",
              ("fp32", 1): "DeepSpeedZeroOptimizer"}


def check_precision_case(case: dict, rank: int) -> str:
    """Assert the common part of one case of one rank (named "<precision> zero<stage> ..."); its precision."""
    where = f"{case['case']}, rank {rank}"
    assert "error" not in case, f"{where}: {case.get('error')}\n{case.get('traceback')}"
    precision, zero = case["case"].split()[:2]
    assert case["optimizer"] == OPTIMIZERS[(precision, int(zero.removeprefix("zero")))], where
    for got, ref in zip(case["losses"], case["ref_losses"]):
        assert abs(got - ref) <= LOSS_TOL * abs(ref), f"{where}: losses {case['losses']} {case['ref_losses']}"
    assert case["update_rel_err"] <= UPDATE_TOL[precision], \
        f"{where}: the update of {case['update_worst']} is off by {case['update_rel_err']}"
    return precision
