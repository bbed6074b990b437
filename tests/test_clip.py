"""Tier a, one process: the parts of runtime/execution/clip.py that need no process group. Which copy of a parameter
counts
in the norm, the arithmetic against torch's clip_grad_norm_ (the all-reduce stubbed: one rank), the tied weights
every rank sees the same, and which configurations are refused. The multi-process checks against the reference
(tests/clipping.py) run in the launches of test_engine_features, test_engine_equivalence (2 x 2 replicas),
test_engine_virtual (features) and test_vocab_parallel."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

from ds_terapipe.runtime.execution import clip
from ds_terapipe.runtime.execution.clip import clip_grad_norm_over, clipping_problem, counted_in_norm, weights_tied_across_ranks


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


def _module(specs: list, owner: dict[int, int]) -> SimpleNamespace:
    return SimpleNamespace(_layer_specs=specs, stage_owner=lambda idx: owner[idx])


def _gpt_like() -> list:
    embed = TiedLayerSpec("embed", torch.nn.Embedding, 8, 4, tied_weight_attr="weight")
    return [embed, LayerSpec(torch.nn.Linear, 4, 4), LayerSpec(torch.nn.Linear, 4, 4), embed]


def test_tied_weights_across_ranks_are_read_from_the_specs() -> None:
    specs = _gpt_like()
    assert weights_tied_across_ranks(_module(specs, {0: 0, 1: 0, 2: 1, 3: 1})) == {"embed": [0, 1]}
    # the V placement: embedding and head both on rank 0, one parameter there
    assert weights_tied_across_ranks(_module(specs, {0: 0, 1: 1, 2: 1, 3: 0})) == {}


class SGD:
    """Stands for the client's optimizer (only its name is read; a torch one takes seconds to create first)."""


def _engine(*, clipping: float = 1.0, fp16: bool = True, zero: int = 0, unfused: bool = True,
            owner: dict[int, int] | None = None) -> SimpleNamespace:
    optimizer: object = SGD()
    if unfused:
        wrapper = object.__new__(FP16_UnfusedOptimizer)  # only its type matters here
        wrapper.optimizer = optimizer
        optimizer = wrapper
    return SimpleNamespace(gradient_clipping=lambda: clipping, fp16_enabled=lambda: fp16,
                           zero_optimization_stage=lambda: zero, optimizer=optimizer,
                           module=_module(_gpt_like(), owner or {0: 0, 1: 0, 2: 1, 3: 1}))


def test_fp16_clipping_that_would_count_a_tied_weight_twice_is_refused_with_the_fix() -> None:
    problem = clipping_problem(_engine())
    assert problem is not None
    for part in ("gradient_clipping=1.0", "FP16_UnfusedOptimizer (used with SGD)", "'embed' on ranks [0, 1]",
                 "use bf16, or zero_optimization.stage 1, or set gradient_clipping to 0"):
        assert part in problem, problem


@pytest.mark.parametrize("change", [{"clipping": 0.0}, {"fp16": False}, {"zero": 1}, {"unfused": False},
                                    {"owner": {0: 0, 1: 1, 2: 1, 3: 0}}])
def test_fp16_combinations_deepspeed_clips_right_are_accepted(change: dict) -> None:
    assert clipping_problem(_engine(**change)) is None
