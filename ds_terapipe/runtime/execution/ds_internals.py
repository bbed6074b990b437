"""The DeepSpeed internals ds_terapipe relies on, in one table, and the check that they are still there.

The plugin extends DeepSpeed by subclassing (docs/design.md, "Parts"): its engine calls PipelineEngine's private
handlers (``super()._exec_forward_pass``), fills its ``pipe_buffers``, overrides methods DeepSpeed calls
(``_exec_schedule``), drives the bf16 optimizer between backwards, and ``ds_terapipe.initialize`` repeats the
pipeline branch of ``deepspeed.initialize``. None of that is DeepSpeed's public API, so a DeepSpeed release can
move it. :data:`INTERNALS` lists every such name with where we use it and why; :func:`check_deepspeed_internals`
runs at engine init (attribute lookups and a few signatures: well under a millisecond) and fails with the
names of what is missing instead of an ``AttributeError`` deep inside a training step, or silently wrong
results. tests/test_ds_internals.py runs the deeper check (source scans) and checks that the runtime uses
no DeepSpeed internal this table lacks.

:data:`TESTED_DEEPSPEED` is the range the tests run with (pyproject.toml declares the same).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import re
from dataclasses import dataclass
from typing import Any, Optional

from packaging.specifiers import SpecifierSet

__all__ = ["TESTED_DEEPSPEED", "Internal", "INTERNALS", "DeepSpeedInternalsError", "check_deepspeed_internals",
           "missing_internals"]

logger = logging.getLogger(__name__)

TESTED_DEEPSPEED = ">=0.19.8,<0.20"

_ENGINE = "deepspeed.runtime.pipe.engine:PipelineEngine"
_DS_ENGINE = "deepspeed.runtime.engine:DeepSpeedEngine"
_MODULE = "deepspeed.runtime.pipe.module:PipelineModule"
_GRID = "deepspeed.runtime.pipe.topology:PipelineParallelGrid"
_SCHED = "deepspeed.runtime.pipe.schedule"
_BF16 = "deepspeed.runtime.bf16_optimizer:BF16_Optimizer"
_CONFIG = "deepspeed.runtime.config:DeepSpeedConfig"
_BF16_CONFIG = "deepspeed.runtime.precision_config:DeepSpeedBF16Config"


@dataclass(frozen=True)
class Internal:
    """One DeepSpeed name ds_terapipe relies on.

    Attributes:
        owner: ``"module:Qualname"`` (a class or function) or ``"module"``.
        name: the attribute of ``owner``; for ``kind="calls"`` a name the owner's source must call.
        kind: ``"attr"`` (class or module attribute: method, class, function, constant), ``"instance"``
            (set on instances, e.g. in ``__init__``: checked on the live object at engine init and in the
            owner's source by the test), ``"field"`` (a config model field) or ``"calls"`` (the owner's source
            calls it: an override DeepSpeed must keep calling; checked by the test only).
        used_in: where ds_terapipe uses it.
        why: what breaks without it.
        params: for methods, the parameter names we pass (keywords or positions by name).
        at_init: for ``"instance"``, whether the attribute exists right after DeepSpeed's ``__init__``.
    """

    owner: str
    name: str
    kind: str
    used_in: str
    why: str
    params: tuple[str, ...] = ()
    at_init: bool = True

    def label(self) -> str:
        owner = self.owner.split(":")[-1].rsplit(".", 1)[-1] if ":" in self.owner else self.owner
        return f"{owner}.{self.name}"


def _i(owner: str, name: str, kind: str, used_in: str, why: str, params: tuple[str, ...] = (),
       at_init: bool = True) -> Internal:
    return Internal(owner, name, kind, used_in, why, params, at_init)


_E = "runtime/execution/engine.py"
# the engine's mixins (engine.py's docstring)
_PLAN, _BATCH = "runtime/execution/plan_selection.py", "runtime/execution/batch_loading.py"
_GRADS, _CKPT = "runtime/execution/grad_reduction.py", "runtime/execution/engine_checkpoint.py"
INTERNALS: tuple[Internal, ...] = (
    # -- PipelineEngine: the instruction map and the handlers the token engine extends -----------------------
    _i(_ENGINE, "_INSTRUCTION_MAP", "attr", _E, "extended with the slice-aware handlers"),
    _i(_ENGINE, "_exec_forward_pass", "attr", f"{_E} ForwardPass", "DeepSpeed's forward of one slice",
       ("buffer_id", )),
    _i(_ENGINE, "_exec_backward_pass", "attr", f"{_E} BackwardPass", "DeepSpeed's backward of one slice",
       ("buffer_id", )),
    _i(_ENGINE, "_exec_schedule", "attr", f"{_E} (overridden)", "runs the token schedule", ("pipe_schedule", )),
    _i(_ENGINE, "_exec_reduce_tied_grads", "attr", f"{_GRADS} ReduceTiedGrads",
       "the step's deferred weight gradients reach .grad first (runtime/slicing/deferred.py); frozen layers: a zero "
       "gradient for a trained tied weight only frozen layers use here (features/freeze.py); then the vocabulary "
       "shards' exchange (runtime/features/vocab.py)"),
    _i(_ENGINE, "_exec_reduce_grads", "attr", f"{_GRADS} ReduceGrads",
       "the step's deferred weight gradients reach .grad before the data-parallel reduction (slicing/deferred.py)"),
    _i(_ENGINE, "pipeline_enable_backward_allreduce", "instance", f"{_GRADS} ReduceGrads",
       "DeepSpeed's reduction is skipped where it would be an identity (one replica, fp32/fp16, no ZeRO)"),
    *(_i(_DS_ENGINE, name, "attr", f"{_GRADS} ReduceGrads", "decides whether the one-replica reduction is an identity")
      for name in ("zero_optimization_stage", "communication_data_type", "postscale_gradients",
                   "gradient_predivide_factor")),
    *(_i(_DS_ENGINE, name, "instance", f"{_GRADS} ReduceGrads", "decides whether the one-replica reduction is an "
         "identity") for name in ("has_moe_layers", "gradient_average")),
    _i(_ENGINE, "_exec_optimizer_step", "attr", f"{_GRADS} OptimizerStep",
       "the deferred weight gradients reach .grad (if no reduction came first); the auto freeze policy reads the "
       "reduced gradients right before the step (runtime/features/freeze.py)"),
    _i(_MODULE, "_synchronize_tied_weights", "attr", "execution/module.py",
       "overridden to broadcast the tied weights under no_grad"),
    _i(_MODULE, "get_tied_weights_and_groups", "attr", "features/freeze.py",
       "the tied weights DeepSpeed all-reduces, to give each a gradient"),
    _i(_ENGINE, "_train_schedule", "attr", f"{_PLAN} (overridden)", "returns the token schedule for training"),
    _i(_ENGINE, "_inference_schedule", "attr", f"{_PLAN} (overridden)", "returns the forward-only token schedule",
       ("micro_batches", )),
    _i(f"{_ENGINE}.train_batch", "_exec_schedule", "calls", f"{_E} _exec_schedule",
       "DeepSpeed's train_batch must run the schedule through the overridable _exec_schedule"),
    _i(f"{_ENGINE}.train_batch", "_train_schedule", "calls", f"{_PLAN} _train_schedule",
       "DeepSpeed's train_batch must take its schedule from _train_schedule"),
    _i(f"{_ENGINE}.eval_batch", "_exec_schedule", "calls", f"{_E} _exec_schedule",
       "DeepSpeed's eval_batch must run the schedule through _exec_schedule"),
    _i(f"{_ENGINE}.eval_batch", "_inference_schedule", "calls", f"{_PLAN} _inference_schedule",
       "DeepSpeed's eval_batch must take its schedule from _inference_schedule"),
    _i(_ENGINE, "_reserve_pipe_buffers", "attr", f"{_E} _exec_schedule", "sizes pipe_buffers per batch",
       ("num_buffers", )),
    _i(_ENGINE, "_next_batch", "attr", f"{_BATCH} LoadMicroBatch", "reads a micro-batch from the data iterator"),
    _i(_ENGINE, "train_batch", "attr", f"{_E} train_batch", "super() after the per-batch plan switch",
       ("data_iter", )),
    _i(_ENGINE, "eval_batch", "attr", f"{_E} eval_batch", "super() after the per-batch plan switch",
       ("data_iter", )),
    _i(_ENGINE, "set_dataiterator", "attr", f"{_E} train_batch", "installs the caller's data iterator",
       ("iterator", )),
    _i(_ENGINE, "is_first_stage", "attr", _E, "stage role"),
    _i(_ENGINE, "is_last_stage", "attr", _E, "stage role"),
    _i(_ENGINE, "_loss_stage_global_rank", "attr", f"{_E} loss broadcast", "the rank of the last chunk"),
    _i(_ENGINE, "pipe_buffers", "instance", f"{_E} handlers", "inputs/labels/outputs of each (micro-batch, slice)"),
    _i(_ENGINE, "loss", "instance", f"{_E} forward/backward", "the slice's loss DeepSpeed's backward reads"),
    _i(_ENGINE, "grad_layer", "instance", f"{_E} BackwardPass", "the received output gradient of a slice"),
    _i(_ENGINE, "outputs", "instance", f"{_E} eval logits", "the last stage's outputs"),
    _i(_ENGINE, "fwd_outputs", "instance", f"{_E} _exec_schedule", "reset per batch as DeepSpeed does",
       at_init=False),
    _i(_ENGINE, "eval_return_logits", "instance", f"{_E} forward", "whether eval_batch returns logits"),
    _i(_ENGINE, "_compute_loss", "instance", f"{_E} forward", "whether fwd_outputs hold losses or outputs",
       at_init=False),
    _i(_ENGINE, "data_iterator", "instance", f"{_E} train_batch", "peeked for the sequence length"),
    _i(_ENGINE, "micro_batches", "instance", f"{_E}, planning/plan.py", "micro-batches per step"),
    _i(_ENGINE, "micro_batch_size", "instance", f"{_BATCH}, {_PLAN}, planning/plan.py", "sequences per micro-batch"),
    _i(_ENGINE, "is_pipe_partitioned", "instance", f"{_E} __init__", "refused: not supported"),
    _i(_ENGINE, "is_grad_partitioned", "instance", f"{_E} __init__", "refused: not supported"),
    _i(_ENGINE, "num_stages", "instance", _E, "pipeline depth"),
    _i(_ENGINE, "stage_id", "instance", _E, "this rank's stage"),
    _i(_ENGINE, "prev_stage", "instance", f"{_E} p2p", "neighbour stage ids"),
    _i(_ENGINE, "next_stage", "instance", f"{_E} p2p", "neighbour stage ids"),
    _i(_ENGINE, "grid", "instance", _E, "stage -> global rank, data-parallel id"),
    _i(_ENGINE, "using_bf16_optimizer", "instance", f"{_E} WeightGradPass", "deferred grads reach bf16 masters"),
    _i(_DS_ENGINE, "__init__", "attr", "initialize.py", "the keywords the engine is built with",
       ("args", "model", "optimizer", "model_parameters", "training_data", "lr_scheduler", "mpu",
        "dist_init_required", "collate_fn", "config", "config_class")),
    _i(_DS_ENGINE, "save_checkpoint", "attr", f"{_CKPT} save_checkpoint", "super() before the manifest",
       ("save_dir", "tag", "client_state", "save_latest")),
    _i(_DS_ENGINE, "load_checkpoint", "attr", f"{_CKPT} load_checkpoint", "super() after the checks",
       ("load_dir", "tag", "load_optimizer_states", "load_lr_scheduler_states", "load_module_only")),
    _i(_DS_ENGINE, "_configure_python_gc", "attr", "initialize.py", "the last step of DeepSpeed's initialize"),
    _i(_DS_ENGINE, "destroy", "attr", f"{_E} destroy", "super() before the thread the transfers waited on stops"),
    _i(_DS_ENGINE, "device", "instance", f"{_E}, execution/p2p.py", "the accelerator device of every tensor"),
    _i(_DS_ENGINE, "global_rank", "instance", _E, "rank in logs, checkpoints and the length agreement"),
    _i(_DS_ENGINE, "dp_world_size", "instance", f"{_CKPT} checkpoint manifest", "data-parallel size"),
    _i(_DS_ENGINE, "skipped_steps", "instance", "features/freeze.py",
       "the steps DeepSpeed skipped (overflow): freezing counts the optimizer steps taken, and a skipped step is no "
       "gradient-norm check"),
    _i(_DS_ENGINE, "optimizer", "instance", f"{_E} WeightGradPass", "the bf16 optimizer's grad buffers"),
    _i(_DS_ENGINE, "_config", "instance", f"{_E} WeightGradPass", "bf16 immediate_grad_update"),
    _i(_CONFIG, "bfloat16_config", "instance", f"{_E} WeightGradPass", "bf16 immediate_grad_update"),
    _i(_BF16_CONFIG, "immediate_grad_update", "field", f"{_E} WeightGradPass", "when hp grads are updated"),
    _i(_CONFIG, "zero_optimization_stage", "instance", "initialize.py", "ZeRO 2/3 refused with pipelines"),
    _i(_CONFIG, "wall_clock_breakdown", "instance", f"{_E} init", "its timers refused (started twice per backward)"),
    _i(_CONFIG, "flops_profiler_config", "instance", f"{_E} init", "the flops profiler turns the timers on"),
    _i(_CONFIG, "_param_dict", "instance", f"{_E} init", "which key turned the timers on"),
    _i("deepspeed.runtime.config", "get_wall_clock_breakdown", "attr", f"{_E} init", "which key turned the timers on"),
    # -- the config keys nothing would read, refused at build (runtime/execution/ds_config_checks.py) ---------------
    _i(_CONFIG, "pipeline", "instance", "execution/ds_config_checks.py", "the pipeline section with its defaults"),
    *(_i(_MODULE, name, "instance", "execution/ds_config_checks.py", "what the pipeline section's key would set")
      for name in ("num_stages", "seed_layers")),
    *(_i(_CONFIG, name, "instance", "execution/ds_config_checks.py", "float16 autocast refused on several stages")
      for name in ("torch_autocast_enabled", "torch_autocast_dtype")),
    _i(_CONFIG, "activation_checkpointing_config", "instance", "execution/ds_config_checks.py",
       "DeepSpeed's checkpoint options, refused with activation checkpointing"),
    *(_i("deepspeed.runtime.activation_checkpointing.checkpointing", flag, "attr", "execution/ds_config_checks.py",
         "the checkpoint options deepspeed.checkpointing.configure set, refused with activation checkpointing")
      for flag in ("PARTITION_ACTIVATIONS", "CONTIGUOUS_CHECKPOINTING", "CPU_CHECKPOINT", "SYNCHRONIZE",
                   "PROFILE_TIME")),
    # -- gradient clipping (runtime/execution/clip.py) -------------------------------------------------------------
    _i(_DS_ENGINE, "clip_fp32_gradients", "attr", f"{_GRADS} (overridden)",
       "fp32 clipping without ZeRO, by the whole model's norm instead of stage 0's"),
    _i(f"{_DS_ENGINE}._take_model_step", "clip_fp32_gradients", "calls", f"{_GRADS} clip_fp32_gradients",
       "DeepSpeed's optimizer step must clip fp32 gradients through the overridable clip_fp32_gradients"),
    _i(_DS_ENGINE, "_global_grad_norm", "instance", f"{_GRADS} clip_fp32_gradients",
       "the norm get_global_grad_norm() reports"),
    _i(_GRID, "get_model_parallel_group", "attr", "execution/clip.py", "the ranks the norm is summed over"),
    _i(_GRID, "get_slice_parallel_rank", "attr", "execution/clip.py", "tensor rank: who counts a replicated tensor"),
    _i("deepspeed.runtime.utils", "is_model_parallel_parameter", "attr", "execution/clip.py",
       "a tensor-parallel parameter counts on every tensor rank"),
    _i("deepspeed.runtime.constants", "PIPE_REPLICATED", "attr", "execution/clip.py, features/vocab.py",
       "the mark of a parameter copy that norms skip (tied weights off their first rank, a tied head's shards)"),
    _i("deepspeed.runtime.fp16.unfused_optimizer", "FP16_UnfusedOptimizer", "attr", "execution/clip.py",
       "its norm takes the gradients, whose tied copies the engine marks before each step"),
    # -- sharded data parallelism (runtime/features/sharding.py) ---------------------------------------------------
    _i(_ENGINE, "module_state_dict", "attr", f"{_CKPT} (overridden)",
       "a sharded layer's state_dict gives whole tensors while DeepSpeed writes the layer files"),
    _i(_ENGINE, "load_module_state_dict", "attr", f"{_CKPT} (overridden)",
       "a sharded layer's load_state_dict keeps its shard of the whole tensors DeepSpeed reads"),
    _i(f"{_DS_ENGINE}._save_checkpoint", "module_state_dict", "calls", f"{_CKPT} module_state_dict",
       "DeepSpeed's save must write the layers through the overridable module_state_dict"),
    _i(f"{_DS_ENGINE}._load_checkpoint", "load_module_state_dict", "calls", f"{_CKPT} load_module_state_dict",
       "DeepSpeed's load must read the layers through the overridable load_module_state_dict"),
    _i(_MODULE, "tied_comms", "instance", "execution/module.py",
       "the tied weights and their groups, broadcast shard-wise when sharded"),
    # -- sequence parallelism (runtime/slicing/sequence.py): the sequence ranks are the topology's model axis ---------
    _i("deepspeed.runtime.pipe.topology", "PipeModelDataParallelTopology", "attr", "execution/module.py",
       "the pipe x model x data grid whose model axis holds a stage's sequence ranks", ("num_pp", "num_mp", "num_dp")),
    _i(_GRID, "get_slice_parallel_group", "attr", f"{_E}, execution/module.py", "a stage's sequence group"),
    _i(_GRID, "get_slice_parallel_world_size", "attr", _E, "the sequence-parallel degree the module was built with"),
    _i(_GRID, "stage_to_global", "attr", "execution/module.py", "the first sequence rank (model=0) of a stage",
       ("stage_id", )),
    _i(_ENGINE, "_aggregate_total_loss", "attr", f"{_GRADS} (overridden)",
       "the sequence ranks' losses summed before DeepSpeed averages over the replicas"),
    _i(_ENGINE, "_reduce_outputs", "attr", f"{_GRADS} (overridden)",
       "eval_batch's loss, summed over the sequence ranks",
       ("outputs", "reduce", "reduce_dp", "micro_batches")),
    # -- fp16 without ZeRO: the loss scale DeepSpeed's backward leaves out
    # (TokenPipelineEngine._loss_scale_deepspeed_leaves_out)
    _i("deepspeed.runtime.base_optimizer", "ZeROOptimizer", "attr", f"{_E} BackwardPass",
       "the optimizers whose loss DeepSpeed's backward scales itself"),
    _i("deepspeed.runtime.fp16.unfused_optimizer:FP16_UnfusedOptimizer", "loss_scale", "attr", f"{_E} BackwardPass",
       "the scale its step divides the gradients by"),
    _i("deepspeed.runtime.fp16.fused_optimizer:FP16_Optimizer", "loss_scale", "attr", f"{_E} BackwardPass",
       "the scale its step divides the gradients by"),
    # -- a dropped engine is freed: ZeRO's optimizer holds the engine's hook weakly (execution/lifetime.py)
    _i(_DS_ENGINE, "_backward_post_hook", "attr", "execution/lifetime.py",
       "the engine's hook ZeRO's optimizer holds, replaced by one through a weak reference"),
    *(_i("deepspeed.runtime.base_optimizer:ZeROOptimizer", name, "attr", "execution/lifetime.py",
         "the optimizer's hooks run when every gradient is ready, where the engine's is replaced")
      for name in ("_grad_acc_post_hooks", "register_grad_acc_post_hook", "unregister_grad_acc_post_hooks")),
    # -- fp16 at ZeRO 0: the optimizer step taken at construction, undone (execution/optimizer_init.py)
    *(_i(owner, name, "attr", "execution/optimizer_init.py", why)
      for owner in ("deepspeed.runtime.fp16.unfused_optimizer:FP16_UnfusedOptimizer",
                    "deepspeed.runtime.fp16.fused_optimizer:FP16_Optimizer")
      for name, why in (("refresh_fp32_params", "copies the fp16 weights into the masters the step moved"),
                        ("initialize_optimizer_states", "the constructor's zero-gradient step being undone"))),
    # -- fp16: the scale update held back until the step has divided the gradients (execution/loss_scale.py)
    _i(_DS_ENGINE, "_take_model_step", "attr", f"{_GRADS} (overridden)",
       "the optimizer step the scale update is held back around, applied before the monitor logs the scale"),
    _i(f"{_ENGINE}._exec_optimizer_step", "_take_model_step", "calls", f"{_GRADS} _take_model_step",
       "the pipeline's step must run through the overridable _take_model_step"),
    *(_i(owner, "_update_scale", "attr", "execution/loss_scale.py",
         "called by step before it divides the gradients by the scale; held back until after")
      for owner in ("deepspeed.runtime.fp16.unfused_optimizer:FP16_UnfusedOptimizer",
                    "deepspeed.runtime.fp16.fused_optimizer:FP16_Optimizer",
                    "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer")),
    # -- bf16 optimizer, driven around the deferred weight-gradient pass --------------------------------------
    _i(_BF16, "clear_lp_grads", "attr", f"{_E} WeightGradPass", "as DeepSpeed's backward does"),
    _i(_BF16, "update_hp_grads", "attr", f"{_E} WeightGradPass", "moves deferred grads to the fp32 masters",
       ("clear_lp_grads", )),
    # -- bf16 gradients as views of flat buffers (execution/bf16_grads.py): the fp32 move is one add per group --
    _i(_BF16, "fp32_groups_gradients_flat", "instance", "execution/bf16_grads.py",
       "the flat fp32 master gradients the flat bf16 gradients are laid out as and added to"),
    _i(_BF16, "immediate_grad_update", "instance", "execution/bf16_grads.py",
       "gradients moved by hooks instead: update_hp_grads is then a no-op"),
    _i(_BF16, "update_hp_grads", "calls", "execution/bf16_grads.py",
       "replaced on the instance, so the optimizer's backward must call it through self"),
    _i(_BF16, "get_grads_for_norm", "calls", "execution/bf16_grads.py",
       "replaced on the instance (never an empty list), so its step must call it through self"),
    # -- gradients computed by hand (the vocabulary passes), put where each optimizer reads them (grad_sink.py)
    _i(_BF16, "bf16_groups", "instance", "execution/grad_sink.py", "which master gradient belongs to a parameter"),
    _i(_BF16, "fp32_groups_gradients", "instance", "execution/grad_sink.py",
       "the fp32 master gradients the shard gradients are added to"),
    _i(_BF16, "fp32_groups_has_gradients", "instance", "execution/grad_sink.py",
       "the optimizer's norm and step read only the gradients flagged here"),
    _i("deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer", "loss_scale", "attr", "execution/grad_sink.py",
       "the fp16 scale ZeRO's step divides the gradients by"),
    # -- frozen weights held still in DeepSpeed's master copies (features/frozen_state.py) ---------------------------
    _i("deepspeed.utils.tensor_fragment:tensor_fragment", "get_hp_fragment_address", "attr",
       "features/frozen_state.py", "where a parameter's fragment lies in its flat fp32 partition (with the "
       "fragment's param_group_index: the inner optimizer's group that holds it; BF16_Optimizer is recognised by "
       "bf16_groups, listed above)"),
    _i("deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer", "single_partition_of_fp32_groups", "instance",
       "features/frozen_state.py, features/freeze.py", "ZeRO 1/2 is recognised by it"),
    _i("deepspeed.utils.tensor_fragment:tensor_fragment", "get_lp_grad_fragment", "attr", "features/freeze.py",
       "under ZeRO 1 the reduced gradient of a parameter's fragment in this rank's partition (``.grad`` is cleared), "
       "with the parameter's ``_index_in_param_group``, ``_dp_group`` and the fragment's ``lp_fragment_address``: "
       "the auto freeze policy's gradient norms"),
    _i("deepspeed.runtime.fp16.unfused_optimizer:FP16_UnfusedOptimizer", "fp32_groups", "instance",
       "features/frozen_state.py", "its per-parameter fp32 copies, parallel to fp16_groups"),
    _i("deepspeed.runtime.fp16.unfused_optimizer:FP16_UnfusedOptimizer", "fp16_groups", "instance",
       "features/frozen_state.py, execution/clip.py", "the parameters the fp32 copies belong to, whose gradients "
       "its norm takes"),
    # -- PipelineModule and the grid ----------------------------------------------------------------------------
    _i(_MODULE, "_local_start", "instance", "planning/slice_check.py, execution/checkpoint.py",
       "global index of the stage's first layer"),
    _i(_MODULE, "forward_funcs", "instance", "planning/slice_check.py, execution/checkpoint.py", "the stage's layers"),
    _i(_MODULE, "activation_checkpoint_interval", "instance", _E, "checked against slicing"),
    _i(_MODULE, "loss_fn", "instance", _E, "weighted per slice"),
    _i(_MODULE, "ckpt_layer_path_list", "attr", "execution/checkpoint.py", "a layer's checkpoint files",
       ("ckpt_dir", "local_layer_idx")),
    _i(_MODULE, "_partition_layers", "attr", "execution/module.py", "cuts the layers into chunks", ("method", )),
    _i(_MODULE, "_build", "attr", "execution/module.py", "builds one chunk's layers"),
    _i(_MODULE, "_set_bounds", "attr", "execution/module.py", "a chunk's layer range", ("start", "stop")),
    _i(_MODULE, "parts", "instance", "execution/module.py", "chunk boundaries"),
    _i(_MODULE, "_layer_specs", "instance", "features/freeze.py", "every layer's spec: counts, tied keys"),
    _i(_MODULE, "_recursive_getattr", "attr", "features/freeze.py", "a tied weight by its tied_weight_attr",
       ("module", "attr_name")),
    _i(_MODULE, "_local_stop", "instance", "execution/module.py", "end of the active chunk's layer range"),
    _i(_MODULE, "_num_layers", "instance", "execution/module.py", "refuses fewer layers than chunks"),
    _i(_MODULE, "_layer_specs", "instance", "features/partition.py", "the layer kinds partition_method=\"terapipe\" "
       "times"),
    _i(_MODULE, "compile", "attr", "execution/module.py", "per chunk"),
    _i(_MODULE, "stage_owner", "attr", "execution/module.py", "rank of a tied layer", ("layer_idx", )),
    _i(_MODULE, "_precompute_checkpointable_values", "attr", "execution/module.py", "per chunk"),
    _i(_MODULE, "is_checkpointable_results", "instance", "execution/module.py", "per chunk"),
    _i(_MODULE, "save_state_dict", "attr", "execution/module.py", "per chunk, global layer indices"),
    _i(_MODULE, "load_state_dir", "attr", "execution/module.py", "per chunk, global layer indices"),
    _i(_MODULE, "mpu", "attr", "initialize.py", "the pipeline's topology as DeepSpeed's mpu"),
    _i(_MODULE, "_layer_specs", "instance", "features/vocab.py", "the stages holding the tied output weight"),
    _i(_MODULE, "_grid", "instance", "features/vocab.py", "pipeline group and ranks for the shards' broadcast"),
    _i(_MODULE, "tied_modules", "instance", "features/vocab.py", "the tied embedding the head's shards share"),
    _i(_GRID, "get_pipe_parallel_group", "attr", "features/vocab.py", "the vocabulary passes' collectives"),
    _i(_GRID, "stage_to_global", "attr", _E, "global rank of a stage", ("stage_id", )),
    _i(_GRID, "data_parallel_id", "instance", f"{_E}, planning/profile.py", "this rank's replica"),
    _i(_GRID, "data_parallel_size", "instance", f"{_PLAN}, {_GRADS}", "replicas"),
    # -- schedule instructions ----------------------------------------------------------------------------------
    _i(f"{_SCHED}:PipeSchedule", "__init__", "attr", "execution/schedule.py", "TokenPipeSchedule's base",
       ("micro_batches", "stages", "stage_id")),
    _i(f"{_SCHED}:PipeInstruction", "kwargs", "instance", _E, "handler arguments (buffer_id, microbatch, ...)",
       at_init=False),
    *(_i(_SCHED, name, "attr", "runtime/execution/schedule.py, " + _E, "an instruction the token schedule yields")
      for name in ("LoadMicroBatch", "ForwardPass", "BackwardPass", "SendActivation", "RecvActivation", "SendGrad",
                   "RecvGrad", "CommitP2P", "ReduceTiedGrads", "ReduceGrads", "OptimizerStep")),
    # -- the pipeline branch of deepspeed.initialize, repeated by ds_terapipe.initialize --------------------------
    *(_i("deepspeed:initialize", name, "calls", "initialize.py",
         "a step of DeepSpeed's pipeline branch that ds_terapipe.initialize repeats")
      for name in ("shutdown_init_context", "init_distributed", "set_optimizer_flags", "restore_init_context",
                   "_configure_python_gc")),
    _i("deepspeed", "initialize", "attr", "initialize.py", "the non-terapipe path passes every argument",
       ("mesh_param", "config_params")),
    _i("deepspeed.comm", "init_distributed", "attr", "initialize.py", "process group set-up",
       ("dist_backend", "distributed_port", "dist_init_required")),
    _i("deepspeed.comm", "broadcast", "attr", _GRADS, "the loss aggregation's broadcast, issued async with a deadline",
       ("tensor", "src", "group", "async_op")),
    _i("deepspeed.comm", "all_reduce", "attr", _GRADS, "the loss aggregation's mean, issued async with a deadline",
       ("tensor", "op", "group", "async_op")),
    _i("deepspeed", "set_optimizer_flags", "attr", "initialize.py", "config flags from the optimizer"),
    _i("deepspeed.runtime.zero.partition_parameters", "shutdown_init_context", "attr", "initialize.py",
       "as deepspeed.initialize"),
    _i("deepspeed.runtime.zero.partition_parameters", "restore_init_context", "attr", "initialize.py",
       "as deepspeed.initialize"),
    _i("deepspeed.runtime.tensor_parallel.init_utils", "load_ds_config", "attr", "initialize.py",
       "reads a config path"),
    _i("deepspeed.constants", "TORCH_DISTRIBUTED_DEFAULT_PORT", "attr", "initialize.py", "default port"),
    _i("deepspeed.runtime.config_utils", "DeepSpeedConfigModel", "attr", "config.py", "base of the terapipe config"),
    # -- accelerator ---------------------------------------------------------------------------------------------
    *(_i("deepspeed.accelerator.abstract_accelerator:DeepSpeedAccelerator", name, "attr",
         "runtime/slicing/devices.py, initialize.py", "device placement and timing")
      for name in ("synchronize", "communication_backend_name")),
)


class DeepSpeedInternalsError(RuntimeError):
    """The installed DeepSpeed lacks something ds_terapipe relies on."""


def _resolve(owner: str) -> Any:
    module_name, _, qualname = owner.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in filter(None, qualname.split(".")):
        obj = getattr(obj, part)
    return obj


@functools.lru_cache(maxsize=None)
def _class_source(cls: type) -> str:
    """Source of the modules defining ``cls`` and its DeepSpeed bases (where instance attributes are assigned;
    whole files: ``inspect.getsource`` of a class parses its module, seconds for DeepSpeed's engine)."""
    parts = []
    for klass in cls.__mro__:
        if klass.__module__.startswith("deepspeed"):
            path = inspect.getsourcefile(klass)
            if path:
                with open(path, encoding="utf-8") as f:
                    parts.append(f.read())
    return "\n".join(parts)


@functools.lru_cache(maxsize=None)
def _source(obj: Any) -> str:
    return inspect.getsource(obj)


def _problem(item: Internal, live: dict[str, Any], deep: bool) -> Optional[str]:
    try:
        owner = _resolve(item.owner)
    except (ImportError, AttributeError) as err:
        return f"{item.owner} is gone ({err})"
    if item.kind == "attr":
        if not hasattr(owner, item.name):
            return "not found"
        if item.params:
            try:
                params = inspect.signature(getattr(owner, item.name)).parameters
            except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
                return None
            absent = [p for p in item.params if p not in params]
            if absent and not any(p.kind == p.VAR_KEYWORD for p in params.values()):
                return f"its signature {tuple(params)} lacks {absent}"
        return None
    if item.kind == "field":
        return None if item.name in getattr(owner, "model_fields", {}) else "no such config field"
    if item.kind == "instance":
        obj = live.get(item.owner)
        if obj is not None and item.at_init and not hasattr(obj, item.name):
            return "not set on the live object"
        if deep and not re.search(rf"self\.{re.escape(item.name)}\s*(:[^=\n]+)?=[^=]", _class_source(owner)):
            return "no longer assigned in DeepSpeed's source"
        return None
    if item.kind == "calls":
        if deep and not re.search(rf"\b{re.escape(item.name)}\b", inspect.getsource(owner)):
            return f"{item.owner.split(':')[-1]} no longer calls it"
        return None
    raise AssertionError(f"unknown kind {item.kind!r} in INTERNALS")


def missing_internals(engine: Any = None, *, deep: bool = False) -> list[str]:
    """One line per internal the installed DeepSpeed lacks (empty: all there).

    ``engine``: a live TokenPipelineEngine whose instance attributes are checked too. ``deep``: also scan
    DeepSpeed's source (assignments, calls): the test does, engine init does not.
    """
    live: dict[str, Any] = {}
    if engine is not None:
        live = {_ENGINE: engine, _DS_ENGINE: engine, _MODULE: getattr(engine, "module", None),
                _GRID: getattr(engine, "grid", None), _CONFIG: getattr(engine, "_config", None)}
    lines = []
    for item in INTERNALS:
        problem = _problem(item, live, deep)
        if problem:
            lines.append(f"{item.label()} ({item.kind}; used in {item.used_in}: {item.why}): {problem}")
    return lines


def check_deepspeed_internals(engine: Any = None, *, deep: bool = False) -> None:
    """Raise :class:`DeepSpeedInternalsError` naming every internal the installed DeepSpeed lacks."""
    import deepspeed

    if engine is not None and deepspeed.__version__ not in SpecifierSet(TESTED_DEEPSPEED, prereleases=True):
        logger.warning("ds_terapipe: DeepSpeed %s is outside the tested range deepspeed%s; the internals it relies "
                       "on are checked, not its behaviour", deepspeed.__version__, TESTED_DEEPSPEED)
    lines = missing_internals(engine, deep=deep)
    if not lines:
        return

    raise DeepSpeedInternalsError(
        f"ds_terapipe relies on DeepSpeed internals that DeepSpeed {deepspeed.__version__} does not have:\n  - "
        + "\n  - ".join(lines) + f"\nds_terapipe is tested with deepspeed{TESTED_DEEPSPEED}: install a version in "
        f"that range (pip install 'deepspeed{TESTED_DEEPSPEED}'), or update runtime/execution/ds_internals.py "
        "and the code that uses these names")
