"""`%mpnb checkpoint info|list|save|load`: checkpoints from the notebook's magic line.

`info` and `list` read manifests in the kernel (no cluster needed). `save` and
`load` call the active trainer's (`mpnb.engine.state.active_trainer()`, the one
`mpnb.prepare` returned last) `save` / `load` on every rank, as one generated
cell line run like `%%distributed` (`run_cell`): grouped output, the watchdog,
rank deaths and the stop button all apply. A rank's error comes back as one
`CheckpointError` message, never a traceback.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from mpnb.checkpoints.info import CheckpointInfo, checkpoint_info, list_checkpoints, recency
from mpnb.errors import CheckpointError, MpnbError
from mpnb.units import format_bytes

ACTIONS = ("info", "list", "save", "load")
ENGINE_MODULE = "mpnb.checkpoints.magic"  # the module the generated cell line imports on every rank


def checkpoint_command(action: str, path: str | None, *, verify: bool = False, background: bool = False,
                       optimizer: bool = True, execution_count: int | None = None) -> Any:
    """Run `%mpnb checkpoint ACTION [PATH]`; `info` returns the CheckpointInfo for the notebook to show."""
    if action == "list":
        print(listing(path or "."))
        return None
    if not path:
        raise CheckpointError(f"`%mpnb checkpoint {action}` needs a PATH: e.g. "
                              f"`%mpnb checkpoint {action} checkpoints/step100`.")
    if action == "info":
        return checkpoint_info(path, verify=verify)
    target = str(Path(path).expanduser().absolute())
    run_on_ranks(action, target, background=background, optimizer=optimizer, execution_count=execution_count)
    if action == "save" and background:
        print(f"mpnb: saving to {target} in the background; training can go on (the next save waits for it).")
    else:
        info = checkpoint_info(target)
        print(f"mpnb: {'saved' if action == 'save' else 'loaded'} step {info.step} "
              f"{'to' if action == 'save' else 'from'} {target} ({format_bytes(info.bytes)})")
    return None


def run_on_ranks(action: str, target: str, *, background: bool, optimizer: bool,
                 execution_count: int | None) -> None:
    """The active trainer's save or load on every rank, as one cell; errors as a `CheckpointError`."""
    from mpnb.cluster import session as cluster
    from mpnb.execution.cell_run import run_cell
    from mpnb.execution.options import CellOptions
    from mpnb.execution.report import CellFailedError

    sess = cluster.session()
    code = (f"__import__({ENGINE_MODULE!r}, fromlist=['on_engine']).on_engine({action!r}, {target!r}, "
            f"background={background!r}, optimizer={optimizer!r})")
    try:
        run_cell(sess, code, CellOptions(monitor=False), execution_count=execution_count,
                 magic_line=f"checkpoint {action} {target}", label=f"checkpoint {action}")
    except CellFailedError as exc:
        first = exc.failures[0]
        ranks = ", ".join(str(r) for r in first.ranks)
        plain = first.ename in _MPNB_ERRORS  # mpnb's own messages say what to do; others need their type
        what = first.evalue if plain else f"{first.ename}: {first.evalue}"
        raise CheckpointError(f"`%mpnb checkpoint {action}` failed on rank {ranks}: {what}") from None


def on_engine(action: str, target: str, *, background: bool = False, optimizer: bool = True) -> None:
    """Engine side of `run_on_ranks`: the trainer `mpnb.prepare` returned last saves or loads."""
    from mpnb.engine import state

    trainer = state.active_trainer()
    if trainer is None:
        raise CheckpointError(f"There is no trainer to {action}: run `trainer = mpnb.prepare(model, "
                              "optimizer)` in a %%distributed cell first.")
    if action == "save":
        trainer.save(target, blocking=not background)
    elif action == "load":
        trainer.load(target, optimizer=optimizer)
    else:
        raise CheckpointError(f"Unknown checkpoint action {action!r}: use save or load.")


def listing(directory: str | os.PathLike[str]) -> str:
    """The checkpoints under `directory` and those saved in this session, newest first, as a text table."""
    found = {str(i.path): i for i in list_checkpoints(directory)}
    announced = _announced()
    for path in announced:
        if path not in found and Path(path).is_dir():
            try:
                found[path] = checkpoint_info(path)
            except MpnbError:
                continue  # replaced or deleted since: list what is there now
    if not found:
        return (f"No checkpoints in {Path(directory).absolute()} (nor saved in this session). "
                "Save one with `trainer.save(path)` or `%mpnb checkpoint save PATH`.")
    rows = [("path", "step", "strategy", "ranks", "size", "written", "")]
    for info in sorted(found.values(), key=recency, reverse=True):
        rows.append(_row(info, announced.get(str(info.path)), Path(directory).absolute()))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def _row(info: CheckpointInfo, record: dict[str, Any] | None, base: Path) -> tuple[str, ...]:
    try:
        shown = str(info.path.relative_to(base))
    except ValueError:
        shown = str(info.path)
    strategy = str(record.get("label") or info.strategy) if record else info.strategy
    flags = "this session" if record else ""
    if info.problems:
        flags = "DAMAGED" + (f", {flags}" if flags else "")
    return (shown, str(info.step), strategy, str(info.world_size), format_bytes(info.bytes), info.written,
            flags)


def _announced() -> dict[str, dict[str, Any]]:
    """Checkpoints the engines announced in this session (the sidebar's list), by path."""
    from mpnb.cluster.session import current

    sess = current()
    if sess is None:
        return {}
    return {str(r["path"]): r for r in sess.memory.checkpoints()}


def _mpnb_error_names() -> set[str]:
    import mpnb.errors as errors

    return {name for name, value in vars(errors).items()
            if isinstance(value, type) and issubclass(value, MpnbError)}


_MPNB_ERRORS = _mpnb_error_names()
