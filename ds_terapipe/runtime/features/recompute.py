"""Activation checkpointing with token slices: a slice's forward is recomputed in its backward, in its context.

DeepSpeed's ``PipelineModule.forward`` cuts a stage's layers into segments of ``activation_checkpoint_interval``
layers and runs each through ``module.activation_checkpoint_func(run_segment, *inputs)``. Only the segment's
inputs stay alive; its forward runs again in the backward to rebuild what the backward needs. Sliced, that
recompute must see what the original forward saw: the slice's token offset and its micro-batch's KV buffers,
through the same attention-call numbering (``SliceContext.kv_calls``, the occurrence part of each buffer's key).
But the backward runs outside any slice context. :func:`sliced_checkpoint` therefore remembers, when a segment
runs forward, the slice context and its attention-call counts at the segment's start, and re-opens a copy of
that context around the recompute.

Which checkpoint: torch's non-reentrant ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``.
It runs the segment's forward once with autograd on, keeps the graph but drops the tensors it saved, and in the
backward reruns the forward only to regenerate those tensors; the *original* graph's backward nodes then run,
each once. So the attention's cache-gradient node of the original forward adds the gradient of earlier slices'
keys/values to the KV-gradient buffer exactly once, and a deferred Linear records its (input, output gradient)
pair once; the recompute's own nodes are discarded unexecuted. The recompute checks each regenerated tensor's
shape and dtype against the original, so a recompute that ran outside the slice context (keys of T rows instead
of the prefix's ``end``) fails loudly instead of differentiating something else. DeepSpeed's default, the
reentrant ``deepspeed.checkpointing.checkpoint``, runs the forward without autograd and backwards the recomputed
graph instead; it gives no gradient to a segment whose inputs need none (token ids into an embedding: DeepSpeed
works around this for its own GPT classes only) and does not support ``torch.autograd.grad`` (which the
profiler uses). The token pipeline therefore runs segments through torch's non-reentrant checkpoint whichever
of DeepSpeed's two functions the module names; any other ``activation_checkpoint_func`` is refused.

The KV cache under recompute: the original forward wrote the slice's key/value rows ``[start, end)``; the
recompute writes the same rows again with the values it recomputed (the same operations on the same inputs:
bit for bit equal with deterministic kernels). Nothing else reads those rows afterwards: every later slice of
the micro-batch already ran its backward (later slices go first), and earlier slices read only rows before
``start``. Earlier slices' rows, still intact, are read as in the forward.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from ...config import TeraPipeConfig
from ...planner.registry import get_schedule
from ...planner.slicing import MemoryModel
from ..slicing.context import current_slice, slice_scope

__all__ = ["sliced_checkpoint", "install_sliced_checkpointing", "planned_activation_factor"]

logger = logging.getLogger(__name__)


def sliced_checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` checkpointed (non-reentrant); its recompute runs in the slice context of its forward.

    The signature of DeepSpeed's ``activation_checkpoint_func``. Outside a slice context (stock forward,
    inference) it is the plain non-reentrant checkpoint.
    """
    ctx = current_slice()
    if ctx is None:
        return torch_checkpoint(function, *args, use_reentrant=False)
    calls_at_start = dict(ctx.kv_calls)  # the segment's first attention call is occurrence calls_at_start[key]

    def run(*inputs: Any) -> Any:
        if current_slice() is ctx:  # the forward itself
            return function(*inputs)
        with slice_scope(dataclasses.replace(ctx, kv_calls=dict(calls_at_start))):  # the recompute
            return function(*inputs)

    return torch_checkpoint(run, *args, use_reentrant=False)


def _weights_wait_for_microbatch(cfg: TeraPipeConfig) -> bool:
    """Deferred weight gradients with one W per micro-batch (gpipe's default): every slice's recorded Linear
    inputs and output gradients stay alive until the micro-batch's last backward, recomputed or not."""
    return bool(cfg.deferred_weight_grads) and not get_schedule(cfg.schedule).weights_per_slice


def planned_activation_factor(interval: int, cfg: TeraPipeConfig) -> float:
    """``MemoryModel.activation_factor`` for the planner's memory cap: recomputed activations (2 / interval)
    where checkpointing frees them, the default otherwise. With weight gradients deferred per micro-batch the
    recorded pairs keep about as much alive as no checkpointing (measured: more, benchmarks/checkpoint_memory.py)."""
    if interval > 0 and _weights_wait_for_microbatch(cfg):
        interval = 0
    return MemoryModel.factor_for_checkpoint_interval(interval)


def install_sliced_checkpointing(module: torch.nn.Module, cfg: TeraPipeConfig | None = None) -> bool:
    """Make ``module`` (a DeepSpeed ``PipelineModule``) checkpoint through :func:`sliced_checkpoint`.

    Returns whether activation checkpointing is on (``activation_checkpoint_interval > 0``). Raises
    ``ValueError`` for an ``activation_checkpoint_func`` other than DeepSpeed's own two, whose recompute this
    module cannot place in the slice context. With ``cfg`` deferring weight gradients per micro-batch it warns:
    the recorded pairs would hold what recomputation frees.
    """
    interval = getattr(module, "activation_checkpoint_interval", 0)
    if interval <= 0:
        return False
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing
    func = module.activation_checkpoint_func
    known = (ds_checkpointing.checkpoint, ds_checkpointing.non_reentrant_checkpoint, sliced_checkpoint)
    if func not in known:
        raise ValueError(f"terapipe: activation_checkpoint_func={getattr(func, '__qualname__', func)!r} is not "
                         "supported by the token pipeline, which must recompute each slice in its slice context; "
                         "leave activation_checkpoint_func at DeepSpeed's default (the token pipeline then "
                         "recomputes through torch's non-reentrant checkpoint)")
    module.activation_checkpoint_func = sliced_checkpoint
    if cfg is not None and _weights_wait_for_microbatch(cfg):
        logger.warning("terapipe: activation checkpointing with deferred weight gradients once per micro-batch "
                       "(schedule %s): every slice's recomputed Linear inputs and output gradients stay alive "
                       "until the W pass, about as much memory as without checkpointing; set "
                       "terapipe.deferred_weight_grads=false or use schedule 1f1b", cfg.schedule)
    logger.info("terapipe: activation checkpointing every %d layer(s), recomputed per slice (non-reentrant)",
                interval)
    return True
