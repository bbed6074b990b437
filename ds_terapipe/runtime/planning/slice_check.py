"""The slice check at engine init: refuse a model that would train wrong when its sequences are cut into slices.

Slicing is exact only for layers that are causal and read the slice context (token offset, KV prefix). A layer
that mixes tokens non-causally, or attends over its slice alone, runs without error and gives wrong gradients.
So before the first step every rank runs, collectively:

1. Probe pass: stage 0 samples an input (``TokenPipelineModule.sample_input``), every stage runs its layers on
   what it receives, unsliced, and passes the result on; each stage now holds a realistic input.
2. Check: each stage runs its layers one by one on that input both unsliced and cut into slices through the
   slice context, forward and backward (one random upstream gradient; the sliced backward runs later slices
   first through the KV gradient buffers, as training does), and compares what training uses: outputs, input
   gradients and parameter gradients. Comparing outputs alone is not enough: a zero-initialised output
   projection makes a bidirectional or slice-blind attention's outputs identical, while its own gradient
   already differs. A layer with an all-zero weight matrix is checked once more with those weights set to
   random values (restored bit for bit). The first layer that differs is named, and every rank refuses with
   :class:`SlicingMismatchError` (one rank's verdict, agreed by all, so no rank waits for a peer that gave up).

The check judges the function a layer computes, not its rounding. In bf16 or fp16 the sliced and unsliced runs
add the same terms in another order (a bias gradient sums per slice, then over slices), and with bf16's 8
significant bits a gradient that is a sum with cancellation differs by tens of percent between the two orders
(the reference GPT's LayerNorm biases: up to 36%), more than a weak token mixer does: no tolerance in bf16
separates rounding from a real bug. So a layer whose parameters, buffers or input are bf16/fp16 is checked on
an fp32 copy (:func:`_fp32_twin`, one layer at a time; its input upcast, which is exact) with the fp32
tolerance, the same weights judged as strictly as an fp32 model. The layers themselves run in their own
precision to make the next layer's input, so each layer is checked on what it really receives.

The probe input is kept: profiling (:mod:`ds_terapipe.runtime.planning.profile`) times the stage on it.
"""

from __future__ import annotations

import copy
import logging
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from ..slicing.context import MicroBatchState, SliceContext, cut_tokens, slice_scope
from ..execution.p2p import as_tuple
from ..execution.collective import agree_or_raise
from ..execution.stage import PipelineStage


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


def probe_pass(engine: "PipelineStage", seq_len: int, first_input: Any = None) -> dict[int, Any]:
    """Run one unsliced forward through the pipeline on a sampled input (or, on the rank holding chunk 0,
    ``first_input``: a real batch's inputs); return each of this rank's chunks' input, by chunk id (collective over
    the ranks of a pipeline).

    Every rank walks the chunks in order and runs its own: a chunk's input comes from the previous chunk, over
    p2p from another rank or handed over on this one. The chain is ordered by chunk id, so no rank waits on a
    chunk that waits on it.
    """
    module = engine.module
    gen = torch.Generator().manual_seed(_PROBE_SEED)
    was_training = module.training
    module.eval()
    inputs: dict[int, Any] = {}
    handed: Any = None
    try:
        for chunk in engine.local_chunks:
            if chunk == 0:
                sample = first_input if first_input is not None else \
                    module.sample_input(engine.micro_batch_size, seq_len, gen)
                chunk_input = tuple(t.to(engine.device) if torch.is_tensor(t) else t for t in sample) \
                    if isinstance(sample, (tuple, list)) else sample.to(engine.device)
            elif engine.placement[chunk - 1] == engine.stage_id:
                chunk_input = handed
            else:
                received = engine.p2p.recv(engine.placement[chunk - 1], f"probe activations of chunk {chunk}")
                chunk_input = received[0] if len(received) == 1 else received
            inputs[chunk] = chunk_input
            with torch.no_grad(), slice_scope(None), engine.on_chunk(chunk):
                output = module(chunk_input)
            handed = None
            if chunk + 1 < engine.num_chunks:
                if engine.placement[chunk + 1] == engine.stage_id:
                    handed = output
                else:
                    engine.p2p.send(as_tuple(output), engine.placement[chunk + 1],
                                     f"probe activations of chunk {chunk + 1}", header=True)
        engine.p2p.drain()
    finally:
        module.train(was_training)
    return inputs


