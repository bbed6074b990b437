"""Where a gradient computed by hand goes: the buffer DeepSpeed's optimizer reads, in the scale it expects.

Why: autograd writes a parameter's gradient into ``.grad`` and DeepSpeed's precision machinery takes it from
there (the engine's backward scales an fp16 loss, the bf16 optimizer moves ``.grad`` into its fp32 master
gradients after every backward). The vocabulary passes (runtime/features/vocab.py, runtime/features/vocab_embedding.py)
compute
their shard's gradients in fp32 without autograd, so they must put them where each optimizer looks itself:

* fp32 (any ZeRO stage): ``param.grad``, as autograd would;
* bf16 through DeepSpeed's ``BF16_Optimizer`` (ZeRO 0): straight into the fp32 master gradient of the parameter
  (no bf16 rounding on the way; ``update_hp_grads`` adds ``.grad`` there after each backward, and the optimizer's
  norm and step read only those);
* bf16 under ZeRO 1: ``param.grad`` in bf16 (ZeRO reduces and casts it itself);
* fp16: ``param.grad`` times the loss scale, since the optimizer's step divides every gradient by it (and checks
  them for overflow) whichever way the backward scaled the rest.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["GradSink"]


class GradSink:
    """One engine's gradient buffers, for code that adds gradients without autograd."""

    def __init__(self, engine: Any) -> None:
        self.optimizer = engine.optimizer
        self.fp16 = bool(engine.fp16_enabled())
        self._master: dict[int, tuple[int, int]] = {}
        if engine.using_bf16_optimizer:
            for i, group in enumerate(self.optimizer.bf16_groups):
                for j, param in enumerate(group):
                    self._master[id(param)] = (i, j)

    def scale(self) -> float:
        """The factor the optimizer divides gradients by (the fp16 loss scale; 1 otherwise)."""
        if not self.fp16:
            return 1.0
        return float(self.optimizer.loss_scale)

    def buffer(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The tensor to add ``param``'s gradient into, shaped as ``param`` (created as zeros if there is none)."""
        where = self._master.get(id(param))
        if where is not None:
            i, j = where
            master = self.optimizer.fp32_groups_gradients[i][j].view(param.shape)
            self.optimizer.fp32_groups_has_gradients[i][j] = True  # the norm and step read flagged ones only
            param._hp_grad = master  # where DeepSpeed's tied-weight reduction looks in bf16
            return master
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        return param.grad

    def add(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """``param``'s gradient += ``grad`` (an fp32 gradient of the unscaled loss)."""
        target = self.buffer(param)
        scale = self.scale()
        target.add_((grad * scale if scale != 1.0 else grad).to(target.dtype))

    def index_add(self, param: torch.nn.Parameter, rows: torch.Tensor, grad: torch.Tensor) -> None:
        """Rows ``rows`` of ``param``'s gradient += ``grad`` (repeated rows add up). ``grad`` comes out of
        autograd, so it is in the optimizer's scale already (an fp16 backward started from a scaled loss)."""
        target = self.buffer(param)
        target.index_add_(0, rows, grad.to(target.dtype))

    def read(self, param: torch.nn.Parameter) -> Optional[torch.Tensor]:
        """The gradient the optimizer will read for ``param`` (None if it has none yet)."""
        where = self._master.get(id(param))
        if where is not None:
            i, j = where
            if not self.optimizer.fp32_groups_has_gradients[i][j]:
                return None
            return self.optimizer.fp32_groups_gradients[i][j].view(param.shape)
        return param.grad

    def write(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """Replace ``param``'s gradient by ``grad`` (already in the optimizer's scale, e.g. one read back)."""
        target = self.buffer(param)
        target.copy_(grad.to(target.dtype))
