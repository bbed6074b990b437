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
    "init_distributed": ".initialize",
    "TeraPipeConfig": ".config",
    "parse_terapipe_config": ".config",
    "FreezeConfig": ".config",
    "AutoFreezeConfig": ".config",
    "Freezer": ".runtime.features.freeze",
    "TokenPipelineEngine": ".runtime.execution.engine",
    "TokenPipelineModule": ".runtime.execution.module",
    "module_chunk_kwargs": ".runtime.execution.module",
    "partition_kwargs": ".runtime.features.partition",
    "PartitionSettings": ".runtime.features.partition",
    "TokenPipeSchedule": ".runtime.execution.schedule",
    "CausalSelfAttention": ".runtime.slicing.attention",
    "sliced_causal_attention": ".runtime.slicing.attention",
    "current_slice": ".runtime.slicing.context",
    "token_offset": ".runtime.slicing.context",
    "slice_positions": ".runtime.slicing.documents",
    "packed_documents": ".runtime.slicing.documents",
    "packed_rows": ".runtime.slicing.documents",
    "SliceContext": ".runtime.slicing.context",
    "P2PTimeoutError": ".runtime.execution.p2p",
    "PeerFailedError": ".runtime.execution.p2p",
    "SlicingMismatchError": ".runtime.planning.slice_check",
    "CheckpointError": ".runtime.execution.checkpoint",
    "export_state_dict": ".runtime.execution.checkpoint",
    "configure_logging": ".log",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name], __name__)
        globals()[name] = getattr(module, name)
        # importing a submodule binds it on the package under its own name; where that is also an export's name
        # (ds_terapipe.initialize: the function, in ds_terapipe/initialize.py), the export keeps it
        leaf = _LAZY[name][1:]
        if _LAZY.get(leaf) == _LAZY[name]:
            globals()[leaf] = getattr(module, leaf)
        return globals()[name]
    raise AttributeError(f"module 'ds_terapipe' has no attribute {name!r}")


# A library configures no logging: the application (the CLI, a training script) decides what is shown. The
# NullHandler only keeps Python from printing this package's warnings through its last-resort handler when the
# application configured nothing.
logging.getLogger(__name__).addHandler(logging.NullHandler())
