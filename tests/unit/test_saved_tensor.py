"""Reading DCP's per-tensor `torch.save` zips without `torch.load`, and the reader built on it.

`tensor_view` must give exactly what `torch.load` gives for every plain tensor
(any dtype, layout, view, size), share the bytes it was handed, and decline
everything else. `trainer.load` through `VerifiedFileReader` (world size 1: the
same DCP files the ranks write) must restore the state and refuse damaged files
before changing the model; each file is checked by the rank that needs most of it.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

import mpnb
from mpnb.engine.checkpoint import verified_reader
from mpnb.engine.checkpoint.saved_tensor import tensor_view
from mpnb.errors import CheckpointError
from mpnb.models import synthetic_batches, tiny_gpt


def _saved(obj: object) -> memoryview:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return memoryview(bytearray(buffer.getvalue()))


BASE = torch.randn(6, 8)
PLAIN = {
    "float32": torch.randn(3, 4),
    "transposed": BASE.t(),
    "a view into a bigger storage": BASE[2:4, 1:5],
    "bfloat16": torch.randn(5).bfloat16(),
    "float16": torch.randn(2, 3).half(),
    "int64": torch.arange(7),
    "bool": torch.tensor([True, False, True]),
    "0-d": torch.tensor(3.5),
    "empty": torch.empty(0, 3),
}


@pytest.mark.parametrize("name", list(PLAIN))
def test_plain_tensors_read_back_as_torch_load_reads_them(name: str) -> None:
    blob = _saved(PLAIN[name])
    view = tensor_view(blob)
    loaded = torch.load(io.BytesIO(blob), weights_only=True)
    assert view is not None
    assert view.dtype == loaded.dtype and view.shape == loaded.shape and view.stride() == loaded.stride()
    assert torch.equal(view, loaded)


def test_the_view_shares_the_bytes_it_was_given() -> None:
    blob = _saved(torch.zeros(4))
    view = tensor_view(blob)
    assert view is not None
    view.fill_(2.0)  # written through to the buffer: no copy was made
    assert torch.equal(torch.load(io.BytesIO(blob), weights_only=True), torch.full((4,), 2.0))


NOT_PLAIN = [torch.nn.Parameter(torch.ones(2)), {"a": torch.ones(2)}, 3, [torch.ones(1)]]


@pytest.mark.parametrize("other", NOT_PLAIN, ids=["parameter", "dict", "int", "list"])
def test_anything_but_a_plain_tensor_is_declined(other: object) -> None:
    assert tensor_view(_saved(other)) is None


def test_bytes_that_are_not_a_zip_are_declined() -> None:
    assert tensor_view(memoryview(bytearray(b"not a torch.save file" * 10))) is None


def _trained(steps: int) -> mpnb.Trainer:
    torch.manual_seed(0)
    net = tiny_gpt(0)
    trainer = mpnb.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-3), config={"strategy": "ddp"})
    for batch in synthetic_batches(batch_size=4, steps=steps):
        trainer.step(batch)
    return trainer


def _state(trainer: mpnb.Trainer) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in trainer.unwrapped_model.named_parameters()}
    model = {f"model.{k}": v.clone() for k, v in trainer.unwrapped_model.state_dict().items()}
    moments = {f"optim.{names[id(p)]}.{k}": v.clone() for p, s in trainer.optimizer.state.items()
               for k, v in s.items()}
    return {**model, **moments}


@pytest.fixture(params=["mapped", "read"])
def file_access(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Checkpoint files mapped, or read where the file system cannot map them."""
    if request.param == "read":
        def refuse(*args: object, **kwargs: object) -> None:
            raise OSError(19, "No such device")  # what mmap says on a file system without it

        monkeypatch.setattr(verified_reader.mmap, "mmap", refuse)
    return request.param


def test_a_load_restores_weights_and_moments(tmp_path: Path, file_access: str) -> None:
    source = _trained(3)
    source.save(tmp_path / "ck")
    fresh = _trained(1)
    fresh.load(tmp_path / "ck")
    want, got = _state(source), _state(fresh)
    assert want.keys() == got.keys()
    assert [k for k in want if not torch.equal(want[k], got[k])] == []
    assert fresh.steps == 3


