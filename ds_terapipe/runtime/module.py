"""TokenPipelineModule: a DeepSpeed PipelineModule that can make sample inputs for the token pipeline.

Any ``PipelineModule`` runs in the token pipeline as long as its token-mixing layers read the slice context
(:func:`~ds_terapipe.runtime.attention.sliced_causal_attention`). What a plain PipelineModule cannot do is
say what its first stage's input looks like, and the engine needs exactly that at init: to check that every
stage gives the same result sliced as unsliced (the refusal of non-causal models) and to profile each stage
for ``slices: "auto"``. This subclass adds that, and nothing else.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
from deepspeed.pipe import PipelineModule

__all__ = ["TokenPipelineModule", "InputSampler"]

# (batch, seq_len, generator) -> first-stage input: a tensor or tuple of tensors of shape (batch, seq_len, ...)
InputSampler = Callable[[int, int, torch.Generator], Union[torch.Tensor, tuple]]


class TokenPipelineModule(PipelineModule):
    """A ``PipelineModule`` with a sampler of first-stage inputs.

    Args:
        layers, num_stages, topology, loss_fn, ...: as ``deepspeed.pipe.PipelineModule``.
        vocab_size: for token-id inputs: sample ids uniformly from ``[0, vocab_size)``.
        input_sampler: for other inputs: ``fn(batch, seq_len, generator)`` returning the first stage's input.
    """

    def __init__(self, layers, *args, vocab_size: Optional[int] = None,
                 input_sampler: Optional[InputSampler] = None, **kwargs) -> None:
        if vocab_size is not None and input_sampler is not None:
            raise ValueError("TokenPipelineModule: pass vocab_size or input_sampler, not both")
        if vocab_size is not None and vocab_size < 1:
            raise ValueError(f"TokenPipelineModule: vocab_size={vocab_size} must be >= 1")
        super().__init__(layers, *args, **kwargs)
        self.vocab_size = vocab_size
        self.input_sampler = input_sampler

    def has_sampler(self) -> bool:
        return self.vocab_size is not None or self.input_sampler is not None

    def sample_input(self, batch: int, seq_len: int, generator: torch.Generator) -> Union[torch.Tensor, tuple]:
        """A first-stage input of ``batch`` sequences of ``seq_len`` tokens (on CPU)."""
        if self.input_sampler is not None:
            return self.input_sampler(batch, seq_len, generator)
        if self.vocab_size is None:
            raise ValueError("TokenPipelineModule has no input sampler: pass vocab_size= or input_sampler=")
        return torch.randint(0, self.vocab_size, (batch, seq_len), generator=generator)
