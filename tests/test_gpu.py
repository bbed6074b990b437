"""Tier c: checks that need CUDA (skipped without a GPU; CI has none). fp16/bf16 sliced attention on device."""

from __future__ import annotations

import pytest
import torch

from ds_terapipe.runtime.slicing.attention import CausalSelfAttention
from ds_terapipe.runtime.slicing.context import MicroBatchState, SliceContext, slice_scope

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sliced_attention_on_cuda(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    attn = CausalSelfAttention(256, 4, rotary=True).cuda().to(dtype)
    x = torch.randn(2, 512, 256, device="cuda", dtype=dtype, requires_grad=True)
    full = attn(x)
    full.float().square().sum().backward()
    ref_grad = x.grad.clone()
    x.grad = None
    state = MicroBatchState(0, 512, 3)
    units, start = [], 0
    for i, length in enumerate([128, 256, 128]):
        piece = x[:, start:start + length].detach().requires_grad_()
        with slice_scope(SliceContext(0, i, start, start + length, state)):
            units.append((piece, attn(piece), start, length))
        start += length
    out = torch.cat([u[1] for u in units], dim=1)
    assert (out.float() - full.float()).abs().max() <= 2e-2 * full.float().abs().max()
    grad = torch.zeros_like(x)
    for piece, y, lo, length in reversed(units):
        y.float().square().sum().backward()
        grad[:, lo:lo + length] = piece.grad
    assert (grad.float() - ref_grad.float()).abs().max() <= 5e-2 * ref_grad.float().abs().max()
