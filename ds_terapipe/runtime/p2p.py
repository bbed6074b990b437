"""Point-to-point transfers of slice activations and gradients between neighbouring stages.

Why not DeepSpeed's own p2p: it exchanges activation shapes once per run, but slices of one plan have
different lengths (and variable sequence lengths change them again), its sends block, and it waits forever.
Here a transfer may carry a small fixed-size header (tensor count, dtypes, shapes); the engine sends one only
the first time a stage boundary sees a given (sequence length, slice length), after which the receiver posts
plain receives (a header costs a second round trip, measured 3.2 ms vs 0.4 ms on CPU gloo). Sends are
non-blocking (``isend``; the tensors stay referenced until the send completes) and every wait has a deadline,
so a dead peer becomes an error naming what this rank was waiting for, not a hang.

Ordering: torch.distributed matches sends and receives between two ranks in FIFO order, so the schedule's
per-rank order is the protocol; :func:`ds_terapipe.planner.schedule.replay` checks it pairs up.
"""

from __future__ import annotations

import datetime
import logging
from typing import Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["P2PTimeoutError", "SliceP2P", "agree_or_raise", "as_tuple"]

logger = logging.getLogger(__name__)

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int16,
           torch.int32, torch.int64, torch.bool]
_DTYPE_ID = {dtype: idx for idx, dtype in enumerate(_DTYPES)}
_HEADER_SIZE = 64


class P2PTimeoutError(RuntimeError):
    """Waiting for a pipeline peer failed: no answer within ``terapipe.p2p_timeout_s``, or the peer went away."""


def agree_or_raise(problem: Optional[str], error: type[Exception]) -> None:
    """Collective: every rank raises ``error`` if any rank found a problem (the first rank's message), so no
    rank is left waiting for a peer that gave up."""
    messages: list[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, problem)
    failures = [m for m in messages if m]
    if failures:
        raise error(failures[0])


def as_tuple(value: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return (value, ) if torch.is_tensor(value) else tuple(value)


class SliceP2P:
    """Non-blocking sends and deadline-bounded receives to the neighbouring pipeline stages."""

    def __init__(self, stage_to_rank: Sequence[int], device: torch.device, timeout_s: float) -> None:
        self.stage_to_rank = list(stage_to_rank)
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._pending: list[tuple[dist.Work, tuple[torch.Tensor, ...], str]] = []

    # -- sending ---------------------------------------------------------------------------------------------
    def send(self, tensors: Sequence[torch.Tensor], stage: int, what: str, *, header: bool) -> None:
        """Start sending ``tensors`` to ``stage``; with ``header`` the receiver learns their shapes first."""
        rank = self.stage_to_rank[stage]
        wire = tuple(t.to(torch.uint8) if t.dtype == torch.bool else t.contiguous() for t in tensors)
        if header:
            head = self._header(tensors)
            self._pending.append((dist.isend(head, rank), (head, ), what))
        for tensor in wire:
            self._pending.append((dist.isend(tensor, rank), (tensor, ), what))
        self._reap()

    def _header(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        fields = [len(tensors)]
        for t in tensors:
            if t.dtype not in _DTYPE_ID:
                raise TypeError(f"token pipeline cannot send tensors of dtype {t.dtype} between stages; "
                                f"use one of {[str(d) for d in _DTYPES]}")
            fields += [_DTYPE_ID[t.dtype], t.dim(), *t.shape]
        if len(fields) > _HEADER_SIZE:
            raise ValueError(f"activations between stages have too many tensors/dimensions ({len(fields)} header "
                             f"fields > {_HEADER_SIZE}); send fewer tensors per stage boundary")
        head = torch.zeros(_HEADER_SIZE, dtype=torch.int64)
        head[:len(fields)] = torch.tensor(fields, dtype=torch.int64)
        return head.to(self.device)

    def _reap(self) -> None:
        """Forget sends that completed, so their tensors can be freed."""
        self._pending = [p for p in self._pending if not p[0].is_completed()]

    def drain(self) -> None:
        """Wait for every outstanding send (end of a batch: nothing may still be in flight)."""
        pending, self._pending = self._pending, []
        for work, _, what in pending:
            self.wait(work, f"send of {what}")

    # -- receiving -------------------------------------------------------------------------------------------
    def recv(self, stage: int, what: str) -> tuple[torch.Tensor, ...]:
        """Receive a header-described group of tensors from ``stage``."""
        rank = self.stage_to_rank[stage]
        head = torch.zeros(_HEADER_SIZE, dtype=torch.int64, device=self.device)
        self.wait(dist.irecv(head, rank), f"header of {what} from stage {stage} (rank {rank})")
        fields = head.tolist()
        pos, specs = 1, []
        for _ in range(fields[0]):
            ndim = fields[pos + 1]
            specs.append((tuple(fields[pos + 2:pos + 2 + ndim]), _DTYPES[fields[pos]]))
            pos += 2 + ndim
        return self.recv_specs(specs, stage, what)

    def recv_like(self, likes: Sequence[torch.Tensor], stage: int, what: str) -> tuple[torch.Tensor, ...]:
        """Receive tensors shaped like ``likes`` (gradients of our own outputs: no header needed)."""
        return self.recv_specs([(tuple(t.shape), t.dtype) for t in likes], stage, what)

    def recv_specs(self, specs: Sequence[tuple[tuple[int, ...], torch.dtype]], stage: int,
                   what: str) -> tuple[torch.Tensor, ...]:
        """Receive tensors of known shapes and dtypes: all receives are posted at once, no header round trip."""
        rank = self.stage_to_rank[stage]
        wire = [torch.empty(shape, dtype=torch.uint8 if dtype == torch.bool else dtype, device=self.device)
                for shape, dtype in specs]
        works = [dist.irecv(buf, rank) for buf in wire]
        for work in works:
            self.wait(work, f"{what} from stage {stage} (rank {rank})")
        return tuple(buf.bool() if dtype == torch.bool else buf for buf, (_, dtype) in zip(wire, specs))

    def wait(self, work: dist.Work, what: str) -> None:
        """Wait for ``work`` (any async collective too) at most ``p2p_timeout_s``; fail naming ``what``."""
        try:
            work.wait(timeout=self.timeout)
        except RuntimeError as err:
            raise P2PTimeoutError(f"rank {dist.get_rank()}: waiting for {what} failed (limit "
                                  f"{self.timeout.total_seconds():.0f}s, terapipe.p2p_timeout_s): a peer died, hung "
                                  f"or runs a different schedule ({err})") from err
