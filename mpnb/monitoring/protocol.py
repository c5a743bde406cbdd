"""The memory side channel's wire format, shared by the engines' sampler and the kernel's receiver.

Engines (`mpnb.engine.monitor`) build samples with `make_sample`, sign them with a
`Signer` and push one ZMQ frame per batch; the kernel (`mpnb.monitoring.channel`)
checks and reads them back with `decode`. A message is a `jupyter_client.Session`
message (HMAC over header, parent, metadata and content with the cluster's key) of
type `MSG_TYPE`, its frames joined by `FRAME_SEPARATOR` into one. Its content is
`{"samples": [sample, ...]}`, plus `"estimate": {str(rank): bytes}` once for each
new Trainer, or `"checkpoint": record` from rank 0 once for each finished save
(`checkpoint_content`). Sample fields: docs/internals.md ("Memory samples").

The kernel (`Verifier`) checks the HMAC before it parses anything, then requires each
sender's message counter to grow (a replay carries an old one), then checks every
field's type and range: a signed but malformed sample is dropped, never stored.

Imported on both sides: standard library only (no torch, no ipywidgets, no zmq).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

MSG_TYPE = "mpnb_memory"
# JSON and hex digests never contain NUL, so it can join a message's frames into one.
FRAME_SEPARATOR = b"\x00"

# Bytes by category from the active Trainer's memory_breakdown(); activations are what autograd
# saved for backward at the peak of the last step (tracked by mpnb.engine.activations).
PARTS = ("parameters", "gradients", "optimizer", "activations")
# The stacked categories of a chart: the parts plus, on CUDA, what they leave of `used`.
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
    "comm_sent",
)
# The fields the kernel needs to store a sample; a sample lacking one is dropped.
REQUIRED_KEYS = ("rank", "t", "used")
DEVICE_KINDS = ("cpu", "cuda")
# Non-negative integer fields (bytes and counts); device_used (no NVML) and comm_sent (no count on
# this rank: CUDA, no process group) may also be None.
COUNT_KEYS = ("used", "reserved", "peak", "capacity", "oom_count", *CATEGORIES)

# Limits on what the kernel accepts. Engines send at most 0.25 s of samples per message (3 at
# 10 Hz, ~400 bytes each); these leave room for much faster configured rates and big worlds while
# bounding what any local process can make the kernel hold before the signature is checked.
MAX_MESSAGE_BYTES = 1 << 20  # also the PULL socket's ZMQ_MAXMSGSIZE
MAX_SAMPLES_PER_MESSAGE = 1000  # the engine splits larger batches
MAX_RANK = 1 << 14  # ranks are 0 <= rank < MAX_RANK
_MAX_COUNT = 1 << 63  # bytes and counts fit an int64
_MAX_TIME = 1e12  # unix seconds, finite (year ~33 700)
# Senders (one per sampler thread) whose last counter the kernel remembers; the least recently
# heard is forgotten first. Only holders of the key can add one.
MAX_SENDERS = 4096

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
    comm_sent: int | None = None,
) -> Sample:
    """One sample; `other` is what CUDA's allocated bytes hold beyond the Trainer's parts.

    On CPU `used` is the process RSS: mostly the interpreter and torch's libraries, not
    tensors, so nothing of it is stacked as `other` (0); the chart draws RSS as its own line.
    `comm_sent`: bytes this rank has sent over torch.distributed so far (`mpnb.engine.comm_bytes`).
    """
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
        "other": max(0, used - accounted) if device_kind == "cuda" else 0,
        "comm_sent": comm_sent,
    }


def samples_content(samples: list[Sample]) -> dict[str, Any]:
    return {"samples": samples}


def estimate_json(per_rank: dict[int, int] | None) -> dict[str, int]:
    """rank -> bytes as JSON needs it (string keys), {} for no estimate; also what the frontend gets."""
    return {str(rank): int(total) for rank, total in (per_rank or {}).items()}


def estimate_content(totals: dict[int, int]) -> dict[str, Any]:
    """The message that carries a new Trainer's estimate."""
    return {"samples": [], "estimate": estimate_json(totals)}


