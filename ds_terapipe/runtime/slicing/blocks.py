"""Exact block attention: a slice's attention as fused causal and full blocks instead of a dense mask.

A slice's queries ``[start, end)`` see keys ``[0, end)`` causally aligned to the lower right. SDPA on a CPU has
one fused (flash) kernel, and it knows only two masks: none, and causal aligned to the upper left. Given the
slice's (T, end) mask as a tensor it computes every block, adds the mask, and saves the mask for backward; at
L = 8192 in 4 slices that is 1.6x the time of unsliced causal attention over the same tokens. Split instead:

* the prefix keys ``[0, start)`` are visible to every query of the slice: one full block, no mask;
* the slice's own keys ``[start, end)`` are causal to its queries with the diagonal at the upper left: one
  ``is_causal`` block, whose kernel skips the masked half.

Each block's kernel returns its output and its rows' log-sum-exp; the two outputs are merged with weights
``exp(lse_block - lse)``, ``lse = logaddexp(lse_prefix, lse_own)``. Backward needs no merge rule of its own: the
flash backward of each block, handed the *merged* output and log-sum-exp, computes that block's exact share of
the gradients (it rebuilds the probabilities as ``exp(q k^T scale - lse)`` and the softmax correction from
``rowsum(grad_out * out)``, both of which are the whole row's). Sliced attention then costs what unsliced
causal attention costs, and saves no mask.

Attention sinks (a logit per head in every row's denominator, no value: gpt-oss) are one more merge, with a block
whose log-sum-exp is the sink and whose output is zero; the flash backward handed the merged output and log-sum-exp
is again exact for q, k and v, and the sink's gradient is ``-sum(exp(sink - lse) * rowsum(grad_out * out))``.

Packed rows (documents) are the same construction per document: a document that started before the slice is a
prefix block plus a causal block, every later document of the slice is one causal block, and keys of other
documents are never touched, so a slice costs its within-document context, which is what the planner's
document cost model charges. Rows with different documents run row by row; a slice cut into many tiny
documents (over :data:`MAX_BLOCKS` blocks) keeps the dense mask, where one kernel call beats many.

Slices of one-document rows shorter than :data:`MIN_PREFIX_TOKENS` keep the dense mask, which is cheaper there.
The merged blocks run on the CPU only (a slice of one-document rows on an accelerator takes SDPA's own
lower-right causal bias and its fused kernels), and only where SDPA itself would pick the flash kernel: no
dropout, equal dtypes, unit stride on the head dimension, flash not switched off, no autocast. The two ``aten``
ops they call are private to torch; :func:`fused_ok` checks they exist, and everything else falls back to the
masked SDPA call. Packed rows on an accelerator need no merge: each block's queries see one contiguous key
range causally aligned to the lower right, so :func:`sdpa_blocks` makes one public SDPA call per block with
torch's lazy ``causal_lower_right`` bias, which the fused kernels take, and never a dense mask.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F

from .devices import causal_lower_right, lower_right_bias   # causal_lower_right: None on a torch without it

__all__ = ["Block", "MAX_BLOCKS", "MIN_PREFIX_TOKENS", "block_attention", "fused_ok", "gqa_kwargs", "on_accelerator",
           "prefix_blocks", "sdpa_blocks"]

#: Above this many blocks in one slice (all rows together), the dense mask's single kernel call is cheaper.
MAX_BLOCKS = 32

#: A slice of one-document rows shorter than this keeps the dense mask: below it the blocks' small extra ops (the
#: merge, the second kernel call) cost more than the masked part of the kernel saves. One core, forward and
#: backward, blocks against the mask: 0.79-0.89x at 80-128 tokens, 0.98-1.05x at 256, ~1.0x at 512, 1.18-1.20x at
#: 1024, 1.6x at 2048 tokens over 8192 keys.
MIN_PREFIX_TOKENS = 512

try:
    _FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    _BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
except (AttributeError, RuntimeError):  # pragma: no cover - a torch without the CPU flash kernel
    _FWD = _BWD = None

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class Block(NamedTuple):
    """Rows ``[row0, row1)`` of the batch, queries ``[q0, q1)`` of the slice (slice-local), which see the keys
    ``[p0, k0)`` fully (the earlier part of their document; empty when ``p0 == k0``) and the keys
    ``[k0, k0 + q1 - q0)`` causally (query ``q0 + i`` sees key ``k0 + j`` for ``j <= i``). Key indices are
    into the key tensor handed to :func:`block_attention`."""

    row0: int
    row1: int
    q0: int
    q1: int
    p0: int
    k0: int

    @property
    def rows(self) -> slice:
        return slice(self.row0, self.row1)

    @property
    def k1(self) -> int:
        """The end of the block's own keys: ``k0`` plus its query count."""
        return self.k0 + self.q1 - self.q0


