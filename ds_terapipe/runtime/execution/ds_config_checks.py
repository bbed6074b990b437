"""DeepSpeed config keys the token pipeline would not honour, refused when its engine is built.

A user keeps the rest of a DeepSpeed config when turning ``terapipe`` on. Most keys work as in DeepSpeed's own
``PipelineEngine`` (docs/training.md, "The rest of the DeepSpeed config"). With the ones here the job would run as
if they were not there, or fail at its first step on one stage, so :func:`unhonoured_config_problem` refuses them
(rule, value, fix) on every rank (the same config everywhere), before DeepSpeed builds anything:

* ``sequence_parallel_size`` > 1: DeepSpeed's Ulysses degree, which it takes from an ``mpu``; a pipeline engine
  takes none (its module's grid is the mpu), so DeepSpeed's own pipeline ignores the key too. Sequence
  parallelism inside the token pipeline is ``terapipe.sequence_parallel``.
* ``pipeline.stages`` and ``pipeline.seed_layers`` other than the module's, ``pipeline.partition`` other than
  DeepSpeed's default: DeepSpeed's pipeline engine reads none of them (the module is cut and seeded when it is
  built, by its own arguments); and a key of the ``pipeline`` section that DeepSpeed's pipeline engine does not
  know.
* ``torch_autocast`` with ``dtype: float16`` on more than one stage: DeepSpeed's GradScaler for it scales the loss
  on the last stage only, so every other stage's optimizer step raises at the first step (``AssertionError:
  Attempted step but _scale is None``, on that stage alone, in DeepSpeed's own pipeline too).
* with activation checkpointing on (an ``activation_checkpoint_interval`` > 0): DeepSpeed's checkpoint options
  (``partition_activations``, ``contiguous_memory_optimization``, ``cpu_checkpointing``,
  ``synchronize_checkpoint_boundary``, ``profile``), in the config's ``activation_checkpointing`` section or set
  by ``deepspeed.checkpointing.configure``. DeepSpeed's checkpoint functions apply them; the token pipeline
  recomputes each slice through torch's non-reentrant checkpoint instead (``runtime/features/recompute.py``),
  which keeps every segment's inputs on the device, whole.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["unhonoured_config_problem", "PIPELINE_KEYS"]

#: the ``pipeline`` section's keys DeepSpeed 0.19.8 knows: ``get_pipeline_config``'s defaults, and ``use_reentrant``,
#: which ``PipelineEngine`` reads
PIPELINE_KEYS = ("activation_checkpoint_interval", "grad_partitioned", "partition", "pipe_partitioned", "seed_layers",
                 "stages", "use_reentrant")

#: DeepSpeed's checkpoint options: the config section's field and the global ``deepspeed.checkpointing.configure``
#: sets from it (runtime/activation_checkpointing/checkpointing.py)
CHECKPOINT_OPTIONS = (("partition_activations", "PARTITION_ACTIVATIONS"),
                      ("contiguous_memory_optimization", "CONTIGUOUS_CHECKPOINTING"),
                      ("cpu_checkpointing", "CPU_CHECKPOINT"), ("synchronize_checkpoint_boundary", "SYNCHRONIZE"),
                      ("profile", "PROFILE_TIME"))


def unhonoured_config_problem(ds_config: dict, config: Any, module: Any) -> Optional[str]:
    """Why the DeepSpeed config holds a key the token pipeline would not honour (rule, value, fix), or None.

    ``ds_config``: the config as the user wrote it; ``config``: DeepSpeed's parsed ``DeepSpeedConfig`` of it;
    ``module``: the ``PipelineModule`` (its ``num_stages``, ``seed_layers`` and activation checkpoint interval,
    which the config's ``pipeline.activation_checkpoint_interval`` overrides when > 0, as in DeepSpeed)."""
    degree = ds_config.get("sequence_parallel_size", 1)
    if degree not in (None, 1):
        return (f"terapipe: sequence_parallel_size={degree!r} is DeepSpeed's Ulysses degree, which a pipeline engine "
                "does not read (it comes with an mpu, and a pipeline takes none): the job would run without "
                f"sequence parallelism; set terapipe.sequence_parallel={degree!r} for sequence parallelism inside the "
                "token pipeline (ds_terapipe.module_chunk_kwargs(terapipe) builds the module for it), and drop "
                "sequence_parallel_size")
    section = ds_config.get("pipeline") or {}
    unknown = sorted(str(key) for key in section if key not in PIPELINE_KEYS)
    if unknown:
        return (f"terapipe: pipeline: unknown key(s) {unknown}, which DeepSpeed's pipeline engine would ignore; "
                f"valid keys are {list(PIPELINE_KEYS)}")
    built = {"stages": ("auto", module.num_stages), "seed_layers": (module.seed_layers, ), "partition": ("best", )}
    fixes = {"stages": f"num_stages={section.get('stages')!r} (or a topology of as many stages)",
             "seed_layers": f"seed_layers={section.get('seed_layers')!r}", "partition": "partition_method='...'"}
    for key, values in built.items():
        if key in section and section[key] not in values:
            return (f"terapipe: pipeline.{key}={section[key]!r} is read by no pipeline engine (DeepSpeed's neither): "
                    f"the PipelineModule is cut and seeded when it is built, by its own arguments; pass "
                    f"{fixes[key]} to ds_terapipe.TokenPipelineModule, and drop pipeline.{key}")
    if config.torch_autocast_enabled and config.torch_autocast_dtype == torch.float16 and module.num_stages > 1:
        return ("terapipe: torch_autocast.dtype=float16 fails at the first step on more than one pipeline stage: "
                "DeepSpeed's GradScaler for it scales the loss on the last stage only, and every other stage's "
                "optimizer step raises (AssertionError 'Attempted step but _scale is None', in DeepSpeed's own "
                "PipelineEngine too); set torch_autocast.dtype to bfloat16, or train in fp16 with fp16.enabled "
                "instead of torch_autocast")
    checkpoint_interval = config.pipeline["activation_checkpoint_interval"] or module.activation_checkpoint_interval
    if checkpoint_interval > 0:
        from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

        section_config = config.activation_checkpointing_config
        on = [key for key, flag in CHECKPOINT_OPTIONS
              if getattr(section_config, key, False) or getattr(ds_checkpointing, flag, False)]
        if on:
            return (f"terapipe: activation_checkpointing {', '.join(f'{key}=true' for key in on)} is not honoured by "
                    f"the token pipeline (activation_checkpoint_interval={checkpoint_interval}): it recomputes each "
                    "slice through torch's non-reentrant checkpoint, which keeps every segment's inputs on the "
                    "device, whole, where DeepSpeed's checkpoint functions apply these options; set them to false "
                    "(in the config's activation_checkpointing section and in deepspeed.checkpointing.configure), "
                    "or turn activation checkpointing off")
    return None
