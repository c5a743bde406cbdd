"""What an mpnb checkpoint directory holds (torch-free: the kernel reads it too).

A checkpoint is a `torch.distributed.checkpoint` (DCP) directory plus one JSON
file that says what wrote it, so it can be inspected without torch and resumed
under any strategy and world size:

    PATH/
      .metadata, __R_I.distcp   DCP's own files: every rank wrote only what it holds
      mpnb.json                 MANIFEST below, written last by rank 0
      rng/rank{R}.pt            each rank's RNG states (torch, python, numpy)
      scheduler.pt              the LR scheduler's state_dict, if prepare got one

DCP keys (after DCP flattens nested dicts with "."): `model.<fqn>` for weights
and `optim.state.<fqn>.<name>` for optimizer state (`exp_avg`, `exp_avg_sq`,
`step`), fqn being the parameter's name in the unwrapped model, the same under
every strategy. A directory is complete once `mpnb.json` exists: it is written
into a temporary sibling directory that is renamed into place at the end.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xxhash

FORMAT = "mpnb-checkpoint/1"
MANIFEST = "mpnb.json"
DCP_METADATA = ".metadata"
DCP_DATA_SUFFIX = ".distcp"  # DCP's tensor files, __{rank}_{i}.distcp
RNG_DIR = "rng"
SCHEDULER = "scheduler.pt"
MODEL_PREFIX = "model."
OPTIM_PREFIX = "optim.state."


SHOWN = 5  # problems (damaged files, mismatching names) an error lists before "and N more"


def first_few(problems: list[str]) -> str:
    """The first `SHOWN` problems joined with "; ", and how many more there are."""
    more = f" and {len(problems) - SHOWN} more" if len(problems) > SHOWN else ""
    return "; ".join(problems[:SHOWN]) + more


def rng_file(rank: int) -> str:
    return f"{RNG_DIR}/rank{rank}.pt"


def partial_name(path: Path, token: str) -> Path:
    """The temporary sibling a save writes into before the rename (hidden, so listings skip it)."""
    return path.parent / f".{path.name}.partial-{token}"


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of checkpoint `path`; raises `CheckpointError` naming what is missing or wrong."""
    from mpnb.errors import CheckpointError

    root = Path(path)
    if not root.exists():
        raise CheckpointError(f"No checkpoint at {root}: the path does not exist. Check the path, or "
                              "list what was saved with `%mpnb checkpoint list`.")
    if not root.is_dir():
        raise CheckpointError(f"{root} is a file, not a checkpoint directory (trainer.save writes a "
                              "directory). Pass the directory trainer.save(path) was given.")
    manifest = root / MANIFEST
    if not manifest.is_file():
        raise CheckpointError(f"{root} is not a complete mpnb checkpoint: it has no {MANIFEST} (a save that "
                              "did not finish, or another tool's directory). Use one trainer.save wrote.")
    try:
        data = json.loads(manifest.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{manifest} cannot be read ({e}): the checkpoint is damaged. "
                              "Resume from an earlier checkpoint.") from e
    if data.get("format") != FORMAT:
        raise CheckpointError(f"{root} has format {data.get('format')!r}, this mpnb reads {FORMAT!r}.")
    return data


CHECKSUM = "xxh3"  # the manifest's per-file checksum; older checkpoints carry "crc32"
READ_CHUNK = 1 << 22


def checksum(path: str | os.PathLike[str]) -> str:
    """The file's xxh3-64 in hex: DCP stores raw tensor bytes, so a flipped byte would load silently
    without one (xxh3 hashes at memory speed; CRC-32 was a fifth of a save's time)."""
    digest = xxhash.xxh3_64()
    _read_through(path, digest.update)
    return digest.hexdigest()


def _read_through(path: str | os.PathLike[str], update: Callable[[memoryview], Any]) -> None:
    buffer = bytearray(READ_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            update(view[:n])


class Digest:
    """The checksum a manifest entry names (xxh3, or CRC-32 in older checkpoints), fed chunk by chunk."""

    def __init__(self, info: dict[str, Any]) -> None:
        self._info = info
        self._xxh3 = xxhash.xxh3_64() if CHECKSUM in info else None
        self._crc32 = 0

    def update(self, chunk: Any) -> None:
        if self._xxh3 is not None:
            self._xxh3.update(chunk)
        elif "crc32" in self._info:
            self._crc32 = zlib.crc32(chunk, self._crc32)

    def differs(self) -> bool:
        if self._xxh3 is not None:
            return self._xxh3.hexdigest() != self._info[CHECKSUM]
        return "crc32" in self._info and self._crc32 != self._info["crc32"]


def _bytes_differ(path: Path, info: dict[str, Any]) -> bool:
    digest = Digest(info)
    _read_through(path, digest.update)
    return digest.differs()


def listed_files(manifest: dict[str, Any]) -> list[tuple[int, str, dict[str, Any]]]:
    """(writing rank, name, {"bytes", CHECKSUM}) for every file the manifest lists."""
    return [(rank["rank"], name, info) for rank in manifest["ranks"] for name, info in rank["files"].items()]


def corrupted_files(path: str | os.PathLike[str], files: list[tuple[int, str, dict[str, Any]]]) -> list[str]:
    """Those of `files` whose checksum differs from the one written (sizes checked first)."""
    root = Path(path)
    return [changed_bytes(name, rank) for rank, name, info in files if _bytes_differ(root / name, info)]


def changed_bytes(name: str, rank: int) -> str:
    return f"{name} (rank {rank}) does not hold the bytes that were written (checksum differs)"


def missing_or_short_files(path: str | os.PathLike[str], manifest: dict[str, Any]) -> list[str]:
    """Files the manifest lists that are absent or not the size they were written with."""
    root = Path(path)
    problems = []
    for rank, name, info in listed_files(manifest):
        f = root / name
        if not f.is_file():
            problems.append(f"{name} (rank {rank}) is missing")
        elif f.stat().st_size != info["bytes"]:
            written = info["bytes"]
            problems.append(f"{name} (rank {rank}) has {f.stat().st_size} bytes, {written} were written")
    return problems