def _flat(value: Any) -> list[torch.Tensor]:
    """Every tensor in a (nested) tuple/list, in order."""
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _flat(v)]
    return []


def _as_leaves(value: Any) -> Any:
    """A copy of ``value`` whose floating tensors are fresh leaves that collect input gradients."""
    if torch.is_tensor(value):
        return value.detach().clone().requires_grad_(value.is_floating_point())
    if isinstance(value, (tuple, list)):
        return tuple(_as_leaves(v) for v in value)
    return value


def _own_copy(value: Any) -> Any:
    """A non-leaf copy of each floating tensor that needs a gradient (as a layer's input is in training, where
    in-place ops on it are allowed), in storage of its own (each slice's input is its own tensor)."""
    if torch.is_tensor(value):
        return value.clone() if value.requires_grad else value
    if isinstance(value, (tuple, list)):
        return tuple(_own_copy(v) for v in value)
    return value


def _owners(layer: Callable) -> list[torch.nn.Module]:
    """The modules whose state a layer computes with: the layer itself, or the modules a ``functools.partial``
    binds (a ``TiedLayerSpec`` with ``forward_fn``)."""
    if isinstance(layer, torch.nn.Module):
        return [layer]
    return [a for a in getattr(layer, "args", ()) if isinstance(a, torch.nn.Module)]


def _layer_params(layer: Callable) -> list[torch.nn.Parameter]:
    """The parameters a layer owns (those of :func:`_owners`, each once)."""
    seen: dict[int, torch.nn.Parameter] = {}
    for owner in _owners(layer):
        for p in owner.parameters():
            seen.setdefault(id(p), p)
    return list(seen.values())


_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _is_low_precision(t: Any) -> bool:
    return torch.is_tensor(t) and t.dtype in _LOW_PRECISION


def _runs_in_low_precision(layer: Callable, x: Any) -> bool:
    """Whether the layer's parameters, buffers or floating input are bf16/fp16."""
    if any(_is_low_precision(t) for t in _flat(x)):
        return True
    return any(_is_low_precision(t) for owner in _owners(layer) for t in (*owner.parameters(), *owner.buffers()))


def _upcast(value: Any) -> Any:
    """``value`` with its bf16/fp16 tensors in fp32 (exact: every bf16/fp16 value is an fp32 value)."""
    if _is_low_precision(value):
        return value.detach().float()
    if isinstance(value, (tuple, list)):
        return tuple(_upcast(v) for v in value)
    return value


def _fp32_twin(layer: Callable) -> Optional[tuple[Callable, dict[int, torch.Tensor]]]:
    """An fp32 copy of a layer (a module, or a ``functools.partial`` binding modules) and the map from
    ``id(original parameter)`` to its copy; None if the layer is neither, or cannot be copied.

    The copy is made straight in fp32: each parameter and buffer enters ``deepcopy``'s memo upcast, so no
    second low-precision copy of the layer is made, and the live layer (its values and storage, ``.grad``, the
    hooks DeepSpeed put on its parameters) is not touched. Other attributes are copied as they are. Memory: one
    layer's parameters in fp32, dropped once that layer is checked.
    """
    owners = _owners(layer)
    if not owners:
        return None
    memo: dict[int, Any] = {}
    for owner in owners:
        for p in owner.parameters():
            if id(p) not in memo:
                data = p.detach().float() if _is_low_precision(p) else p.detach().clone()
                memo[id(p)] = torch.nn.Parameter(data, requires_grad=p.requires_grad)
        for b in owner.buffers():
            memo.setdefault(id(b), b.detach().float() if _is_low_precision(b) else b.detach().clone())
    twin_of = {key: t for key, t in memo.items() if torch.is_tensor(t)}
    try:
        twin = copy.deepcopy(layer, memo)
    except Exception as err:  # noqa: BLE001 - any layer a user wrote; the caller falls back to its own precision
        logger.warning("terapipe: the slice check could not copy %s to fp32 (%s: %s), so it compares the layer in "
                       "its own precision, where rounding may look like a slicing difference; make the layer "
                       "deep-copyable to have it checked in fp32", _layer_name(layer), type(err).__name__, err)
        return None
    return twin, twin_of


