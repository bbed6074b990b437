"""Tier a, one process: exact block attention on CPU (runtime/slicing/blocks.py).

The blocks (a full block over the prefix, a causal block over the slice's own keys, merged by log-sum-exp; per
document for packed rows) must equal SDPA under the dense mask they replace: outputs and the gradients of
queries, keys and values, in fp64, fp32 and bf16, with grouped-query heads, rows of different documents, and a
slice that starts inside a document. Sliced attention on CPU must take them (and save no (T, end) mask), and
keep the dense mask where they do not apply. Sliding windows: sliced attention with a window must equal SDPA under
the dense sliding-window mask on every path, reading (and handing gradients to) only the key rows its window reaches.
"""

from __future__ import annotations

import random
import re

import pytest
import torch
import torch.nn.functional as F

from ds_terapipe.runtime.slicing import blocks as blocks_mod
from ds_terapipe.runtime.slicing.attention import CausalSelfAttention, sliced_causal_attention
from ds_terapipe.runtime.slicing.blocks import (MAX_BLOCKS, Block, block_attention, fused_ok, prefix_blocks,
                                                sdpa_blocks)
from ds_terapipe.runtime.slicing.context import MicroBatchState, SliceContext, slice_scope
from ds_terapipe.runtime.slicing.documents import Documents

TOL = {torch.float64: 1e-9, torch.float32: 2e-5, torch.bfloat16: 4e-2}


