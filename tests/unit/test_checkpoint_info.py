"""`mpnb.checkpoint_info` and `%mpnb checkpoint info|list` on real checkpoints written in this process.

`mpnb.prepare` outside a cluster trains at world size 1 and `trainer.save` writes
the same DCP directory + manifest the ranks write, so no cluster is needed here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import mpnb
from mpnb.checkpoints.info import checkpoint_info, list_checkpoints
from mpnb.errors import CheckpointError
from mpnb.planning.config import Config

STEPS = 3


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mpnb.models import synthetic_batches, tiny_gpt

    torch.manual_seed(0)
    net = tiny_gpt(0)
    trainer = mpnb.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-3), config={"strategy": "ddp"})
    for batch in synthetic_batches(batch_size=8, steps=STEPS):
        trainer.step(batch)
    path = tmp_path_factory.mktemp("ckpts") / "run" / "step3"
    path.parent.mkdir()
    trainer.save(path)
    return path


@pytest.fixture
def no_cluster() -> None:
    from mpnb.cluster import session as cluster

    assert cluster.current() is None  # "the active config" below is only what the tests pass


def _copy(saved: Path, to: Path) -> Path:
    shutil.copytree(saved, to)
    return to


def test_info_reads_what_the_manifest_says(saved: Path, no_cluster: None) -> None:
    from mpnb.models import tiny_gpt

    info = mpnb.checkpoint_info(saved)
    assert (info.step, info.world_size, info.strategy) == (STEPS, 1, "ddp")
    assert info.model_class.endswith(".GPT")
    assert info.config["strategy"] == "ddp"
    assert info.model_tensors == len(tiny_gpt(0).state_dict())
    assert info.tensors > info.model_tensors  # AdamW's moments are in it too
    on_disk = sum(f.stat().st_size for f in saved.rglob("*") if f.is_file() and f.name != "mpnb.json")
    assert info.bytes == on_disk > 0
    [rank] = info.ranks
    assert rank.rank == 0 and rank.tensors > 0 and rank.bytes > 0 and rank.file_bytes == info.bytes
    assert info.problems == [] and info.can_resume() and info.why_not() is None
    text = repr(info)
    assert f"step {STEPS}" in text and "resumable here: yes" in text
    page = info._repr_html_()
    assert "<table>" in page and ">yes<" in page and str(saved) in page


def test_resharding_is_no_reason_but_an_impossible_config_is(saved: Path, no_cluster: None) -> None:
    info = checkpoint_info(saved)
    assert info.can_resume(Config().update(strategy="fsdp"), world_size=8)  # written on 1 rank: reshards
    tp = Config().update(strategy="tensor", tensor_parallel=2)
    assert info.can_resume(tp, world_size=4)
    why = info.why_not(tp.to_dict(), world_size=3)  # a plain dict, as on the engines, works too
    assert why is not None and "cannot run on 3 ranks" in why and "tensor_parallel=2" in why
    assert not info.can_resume(tp, world_size=3)
    assert info.can_resume(tp)  # no cluster, no world size: nothing to hold it against


def test_truncated_and_corrupted_files_are_found(saved: Path, tmp_path: Path, no_cluster: None) -> None:
    short = _copy(saved, tmp_path / "short")
    shard = next(short.glob("__0_*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    (short / "rng" / "rank0.pt").unlink()
    info = checkpoint_info(short)
    assert len(info.problems) == 2
    assert any(shard.name in p and f"{len(data) // 2} bytes" in p for p in info.problems)
    assert any("rng/rank0.pt (rank 0) is missing" in p for p in info.problems)
    why = info.why_not(Config(), world_size=1)
    assert why is not None and why.startswith("the checkpoint is damaged") and shard.name in why
    assert "resumable here: no, the checkpoint is damaged" in repr(info)

    flipped = _copy(saved, tmp_path / "flipped")
    shard = next(flipped.glob("__0_*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum tells
    shard.write_bytes(bytes(data))
    assert checkpoint_info(flipped).problems == []
    [problem] = checkpoint_info(flipped, verify=True).problems
    assert shard.name in problem and "checksum differs" in problem


def test_checkpoints_written_with_crc32_sums_are_still_verified(saved: Path, tmp_path: Path) -> None:
    import zlib

    older = _copy(saved, tmp_path / "older")
    manifest_path = older / "mpnb.json"
    manifest = json.loads(manifest_path.read_text())
    for rank in manifest["ranks"]:
        for name, entry in rank["files"].items():
            del entry["xxh3"]
            entry["crc32"] = zlib.crc32((older / name).read_bytes())
    manifest_path.write_text(json.dumps(manifest))
    assert checkpoint_info(older, verify=True).problems == []
    shard = next(older.glob("__0_*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-7] ^= 0x01
    shard.write_bytes(bytes(data))
    [problem] = checkpoint_info(older, verify=True).problems
    assert shard.name in problem and "checksum differs" in problem


@pytest.mark.parametrize("make", ["missing", "file", "empty_dir", "other_format"])
def test_what_is_not_a_checkpoint_is_a_checkpoint_error(tmp_path: Path, make: str) -> None:
    path = tmp_path / "x"
    if make == "file":
        path.write_text("not a checkpoint")
    elif make == "empty_dir":
        path.mkdir()
    elif make == "other_format":
        path.mkdir()
        (path / "mpnb.json").write_text(json.dumps({"format": "something-else/9"}))
    expected = {"missing": "does not exist", "file": "is a file", "empty_dir": "has no mpnb.json",
                "other_format": "something-else/9"}[make]
    with pytest.raises(CheckpointError, match=expected):
        checkpoint_info(path)


def _rewrite_written(path: Path, written: str) -> None:
    manifest = json.loads((path / "mpnb.json").read_text())
    manifest["written"] = written
    (path / "mpnb.json").write_text(json.dumps(manifest))


def test_list_finds_checkpoints_newest_first_and_skips_hidden_ones(saved: Path, tmp_path: Path) -> None:
    older = _copy(saved, tmp_path / "a" / "older")
    newer = _copy(saved, tmp_path / "b" / "newer")
    _copy(saved, tmp_path / ".newer.partial-1234")  # a save in progress
    (tmp_path / "notes").mkdir()
    _rewrite_written(older, "2026-01-01T00:00:00+00:00")
    _rewrite_written(newer, "2026-02-01T00:00:00+00:00")
    assert [i.path for i in list_checkpoints(tmp_path)] == [newer, older]
    assert list_checkpoints(tmp_path, depth=0) == []


def test_magic_info_shows_the_info_and_list_prints_a_table(ipython: Any, saved: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str],
                                                           no_cluster: None) -> None:
    magics = ipython.magics_manager.registry["MpnbMagics"]
    shown = magics.mpnb(f"checkpoint info {saved}")
    assert shown.step == STEPS and shown.path == saved
    damaged = _copy(saved, tmp_path / "damaged")
    next(damaged.glob("__0_*.distcp")).unlink()
    magics.mpnb(f"checkpoint list {tmp_path}")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["path", "step", "strategy", "ranks", "size", "written"]
    assert lines[1].split()[:4] == ["damaged", str(STEPS), "ddp", "1"] and lines[1].endswith("DAMAGED")
    magics.mpnb(f"checkpoint list {tmp_path / 'damaged' / 'rng'}")
    assert "No checkpoints in" in capsys.readouterr().out
    with pytest.raises(CheckpointError, match="does not exist"):
        magics.mpnb(f"checkpoint info {tmp_path / 'nothing'}")
    with pytest.raises(CheckpointError, match="needs a PATH"):
        magics.mpnb("checkpoint info")
    with pytest.raises(mpnb.NoClusterError):  # save and load need the ranks
        magics.mpnb(f"checkpoint save {tmp_path / 'new'}")