def _judged(layer: Callable, x: Any, params: list[torch.nn.Parameter]) -> tuple[Callable, Any, list[torch.Tensor]]:
    """What the check runs for a layer, its input and the parameters whose gradients it compares: for a layer in
    bf16/fp16, its fp32 copy, the input upcast and the copy's parameters (same order); else the layer as it is."""
    if not _runs_in_low_precision(layer, x):
        return layer, x, params
    twin = _fp32_twin(layer)
    if twin is None:
        return layer, x, params
    copied, twin_of = twin
    return copied, _upcast(x), [twin_of[id(p)] for p in params]


def _layer_name(layer: Callable) -> str:
    return getattr(layer, "__name__", None) or type(layer).__name__


class _Run:
    """One pass of a layer (unsliced or sliced): outputs, input gradients, parameter gradients."""

    def __init__(self, outputs: Any, input_grads: list[Optional[torch.Tensor]],
                 param_grads: list[Optional[torch.Tensor]]) -> None:
        self.outputs, self.input_grads, self.param_grads = outputs, input_grads, param_grads


def _upstream(outputs: Any, seq_len: int, gen: torch.Generator) -> list[Optional[torch.Tensor]]:
    """A random upstream gradient for every output a backward reaches (floating, needing a gradient, with the
    sequence on dim 1); None for the others."""
    grads: list[Optional[torch.Tensor]] = []
    for t in _flat(outputs):
        if t.is_floating_point() and t.requires_grad and t.dim() >= 2 and t.shape[1] == seq_len:
            grads.append(torch.randn(t.shape, generator=gen).to(dtype=t.dtype, device=t.device))
        else:
            grads.append(None)
    return grads


def _backward(outputs: Any, upstream: list[Optional[torch.Tensor]], lo: int, hi: int,
              wrt: Sequence[torch.Tensor], into: list[Optional[torch.Tensor]]) -> None:
    """Add the gradients of ``wrt`` for tokens [lo, hi) of ``upstream`` into ``into``.

    ``torch.autograd.grad``, not ``backward``: nothing is accumulated into ``.grad``, so the hooks DeepSpeed put
    on the live parameters (ZeRO's gradient buckets, bf16 ``immediate_grad_update`` into the fp32 copies) never
    see the check's gradients."""
    pairs = [(t, g[:, lo:hi]) for t, g in zip(_flat(outputs), upstream) if g is not None]
    if not pairs or not wrt:
        return
    grads = torch.autograd.grad([t for t, _ in pairs], list(wrt), [g for _, g in pairs], allow_unused=True)
    for i, g in enumerate(grads):
        if g is not None:
            into[i] = g if into[i] is None else into[i] + g


def _needing_grad(leaves: Any) -> list[torch.Tensor]:
    return [t for t in _flat(leaves) if t.requires_grad]


def _run_unsliced(layer: Callable, x: Any, params: Sequence[torch.Tensor], seq_len: int,
                  gen: torch.Generator) -> tuple[_Run, list[Optional[torch.Tensor]]]:
    leaves = _as_leaves(x)
    with slice_scope(None):
        outputs = layer(_own_copy(leaves))
    upstream = _upstream(outputs, seq_len, gen)
    inputs = _needing_grad(leaves)
    grads: list[Optional[torch.Tensor]] = [None] * (len(inputs) + len(params))
    _backward(outputs, upstream, 0, seq_len, [*inputs, *params], grads)
    return _Run(_detach(outputs), grads[:len(inputs)], grads[len(inputs):]), upstream


def _run_sliced(layer: Callable, x: Any, params: Sequence[torch.Tensor], bounds: list[tuple[int, int]],
                upstream: list[Optional[torch.Tensor]]) -> _Run:
    """Slices forward in order, then backward later slices first, one graph each: as a stage trains (KV
    gradients of earlier slices travel through the KV gradient buffers)."""
    seq_len = bounds[-1][1]
    leaves = _as_leaves(x)
    state = MicroBatchState(0, seq_len, len(bounds))
    parts = []
    for i, (lo, hi) in enumerate(bounds):
        with slice_scope(SliceContext(0, i, lo, hi, state)):
            parts.append(layer(_own_copy(cut_tokens(leaves, lo, hi, seq_len))))
    inputs = _needing_grad(leaves)
    grads: list[Optional[torch.Tensor]] = [None] * (len(inputs) + len(params))
    for (lo, hi), part in zip(reversed(bounds), reversed(parts)):
        _backward(part, upstream, lo, hi, [*inputs, *params], grads)
    # per-slice outputs; _compare joins them along the unsliced output's sequence dims
    return _Run([_detach(p) for p in parts], grads[:len(inputs)], grads[len(inputs):])


