"""`trainer.save(path)`: every rank writes what it holds, into a temporary directory renamed at the end.

Nothing is gathered onto one rank: DCP writes each rank's tensors (DTensor
shards, ZeRO partitions, pipeline stages) from where they are; replicated
tensors are written once. The directory appears complete or not at all
(`atomic.replace_dir`), so a rank killed mid-save, or a full disk, leaves the
previous checkpoint at `path` untouched.

`blocking=False` copies the state to CPU memory (one copy of this rank's
shard) and writes it from a background thread on a process group of its own,
so training goes on while the files are written; the next save waits for it.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mpnb._version import __version__
from mpnb.checkpoints import format as fmt
from mpnb.engine.checkpoint import atomic, rng
from mpnb.engine.checkpoint.collective import (
    agree,
    checkpoint_exception,
    distributed,
    failure_text,
    from_rank0,
    gather,
    rank,
    single_process_quiet,
)
from mpnb.engine.checkpoint.hashing_writer import HashingFileSystemWriter
from mpnb.errors import CheckpointError
from mpnb.units import format_bytes

FULL_DISK_MARGIN = 1 << 20  # less free than this after a failed write: the disk filled up
BACKGROUND_NICE = 19  # a background save's CPU priority (nice), the lowest
# DCP splits a rank's tensors over this many files, each written by its own thread: one thread
# serializes while another waits on its fsync (measured: save time 0.66 of one thread's)
WRITE_THREADS = 2


class SaveHandle:
    """A save in progress or done: `wait()` returns once it is on disk (raising its error, if any)."""

    def __init__(self, path: Path, step: int) -> None:
        self.path, self.step = path, step
        self.seconds: float | None = None
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    @property
    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> SaveHandle:
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            error, self.error = self.error, None  # raised once: the next save starts clean
            raise error
        return self

    def __repr__(self) -> str:
        what = "saved" if self.done else "saving"
        took = f" in {self.seconds:.2f} s" if self.seconds is not None else ""
        return f"<mpnb checkpoint {what}: step {self.step} -> {self.path}{took}>"


def save(trainer: Any, path: str | os.PathLike[str], *, blocking: bool = True) -> SaveHandle:
    """Write `trainer`'s model, optimizer, step, scheduler and RNG states to directory `path` (every rank)."""
    trainer.wait_for_save()
    target_name, token = from_rank0((str(Path(path).absolute()), uuid.uuid4().hex[:8]))
    target = Path(target_name)
    agree(_target_problem(target) if rank() == 0 else None)  # rank 0 also cleared stale partials by then
    group = None if blocking else _background_group(trainer)
    state = trainer.checkpoint_state()
    groups = state.get("optim", {}).pop("param_groups", [])
    scheduler = getattr(trainer, "lr_scheduler", None)
    extras = {"rng": rng.capture(), "scheduler": scheduler.state_dict() if scheduler is not None else None}
    manifest = _manifest_base(trainer, groups)
    handle = SaveHandle(target, trainer.steps)
    if blocking:
        _write(handle, target, token, state, extras, manifest, None)
        return handle
    staged = _stage(state, trainer.staging_buffers)
    handle._thread = threading.Thread(
        target=_write_catching, args=(handle, target, token, staged, extras, manifest, group),
        name="mpnb-checkpoint", daemon=True,
    )
    handle._thread.start()
    return handle


def _write_catching(handle: SaveHandle, *args: Any) -> None:
    _yield_cpu_to_training()
    try:
        _write(handle, *args)
    except BaseException as e:  # reported by handle.wait() on the next save; printed now
        handle.error = e
        if rank() == 0:
            print(f"mpnb: the background save to {handle.path} failed: {e}", flush=True)


def _write(handle: SaveHandle, target: Path, token: str, state: dict[str, Any], extras: dict[str, Any],
           manifest: dict[str, Any], group: dist.ProcessGroup | None) -> None:
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint import save as dcp_save

    started = time.perf_counter()
    me = rank(group)
    tmp = fmt.partial_name(target, token)
    with _removed_on_failure(tmp, me):
        error = None
        try:
            (tmp / fmt.RNG_DIR).mkdir(parents=True, exist_ok=True)
            torch.save(extras["rng"], tmp / fmt.rng_file(me))
            if me == 0 and extras["scheduler"] is not None:
                torch.save(extras["scheduler"], tmp / fmt.SCHEDULER)
        except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError
            error = _failed(target, _disk_full(tmp, str(e)) or f"rank {me}: {e}")
        agree(error, group)
        try:
            with single_process_quiet():
                writer = HashingFileSystemWriter(tmp, thread_count=WRITE_THREADS)
                # plan caching: a save of the same state as last time skips DCP's gather/scatter of plans
                metadata = dcp_save(state, storage_writer=writer,
                                    planner=DefaultSavePlanner(enable_plan_caching=True),
                                    process_group=group, no_dist=not distributed())
        except (Exception, checkpoint_exception()) as e:
            why = failure_text(e)
            raise CheckpointError(_failed(target, _disk_full(tmp, why) or why)) from None
        record, error = None, None
        try:
            record = _rank_record(tmp, me, state, writer.checksums)
        except OSError as e:
            error = _failed(target, f"rank {me}: {e}")
        agree(error, group)
        ranks = gather(record, group)
        if me == 0:
            try:
                seconds = time.perf_counter() - started
                _write_manifest(tmp, {**manifest, "tensors": _tensor_shapes(metadata), "ranks": ranks,
                                      "seconds": round(seconds, 4)})
                atomic.replace_dir(tmp, target)
            except OSError as e:
                error = _failed(target, f"rank 0 finishing the directory: {e}")
        agree(error, group)
    handle.seconds = time.perf_counter() - started
    if me == 0:
        _announce(handle, manifest, ranks)


