"""ds_terapipe.log: the opt-in setup every script here uses; the library itself only adds a NullHandler."""
from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from ds_terapipe.log import LOG_FORMAT, configure_logging, env_log_level


@pytest.fixture
def lib_logger():
    lib = logging.getLogger("ds_terapipe")
    saved = (list(lib.handlers), lib.level, lib.propagate)
    yield lib
    lib.handlers[:], lib.level, lib.propagate = saved[0], saved[1], saved[2]


def test_import_installs_only_a_null_handler() -> None:
    code = ("import logging, ds_terapipe; h = logging.getLogger('ds_terapipe').handlers; "
            "print([type(x).__name__ for x in h], logging.getLogger().handlers)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['NullHandler'] []"


def test_configure_logging_adds_one_handler_with_the_format(lib_logger, monkeypatch) -> None:
    monkeypatch.delenv("DS_TERAPIPE_LOG_LEVEL", raising=False)
    configure_logging()
    configure_logging()   # idempotent: a second call only sets the level
    shown = [h for h in lib_logger.handlers if not isinstance(h, logging.NullHandler)]
    assert len(shown) == 1 and shown[0].formatter._fmt == LOG_FORMAT
    assert lib_logger.level == logging.INFO and lib_logger.propagate is False
    configure_logging("DEBUG")
    assert lib_logger.level == logging.DEBUG


def test_level_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("DS_TERAPIPE_LOG_LEVEL", "debug")
    assert env_log_level() == logging.DEBUG
    monkeypatch.delenv("DS_TERAPIPE_LOG_LEVEL")
    assert env_log_level(default="WARNING") == logging.WARNING
    monkeypatch.setenv("DS_TERAPIPE_LOG_LEVEL", "LOUD")
    with pytest.raises(ValueError, match="DS_TERAPIPE_LOG_LEVEL='LOUD' is not a logging level"):
        env_log_level()
