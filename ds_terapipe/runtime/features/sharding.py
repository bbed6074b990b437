"""Sharded data parallelism per chunk (``terapipe.shard_params``): each chunk's parameters, gradients and optimizer
state split over the data-parallel replicas, gathered only while the schedule runs the chunk.

Why per chunk and driven by the schedule: a rank that runs a chunk for a whole *run* of consecutive actions (every
micro-batch's forward of it under ``looped-bfs``) needs its parameters for that run only, and the run's gradients
can leave as one reduce-scatter when it ends. The schedule says where runs start and end: the lowering adds
``AG`` (gather), ``RS`` (reduce-scatter the run's gradients, free the parameters) and ``RL`` (free after a
forward-only run) to each rank's stream (``planner/sharding.py``), and the engine executes them here. So the count
of gathers per step is the schedule's, visible to ``validate``, ``replay`` and the planner's estimate.

What does the sharding: torch's FSDP2 (``torch.distributed.fsdp.fully_shard``), one parameter group per chunk over
the rank's data-parallel group, rather than a shard manager of our own: it owns the flat all-gather and
reduce-scatter buffers, uneven shards, mixed precision (bf16 compute over fp32 shards, gradients reduced in fp32)
and the CUDA streams that overlap them. It is driven explicitly, as torch's own pipelining drives it: the chunk's
layers are grouped under a container module that is never called, so none of FSDP2's forward/backward hooks fire,
and the actions call ``unshard``/``reshard`` and the parameter group's ``post_backward`` (the reduce-scatter). A
compute action on a chunk that is not gathered is refused (a schedule bug), never run on shards.

A weight tied across layers (``TiedLayerSpec``, e.g. a GPT's embedding and head) is sharded as a group of its own,
gathered with each chunk of the rank that uses it; the copies on other pipeline ranks hold the same rows, so the
tied gradients' all-reduce over the pipeline runs on shards. The optimizer is the engine's torch optimizer, stepping
the local shards (DTensors); its state is therefore sharded too.

Checkpoints hold whole tensors: every replica joins the all-gathers, the layer files and the optimizer state are
written as without sharding, and a load takes each rank's shard of them, so a run resumes at any data-parallel size.
"""

from __future__ import annotations

import functools
import logging
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from ...planner.sharding import shard_counts

__all__ = ["ShardedChunks", "check_fsdp_internals", "is_sharded", "local_shard", "sharding_problem"]

logger = logging.getLogger(__name__)


def sharding_problem(ds_config: Any) -> Optional[str]:
    """Why the DeepSpeed config cannot run ``terapipe.shard_params`` (rule, value, fix), or None. Read from the
    config alone, so every rank refuses alike before anything is built."""
    stage = ds_config.zero_optimization_stage
    if stage != 0:
        return (f"terapipe.shard_params shards parameters, gradients and optimizer state itself; "
                f"zero_optimization.stage={stage} would partition the optimizer again: set the stage to 0")
    if ds_config.float16_config.enabled:
        return ("terapipe.shard_params runs fp32 or bf16 (fp32 shards, bf16 compute); fp16 with its loss scaler is "
                "not supported: use bf16, or turn shard_params off")
    return None


