"""What a training step costs besides the slices' forward and backward: the whole-step part of the cost model.

A step is more than its pipeline schedule. After the last action every rank meets the others (the engine's
end-of-schedule barrier), the first and last stage all-reduce the tied embedding/head gradient, every rank
reduces its gradients over the data-parallel replicas and steps its optimizer, and the last stage broadcasts
the loss, which meets every rank once more. Left out, a plan's predicted time misses all of that
(20% below the trainer's measured step), and a planner choosing between plans of different slice counts also
misses that every action carries a fixed cost of its own (dispatch, slice buffers, the per-slice loss).

:class:`StepCost` holds those terms, measured at engine init (``runtime/planning/profile.py``):

* ``action_ms``: a fixed cost per F / B / W action, per cost stage (chunk), added to the stage's fitted times
  by the simulator and the planner's tables, so more slices cost more;
* ``optimizer_ms``, ``grad_reduce_ms``: per rank, the optimizer step (with gradient clipping) and the
  data-parallel gradient reduction;
* ``tied_reduce_ms`` on ``tied_ranks``: the tied-weight all-reduce;
* ``sync_ms``: per step, once: the barriers and the loss broadcast that every rank waits in.

Because the end-of-schedule barrier lines every rank up, the step is ``makespan + sync_ms + max over ranks of
(tied + grad reduce + optimizer)`` (:meth:`StepCost.tail_ms`). The point-to-point latency per transfer is the
stage's ``comm.latency_ms`` (``cost.py``), which the profiler now measures too.

In the cost file this is the optional top-level ``"step"`` object (``docs/cost_format.md``); a file without it
predicts exactly as before. Pure Python and numpy, like the rest of the planner.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

from ._checks import check_int, check_number

__all__ = ["StepCost"]

PerStage = Union[float, Sequence[float]]

_STEP_KEYS = ("action_ms", "optimizer_ms", "grad_reduce_ms", "tied_reduce_ms", "tied_ranks", "sync_ms")
_ACTION_KEYS = ("forward", "backward", "weight")


def _numbers(value: Any, where: str) -> tuple[float, ...]:
    """A number or a list of numbers, each finite and >= 0."""
    fix = "write a finite JSON number >= 0, or a list of them (one per stage)"
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"{where} = [] must hold at least one number; {fix}")
        return tuple(check_number(v, f"{where}[{i}]", fix=fix) for i, v in enumerate(value))
    return (check_number(value, where, fix=fix),)


def _pick(values: tuple[float, ...], index: int, count: int, where: str) -> float:
    """``values[index]``; a single value applies to every stage."""
    if len(values) == 1:
        return values[0]
    if len(values) != count:
        raise ValueError(f"{where} has {len(values)} entries but the pipeline has {count}; give one per "
                         "stage (chunks for action_ms, ranks for the rest) or a single number")
    return values[index]


@dataclass(frozen=True)
class StepCost:
    """The whole-step terms of a cost model (milliseconds); see the module docstring.

    Every per-stage field is a tuple with one entry per stage, or a single entry that applies to all.
    ``action_ms`` entries are per cost stage (chunk); ``optimizer_ms`` and ``grad_reduce_ms`` per rank.
    """

    forward_ms: tuple[float, ...] = (0.0,)
    backward_ms: tuple[float, ...] = (0.0,)
    weight_ms: tuple[float, ...] = (0.0,)
    optimizer_ms: tuple[float, ...] = (0.0,)
    grad_reduce_ms: tuple[float, ...] = (0.0,)
    tied_reduce_ms: float = 0.0
    tied_ranks: tuple[int, ...] = ()
    sync_ms: float = 0.0

    def __post_init__(self) -> None:
        for name in ("forward_ms", "backward_ms", "weight_ms", "optimizer_ms", "grad_reduce_ms"):
            object.__setattr__(self, name, _numbers(list(getattr(self, name)), f"step.{name}"))
        for name in ("tied_reduce_ms", "sync_ms"):
            object.__setattr__(self, name, check_number(getattr(self, name), f"step.{name}",
                                                         fix="write a finite JSON number >= 0"))
        object.__setattr__(self, "tied_ranks", tuple(
            check_int(r, f"step.tied_ranks[{i}]", minimum=0, wrong_type=ValueError)
            for i, r in enumerate(self.tied_ranks)))

    # -- per action -----------------------------------------------------------------------------------------------
    def action_ms(self, kind: str, stage: int, num_stages: int) -> float:
        """The fixed cost of one ``kind`` ("forward", "backward", "weight") action on cost stage ``stage``."""
        values = {"forward": self.forward_ms, "backward": self.backward_ms, "weight": self.weight_ms}[kind]
        return _pick(values, stage, num_stages, f"step.action_ms.{kind}")

    # -- after the schedule ---------------------------------------------------------------------------------------
    def rank_tail_ms(self, rank: int, num_ranks: int) -> float:
        """What rank ``rank`` does after the end-of-schedule barrier: tied reduce, gradient reduce, optimizer."""
        tied = self.tied_reduce_ms if rank in self.tied_ranks else 0.0
        return (tied + _pick(self.grad_reduce_ms, rank, num_ranks, "step.grad_reduce_ms")
                + _pick(self.optimizer_ms, rank, num_ranks, "step.optimizer_ms"))

    def tail_ms(self, num_ranks: int) -> float:
        """Step time after the schedule's makespan: ``sync_ms`` plus the slowest rank's tail."""
        num_ranks = check_int(num_ranks, "num_ranks", minimum=1, wrong_type=ValueError)
        return self.sync_ms + max(self.rank_tail_ms(r, num_ranks) for r in range(num_ranks))

    # -- the cost file --------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The ``"step"`` object of the cost file; ``StepCost.from_dict(x.to_dict()) == x``."""
        def out(values: tuple[float, ...]) -> Any:
            return values[0] if len(values) == 1 else list(values)

        return {"action_ms": {"forward": out(self.forward_ms), "backward": out(self.backward_ms),
                              "weight": out(self.weight_ms)},
                "optimizer_ms": out(self.optimizer_ms), "grad_reduce_ms": out(self.grad_reduce_ms),
                "tied_reduce_ms": self.tied_reduce_ms, "tied_ranks": list(self.tied_ranks), "sync_ms": self.sync_ms}

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any], where: str = "cost.step") -> StepCost:
        """Parse the cost file's ``"step"`` object; every key is optional (absent: 0)."""
        if not isinstance(obj, Mapping):
            raise TypeError(f"{where} must be a JSON object (dict), got {type(obj).__name__}; see "
                            "docs/cost_format.md")
        for key in obj:
            if key not in _STEP_KEYS:
                raise ValueError(f"{where} has unknown key {key!r}; valid keys: {', '.join(_STEP_KEYS)}")
        actions = obj.get("action_ms", {})
        if not isinstance(actions, Mapping):
            raise TypeError(f"{where}.action_ms must be a JSON object with keys {', '.join(_ACTION_KEYS)}, got "
                            f"{type(actions).__name__}")
        for key in actions:
            if key not in _ACTION_KEYS:
                raise ValueError(f"{where}.action_ms has unknown key {key!r}; valid keys: {', '.join(_ACTION_KEYS)}")
        ranks = obj.get("tied_ranks", [])
        if not isinstance(ranks, (list, tuple)):
            raise ValueError(f"{where}.tied_ranks = {ranks!r:.60} must be a list of ranks (e.g. [0, 1])")
        try:
            return cls(forward_ms=_numbers(actions.get("forward", 0.0), f"{where}.action_ms.forward"),
                       backward_ms=_numbers(actions.get("backward", 0.0), f"{where}.action_ms.backward"),
                       weight_ms=_numbers(actions.get("weight", 0.0), f"{where}.action_ms.weight"),
                       optimizer_ms=_numbers(obj.get("optimizer_ms", 0.0), f"{where}.optimizer_ms"),
                       grad_reduce_ms=_numbers(obj.get("grad_reduce_ms", 0.0), f"{where}.grad_reduce_ms"),
                       tied_reduce_ms=obj.get("tied_reduce_ms", 0.0), tied_ranks=tuple(ranks),
                       sync_ms=obj.get("sync_ms", 0.0))
        except ValueError as err:
            msg = str(err)
            raise ValueError(msg if msg.startswith(where) else msg.replace("step.", f"{where}.", 1)) from None

    def check_sizes(self, num_chunks: int, num_ranks: int) -> None:
        """Raise ValueError when a per-stage list does not fit a pipeline of these sizes."""
        for kind in _ACTION_KEYS:
            self.action_ms(kind, 0, num_chunks)
        self.tail_ms(num_ranks)
        bad = [r for r in self.tied_ranks if r >= num_ranks]
        if bad:
            raise ValueError(f"step.tied_ranks = {list(self.tied_ranks)} names rank(s) {bad} of a {num_ranks}-rank "
                             "pipeline; list ranks below the pipeline depth")
