"""FlatShard: a ZeRO partition (a flat range of a row-major tensor) as boxes DCP reads and writes in place."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex

from mpnb.engine.checkpoint.flat_shards import FlatShard, flat_range_boxes

# dcp.save/load(no_dist=True) warn that they run in one process: that is the point here
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _covered(shape: tuple[int, ...], boxes: list) -> list[int]:
    """Flat indices the boxes cover, in box order (duplicates kept, so overlaps show)."""
    index = torch.arange(math.prod(shape)).view(shape)
    out: list[int] = []
    for offsets, sizes in boxes:
        assert len(offsets) == len(sizes) == len(shape)
        assert all(s > 0 for s in sizes)
        out += index[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))].flatten().tolist()
    return out


def test_boxes_tile_exactly_the_range_in_order() -> None:
    rng = random.Random(0)
    for _ in range(400):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
        n = math.prod(shape)
        start = rng.randint(0, n)
        stop = rng.randint(start, n)
        boxes = flat_range_boxes(shape, start, stop)
        assert _covered(shape, boxes) == list(range(start, stop)), (shape, start, stop, boxes)
        assert len(boxes) <= 2 * len(shape) - 1 or not boxes


def test_boxes_of_scalars_and_edges() -> None:
    assert flat_range_boxes((), 0, 1) == [((), ())]
    assert flat_range_boxes((), 0, 0) == []
    assert flat_range_boxes((7,), 2, 5) == [((2,), (3,))]
    assert flat_range_boxes((4, 6), 0, 24) == [((0, 0), (4, 6))]  # whole tensor: one box
    assert flat_range_boxes((4, 6), 6, 18) == [((1, 0), (2, 6))]  # whole rows: one box
    assert flat_range_boxes((4, 6), 3, 15) == [((0, 3), (1, 3)), ((1, 0), (1, 6)), ((2, 0), (1, 3))]


def test_shards_are_views_of_the_buffer() -> None:
    x = torch.arange(60.0).view(3, 4, 5)
    buffer = x.flatten().clone()
    shard = FlatShard(buffer[7:49], x.shape, 7)
    assert shard.shape == x.shape and shard.local_numel == 42 and shard.local_nbytes == 42 * 4
    assert shard.to_local().data_ptr() == buffer[7:].data_ptr()
    for offsets, sizes in shard.boxes():
        piece = shard.__get_tensor_shard__(MetadataIndex("w", torch.Size(offsets)))
        assert torch.equal(piece, x[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))])
        piece.zero_()  # writes land in the buffer: that is how DCP loads in place
    assert buffer[7:49].abs().sum() == 0 and buffer[:7].abs().sum() > 0 and buffer[49:].abs().sum() > 0


def test_a_background_save_stages_independent_copies_into_the_last_ones_buffers() -> None:
    from mpnb.engine.checkpoint.writer import _stage

    buffer = torch.arange(10.0)
    weight = torch.ones(2, 3)
    state = {"model": {"w": weight}, "optim": {"flat": FlatShard(buffer[2:6], (10,), 2)}}
    kept: dict[str, torch.Tensor] = {}
    first = _stage(state, kept)
    buffer.zero_()
    weight.mul_(3)
    flat = first["optim"]["flat"]
    assert flat.flat.tolist() == [2.0, 3.0, 4.0, 5.0] and flat.offset == 2 and flat.shape == (10,)
    assert first["model"]["w"].tolist() == [[1.0] * 3] * 2  # training changed the live tensors since
    second = _stage(state, kept)
    assert second["model"]["w"].data_ptr() == first["model"]["w"].data_ptr()  # the same memory, reused
    assert second["model"]["w"].tolist() == [[3.0] * 3] * 2 and second["optim"]["flat"].flat.sum() == 0
    state["model"]["w"] = torch.ones(4)  # another shape: a buffer of its own
    third = _stage(state, kept)
    assert third["model"]["w"].shape == (4,) and kept[".model.w"] is third["model"]["w"]


def test_bad_ranges_and_ops_are_refused() -> None:
    with pytest.raises(ValueError, match="outside"):
        FlatShard(torch.zeros(5), (2, 2), 0)
    with pytest.raises(ValueError, match="contiguous 1-D"):
        FlatShard(torch.zeros(4, 2)[:, 0], (8,), 0)
    with pytest.raises(TypeError):
        FlatShard(torch.zeros(3), (4,), 1) + 1


# ---- real DCP round trips in one process (no_dist) ----------------------------------------------


def _pieces(n: int, parts: int) -> list[tuple[int, int]]:
    """ZeRO-like ranges: ceil(n / parts) elements each, the last one short (or empty)."""
    size = -(-n // parts)
    return [(min(r * size, n), min((r + 1) * size, n)) for r in range(parts)]


def test_tensor_saved_whole_loads_into_flat_shards(tmp_path) -> None:
    torch.manual_seed(0)
    whole = {"w": torch.randn(5, 7, 3), "b": torch.randn(11), "s": torch.tensor(3.0)}
    dcp.save(whole, checkpoint_id=tmp_path, no_dist=True)
    for start, stop in [*_pieces(105, 3), (4, 5), (20, 64)]:
        buffer = torch.full((stop - start + 2,), -1.0)  # padding either side must stay untouched
        target = {"w": FlatShard(buffer[1:-1], (5, 7, 3), start)}
        dcp.load(target, checkpoint_id=tmp_path, no_dist=True)
        assert torch.equal(buffer[1:-1], whole["w"].flatten()[start:stop])
        assert buffer[0] == -1 and buffer[-1] == -1
    scalar = torch.zeros(1)
    dcp.load({"s": FlatShard(scalar, (), 0)}, checkpoint_id=tmp_path, no_dist=True)
    assert scalar.item() == 3.0


def test_flat_shards_save_and_load_into_whole_tensors(tmp_path) -> None:
    torch.manual_seed(1)
    w = torch.randn(6, 10)
    flat = w.flatten()
    # one process holds one piece per key; the pieces of all "ranks" together are the whole tensor
    ranges = _pieces(60, 3)
    state = {f"w{r}": FlatShard(flat[a:b].clone(), w.shape, a) for r, (a, b) in enumerate(ranges)}
    dcp.save(state, checkpoint_id=tmp_path, no_dist=True)
    meta = dcp.FileSystemReader(tmp_path).read_metadata().state_dict_metadata
    for r, (a, b) in enumerate(ranges):
        md = meta[f"w{r}"]
        assert md.size == w.shape and sum(math.prod(c.sizes) for c in md.chunks) == b - a
        # the rest of the tensor was never written: load the written boxes and compare them
        back = torch.zeros_like(flat)
        dcp.load({f"w{r}": FlatShard(back[a:b], w.shape, a)}, checkpoint_id=tmp_path, no_dist=True)
        assert torch.equal(back[a:b], flat[a:b]) and back[:a].abs().sum() == 0
    # all of a tensor from flat pieces written together, read back as a plain tensor
    whole_dir = tmp_path / "whole"
    buffer = w.flatten().clone()
    dcp.save({"w": FlatShard(buffer, w.shape, 0)}, checkpoint_id=whole_dir, no_dist=True)
    plain = {"w": torch.zeros(6, 10)}
    dcp.load(plain, checkpoint_id=whole_dir, no_dist=True)
    assert torch.equal(plain["w"], w)


def test_flat_shards_reshard_between_layouts(tmp_path) -> None:
    """Pieces written at one split read back at another: what a change of world size does."""
    torch.manual_seed(2)
    w = torch.randn(7, 9)
    flat = w.flatten()
    dcp.save({"w": FlatShard(flat.clone(), w.shape, 0)}, checkpoint_id=tmp_path, no_dist=True)
    for start, stop in _pieces(63, 4):
        buffer = torch.zeros(stop - start)
        dcp.load({"w": FlatShard(buffer, w.shape, start)}, checkpoint_id=tmp_path, no_dist=True)
        assert torch.equal(buffer, flat[start:stop])
    rows = {"w": torch.zeros(7, 9)}  # an FSDP-like reader: plain whole tensor
    dcp.load(rows, checkpoint_id=tmp_path, no_dist=True)
    assert torch.equal(rows["w"], w)


def test_bf16_shards_round_trip(tmp_path) -> None:
    w = torch.randn(4, 6).to(torch.bfloat16)
    dcp.save({"w": w}, checkpoint_id=tmp_path, no_dist=True)
    buffer = torch.zeros(13, dtype=torch.bfloat16)
    dcp.load({"w": FlatShard(buffer, w.shape, 5)}, checkpoint_id=tmp_path, no_dist=True)
    assert torch.equal(buffer, w.flatten()[5:18])