# A finished save as the sidebar lists it: where, at which step, under what, how big, how long, when.
# `label` is the strategy as the status bar names it ("ZeRO-2"); `t` is when the save finished.
CHECKPOINT_KEYS = ("path", "step", "strategy", "label", "world_size", "bytes", "seconds", "t")
MAX_PATH_CHARS = 4096
_MAX_NAME_CHARS = 200


def checkpoint_content(record: dict[str, Any]) -> dict[str, Any]:
    """The message that tells the kernel about one checkpoint written on the engines."""
    return {"samples": [], "checkpoint": record}


def _text(value: Any, limit: int) -> bool:
    return isinstance(value, str) and 0 < len(value) <= limit and "\x00" not in value


def _seconds(value: Any, high: float) -> bool:
    return type(value) in (int, float) and 0 <= value < high  # NaN compares False: refused


def valid_checkpoint(record: Any) -> dict[str, Any] | None:
    """The record with only its known fields if each has the right type and range, else None."""
    if not isinstance(record, dict) or not all(key in record for key in CHECKPOINT_KEYS):
        return None
    ok = (
        _text(record["path"], MAX_PATH_CHARS)
        and _text(record["strategy"], _MAX_NAME_CHARS)
        and _text(record["label"], _MAX_NAME_CHARS)
        and _int_in(record["step"], 0, _MAX_COUNT)
        and _int_in(record["world_size"], 1, MAX_RANK + 1)
        and _int_in(record["bytes"], 0, _MAX_COUNT)
        and (record["seconds"] is None or _seconds(record["seconds"], _MAX_TIME))
        and _seconds(record["t"], _MAX_TIME)
    )
    return {key: record[key] for key in CHECKPOINT_KEYS} if ok else None


