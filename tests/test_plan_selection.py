"""Tier a: the engine's plan selection (runtime/execution/plan_selection.py) refuses what it cannot run on every
rank together, in one process."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ds_terapipe.runtime.execution.plan_selection import PlanSelection


@pytest.mark.parametrize("last_stage", [True, False])
def test_a_module_without_a_loss_fn_is_refused_on_every_stage_as_one_verdict(last_stage: bool) -> None:
    # only the last stage calls the loss function, but a refusal there alone would leave the other stages in the
    # collectives after init: every rank checks the module's loss_fn (the same constructor argument everywhere)
    engine = SimpleNamespace(num_slices=2, module=SimpleNamespace(loss_fn=None), is_last_stage=lambda: last_stage)
    with pytest.raises(ValueError, match="needs a loss_fn with more than one slice") as refused:
        PlanSelection._check_model_supports_slicing(engine)
    assert getattr(refused.value, "terapipe_collective", False), "every rank raises it: it must not set the flag"
    PlanSelection._check_model_supports_slicing(SimpleNamespace(num_slices=1, module=engine.module))  # unsliced: ok
