"""`trainer.export(path)`: the trained weights as one file that plain torch (or transformers) loads.

A sharded checkpoint is written first (every rank its part), then rank 0
alone turns it into one consolidated file with `mpnb.checkpoints.export`: the
only step that holds the whole model in one process, as a single-file export must.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from mpnb.engine.checkpoint import writer
from mpnb.engine.checkpoint.collective import agree, from_rank0, rank
from mpnb.errors import MpnbError


def export(trainer: Any, path: str | os.PathLike[str]) -> None:
    from mpnb.checkpoints.export import export_checkpoint

    trainer.wait_for_save()
    target_name, token = from_rank0((str(Path(path).absolute()), uuid.uuid4().hex[:8]))
    target = Path(target_name)
    scratch = target.parent / f".{target.name}.export-{token}"
    writer.save(trainer, scratch)
    error = None
    if rank() == 0:
        try:
            export_checkpoint(scratch, target)
        except (MpnbError, OSError) as e:
            error = str(e)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    agree(error)
