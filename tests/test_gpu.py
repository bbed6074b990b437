"""Tier c: checks that need CUDA (skipped without a GPU; CI has none). fp16/bf16 sliced attention on device, and
packed rows through the flash kernel per document."""

from __future__ import annotations

import pytest
import torch

from ds_terapipe.runtime.slicing.attention import CausalSelfAttention
from ds_terapipe.runtime.slicing.blocks import sdpa_blocks
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


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_packed_rows_on_cuda_run_the_flash_kernel_per_document(kv_heads: int) -> None:
    """sdpa_blocks on CUDA in bf16, with SDPA restricted to its flash kernel (a block it could not take would
    raise), against SDPA under the dense document mask: outputs and q/k/v gradients."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ds_terapipe.runtime.slicing.documents import Documents

    torch.manual_seed(0)
    batch, heads, head_dim, tokens, start = 2, 4, 64, 256, 768
    end = start + tokens
    positions = torch.zeros(batch, end, dtype=torch.long)
    for row, starts in enumerate([[0, 500, 900, 1000], [0, 800]]):
        bounds = [*starts, end]
        for a, b in zip(bounds, bounds[1:]):
            positions[row, a:b] = torch.arange(b - a)
    docs = Documents(positions.cuda())
    first = docs.first_visible(start)
    blocks = docs.blocks(start, end, first)
    opts = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(batch, heads, tokens, head_dim, **opts, requires_grad=True)
    k = torch.randn(batch, kv_heads, end - first, head_dim, **opts, requires_grad=True)
    v = torch.randn(batch, kv_heads, end - first, head_dim, **opts, requires_grad=True)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = sdpa_blocks(q, k, v, blocks, None)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    mask = docs.mask(start, end, torch.bfloat16, first)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=kv_heads != heads)
    ref_grads = torch.autograd.grad(ref.float().square().sum(), (q, k, v))
    for a, b in zip((out, *grads), (ref, *ref_grads)):
        assert (a.float() - b.float()).abs().max() <= 3e-2 * b.float().abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_bias_gradients_go_into_grad_in_one_gemv(dtype: torch.dtype) -> None:
    """The accelerator-only branch of the in-GEMM accumulation: from the second slice's backward on, each Linear's
    bias gradient is one ``addmv_`` into ``.grad`` (no sum and add), and the gradients equal autograd's sum and add
    over the same slices."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from ds_terapipe.models.gpt import GPTBlock, GPTConfig
    from ds_terapipe.runtime.slicing.deferred import enable_fused_grad_accumulation, fused_parameters

    class Calls(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            self.names.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    block = GPTBlock(GPTConfig(num_layers=1, hidden=256, num_heads=4, max_seq_len=512), 0).cuda().to(dtype)
    enable_fused_grad_accumulation(block)
    assert len(fused_parameters(block)) == 8   # 4 weights and their biases
    x = torch.randn(2, 512, 256, device="cuda", dtype=dtype)

    def sliced(fuse: bool) -> tuple[dict, list[str]]:
        block.zero_grad(set_to_none=True)
        state = MicroBatchState(0, 512, 2)
        state.fuse_grad_accumulation = fuse
        outs = []
        for i, (lo, hi) in enumerate(((0, 256), (256, 512))):
            with slice_scope(SliceContext(0, i, lo, hi, state)):
                outs.append(block(x[:, lo:hi]))
        outs[1].float().square().sum().backward()
        with Calls() as calls:
            outs[0].float().square().sum().backward()
        return {n: p.grad.float().clone() for n, p in block.named_parameters()}, calls.names

    ref, plain = sliced(fuse=False)
    got, fused = sliced(fuse=True)
    assert plain.count("addmv_") == 0 and fused.count("addmv_") == 4 and fused.count("addmm_") == 4, fused
    assert fused.count("sum") == plain.count("sum") - 4, (plain, fused)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, g in ref.items():
        assert (got[name] - g).abs().max() <= tol * g.abs().max(), name
