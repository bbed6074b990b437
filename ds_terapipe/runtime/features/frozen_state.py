"""What freezing a parameter does to the optimizer that updates it (``terapipe.freeze``, runtime/features/freeze.py).

Why: a frozen weight must stop moving, and its optimizer state with it (no momentum, no weight decay). With a
torch optimizer that holds the parameters themselves (fp32 without ZeRO) that is two facts torch already honours:
a parameter without a gradient is skipped, and its state can be dropped (the memory comes back). DeepSpeed's
other optimizers keep fp32 master copies, and all but one keep them flat: BF16_Optimizer (bf16 without ZeRO) and
ZeRO 1 (any precision) one flat fp32 partition per parameter group, the fp16 optimizers one copy per parameter
or one flat copy per group. Their inner torch optimizer updates a whole flat partition at once, with a zero
gradient where a frozen weight lies (momentum and weight decay would still move it), and its state cannot lose
part of a flat tensor. So here the frozen elements are held still instead:

* the state of a frozen parameter's elements (momentum, Adam's moments: every state tensor shaped as its
  master copy) is zeroed when it freezes and after every step;
* around the inner optimizer's ``step`` its master elements are copied out and back, so the step leaves them as
  they were; DeepSpeed then writes the low-precision weights (and ZeRO all-gathers them) from unchanged masters.

What this costs: a copy of this rank's frozen master elements during each step (transient) and two element-wise
passes over them; what it cannot release is the frozen elements' master copy and state, which stay allocated in
DeepSpeed's flat buffers (the log states how many bytes that is, per rank). Where the master copy is found:
``param._hp_mapping`` (BF16_Optimizer and ZeRO 1/2 link every parameter to its fragment of a flat partition; a
parameter whose partition is another replica's has none here), or FP16_UnfusedOptimizer's per-parameter
``fp32_groups``. FP16_Optimizer (fused, flat fp32 groups) is refused: no CPU run can exercise it.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

__all__ = ["FrozenMasters", "frozen_state_problem"]

logger = logging.getLogger(__name__)


def frozen_state_problem(optimizer: Any) -> Optional[str]:
    """Why freezing cannot hold this optimizer's state still (None when it can)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return None
    name = type(optimizer).__name__
    inner = getattr(optimizer, "optimizer", None)
    if not isinstance(inner, torch.optim.Optimizer):
        return (f"terapipe.freeze needs a torch optimizer inside DeepSpeed's {name}; use a torch.optim optimizer or "
                "remove terapipe.freeze")
    if name == "FP16_Optimizer":
        return ("terapipe.freeze does not support fp16 with DeepSpeed's fused FP16_Optimizer (ZeRO stage 0 with a "
                "fused optimizer); use bf16, ZeRO stage 1, or an unfused torch optimizer")
    if name == "FP16_UnfusedOptimizer" or hasattr(optimizer, "bf16_groups") or \
            hasattr(optimizer, "single_partition_of_fp32_groups"):
        return None
    return f"terapipe.freeze does not know where {name} keeps its master weights; remove terapipe.freeze"


class FrozenMasters:
    """The frozen elements of one DeepSpeed optimizer's master copies, held still around its inner step."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.inner: torch.optim.Optimizer = optimizer.optimizer
        self.regions: list[tuple[torch.Tensor, int, int]] = []  # (master tensor, first element, count)
        self._seen: set[int] = set()
        self._copies: dict[int, torch.Tensor] = {}
        if type(optimizer).__name__ == "FP16_UnfusedOptimizer":
            self._copies = {id(p16): p32 for g16, g32 in zip(optimizer.fp16_groups, optimizer.fp32_groups)
                            for p16, p32 in zip(g16, g32)}
        self._step: Optional[Callable[..., Any]] = None

    def _region(self, param: torch.nn.Parameter) -> Optional[tuple[torch.Tensor, int, int]]:
        if id(param) in self._copies:
            return self._copies[id(param)], 0, param.numel()
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is None:   # its partition lives on another replica
            return None
        flat = self.inner.param_groups[mapping.param_group_index]["params"][0]
        address = mapping.get_hp_fragment_address()
        return flat, int(address.start), int(address.numel)

    def freeze(self, param: torch.nn.Parameter) -> int:
        """Hold ``param``'s master elements (and their state) still from now on; the bytes that stay allocated."""
        if id(param) in self._seen:
            return 0
        self._seen.add(id(param))
        region = self._region(param)
        if region is None:
            return 0
        self.regions.append(region)
        self._zero_state([region])
        if self._step is None:
            self._step = self.inner.step
            self.inner.step = self._held_step  # type: ignore[method-assign]
        master, _, count = region
        return count * master.element_size() * (1 + len(self._state_tensors(master)))

    def _state_tensors(self, master: torch.Tensor) -> list[torch.Tensor]:
        state = self.inner.state.get(master, {})
        return [v for v in state.values() if torch.is_tensor(v) and v.shape == master.shape]

    def _zero_state(self, regions: list[tuple[torch.Tensor, int, int]]) -> None:
        with torch.no_grad():
            for master, start, count in regions:
                for value in self._state_tensors(master):
                    value.view(-1).narrow(0, start, count).zero_()

    def _held_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self._step is not None
        with torch.no_grad():
            kept = [master.detach().view(-1).narrow(0, start, count).clone() for master, start, count in self.regions]
        out = self._step(*args, **kwargs)
        with torch.no_grad():
            for (master, start, count), value in zip(self.regions, kept):
                master.data.view(-1).narrow(0, start, count).copy_(value)
        self._zero_state(self.regions)
        return out
