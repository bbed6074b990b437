"""Checkpointing: the TokenPipelineEngine's save and load, around DeepSpeed's own.

What it owns: ``save_checkpoint`` (DeepSpeed's files plus the plan and the terapipe config, and a manifest of
every file's size and SHA-256; ``latest`` moves to the new tag only after every rank has written, so an
interrupted save never hides the previous checkpoint); ``load_checkpoint`` (the manifest and the layer shapes
checked on every rank before anything is touched; a checkpoint of another stage layout, sequence degree or
data-parallel size loaded as far as it can be; optimizer state in another format refused with the way out; a
repacked checkpoint's layout repeated before loading; a weights-only load's step count and lr scheduler); and a
sharded layer's whole tensors while DeepSpeed writes or reads the layer files.

Why apart from ``checkpoint.py``: that module is the file format (manifests, shape checks, export, the bf16
optimizer's files) and needs no engine and no process group (``export_state_dict`` runs in a plain process);
this one is the engine's side, collective, inside its fail-fast scope, and a mixin of
:class:`~ds_terapipe.runtime.execution.engine.TokenPipelineEngine` because DeepSpeed's callers save and load
through the engine's own methods.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator, Optional

import torch

from ..planning.plan import restore_checkpoint_plan
from . import checkpoint as ckpt
from .collective import agree_or_raise, decided_on_rank0, mark_collective

__all__ = ["Checkpointing"]

# the engine's logger: these records are the engine's, under the name its users filter on
logger = logging.getLogger(f"{__package__}.engine")


def _unusable_directory(path: str, writes: bool) -> Optional[str]:
    """Why ``path`` cannot serve as a directory this rank uses (created if missing; ``writes``: also writable), as
    the end of a sentence naming it, or None."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        return f"cannot be created ({type(err).__name__}: {err.strerror or err})"
    return "is not writable" if writes and not os.access(path, os.W_OK) else None


def _set_scheduled_lr(scheduler: Any) -> None:
    """The learning rate a just-loaded lr scheduler stands at, written into its optimizer's param groups.

    Why: a scheduler's ``load_state_dict`` restores its counters only, and DeepSpeed steps it after the optimizer:
    with a fresh optimizer (a load without its state) the next step would run at the lr the scheduler set at init
    (DeepSpeed's warm-up minimum, or a torch scheduler's base lr) instead of the checkpoint's. torch's schedulers
    keep the last lr they set (``get_last_lr``); DeepSpeed's compute it from their step (``get_lr``)."""
    if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        lrs = scheduler.get_last_lr()
    else:
        lrs = scheduler.get_lr()
    groups = scheduler.optimizer.param_groups
    if len(lrs) != len(groups):
        raise ValueError(f"the scheduler has {len(lrs)} learning rates for {len(groups)} param groups")
    for group, lr in zip(groups, lrs):
        group["lr"] = lr


# optimizer_format's values, as a refused load names them
_OPTIMIZER_FORMATS = {
    "zero": "ZeRO's partitioned files (zero_optimization.stage 1 or 2)",
    "torch": "the torch optimizer's state dict of whole tensors (fp32 at stage 0, or shard_params)",
    "bf16": "DeepSpeed's bf16 optimizer files per data-parallel rank (bf16, stage 0)",
    "fp16": "DeepSpeed's fp16 optimizer state (fp16, stage 0)",
}


