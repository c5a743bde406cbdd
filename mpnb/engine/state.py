"""Per-engine state that the kernel sets and engine-side code reads.

This is the only module-level state on an engine. The kernel writes it through
`view.apply(...)` with plain data; `mpnb.prepare`, the monitor and the stop
machinery read it.
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any

rank: int = 0
world_size: int = 1
local_rank: int = 0
local_world_size: int = 1
group_rank: int = 0  # this host's place among the hosts (torchrun's GROUP_RANK)
group_world_size: int = 1
group_connections: set[int] = set()  # socket inodes mpnb's process group opened (gloo_unblock)
device: str = "cpu"  # "cpu" or "cuda:N" (N is always 0 after CUDA_VISIBLE_DEVICES binding)
backend: str = "gloo"
master_addr: str = "127.0.0.1"  # where rank 0 serves the group's store (`%mpnb run` sets MASTER_*)
master_port: int = 0  # the live mpnb group's store port (mpnb.engine.own_group moves it on each re-form)
timeout_s: float = 1800.0  # the group's timeout: own_group forms the group again with it

# Counts the bytes torch.distributed sends (mpnb.engine.comm_bytes.CommCounter); made by bootstrap
# before the first process group, so the connections it finds later are the group's.
comm_counter: Any = None

# The session's active mpnb.Config as a dict (Config.to_dict()); mpnb.prepare reads it.
config: dict[str, Any] = {}

# The Trainer most recently returned by mpnb.prepare, for the memory monitor.
_active_trainer: weakref.ref | None = None


def set_config(data: dict[str, Any]) -> None:
    global config
    config = dict(data)


def set_active_trainer(trainer: Any) -> None:
    global _active_trainer
    _active_trainer = weakref.ref(trainer)


def active_trainer() -> Any | None:
    return _active_trainer() if _active_trainer is not None else None


# The full `mpnb.estimate` of the model the last mpnb.prepare got (None: none, or it could not be
# read), and a counter the memory sampler compares to send each new one's line exactly once.
last_estimate: Any = None
estimate_version = 0

# While `mpnb.compare` measures a cell: a `mpnb.engine.measure.StepMeasure` that `Trainer.step` reports to.
step_observer: Any = None


def set_estimate(estimate: Any) -> None:
    global last_estimate, estimate_version
    last_estimate = estimate
    estimate_version += 1


# Messages for the kernel besides samples (a finished checkpoint, from rank 0), sent in order by
# the memory sampler (`monitor.wake()` makes it look at once); bounded if no sampler drains them.
announcements: deque[dict[str, Any]] = deque(maxlen=64)
