"""Tell the notebook kernel that a checkpoint was saved, so the sidebar can list it.

Rank 0 calls `announce_checkpoint` after each completed save (`writer._announce`).
The record travels over the memory side channel (`mpnb.engine.monitor`'s sampler
thread owns the socket; zmq sockets are not thread-safe, and a background save
finishes on a thread of its own), signed like the samples, and lands in the
kernel's `MemoryStore.checkpoints()`. Without a sampler (a single process
outside a cluster, or a monitor stopped by hand) there is nobody to tell: nothing
happens. Nothing here raises: a save never fails because the sidebar missed it.
"""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path
from typing import Any

from mpnb.checkpoints import format as fmt
from mpnb.engine import monitor, state
from mpnb.monitoring.protocol import checkpoint_content, valid_checkpoint

log = logging.getLogger(__name__)


def announce_checkpoint(record: dict[str, Any]) -> None:
    """Queue `record` ({path, step, strategy, world_size, seconds, bytes}) for the kernel; never raises."""
    try:
        if not monitor.status().get("running"):
            return
        full = {**record, "label": _label(Path(record["path"]), record), "t": time.time()}
        checked = valid_checkpoint(full)
        if checked is None:  # the kernel would drop it too; say so here, where it can be read
            log.debug("mpnb: checkpoint record not announced, a field is off: %r", full)
            return
        state.announcements.append(checkpoint_content(checked))
        monitor.wake()
    except Exception:
        log.debug("mpnb: could not announce the checkpoint", exc_info=True)


def _label(path: Path, record: dict[str, Any]) -> str:
    """The strategy as the status bar names it ("ZeRO-2", "TP 2 x FSDP 2"), from the saved Config.

    The record says only "zero"; the stage, degrees and reshard setting are in the saved config.
    """
    from mpnb.planning.config import Config

    try:
        config = Config.from_dict(json.loads((path / fmt.MANIFEST).read_text())["config"])
        if str(config.strategy) != record["strategy"]:  # "local": one process, whatever the config says
            return str(record["strategy"])
        head = config.summary(int(record["world_size"])).split("·")[0]
        return re.sub(r"\s*\([^)]*\)", "", head).strip() or str(record["strategy"])  # no "(gpipe, 4 µb)"
    except Exception:  # an older or foreign config: the plain name still says what wrote it
        return str(record["strategy"])
