"""The memory side channel's wire format, shared by the engines' sampler and the kernel's receiver.

Engines (`mpnb.engine.monitor`) build samples with `make_sample`, sign them with a
`Signer` and push one ZMQ frame per batch; the kernel (`mpnb.monitoring.channel`)
checks and reads them back with `decode`. A message is a `jupyter_client.Session`
message (HMAC over header, parent, metadata and content with the cluster's key) of
type `MSG_TYPE`, its frames joined by `FRAME_SEPARATOR` into one. Its content is
`{"samples": [sample, ...]}`, plus `"estimate": {str(rank): bytes}` once for each
new Trainer. Sample fields: docs/internals.md ("Memory samples").

Imported on both sides: standard library only (no torch, no ipywidgets, no zmq).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import uuid
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

MSG_TYPE = "mpnb_memory"
# JSON and hex digests never contain NUL, so it can join a message's frames into one.
FRAME_SEPARATOR = b"\x00"

# Bytes by category from the active Trainer's memory_breakdown().
PARTS = ("parameters", "gradients", "optimizer")
# The stacked categories of a chart: the parts plus what they leave of `used`.
CATEGORIES = (*PARTS, "other")
# Every field of a sample, in the order the engines write them.
SAMPLE_KEYS = (
    "rank",
    "t",
    "busy",
    "device_kind",
    "used",
    "reserved",
    "peak",
    "capacity",
    "device_used",
    "oom_count",
    *CATEGORIES,
)
# The fields the kernel needs to store a sample; a message with a sample lacking one is dropped.
REQUIRED_KEYS = ("rank", "t", "used")

Sample = dict[str, Any]


def make_sample(
    *,
    rank: int,
    t: float,
    busy: bool,
    device_kind: str,
    used: int,
    reserved: int,
    peak: int,
    capacity: int,
    device_used: int | None,
    oom_count: int,
    parts: dict[str, int],
) -> Sample:
    """One sample; `other` is what `used` holds beyond the Trainer's parts."""
    accounted = sum(parts.get(key, 0) for key in PARTS)
    return {
        "rank": rank,
        "t": t,
        "busy": busy,
        "device_kind": device_kind,
        "used": used,
        "reserved": reserved,
        "peak": peak,
        "capacity": capacity,
        "device_used": device_used,
        "oom_count": oom_count,
        **{key: parts.get(key, 0) for key in PARTS},
        "other": max(0, used - accounted),
    }


def samples_content(samples: list[Sample]) -> dict[str, Any]:
    return {"samples": samples}


def estimate_json(per_rank: dict[int, int] | None) -> dict[str, int]:
    """rank -> bytes as JSON needs it (string keys), {} for no estimate; also what the frontend gets."""
    return {str(rank): int(total) for rank, total in (per_rank or {}).items()}


def estimate_content(totals: dict[int, int]) -> dict[str, Any]:
    """The message that carries a new Trainer's estimate."""
    return {"samples": [], "estimate": estimate_json(totals)}


class Signer:
    """Builds signed messages in `jupyter_client.Session`'s wire format, cheaply.

    The kernel verifies them with a real `Session` (HMAC over header, parent,
    metadata and content; a digest seen twice is a replay). Building them here
    without `Session.send` costs a tenth as much, which matters at 10 Hz beside
    a training loop.
    """

    DELIM = b"<IDS|MSG>"

    def __init__(self, key: bytes, signature_scheme: str = "hmac-sha256") -> None:
        algorithm = signature_scheme.split("-", 1)[1]
        self._auth = hmac.new(key, digestmod=getattr(hashlib, algorithm))
        self._session = uuid.uuid4().hex
        self._count = 0

    def frames(self, msg_type: str, content: dict[str, Any]) -> list[bytes]:
        self._count += 1
        header = {
            "msg_id": f"{self._session}_{self._count}",
            "msg_type": msg_type,
            "session": self._session,
            "username": "mpnb-monitor",
            "date": datetime.now(timezone.utc).isoformat(),
            "version": "5.3",
        }
        parts = [json.dumps(header).encode(), b"{}", b"{}", json.dumps(content).encode()]
        digest = self._auth.copy()
        for part in parts:
            digest.update(part)
        return [self.DELIM, digest.hexdigest().encode(), *parts]

    def packed(self, msg_type: str, content: dict[str, Any]) -> bytes:
        """The frames joined into one ZMQ frame.

        One frame is one GIL release in pyzmq instead of six, each of which can make
        the training thread wait on a crowded CPU. `decode` splits it back.
        """
        return FRAME_SEPARATOR.join(self.frames(msg_type, content))


def decode(session: Any, frames: Sequence[bytes]) -> tuple[list[Sample], dict[int, int] | None]:
    """The samples and the estimate (or None) in one message; raises if it is not authentic.

    `session` is a `jupyter_client.Session` with the cluster's key: it checks the
    signature and refuses a digest it has seen before (a replay). Any exception
    means: drop the message.
    """
    frames = list(frames)
    if len(frames) == 1:  # packed by Signer.packed
        frames = frames[0].split(FRAME_SEPARATOR)
    _, msg_frames = session.feed_identities(frames, copy=True)
    msg = session.deserialize(msg_frames, content=True)
    if msg["header"].get("msg_type") != MSG_TYPE:
        raise ValueError("unexpected message type")
    content = msg["content"]
    samples = content["samples"]
    if not isinstance(samples, list) or not all(
        isinstance(s, dict) and all(k in s for k in REQUIRED_KEYS) for s in samples
    ):
        raise ValueError("malformed samples")
    estimate = content.get("estimate")
    if estimate is None:
        return samples, None
    return samples, {int(rank): int(total) for rank, total in estimate.items()}
