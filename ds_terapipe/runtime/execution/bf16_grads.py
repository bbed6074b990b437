"""bf16 weights' gradients in one flat buffer per parameter group, so moving them to fp32 is one add per group.

Why: DeepSpeed's ``BF16_Optimizer`` (bf16 without ZeRO) keeps fp32 master gradients and, after every backward
pass, adds each parameter's bf16 ``.grad`` into its master gradient and later zeroes ``.grad``: a Python loop
with a cast and an add per parameter. A pipeline stage runs that once per backward, and a token pipeline runs a
backward (and, with deferred weight gradients, a W pass) per slice, so the loop runs ``2 x slices`` times per
micro-batch. On a GPU that is two kernel launches per parameter each time, host work that does not shrink with
the slice: on a small model it is most of what the engine adds to a slice. The optimizer's master gradients are
already one flat fp32 buffer per group (its parameters end to end, in group order); this module gives the bf16
gradients the same layout, each ``.grad`` a view of a flat bf16 buffer, so the move is one mixed-precision add
of the two buffers (the same fp32 sums: a bf16 value widens to fp32 exactly) and the zeroing one fill.

:meth:`FlatBf16Grads.begin_step` installs the views before a step's first backward (DeepSpeed's ``zero_grad``
sets ``.grad`` to None after each step). Autograd accumulates into a ``.grad`` that exists in place, so the
views stay. Should anything replace a ``.grad`` with another tensor during the step, that group is no longer
intact and the optimizer's own per-parameter loop runs instead: never a missed gradient, only the old speed.
Memory: the flat buffers stay allocated between steps, where DeepSpeed's ``zero_grad`` would let autograd's
``.grad`` tensors go until the next backward; the same bytes, held through the forwards before the first backward.
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch

__all__ = ["FlatBf16Grads", "norm_of_no_gradient_is_zero"]

logger = logging.getLogger(__name__)


class FlatBf16Grads:
    """Flat bf16 gradient buffers laid out as ``optimizer``'s fp32 master gradients, and the optimizer's
    ``update_hp_grads``/``clear_lp_grads`` replaced (on this instance) by one add and one fill per group."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.params = [list(group) for group in optimizer.bf16_groups]
        self.flats: list[torch.Tensor] = []
        self.views: list[list[torch.Tensor]] = []
        for group, hp_flat in zip(self.params, optimizer.fp32_groups_gradients_flat):
            flat = torch.zeros(hp_flat.numel(), dtype=group[0].dtype if group else torch.bfloat16,
                               device=hp_flat.device)
            views, offset = [], 0
            for lp in group:
                views.append(flat.narrow(0, offset, lp.numel()).view(lp.shape))
                offset += lp.numel()
            self.flats.append(flat)
            self.views.append(views)
        self.lengths = [sum(p.numel() for p in group) for group in self.params]
        # per parameter, what its .grad must be for the group to be intact: its view, or None (not trained)
        self.expected: list[list[Any]] = [[None] * len(group) for group in self.params]
        cls = type(optimizer)
        self._update_each = cls.update_hp_grads.__get__(optimizer)
        self._clear_each = cls.clear_lp_grads.__get__(optimizer)
        optimizer.update_hp_grads = self.update_hp_grads
        optimizer.clear_lp_grads = self.clear_lp_grads

    @classmethod
    def attach(cls, optimizer: Any) -> "FlatBf16Grads":
        """This optimizer's buffers (made on first use, and again if its parameter groups changed)."""
        mine = optimizer.__dict__.get("_terapipe_flat_grads")
        if mine is None or not mine._same_groups():
            mine = cls(optimizer)
            optimizer._terapipe_flat_grads = mine
        return mine

    def _same_groups(self) -> bool:
        groups = self.optimizer.bf16_groups
        return len(groups) == len(self.params) and all(
            len(a) == len(b) and all(p is q for p, q in zip(a, b)) for a, b in zip(groups, self.params))

    def begin_step(self) -> None:
        """Make every trainable parameter's ``.grad`` its zeroed view (before the step's first backward)."""
        for i, (flat, group, views) in enumerate(zip(self.flats, self.params, self.views)):
            flat.zero_()
            hp_grads = self.optimizer.fp32_groups_gradients[i]
            for j, (lp, view) in enumerate(zip(group, views)):
                self.expected[i][j] = view if lp.requires_grad else None
                if lp.requires_grad:
                    lp.grad = view
                    lp._hp_grad = hp_grads[j]   # as the optimizer links it when it first adds a gradient

    def _intact(self, i: int) -> bool:
        """Whether group ``i``'s gradients are exactly its views (and nothing else holds one): identities compared
        in C (``map(operator.is_)``), since this runs twice per backward."""
        return all(map(operator.is_, [lp.grad for lp in self.params[i]], self.expected[i]))

    @torch.no_grad()
    def update_hp_grads(self, clear_lp_grads: bool = False) -> None:
        """``BF16_Optimizer.update_hp_grads``: master gradient += ``.grad``, one add per intact group."""
        opt = self.optimizer
        if opt.immediate_grad_update:
            return
        if not all(self._intact(i) for i in range(len(self.params))):
            logger.debug("bf16 gradients: a .grad was replaced during the step; per-parameter update")
            self._update_each(clear_lp_grads=clear_lp_grads)
            return
        for i, flat in enumerate(self.flats):
            n = self.lengths[i]
            opt.fp32_groups_gradients_flat[i].narrow(0, 0, n).add_(flat.narrow(0, 0, n))
            flags = opt.fp32_groups_has_gradients[i]
            for j, view in enumerate(self.expected[i]):
                if view is not None:
                    flags[j] = True
            if clear_lp_grads:
                flat.zero_()

    @torch.no_grad()
    def clear_lp_grads(self, set_to_none: bool = False) -> None:
        """``BF16_Optimizer.clear_lp_grads``: one fill per intact group (None-ing them gives the views up)."""
        if set_to_none or not all(self._intact(i) for i in range(len(self.params))):
            self._clear_each(set_to_none=set_to_none)
            return
        for flat in self.flats:
            flat.zero_()


def norm_of_no_gradient_is_zero(optimizer: Any) -> None:
    """Let ``BF16_Optimizer``'s gradient norm run on a rank that lists no gradient for it (on this instance).

    Why: DeepSpeed's norm stacks the gradients it lists and fails on an empty list, while every other rank waits
    for this one in the norm's all-reduce over the model-parallel group (the stages and the sequence ranks). It
    lists a gradient that is present, not ``ds_pipe_replicated``, and, since it sees the sequence ranks as
    tensor-parallel ones, on model rank 0 only. That is the right norm here (the engine has summed each gradient
    over the sequence ranks before the step, so they all hold the same one, and a tied weight's copies hold the
    same gradient), but the list is empty on the other sequence ranks, on a stage that holds only copies of tied
    modules (the tied head alone), and on a rank whose own layers are all frozen (its only gradients those of tied
    copies, or none). Those get one zero instead, which adds nothing to the sum.
    """
    listed = type(optimizer).get_grads_for_norm.__get__(optimizer)

    def get_grads_for_norm(for_clipping: bool = False) -> Any:
        grads = listed(for_clipping=for_clipping)
        if for_clipping:
            return grads
        dense, experts = grads
        if not dense:
            flat = optimizer.fp32_groups_gradients_flat[0]
            dense = [torch.zeros(1, dtype=flat.dtype, device=flat.device)]
        return dense, experts

    optimizer.get_grads_for_norm = get_grads_for_norm