def _positions(doc_starts: list[list[int]], length: int) -> torch.Tensor:
    """(B, length) position ids restarting at 0 at each row's document starts."""
    pos = torch.zeros(len(doc_starts), length, dtype=torch.long)
    for row, starts in enumerate(doc_starts):
        bounds = [*starts, length]
        for a, b in zip(bounds, bounds[1:]):
            pos[row, a:b] = torch.arange(b - a)
    return pos


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    mask = torch.zeros(visible.shape, dtype=q.dtype).masked_fill(~visible, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


def _compare(q, k, v, blocks, visible, dtype, run=block_attention) -> None:
    grad = torch.randn(q.shape[0], q.shape[2], q.shape[1], q.shape[3], dtype=dtype).transpose(1, 2)  # as a model's
    ref_in = [t.detach().requires_grad_() for t in (q, k, v)]
    ref = _dense(*ref_in, visible)
    ref_grads = torch.autograd.grad(ref, ref_in, grad)
    got_in = [t.detach().requires_grad_() for t in (q, k, v)]
    got = run(*got_in, blocks, None)
    got_grads = torch.autograd.grad(got, got_in, grad)
    for name, a, b in zip(("out", "dq", "dk", "dv"), (got, *got_grads), (ref, *ref_grads)):
        err = float((a.detach().double() - b.detach().double()).abs().max() / b.detach().double().abs().max())
        assert err < TOL[dtype], f"{name}: rel err {err:.2e} (dtype {dtype})"


@pytest.mark.parametrize("run", [block_attention, sdpa_blocks], ids=["merged (CPU)", "per-block SDPA (accelerator)"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("layout", ["prefix", "documents", "same documents", "slice starts a document"])
def test_blocks_equal_sdpa_under_the_dense_mask(dtype: torch.dtype, kv_heads: int, layout: str, run) -> None:
    torch.manual_seed(kv_heads)
    batch, heads, head_dim, tokens, start = 2, 4, 16, 24, 40
    end = start + tokens
    q = torch.randn(batch, heads, tokens, head_dim, dtype=dtype)
    k = torch.randn(batch, kv_heads, end, head_dim, dtype=dtype)
    v = torch.randn(batch, kv_heads, end, head_dim, dtype=dtype)
    if layout == "prefix":
        visible = torch.ones(tokens, end, dtype=torch.bool).tril(diagonal=start)
        _compare(q, k, v, prefix_blocks(batch, start, tokens), visible, dtype, run)
        return
    starts = {"documents": [[0, 30, 50, 58], [0, 45, 52]], "same documents": [[0, 30, 50, 58]] * 2,
              "slice starts a document": [[0, 40, 47], [0, 12, 40]]}[layout]
    docs = Documents(_positions(starts, end))
    first = docs.first_visible(start)
    blocks = docs.blocks(start, end, first)
    assert blocks is not None
    if layout == "same documents":
        assert all((b.row0, b.row1) == (0, batch) for b in blocks), "rows with the same documents share blocks"
        assert first == 30 and blocks[0] == Block(0, batch, 0, 10, 0, 10)
    ids = docs.ids(end)
    visible = (ids[:, start:, None] == ids[:, None, first:]) & \
        torch.ones(tokens, end, dtype=torch.bool).tril(diagonal=start)[:, first:]
    _compare(q, k[:, :, first:], v[:, :, first:], blocks, visible.unsqueeze(1), dtype, run)


@pytest.mark.parametrize("min_tokens", [0, 11])
def test_sliced_attention_on_cpu_runs_blocks_and_saves_no_mask(min_tokens: int, monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    """Every slice after the first goes through the blocks (two kernel calls), and nothing of shape (T, end) is
    saved for backward: the dense mask the blocks replace is gone. Slices shorter than MIN_PREFIX_TOKENS keep the
    mask (where it is cheaper)."""
    calls = []
    real = blocks_mod._FWD
    monkeypatch.setattr(blocks_mod, "_FWD", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    monkeypatch.setattr(blocks_mod, "MIN_PREFIX_TOKENS", min_tokens)
    torch.manual_seed(0)
    attn = CausalSelfAttention(24, 4)
    x = torch.randn(1, 30, 24)
    saved: list[tuple[int, ...]] = []
    state = MicroBatchState(0, 30, 3)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        for i, start in enumerate((0, 10, 20)):
            with slice_scope(SliceContext(0, i, start, start + 10, state)):
                attn(x[:, start:start + 10])
    masks = [s for s in saved if s[-2:] in ((10, 20), (10, 30))]
    if min_tokens > 10:   # slices of 10 tokens: the dense mask
        assert not calls and masks, (calls, saved)
        return
    assert len(calls) == 4, f"expected two block kernels for each of the two later slices, got {len(calls)}"
    assert not masks, f"a (T, end) mask was saved: {saved}"


def test_many_tiny_documents_keep_the_dense_mask() -> None:
    """Over MAX_BLOCKS blocks in a slice, one dense kernel call is cheaper: Documents.blocks says None."""
    length = 4 * (MAX_BLOCKS + 1)
    docs = Documents(_positions([list(range(0, length, 4))], length))
    assert docs.blocks(0, length) is None
    assert docs.blocks(0, 4 * MAX_BLOCKS) is not None


def test_blocks_apply_where_sdpa_would_take_its_cpu_flash_kernel() -> None:
    q = torch.randn(1, 2, 8, 16)
    assert fused_ok(q, q, q, 0.0)
    assert not fused_ok(q, q, q, 0.1), "dropout: the dense path"
    assert not fused_ok(q, q.double(), q, 0.0), "mixed dtypes: the dense path"
    assert not fused_ok(q.transpose(-1, -2), q, q, 0.0), "no unit stride on the head dimension"
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.MATH):
        assert not fused_ok(q, q, q, 0.0), "flash switched off: the dense path"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not fused_ok(q, q, q, 0.0), "autocast: SDPA's own casts"


@pytest.mark.parametrize("seed", range(4))
def test_blocks_and_dense_mask_agree_through_a_sliced_layer(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same sliced forward/backward with the blocks and with the dense mask (fp64): equal."""
    monkeypatch.setattr(blocks_mod, "MIN_PREFIX_TOKENS", 0)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    attn = CausalSelfAttention(32, 4, rotary=True).double()
    length = rng.randint(20, 60)
    cuts = sorted(rng.sample(range(1, length), 3))
    bounds = [0, *cuts, length]
    x = torch.randn(2, length, 32, dtype=torch.double)

    def run() -> list[torch.Tensor]:
        """Forward slice by slice, backward later slices first (as a stage runs them)."""
        attn.zero_grad()
        state, outs = MicroBatchState(0, length, len(bounds) - 1), []
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            with slice_scope(SliceContext(0, i, a, b, state)):
                outs.append(attn(x[:, a:b]))
        for out in reversed(outs):
            out.pow(2).sum().backward()
        return [torch.cat(outs, 1).detach()] + [p.grad.clone() for p in attn.parameters()]

    fused = run()
    monkeypatch.setattr(blocks_mod, "_FWD", None)
    dense = run()
    for a, b in zip(fused, dense):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_packed_rows_on_an_accelerator_take_one_sdpa_call_per_document(monkeypatch: pytest.MonkeyPatch) -> None:
    """The accelerator's path for packed rows, run on CPU: every slice goes through sdpa_blocks (one SDPA call per
    block, a lazy lower-right causal bias or is_causal, never a dense mask), and the sliced result equals the
    unsliced one under the dense mask (fp64)."""
    calls = []
    real = blocks_mod.sdpa_blocks
    monkeypatch.setattr(blocks_mod, "on_accelerator", lambda q: True)
    monkeypatch.setattr(blocks_mod, "_FWD", None)   # as on an accelerator: no CPU flash blocks
    import ds_terapipe.runtime.slicing.attention as attention
    monkeypatch.setattr(attention, "sdpa_blocks", lambda *a, **kw: calls.append(len(a[3])) or real(*a, **kw))
    torch.manual_seed(0)
    attn = CausalSelfAttention(16, 4, rotary=True).double()
    length, bounds = 30, [0, 7, 22, 30]
    positions = _positions([[0, 5, 12, 25], [0, 18]], length)
    x = torch.randn(2, length, 16, dtype=torch.double)
    weight = torch.randn(2, length, 16, dtype=torch.double)

    def sliced() -> list[torch.Tensor]:
        attn.zero_grad()
        state, outs, docs = MicroBatchState(0, length, 3), [], Documents(positions)
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            with slice_scope(SliceContext(0, i, a, b, state, documents=docs)):
                outs.append(attn(x[:, a:b]))
        for (a, b), out in reversed(list(zip(zip(bounds, bounds[1:]), outs))):
            (out * weight[:, a:b]).sum().backward()
        return [torch.cat(outs, 1).detach()] + [p.grad.clone() for p in attn.parameters()]

    got = sliced()
    assert calls == [3, 4, 3], f"blocks per slice (rows with different documents): {calls}"
    monkeypatch.setattr(blocks_mod, "on_accelerator", lambda q: False)   # the dense mask, as before the blocks
    calls.clear()
    want = sliced()
    assert not calls
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


# -- sliding windows ------------------------------------------------------------------------------------------
def _sliding_visible(length: int, window: int, positions: torch.Tensor | None) -> torch.Tensor:
    """(B or 1, 1, L, L) transformers' sliding-window causal mask (``kv_idx <= q_idx`` and ``kv_idx > q_idx -
    window``), within each document for packed rows: the reference, built apart from the code under test."""
    query, key = torch.arange(length)[:, None], torch.arange(length)[None, :]
    visible = ((key <= query) & (key > query - window))[None, None]
    if positions is not None:
        ids = (positions == 0).cumsum(dim=1)
        visible = visible & (ids[:, None, :, None] == ids[:, None, None, :])
    return visible


def _force_accelerator_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """The accelerator's paths, run on CPU: lazy lower-right causal biases for a prefix, one SDPA call per document
    for packed rows, no CPU flash blocks."""
    import ds_terapipe.runtime.slicing.attention as attention
    from torch.nn.attention.bias import causal_lower_right
    monkeypatch.setattr(blocks_mod, "on_accelerator", lambda q: True)
    monkeypatch.setattr(blocks_mod, "_FWD", None)
    monkeypatch.setattr(attention, "prefix_causal_bias", lambda start, end, _: causal_lower_right(end - start, end))


def _sliced_outputs_and_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor,
                              slices: list[int], positions: torch.Tensor | None, arriving: bool = False,
                              **kwargs) -> list[torch.Tensor]:
    """Sliced attention over ``slices`` (forward in order, backward later slices first, as a stage runs them):
    the output and the gradients of q, k, v, each concatenated over the slices. ``arriving``: packed rows' positions
    written slice by slice, as a stage after the first learns them."""
    bounds = [sum(slices[:i]) for i in range(len(slices) + 1)]
    state = MicroBatchState(0, q.shape[2], len(slices))
    docs = None if positions is None else Documents(positions)
    if positions is not None and arriving:
        docs = Documents.empty(*positions.shape, positions.device)
    pieces, outs = [], []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if positions is not None and arriving:
            docs.write(a, positions[:, a:b])
        piece = [t[:, :, a:b].detach().requires_grad_() for t in (q, k, v)]
        with slice_scope(SliceContext(0, i, a, b, state, documents=docs)):
            outs.append(sliced_causal_attention(*piece, cache_key="attn", **kwargs))
        pieces.append(piece)
    for (a, b), out in reversed(list(zip(zip(bounds, bounds[1:]), outs))):
        out.backward(grad[:, :, a:b])
    return [torch.cat(outs, dim=2).detach(), *(torch.cat([p[j].grad for p in pieces], dim=2) for j in range(3))]


WINDOW_SLICINGS = {"one": [24], "short": [4, 4, 4, 4, 4, 4], "long": [11, 13], "uneven": [1, 9, 3, 6, 5]}


def _query_blocks(monkeypatch: pytest.MonkeyPatch, blocked: bool) -> None:
    """``blocked``: windowed slices run in query blocks as short as the window (the fewest queries a block takes,
    256 in use, down to 1), so the 24-token tests cut a slice into several blocks."""
    import ds_terapipe.runtime.slicing.attention as attention
    if blocked:
        monkeypatch.setattr(attention, "WINDOW_QUERY_BLOCK", 1)


@pytest.mark.parametrize("blocked", [False, True], ids=["whole", "query-blocks"])
@pytest.mark.parametrize("path", ["cpu", "accelerator"])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("window", [1, 3, 7, 24, 40])
@pytest.mark.parametrize("slicing", list(WINDOW_SLICINGS))
def test_windowed_sliced_attention_equals_sdpa_under_the_sliding_mask(slicing: str, window: int, dtype: torch.dtype,
                                                                      packed: bool, path: str, blocked: bool,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Sliced attention with a sliding window, slices forward in order and backward later slices first (as a stage
    runs them), against one SDPA call under the dense sliding-window mask: output and the gradients of q, k, v.
    Windows of one key, shorter and longer than the slices, equal to the sequence and beyond it; grouped-query
    heads; packed rows (documents cut inside slices and across them); the CPU's paths and the accelerator's; slices
    run whole and in query blocks."""
    monkeypatch.setattr(blocks_mod, "MIN_PREFIX_TOKENS", 0)   # unwindowed slices take the blocks on CPU
    _query_blocks(monkeypatch, blocked)
    if path == "accelerator":
        _force_accelerator_paths(monkeypatch)
    torch.manual_seed(window)
    batch, heads, kv_heads, head_dim, length = 2, 4, 2, 8, 24
    q = torch.randn(batch, heads, length, head_dim, dtype=dtype)
    k, v = (torch.randn(batch, kv_heads, length, head_dim, dtype=dtype) for _ in range(2))
    grad = torch.randn(batch, length, heads, head_dim, dtype=dtype).transpose(1, 2)
    positions = _positions([[0, 6, 15], [0, 10]], length) if packed else None
    ref_in = [t.detach().requires_grad_() for t in (q, k, v)]
    ref = _dense(*ref_in, _sliding_visible(length, window, positions))
    ref_grads = torch.autograd.grad(ref, ref_in, grad)

    slices = WINDOW_SLICINGS[slicing]
    got = _sliced_outputs_and_grads(q, k, v, grad, slices, positions, window=window)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, (ref.detach(), *ref_grads)):
        # relative to the reference's size, absolute below 1 (a window of one key has dq = 0: rounding alone)
        err = float((a.double() - b.double()).abs().max() / max(float(b.double().abs().max()), 1.0))
        assert err < TOL[dtype], f"{name}: err {err:.2e} (window {window}, slices {slices})"


def test_a_windowed_slice_reads_and_carries_back_only_the_rows_its_window_reaches() -> None:
    """Slice [16, 24) with a window of 3 needs the keys [14, 24): it saves no longer view of the buffers, and its
    backward (the first, so the gradient buffers hold its part alone) writes nothing into rows [0, 14)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 24, 8) for _ in range(3))
    state = MicroBatchState(0, 24, 3)
    outs, saved = [], []
    for i, start in enumerate((0, 8, 16)):
        piece = [t[:, :, start:start + 8].detach().requires_grad_() for t in (q, k, v)]
        hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t)
        with hooks, slice_scope(SliceContext(0, i, start, start + 8, state)):
            outs.append(sliced_causal_attention(*piece, cache_key="attn", window=3))
        if i == 2:
            assert (1, 2, 10, 8) in saved and not any(s[2] > 10 for s in saved if len(s) == 4), saved
    outs[2].sum().backward()
    (bufs,) = state.kv.values()
    for grad in (bufs.grad_k, bufs.grad_v):
        assert not grad[:, :, :14].any() and grad[:, :, 14:16].abs().sum() > 0


def test_a_windowed_slice_longer_than_a_query_block_scores_each_block_over_its_own_window(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With a window of 3 and blocks of at least 4 queries, slice [5, 18) runs blocks [5, 9), [9, 13), [13, 17),
    [17, 18), each over the keys from 2 before its first query: no mask is wider than 4 + 2 keys, where the slice
    run whole would mask (13, 15). The planner's analytic cost counts the same blocks (planner/roofline.py)."""
    import ds_terapipe.runtime.slicing.attention as attention
    from ds_terapipe.planner import roofline

    assert attention.WINDOW_QUERY_BLOCK == roofline.WINDOW_QUERY_BLOCK
    assert attention.window_query_blocks(5, 18, 3, 3) == [(5, 18, 3)]   # blocks of 256: one
    monkeypatch.setattr(attention, "WINDOW_QUERY_BLOCK", 4)
    assert attention.window_query_blocks(5, 18, 3, 3) == [(5, 9, 3), (9, 13, 7), (13, 17, 11), (17, 18, 15)]
    assert attention.window_query_blocks(5, 18, 4, 3) == [(5, 9, 4), (9, 13, 7), (13, 17, 11), (17, 18, 15)]
    masks = []
    real = attention._visible_mask
    monkeypatch.setattr(attention, "_visible_mask", lambda *a: masks.append(real(*a)) or masks[-1])
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 24, 8, dtype=torch.float64) for _ in range(3))
    state = MicroBatchState(0, 24, 3)
    for i, (start, end) in enumerate(((0, 5), (5, 18), (18, 24))):
        masks.clear()
        with slice_scope(SliceContext(0, i, start, end, state)):
            out = sliced_causal_attention(*(t[:, :, start:end] for t in (q, k, v)), cache_key="attn", window=3)
        if i == 1:
            assert [tuple(m.shape) for m in masks] == [(4, 6), (4, 6), (4, 6), (1, 3)]
            ref = _dense(q, k, v, _sliding_visible(24, 3, None))[:, :, start:end]
            torch.testing.assert_close(out, ref)
    assert roofline.computed_pairs(13, 5, 3, block=4) == 3 * 4 * 6 + 1 * 3
    assert roofline.computed_pairs(13, 5, 3) == 13 * 15


