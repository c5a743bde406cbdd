"""Start, connect, restart, heal and stop the one live session, and what they share.

Each ends the same way: a world formed (`mpnb.cluster.ranks.form_world`), then
`_go_live` (memory monitor on, one summary line, listeners told); a start that
fails part-way stops whatever it started. `_close` is the one way a session ends.
One lock serialises them, so a heal cannot interleave with a stop.

How old engines leave (and their nannies are reaped) is `mpnb.cluster.engine_exit`; the warm
engines a restart forms its world on are `mpnb.cluster.spares`.

Each prints one line when it works. ipyparallel's log and the engines' output go to a private
file (`mpnb.cluster.ipp_log`); the notebook sees engine output only when an engine really failed.

Kernel side: never imports torch.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from mpnb.cluster import engine_exit, ipp_log, launch, recovery, spares, ssh_hosts, watchdog
from mpnb.cluster.launch import DEFAULT_PG_TIMEOUT_S, WorldPlan
from mpnb.cluster.ranks import form_world, short_error
from mpnb.cluster.session import Session, current, release_current, set_current
from mpnb.cluster.session import session as live_session
from mpnb.errors import ClusterError, RankError
from mpnb.execution.output import format_ranks

if TYPE_CHECKING:
    import ipyparallel as ipp

    from mpnb.planning.config import Config

log = logging.getLogger("mpnb")

_lock = threading.RLock()  # start, connect, restart, heal and close never interleave


def _check_no_session() -> None:
    if current() is not None:
        s = current()
        raise ClusterError(
            f"An mpnb cluster is already running ({s.world_size} ranks, {s.backend}). "
            "Use it, run `%mpnb restart` for fresh engines, or `%mpnb stop` before starting another."
        )


def start(
    n: int | None = None,
    *,
    devices: str | Sequence[int] | None = None,
    backend: str | None = None,
    timeout: float = DEFAULT_PG_TIMEOUT_S,
    port: int | None = None,
    config: Config | None = None,
    spares: bool = True,
    verbose: bool = True,
    ssh: str | Mapping[str, int] | None = None,
    ssh_args: str | Sequence[str] | None = None,
    python: str | None = None,
) -> Session:
    """Start a cluster: one engine per visible GPU (or `devices`), else `n` CPU engines (default 2).

    Every engine gets rank env vars, its device and a process group with a
    `timeout`-second timeout. Prints one line (ranks, devices, backend, seconds).
    `spares`: keep as many engines warm beside them, so `restart` takes under a second.
    `ssh`: engines on other machines instead, `{"host": engines}` or `"hostA:2,hostB:2"`, started by
    ipyparallel's SSH launcher (`mpnb.cluster.ssh_hosts`) with `python` there (default: this
    kernel's interpreter path) and `ssh_args` added to every ssh command.
    """
    from mpnb.planning.config import Config

    cfg = config if config is not None else Config()
    with _lock:
        _check_no_session()
        ssh_hosts.check_options(ssh, ssh_args, python, n=n, devices=devices, port=port)
        if ssh is None:
            count, plan = launch.plan_local(n, devices, backend, timeout, port, spares)
            t0 = time.perf_counter()
            cluster, source = launch.local_cluster(count, plan, ipp_log.logger()), "start"  # its log: a file
        else:
            plan = WorldPlan(launch.check_backend(backend), launch.check_timeout(timeout), None, None)
            t0 = time.perf_counter()
            cluster, count, source = ssh_hosts.checked_cluster(
                ssh, ssh_args, python, launch.CONTROLLER_ARGS, ipp_log.logger(), ipp_log.path()
            )
        sess = _start_and_form(cluster, count, plan, cfg, source)
    return _go_live(sess, "start", t0, verbose)


def _start_and_form(cluster: ipp.Cluster, count: int, plan: WorldPlan, cfg: Config, source: str) -> Session:
    """Start `cluster`, wait for its `count` engines and form the world; roll all of it back on failure."""
    try:
        cluster.start_cluster_sync()
        client = cluster.connect_client_sync()
        # interactive=False: no progress bar printed into the notebook while engines register
        client.wait_for_engines(count, timeout=cluster.engine_timeout, interactive=False)
        sess = Session(client, cluster, plan, cfg, source=source)
        sess.engine_set = next(iter(cluster.engines))
        sess.ranks, sess.backend = form_world(client, list(client.ids), plan, cfg)
    except BaseException as exc:
        ipp_log.stop_cluster(cluster)  # its failures are in the log; the start's error says enough
        if isinstance(exc, KeyboardInterrupt):
            raise
        reason = str(exc) if isinstance(exc, ClusterError) else short_error(exc)
        raise ClusterError(
            f"{reason}\nThe start was rolled back: the controller and engines it launched are stopped."
        ) from exc
    set_current(sess)
    return sess


def connect(
    profile: str = "default",
    cluster_id: str | None = None,
    *,
    backend: str | None = None,
    timeout: float = DEFAULT_PG_TIMEOUT_S,
    engines_timeout: float = 60.0,
    config: Config | None = None,
    verbose: bool = True,
) -> Session:
    """Attach to a cluster started outside the notebook (`ipcluster start --profile P`).

    `profile` is a profile name or a profile directory. Ranks are grouped by host
    so LOCAL_RANK is right across machines; the process group spans all engines.
    `%mpnb stop` later disconnects but leaves that cluster running.
    """
    import ipyparallel as ipp

    from mpnb.planning.config import Config

    with _lock:
        _check_no_session()
        plan = WorldPlan(
            backend=launch.check_backend(backend),
            timeout_s=launch.check_timeout(timeout),
            port=None,
            devices=None,
        )
        profile_kwargs = launch.profile_args(profile)
        cfg = config if config is not None else Config()
        t0 = time.perf_counter()
        try:
            client = ipp.Client(cluster_id=cluster_id or "", timeout=10, **profile_kwargs)
        except (OSError, ValueError) as exc:
            known = launch.known_cluster_ids(profile_kwargs)
            listing = (
                f"Clusters in that profile: {', '.join(known)}."
                if known
                else "That profile has no running cluster."
            )
            raise ClusterError(
                f"No ipyparallel cluster with id {cluster_id or repr('')} in profile {profile!r} ({exc}). "
                f"{listing} Start one with `ipcluster start -n N --profile {profile}` or fix --cluster-id."
            ) from None
        try:
            if not launch.wait_for_launched_engines(
                client, profile_kwargs, cluster_id or "", engines_timeout
            ):
                raise ClusterError(
                    f"The cluster in profile {profile!r} has no engines after {engines_timeout:g} s. "
                    "Start engines (`ipengine --profile ...`) and retry."
                )
            sess = Session(client, None, plan, cfg, source=f"connect --profile {profile}")
            sess.ranks, sess.backend = form_world(client, sorted(client.ids), plan, cfg)
        except BaseException:
            client.close()
            raise
        set_current(sess)
    return _go_live(sess, "start", t0, verbose)


def restart(verbose: bool = True) -> Session:
    """Fresh engines and a fresh process group, same world size, same session object.

    The warm spares (`mpnb.cluster.spares`) become the ranks when they are ready; otherwise a new
    engine set starts. The old ranks' engines are stopped either way."""
    sess = live_session()
    if sess.cluster is None:
        raise ClusterError(
            "mpnb did not start this cluster (it was connected with `%mpnb connect`), so it cannot "
            "restart its engines. Restart them with ipcluster, then `%mpnb stop` and `%mpnb connect` again."
        )
    with _lock:
        t0 = time.perf_counter()
        n = max(sess.world_size, sess.full_world_size)
        old_ranks = list(sess.ranks)
        old_ids = {r.engine_id for r in old_ranks}
        sess.cell = None
        sess.health = None
        try:
            taken = spares.take(sess)
            unused_spares = spares.stop(sess) if taken is None else []
            watched = ipp_log.EngineExits.before_stop(sess.cluster)
            engine_exit.prepare(sess, sorted(old_ids))
            engine_exit.reap_nannies_later(sess, unused_spares)
            engine_exit.terminate(old_ranks)  # they exit while the new world forms
            watchdog.remove_stack_files(old_ranks)  # the old engines' files (in our private directory)
            old_set = sess.engine_set
            if taken is None:
                known = set(sess.client.ids) | old_ids  # stopped spares may still be listed a while
                sess.engine_set = sess.cluster.start_engines_sync(n)
                new_ids = _wait_new_engines(sess.client, known, old_ids, n, timeout=120.0)
            else:
                sess.engine_set, new_ids = taken
            sess.ranks, sess.backend = form_world(sess.client, new_ids, sess.plan, sess.config)
            if old_set is not None:
                sess.cluster.stop_engines_sync(old_set)  # gone by now: this collects their exits
        except BaseException as exc:
            _close(sess)
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise ClusterError(
                f"Restart failed, so the cluster was stopped: {short_error(exc)}. "
                "Run `%mpnb start` for a new one."
            ) from exc
    ipp_log.print_lines(watched.problems(old_ranks, "restart"))  # an old engine that had died, and why
    return _go_live(sess, "restart", t0, verbose)


