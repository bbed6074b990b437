"""File writes shared by checkpoints, plan caches and traces (standard library only: the CLI imports it)."""

from __future__ import annotations

import os

__all__ = ["atomic_write_text"]


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write via a temporary file and a rename: readers see the old file or the whole new one, never half.

    The temporary name contains ``.tmp`` (checkpoint manifests skip such files) and the writer's pid (two
    processes writing the same path never share one).
    """
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
