"""What the runtime's helpers may use of the engine: one pipeline rank's view of the run, as a typed protocol.

Why: planning, profiling, freezing, vocabulary parallelism and checkpointing each work on "the stage this
process runs". Typed against the engine class itself they would import the engine (which imports them), and
nothing would say which of its hundreds of attributes (DeepSpeed's included) they rely on. They take a
:class:`PipelineStage` instead: the engine satisfies it structurally, the list below is the whole interface, and
none of it is private (a test checks that no module outside the engine reads an ``engine._`` attribute).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Optional, Protocol

import torch

__all__ = ["PipelineStage"]


class PipelineStage(Protocol):
    """One pipeline rank of a running token pipeline (``TokenPipelineEngine`` implements it)."""

    # -- sizes and placement ----------------------------------------------------------------------------------
    terapipe: Any                    # the parsed "terapipe" config section (config.TeraPipeConfig)
    module: Any                      # the TokenPipelineModule (this rank's chunks)
    grid: Any                        # DeepSpeed's PipelineParallelGrid
    device: torch.device
    global_rank: int
    stage_id: int                    # this process's pipeline rank
    num_stages: int                  # pipeline ranks
    num_chunks: int                  # chunks of the model: ranks x virtual stages
    local_chunks: tuple[int, ...]    # the chunks on this rank
    placement: tuple[int, ...]       # chunk -> pipeline rank
    micro_batches: int
    micro_batch_size: int
    dp_world_size: int
    sequence: Any                    # runtime.slicing.sequence.SequenceShare under sequence parallelism, else None
    seq_len: int
    slices: tuple[int, ...]
    global_steps: int                # DeepSpeed's step count, the steps it skipped included
    skipped_steps: int               # steps DeepSpeed skipped (fp16 overflow, bf16 inf/nan gradients)

    # -- the plan ---------------------------------------------------------------------------------------------
    plan: Any                        # runtime.planning.plan.ResolvedPlan in use
    plans: dict                      # sequence length -> ResolvedPlan
    running: Any                     # the TokenPipeSchedule being executed
    record_timeline: bool
    last_timeline: Any
    last_step_terms: Any
    predicted_step_ms: Optional[float]

    step_slices: Any                 # per micro-batch, the running step's slicing (None: ``plan.slices`` for all)
    uniform_step: bool

    def install_plan(self, plan: Any) -> None: ...
    def slice_bounds(self, slice_index: int, microbatch: Optional[int] = None) -> tuple[int, int]: ...
    def token_bounds(self, slice_index: int, microbatch: Optional[int] = None) -> tuple[int, int]: ...
    def slices_of(self, microbatch: int) -> tuple[int, ...]: ...
    def seq_len_of(self, microbatch: int) -> int: ...
    def lowered_schedule(self, num_slices: int, num_frozen_chunks: Optional[int] = None,
                         train: bool = True) -> Any: ...

    # -- communication ----------------------------------------------------------------------------------------
    p2p: Any                         # runtime.execution.p2p.SliceP2P: sends, receives and waits with deadlines

    def barrier(self, what: str) -> None: ...
    def watching(self, what: str) -> AbstractContextManager[None]: ...   # collectives blind to the abort flag
    def on_chunk(self, chunk: int) -> AbstractContextManager[None]: ...
    def last_chunk_global_rank(self) -> int: ...
    def dp_reduce_will_be_identity(self) -> bool: ...

    # -- the step's buffers -----------------------------------------------------------------------------------
    pipe_buffers: dict
    loaded: dict                     # micro-batch -> its loaded batch
    unit_losses: dict                # buffer id -> the loss a unit's backward starts from
    total_loss: Any
    eval_return_logits: bool

    # -- DeepSpeed's engine -----------------------------------------------------------------------------------
    optimizer: Any
    lr_scheduler: Any
    training_dataloader: Any
    config: Any
    using_bf16_optimizer: bool
    freezer: Any
    grad_sink: Any                   # runtime.execution.grad_sink.GradSink: hand-computed gradients, as optimizers read

    def fp16_enabled(self) -> bool: ...
    def zero_optimization_stage(self) -> int: ...
    def gradient_accumulation_steps(self) -> int: ...
    def gradient_clipping(self) -> float: ...
    def train_batch_size(self) -> int: ...