def _wait_new_engines(
    client: ipp.Client, known: set[int], old_ids: set[int], n: int, timeout: float
) -> list[int]:
    """Until `n` engines not in `known` registered and the old ranks' engines left; the new ids."""
    deadline = time.monotonic() + timeout
    while True:
        ids = set(client.ids)
        if len(ids - known) >= n and not (ids & old_ids):
            return sorted(ids - known)
        if time.monotonic() > deadline:
            raise ClusterError(
                f"Only {len(ids - known)} of {n} restarted engines registered within {timeout:g} s."
            )
        time.sleep(0.05)


def stop(verbose: bool = False) -> None:
    """Stop the cluster mpnb started (or disconnect from a connected one). No-op without a session.

    `verbose`: say so in one line. What really failed (an engine that had died, one that crashed on
    its way out, a stop that raised) is always shown, trimmed, with where the full log is.
    """
    sess = current()
    if sess is None:
        if verbose:
            print("No mpnb cluster is running; nothing to stop.")
        return
    problems = _close(sess)
    if verbose:
        print(
            "mpnb: cluster stopped."
            if sess.cluster is not None
            else "mpnb: disconnected (the cluster keeps running)."
        )
    ipp_log.print_lines(problems)


def heal(session: Session | None = None, wait_s: float | None = None, verbose: bool = True) -> Session:
    """Rebuild the process group on the surviving engines: destroy, new port, init. Namespaces stay."""
    sess = session or live_session()
    t0 = time.perf_counter()
    alive = recovery.alive_ranks(sess)
    if not alive:
        raise ClusterError("No rank survived, so there is nothing to heal. Run `%mpnb restart`.")
    _wait_idle(sess, alive, sess.timeout + 5.0 if wait_s is None else wait_s)
    infos = [sess.ranks[r] for r in alive]
    gpus = [i.gpu for i in infos]
    all_gpus = all(g is not None for g in gpus)
    plan = dataclasses.replace(sess.plan, port=None, devices=gpus if all_gpus else None)
    before = sess.world_size
    sess.full_world_size = max(sess.full_world_size, before)
    with _lock:
        try:
            engine_ids = [i.engine_id for i in infos]
            lost = [r for r in sess.ranks if r not in infos]
            sess.ranks, sess.backend = form_world(sess.client, engine_ids, plan, sess.config)
            watchdog.remove_stack_files(lost)
        except Exception as exc:
            raise ClusterError(f"Healing failed: {exc}. Run `%mpnb restart` for fresh engines.") from exc
    sess.health = None
    sess.cell = None
    if verbose:
        dropped = before - len(alive)
        lost = f" ({dropped} lost rank{'s' if dropped != 1 else ''} left out)" if dropped > 0 else ""
        print(
            f"mpnb: process group rebuilt on {len(alive)} rank{'s' if len(alive) != 1 else ''}{lost} "
            f"in {time.perf_counter() - t0:.1f} s; namespaces kept. Run mpnb.prepare(...) again for "
            "wrapped models."
        )
    sess.notify("restart")
    return sess


