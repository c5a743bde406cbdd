"""Whether an `init_process_group(...)` call in a cell can be served by the group mpnb formed.

Pure functions of plain data (`mpnb.engine.own_group` feeds them what torch reports), so the
decision is unit-tested without a world: backend compatible per device, rank and world size as
assigned, a rendezvous (`init_method`) on the ranks' host, no store of the call's own.
"""

from __future__ import annotations

import contextlib
import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

# torch.distributed.Backend.backend_capability in torch 2.13 (the engines pass torch's own)
CAPABILITY: dict[str, tuple[str, ...]] = {
    "gloo": ("cpu", "cuda"),
    "nccl": ("cuda",),
    "xccl": ("xpu",),
    "ucc": ("cpu", "cuda"),
    "mpi": ("cpu", "cuda"),
}
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


@dataclass(frozen=True)
class InitRequest:
    """What an `init_process_group` call asked for, as plain data (-1: not given, as torch's defaults)."""

    backend: str | None = None
    init_method: str | None = None
    rank: int = -1
    world_size: int = -1
    store: bool = False  # a store object of its own was passed


@dataclass(frozen=True)
class RunningGroup:
    """The default group live on this engine."""

    backends: Mapping[str, str]  # device type -> backend, from dist.get_backend_config()
    rank: int
    world_size: int
    master_addr: str
    device_type: str = "cpu"  # this engine's device ("cuda" on GPU engines)
    hosts: frozenset[str] = frozenset()  # other names of the rendezvous host (its host name, ...)


def parse_backends(spec: str, capability: Mapping[str, Sequence[str]] = CAPABILITY) -> dict[str, str]:
    """'gloo' -> {'cpu': 'gloo', 'cuda': 'gloo'}; 'cpu:gloo,cuda:nccl' -> that mapping ({} for none)."""
    spec = str(spec).strip().lower()
    if not spec or spec == "undefined":
        return {}
    if ":" in spec:
        pairs = (part.split(":", 1) for part in spec.split(",") if part.strip())
        return {device.strip(): backend.strip() for device, backend in pairs}
    return {device: spec for device in capability.get(spec, ())}


def is_loopback(host: str) -> bool:
    host = host.strip("[]").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


def same_host(host: str, group: RunningGroup) -> bool:
    """`host` names the rendezvous host of `group` (any loopback name when it is on loopback)."""
    host = host.strip("[]").lower()
    if host == group.master_addr.lower() or host in {h.lower() for h in group.hosts}:
        return True
    return is_loopback(host) and is_loopback(group.master_addr)


def incompatibility(
    request: InitRequest, group: RunningGroup, capability: Mapping[str, Sequence[str]] = CAPABILITY
) -> str | None:
    """Why `request` cannot be served by the live `group` (None: it can). Pure, for the unit tests."""
    problems = []
    wanted = parse_backends(request.backend, capability) if request.backend is not None else {}
    if wanted:
        devices = {"cpu", group.device_type}
        mine = {d: b for d, b in wanted.items() if d in devices}
        if not mine or any(group.backends.get(d) != b for d, b in mine.items()):
            running = ",".join(f"{d}:{b}" for d, b in sorted(group.backends.items()))
            problems.append(f"backend {request.backend!r} (mpnb's group: {running or 'none'})")
    rank, world_size = request.rank, request.world_size
    if request.store:
        problems.append("a store of its own (mpnb's group has its rendezvous store already)")
    elif request.init_method is not None:
        url = urlsplit(str(request.init_method))
        query = parse_qs(url.query)
        with contextlib.suppress(ValueError, IndexError):
            rank = int(query["rank"][0]) if "rank" in query else rank
            world_size = int(query["world_size"][0]) if "world_size" in query else world_size
        if url.scheme == "tcp" and not same_host(url.hostname or "", group):
            problems.append(
                f"init_method {request.init_method!r} (mpnb's group meets at {group.master_addr})"
            )
        elif url.scheme not in ("env", "tcp", "file"):
            problems.append(f"init_method {request.init_method!r} (mpnb's group uses its own store)")
    if world_size >= 0 and world_size != group.world_size:
        problems.append(f"world_size={world_size} (mpnb's group has {_ranks(group.world_size)})")
    if rank >= 0 and rank != group.rank:
        problems.append(f"rank={rank} (this engine is rank {group.rank})")
    return "; ".join(problems) or None


def describe(group: RunningGroup) -> str:
    """'gloo, 2 ranks': the group as the one-line notes name it."""
    return f"{'/'.join(sorted(set(group.backends.values()))) or 'no backend'}, {_ranks(group.world_size)}"


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"