def _yield_cpu_to_training() -> None:
    """Run this thread, and the file threads it starts (they inherit it), at the lowest CPU priority:
    the training loop keeps its cores and the write takes what they leave. With both cores of 2
    busy training, a background save's cost to the loop fell from about 100% to 40-75% of a blocking
    save's time (benchmarks/checkpoint.py); the rest is the staging copy and the GIL."""
    if sys.platform.startswith("linux"):  # elsewhere setpriority takes no thread id
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)


@contextlib.contextmanager
def _removed_on_failure(tmp: Path, me: int) -> Iterator[None]:
    try:
        yield
    except BaseException:
        if me == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _failed(target: Path, why: str) -> str:
    kept = "The checkpoint already there is untouched. " if target.exists() else ""
    return (f"Saving the checkpoint to {target} failed ({why}). {kept}Free space or fix the directory, "
            "or save to another path; training can go on.")


def _disk_full(tmp: Path, why: str) -> str | None:
    """A full disk in words: torch's writers may report it as an 'enforce fail' or a short write."""
    free = shutil.disk_usage(tmp.parent).free
    if free > FULL_DISK_MARGIN and "No space left on device" not in why:
        return None
    return f"No space left on device: {format_bytes(free)} free in {tmp.parent}"


def _target_problem(target: Path) -> str | None:
    """Why `target` cannot receive a checkpoint (checked on rank 0 before anything is written)."""
    foreign = target.is_file() or (target.is_dir() and any(target.iterdir()))
    if foreign and not (target / fmt.MANIFEST).is_file():
        return (f"{target} exists and is not an mpnb checkpoint; trainer.save replaces only an earlier "
                "checkpoint. Choose a new path (a directory trainer.save creates).")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"Cannot save to {target}: its folder cannot be created ({e}). Choose a writable folder."
    if not os.access(target.parent, os.W_OK):
        return f"Cannot save to {target}: {target.parent} is not writable. Choose a writable folder."
    _remove_stale_partials(target)
    return None


def _remove_stale_partials(target: Path) -> None:
    """What an earlier save to `target` left when a rank died mid-write (saves to one path never overlap)."""
    for stale in target.parent.glob(fmt.partial_name(target, "*").name):
        shutil.rmtree(stale, ignore_errors=True)


def _background_group(trainer: Any) -> dist.ProcessGroup | None:
    """A gloo group for background saves, so their collectives never interleave with training's."""
    if not distributed():
        return None
    world = dist.group.WORLD
    cached = getattr(trainer, "_checkpoint_group", None)
    if cached is None or cached[0] is not world:
        cached = (world, dist.new_group(backend="gloo"))
        trainer._checkpoint_group = cached
    return cached[1]


def _stage(x: Any, kept: dict[str, torch.Tensor], key: str = "") -> Any:
    """A CPU copy of the state for a background save: training may change the live tensors meanwhile.

    Copied into the buffers `kept` from the previous background save where they fit (the next
    save waits for the previous one, so nothing reads them any more), as DCP's cached staging
    does: a copy into memory already paged in takes a third of the time of one into fresh memory."""
    if hasattr(x, "staged"):  # ZeRO's FlatShard views
        return x.staged(_copied(x.flat, kept, key))
    if hasattr(x, "to_local") and hasattr(x, "device_mesh"):  # DTensor: copy the local shard, keep the layout
        from torch.distributed.tensor import DTensor

        local = _copied(x.to_local(), kept, key)
        return DTensor.from_local(local, x.device_mesh, x.placements, run_check=False, shape=x.shape,
                                  stride=x.stride())
    if torch.is_tensor(x):
        return _copied(x, kept, key)
    if isinstance(x, dict):
        return {k: _stage(v, kept, f"{key}.{k}") for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_stage(v, kept, f"{key}.{i}") for i, v in enumerate(x))
    return x


