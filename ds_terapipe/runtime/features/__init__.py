"""Features a config section switches on, each built on the execution room's interface.

``vocab``, ``vocab_shard``, ``vocab_embedding``, ``vocab_cost`` (vocabulary parallelism: the output layer and a
tied input embedding split by rows over the pipeline), ``freeze``, ``frozen_state``, ``repack`` (progressive
freezing, holding DeepSpeed's master copies of frozen weights still, repacking the stages that still train),
``partition`` (cost-based partitioning of layers into chunks), ``recompute`` (activation checkpointing that
respects slices).
"""
