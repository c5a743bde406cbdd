"""What every rank of a checkpoint must agree on: one path, one outcome.

A rank that fails alone while the others go on into a collective would hang
them; so each local step ends in `agree`, and every rank raises the same error.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from mpnb.errors import CheckpointError


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if distributed() else 0


def world(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if distributed() else 1


def from_rank0(value: Any, group: dist.ProcessGroup | None = None) -> Any:
    """Rank 0's `value` on every rank."""
    if not distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    return box[0]


def gather(value: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's `value`, in rank order, on every rank."""
    if not distributed():
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def agree(error: str | None, group: dist.ProcessGroup | None = None, *,
          cause: BaseException | None = None) -> None:
    """Raise the same CheckpointError on every rank if any rank reports an error."""
    errors = [e for e in gather(error, group) if e]
    if errors:
        first = errors[0]
        others = sum(e != first for e in errors)  # ranks that found the same problem add nothing
        suffix = f" ({others} other rank(s) failed otherwise)" if others else ""
        raise CheckpointError(first + suffix) from cause


def checkpoint_exception() -> type[BaseException]:
    """DCP's CheckpointException: a BaseException, so `except Exception` alone misses it."""
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def failure_text(e: BaseException) -> str:
    """One line per failing rank of a DCP CheckpointException (a BaseException), else the error itself."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for r, pair in sorted(failures.items()):
            exc = pair[0] if isinstance(pair, tuple) else pair
            parts.append(f"rank {r}: {type(exc).__name__}: {exc}")
        return "; ".join(parts)
    return f"{type(e).__name__}: {e}"


@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    """DCP warns that it "assumes" a single process whenever no group exists: that is the point here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield
