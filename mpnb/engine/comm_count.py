"""Bytes, calls and seconds of every collective a block of code runs on this rank.

Counted from the torch profiler's record of the c10d operators, the one level
every path goes through: DDP's C++ reducer, FSDP2's all-gathers and
reduce-scatters, DTensor's functional collectives under tensor parallelism,
`deepspeed.comm`, and pipeline send/recv (wrapping torch.distributed's Python
functions would miss the first three). The chrome trace is
read because only it carries the operators' input shapes
(`record_shapes=True`; `prof.events()` leaves the list arguments' shapes
empty). Element types come from the op when it names them, else from the
backend's own event for the same shape (`gloo:*`, run on gloo's worker thread,
whose durations are the transfer times), else fp32.

Bytes are those of the tensors handed to the op (not wire bytes): an
all-reduce's tensor, an all-gather's gathered output, a reduce-scatter's full
input, a send's tensor. `mpnb.planning.comm_estimate.volume` puts them in the
ZeRO paper's units, where an all-reduce costs twice its tensor (a
reduce-scatter plus an all-gather). On the wire a ring moves (n-1)/n of that
per rank.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

# c10d operator -> collective kind (one name per kind, as the papers use)
C10D_KINDS: dict[str, str] = {
    "c10d::allreduce_": "all_reduce",
    "c10d::allreduce_coalesced_": "all_reduce",
    "c10d::_allgather_base_": "all_gather",
    "c10d::allgather_": "all_gather",
    "c10d::allgather_into_tensor_coalesced_": "all_gather",
    "c10d::_reduce_scatter_base_": "reduce_scatter",
    "c10d::reduce_scatter_": "reduce_scatter",
    "c10d::reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "c10d::broadcast_": "broadcast",
    "c10d::reduce_": "reduce",
    "c10d::alltoall_base_": "all_to_all",
    "c10d::alltoall_": "all_to_all",
    "c10d::send": "send",
    "c10d::recv_": "recv",
    "c10d::recv_any_source_": "recv",
    "c10d::gather_": "gather",
    "c10d::scatter_": "scatter",
}
# the operand whose size is the op's payload (see the module docstring), by position in "Input Dims"
_PAYLOAD_ARG: dict[str, int] = {"c10d::_allgather_base_": 0, "c10d::_reduce_scatter_base_": 1,
                                "c10d::allgather_": 1, "c10d::allgather_into_tensor_coalesced_": 0,
                                "c10d::reduce_scatter_": 1, "c10d::reduce_scatter_tensor_coalesced_": 1}
_GATHERS_INPUT = ("c10d::allgather_",)  # the trace shows only the input: the output is world_size times it
ELEMENT_BYTES: dict[str, int] = {
    "float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "int": 4, "long int": 8,
    "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1, "c10::Float8_e4m3fn": 1,
    "c10::Float8_e5m2": 1,
}


@dataclass
class Collective:
    """One kind of collective over the counted block: calls, payload bytes, seconds."""

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass
class CommCount:
    """What `count_collectives()` saw in its block, per collective kind."""

    kinds: dict[str, Collective] = field(default_factory=dict)

    def as_data(self) -> dict[str, dict[str, float]]:
        """{kind: {"calls", "bytes", "seconds"}}: plain data, for the kernel."""
        return {k: asdict(c) for k, c in sorted(self.kinds.items())}


@contextlib.contextmanager
def count_collectives() -> Iterator[CommCount]:
    """Count the collectives this rank runs inside the block; read the yielded `CommCount` after it.

    The profiler's start and stop lines (kineto writes them to fd 2) go to the engine's log.
    """
    from torch.profiler import ProfilerActivity, profile

    from mpnb.engine.quiet import quiet_fds

    result = CommCount()
    prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
    with quiet_fds():
        prof.start()
    try:
        yield result
    finally:
        with quiet_fds():
            prof.stop()
        result.kinds = collectives_in_trace(_trace_events(prof))


def _trace_events(prof: Any) -> list[dict[str, Any]]:
    fd, path = tempfile.mkstemp(prefix="mpnb-comm-", suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f).get("traceEvents", [])
    finally:
        os.unlink(path)


def collectives_in_trace(
    events: list[dict[str, Any]], world_size: int | None = None
) -> dict[str, Collective]:
    """Sum the trace's c10d operators by kind (`C10D_KINDS`); see the module docstring for the sizes."""
    if world_size is None:
        world_size = _world_size()
    backend = _backend_events(events)
    kinds: dict[str, Collective] = {}
    for event in events:
        name = event.get("name", "")
        kind = C10D_KINDS.get(name)
        if kind is None:
            continue
        args = event.get("args", {})
        dims, types = args.get("Input Dims") or [], args.get("Input type") or []
        index = _PAYLOAD_ARG.get(name, 0)
        shapes = _shapes(dims[index] if index < len(dims) else [])
        dtype = types[index] if index < len(types) else ""
        payload = 0
        for shape in shapes:
            numel = math.prod(shape)
            size = ELEMENT_BYTES.get(dtype) or _backend_element_bytes(backend, shape)
            payload += numel * size
        if name in _GATHERS_INPUT:
            payload *= world_size
        entry = kinds.setdefault(kind, Collective())
        entry.calls += 1
        entry.bytes += payload
        entry.seconds += backend_seconds(backend, shapes) or event.get("dur", 0) / 1e6
    return kinds


def _shapes(arg: Any) -> list[list[int]]:
    """An operand's shapes: one tensor's [d0, d1, ...] or a tensor list's [[...], [...]]."""
    if not arg:
        return []
    if all(isinstance(d, int) for d in arg):
        return [arg]
    return [s for s in arg if isinstance(s, list) and all(isinstance(d, int) for d in s)]


def _backend_events(events: list[dict[str, Any]]) -> dict[tuple[int, ...], list[dict[str, Any]]]:
    """The backend's own events (gloo:*), by input shape, in order: element types and transfer times."""
    found: dict[tuple[int, ...], list[dict[str, Any]]] = {}
    for event in events:
        if event.get("name", "").startswith("gloo:"):
            dims = (event.get("args", {}).get("Input Dims") or [[]])[0]
            found.setdefault(tuple(dims), []).append(event)
    return found


def _backend_element_bytes(backend: dict[tuple[int, ...], list[dict[str, Any]]], shape: list[int]) -> int:
    for event in backend.get(tuple(shape), []):
        types = event.get("args", {}).get("Input type") or []
        if types and types[0] in ELEMENT_BYTES:
            return ELEMENT_BYTES[types[0]]
    return 4


def backend_seconds(backend: dict[tuple[int, ...], list[dict[str, Any]]], shapes: list[list[int]]) -> float:
    """Seconds the backend spent on the first unused events of these shapes (0 if it has none)."""
    total = 0.0
    for shape in shapes:
        queue = backend.get(tuple(shape))
        if queue:
            total += queue.pop(0).get("dur", 0) / 1e6
    return total


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
