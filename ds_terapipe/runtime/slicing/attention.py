"""Causal self-attention over the cached prefix, with cache gradients carried backward.

Slice ``i`` of a sequence (tokens ``[start, end)``) attends to every earlier token of its micro-batch, so its
keys/values are the rows ``[0, end)`` of a full-length buffer (:class:`~ds_terapipe.runtime.slicing.context.KVBuffers`)
into which each slice writes its own rows. :class:`_PrefixKV` does that write and returns the ``[0, end)``
view; its backward adds the incoming gradient into a gradient buffer of the same length, in one kernel:

* rows ``[0, start)`` belong to earlier slices: they collect there until the backwards of those slices (which
  run later: backwards go later slices first) pick them up;
* rows ``[start, end)`` are this slice's own keys/values: after the add they hold this slice's part plus
  whatever later slices accumulated there, and are returned as they lie (a view).

With a sliding window ``w`` (``window=``, as Mistral's or Gemma's sliding layers) the slice's queries see only
the keys ``[start - w + 1, end)``: the view starts there, and rows before it are neither read nor handed gradients
(likewise keys of documents that ended before the slice, for packed rows). Where the window hides keys, a slice
longer than ``max(w, WINDOW_QUERY_BLOCK)`` runs its queries in blocks of that many, each over the keys its own
window leaves (:func:`window_query_blocks`): a band-masked call scores every query against every key it is handed,
so the blocks keep that near ``T * 2w`` scores instead of ``T * (T + w)``.

With chunked attention (``chunk=C``, Llama 4's chunked layers) a query sees the earlier keys of its own chunk only,
chunks of ``C`` tokens counted from the start of its row (of its document, for packed rows), rotary positions running
on across them. That is the shape of packed documents, so the slice runs as packed rows whose documents are the
chunks (:func:`~ds_terapipe.runtime.slicing.documents.chunked_documents`): it reads the keys from the start of its
first query's chunk on, each chunk of the slice is one fused causal block on a CPU and one SDPA call on an
accelerator, and windows, softcaps and sinks apply within the chunks as they do within documents.

With attention-logit softcapping (``softcap=``, Gemma 2's ``attn_logit_softcapping``) the scores are
``softcap * tanh(q @ k^T * scale / softcap)`` before the mask: no SDPA kernel takes that, so the slice runs the
plain math over the same keys/values view, under the same additive mask.

With attention sinks (``sinks=``, gpt-oss: one learned logit per query head that joins each softmax's denominator
and carries no value) the output is ``o * exp(lse - logaddexp(lse, sink))``, ``o`` and ``lse`` the attention and
log-sum-exp over the visible keys. Where a slice runs the CPU's fused blocks (``blocks.py``) the sink is merged into
their log-sum-exp and the flash backward, handed the merged output and log-sum-exp, gives the exact q/k/v gradients.
Public SDPA returns no log-sum-exp, so on an accelerator the sink rides as one more key whose value is zero
(:func:`_sinks_as_key`: one fused call over widened q/k/v, one per document block for packed rows), and every other
path (windows that hide keys, the dense-mask fallbacks) runs the plain math with the sink as one more logit.

No graph is traversed twice and nothing full-length is copied per slice. Adapting an existing attention is a
one-line change: replace ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` with
``sliced_causal_attention(q, k, v, cache_key=self)``, and take position ids (learned or rotary) from
:func:`~ds_terapipe.runtime.slicing.documents.slice_positions` (the slice's offset, or packed rows' positions).
"""

from __future__ import annotations

import math
from typing import Hashable

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import blocks as blocks_mod
from .blocks import block_attention, fused_ok, gqa_kwargs, prefix_blocks, sdpa_blocks
from .context import KVBuffers, SliceContext, current_slice
from .devices import lower_right_bias, prefix_causal_bias
from .documents import Documents, causal_visible, chunked_documents, current_documents, slice_positions
from .sequence import gather_qkv, scatter_heads

__all__ = ["CausalSelfAttention", "sliced_causal_attention"]


