"""Deferred weight gradients: a slice's backward computes input gradients only; weights get theirs later, in a ``W``
action per micro-batch or per slice, as the schedule places them (``ScheduleSpec.weights_per_slice``).

Why: the weight gradient sits on the critical path of a sliced backward. The previous stage waits for this
stage's input gradient, which does not need the weight gradient at all; at one micro-batch on 2 stages the
pipeline's idle gap shrinks by the weight-gradient time of one slice. With deferral, each slice's backward
records the Linear's (input, output gradient) pair and returns at once; a ``W`` action after the gradient was
sent on computes the recorded weight gradients and adds them to ``.grad``: with gpipe once per micro-batch,
after its last backward (``1W<b>.0`` in the schedule IR: one pass, one accumulation), with 1f1b after every
slice (``1W<b>.<i>``: the pairs live no longer than activations would). Zero-bubble pipelines (Qi et al. 2024)
apply the same split to whole micro-batches.

What is deferred: ``nn.Linear`` modules of the stage (their ``forward`` is wrapped at engine init, the module
is otherwise untouched). Everything else (embeddings, norms, attention's prefix cache) keeps ordinary autograd.
Outside a slice context with a stash (plain forwards, profiling, evaluation) the wrapped Linear runs the
original code path.

The engine sums a step's W passes in place (:class:`WeightGradAccumulator`: each GEMM accumulates into the
parameter's running sum) and hands the sum to ``.grad`` once, before the step's gradient reductions, through
``torch.autograd.backward`` on the parameters themselves, so DeepSpeed's gradient-accumulation hooks fire as
after an ordinary backward of the whole batch.

Memory: each pending pair holds the Linear's input (which autograd would have saved anyway until the slice's
backward) and its output gradient (held for deferral only: about 9 x hidden floats per token per transformer
block), from the slice's backward until its ``W``.
"""

from __future__ import annotations

from types import MethodType
from typing import Any, Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .context import current_slice

__all__ = ["WeightGradAccumulator", "WeightGradStash", "enable_deferred_weight_grads",
           "enable_fused_grad_accumulation", "fused_parameters"]


