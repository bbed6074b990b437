"""fp16 without ZeRO: the optimizer step DeepSpeed takes while it builds the optimizer, undone.

DeepSpeed 0.19.8's fp16 optimizers at ZeRO stage 0 (``FP16_Optimizer``, ``FP16_UnfusedOptimizer``) call the
wrapped optimizer's ``step()`` once in their constructor, with zero gradients on the fp32 master copies, to create
its state. A step on zero gradients is not nothing: SGD's weight decay moves the masters and seeds the momentum
with the decay; Adam counts the step, so every later update takes the bias correction of one step further on
(the first real Adam step moves the weights about 0.74 of what torch's Adam moves them); AdamW decays the masters
once. The run then departs from the same model trained in fp32 or bf16 (measured: SGD with momentum 0.9 and weight
decay 0.01, 4 steps, the masters' change 0.32 off torch's, relative). ZeRO 1 and the bf16 optimizer take no such
step.

:func:`undo_construction_step` puts things back as they were before that step: the masters are copied again from
the fp16 weights (the step left those alone, and the masters began as their exact copies), and the state the step
created for the masters is dropped, so the optimizer creates it on the first real step, as torch's does.
Everything the wrapped optimizer held before DeepSpeed wrapped it is keyed by the model's own parameters, not by
the masters, and is left alone.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["undo_construction_step"]

logger = logging.getLogger(__name__)


def undo_construction_step(optimizer: Any) -> bool:
    """Undo the zero-gradient step an fp16 ZeRO-0 optimizer took at construction; False (nothing done) for any
    other optimizer. Call it right after the engine is built, before any step or checkpoint load."""
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    if not isinstance(optimizer, (FP16_Optimizer, FP16_UnfusedOptimizer)):
        return False
    optimizer.refresh_fp32_params()   # masters <- fp16 weights, exact: the masters were made as their copies
    inner = optimizer.optimizer
    dropped = 0
    for group in inner.param_groups:
        for master in group["params"]:
            dropped += inner.state.pop(master, None) is not None
    logger.debug("terapipe: undid the fp16 optimizer's construction step (%d master state(s) dropped)", dropped)
    return True
