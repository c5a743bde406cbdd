"""Whether a host of the cluster went away as a whole (cable, switch, power), not only an engine.

An engine that dies is seen at once (its process is gone, or its nanny tells the controller); a
host that drops off the network says nothing: its ranks' memory samples stop arriving, and the
controller notices only after its heartbeat tolerance (30 s). Two signs together name it here:
every rank of the host has been silent for `SILENT_S` while ranks elsewhere were heard, and the
host's address does not answer a TCP connection attempt within `PROBE_TIMEOUT_S` (a live host
answers at once, if only with a refusal).

Kernel side: never imports torch.
"""

from __future__ import annotations

import errno
import socket
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mpnb.cluster.session import RankInfo, Session

SILENT_S = 3.0  # ranks sample 10 times a second while busy and once a second while idle
PROBE_TIMEOUT_S = 1.0
PROBE_PORT = 9  # "discard": a port nothing listens on, so a live host refuses at once
_PROBE_VALID_S = 2.0  # a probe's answer is reused this long: the supervisor asks every 0.25 s

_probes: dict[str, tuple[float, bool]] = {}  # address -> (when probed, answered)
_lock = threading.Lock()


def unreachable(session: Session, ranks: Iterable[int]) -> dict[int, str]:
    """Of `ranks`, those on another host that went silent and does not answer: rank -> cause."""
    heard = session.memory.last_heard()
    now = time.monotonic()

    def silent_for(info: RankInfo) -> float | None:
        at = heard.get(info.rank)
        return None if at is None or at < info.formed_at else now - at  # None: nothing heard from it yet

    by_host: dict[str, list[RankInfo]] = {}
    for info in session.ranks:
        by_host.setdefault(info.host, []).append(info)
    wanted = set(ranks)
    found: dict[int, str] = {}
    for host, infos in by_host.items():
        mine = [i for i in infos if i.rank in wanted]
        if not mine or is_local(infos[0]) or not infos[0].address:
            continue
        silences = [silent_for(i) for i in infos]
        others = [silent_for(i) for h, rest in by_host.items() if h != host for i in rest]
        if any(s is None or s < SILENT_S for s in silences):
            continue  # some rank of it still talks, or there is nothing to judge by
        if not any(s is not None and s < SILENT_S for s in others):
            continue  # nothing arrives from anywhere: the kernel's own side is the likelier cause
        if _answers(infos[0].address):
            continue
        quiet = min(s for s in silences if s is not None)
        cause = f"is unreachable: its host ({infos[0].address}) stopped answering {quiet:.0f} s ago"
        found.update({i.rank: cause for i in mine})
    return found


class DropWatch:
    """The ranks cut off by a host gone from the network, judged again at most every `every` seconds,
    for a listener that is told of changes (the sidebar) rather than asking at each cell. It reads
    only the memory store and the rank table, never the ipyparallel client: any thread may call it."""

    def __init__(self, every: float = 1.0) -> None:
        self.every = every
        self.ranks: frozenset[int] = frozenset()
        self._judged = float("-inf")

    def changed(self, session: Session) -> bool:
        """Judge again if `every` has passed; True if the set of cut-off ranks moved."""
        now = time.monotonic()
        if now - self._judged < self.every:
            return False
        self._judged = now
        ranks = frozenset(unreachable(session, range(len(session.ranks))))
        moved, self.ranks = ranks != self.ranks, ranks
        return moved


def is_local(info: RankInfo) -> bool:
    """The rank runs on this kernel's machine."""
    return info.host in (socket.gethostname(), "localhost", "127.0.0.1")


def _answers(address: str) -> bool:
    """A TCP connection attempt gets an answer (accepted or refused) within PROBE_TIMEOUT_S."""
    now = time.monotonic()
    with _lock:
        cached = _probes.get(address)
    if cached is not None and now - cached[0] < _PROBE_VALID_S:
        return cached[1]
    try:
        with socket.create_connection((address, PROBE_PORT), timeout=PROBE_TIMEOUT_S):
            answered = True
    except ConnectionRefusedError:
        answered = True
    except OSError as exc:  # timeout, or no route: nobody there
        answered = exc.errno not in (None, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ETIMEDOUT)
    with _lock:
        _probes[address] = (time.monotonic(), answered)
    return answered