def check_fsdp_internals() -> None:
    """FSDP2's names the explicit driving relies on (private in torch; torch's own pipelining calls them the same
    way): a torch that moved them fails here, at engine init, naming them, instead of inside a step."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    missing = [f"{cls.__name__}.{name}" for cls, name in ((FSDPState, "_lazy_init"),
                                                           (FSDPParamGroup, "post_backward"),
                                                           (FSDPParamGroup, "finalize_backward"))
               if not callable(getattr(cls, name, None))]
    if missing:
        raise RuntimeError(f"terapipe.shard_params drives torch's FSDP2 through {', '.join(missing)}, which torch "
                           f"{torch.__version__} does not have; use the torch the tests ran with (2.13), or turn "
                           "shard_params off")


def _param_groups(unit: torch.nn.Module) -> list[Any]:
    """A fully_shard module's parameter groups (FSDP2's ``FSDPParamGroup``, driven through ``post_backward`` and
    ``finalize_backward``)."""
    from torch.distributed.fsdp import fully_shard

    return fully_shard.state(unit)._fsdp_param_groups


class _Chunk(torch.nn.Module):
    """The layers of one chunk, as the one module FSDP2 shards them under. Never called: the pipeline module runs
    the layers, and the schedule's actions gather and free them."""

    def __init__(self, layers: list[torch.nn.Module]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a sharded chunk is run by the pipeline module's layers, never called as a whole")


class ShardedChunks:
    """This rank's chunks under FSDP2 over the data-parallel group, and the schedule's sharding actions.

    What is sharded: per chunk, its own layers as one FSDP2 group; per weight tied across layers
    (``TiedLayerSpec``), its module as a group of its own, gathered with whichever chunk of this rank uses it (a
    reference count: under a V placement both uses of a tied embedding can be on one rank) and reduce-scattered
    when the last run using it ends. The tied weight's copies on other pipeline ranks hold the same shard layout
    (the same data-parallel size), so DeepSpeed's all-reduce of tied gradients runs on the local shards.

    Counters (per step, reset by :meth:`begin_step`): ``gathers`` and ``reduce_scatters``, the ``AG`` and ``RS``
    actions executed on chunks with sharded states; ``peak_gathered`` the most parameter elements whole at once."""

    def __init__(self, engine: Any) -> None:
        from deepspeed.pipe import TiedLayerSpec
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        check_fsdp_internals()
        self.engine = engine
        self.group = engine.grid.get_data_parallel_group()
        self.dp = engine.grid.data_parallel_size
        device = torch.device(engine.device)
        self.mesh = DeviceMesh.from_group(self.group, device_type=device.type)
        optimizer = engine.optimizer
        if not isinstance(optimizer, torch.optim.Optimizer) or not type(optimizer).__module__.startswith("torch."):
            raise ValueError(f"terapipe.shard_params steps the sharded parameters with a torch optimizer; the engine "
                             f"has {type(optimizer).__module__}.{type(optimizer).__name__}: pass a torch.optim "
                             "optimizer to initialize(optimizer=...), or for a config optimizer set "
                             '"torch_adam": true in its params')
        if optimizer.state:
            raise RuntimeError("terapipe.shard_params: the optimizer has state before the first step; shard the "
                               "model before anything steps it")
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                  cast_forward_inputs=False) if engine.terapipe_bf16 else MixedPrecisionPolicy()
        module = engine.module
        tied = {id(m) for m in module.tied_modules.values()}
        specs = module._layer_specs
        bounds = getattr(module, "chunk_bounds", [(module._local_start, module._local_stop)])
        owners: dict[int, tuple[torch.nn.Module, str, torch.nn.Parameter]] = {}

        def shard(name: str, layers: list[torch.nn.Module]) -> None:
            for layer in layers:
                for sub in layer.modules():
                    for attr, param in sub.named_parameters(recurse=False):
                        owners[id(param)] = (sub, attr, param)
            box = _Chunk(layers)
            self.numel[name] = sum(p.numel() for p in box.parameters())
            fully_shard(box, mesh=self.mesh, reshard_after_forward=False, mp_policy=mp)
            fully_shard.state(box)._lazy_init()   # its root state (communication context); no forward will do it
            self.units[name] = box

        self.units: dict[str, Any] = {}      # "chunk <c>" or "tied <key>" -> its FSDP2 module
        self.numel: dict[str, int] = {}
        self.uses: dict[int, list[str]] = {}  # local chunk -> the units it computes with
        for index, chunk in enumerate(engine.local_chunks):
            layers = [f for f in module.chunk_funcs[index] if isinstance(f, torch.nn.Module) and id(f) not in tied
                      and any(True for _ in f.parameters())]
            uses = []
            if layers:
                shard(f"chunk {chunk}", layers)
                uses.append(f"chunk {chunk}")
            start, stop = bounds[index]
            for spec in specs[start:stop]:
                key = f"tied {spec.key}" if isinstance(spec, TiedLayerSpec) else None
                if key is None or key in uses:
                    continue
                if key not in self.units and any(True for _ in module.tied_modules[spec.key].parameters()):
                    shard(key, [module.tied_modules[spec.key]])
                if key in self.units:
                    uses.append(key)
            self.uses[chunk] = uses
        # the optimizer was built over the whole parameters: point it at the shards that replaced them (with the
        # marks DeepSpeed put on the parameters, e.g. which copy of a tied weight counts in the norm)
        swap = {}
        for key, (sub, attr, old) in owners.items():
            new = getattr(sub, attr)
            for mark, value in vars(old).items():
                if not mark.startswith("_") and not hasattr(new, mark):
                    setattr(new, mark, value)
            swap[key] = new
        for group in optimizer.param_groups:
            group["params"] = [swap.get(id(p), p) for p in group["params"]]
        self._pending: dict[str, Any] = {}   # unit -> all-gather handle not yet waited for
        self._refs: dict[str, int] = {}      # unit -> chunks of this rank gathered that use it
        self._grads: set[str] = set()        # gathered units whose runs computed gradients
        self._saving = False                 # inside save_checkpoint (see saving)
        self.begin_step()
        gathers, scatters = shard_counts(engine.lowered_schedule(engine.num_slices))[engine.stage_id]
        logger.info("terapipe: stage %d shards %s (%d parameters) over %d data-parallel replicas (FSDP2%s); a "
                    "training step gathers %d time(s) and reduce-scatters %d", engine.stage_id,
                    ", ".join(self.units) or "nothing", sum(self.numel.values()), self.dp,
                    ", bf16 compute" if engine.terapipe_bf16 else "", gathers, scatters)

    # -- the schedule's actions -------------------------------------------------------------------------------
    def begin_step(self) -> None:
        self.gathers = self.reduce_scatters = 0
        self.peak_gathered = 0

    def gather(self, chunk: int) -> None:
        """``AG``: start the all-gathers of what the chunk computes with (waited for at its first compute action)."""
        uses = self.uses.get(chunk, [])
        if not uses:
            return
        for unit in uses:
            refs = self._refs.get(unit, 0)
            if refs and unit == f"chunk {chunk}":
                raise RuntimeError(f"terapipe.shard_params: chunk {chunk} is gathered twice without a release; "
                                   "this is a bug in the schedule's sharding actions, please report it")
            if not refs:
                self._pending[unit] = self.units[unit].unshard(async_op=True)
            self._refs[unit] = refs + 1
        self.gathers += 1
        self.peak_gathered = max(self.peak_gathered, sum(self.numel[u] for u in self._refs))

    def ready(self, chunk: int) -> None:
        """Before a compute action on ``chunk``: its parameters are whole (waits for its all-gathers)."""
        for unit in self.uses.get(chunk, []):
            handle = self._pending.pop(unit, None)
            if handle is not None:
                handle.wait()
            elif unit not in self._refs:
                raise RuntimeError(f"terapipe.shard_params: a compute action on chunk {chunk} found {unit} sharded "
                                   "(no AG before it); this is a bug in the schedule's sharding actions, please "
                                   "report it")

    def reduce_scatter(self, chunk: int) -> None:
        """``RS``: the run computed gradients: reduce-scatter them (added to the shards' gradients) and free the
        whole parameters, for each unit no other gathered chunk of this rank still uses."""
        self._end_run(chunk, grads=True)
        if self.uses.get(chunk):
            self.reduce_scatters += 1

    def release(self, chunk: int) -> None:
        """``RL``: free the whole parameters after a run without gradients (a tied unit another run of this rank
        gave gradients is reduce-scattered)."""
        self._end_run(chunk, grads=False)

    def _end_run(self, chunk: int, grads: bool) -> None:
        self.ready(chunk)
        for unit in self.uses.get(chunk, []):
            if grads:
                self._grads.add(unit)
            self._refs[unit] -= 1
            if self._refs[unit]:
                continue
            del self._refs[unit]
            if unit in self._grads:
                self._grads.discard(unit)
                for group in _param_groups(self.units[unit]):
                    group.post_backward()
            else:
                self.units[unit].reshard()

    @contextmanager
    def whole(self) -> Iterator[None]:
        """Every unit of this rank gathered for a block that runs the layers outside the schedule (the slice check on
        a first batch); freed after it, gradients it left discarded (collective over the replicas)."""
        if self._refs:
            raise RuntimeError("terapipe.shard_params: the layers were asked to run whole in the middle of a step")
        for unit, box in self.units.items():
            box.unshard()
            self._refs[unit] = 1
        try:
            yield
        finally:
            self._refs.clear()
            for box in self.units.values():
                for param in box.parameters():
                    param.grad = None
                box.reshard()

    def finish_step(self) -> None:
        """After the schedule, before the optimizer: wait for the reduce-scatters (their streams), check every unit
        was released, and all-reduce the gradients of parameters in no unit (whole on every replica)."""
        left = sorted(self._refs)
        if left:
            raise RuntimeError(f"terapipe.shard_params: {', '.join(left)} still gathered after the schedule; this is "
                               "a bug in the schedule's sharding actions, please report it")
        for box in self.units.values():
            for group in _param_groups(box):
                group.finalize_backward()
        if self.dp > 1:
            grads = [p.grad for p in self.replicated_params() if p.grad is not None]
            self.engine.sum_gradients_over(grads, self.group, "the data-parallel mean of the replicated gradients",
                                           divide=self.dp)

    def reduce_tied_grads(self) -> None:
        """DeepSpeed's sum of a tied weight's gradients over the pipeline ranks that hold it, on the local shards
        (each copy holds the same rows of it)."""
        for weight, group in self.engine.module.get_tied_weights_and_groups():
            if weight.grad is not None:
                dist.all_reduce(local_shard(weight.grad), group=group)

    # -- what a rank holds ------------------------------------------------------------------------------------
    def replicated_params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.engine.module.parameters() if not is_sharded(p)]

    def memory(self) -> dict[str, float]:
        """Bytes of model states on this rank: sharded now (``params``, ``grads``, ``optimizer``: local shards and
        replicated tensors) and as replicated data parallelism would hold them (``replicated_*``: whole tensors),
        ``gathered_peak``: the most whole parameters gathered at once in the last step, and ``largest_chunk``: the
        whole parameters of this rank's largest chunk (its layers and the tied weights it uses), in bytes at compute
        precision."""
        out = {"params": 0.0, "grads": 0.0, "optimizer": 0.0, "replicated_params": 0.0, "replicated_grads": 0.0,
               "replicated_optimizer": 0.0}
        for p in self.engine.module.parameters():
            out["params"] += local_shard(p).numel() * p.element_size()
            out["replicated_params"] += p.numel() * p.element_size()
            if p.grad is not None:
                out["grads"] += local_shard(p.grad).numel() * p.grad.element_size()
                out["replicated_grads"] += p.grad.numel() * p.grad.element_size()
            for value in self.engine.optimizer.state.get(p, {}).values():
                if torch.is_tensor(value) and value.dim() > 0:
                    out["optimizer"] += local_shard(value).numel() * value.element_size()
                    out["replicated_optimizer"] += value.numel() * value.element_size()
        size = 2 if self.engine.terapipe_bf16 else 4
        out["gathered_peak"] = float(self.peak_gathered * size)
        out["largest_chunk"] = float(max((sum(self.numel[u] for u in uses) for uses in self.uses.values()),
                                         default=0) * size)
        return out

    # -- checkpoints: whole tensors ---------------------------------------------------------------------------
    def _sharded_layers(self) -> list[torch.nn.Module]:
        return [layer for box in self.units.values() for layer in box.layers]

    def _saved_layers(self) -> list[torch.nn.Module]:
        """Every position at which DeepSpeed's save may ask a sharded layer for its ``state_dict``, in the order its
        loop asks (chunk by chunk, layer by layer; a tied module used by two chunks of this rank twice)."""
        module, sharded = self.engine.module, {id(layer) for layer in self._sharded_layers()}
        chunks = getattr(module, "chunk_funcs", [module.forward_funcs])
        return [f for funcs in chunks for f in funcs if id(f) in sharded]

    @contextmanager
    def whole_layer_state(self) -> Iterator[None]:
        """While saving: each sharded layer's ``state_dict()`` gives whole tensors, gathered when DeepSpeed asks
        for it, so one layer is whole at a time (the whole stage at once is what sharding exists to avoid).

        The gathers are collective over the replicas, but DeepSpeed asks only on the replicas that write a layer
        (data-parallel rank 0, or each its range with ``checkpoint.parallel_write.pipeline_stage``). So every
        replica walks the same positions (:meth:`_saved_layers`): a layer asked for gathers the positions before it
        that were not asked here (and drops them), then itself; after DeepSpeed's loop the rest are gathered and
        dropped. Every replica thus gathers every position once, in one order."""
        positions = self._saved_layers()
        state = {"next": 0}

        def gather(index: int) -> dict:   # the layer's own state_dict, not the one set below
            layer = positions[index]
            return {k: _whole(v) for k, v in type(layer).state_dict(layer).items()}

        def asked(layer: torch.nn.Module, *args: Any, **kwargs: Any) -> dict:
            index = next((i for i in range(state["next"], len(positions)) if positions[i] is layer), None)
            if index is None:
                raise RuntimeError(f"terapipe.shard_params: DeepSpeed asked {type(layer).__name__} for its state "
                                   "out of the order of its save loop; this is a bug, please report it")
            for skipped in range(state["next"], index):
                gather(skipped)
            state["next"] = index + 1
            return gather(index)

        layers = {id(layer): layer for layer in positions}
        for layer in layers.values():
            layer.state_dict = functools.partial(asked, layer)
        try:
            yield
        finally:
            for layer in layers.values():
                del layer.state_dict
        for rest in range(state["next"], len(positions)):
            gather(rest)

    @contextmanager
    def loading_whole_layers(self) -> Iterator[None]:
        """While loading: a sharded layer's ``load_state_dict`` takes whole tensors and keeps its shard of each."""
        layers = self._sharded_layers()
        for layer in layers:
            layer.load_state_dict = lambda sd, strict=True, _layer=layer, **k: _load_whole(_layer, sd, strict)
        try:
            yield
        finally:
            for layer in layers:
                del layer.load_state_dict

    def wrap_optimizer_state(self) -> None:
        """The optimizer's ``state_dict`` holds whole tensors (collective: DeepSpeed calls it on every rank) and its
        ``load_state_dict`` takes this rank's shard of them, so the state moves between data-parallel sizes."""
        optimizer = self.engine.optimizer
        cls = type(optimizer)

        def state_dict() -> dict:
            # whole tensors on the host, one parameter's state gathered on the device at a time; a replica that
            # does not write the optimizer state (DeepSpeed: data-parallel rank 0 writes it) joins each gather
            # and keeps nothing
            sd = cls.state_dict(optimizer)
            writes = not self._saving or getattr(self.engine, "save_non_zero_checkpoint", True)
            state = {}
            for key, st in sd["state"].items():
                whole = {n: _whole(v) for n, v in st.items()}
                if writes:
                    state[key] = {n: v.cpu() if is_sharded(st[n]) else v for n, v in whole.items()}
            return dict(sd, state=state)

        def load_state_dict(sd: dict) -> None:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            state = {}
            for key, st in sd["state"].items():
                param = params[int(key)]
                state[key] = {n: _shard_like(v, param) for n, v in st.items()}
            cls.load_state_dict(optimizer, dict(sd, state=state))

        optimizer.state_dict = state_dict
        optimizer.load_state_dict = load_state_dict

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Around DeepSpeed's ``save_checkpoint``: the optimizer's ``state_dict`` on a replica that does not write
        it drops each whole tensor once gathered (outside a save it always returns them)."""
        self._saving = True
        try:
            yield
        finally:
            self._saving = False


def is_sharded(t: Any) -> bool:
    """Whether ``t`` is a sharded tensor (a DTensor: a ``shard_params`` parameter, its gradient or state)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` when it is sharded (a view: in-place changes reach it), else ``t``: what
    collectives and in-place updates that act shard by shard take."""
    return t.to_local() if is_sharded(t) else t


def _whole(value: Any) -> Any:
    return value.full_tensor() if is_sharded(value) else value


def _shard_like(value: Any, param: torch.Tensor) -> Any:
    """``value`` (a whole tensor of ``param``'s shape) as ``param``'s shard of it; anything else as it is."""
    from torch.distributed.tensor import distribute_tensor

    if not is_sharded(param) or not torch.is_tensor(value) or value.shape != param.shape:
        return value
    return distribute_tensor(value.to(param.device_mesh.device_type), param.device_mesh, param.placements,
                             src_data_rank=None)


def _load_whole(layer: torch.nn.Module, state: dict, strict: bool) -> Any:
    """Copy whole tensors of ``state`` into ``layer``'s parameters and persistent buffers: each sharded one takes
    its shard. A non-persistent buffer (a rotary embedding's ``inv_freq``) is in no state dict, as in torch's
    ``load_state_dict``: the layer rebuilds it."""
    own = dict(layer.named_parameters())
    own.update({f"{prefix}.{name}" if prefix else name: buf for prefix, module in layer.named_modules()
                for name, buf in module.named_buffers(recurse=False)
                if name not in module._non_persistent_buffers_set})
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if strict and (missing or unexpected):
        raise RuntimeError(f"terapipe.shard_params: loading {type(layer).__name__}: missing keys {missing}, "
                           f"unexpected keys {unexpected}")
    with torch.no_grad():
        for name, value in state.items():
            if name not in own:
                continue
            target = own[name]
            if is_sharded(target):
                local_shard(target).copy_(local_shard(_shard_like(value, target)))
            else:
                target.copy_(value)
    return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)
