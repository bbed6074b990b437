"""Remove the shared-memory segments DeepSpeed's CPU allreduce leaves behind.

On CPU, DeepSpeed (0.19.8) gives every process a ~66 MB ``/dev/shm/deepspeed_allreduce_buffer_*`` segment,
named after the master address, the master port and the local rank, and never unlinks it. Every launch leaks
world-size x 66 MB of RAM-backed tmpfs; a day of test runs filled 23 GB and the OOM killer ended the next one.
Whoever knows a finished (or finishing) run's master port calls :func:`remove_shm_segments`.
"""

from __future__ import annotations

import glob
import logging
import os

__all__ = ["remove_shm_segments"]

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
