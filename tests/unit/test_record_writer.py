"""Tensor files written from templates (`record_writer`) are byte for byte those DCP's own loop writes."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter, load, save

from mpnb.engine.checkpoint import record_writer
from mpnb.engine.checkpoint.hashing_writer import HashingFileSystemWriter
from mpnb.engine.checkpoint.record_writer import without_zip_crc32

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning"),  # deprecated; still saved
]


def _state() -> dict[str, object]:
    torch.manual_seed(0)
    big = torch.randn(6, 8)
    return {
        "layer0.w": torch.randn(4, 3),
        "layer1.w": torch.randn(4, 3),  # the same layout: written from the template
        "layer2.w": torch.randn(4, 3),
        "bf16": torch.randn(5).to(torch.bfloat16),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "steps": torch.tensor([7], dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "transposed": big.t(),  # not contiguous: torch.save's own way
        "slice": big[1:3],  # a view into a larger storage: copied out first, as DCP does
        "param": torch.nn.Parameter(torch.randn(4, 3)),
        "note": {"epoch": 3, "name": "run"},  # not a tensor: pickled bytes
    }


@pytest.fixture(autouse=True)
def dcp_threads_without_crc32(monkeypatch: pytest.MonkeyPatch) -> None:
    """DCP's own writer threads with the CRC-32 off as well, as mpnb's are: the reference files."""
    from torch.distributed.checkpoint import filesystem

    write = filesystem._write_files_from_queue

    def without(*args: object, **kwargs: object) -> None:
        with without_zip_crc32():
            write(*args, **kwargs)

    monkeypatch.setattr(filesystem, "_write_files_from_queue", without)


def _save(path: Path, writer: FileSystemWriter) -> None:
    save(_state(), storage_writer=writer, no_dist=True)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_files_are_the_ones_dcp_writes(tmp_path: Path, threads: int) -> None:
    _save(tmp_path / "dcp", FileSystemWriter(tmp_path / "dcp", thread_count=threads))
    ours = HashingFileSystemWriter(tmp_path / "ours", thread_count=threads)
    _save(tmp_path / "ours", ours)
    _save(tmp_path / "again", HashingFileSystemWriter(tmp_path / "again", thread_count=threads))
    names = sorted(p.name for p in (tmp_path / "dcp").glob("*.distcp"))
    assert names and names == sorted(p.name for p in (tmp_path / "ours").glob("*.distcp"))
    for name in names:
        want = (tmp_path / "dcp" / name).read_bytes()
        assert (tmp_path / "ours" / name).read_bytes() == want, name
        assert (tmp_path / "again" / name).read_bytes() == want, name  # every layout from its template
    assert set(ours.checksums) == set(names)
    meta = [FileSystemReader(tmp_path / d).read_metadata().storage_data for d in ("dcp", "ours")]
    assert meta[0] == meta[1]


def test_dcps_own_reader_reads_them_back(tmp_path: Path) -> None:
    _save(tmp_path / "ck", HashingFileSystemWriter(tmp_path / "ck", thread_count=2))
    _save(tmp_path / "ck2", HashingFileSystemWriter(tmp_path / "ck2", thread_count=2))
    want = _state()
    got = {k: torch.zeros_like(v) if torch.is_tensor(v) else {"epoch": 0, "name": ""}
           for k, v in want.items()}
    load(got, storage_reader=FileSystemReader(tmp_path / "ck2"), no_dist=True)
    for key, value in want.items():
        if torch.is_tensor(value):
            assert torch.equal(got[key], value), key
    assert got["note"] == want["note"]


def test_a_checksummed_zip_is_never_templated() -> None:
    tensor = torch.randn(3, 2)
    assert record_writer._layout(tensor) is None  # CRC-32 on (torch's default): it covers the data
    with without_zip_crc32():
        assert record_writer._layout(tensor) == (torch.float32, (3, 2), (2, 1))
        assert record_writer._layout(tensor.t()) is None
        assert record_writer._layout(torch.randn(2, dtype=torch.complex64).conj()) is None
        assert record_writer._layout(torch.quantize_per_tensor(tensor, 0.1, 0, torch.qint8)) is None
        assert record_writer._layout(tensor.requires_grad_()) is None
    expected = io.BytesIO()
    torch.save(torch.ones(3, 2), expected)
    written = io.BytesIO()
    record_writer.write_tensor(written, torch.ones(3, 2))
    assert written.getvalue() == expected.getvalue()


def test_every_writing_thread_writes_plain_tensors_from_templates(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _save(tmp_path / "first", HashingFileSystemWriter(tmp_path / "first", thread_count=2))  # the templates
    saved: list[tuple[int, ...]] = []
    torch_save = torch.save

    def counting(obj: object, *args: object, **kwargs: object) -> None:
        if torch.is_tensor(obj):
            saved.append(tuple(obj.shape))
        torch_save(obj, *args, **kwargs)

    monkeypatch.setattr(torch, "save", counting)
    _save(tmp_path / "again", HashingFileSystemWriter(tmp_path / "again", thread_count=2))
    state = _state()
    assert len(list((tmp_path / "again").glob("*.distcp"))) == 2
    assert saved == [tuple(state["transposed"].shape)]  # not contiguous: the only one torch.save writes