class _PrefixKV(torch.autograd.Function):
    """Append a slice's keys (or values) to the cache and return the cached prefix including them."""

    @staticmethod
    def forward(ctx, new: torch.Tensor, bufs: KVBuffers, which: str, start: int, lo: int) -> torch.Tensor:
        end = start + new.shape[2]
        writable = bufs.k_w if which == "k" else bufs.v_w
        writable[:, :, start:end].copy_(new)
        ctx.bufs, ctx.which, ctx.start, ctx.lo = bufs, which, start, lo
        root = new if new._base is None else new._base   # a view's gradient reaches its base through views
        ctx.leaf = root.grad_fn is None
        full = bufs.k if which == "k" else bufs.v
        return full[:, :, lo:end]  # (B, nh, end - lo, hs), a view: the rows [lo, end) the slice's queries read

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # (B, nh, end - start, hs), a view into the buffer; rows before lo get nothing
        own = ctx.bufs.add_grad(ctx.which, grad, ctx.start, ctx.lo)
        # A leaf (or a view of one) would keep what it is handed as its ``.grad``, tying the whole buffer to it: give
        # it its own copy.
        return (own.clone() if ctx.leaf else own), None, None, None, None


_MASKS: dict[tuple, torch.Tensor] = {}


def _prefix_causal_mask(start: int, end: int, dtype: torch.dtype, device: torch.device, first_key: int = 0,
                        window: int | None = None) -> torch.Tensor:
    """(end - start, end - first_key) additive mask: query row r (global position start + r) sees the keys
    ``first_key + j`` that :func:`~ds_terapipe.runtime.slicing.documents.causal_visible` gives (<= start + r, and
    within ``window`` of it).

    Additive and already in the query dtype: SDPA would otherwise convert a boolean mask on every call, in
    every layer, and keep that copy for backward.
    """
    # The mask depends on the geometry alone (the rows, where the keys start relative to the first query, the
    # window): the interior query blocks of a windowed slice, and slices of the same length and offset, share one.
    key = (end - start, start - first_key, window, dtype, str(device))
    mask = _MASKS.get(key)
    if mask is None:
        if len(_MASKS) > 256:
            _MASKS.clear()
        visible = causal_visible(start, end, first_key, window, device)
        mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill(~visible, float("-inf"))
        _MASKS[key] = mask
    return mask


# Outside torch.compile's graphs (engine.compile()): the slice's keys/values are written into the KV buffers in place
# and views of them handed on, which AOT autograd cannot trace; the layers around each call compile.
@torch.compiler.disable
def sliced_causal_attention(q: torch.Tensor,
                            k: torch.Tensor,
                            v: torch.Tensor,
                            *,
                            cache_key: Hashable,
                            dropout_p: float = 0.0,
                            scale: float | None = None,
                            window: int | None = None,
                            softcap: float | None = None,
                            sinks: torch.Tensor | None = None,
                            chunk: int | None = None) -> torch.Tensor:
    """Causal attention of one slice over itself and the cached earlier slices of its micro-batch.

    Args:
        q, k, v: (B, nh, T, hs) for the running slice's T tokens (the whole sequence outside a pipeline); k and
            v may have fewer heads (B, nkv, T, hs), nh a multiple of nkv (grouped-query attention): the KV cache
            then holds nkv heads, and SDPA pairs query head h with key/value head h // (nh / nkv).
        cache_key: names the attention layer (``self`` is the usual choice). Each call within one slice's
            forward gets its own KV buffer, keyed by (cache_key, how many calls with this key came before it),
            so a layer applied twice (shared weights) or two layers passing the same key still train exactly.
        dropout_p, scale: as in ``torch.nn.functional.scaled_dot_product_attention``.
        window: sliding-window attention: query ``t`` sees key ``k`` iff ``k <= t`` and ``t - k < window`` (at most
            ``window`` keys, itself included, as ``transformers``' sliding-window mask); None: every earlier key.
            A slice ``[start, end)`` then reads only the cached rows ``[start - window + 1, end)``, and the key/value
            gradients it carries back land only in those.
        softcap: attention-logit softcapping: the scores (``q @ k^T * scale``) become ``softcap * tanh(scores /
            softcap)`` before the mask and softmax, as ``transformers``' Gemma 2 eager attention; computed as plain
            tensor math (dense (T, keys) scores per head, per query block under a window that hides keys) instead of
            SDPA. None: no capping.
        sinks: attention sinks, (nh,): head h's logit joins the denominator of every softmax of that head and
            contributes no value (``transformers``' gpt-oss ``s_aux``); the gradient reaches it. Exact on every path:
            merged into the fused blocks' log-sum-exp on a CPU, one more key in fused SDPA calls on an accelerator,
            plain math (dense scores per head, as with ``softcap``) under a window that hides keys. None: no
            sinks.
        chunk: chunked attention: query ``t`` sees key ``k`` iff ``k <= t`` and ``k // chunk == t // chunk`` (by
            position ids: within each document of packed rows, from its start), ``transformers``' chunked causal
            mask (Llama 4's ``attention_chunk_size``). A slice reads only the cached rows from the start of its first
            query's chunk. Combines with ``window``, ``softcap`` and ``sinks``, all within the chunks. None: no
            chunks.

    Returns:
        (B, nh, T, hs), equal to rows ``[start, end)`` of unsliced causal attention over the whole sequence.
    """
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"sliced_causal_attention: window={window!r}; a sliding window is a positive int (how many "
                         "keys a query sees, itself included), or None for causal attention over every earlier key")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or softcap <= 0):
        raise ValueError(f"sliced_causal_attention: softcap={softcap!r}; attention-logit softcapping takes a positive "
                         "number (the cap of the scores, e.g. 50.0), or None for no capping")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"sliced_causal_attention: chunk={chunk!r}; chunked attention takes a positive int (the "
                         "tokens of a chunk, e.g. Llama 4's attention_chunk_size), or None for no chunks")
    _check_sinks(sinks, q)
    ctx = current_slice()
    share = None if ctx is None else ctx.sequence
    if share is not None and share.degree > 1:   # this rank's tokens, all heads -> the whole slice, its heads
        q, k, v = gather_qkv((q, k, v), share)   # one all-to-all
        if sinks is not None:   # the sinks of this rank's heads (gather_qkv hands rank r the r-th head subset)
            sinks = sinks[share.rank * q.shape[1]:(share.rank + 1) * q.shape[1]]
        return scatter_heads(_sliced(q, k, v, ctx, cache_key, dropout_p, scale, window, softcap, sinks, chunk), share)
    return _sliced(q, k, v, ctx, cache_key, dropout_p, scale, window, softcap, sinks, chunk)


