"""Everything that runs inside DeepSpeed, in four rooms by concept.

* :mod:`~ds_terapipe.runtime.execution`: the engine and what it drives directly: the instruction stream
  (one dispatch table), p2p between ranks, the module split into chunks, checkpoints, collective verdicts, the
  narrow interface helpers take (``stage.PipelineStage``), and the DeepSpeed internals relied on.
* :mod:`~ds_terapipe.runtime.planning`: deciding the slicing at run time: the plan and its cache, profiling,
  re-planning from measured steps, the slice check.
* :mod:`~ds_terapipe.runtime.features`: what a config switches on: vocabulary parallelism, progressive freezing
  and repacking, cost-based partitioning, sliced activation checkpointing.
* :mod:`~ds_terapipe.runtime.slicing`: the mechanics of one slice: its context, sliced causal attention with
  the KV carry, deferred weight gradients, device timing.

The pure parts (schedules, their lowering, cost models, the solver) are in :mod:`ds_terapipe.planner`, which
imports nothing from here.
"""
