"""Deferred weight gradients (runtime/slicing/deferred.py): the split backward gives ordinary autograd's gradients.

Single process, no DeepSpeed engine: GPT blocks run slice by slice through the slice context exactly as a
stage does, backwards later slices first, then the micro-batch's W pass. Every parameter gradient must equal
plain autograd over the unsliced sequence, the pass must go through AccumulateGrad (DeepSpeed's gradient
hooks), and nothing may be deferred outside a slice context with a stash.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from ds_terapipe.models.gpt import GPTBlock, GPTConfig
from ds_terapipe.runtime.slicing.context import MicroBatchState, SliceContext, slice_scope
from ds_terapipe.runtime.slicing.deferred import WeightGradStash, enable_deferred_weight_grads
from tests.aten_calls import AtenCalls

CFG = GPTConfig(num_layers=2, hidden=32, num_heads=4, max_seq_len=64, seed=3)


def _blocks() -> nn.Sequential:
    return nn.Sequential(GPTBlock(CFG, 0), GPTBlock(CFG, 1)).double()


def _sliced_grads(model: nn.Module, x: torch.Tensor, slices: list[int], deferred: bool,
                  pairs_per_slice: int = 4 * 2) -> tuple[dict, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    seq_len = x.shape[1]
    state = MicroBatchState(0, seq_len, len(slices))
    state.weight_stash = WeightGradStash() if deferred else None
    outs, pieces, start = [], [], 0
    for i, length in enumerate(slices):
        piece = x[:, start:start + length].detach().requires_grad_()
        with slice_scope(SliceContext(0, i, start, start + length, state)):
            outs.append(model(piece))
        pieces.append(piece)
        start += length
    weights = torch.linspace(0.5, 1.5, seq_len, dtype=x.dtype)[None, :, None]
    start_of = [sum(slices[:i]) for i in range(len(slices))]
    for i in reversed(range(len(slices))):
        w = weights[:, start_of[i]:start_of[i] + slices[i]]
        outs[i].backward((w * torch.ones_like(outs[i])))
    if deferred:
        # 4 Linears per block, one pair per call and slice
        assert len(state.weight_stash) == pairs_per_slice * len(slices)
        state.weight_stash.flush()
        assert len(state.weight_stash) == 0
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return grads, torch.cat([p.grad for p in pieces], dim=1)


def test_deferred_weight_grads_equal_unsliced_autograd() -> None:
    model = _blocks()
    x = torch.randn(2, 40, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    ref, ref_input = _sliced_grads(model, x, [40], deferred=False)
    assert enable_deferred_weight_grads(model) == 8
    for slices in ([40], [8, 24, 8], [16, 8, 8, 8]):
        got, got_input = _sliced_grads(model, x, slices, deferred=True)
        assert torch.allclose(got_input, ref_input, rtol=1e-10, atol=1e-12)
        for name, g in ref.items():
            assert torch.allclose(got[name], g, rtol=1e-10, atol=1e-12), (slices, name)


def test_weight_pass_goes_through_accumulate_grad_hooks() -> None:
    model = _blocks()
    enable_deferred_weight_grads(model)
    fired: list[str] = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: fired.append(name))
    x = torch.randn(1, 16, 32, dtype=torch.float64)
    _sliced_grads(model, x, [8, 8], deferred=True)
    linear = {n for n, _ in model.named_parameters() if any(k in n for k in ("qkv", "proj", "fc_in", "fc_out"))}
    assert linear and linear <= set(fired)
    assert all(fired.count(n) == 1 for n in linear)  # one accumulation per weight per micro-batch, not per slice


def test_without_a_stash_the_wrapped_linear_is_plain_autograd() -> None:
    model = _blocks()
    enable_deferred_weight_grads(model)
    x = torch.randn(1, 16, 32, dtype=torch.float64)
    model(x).sum().backward()  # no slice context at all: weights get gradients at once
    assert all(p.grad is not None for p in model.parameters())
    model.zero_grad(set_to_none=True)
    state = MicroBatchState(0, 16, 1)
    state.weight_stash = WeightGradStash()
    with torch.no_grad(), slice_scope(SliceContext(0, 0, 0, 16, state)):
        model(x)  # evaluation: nothing recorded
    assert len(state.weight_stash) == 0


def test_a_linear_whose_input_needs_no_gradient_still_gets_its_weight_gradient() -> None:
    """A Linear fed data that needs no gradient (a first layer on raw features) is not deferred: its backward
    would never run through the input, so its weight gradient would be lost."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 8).double()
    offset = nn.Parameter(torch.randn(8, dtype=torch.float64))
    enable_deferred_weight_grads(lin)
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    (lin(x) + offset).square().sum().backward()
    ref = [p.grad.clone() for p in (lin.weight, lin.bias, offset)]
    lin.zero_grad(set_to_none=True)
    offset.grad = None
    state = MicroBatchState(0, 6, 1)
    state.weight_stash = WeightGradStash()
    with slice_scope(SliceContext(0, 0, 0, 6, state)):
        out = lin(x) + offset
    out.square().sum().backward()
    state.weight_stash.flush()
    got = [lin.weight.grad, lin.bias.grad, offset.grad]
    assert all(g is not None for g in got)
    assert all(torch.allclose(g, r, rtol=1e-12, atol=1e-12) for g, r in zip(got, ref))