def _check_sinks(sinks: "torch.Tensor | None", q: torch.Tensor) -> None:
    if sinks is not None and (not torch.is_tensor(sinks) or sinks.shape != (q.shape[1],)
                              or not sinks.is_floating_point()):
        got = (f"a {type(sinks).__name__}" if not torch.is_tensor(sinks) else f"of shape {tuple(sinks.shape)}"
               if sinks.shape != (q.shape[1],) else f"of dtype {sinks.dtype}")
        raise ValueError(f"sliced_causal_attention: sinks is {got}, and q has {q.shape[1]} heads; attention sinks are "
                         f"a floating-point tensor of shape ({q.shape[1]},), one logit per query head, or None")


#: The fewest queries a block of a windowed slice holds (see :func:`window_query_blocks`): shorter blocks would
#: save scores but cost a kernel launch each. The planner's analytic cost mirrors it (planner/roofline.py).
WINDOW_QUERY_BLOCK = 256


def window_query_blocks(start: int, end: int, first: int, window: int) -> list[tuple[int, int, int]]:
    """The query blocks ``(q0, q1, k0)`` a slice ``[start, end)`` whose keys begin at ``first`` runs under a sliding
    ``window``: blocks of ``max(window, WINDOW_QUERY_BLOCK)`` queries (the last one shorter), block ``[q0, q1)`` over
    the keys ``[k0, q1)``, ``k0 = max(first, q0 - window + 1)`` (the first key its first query sees). One block when
    the slice is no longer than that. A block of at least ``window`` queries makes every block after the first read
    ``window - 1`` keys before its own."""
    size = max(window, WINDOW_QUERY_BLOCK)
    return [(q0, min(q0 + size, end), max(first, q0 - window + 1)) for q0 in range(start, end, size)]


def _in_query_blocks(run, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, end: int,
                     first: int, window: int) -> "torch.Tensor | None":
    """``run(q, keys, values, q0, q1, k0)`` per query block of :func:`window_query_blocks`, the outputs
    concatenated over the queries; None when the slice is one block (the caller runs it whole)."""
    parts = window_query_blocks(start, end, first, window)
    if len(parts) == 1:
        return None
    return torch.cat([run(q[:, :, q0 - start:q1 - start], keys[:, :, k0 - first:q1 - first],
                          values[:, :, k0 - first:q1 - first], q0, q1, k0) for q0, q1, k0 in parts], dim=2)


