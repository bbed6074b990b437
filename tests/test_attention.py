"""Tier a, one process: sliced causal attention equals unsliced, forward and backward, for random slicings.

Runs slices forward in order and backward later-slices-first exactly as the engine does (each slice's graph
separately), so it checks the KV-gradient carry without DeepSpeed or processes.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ds_terapipe.runtime.slicing.attention import CausalSelfAttention, apply_rotary, sliced_causal_attention
from ds_terapipe.runtime.slicing.context import KVBuffers, MicroBatchState, SliceContext, slice_scope
from ds_terapipe.runtime.planning.slice_check import check_slicing_equivalence
from tests.aten_calls import AtenCalls


def random_slices(seq_len: int, rng: random.Random) -> list[int]:
    cuts = sorted(rng.sample(range(1, seq_len), rng.randint(1, min(6, seq_len - 1))))
    bounds = [0, *cuts, seq_len]
    return [b - a for a, b in zip(bounds, bounds[1:])]


class Block(nn.Module):

    def __init__(self, hidden: int, heads: int, rotary: bool) -> None:
        super().__init__()
        self.attn = CausalSelfAttention(hidden, heads, rotary=rotary)
        self.mlp = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


def run_slices(model: nn.Module, x: torch.Tensor, slices: list[int]) -> list[tuple]:
    """Forward of each slice in order through the slice context, as a stage runs them: (input leaf, output,
    start, length) per slice."""
    state = MicroBatchState(0, x.shape[1], len(slices))
    units, start = [], 0
    for i, length in enumerate(slices):
        piece = x[:, start:start + length].detach().requires_grad_()
        with slice_scope(SliceContext(0, i, start, start + length, state)):
            units.append((piece, model(piece), start, length))
        start += length
    return units


@pytest.mark.parametrize("rotary", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_sliced_forward_backward_equals_unsliced(rotary: bool, seed: int) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    seq_len, hidden = rng.randint(5, 40), 16
    model = nn.Sequential(Block(hidden, 4, rotary), Block(hidden, 4, rotary)).double()
    x = torch.randn(2, seq_len, hidden, dtype=torch.double, requires_grad=True)
    weight = torch.randn(2, seq_len, hidden, dtype=torch.double)
    (model(x) * weight).sum().backward()
    ref_x, ref_params = x.grad.clone(), [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    x.grad = None

    slices = random_slices(seq_len, rng)
    units = run_slices(model, x, slices)
    out = torch.cat([u[1] for u in units], dim=1)
    assert torch.allclose(out, model(x.detach()), atol=1e-10), slices
    grad_x = torch.zeros_like(x)
    for piece, y, start, length in reversed(units):  # later slices first, one graph each
        y.backward(weight[:, start:start + length])
        grad_x[:, start:start + length] = piece.grad
    assert torch.allclose(grad_x, ref_x, atol=1e-10), slices
    for p, ref in zip(model.parameters(), ref_params):
        assert torch.allclose(p.grad, ref, atol=1e-10), slices


def test_the_cache_gradient_is_one_add_per_slice_and_no_copy_for_the_projection() -> None:
    """A slice's backward adds its key (and value) gradient into the cache's gradient buffer with one kernel and
    hands its own rows back as they lie: no second add, and (on a CPU, whose flash kernel lays its gradient out as
    (B, T, nh, hs)) no copy before the fused projection's backward. On a device bound by launching kernels every
    kernel counts; a GPT block has 2 per slice fewer than adding the two parts apart."""
    torch.manual_seed(0)
    model = CausalSelfAttention(32, 4).requires_grad_(False)   # no AccumulateGrad adds in the count
    x = torch.randn(2, 24, 32)
    units = run_slices(model, x, [8, 8, 8])
    counts = []
    for piece, y, start, length in reversed(units):
        with AtenCalls() as ops:
            y.backward(torch.ones_like(y))
        counts.append((ops.names.count("add_"), ops.names.count("add"), ops.names.count("clone"),
                       ops.names.count("copy_")))
    # the last slice's backward copies its gradient into the new buffer (one clone per k/v); the others add
    assert counts == [(0, 0, 2, 0), (2, 0, 0, 0), (2, 0, 0, 0)], counts
    ref = x.clone().requires_grad_()
    model(ref).backward(torch.ones_like(ref))
    got = torch.cat([u[0].grad for u in units], dim=1)
    assert torch.allclose(got, ref.grad, atol=1e-6)


def test_the_device_presets_count_the_gpt_blocks_backward_kernels_as_it_runs() -> None:
    """The analytic GPU cost (``planner/roofline.py`` ``BLOCKS``) prices a GPT block's backward by its kernels
    besides the GEMMs, the attention kernel and the gradients' accumulation: the count must be the block's own.
    A slice with a prefix, the block's parameters frozen (their gradients are priced apart)."""
    from ds_terapipe.models.gpt import GPTBlock, GPTConfig
    from ds_terapipe.planner.roofline import BLOCKS
    block = GPTBlock(GPTConfig(num_layers=1, hidden=32, num_heads=4, max_seq_len=64), 0).requires_grad_(False)
    x = torch.randn(1, 16, 32)
    state = MicroBatchState(0, 16, 3)
    with torch.no_grad(), slice_scope(SliceContext(0, 0, 0, 8, state)):
        block(x[:, :8])
    piece, last = x[:, 8:12].clone().requires_grad_(), x[:, 12:].clone().requires_grad_()
    with slice_scope(SliceContext(0, 1, 8, 12, state)):
        y = block(piece)
    with slice_scope(SliceContext(0, 2, 12, 16, state)):
        block(last).sum().backward()   # the later slice first: it makes the cache's gradient buffers
    grad = torch.ones_like(y)
    with AtenCalls() as ops:
        y.backward(grad)
    gemm_attention = {"mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu_backward"}
    views = {"view", "_unsafe_view", "_reshape_alias", "reshape", "transpose", "t", "permute", "expand", "split",
             "split_with_sizes", "slice", "select", "unsqueeze", "squeeze", "as_strided", "alias", "detach",
             "empty", "empty_like", "empty_strided"}
    small = [name for name in ops.names if name not in gemm_attention | views]
    assert len(small) == BLOCKS["gpt"].input_grad, small