class Signer:
    """Builds signed messages in `jupyter_client.Session`'s wire format, cheaply.

    The kernel verifies them with `Verifier` (HMAC over header, parent, metadata
    and content; the counter at the end of `msg_id`, as `Session` numbers its
    messages, must grow per sender `session`). Building them here without
    `Session.send` costs a tenth as much, which matters at 10 Hz beside a
    training loop.
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


class AuthenticationError(ValueError):
    """Unsigned, badly signed, replayed or not one of ours: the whole message is dropped."""


def _int_in(value: Any, low: int, high: int) -> bool:
    return type(value) is int and low <= value < high  # bool is an int subclass: refused


def valid_sample(sample: Any) -> Sample | None:
    """The sample with only its known fields if every one has the right type and range, else None."""
    if not isinstance(sample, dict) or not all(key in sample for key in REQUIRED_KEYS):
        return None
    t = sample["t"]
    if not _int_in(sample["rank"], 0, MAX_RANK):
        return None
    if type(t) not in (int, float) or not 0 <= t < _MAX_TIME:  # NaN compares False: refused too
        return None
    for key in COUNT_KEYS:
        if key in sample and not _int_in(sample[key], 0, _MAX_COUNT):
            return None
    for key in ("device_used", "comm_sent"):
        value = sample.get(key)
        if value is not None and not _int_in(value, 0, _MAX_COUNT):
            return None
    if "busy" in sample and type(sample["busy"]) is not bool:
        return None
    if "device_kind" in sample and sample["device_kind"] not in DEVICE_KINDS:
        return None
    return {key: sample[key] for key in SAMPLE_KEYS if key in sample}


def valid_estimate(estimate: Any) -> dict[int, int] | None:
    """rank -> bytes from the JSON form, or None if any entry is not a rank and a byte count."""
    if not isinstance(estimate, dict) or len(estimate) > MAX_RANK:
        return None
    out: dict[int, int] = {}
    for rank, total in estimate.items():
        if not (isinstance(rank, str) and rank.isascii() and rank.isdigit() and len(rank) <= 6):
            return None
        if not _int_in(int(rank), 0, MAX_RANK) or not _int_in(total, 0, _MAX_COUNT):
            return None
        out[int(rank)] = total
    return out


@dataclass
class Decoded:
    """What one authentic message brings: valid samples, the estimate, the checkpoint, what was refused."""

    samples: list[Sample]
    estimate: dict[int, int] | None = None
    checkpoint: dict[str, Any] | None = None
    invalid: int = 0  # samples (and a bad estimate or checkpoint) dropped for a wrong type or range


class Verifier:
    """The kernel's check of `Signer`'s messages (and of any `jupyter_client.Session` message).

    The HMAC is checked before anything is parsed or remembered, so junk costs a hash and
    leaves no trace. Then the counter at the end of the signed `msg_id` must be greater than
    the last one accepted from the same sender (`header["session"]`, new for each sampler
    thread): a captured message replayed later carries an old counter. One thread only.
    """

    def __init__(self, key: bytes, signature_scheme: str = "hmac-sha256") -> None:
        algorithm = signature_scheme.split("-", 1)[1]
        self._auth = hmac.new(key, digestmod=getattr(hashlib, algorithm))
        self._last: OrderedDict[str, int] = OrderedDict()

    def open(self, frames: Sequence[bytes]) -> tuple[dict[str, Any], bytes]:
        """The header and the raw content of an authentic, fresh message; raises otherwise."""
        frames = list(frames)
        if len(frames) == 1:  # packed by Signer.packed
            frames = frames[0].split(FRAME_SEPARATOR, 6)
        if sum(len(f) for f in frames) > MAX_MESSAGE_BYTES:
            raise AuthenticationError("message too large")
        try:
            parts = frames[frames.index(Signer.DELIM) + 1 :]
        except ValueError:
            raise AuthenticationError("no message delimiter") from None
        if len(parts) != 5:
            raise AuthenticationError("not a five-part message")
        signature, *signed = parts
        digest = self._auth.copy()
        for part in signed:
            digest.update(part)
        if not signature or not hmac.compare_digest(digest.hexdigest().encode(), signature):
            raise AuthenticationError("bad signature")
        header = json.loads(signed[0])
        sender, msg_id = header.get("session"), header.get("msg_id")
        counter = msg_id.rsplit("_", 1)[-1] if isinstance(msg_id, str) else ""
        if not isinstance(sender, str) or not (counter.isascii() and counter.isdigit()) or len(counter) > 18:
            raise AuthenticationError("no sender counter")
        if int(counter) <= self._last.get(sender, -1):
            raise AuthenticationError("replayed message")
        self._last[sender] = int(counter)
        self._last.move_to_end(sender)
        if len(self._last) > MAX_SENDERS:
            self._last.popitem(last=False)
        if header.get("msg_type") != MSG_TYPE:
            raise AuthenticationError("unexpected message type")
        return header, signed[3]


def decode(verifier: Verifier, frames: Sequence[bytes]) -> Decoded:
    """The valid samples, estimate and checkpoint in one message; raises if it is not authentic.

    Any exception means: drop the whole message. A signed message with bad fields
    loses only those samples (counted in `Decoded.invalid`).
    """
    _, raw = verifier.open(frames)
    content = json.loads(raw)
    samples = content.get("samples") if isinstance(content, dict) else None
    if not isinstance(samples, list) or len(samples) > MAX_SAMPLES_PER_MESSAGE:
        raise ValueError("malformed samples")
    valid = [v for v in map(valid_sample, samples) if v is not None]
    out = Decoded(valid, invalid=len(samples) - len(valid))
    if content.get("estimate") is not None:
        out.estimate = valid_estimate(content["estimate"])
        out.invalid += out.estimate is None
    if content.get("checkpoint") is not None:
        out.checkpoint = valid_checkpoint(content["checkpoint"])
        out.invalid += out.checkpoint is None
    return out
