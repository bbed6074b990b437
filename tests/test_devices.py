"""Tier a, one process: the GPU-only rules of runtime/slicing/devices.py, checked on CPU.

* Every host-clock read of the profiler comes right after an accelerator synchronize (the accelerator is
  patched to log its syncs next to the clock's reads: on CPU a missing sync changes no number, so only the
  order can show it).
* On an accelerator the prefix-causal mask is a lazy lower-right ``CausalBias`` (fused SDPA kernels stay
  eligible), and that form gives the same outputs and gradients as the CPU's additive mask, sliced attention
  included; it is made outside an active ``TorchDispatchMode`` (torch cannot make it inside one).

The collectives' devices are checked with processes: tests/test_device_collectives.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from torch.nn.attention.bias import CausalBias, CausalVariant

from ds_terapipe.runtime.slicing import attention, devices
from ds_terapipe.runtime.slicing.attention import CausalSelfAttention, _prefix_causal_mask
from ds_terapipe.runtime.slicing.context import MicroBatchState, SliceContext, slice_scope
from ds_terapipe.runtime.slicing.deferred import enable_deferred_weight_grads
from ds_terapipe.runtime.planning.profile import profile_stage


@pytest.fixture
def events(monkeypatch) -> list[str]:
    """The accelerator's synchronize calls, logged in order with the clock reads of :func:`clock`."""
    log: list[str] = []
    monkeypatch.setattr(get_accelerator(), "synchronize", lambda *args, **kwargs: log.append("sync"))
    return log


def logging_clock(log: list[str]):
    ticks = iter(range(10**6))

    def clock() -> float:
        log.append("clock")
        return float(next(ticks))

    return clock


def assert_every_clock_read_follows_a_sync(log: list[str]) -> None:
    reads = [i for i, e in enumerate(log) if e == "clock"]
    assert reads, log
    unsynced = [i for i in reads if i == 0 or log[i - 1] != "sync"]
    assert not unsynced, f"clock read without an accelerator synchronize right before it (at {unsynced[:3]}): {log[:12]}"


def test_profiling_synchronizes_the_accelerator_before_every_clock_read(events) -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8)
    x = torch.randn(2, 32, 8)
    points = profile_stage(layer, list(layer.parameters()), x, 32, 8, 2, slice_lengths=[8, 16], num_contexts=2,
                           warmup=0, repeats=2, clock=logging_clock(events))
    assert len(points) == 4
    assert_every_clock_read_follows_a_sync(events)
    events.clear()
    enable_deferred_weight_grads(layer)   # + each slice's deferred weight-gradient pass, timed too
    points = profile_stage(layer, list(layer.parameters()), x, 32, 8, 2, slice_lengths=[8, 16], num_contexts=2,
                           warmup=0, repeats=2, deferred=True, clock=logging_clock(events))
    assert all("weight_ms" in p for p in points)
    assert_every_clock_read_follows_a_sync(events)


def test_synchronized_ms_syncs_then_reads_the_host_clock(events, monkeypatch) -> None:
    monkeypatch.setattr(devices.time, "time", lambda: events.append("clock") or 1.5)
    assert devices.synchronized_ms() == 1500.0
    assert events == ["sync", "clock"]


@pytest.mark.parametrize("device", ["cuda", "cuda:1", "xpu", "hpu"])
def test_accelerator_mask_is_a_lazy_lower_right_causal_bias(device: str) -> None:
    bias = devices.prefix_causal_bias(16, 40, torch.device(device))  # nothing is allocated on the device
    assert isinstance(bias, CausalBias) and bias.variant == CausalVariant.LOWER_RIGHT
    assert (bias.seq_len_q, bias.seq_len_kv) == (24, 40)
    assert devices.prefix_causal_bias(16, 40, torch.device("cpu")) is None  # CPU keeps the cached additive mask


def test_the_bias_is_made_under_a_dispatch_mode_and_attention_runs_under_it() -> None:
    """torch cannot make a CausalBias while a TorchDispatchMode runs (FlopCounterMode, a kernel counter); the
    bias is made outside the mode, and SDPA with it still runs, and is seen, under the mode."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 8, generator=gen) for n in (4, 8, 8))
    with Count():
        bias = devices.prefix_causal_bias(4, 8, torch.device("cuda"))   # metadata only: nothing on the device
        assert isinstance(bias, CausalBias) and (bias.seq_len_q, bias.seq_len_kv) == (4, 8)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=devices.lower_right_bias(4, 8))
    assert Count.calls > 0
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, attn_mask=bias))


@pytest.mark.parametrize("start, end", [(1, 2), (8, 24), (16, 20), (5, 40)])
def test_causal_bias_matches_the_additive_mask_forward_and_backward(start: int, end: int) -> None:
    torch.manual_seed(start)
    q = torch.randn(2, 3, end - start, 8, dtype=torch.double, requires_grad=True)
    k = torch.randn(2, 3, end, 8, dtype=torch.double, requires_grad=True)
    v = torch.randn(2, 3, end, 8, dtype=torch.double, requires_grad=True)
    weight = torch.randn(2, 3, end - start, 8, dtype=torch.double)
    results = []
    for mask in (_prefix_causal_mask(start, end, q.dtype, q.device),
                 devices.prefix_causal_bias(start, end, torch.device("cuda"))):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
        grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
        results.append((out, *grads))
    for ours, ref in zip(*results):
        torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)


def test_sliced_attention_with_the_accelerator_mask_equals_unsliced(monkeypatch) -> None:
    """The whole sliced attention (KV cache, gradient carry) through the accelerator's mask form, on CPU."""
    calls = []

    class UsedBias(CausalBias):
        """The accelerator's bias, noting each attention that really ran with it."""

        @staticmethod
        def _dispatch(query, key, *args, **kwargs):
            calls.append((key.shape[2] - query.shape[2], key.shape[2]))
            return CausalBias._dispatch(query, key, *args, **kwargs)

    def accelerator_bias(start: int, end: int, device: torch.device) -> CausalBias:
        bias = devices.prefix_causal_bias(start, end, torch.device("cuda"))
        return UsedBias(bias.variant, bias.seq_len_q, bias.seq_len_kv)

    monkeypatch.setattr(attention, "prefix_causal_bias", accelerator_bias)
    torch.manual_seed(0)
    attn = CausalSelfAttention(16, 4, rotary=True).double()
    x = torch.randn(2, 30, 16, dtype=torch.double, requires_grad=True)
    weight = torch.randn(2, 30, 16, dtype=torch.double)
    (attn(x) * weight).sum().backward()
    ref_x, ref_w = x.grad.clone(), attn.qkv.weight.grad.clone()
    attn.zero_grad()
    state, units, start = MicroBatchState(0, 30, 3), [], 0
    calls.clear()
    for i, length in enumerate([7, 15, 8]):
        piece = x[:, start:start + length].detach().requires_grad_()
        with slice_scope(SliceContext(0, i, start, start + length, state)):
            units.append((piece, attn(piece), start, length))
        start += length
    assert calls == [(7, 22), (22, 30)]  # slice 0 runs plain is_causal=True; later slices take the bias
    grad_x = torch.zeros_like(x)
    for piece, y, lo, length in reversed(units):
        y.backward(weight[:, lo:lo + length])
        grad_x[:, lo:lo + length] = piece.grad
    torch.testing.assert_close(grad_x, ref_x, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(attn.qkv.weight.grad, ref_w, rtol=1e-10, atol=1e-12)