def _copied(t: torch.Tensor, kept: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    t = t.detach()
    buffer = kept.get(key)
    if (buffer is None or buffer.shape != t.shape or buffer.dtype != t.dtype
            or buffer.stride() != t.stride()):
        buffer = kept[key] = t.to("cpu", copy=True)
    else:
        buffer.copy_(t)
    return buffer


def local_bytes(x: Any) -> int:
    """Bytes of `x` this rank holds: a DTensor's local shard, a FlatShard's range, a tensor."""
    if hasattr(x, "to_local"):
        x = x.to_local()
    if torch.is_tensor(x):
        return x.numel() * x.element_size()
    return int(getattr(x, "nbytes", 0))


def leaves(state: Any) -> Iterator[Any]:
    if isinstance(state, dict):
        for v in state.values():
            yield from leaves(v)
    elif isinstance(state, (list, tuple)):
        for v in state:
            yield from leaves(v)
    else:
        yield state


def _rank_record(tmp: Path, me: int, state: dict[str, Any], hashed: dict[str, str]) -> dict[str, Any]:
    """What this rank wrote: counts, bytes, and each file's size and checksum (`hashed` while written)."""
    names = [p.name for p in tmp.glob(f"__{me}_*{fmt.DCP_DATA_SUFFIX}")] + [fmt.rng_file(me)]
    if me == 0:
        names += [fmt.DCP_METADATA] + ([fmt.SCHEDULER] if (tmp / fmt.SCHEDULER).exists() else [])
    held = [x for x in leaves(state) if not isinstance(x, (int, float, str, type(None)))]
    return {
        "rank": me,
        "tensors": len(held),
        "bytes": sum(local_bytes(x) for x in held),
        "files": {n: {"bytes": (tmp / n).stat().st_size, fmt.CHECKSUM: hashed.get(n) or fmt.checksum(tmp / n)}
                  for n in sorted(names)},
    }


def _tensor_shapes(metadata: Any) -> dict[str, dict[str, Any]]:
    shapes = {}
    for key, md in metadata.state_dict_metadata.items():
        if hasattr(md, "size"):
            shapes[key] = {"shape": list(md.size), "dtype": str(md.properties.dtype).removeprefix("torch.")}
    return shapes


def _manifest_base(trainer: Any, groups: list[dict[str, Any]]) -> dict[str, Any]:
    model = trainer.unwrapped_model
    hf_config = getattr(model, "config", None)
    hf = None
    if hasattr(hf_config, "to_json_string"):  # a transformers model: its config, for from_pretrained
        hf = json.loads(hf_config.to_json_string(use_diff=False))
    return {
        "format": fmt.FORMAT,
        "strategy": trainer.strategy,
        "config": trainer.config.to_dict(),
        "world_size": dist.get_world_size() if distributed() else 1,
        "step": trainer.steps,
        "model_class": _user_class(model),
        "hf_config": hf,
        "tied": _tied_names(model, hf),
        "param_groups": [_plain({k: v for k, v in g.items() if k != "params"}) for g in groups],
        "scheduler": getattr(trainer, "lr_scheduler", None) is not None,
        "written": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__.split("+")[0],
        "mpnb": __version__,
    }


def _user_class(model: torch.nn.Module) -> str:
    """The model's own class: FSDP2 swaps in a subclass (FSDPGPT for GPT) that the user never wrote."""
    from torch.distributed.fsdp import FSDPModule

    cls = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
    return f"{cls.__module__}.{cls.__qualname__}"


def _tied_names(model: torch.nn.Module, hf: dict[str, Any] | None) -> list[str]:
    """Weights that alias another one (a tied LM head): exports drop them, from_pretrained re-ties them."""
    seen: set[int] = set()
    tied = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.append(name)
        seen.add(id(p))
    if hf and hf.get("tie_word_embeddings") and "lm_head.weight" not in tied:
        out = getattr(model, "get_output_embeddings", lambda: None)()
        if out is not None:
            tied.append("lm_head.weight")
    return tied


def _plain(x: Any) -> Any:
    """JSON-safe: tensors to numbers, tuples to lists."""
    if torch.is_tensor(x):
        return x.item() if x.numel() == 1 else x.tolist()
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x if isinstance(x, (int, float, str, bool, type(None))) else repr(x)


def _write_manifest(tmp: Path, manifest: dict[str, Any]) -> None:
    path = tmp / fmt.MANIFEST
    with open(path, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _announce(handle: SaveHandle, manifest: dict[str, Any], ranks: list[dict[str, Any]]) -> None:
    """Tell the sidebar (never fails a save)."""
    try:
        from mpnb.engine.checkpoint.announce import announce_checkpoint
    except ImportError:
        return
    announce_checkpoint({
        "path": str(handle.path), "step": manifest["step"], "strategy": manifest["strategy"],
        "world_size": manifest["world_size"], "seconds": handle.seconds,
        "bytes": sum(f["bytes"] for r in ranks for f in r["files"].values()),
    })
