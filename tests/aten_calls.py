"""The ATen calls a piece of code makes, in order: tests that count kernels (each call launches at most one on a
device, views and allocations none) use it to hold a path to what it launches."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class AtenCalls(TorchDispatchMode):
    """``with AtenCalls() as ops: ...`` then ``ops.names``: the overload packets' names (``"addmm_"``, ``"mm"``)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.names.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))
