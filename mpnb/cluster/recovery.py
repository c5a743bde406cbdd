"""After a crash, a release or a hang: what the session needs before the next cell can run.

Two ways back (docs/internals.md, "Recovery model"):
- heal (`mpnb.cluster.lifecycle.heal`): destroy the process group on the
  surviving engines and init a new one on a new port. Namespaces stay; models
  wrapped around the old group (DDP, FSDP, DeepSpeed) must be prepared again.
  With a dead rank the world shrinks.
- restart (`mpnb.cluster.lifecycle.restart`): fresh engines, a full world, empty namespaces.

`mpnb.execution` records what happened with `mark`; the next `%%distributed`
cell is refused (`check_ready`) until one of them has run, with a message
saying which.

Kernel side: never imports torch.
"""

from __future__ import annotations

import time

from mpnb.cluster.session import Health, Need, Session
from mpnb.errors import RankError
from mpnb.execution.output import format_ranks

# A death outranks a torn-down group, which outranks a wait: a later, milder event keeps the worse need.
_SEVERITY: dict[str, int] = {"wait": 0, "heal": 1, "restart": 2}


def mark(session: Session, need: Need, reason: str, busy: list[int] | None = None) -> None:
    """Record what the session needs (see `Health`); a worse need already recorded is kept."""
    old = session.health
    if old is not None and _SEVERITY[old.need] > _SEVERITY[need]:
        need, reason = old.need, old.reason
    busy = busy or (old.busy if old is not None else None) or []
    session.health = Health(need=need, reason=reason, busy=busy, at=time.time())


def needs(session: Session) -> Need | None:
    return session.health.need if session.health is not None else None


def advice(session: Session) -> str:
    health = session.health
    if health is None:
        return ""
    if health.need == "restart":
        n = max(session.world_size, session.full_world_size)
        alive = alive_ranks(session)
        return (
            f"A rank is gone. Run `%mpnb restart` for a fresh world of {n} ranks (namespaces are lost), "
            f"or `%mpnb heal` to go on with the {len(alive)} surviving rank{'s' if len(alive) != 1 else ''} "
            "(namespaces kept; run mpnb.prepare again)."
        )
    if health.need == "wait":
        return (
            f"{format_ranks(health.busy)} returns by the process-group timeout "
            f"({session.timeout:g} s) at the latest; run the cell again then, or `%mpnb restart` now."
        )
    if health.need == "heal":
        wait = (
            f" {format_ranks(health.busy)} may still be blocked until the process-group timeout "
            f"({session.timeout:g} s); `%mpnb restart` ends that at once."
            if health.busy
            else ""
        )
        return (
            "The process group was torn down. Run `%mpnb heal` to rebuild it on the same engines "
            "(namespaces are kept; models wrapped with DDP/FSDP/DeepSpeed must be prepared again), "
            f"or `%mpnb restart` for fresh engines.{wait}"
        )
    return ""


def check_ready(session: Session) -> None:
    """Refuse a cell while the group is known broken, naming the fix (before any engine work)."""
    health = session.health
    if health is None:
        return
    if health.need == "wait":
        busy = [r for r in health.busy if r < session.world_size]
        still = session.with_queued_work([session.ranks[r].engine_id for r in busy])
        if not still:
            session.health = None  # they came back on their own
            return
    raise RankError(f"Not run: {health.reason}. {advice(session)}")


def alive_ranks(session: Session) -> list[int]:
    """Ranks whose engine is still there (process table and controller; no engine is asked)."""
    from mpnb.cluster import watchdog

    dead = {d.rank for d in watchdog.dead_ranks(session, list(range(session.world_size)))}
    return [r for r in range(session.world_size) if r not in dead]