def _detach(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.detach()
    if isinstance(value, (tuple, list)):
        return tuple(_detach(v) for v in value)
    return value


def _grad_diff(got: Optional[torch.Tensor], ref: Optional[torch.Tensor], floor: float) -> float:
    """Max absolute difference relative to the reference's largest entry, with a floor (a fraction of the
    layer's largest gradient) so that gradients that are zero up to rounding are not compared digit by digit."""
    if got is None and ref is None:
        return 0.0
    if got is None or ref is None:
        only = got if ref is None else ref
        assert only is not None
        return float(only.abs().max()) / max(floor, 1e-30) if only.numel() else 0.0
    if got.shape != ref.shape:
        return float("inf")
    if not got.numel():
        return 0.0
    scale = max(float(ref.abs().max()), floor, 1e-30)
    return float((got.float() - ref.float()).abs().max()) / scale


def _compare(sliced: _Run, full: _Run, seq_len: int, param_names: Sequence[str]) -> tuple[float, str]:
    """The worst relative difference between two runs and what it is in (outputs, input or parameter grads)."""
    worst, what = _max_rel_diff(_concat_like(sliced.outputs, full.outputs, seq_len), full.outputs), "outputs"
    ref_grads = [g for g in [*full.input_grads, *full.param_grads] if g is not None and g.numel()]
    floor = 1e-2 * max((float(g.abs().max()) for g in ref_grads), default=0.0)
    for i, (got, ref) in enumerate(zip(sliced.input_grads, full.input_grads)):
        diff = _grad_diff(got, ref, floor)
        if diff > worst:
            worst, what = diff, "input gradients" if len(full.input_grads) == 1 else f"gradients of input {i}"
    for name, got, ref in zip(param_names, sliced.param_grads, full.param_grads):
        diff = _grad_diff(got, ref, floor)
        if diff > worst:
            worst, what = diff, f"gradients of parameter {name}"
    return worst, what


def _zero_matrices(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Floating parameters of two or more dims that are all zero: a zero-initialised projection, behind which
    a layer's token mixing is invisible to its outputs (and partly to its gradients)."""
    return [p for p in params if p.is_floating_point() and p.dim() >= 2 and p.numel() and not bool(p.any())]


@contextmanager
def _perturbed(params: Sequence[torch.Tensor], gen: torch.Generator) -> Iterator[None]:
    """Give zero matrices random values (1/sqrt(fan-in) scale) for the block, then restore them bit for bit."""
    saved = [p.detach().clone() for p in params]
    try:
        with torch.no_grad():
            for p in params:
                noise = torch.randn(p.shape, generator=gen) / max(p.shape[-1], 1) ** 0.5
                p.copy_(noise.to(dtype=p.dtype, device=p.device))
        yield
    finally:
        with torch.no_grad():
            for p, value in zip(params, saved):
                p.copy_(value)


def _check_layer(layer: Callable, x: Any, bounds: list[tuple[int, int]], params: Sequence[torch.Tensor],
                 names: Sequence[str], gen: torch.Generator) -> tuple[float, str, float]:
    """(worst relative difference, where, tolerance for the layer's output dtype)."""
    seq_len = bounds[-1][1]
    full, upstream = _run_unsliced(layer, x, params, seq_len, gen)
    sliced = _run_sliced(layer, x, params, bounds, upstream)
    dtype = next((t.dtype for t in _flat(full.outputs) if t.is_floating_point()), torch.float32)
    tolerance = 1e-3 if dtype in (torch.float32, torch.float64) else 5e-2
    return (*_compare(sliced, full, seq_len, names), tolerance)


def check_slicing_equivalence(layers: list[Callable], first_layer_idx: int, stage_input: Any, slices: list[int],
                              param_names: Optional[dict[int, str]] = None) -> Optional[str]:
    """Run each of ``layers`` unsliced and sliced, forward and backward; return a description of the first
    layer whose outputs, input gradients or parameter gradients differ, or None.

    The backward takes one random upstream gradient for both runs and goes through the slice machinery as in
    training (later slices first, KV gradients carried to earlier slices), so a layer that mixes tokens
    non-causally is found by its parameter gradients even when a zero-initialised output projection hides it
    from the outputs. A layer with an all-zero weight matrix is checked a second time with those matrices set
    to random values (restored bit for bit afterwards), for what zero weights hide from the gradients too.
    Parameter ``.grad`` are never touched (see :func:`_backward`). A layer in bf16 or fp16 is checked on an fp32
    copy (see the module docstring: in those precisions the order of a sum alone moves gradients more than any
    tolerance that would still catch a bug), and runs in its own precision to make the next layer's input.
    ``param_names`` maps ``id(parameter)`` to a name for messages.
    """
    bounds, start = [], 0
    for length in slices:
        bounds.append((start, start + length))
        start += length
    gen = torch.Generator().manual_seed(_PROBE_SEED + 1)
    x = stage_input
    for idx, layer in enumerate(layers):
        params = [p for p in _layer_params(layer) if p.requires_grad]
        names = [(param_names or {}).get(id(p), f"#{i}") for i, p in enumerate(params)]
        checked, checked_x, checked_params = _judged(layer, x, params)
        with torch.enable_grad():
            diff, what, tolerance = _check_layer(checked, checked_x, bounds, checked_params, names, gen)
            note = ""
            zeros = _zero_matrices(checked_params)
            if diff <= tolerance and zeros:
                with _perturbed(zeros, gen):
                    diff, what, tolerance = _check_layer(checked, checked_x, bounds, checked_params, names, gen)
                note = " with its all-zero weights set to random values"
        del checked, checked_x, checked_params  # an fp32 copy lives for its own layer's check only
        if diff > tolerance:
            name = _layer_name(layer)
            return (f"layer {first_layer_idx + idx} ({name}) gives different {what} when the sequence is cut into "
                    f"slices {slices}{note} (max relative difference {diff:.2e}): it mixes tokens non-causally or "
                    "does not read the slice context (e.g. plain F.scaled_dot_product_attention on the slice "
                    "alone). Use ds_terapipe.sliced_causal_attention for attention (and ds_terapipe.token_offset "
                    "for positions), or run with terapipe.slices=1")
        with torch.no_grad(), slice_scope(None):
            x = layer(_as_leaves(x))  # a copy: a layer working in place must not change the probe input
    return None


def check_stage_slicing(engine: "PipelineStage", seq_len: int, slices: Optional[tuple[int, ...]],
                        batch_input: Any = None, *, on_batch: bool = False) -> Optional[dict[int, Any]]:
    """Probe and check this rank's chunks for ``slices`` (None: not planned yet); return the probe inputs, by
    chunk, if any.

    Collective over all ranks. Every rank raises :class:`SlicingMismatchError` if any chunk fails the check. A
    model with an input sampler is probed at engine init on a sampled input. Without one nothing can be sampled,
    so init checks nothing and the engine calls this again with ``on_batch`` at the first batch of each sequence
    length (every rank, before the step), the rank holding chunk 0 passing that batch's inputs as
    ``batch_input``: a model built without ``vocab_size`` or ``input_sampler`` is checked all the same, on real
    data, before it trains on a slicing that would give it wrong gradients.
    """
    module = engine.module
    can_sample = hasattr(module, "has_sampler") and module.has_sampler()
    if not on_batch and (not can_sample or (slices is not None and len(slices) == 1)):
        return None
    inputs = probe_pass(engine, seq_len, batch_input)
    cuts = _probe_cuts(seq_len, engine.terapipe.granularity, slices)
    problem = None
    if len(cuts) > 1:
        names = {id(p): name for name, p in module.named_parameters()}
        was_training = module.training
        module.eval()  # dropout would make the two runs differ
        try:
            for chunk in engine.local_chunks:
                with engine.on_chunk(chunk):
                    problem = check_slicing_equivalence(list(module.forward_funcs), module._local_start,
                                                        inputs[chunk], cuts, names)
                if problem:
                    where = f"stage {engine.stage_id}" if engine.num_chunks == engine.num_stages else \
                        f"stage {engine.stage_id} (chunk {chunk})"
                    problem = f"terapipe: {where}: {problem}"
                    if on_batch:
                        problem += " (checked on the first batch: the model has no input sampler)"
                    break
        finally:
            module.train(was_training)
    agree_or_raise(problem, SlicingMismatchError, engine.p2p, "the slice check of every stage")
    return inputs
