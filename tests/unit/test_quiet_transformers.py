"""On engines transformers logs only errors, except in `%%distributed --verbose` cells (mpnb.engine.quiet)."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest

from mpnb.engine import quiet
from mpnb.engine.control import CELL_MARK

transformers = pytest.importorskip("transformers")

PLAIN = SimpleNamespace(raw_cell=f"{CELL_MARK}  # all ranks\nx = 1\n")
VERBOSE = SimpleNamespace(raw_cell=f"{CELL_MARK} --verbose  # all ranks{quiet.VERBOSE_MARK}\nx = 1\n")


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.delenv(quiet.VERBOSE_ENV, raising=False)
    monkeypatch.delenv(quiet.TRANSFORMERS_VERBOSITY, raising=False)
    monkeypatch.setattr(quiet, "_own_transformers_verbosity", False)
    logger = logging.getLogger("transformers")
    level = logger.level
    yield logger
    quiet._pre_run_cell(PLAIN)
    monkeypatch.setattr(quiet, "_own_transformers_verbosity", False)
    logger.setLevel(level)


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_transformers_warnings_only_in_verbose_cells(fresh):
    seen = Records()
    fresh.addHandler(seen)
    quiet.install()
    assert os.environ[quiet.TRANSFORMERS_VERBOSITY] == "error"  # read by transformers when imported
    probe = transformers.utils.logging.get_logger("transformers.mpnb_unit_probe")
    probe.warning("hidden record")
    quiet._pre_run_cell(VERBOSE)
    assert os.environ[quiet.TRANSFORMERS_VERBOSITY] == "warning" and fresh.level == logging.WARNING
    probe.warning("shown record")
    quiet._pre_run_cell(PLAIN)
    assert fresh.level == logging.ERROR
    fresh.removeHandler(seen)
    assert seen.messages == ["shown record"]


def test_a_users_own_verbosity_is_kept(fresh, monkeypatch):
    monkeypatch.setenv(quiet.TRANSFORMERS_VERBOSITY, "info")
    fresh.setLevel(logging.INFO)
    quiet.install()
    quiet._pre_run_cell(PLAIN)
    assert os.environ[quiet.TRANSFORMERS_VERBOSITY] == "info" and fresh.level == logging.INFO
