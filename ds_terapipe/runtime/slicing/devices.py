"""Devices and clocks: what the runtime needs to be right on an accelerator, not only on CPU.

Two rules (docs/design.md, "Devices, collectives and faults"):

* Every tensor handed to ``torch.distributed`` lives on the engine's device, the one DeepSpeed took from the
  accelerator (``engine.device``): NCCL accepts no CPU tensors. Tensors made from host values
  (``torch.tensor``, ``torch.full``, ...) must say ``device=engine.device``. The ``*_object`` collectives
  pick their device from the accelerator's current device, which DeepSpeed's engine sets at init
  (``get_accelerator().set_device(local_rank)``), before any of ours runs.
* A host clock read after device work measures only the launch of that work unless the accelerator is
  synchronised first: :func:`synchronized_ms` does both, and the profiler syncs through :func:`synchronize`.

On the CPU accelerator both syncs are no-ops; tests/suites/device.py checks the first rule on CPU by giving
the accelerator a device tensors cannot silently match.
"""

from __future__ import annotations

import time
from typing import Optional

import torch
from deepspeed.accelerator import get_accelerator

from torch.utils._python_dispatch import _disable_current_modes

try:  # torch >= 2.3
    from torch.nn.attention.bias import CausalBias, causal_lower_right
except ImportError:  # pragma: no cover - older torch: the additive mask everywhere
    CausalBias, causal_lower_right = None, None

__all__ = ["lower_right_bias", "prefix_causal_bias", "synchronize", "synchronized_ms"]


def synchronize() -> None:
    """Wait for the accelerator's queued work (a no-op on CPU)."""
    get_accelerator().synchronize()


def synchronized_ms() -> float:
    """Host time in milliseconds since the epoch, read after the accelerator finished its queued work."""
    synchronize()
    return time.time() * 1e3


def lower_right_bias(queries: int, keys: int) -> "CausalBias":
    """torch's lazy causal bias aligned to the lower right, ``queries`` over ``keys``, made outside any active
    ``TorchDispatchMode``: torch cannot make the ``CausalBias`` tensor subclass while one runs (FlopCounterMode, a
    kernel counter: "Creating a new Tensor subclass CausalBias but the raw Tensor object is already associated"),
    and the bias holds no data, so the mode misses nothing; the attention that takes it runs under the mode."""
    with _disable_current_modes():
        return causal_lower_right(queries, keys)


def prefix_causal_bias(start: int, end: int, device: torch.device) -> Optional["CausalBias"]:
    """For an accelerator, the mask of a slice's queries ``[start, end)`` over keys ``[0, end)`` as a lazy
    ``CausalBias`` (query row r sees keys ``<= start + r``: causal aligned to the lower right), so SDPA can
    run its fused flash / memory-efficient kernels instead of reading a materialised (T, end) mask.

    None on CPU: there no fused kernel takes it, and torch would materialise a boolean mask (and convert it)
    in every call of every layer; the caller keeps its cached additive mask there.
    """
    if device.type == "cpu" or causal_lower_right is None:
        return None
    return lower_right_bias(end - start, end)