def test_the_cache_gradient_buffer_takes_the_layout_of_the_gradient() -> None:
    """The buffer's rows are handed on as views, so it is laid out as the attention kernel's gradient is (dims of
    size 1 carry no order; an expanded gradient gets a contiguous buffer), with the full length in dim 2."""
    from ds_terapipe.runtime.slicing.context import _zeros_in_layout_of

    bthd = torch.randn(2, 5, 4, 8).transpose(1, 2)                      # (B, nh, T, hs), (B, T, nh, hs) in memory
    got = _zeros_in_layout_of(bthd, 12)
    assert got.shape == (2, 4, 12, 8) and got.transpose(1, 2).is_contiguous() and not got.any()
    one = torch.randn(1, 5, 4, 8).transpose(1, 2)                       # batch 1: its stride says nothing
    assert _zeros_in_layout_of(one, 12).transpose(1, 2).is_contiguous()
    single = torch.randn(2, 1, 4, 8).transpose(1, 2)                    # a one-token slice: still (B, T, nh, hs)
    assert _zeros_in_layout_of(single, 12).transpose(1, 2).is_contiguous()
    expanded = torch.randn(2, 4, 1, 8).expand(2, 4, 5, 8)               # stride 0 in the token dim
    assert _zeros_in_layout_of(expanded, 12).is_contiguous()


def test_a_leaf_key_gets_a_gradient_of_its_own() -> None:
    """Keys and values that are leaves, or views of leaves, get a copy: autograd would keep the buffer's view as the
    leaf's ``.grad``, and the buffer with it. Laid out as a fused projection's views are, (B, T, nh, hs) in memory,
    the layout of the buffer's rows (autograd copies a gradient of another layout anyway)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12, 8, requires_grad=True) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref.backward(torch.ones_like(ref))
    state = MicroBatchState(0, 12, 2)
    roots, outs = [], []
    for i, (lo, hi) in enumerate(((0, 4), (4, 12))):
        if i == 0:   # leaves themselves
            leaves = [t.detach()[:, :, lo:hi].transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
                      for t in (q, k, v)]
            roots.append(leaves)
        else:        # views of leaves: (B, T, nh, hs) leaves seen as (B, nh, T, hs)
            bases = [t.detach()[:, :, lo:hi].transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
            roots.append(bases)
            leaves = [t.transpose(1, 2) for t in bases]
        with slice_scope(SliceContext(0, i, lo, hi, state)):
            outs.append(sliced_causal_attention(*leaves, cache_key="a"))
    for y in reversed(outs):
        y.backward(torch.ones_like(y))
    buffers = next(iter(state.kv.values()))
    cache = {buffers.grad_k.untyped_storage().data_ptr(), buffers.grad_v.untyped_storage().data_ptr()}
    for index, want in enumerate((q.grad, k.grad, v.grad)):
        first, second = roots[0][index], roots[1][index]
        assert torch.allclose(torch.cat([first.grad, second.grad.transpose(1, 2)], dim=2), want, atol=1e-5), index
        if index:   # keys and values (queries are never cached)
            assert first.grad.untyped_storage().data_ptr() not in cache, index
            assert second.grad.untyped_storage().data_ptr() not in cache, index


class ConstantKeyAttention(nn.Module):
    """Attention that passes one constant ``cache_key`` for every instance (a common user shortcut)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(hidden, 3 * hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.unsqueeze(1) for t in self.qkv(x).chunk(3, dim=2))  # (B, 1, T, C)
        return x + sliced_causal_attention(q, k, v, cache_key="attn").squeeze(1)


