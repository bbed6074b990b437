"""Sequence parallelism inside a stage (``terapipe.sequence_parallel``): Ulysses all-to-alls around sliced attention.

Why: at long context a stage's activations and KV carry outgrow one device, and a pipeline alone cannot split a
sequence. With ``N`` sequence-parallel ranks per stage, every slice's tokens ``[start, end)`` are split ``N`` ways
(rank ``j`` holds ``[start + j T/N, start + (j+1) T/N)``, ``T = end - start``): position-wise layers (embeddings,
norms, MLPs, projections) run on the rank's share alone, and around attention two all-to-alls (DeepSpeed Ulysses'
pattern) turn the share of all heads into the whole slice for ``1/N`` of the heads and back:

* :func:`gather_heads` (before attention): q, k, v (B, heads, T/N, hs) -> (B, heads/N, T, hs). Attention then
  runs exactly as without sequence parallelism, over the slice and the KV carry of earlier slices, for this
  rank's heads (the carry holds only them: 1/N of the KV memory). Grouped-query K/V are split by their own heads
  (KV heads must divide by N).
* :func:`scatter_heads` (after it): (B, heads/N, T, hs) -> (B, heads, T/N, hs).

Both are autograd functions whose backward is the opposite all-to-all, so gradients (and the KV-gradient carry,
which lives per head subset) follow the same split. Parameters are replicated over the sequence ranks: each rank's
weight gradients are those of its tokens, and the engine sums them over the sequence group before the
data-parallel reduction, as DeepSpeed's Ulysses does.

Not DeepSpeed's ``DistributedAttention``: it wraps a local attention module and expects (seq, batch, heads, hs)
with its own layout conventions, while here the local attention is :func:`sliced_causal_attention` with its KV
carry keyed per layer call; the all-to-alls are the same pattern, written for (B, heads, T, hs) and called from
inside that function, so every model that uses it (the reference GPT, the Hugging Face layers) is
sequence-parallel without a change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["SequenceShare", "gather_heads", "scatter_heads"]


@dataclass(frozen=True)
class SequenceShare:
    """This rank's place in its stage's sequence-parallel group: ``rank`` of ``degree``, ``group`` the process
    group of the ``degree`` ranks that split every slice of this stage."""

    group: Any
    rank: int
    degree: int

    def bounds(self, start: int, end: int) -> tuple[int, int]:
        """This rank's tokens of the slice ``[start, end)`` (its length divides by ``degree``)."""
        share = (end - start) // self.degree
        return start + self.rank * share, start + (self.rank + 1) * share


class _AllToAll(torch.autograd.Function):
    """Chunk ``i`` of dim 0 goes to rank ``i`` of the group, chunk ``i`` of the result came from rank ``i``; the
    backward is the same exchange of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _exchange(grad, ctx.group), None


def _exchange(x: torch.Tensor, group: Any) -> torch.Tensor:
    # Both buffers dense in row-major order: the collective reads and writes storage in that order, and a
    # gradient arriving through a permute has other strides, which empty_like would keep.
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dist.all_to_all_single(out, x, group=group)
    return out


def _check_heads(x: torch.Tensor, share: SequenceShare, what: str) -> None:
    if x.shape[1] % share.degree:
        raise ValueError(f"terapipe.sequence_parallel={share.degree}: attention {what} has {x.shape[1]} heads, not "
                         f"a multiple of {share.degree} (each sequence rank attends with 1/{share.degree} of the "
                         "heads); use a sequence-parallel degree that divides the (key/value) head count")


def gather_heads(x: torch.Tensor, share: SequenceShare, what: str = "q/k/v") -> torch.Tensor:
    """(B, heads, T/N, hs) of this rank's tokens -> (B, heads/N, T, hs): the whole slice for this rank's heads."""
    _check_heads(x, share, what)
    n = share.degree
    b, h, t, d = x.shape
    parts = x.reshape(b, n, h // n, t, d).transpose(0, 1)                  # (N, B, h/N, t, hs): to rank i
    got = _AllToAll.apply(parts, share.group)   # dense in _exchange; (N, B, h/N, t, hs): from rank i
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * t, d)


def scatter_heads(x: torch.Tensor, share: SequenceShare) -> torch.Tensor:
    """(B, heads/N, T, hs) -> (B, heads, T/N, hs): every head of this rank's tokens (the inverse of
    :func:`gather_heads`)."""
    n = share.degree
    b, hn, tt, d = x.shape
    parts = x.reshape(b, hn, n, tt // n, d).permute(2, 0, 1, 3, 4)       # (N, B, h/N, t, hs): rank i's tokens
    got = _AllToAll.apply(parts, share.group)   # dense in _exchange; (N, B, h/N, t, hs): head subset i
    return got.transpose(0, 1).reshape(b, n * hn, tt // n, d)
