"""DCP's file writer, hashing each tensor file as it writes it, so the manifest's checksums need no re-read.

DCP writes every file front to back (torch's zip writer never seeks back), so the
xxh3 of the bytes handed to `write` is the xxh3 of the file.
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import xxhash
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from mpnb.checkpoints import format as fmt


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
    """`FileSystemWriter` whose `checksums` name the xxh3 of each tensor file it wrote."""

    def __init__(self, path: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.fs = _HashingFileSystem()

    @property
    def checksums(self) -> dict[str, str]:
        return self.fs.checksums
