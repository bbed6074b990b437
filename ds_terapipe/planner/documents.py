"""Planning packed rows by their documents: a slice's attention costs its context inside its own document.

In a packed row a query sees the keys of its own document only, and the runtime skips the keys of documents that
ended before a slice starts (``runtime/slicing/documents.py``): a slice starting at token ``a`` attends over the
keys ``[a - c, a + s)`` with ``c`` the position of token ``a`` inside its document (the largest over the rows of
the micro-batch, which share one slicing). So the cost model's ``forward_ms(s, context)`` still describes a
slice exactly, with ``context = c`` rather than ``a``: the same row length costs less, and its best cuts move,
when documents end inside it. A cut at a document boundary starts the next slice at context 0.

Everything the planner runs (the DP tables, the lower bounds, the simulator) asks for a slice's cost with its
start as the context. :func:`within_documents` wraps a :class:`~ds_terapipe.planner.cost.PipelineCost` so that
every such call reads the document context at that start instead: the planner and the simulator run unchanged.

A step's micro-batches share one slicing. Each has its own documents; the step pays the sum of their slices'
costs, which for costs linear in the context (attention is) is the cost at their mean context:
:func:`document_context` takes the mean over micro-batches of the per-micro-batch context at each grid start.

:class:`DocumentPlanner` plans per batch: contexts rounded to ``quantum`` tokens form the key of a bounded
memo, so rows with the same document layout (up to the quantum) reuse a plan, and the work per new layout is
one ``plan_slicing`` call (timed: :attr:`DocumentPlanner.planning_ms`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Callable, Hashable, Sequence

import numpy as np

from .cost import ArrayLike, ChunkCostView, PipelineCost, StageCost

__all__ = ["DocumentPlanner", "WithinDocuments", "document_context", "within_documents"]


def document_context(positions: Sequence[Any], granularity: int) -> np.ndarray:
    """(L / granularity,) float: at each grid start ``a = k * granularity``, the mean over micro-batches of the
    largest position id over a micro-batch's rows (the context its slice starting at ``a`` attends over).

    ``positions``: one (B, L) integer array per micro-batch (numpy or anything ``np.asarray`` reads), position ids
    restarting at 0 per document."""
    if not len(positions):
        raise ValueError("document_context needs the position ids of at least one micro-batch")
    per_batch = [np.asarray(p)[:, ::granularity].max(axis=0) for p in positions]
    lengths = {len(c) for c in per_batch}
    if len(lengths) != 1:
        raise ValueError(f"document_context: micro-batches of different lengths ({sorted(lengths)} grid starts); "
                         "one slicing covers micro-batches of one length")
    return np.mean(per_batch, axis=0, dtype=float)


class WithinDocuments(ChunkCostView):
    """A chunk's cost where the context a caller passes is a slice's *start* (a multiple of ``granularity``),
    read as the document context at that start (``context[start // granularity]``). Everything else is the
    chunk's own."""

    def __init__(self, chunk: StageCost, context: np.ndarray, granularity: int) -> None:
        super().__init__(chunk)
        self.granularity = int(granularity)
        self.context = np.asarray(context, dtype=float)
        self._key = (self.granularity, self.context.tobytes())

    def _at(self, start: ArrayLike) -> np.ndarray:
        index = np.asarray(start) // self.granularity
        return self.context[np.clip(index.astype(np.int64), 0, len(self.context) - 1)]

    def forward_ms(self, slice_len: ArrayLike, context: ArrayLike, batch: ArrayLike = 1) -> Any:
        return self.chunk.forward_ms(slice_len, self._at(context), batch)

    def backward_ms(self, slice_len: ArrayLike, context: ArrayLike, batch: ArrayLike = 1) -> Any:
        return self.chunk.backward_ms(slice_len, self._at(context), batch)

    def covers(self, slice_len: ArrayLike, context: ArrayLike, batch: ArrayLike | None = None) -> bool:
        return self.chunk.covers(slice_len, self._at(context), batch)

    def cache_key(self) -> Hashable:
        return ("within-documents", self.chunk.cache_key(), self._key)


def within_documents(cost: PipelineCost, context: np.ndarray, granularity: int) -> PipelineCost:
    """``cost`` with every chunk read at the document ``context`` of a slice's start (:func:`document_context`
    gives it): plan or simulate this for packed rows. The step and vocabulary terms do not depend on context."""
    if not isinstance(cost, PipelineCost):
        raise TypeError(f"cost must be a PipelineCost, got {type(cost).__name__}")
    context = np.asarray(context, dtype=float)
    if context.ndim != 1 or not len(context) or not np.all(np.isfinite(context)) or context.min() < 0:
        raise ValueError(f"document context must be a non-empty 1-D array of finite contexts >= 0, got "
                         f"shape {context.shape}")
    # one wrapper per distinct chunk model, so the planner still evaluates shared chunk models once
    wrapped: dict[Hashable, WithinDocuments] = {}
    stages = [wrapped.setdefault(st.cache_key(), WithinDocuments(st, context, granularity)) for st in cost.stages]
    return PipelineCost(stages, meta=cost.meta, step=cost.step, vocab=cost.vocab)


class DocumentPlanner:
    """Per-batch plans for packed rows, memoised by document layout.

    ``plan(seq_len, context)`` returns ``solve(seq_len, cost_within_documents)``'s result for the context rounded
    down to ``quantum`` tokens (at least the planning granularity): two batches whose documents end at nearly the
    same places share a plan. At most ``capacity`` layouts are kept (least recently used dropped), so memory is
    bounded whatever the data; ``planning_ms`` holds the wall time of every call (hits cost a dictionary lookup).
    """

    def __init__(self, cost: PipelineCost, granularity: int, solve: Callable[[int, PipelineCost], Any], *,
                 quantum: int | None = None, capacity: int = 256) -> None:
        self.cost, self.granularity, self.solve = cost, int(granularity), solve
        self.quantum = max(self.granularity, int(quantum or self.granularity))
        self.capacity = int(capacity)
        self._memo: OrderedDict[tuple, Any] = OrderedDict()
        self.planning_ms: list[float] = []
        self.hits = 0

    def key(self, seq_len: int, context: np.ndarray) -> tuple:
        return (int(seq_len), tuple((np.asarray(context) // self.quantum * self.quantum).astype(np.int64).tolist()))

    def plan(self, seq_len: int, context: np.ndarray) -> Any:
        began = time.perf_counter()
        key = self.key(seq_len, context)
        found = self._memo.get(key)
        if found is not None:
            self._memo.move_to_end(key)
            self.hits += 1
        else:
            found = self.solve(seq_len, within_documents(self.cost, np.asarray(key[1], dtype=float),
                                                         self.granularity))
            self._memo[key] = found
            if len(self._memo) > self.capacity:
                self._memo.popitem(last=False)
        self.planning_ms.append((time.perf_counter() - began) * 1e3)
        return found