def _binds(window: "int | None", end: int) -> bool:
    """Whether a sliding window hides any key from the queries before ``end`` (the last one sees ``end - window``
    keys fewer than causal attention would)."""
    return window is not None and end > window


def _sliced(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: "SliceContext | None", cache_key: Hashable,
            dropout_p: float, scale: "float | None", window: "int | None", softcap: "float | None" = None,
            sinks: "torch.Tensor | None" = None, chunk: "int | None" = None) -> torch.Tensor:
    gqa = gqa_kwargs(q, k, v)
    docs = current_documents()
    if chunk is not None:   # the chunks as documents (within the documents of packed rows)
        docs = chunked_documents(docs, chunk, q.shape[0], q.shape[2] if ctx is None else ctx.seq_len, q.device)
    if ctx is None or ctx.num_slices == 1:
        if softcap is not None or sinks is not None:
            return _softcap_or_sinks(q, k, v, docs, 0, q.shape[2], 0, window, softcap, sinks, dropout_p, scale)
        if _binds(window, q.shape[2]):
            return _banded(q, k, v, docs, 0, q.shape[2], 0, window, dropout_p, scale, gqa)
        if docs is not None:  # packed rows: causal within each document
            return _within_documents(q, k, v, docs, 0, q.shape[2], 0, fused_ok(q, k, v, dropout_p), dropout_p,
                                     scale, gqa)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p, scale=scale, **gqa)
    if k.shape[2] != ctx.length or q.shape[2] != ctx.length:
        raise ValueError(f"sliced_causal_attention: q/k/v have {q.shape[2]}/{k.shape[2]} tokens but the running "
                         f"slice has {ctx.length} (tokens [{ctx.start}, {ctx.end})); pass (B, heads, T, head_dim) "
                         "tensors of the slice, not of the whole sequence")
    bufs = ctx.kv_buffers(cache_key, k, v)
    fused = fused_ok(q, k, v, dropout_p)  # CPU: exact blocks on the flash kernel instead of a dense mask
    # SDPA saves q for backward; q is usually a view of a fused qkv projection whose k/v parts now live in the
    # cache, so give q its own storage (same (B, nh, T, hs) strides as before) and let that projection go.
    q = q.transpose(1, 2).contiguous().transpose(1, 2)
    # The first key any query of the slice sees: keys of documents (or chunks) that ended before the slice, and keys
    # a sliding window has left behind, are neither read nor handed gradients.
    first = 0 if docs is None else docs.first_visible(ctx.start)
    windowed = _binds(window, ctx.end)
    if windowed:
        first = max(first, ctx.start - window + 1)
    keys = _PrefixKV.apply(k, bufs, "k", ctx.start, first)  # (B, nh, end - first, hs)
    values = _PrefixKV.apply(v, bufs, "v", ctx.start, first)
    if softcap is not None or sinks is not None:
        return _softcap_or_sinks(q, keys, values, docs, ctx.start, ctx.end, first, window, softcap, sinks, dropout_p,
                                 scale)
    if windowed:
        return _banded(q, keys, values, docs, ctx.start, ctx.end, first, window, dropout_p, scale, gqa)
    if docs is not None:  # packed rows: the prefix's keys of the query's own document only
        return _within_documents(q, keys, values, docs, ctx.start, ctx.end, first, fused, dropout_p, scale, gqa)
    if ctx.start == 0:
        return F.scaled_dot_product_attention(q, keys, values, is_causal=True, dropout_p=dropout_p, scale=scale, **gqa)
    mask = prefix_causal_bias(ctx.start, ctx.end, q.device)  # lazy on an accelerator: fused kernels stay eligible
    if mask is None and fused and ctx.length >= blocks_mod.MIN_PREFIX_TOKENS:  # CPU: full prefix + causal own
        return block_attention(q, keys, values, prefix_blocks(q.shape[0], ctx.start, ctx.length), scale)
    if mask is None:
        mask = _prefix_causal_mask(ctx.start, ctx.end, q.dtype, q.device)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, dropout_p=dropout_p, scale=scale, **gqa)


def _visible_mask(q: torch.Tensor, docs: "Documents | None", start: int, end: int, first: int,
                  window: "int | None") -> torch.Tensor:
    """The additive mask of queries ``[start, end)`` over keys ``[first, end)``: causal, within ``window``, and
    within each document for packed rows; (B, 1, T, end - first) for packed rows, (T, end - first) otherwise."""
    if docs is not None:
        return docs.mask(start, end, q.dtype, first, window)
    return _prefix_causal_mask(start, end, q.dtype, q.device, first, window)


