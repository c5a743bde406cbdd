"""A warm spare engine set, so that `%mpnb restart` forms its world at once.

Restarting meant new engine processes: launch, register, import torch, about 3.3 s on 2 cores.
After every start and restart of a cluster mpnb launched, `watch` starts a thread that launches a
second engine set of the same size once no cell has run for IDLE_BEFORE_LAUNCH_S, so the spares'
own start never competes with the cells of a busy session. Its engines register, then import
torch and DeepSpeed on a nice-19 thread (`mpnb.engine.boot`, "warm"), so they use only CPU time
nobody else wants, and import nothing on GPU machines (a GPU is bound only when an engine becomes a
rank). `take` hands them to the restart when all are registered and warm; otherwise they are
stopped and the restart starts fresh engines as before.

Threads: only `_launch` runs on the watch thread, under the lifecycle's lock, and it touches the
`Cluster` alone (the ipyparallel `Client` is not thread-safe); everything else runs on the kernel's.

Kernel side: never imports torch.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import TYPE_CHECKING

from mpnb.cluster import engine_exit
from mpnb.cluster.session import SpareSet

if TYPE_CHECKING:
    from mpnb.cluster.session import Session

log = logging.getLogger("mpnb")

IDLE_BEFORE_LAUNCH_S = 5.0  # spares start once no cell has started or ended for this long
IDLE_POLL_S = 0.5
READY_CHECK_S = 2.0  # how long `take` waits for the spares to answer whether they are warm


def watch(sess: Session, lock: threading.RLock) -> None:
    """Launch a spare set (as large as the full world) once the session idles; none for a
    cluster mpnb did not start, or one started with `--no-spares`."""
    if sess.cluster is None or not sess.plan.spares or sess.spares is not None:
        return
    token = sess.spare_watch = object()  # a newer watch (after a restart) ends this one
    before = frozenset(sess.client.ids)  # here, on the kernel's thread
    thread = threading.Thread(
        target=_watch, args=(sess, lock, token, before), name="mpnb-spare-watch", daemon=True
    )
    thread.start()


def _watch(sess: Session, lock: threading.RLock, token: object, before: frozenset[int]) -> None:
    while True:
        time.sleep(IDLE_POLL_S)
        if sess.closed or sess.spare_watch is not token:
            return
        running = (sess.cell or {}).get("status") == "running"
        if running or time.monotonic() - sess.active_at < IDLE_BEFORE_LAUNCH_S:
            continue
        if not lock.acquire(blocking=False):  # a restart or stop is under way
            continue
        try:
            if not sess.closed and sess.spare_watch is token and sess.spares is None:
                _launch(sess, before)
            return
        finally:
            lock.release()


def _launch(sess: Session, before: frozenset[int]) -> None:
    cluster = sess.cluster
    if cluster is None:
        return
    count = max(sess.world_size, sess.full_world_size)
    launcher_env = dict(cluster.config.LocalEngineSetLauncher.get("environment", {}))
    environment = {**launcher_env, "MPNB_PRELOAD": "warm" if sess.plan.cpu_only else ""}
    try:
        set_id = cluster.start_engines_sync(count, environment=environment)
    except Exception:  # no spares: the next restart starts engines as it always did
        log.exception("mpnb: starting spare engines failed")
        return
    sess.spares = SpareSet(set_id, count, before)


def engine_ids(sess: Session) -> list[int]:
    """The spare engines registered so far."""
    spare = sess.spares
    if spare is None:
        return []
    ranks = {r.engine_id for r in sess.ranks}
    return sorted(set(sess.client.ids) - spare.before - ranks)


def ready(sess: Session) -> bool:
    """Every spare engine registered and done with its preload."""
    from mpnb.engine import boot

    spare, ids = sess.spares, engine_ids(sess)
    if spare is None or len(ids) != spare.count:
        return False
    with contextlib.suppress(Exception):
        return all(sess.client[ids].apply_async(boot.preloaded).get(timeout=READY_CHECK_S))
    return False


def take(sess: Session) -> tuple[str, list[int]] | None:
    """(set id, engine ids) of the spares if they are `ready`, else None (and they are stopped)."""
    spare = sess.spares
    if spare is None:
        return None
    if not ready(sess):
        stop(sess)
        return None
    ids = engine_ids(sess)
    sess.spares = None
    return spare.set_id, ids


def nanny_pairs(sess: Session) -> list[str]:
    """The reaper's ENGINE:NANNY:STARTED arguments for the spare engines (`mpnb/cluster/reaper.py`)."""
    from mpnb.engine import bootstrap

    ids = engine_ids(sess)
    if not ids:
        return []
    with contextlib.suppress(Exception):
        found = sess.client[ids].apply_async(bootstrap.nanny_pairs).get(timeout=READY_CHECK_S)
        return [pair for pairs in found for pair in pairs]
    return []


def stop(sess: Session) -> list[str]:
    """Stop the spare set, if there is one; the reaper's arguments for its nannies.

    They hold no process group, and leave without a garbage collection, so they exit at once."""
    pairs = nanny_pairs(sess)
    ids = engine_ids(sess)
    spare, sess.spares = sess.spares, None
    if spare is not None and sess.cluster is not None:
        engine_exit.prepare(sess, ids)
        with contextlib.suppress(Exception):
            sess.cluster.stop_engines_sync(spare.set_id)
    return pairs