class WeightGradStash:
    """The (input, output-gradient) pairs of one micro-batch's slices, per deferred Linear, until computed.

    Each pair remembers the slice whose forward made it, so a ``W`` per slice computes that slice's pairs and no
    others: a list-scheduled ``W`` (dualpipev's, placed in a bubble after several backwards of its chunk) must take
    the time the plan gave it, not the whole chunk's (a first ``W`` of a chunk that ran every slice's pairs was
    measured at 5 times its planned span, holding up the backward behind it).
    """

    def __init__(self) -> None:
        self._pairs: dict[nn.Linear, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}

    def add(self, module: nn.Linear, inputs: torch.Tensor, grad_output: torch.Tensor, slice_index: int) -> None:
        # A view into a larger tensor (a key or value projection's output gradient is the slice's rows of the KV
        # cache's full-length gradient buffer) would keep all of it alive until this W: keep the rows alone.
        if grad_output.untyped_storage().nbytes() > grad_output.numel() * grad_output.element_size():
            grad_output = grad_output.clone()
        self._pairs.setdefault(module, []).append((slice_index, inputs, grad_output))

    def __len__(self) -> int:
        return sum(len(p) for p in self._pairs.values())

    def slices(self) -> set[int]:
        """The slices with pairs not computed yet."""
        return {i for pairs in self._pairs.values() for i, _, _ in pairs}

    def tensors(self) -> Iterator[torch.Tensor]:
        """Every recorded input and output gradient (what the stash keeps alive)."""
        for pairs in self._pairs.values():
            for _, x, g in pairs:
                yield x
                yield g

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def flush(self) -> None:
        """Compute every recorded weight (and bias) gradient and add it to ``.grad`` (once per parameter)."""
        params, grads = self.compute()
        if params:
            # Through autograd, not ``.grad +=``: AccumulateGrad runs DeepSpeed's hooks as in any backward.
            torch.autograd.backward(params, grads)

    @torch.no_grad()
    def compute(self, into: Optional["WeightGradAccumulator"] = None, slice_index: Optional[int] = None
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The recorded weight (and bias) gradients as (parameters, gradients), of every slice or of
        ``slice_index`` only; removes the pairs it used, without touching ``.grad`` (profiling times this).

        Per module, one GEMM over all the slices the call covers: their inputs and output gradients are laid
        end to end in token order (one copy of each, about ``tokens x (in + out)`` values) and multiplied once.
        Why: each GEMM reads the weight-sized gradient it writes into, so a GEMM per slice reads and writes it
        once per slice. On a GPU that traffic, not the FLOPs, is what a small slice's W costs (measured on one
        H100, a GPT-3-175B-shaped layer: W of one 2048-token micro-batch 13 ms unsliced, 33 ms as 8 per-slice
        GEMMs); on a CPU the copies and the GEMMs cost about what the per-slice ``addmm_`` did. With ``into``,
        fp32 (and fp64) parameters' gradients go into the step's running sums (:class:`WeightGradAccumulator`:
        ``addmm_`` into the sum) and only the others are returned: a bf16/fp16 gradient summed over the step in
        its own dtype would lose precision that DeepSpeed's per-backward fp32 accumulation keeps, so those are
        handed over per W.
        """
        params: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        for module in list(self._pairs):
            pairs = self._pairs[module]
            if slice_index is None:
                del self._pairs[module]
            else:
                keep = [pair for pair in pairs if pair[0] != slice_index]
                pairs = [pair for pair in pairs if pair[0] == slice_index]
                if keep:
                    self._pairs[module] = keep
                else:
                    del self._pairs[module]
                if not pairs:
                    continue
            want_w = module.weight.requires_grad
            want_b = module.bias is not None and module.bias.requires_grad
            summed = into is not None and torch.finfo(module.weight.dtype).bits >= 32
            dw = into.running(module.weight) if (summed and want_w) else None
            db = into.running(module.bias) if (summed and want_b) else None
            x, g = _rows_in_token_order(pairs)   # (tokens, in), (tokens, out)
            pairs.clear()   # the slices' own tensors go now; only the laid-out copies stay until the GEMM
            if want_w:
                dw = g.t().mm(x) if dw is None else dw.addmm_(g.t(), x)
            if want_b:
                db = g.sum(0) if db is None else add_bias_grad(db, g)
            del x, g
            for param, grad in ((module.weight, dw), (module.bias, db)):
                if grad is None:
                    continue
                if summed:
                    into.keep(param, grad)
                else:
                    params.append(param)
                    grads.append(grad.to(param.dtype))
        return params, grads


def _rows_in_token_order(pairs: list[tuple[int, torch.Tensor, torch.Tensor]]
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs' inputs and output gradients as two 2-D matrices, one row per token, slices in token order.

    Pairs are recorded as backwards run, later slices first; sorting by slice puts the rows in token order, so the
    GEMM sums over tokens in one fixed order whatever the schedule. A single pair is only reshaped (a view).
    """
    ordered = sorted(pairs, key=lambda pair: pair[0])
    xs = [x.reshape(-1, x.shape[-1]) for _, x, _ in ordered]
    gs = [g.reshape(-1, g.shape[-1]) for _, _, g in ordered]
    if len(ordered) == 1:
        return xs[0], gs[0]
    return torch.cat(xs), torch.cat(gs)