def _banded(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, docs: "Documents | None", start: int, end: int,
            first: int, window: int, dropout_p: float, scale: "float | None", gqa: dict[str, bool]) -> torch.Tensor:
    """Queries ``[start, end)`` over ``keys``/``values`` ``[first, end)`` under a sliding window (and within each
    document for packed rows): one SDPA call with the band's additive mask, on a CPU and an accelerator alike (no
    fused kernel takes a band without one), per block of queries (:func:`window_query_blocks`). The keys start where
    the window of the block's first query does, so a block's mask is (b, b + window - 1) at most, whatever the
    prefix."""
    blocked = _in_query_blocks(lambda qb, kb, vb, q0, q1, k0: _banded(qb, kb, vb, docs, q0, q1, k0, window, dropout_p,
                                                                      scale, gqa), q, keys, values, start, end, first,
                               window)
    if blocked is not None:
        return blocked
    mask = _visible_mask(q, docs, start, end, first, window)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, dropout_p=dropout_p, scale=scale, **gqa)


def _softcap_or_sinks(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, docs: "Documents | None",
                      start: int, end: int, first: int, window: "int | None", softcap: "float | None",
                      sinks: "torch.Tensor | None", dropout_p: float, scale: "float | None") -> torch.Tensor:
    """Softcapped scores or attention sinks: sinks alone run on the CPU's fused blocks with the sink merged into
    their log-sum-exp (where the flash kernel applies, no window hides a key, and packed rows make at most
    MAX_BLOCKS blocks), anything else as :func:`_eager`."""
    if softcap is None and not _binds(window, end) and fused_ok(q, keys, values, dropout_p):
        blocks = docs.blocks(start, end, first) if docs is not None else prefix_blocks(q.shape[0], start, end - start)
        if blocks is not None:
            return block_attention(q, keys, values, blocks, scale, sinks)
    if softcap is None and not _binds(window, end) and blocks_mod.on_accelerator(q):
        def attend(qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor) -> torch.Tensor:
            return _sinks_as_key(qb, kb, vb, sinks, dropout_p, scale)
        if docs is None:   # no window binds and no documents: the keys start at 0
            return attend(q, keys, values)
        blocks = docs.blocks(start, end, first)
        if blocks is not None:
            return sdpa_blocks(q, keys, values, blocks, scale, dropout_p, attend=attend)
    return _eager(q, keys, values, docs, start, end, first, window, softcap, sinks, dropout_p, scale)


#: Sink logits are clamped to [-SINK_LIMIT, SINK_LIMIT] where they ride as a key (:func:`_sinks_as_key`): a -inf sink
#: times a real key's zero in that column would be nan. exp(-1e4) is 0 in every dtype and a sink of 1e4 takes its
#: rows whole, as an unclamped one does; the value fits fp16.
SINK_LIMIT = 1e4


