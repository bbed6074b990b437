"""Tier a: ``eval_batch``'s arguments the token pipeline cannot honour, and ``train_batch`` on an engine without an
optimizer, are refused on every rank before any batch is read (each refusal here is a failure DeepSpeed's own
pipeline meets on one rank only, or a hang)."""
from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace
from typing import Any

import pytest

from ds_terapipe.config import parse_terapipe_config
from ds_terapipe.runtime.execution.engine import _EVAL_SIGNATURE, TokenPipelineEngine


def _check(monitor: bool = False, terapipe: dict | None = None, **kwargs: Any) -> None:
    section = {"enabled": True, "seq_len": 64, **(terapipe or {})}
    engine = SimpleNamespace(terapipe=parse_terapipe_config({"terapipe": section}),
                             monitor=SimpleNamespace(enabled=monitor))
    bound = _EVAL_SIGNATURE.bind(engine, iter(()), **kwargs)
    bound.apply_defaults()
    TokenPipelineEngine._check_eval_arguments(engine, bound.arguments)


@pytest.mark.parametrize("kwargs, needle", [
    ({"reduce_output": "sum"}, "eval_batch(reduce_output='sum') is not supported"),
    ({"compute_loss": False, "monitor": True}, "compute_loss=False) with the DeepSpeed monitor enabled"),
    ({"reduce_output": None}, "pass bcast_loss=False"),
    ({"reduce_output": None, "bcast_loss": False, "monitor": True}, "disable the DeepSpeed monitor"),
    ({"return_logits": True, "terapipe": {"sequence_parallel": 2}}, "terapipe.sequence_parallel=2 no rank holds"),
    ({"compute_loss": False, "terapipe": {"vocab_parallel": True}}, "terapipe.vocab_parallel=True no rank holds"),
])
def test_an_eval_argument_the_pipeline_cannot_honour_is_refused_on_every_rank(kwargs, needle) -> None:
    with pytest.raises(ValueError) as err:
        _check(**kwargs)
    assert needle in str(err.value), str(err.value)
    assert getattr(err.value, "terapipe_collective", False)   # every rank raises it: no rank is left waiting


@pytest.mark.parametrize("kwargs", [{}, {"reduce_output": "AVG"}, {"reduce_output": None, "bcast_loss": False},
                                    {"compute_loss": False}, {"compute_loss": False, "reduce_output": None},
                                    {"return_logits": True}, {"num_micro_batches": 1}])
def test_the_arguments_deepspeed_supports_pass(kwargs) -> None:
    _check(**kwargs)


def test_train_batch_without_an_optimizer_is_refused_before_the_batch_is_read() -> None:
    """DeepSpeed's own pipeline asserts in the first backward, on the last stage first, the others waiting on it."""
    data = iter(())
    engine = SimpleNamespace(optimizer=None, _failing_fast=lambda what: nullcontext())
    with pytest.raises(ValueError, match=r"no \"optimizer\" section and ds_terapipe.initialize got no optimizer=") as err:
        TokenPipelineEngine.train_batch(engine, data)
    assert getattr(err.value, "terapipe_collective", False)
