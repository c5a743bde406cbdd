"""DCP-checkpointable views of a contiguous range of a flattened tensor: DeepSpeed ZeRO's partitions.

ZeRO keeps each rank's share of a parameter (and of its optimizer moments) as
a range [offset, offset + numel) of the parameter flattened row-major, inside a
flat fp32 buffer. torch.distributed.checkpoint (DCP) describes shards as
rectangular boxes of the global tensor, so a `FlatShard` cuts its range into
the few boxes that tile it (a partial first row, whole middle rows, a partial
last row, recursively per dimension) and hands DCP a view of its buffer for
each one. DCP then writes only this rank's range, and reads any other layout
(another world size, FSDP's row shards, a whole tensor) into it in place.

It implements DCP's extension protocol (`__create_write_items__`,
`__create_chunk_list__`, `__get_tensor_shard__`, as DTensor does). It is a
tensor subclass only because DCP's planners look objects up with
`isinstance(obj, torch.Tensor)`; its size is the global shape, and it refuses
every tensor operation: it is a checkpoint handle, not a tensor to compute with.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) in the global tensor


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """Rectangular boxes that tile elements [start, stop) of a row-major tensor of `shape`, in order.

    Each box is itself contiguous in row-major order, so box k is the slice of
    the flat range right after box k-1. At most two partial boxes per dimension.
    """
    shape = tuple(int(s) for s in shape)
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    row = math.prod(shape[1:])  # elements per index of the first dimension
    first, last = start // row, (stop - 1) // row
    rest = shape[1:]
    if first == last and (start % row or stop % row):  # inside one row: recurse into it
        inner = flat_range_boxes(rest, start - first * row, stop - first * row)
        return [((first, *o), (1, *s)) for o, s in inner]
    boxes: list[Box] = []
    full_from, full_to = first, last + 1  # rows covered whole: [full_from, full_to)
    if start % row:
        boxes += [((first, *o), (1, *s)) for o, s in flat_range_boxes(rest, start % row, row)]
        full_from = first + 1
    if stop % row:
        full_to = last
    if full_to > full_from:
        boxes.append(((full_from, *(0,) * len(rest)), (full_to - full_from, *rest)))
    if stop % row:
        boxes += [((last, *o), (1, *s)) for o, s in flat_range_boxes(rest, 0, stop % row)]
    return boxes


def _exact_storage(view: torch.Tensor) -> torch.Tensor:
    """The same memory as a tensor whose storage is exactly its bytes (CPU; others as they are).

    DCP clones a tensor whose storage is larger than itself before writing it
    (and torch.save would write the whole storage): for views of DeepSpeed's
    flat buffer that was a full extra copy of the partition during a save.
    """
    if view.device.type != "cpu" or view.numel() == 0:
        return view
    alias = torch.from_numpy(view.view(torch.uint8).numpy())  # numpy keeps `view`'s storage alive
    return alias.view(view.dtype)


class FlatShard(torch.Tensor):
    """Elements [offset, offset + flat.numel()) of a tensor of global `shape`, held as the 1-D view `flat`.

    `flat` must be a contiguous view into the owner's buffer (DeepSpeed's
    partition): DCP saves from it and loads into it in place.
    """

    flat: torch.Tensor
    offset: int
    _pieces: dict[tuple[int, ...], tuple[int, tuple[int, ...]]]  # box offsets -> (start in flat, sizes)

    __torch_function__ = torch._C._disabled_torch_function_impl  # every op goes to __torch_dispatch__

    @staticmethod
    def __new__(cls, flat: torch.Tensor, shape: Sequence[int], offset: int) -> FlatShard:
        shape = torch.Size(shape)
        if flat.dim() != 1 or not flat.is_contiguous():
            raise ValueError(f"FlatShard needs a contiguous 1-D view, got shape {tuple(flat.shape)}")
        if offset < 0 or offset + flat.numel() > shape.numel():
            raise ValueError(f"range [{offset}, {offset + flat.numel()}) is outside a tensor of "
                             f"{shape.numel()} elements {tuple(shape)}")
        self = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=flat.dtype, device=flat.device,
                                                   requires_grad=False)
        self.flat = flat.detach()
        self.offset = int(offset)
        self._pieces = {}
        if shape.numel() == 0:  # still one (empty) box, so the key exists in the checkpoint
            boxes: list[Box] = [((0,) * len(shape), tuple(shape))]
        else:
            boxes = flat_range_boxes(shape, self.offset, self.offset + flat.numel())
        pos = 0
        for offsets, sizes in boxes:
            self._pieces[offsets] = (pos, sizes)
            pos += math.prod(sizes)
        return self

    # ---- what this rank holds ------------------------------------------------------------------
    def to_local(self) -> torch.Tensor:
        """The 1-D view this rank holds (the name DTensor uses, so byte counters treat both alike)."""
        return self.flat

    @property
    def local_numel(self) -> int:
        return self.flat.numel()

    @property
    def local_nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def boxes(self) -> list[Box]:
        return [(o, s) for o, (_, s) in self._pieces.items()]

    def staged(self, copy: torch.Tensor) -> FlatShard:
        """The same range over `copy`, a CPU copy of `flat`: what a background save writes while
        training goes on."""
        return FlatShard(copy, self.shape, self.offset)

    def __repr__(self) -> str:  # type: ignore[override]
        stop = self.offset + self.flat.numel()
        return (f"FlatShard(shape={tuple(self.shape)}, range=[{self.offset}, {stop}), "
                f"dtype={self.dtype}, device={self.device})")

    # ---- torch.distributed.checkpoint's extension protocol ---------------------------------------
    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        properties = TensorProperties(dtype=self.flat.dtype)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                    properties=properties,
                    size=self.shape,
                ),
            )
            for offsets, sizes in self.boxes()
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in self.boxes()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        key = tuple(index.offset) if index.offset is not None else (0,) * self.dim()
        if key not in self._pieces:
            raise ValueError(f"{index.fqn}: this rank holds no box at offsets {key} ({self!r})")
        pos, sizes = self._pieces[key]
        return _exact_storage(self.flat[pos:pos + math.prod(sizes)]).view(sizes)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            return args[0]  # DCP detaches what it saves; a view of a view is this
        raise TypeError(f"{func} on a FlatShard: it only marks a ZeRO partition for checkpoints. "
                        "Compute with its .flat view (this rank's range) instead.")