class WeightGradAccumulator:
    """The weight gradients of a step's ``W`` passes, summed in place, handed to ``.grad`` once.

    Why: handing each W pass's gradients to ``.grad`` costs a full pass over the stage's parameters per W
    (AccumulateGrad's clone for the first, an add for every other): a W per slice on 1f1b with n slices and m
    micro-batches did that n x m times per step (measured: W per slice 25% dearer than a W per micro-batch on
    the benchmark CPU, GPT 8 x 512, 5 slices). Summing into one running tensor per parameter with
    ``addmm_`` (the GEMM accumulates into it) and handing the sum over once, before the step's gradient
    reductions, costs one such pass per step. Gradients reach ``.grad`` through ``torch.autograd.backward``, so
    DeepSpeed's accumulation hooks fire once per parameter per step, as after an ordinary backward of the
    whole batch.
    """

    def __init__(self) -> None:
        self._sums: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # id(param) -> (param, running sum)

    def running(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """The parameter's running sum (None before its first W)."""
        entry = self._sums.get(id(param))
        return None if entry is None else entry[1]

    def keep(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        self._sums[id(param)] = (param, grad)

    def __len__(self) -> int:
        return len(self._sums)

    def hand_over(self) -> None:
        """Add every running sum to its parameter's ``.grad`` (through autograd) and empty the accumulator."""
        if not self._sums:
            return
        params = [p for p, _ in self._sums.values()]
        grads = [g.to(p.dtype) for p, g in self._sums.values()]
        self._sums.clear()
        torch.autograd.backward(params, grads)


class _DeferredLinear(torch.autograd.Function):
    """``F.linear`` whose backward returns the input gradient and records the pair for the weight gradient.

    The weight and bias come in detached: autograd must not see them, or it would run their AccumulateGrad
    (and DeepSpeed's hooks on it) once per slice with no gradient.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                module: nn.Linear, stash: WeightGradStash, slice_index: int) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.module, ctx.stash, ctx.slice_index = module, stash, slice_index
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        x, weight = ctx.saved_tensors
        grad_in = grad_out.matmul(weight)
        ctx.stash.add(ctx.module, x.detach(), grad_out.detach(), ctx.slice_index)
        ctx.stash = ctx.module = None
        return grad_in, None, None, None, None, None


class _AccumulatingLinear(torch.autograd.Function):
    """``F.linear`` whose backward adds the weight gradient into the weight's ``.grad`` inside the GEMM
    (``addmm_``) when ``.grad`` already holds earlier slices' sum, instead of a fresh gradient that autograd then
    adds in (see :func:`enable_fused_grad_accumulation`); the bias gradient likewise, as a matrix-vector product
    with ones (``addmv_``) where that pays (:func:`bias_grad_in_gemv`). The first backward of a step, with
    ``.grad`` still None, returns the gradients to autograd as usual."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.weight, ctx.bias = weight, bias
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        x, weight = ctx.saved_tensors
        param, bias, ctx.weight, ctx.bias = ctx.weight, ctx.bias, None, None
        grad_in = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        g = grad_out.reshape(-1, grad_out.shape[-1])   # (tokens, out)
        grad_w = grad_b = None
        if ctx.needs_input_grad[1]:
            into = param.grad
            if _accumulates_in_place(param, into):
                into.addmm_(g.t(), x.reshape(-1, x.shape[-1]))
            else:
                grad_w = g.t().mm(x.reshape(-1, x.shape[-1]))
        if bias is not None and ctx.needs_input_grad[2]:
            into = bias.grad
            if bias_grad_in_gemv(bias) and _accumulates_in_place(bias, into):
                add_bias_grad(into, g)
            else:
                grad_b = g.sum(0)
        return grad_in, grad_w, grad_b


_ONES: dict[tuple, torch.Tensor] = {}


def bias_grad_in_gemv(bias: torch.Tensor) -> bool:
    """Whether a bias gradient is added in as ``addmv_`` with a vector of ones (one kernel) rather than summed over
    the tokens and then added (two): for fp32 (and fp64) biases on an accelerator, where a short slice's backward is
    bound by launching its kernels. Not on a CPU: there BLAS's matrix-vector product adds the tokens one after
    another (measured: 5e-6 relative error over 4096 fp32 tokens against 7e-7 for torch's pairwise sum, enough to
    move Adam's update of a small bias), and in bf16 it is also the slower. Not for bf16/fp16 on a GPU either until
    measured there: cuBLAS may reduce a long matrix-vector product in the low precision (torch's
    ``allow_bf16_reduced_precision_reduction``), where the sum accumulates in fp32 (``tests/test_gpu.py`` checks
    both dtypes against fp64)."""
    return bias.device.type != "cpu" and torch.finfo(bias.dtype).bits >= 32


def add_bias_grad(into: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``into += g.sum(0)`` for ``g`` (tokens, out): one ``addmv_`` with a cached vector of ones where
    :func:`bias_grad_in_gemv` holds. The same sum up to the order of the additions."""
    if not bias_grad_in_gemv(into):
        return into.add_(g.sum(0))
    key = (g.shape[0], g.dtype, g.device)
    ones = _ONES.get(key)
    if ones is None:
        if len(_ONES) > 64:
            _ONES.clear()
        ones = _ONES[key] = torch.ones(g.shape[0], dtype=g.dtype, device=g.device)
    return into.addmv_(g.t(), ones)


def _accumulates_in_place(param: torch.Tensor, grad: Optional[torch.Tensor]) -> bool:
    """Whether ``param``'s gradient (a Linear's weight or bias) may be added into ``grad`` directly: a plain dense
    tensor of its shape and dtype, and no hook that autograd's accumulation would run
    (``register_post_accumulate_grad_hook``)."""
    return (grad is not None and type(grad) is torch.Tensor and grad.layout == torch.strided
            and grad.dtype == param.dtype and grad.shape == param.shape and not grad.requires_grad
            and getattr(param, "_post_accumulate_grad_hooks", None) is None)


def _token_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    ctx = current_slice()
    if ctx is None or not torch.is_grad_enabled():
        return F.linear(x, self.weight, self.bias)
    wants = self.weight.requires_grad or (self.bias is not None and self.bias.requires_grad)
    stash = ctx.state.weight_stash if getattr(self, "_terapipe_deferred", False) else None
    # Deferral needs a backward that reaches this layer through its input; otherwise (an input that needs no
    # gradient, frozen weights) ordinary autograd is exact and costs nothing extra.
    if stash is not None and x.requires_grad and wants:
        bias = self.bias.detach() if self.bias is not None else None
        return _DeferredLinear.apply(x, self.weight.detach(), bias, self, stash, ctx.slice_index)
    # Not under autocast (its casts, autograd's backward), nor under torch.compile: dynamo cannot trace the
    # backward's look at ``.grad``, so every Linear would break the graph (a compiled piece per GEMM, each with its
    # own call overhead: slower than eager on a host-bound GPU); autograd's accumulation is exact.
    if ctx.state.fuse_grad_accumulation and self.weight.requires_grad and getattr(self, "_terapipe_fused", False) \
            and not torch.is_autocast_enabled(x.device.type) and not torch.compiler.is_compiling():
        return _AccumulatingLinear.apply(x, self.weight, self.bias)
    return F.linear(x, self.weight, self.bias)


def _wrap_linears(module: nn.Module, mark: str) -> int:
    """Route the forward of every plain ``nn.Linear`` in ``module`` through :func:`_token_linear_forward` and set
    ``mark`` on it; returns how many got the mark. Subclasses that override ``forward`` (quantised or fused
    Linears) are left alone: their backward is theirs."""
    count = 0
    for sub in module.modules():
        if isinstance(sub, nn.Linear) and type(sub).forward is nn.Linear.forward and not getattr(sub, mark, False):
            sub.forward = MethodType(_token_linear_forward, sub)
            setattr(sub, mark, True)
            count += 1
    return count


def enable_deferred_weight_grads(module: nn.Module) -> int:
    """Defer the weight gradients of every plain ``nn.Linear`` in ``module`` (under a slice context with a stash);
    returns how many were wrapped."""
    return _wrap_linears(module, "_terapipe_deferred")


def enable_fused_grad_accumulation(module: nn.Module) -> int:
    """Let every plain ``nn.Linear`` in ``module`` add its weight (and bias) gradient into ``.grad`` inside the GEMM,
    under a slice context whose micro-batch state asks for it (``MicroBatchState.fuse_grad_accumulation``, set by
    the engine for training); returns how many were wrapped.

    Why: a backward that is not deferred runs once per slice, and from the second on autograd adds each fresh
    weight gradient into ``.grad``, one more pass over a weight-sized tensor per Linear and slice (on one H100 a
    GPT-3-175B-shaped layer's backward took 7.5 ms into ``.grad`` against 4.1 ms without the accumulation, for a
    256-token slice). ``addmm_`` into ``.grad`` computes the same sum in the GEMM: the gradient is never written
    out on its own and read back. An fp32 bias's gradient on an accelerator goes in as one ``addmv_`` with ones
    instead of a sum and an add (:func:`add_bias_grad`): on a device bound by launching kernels, a slice's backward
    of a GPT block launches 4 kernels fewer. The sum is the same up to the order of the additions (fp32: within
    rounding). The hooks autograd runs after accumulating are skipped for these additions, so the engine turns
    this on only where none are registered (not under DeepSpeed's ZeRO optimizer, which hooks every
    accumulation), and a parameter with a ``register_post_accumulate_grad_hook`` keeps the ordinary path, and so
    does a Linear inside a ``torch.compile`` graph (``engine.compile()``)."""
    return _wrap_linears(module, "_terapipe_fused")


def fused_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The weights (and, where :func:`bias_grad_in_gemv` holds, biases) of ``module``'s Linears that
    :func:`enable_fused_grad_accumulation` marked and that train: what a backward adds into ``.grad`` itself."""
    fused: list[nn.Parameter] = []
    for m in module.modules():
        if isinstance(m, nn.Linear) and getattr(m, "_terapipe_fused", False) and m.weight.requires_grad:
            fused.append(m.weight)
            if m.bias is not None and m.bias.requires_grad and bias_grad_in_gemv(m.bias):
                fused.append(m.bias)
    return fused
