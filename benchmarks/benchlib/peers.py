"""Peer pipeline engines on the same layers, behind the engine surface the benchmark workers drive.

A benchmark worker builds an engine per variant and times ``engine.train_batch(data_iter)``; the token pipeline
and stock DeepSpeed are engines already. The peers here are wrapped to look alike, so one worker alternates
all of them in one run:

* ``ds-dualpipev``: DeepSpeed 0.19.8's own DualPipeV (``DualPipeVModule`` + ``deepspeed.initialize``), two chunks
  per rank in a V. Its engine needs at least 2 micro-batches per rank (m >= 2p), so it is absent below that.
* ``torch-interleaved`` / ``torch-loopedbfs`` / ``torch-zb-interleaved``: ``torch.distributed.pipelining``'s
  ``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS`` and ``ScheduleInterleavedZeroBubble`` (ZB1P: backwards split
  into input and weight gradients, the weight halves filling the bubbles), two stages per rank, looped placement
  (chunk c on rank c mod p), built from the same ``LayerSpec`` list and cut where DeepSpeed's ``partition_method``
  would cut p*v chunks.
* ``torch-zbv`` / ``torch-dualpipev``: its ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV``, two stages per rank
  in a V (rank r holds chunks r and 2p-1-r), weight gradients split off as above. ``torch-dualpipev`` needs
  m >= 2p (torch's rule), so it is absent below that.
* ``TorchPipelineEngine("torch-loopedbfs-fsdp2", ..., dp=N)`` (benchmarks/sharded_training.py builds it directly):
  the same ``ScheduleLoopedBFS`` on N data-parallel replicas with FSDP2 as torchtitan arranges it: each block
  ``fully_shard``-ed, then each stage module, over the stage's data-parallel group, not resharded after forward
  (the pipeline's gathers stay per step); its schedule's ``perform_reduce_grad`` reduce-scatters once per stage and
  step. The tied copies' gradients are summed on their local shards.

torch pipelining knows nothing of tied weights: the embedding and the head (chunks 0 and p*v-1) each build their
own copy (identical: layers initialise from their index) and their gradients are summed before the optimizer
step, as DeepSpeed does for tied layers: all-reduced between two ranks (looped placement), added on the one rank
that holds both (V placement). The loss is scaled by 1/m (``scale_grads``), as DeepSpeed's gradient
accumulation does.

Peers expose no instruction map, so the per-instruction recorder sees nothing: their rows have step time and
memory, not the busy-time bound (efficiency) the token rows have.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any, Callable

__all__ = ["PEER_VARIANTS", "TorchPipelineEngine", "build_peer", "chunk_rank", "peer_applies"]

PEER_VARIANTS: dict[str, str] = {
    "ds-dualpipev": "DeepSpeed DualPipeV (DualPipeVModule, v=2, V placement)",
    "torch-interleaved": "torch.distributed.pipelining ScheduleInterleaved1F1B (v=2, looped)",
    "torch-loopedbfs": "torch.distributed.pipelining ScheduleLoopedBFS (v=2, looped)",
    "torch-zb-interleaved": "torch.distributed.pipelining ScheduleInterleavedZeroBubble (v=2, looped)",
    "torch-zbv": "torch.distributed.pipelining ScheduleZBVZeroBubble (v=2, V placement)",
    "torch-dualpipev": "torch.distributed.pipelining ScheduleDualPipeV (v=2, V placement)",
}

#: torch's schedules by variant, and whether they place chunks in a V (rank r: chunks r and 2p-1-r)
_TORCH_SCHEDULES: dict[str, tuple[str, bool]] = {
    "torch-interleaved": ("ScheduleInterleaved1F1B", False),
    "torch-loopedbfs": ("ScheduleLoopedBFS", False),
    "torch-loopedbfs-fsdp2": ("ScheduleLoopedBFS", False),
    "torch-zb-interleaved": ("ScheduleInterleavedZeroBubble", False),
    "torch-zbv": ("ScheduleZBVZeroBubble", True),
    "torch-dualpipev": ("ScheduleDualPipeV", True),
}


def peer_applies(variant: str, m: int, num_ranks: int) -> bool:
    """Whether a peer can run m micro-batches on ``num_ranks`` ranks (DeepSpeed's and torch's DualPipeV need
    m >= 2p)."""
    return not (variant in ("ds-dualpipev", "torch-dualpipev") and m < 2 * num_ranks)


def chunk_rank(chunk: int, num_ranks: int, v_shape: bool) -> int:
    """The pipeline rank holding ``chunk`` of ``2 * num_ranks`` (V) or any number (looped) chunks."""
    if not v_shape:
        return chunk % num_ranks
    return chunk if chunk < num_ranks else 2 * num_ranks - 1 - chunk


def chunk_layers(specs: list, num_chunks: int, type_name: str) -> list[tuple[int, int]]:
    """[start, stop) layer ranges of ``num_chunks`` chunks, balanced over layers of class ``type_name``: the cut
    DeepSpeed's ``partition_method="type:<type_name>"`` makes (``partition_balanced`` over 0/1 weights)."""
    from deepspeed.runtime.utils import partition_balanced

    weights = [1 if getattr(spec, "typename", None) is not None and spec.typename.__name__ == type_name else 0
               for spec in specs]
    parts = partition_balanced(weights, num_chunks)
    return [(parts[c], parts[c + 1]) for c in range(num_chunks)]