def fused_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> bool:
    """Whether the fused CPU blocks apply: where SDPA itself would take its CPU flash kernel."""
    return (_FWD is not None and q.device.type == "cpu" and dropout_p == 0.0 and q.dtype in _DTYPES
            and q.dtype == k.dtype == v.dtype and q.dim() == k.dim() == v.dim() == 4
            and q.shape[-1] == k.shape[-1] == v.shape[-1]
            and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
            and torch.backends.cuda.flash_sdp_enabled()  # the global switch CPU SDPA also reads
            and not torch.is_autocast_enabled("cpu"))


def prefix_blocks(batch: int, start: int, length: int) -> list[Block]:
    """A slice of ``length`` tokens at ``start`` of rows that are one document each, keys ``[0, start + length)``."""
    return [Block(0, batch, 0, length, 0, start)]


def block_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, blocks: Sequence[Block],
                    scale: Optional[float], sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of ``q`` (B, nh, T, hs) over ``keys``/``values`` (B, nkv, E, hs) as ``blocks`` say: every query
    lies in exactly one block; keys no block names get zero gradient. nkv may divide nh (grouped-query).
    ``sinks`` (nh,): attention sinks, one logit per head in every row's denominator (their gradient returned)."""
    return _BlockAttention.apply(q, keys, values, tuple(blocks), scale, sinks)


def on_accelerator(q: torch.Tensor) -> bool:
    """Whether packed rows take :func:`sdpa_blocks` (an accelerator: SDPA's fused kernels take each block)."""
    return q.device.type != "cpu" and causal_lower_right is not None


def gqa_kwargs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, bool]:
    """``enable_gqa=True`` for SDPA when k/v have fewer heads than q (nothing otherwise, so equal-head calls stay
    exactly what they were); the cache keeps the k/v heads, never repeated copies."""
    num_heads, num_kv = q.shape[1], k.shape[1]
    if num_kv == num_heads:
        return {}
    if v.shape[1] != num_kv or num_heads % num_kv:
        raise ValueError(f"sliced_causal_attention: q has {num_heads} heads but k/v have {num_kv}/{v.shape[1]}; "
                         "grouped-query attention needs k and v with the same number of heads, dividing q's")
    return {"enable_gqa": True}


def sdpa_blocks(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, blocks: Sequence[Block],
                scale: Optional[float], dropout_p: float = 0.0,
                attend: Optional[Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = None
                ) -> torch.Tensor:
    """The same blocks for an accelerator, through public SDPA and no merge: a block's queries see the keys
    ``[p0, k0 + n)`` causally aligned to the lower right (their document's earlier part fully, their own keys
    causally), which is one SDPA call with torch's lazy ``causal_lower_right`` bias (``is_causal=True`` when the
    block has no prefix), a form the fused flash / memory-efficient kernels take. Each query lies in one block,
    so dropout per call is dropout over its row. Autograd runs through SDPA's own backward. ``attend(qb, kb, vb)``:
    a block's attention in place of that call, over the same keys aligned the same way (attention sinks)."""
    gqa = gqa_kwargs(q, keys, values)
    batch, heads, tokens, _ = q.shape
    out = q.new_empty(batch, tokens, heads, values.shape[-1]).transpose(1, 2)   # (B, nh, T, hs), as SDPA's
    for b in blocks:
        qb, kb, vb = q[b.rows, :, b.q0:b.q1], keys[b.rows, :, b.p0:b.k1], values[b.rows, :, b.p0:b.k1]
        if attend is not None:
            o = attend(qb, kb, vb)
        elif b.p0 < b.k0:
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=lower_right_bias(b.q1 - b.q0, b.k1 - b.p0),
                                               dropout_p=dropout_p, scale=scale, **gqa)
        else:
            o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, dropout_p=dropout_p, scale=scale, **gqa)
        out[b.rows, :, b.q0:b.q1] = o
    return out


