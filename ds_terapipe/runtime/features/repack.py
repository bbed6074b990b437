"""Repacking (``terapipe.freeze.repack``): fewer pipeline stages and more data-parallel replicas after a freeze.

Why: once a freeze leaves whole stages with frozen layers only, those ranks run forwards only and the stage that
still trains becomes the pipeline's bottleneck; re-planning the slicing cannot fix that. PipeTransformer (ICML
2021) packs the layers that still train into fewer stages and uses the freed ranks as extra data-parallel
replicas. This module does it inside the running job: same processes, same ``deepspeed`` command.

The rule (decided after every freeze, on every rank from the same numbers): with ``f`` leading stages holding
frozen layers only, the pipeline shrinks from ``p`` to ``p'``, the largest divisor of ``p`` with ``p' <= p - f``;
nothing happens while ``f = 0``. With ``v`` chunks per rank ``f`` is the frozen chunks in whole ranks' worth,
``floor(frozen chunks / v)``: the work a repack can take off the pipeline. With ``k = p / p'``:

* layout: new chunk ``c'`` holds the layers of old chunks ``[c'k, (c'+1)k)`` (boundaries ``parts[::k]``; with one
  chunk per rank, chunks are stages), placed by the same schedule over ``p'`` ranks, so the costs profiled at init
  merge exactly (a sum per chunk) and nothing is profiled again. The rank that was old
  stage ``s`` of replica ``r`` becomes stage ``s // k`` of replica ``(s % k) * d + r`` (``d`` old replicas). The
  frozen prefix runs forward-only in front of the first trained layers on every replica: replicated, not cached,
  because each step brings new inputs (a cache pays off only for repeated data, and its memory grows with it).
* batch and data order: the global batch stays (``gradient_accumulation_steps`` becomes ``G / k``). Every rank
  reads all ``G`` micro-batches of the step from the iterator it is given (the stream of its old replica, as
  before the repack) and runs its share: new replica ``(s % k) * d + r`` takes micro-batches
  ``[(s % k) G/k, (s % k + 1) G/k)``. DeepSpeed's mean over micro-batches and replicas then equals the mean the
  old pipeline took. A cheap checksum per step checks that the ranks of one old replica read the same data
  (a middle stage's iterator that DeepSpeed never read from would be behind): a mismatch fails every rank.
* state: every parameter and the optimizer state of every parameter still training move from their owner
  (the old stage's replica 0) to every rank that holds them now, as device tensors over p2p. The optimizer
  object and the learning-rate scheduler are the ones the run started with (their param groups now list the
  new module's parameters), so references a script holds stay valid; step counters carry over. Under DeepSpeed's
  master-copy optimizers (BF16_Optimizer, ZeRO 1, FP16_UnfusedOptimizer) the torch optimizer inside is the one
  regrouped, each parameter's fp32 master copy and state move whole (gathered from the partitions of its stage's
  replicas) and are written where the new DeepSpeed optimizer keeps them; fp16's loss scale carries over.
* vocabulary parallelism: the rows it splits over the pipeline (the head's, an untied input embedding's) are split
  again over the new one: each such parameter and its per-element optimizer state are gathered whole from the old
  pipeline's stages and cut into this rank's rows (:func:`_reshard_rows`).
* the engine: a new :class:`~ds_terapipe.runtime.execution.engine.TokenPipelineEngine` over the new topology
(DeepSpeed's
  own process groups for it), whose state then replaces the old engine's in place: the object the script holds
  is the repacked engine.

Checkpoints written after a repack hold the new layout; loading one into an engine started with the original
layout repacks first, then loads (``TokenPipelineEngine.load_checkpoint``).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from ...planner.cost import WEIGHT_KEYS, per_stage_cost
from ..execution.collective import mark_collective
from ..execution.stage import PipelineStage


__all__ = ["repack_factor", "merged_cost", "repacked_rank", "RepackShare", "repack", "check_repack_supported"]

logger = logging.getLogger(__name__)


# -- pure parts ---------------------------------------------------------------------------------------------------
def repack_factor(num_stages: int, num_frozen_chunks: int, virtual_stages: int = 1) -> int:
    """``k = p / p'`` for ``p'`` the largest divisor of ``p`` with ``p' <= p - f`` (1: stay as is), ``f`` the
    frozen chunks in whole ranks' worth (``num_frozen_chunks // virtual_stages``: each rank holds ``v`` chunks)."""
    num_frozen_stages = num_frozen_chunks // virtual_stages
    if num_frozen_stages <= 0:
        return 1
    for p2 in range(num_stages - num_frozen_stages, 0, -1):
        if num_stages % p2 == 0:
            return num_stages // p2
    return num_stages


