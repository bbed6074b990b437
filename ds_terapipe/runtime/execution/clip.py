"""Gradient clipping (``"gradient_clipping"`` in the DeepSpeed config) by the norm of the whole model's gradient.

Why this module: DeepSpeed's fp32 clipping without ZeRO (``DeepSpeedEngine.clip_fp32_gradients``, which calls
``deepspeed.runtime.utils.clip_grad_norm_(..., mpu=grid)``) is wrong in a pipeline (DeepSpeed 0.19.8). The
pipeline's grid is the mpu: its model-parallel group is the whole pipeline, but its model-parallel rank is the
stage, and that function counts a gradient only on model-parallel rank 0. So only stage 0's gradients enter the
norm and every stage clips by stage 0's norm: the step differs from the reference model's, which clips by
``sqrt(sum over its parameters of ||g||^2)``. :func:`clip_by_global_norm` replaces it (the engine overrides
``clip_fp32_gradients``): every stage sums the squares of the gradients it counts, one all-reduce over the
pipeline gives every stage the same norm, and every stage scales its gradients by the same coefficient,
``min(1, max_norm / (norm + 1e-6))`` as ``torch.nn.utils.clip_grad_norm_``.

Which copy of a parameter counts (:func:`counted_in_norm`), so that every parameter of the reference counts once;
the same rule DeepSpeed's ZeRO and bf16 optimizers apply:

* a weight tied across pipeline ranks (``TiedLayerSpec``, e.g. the GPT embedding and head): DeepSpeed all-reduces
  its gradient, every copy holds the same one, and it marks every copy but the first rank's
  ``ds_pipe_replicated``. Under a V placement (``dualpipev``) both uses are one parameter on rank 0;
* vocabulary-parallel shards (``runtime/features/vocab.py``): each rank's rows are its own and count there (with a tied
  head split together with the input embedding, the shard holds both uses' gradient); where the input embedding
  stays whole, a tied head's shards copy rows of its gradient and are marked ``ds_pipe_replicated`` when built;
* data-parallel replicas hold the same reduced gradient: the sum runs over one pipeline (each replica computes the
  same norm), never over replicas;
* tensor parallelism (a ``model`` axis in the topology; not otherwise used by ds_terapipe): a parameter not marked
  model-parallel counts on tensor rank 0 only, and the sum runs over the pipeline x tensor group (the grid's
  ``get_model_parallel_group``).

The other paths clip inside DeepSpeed's optimizers:

* ZeRO 1, any precision (``DeepSpeedZeroOptimizer``): its model-parallel rank is the tensor rank, so every stage
  counts its partitions (``ds_pipe_replicated`` skipped), summed over data parallelism then the pipeline: right.
* bf16 with ZeRO 0 (``BF16_Optimizer``): the same rule over the pipeline: right.
* fp16 with ZeRO 0: ``FP16_Optimizer`` (DeepSpeed's FusedAdam) masks the marked copies: right.
  ``FP16_UnfusedOptimizer`` (any other optimizer) takes the norm of the gradient tensors, which do not carry the
  mark, so a weight tied across ranks would count once per rank holding it (measured: 0.875 for a true 0.760).
  :func:`mark_replicated_grads` gives the gradient of every marked parameter the mark before each step, so its
  norm skips the copies too: right.

Tested against ``clip_grad_norm_`` on the unsliced single-process model (tests/clipping.py and its callers).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist
from deepspeed.runtime.constants import PIPE_REPLICATED
from deepspeed.runtime.utils import is_model_parallel_parameter
from ..features.sharding import is_sharded, local_shard
from .stage import PipelineStage


__all__ = ["clip_by_global_norm", "clip_grad_norm_over", "counted_in_norm", "mark_replicated_grads"]

# torch.nn.utils.clip_grad_norm_'s: the coefficient is max_norm / (norm + EPS), at most 1.
EPS = 1e-6


def counted_in_norm(param: torch.Tensor, tensor_rank: int = 0) -> bool:
    """Whether this rank's copy of ``param`` counts in the global norm (module docstring: one copy per
    parameter of the reference model)."""
    if getattr(param, PIPE_REPLICATED, False):  # "ds_pipe_replicated"
        return False
    return tensor_rank == 0 or is_model_parallel_parameter(param)


def clip_grad_norm_over(params: Iterable[torch.Tensor], max_norm: float, group: Any, device: torch.device,
                        tensor_rank: int = 0, shard_group: Any = None) -> torch.Tensor:
    """Clip the gradients of ``params`` in place by the 2-norm of all counted gradients of every rank of
    ``group`` (collective: every rank of the group calls it, with or without gradients). Returns the norm, a
    float32 tensor on ``device`` (no host synchronisation).

    ``shard_group``: the data-parallel group over which sharded parameters (DTensors, ``terapipe.shard_params``)
    are split: their local shards' squares are summed over it first (each replica holds a different part), then
    added to the whole tensors' squares."""
    params = [p for p in params if p.grad is not None]
    counted = [p.grad.detach() for p in params if counted_in_norm(p, tensor_rank)]
    sharded = [local_shard(g) for g in counted if is_sharded(g)]
    whole = [g for g in counted if not is_sharded(g)]
    squares = _squares(whole, device)
    if shard_group is not None:
        part = _squares(sharded, device)
        dist.all_reduce(part, op=dist.ReduceOp.SUM, group=shard_group)
        squares = squares + part
    dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=group)
    norm = squares.sqrt()
    coef = torch.clamp(max_norm / (norm + EPS), max=1.0)
    for p in params:
        grad = local_shard(p.grad.detach())
        grad.mul_(coef.to(device=grad.device, dtype=grad.dtype))
    return norm


def _squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if grads:  # per-tensor norms first, as torch's clip_grad_norm_ takes them
        norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32).to(device) for g in grads])
        return norms.square().sum()
    # a rank with nothing to count (all its layers frozen, say) still joins the sum
    return torch.zeros((), dtype=torch.float32, device=device)


def clip_by_global_norm(engine: "PipelineStage") -> torch.Tensor:
    """The engine's fp32 clipping (no ZeRO, no fp16/bf16 optimizer): all its parameters by the whole model's
    norm, summed over its pipeline (with tensor parallelism: pipeline x tensor). Returns the norm."""
    grid = engine.grid
    sharded = getattr(engine, "sharded", None)
    return clip_grad_norm_over(engine.module.parameters(), engine.gradient_clipping(),
                               grid.get_model_parallel_group(), engine.device,
                               tensor_rank=grid.get_slice_parallel_rank(),
                               shard_group=sharded.group if sharded is not None else None)


def mark_replicated_grads(optimizer: Any) -> None:
    """Let ``FP16_UnfusedOptimizer``'s gradient norm skip the copies of a weight tied across ranks (on this instance).

    Its step hands DeepSpeed's norm each parameter's ``.grad`` (the fp16 gradient itself: ``.to`` its own dtype),
    and the norm skips a tensor marked ``ds_pipe_replicated``; the mark is on the parameter, and autograd makes a
    new ``.grad`` every step. So before each step the gradient of every marked parameter is marked too. Any other
    optimizer is left as it is."""
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    if not isinstance(optimizer, FP16_UnfusedOptimizer):
        return
    step = optimizer.step

    def marked_step(*args: Any, **kwargs: Any) -> Any:
        for group in optimizer.fp16_groups:
            for param in group:
                if getattr(param, PIPE_REPLICATED, False) and param.grad is not None:
                    setattr(param.grad, PIPE_REPLICATED, True)
        return step(*args, **kwargs)

    optimizer.step = marked_step