def _sliced_vs_unsliced(model: nn.Module, x: torch.Tensor, slices: list[int]) -> float:
    """Worst absolute difference of output, input gradient and parameter gradients, sliced vs unsliced."""
    weight = torch.randn(x.shape, dtype=x.dtype, generator=torch.Generator().manual_seed(1))
    x = x.detach().requires_grad_()
    out = model(x)
    (out * weight).sum().backward()
    ref = [out.detach(), x.grad.clone(), *[p.grad.clone() for p in model.parameters()]]
    model.zero_grad(set_to_none=True)
    units = run_slices(model, x, slices)
    for piece, y, start, length in reversed(units):  # later slices first, one graph each
        y.backward(weight[:, start:start + length])
    got = [torch.cat([u[1] for u in units], dim=1).detach(), torch.cat([u[0].grad for u in units], dim=1),
           *[p.grad for p in model.parameters()]]
    return max(float((a - b).abs().max()) for a, b in zip(got, ref))


def test_a_block_applied_twice_and_shared_cache_keys_train_exactly() -> None:
    torch.manual_seed(3)
    shared = Block(16, 4, rotary=True)
    # one module at two depths (weight sharing), and two layers that pass the same constant cache_key
    model = nn.Sequential(shared, nn.Linear(16, 16), shared, ConstantKeyAttention(16),
                          ConstantKeyAttention(16)).double()
    x = torch.randn(2, 24, 16, dtype=torch.double)
    assert _sliced_vs_unsliced(model, x, [8, 4, 12]) < 1e-10
    assert check_slicing_equivalence(list(model), 0, x, [8, 4, 12]) is None


class PlainCausal(nn.Module):
    """Causal, but ignores the slice context: sliced it would not see earlier slices."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = x.unsqueeze(1)
        return F.scaled_dot_product_attention(q, q, q, is_causal=True).squeeze(1)


class MeanMixer(nn.Module):

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + x.mean(dim=1, keepdim=True)


class InplaceScale(nn.Module):
    """Position-wise, in place on its input (allowed in training, where its input is not a leaf)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2.0)


def test_slice_check_accepts_sliced_attention_and_refuses_the_rest() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 32, 16)
    good = [nn.Linear(16, 16), CausalSelfAttention(16, 4, rotary=True), InplaceScale(), nn.LayerNorm(16)]
    assert check_slicing_equivalence(good, 0, x, [8, 16, 8]) is None
    for bad, name in ((PlainCausal(), "PlainCausal"), (MeanMixer(), "MeanMixer")):
        problem = check_slicing_equivalence([nn.Linear(16, 16), bad], 5, x, [8, 16, 8])
        assert problem is not None and f"layer 6 ({name})" in problem


def test_wrong_slice_length_is_a_clear_error() -> None:
    attn = CausalSelfAttention(16, 4)
    state = MicroBatchState(0, 32, 2)
    with slice_scope(SliceContext(0, 1, 8, 16, state)), pytest.raises(ValueError, match="running slice has 8"):
        attn(torch.randn(1, 32, 16))


def test_queries_of_the_whole_sequence_with_keys_of_the_slice_are_a_clear_error() -> None:
    """The length check covers the queries too: keys/values of the slice with queries of the whole sequence would
    otherwise run attention over the wrong rows."""
    state = MicroBatchState(0, 32, 2)
    q, kv = torch.randn(1, 4, 32, 4), torch.randn(1, 4, 8, 4)
    for ctx in (SliceContext(0, 0, 0, 8, state), SliceContext(0, 1, 8, 16, state)):
        with slice_scope(ctx), pytest.raises(ValueError, match="running slice has 8"):
            sliced_causal_attention(q, kv, kv, cache_key="attn")


