"""TokenPipelineModule: a DeepSpeed PipelineModule that can sample inputs and hold several chunks per rank.

Any ``PipelineModule`` runs in the token pipeline as long as its token-mixing layers read the slice context
(:func:`~ds_terapipe.runtime.slicing.attention.sliced_causal_attention`). What a plain PipelineModule cannot do is
say what its first stage's input looks like, and the engine needs exactly that at init: to check that every
stage gives the same result sliced as unsliced (the refusal of non-causal models) and to profile each stage
for ``slices: "auto"``. This subclass adds that.

Virtual stages (``virtual_stages=v > 1``): ``num_stages`` stays the number p of pipeline ranks, DeepSpeed's
``partition_method`` cuts the layers into p*v *chunks*, and rank r builds the chunks the schedule places on it
(``schedule=``: looped, chunk c on rank c mod p, for ``interleaved-1f1b`` and ``looped-bfs``; a V, chunks r and
2p-1-r, for ``dualpipev``). This generalises DeepSpeed's ``DualPipeVModule`` (two chunks, ``activate_phase``):
the engine calls :meth:`activate_chunk` before running a chunk, which points DeepSpeed's ``forward_funcs`` and
layer bounds at that chunk, so DeepSpeed's own forward, activation checkpointing and per-layer checkpoint files
(global layer indices: any (p, v) loads weights written by any other) work per chunk unchanged. A tied layer
used by two chunks of one rank (embedding and head under the V placement) is one module there.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Union

import torch
import torch.distributed as dist
from deepspeed.pipe import PipelineModule

from ...planner.registry import get_schedule
from ...planner.schedule import chunks_on, looped_placement
from ..features import vocab
from ..features.sharding import local_shard
from ..features.vocab_shard import split_output_layer
from ..features.vocab_embedding import install_split
from ..features.partition import custom_parts

__all__ = ["TokenPipelineModule", "InputSampler", "chunk_layout", "loss_fn_problem", "loss_fn_replaced",
           "module_chunk_kwargs"]

# (batch, seq_len, generator) -> first-stage input: a tensor or tuple of tensors of shape (batch, seq_len, ...)
InputSampler = Callable[[int, int, torch.Generator], Union[torch.Tensor, tuple]]


class TokenPipelineModule(PipelineModule):
    """A ``PipelineModule`` with a sampler of first-stage inputs and, optionally, several chunks per rank.

    Args:
        layers, num_stages, topology, loss_fn, partition_method, ...: as ``deepspeed.pipe.PipelineModule``;
            ``num_stages`` is the number of pipeline ranks.
        vocab_size: for token-id inputs: sample ids uniformly from ``[0, vocab_size)``; also the range the engine
            holds input ids (and labels, with ``causal_lm_loss``) to before each step
            (``runtime/execution/batch_checks.py``).
        input_sampler: for other inputs: ``fn(batch, seq_len, generator)`` returning the first stage's input.
        virtual_stages: chunks per rank (the config's ``terapipe.virtual_stages``); the model is cut into
            ``num_stages * virtual_stages`` chunks.
        schedule: the registered schedule whose placement puts chunks on ranks (the config's
            ``terapipe.schedule``); None: looped (chunk c on rank c mod p).
        partition_method: DeepSpeed's (``uniform``, ``parameters``, ``type:...``), or ``"terapipe"`` (cost-based:
            layers profiled, boundaries and slicing planned together; needs ``partition_settings``, see
            :func:`~ds_terapipe.runtime.features.partition.partition_kwargs`) or ``"parts:0,5,9"`` (your own
            boundaries).
        vocab_parallel: split the output layer (the last of ``layers``) by vocabulary rows over the pipeline
            ranks (the config's ``terapipe.vocab_parallel``; :mod:`ds_terapipe.runtime.features.vocab`): every rank
            holds
            ``vocab_head``, its shard, and the last chunk's forward ends with the final hidden states (the other
            ``layers`` are cut into chunks as without it). With ``partition_method="terapipe"`` the partition
            is costed with the head's shard on every rank (one chunk per rank; virtual stages are refused).

    Attributes:
        placement: the rank of every chunk, chunk-indexed (``(0, 1, ..., p-1)`` with one chunk per rank).
        chunk_ids: the chunks this rank holds, ascending; :meth:`activate_chunk` takes an index into it.
        partition_report: for ``partition_method="terapipe"``, the chosen and naive layouts (boundaries, slices,
            predicted step and busy time per rank); else None.
    """

    def __init__(self, layers, *args, vocab_size: Optional[int] = None,
                 input_sampler: Optional[InputSampler] = None, virtual_stages: int = 1,
                 schedule: Optional[str] = None, partition_settings: Optional[Any] = None,
                 vocab_parallel: bool = False, sequence_parallel: int = 1, **kwargs) -> None:
        if vocab_size is not None and input_sampler is not None:
            raise ValueError("TokenPipelineModule: pass vocab_size or input_sampler, not both")
        if vocab_size is not None and vocab_size < 1:
            raise ValueError(f"TokenPipelineModule: vocab_size={vocab_size} must be >= 1")
        if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or virtual_stages < 1:
            raise ValueError(f"TokenPipelineModule: virtual_stages={virtual_stages!r} must be an int >= 1 (chunks per "
                             "pipeline rank; the config's terapipe.virtual_stages)")
        if schedule is not None:
            get_schedule(schedule)  # an unknown name fails here, listing the valid ones
        if sequence_parallel != 1:
            kwargs = _sequence_topology(sequence_parallel, kwargs)
        # Read by _partition_layers, which PipelineModule.__init__ calls before returning.
        self.virtual_stages = virtual_stages
        self.chunk_schedule = schedule
        self.partition_settings = partition_settings   # and the sampler: partition_method="terapipe" profiles
        self.vocab_size = vocab_size
        self.input_sampler = input_sampler
        self.sequence_parallel = sequence_parallel   # the engine checks it against terapipe.sequence_parallel
        head_spec = None
        if vocab_parallel:
            given = list(layers)   # with the output layer: what a rebuild starts from
            layers, head_spec = split_output_layer(layers)
        # Read by the cost-based partition (runtime/features/partition.py): it times the head's shard, not the head.
        self.vocab_head_spec = head_spec
        # What a repack (runtime/features/repack.py) needs to build this model again over another topology.
        self.rebuild_spec = {"layers": list(layers) if head_spec is None else given, "args": args,
                             "kwargs": dict(kwargs, vocab_size=vocab_size, input_sampler=input_sampler,
                                            virtual_stages=virtual_stages, schedule=schedule,
                                            partition_settings=partition_settings, vocab_parallel=vocab_parallel,
                                            sequence_parallel=sequence_parallel)}
        super().__init__(layers, *args, **kwargs)
        if sequence_parallel != 1:   # replicated over the sequence ranks: start them equal (from the first)
            group = self._grid.get_slice_parallel_group()
            source = self._grid.stage_to_global(self.stage_id, model=0)
            with torch.no_grad():
                for param in self.parameters():
                    dist.broadcast(param.data, source, group=group)
        self.vocab_head = None if head_spec is None else vocab.build_shard_head(self, head_spec)
        split = None if self.vocab_head is None else self.vocab_head.embedding
        # an untied input embedding split too: its own rows on every rank (the tied one uses the head's)
        self.vocab_embed = None if split is None or split.tied else vocab.build_embedding_shard(self, split)
        if split is not None:
            install_split(self, self.vocab_head if split.tied else self.vocab_embed, split)

    # -- inputs ---------------------------------------------------------------------------------------------
    def has_sampler(self) -> bool:
        return self.vocab_size is not None or self.input_sampler is not None

    def sample_input(self, batch: int, seq_len: int, generator: torch.Generator) -> Union[torch.Tensor, tuple]:
        """A first-stage input of ``batch`` sequences of ``seq_len`` tokens (on CPU)."""
        if self.input_sampler is not None:
            return self.input_sampler(batch, seq_len, generator)
        if self.vocab_size is None:
            raise ValueError("TokenPipelineModule has no input sampler: pass vocab_size= or input_sampler=")
        return torch.randint(0, self.vocab_size, (batch, seq_len), generator=generator)

    # -- chunks ---------------------------------------------------------------------------------------------
    @property
    def num_chunks(self) -> int:
        return len(self.placement)

    @property
    def has_chunks(self) -> bool:
        """Whether this rank's layers are cut into chunks placed by a schedule (else DeepSpeed's one range)."""
        return self.placement != tuple(range(self.num_stages))

    def _chunk_placement(self, num_ranks: int) -> tuple[int, ...]:
        if self.chunk_schedule is not None:
            return tuple(get_schedule(self.chunk_schedule).placement(num_ranks, self.virtual_stages))
        return looped_placement(num_ranks, self.virtual_stages)

    def _partition_layers(self, method: str = "uniform") -> None:
        num_ranks = self.num_stages
        self.placement = self._chunk_placement(num_ranks)
        parts = custom_parts(self, method, len(self.placement))  # "terapipe", "parts:..." (features/partition.py)
        if not self.has_chunks:
            if parts is None:
                super()._partition_layers(method)
            else:
                self.parts = list(parts)
                self._set_bounds(start=self.parts[self.stage_id], stop=self.parts[self.stage_id + 1])
            self.chunk_ids = (self.stage_id, )
            self.chunk_bounds = [(self._local_start, self._local_stop)]
            return
        num_chunks = len(self.placement)
        if self._num_layers < num_chunks:
            raise ValueError(f"TokenPipelineModule: {self._num_layers} layers cannot be cut into {num_ranks} stages x "
                             f"{self.virtual_stages} virtual stages = {num_chunks} chunks of at least one layer each; "
                             "use fewer virtual_stages or pipeline stages, or a model with more layers")
        # DeepSpeed's partition methods (uniform, parameters, type:...) cut over the chunks.
        self.num_stages = num_chunks
        try:
            if parts is None:
                super()._partition_layers(method)
            else:
                self.parts = list(parts)
        finally:
            self.num_stages = num_ranks
        self.chunk_ids = chunks_on(self.placement, self.stage_id)
        self.chunk_bounds = [(self.parts[c], self.parts[c + 1]) for c in self.chunk_ids]
        self._set_bounds(*self.chunk_bounds[0])

    def stage_owner(self, layer_idx: int) -> int:
        """The pipeline rank that holds ``layer_idx`` (DeepSpeed groups tied layers by it)."""
        if not self.has_chunks:
            return super().stage_owner(layer_idx)
        for chunk, rank in enumerate(self.placement):
            if self.parts[chunk] <= layer_idx < self.parts[chunk + 1]:
                return rank
        raise ValueError(f"layer {layer_idx} is in no chunk (parts {self.parts})")

    def _build(self) -> None:
        if not self.has_chunks:
            super()._build()
            self.chunk_funcs = [self.forward_funcs]
            self.chunk_checkpointable = [self.is_checkpointable_results]
            self.active_chunk = 0
            return
        self.chunk_funcs, self.chunk_checkpointable = [], []
        for start, stop in self.chunk_bounds:
            self._set_bounds(start, stop)
            self.forward_funcs = []
            super()._build()
            self.chunk_funcs.append(self.forward_funcs)
            self.chunk_checkpointable.append([])
        self.activate_chunk(0)

    def activate_chunk(self, index: int) -> None:
        """Make the ``index``-th chunk of this rank (``chunk_ids[index]``) the one ``forward()`` runs."""
        self.active_chunk = index
        self.forward_funcs = self.chunk_funcs[index]
        self.is_checkpointable_results = self.chunk_checkpointable[index]
        self._local_start, self._local_stop = self.chunk_bounds[index]

    @contextmanager
    def chunk(self, index: int) -> Iterator[None]:
        """Run a block with the ``index``-th local chunk active; the previously active one is restored."""
        previous = self.active_chunk
        self.activate_chunk(index)
        try:
            yield
        finally:
            self.activate_chunk(previous)

    def each_chunk(self) -> Iterator[int]:
        """Activate each local chunk in turn, yielding its chunk id; restores the active chunk afterwards."""
        previous = self.active_chunk
        try:
            for index, chunk in enumerate(self.chunk_ids):
                self.activate_chunk(index)
                yield chunk
        finally:
            self.activate_chunk(previous)

    def _precompute_checkpointable_values(self) -> None:
        if not self.has_chunks:
            super()._precompute_checkpointable_values()
            self.chunk_checkpointable = [self.is_checkpointable_results]
            return
        for index, _ in enumerate(self.each_chunk()):
            self.is_checkpointable_results_interval = None  # DeepSpeed caches per interval, not per chunk
            super()._precompute_checkpointable_values()
            self.chunk_checkpointable[index] = self.is_checkpointable_results

    def save_state_dict(self, save_dir, *args, **kwargs) -> None:
        for _ in self.each_chunk():
            super().save_state_dict(save_dir, *args, **kwargs)
        if self.vocab_head is not None:
            vocab.save_vocab_shard(self, save_dir)

    def ckpt_layer_path_list(self, ckpt_dir, local_layer_idx) -> list:
        """A layer's checkpoint files as DeepSpeed's loader should see them: one per sequence rank of this run.

        Why: the model axis of this module's topology holds sequence ranks, and each writes a whole copy of its
        stage's layers (``model_00``, ``model_01``, ...). DeepSpeed's loader takes more files than model ranks for
        tensor-parallel pieces to merge (and fewer for one to split); here they are copies, so a checkpoint written
        at another sequence degree hands every rank the first copy."""
        files = super().ckpt_layer_path_list(ckpt_dir, local_layer_idx)
        ranks = self._grid.get_slice_parallel_world_size()
        return files if len(files) in (0, ranks) else [files[0]] * ranks

    def load_state_dir(self, load_dir, *args, **kwargs) -> None:
        # Without vocabulary parallelism, from a checkpoint written with it: a tied input embedding split with
        # the head left its table in the shards; its layer file gets it back while it loads.
        # An untied head split by it has no layer file at all: it loads from the shards alone.
        fills = vocab.layer_fills(load_dir) if self.vocab_head is None else {}
        for _ in self.each_chunk():
            patched, hidden = [], {}
            for local, layer in enumerate(self.forward_funcs):
                extra = fills.get(local + self._local_start)
                if extra and isinstance(layer, torch.nn.Module):
                    if not self.ckpt_layer_path_list(load_dir, local):
                        layer.load_state_dict(extra)
                        hidden[local] = layer
                        self.forward_funcs[local] = _loaded   # DeepSpeed's loop skips what has no state dict
                        continue
                    original = layer.load_state_dict
                    layer.load_state_dict = functools.partial(_load_with, original, extra)
                    patched.append(layer)
            try:
                super().load_state_dir(load_dir, *args, **kwargs)
            finally:
                for layer in patched:
                    del layer.load_state_dict
                for local, layer in hidden.items():
                    self.forward_funcs[local] = layer
        if self.vocab_head is not None:
            vocab.load_vocab_shard(self, load_dir)

    def _synchronize_tied_weights(self) -> None:
        """DeepSpeed's broadcast of the tied weights, without autograd recording it: done with grad on (at build,
        on leaf parameters), torch keeps the in-place broadcast in the graph and warns at the first backward that
        c10d's broadcast has no autograd kernel ("may lead to silently incorrect behavior"), though the gradients
        are right; under no_grad no such node is made. DeepSpeed's loop, shard by shard where the weights are sharded
        (``terapipe.shard_params``: every copy holds the same rows of the weight)."""
        with torch.no_grad():
            for comm in self.tied_comms.values():
                for attr_name in comm["weight_attr"]:
                    weight = self._recursive_getattr(comm["module"], attr_name)
                    dist.broadcast(local_shard(weight), src=min(comm["ranks"]), group=comm["group"])

    def compile(self, *args, **kwargs) -> None:
        for _ in self.each_chunk():
            super().compile(*args, **kwargs)


def loss_fn_problem(module: torch.nn.Module) -> Optional[str]:
    """Why the module's ``loss_fn`` cannot be trained correctly (rule, value, fix), or None.

    A ``loss_fn`` that is a module with trainable parameters (a learned temperature, an adaptive softmax) trains
    on the last stage, but DeepSpeed's pipeline checkpoints hold the layers' states and nothing else: a resume
    would silently restart those parameters from their initial values. Refused at engine init instead; a
    parameter-free module loss (``nn.CrossEntropyLoss()``-like) runs as a function does."""
    loss_fn = getattr(module, "loss_fn", None)
    if not isinstance(loss_fn, torch.nn.Module):
        return None
    trained = [name for name, param in loss_fn.named_parameters() if param.requires_grad]
    if not trained:
        return None
    shown = ", ".join(trained[:4]) + (f" and {len(trained) - 4} more" if len(trained) > 4 else "")
    return (f"terapipe: loss_fn ({type(loss_fn).__name__}) has trainable parameters ({shown}); DeepSpeed's pipeline "
            "checkpoints save the layers' states only, so a resume would restart them from their initial values. "
            "Move them into the last layer (a LayerSpec whose module owns them, its output what the loss reads) "
            "and keep loss_fn free of trainable parameters")


@contextmanager
def loss_fn_replaced(module: torch.nn.Module, fn: Callable[[Any, Any], Any]) -> Iterator[None]:
    """Inside the block, ``module.loss_fn`` (what DeepSpeed's forward calls) is ``fn``.

    Set in the instance's ``__dict__``, which attribute lookup reads before the children ``nn.Module`` registers:
    a ``loss_fn`` that is itself a module (``nn.CrossEntropyLoss()``) stays registered, where assigning a function
    over it is refused by torch. (One with trainable parameters is refused at init: :func:`loss_fn_problem`.)"""
    missing = object()
    before = module.__dict__.get("loss_fn", missing)
    module.__dict__["loss_fn"] = fn
    try:
        yield
    finally:
        if before is missing:
            del module.__dict__["loss_fn"]
        else:
            module.__dict__["loss_fn"] = before


def _sequence_topology(degree: int, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with DeepSpeed's topology for ``num_stages`` x ``degree`` sequence ranks x the data-parallel
    replicas the world leaves: the sequence ranks are its model axis, so DeepSpeed's grid gives each stage its
    group (``get_slice_parallel_group``) and pipes the activations between ranks of one sequence index."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise ValueError(f"TokenPipelineModule: sequence_parallel={degree!r} must be an int >= 1")
    stages = kwargs.pop("num_stages", None)
    if stages is None or kwargs.get("topology") is not None:
        raise ValueError("TokenPipelineModule(sequence_parallel=N) builds the topology from num_stages: pass "
                         "num_stages, not topology")
    world = dist.get_world_size()
    if world % (stages * degree):
        raise ValueError(f"TokenPipelineModule: {world} processes are not a multiple of {stages} stages x "
                         f"{degree} sequence-parallel ranks; launch stages x sequence_parallel x replicas processes")
    return dict(kwargs, topology=PipeModelDataParallelTopology(num_pp=stages, num_mp=degree,
                                                               num_dp=world // (stages * degree)))


def _loaded(*args: Any) -> None:
    """Stands in for a layer while DeepSpeed loads the others (it was loaded from the vocabulary shards)."""


def _load_with(load: Callable, extra: dict, state_dict: dict, *args: Any, **kwargs: Any) -> Any:
    return load({**state_dict, **{k: v for k, v in extra.items() if k not in state_dict}}, *args, **kwargs)


def chunk_layout(module: torch.nn.Module) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(placement, this rank's chunk ids) of any PipelineModule: one chunk per rank unless it is a
    :class:`TokenPipelineModule` with virtual stages."""
    placement = getattr(module, "placement", None)
    if placement is None:
        return tuple(range(module.num_stages)), (module.stage_id, )
    return tuple(placement), tuple(module.chunk_ids)



def module_chunk_kwargs(terapipe: Optional[Any]) -> dict[str, Any]:
    """The :class:`TokenPipelineModule` keywords a parsed ``"terapipe"`` section asks for: ``virtual_stages`` and
    ``schedule`` when it places several chunks per rank, ``vocab_parallel`` when on, ``sequence_parallel`` when
    above 1, else none (one chunk per rank, or stock DeepSpeed)::

        terapipe = ds_terapipe.parse_terapipe_config(ds_config)
        model = TokenPipelineModule(layers, num_stages=2, ..., **ds_terapipe.module_chunk_kwargs(terapipe))
    """
    if terapipe is None or not terapipe.enabled:
        return {}
    out: dict[str, Any] = {"vocab_parallel": True} if terapipe.vocab_parallel else {}
    if terapipe.virtual_stages != 1:
        out.update(virtual_stages=terapipe.virtual_stages, schedule=terapipe.schedule)
    if terapipe.sequence_parallel != 1:
        out["sequence_parallel"] = terapipe.sequence_parallel
    return out