def _wait_idle(session: Session, ranks: list[int], timeout: float) -> None:
    """Engines still inside the last cell (blocked in C) cannot take the new group yet."""
    deadline = time.monotonic() + timeout
    ids = [session.ranks[r].engine_id for r in ranks]
    while True:
        busy = session.with_queued_work(ids)
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


# ----------------------------------------------------------------------------- shared steps


def _go_live(sess: Session, event: str, t0: float, verbose: bool) -> Session:
    """Last steps of start, connect and restart: monitor on, one summary line, listeners told."""
    _start_monitor(sess)
    sess.warm = False  # new engines warm up in the background; the first cell waits (Session.wait_until_warm)
    if verbose:
        print(sess.summary(time.perf_counter() - t0))
    sess.active_at = time.monotonic()
    spares.watch(sess, _lock)  # spares for the next restart, launched once the session idles
    sess.notify(event)
    return sess


def _start_monitor(sess: Session) -> None:
    """Memory samples from every rank (mpnb.monitoring.channel); a failure empties charts, not the cluster."""
    try:
        from mpnb.monitoring import channel as monitor_channel

        monitor_channel.attach(sess)
    except Exception:
        log.exception("mpnb: the memory monitor could not start; memory charts will stay empty")


def _stop_monitor(sess: Session) -> None:
    with contextlib.suppress(Exception):
        from mpnb.monitoring import channel as monitor_channel

        monitor_channel.detach(sess, timeout=2.0)


