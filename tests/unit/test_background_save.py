"""A background save yields the CPU to training: its threads run at the lowest priority.

World size 1 (no process group): the same writer threads the ranks start.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest
import torch

import mpnb
from mpnb.checkpoints.format import MANIFEST
from mpnb.engine.checkpoint import hashing_writer, writer
from mpnb.models import tiny_gpt

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")


def _priority() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_the_background_writer_and_its_file_threads_run_at_the_lowest_priority(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, int] = {}
    write_files = hashing_writer.write_files

    def recording(*args: object, **kwargs: object) -> None:
        seen[threading.current_thread().name] = _priority()
        write_files(*args, **kwargs)

    monkeypatch.setattr(hashing_writer, "write_files", recording)
    net = tiny_gpt(0)
    trainer = mpnb.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-3), config={"strategy": "ddp"})
    trainer.save(tmp_path / "blocking")
    assert set(seen.values()) == {_priority()}  # a blocking save runs as the caller does
    seen.clear()
    trainer.save(tmp_path / "background", blocking=False).wait()
    assert len(seen) == writer.WRITE_THREADS
    assert set(seen.values()) == {writer.BACKGROUND_NICE}
    assert _priority() != writer.BACKGROUND_NICE  # the caller's own priority is unchanged
    assert (tmp_path / "background" / MANIFEST).is_file()