def _merge(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions over disjoint keys -> the attention over their union, and its log-sum-exp."""
    lse = torch.logaddexp(l1, l2)                                        # (b, nh, t), fp32 (fp64 for fp64)
    w1, w2 = torch.exp(l1 - lse).unsqueeze(-1), torch.exp(l2 - lse).unsqueeze(-1)
    return (o1.to(lse.dtype) * w1 + o2.to(lse.dtype) * w2).to(o1.dtype), lse


class _BlockAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, keys, values, blocks, scale, sinks):
        batch, heads, tokens, _ = q.shape
        # (B, nh, T, hs) laid out (B, T, nh, hs), as SDPA's own output: the caller's transpose back is free
        out = q.new_empty(batch, tokens, heads, values.shape[-1]).transpose(1, 2)
        lse = q.new_empty(q.shape[:3], dtype=_lse_dtype(q))                  # (B, nh, T)
        for b in blocks:
            rows = b.rows
            qb = q[rows, :, b.q0:b.q1]
            o, l = _FWD(qb, keys[rows, :, b.k0:b.k1], values[rows, :, b.k0:b.k1], 0.0, True, scale=scale)
            if b.p0 < b.k0:
                o1, l1 = _FWD(qb, keys[rows, :, b.p0:b.k0], values[rows, :, b.p0:b.k0], 0.0, False, scale=scale)
                o, l = _merge(o1, l1, o, l)
            out[rows, :, b.q0:b.q1] = o
            lse[rows, :, b.q0:b.q1] = l
        if sinks is not None:   # a zero-output block whose log-sum-exp is the sink
            total = torch.logaddexp(lse, sinks.detach().to(lse.dtype).view(1, -1, 1))            # (B, nh, T)
            out.copy_(out.to(lse.dtype) * torch.exp(lse - total).unsqueeze(-1))
            lse = total
        ctx.save_for_backward(q, keys, values, out, lse, sinks)
        ctx.blocks, ctx.scale = blocks, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, keys, values, out, lse, sinks = ctx.saved_tensors
        scale = ctx.scale
        grad = grad.contiguous()
        dq = torch.empty_like(q, memory_format=torch.contiguous_format)
        dk = torch.zeros_like(keys, memory_format=torch.contiguous_format)
        dv = torch.zeros_like(values, memory_format=torch.contiguous_format)
        for b in ctx.blocks:
            rows, qs, own = b.rows, slice(b.q0, b.q1), slice(b.k0, b.k1)
            g, qb, ob = grad[rows, :, qs], q[rows, :, qs], out[rows, :, qs]
            lb = lse[rows, :, qs]
            gq, gk, gv = _BWD(g, qb, keys[rows, :, own], values[rows, :, own], ob, lb, 0.0, True, scale=scale)
            dk[rows, :, own] += gk
            dv[rows, :, own] += gv
            if b.p0 < b.k0:
                gq1, gk1, gv1 = _BWD(g, qb, keys[rows, :, b.p0:b.k0], values[rows, :, b.p0:b.k0], ob, lb, 0.0,
                                     False, scale=scale)
                gq = gq + gq1
                dk[rows, :, b.p0:b.k0] += gk1
                dv[rows, :, b.p0:b.k0] += gv1
            dq[rows, :, qs] = gq
        dsinks = None
        if sinks is not None:   # d out / d sink = -out * exp(sink - lse), per row
            p_sink = torch.exp(sinks.detach().to(lse.dtype).view(1, -1, 1) - lse)                  # (B, nh, T)
            dsinks = -(p_sink * (grad.to(lse.dtype) * out.to(lse.dtype)).sum(-1)).sum((0, 2)).to(sinks.dtype)
        return dq, dk, dv, None, None, dsinks


def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    """The log-sum-exp dtype the CPU flash kernel returns for ``q``'s dtype (fp64 keeps fp64)."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32
