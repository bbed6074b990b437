"""The mechanics of one token slice, shared by every schedule and feature.

``context`` (the slice a layer is running: offsets, KV carry, micro-batch state), ``attention`` (sliced causal
attention over the carried keys and values, on the fast SDPA paths), ``blocks`` (that attention as fused causal and
full blocks instead of a dense mask: merged by log-sum-exp on a CPU, per document for packed rows on any device),
``documents`` (packed rows: attention within each document, positions restarting per document), ``sequence``
(sequence parallelism inside a stage: the all-to-alls that give attention the whole slice for a share of the heads),
``deferred`` (weight gradients computed later, one GEMM per Linear over all slices), ``devices``
(accelerator-synchronised timing and device helpers).
"""