def test_rotary_at_an_integer_offset_rotates_by_the_positions_from_it() -> None:
    """``apply_rotary(x, offset)`` is ``apply_rotary(x, arange(offset, offset + T))``, not positions from 0."""
    x = torch.randn(2, 4, 6, 8, dtype=torch.float64)
    positions = torch.arange(5, 11)
    assert torch.equal(apply_rotary(x, 5), apply_rotary(x, positions))
    assert not torch.allclose(apply_rotary(x, 5), apply_rotary(x, 0))


def test_a_first_cache_gradient_short_of_the_end_starts_from_zeros() -> None:
    """``KVBuffers.add_grad``: a first call that does not reach the end (the profile's) adds into zeros, never into
    uninitialised memory (torch fills that with NaN here)."""
    grad = torch.randn(1, 2, 5, 4)
    deterministic = torch.are_deterministic_algorithms_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        bufs = KVBuffers(torch.empty(1, 2, 8, 4), torch.empty(1, 2, 8, 4), 8)
        own = bufs.add_grad("k", grad, 2)
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch.utils.deterministic.fill_uninitialized_memory = fill
    assert torch.equal(own, grad[:, :, 2:5])
    assert torch.equal(bufs.grad_k[:, :, :5], grad) and not bufs.grad_k[:, :, 5:].any()


class ZeroProjAttention(nn.Module):
    """Residual attention with a zero-initialised output projection (outputs equal the input at init)."""

    def __init__(self, hidden: int, mode: str, zero_qkv: bool = False) -> None:
        super().__init__()
        self.mode = mode
        self.attn = CausalSelfAttention(hidden, 4)
        nn.init.zeros_(self.attn.proj.weight)
        nn.init.zeros_(self.attn.proj.bias)
        if zero_qkv:
            nn.init.zeros_(self.attn.qkv.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "sliced":
            return x + self.attn(x)
        q, k, v = self.attn.qkv(x).unsqueeze(1).chunk(3, dim=3)  # (B, 1, T, C) each
        # "bidirectional": no mask; "slice-blind": causal over the running slice alone
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.mode == "slice-blind").squeeze(1)
        return x + self.attn.proj(y)


@pytest.mark.parametrize("mode", ["bidirectional", "slice-blind"])
@pytest.mark.parametrize("zero_qkv", [False, True])
def test_zero_initialised_projection_does_not_hide_token_mixing(mode: str, zero_qkv: bool) -> None:
    torch.manual_seed(0)
    layer = ZeroProjAttention(16, mode, zero_qkv)
    x = torch.randn(2, 32, 16)
    assert torch.equal(layer(x), x)  # the outputs alone cannot tell
    problem = check_slicing_equivalence([nn.LayerNorm(16), layer], 3, x, [8, 16, 8])
    assert problem is not None and "layer 4 (ZeroProjAttention)" in problem and "slices=1" in problem
    # zero proj alone: its own gradient shows the mixing; zero qkv too: found with the zero weights perturbed
    assert ("all-zero weights set to random values" in problem) == zero_qkv, problem


def test_slice_check_leaves_weights_and_grads_untouched() -> None:
    torch.manual_seed(0)
    layer = ZeroProjAttention(16, "sliced", zero_qkv=True)
    grads = [torch.randn_like(p) for p in layer.parameters()]
    for p, g in zip(layer.parameters(), grads):
        p.grad = g
    before = [p.detach().clone() for p in layer.parameters()]
    assert check_slicing_equivalence([layer], 0, torch.randn(2, 32, 16), [8, 16, 8]) is None  # accepted
    assert all(torch.equal(p, b) for p, b in zip(layer.parameters(), before))  # perturbed, restored bit for bit
    assert all(p.grad is g for p, g in zip(layer.parameters(), grads))


