"""The slice check at engine init: refuse a model that would train wrong when its sequences are cut into slices.

Slicing is exact only for layers that are causal and read the slice context (token offset, KV prefix). A layer
that mixes tokens non-causally, or attends over its slice alone, runs without error and gives wrong gradients.
So before the first step every rank runs, collectively:

1. Probe pass: stage 0 samples an input (``TokenPipelineModule.sample_input``), every stage runs its layers on
   what it receives, unsliced, and passes the result on; each stage now holds a realistic input.
2. Check: each stage runs its layers one by one on that input both unsliced and cut into slices through the
   slice context. The first layer whose sliced output differs is named, and every rank refuses with
   :class:`SlicingMismatchError` (one rank's verdict, agreed by all, so no rank waits for a peer that gave up).

The probe input is kept: profiling (:mod:`ds_terapipe.runtime.profile`) times the stage on it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from .context import MicroBatchState, SliceContext, cut_tokens, slice_scope
from .p2p import agree_or_raise, as_tuple

if TYPE_CHECKING:  # pragma: no cover - annotations only
    from .engine import TokenPipelineEngine

__all__ = ["SlicingMismatchError", "check_slicing_equivalence", "check_stage_slicing", "probe_pass"]

logger = logging.getLogger(__name__)

# Fixed so that every run (and every rank of one run) probes with the same sample.
_PROBE_SEED = 20210701


class SlicingMismatchError(ValueError):
    """A layer gives different results when the sequence is cut into slices."""


def _concat_like(parts: list[Any], full: Any, seq_len: int) -> Any:
    """Reassemble per-slice outputs along dim 1 wherever the unsliced output has the sequence on dim 1."""
    if torch.is_tensor(full):
        if full.dim() >= 2 and full.shape[1] == seq_len:
            return torch.cat(parts, dim=1)
        return parts[-1]
    return tuple(_concat_like([p[i] for p in parts], f, seq_len) for i, f in enumerate(full))


def _max_rel_diff(a: Any, b: Any) -> float:
    worst = 0.0
    for x, y in zip(as_tuple(a), as_tuple(b)):
        if x.shape != y.shape:
            return float("inf")
        if not x.is_floating_point():
            worst = max(worst, 0.0 if torch.equal(x, y) else float("inf"))
            continue
        scale = float(y.abs().max()) + 1e-6
        worst = max(worst, float((x.float() - y.float()).abs().max()) / scale)
    return worst


def _probe_cuts(seq_len: int, granularity: int, slices: Optional[Sequence[int]]) -> list[int]:
    """The slicing used for the check: the plan's if known, else three unequal slices on the granularity."""
    if slices is not None and len(slices) > 1:
        return list(slices)
    units = seq_len // granularity
    if units < 2:
        return [seq_len]
    first = max(1, units // 4)
    second = max(1, (units - first) // 2) if units - first > 1 else 0
    cuts = [first, second, units - first - second] if second else [first, units - first]
    return [c * granularity for c in cuts if c > 0]


def probe_pass(engine: "TokenPipelineEngine", seq_len: int) -> Any:
    """Run one unsliced forward through the pipeline on a sampled input; return this stage's input
    (collective over the stages of a pipeline)."""
    module = engine.module
    gen = torch.Generator().manual_seed(_PROBE_SEED)
    was_training = module.training
    module.eval()
    try:
        if engine.is_first_stage():
            sample = module.sample_input(engine.micro_batch_size, seq_len, gen)
            stage_input = tuple(t.to(engine.device) for t in sample) if isinstance(sample, tuple) else \
                sample.to(engine.device)
        else:
            received = engine._p2p.recv(engine.prev_stage, "probe activations")
            stage_input = received[0] if len(received) == 1 else received
        with torch.no_grad(), slice_scope(None):
            output = module(stage_input)
        if not engine.is_last_stage():
            engine._p2p.send(as_tuple(output), engine.next_stage, "probe activations", header=True)
            engine._p2p.drain()
    finally:
        module.train(was_training)
    return stage_input


def check_slicing_equivalence(layers: list[Callable], first_layer_idx: int, stage_input: Any,
                              slices: list[int]) -> Optional[str]:
    """Run ``layers`` unsliced and sliced; return a description of the first layer that differs, or None."""
    seq_len = sum(slices)
    bounds, start = [], 0
    for length in slices:
        bounds.append((start, start + length))
        start += length
    x = stage_input
    with torch.no_grad():
        for idx, layer in enumerate(layers):
            with slice_scope(None):
                full = layer(x)
            state = MicroBatchState(0, seq_len, len(slices))
            parts = []
            for i, (lo, hi) in enumerate(bounds):
                with slice_scope(SliceContext(0, i, lo, hi, state)):
                    parts.append(layer(cut_tokens(x, lo, hi, seq_len)))
            sliced = _concat_like(parts, full, seq_len)
            dtype = as_tuple(full)[0].dtype
            tolerance = 1e-3 if dtype in (torch.float32, torch.float64) else 5e-2
            diff = _max_rel_diff(sliced, full)
            if diff > tolerance:
                name = getattr(layer, "__name__", None) or type(layer).__name__
                return (f"layer {first_layer_idx + idx} ({name}) gives different outputs when the sequence is cut "
                        f"into slices {slices} (max relative difference {diff:.2e}): it mixes tokens non-causally or "
                        "does not read the slice context. Use ds_terapipe.sliced_causal_attention for attention "
                        "(and ds_terapipe.token_offset for positions), or run with terapipe.slices=1")
            x = full
    return None


def check_stage_slicing(engine: "TokenPipelineEngine", seq_len: int,
                        slices: Optional[tuple[int, ...]]) -> Optional[Any]:
    """Probe and check this stage for ``slices`` (None: not planned yet); return the probe input, if any.

    Collective over all ranks. Every rank raises :class:`SlicingMismatchError` if any stage fails the check.
    Without an input sampler nothing can be probed: the check is skipped with a warning.
    """
    module = engine.module
    can_sample = hasattr(module, "has_sampler") and module.has_sampler()
    if can_sample and (slices is None or len(slices) > 1):
        stage_input = probe_pass(engine, seq_len)
        cuts = _probe_cuts(seq_len, engine.terapipe.granularity, slices)
        problem = None
        if len(cuts) > 1:
            problem = check_slicing_equivalence(list(module.forward_funcs), module._local_start, stage_input, cuts)
            if problem:
                problem = f"terapipe: stage {engine.stage_id}: {problem}"
        agree_or_raise(problem, SlicingMismatchError)
        return stage_input
    if slices is not None and len(slices) > 1 and engine.global_rank == 0:
        logger.warning("terapipe: %s has no input sampler, so the slice check (refusing layers that mix tokens "
                       "non-causally) was skipped; use ds_terapipe.TokenPipelineModule(..., vocab_size=V)",
                       type(module).__name__)
    return None