def _sinks_as_key(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sinks: torch.Tensor, dropout_p: float,
                  scale: "float | None") -> torch.Tensor:
    """Attention with sinks of queries ``q`` over ``keys``/``values``, causal aligned to the lower right (the
    queries are the last of the keys' positions), in one SDPA call the accelerator's fused kernels take (packed
    rows: one per document block, through :func:`~ds_terapipe.runtime.slicing.blocks.sdpa_blocks`). The sink is one
    more key, first, whose value is zero. Its score must be head h's sink for every query of head h, so q, k and v
    are widened by one column (then to a multiple of 8, one width for all three, as the flash kernel wants): q's
    holds the sink, the sink key's holds 1 / scale, the real keys' hold 0; the causal mask is the lazy lower-right
    one over the keys plus the sink key. The gradient reaches the sinks through q's column. What SDPA keeps for
    backward is the widened q, k and v (copies of the keys and values the call reads) and its log-sum-exp, against
    the (heads, T, keys) scores the plain math keeps: at 64 query heads over 8 key/value heads, the scores cost more
    from about 20 queries on."""
    batch, heads, tokens, head_dim = q.shape
    kv_heads, width = keys.shape[1], -(-(max(head_dim + 1, values.shape[-1])) // 8) * 8
    scale = head_dim ** -0.5 if scale is None else scale
    wide_q = q.new_zeros(batch, heads, tokens, width)
    wide_q[..., :head_dim] = q
    wide_q[..., head_dim] = sinks.clamp(-SINK_LIMIT, SINK_LIMIT).to(q.dtype).view(1, heads, 1)
    wide_k = keys.new_zeros(batch, kv_heads, keys.shape[2] + 1, width)
    wide_k[:, :, 1:, :head_dim] = keys
    wide_k[:, :, 0, head_dim] = 1.0 / scale
    wide_v = values.new_zeros(batch, kv_heads, values.shape[2] + 1, width)
    wide_v[:, :, 1:, :values.shape[-1]] = values
    out = F.scaled_dot_product_attention(wide_q, wide_k, wide_v, attn_mask=lower_right_bias(tokens, wide_k.shape[2]),
                                         dropout_p=dropout_p, scale=scale, **gqa_kwargs(q, keys, values))
    return out[..., :values.shape[-1]]


def _eager(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, docs: "Documents | None", start: int, end: int,
           first: int, window: "int | None", softcap: "float | None", sinks: "torch.Tensor | None",
           dropout_p: float, scale: "float | None") -> torch.Tensor:
    """Queries ``[start, end)`` over ``keys``/``values`` ``[first, end)`` as plain tensor math, in the order of
    ``transformers``' eager attention (Gemma 2's with a softcap, gpt-oss' with sinks): scale, cap, add the mask
    (causal, the window, within each document), the sink as one more logit per row, softmax in fp32 (fp64 stays),
    the sink's column dropped, back to the query dtype, dropout, times the values. Head h reads k/v head
    h // (nh / nkv), as SDPA's ``enable_gqa`` pairs them. Under a window that hides keys, per block of queries
    (:func:`window_query_blocks`)."""
    if _binds(window, end):
        blocked = _in_query_blocks(lambda qb, kb, vb, q0, q1, k0: _eager(qb, kb, vb, docs, q0, q1, k0, window,
                                                                         softcap, sinks, dropout_p, scale),
                                   q, keys, values, start, end, first, window)
        if blocked is not None:
            return blocked
    batch, heads, tokens, _ = q.shape
    kv_heads = keys.shape[1]
    groups = heads // kv_heads
    # Head h reads k/v head h // groups (as SDPA's enable_gqa pairs them): a k/v head's query heads side by side in
    # one matmul, so the keys and values are read where they lie, never repeated per query head.
    grouped = q.reshape(batch, kv_heads, groups * tokens, q.shape[-1])
    scores = torch.matmul(grouped, keys.transpose(2, 3)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    scores = scores.view(batch, kv_heads, groups, tokens, -1)                 # (B, nkv, groups, T, end - first)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    mask = _visible_mask(q, docs, start, end, first, window)                 # (T, keys) or (B, 1, T, keys)
    scores = scores + (mask.unsqueeze(1) if mask.dim() == 4 else mask)
    probs = _EagerSoftmax.apply(scores, None if sinks is None else sinks.view(1, kv_heads, groups, 1, 1))
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p)
    out = torch.matmul(probs.view(batch, kv_heads, groups * tokens, -1), values)
    return out.view(batch, heads, tokens, values.shape[-1])                  # (B, nh, T, hs of v)


class _EagerSoftmax(torch.autograd.Function):
    """Softmax over the keys in fp32 (fp64 stays), with an optional sink logit per row that joins the denominator
    and leaves no column in the output, returned in the scores' dtype. Backward from that output alone (and each
    row's sink share): autograd's softmax would keep its fp32 output beside the cast copy the values' matmul keeps,
    three times the scores' bytes in bf16."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, sinks: "torch.Tensor | None") -> torch.Tensor:
        dtype = torch.promote_types(scores.dtype, torch.float32)
        logits = scores.to(dtype)
        top = logits.amax(-1, keepdim=True)
        if sinks is not None:
            sink = sinks.to(dtype)
            top = torch.maximum(top, sink)
        weights = torch.exp(logits - top)
        total = weights.sum(-1, keepdim=True)
        share = None
        if sinks is not None:
            sink_weight = torch.exp(sink - top)
            total = total + sink_weight
            share = sink_weight / total                                        # the sink's probability per row
        probs = weights.div_(total).to(scores.dtype)
        ctx.save_for_backward(probs, share)
        ctx.sinks = None if sinks is None else (sinks.shape, sinks.dtype)
        return probs

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        probs, share = ctx.saved_tensors
        dtype = torch.promote_types(probs.dtype, torch.float32)
        p = probs.to(dtype)
        weighted = grad.to(dtype) * p
        row = weighted.sum(-1, keepdim=True)                                   # sum_j grad_j p_j
        d_scores = (weighted - p * row).to(probs.dtype)
        d_sinks = None
        if ctx.sinks is not None and ctx.needs_input_grad[1]:
            shape, sink_dtype = ctx.sinks
            d_sinks = (-(share * row)).sum_to_size(shape).to(sink_dtype)       # d p_j / d sink = -p_j p_sink
        return d_scores, d_sinks


def _within_documents(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, docs: "Documents", start: int,
                      end: int, first: int, fused: bool, dropout_p: float, scale: "float | None",
                      gqa: dict[str, bool]) -> torch.Tensor:
    """Queries ``[start, end)`` of packed rows over ``keys``/``values`` ``[first, end)``, each within its document:
    per-document blocks (one SDPA call each on an accelerator, merged fused kernels on a CPU), or the dense mask
    where they do not apply."""
    accel = blocks_mod.on_accelerator(q)
    blocks = docs.blocks(start, end, first) if fused or accel else None
    if blocks is not None and accel:   # one fused SDPA call per document
        return sdpa_blocks(q, keys, values, blocks, scale, dropout_p)
    if blocks is not None:
        return block_attention(q, keys, values, blocks, scale)
    mask = docs.mask(start, end, q.dtype, first)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, dropout_p=dropout_p, scale=scale, **gqa)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention (GPT-2 style) that runs sliced inside a token pipeline.

    Input and output: (B, T, C). Optional rotary position embedding uses :func:`slice_positions`, so slices get
    their true positions; ``window``: sliding-window attention (see :func:`sliced_causal_attention`).
    """

    terapipe_token_mixing = "causal-sliced"

    def __init__(self, hidden: int, num_heads: int, *, dropout: float = 0.0, bias: bool = True,
                 rotary: bool = False, window: int | None = None) -> None:
        super().__init__()
        if hidden % num_heads != 0:
            raise ValueError(f"CausalSelfAttention: hidden={hidden} is not divisible by num_heads={num_heads}; "
                             "choose num_heads dividing hidden")
        self.hidden, self.num_heads, self.dropout, self.rotary = hidden, num_heads, dropout, rotary
        self.window = window
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.proj = nn.Linear(hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, channels = x.shape  # (B, T, C)
        head_dim = channels // self.num_heads
        q, k, v = self.qkv(x).split(channels, dim=2)
        q = q.view(batch, tokens, self.num_heads, head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(batch, tokens, self.num_heads, head_dim).transpose(1, 2)
        v = v.view(batch, tokens, self.num_heads, head_dim).transpose(1, 2)
        if self.rotary:
            positions = slice_positions(tokens, x.device)  # packed rows: within each document
            q, k = apply_rotary(q, positions), apply_rotary(k, positions)
        dropout = self.dropout if self.training else 0.0
        y = sliced_causal_attention(q, k, v, cache_key=self, dropout_p=dropout, window=self.window)  # (B,nh,T,hs)
        y = y.transpose(1, 2).contiguous().view(batch, tokens, channels)
        return self.proj(y)


def apply_rotary(x: torch.Tensor, offset: int | torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding of (B, nh, T, hs) for positions ``offset .. offset + T - 1``, or for the
    positions ``offset`` gives: (T,) or (B, T) (packed rows, :func:`slice_positions`)."""
    head_dim = x.shape[-1]
    if head_dim % 2:
        raise ValueError(f"apply_rotary: head_dim={head_dim} must be even for rotary embeddings")
    half = head_dim // 2
    inv_freq = torch.exp(-math.log(base) * torch.arange(half, device=x.device, dtype=torch.float32) / half)
    if torch.is_tensor(offset):
        pos = offset.to(device=x.device, dtype=torch.float32)
    else:
        pos = torch.arange(offset, offset + x.shape[2], device=x.device, dtype=torch.float32)
    angles = pos.unsqueeze(-1) * inv_freq  # (T, hs/2) or (B, T, hs/2)
    if angles.dim() == 3:
        angles = angles.unsqueeze(1)  # (B, 1, T, hs/2): one rotation per row, every head
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
