"""After a crash, a release or a hang: what the session needs, and `heal` to rebuild the process group.

Two ways back (docs/internals.md, "Recovery model"):
- heal: destroy the process group on the surviving engines and init a new one
  on a new port. Namespaces stay; models wrapped around the old group (DDP,
  FSDP, DeepSpeed) must be prepared again. With a dead rank the world shrinks.
- restart (`mpnb.cluster.restart`): fresh engines, a full world, empty namespaces.

`mpnb.execution` records what happened with `mark`; the next `%%distributed`
cell is refused (`check_ready`) until one of them has run, with a message
saying which.

Kernel side: never imports torch.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

from mpnb.errors import ClusterError, RankError
from mpnb.execution.output import format_ranks

if TYPE_CHECKING:
    from mpnb.cluster.session import Session


_RANK = {"wait": 0, "heal": 1, "restart": 2}


def mark(session: Session, need: str, reason: str, busy: list[int] | None = None) -> None:
    """Record what the session needs: "wait" (ranks still busy in the last cell), "heal" (the group
    was torn down, every engine alive) or "restart" (an engine died)."""
    old = session.health or {}
    if _RANK.get(old.get("need", ""), -1) > _RANK[need]:
        need, reason = old["need"], old["reason"]  # a death outranks a torn-down group, which outranks a wait
    busy = busy or old.get("busy") or []
    session.health = {"need": need, "reason": reason, "busy": busy, "at": time.time()}


def needs(session: Session) -> str | None:
    return (session.health or {}).get("need")


def advice(session: Session) -> str:
    health = session.health or {}
    if health.get("need") == "restart":
        n = max(session.world_size, session.full_world_size)
        alive = _alive_ranks(session)
        return (
            f"A rank is gone. Run `%mpnb restart` for a fresh world of {n} ranks (namespaces are lost), "
            f"or `%mpnb heal` to go on with the {len(alive)} surviving rank{'s' if len(alive) != 1 else ''} "
            "(namespaces kept; run mpnb.prepare again)."
        )
    if health.get("need") == "wait":
        return (
            f"{format_ranks(health.get('busy') or [])} returns by the process-group timeout "
            f"({session.timeout:g} s) at the latest; run the cell again then, or `%mpnb restart` now."
        )
    if health.get("need") == "heal":
        busy = health.get("busy") or []
        wait = (
            f" {format_ranks(busy)} may still be blocked until the process-group timeout "
            f"({session.timeout:g} s); `%mpnb restart` ends that at once."
            if busy
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
    if needs(session) == "wait":
        busy = [r for r in session.health["busy"] if r < session.world_size]
        still = _busy(session, [session.ranks[r].engine_id for r in busy])
        if not still:
            session.health = None  # they came back on their own
            return
    if needs(session):
        raise RankError(f"Not run: {session.health['reason']}. {advice(session)}")


def _alive_ranks(session: Session) -> list[int]:
    from mpnb.cluster import watchdog

    dead = {d.rank for d in watchdog.dead_ranks(session, list(range(session.world_size)))}
    return [r for r in range(session.world_size) if r not in dead]


def heal(session: Session | None = None, wait_s: float | None = None, verbose: bool = True) -> Session:
    """Rebuild the process group on the surviving engines: destroy, new port, init. Namespaces stay."""
    from mpnb.cluster import session as cluster

    sess = session or cluster.session()
    t0 = time.perf_counter()
    alive = _alive_ranks(sess)
    if not alive:
        raise ClusterError("No rank survived, so there is nothing to heal. Run `%mpnb restart`.")
    _wait_idle(sess, alive, sess.timeout + 5.0 if wait_s is None else wait_s)
    infos = [sess.ranks[r] for r in alive]
    gpus = [i.gpu for i in infos]
    plan = dataclasses.replace(
        sess._plan, port=None, devices=gpus if all(g is not None for g in gpus) else None
    )
    before = sess.world_size
    sess.full_world_size = max(sess.full_world_size, before)
    with cluster._lock:
        try:
            sess.ranks, sess.backend = cluster._form_world(
                sess.client, [i.engine_id for i in infos], plan, sess.config
            )
        except Exception as exc:
            raise ClusterError(
                f"Healing failed: {exc}. Run `%mpnb restart` for fresh engines."
            ) from exc
    sess.health = None
    sess.cell = None
    if verbose:
        lost = f" ({before - len(alive)} lost rank{'s' if before - len(alive) != 1 else ''} left out)" if len(
            alive
        ) < before else ""
        print(
            f"mpnb: process group rebuilt on {len(alive)} rank{'s' if len(alive) != 1 else ''}{lost} "
            f"in {time.perf_counter() - t0:.1f} s; namespaces kept. Run mpnb.prepare(...) again for "
            "wrapped models."
        )
    sess._notify("restart")
    return sess


def _wait_idle(session: Session, ranks: list[int], timeout: float) -> None:
    """Engines still inside the last cell (blocked in C) cannot take the new group yet."""
    deadline = time.monotonic() + timeout
    ids = [session.ranks[r].engine_id for r in ranks]
    while True:
        busy = _busy(session, ids)
        if not busy:
            return
        if time.monotonic() > deadline:
            names = [session.rank_of_engine(e) for e in busy]
            raise RankError(
                f"{format_ranks([n for n in names if n is not None])} is still busy with the last cell "
                "(blocked in a collective). Wait for the process-group timeout and heal again, or run "
                "`%mpnb restart`."
            )
        time.sleep(0.1)


def _busy(session: Session, engine_ids: list[int]) -> list[int]:
    try:
        queues: Any = session.client.queue_status(targets=engine_ids)
    except Exception:
        return []
    return [e for e in engine_ids if isinstance(queues.get(e), dict) and queues[e].get("queue", 0)]
