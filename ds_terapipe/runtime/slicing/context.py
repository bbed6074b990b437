"""The slice context: what a layer needs to know while one token slice runs through it.

A token pipeline runs each micro-batch as several slices of the sequence. Position-wise layers do not care,
but two kinds of layer do: attention, which must see the keys/values of all earlier slices of the same
micro-batch, and position embeddings, which need the slice's token offset. The engine opens a
:class:`SliceContext` around every slice's forward; layers read it with :func:`current_slice`. Outside the
engine (a plain forward, stock DeepSpeed, inference) there is no context and layers behave as usual, so one
model definition serves both.

Keys/values live in one full-length buffer per (micro-batch, attention call) on each stage: slice ``i``
writes its own rows and reads rows ``[0, end_i)`` as a view, never a copy. An attention call is identified by
its ``cache_key`` *and* how many calls with that key came before it in the same slice's forward
(:meth:`SliceContext.kv_buffers`), so a layer applied twice (shared weights, a block reused in a loop) or two
layers given the same key get a buffer each: every slice runs the stage's layers in the same order, so the
n-th call of slice ``i`` and the n-th call of slice ``j`` are the same attention. Their gradients accumulate in a
buffer of the same shape; because backwards run later slices first, slice ``i``'s backward finds the
contributions of all later slices already there (see :mod:`ds_terapipe.runtime.slicing.attention`).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterator

import torch

__all__ = ["KVBuffers", "MicroBatchState", "SliceContext", "current_slice", "token_offset", "slice_scope",
           "cut_tokens"]


class KVBuffers:
    """Full-length key/value storage of one attention layer for one micro-batch on one stage.

    ``k``/``v`` are read through views (``k[:, :, :end]``) that autograd saves for backward; writes of later
    slices go through ``k_w`` (the ``.data`` alias, which has its own version counter), so appending a slice
    never invalidates what earlier slices saved. Positions are written once and never rewritten, which is
    what makes that safe.
    """

    def __init__(self, like_k: torch.Tensor, like_v: torch.Tensor, seq_len: int) -> None:
        batch, heads, _, k_dim = like_k.shape
        v_dim = like_v.shape[-1]
        opts = dict(dtype=like_k.dtype, device=like_k.device)
        # No zero-fill: slice i writes rows [start, end) before reading [0, end), and earlier rows were
        # written by earlier slices. Gradients accumulate, so those buffers start at zero.
        self.k = torch.empty(batch, heads, seq_len, k_dim, **opts)  # (B, nh, L, hs)
        self.v = torch.empty(batch, heads, seq_len, v_dim, **opts)  # (B, nh, L, hs)
        self.k_w = self.k.data
        self.v_w = self.v.data
        # Gradients w.r.t. cached keys/values, filled by later slices' backwards (add_grad); allocated by the
        # first backward (the last slice's), so forwards in flight do not hold them.
        self.grad_k: torch.Tensor | None = None
        self.grad_v: torch.Tensor | None = None

    def add_grad(self, which: str, grad: torch.Tensor, start: int, lo: int = 0) -> torch.Tensor:
        """Add the gradient w.r.t. cached rows ``[lo, end)`` of ``"k"`` or ``"v"`` (``grad``: (B, nh, end - lo, hs),
        from the backward of the slice ``[start, end)``, which read the keys from ``lo <= start`` on: a sliding
        window or packed documents leave the rows before it unread) and return rows ``[start, end)`` of the sum:
        that slice's whole gradient, its own part plus what later slices' backwards left there (a view into the
        buffer).

        One kernel per call (the first call, the last slice's, a copy; a first call that does not cover the whole
        buffer, as the profile's or a windowed one, a fill and the add): rows ``[lo, start)`` keep collecting for
        the earlier slices, whose backwards come later and read only rows before their own ``end <= start``, so
        the rows handed out are never written again. The buffer takes the memory layout of the gradient the
        attention kernel produces, so adding into it reads both alike, and the rows handed out keep the layout a
        fused projection's backward can read without a copy (the CPU flash kernel: (B, T, nh, hs) in memory).
        """
        acc = self.grad_k if which == "k" else self.grad_v
        end = lo + grad.shape[2]
        if acc is None:
            full = self.k.shape[2]
            whole = lo == 0 and end == full
            acc = grad.clone() if whole else _zeros_in_layout_of(grad, full)
            if which == "k":
                self.grad_k = acc
            else:
                self.grad_v = acc
            if whole:
                return acc[:, :, start:end]
        acc[:, :, lo:end].add_(grad)
        return acc[:, :, start:end]

    def nbytes(self) -> int:
        tensors = [self.k, self.v, self.grad_k, self.grad_v]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _zeros_in_layout_of(like: torch.Tensor, length: int) -> torch.Tensor:
    """Zeros of ``like``'s shape with dim 2 ``length`` long, laid out in memory in ``like``'s dimension order (dims
    of size 1 outermost, their strides say nothing); contiguous where ``like`` is expanded (a stride of 0)."""
    sized = [like.shape[d] > 1 or d == 2 for d in range(like.dim())]
    if any(like.stride(d) == 0 for d in range(like.dim()) if sized[d]):
        order = list(range(like.dim()))
    else:   # outermost first
        order = sorted(range(like.dim()), key=lambda d: (sized[d], -like.stride(d)))
    shape = list(like.shape)
    shape[2] = length
    dense = torch.zeros([shape[d] for d in order], dtype=like.dtype, device=like.device)
    return dense.permute([order.index(d) for d in range(like.dim())])


@dataclass
class MicroBatchState:
    """Per-(micro-batch, stage) state that outlives one slice: KV buffers and backward progress."""

    microbatch: int
    seq_len: int
    num_slices: int
    kv: dict[Hashable, KVBuffers] = field(default_factory=dict)
    # Slices whose backward finished, to check the later-slices-first invariant at run time.
    backward_done: set[int] = field(default_factory=set)
    # With deferred weight gradients: the micro-batch's WeightGradStash (runtime/slicing/deferred.py), else None.
    weight_stash: Any = None
    # Linears marked by enable_fused_grad_accumulation add their weight gradients into .grad inside the GEMM
    # (runtime/slicing/deferred.py): the engine sets it for training, the profile while it times that backward.
    fuse_grad_accumulation: bool = False

    def buffers(self, key: Hashable, like_k: torch.Tensor, like_v: torch.Tensor) -> KVBuffers:
        bufs = self.kv.get(key)
        if bufs is None:
            bufs = KVBuffers(like_k, like_v, self.seq_len)
            self.kv[key] = bufs
        return bufs

    def nbytes(self) -> int:
        return sum(b.nbytes() for b in self.kv.values())


@dataclass
class SliceContext:
    """The slice being computed: micro-batch, slice index and its token range ``[start, end)``."""

    microbatch: int
    slice_index: int
    start: int
    end: int
    state: MicroBatchState
    # Packed rows: the micro-batch's documents (runtime/slicing/documents.py Documents), else None.
    documents: Any = None
    # Sequence parallelism: this rank's SequenceShare (runtime/slicing/sequence.py), else None. The layers then
    # run on its share of [start, end); attention gathers the whole slice for its heads.
    sequence: Any = None
    # Attention calls so far in this slice's forward, per cache key (see kv_buffers).
    kv_calls: dict[Hashable, int] = field(default_factory=dict, repr=False)

    def kv_buffers(self, cache_key: Hashable, like_k: torch.Tensor, like_v: torch.Tensor) -> KVBuffers:
        """The KV buffers of the next attention call with ``cache_key`` in this slice's forward.

        Keyed by (cache_key, occurrence): the n-th call with a key in slice ``i`` and the n-th in slice ``j`` are
        the same attention (a stage runs its layers in the same order for every slice), while two calls in one
        forward never share a buffer, whatever the model passes as key.
        """
        occurrence = self.kv_calls.get(cache_key, 0)
        self.kv_calls[cache_key] = occurrence + 1
        return self.state.buffers((cache_key, occurrence), like_k, like_v)

    @property
    def seq_len(self) -> int:
        return self.state.seq_len

    @property
    def num_slices(self) -> int:
        return self.state.num_slices

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def position_start(self) -> int:
        """Global position of this rank's first token: ``start``, or its share's start under sequence
        parallelism."""
        return self.start if self.sequence is None else self.sequence.bounds(self.start, self.end)[0]


_local = threading.local()


def current_slice() -> SliceContext | None:
    """The slice context of the running forward, or None outside a token pipeline (plain forward)."""
    return getattr(_local, "ctx", None)


def token_offset() -> int:
    """Global position of the first token of the running slice (0 outside a token pipeline; under sequence
    parallelism the first token of this rank's share).

    Position embeddings (learned or rotary) add this to ``arange(T)``.
    """
    ctx = current_slice()
    return 0 if ctx is None else ctx.position_start


@contextmanager
def slice_scope(ctx: SliceContext | None) -> Iterator[SliceContext | None]:
    """Make ``ctx`` the current slice for the duration of one forward."""
    previous = current_slice()
    _local.ctx = ctx
    try:
        yield ctx
    finally:
        _local.ctx = previous


def cut_tokens(value: Any, start: int, end: int, seq_len: int) -> Any:
    """Tokens ``[start, end)`` of every tensor whose dim 1 is the sequence (``seq_len`` long); other values,
    and tensors without that dimension, pass whole (they are the same for every slice)."""
    if torch.is_tensor(value):
        return value[:, start:end] if value.dim() >= 2 and value.shape[1] == seq_len else value
    if isinstance(value, (tuple, list)):
        return tuple(cut_tokens(v, start, end, seq_len) for v in value)
    return value
