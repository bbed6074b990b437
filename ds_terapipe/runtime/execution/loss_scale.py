"""fp16 dynamic loss scaling: the gradients are divided by the scale they were multiplied by.

DeepSpeed 0.19.8's fp16 optimizers (``FP16_Optimizer``, ``FP16_UnfusedOptimizer`` at ZeRO stage 0, and
``DeepSpeedZeroOptimizer`` at stage 1) move the dynamic loss scale in ``step`` *before* they divide the gradients
by it. On a step where the scale grows (every ``loss_scale_window`` steps without an overflow) the gradients,
computed at scale ``s``, are divided by ``2 s``: that step moves the weights half as far as it should (measured on
``FP16_UnfusedOptimizer`` with SGD: 0.5 instead of 1.0 on every growth step). :func:`scale_moved_after_step` holds
the optimizer's scale update back until its step has divided the gradients, then applies it: the next step's
backward uses the new scale, as before, and this step's gradients are divided by the scale of their backward.

``FP16_UnfusedOptimizer`` also reports the norm of the scaled gradients as its step's gradient norm (DeepSpeed's
own pipeline never scaled the loss there, so its figure looked right): :func:`reports_scaled_norm` tells the
engine to divide it by the scale of the backward, as the other optimizers do.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

__all__ = ["reports_scaled_norm", "scale_moved_after_step"]


@contextmanager
def scale_moved_after_step(optimizer: Any) -> Iterator[None]:
    """Within the block, ``optimizer._update_scale`` calls are recorded instead of run; they run, in order, when
    the block ends (also when it raises). An optimizer without a loss scale (no ``_update_scale``) is left alone."""
    update = getattr(optimizer, "_update_scale", None)
    if update is None:
        yield
        return
    own = "_update_scale" in vars(optimizer)   # an instance attribute of its own: put back, not deleted
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    optimizer._update_scale = lambda *args, **kwargs: calls.append((args, kwargs))
    try:
        yield
    finally:
        if own:
            optimizer._update_scale = update
        else:
            del optimizer._update_scale
        for args, kwargs in calls:
            update(*args, **kwargs)


def reports_scaled_norm(optimizer: Any) -> bool:
    """Whether ``optimizer``'s ``_global_grad_norm`` after a step is that of the scaled gradients."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    return isinstance(optimizer, FP16_UnfusedOptimizer)