def _close(sess: Session, at_exit: bool = False) -> list[str]:
    """End the session; return lines that explain what failed on the way (none when all went well).

    `at_exit`: the kernel is exiting: no monitor to detach politely, no listeners to tell."""
    problems: list[str] = []
    with _lock:
        watched = ipp_log.EngineExits.before_stop(sess.cluster) if sess.cluster is not None else None
        if not at_exit:
            _stop_monitor(sess)  # samplers and the kernel end stop before the engines do
        spare_nannies = spares.nanny_pairs(sess)
        engine_exit.prepare(sess, list(sess.client.ids))  # the spares' too
        if sess.cluster is not None:
            engine_exit.reap_nannies_later(sess, spare_nannies)
            with contextlib.suppress(Exception):
                sess.client.shutdown(hub=False, block=False)  # engines exit now; the stop below reaps them
            failed = ipp_log.stop_cluster(sess.cluster)
            problems = (watched.problems(sess.ranks, "stop") if watched else []) + failed
            watchdog.remove_stack_files(sess.ranks)  # a connected cluster's engines live on and keep theirs
        with contextlib.suppress(Exception):
            sess.client.close()
        sess.closed = True
        release_current(sess)
    if not at_exit:
        sess.notify("stop")
    return problems


def _stop_at_exit() -> None:
    """The kernel is exiting: stop the cluster mpnb started (its engines, nannies and stack-dump files).

    ipyparallel's own exit hook is off for it (it prints the cluster's repr and engine logs). One line
    goes to the kernel's stderr (the server's log) before the work, since the server kills a kernel
    that takes more than 5 s to exit; only what really failed follows it."""
    sess = current()
    if sess is None or sess.cluster is None:
        return  # a connected cluster keeps running
    stream = sys.__stderr__
    ipp_log.print_lines(["mpnb: stopping the cluster (the kernel is shutting down)."], stream, False)
    try:
        problems = _close(sess, at_exit=True)
    except Exception as exc:
        ipp_log.logger().exception("stopping the cluster at exit failed")
        problems = [f"mpnb: stopping the cluster failed ({short_error(exc)}). Details: {ipp_log.path()}"]
    ipp_log.print_lines(problems, stream, flush_stdout=False)


atexit.register(_stop_at_exit)
