"""The order of a step's gradient sums (``runtime/execution/grad_reduction.py``): where the data-parallel
reduction leaves every replica the whole gradient (ZeRO 0, DeepSpeed's bf16 optimizer), the tied weights are
summed after it, so every copy of a tied weight gets one all-reduce's result; elsewhere DeepSpeed's order stays.
Copies that drift apart show only with 3 or more replicas (world 6 or more, too many processes for the suite);
the fuzzer checks them bit for bit (``copies``; 1.8e-4 apart in the tied order, 0 after the average)::

    python -m tests.fuzz --world 8 --case '{"stages": 2, "layers": 2, "vocab": 63, "slices": 1, "granularity": 8,
        "micro": 3, "precision": "bf16", "steps": 3}'
"""
import logging
from types import SimpleNamespace

import pytest

from ds_terapipe.runtime.execution.grad_reduction import GradReduction


class _DeepSpeed:
    """The two DeepSpeed handlers the mixin extends, recording the order they run in."""

    def _exec_reduce_tied_grads(self) -> None:
        self.calls.append("tied")

    def _exec_reduce_grads(self) -> None:
        self.calls.append("data-parallel")


class _Engine(GradReduction, _DeepSpeed):
    sharded = sequence = _vocab = freezer = None

    stage_id, optimizer = 0, object()

    def __init__(self, *, zero: int, bf16: bool, shard_params: bool = False, one_replica: bool = False,
                 replicas: int = 2, tied: int = 0) -> None:
        self.calls: list[str] = []
        self.grid = SimpleNamespace(data_parallel_size=replicas)
        # one key held by this rank and another (``tied``), one held by this rank alone: DeepSpeed lists both
        self._tied = {"embed": {"ranks": [0, 1]}} if tied else {}
        self._tied["alone"] = {"ranks": [0]}
        self.terapipe = SimpleNamespace(shard_params=shard_params)
        self.using_bf16_optimizer = bf16
        self._zero = zero
        self._stashes, self._weight_grads = {}, []
        self._one_replica = one_replica
        self._tied_sum_after_dp = self._tied_sum_after_dp_by_config()

    def zero_optimization_stage(self) -> int:
        return self._zero

    def _dp_reduce_is_identity(self) -> bool:
        return self._one_replica

    @property
    def module(self) -> SimpleNamespace:
        return SimpleNamespace(get_tied_weights_and_groups=lambda: [], tied_comms=self._tied)

    def tail(self) -> list[str]:
        self._exec_reduce_tied_grads()
        self._exec_reduce_grads()
        return self.calls


@pytest.mark.parametrize("zero, bf16, order", [
    (0, False, ["data-parallel", "tied"]),    # fp32/fp16 at ZeRO 0: the fallback all-reduces whole gradients
    (0, True, ["data-parallel", "tied"]),     # BF16_Optimizer at ZeRO 0 ...
    (1, True, ["data-parallel", "tied"]),     # ... and at ZeRO 1: it all-reduces its whole fp32 gradients
    (1, False, ["tied", "data-parallel"]),    # ZeRO 1's optimizer keeps its partition only: DeepSpeed's order
], ids=["zero0", "bf16-zero0", "bf16-zero1", "zero1"])
def test_tied_sum_runs_after_the_data_parallel_reduction_where_replicas_keep_whole_gradients(zero, bf16, order):
    assert _Engine(zero=zero, bf16=bf16).tail() == order


def test_tied_sum_runs_with_one_replica_too():
    """No data-parallel reduction to run (an identity with one replica): the tied weights are still summed."""
    assert _Engine(zero=0, bf16=False, one_replica=True).tail() == ["tied"]


@pytest.mark.parametrize("replicas, zero, tied, warned", [(3, 1, 1, True), (2, 1, 1, False), (4, 0, 1, False),
                                                           (4, 1, 0, False)])
def test_a_tied_copy_left_to_drift_is_warned_about(replicas, zero, tied, warned, caplog):
    """ZeRO 1's optimizer with 3 or more replicas keeps DeepSpeed's order, where the copies may drift: said once, at
    init, with the two settings that keep them equal (2 replicas add in one order: a + b = b + a). A tied key one
    rank holds alone has no copy to drift from."""
    with caplog.at_level(logging.WARNING, logger="ds_terapipe.runtime.execution.engine"):
        _Engine(zero=zero, bf16=False, replicas=replicas, tied=tied)
    text = " ".join(r.getMessage() for r in caplog.records)
    assert ("drift apart" in text and "grad_accum_dtype" in text and "ZeRO 0" in text) == warned, text
    assert "'alone'" not in text
