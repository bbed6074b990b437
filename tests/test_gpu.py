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
def test_on_cuda_fp32_bias_gradients_go_into_grad_in_one_gemv(dtype: torch.dtype) -> None:
    """The accelerator branch of the in-GEMM accumulation: in fp32, from the second slice's backward on, each
    Linear's bias gradient is one ``addmv_`` into ``.grad`` (no sum and add), and over 4096 tokens it is as close to
    the fp64 sum as autograd's sum and add; bf16 keeps the sum and add (see ``deferred.bias_grad_in_gemv``)."""
    from ds_terapipe.models.gpt import GPTBlock, GPTConfig
    from ds_terapipe.runtime.slicing.deferred import enable_fused_grad_accumulation, fused_parameters
    from tests.aten_calls import AtenCalls

    seq = 4096
    block = GPTBlock(GPTConfig(num_layers=1, hidden=256, num_heads=4, max_seq_len=seq), 0).cuda().to(dtype)
    enable_fused_grad_accumulation(block)
    assert len(fused_parameters(block)) == (8 if dtype == torch.float32 else 4)   # weights (and fp32 biases)
    x = torch.randn(2, seq, 256, device="cuda", dtype=dtype)
    half = seq // 2

    def sliced(model: torch.nn.Module, inputs: torch.Tensor, fuse: bool) -> tuple[dict, list[str]]:
        model.zero_grad(set_to_none=True)
        state = MicroBatchState(0, seq, 2)
        state.fuse_grad_accumulation = fuse
        outs = []
        for i, (lo, hi) in enumerate(((0, half), (half, seq))):
            with slice_scope(SliceContext(0, i, lo, hi, state)):
                outs.append(model(inputs[:, lo:hi]))
        outs[1].float().square().mean().backward()
        with AtenCalls() as calls:
            outs[0].float().square().mean().backward()
        return {n: p.grad.double().clone() for n, p in model.named_parameters()}, calls.names

    ref, plain = sliced(block, x, fuse=False)
    got, fused = sliced(block, x, fuse=True)
    exact, _ = sliced(GPTBlock(GPTConfig(num_layers=1, hidden=256, num_heads=4, max_seq_len=seq), 0).cuda().double(),
                      x.double(), fuse=False)
    gemvs = 4 if dtype == torch.float32 else 0
    assert plain.count("addmv_") == 0 and fused.count("addmv_") == gemvs and fused.count("addmm_") == 4, fused
    assert fused.count("sum") == plain.count("sum") - gemvs, (plain, fused)
    for name, want in exact.items():
        err_fused, err_plain = (got[name] - want).abs().max(), (ref[name] - want).abs().max()
        assert err_fused <= 2 * err_plain + 1e-6 * want.abs().max(), (name, float(err_fused), float(err_plain))


def _variant_reference(q, k, v, visible, softcap=None, sinks=None):
    """Dense attention in fp32 with transformers' eager order: scaled scores, cap, mask, the sink as one more logit,
    softmax, the sink's column dropped, times the values (grouped-query k/v repeated to the query heads)."""
    groups = q.shape[1] // k.shape[1]
    k, v = (t.float().repeat_interleave(groups, dim=1) for t in (k, v))
    scores = q.float() @ k.transpose(2, 3) * q.shape[-1] ** -0.5
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1] @ v
    return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("variant", ["window", "window+softcap", "sinks", "window+sinks", "narrow values"])
def test_attention_variants_on_cuda_in_bf16(variant: str, device: str = "cuda") -> None:
    """The models' attention variants on the device, bf16, 3 slices of a 1024-token sequence (backward later slices
    first): a window of 96 (binding slices run in query blocks of 256), Gemma 2's softcap, gpt-oss' sinks, keys of 96
    dims over values of 64; output and q/k/v (and sink) gradients against the fp32 dense reference."""
    from ds_terapipe import sliced_causal_attention

    torch.manual_seed(0)
    batch, heads, kv_heads, length, window = 2, 8, 2, 1024, 96
    qk_dim, v_dim = (96, 64) if variant == "narrow values" else (64, 64)
    opts = dict(device=device, dtype=torch.bfloat16)
    q = torch.randn(batch, heads, length, qk_dim, **opts)
    k = torch.randn(batch, kv_heads, length, qk_dim, **opts)
    v = torch.randn(batch, kv_heads, length, v_dim, **opts)
    kwargs = {"window": window if "window" in variant else None,
              "softcap": 20.0 if "softcap" in variant else None}
    sinks = torch.randn(heads, device=device, dtype=torch.float32).requires_grad_() if "sinks" in variant else None
    idx = torch.arange(length, device=device)
    visible = (idx[None] <= idx[:, None]) & (idx[:, None] - idx[None] < (kwargs["window"] or length))
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref_sinks = None if sinks is None else sinks.detach().clone().requires_grad_()
    ref = _variant_reference(*ref_in, visible, kwargs["softcap"], ref_sinks)
    grad_out = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, ref_in + ([ref_sinks] if sinks is not None else []), grad_out)
    state = MicroBatchState(0, length, 3)
    bounds, pieces, outs = [0, 200, 700, length], [], []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        piece = [t[:, :, a:b].detach().requires_grad_() for t in (q, k, v)]
        with slice_scope(SliceContext(0, i, a, b, state)):
            outs.append(sliced_causal_attention(*piece, cache_key="attn", sinks=sinks, **kwargs))
        pieces.append(piece)
    for (a, b), out in reversed(list(zip(zip(bounds, bounds[1:]), outs))):
        out.float().backward(grad_out[:, :, a:b])
    got = [torch.cat(outs, dim=2), *(torch.cat([p[j].grad for p in pieces], dim=2) for j in range(3))]
    if sinks is not None:
        got.append(sinks.grad)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, (ref, *ref_grads)):
        err = float((a.detach().float() - b.float()).abs().max() / b.float().abs().max())
        assert err < 3e-2, f"{variant} {name}: rel err {err:.2e}"
