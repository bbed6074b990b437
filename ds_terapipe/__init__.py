"""ds_terapipe: token-level pipeline parallelism (TeraPipe) for DeepSpeed.

    engine, _, _, _ = ds_terapipe.initialize(model=TokenPipelineModule(layers, num_stages=2, ...),
                                             config="ds_config.json")   # with a "terapipe" section
    loss = engine.train_batch(data_iter)

The planner (``ds_terapipe.planner``) is importable without torch.distributed or DeepSpeed; the names below
pull in DeepSpeed lazily, so ``import ds_terapipe`` stays cheap for the CLI.
"""

from __future__ import annotations

import importlib
import logging

__version__ = "0.1.0"

_LAZY = {
    "initialize": ".initialize",
    "TeraPipeConfig": ".config",
    "parse_terapipe_config": ".config",
    "FreezeConfig": ".config",
    "AutoFreezeConfig": ".config",
    "Freezer": ".runtime.freeze",
    "TokenPipelineEngine": ".runtime.engine",
    "TokenPipelineModule": ".runtime.module",
    "module_chunk_kwargs": ".runtime.module",
    "partition_kwargs": ".runtime.partition",
    "PartitionSettings": ".runtime.partition",
    "TokenPipeSchedule": ".runtime.schedule",
    "CausalSelfAttention": ".runtime.attention",
    "sliced_causal_attention": ".runtime.attention",
    "current_slice": ".runtime.context",
    "token_offset": ".runtime.context",
    "SliceContext": ".runtime.context",
    "P2PTimeoutError": ".runtime.p2p",
    "PeerFailedError": ".runtime.p2p",
    "SlicingMismatchError": ".runtime.slice_check",
    "CheckpointError": ".runtime.checkpoint",
    "export_state_dict": ".runtime.checkpoint",
    "configure_logging": ".log",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ds_terapipe' has no attribute {name!r}")


# A library configures no logging: the application (the CLI, a training script) decides what is shown. The
# NullHandler only keeps Python from printing this package's warnings through its last-resort handler when the
# application configured nothing.
logging.getLogger(__name__).addHandler(logging.NullHandler())
