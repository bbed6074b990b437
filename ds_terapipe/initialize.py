"""``ds_terapipe.initialize``: ``deepspeed.initialize`` that builds a TokenPipelineEngine when asked to.

Same arguments, same return value. With ``"terapipe": {"enabled": true}`` in the DeepSpeed config and a
``PipelineModule`` it builds :class:`~ds_terapipe.runtime.execution.engine.TokenPipelineEngine` the way
``deepspeed.initialize`` builds its ``PipelineEngine`` (same steps, in the same order); in every other case it
calls ``deepspeed.initialize`` with the arguments untouched. ``ds_terapipe.init_distributed``:
``deepspeed.init_distributed`` without the shared-memory all-reduce DeepSpeed builds on CPU for inference only.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import deepspeed
from deepspeed.accelerator import get_accelerator
from deepspeed.constants import TORCH_DISTRIBUTED_DEFAULT_PORT
from deepspeed.pipe import PipelineModule
from deepspeed.runtime import zero
from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

from .config import parse_terapipe_config
from .runtime.execution.shm import skip_shm_allreduce_op

__all__ = ["initialize", "init_distributed", "build_engine"]

logger = logging.getLogger(__name__)


def init_distributed(dist_backend: Optional[str] = None, **kwargs: Any) -> None:
    """``deepspeed.init_distributed`` (same arguments), without the shared-memory all-reduce op DeepSpeed builds on
    CPU for its inference all-reduce only: no 60-80 s C++ build on a machine's first run, no ``g++`` needed, no
    ~66 MB ``/dev/shm`` segment per process left behind (:mod:`ds_terapipe.runtime.execution.shm`). Training's
    collectives are the same either way. Call it where you would call ``deepspeed.init_distributed``; on a GPU it
    is ``deepspeed.init_distributed``."""
    skip_shm_allreduce_op()
    deepspeed.comm.init_distributed(dist_backend=dist_backend, **kwargs)


def _resolve_config(args: Any, config: Any, config_params: Any) -> Optional[dict]:
    """The config dict ``deepspeed.initialize`` would use (args.deepspeed_config, config or config_params)."""
    if config is None and config_params is not None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None)
    if from_args is not None:
        if config is not None:
            raise ValueError("ds_terapipe.initialize: got both args.deepspeed_config and config=; pass only one")
        config = from_args
    if config is None:
        return None
    return config if isinstance(config, dict) else load_ds_config(config)


def initialize(args: Any = None,
               model: Any = None,
               optimizer: Any = None,
               model_parameters: Any = None,
               training_data: Any = None,
               lr_scheduler: Any = None,
               distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT,
               mpu: Any = None,
               dist_init_required: Optional[bool] = None,
               collate_fn: Any = None,
               config: Any = None,
               mesh_param: Any = None,
               config_params: Any = None):
    """Drop-in for ``deepspeed.initialize``; returns ``(engine, optimizer, training_dataloader, lr_scheduler)``."""
    ds_config = _resolve_config(args, config, config_params)
    terapipe = parse_terapipe_config(ds_config) if ds_config is not None else None
    if terapipe is None or not terapipe.enabled:
        return deepspeed.initialize(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                                    training_data=training_data, lr_scheduler=lr_scheduler,
                                    distributed_port=distributed_port, mpu=mpu,
                                    dist_init_required=dist_init_required, collate_fn=collate_fn, config=config,
                                    mesh_param=mesh_param, config_params=config_params)
    if not isinstance(model, PipelineModule):
        raise TypeError(f"terapipe.enabled needs a deepspeed.pipe.PipelineModule (e.g. ds_terapipe.TokenPipelineModule)"
                        f", got {type(model).__name__}; build the model from LayerSpecs or disable terapipe")
    if mpu is not None:
        raise ValueError("ds_terapipe.initialize: mpu must be None with pipeline parallelism (the PipelineModule "
                         "provides its own topology)")

    deepspeed.utils.log_dist(f"ds_terapipe: DeepSpeed {deepspeed.__version__}, token pipeline enabled", ranks=[0])
    zero.partition_parameters.shutdown_init_context()
    init_distributed(dist_backend=get_accelerator().communication_backend_name(), distributed_port=distributed_port,
                     dist_init_required=dist_init_required)
    engine = build_engine(model, ds_config, terapipe, args=args, optimizer=optimizer,
                          model_parameters=model_parameters, training_data=training_data, lr_scheduler=lr_scheduler,
                          dist_init_required=dist_init_required, collate_fn=collate_fn)
    zero.partition_parameters.restore_init_context()
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def build_engine(model: PipelineModule, ds_config: dict, terapipe: Any, **kwargs: Any) -> Any:
    """A :class:`~ds_terapipe.runtime.execution.engine.TokenPipelineEngine` built the way ``deepspeed.initialize``
    builds its
    ``PipelineEngine`` (process group up; collective): ``TokenPipelineEngine.build``."""
    from .runtime.execution.engine import TokenPipelineEngine

    return TokenPipelineEngine.build(model, ds_config, terapipe, **kwargs)
