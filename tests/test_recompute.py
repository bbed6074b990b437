"""Tier a, one process: activation checkpointing of token slices (runtime/features/recompute.py).

Slices run forward in order and backward later-slices-first, as a stage runs them; every two-block segment is
checkpointed, so each slice's backward recomputes its forward over the earlier slices' cached keys/values. The
multi-process equivalence through DeepSpeed is in tests/test_engine_features.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from ds_terapipe.config import TeraPipeConfig
from ds_terapipe.planner.slicing import MemoryModel
from ds_terapipe.runtime.slicing.attention import CausalSelfAttention
from ds_terapipe.runtime.slicing.context import MicroBatchState, SliceContext, slice_scope
from ds_terapipe.runtime.slicing.deferred import WeightGradStash, enable_deferred_weight_grads
from ds_terapipe.runtime.features.recompute import install_sliced_checkpointing, planned_activation_factor, sliced_checkpoint


class Block(nn.Module):

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.attn = CausalSelfAttention(hidden, 4, rotary=True)
        self.mlp = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


@pytest.mark.parametrize("deferred", [False, True])
def test_recomputed_slices_equal_unsliced(deferred: bool) -> None:
    torch.manual_seed(0)
    hidden, slices = 16, [5, 11, 8]
    seq_len = sum(slices)
    blocks = nn.ModuleList(Block(hidden) for _ in range(4)).double()
    x = torch.randn(2, seq_len, hidden, dtype=torch.double, requires_grad=True)
    weight = torch.randn(2, seq_len, hidden, dtype=torch.double)

    def segment(lo: int, hi: int):
        def run(h: torch.Tensor) -> torch.Tensor:
            for block in blocks[lo:hi]:
                h = block(h)
            return h
        return run

    y = x
    for lo in (0, 2):
        y = segment(lo, lo + 2)(y)
    (y * weight).sum().backward()
    ref_x, ref_params = x.grad.clone(), [p.grad.clone() for p in blocks.parameters()]
    blocks.zero_grad()
    if deferred:
        enable_deferred_weight_grads(blocks)

    state = MicroBatchState(0, seq_len, len(slices))
    state.weight_stash = WeightGradStash() if deferred else None
    units, start = [], 0
    for i, length in enumerate(slices):
        piece = x[:, start:start + length].detach().requires_grad_()
        with slice_scope(SliceContext(0, i, start, start + length, state)):
            h = piece
            for lo in (0, 2):  # two checkpointed segments, each with two attention calls
                h = sliced_checkpoint(segment(lo, lo + 2), h)
        units.append((piece, h, start, length))
        start += length
    grad_x = torch.zeros_like(x)
    for piece, out, start, length in reversed(units):  # backward outside any slice context, as the engine's
        out.backward(weight[:, start:start + length])
        grad_x[:, start:start + length] = piece.grad
    if deferred:
        state.weight_stash.flush()
    assert torch.allclose(grad_x, ref_x, atol=1e-10)
    for p, ref in zip(blocks.parameters(), ref_params):
        assert torch.allclose(p.grad, ref, atol=1e-10)


def test_install_refuses_other_checkpoint_functions() -> None:
    module = SimpleNamespace(activation_checkpoint_interval=2, activation_checkpoint_func=lambda f, *a: f(*a))
    with pytest.raises(ValueError, match="activation_checkpoint_func=.*not supported by the token pipeline"):
        install_sliced_checkpointing(module)
    off = SimpleNamespace(activation_checkpoint_interval=0, activation_checkpoint_func=None)
    assert install_sliced_checkpointing(off) is False and off.activation_checkpoint_func is None


def test_memory_factor_follows_the_interval() -> None:
    assert MemoryModel.factor_for_checkpoint_interval(0) == 34.0
    assert MemoryModel.factor_for_checkpoint_interval(1) == 2.0
    assert MemoryModel.factor_for_checkpoint_interval(4) == 0.5
    with pytest.raises(ValueError, match="activation_checkpoint_interval"):
        MemoryModel.factor_for_checkpoint_interval(-1)


@pytest.mark.parametrize("schedule, deferred, factor", [("gpipe", None, 34.0), ("gpipe", False, 2.0),
                                                        ("1f1b", None, 2.0), ("1f1b", True, 2.0)])
def test_planned_factor_keeps_what_deferred_weights_hold(schedule: str, deferred: bool | None,
                                                         factor: float) -> None:
    """gpipe defers weight gradients to one W per micro-batch: the recorded pairs hold what recompute frees."""
    cfg = TeraPipeConfig(enabled=True, seq_len=64, schedule=schedule, deferred_weight_grads=deferred)
    assert planned_activation_factor(1, cfg) == factor
    assert planned_activation_factor(0, cfg) == 34.0
