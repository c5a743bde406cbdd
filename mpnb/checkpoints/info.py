"""`mpnb.checkpoint_info(path)`: what a checkpoint holds and whether it can be resumed here.

Reads only the manifest (`mpnb.json`) and the sizes of the files it lists, so
it is instant, needs no torch and works in the notebook kernel with or without
a cluster. Resuming reshards between any world sizes (DCP), so the world size a
checkpoint was written under is never a reason on its own: what can stop a
resume is a damaged file, or an active config that cannot run on the cluster.
"""

from __future__ import annotations

import contextlib
import html
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mpnb.checkpoints.format import (
    MODEL_PREFIX,
    corrupted_files,
    first_few,
    listed_files,
    missing_or_short_files,
    read_manifest,
)
from mpnb.units import format_bytes

if TYPE_CHECKING:
    from typing import TypeAlias

    from mpnb.planning.config import Config

    ConfigLike: TypeAlias = Config | dict[str, Any] | None  # a Config, its to_dict(), or the cluster's

@dataclass(frozen=True)
class RankShare:
    """One rank's part of a checkpoint: the tensors it held and the bytes of the files it wrote."""

    rank: int
    tensors: int
    bytes: int  # tensor bytes the rank held when it saved (its shard)
    file_bytes: int  # bytes of the files it wrote (replicated tensors are written by one rank only)


