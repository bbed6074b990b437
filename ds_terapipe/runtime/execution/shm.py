"""DeepSpeed's shared-memory all-reduce on CPU: not built where ds_terapipe starts the process group, and the
segments it leaves removed where it was built.

On CPU, DeepSpeed (0.19.8) builds a shared-memory all-reduce op whenever its communication backend starts: a C++
build of 60-80 s on 2 cores the first time on a machine (it needs ``g++``), then ~0.15 s per process to load, and a
~66 MB ``/dev/shm/deepspeed_allreduce_buffer_*`` segment per process, named after the master address, the master
port and the local rank, that it never unlinks. Only ``deepspeed.comm.inference_all_reduce`` (DeepSpeed
inference's tensor parallelism) calls the op; training's collectives are the process group's. So
:func:`skip_shm_allreduce_op` marks the op as not buildable before the backend starts
(``ds_terapipe.init_distributed`` and ``ds_terapipe.initialize`` do), and ``inference_all_reduce`` takes the process
group's all-reduce, as DeepSpeed does on a machine without the op. A process group started by
``deepspeed.init_distributed`` still builds it, and every launch leaks world size x 66 MB of RAM-backed tmpfs until
the OOM killer ends a later run: whoever knows such a run's master port calls :func:`remove_shm_segments`.
"""

from __future__ import annotations

import glob
import logging
import os

__all__ = ["remove_shm_segments", "skip_shm_allreduce_op"]

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_PREFIX = "deepspeed_allreduce_buffer"


def remove_shm_segments(master_port: int | str, local_rank: int | None = None) -> list[str]:
    """Unlink the segments of the run on ``master_port`` (one local rank's, or all); return what was removed.

    Unlinking while a process still maps a segment is safe: the memory goes once the last mapping closes.
    """
    rank = "*" if local_rank is None else str(local_rank)
    removed = []
    for path in glob.glob(os.path.join(SHM_DIR, f"{_PREFIX}_*_{master_port}_{rank}")):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    if removed:
        logger.debug("removed %d DeepSpeed shm segment(s) of port %s", len(removed), master_port)
    return removed


def skip_shm_allreduce_op() -> bool:
    """Keep DeepSpeed from building its shared-memory all-reduce op when its communication backend starts next;
    True when the op is marked so. Call it before the backend starts (after, the op is built and this changes
    nothing). A no-op (False) where the accelerator has no such op (CUDA) or DeepSpeed keeps no table of buildable
    ops with it: the op is then built as DeepSpeed decides (tests/test_device_collectives.py checks this
    DeepSpeed)."""
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().get_op_builder("ShareMemCommBuilder")
    if builder is None:
        return False
    import deepspeed.ops

    # the table DeepSpeed's backend reads before it builds the op (deepspeed.comm.torch.build_shm_op); DeepSpeed
    # fills it on first access and keeps that one dict, so the mark stays for the process
    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if not isinstance(compatible, dict) or builder.NAME not in compatible:
        logger.debug("DeepSpeed keeps no compatible-ops table with %s: its shm all-reduce is built as it decides",
                     getattr(builder, "NAME", builder))
        return False
    compatible[builder.NAME] = False
    return True