def test_a_damaged_tensor_file_is_refused_before_the_model_changes(tmp_path: Path, file_access: str) -> None:
    _trained(3).save(tmp_path / "ck")
    shard = next((tmp_path / "ck").glob("__0_*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum tells
    shard.write_bytes(data)
    fresh = _trained(1)
    before = _state(fresh)
    with pytest.raises(CheckpointError, match=rf"damaged: {shard.name} \(rank 0\).*checksum differs"):
        fresh.load(tmp_path / "ck")
    after = _state(fresh)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert fresh.steps == 1


def test_each_file_is_checked_by_the_rank_that_needs_most_of_it(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    from mpnb.engine.checkpoint.verified_reader import VerifiedFileReader

    stored = {("a", 0): ("__0_0.distcp", 100), ("b", 0): ("__0_0.distcp", 5),
              ("c", 0): ("__1_0.distcp", 100), ("step", 0): ("__1_0.distcp", 8)}
    reader = VerifiedFileReader(tmp_path, {}, lambda problems: None)
    reader.storage_data = {MetadataIndex(fqn, index=i): _StorageInfo(name, 0, length)
                           for (fqn, i), (name, length) in stored.items()}

    def plan(*fqns: str) -> LoadPlan:
        return LoadPlan([ReadItem(LoadItemType.TENSOR, MetadataIndex(f, index=0), torch.Size([0]),
                                  MetadataIndex(f, index=0), torch.Size([0]), torch.Size([1])) for f in fqns])

    # rank 0 needs its own file and a replicated scalar rank 1 wrote; rank 1 its file and a bit of rank 0's
    plans = reader.prepare_global_plan([plan("a", "step"), plan("b", "c", "step")])
    assert [p.storage_data for p in plans] == [["__0_0.distcp"], ["__1_0.distcp"]]
    assert [len(p.items) for p in plans] == [2, 3]  # what each reads is unchanged


def test_checksums_hashed_while_writing_match_the_files(tmp_path: Path) -> None:
    from mpnb.checkpoints import format as fmt

    _trained(1).save(tmp_path / "ck")
    listed = fmt.listed_files(fmt.read_manifest(tmp_path / "ck"))
    assert any(name.endswith(fmt.DCP_DATA_SUFFIX) for _, name, _ in listed)
    assert {name: info[fmt.CHECKSUM] for _, name, info in listed} == {
        name: fmt.checksum(tmp_path / "ck" / name) for _, name, _ in listed}


def test_each_tensor_file_is_checked_once_starting_before_the_load_plans(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    _trained(3).save(tmp_path / "ck")
    fresh = _trained(1)
    checked: list[str] = []
    started = threading.Event()
    read_checked = verified_reader.VerifiedFileReader._read_checked

    def counting(self: verified_reader.VerifiedFileReader, name: str) -> object:
        checked.append(name)
        started.set()
        return read_checked(self, name)

    monkeypatch.setattr(verified_reader.VerifiedFileReader, "_read_checked", counting)
    live_state = fresh.checkpoint_state
    started_before_planning: list[bool] = []

    def state_once_reading() -> dict:
        started_before_planning.append(started.wait(5))
        return live_state()

    monkeypatch.setattr(fresh, "checkpoint_state", state_once_reading)
    fresh.load(tmp_path / "ck")
    assert started_before_planning == [True]
    files = sorted(p.name for p in (tmp_path / "ck").glob("*.distcp"))
    assert sorted(checked) == files


def test_a_load_into_the_live_tensors_needs_no_set_state_dict(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.checkpoint.state_dict as torch_state_dict

    handed: list[str] = []
    monkeypatch.setattr(torch_state_dict, "set_model_state_dict", lambda *a, **k: handed.append("model"))
    monkeypatch.setattr(torch_state_dict, "set_optimizer_state_dict", lambda *a, **k: handed.append("optim"))
    trainer = _trained(1)
    trainer.finish_checkpoint_load(trainer.checkpoint_state())
    assert handed == []


def test_state_held_apart_from_the_live_tensors_is_handed_over() -> None:
    source, fresh = _trained(3), _trained(1)
    fresh.finish_checkpoint_load(source.checkpoint_state())  # another trainer's tensors: copied over
    want, got = _state(source), _state(fresh)
    assert [k for k in want if not torch.equal(want[k], got[k])] == []