class Checkpointing:
    """Save and load around DeepSpeed's own: a mixin of ``TokenPipelineEngine`` (see the module docstring)."""

    def module_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        with self.sharded.whole_layer_state() if self.sharded is not None else nullcontext():
            return super().module_state_dict(*args, **kwargs)

    def load_module_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        with self.sharded.loading_whole_layers() if self.sharded is not None else nullcontext():
            return super().load_module_state_dict(*args, **kwargs)

    def save_checkpoint(self, save_dir: str, tag: Any = None, client_state: Optional[dict] = None,
                        save_latest: bool = True, **kwargs: Any) -> Any:
        """DeepSpeed's checkpoint, plus the slicing plan and terapipe config, made crash-safe.

        ``latest`` moves to the new tag only after every rank wrote its files and rank 0 wrote the manifest
        (sizes and SHA-256 of every file), so an interrupted save never hides the previous checkpoint.
        """
        tag = str(tag) if tag is not None else f"global_step{self.global_steps}"
        tag_dir = os.path.join(save_dir, tag)
        with self._failing_fast("save_checkpoint"):
            state = dict(client_state or {})
            state.setdefault("terapipe", {"plan": self.plan_summary(), "config": self.terapipe.model_dump()})
            if self.freezer is not None and isinstance(state["terapipe"], dict):  # a resumed run re-freezes it
                state["terapipe"] = {**state["terapipe"], "freeze": self.freezer.state_dict()}
            # every rank writes files there: a directory one of them cannot write fails all of them, now
            problem = _unusable_directory(tag_dir, writes=True)
            agree_or_raise(None if problem is None else
                           f"save_checkpoint: {tag_dir} {problem} on global rank {self.global_rank}; save to a "
                           "writable directory", ckpt.CheckpointError, self.p2p,
                           "the check of the checkpoint directory")
            if self.global_rank == 0 and os.path.exists(os.path.join(tag_dir, ckpt.MANIFEST)):
                os.remove(os.path.join(tag_dir, ckpt.MANIFEST))  # being rewritten: incomplete until the end
            self.barrier("starting a checkpoint")  # DeepSpeed's own barriers in the save cannot watch the flag,
            with self.collective_watch.stretch("DeepSpeed's checkpoint save"):   # so a thread watches it for them
                with self.sharded.saving() if self.sharded is not None else nullcontext():
                    result = super().save_checkpoint(save_dir, tag=tag, client_state=state, save_latest=False,
                                                     **kwargs)
            self.barrier("saving a checkpoint")
            if self.global_rank == 0:
                ckpt.write_manifest(tag_dir, {"num_stages": self.num_stages, "dp": self.dp_world_size,
                                              "sequence_parallel": self.terapipe.sequence_parallel,
                                              "virtual_stages": self.terapipe.virtual_stages,
                                              "placement": list(self.placement),
                                              "optimizer_format": self.optimizer_format(),
                                              "repacked": self.freezer.repacked if self.freezer else None,
                                              "plan": self.plan_summary(), "terapipe": self.terapipe.model_dump(),
                                              # every sequence length's slicing, for a resumed run to run again
                                              "plans": {str(n): list(p.slices) for n, p in self.plans.items()}})
                if save_latest:
                    ckpt.write_latest(save_dir, tag)
                logger.info("terapipe: checkpoint %s complete (manifest written)", tag_dir)
            self.barrier("finishing a checkpoint")
            return result

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin", *args: Any,
                         **kwargs: Any) -> bool:
        """Refused on every rank (DeepSpeed 0.19.8's pipeline engine fails in it with an AttributeError: its
        module's state dict is written per layer by ``save_checkpoint``), naming the way to one state dict."""
        raise mark_collective(ValueError(
            f"token pipeline: save_16bit_model({save_dir!r}, {save_filename!r}) is not supported by a pipeline engine "
            "(DeepSpeed's own fails in it: a pipeline's weights are written per layer); save with "
            "engine.save_checkpoint(dir), then ds_terapipe.export_state_dict(dir) returns one "
            "{'<layer>.<param>': tensor} dict of the whole model, no process group needed"))

    def load_checkpoint(self, load_dir: str, tag: Any = None, **kwargs: Any) -> Any:
        """DeepSpeed's load, after checking the checkpoint is complete and fits this model (nothing is touched
        otherwise). A checkpoint from another number of stages loads its weights (per-layer files) but not the
        optimizer state, which DeepSpeed stores per stage."""
        with self._failing_fast("load_checkpoint"):
            # the broadcasts below block without a deadline: a rank that failed after its last wait on the abort
            # flag (at the end of a step its script caught) stops its peers here first
            self.barrier("the start of a checkpoint load")
            # `latest` is written by global rank 0 alone: every rank loads the tag rank 0 reads there (None: nothing)
            tag = str(tag) if tag is not None else decided_on_rank0(lambda: ckpt.read_latest(load_dir))
            self._repack_like(load_dir, tag)
            result, manifest = self._checked_load(load_dir, tag, **kwargs)
            client = result[1] if isinstance(result, tuple) and len(result) > 1 else None
            # the checkpoint's slicing first, so a re-applied freeze keeps it (it re-plans only without one); from
            # the manifest, which the engine writes itself (a caller's client_state may hold its own "terapipe");
            # nothing loaded (no `latest` on rank 0: nothing on any rank) restores nothing
            restored = None if manifest is None else restore_checkpoint_plan(
                self, {"plan": manifest.get("plan"), "plans": manifest.get("plans"),
                       "config": manifest.get("terapipe")})
            if self.freezer is not None and isinstance(client, dict):
                self.freezer.load_state_dict(self, client.get("terapipe", {}).get("freeze") or {},
                                             keep_slices=self.plan.seq_len in (restored or {}))
            return result

    def _repack_like(self, load_dir: str, tag: Optional[str]) -> None:
        """A checkpoint written after a repack (runtime/features/repack.py) holds the repacked layout: an engine still
        in
        the layout the run started with freezes and repacks the same way first (collective: every rank reads the
        same manifest), so the optimizer state DeepSpeed stores per stage loads into the stages it was saved from."""
        if self.freezer is None or self.freezer.repacked is not None or not self.freezer.cfg.repack:
            return
        try:
            manifest = ckpt.read_manifest(os.path.join(load_dir, tag)) if tag is not None else {}
        except (ckpt.CheckpointError, OSError):   # (a file this rank alone cannot read: it must not freeze alone)
            return  # _checked_load reports it, on every rank
        done = manifest.get("repacked")
        if not done or list(done["stages"]) != [self.num_stages, manifest.get("num_stages")]:
            return
        from ..features.repack import repack

        if int(done["num_frozen_layers"]) > self.freezer.num_frozen_layers:
            self.freezer.apply(self, int(done["num_frozen_layers"]))
        repack(self, self.num_stages // int(manifest["num_stages"]))

    def _checked_load(self, load_dir: str, tag: Optional[str], **kwargs: Any) -> tuple[Any, Optional[dict]]:
        """DeepSpeed's load result and the checkpoint's manifest (None when nothing was loaded); ``tag`` is the one
        every rank agreed on (None: no `latest` on rank 0)."""
        if tag is None:
            logger.warning("terapipe: no 'latest' file in %s: nothing loaded", load_dir)
            return (None, None), None
        tag_dir = os.path.join(load_dir, tag)
        manifest, problem = None, None
        try:
            manifest = ckpt.verify_manifest(tag_dir)
            problem = ckpt.check_layer_shapes(self.module, tag_dir)
            if problem:
                problem = (f"checkpoint {tag_dir} was written for a model with different dimensions: {problem}; "
                           "build the model with the checkpoint's dimensions")
        except ckpt.CheckpointError as err:
            problem = str(err)
        agree_or_raise(problem, ckpt.CheckpointError, self.p2p, f"the check of checkpoint {tag_dir}")
        assert manifest is not None
        written = (manifest.get("num_stages", self.num_stages), manifest.get("virtual_stages", 1),
                   tuple(manifest.get("placement", range(manifest.get("num_stages", self.num_stages)))))
        restaged = written != (self.num_stages, self.terapipe.virtual_stages, self.placement)
        scheduler_wanted = kwargs.get("load_lr_scheduler_states", True)
        if restaged:
            if self.global_rank == 0:
                logger.warning("terapipe: checkpoint %s has %s stages x %s virtual stages (chunk -> rank %s), this run "
                               "%d x %d (%s): loading the weights, step count and lr scheduler, not the optimizer "
                               "state (it is per stage)", tag_dir, written[0], written[1], list(written[2]),
                               self.num_stages, self.terapipe.virtual_stages, list(self.placement))
            kwargs.update(load_optimizer_states=False, load_lr_scheduler_states=False, load_module_only=True)
        saved_format, own_format = manifest.get("optimizer_format"), self.optimizer_format()
        # every rank reaches these verdicts (the same manifest and config everywhere): no agreement needed
        wants_state = kwargs.get("load_optimizer_states", True) and not kwargs.get("load_module_only")
        weights_only = ("load the weights, step count and lr scheduler with a fresh optimizer: "
                        "load_checkpoint(..., load_optimizer_states=False)")
        if saved_format not in (None, own_format) and wants_state:
            saved, own = _OPTIMIZER_FORMATS.get(saved_format, saved_format), _OPTIMIZER_FORMATS[own_format]
            raise mark_collective(ckpt.CheckpointError(
                f"checkpoint {tag_dir} holds its optimizer state as {saved}, this run keeps it as {own}: resume with "
                f"the checkpoint's zero_optimization.stage, bf16/fp16 and terapipe.shard_params, or {weights_only}"))
        saved_dp = manifest.get("dp")
        if own_format == "zero" and saved_format in (None, "zero") and saved_dp not in (None, self.dp_world_size) \
                and wants_state and not self.load_universal_checkpoint():
            # DeepSpeed would refuse it only after loading the weights, without the way out
            raise mark_collective(ckpt.CheckpointError(
                f"checkpoint {tag_dir} holds ZeRO's optimizer state partitioned over {saved_dp} data-parallel "
                f"replicas, this run has {self.dp_world_size}, and DeepSpeed cannot partition it anew: resume with "
                f"{saved_dp} replicas, or {weights_only}"))
        # without ZeRO, DeepSpeed cannot load the bf16 optimizer, and loading weights only leaves the fp32 master
        # weights of the bf16/fp16 optimizers at their initial values (runtime/execution/checkpoint.py)
        no_zero = not self.zero_optimization() and not kwargs.get("load_module_only")
        own_bf16 = no_zero and self.using_bf16_optimizer
        load_optimizer_states = kwargs.pop("load_optimizer_states", True)
        with self._saved_mp_rank(manifest.get("sequence_parallel", 1)):
            if own_bf16:
                dp_group = self.optimizer.dp_process_group
                dp_rank = torch.distributed.get_rank(group=dp_group)
                dp_size = torch.distributed.get_world_size(dp_group)
                bf16_file = None if not load_optimizer_states else ckpt.bf16_optimizer_file(
                    tag_dir, dp_rank=dp_rank, dp_world_size=dp_size, mp_rank=self.checkpoint_mp_rank,
                    saved_dp_world_size=manifest.get("dp"))
            # ZeRO's gathers in DeepSpeed's load cannot watch the flag
            with self.collective_watch.stretch("DeepSpeed's checkpoint load"):
                result = super().load_checkpoint(load_dir, tag=tag,
                                                 load_optimizer_states=load_optimizer_states and not own_bf16,
                                                 **kwargs)
        if result[0] is not None and restaged:
            self._restore_step_state(result[1], tag_dir, scheduler_wanted)
        if result[0] is not None and own_bf16:
            ckpt.load_bf16_optimizer_state(self.optimizer, bf16_file, dp_rank=dp_rank, dp_world_size=dp_size,
                                           load_from_fp32_weights=self.zero_load_from_fp32_weights())
        elif result[0] is not None and no_zero and not load_optimizer_states:
            refresh = getattr(self.optimizer, "refresh_fp32_params", None)   # fp16's optimizers; fp32 has no masters
            if refresh is not None:
                refresh()
        # what follows (the checkpoint's plan decided on rank 0, the freezer's state) waits without a deadline: a
        # rank whose load failed (a file it alone cannot read, memory) stops the others here, naming itself
        self.barrier("loading a checkpoint")
        return result, manifest

    def _restore_step_state(self, state: Optional[dict], tag_dir: str, scheduler: bool) -> None:
        """After a weights-only load into another stage layout: the step count (and samples, skipped steps) and the
        lr scheduler from the checkpoint's state, which DeepSpeed's module-only load leaves in the client state
        it returns. Why: without them the run would save ``global_step2`` after a checkpoint of step 3 (moving
        ``latest`` back) and restart its lr schedule and freezing schedule from step 0. The values are the same in
        every rank's file; the optimizer state is not (it is per stage) and starts fresh."""
        state = state or {}
        if "global_steps" not in state:
            raise mark_collective(ckpt.CheckpointError(
                f"checkpoint {tag_dir} holds no step count (global_steps) in its model states; it was not written "
                "by DeepSpeed's save_checkpoint: load it into the layout it was saved in"))
        self.global_steps = int(state["global_steps"])
        self.global_samples = int(state.get("global_samples", self.global_steps * self.train_batch_size()))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        for key in ("global_steps", "global_samples", "skipped_steps", "dp_world_size", "mp_world_size",
                    "data_sampler", "random_ltd"):   # what a full load takes out of the client state
            state.pop(key, None)
        saved = state.get("lr_scheduler")
        if scheduler and self.lr_scheduler is not None and saved is not None:
            try:
                self.lr_scheduler.load_state_dict(saved)
                _set_scheduled_lr(self.lr_scheduler)
            except (KeyError, ValueError, TypeError, RuntimeError) as err:
                if self.global_rank == 0:
                    logger.warning("terapipe: the lr scheduler of checkpoint %s does not load into this layout "
                                   "(%s: %s); it starts afresh at step %d", tag_dir, type(err).__name__, err,
                                   self.global_steps)

    def optimizer_format(self) -> str:
        """How this run's checkpoints hold the optimizer state (a key of ``_OPTIMIZER_FORMATS``). Runs that agree
        load each other's state; across formats a load that asks for the optimizer state is refused before anything
        is read (DeepSpeed would fail looking for files the other format does not write, or hand one optimizer the
        other's state dict), and one with ``load_optimizer_states=False`` takes the rest."""
        if self.zero_optimization():
            return "zero"
        if self.terapipe.shard_params:   # the torch optimizer over fp32 shards, saved and loaded as whole tensors
            return "torch"
        if self.using_bf16_optimizer:
            return "bf16"
        return "fp16" if self.fp16_enabled() else "torch"

    @contextmanager
    def _saved_mp_rank(self, saved_degree: int) -> Iterator[None]:
        """While loading: DeepSpeed's per-rank file names (``mp_rank_XX``: the rank among the stages x sequence
        ranks of one replica, stage-major) as the checkpoint wrote them. At the same sequence degree each rank reads
        its own; at another, the first sequence rank's copy of its stage (every sequence rank's state is the same)."""
        own = self.checkpoint_mp_rank, self.mp_world_size
        if saved_degree != self.terapipe.sequence_parallel:
            # DeepSpeed picks its file from all ``mp_rank_*`` ones by this rank and their count (more files than
            # model ranks would be merged as tensor-parallel pieces): both as the checkpoint's layout had them
            self.checkpoint_mp_rank = self.stage_id * saved_degree
            self.mp_world_size = self.num_stages * saved_degree
        try:
            yield
        finally:
            self.checkpoint_mp_rank, self.mp_world_size = own