def test_compute_leaves_grad_untouched_and_empties_the_stash() -> None:
    model = _blocks()
    enable_deferred_weight_grads(model)
    state = MicroBatchState(0, 16, 1)
    state.weight_stash = WeightGradStash()
    with slice_scope(SliceContext(0, 0, 0, 16, state)):
        out = model(torch.randn(1, 16, 32, dtype=torch.float64))
    out.sum().backward()
    weight = model[0].fc_in.weight
    assert weight.grad is None and state.weight_stash.nbytes() > 0
    params, grads = state.weight_stash.compute()
    assert any(p is weight for p in params) and len(params) == len(grads) == 16
    assert weight.grad is None and len(state.weight_stash) == 0


def test_only_plain_linears_are_wrapped_once() -> None:
    class Custom(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    model = nn.Sequential(nn.Linear(4, 4), Custom(4, 4), nn.Sequential(nn.Linear(4, 2)))
    assert enable_deferred_weight_grads(model) == 2
    assert enable_deferred_weight_grads(model) == 0
    wrapped = [m for m in model.modules() if getattr(m, "_terapipe_deferred", False)]
    assert wrapped == [model[0], model[2][0]]   # the plain ones, not the subclass


def test_a_module_applied_twice_defers_both_calls() -> None:
    """Weight sharing: one block at two depths records two pairs per Linear per slice; the W pass sums them."""
    block = GPTBlock(CFG, 0)
    model = nn.Sequential(block, GPTBlock(CFG, 1), block).double()
    x = torch.randn(2, 24, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    ref, ref_input = _sliced_grads(model, x, [24], deferred=False)
    enable_deferred_weight_grads(model)
    got, got_input = _sliced_grads(model, x, [8, 8, 8], deferred=True, pairs_per_slice=4 * 3)
    assert torch.allclose(got_input, ref_input, rtol=1e-10, atol=1e-12)
    for name, g in ref.items():
        assert torch.allclose(got[name], g, rtol=1e-10, atol=1e-12), name


def _record(model: nn.Module, x: torch.Tensor, slices: list[int], stash: WeightGradStash) -> None:
    """Forward and backward of one micro-batch slice by slice, recording into ``stash`` (no W pass)."""
    state = MicroBatchState(0, x.shape[1], len(slices))
    state.weight_stash = stash
    outs, start = [], 0
    for i, length in enumerate(slices):
        piece = x[:, start:start + length].detach().requires_grad_()
        with slice_scope(SliceContext(0, i, start, start + length, state)):
            outs.append(model(piece))
        start += length
    for out in reversed(outs):
        out.backward(torch.ones_like(out))


@pytest.mark.parametrize("gemv", [False, True], ids=["cpu", "as on an accelerator"])
def test_step_accumulator_sums_the_w_passes_and_hands_over_once(gemv: bool, monkeypatch) -> None:  # noqa: ANN001
    """The engine's path: W passes (one per slice, two micro-batches) summed in place, handed to .grad once;
    the same gradients as handing each W pass over on its own, and one accumulation per parameter per step. As on
    an accelerator, the biases' running sums take each W's sum in one ``addmv_``."""
    from ds_terapipe.runtime.slicing import deferred
    from ds_terapipe.runtime.slicing.deferred import WeightGradAccumulator
    if gemv:
        monkeypatch.setattr(deferred, "bias_grad_in_gemv", lambda bias: True)
    model = _blocks()
    enable_deferred_weight_grads(model)
    xs = [torch.randn(2, 24, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(s)) for s in (5, 6)]
    for x in xs:  # reference: every W pass straight to .grad
        stash = WeightGradStash()
        _record(model, x, [8, 16], stash)
        stash.flush()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    fired: list[str] = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: fired.append(name))
    acc = WeightGradAccumulator()
    with AtenCalls() as calls:
        for x in xs:
            stash = WeightGradStash()
            _record(model, x, [8, 16], stash)
            assert stash.compute(into=acc) == ([], [])   # fp64 here, like fp32: everything goes into the sums
    assert calls.names.count("addmv_") == (8 if gemv else 0)   # the second micro-batch's W, 8 biases
    linear = {n for n, _ in model.named_parameters() if any(k in n for k in ("qkv", "proj", "fc_in", "fc_out"))}
    assert not linear & set(fired) and len(acc) == 16   # 8 Linears' weights and biases, none in .grad yet
    acc.hand_over()
    assert len(acc) == 0 and all(fired.count(n) == 1 for n in linear)
    for name, g in ref.items():
        assert torch.allclose(model.get_parameter(name).grad, g, rtol=1e-10, atol=1e-12), name


def test_step_accumulator_leaves_low_precision_weights_to_each_w_pass() -> None:
    """bf16 weights: summing a step's W passes in bf16 would lose what DeepSpeed's fp32 accumulation keeps, so
    compute(into=...) returns their gradients for an immediate hand-over and keeps nothing."""
    from ds_terapipe.runtime.slicing.deferred import WeightGradAccumulator
    model = _blocks().to(torch.bfloat16)
    enable_deferred_weight_grads(model)
    acc = WeightGradAccumulator()
    stash = WeightGradStash()
    _record(model, torch.randn(1, 16, 32, dtype=torch.bfloat16), [8, 8], stash)
    params, grads = stash.compute(into=acc)
    assert len(acc) == 0 and len(params) == len(grads) == 16
    assert all(g.dtype == torch.bfloat16 for g in grads)


def _per_slice_reference(model: nn.Module, x: torch.Tensor, slices: list[int]) -> list[dict]:
    """Each slice's own weight gradients (what a W of that slice alone must add)."""
    out = []
    names = {id(p): n for n, p in model.named_parameters()}
    for i in range(len(slices)):
        stash = WeightGradStash()
        _record(model, x, slices, stash)
        params, grads = stash.compute(slice_index=i)
        out.append({names[id(p)]: g for p, g in zip(params, grads)})
        assert stash.slices() == set(range(len(slices))) - {i}
    return out


def test_a_w_per_slice_computes_its_slice_alone_wherever_it_runs() -> None:
    """The engine's W of slice i (dualpipev places W in bubbles, after several backwards of its chunk) computes
    slice i's pairs and no others, so it takes the time the plan gave it; a W per micro-batch (slice 0, gpipe)
    computes all; the sums are the same as one W over everything, and the stash goes once nothing is left."""
    from types import SimpleNamespace

    from ds_terapipe.runtime.slicing.deferred import WeightGradAccumulator
    from ds_terapipe.runtime.execution.engine import TokenPipelineEngine
    model = _blocks()
    enable_deferred_weight_grads(model)
    x = torch.randn(1, 24, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    slices = [8, 8, 8]
    each = _per_slice_reference(model, x, slices)
    stash = WeightGradStash()
    _record(model, x, slices, stash)
    names = {id(p): n for n, p in model.named_parameters()}
    whole = {names[id(p)]: g for p, g in zip(*stash.compute())}
    for per_slice in (True, False):
        fake = SimpleNamespace(running=SimpleNamespace(schedule=SimpleNamespace(weights_per_slice=per_slice)),
                               _stashes={}, _states={}, _weight_grads=WeightGradAccumulator())
        stash = fake._stashes[(0, 0)] = WeightGradStash()
        _record(model, x, slices, stash)
        order = [2, 1, 0] if per_slice else [0]   # the backward order: later slices first
        for step, i in enumerate(order):
            before = {n: (g.clone() if g is not None else None) for n, p in model.named_parameters()
                      for g in [fake._weight_grads.running(p)]}
            TokenPipelineEngine._exec_weight_grad_pass(fake, 0, 0, i, 0)
            for name, p in model.named_parameters():
                if name not in whole:
                    continue
                added = fake._weight_grads.running(p) - (before[name] if before[name] is not None else 0)
                want = each[i][name] if per_slice else whole[name]
                assert torch.allclose(added, want, rtol=1e-10, atol=1e-12), (per_slice, i, name)
            left = set(order[step + 1:])
            assert ((0, 0) in fake._stashes) == bool(left) and stash.slices() == left
        for name, p in model.named_parameters():
            if name in whole:
                assert torch.allclose(fake._weight_grads.running(p), whole[name], rtol=1e-10, atol=1e-12)
    # 1f1b's W right after its B: the stash is empty while the micro-batch's earlier slices still have their
    # backward to run (its state lives), so it must stay where their pairs will be recorded
    fake._stashes[(0, 0)] = stash = WeightGradStash()
    fake._states[(0, 0)] = object()
    _record(model, x, [8], stash)
    TokenPipelineEngine._exec_weight_grad_pass(fake, 0, 0, 0, 0)
    assert not len(stash) and fake._stashes[(0, 0)] is stash


def test_a_step_ending_with_uncomputed_weight_grads_is_refused() -> None:
    """A schedule that forgot a W would lose those weight gradients: the hand-over refuses, naming them."""
    from types import SimpleNamespace

    import pytest

    from ds_terapipe.runtime.slicing.deferred import WeightGradAccumulator
    from ds_terapipe.runtime.execution.engine import TokenPipelineEngine
    model = _blocks()
    enable_deferred_weight_grads(model)
    stash = WeightGradStash()
    _record(model, torch.randn(1, 16, 32, dtype=torch.float64), [8, 8], stash)
    stash.compute(slice_index=1)
    fake = SimpleNamespace(running=SimpleNamespace(schedule=SimpleNamespace(name="broken")),
                           _stashes={(1, 0): stash, (0, 0): WeightGradStash()}, _weight_grads=WeightGradAccumulator())
    with pytest.raises(RuntimeError, match=r"'broken' left deferred weight gradients.*\(1, 0\): \[0\]"):
        TokenPipelineEngine._hand_over_weight_grads(fake)


class _CountGemms(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the matrix multiplications dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.gemms = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            self.gemms += 1
        return func(*args, **(kwargs or {}))


def test_the_stash_keeps_a_slice_s_rows_not_the_tensor_they_are_a_view_of() -> None:
    # a key or value projection's output gradient is the slice's rows of the KV cache's full-length gradient
    # buffer: kept as a view, the stash would hold the whole buffer until the W
    lin = nn.Linear(4, 8)
    whole = torch.randn(2, 64, 8)
    stash = WeightGradStash()
    stash.add(lin, torch.randn(2, 16, 4), whole[:, 16:32], 1)
    stash.add(lin, torch.randn(2, 16, 4), torch.randn(2, 16, 8), 0)
    kept = [g for i, (_, _, g) in enumerate(stash._pairs[lin])]
    assert kept[0].untyped_storage().data_ptr() != whole.untyped_storage().data_ptr()
    assert torch.equal(kept[0], whole[:, 16:32])
    assert stash.nbytes() == 2 * (2 * 16 * 4 + 2 * 16 * 8) * 4   # the rows alone


def test_a_w_over_several_slices_is_one_gemm_per_linear_summed_in_token_order() -> None:
    # A W covering a micro-batch's 4 slices must read (and write) each weight-sized gradient once: one GEMM per
    # Linear over the slices laid end to end, not one per slice (on a GPU each of those is a full weight read).
    torch.manual_seed(0)
    lin = nn.Linear(8, 16).double()
    stash = WeightGradStash()
    xs = [torch.randn(2, 3, 8, dtype=torch.float64) for _ in range(4)]
    gs = [torch.randn(2, 3, 16, dtype=torch.float64) for _ in range(4)]
    for i in reversed(range(4)):   # recorded as backwards run: later slices first
        stash.add(lin, xs[i], gs[i], i)
    with _CountGemms() as count:
        params, grads = stash.compute()
    assert count.gemms == 1 and len(stash) == 0
    x, g = torch.cat([t.reshape(-1, 8) for t in xs]), torch.cat([t.reshape(-1, 16) for t in gs])
    assert torch.equal(grads[0], g.t().mm(x))   # the slices' rows in slice order: bit for bit
    assert torch.allclose(grads[1], g.sum(0))
    # a W per slice still computes one slice per call, one GEMM each
    for i in reversed(range(4)):
        stash.add(lin, xs[i], gs[i], i)
    with _CountGemms() as count:
        per_slice = [stash.compute(slice_index=i)[1][0] for i in range(4)]
    assert count.gemms == 4
    assert torch.allclose(sum(per_slice), grads[0])


# -- the weight gradients added into .grad inside the GEMM (enable_fused_grad_accumulation) -----------------------

def _fused_run(model: nn.Module, xs: list[torch.Tensor], slices: list[int], fuse: bool) -> dict:
    """Micro-batches ``xs`` one after another in ``slices``, backwards later slices first, all into ``.grad``
    (as a step of the engine does): the summed gradients."""
    model.zero_grad(set_to_none=True)
    for mb, x in enumerate(xs):
        state = MicroBatchState(mb, x.shape[1], len(slices))
        state.fuse_grad_accumulation = fuse
        outs, bounds, start = [], [], 0
        for i, length in enumerate(slices):
            with slice_scope(SliceContext(mb, i, start, start + length, state)):
                outs.append(model(x[:, start:start + length].detach().requires_grad_()))
            bounds.append((start, start + length))
            start += length
        grad = torch.linspace(0.5, 1.5, x.numel(), dtype=x.dtype).view_as(x)   # the same for any slicing
        for y, (lo, hi) in reversed(list(zip(outs, bounds))):
            y.backward(grad[:, lo:hi])
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture
def as_on_an_accelerator(monkeypatch):  # noqa: ANN001, ANN201
    """Bias gradients added in with ``addmv_``, as on an accelerator (a CPU keeps autograd's sum and add)."""
    from ds_terapipe.runtime.slicing import deferred
    monkeypatch.setattr(deferred, "bias_grad_in_gemv", lambda bias: True)


def test_fused_accumulation_equals_autograds_and_adds_in_the_gemm(as_on_an_accelerator) -> None:  # noqa: ANN001
    from ds_terapipe.runtime.slicing.deferred import enable_fused_grad_accumulation, fused_parameters
    model = _blocks()
    gen = torch.Generator().manual_seed(4)
    xs = [torch.randn(2, 40, 32, dtype=torch.float64, generator=gen) for _ in range(2)]
    ref = _fused_run(model, xs, [40], fuse=False)
    assert enable_fused_grad_accumulation(model) == 8 and len(fused_parameters(model)) == 16   # weights and biases
    for slices in ([40], [8, 24, 8], [16, 8, 8, 8]):
        got = _fused_run(model, xs, slices, fuse=True)
        for name, g in ref.items():
            assert torch.allclose(got[name], g, rtol=1e-10, atol=1e-12), name
    # where it is used: from the second backward on, one addmm_ per Linear weight and one addmv_ per bias, no
    # mm + add, sum + add for them
    with AtenCalls() as ops:
        _fused_run(model, xs[:1], [20, 20], fuse=True)
    assert ops.names.count("addmm_") == 8, ops.names   # the first slice's backward; the second has no .grad yet
    assert ops.names.count("addmv_") == 8, ops.names
    with AtenCalls() as plain:
        _fused_run(model, xs[:1], [20, 20], fuse=False)
    assert plain.names.count("addmm_") == 0 and plain.names.count("mm") > ops.names.count("mm")
    assert plain.names.count("addmv_") == 0 and plain.names.count("sum") == ops.names.count("sum") + 8
    assert len(ops.names) < len(plain.names) - 16, (len(ops.names), len(plain.names))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_a_cpu_bias_gradients_keep_autograds_sum_and_add(dtype: torch.dtype) -> None:
    # a CPU's matrix-vector product sums the tokens one after another (and is the slower in bf16): biases keep
    # sum + add there, and the profile's stand-ins and the step profile's accumulation term see them as autograd's
    from ds_terapipe.runtime.slicing.deferred import enable_fused_grad_accumulation, fused_parameters
    model = nn.Sequential(GPTBlock(CFG, 0)).to(dtype)
    enable_fused_grad_accumulation(model)
    fused = fused_parameters(model)
    assert len(fused) == 4 and all(p.dim() == 2 for p in fused)
    x = torch.randn(2, 40, 32, dtype=dtype, generator=torch.Generator().manual_seed(7))
    with AtenCalls() as ops:
        _fused_run(model, [x], [20, 20], fuse=True)
    assert ops.names.count("addmm_") == 4 and ops.names.count("addmv_") == 0


def test_fused_accumulation_keeps_hooked_and_frozen_weights_on_autograd(as_on_an_accelerator) -> None:  # noqa: ANN001
    from ds_terapipe.runtime.slicing.deferred import enable_fused_grad_accumulation, fused_parameters
    model = _blocks()
    enable_fused_grad_accumulation(model)
    fc = model[0].fc_in
    calls = []
    fc.weight.register_post_accumulate_grad_hook(lambda p: calls.append(p.grad.clone()))
    model[1].fc_out.weight.requires_grad_(False)
    assert len(fused_parameters(model)) == 14   # weights and biases, but the frozen weight's Linear's (autograd's)
    x = torch.randn(2, 40, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    with AtenCalls() as ops:
        got = _fused_run(model, [x], [20, 20], fuse=True)
    assert len(calls) == 2, "the hooked weight's accumulations must run through autograd (its hook each time)"
    assert torch.allclose(calls[-1], got["0.fc_in.weight"])
    assert ops.names.count("addmm_") == 6   # the 8 Linears less the hooked and the frozen one
    assert ops.names.count("addmv_") == 7   # the hooked weight's bias has no hook: in place
    assert model[1].fc_out.weight.grad is None and "1.fc_out.weight" not in got
    # outside a state that asks for it, and without a slice context, the wrapped Linear is plain autograd
    with AtenCalls() as off:
        _fused_run(model, [x], [20, 20], fuse=False)
    with AtenCalls() as bare:
        model(x).sum().backward()
    assert off.names.count("addmm_") == 0 and bare.names.count("addmm_") == 0


def test_the_profile_adds_into_stand_ins_and_leaves_the_real_grads_alone() -> None:
    """The profile times the in-GEMM backward into stand-in ``.grad`` tensors (not deferred) and makes none where the
    W passes take the Linears' gradients (deferred): either way the real ``.grad`` comes back the same tensor, with
    the same values, and no stand-in is left on a weight that had none."""
    from ds_terapipe.runtime.planning.profile import profile_stage
    from ds_terapipe.runtime.slicing.deferred import enable_fused_grad_accumulation, fused_parameters
    model = _blocks()
    enable_deferred_weight_grads(model)
    enable_fused_grad_accumulation(model)
    weights = fused_parameters(model)
    for w in weights[:4]:
        w.grad = torch.full_like(w, 0.25)
    kept = [(w.grad, None if w.grad is None else w.grad.clone()) for w in weights]
    x = torch.randn(1, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    made = []
    real_zeros_like = torch.zeros_like

    def counting(t, *a, **k):  # noqa: ANN001, ANN002, ANN003
        if any(t is w for w in weights):
            made.append(t)
        return real_zeros_like(t, *a, **k)

    torch.zeros_like = counting
    try:
        for deferred in (False, True):
            made.clear()
            with AtenCalls() as ops:
                profile_stage(model, list(model.parameters()), x, 32, 8, 1, slice_lengths=[16], num_contexts=2,
                              warmup=0, repeats=1, deferred=deferred, fused=weights)
            assert len(made) == (0 if deferred else len(weights)), deferred
            if not deferred:   # timed as training runs it: added into the stand-ins inside the GEMMs
                assert ops.names.count("addmm_") > 0
            for w, (grad, values) in zip(weights, kept):
                assert w.grad is grad
                assert grad is None or torch.equal(grad, values)
    finally:
        torch.zeros_like = real_zeros_like


def test_the_profile_takes_the_cache_gradient_in_as_training_does(monkeypatch) -> None:
    """Each profiled slice ends its micro-batch, so its backward takes the KV cache's gradient in with one copy (as
    every training slice takes it with one kernel), never filling a buffer that reaches past the slice first."""
    from ds_terapipe.runtime.planning.profile import profile_stage
    from ds_terapipe.runtime.slicing import context

    fills = []
    real = context._zeros_in_layout_of
    monkeypatch.setattr(context, "_zeros_in_layout_of", lambda like, length: fills.append(length) or real(like, length))
    model = _blocks()
    x = torch.randn(1, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(8))
    points = profile_stage(model, list(model.parameters()), x, 32, 8, 1, slice_lengths=[8, 16], num_contexts=2,
                           warmup=0, repeats=1)
    assert {(p["slice"], p["context"]) for p in points} == {(8, 0), (8, 24), (16, 0), (16, 16)}
    assert fills == []


def test_compiled_blocks_leave_the_accumulation_to_autograd_and_break_only_at_the_attention() -> None:
    """Under ``torch.compile`` (``engine.compile()``) a Linear whose backward would add into ``.grad`` in its GEMM
    takes autograd's path instead: dynamo cannot trace that backward, and each Linear would otherwise break the
    graph (a compiled piece per GEMM, slower than eager where the host is the bound). The gradients are
    autograd's, and the graphs break at the sliced attention alone."""
    from torch._dynamo.utils import counters
    from ds_terapipe.runtime.slicing.deferred import enable_fused_grad_accumulation
    model = _blocks()
    gen = torch.Generator().manual_seed(6)
    xs = [torch.randn(2, 40, 32, dtype=torch.float64, generator=gen) for _ in range(2)]
    ref = _fused_run(model, xs, [40], fuse=False)
    enable_fused_grad_accumulation(model)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager")
    got = {n.removeprefix("_orig_mod."): g for n, g in _fused_run(compiled, xs, [8, 24, 8], fuse=True).items()}
    for name, g in ref.items():
        assert torch.allclose(got[name], g, rtol=1e-10, atol=1e-12), name
    breaks = [reason.split("\n")[0] for reason in counters["graph_break"]]
    assert breaks and all("sliced_causal_attention" in reason for reason in counters["graph_break"]), breaks
