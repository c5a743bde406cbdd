"""How the engines mpnb launched leave: out of the process group at once, SIGTERM, and their nannies reaped.

Engines that mpnb launched leave ipyparallel nannies behind now and then; the detached reaper
(`mpnb/cluster/reaper.py`, run as a script) is started on stop, restart and kernel exit to kill those.

Kernel side: never imports torch.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from mpnb.cluster import reaper

if TYPE_CHECKING:
    from mpnb.cluster.session import RankInfo, Session


def prepare(sess: Session, engine_ids: Sequence[int]) -> None:
    """Engines leave the process group and freeze their GC, so they exit at once.

    With a live gloo group they ignore SIGTERM and are killed only after ipyparallel's 5 s grace.
    """
    from mpnb.engine import bootstrap

    if engine_ids:
        with contextlib.suppress(Exception):
            sess.client[list(engine_ids)].apply_async(bootstrap.prepare_exit).wait(3)


def terminate(ranks: Sequence[RankInfo]) -> None:
    """SIGTERM each rank's engine now, where it is still the process the world was formed with."""
    for info in ranks:
        if info.started is not None and reaper.start_ticks(info.pid) == info.started:
            with contextlib.suppress(OSError):
                os.kill(info.pid, signal.SIGTERM)


def reap_nannies_later(sess: Session, more: Sequence[str] = ()) -> None:
    """Start the detached nanny reaper for this session's ranks, and for `more` engines' nannies
    (the reaper's ENGINE:NANNY:STARTED arguments: the spares')."""
    pairs = [
        reaper.pair(r.pid, nanny, started)
        for r in sess.ranks
        for nanny, started in zip(r.nannies, r.nanny_started, strict=False)
    ] + list(more)
    if sess.cluster is None or not pairs:
        return  # a connected cluster's engines, and their nannies, are not ours
    script = Path(__file__).with_name("reaper.py")
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        starter = subprocess.Popen(
            [sys.executable, str(script), *pairs],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        starter.wait(10)  # it forks the watcher off and exits at once