def _build_chunk(specs: list, start: int, stop: int) -> Any:
    """One chunk's ``nn.Module``: the layers of ``specs[start:stop]`` run in order."""
    import torch.nn as nn

    class Chunk(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList()
            self.calls: list[Callable[[Any], Any]] = []
            self.tied: list[Any] = []   # parameters a TiedLayerSpec shares with another chunk
            self.tied_paths: list[str] = []   # and their attribute paths from the chunk
            for spec in specs[start:stop]:
                layer = spec.build()
                self.layers.append(layer)
                fn = getattr(spec, "forward_fn", None)
                self.calls.append((lambda x, l=layer, f=fn: f(l, x)) if fn is not None else layer)
                if getattr(spec, "key", None) is not None:   # DeepSpeed keeps a list of attribute paths
                    attrs = spec.tied_weight_attr
                    attrs = [attrs] if isinstance(attrs, str) else attrs
                    self.tied += [attrgetter(a)(layer) for a in attrs]
                    self.tied_paths += [f"layers.{len(self.layers) - 1}.{a}" for a in attrs]

        def forward(self, x: Any) -> Any:
            for call in self.calls:
                x = call(x)
            return x

    return Chunk()


class TorchPipelineEngine:
    """``torch.distributed.pipelining`` with ``virtual_stages`` stages per rank, driven like a DeepSpeed engine."""

    _INSTRUCTION_MAP: dict = {}   # nothing for InstructionRecorder to wrap

    def __init__(self, schedule: str, specs: list, loss_fn: Callable, micro_batches: int, num_ranks: int,
                 virtual_stages: int = 2, type_name: str = "GPTBlock", lr: float = 1e-5, dp: int = 1,
                 optimizer: Callable[..., Any] | None = None) -> None:
        import torch
        import torch.distributed as dist
        import torch.nn as nn
        import torch.distributed.pipelining as pipelining
        from torch.distributed.pipelining import PipelineStage

        # DeepSpeed's rank order (pipe-major): rank = stage * dp + replica; every rank creates every group
        rank = dist.get_rank()
        self.stage_id, replica = divmod(rank, dp)
        pipes = [dist.new_group([s * dp + d for s in range(num_ranks)]) for d in range(dp)] if dp > 1 else [None]
        replicas = [dist.new_group([s * dp + d for d in range(dp)]) for s in range(num_ranks)] if dp > 1 else [None]
        pipe_group = pipes[replica]
        self.micro_batches = micro_batches
        num_chunks = num_ranks * virtual_stages
        bounds = chunk_layers(specs, num_chunks, type_name)
        cls_name, v_shape = _TORCH_SCHEDULES[schedule]
        if v_shape and virtual_stages != 2:
            raise ValueError(f"{schedule} places exactly 2 stages per rank in a V, not {virtual_stages}")
        self.local_chunks = sorted(c for c in range(num_chunks) if chunk_rank(c, num_ranks, v_shape) == self.stage_id)
        # the accelerator's device, as DeepSpeed's engines use: gloo takes CPU tensors, NCCL only device ones
        from deepspeed.accelerator import get_accelerator

        self.device = torch.device(get_accelerator().current_device_name())
        chunks = [_build_chunk(specs, *bounds[c]).to(self.device) for c in self.local_chunks]
        self.module = nn.ModuleList(chunks)
        self.module.forward_funcs = [layer for chunk in chunks for layer in chunk.layers]
        device = self.device
        if schedule.endswith("-fsdp2"):
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.fsdp import fully_shard

            mesh = DeviceMesh.from_group(replicas[self.stage_id], device_type=device.type)
            for chunk in chunks:
                for layer in chunk.layers:
                    if type(layer).__name__ == type_name:
                        fully_shard(layer, mesh=mesh, reshard_after_forward=False)
                fully_shard(chunk, mesh=mesh, reshard_after_forward=False)
            for chunk in chunks:   # the tied copies' parameters are now the shards that replaced them
                chunk.tied = _tied_of(chunk)
        stages = [PipelineStage(chunk, c, num_chunks, device, group=pipe_group)
                  for c, chunk in zip(self.local_chunks, chunks)]
        cls = getattr(pipelining, cls_name)
        self.schedule = cls(stages, n_microbatches=micro_batches, loss_fn=loss_fn, scale_grads=True)
        self.first = 0 in self.local_chunks
        self.last = num_chunks - 1 in self.local_chunks
        # tied layers (DeepSpeed TiedLayerSpec): the first and last chunk's copies, their gradients summed
        self.tied = [p for chunk in chunks for p in chunk.tied]
        holders = sorted({0, chunk_rank(num_chunks - 1, num_ranks, v_shape)})
        # one rank holds both copies (V placement): [first chunk's, last chunk's] pairs, added locally
        self.local_tied = [(chunks[0].tied, chunks[-1].tied)] if len(holders) == 1 and self.first else []
        tied_groups = [dist.new_group([h * dp + d for h in holders]) if len(holders) > 1 else None
                       for d in range(dp)]   # every rank calls new_group
        self.tied_group = tied_groups[replica]
        self.replica_group = replicas[self.stage_id] if dp > 1 else None
        self.pipe_group = pipe_group
        self.dp = dp
        self.optimizer = (optimizer or (lambda params: torch.optim.SGD(params, lr=lr)))(self.module.parameters())

    def train_batch(self, data_iter: Any) -> Any:
        import torch
        import torch.distributed as dist

        batches = [next(data_iter) for _ in range(self.micro_batches)]
        inputs = torch.cat([x for x, _ in batches]).to(self.device)   # (m*B, L): split into m micro-batches
        labels = torch.cat([y for _, y in batches]).to(self.device)
        losses: list = []
        args = (inputs,) if self.first else ()
        self.schedule.step(*args, target=labels if self.last else None, losses=losses if self.last else None)
        for firsts, lasts in self.local_tied:
            for a, b in zip(firsts, lasts):
                total = a.grad + b.grad
                a.grad.copy_(total)
                b.grad.copy_(total)
        if self.tied_group is not None:
            for p in self.tied:
                grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                dist.all_reduce(grad, group=self.tied_group)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss = torch.stack(losses).mean().detach() if losses else torch.zeros((), device=self.device)
        # every rank of the pipeline reports it, as DeepSpeed's engines do (in a V the last chunk is on rank 0)
        dist.all_reduce(loss, group=self.pipe_group)
        if self.dp > 1:   # the replicas' mean, as DeepSpeed's engines report it
            dist.all_reduce(loss, group=self.replica_group)
            loss /= self.dp
        return loss


def _tied_of(chunk: Any) -> list:
    """The tied weights of ``chunk`` after ``fully_shard`` replaced its parameters (looked up by the same paths)."""
    return [attrgetter(path)(chunk) for path in chunk.tied_paths]


def build_peer(variant: str, specs: list, loss_fn: Callable, micro_batches: int, num_ranks: int,
               base_config: dict, type_name: str = "GPTBlock") -> Any:
    """The engine of peer ``variant`` for ``micro_batches`` micro-batches (see the module docstring)."""
    if variant == "ds-dualpipev":
        import deepspeed
        import torch
        from deepspeed.runtime.pipe.dualpipev import DualPipeVModule

        model = DualPipeVModule(specs, num_stages=num_ranks, loss_fn=loss_fn, partition_method=f"type:{type_name}")
        opt = torch.optim.SGD(model.parameters(), lr=1e-5)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=base_config)
        return engine
    if variant in _TORCH_SCHEDULES:
        return TorchPipelineEngine(variant, specs, loss_fn, micro_batches, num_ranks, type_name=type_name)
    raise ValueError(f"unknown peer {variant!r}; known: {', '.join(PEER_VARIANTS)}")
