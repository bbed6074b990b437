"""Tier a, one process: the parts of runtime/execution/clip.py that need no process group. Which copy of a parameter
counts in the norm, the arithmetic against torch's clip_grad_norm_ (the all-reduce stubbed: one rank), and the mark
that lets fp16's unfused optimizer skip a tied copy. The multi-process checks against the reference
(tests/clipping.py) run in the launches of test_engine_features, test_engine_equivalence (2 x 2 replicas),
test_engine_virtual (features) and test_vocab_parallel."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

from ds_terapipe.runtime.execution import clip
from ds_terapipe.runtime.execution.clip import clip_grad_norm_over, counted_in_norm, mark_replicated_grads


def _param(values: list[float], **marks: object) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.zeros(len(values)))
    p.grad = torch.tensor(values)
    for name, value in marks.items():
        setattr(p, name, value)
    return p


def test_a_copy_marked_replicated_does_not_count_and_tensor_ranks_count_only_their_shards() -> None:
    plain, copy = _param([1.0]), _param([1.0], ds_pipe_replicated=True)
    shard = _param([1.0], model_parallel=True)
    assert counted_in_norm(plain) and not counted_in_norm(copy)
    assert not counted_in_norm(plain, tensor_rank=1) and counted_in_norm(shard, tensor_rank=1)


@pytest.fixture
def one_rank(monkeypatch) -> None:
    """The norm's all-reduce over a group of one: the local sum."""
    monkeypatch.setattr(clip.dist, "all_reduce", lambda tensor, op=None, group=None: None)


def test_the_norm_and_the_coefficient_are_torch_clip_grad_norm_s(one_rank) -> None:
    gen = torch.Generator().manual_seed(0)
    mine = [_param(torch.randn(n, generator=gen).tolist()) for n in (3, 5, 7)]
    theirs = [_param(p.grad.tolist()) for p in mine]
    tied_copy = _param(mine[0].grad.tolist(), ds_pipe_replicated=True)  # e.g. the head's copy of the embedding
    norm = clip_grad_norm_over([*mine, tied_copy], 0.5, None, torch.device("cpu"))
    expected = torch.nn.utils.clip_grad_norm_(theirs, 0.5)
    assert float(norm) == pytest.approx(float(expected), rel=1e-6)
    for p, q in zip(mine, theirs):
        assert torch.allclose(p.grad, q.grad, rtol=1e-6, atol=0)
    assert torch.allclose(tied_copy.grad, mine[0].grad)  # every copy takes the same coefficient
    # below the threshold nothing changes
    before = [p.grad.clone() for p in mine]
    clip_grad_norm_over(mine, 100.0, None, torch.device("cpu"))
    assert all(torch.equal(p.grad, b) for p, b in zip(mine, before))


def test_a_rank_without_gradients_joins_with_zero(one_rank) -> None:
    frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    assert float(clip_grad_norm_over([frozen], 1.0, None, torch.device("cpu"))) == 0.0


def test_fp16_unfused_norm_skips_the_gradient_of_a_tied_copy() -> None:
    """FP16_UnfusedOptimizer hands DeepSpeed's norm the gradients, not the parameters: the engine marks the gradient
    of every parameter marked ``ds_pipe_replicated`` right before each step, so the norm counts a tied weight once
    (on the rank holding its first copy), as torch's clip_grad_norm_ does on the whole model."""
    from deepspeed.runtime.utils import get_weight_norm

    owned, copy = _param([3.0]), _param([4.0], ds_pipe_replicated=True)
    wrapper = object.__new__(FP16_UnfusedOptimizer)   # only its type, groups and step are used here
    wrapper.fp16_groups = [[owned, copy]]
    norms = []
    wrapper.step = lambda: norms.append(get_weight_norm([p.grad for group in wrapper.fp16_groups for p in group]))
    assert get_weight_norm([owned.grad, copy.grad]) == pytest.approx(5.0)   # unmarked: the copy counts too
    mark_replicated_grads(wrapper)
    wrapper.step()
    assert norms == [pytest.approx(3.0)]
    copy.grad = torch.tensor([4.0])   # autograd's next step makes new gradients: marked again before the step
    wrapper.step()
    assert norms[-1] == pytest.approx(3.0)
    assert not hasattr(owned.grad, "ds_pipe_replicated")
    other = SimpleNamespace(step=print)   # any other optimizer is left as it is
    mark_replicated_grads(other)
    assert other.step is print
