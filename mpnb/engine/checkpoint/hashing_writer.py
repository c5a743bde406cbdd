"""DCP's file writer, hashing each tensor file as it writes it, so the manifest's checksums need no re-read.

DCP writes every file front to back (torch's zip writer never seeks back), so the
xxh3 of the bytes handed to `write` is the xxh3 of the file.
"""

from __future__ import annotations

import contextlib
import io
import os
import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import xxhash
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem, SerializationFormat
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from mpnb.checkpoints import format as fmt
from mpnb.engine.checkpoint.record_writer import write_files


class _HashingStream(io.RawIOBase):
    def __init__(self, raw: Any, digest: Any) -> None:
        super().__init__()
        self._raw, self._digest = raw, digest

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self._digest.update(data)
        return self._raw.write(data)

    def tell(self) -> int:
        return self._raw.tell()

    def fileno(self) -> int:
        return self._raw.fileno()

    def flush(self) -> None:
        if not self._raw.closed:  # a wrapper collected after its file was closed flushes nothing
            self._raw.flush()


class _HashingFileSystem(FileSystem):
    def __init__(self) -> None:
        super().__init__()
        self.checksums: dict[str, str] = {}  # file name -> xxh3 hex, for DCP's tensor files

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        name = Path(path).name
        with super().create_stream(path, mode) as stream:
            if "w" not in mode or not name.endswith(fmt.DCP_DATA_SUFFIX):
                yield stream
                return
            digest = xxhash.xxh3_64()
            yield _HashingStream(stream, digest)
        self.checksums[name] = digest.hexdigest()


class HashingFileSystemWriter(FileSystemWriter):
    """`FileSystemWriter` whose `checksums` name the xxh3 of each tensor file it wrote, its tensors
    written from templates (`record_writer`)."""

    def __init__(self, path: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.fs = _HashingFileSystem()

    def _write_data(self, planner: SavePlanner, file_queue: queue.Queue) -> Future[list[WriteResult]]:
        if self.serialization_format != SerializationFormat.TORCH_SAVE or self.transforms.extensions:
            return super()._write_data(planner, file_queue)
        results: queue.Queue = queue.Queue()
        errors: list[BaseException] = []

        def write() -> None:
            try:
                write_files(self.fs.create_stream, file_queue, results, planner, self.sync_files)
            except BaseException as e:  # raised on the calling thread, below
                errors.append(e)

        threads = [threading.Thread(target=write, name="mpnb-checkpoint-file", daemon=True)
                   for _ in range(1, self.thread_count)]
        for thread in threads:
            thread.start()
        write()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        written: list[WriteResult] = []
        while not results.empty():
            written += results.get_nowait()
        done: Future[list[WriteResult]] = Future()
        done.set_result(written)
        return done

    @property
    def checksums(self) -> dict[str, str]:
        return self.fs.checksums
