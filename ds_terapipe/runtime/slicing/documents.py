"""Packed documents: rows that hold several documents, each token attending to its own document only.

Long-context training packs documents into fixed-length rows; fine-tuning packs examples. A row's structure is
given the Hugging Face way (what ``DataCollatorWithFlattening`` produces): ``position_ids`` that restart at 0
where a document starts, batches ``((input_ids, position_ids), labels)``. Two things follow for every layer:

* attention: a query sees the keys of its own document only (and, causally, only earlier ones): a key ``j``
  is visible to query ``i`` iff ``j <= i`` and both lie in the same document (with a sliding window ``w``, also
  ``i - j < w``). Documents are numbered by the restarts (:meth:`Documents.ids`), so a slice of a row needs the
  positions of the row up to its end: the keys held in the KV carry from earlier slices keep their documents;
* positions: each document starts at position 0 (learned position embeddings and rotary alike), so a layer
  takes :func:`slice_positions` rather than ``token_offset() + arange(T)``.

In the token pipeline the engine keeps one :class:`Documents` per micro-batch on each rank (the first stage
from the batch, the others from the positions each slice's activations carry) and hands it to the slice
context. For a plain forward (a single-process reference, inference) :func:`packed_documents` sets the same
structure around the call. On a CPU the mask is dense; it is built once per slice and shared by every attention
layer of the slice. Keys of documents that ended before a slice starts (in every row of the micro-batch) are not
attended to at all (:meth:`Documents.first_visible`): a slice deep in a row of short documents pays attention
over its own documents' prefix, not the row's.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch

from .blocks import MAX_BLOCKS, Block
from .context import current_slice

__all__ = ["Documents", "causal_visible", "check_position_ids", "chunked_documents", "current_documents",
           "packed_documents", "packed_rows", "positions_of", "slice_positions"]


def check_position_ids(ids: Any, positions: Any, where: str = "batch") -> None:
    """Refuse position ids that do not describe packed documents of ``ids`` (ValueError with the rule and fix)."""
    if not torch.is_tensor(positions) or positions.is_floating_point() or positions.dim() != 2:
        got = f"{positions.dtype} {tuple(positions.shape)}" if torch.is_tensor(positions) else type(positions).__name__
        raise ValueError(f"token pipeline: {where}: position_ids must be an integer tensor (batch, seq_len) that "
                         f"restarts at 0 where each packed document starts, got {got}; pass "
                         "((input_ids, position_ids), labels)")
    if not torch.is_tensor(ids) or tuple(ids.shape[:2]) != tuple(positions.shape):
        got = tuple(ids.shape) if torch.is_tensor(ids) else type(ids).__name__
        raise ValueError(f"token pipeline: {where}: input_ids {got} and position_ids {tuple(positions.shape)} "
                         "differ in shape; give one position id per token")
    if positions.numel() and int(positions.min()) >= 0 and int(positions.max()) <= 1 and \
            bool(((positions[:, 1:] == 1) & (positions[:, :-1] == 1)).any()):
        raise ValueError(f"token pipeline: {where}: position_ids look like an attention mask (only 0 and 1, with "
                         "runs of 1); packed rows take position ids that restart at 0 per document, and padding "
                         "masks are not supported with token slicing: pack documents into full rows instead")
    if bool((positions[:, 0] != 0).any()):
        raise ValueError(f"token pipeline: {where}: position_ids must start each row at 0 (a row starts a "
                         f"document), got first positions {positions[:, 0].tolist()}")
    step = positions[:, 1:] - positions[:, :-1]
    bad = (step != 1) & (positions[:, 1:] != 0)
    if bool(bad.any()):
        row, col = (int(i) for i in bad.nonzero()[0])
        raise ValueError(f"token pipeline: {where}: position_ids must count up by 1 within a document and "
                         f"restart at 0 at the next one; row {row} goes {int(positions[row, col])} -> "
                         f"{int(positions[row, col + 1])} at token {col + 1}")


def positions_of(inputs: Any) -> Optional[torch.Tensor]:
    """A micro-batch's (B, L) position ids: ``(ids, position_ids)`` for packed rows, ``arange`` for plain ids
    (one document per row); None when the inputs are neither."""
    if isinstance(inputs, (tuple, list)) and len(inputs) == 2 and torch.is_tensor(inputs[1]) and \
            inputs[1].dim() == 2:
        return inputs[1]
    if torch.is_tensor(inputs) and inputs.dim() == 2 and not inputs.is_floating_point():
        return torch.arange(inputs.shape[1]).expand(inputs.shape[0], -1)
    return None


class Documents:
    """The document structure of one micro-batch: ``positions`` (B, L), filled as the slices arrive."""

    def __init__(self, positions: torch.Tensor, filled: Optional[int] = None) -> None:
        self.positions = positions
        # Rows [0, filled) are known. Rows are written once: a layer may keep a view of them for its backward
        # (an embedding saves its indices), and a rewrite would invalidate that view.
        self.filled = positions.shape[1] if filled is None else filled
        self._masks: dict[tuple, torch.Tensor] = {}
        self._blocks: dict[tuple, Optional[list[Block]]] = {}
        self._first: dict[int, int] = {}
        self._chunked: dict[int, Documents] = {}

    @classmethod
    def empty(cls, batch: int, seq_len: int, device: torch.device) -> "Documents":
        """To be filled slice by slice (a stage that receives positions with each slice's activations)."""
        return cls(torch.zeros(batch, seq_len, dtype=torch.int64, device=device), filled=0)

    def write(self, start: int, positions: torch.Tensor) -> None:
        """Rows ``[start, start + T)`` (a slice arriving); rows already known (a rank holding two chunks gets
        each slice twice) are left as they are."""
        end = start + positions.shape[1]
        if end <= self.filled:
            return
        if start != self.filled:
            raise RuntimeError(f"packed documents: slice rows [{start}, {end}) arrived after rows [0, "
                               f"{self.filled}); slices of a micro-batch must arrive in order")
        self.positions[:, start:end] = positions
        self.filled = end

    def chunked(self, chunk: int) -> "Documents":
        """These rows under chunked attention: every document cut into chunks of ``chunk`` tokens counted from its
        own start, as documents (their positions are the position ids modulo ``chunk``). Rebuilt when more rows
        are known; the rows' masks and blocks are then cached on it."""
        got = self._chunked.get(chunk)
        if got is None or got.filled != self.filled:
            got = Documents(self.positions % chunk, self.filled)
            self._chunked[chunk] = got
        return got

    def ids(self, end: int) -> torch.Tensor:
        """(B, end): the document index of each token of ``[0, end)`` (0 for the row's first document)."""
        return (self.positions[:, :end] == 0).cumsum(dim=1)

    def first_visible(self, start: int) -> int:
        """The first key any query of a slice starting at ``start`` can see: the earliest start, over the rows, of
        the document token ``start`` is in. Keys before it belong to documents that ended: attention skips them.
        Once per slice (the value is cached: on an accelerator reading it waits for the device)."""
        first = self._first.get(start)
        if first is None:
            first = int((start - self.positions[:, start]).min().clamp(min=0))
            self._first = {start: first}
        return first

    def blocks(self, start: int, end: int, first_key: int = 0) -> Optional[list[Block]]:
        """The slice ``[start, end)`` as exact attention blocks over keys ``[first_key, end)`` (key indices from
        ``first_key``): per document of the slice one causal block, plus a full block over the earlier part of
        the document the slice starts in (:mod:`~ds_terapipe.runtime.slicing.blocks`). Rows with the same
        documents share blocks. None when the slice holds more than ``MAX_BLOCKS`` blocks: the dense mask is
        cheaper then. Cached like :meth:`mask`."""
        key = (start, end, first_key)
        if key in self._blocks:
            return self._blocks[key]
        pos = self.positions[:, start:end].cpu()                                       # (B, T)
        rows: list[tuple[tuple[int, int, int], ...]] = []
        for row in pos:
            cuts = (row == 0).nonzero().flatten().tolist()
            bounds = ([] if cuts[:1] == [0] else [0]) + cuts + [end - start]
            first = start - int(row[0]) - first_key                                    # the first document's start
            rows.append(tuple((q0, q1, first if i == 0 else start + q0 - first_key)
                              for i, (q0, q1) in enumerate(zip(bounds, bounds[1:]))))
        out: list[Block] = []
        row0 = 0
        for r in range(1, len(rows) + 1):                                              # runs of equal rows
            if r == len(rows) or rows[r] != rows[row0]:
                out += [Block(row0, r, q0, q1, p0, start + q0 - first_key) for q0, q1, p0 in rows[row0]]
                row0 = r
        result = out if len(out) <= MAX_BLOCKS else None
        self._blocks = {key: result}  # one slice at a time, as the masks
        return result

    def mask(self, start: int, end: int, dtype: torch.dtype, first_key: int = 0,
             window: Optional[int] = None) -> torch.Tensor:
        """(B, 1, end - start, end - first_key) additive mask: query ``start + r`` sees key ``first_key + j`` iff
        :func:`causal_visible` says so (causal, within ``window``) and both are in the same document (-inf
        elsewhere). Cached: every attention layer of a slice reuses it."""
        key = (start, end, dtype, first_key, window)
        mask = self._masks.get(key)
        if mask is None:
            docs = self.ids(end)
            same = docs[:, start:end, None] == docs[:, None, first_key:]                 # (B, T, end - first_key)
            visible = (same & causal_visible(start, end, first_key, window, docs.device)).unsqueeze(1)
            mask = torch.zeros(visible.shape, dtype=dtype, device=docs.device).masked_fill(~visible, float("-inf"))
            # one slice at a time: the previous slice's masks are no longer needed (a slice's full and sliding
            # layers, and the query blocks of its windowed layers, each keep theirs)
            ctx = current_slice()
            if ctx is not None:
                self._masks = {k: m for k, m in self._masks.items() if ctx.start <= k[0] and k[1] <= ctx.end}
            elif len(self._masks) >= _UNSLICED_MASKS:
                self._masks.clear()
            self._masks[key] = mask
        return mask


#: Masks kept outside a slice context (an unsliced forward over packed rows: its layers and query blocks).
_UNSLICED_MASKS = 64


def causal_visible(start: int, end: int, first_key: int, window: Optional[int], device: torch.device
                   ) -> torch.Tensor:
    """(end - start, end - first_key) booleans: query ``t`` in ``[start, end)`` sees key ``k`` in ``[first_key,
    end)`` iff ``k <= t`` and, with a sliding ``window``, ``t - k < window`` (at most ``window`` keys, itself
    included: transformers' ``sliding_window_causal_mask_function``)."""
    query = torch.arange(start, end, device=device).unsqueeze(1)                      # (T, 1)
    key = torch.arange(first_key, end, device=device).unsqueeze(0)                    # (1, end - first_key)
    visible = key <= query
    if window is not None:
        visible &= query - key < window
    return visible


_ROWS: dict[tuple, Documents] = {}


def chunked_documents(documents: Optional[Documents], chunk: int, batch: int, seq_len: int,
                      device: torch.device) -> Optional[Documents]:
    """The attention structure of chunked attention (Llama 4's ``attention_chunk_size``) as documents: query ``t``
    sees key ``k`` iff ``k <= t``, both lie in the same document, and in the same chunk of it, chunk
    ``position // chunk`` by their position ids (``transformers``' ``chunked_overlay`` over the positions it remaps
    packed rows to). Rows of one document each are cut at the multiples of ``chunk``; packed rows within each
    document, from its start. Either way block-diagonal causal attention, which every documents' path (the CPU's
    fused blocks, one SDPA call per block on an accelerator, the dense mask) runs exactly. ``documents`` unchanged
    (None: rows of one document) where no chunk boundary falls inside the ``seq_len`` tokens."""
    if chunk >= seq_len:
        return documents
    if documents is not None:
        return documents.chunked(chunk)
    key = (batch, seq_len, chunk, str(device))
    rows = _ROWS.get(key)
    if rows is None:
        if len(_ROWS) > 16:
            _ROWS.clear()
        rows = Documents((torch.arange(seq_len, device=device) % chunk).expand(batch, -1))   # (B, L), one copy
        _ROWS[key] = rows
    return rows


_local = threading.local()


def current_documents() -> Optional[Documents]:
    """The documents of the running forward: the slice context's, else those :func:`packed_documents` set."""
    ctx = current_slice()
    if ctx is not None:
        return ctx.documents
    return getattr(_local, "documents", None)


@contextmanager
def packed_documents(position_ids: Optional[torch.Tensor]) -> Iterator[Optional[Documents]]:
    """Run a plain (unsliced) forward over packed rows: ``position_ids`` (B, L) restarting at 0 per document.

    ``with packed_documents(pos): loss = model(ids)`` applies the same document mask and positions as the
    token pipeline does with ``((ids, pos), labels)`` batches. None: rows are one document each."""
    previous = getattr(_local, "documents", None)
    _local.documents = None if position_ids is None else Documents(position_ids)
    try:
        yield _local.documents
    finally:
        _local.documents = previous


@torch.compiler.disable
def slice_positions(tokens: int, device: torch.device, max_positions: Optional[int] = None,
                    refusal: str = "positions up to {end} exceed the position table's {max_positions}") -> torch.Tensor:
    """Position ids of the running slice's ``tokens`` tokens: (B, T) within their documents for packed rows,
    else (T,) ``token_offset() + arange(T)``. Outside torch.compile's graphs: traced, the slice's offset would be
    a constant of the graph, and every slice of a micro-batch would compile its layers again.

    ``max_positions``: a position table's length; a slice reaching past it raises ``ValueError(refusal)``, with
    ``{end}`` in ``refusal`` the end of the slice's positions and ``{max_positions}`` the length (checked here,
    outside the graphs, for the same reason: the check reads the offset)."""
    ctx = current_slice()
    docs = current_documents()
    start = 0 if ctx is None else ctx.position_start
    if max_positions is not None and start + tokens > max_positions:
        raise ValueError(refusal.format(end=start + tokens, max_positions=max_positions))
    if docs is not None:
        return docs.positions[:, start:start + tokens].to(device)
    return torch.arange(start, start + tokens, device=device)


def packed_rows(tokens: Any, starts: Any, begins: Any, seq_len: int
                ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Windows of a corpus of concatenated documents as packed rows in the convention above:
    ``((input_ids, position_ids), labels)``, each (len(begins), seq_len).

    ``tokens``: the corpus (N,) integers; ``starts``: each document's first index into it, ascending, from 0;
    ``begins``: where each row's window starts (``begin + seq_len < N``). The position ids restart at 0 where a
    document starts inside the window (the window's first document starts at 0 too); the labels are the next
    tokens, -100 where the next token belongs to another document, so no prediction crosses a boundary and the loss
    counts each token's prediction within its document once."""
    import numpy as np

    tokens, starts = np.asarray(tokens), np.asarray(starts)
    begins = np.asarray(begins, dtype=np.int64).reshape(-1, 1)
    index = begins + np.arange(seq_len + 1)                          # (B, L + 1) corpus positions
    doc = np.searchsorted(starts, index, side="right")               # each token's document
    first = np.maximum(starts[doc - 1], begins)                      # where that document starts in the window
    ids = torch.from_numpy(tokens[index].astype(np.int64))
    positions = torch.from_numpy(index - first)
    labels = ids[:, 1:].clone()
    labels[torch.from_numpy(doc[:, 1:] != doc[:, :-1])] = -100
    return (ids[:, :-1].contiguous(), positions[:, :-1].contiguous()), labels
