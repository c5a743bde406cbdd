"""DCP's file reader, reading each file once: checksum first, then the tensors straight from memory.

Stock `FileSystemReader.read_data` runs `torch.load` on every saved tensor and
copies each twice (out of the file, then into the model), and checking checksums
before it would read every file a second time. Here each file is checked
by one rank, the one that needs most of it (in a resume at the same world size:
the rank that wrote it), which reads it whole and compares its checksum with the
manifest's; other ranks read only the tensors they need from it. Only when every
rank found its files intact are the tensors copied into the model, straight from
those bytes (`saved_tensor.tensor_view`). The files are DCP's own, unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import mmap
import os
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from mpnb.checkpoints import format as fmt
from mpnb.engine.checkpoint.saved_tensor import tensor_view

# files read at once: one thread waits on the disk while another hashes (both release the GIL)
READ_THREADS = 2
# mapped bytes hashed per call: xxh3 releases the GIL inside a call, so large slices let the hashing
# (and the disk reads its page faults wait on) run beside the planning; with 4 MB slices each call
# waited up to 5 ms for the GIL, doubling a cold file's check while Python ran beside it
HASH_SLICE = 1 << 28


def _mapped_or_read(f: Any) -> memoryview:
    """The whole file: mapped (the kernel reads ahead of the hashing), or read where it cannot be."""
    size = os.fstat(f.fileno()).st_size
    if size == 0:
        return memoryview(b"")
    try:
        mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    except OSError:  # a file system without mmap
        data = bytearray(size)
        view = memoryview(data)
        got = 0
        while got < size and (n := f.readinto(view[got:got + fmt.READ_CHUNK])):
            got += n
        return view[:got]
    mapped.madvise(mmap.MADV_SEQUENTIAL)
    mapped.madvise(mmap.MADV_WILLNEED)
    return memoryview(mapped)


class VerifiedFileReader(FileSystemReader):
    """`FileSystemReader` for a checkpoint whose manifest lists each file's size and checksum.

    `agree(problems)` runs on every rank with the damage this rank found and must raise
    the same error everywhere if any rank found some; nothing is copied into the
    model before it returns.
    """

    def __init__(self, path: str | os.PathLike[str], files: dict[str, tuple[int, dict[str, Any]]],
                 agree: Callable[[list[str]], None]) -> None:
        super().__init__(path)
        self._files = files  # name -> (writing rank, {"bytes", checksum})
        self._agree = agree
        self._pool: ThreadPoolExecutor | None = None
        self._checks: dict[str, futures.Future[tuple[memoryview, str | None]]] = {}

    def check_early(self, names: list[str]) -> None:
        """Start reading and checking `names` now, on threads: the disk then works while the load
        compares shapes and DCP plans (the kernel's own read-ahead stops at a few MB per file)."""
        for name in names:
            self._check(name)

    def close(self) -> None:
        """Drop the checks not yet started (a load that failed before reading)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._checks.clear()

    def _check(self, name: str) -> futures.Future[tuple[memoryview, str | None]]:
        if name not in self._checks:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="mpnb-checkpoint-read")
            self._checks[name] = self._pool.submit(self._read_checked, name)
        return self._checks[name]

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Name in each rank's plan the files it checks: each file read by the rank needing most of it."""
        needed: dict[str, list[int]] = {}
        for r, plan in enumerate(plans):
            for item in plan.items:
                stored = self.storage_data[item.storage_index]
                needed.setdefault(stored.relative_path, [0] * len(plans))[r] += stored.length
        checks: list[list[str]] = [[] for _ in plans]
        for name, per_rank in needed.items():
            checks[max(range(len(plans)), key=lambda r: (per_rank[r], -r))].append(name)
        return [dataclasses.replace(plan, storage_data=own) for plan, own in zip(plans, checks, strict=True)]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        checked = set(plan.storage_data or ()) | set(self._checks)  # those started early count too
        started = {name: self._check(name) for name in sorted(checked)}
        whole = {name: check.result() for name, check in started.items()}
        self.close()
        self._agree([problem for _, problem in whole.values() if problem])
        for name, items in per_file.items():
            data = whole.pop(name)[0] if name in whole else None
            path = self.fs.concat_path(self.path, name)
            with contextlib.nullcontext() if data is not None else open(path, "rb", buffering=0) as f:
                for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
                    self._load_item(self._blob(item, data, f), item, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _blob(self, item: ReadItem, data: memoryview | None, f: Any) -> memoryview:
        """The bytes of `item`: from the file read whole, else read now (a file another rank checks)."""
        stored = self.storage_data[item.storage_index]
        if data is not None:
            return data[stored.offset:stored.offset + stored.length]
        blob = bytearray(stored.length)
        f.seek(stored.offset)
        f.readinto(blob)
        return memoryview(blob)

    def _read_checked(self, name: str) -> tuple[memoryview, str | None]:
        """The file's bytes, mapped, and what is wrong with them, if anything.

        Mapped rather than read: the tensors are copied into the model straight from the page cache
        (a read would copy every byte once more, into fresh pages faulted in one by one), and the
        kernel reads ahead while the chunks are hashed. The sizes were checked against the manifest
        before any file was opened; private mapping: `torch.frombuffer` wants a writable buffer."""
        path = self.fs.concat_path(self.path, name)
        writer, info = self._files.get(name, (None, {}))
        if writer is None:
            return memoryview(b""), f"{name} is not listed in the manifest"
        digest = fmt.Digest(info)
        try:  # a rank raising here would leave the others waiting in `agree`
            with open(path, "rb", buffering=0) as f:
                view = _mapped_or_read(f)
        except (OSError, ValueError) as e:
            return memoryview(b""), f"{name} (rank {writer}) cannot be read ({e})"
        for at in range(0, len(view), HASH_SLICE):
            digest.update(view[at:at + HASH_SLICE])
        if len(view) != info["bytes"] or digest.differs():
            return view, fmt.changed_bytes(name, writer)
        return view, None

    def _load_item(self, blob: memoryview, item: ReadItem, planner: LoadPlanner) -> None:
        stored = self.storage_data[item.storage_index]
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(blob))
            return
        tensor = None if stored.transform_descriptors else tensor_view(blob)
        if tensor is None:  # DCP's own way: a transformed or unusual record
            stream = self.transforms.transform_load_stream(item, stored.transform_descriptors or (),
                                                           io.BytesIO(blob))
            tensor = torch.load(io.BytesIO(stream.read()), map_location="cpu", weights_only=True)
        tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise AssertionError(f"{item.storage_index}: saved {tuple(tensor.size())}, "
                                 f"model {tuple(target.size())}")
        target.copy_(tensor)
        planner.commit_tensor(item, target)
