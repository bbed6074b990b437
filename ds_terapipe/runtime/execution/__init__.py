"""Execution: the engine and what it drives directly.

``engine`` (TokenPipelineEngine, DeepSpeed's PipelineEngine running token slices) and its mixins ``plan_selection``
(which plan and schedule a step runs), ``batch_loading`` (micro-batches loaded and checked), ``grad_reduction``
(gradients and loss after the schedule, to the optimizer step) and ``engine_checkpoint`` (save and load around
DeepSpeed's), ``schedule`` (a lowered schedule as DeepSpeed instructions; DISPATCH, the one table from action kind
to instruction and handler), ``p2p`` (sends, receives and deadlines between ranks), ``module`` (TokenPipelineModule:
layers cut into chunks), ``checkpoint`` and ``errors``, ``collective`` (verdicts every rank takes together),
``stage`` (PipelineStage, the interface the other rooms take instead of the engine), ``grad_sink`` (hand-computed
gradients into DeepSpeed's optimizers), ``clip``, ``bf16_grads`` (bf16 gradients in one flat buffer per group),
``loss_scale`` (fp16: the scale moved after the step), ``optimizer_init`` (fp16 at ZeRO 0: the construction's
optimizer step undone), ``batch_checks`` (token ids outside the vocabulary), ``ds_internals`` (the DeepSpeed
internals relied on, checked at init), ``ds_config_checks`` (DeepSpeed config keys the token pipeline would not
honour, refused at build), ``shm`` and ``local_launch`` (process hygiene, in-process launches).
"""
