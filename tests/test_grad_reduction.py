"""The order of a step's gradient sums (``runtime/execution/grad_reduction.py``): where the data-parallel
reduction leaves every replica the whole gradient (ZeRO 0, DeepSpeed's bf16 optimizer), the tied weights are
summed after it, so every copy of a tied weight gets one all-reduce's result; under ZeRO 1's own optimizer with 3
or more replicas, the copies are summed over the replicas onto the first one, tied-summed there alone and zeroed
elsewhere before DeepSpeed's average; fp16 there, and 2 replicas, keep DeepSpeed's order. Copies that drift apart
show only with 3 or more replicas (world 6 or more, too many processes for the suite); the fuzzer checks them bit
for bit (``copies``; 1.8e-4 apart in DeepSpeed's order, 0 in the engine's; ``"zero": 1`` for the first replica)::

    python -m tests.fuzz --world 8 --case '{"stages": 2, "layers": 2, "vocab": 63, "slices": 1, "granularity": 8,
        "micro": 3, "precision": "bf16", "steps": 3}'
"""
import logging
from types import SimpleNamespace

import pytest
import torch

from ds_terapipe.runtime.execution import grad_reduction
from ds_terapipe.runtime.execution.grad_reduction import GradReduction


class _DeepSpeed:
    """The two DeepSpeed handlers the mixin extends, recording the order they run in."""

    def _exec_reduce_tied_grads(self) -> None:
        self.calls.append("tied")

    def _exec_reduce_grads(self) -> None:
        self.calls.append("data-parallel")


class _Dist:
    """``torch.distributed`` as the first-replica sum calls it: the reduce onto the first replica multiplies by
    the replicas' count (as if every replica held the same gradient) on that replica, and is recorded."""

    def __init__(self, engine: "_Engine") -> None:
        self.engine = engine

    def get_global_rank(self, group: str, rank: int) -> int:
        return 10 + rank

    def get_rank(self) -> int:
        return 10 + self.engine.grid.data_parallel_id

    def reduce(self, tensor, dst, group, async_op):
        assert tensor.dtype == torch.float32 and dst == 10 and group == "dp" and async_op
        self.engine.calls.append("reduce")
        if self.engine.grid.data_parallel_id == 0:
            tensor.mul_(self.engine.grid.data_parallel_size)
        return "work"


class _Engine(GradReduction, _DeepSpeed):
    sharded = sequence = _vocab = freezer = None

    stage_id, optimizer = 0, object()

    def __init__(self, *, zero: int, bf16: bool, shard_params: bool = False, one_replica: bool = False,
                 replicas: int = 2, tied: int = 0, fp16: bool = False, replica: int = 0, frozen: bool = False) -> None:
        self.calls: list[str] = []
        self.grid = SimpleNamespace(data_parallel_size=replicas, data_parallel_id=replica,
                                    get_data_parallel_group=lambda: "dp")
        # one key held by this rank and another (``tied``), one held by this rank alone: DeepSpeed lists both
        self.weights = {"embed": torch.nn.Linear(2, 3, bias=False), "alone": torch.nn.Linear(2, 2, bias=False)}
        for weight in self.weights.values():
            weight.weight.grad = torch.ones_like(weight.weight)
        self.weights["embed"].weight.requires_grad_(not frozen)
        self._tied = {"embed": {"ranks": [0, 1], "weight_attr": ["weight"], "module": self.weights["embed"]}} \
            if tied else {}
        self._tied["alone"] = {"ranks": [0], "weight_attr": ["weight"], "module": self.weights["alone"]}
        self.terapipe = SimpleNamespace(shard_params=shard_params)
        self.using_bf16_optimizer = bf16
        self._zero, self._fp16 = zero, fp16
        self._stashes, self._weight_grads = {}, []
        self._one_replica = one_replica
        self.grad_sink = SimpleNamespace(buffer=lambda p: p.grad)
        self.p2p = SimpleNamespace(wait=lambda work, what, group: None)
        self._tied_order = self._tied_order_by_config()

    def zero_optimization_stage(self) -> int:
        return self._zero

    def fp16_enabled(self) -> bool:
        return self._fp16

    def _dp_reduce_is_identity(self) -> bool:
        return self._one_replica

    @property
    def module(self) -> SimpleNamespace:
        return SimpleNamespace(tied_comms=self._tied, tied_modules=self.weights, get_tied_weights_and_groups=lambda: [])

    def tail(self) -> list[str]:
        self._exec_reduce_tied_grads()
        self._exec_reduce_grads()
        return self.calls