@pytest.mark.parametrize("packed", [False, True])
def test_the_masks_of_a_windowed_slice_are_built_once_for_all_its_layers(packed: bool,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Slice [5, 18) with a window of 3 in blocks of 3 queries, through 3 attention layers: plain rows build one
    mask per block geometry (the interior blocks share one: 2 in all), packed rows one per block (5), not one per
    block and layer."""
    import ds_terapipe.runtime.slicing.attention as attention
    import ds_terapipe.runtime.slicing.documents as documents_mod

    monkeypatch.setattr(attention, "WINDOW_QUERY_BLOCK", 1)
    monkeypatch.setattr(attention, "_MASKS", {})
    builds = []
    real = documents_mod.causal_visible
    counting = lambda *a: builds.append(a[:2]) or real(*a)   # noqa: E731
    monkeypatch.setattr(documents_mod, "causal_visible", counting)
    monkeypatch.setattr(attention, "causal_visible", counting)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 24, 8, dtype=torch.float64) for _ in range(3))
    docs = Documents(_positions([[0, 10], [0, 4, 15]], 24)) if packed else None
    state = MicroBatchState(0, 24, 3)
    for i, (start, end) in enumerate(((0, 5), (5, 18), (18, 24))):
        builds.clear()
        with slice_scope(SliceContext(0, i, start, end, state, documents=docs)):
            for layer in range(3):
                sliced_causal_attention(*(t[:, :, start:end] for t in (q, k, v)), cache_key=f"layer{layer}", window=3)
        if i == 1:
            assert len(builds) == (5 if packed else 2), builds


def test_window_one_attends_to_itself_and_a_window_covering_the_sequence_is_causal() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12, 8, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(sliced_causal_attention(q, k, v, cache_key="a", window=1), v)
    causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for window in (12, 13, 1000):
        torch.testing.assert_close(sliced_causal_attention(q, k, v, cache_key="a", window=window), causal)


@pytest.mark.parametrize("window", [0, -2, 2.5, True, "4"])
def test_a_window_that_is_no_positive_int_is_refused(window) -> None:
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=f"window={window!r}; a sliding window is a positive int"):
        sliced_causal_attention(q, q, q, cache_key="a", window=window)


def test_causal_self_attention_with_a_window_passes_the_slice_check() -> None:
    """The reference GPT's attention with ``window=``: unsliced it is SDPA under the sliding mask, and sliced
    (forward, backward, parameter gradients: the engine's check) it equals itself unsliced."""
    from ds_terapipe.runtime.planning.slice_check import check_slicing_equivalence
    torch.manual_seed(0)
    attn = CausalSelfAttention(16, 4, rotary=True, window=5)
    x = torch.randn(2, 32, 16)
    q, k, v = (t.view(2, 32, 4, 4).transpose(1, 2) for t in attn.qkv(x).split(16, dim=2))
    from ds_terapipe.runtime.slicing.attention import apply_rotary
    q, k = apply_rotary(q, 0), apply_rotary(k, 0)
    want = attn.proj(_dense(q, k, v, _sliding_visible(32, 5, None)).transpose(1, 2).reshape(2, 32, 16))
    torch.testing.assert_close(attn(x), want, rtol=1e-5, atol=1e-6)
    assert check_slicing_equivalence([attn], 0, x, [3, 13, 16]) is None


# -- attention-logit softcapping -------------------------------------------------------------------------------
def _softcapped_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                      softcap: float) -> torch.Tensor:
    """transformers' Gemma 2 eager attention, the reference: repeated k/v heads, scores scaled then capped, the
    mask added, softmax, times the values."""
    groups = q.shape[1] // k.shape[1]
    k, v = (t[:, :, None].expand(-1, -1, groups, -1, -1).flatten(1, 2) for t in (k, v))   # transformers' repeat_kv
    scores = torch.tanh(q @ k.transpose(2, 3) * q.shape[-1] ** -0.5 / softcap) * softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("blocked", [False, True], ids=["whole", "query-blocks"])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("window", [None, 3, 7])
@pytest.mark.parametrize("slicing", list(WINDOW_SLICINGS))
def test_softcapped_sliced_attention_equals_the_dense_eager_reference(slicing: str, window: int | None,
                                                                     packed: bool, blocked: bool,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Sliced attention with ``softcap`` (slices forward in order, backward later slices first) against the dense
    softcapped attention of transformers' eager path, fp64: output and the gradients of q, k, v. Scores of a few
    units and a cap of 2, so the cap bites; grouped-query heads; with and without a window; packed rows; windowed
    slices whole and in query blocks."""
    _query_blocks(monkeypatch, blocked)
    torch.manual_seed(3)
    batch, heads, kv_heads, head_dim, length, softcap = 2, 4, 2, 8, 24, 2.0
    q = torch.randn(batch, heads, length, head_dim, dtype=torch.float64) * 2
    k, v = (torch.randn(batch, kv_heads, length, head_dim, dtype=torch.float64) for _ in range(2))
    grad = torch.randn(batch, length, heads, head_dim, dtype=torch.float64).transpose(1, 2)
    positions = _positions([[0, 6, 15], [0, 10]], length) if packed else None
    ref_in = [t.detach().requires_grad_() for t in (q, k, v)]
    ref = _softcapped_dense(*ref_in, _sliding_visible(length, window or length, positions), softcap)
    ref_grads = torch.autograd.grad(ref, ref_in, grad)

    slices = WINDOW_SLICINGS[slicing]
    got = _sliced_outputs_and_grads(q, k, v, grad, slices, positions, window=window, softcap=softcap)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, (ref.detach(), *ref_grads)):
        err = float((a - b).abs().max() / b.abs().max())
        assert err < TOL[torch.float64], f"{name}: rel err {err:.2e} (window {window}, slices {slices})"
    capped = sliced_causal_attention(q, k, v, cache_key="whole", window=window, softcap=1e6)   # a cap never reached
    torch.testing.assert_close(capped, _dense(q, k, v, _sliding_visible(length, window or length, None)))


@pytest.mark.parametrize("softcap", [0, -1.0, True, "50"])
def test_a_softcap_that_is_no_positive_number_is_refused(softcap) -> None:
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=f"softcap={softcap!r}; attention-logit softcapping takes a positive number"):
        sliced_causal_attention(q, q, q, cache_key="a", softcap=softcap)


# -- attention sinks -------------------------------------------------------------------------------------------
def _sinks_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                 sinks: torch.Tensor) -> torch.Tensor:
    """transformers' gpt-oss eager attention, the reference: repeated k/v heads, scaled scores, the mask, each
    head's sink logit appended to every row, the max subtracted, softmax, the sink's column dropped, times v."""
    groups = q.shape[1] // k.shape[1]
    k, v = (t[:, :, None].expand(-1, -1, groups, -1, -1).flatten(1, 2) for t in (k, v))   # transformers' repeat_kv
    scores = (q @ k.transpose(2, 3) * q.shape[-1] ** -0.5).masked_fill(~visible, float("-inf"))
    logits = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    return torch.softmax(logits, dim=-1)[..., :-1] @ v


@pytest.mark.parametrize("special", ["sinks", "softcap"])
def test_the_plain_math_keeps_one_copy_of_the_scores_and_never_repeats_keys(special: str) -> None:
    """A bf16 slice on the plain-math path (an accelerator's for softcaps, and for sinks under a window or in packed
    rows; run on the CPU) keeps for
    backward one (heads, T, keys) tensor of probabilities in bf16 (softcap: and tanh's output), nothing in fp32 of
    that size, and no key/value tensor repeated to the query heads (8 query heads over 2 key/value heads)."""
    torch.manual_seed(0)
    batch, heads, kv_heads, head_dim, length, start = 1, 8, 2, 16, 96, 64
    q = torch.randn(batch, heads, length - start, head_dim, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(batch, kv_heads, length, head_dim, dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    kwargs = {"sinks": torch.randn(heads, requires_grad=True)} if special == "sinks" else {"softcap": 5.0}
    import ds_terapipe.runtime.slicing.attention as attention
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
        out = attention._eager(q, k, v, None, start, length, 0, None, kwargs.get("softcap"), kwargs.get("sinks"),
                               0.0, None)
    scores = batch * heads * (length - start) * length
    big = {x.untyped_storage().data_ptr(): (x.dtype, x.numel()) for x in saved if x.numel() >= scores}
    big = sorted(big.values(), key=str)   # one storage may be kept twice (the softmax's output, the matmul's input)
    assert big == [(torch.bfloat16, scores)] * (1 if special == "sinks" else 2), big
    repeated = batch * heads * length * head_dim   # a key/value tensor with a copy per query head
    assert not any(x.numel() >= repeated and head_dim in x.shape for x in saved), "keys repeated per head"
    out.float().sum().backward()


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("kv_heads, head_dim, v_dim", [(2, 16, 16), (4, 12, 20)], ids=["gqa", "narrow-keys"])
def test_on_an_accelerator_sinks_ride_as_one_more_key_in_flash_eligible_calls(
        kv_heads: int, head_dim: int, v_dim: int, packed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The accelerator's path for sinks where no window hides a key (run on the CPU): a bf16 slice runs one SDPA
    call (packed rows: one per document block), no plain math, whose q, k and v share one width, a multiple of 8
    with room for the sink's column, under the lazy lower-right causal bias over its keys plus the sink key in front,
    as the flash kernel takes them; the result is the dense reference's. Sinks of -inf give plain causal attention
    (not nan: -inf times a key's zero), and a sink of 1e6 takes every row whole (0, not nan)."""
    import ds_terapipe.runtime.slicing.attention as attention
    from torch.nn.attention.bias import CausalBias
    _force_accelerator_paths(monkeypatch)
    calls, real = [], F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):   # the bias dispatches only to the real function: hand it the dense mask
        calls.append((q, k, v, attn_mask))
        return real(q, k, v, attn_mask=attn_mask._materialize(q.device), **kw)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(attention, "_eager", lambda *a: pytest.fail("the plain math ran"))
    torch.manual_seed(2)
    batch, heads, length, start = 2, 4, 40, 24
    q = torch.randn(batch, heads, length, head_dim, dtype=torch.bfloat16)
    k = torch.randn(batch, kv_heads, length, head_dim, dtype=torch.bfloat16)
    v = torch.randn(batch, kv_heads, length, v_dim, dtype=torch.bfloat16)
    sinks = torch.randn(heads) * 2
    positions = _positions([[0, 10, 30], [0, 33]], length) if packed else None
    docs = None if positions is None else Documents(positions)
    out = attention._softcap_or_sinks(q[:, :, start:], k, v, docs, start, length, 0, None, None, sinks, 0.0, None)
    blocks = [Block(0, batch, 0, length - start, 0, start)] if docs is None else docs.blocks(start, length)
    assert len(calls) == len(blocks) == (4 if packed else 1)   # packed: two documents in the slice of each row
    for (wq, wk, wv, bias), b in zip(calls, blocks):
        width = wq.shape[-1]
        assert wk.shape[-1] == wv.shape[-1] == width and width % 8 == 0 and width > head_dim and width >= v_dim
        assert wq.dtype == wk.dtype == wv.dtype == torch.bfloat16 and wk.shape[2] == b.k1 - b.p0 + 1
        assert isinstance(bias, CausalBias) and bias.variant.name == "LOWER_RIGHT"
        assert (bias.seq_len_q, bias.seq_len_kv) == (b.q1 - b.q0, b.k1 - b.p0 + 1)
    ref = _sinks_dense(q.double(), k.double(), v.double(), _sliding_visible(length, length, positions), sinks.double())
    ref = ref[:, :, start:]
    assert float((out.double() - ref).abs().max() / ref.abs().max()) < 2e-2
    whole = [t.double() for t in (q, k, v)]
    plain = real(*whole, is_causal=True, enable_gqa=kv_heads != heads)
    none = sliced_causal_attention(*whole, cache_key="b", sinks=torch.full((heads,), float("-inf")))
    torch.testing.assert_close(none, plain)
    taken = sliced_causal_attention(*whole, cache_key="c", sinks=torch.full((heads,), 1e6))
    assert torch.equal(taken, torch.zeros_like(taken))


@pytest.mark.parametrize("blocked", [False, True], ids=["whole", "query-blocks"])
@pytest.mark.parametrize("path", ["cpu", "accelerator"])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("slicing", ["one", "uneven"])
def test_sliced_attention_with_sinks_equals_the_dense_eager_reference(slicing: str, window: int | None, packed: bool,
                                                                      path: str, blocked: bool,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Sliced attention with ``sinks`` (slices forward in order, backward later slices first) against the dense
    gpt-oss eager reference, fp64: the output and the gradients of q, k, v and the sinks. Sink logits of a few
    units (each takes a visible share of its rows); grouped-query heads; no window and a window of 5 (slices [1, 9,
    3, 6, 5] shorter and longer than it); plain and packed rows; the CPU's fused blocks (the sink merged into their
    log-sum-exp) and the plain math (an accelerator's path, run on the CPU); windowed slices whole and in query
    blocks."""
    import ds_terapipe.runtime.slicing.attention as attention
    _query_blocks(monkeypatch, blocked)
    if path == "accelerator":
        _force_accelerator_paths(monkeypatch)
    merged = []
    monkeypatch.setattr(attention, "block_attention", lambda *a: merged.append(1) or block_attention(*a))
    torch.manual_seed(4)
    batch, heads, kv_heads, head_dim, length = 2, 4, 2, 8, 24
    q = torch.randn(batch, heads, length, head_dim, dtype=torch.float64)
    k, v = (torch.randn(batch, kv_heads, length, head_dim, dtype=torch.float64) for _ in range(2))
    sinks = torch.randn(heads, dtype=torch.float64) * 2
    grad = torch.randn(batch, length, heads, head_dim, dtype=torch.float64).transpose(1, 2)
    positions = _positions([[0, 6, 15], [0, 10]], length) if packed else None
    ref_in = [t.detach().requires_grad_() for t in (q, k, v, sinks)]
    ref = _sinks_dense(*ref_in[:3], _sliding_visible(length, window or length, positions), ref_in[3])
    ref_grads = torch.autograd.grad(ref, ref_in, grad)

    got_sinks = sinks.detach().requires_grad_()
    got = _sliced_outputs_and_grads(q, k, v, grad, WINDOW_SLICINGS[slicing], positions, window=window,
                                    sinks=got_sinks)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), (*got, got_sinks.grad), (ref.detach(), *ref_grads)):
        err = float((a - b).abs().max() / b.abs().max())
        assert err < TOL[torch.float64], f"{name}: rel err {err:.2e} (window {window}, slices {slicing})"
    if path == "accelerator":
        assert not merged, "an accelerator takes the plain math"
    elif window is None:
        assert len(merged) == len(WINDOW_SLICINGS[slicing]), "the CPU takes the blocks wherever no window binds"


def test_sinks_of_minus_infinity_are_plain_causal_attention_and_bad_sinks_are_refused() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12, 8, dtype=torch.float64) for _ in range(3))
    none = torch.full((2,), float("-inf"), dtype=torch.float64)
    torch.testing.assert_close(sliced_causal_attention(q, k, v, cache_key="a", sinks=none),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True))
    bad = ((torch.zeros(3), "of shape (3,)"), ([0.0, 0.0], "a list"), (torch.zeros(2, 1), "of shape (2, 1)"),
           (torch.zeros(2, dtype=torch.int64), "of dtype torch.int64"))
    for sinks, got in bad:
        with pytest.raises(ValueError, match=rf"sinks is {re.escape(got)}, and q has 2 heads; attention sinks are "
                                             r"a floating-point tensor of shape \(2,\)"):
            sliced_causal_attention(q, k, v, cache_key="a", sinks=sinks)


def test_a_sink_far_above_the_scores_takes_every_row_whole_without_overflow() -> None:
    """A sink logit of 1000 (its exp overflows even fp64) on the plain math (a window that hides keys): the sink
    takes every row's whole weight, so the output and all gradients are 0, none nan."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    sinks = torch.full((2,), 1000.0, dtype=torch.float64, requires_grad=True)
    out = sliced_causal_attention(q, k, v, cache_key="a", window=4, sinks=sinks)
    out.sum().backward()
    for got in (out, q.grad, k.grad, v.grad, sinks.grad):
        assert torch.equal(got, torch.zeros_like(got)), got


def test_sequence_parallel_ranks_attend_with_their_heads_sinks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under sequence parallelism rank r attends with the r-th subset of the heads (gather_qkv's split), so it
    takes those heads' sinks: each of 2 emulated ranks (the all-to-alls replaced by the head split they make)
    equals the reference's heads, and the sink gradients of the ranks add up to the reference's."""
    import ds_terapipe.runtime.slicing.attention as attention
    from ds_terapipe.runtime.slicing.sequence import SequenceShare
    torch.manual_seed(5)
    batch, heads, length, head_dim = 1, 4, 12, 8
    q, k, v = (torch.randn(batch, heads, length, head_dim, dtype=torch.float64) for _ in range(3))
    sinks = (torch.randn(heads, dtype=torch.float64) * 2).requires_grad_()
    ref = _sinks_dense(q, k, v, _sliding_visible(length, length, None), sinks)
    (ref_grad,) = torch.autograd.grad(ref.sum(), sinks)
    total = torch.zeros(heads, dtype=torch.float64)
    for rank in range(2):
        share = SequenceShare(group=None, rank=rank, degree=2)
        mine = slice(rank * heads // 2, (rank + 1) * heads // 2)
        monkeypatch.setattr(attention, "gather_qkv", lambda tensors, share: tuple(x[:, mine] for x in tensors))
        monkeypatch.setattr(attention, "scatter_heads", lambda y, share: y)
        ranked = sinks.detach().requires_grad_()
        with slice_scope(SliceContext(0, 0, 0, length, MicroBatchState(0, length, 2), sequence=share)):
            out = sliced_causal_attention(q, k, v, cache_key="a", sinks=ranked)
        torch.testing.assert_close(out, ref[:, mine].detach())
        out.sum().backward()
        assert not ranked.grad[[h for h in range(heads) if h not in range(mine.start, mine.stop)]].any()
        total += ranked.grad
    torch.testing.assert_close(total, ref_grad)


@pytest.mark.parametrize("mixed_dtypes", [False, True])
def test_q_k_v_cross_to_the_sequence_ranks_in_one_all_to_all_per_direction(mixed_dtypes: bool,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """gather_qkv packs queries, keys and values (4 query heads, 2 KV heads, values wider than keys) into one
    all-to-all, forward and backward (tensors of different dtypes: one each). The collective emulated as the identity
    (what a rank would receive if every rank held its tokens): token block i of each result is head subset i of
    that tensor, so a mix-up between q, k and v or their heads shows; scatter_heads undoes it."""
    from ds_terapipe.runtime.slicing import sequence
    from ds_terapipe.runtime.slicing.sequence import SequenceShare, gather_qkv, scatter_heads
    calls = []

    def identity(out: torch.Tensor, inp: torch.Tensor, group: object = None) -> None:
        assert out.is_contiguous() and inp.is_contiguous()
        calls.append(inp.shape)
        out.copy_(inp)

    monkeypatch.setattr(sequence.dist, "all_to_all_single", identity)
    torch.manual_seed(7)
    n, batch, length = 2, 2, 3
    q = torch.randn(batch, 4, length, 12, dtype=torch.float64)
    k = torch.randn(batch, 2, length, 12, dtype=torch.float64)
    v = torch.randn(batch, 2, length, 20, dtype=torch.float32 if mixed_dtypes else torch.float64)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    got = gather_qkv(leaves, SequenceShare(group=None, rank=0, degree=n))
    assert len(calls) == (2 if mixed_dtypes else 1), calls

    def emulated(x: torch.Tensor) -> torch.Tensor:
        part = x.shape[1] // n
        return torch.cat([x[:, i * part:(i + 1) * part] for i in range(n)], dim=2)

    refs = [x.detach().clone().requires_grad_() for x in leaves]
    for g, r in zip(got, refs):
        assert torch.equal(g, emulated(r))
    weights = [torch.randn_like(g) for g in got]
    sum((g * w).sum() for g, w in zip(got, weights)).backward()
    assert len(calls) == (4 if mixed_dtypes else 2), calls
    sum((emulated(r) * w).sum() for r, w in zip(refs, weights)).backward()
    for leaf, ref in zip(leaves, refs):
        assert torch.equal(leaf.grad, ref.grad)
    for g, x in zip(got, leaves):
        assert torch.equal(scatter_heads(g, SequenceShare(group=None, rank=0, degree=n)), x)


# -- values narrower than keys (DeepSeek's latent attention) ---------------------------------------------------
@pytest.mark.parametrize("path", ["cpu", "accelerator"])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("special", [None, "sinks"])
def test_values_of_another_width_than_keys_slice_exactly(special: str | None, window: int | None, packed: bool,
                                                         path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys of 12 dims, values of 20 (MLA's qk_nope + qk_rope vs v_head_dim): sliced attention (slices [1, 9, 3, 6,
    5], backward later slices first) equals the dense reference, fp64: the output (B, nh, T, 20) and the q, k, v
    gradients, on every path (SDPA, the band mask, per-document calls, the plain math sinks and softcaps take)."""
    monkeypatch.setattr(blocks_mod, "MIN_PREFIX_TOKENS", 0)
    if path == "accelerator":
        _force_accelerator_paths(monkeypatch)
    torch.manual_seed(6)
    batch, heads, length = 2, 4, 24
    q, k = (torch.randn(batch, heads, length, 12, dtype=torch.float64) for _ in range(2))
    v = torch.randn(batch, heads, length, 20, dtype=torch.float64)
    grad = torch.randn(batch, length, heads, 20, dtype=torch.float64).transpose(1, 2)
    positions = _positions([[0, 6, 15], [0, 10]], length) if packed else None
    visible = _sliding_visible(length, window or length, positions)
    sinks = torch.randn(heads, dtype=torch.float64)
    kwargs = {"sinks": sinks} if special == "sinks" else {}
    ref_in = [t.detach().requires_grad_() for t in (q, k, v)]
    ref = _sinks_dense(*ref_in, visible, sinks) if special == "sinks" else _dense(*ref_in, visible)
    ref_grads = torch.autograd.grad(ref, ref_in, grad)
    got = _sliced_outputs_and_grads(q, k, v, grad, WINDOW_SLICINGS["uneven"], positions, window=window, **kwargs)
    assert got[0].shape == (batch, heads, length, 20)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, (ref.detach(), *ref_grads)):
        err = float((a - b).abs().max() / b.abs().max())
        assert err < TOL[torch.float64], f"{name}: rel err {err:.2e}"


# -- chunked attention (Llama 4) --------------------------------------------------------------------------------
def _chunked_visible(length: int, chunk: int, positions: torch.Tensor | None) -> torch.Tensor:
    """(B or 1, 1, L, L) transformers' chunked causal mask (``kv_idx <= q_idx`` and ``kv_idx // chunk == q_idx //
    chunk``; for packed rows on the position ids, within each document): the reference, built apart from the code
    under test."""
    query, key = torch.arange(length)[:, None], torch.arange(length)[None, :]
    if positions is None:
        return ((key <= query) & (key // chunk == query // chunk))[None, None]
    ids, chunks = (positions == 0).cumsum(dim=1), positions // chunk
    same = (ids[:, :, None] == ids[:, None, :]) & (chunks[:, :, None] == chunks[:, None, :])
    return ((key <= query)[None] & same)[:, None]


CHUNK_ROWS = {"one document": None, "packed": [[0, 6, 15], [0, 10]], "packed, arriving": [[0, 6, 15], [0, 10]]}


@pytest.mark.parametrize("path", ["cpu", "accelerator"])
@pytest.mark.parametrize("rows", list(CHUNK_ROWS))
@pytest.mark.parametrize("chunk", [1, 4, 7, 24, 40])
@pytest.mark.parametrize("slicing", list(WINDOW_SLICINGS))
def test_chunked_sliced_attention_equals_sdpa_under_the_chunked_mask(slicing: str, chunk: int, rows: str, path: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Sliced attention with ``chunk`` (slices forward in order, backward later slices first) against one SDPA call
    under the dense chunked mask, fp64: output and the gradients of q, k, v. Chunks of one token, shorter and longer
    than the slices, as long as the sequence and beyond it; grouped-query heads; rows of one document (chunks from
    the row's start) and packed rows (chunks from each document's start), their positions known up front (the first
    stage) or arriving slice by slice (a later stage); the CPU's fused blocks and the accelerator's one SDPA call per
    block, each taken by every slice wherever a chunk boundary falls inside the sequence."""
    import ds_terapipe.runtime.slicing.attention as attention
    monkeypatch.setattr(blocks_mod, "MIN_PREFIX_TOKENS", 0)
    if path == "accelerator":
        _force_accelerator_paths(monkeypatch)
    calls = []
    fused, per_block = attention.block_attention, attention.sdpa_blocks
    monkeypatch.setattr(attention, "block_attention", lambda *a: calls.append("fused") or fused(*a))
    monkeypatch.setattr(attention, "sdpa_blocks", lambda *a: calls.append("per block") or per_block(*a))
    torch.manual_seed(chunk)
    batch, heads, kv_heads, head_dim, length = 2, 4, 2, 8, 24
    q = torch.randn(batch, heads, length, head_dim, dtype=torch.float64)
    k, v = (torch.randn(batch, kv_heads, length, head_dim, dtype=torch.float64) for _ in range(2))
    grad = torch.randn(batch, length, heads, head_dim, dtype=torch.float64).transpose(1, 2)
    positions = None if CHUNK_ROWS[rows] is None else _positions(CHUNK_ROWS[rows], length)
    ref_in = [t.detach().requires_grad_() for t in (q, k, v)]
    ref = _dense(*ref_in, _chunked_visible(length, chunk, positions))
    ref_grads = torch.autograd.grad(ref, ref_in, grad)

    slices = WINDOW_SLICINGS[slicing]
    got = _sliced_outputs_and_grads(q, k, v, grad, slices, positions, arriving=rows.endswith("arriving"), chunk=chunk)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, (ref.detach(), *ref_grads)):
        # relative to the reference's size, absolute below 1 (a chunk of one key has dq = 0: rounding alone)
        err = float((a - b).abs().max() / max(float(b.abs().max()), 1.0))
        assert err < TOL[torch.float64], f"{name}: err {err:.2e} (chunk {chunk}, slices {slices}, {rows})"
    if chunk < length:
        assert calls == [{"cpu": "fused", "accelerator": "per block"}[path]] * len(slices), calls


def test_a_chunked_slice_reads_and_carries_back_only_the_rows_of_its_chunk() -> None:
    """Chunks of 7, slices [0, 8), [8, 16), [16, 24): slice [8, 16) needs the keys [7, 16), slice [16, 24) the keys
    [14, 24) (its first query's chunk starts at 14); neither saves a longer view of the buffers, and the last slice's
    backward (the first, so the gradient buffers hold its part alone) writes nothing into rows [0, 14)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 24, 8) for _ in range(3))
    state = MicroBatchState(0, 24, 3)
    outs = []
    for i, start in enumerate((0, 8, 16)):
        saved = []
        piece = [t[:, :, start:start + 8].detach().requires_grad_() for t in (q, k, v)]
        hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t)
        with hooks, slice_scope(SliceContext(0, i, start, start + 8, state)):
            outs.append(sliced_causal_attention(*piece, cache_key="attn", chunk=7))
        keys = {1: 9, 2: 10}.get(i)
        if keys is not None:
            assert (1, 2, keys, 8) in saved and not any(s[2] > keys for s in saved if len(s) == 4), (i, saved)
    outs[2].sum().backward()
    (bufs,) = state.kv.values()
    for grad in (bufs.grad_k, bufs.grad_v):
        assert not grad[:, :, :14].any() and grad[:, :, 14:16].abs().sum() > 0


@pytest.mark.parametrize("path", ["cpu", "accelerator"])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("special", ["window", "softcap", "sinks"])
def test_chunks_combine_exactly_with_a_window_a_softcap_and_sinks(special: str, packed: bool, path: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 7 with a window of 3, a softcap of 2 or sinks (slices [1, 9, 3, 6, 5]; each within the chunks, as
    within documents) against the dense references of the window, Gemma 2 and gpt-oss tests under the chunked mask,
    fp64: the output and the gradients of q, k, v (and of the sinks)."""
    if path == "accelerator":
        _force_accelerator_paths(monkeypatch)
    torch.manual_seed(7)
    batch, heads, kv_heads, head_dim, length, chunk = 2, 4, 2, 8, 24, 7
    q = torch.randn(batch, heads, length, head_dim, dtype=torch.float64) * 2
    k, v = (torch.randn(batch, kv_heads, length, head_dim, dtype=torch.float64) for _ in range(2))
    sinks = torch.randn(heads, dtype=torch.float64) * 2
    grad = torch.randn(batch, length, heads, head_dim, dtype=torch.float64).transpose(1, 2)
    positions = _positions([[0, 6, 15], [0, 10]], length) if packed else None
    visible = _chunked_visible(length, chunk, positions)
    kwargs: dict = {"chunk": chunk}
    ref_in = [t.detach().requires_grad_() for t in (q, k, v, sinks)]
    if special == "window":
        kwargs["window"] = 3
        ref = _dense(*ref_in[:3], visible & _sliding_visible(length, 3, None))
    elif special == "softcap":
        kwargs["softcap"] = 2.0
        ref = _softcapped_dense(*ref_in[:3], visible, 2.0)
    else:
        kwargs["sinks"] = sinks.detach().requires_grad_()
        ref = _sinks_dense(*ref_in[:3], visible, ref_in[3])
    wanted = ref_in if special == "sinks" else ref_in[:3]
    ref_grads = torch.autograd.grad(ref, wanted, grad)
    got = _sliced_outputs_and_grads(q, k, v, grad, WINDOW_SLICINGS["uneven"], positions, **kwargs)
    if special == "sinks":
        got.append(kwargs["sinks"].grad)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, (ref.detach(), *ref_grads)):
        err = float((a - b).abs().max() / b.abs().max())
        assert err < TOL[torch.float64], f"{name}: rel err {err:.2e} ({special}, packed {packed})"


@pytest.mark.parametrize("chunk", [0, -3, 2.5, True, "8"])
def test_a_chunk_that_is_no_positive_int_is_refused(chunk) -> None:
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=f"chunk={chunk!r}; chunked attention takes a positive int"):
        sliced_causal_attention(q, q, q, cache_key="a", chunk=chunk)