class GQAAttention(nn.Module):
    """Grouped-query attention: 4 query heads over 2 key/value heads, handed over without repeating k/v."""

    def __init__(self, hidden: int, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.q = nn.Linear(hidden, hidden)
        self.kv = nn.Linear(hidden, 2 * kv_heads * self.head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape
        q = self.q(x).view(batch, tokens, self.heads, self.head_dim).transpose(1, 2)   # (B, nh, T, hs)
        k, v = (t.view(batch, tokens, self.kv_heads, self.head_dim).transpose(1, 2)    # (B, nkv, T, hs)
                for t in self.kv(x).chunk(2, dim=2))
        return x + sliced_causal_attention(q, k, v, cache_key=self).transpose(1, 2).reshape(batch, tokens, -1)


@pytest.mark.parametrize("seed", range(3))
def test_grouped_query_attention_sliced_equals_repeated_kv_unsliced(seed: int) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    seq_len, hidden = rng.randint(8, 40), 16
    model = GQAAttention(hidden).double()
    x = torch.randn(2, seq_len, hidden, dtype=torch.double, requires_grad=True)
    weight = torch.randn(2, seq_len, hidden, dtype=torch.double)

    # reference: plain causal attention with each key/value head repeated for its query group
    q = model.q(x).view(2, seq_len, 4, 4).transpose(1, 2)
    k, v = (t.view(2, seq_len, 2, 4).transpose(1, 2).repeat_interleave(2, dim=1) for t in model.kv(x).chunk(2, dim=2))
    ref = x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, seq_len, hidden)
    (ref * weight).sum().backward()
    ref_x, ref_params = x.grad.clone(), [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    slices = random_slices(seq_len, rng)
    units = run_slices(model, x, slices)
    assert torch.allclose(torch.cat([u[1] for u in units], dim=1), ref, atol=1e-10), slices
    assert kv_buffer_heads(model, x, slices[0]) == 2   # the cache holds the 2 key/value heads, not 4 repeats
    grad_x = torch.zeros_like(x)
    for piece, y, start, length in reversed(units):
        y.backward(weight[:, start:start + length])
        grad_x[:, start:start + length] = piece.grad
    assert torch.allclose(grad_x, ref_x, atol=1e-10), slices
    for p, r in zip(model.parameters(), ref_params):
        assert torch.allclose(p.grad, r, atol=1e-10), slices


def kv_buffer_heads(model: GQAAttention, x: torch.Tensor, first: int) -> int:
    """Heads of the K buffer the attention fills for a first slice of ``first`` tokens (of two or more)."""
    state = MicroBatchState(0, x.shape[1], 2)
    with torch.no_grad(), slice_scope(SliceContext(0, 0, 0, first, state)):
        model(x[:, :first])
    (buffers,) = state.kv.values()
    return buffers.k.shape[1]


def test_grouped_query_heads_must_divide() -> None:
    q, kv = torch.randn(1, 4, 8, 4), torch.randn(1, 3, 8, 4)
    with pytest.raises(ValueError, match="q has 4 heads but k/v have 3/3"):
        sliced_causal_attention(q, kv, kv, cache_key="x")


def test_the_slice_check_leaves_grads_and_gradient_hooks_alone() -> None:
    # DeepSpeed hooks the live parameters (ZeRO buckets, bf16 immediate_grad_update into the fp32 copies): the
    # check's gradients must never reach them, nor .grad
    torch.manual_seed(0)
    block = Block(16, 4, rotary=True)
    fired = []
    for p in block.parameters():
        p.grad = torch.full_like(p, 7.0)
        p.register_post_accumulate_grad_hook(lambda param: fired.append(param))
    x = torch.randn(2, 24, 16)
    assert check_slicing_equivalence([block], 0, x, [5, 11, 8]) is None
    assert not fired
    assert all(torch.equal(p.grad, torch.full_like(p, 7.0)) for p in block.parameters())


def test_causal_lm_loss_is_additive_over_slices_with_ignored_labels() -> None:
    # the engine weights each slice's loss by tokens / seq_len; with -100 labels (and a slice of nothing but
    # them) that must still add up to the unsliced loss, and stay finite
    from ds_terapipe.models.gpt import causal_lm_loss

    torch.manual_seed(0)
    logits, labels = torch.randn(2, 12, 7), torch.randint(0, 7, (2, 12))
    labels[:, 4:8] = -100
    labels[0, 0] = -100
    whole = causal_lm_loss(logits, labels)
    sliced = sum(causal_lm_loss(logits[:, a:b], labels[:, a:b]) * (b - a) / 12 for a, b in ((0, 4), (4, 8), (8, 12)))
    assert torch.isfinite(sliced) and torch.allclose(sliced, whole, rtol=1e-6), (sliced, whole)
    plain = torch.randint(0, 7, (2, 12))
    assert torch.allclose(causal_lm_loss(logits, plain), F.cross_entropy(logits.reshape(-1, 7), plain.reshape(-1)))