@dataclass
class CheckpointInfo:
    """What `mpnb.checkpoint_info(path)` found; `why_not()` says what stops a resume here, if anything."""

    path: Path
    strategy: str
    world_size: int
    step: int
    model_class: str
    config: dict[str, Any]
    tensors: int  # distinct tensors in the checkpoint (weights and optimizer state)
    bytes: int  # on disk, all files the manifest lists
    ranks: list[RankShare]
    written: str
    problems: list[str] = field(default_factory=list)  # damaged or missing files
    manifest: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def model_tensors(self) -> int:
        return sum(1 for k in self.manifest.get("tensors", {}) if k.startswith(MODEL_PREFIX))

    def why_not(self, config: ConfigLike = None, world_size: int | None = None) -> str | None:
        """Why this checkpoint cannot be resumed under `config` on `world_size` ranks, or None if it can.

        Both default to the running cluster's (its active config and size). With
        neither a cluster nor arguments, only the files are checked.
        """
        if self.problems:
            return (f"the checkpoint is damaged: {first_few(self.problems)}. "
                    "Resume from an earlier checkpoint.")
        cfg, world, device_kind = _target(config, world_size)
        if cfg is None or world is None:
            return None  # nothing known to check against: resharding fits any world size
        found = cfg.problems(world, device_kind)
        if found:
            return (f"the active config cannot run on {world} ranks: {found[0].rstrip('.')}. The checkpoint "
                    "reshards to any world size: change the config (`%mpnb config`) and resume.")
        return None

    def can_resume(self, config: ConfigLike = None, world_size: int | None = None) -> bool:
        return self.why_not(config, world_size) is None

    # ------------------------------------------------------------------ display

    def _rows(self) -> list[tuple[str, str, str, str]]:
        return [(str(r.rank), str(r.tensors), format_bytes(r.bytes), format_bytes(r.file_bytes))
                for r in self.ranks]

    def _headline(self) -> str:
        model = self.model_class.rsplit(".", 1)[-1]
        ranks = f"{self.world_size} rank{'s' if self.world_size != 1 else ''}"
        return (f"{self.strategy} · {ranks} · step {self.step} · {model} · "
                f"{self.tensors} tensors · {format_bytes(self.bytes)} on disk · written {self.written}")

    def __repr__(self) -> str:
        why = self.why_not()
        header = ("rank", "tensors", "held", "written")
        table = [header, *self._rows()]
        widths = [max(len(row[i]) for row in table) for i in range(len(header))]
        lines = [f"mpnb checkpoint {self.path}", f"  {self._headline()}"]
        lines += ["  " + "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in table]
        lines.append("  resumable here: yes" if why is None else f"  resumable here: no, {why}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        why = self.why_not()
        e = html.escape
        rows = "".join(
            "<tr>" + "".join(f"<td style='text-align:right'>{e(c)}</td>" for c in row) + "</tr>"
            for row in self._rows()
        )
        verdict = ("<b style='color:#2e7d32'>yes</b>" if why is None
                   else f"<b style='color:#c62828'>no</b>: {e(why)}")
        return (
            f"<div class='mpnb-checkpoint'><div><b>mpnb checkpoint</b> <code>{e(str(self.path))}</code></div>"
            f"<div>{e(self._headline())}</div>"
            "<table><thead><tr><th>rank</th><th>tensors</th><th>held</th><th>written</th></tr></thead>"
            f"<tbody>{rows}</tbody></table><div>resumable here: {verdict}</div></div>"
        )


def checkpoint_info(path: str | os.PathLike[str], *, verify: bool = False) -> CheckpointInfo:
    """What the checkpoint at `path` holds (no torch, no cluster needed); `CheckpointError` if it is none.

    Missing and truncated files are always found (their sizes are compared with
    the manifest's); `verify=True` also reads every file to compare its checksum,
    which finds corrupted bytes at the cost of reading the whole checkpoint.
    """
    root = Path(path).absolute()
    manifest = read_manifest(root)
    problems = damaged_files(root, manifest, verify=verify)
    ranks = [
        RankShare(int(r["rank"]), int(r["tensors"]), int(r["bytes"]),
                  sum(int(f["bytes"]) for f in r["files"].values()))
        for r in manifest["ranks"]
    ]
    return CheckpointInfo(
        path=root,
        strategy=str(manifest.get("strategy", "?")),
        world_size=int(manifest["world_size"]),
        step=int(manifest["step"]),
        model_class=str(manifest.get("model_class", "?")),
        config=dict(manifest.get("config") or {}),
        tensors=len(manifest.get("tensors", {})),
        bytes=sum(r.file_bytes for r in ranks),
        ranks=ranks,
        written=str(manifest.get("written", "?")),
        problems=problems,
        manifest=manifest,
    )


def damaged_files(root: Path, manifest: dict[str, Any], *, verify: bool) -> list[str]:
    """Missing or truncated files; with `verify`, also those whose bytes changed (checksum)."""
    problems = missing_or_short_files(root, manifest)
    if verify:  # the checksum of files whose size is right (the others are reported already)
        whole = [f for f in listed_files(manifest)
                 if (root / f[1]).is_file() and (root / f[1]).stat().st_size == f[2]["bytes"]]
        problems += corrupted_files(root, whole)
    return problems


def list_checkpoints(directory: str | os.PathLike[str] = ".", depth: int = 2) -> list[CheckpointInfo]:
    """Complete checkpoints in `directory` and up to `depth` levels below it, newest first.

    Hidden directories are skipped: that is where saves in progress and exports write.
    """
    from mpnb.checkpoints.format import MANIFEST
    from mpnb.errors import CheckpointError

    found: list[CheckpointInfo] = []
    level = [Path(directory)]
    for _ in range(depth + 1):
        below: list[Path] = []
        for d in level:
            if (d / MANIFEST).is_file():
                with contextlib.suppress(CheckpointError):  # another format's manifest: not ours to list
                    found.append(checkpoint_info(d))
                continue
            try:
                below += [c for c in d.iterdir() if c.is_dir() and not c.name.startswith(".")]
            except OSError:
                continue  # unreadable folder: list what can be read
        level = below
    return sorted(found, key=recency, reverse=True)


def recency(info: CheckpointInfo) -> tuple[str, int]:
    """Sort key, newest last: `written` has whole seconds, the manifest's mtime orders saves within one."""
    from mpnb.checkpoints.format import MANIFEST

    try:
        return info.written, (info.path / MANIFEST).stat().st_mtime_ns
    except OSError:
        return info.written, 0


def _target(config: ConfigLike, world_size: int | None) -> tuple[Config | None, int | None, str | None]:
    """The config, world size and device kind to check against: the arguments, else the running cluster's."""
    from mpnb.cluster.session import current
    from mpnb.planning.config import Config

    sess = current()
    if config is None and sess is not None:
        config = sess.config
    if isinstance(config, dict):
        config = Config.from_dict(config)
    if world_size is None and sess is not None:
        world_size = sess.world_size
    device_kind = sess.device_kind if sess is not None else None
    return config, world_size, device_kind
