"""Errors the runtime's parts raise to users, in a module that imports nothing of the runtime.

Why apart: the checkpoint code (runtime/execution/checkpoint.py) reads the vocabulary shards' files
(runtime/features/vocab.py), and
those raise the checkpoint error too; defined here, neither module needs the other for it.
"""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint that is incomplete, corrupt, or written for another model."""