def repacked_rank(stage: int, replica: int, num_replicas: int, k: int) -> tuple[int, int]:
    """(new stage, new replica) of the rank that was ``stage`` of ``replica`` (of ``num_replicas``)."""
    return stage // k, (stage % k) * num_replicas + replica


def merged_cost(cost: Optional[Mapping[str, Any]], num_stages: int, k: int) -> Optional[dict[str, Any]]:
    """The cost-file dict ``cost`` (one stage per old stage) for stages merged ``k`` at a time: forward and
    backward times add up point by point, as do the weight-gradient rates; the transfer cost is the last merged
    stage's (it sends to the next). Whole-step terms (``step``) were measured on the old layout and are dropped."""
    if cost is None:
        return None
    stages = per_stage_cost({**cost, "num_stages": num_stages})["stages"]   # equal stages may be written once
    out_stages = []
    for group in range(num_stages // k):
        members = stages[group * k:(group + 1) * k]
        merged = copy.deepcopy(members[-1])
        by_key: dict[tuple, dict] = {}
        for member in members:
            for point in member["points"]:
                key = (point["batch"], point["slice"], point["context"])
                if key not in by_key:
                    by_key[key] = dict(point, forward_ms=0.0, backward_ms=0.0)
                by_key[key]["forward_ms"] += point["forward_ms"]
                by_key[key]["backward_ms"] += point["backward_ms"]
        complete = [point for key, point in by_key.items()
                    if all(any((q["batch"], q["slice"], q["context"]) == key for q in m["points"]) for m in members)]
        merged["points"] = complete
        for key in WEIGHT_KEYS:
            merged.pop(key, None)
            if any(key in m for m in members):   # a merged stage's W of a slice is its members' W of it
                merged[key] = sum(m.get(key, 0.0) for m in members)
        out_stages.append(merged)
    out: dict[str, Any] = {"stages": out_stages, "num_stages": num_stages // k}
    if cost.get("meta") is not None:
        out["meta"] = dict(cost["meta"])
    return out


def merged_stage_meta(meta: Optional[Sequence[Mapping[str, Any]]], k: int) -> Optional[tuple[dict, ...]]:
    if meta is None:
        return None
    groups = [meta[i:i + k] for i in range(0, len(meta), k)]
    return tuple({"layers": sum(m["layers"] for m in g), "hidden": g[0]["hidden"], "bytes": max(m["bytes"] for m in g)}
                 for g in groups)


def check_repack_supported(engine: "PipelineStage") -> Optional[str]:
    """Why ``terapipe.freeze.repack`` cannot run with this engine (the same answer on every rank), or None."""
    if engine.optimizer is not None and not isinstance(engine.optimizer, torch.optim.Optimizer) and \
            not _flat_masters(engine.optimizer):
        return (f"terapipe.freeze.repack moves every parameter's master copy and optimizer state to the ranks that "
                f"hold it after the repack; DeepSpeed's {type(engine.optimizer).__name__} keeps them where the repack "
                "cannot reach: repack works with a torch optimizer (fp32), BF16_Optimizer, ZeRO stage 1 and fp16's "
                "FP16_UnfusedOptimizer; use one of those, or set repack to false (freezing itself works with it)")
    if getattr(engine.module, "rebuild_spec", None) is None or engine.module.rebuild_spec["layers"] is None:
        return (f"terapipe.freeze.repack rebuilds the model over the new layout and needs a "
                f"ds_terapipe.TokenPipelineModule, got {type(engine.module).__name__}; build the model as a "
                "TokenPipelineModule or set repack to false")
    gas = engine.micro_batches
    if gas % engine.num_stages:
        return (f"terapipe.freeze.repack splits each step's micro-batches over the replicas a repack adds: "
                f"gradient_accumulation_steps={gas} must be divisible by the {engine.num_stages} pipeline stages; "
                f"use a multiple of {engine.num_stages} or set repack to false")
    if engine.training_dataloader is not None:
        return ("terapipe.freeze.repack changes the data-parallel layout, which a DeepSpeed data loader built by "
                "initialize(training_data=...) is sharded by; hand train_batch an iterator on every rank instead")
    if not isinstance(engine.config, dict):
        return "terapipe.freeze.repack needs the DeepSpeed config as a dict or a JSON file path"
    return None


# -- DeepSpeed's flat master copies ----------------------------------------------------------------------------------
def _flat_masters(optimizer: Any) -> bool:
    """Whether ``optimizer`` is one of DeepSpeed's whose fp32 master copies and state a repack can read and write
    per parameter: in flat partitions (``param._hp_mapping``: BF16_Optimizer, ZeRO stage 1 in any precision), or
    one fp32 copy per parameter (fp16's FP16_UnfusedOptimizer). The fused FP16_Optimizer is not (nor can freezing
    hold its state still)."""
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(optimizer, torch.optim.Optimizer) or not isinstance(inner, torch.optim.Optimizer):
        return False
    return hasattr(optimizer, "bf16_groups") or hasattr(optimizer, "single_partition_of_fp32_groups") or \
        _copies(optimizer) is not None


def _copies(optimizer: Any) -> Optional[dict[int, torch.Tensor]]:
    """fp16's FP16_UnfusedOptimizer: model parameter id -> its fp32 copy (the inner optimizer's parameter)."""
    if type(optimizer).__name__ != "FP16_UnfusedOptimizer":
        return None
    return {id(p16): p32 for g16, g32 in zip(optimizer.fp16_groups, optimizer.fp32_groups)
            for p16, p32 in zip(g16, g32)}


def _flat_tensor(inner: torch.optim.Optimizer, group: int, key: Optional[str], create: bool = False
                 ) -> Optional[torch.Tensor]:
    """Group ``group``'s flat fp32 master partition (``key`` None) or that partition's optimizer state ``key``
    (created as zeros when ``create``: a new optimizer that has not stepped yet has none)."""
    flat = inner.param_groups[group]["params"][0]
    if key is None:
        return flat
    state = inner.state.setdefault(flat, {}) if create else inner.state.get(flat, {})
    if key not in state and create:
        state[key] = torch.zeros_like(flat)
    return state.get(key)


def _state_keys(inner: torch.optim.Optimizer) -> tuple[list[str], dict[str, Any]]:
    """The per-element state keys of the inner optimizer's flat partitions (momentum, Adam's moments) and its
    scalar state (Adam's step), the same on every replica of a stage."""
    keys: set[str] = set()
    scalars: dict[str, Any] = {}
    for flat_state in inner.state.values():
        for key, value in flat_state.items():
            if torch.is_tensor(value) and value.dim() > 0:
                keys.add(key)
            else:
                scalars[key] = value.clone() if torch.is_tensor(value) else value
    return sorted(keys), scalars


def _read_masters(engine: "PipelineStage") -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
    """Every parameter's whole fp32 master copy and per-element optimizer state, by name, gathered from the
    partitions of its stage's replicas (collective over each stage's data-parallel group: every replica of a stage
    reads its parameters in the same order), and the inner optimizer's scalar state."""
    inner = engine.optimizer.optimizer
    keys, scalars = _state_keys(inner)
    out: dict[str, dict[str, torch.Tensor]] = {}
    copies = _copies(engine.optimizer)
    if copies is not None:   # one fp32 copy per parameter, whole on every replica
        for name, param in engine.module.named_parameters():
            copy32 = copies.get(id(param))
            if copy32 is not None:
                state = inner.state.get(copy32, {})
                out[name] = {"master": copy32.detach().clone(),
                             **{k: state[k].detach().clone() for k in keys if k in state}}
        return out, scalars
    for name, param in engine.module.named_parameters():
        if not hasattr(param, "_hp_mapping"):
            continue
        mapping = param._hp_mapping
        values = {}
        for key in [None, *keys]:
            buf = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
            if mapping is not None:
                flat = _flat_tensor(inner, mapping.param_group_index, key)
                if flat is not None:
                    hp, lp = mapping.get_hp_fragment_address(), mapping.lp_fragment_address
                    buf.narrow(0, lp.start, lp.numel).copy_(flat.detach().view(-1).narrow(0, hp.start, hp.numel))
            dist.all_reduce(buf, group=param._dp_group)   # each element lives on exactly one replica
            values["master" if key is None else key] = buf.view(param.shape)
        out[name] = values
    return out, scalars


def _write_masters(optimizer: Any, params: Mapping[str, torch.nn.Parameter],
                   states: Mapping[str, Mapping[str, Any]], scalars: Mapping[str, Any]) -> None:
    """Into the new flat partitions: each parameter's fp32 master copy and optimizer state (this replica's
    fragment of each), and the scalar state (the step) on every partition; then the low-precision weights from
    their masters."""
    inner = optimizer.optimizer
    copies = _copies(optimizer)
    if copies is not None:
        with torch.no_grad():
            for name, values in states.items():
                copy32 = copies.get(id(params[name]))
                if copy32 is None:
                    continue
                copy32.copy_(values["master"])
                params[name].copy_(copy32)
                state = inner.state.setdefault(copy32, {})
                state.update({k: v.clone() for k, v in values.items() if k != "master" and torch.is_tensor(v)})
                state.update({k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.items()})
        return
    with torch.no_grad():
        for name, values in states.items():
            mapping = getattr(params[name], "_hp_mapping", None)
            if mapping is None:
                continue
            hp, lp = mapping.get_hp_fragment_address(), mapping.lp_fragment_address
            for key, value in values.items():
                if not torch.is_tensor(value) or value.dim() == 0:
                    continue
                flat = _flat_tensor(inner, mapping.param_group_index, None if key == "master" else key, create=True)
                flat.view(-1).narrow(0, hp.start, hp.numel).copy_(value.reshape(-1).narrow(0, lp.start, lp.numel))
        for group in inner.param_groups:
            state = inner.state.setdefault(group["params"][0], {})
            for key, value in scalars.items():
                state[key] = value.clone() if torch.is_tensor(value) else value
        for lp_param in params.values():
            mapping = getattr(lp_param, "_hp_mapping", None)
            if mapping is not None:
                mapping.update_lp()


def _groups_by_param(optimizer: Any) -> dict[int, dict[str, Any]]:
    """Each model parameter's param-group settings (a DeepSpeed optimizer's groups list its fp32 copies or
    partitions, not them)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return {id(p): _hyper(g) for g in optimizer.param_groups for p in g["params"]}
    groups = getattr(optimizer, "bf16_groups", None) or getattr(optimizer, "bit16_groups", None) or \
        getattr(optimizer, "fp16_groups", None) or []
    return {id(p): _hyper(optimizer.optimizer.param_groups[i]) for i, group in enumerate(groups) for p in group}


# -- the data share ---------------------------------------------------------------------------------------------------
def _signature(batch: Any) -> tuple[float, float]:
    tensors = [batch] if torch.is_tensor(batch) else [t for t in (batch if isinstance(batch, (tuple, list)) else ())
                                                     if torch.is_tensor(t)]
    total, squares = 0.0, 0.0
    for t in tensors:
        values = t.detach().double()
        total += float(values.sum())
        squares += float((values * values).sum())
    return total, squares


@dataclass
class RepackShare:
    """This rank's share of each step's micro-batches after a repack (see the module docstring).

    Attributes:
        factor: ``k``, the replicas each old pipeline became.
        index: which ``1/k`` of the step this rank's replica runs.
        old_replica: the replica this rank belonged to before (ranks of one old replica read the same stream).
    """

    factor: int
    index: int
    old_replica: int

    def take(self, engine: "PipelineStage", source: Optional[Iterator], per_replica: int,
             what: str = "train_batch") -> Iterator:
        """Read ``factor x per_replica`` micro-batches from ``source`` and return an iterator over this replica's
        share; collective (the data check)."""
        total = self.factor * per_replica
        batches: list[Any] = []
        problem = 0.0
        if source is None:
            problem = 1.0
        else:
            try:
                for _ in range(total):
                    batches.append(next(source))
            except StopIteration:
                problem = 2.0
        world = dist.get_world_size()
        table = torch.zeros(world, 4, dtype=torch.float64, device=engine.device)
        sums = [_signature(b) for b in batches]
        table[engine.global_rank] = torch.tensor([self.old_replica, problem, sum(s[0] for s in sums),
                                                  sum(s[1] for s in sums)], dtype=torch.float64)
        engine.p2p.wait(dist.all_reduce(table, async_op=True), f"the data check of {what} after a repack")
        rows = table.cpu().tolist()
        missing = [r for r, row in enumerate(rows) if row[1] == 1.0]
        short = [r for r, row in enumerate(rows) if row[1] == 2.0]
        if missing:
            raise mark_collective(ValueError(
                f"terapipe: after a repack every rank runs micro-batches, but rank(s) {missing} got no data iterator "
                f"in {what}; pass the same data_iter to {what} on every rank"))
        if short:
            raise mark_collective(StopIteration(
                f"terapipe: a data iterator ran out on rank(s) {short}: after a repack each rank reads the whole "
                f"step ({total} micro-batches) and runs {per_replica} of them"))
        for replica in sorted({int(row[0]) for row in rows}):
            members = [r for r, row in enumerate(rows) if int(row[0]) == replica]
            seen = {tuple(rows[r][2:]) for r in members}
            if len(seen) > 1:
                raise mark_collective(ValueError(
                    f"terapipe: after a repack the ranks {members} of one former pipeline read different "
                    f"micro-batches in {what} (checksums {[rows[r][2:] for r in members]}); every rank must get that "
                    "pipeline's stream: a persistent iterator on a former middle stage, which DeepSpeed never read "
                    "from, is behind; create the iterator per step or advance it"))
        return iter(batches[self.index * per_replica:(self.index + 1) * per_replica])


# -- moving the state -------------------------------------------------------------------------------------------------
def _state_spec(state: Mapping[str, Any], param: torch.Tensor) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    for name, value in state.items():
        if torch.is_tensor(value):
            spec[name] = ("tensor", tuple(value.shape), str(value.dtype).replace("torch.", ""),
                          value.device == param.device)
        else:
            spec[name] = ("value", value)
    return spec


def _hyper(group: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in group.items() if key != "params"}


def _manifest(engine: "PipelineStage", new_module: Any, old_state: Mapping[str, Mapping[str, Any]]
              ) -> dict[str, Any]:
    """What this rank holds (old module: parameters, their optimizer state and group settings) and needs."""
    groups = _groups_by_param(engine.optimizer)
    held = {}
    if engine.grid.data_parallel_id == 0:  # replicas hold copies: replica 0 of each stage sends
        for name, param in engine.module.named_parameters():
            state = old_state.get(name, {})
            held[name] = {"shape": tuple(param.shape), "dtype": str(param.dtype).replace("torch.", ""),
                          "hyper": groups.get(id(param)), "state": _state_spec(state, param)}
    return {"held": held, "needed": [name for name, _ in new_module.named_parameters()]}


def _owners(manifests: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    owners: dict[str, int] = {}
    for rank, manifest in enumerate(manifests):
        for name in manifest["held"]:
            owners.setdefault(name, rank)
    return owners


def _transfer(engine: "PipelineStage", manifests: Sequence[Mapping[str, Any]], owners: Mapping[str, int],
              old_state: Mapping[str, Mapping[str, Any]], new_params: Mapping[str, torch.nn.Parameter]
              ) -> dict[str, dict[str, Any]]:
    """Send every parameter and optimizer-state tensor from its owner to each rank that now holds it (p2p, device
    tensors). ``old_state``: this rank's optimizer state before the repack, by parameter name. Returns this rank's
    new optimizer state by parameter name."""
    me, device = engine.global_rank, engine.device
    old_params = dict(engine.module.named_parameters())
    pending: list[tuple[Any, Any, Any]] = []  # (work, received buffer, where it goes)
    states: dict[str, dict[str, Any]] = {}
    keep_alive: list[torch.Tensor] = []
    for name in sorted(owners):
        if name in _ROWS:   # vocabulary rows: split again over the new pipeline (_reshard_rows), not moved whole
            continue
        owner = owners[name]
        receivers = [r for r, m in enumerate(manifests) if name in m["needed"]]
        info = manifests[owner]["held"][name]
        items: list[tuple[str, Optional[str], tuple, str]] = [("param", None, info["shape"], info["dtype"])]
        for key in sorted(info["state"]):
            kind = info["state"][key]
            if kind[0] == "tensor":
                items.append(("state", key, kind[1], kind[2]))
        if me in receivers:
            states[name] = {key: kind[1] for key, kind in info["state"].items() if kind[0] == "value"}
        for what, key, shape, dtype in items:
            if me == owner:
                src = old_params[name] if what == "param" else old_state[name][key]
                wire = src.detach().to(device).contiguous()
                keep_alive.append(wire)
                for dst in receivers:
                    if dst != me:
                        pending.append((dist.isend(wire, dst), None, None))
                if me in receivers:
                    pending.append((None, wire.clone(), (name, what, key)))
            elif me in receivers:
                buf = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                pending.append((dist.irecv(buf, owner), buf, (name, what, key)))
    for work, buf, where in pending:
        if work is not None:
            engine.p2p.wait(work, "moving parameters and optimizer state in a repack")
        if buf is None:
            continue
        name, what, key = where
        if what == "param":
            with torch.no_grad():
                new_params[name].copy_(buf)
        else:
            on_param = manifests[owners[name]]["held"][name]["state"][key][3]
            states[name][key] = buf.to(new_params[name].device if on_param else torch.device("cpu"))
    return states


# the parameters vocabulary parallelism splits by rows over the pipeline (runtime/features/vocab.py)
_ROWS = ("vocab_head.weight", "vocab_head.bias", "vocab_embed.weight")


def _reshard_rows(engine: "PipelineStage", new_module: Any, old_state: Mapping[str, Mapping[str, Any]]
                  ) -> dict[str, tuple[torch.Tensor, dict[str, Any]]]:
    """Vocabulary parallelism's rows for the new pipeline: each row-split parameter (the head's rows, an untied
    input embedding's) and its per-element optimizer state (the fp32 master copy too, under DeepSpeed's) gathered
    whole from the old pipeline's ranks (replica 0 of each stage, in stage order) and cut into this rank's rows of
    the new one. Collective over the world. Returns name -> (rows, state rows plus the scalar state)."""
    if getattr(engine.module, "vocab_head", None) is None:
        return {}
    old_params = dict(engine.module.named_parameters())
    new_params = dict(new_module.named_parameters())
    sources = [engine.grid.stage_to_global(stage, data=0) for stage in range(engine.num_stages)]
    out = {}
    for name in _ROWS:
        if name not in old_params:
            continue
        param = old_params[name]
        state = old_state.get(name, {})
        per_row = {key: value for key, value in state.items() if torch.is_tensor(value) and value.shape == param.shape}
        scalars = {key: value for key, value in state.items() if key not in per_row}
        keys: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(keys, sorted(per_row))
        shard = new_module.vocab_embed if name.startswith("vocab_embed") else new_module.vocab_head
        rows = {}
        for key in ["param", *keys[sources[0]]]:
            if key == "param":
                local = param.detach()
            else:   # a rank without the key (none: the same optimizer everywhere) would send zeros
                local = per_row.get(key, torch.zeros_like(param, dtype=torch.float32))
            local = local.to(engine.device).contiguous()
            gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, local)
            full = torch.cat([gathered[rank] for rank in sources])[:shard.vocab_size]
            rows[key] = shard.take_rows(full.to(new_params[name].device))
        out[name] = (rows.pop("param"), {**rows, **scalars})
    return out


def _regroup(optimizer: torch.optim.Optimizer, manifests: Sequence[Mapping[str, Any]], owners: Mapping[str, int],
             new_module: Any) -> None:
    """The optimizer's param groups list the new module's parameters, each with the settings its group had."""
    groups: list[tuple[dict[str, Any], list[torch.nn.Parameter]]] = []
    fallback = _hyper(optimizer.param_groups[0]) if optimizer.param_groups else {}
    for name, param in new_module.named_parameters():
        hyper = manifests[owners[name]]["held"][name]["hyper"] if name in owners else None
        hyper = dict(fallback if hyper is None else hyper)
        for settings, params in groups:
            if repr(settings) == repr(hyper):
                params.append(param)
                break
        else:
            groups.append((hyper, [param]))
    optimizer.param_groups.clear()
    optimizer.state.clear()
    for settings, params in groups:
        optimizer.add_param_group({**settings, "params": params})


def _new_config(engine: "PipelineStage", k: int) -> dict[str, Any]:
    config = copy.deepcopy(engine.config)
    config["gradient_accumulation_steps"] = engine.micro_batches // k
    config["train_micro_batch_size_per_gpu"] = engine.micro_batch_size
    config["train_batch_size"] = engine.train_batch_size()
    config.pop("optimizer", None)   # the run's optimizer and scheduler objects carry over
    config.pop("scheduler", None)
    if isinstance(config.get("pipeline"), dict) and "stages" in config["pipeline"]:
        config["pipeline"] = dict(config["pipeline"], stages=engine.num_stages // k)
    return config


_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")


def repack(engine: "PipelineStage", k: int) -> dict[str, Any]:
    """Continue ``engine`` on ``p / k`` stages x ``k d`` replicas (collective; see the module docstring).

    On return ``engine`` *is* the repacked engine (its state was replaced in place). Returns the event logged.
    Under the collective watch: building the new engine runs DeepSpeed's broadcasts and group creation, which
    cannot watch the abort flag, so a rank failing in it (out of memory) would leave its peers there."""
    with engine.watching("the repack"):
        return _repack(engine, k)


def _repack(engine: "PipelineStage", k: int) -> dict[str, Any]:
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    from ..planning.plan import ResolvedPlan

    old_stages, old_replicas = engine.num_stages, engine.dp_world_size
    new_stages, new_replicas = old_stages // k, old_replicas * k
    stage, replica = engine.stage_id, engine.grid.data_parallel_id
    freezer = engine.freezer
    assert freezer is not None and engine.optimizer is not None
    parts = [int(b) for b in engine.module.parts]
    new_parts = parts[::k]
    spec = engine.module.rebuild_spec
    kwargs = dict(spec["kwargs"])
    kwargs.pop("num_stages", None)
    if kwargs.get("sequence_parallel", 1) != 1:   # the module builds stages x sequence ranks x replicas itself
        kwargs.pop("topology", None)
        kwargs.update(num_stages=new_stages)
    else:
        kwargs.update(topology=PipeDataParallelTopology(num_pp=new_stages, num_dp=new_replicas))
    kwargs.update(partition_method="parts:" + ",".join(str(b) for b in new_parts))
    new_module = type(engine.module)(spec["layers"], *spec["args"], **kwargs)
    expected = repacked_rank(stage, replica, old_replicas, k)
    got = (new_module.stage_id, new_module._grid.data_parallel_id)
    assert got == expected, (got, expected)

    optimizer, scheduler = engine.optimizer, engine.lr_scheduler
    flat = not isinstance(optimizer, torch.optim.Optimizer)   # DeepSpeed's flat master copies (_flat_masters)
    scalars: dict[str, Any] = {}
    if flat:
        old_state, scalars = _read_masters(engine)
    else:
        old_state = {name: dict(optimizer.state.get(param, {})) for name, param in engine.module.named_parameters()}
    manifests: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(manifests, _manifest(engine, new_module, old_state))
    owners = _owners(manifests)
    missing = sorted({n for m in manifests for n in m["needed"]} - set(owners))
    if missing:
        raise mark_collective(RuntimeError(f"terapipe: repack: no rank holds {missing[:5]}"))
    # the torch optimizer the run started with (inside DeepSpeed's, which is rebuilt over the new partitions)
    torch_optimizer = optimizer.optimizer if flat else optimizer
    _regroup(torch_optimizer, manifests, owners, new_module)

    plan = engine.plan
    preset = None
    if engine.terapipe.slicing.is_auto:
        base = freezer.base_cost
        preset = ResolvedPlan(tuple(plan.slices), "repacked", None, merged_cost(base, engine.num_chunks, k),
                              merged_stage_meta(plan.stage_meta, k), None)
    new = type(engine).build(new_module, _new_config(engine, k), engine.terapipe, args=None,
                             optimizer=torch_optimizer, lr_scheduler=scheduler, preset_plan=preset)
    new_params = dict(new.module.named_parameters())
    states = _transfer(engine, manifests, owners, old_state, new_params)
    for name, (rows, state) in _reshard_rows(engine, new.module, old_state).items():
        with torch.no_grad():
            new_params[name].copy_(rows)
        states[name] = state
    if flat:
        _write_masters(new.optimizer, new_params, states, scalars)
        for scaler in ("loss_scaler", "loss_scale_config"):   # fp16: the dynamic loss scale goes on as it was
            if hasattr(optimizer, scaler) and hasattr(new.optimizer, scaler):
                setattr(new.optimizer, scaler, getattr(optimizer, scaler))
    else:
        for name, state in states.items():
            if state and new_params[name].requires_grad:
                optimizer.state[new_params[name]] = state
    for counter in _COUNTERS:
        setattr(new, counter, getattr(engine, counter))
    new.repack_share = RepackShare(factor=k, index=expected[1] // old_replicas, old_replica=replica)
    event = {"step": freezer.steps_taken(engine), "global_step": engine.global_steps,
             "repack": {"stages": [old_stages, new_stages], "replicas": [old_replicas, new_replicas],
                        "parts": new_parts, "micro_batches": [engine.micro_batches, new.micro_batches]}}
    before_ms = freezer.predicted_ms()
    new.freezer.adopt(new, freezer, event)
    after_ms = new.freezer.predicted_ms()
    event["repack"].update(before_ms=before_ms, after_ms=after_ms)
    if engine.global_rank == 0:
        speed = f"; predicted step {before_ms:.1f} ms -> {after_ms:.1f} ms ({before_ms / after_ms:.2f}x)" \
            if before_ms and after_ms else ""
        logger.info("terapipe: step %d: repacked %d stage(s) x %d replica(s) -> %d x %d (layer boundaries %s; "
                    "%d micro-batch(es) per replica per step); plan %s%s", engine.global_steps, old_stages,
                    old_replicas, new_stages, new_replicas, new_parts, new.micro_batches, list(new.slices), speed)
    if engine.p2p is not new.p2p:
        engine.p2p.close()   # the thread the replaced engine waited on for its transfers: the new one has its own
    # DeepSpeed's hooks (on the new module; at ZeRO 1 the optimizer's, held weakly: runtime/execution/lifetime.py)
    # are bound to the new object, whose state the script's object shares from here on: it lives as long as that
    # state, never collected (and destroyed) on its own
    new.hooks_bound_to = new
    engine.__dict__ = new.__dict__  # the script's engine object is the repacked engine from here on
    return event
