"""Sequence parallelism inside a stage (``terapipe.sequence_parallel``): Ulysses all-to-alls around sliced attention.

Why: at long context a stage's activations and KV carry outgrow one device, and a pipeline alone cannot split a
sequence. With ``N`` sequence-parallel ranks per stage, every slice's tokens ``[start, end)`` are split ``N`` ways
(rank ``j`` holds ``[start + j T/N, start + (j+1) T/N)``, ``T = end - start``): position-wise layers (embeddings,
norms, MLPs, projections) run on the rank's share alone, and around attention two all-to-alls (DeepSpeed Ulysses'
pattern) turn the share of all heads into the whole slice for ``1/N`` of the heads and back:

* :func:`gather_qkv` (before attention): q, k, v (B, heads, T/N, hs) -> (B, heads/N, T, hs), the three in one
  all-to-all. Attention then runs exactly as without sequence parallelism, over the slice and the KV carry of
  earlier slices, for this rank's heads (the carry holds only them: 1/N of the KV memory). Grouped-query K/V are
  split by their own heads (KV heads must divide by N).
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

import itertools
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

__all__ = ["SequenceShare", "gather_qkv", "scatter_heads"]


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
    """For each tensor: chunk ``i`` of dim 0 goes to rank ``i`` of the group, chunk ``i`` of its result came from
    rank ``i``; every tensor in one exchange. The backward is the same exchange of the gradients."""

    @staticmethod
    def forward(ctx: Any, group: Any, *parts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        return _exchange(parts, group)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        return (None, *_exchange(grads, ctx.group))


def _exchange(parts: tuple[torch.Tensor, ...], group: Any) -> tuple[torch.Tensor, ...]:
    """One all-to-all for every tensor of ``parts`` (each (N, ...), dim 0 the ranks; one per dtype): rank ``i``'s row of
    a dense (N, total) buffer holds chunk ``i`` of each tensor side by side, so q, k and v (whatever their head
    counts and widths) cost one collective per direction, not three: a small slice's all-to-all is latency, not
    bandwidth. Both buffers dense in row-major order: the collective reads and writes storage in that order (a
    gradient arriving through a permute has other strides; the copy into the buffer is the one copy each tensor
    takes, as ``contiguous()`` would)."""
    dtypes = list(dict.fromkeys(p.dtype for p in parts))
    if len(dtypes) > 1:   # one exchange per dtype
        out: list[Any] = [None] * len(parts)
        for dtype in dtypes:
            where = [i for i, p in enumerate(parts) if p.dtype == dtype]
            for i, got in zip(where, _exchange(tuple(parts[i] for i in where), group)):
                out[i] = got
        return tuple(out)
    n = parts[0].shape[0]
    sizes = [p[0].numel() for p in parts]
    send = torch.empty((n, sum(sizes)), dtype=parts[0].dtype, device=parts[0].device)
    received = torch.empty_like(send)
    offsets = list(itertools.accumulate([0, *sizes]))
    for offset, size, part in zip(offsets, sizes, parts):
        send[:, offset:offset + size].view(part.shape).copy_(part)
    dist.all_to_all_single(received, send, group=group)
    return tuple(received[:, offset:offset + size].view(part.shape)
                 for offset, size, part in zip(offsets, sizes, parts))


def _check_heads(x: torch.Tensor, share: SequenceShare, what: str) -> None:
    if x.shape[1] % share.degree:
        raise ValueError(f"terapipe.sequence_parallel={share.degree}: attention {what} has {x.shape[1]} heads, not "
                         f"a multiple of {share.degree} (each sequence rank attends with 1/{share.degree} of the "
                         "heads); use a sequence-parallel degree that divides the (key/value) head count")


def gather_qkv(tensors: Sequence[torch.Tensor], share: SequenceShare,
               whats: Sequence[str] = ("q", "k/v", "k/v")) -> tuple[torch.Tensor, ...]:
    """Each (B, heads, T/N, hs) of this rank's tokens -> (B, heads/N, T, hs): the whole slice for this rank's heads.
    For queries, keys and values (their head counts and widths may differ), all in one all-to-all."""
    for x, what in zip(tensors, whats):
        _check_heads(x, share, what)
    n = share.degree
    parts = [x.reshape(x.shape[0], n, x.shape[1] // n, *x.shape[2:]).transpose(0, 1) for x in tensors]
    got = _AllToAll.apply(share.group, *parts)   # (N, B, h/N, t, hs) each: to rank i, then from rank i
    return tuple(g.permute(1, 2, 0, 3, 4).reshape(g.shape[1], g.shape[2], n * g.shape[3], g.shape[4]) for g in got)


def scatter_heads(x: torch.Tensor, share: SequenceShare) -> torch.Tensor:
    """(B, heads/N, T, hs) -> (B, heads, T/N, hs): every head of this rank's tokens (the inverse of
    :func:`gather_qkv`)."""
    n = share.degree
    b, hn, tt, d = x.shape
    parts = x.reshape(b, hn, n, tt // n, d).permute(2, 0, 1, 3, 4)       # (N, B, h/N, t, hs): rank i's tokens
    (got,) = _AllToAll.apply(share.group, parts)   # (N, B, h/N, t, hs): head subset i
    return got.transpose(0, 1).reshape(b, n * hn, tt // n, d)
