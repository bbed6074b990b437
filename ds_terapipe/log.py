"""Opt-in logging setup for applications that use ds_terapipe (trainers, benchmarks, the CLI).

The library itself only adds a ``NullHandler`` (``ds_terapipe/__init__.py``): what is shown, where and how is the
application's choice. This module is what an application calls when it wants ds_terapipe's lines (the plan,
profiling, faults) shown the way DeepSpeed shows its own, so every script in this repository configures logging
the same way instead of each carrying its own handler code::

    import ds_terapipe
    ds_terapipe.configure_logging()          # INFO, or DS_TERAPIPE_LOG_LEVEL
"""
from __future__ import annotations

import logging
import os

__all__ = ["LOG_FORMAT", "LOG_LEVEL_ENV", "configure_logging", "env_log_level"]

LOG_FORMAT = "[%(asctime)s] [%(levelname)s] [%(name)s] %(message)s"
LOG_LEVEL_ENV = "DS_TERAPIPE_LOG_LEVEL"


def env_log_level(default: str = "INFO") -> int:
    """The level named by ``DS_TERAPIPE_LOG_LEVEL`` (e.g. ``DEBUG``), else ``default``.

    Raises:
        ValueError: the variable names no logging level (a typo must not silently hide or flood the log).
    """
    name = (os.environ.get(LOG_LEVEL_ENV) or default).strip().upper()
    level = logging.getLevelName(name)
    if not isinstance(level, int):
        raise ValueError(f"{LOG_LEVEL_ENV}={name!r} is not a logging level; use DEBUG, INFO, WARNING or ERROR, "
                         "or unset it")
    return level


def configure_logging(level: int | str | None = None) -> logging.Logger:
    """Show ds_terapipe's log lines on stderr as ``[time] [LEVEL] [name] message``; return its logger.

    ``level``: a logging level or its name; default ``DS_TERAPIPE_LOG_LEVEL``, else INFO. Idempotent: the
    handler is added once, so calling it again (e.g. in every worker of a launch) only changes the level. The
    package logger stops propagating, so a root handler configured elsewhere does not print each line twice.
    """
    lib = logging.getLogger("ds_terapipe")
    lib.setLevel(env_log_level() if level is None else level)
    if not any(not isinstance(h, logging.NullHandler) for h in lib.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        lib.addHandler(handler)
        lib.propagate = False
    return lib