@pytest.mark.parametrize("zero, bf16, order", [
    (0, False, ["data-parallel", "tied"]),    # fp32/fp16 at ZeRO 0: the fallback all-reduces whole gradients
    (0, True, ["data-parallel", "tied"]),     # BF16_Optimizer at ZeRO 0 ...
    (1, True, ["data-parallel", "tied"]),     # ... and at ZeRO 1: it all-reduces its whole fp32 gradients
    (1, False, ["tied", "data-parallel"]),    # ZeRO 1's optimizer, 2 replicas: DeepSpeed's order (a + b = b + a)
], ids=["zero0", "bf16-zero0", "bf16-zero1", "zero1"])
def test_tied_sum_runs_after_the_data_parallel_reduction_where_replicas_keep_whole_gradients(zero, bf16, order):
    assert _Engine(zero=zero, bf16=bf16, tied=1).tail() == order


def test_tied_sum_runs_with_one_replica_too():
    """No data-parallel reduction to run (an identity with one replica): the tied weights are still summed."""
    assert _Engine(zero=0, bf16=False, one_replica=True).tail() == ["tied"]


@pytest.mark.parametrize("replica", [0, 1, 2])
def test_zero1_sums_the_tied_copies_onto_the_first_replica(replica, monkeypatch):
    """ZeRO 1's own optimizer with 3 replicas: the copies' gradients reduced onto the first replica in fp32, the tied
    sum there alone, zeros elsewhere, all before DeepSpeed's average (which then adds a sum to zeros, exactly); the
    key one rank holds alone is left to DeepSpeed."""
    engine = _Engine(zero=1, bf16=False, replicas=3, tied=1, replica=replica)
    monkeypatch.setattr(grad_reduction, "dist", _Dist(engine))
    assert engine._tied_order == "first replica"
    order = engine.tail()
    assert order == (["reduce", "tied", "data-parallel"] if replica == 0 else ["reduce", "data-parallel"]), order
    assert engine.weights["embed"].weight.grad.eq(3.0 if replica == 0 else 0.0).all()
    assert engine.weights["alone"].weight.grad.eq(1.0).all()


@pytest.mark.parametrize("replica", [0, 1])
def test_a_frozen_copy_keeps_the_order_its_tied_group_takes(replica, monkeypatch):
    """The order is decided by structure: a copy frozen before the engine was built still takes the first-replica
    order (its tied group's other ranks take it too, and the first replica's tied sum waits for theirs); it is left
    out of the reduce, which then has nothing to send."""
    engine = _Engine(zero=1, bf16=False, replicas=3, tied=1, replica=replica, frozen=True)
    monkeypatch.setattr(grad_reduction, "dist", _Dist(engine))
    assert engine._tied_order == "first replica"
    assert engine.tail() == (["tied", "data-parallel"] if replica == 0 else ["data-parallel"])
    assert engine.weights["embed"].weight.grad.eq(1.0).all()


@pytest.mark.parametrize("replicas, tied, fp16, order", [
    (3, 1, False, "first replica"), (2, 1, False, "before"), (4, 0, False, "before"), (4, 1, True, "before")])
def test_zero1_first_replica_only_where_copies_would_drift(replicas, tied, fp16, order, monkeypatch):
    """3 or more replicas and a tied key on more than one rank (a key one rank holds alone has no copy); fp16
    keeps DeepSpeed's order (the undivided sum could overflow where the average would not)."""
    assert _Engine(zero=1, bf16=False, replicas=replicas, tied=tied, fp16=fp16)._tied_order == order


@pytest.mark.parametrize("replicas, zero, tied, fp16, warned", [
    (3, 1, 1, True, True), (2, 1, 1, True, False), (4, 0, 1, True, False), (4, 1, 0, True, False),
    (3, 1, 1, False, False)])
def test_a_tied_copy_left_to_drift_is_warned_about(replicas, zero, tied, fp16, warned, caplog):
    """fp16 at ZeRO 1 with 3 or more replicas keeps DeepSpeed's order, where the copies may drift: said once, at init,
    with the settings that keep them equal. A tied key one rank holds alone has no copy to drift from."""
    with caplog.at_level(logging.WARNING, logger="ds_terapipe.runtime.execution.engine"):
        _Engine(zero=zero, bf16=False, replicas=replicas, tied=tied, fp16=fp16)
    text = " ".join(r.getMessage() for r in caplog.records)
    assert ("drift apart" in text and "bf16, fp32 or ZeRO 0" in text) == warned, text
    assert "'alone'" not in text
