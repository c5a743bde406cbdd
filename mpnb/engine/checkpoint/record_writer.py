"""DCP's tensor files written as DCP writes them, each tensor's record from a template of its layout.

DCP's `FileSystemWriter` runs `torch.save` once per tensor: with its stream wrappers about
0.5 ms each (a pickler, a zip writer, ~40 small writes through Python), 0.15 s of CPU for a
GPT's 308 tensors at 115 MB per rank. That is as much as a `torch.save` of all the same bytes,
and it is what a background save takes from the training loop on CPU ranks. Two tensors of one
layout (dtype, shape, strides) saved with the zip's CRC-32 off (`without_zip_crc32`)
differ only in their data bytes, so the first `torch.save` of a layout is split around its data
record, and each later tensor of that layout is written as prefix + its bytes + suffix. The
files are byte for byte the ones DCP's own loop writes (tests/unit/test_record_writer.py).
"""

from __future__ import annotations

import contextlib
import io
import os
import queue
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from mpnb.engine.checkpoint.saved_tensor import zip_records

DATA_RECORD = "archive/data/0"  # torch.save's record of a lone tensor's storage (to a stream)

# (dtype, shape, strides) -> (bytes before the data, bytes after), or None: not splittable
_templates: dict[tuple[Any, ...], tuple[bytes, bytes] | None] = {}


@contextlib.contextmanager
def without_zip_crc32() -> Iterator[None]:
    """In this thread (torch's serialization settings are per thread), `torch.save` writes no CRC-32:
    `torch.load` never checks it, and the manifest's xxh3 of every file covers each byte."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


def write_tensor(stream: Any, tensor: torch.Tensor) -> None:
    """Write `torch.save(tensor)`'s bytes to `stream`."""
    key = _layout(tensor)
    parts = _templates.get(key) if key is not None else None
    if parts is None:
        saved = io.BytesIO()
        torch.save(tensor, saved)
        if key is not None and key not in _templates:
            _templates[key] = _split(saved.getbuffer(), tensor.nbytes)
        stream.write(saved.getbuffer())
        return
    prefix, suffix = parts
    stream.write(prefix)
    if tensor.nbytes:
        stream.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
    stream.write(suffix)


def _layout(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    """What `torch.save` writes besides the data, for a tensor it writes as its bytes alone."""
    plain = (
        type(tensor) is torch.Tensor
        and tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and not (tensor.is_quantized or tensor.is_nested or tensor.is_conj() or tensor.is_neg())
        and tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.nbytes
        and not tensor.requires_grad
        and not tensor.__dict__
        and not torch.serialization.get_crc32_options()  # else the zip holds a checksum of the data
    )
    return (tensor.dtype, tuple(tensor.shape), tuple(tensor.stride())) if plain else None


def _split(saved: memoryview, nbytes: int) -> tuple[bytes, bytes] | None:
    data = zip_records(saved).get(DATA_RECORD)
    if data is None or data.size != nbytes:
        return None
    return bytes(saved[:data.start]), bytes(saved[data.start + nbytes:])


def write_files(create_stream: Callable[..., Any], files: queue.Queue, results: queue.Queue,
                planner: SavePlanner, sync_files: bool) -> None:
    """DCP's `_write_files_from_queue` for CPU tensors without stream transforms: the files in
    `files` ((path, storage key, items) each), byte items first, each its `WriteResult`s in `results`.
    Called on each writing thread: the CRC-32 setting is the calling thread's."""
    with without_zip_crc32():
        _write_files(create_stream, files, results, planner, sync_files)


def _write_files(create_stream: Callable[..., Any], files: queue.Queue, results: queue.Queue,
                 planner: SavePlanner, sync_files: bool) -> None:
    while True:
        try:
            path, storage_key, items = files.get_nowait()
        except queue.Empty:
            return
        written = []
        byte_items = [item for item in items if item.type == WriteItemType.BYTE_IO]
        with create_stream(path, "wb") as stream:
            for item in byte_items + [item for item in items if item.type != WriteItemType.BYTE_IO]:
                data = planner.resolve_data(item)
                offset = stream.tell()
                if item.type == WriteItemType.BYTE_IO:
                    stream.write(data.getbuffer())
                else:
                    write_tensor(stream, _own_storage(data))
                written.append(_result(item, storage_key, offset, stream.tell()))
            if sync_files:
                os.fsync(stream.fileno())
        results.put(written)


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """As DCP's loader hands it over: on the CPU, and a view copied out of a larger storage."""
    tensor = tensor.detach().cpu()
    return tensor.clone() if tensor.untyped_storage().size() != tensor.nbytes else tensor


def _result(item: WriteItem, storage_key: str, start: int, end: int) -> WriteResult:
    return WriteResult(index=item.index, size_in_bytes=end - start,
                       storage_data=_StorageInfo(storage_key, start, end - start))
